//! Device memory on the backends that move bytes with the CPU: `tcp`, `mooncake`, `local` and
//! `auto` refuse [`Transport::register_device`] with a typed error naming themselves, register
//! nothing and never touch the range (it is a `PROT_NONE` mapping here: any CPU access would
//! kill the test). The `verbs` backend's acceptance needs an RDMA device and GPU memory and is
//! not exercised on hosts without them (see `verbs_hw.rs`).

use std::sync::Arc;
use std::time::Duration;

use kvx_rdma::{
    AutoTransport, LocalTransport, MooncakeConfig, MooncakeTransport, TcpConfig, TcpTransport,
    Transport, TransportError,
};

/// A `PROT_NONE` anonymous mapping: stands in for device memory the CPU must never touch.
struct NoAccess {
    addr: *mut libc::c_void,
    len: usize,
}

impl NoAccess {
    fn new(len: usize) -> NoAccess {
        // SAFETY: an anonymous private mapping with no access rights; no pointer into it is
        // ever dereferenced.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED, "mmap PROT_NONE");
        NoAccess { addr, len }
    }

    fn base(&self) -> u64 {
        self.addr as u64
    }
}

impl Drop for NoAccess {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn assert_refuses(t: &dyn Transport, backend: &str) {
    let dev = NoAccess::new(1 << 16);
    assert!(!t.accepts_device_memory(), "{backend}");
    // SAFETY: the mapping outlives the call; the default implementation refuses before any use.
    let err = unsafe { t.register_device(dev.base(), 1 << 16) }
        .expect_err("a CPU backend refuses device memory");
    assert_eq!(
        err,
        TransportError::DeviceMemoryUnsupported { backend: t.kind() }
    );
    assert_eq!(t.kind(), backend);
    assert_eq!(err.label(), "device_memory_unsupported");
    assert!(!err.is_peer_failure());
    let msg = err.to_string();
    assert!(
        msg.contains(backend) && msg.contains("`verbs`"),
        "the message names the backend and the way out: {msg}"
    );
    assert!(
        t.descriptor().regions.is_empty(),
        "{backend}: nothing was registered"
    );
    // Host memory still registers after the refusal.
    let host = vec![0u8; 4096];
    // SAFETY: `host` outlives the transport's use of it (deregistered just below).
    let key = unsafe { t.register(host.as_ptr() as u64, 4096) }.expect("host memory registers");
    assert_eq!(t.descriptor().regions.len(), 1);
    t.deregister(key).expect("deregister");
}

#[tokio::test]
async fn tcp_refuses_device_memory() {
    let t = TcpTransport::client(TcpConfig::default());
    assert_refuses(t.as_ref(), "tcp");
}

#[tokio::test]
async fn mooncake_refuses_device_memory() {
    let t = MooncakeTransport::client(MooncakeConfig::default());
    assert_refuses(t.as_ref(), "mooncake");
}

#[tokio::test]
async fn auto_refuses_device_memory() {
    let t = AutoTransport::client(
        TcpConfig::default(),
        MooncakeConfig::default(),
        Duration::from_secs(1),
    );
    assert_refuses(t.as_ref(), "auto");
}

#[tokio::test]
async fn local_refuses_device_memory() {
    let name = format!("kvx-devmem-test-{}", std::process::id());
    let t: Arc<LocalTransport> = LocalTransport::new(&name).unwrap();
    assert_refuses(t.as_ref(), "local");
}
