//! Device memory handed to the engines: a "device" region here is a `PROT_NONE` mapping wrapped
//! with `Region::from_raw_device`, so any CPU touch by an engine would kill the test process.
//!
//! - A device KV pool (or prefill state buffer) over a backend that moves bytes with the CPU
//!   (`tcp`, `auto`, `mooncake`, `local`, `shm`) fails at start with
//!   `TransportError::DeviceMemoryUnsupported` naming the backend.
//! - Device aux rows are refused (`MemoryError::DeviceAux`), whatever the backend.
//! - Staging over a device KV pool is refused (`MemoryError::StagingWithDeviceKv`).
//! - Over `verbs`, the acceptance needs an RDMA device with GPUDirect RDMA and real GPU memory:
//!   where those are missing the test prints `SKIP` with what is missing (it never passes
//!   silently).

use std::sync::Arc;

use kvx_engine::decode::DecodeStagingConfig;
use kvx_engine::decode::engine::{DecodeEngine, DecodeEngineConfig, DecodeMemory};
use kvx_engine::engine::{EngineError, PrefillConfig, PrefillEngine, PrefillMemory};
use kvx_engine::memory::MemoryError;
use kvx_engine::model::{KvLayout, ModelPreset};
use kvx_engine::plane::{Backend, RdmaOptions, check_backend};
use kvx_engine::region::Region;
use kvx_rdma::TransportError;

/// A `PROT_NONE` anonymous mapping standing in for GPU memory: reserved address space the CPU
/// cannot read or write.
struct NoAccess {
    addr: *mut libc::c_void,
    len: usize,
}

impl NoAccess {
    fn new(len: usize) -> NoAccess {
        // SAFETY: an anonymous private mapping with no access rights; never dereferenced.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED, "mmap PROT_NONE");
        NoAccess {
            addr,
            len: len.max(1),
        }
    }

    /// A device region over the whole mapping.
    fn region(&self) -> Arc<Region> {
        // SAFETY: the mapping outlives every engine of the test (each test drops its engine, or
        // never gets one, before the mapping); engines never touch device regions from the CPU.
        Arc::new(unsafe { Region::from_raw_device(self.addr as u64, self.len) }.expect("region"))
    }
}

impl Drop for NoAccess {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

const ITEM: u64 = 4096;
const PAGES: u64 = 32;

/// A prefill's memory: one layer (K and V, `PAGES` pages each) in `kv`, 8-byte aux rows in `aux`.
fn prefill_mem(kv: Arc<Region>, aux: Arc<Region>) -> PrefillMemory {
    let kv_ptrs = vec![kv.base(), kv.base() + PAGES * ITEM];
    let aux_ptrs = vec![aux.base()];
    PrefillMemory::new(kv, kv_ptrs, ITEM, aux, aux_ptrs, vec![8])
}

fn prefill_start(cfg: PrefillConfig, mem: PrefillMemory) -> Result<PrefillEngine, EngineError> {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let res = PrefillEngine::start(cfg, mem, rt.handle().clone());
    if let Ok(engine) = &res {
        engine.shutdown();
    }
    res
}

fn layout() -> KvLayout {
    ModelPreset::Tiny.layout(1, 0, 16, 64)
}

fn decode_start(cfg: DecodeEngineConfig, mem: DecodeMemory) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let engine = DecodeEngine::start_async(cfg, mem).await?;
        engine.close();
        Ok(())
    })
}

fn assert_backend_refused(err: &TransportError, backend: &str) {
    assert!(
        matches!(err, TransportError::DeviceMemoryUnsupported { backend: b } if *b == backend),
        "{backend}: {err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(backend) && msg.contains("`verbs`"),
        "names the backend and verbs: {msg}"
    );
}

#[test]
fn prefill_device_kv_over_cpu_backends_fails_naming_the_backend() {
    let dev = NoAccess::new((2 * PAGES * ITEM) as usize);
    for (backend, name) in [
        (Backend::Tcp, "tcp"),
        (Backend::Auto, "auto"),
        (Backend::Mooncake, "mooncake"),
        (Backend::Local, "local"),
    ] {
        let cfg = PrefillConfig {
            backend,
            ..PrefillConfig::default()
        };
        let mem = prefill_mem(dev.region(), Arc::new(Region::new(64 * 8)));
        match prefill_start(cfg, mem) {
            Err(EngineError::Transport(e)) => assert_backend_refused(&e, name),
            Err(e) => panic!("{name}: unexpected error {e}"),
            Ok(_) => panic!("{name}: device KV accepted by a CPU backend"),
        }
    }
}

