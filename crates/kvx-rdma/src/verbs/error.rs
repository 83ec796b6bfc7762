//! Typed errors of the verbs backend.
//!
//! Everything the verbs backend can fail with is one [`VerbsError`] variant: no device, a
//! failed verbs call, a write that does not fit the registered regions, a malformed handshake,
//! or a work completion that ended in error. The errno mapping that decides "no device" lives
//! here ([`classify_device_list_error`]) so it can be tested without hardware.

use std::io;

/// A verbs-backend error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No usable RDMA device: the kernel lacks verbs support (ENOSYS), libibverbs is missing
    /// (EOPNOTSUPP), no device node (ENODEV), or the device list is empty.
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// Human-readable cause, e.g. `ibv_get_device_list: ENOSYS`.
        reason: String,
    },
    /// Devices exist but none carries the requested name.
    #[error("RDMA device {name:?} not found (have: {available})")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The names that exist, comma separated.
        available: String,
    },
    /// A verbs call failed.
    #[error("{call} failed: {detail}")]
    Verbs {
        /// The verbs call (`ibv_reg_mr`, `ibv_modify_qp(RTR)`, ...).
        call: &'static str,
        /// The cause as reported by the library.
        detail: String,
    },
    /// A source range lies outside every locally registered region.
    #[error("local range {addr:#x} (+{len}) is not registered")]
    LocalNotRegistered {
        /// Source address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A destination range lies outside every region the peer advertised.
    #[error("remote range {addr:#x} (+{len}) is not inside a region the peer advertised")]
    RemoteNotRegistered {
        /// Destination address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A region list is malformed (empty region, overflow, overlap).
    #[error("bad region list: {0}")]
    BadRegions(&'static str),
    /// The queue-pair handshake payload could not be decoded or does not fit this side.
    #[error("bad verbs handshake: {0}")]
    Handshake(String),
    /// A work request completed with an error status.
    #[error(
        "work completion error on qp {qpn:#x}: {status_name} (status {status}, vendor {vendor_err:#x})"
    )]
    Completion {
        /// Queue pair number that reported it.
        qpn: u32,
        /// `ibv_wc_status` value.
        status: u32,
        /// Its symbolic name.
        status_name: &'static str,
        /// Vendor syndrome.
        vendor_err: u32,
    },
    /// Every queue pair to the peer failed; the batch could not be finished on any of them.
    #[error("peer lost: {0}")]
    PeerLost(String),
    /// The engine was shut down.
    #[error("verbs engine closed")]
    Closed,
}

impl VerbsError {
    /// A short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            VerbsError::NoDevice { .. } => "no_device",
            VerbsError::DeviceNotFound { .. } => "device_not_found",
            VerbsError::Verbs { .. } => "verbs_call",
            VerbsError::LocalNotRegistered { .. } => "local_not_registered",
            VerbsError::RemoteNotRegistered { .. } => "remote_not_registered",
            VerbsError::BadRegions(_) => "bad_regions",
            VerbsError::Handshake(_) => "handshake",
            VerbsError::Completion { .. } => "completion",
            VerbsError::PeerLost(_) => "peer_lost",
            VerbsError::Closed => "closed",
        }
    }

    /// A failed verbs call with its library error.
    pub fn verbs(call: &'static str, e: impl std::fmt::Display) -> Self {
        VerbsError::Verbs {
            call,
            detail: e.to_string(),
        }
    }
}

/// The symbolic errno name for the codes that matter to device discovery.
fn errno_name(code: i32) -> &'static str {
    match code {
        libc_codes::ENOSYS => "ENOSYS",
        libc_codes::EOPNOTSUPP => "EOPNOTSUPP",
        libc_codes::ENODEV => "ENODEV",
        libc_codes::ENOENT => "ENOENT",
        libc_codes::EPERM => "EPERM",
        libc_codes::EACCES => "EACCES",
        _ => "errno",
    }
}

/// Linux errno values used by the classification (kept local so this file needs no libc).
mod libc_codes {
    pub const EPERM: i32 = 1;
    pub const ENOENT: i32 = 2;
    pub const EACCES: i32 = 13;
    pub const ENODEV: i32 = 19;
    pub const ENOSYS: i32 = 38;
    pub const EOPNOTSUPP: i32 = 95;
}

/// Maps the error of `ibv_get_device_list` to a [`VerbsError`].
///
/// ENOSYS (no kernel verbs support), EOPNOTSUPP (libibverbs could not be loaded), ENODEV and
/// ENOENT (no device nodes) mean "no device"; anything else is a failed verbs call.
pub fn classify_device_list_error(e: &io::Error) -> VerbsError {
    match e.raw_os_error() {
        Some(
            code @ (libc_codes::ENOSYS
            | libc_codes::EOPNOTSUPP
            | libc_codes::ENODEV
            | libc_codes::ENOENT),
        ) => VerbsError::NoDevice {
            reason: format!("ibv_get_device_list: {}", errno_name(code)),
        },
        Some(code) => VerbsError::Verbs {
            call: "ibv_get_device_list",
            detail: format!("{} ({code}): {e}", errno_name(code)),
        },
        None => VerbsError::verbs("ibv_get_device_list", e),
    }
}

/// The symbolic name of an `ibv_wc_status` value (values from `<infiniband/verbs.h>`).
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 23] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_UNKNOWN")
}

/// `IBV_WC_SUCCESS`.
pub const WC_SUCCESS: u32 = 0;
/// `IBV_WC_WR_FLUSH_ERR`: the work request was flushed because the queue pair entered the error
/// state; it did not fail itself.
pub const WC_WR_FLUSH_ERR: u32 = 5;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_errnos() {
        for code in [38, 95, 19, 2] {
            let e = classify_device_list_error(&io::Error::from_raw_os_error(code));
            assert!(matches!(e, VerbsError::NoDevice { .. }), "{code}: {e}");
            assert_eq!(e.label(), "no_device");
        }
        let e = classify_device_list_error(&io::Error::from_raw_os_error(38));
        assert_eq!(e.to_string(), "no RDMA device: ibv_get_device_list: ENOSYS");
    }

    #[test]
    fn other_errnos_are_call_failures() {
        let e = classify_device_list_error(&io::Error::from_raw_os_error(13));
        assert!(matches!(
            e,
            VerbsError::Verbs {
                call: "ibv_get_device_list",
                ..
            }
        ));
        let e = classify_device_list_error(&io::Error::other("x"));
        assert!(matches!(e, VerbsError::Verbs { .. }));
    }

    #[test]
    fn status_names() {
        assert_eq!(wc_status_name(WC_SUCCESS), "IBV_WC_SUCCESS");
        assert_eq!(wc_status_name(WC_WR_FLUSH_ERR), "IBV_WC_WR_FLUSH_ERR");
        assert_eq!(wc_status_name(10), "IBV_WC_REM_ACCESS_ERR");
        assert_eq!(wc_status_name(12), "IBV_WC_RETRY_EXC_ERR");
        assert_eq!(wc_status_name(999), "IBV_WC_UNKNOWN");
    }
}
