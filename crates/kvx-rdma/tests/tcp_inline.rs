//! The tcp backend's inline path: small windows written from the caller's thread (a thread
//! that may block: here the root future of a multi-thread runtime, as kvx-cli's workers drive
//! theirs) beside windows queued for the connections' writers, and connections that fail while
//! the caller is writing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream as StdStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::tcp::wire::{self, ClientFrame, HEADER_LEN, HELLO_LEN, Hello};
use kvx_rdma::{
    RejectReason, SegmentDescriptor, TcpConfig, TcpTransport, Transport, TransportError,
};

/// Heap buffer with a stable address, registered with a transport for the test's lifetime.
struct Buf(Vec<u8>);

impl Buf {
    fn pattern(n: usize, seed: u8) -> Self {
        Buf((0..n).map(|i| (i % 251) as u8 ^ seed).collect())
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn register(&mut self, t: &dyn Transport) -> kvx_rdma::RegionKey {
        // SAFETY: the buffer outlives the transport in every test (declared before it and
        // dropped at the end of the test), and is only read after batches complete.
        unsafe { t.register(self.0.as_mut_ptr() as u64, self.0.len() as u64) }.unwrap()
    }
}

const KIB: usize = 1 << 10;

/// Windows of at most 64 KiB (each one inline-sized).
fn cfg(connections: usize) -> TcpConfig {
    TcpConfig {
        connections,
        slice_bytes: 64 * KIB,
        window_bytes: 64 * KIB as u64,
        queue_depth: 2,
        ..TcpConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_writes_arrive_from_a_blocking_caller_and_from_tasks_at_once() {
    let mut dst = Buf::pattern(8 << 20, 0);
    dst.0.fill(0);
    let server = TcpTransport::bind("127.0.0.1:0", cfg(2)).await.unwrap();
    dst.register(&*server);
    let mut src = Buf::pattern(8 << 20, 0x5a);
    let client = TcpTransport::client(cfg(2));
    src.register(&*client);
    let session = client.connect(&server.endpoint()).await.unwrap();
    // Tasks (never inline) write the upper half while this root future (inline when a
    // connection is idle) writes the lower half, one small batch at a time.
    let half = 4 << 20;
    let mut tasks = Vec::new();
    for t in 0..4u64 {
        let s = session.clone();
        let (sa, da) = (src.addr() + half as u64, dst.addr() + half as u64);
        tasks.push(tokio::spawn(async move {
            for i in 0..64u64 {
                let off = (t * 64 + i) * 16 * KIB as u64;
                s.write_batch(vec![TransferOp::new(sa + off, da + off, 16 * KIB as u64)])
                    .await
                    .unwrap();
            }
        }));
    }
    let mut off = 0u64;
    for size in [1u64, 4096, 64 * KIB as u64 - 7, 64 * KIB as u64] {
        for _ in 0..32 {
            session
                .write_batch(vec![TransferOp::new(
                    src.addr() + off,
                    dst.addr() + off,
                    size,
                )])
                .await
                .unwrap();
            off += size;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(dst.0[..off as usize] == src.0[..off as usize]);
    assert!(dst.0[half..] == src.0[half..]);
    assert!(session.is_alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_mixing_inline_and_queued_windows_answers_after_all_of_them() {
    // Two connections, 64 KiB windows: the first two windows of a batch go out inline (one
    // per idle connection), the rest through the queue.
    let mut a = Buf::pattern(8 << 20, 0);
    a.0.fill(0);
    let mut b = Buf::pattern(64 * KIB, 0);
    b.0.fill(0);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    a.register(&*server);
    let b_key = b.register(&*server);
    let mut src = Buf::pattern(8 << 20, 0x33);
    let client = TcpTransport::client(cfg(2));
    src.register(&*client);
    let session = client.connect(&server.endpoint()).await.unwrap();

    // All applied: every byte arrives, in every window.
    let ops: Vec<TransferOp> = (0..64u64)
        .map(|i| {
            let off = i * 64 * KIB as u64;
            TransferOp::new(src.addr() + off, a.addr() + off, 64 * KIB as u64)
        })
        .collect();
    let r = session.write_batch(ops).await.unwrap();
    assert_eq!(r.bytes, 4 << 20);
    assert!(a.0[..4 << 20] == src.0[..4 << 20]);

    // The first (inline) window rejected: the batch fails with it, and answers only once
    // nothing of it can still land.
    a.0.fill(0);
    server.deregister(b_key).unwrap();
    let mut ops = vec![TransferOp::new(src.addr(), b.addr(), 64 * KIB as u64)];
    ops.extend((0..127u64).map(|i| {
        let off = i * 64 * KIB as u64;
        TransferOp::new(src.addr() + off, a.addr() + off, 64 * KIB as u64)
    }));
    let r = tokio::time::timeout(Duration::from_secs(20), session.write_batch(ops))
        .await
        .expect("hang guard");
    assert!(
        matches!(
            r,
            Err(TransportError::RemoteRejected {
                reason: RejectReason::BadKey,
                ..
            })
        ),
        "{r:?}"
    );
    let image = a.0.clone();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        a.0 == image,
        "windows of the failed batch landed after it resolved"
    );
    assert!(b.0.iter().all(|&x| x == 0));
    // A rejection fails the batch, not the connections.
    assert!(session.is_alive());
    session
        .write_batch(vec![TransferOp::new(src.addr(), a.addr(), 4096)])
        .await
        .unwrap();
    assert!(a.0[..4096] == src.0[..4096]);
}

/// Where a fake peer's one advertised region starts (its key is 5).
const FAKE_BASE: u64 = 1 << 30;

/// A fake peer with a 4 KiB receive buffer: handshakes (one 1 GiB region at [`FAKE_BASE`]),
/// then runs `then` on each connection's socket.
fn fake_peer(then: impl FnOnce(StdStream) + Send + Clone + 'static) -> String {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    sock.bind(&any.into()).unwrap();
    sock.listen(16).unwrap();
    let l: std::net::TcpListener = sock.into();
    let region = SegmentDescriptor {
        endpoint: String::new(),
        regions: vec![kvx_rdma::RegionDesc {
            base: FAKE_BASE,
            len: 1 << 30,
            key: kvx_rdma::RegionKey(5),
        }],
    };
    let ep = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut fixed = [0u8; HELLO_LEN];
            if s.read_exact(&mut fixed).is_err() {
                continue;
            }
            let h = Hello::decode(&fixed).unwrap();
            let mut d = vec![0u8; h.desc_len as usize];
            s.read_exact(&mut d).unwrap();
            let enc = region.encode();
            let reply = Hello {
                version: wire::VERSION,
                status: 0,
                param: 16 << 20,
                desc_len: enc.len() as u32,
            };
            s.write_all(&reply.encode()).unwrap();
            s.write_all(&enc).unwrap();
            let then = then.clone();
            std::thread::spawn(move || then(s));
        }
    });
    ep
}

/// A client whose sockets have 4 KiB buffers (a 64 KiB window cannot go out in one call, so
/// an inline sender writes the rest blocking), one connection.
fn tiny_client(src: &mut Buf, ack_timeout: Duration) -> Arc<TcpTransport> {
    let client = TcpTransport::client(TcpConfig {
        socket_buffer: Some(4096),
        ack_timeout,
        ..cfg(1)
    });
    src.register(&*client);
    client
}

/// Reads the window's first header: it went out with tag 1 (the inline sender's).
fn first_header(s: &mut StdStream) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        ClientFrame::decode(&h).unwrap(),
        ClientFrame::WriteV { count: 1, tag: 1 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_lost_mid_inline_send_fails_the_batch() {
    // The peer reads the window's header, lets the sender block on the rest, then closes with
    // unread bytes (a reset).
    let peer = fake_peer(|mut s| {
        first_header(&mut s);
        std::thread::sleep(Duration::from_millis(200));
        drop(s);
    });
    let mut src = Buf::pattern(64 * KIB, 1);
    let client = tiny_client(&mut src, Duration::from_secs(10));
    let session = client.connect(&peer).await.unwrap();
    let t = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        session.write_batch(vec![TransferOp::new(
            src.addr(),
            FAKE_BASE,
            64 * KIB as u64,
        )]),
    )
    .await
    .expect("hang guard");
    assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "answered before the peer left"
    );
    assert!(!session.is_alive());
    // The dead session fails the next batch at once, inline or not.
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        session.write_batch(vec![TransferOp::new(src.addr(), FAKE_BASE, 4096)]),
    )
    .await
    .expect("hang guard");
    assert!(r.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_mid_inline_send_times_out() {
    // The peer reads the window's header and then nothing, holding the connection open: the
    // sender blocks on the rest of the window until the acknowledgement timeout fails the
    // connection, whose shutdown ends the write.
    let held: Arc<Mutex<Vec<StdStream>>> = Arc::default();
    let keep = held.clone();
    let peer = fake_peer(move |mut s| {
        first_header(&mut s);
        keep.lock().unwrap().push(s);
    });
    let mut src = Buf::pattern(64 * KIB, 2);
    let client = tiny_client(&mut src, Duration::from_millis(300));
    let session = client.connect(&peer).await.unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        session.write_batch(vec![TransferOp::new(
            src.addr(),
            FAKE_BASE,
            64 * KIB as u64,
        )]),
    )
    .await
    .expect("hang guard");
    // The acknowledgement timeout as a rule; the kernel's TCP_USER_TIMEOUT (set to the same
    // value) may abort the socket first, which the blocked write reports as a lost peer.
    assert!(
        matches!(
            r,
            Err(TransportError::Timeout { .. } | TransportError::PeerLost { .. })
        ),
        "{r:?}"
    );
    assert!(!session.is_alive());
    drop(held);
}