#[test]
fn prefill_device_state_over_tcp_fails_naming_tcp() {
    let dev = NoAccess::new(1 << 16);
    let mem = prefill_mem(
        Arc::new(Region::new((2 * PAGES * ITEM) as usize)),
        Arc::new(Region::new(64 * 8)),
    )
    .with_state(vec![dev.region()], Vec::new());
    let cfg = PrefillConfig {
        backend: Backend::Tcp,
        ..PrefillConfig::default()
    };
    match prefill_start(cfg, mem) {
        Err(EngineError::Transport(e)) => assert_backend_refused(&e, "tcp"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("device state accepted by tcp"),
    }
}

#[test]
fn prefill_refuses_device_aux_rows() {
    let dev = NoAccess::new(64 * 8);
    // Refused whatever the backend, verbs included: the engine writes aux rows with the CPU.
    for backend in [Backend::Tcp, Backend::Verbs] {
        let cfg = PrefillConfig {
            backend,
            ..PrefillConfig::default()
        };
        let mem = prefill_mem(
            Arc::new(Region::new((2 * PAGES * ITEM) as usize)),
            dev.region(),
        );
        match prefill_start(cfg, mem) {
            Err(EngineError::Memory(e @ MemoryError::DeviceAux { .. })) => {
                assert!(e.to_string().contains("host memory"), "{e}");
            }
            Err(e) => panic!("{backend:?}: unexpected error {e}"),
            Ok(_) => panic!("{backend:?}: device aux accepted"),
        }
    }
}

#[test]
fn prefill_refuses_staging_over_device_kv() {
    let dev = NoAccess::new((2 * PAGES * ITEM) as usize);
    let cfg = PrefillConfig {
        backend: Backend::Verbs,
        staging: true,
        ..PrefillConfig::default()
    };
    let mem = prefill_mem(dev.region(), Arc::new(Region::new(64 * 8)));
    match prefill_start(cfg, mem) {
        Err(EngineError::Memory(
            e @ MemoryError::StagingWithDeviceKv {
                option: "PrefillConfig::staging",
            },
        )) => assert!(e.to_string().contains("CPU"), "{e}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("staging over device KV accepted"),
    }
}

#[test]
fn decode_device_kv_over_cpu_backends_fails_naming_the_backend() {
    let l = layout();
    let dev = NoAccess::new(l.pool_bytes() as usize);
    for (backend, name) in [
        (Backend::Tcp, "tcp"),
        (Backend::Mooncake, "mooncake"),
        (Backend::Local, "local"),
        (Backend::Shm, "shm"),
    ] {
        let cfg = DecodeEngineConfig {
            backend,
            ..DecodeEngineConfig::new(l.clone())
        };
        let mem = DecodeMemory::new(dev.region(), Arc::new(Region::new(l.aux_bytes() as usize)));
        let err = decode_start(cfg, mem).expect_err("device KV accepted by a CPU backend");
        let e = err
            .downcast_ref::<TransportError>()
            .unwrap_or_else(|| panic!("{name}: not a TransportError: {err:#}"));
        assert_backend_refused(e, name);
    }
}

#[test]
fn decode_refuses_device_aux_rows() {
    let l = layout();
    let dev = NoAccess::new(l.aux_bytes() as usize);
    let cfg = DecodeEngineConfig {
        backend: Backend::Verbs,
        ..DecodeEngineConfig::new(l.clone())
    };
    let mem = DecodeMemory::new(Arc::new(Region::new(l.pool_bytes() as usize)), dev.region());
    let err = decode_start(cfg, mem).expect_err("device aux accepted");
    assert!(
        matches!(
            err.downcast_ref::<MemoryError>(),
            Some(MemoryError::DeviceAux { .. })
        ),
        "{err:#}"
    );
}

#[test]
fn decode_refuses_staging_over_device_kv() {
    let l = layout();
    let dev = NoAccess::new(l.pool_bytes() as usize);
    let cfg = DecodeEngineConfig {
        backend: Backend::Verbs,
        staging: Some(DecodeStagingConfig {
            ring_bytes: 1 << 20,
            chunked_prefill_size: 8192,
            in_place: true,
        }),
        ..DecodeEngineConfig::new(l.clone())
    };
    let mem = DecodeMemory::new(dev.region(), Arc::new(Region::new(l.aux_bytes() as usize)));
    let err = decode_start(cfg, mem).expect_err("staging over device KV accepted");
    assert_eq!(
        err.downcast_ref::<MemoryError>(),
        Some(&MemoryError::StagingWithDeviceKv {
            option: "DecodeEngineConfig::staging"
        }),
        "{err:#}"
    );
}

/// Over `verbs` a device KV pool gets past the engines' checks and is handed to `ibv_reg_mr`.
/// That needs an RDMA device, a GPUDirect-RDMA capable NIC with `nvidia-peermem`, and a real
/// GPU allocation; where any is missing the test says which and what it could check.
#[test]
fn verbs_device_kv_needs_hardware() {
    if let Err(e) = check_backend(Backend::Verbs, &RdmaOptions::default()) {
        eprintln!(
            "SKIP verbs_device_kv_needs_hardware: device-memory registration over verbs not \
             exercised: {e}"
        );
        return;
    }
    // An RDMA device exists, but this test has no GPU allocation to give it: the PROT_NONE
    // stand-in must reach ibv_reg_mr (not be refused as unsupported), and is expected to fail
    // there (the NIC cannot pin it).
    let dev = NoAccess::new((2 * PAGES * ITEM) as usize);
    let cfg = PrefillConfig {
        backend: Backend::Verbs,
        ..PrefillConfig::default()
    };
    let mem = prefill_mem(dev.region(), Arc::new(Region::new(64 * 8)));
    match prefill_start(cfg, mem) {
        Err(EngineError::Transport(TransportError::DeviceMemoryUnsupported { backend })) => {
            panic!("verbs refused device memory as unsupported ({backend})")
        }
        Err(e) => eprintln!(
            "SKIP verbs_device_kv_needs_hardware (partly): an RDMA device exists and verbs took \
             the device region to ibv_reg_mr, which refused the CPU-inaccessible stand-in: {e}; \
             a real GPU allocation with GPUDirect RDMA (nvidia-peermem) is needed to test the \
             transfer"
        ),
        Ok(_) => eprintln!(
            "SKIP verbs_device_kv_needs_hardware (partly): verbs registered the device stand-in; \
             no transfer into GPU memory was tested (needs a real GPU allocation)"
        ),
    }
}
