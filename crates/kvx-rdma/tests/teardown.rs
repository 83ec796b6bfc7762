//! Teardown never writes into memory after it returns: a peer is in the middle of writing into
//! a registered region when the receiving side deregisters it, shuts down or is dropped; once
//! that call returns, the region's bytes no longer change (tcp and local backends; the
//! mooncake target's case is in `mooncake_server.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream as StdStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::tcp::wire::{self, ClientFrame, HELLO_LEN, Hello};
use kvx_rdma::{LocalTransport, RegionKey, TcpConfig, TcpTransport, Transport};

/// A heap buffer that other threads write into while the test reads it: every read goes
/// through volatile loads of a raw pointer.
struct Shared {
    ptr: *mut u8,
    len: usize,
    _buf: Box<[u8]>,
}

// SAFETY (test-only): the buffer is only accessed through volatile loads and by the transports.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn zeroed(len: usize) -> Self {
        let mut b = vec![0u8; len].into_boxed_slice();
        Shared {
            ptr: b.as_mut_ptr(),
            len,
            _buf: b,
        }
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn at(&self, i: usize) -> u8 {
        assert!(i < self.len);
        // SAFETY: `i` is in bounds of the live allocation.
        unsafe { std::ptr::read_volatile(self.ptr.add(i)) }
    }
    fn snapshot(&self) -> Vec<u8> {
        (0..self.len).map(|i| self.at(i)).collect()
    }
    fn register(&self, t: &dyn Transport) -> RegionKey {
        // SAFETY: the buffer outlives every transport of these tests (declared first).
        unsafe { t.register(self.addr(), self.len as u64) }.unwrap()
    }
    /// Waits until byte `i` is `v` (a peer's write has reached it).
    async fn wait_for(&self, i: usize, v: u8) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.at(i) != v {
            assert!(Instant::now() < deadline, "the write never arrived");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

const LEN: usize = 4 << 20;
const FIRST: usize = 256 << 10;

/// A raw sender that handshakes, then starts one write of `LEN` bytes into `buf` and sends
/// only its first `FIRST` bytes (0xAB), stalling inside the payload.
async fn stalled_writer(endpoint: &str, key: RegionKey, buf: &Shared) -> StdStream {
    let mut s = StdStream::connect(kvx_rdma::instance::address(endpoint)).unwrap();
    let hello = Hello {
        version: wire::VERSION,
        status: 0,
        param: 0,
        desc_len: 0,
    };
    s.write_all(&hello.encode()).unwrap();
    let mut fixed = [0u8; HELLO_LEN];
    s.read_exact(&mut fixed).unwrap();
    let h = Hello::decode(&fixed).unwrap();
    let mut desc = vec![0u8; h.desc_len as usize];
    s.read_exact(&mut desc).unwrap();
    let frame = ClientFrame::Write {
        key,
        addr: buf.addr(),
        len: LEN as u64,
        tag: 1,
    };
    s.write_all(&frame.encode()).unwrap();
    s.write_all(&vec![0xAB; FIRST]).unwrap();
    buf.wait_for(FIRST - 1, 0xAB).await;
    s
}

/// After teardown returned: the writer sends the rest of its payload; none of it may land.
async fn rest_never_lands(mut s: StdStream, buf: &Shared, after: Vec<u8>) {
    let _ = s.write_all(&vec![0xCD; LEN - FIRST]);
    let _ = s.shutdown(std::net::Shutdown::Write);
    // Give a receive thread that outlived the teardown every chance to write.
    let mut sink = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = buf.snapshot();
    let changed = now.iter().zip(&after).filter(|(a, b)| a != b).count();
    assert_eq!(
        changed, 0,
        "{changed} bytes written after teardown returned"
    );
    assert!(now[FIRST..].iter().all(|&b| b != 0xCD));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_deregister_returns_only_once_no_write_lands() {
    let buf = Shared::zeroed(LEN);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    let key = buf.register(&*server);
    let s = stalled_writer(&server.endpoint(), key, &buf).await;
    let t = server.clone();
    tokio::task::spawn_blocking(move || t.deregister(key).unwrap())
        .await
        .unwrap();
    let after = buf.snapshot();
    rest_never_lands(s, &buf, after).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_drop_returns_only_once_no_write_lands() {
    let buf = Shared::zeroed(LEN);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    let key = buf.register(&*server);
    let s = stalled_writer(&server.endpoint(), key, &buf).await;
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .unwrap();
    let after = buf.snapshot();
    rest_never_lands(s, &buf, after).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_shutdown_returns_only_once_no_write_lands() {
    let buf = Shared::zeroed(LEN);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    let key = buf.register(&*server);
    let s = stalled_writer(&server.endpoint(), key, &buf).await;
    server.shutdown().await;
    let after = buf.snapshot();
    rest_never_lands(s, &buf, after).await;
    drop(server);
}

/// A same-process copy of many large ops is running when the target deregisters (or is
/// dropped): the call returns only after the copy's last byte, so nothing changes afterwards.
async fn local_teardown(name: &str, drop_target: bool) {
    const OPS: usize = 16;
    const OP: usize = 4 << 20;
    let src = Shared::zeroed(OPS * OP);
    let dst = Shared::zeroed(OPS * OP);
    // SAFETY: `src` outlives the transports; nothing reads it through another reference.
    unsafe { std::ptr::write_bytes(src.ptr, 0x5A, OPS * OP) };
    let a: Arc<dyn Transport> = LocalTransport::new(&format!("{name}-a")).unwrap();
    let b: Arc<dyn Transport> = LocalTransport::new(&format!("{name}-b")).unwrap();
    src.register(&*a);
    let key = dst.register(&*b);
    let session = a.connect(&b.endpoint()).await.unwrap();
    let ops: Vec<TransferOp> = (0..OPS)
        .map(|i| {
            TransferOp::new(
                src.addr() + (i * OP) as u64,
                dst.addr() + (i * OP) as u64,
                OP as u64,
            )
        })
        .collect();
    let batch = tokio::spawn(session.write_batch(ops));
    dst.wait_for(0, 0x5A).await;
    // The last reference to the target goes into the blocking call when it is dropped.
    tokio::task::spawn_blocking(move || {
        if drop_target {
            drop(b);
        } else {
            b.deregister(key).unwrap();
        }
    })
    .await
    .unwrap();
    // The copy had started, so it held its lease: it has ended, down to its last byte.
    let sample = |d: &Shared| {
        (0..OPS * OP)
            .step_by(4096)
            .map(|i| d.at(i))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        dst.at(OPS * OP - 1),
        0x5A,
        "teardown returned while the copy ran"
    );
    let after = sample(&dst);
    let _ = batch.await.unwrap();
    let now = sample(&dst);
    let changed = now.iter().zip(&after).filter(|(x, y)| x != y).count();
    assert_eq!(
        changed, 0,
        "{changed} sampled bytes copied after teardown returned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_deregister_returns_only_after_the_copy() {
    local_teardown("teardown-dereg", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_drop_returns_only_after_the_copy() {
    local_teardown("teardown-drop", true).await;
}
