//! What memory the engines accept, checked once at start, before anything is bound.
//!
//! KV pools (and a prefill's state buffers) may be device memory ([`Region::from_raw_device`]):
//! only the data plane's NIC touches them, and only the `verbs` backend can register them (any
//! other backend refuses with [`kvx_rdma::TransportError::DeviceMemoryUnsupported`], naming
//! itself). Aux rows must be host memory: the engines write the room id into them and `AUX_DATA`
//! rows with the CPU. Staging gathers (prefill) and scatters (decode) KV pages with the CPU, so it
//! needs a host KV pool. A decode with a device KV pool also skips its late-write check on
//! aborted rooms (see [`crate::decode`]'s deferred release).

use crate::region::Region;

/// Why an engine refused the memory it was given (nothing was bound or registered).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The aux region is device memory.
    #[error(
        "the aux region is device memory: aux rows must be host memory ({why}); pass host \
         memory (Region::from_raw) for the aux rows"
    )]
    DeviceAux {
        /// What the engine does to aux rows with the CPU.
        why: &'static str,
    },
    /// Staging is on and the KV region is device memory.
    #[error(
        "{option} is on but the KV region is device memory: staging gathers and scatters KV \
         pages with the CPU; turn {option} off or give a host KV pool"
    )]
    StagingWithDeviceKv {
        /// The setting that turned staging on (`PrefillConfig::staging`,
        /// `DecodeEngineConfig::staging`).
        option: &'static str,
    },
}

/// What the prefill engine does to aux rows with the CPU.
pub(crate) const PREFILL_AUX: &str =
    "the prefill engine writes the room id into them and reads them for AUX_DATA";
/// What the decode engine does to aux rows with the CPU.
pub(crate) const DECODE_AUX: &str = "the decode engine writes AUX_DATA rows into them";

/// Refuses a device aux region, and staging (`staging`: the option's name when it is on) over
/// a device KV region.
pub(crate) fn check(
    kv: &Region,
    aux: &Region,
    staging: Option<&'static str>,
    aux_why: &'static str,
) -> Result<(), MemoryError> {
    if aux.is_device() {
        return Err(MemoryError::DeviceAux { why: aux_why });
    }
    match staging {
        Some(option) if kv.is_device() => Err(MemoryError::StagingWithDeviceKv { option }),
        _ => Ok(()),
    }
}
