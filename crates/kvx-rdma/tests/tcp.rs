//! End-to-end tests of the tcp backend over loopback: bytes verified, sender-side checks,
//! adversarial raw clients, killed and silent peers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream as StdStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::tcp::wire::{self, Ack, ClientFrame, Entry, HEADER_LEN, HELLO_LEN, Hello};
use kvx_rdma::{
    RejectReason, SegmentDescriptor, TcpConfig, TcpTransport, Transport, TransportError,
};

/// Heap buffer with a stable address, registered with a transport for the test's lifetime.
struct Buf(Vec<u8>);

impl Buf {
    fn zeroed(n: usize) -> Self {
        Buf(vec![0u8; n])
    }
    fn pattern(n: usize, seed: u8) -> Self {
        Buf((0..n)
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
            .collect())
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn register(&mut self, t: &dyn Transport) -> kvx_rdma::RegionKey {
        // SAFETY: the buffer outlives the transport in every test (declared before it is used
        // and dropped at the end of the test), and is only read after batches complete.
        unsafe { t.register(self.0.as_mut_ptr() as u64, self.0.len() as u64) }.unwrap()
    }
}

fn small_cfg() -> TcpConfig {
    TcpConfig {
        connections: 3,
        slice_bytes: 64 << 10,
        window_bytes: 256 << 10,
        max_writes_per_window: 100,
        queue_depth: 2,
        ack_timeout: Duration::from_secs(10),
        ..TcpConfig::default()
    }
}

/// A [`small_cfg`] server on loopback with `dst` registered, and a client with `src` registered.
async fn small_pair(src: &mut Buf, dst: &mut Buf) -> (Arc<TcpTransport>, Arc<TcpTransport>) {
    let server = TcpTransport::bind("127.0.0.1:0", small_cfg())
        .await
        .unwrap();
    dst.register(&*server);
    let client = TcpTransport::client(small_cfg());
    src.register(&*client);
    (server, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_arrive_exactly() {
    let mut dst = Buf::zeroed(4 << 20);
    let mut src = Buf::pattern(4 << 20, 0x5a);
    let (server, client) = small_pair(&mut src, &mut dst).await;

    // Mixed sizes: tiny, odd, sliced (> slice_bytes), spanning windows; gaps stay zero.
    let mut ops = Vec::new();
    let mut expect = vec![0u8; dst.0.len()];
    let mut s = 0u64;
    let mut d = 0u64;
    for (i, len) in [1u64, 7, 4096, 100_000, 3, 1 << 20, 65_536, 65_537, 12_345]
        .iter()
        .cycle()
        .take(27)
        .enumerate()
    {
        if d + len + 64 > dst.0.len() as u64 || s + len > src.0.len() as u64 {
            break;
        }
        ops.push(TransferOp::new(src.addr() + s, dst.addr() + d, *len));
        expect[d as usize..(d + len) as usize]
            .copy_from_slice(&src.0[s as usize..(s + len) as usize]);
        s += len + (i as u64 % 5);
        d += len + 17;
    }
    let session = client.connect(&server.endpoint()).await.unwrap();
    assert_eq!(session.remote().regions.len(), 1);
    let report = session.write_batch(ops.clone()).await.unwrap();
    assert_eq!(report.bytes, TransferOp::total_bytes(&ops));
    assert!(
        dst.0 == expect,
        "destination differs from the expected image"
    );

    // The session is reused, and concurrent batches complete independently.
    let again = client.connect(&server.endpoint()).await.unwrap();
    assert!(Arc::ptr_eq(&session, &again));
    let mut futs = Vec::new();
    for k in 0..8u64 {
        let op = TransferOp::new(
            src.addr() + k * 1000,
            dst.addr() + (3 << 20) + k * 4096,
            999,
        );
        futs.push(tokio::spawn(session.write_batch(vec![op])));
    }
    for f in futs {
        assert_eq!(f.await.unwrap().unwrap().bytes, 999);
    }
    for k in 0..8usize {
        let at = (3 << 20) + k * 4096;
        assert_eq!(&dst.0[at..at + 999], &src.0[k * 1000..k * 1000 + 999]);
    }
    // Empty batch completes at once.
    assert_eq!(session.write_batch(Vec::new()).await.unwrap().ops, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_batches_of_small_scattered_ops() {
    // Far more entries than one vectored frame or one window holds (sglang submits every
    // triple of a chunk in one batch).
    const N: u64 = 20_000;
    let mut dst = Buf::zeroed((2 * N * 64) as usize);
    let mut src = Buf::pattern((N * 64) as usize, 0x33);
    let (server, client) = small_pair(&mut src, &mut dst).await;
    // Op i copies src[64i..64i+40] to the reversed slot dst[128(N-1-i)..+40].
    let ops: Vec<_> = (0..N)
        .map(|i| TransferOp::new(src.addr() + 64 * i, dst.addr() + 128 * (N - 1 - i), 40))
        .collect();
    let session = client.connect(&server.endpoint()).await.unwrap();
    assert_eq!(session.write_batch(ops).await.unwrap().ops, N);
    for i in 0..N as usize {
        let at = 128 * (N as usize - 1 - i);
        assert_eq!(&dst.0[at..at + 40], &src.0[64 * i..64 * i + 40], "op {i}");
        assert!(dst.0[at + 40..at + 128].iter().all(|&b| b == 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_ranges_fail_before_sending() {
    let mut dst = Buf::zeroed(1 << 16);
    let mut src = Buf::pattern(1 << 16, 1);
    let (server, client) = small_pair(&mut src, &mut dst).await;
    let session = client.connect(&server.endpoint()).await.unwrap();
    let good = TransferOp::new(src.addr(), dst.addr(), 16);
    let past_dst = TransferOp::new(src.addr(), dst.addr() + (1 << 16) - 8, 16);
    let past_src = TransferOp::new(src.addr() + (1 << 16) - 8, dst.addr(), 16);
    assert!(matches!(
        session.write_batch(vec![good, past_dst]).await,
        Err(TransportError::RemoteNotRegistered { .. })
    ));
    assert!(matches!(
        session.write_batch(vec![past_src]).await,
        Err(TransportError::LocalNotRegistered { .. })
    ));
    assert!(dst.0.iter().all(|&b| b == 0), "nothing may be written");
    session.write_batch(vec![good]).await.unwrap();
    assert_eq!(&dst.0[..16], &src.0[..16]);
}

/// Handshakes a raw blocking socket; returns it and the server's descriptor.
fn raw_connect(endpoint: &str) -> (StdStream, SegmentDescriptor) {
    let mut s = StdStream::connect(kvx_rdma::instance::address(endpoint)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
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
    assert_eq!(h.status, wire::HELLO_OK);
    let mut desc = vec![0u8; h.desc_len as usize];
    s.read_exact(&mut desc).unwrap();
    (s, SegmentDescriptor::decode(&desc).unwrap())
}

fn raw_write(s: &mut StdStream, key: u32, addr: u64, payload: &[u8]) {
    let h = ClientFrame::Write {
        key: kvx_rdma::RegionKey(key),
        addr,
        len: payload.len() as u64,
        tag: 0,
    };
    s.write_all(&h.encode()).unwrap();
    s.write_all(payload).unwrap();
}

fn raw_fence(s: &mut StdStream, tag: u64) -> Ack {
    s.write_all(&ClientFrame::Fence { tag }.encode()).unwrap();
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    Ack::decode(&b).unwrap()
}

fn read_ack(s: &mut StdStream) -> Ack {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    Ack::decode(&b).unwrap()
}

fn assert_closed(s: &mut StdStream) {
    let mut b = [0u8; 1];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adversarial_client_is_rejected_and_server_lives_on() {
    let mut dst = Buf::zeroed(1 << 16);
    let server = TcpTransport::bind("127.0.0.1:0", small_cfg())
        .await
        .unwrap();
    let key = dst.register(&*server).0;
    let ep = server.endpoint();
    let base = dst.addr();
    let ep2 = ep.clone();
    tokio::task::spawn_blocking(move || {
        let (mut s, desc) = raw_connect(&ep2);
        assert_eq!(desc.regions[0].key.0, key);
        // Out of bounds (straddles the end), wrong key, then a good write: the bad ones are
        // drained and reported, the good one lands.
        raw_write(&mut s, key, base + (1 << 16) - 4, &[0xee; 8]);
        raw_write(&mut s, key ^ 0x5555, base, &[0xee; 8]);
        raw_write(&mut s, key, u64::MAX - 2, &[0xee; 8]);
        let ack = raw_fence(&mut s, 7);
        assert_eq!(ack.tag, 7);
        assert_eq!(ack.status, Some(RejectReason::OutOfBounds));
        assert_eq!(ack.rejected, 3);
        assert_eq!(ack.bytes, 0);
        raw_write(&mut s, key, base + 100, b"hello");
        let ack = raw_fence(&mut s, 8);
        assert_eq!((ack.status, ack.bytes), (None, 5));

        // Vectored write: out of bounds, wrong key, then a good entry; only the good one lands.
        let entries = [
            (key, base + (1 << 16) - 2, 8u64),
            (key ^ 1, base + 200, 8),
            (key, base + 300, 5),
        ];
        let mut frame = ClientFrame::WriteV { count: 3, tag: 0 }.encode().to_vec();
        for (k, addr, len) in entries {
            frame.extend_from_slice(
                &Entry {
                    key: kvx_rdma::RegionKey(k),
                    addr,
                    len,
                }
                .encode(),
            );
        }
        frame.extend_from_slice(&[0xee; 16]);
        frame.extend_from_slice(b"world");
        s.write_all(&frame).unwrap();
        let ack = raw_fence(&mut s, 9);
        assert_eq!(
            (ack.status, ack.rejected, ack.bytes),
            (Some(RejectReason::OutOfBounds), 2, 5)
        );

        // A vectored write whose entry is oversized (after a wrong key): rejected and closed;
        // the fatal reason is the one reported.
        let (mut s, _) = raw_connect(&ep2);
        let mut frame = ClientFrame::WriteV { count: 2, tag: 0 }.encode().to_vec();
        frame.extend_from_slice(
            &Entry {
                key: kvx_rdma::RegionKey(key ^ 1),
                addr: base,
                len: 1,
            }
            .encode(),
        );
        frame.extend_from_slice(
            &Entry {
                key: kvx_rdma::RegionKey(key),
                addr: base,
                len: 1 << 40,
            }
            .encode(),
        );
        s.write_all(&frame).unwrap();
        assert_eq!(read_ack(&mut s).status, Some(RejectReason::TooLong));
        assert_closed(&mut s);

        // Truncated entries.
        let (mut s, _) = raw_connect(&ep2);
        s.write_all(&ClientFrame::WriteV { count: 4, tag: 0 }.encode())
            .unwrap();
        s.write_all(&[0u8; 30]).unwrap();
        drop(s);

        // Huge length: rejected, connection closed without reading a payload.
        let (mut s, _) = raw_connect(&ep2);
        s.write_all(
            &ClientFrame::Write {
                key: kvx_rdma::RegionKey(key),
                addr: base,
                len: u64::MAX,
                tag: 1,
            }
            .encode(),
        )
        .unwrap();
        let ack = read_ack(&mut s);
        assert_eq!(ack.status, Some(RejectReason::TooLong));
        assert_closed(&mut s);

        // Malformed header kind.
        let (mut s, _) = raw_connect(&ep2);
        let mut bad = [0u8; HEADER_LEN];
        bad[0] = 0x42;
        s.write_all(&bad).unwrap();
        assert_eq!(read_ack(&mut s).status, Some(RejectReason::BadFrame));
        assert_closed(&mut s);

        // Truncated frames: half a header; a header with half its payload; then close.
        let (mut s, _) = raw_connect(&ep2);
        s.write_all(&[1u8; 10]).unwrap();
        drop(s);
        let (mut s, _) = raw_connect(&ep2);
        raw_write(&mut s, key, base + 1000, &[]);
        s.write_all(
            &ClientFrame::Write {
                key: kvx_rdma::RegionKey(key),
                addr: base + 2000,
                len: 100,
                tag: 1,
            }
            .encode(),
        )
        .unwrap();
        s.write_all(&[0xab; 50]).unwrap();
        drop(s);

        // Bad magic, and a hello claiming a huge descriptor.
        let mut s = StdStream::connect(kvx_rdma::instance::address(&ep2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert_closed(&mut s);
        let mut s = StdStream::connect(kvx_rdma::instance::address(&ep2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut h = Hello {
            version: 1,
            status: 0,
            param: 0,
            desc_len: 0,
        }
        .encode();
        h[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        s.write_all(&h).unwrap();
        assert_closed(&mut s);
    })
    .await
    .unwrap();

    // Only the good 5 bytes (and the truncated write's 50 bytes, which were in bounds and
    // under a valid key) reached memory; the rest is untouched.
    assert_eq!(&dst.0[100..105], b"hello");
    assert_eq!(&dst.0[300..305], b"world");
    let other = dst
        .0
        .iter()
        .enumerate()
        .filter(|&(i, &b)| {
            b != 0
                && !(100..105).contains(&i)
                && !(300..305).contains(&i)
                && !(2000..2050).contains(&i)
        })
        .count();
    assert_eq!(other, 0, "rejected writes must not touch memory");

    // A well-behaved client is still served.
    let mut src = Buf::pattern(1 << 12, 9);
    let client = TcpTransport::client(small_cfg());
    src.register(&*client);
    let session = client.connect(&ep).await.unwrap();
    session
        .write_batch(vec![TransferOp::new(src.addr(), base + 8192, 4096)])
        .await
        .unwrap();
    assert_eq!(&dst.0[8192..8192 + 4096], &src.0[..]);
}

/// Where a fake peer's one advertised region starts (its key is 5).
const FAKE_BASE: u64 = 1 << 30;

/// A fake peer that handshakes (advertising one region of `region_len` bytes at [`FAKE_BASE`])
/// and then runs `then` on the socket.
fn fake_peer(region_len: u64, then: impl FnOnce(StdStream) + Send + Clone + 'static) -> String {
    fake_peer_on(
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        region_len,
        then,
    )
}

/// [`fake_peer`] on a given listener.
fn fake_peer_on(
    l: std::net::TcpListener,
    region_len: u64,
    then: impl FnOnce(StdStream) + Send + Clone + 'static,
) -> String {
    let region = SegmentDescriptor {
        endpoint: String::new(),
        regions: vec![kvx_rdma::RegionDesc {
            base: FAKE_BASE,
            len: region_len,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_fails_its_batch_only() {
    // The dying peer reads 1 MiB on one connection, then dies: like a killed process's
    // kernel, it closes every connection at once.
    let all: Arc<std::sync::Mutex<(bool, Vec<StdStream>)>> = Arc::default();
    let dying = fake_peer(1 << 30, move |mut s| {
        {
            let mut g = all.lock().unwrap();
            if g.0 {
                return;
            }
            g.1.push(s.try_clone().unwrap());
        }
        let mut sink = vec![0u8; 1 << 20];
        if s.read_exact(&mut sink).is_ok() {
            let mut g = all.lock().unwrap();
            g.0 = true;
            for c in &g.1 {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
    });
    let mut dst = Buf::zeroed(8 << 20);
    let healthy = TcpTransport::bind("127.0.0.1:0", small_cfg())
        .await
        .unwrap();
    dst.register(&*healthy);
    let mut src = Buf::pattern(16 << 20, 3);
    let client = TcpTransport::client(small_cfg());
    src.register(&*client);

    let doomed = client.connect(&dying).await.unwrap();
    let big = vec![TransferOp::new(src.addr(), FAKE_BASE, 16 << 20)];
    let good = client.connect(&healthy.endpoint()).await.unwrap();
    let ok_op = vec![TransferOp::new(src.addr(), dst.addr(), 8 << 20)];
    let (bad, ok) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(5), doomed.write_batch(big.clone())),
        good.write_batch(ok_op)
    );
    let err = bad.expect("hang guard").unwrap_err();
    assert!(matches!(err, TransportError::PeerLost { .. }), "{err}");
    assert!(err.is_peer_failure());
    assert_eq!(ok.unwrap().bytes, 8 << 20);
    assert!(dst.0 == src.0[..8 << 20]);
    assert!(!doomed.is_alive());
    // Later batches on the dead session fail at once; the healthy session is still good.
    assert!(
        tokio::time::timeout(Duration::from_secs(5), doomed.write_batch(big))
            .await
            .expect("hang guard")
            .is_err()
    );
    assert!(good.is_alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_peer_times_out() {
    // Reads everything, never acknowledges.
    let silent = fake_peer(1 << 20, |mut s| {
        let mut sink = vec![0u8; 1 << 16];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    let mut src = Buf::pattern(1 << 20, 3);
    let cfg = TcpConfig {
        ack_timeout: Duration::from_millis(300),
        ..small_cfg()
    };
    let client = TcpTransport::client(cfg);
    src.register(&*client);
    let s = client.connect(&silent).await.unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        s.write_batch(vec![TransferOp::new(src.addr(), FAKE_BASE, 1 << 20)]),
    )
    .await
    .expect("hang guard");
    assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_shutdown_mid_batch_fails_promptly_and_reconnect_is_refused() {
    let mut dst = Buf::zeroed(64 << 20);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    dst.register(&*server);
    let mut src = Buf::zeroed(64 << 20);
    src.0.fill(0x77);
    let client = TcpTransport::client(TcpConfig::default());
    src.register(&*client);
    let ep = server.endpoint();
    let session = client.connect(&ep).await.unwrap();
    let batch: Vec<_> = (0..16u64)
        .map(|i| {
            TransferOp::new(
                src.addr() + i * (4 << 20),
                dst.addr() + i * (4 << 20),
                4 << 20,
            )
        })
        .collect();
    let fut = tokio::spawn(session.write_batch(batch));
    // Wait until the first bytes land, then kill the receiver.
    let probe = dst.addr() as usize;
    tokio::task::spawn_blocking(move || {
        // SAFETY: reading one byte of the registered destination; a torn read is harmless.
        while unsafe { std::ptr::read_volatile(probe as *const u8) } == 0 {
            std::thread::yield_now();
        }
    })
    .await
    .unwrap();
    server.shutdown().await;
    let r = tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .expect("hang guard")
        .unwrap();
    // Either the kill landed mid-batch (peer lost) or the batch had already been fully acked.
    if let Err(e) = r {
        assert!(e.is_peer_failure(), "{e}");
        assert!(!session.is_alive());
    }
    // Whatever the race, the receiver is gone now: a new batch fails promptly and a fresh
    // session cannot be opened.
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        session.write_batch(vec![TransferOp::new(src.addr(), dst.addr(), 4 << 20)]),
    )
    .await
    .expect("hang guard");
    assert!(matches!(&r, Err(e) if e.is_peer_failure()), "{r:?}");
    assert!(matches!(
        client.open_session(&ep).await.map(|_| ()),
        Err(TransportError::PeerUnreachable { .. })
    ));
}

/// 4 KiB pages of `buf` whose first byte is not zero; safe to call while a peer may still write.
fn touched_pages(buf: &Buf) -> usize {
    (0..buf.0.len())
        .step_by(4096)
        // SAFETY: one byte inside the buffer; a peer writing it concurrently is what the caller
        // looks for (a torn read is harmless).
        .filter(|&i| unsafe { std::ptr::read_volatile(buf.0.as_ptr().add(i)) } != 0)
        .count()
}

/// A copy of `buf`, taken while a peer may still write (see [`touched_pages`]).
fn snapshot(buf: &Buf) -> Vec<u8> {
    let mut out = vec![0u8; buf.0.len()];
    // SAFETY: both ranges are live and do not overlap; a concurrent write only tears the copy.
    unsafe { std::ptr::copy_nonoverlapping(buf.0.as_ptr(), out.as_mut_ptr(), out.len()) };
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_window_cancels_the_rest_of_its_batch_before_it_resolves() {
    // The receiver deregisters B after the sender's handshake: the batch's first window (into
    // B) is rejected while its other windows (into A) are queued or in flight on the other
    // connections. Once the batch answers Err, nothing of it may still land in A.
    const MIB: usize = 1 << 20;
    const WINDOWS: usize = 96;
    let mut a = Buf::zeroed(WINDOWS * MIB);
    let mut b = Buf::zeroed(MIB);
    let mut c = Buf::zeroed(8 * MIB);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    a.register(&*server);
    let b_key = b.register(&*server);
    c.register(&*server);
    let cfg = TcpConfig {
        connections: 4,
        slice_bytes: MIB,
        window_bytes: MIB as u64,
        queue_depth: 8,
        ..TcpConfig::default()
    };
    let mut src = Buf::zeroed((WINDOWS + 1) * MIB);
    src.0.fill(0xa5);
    let client = TcpTransport::client(cfg);
    src.register(&*client);
    let session = client.connect(&server.endpoint()).await.unwrap();
    assert_eq!(session.remote().regions.len(), 3);
    server.deregister(b_key).unwrap();

    let mut bad = vec![TransferOp::new(src.addr(), b.addr(), MIB as u64)];
    bad.extend((0..WINDOWS).map(|i| {
        TransferOp::new(
            src.addr() + ((i + 1) * MIB) as u64,
            a.addr() + (i * MIB) as u64,
            MIB as u64,
        )
    }));
    // Another batch on the same session at the same time is not affected.
    let good = tokio::spawn(session.write_batch(vec![TransferOp::new(
        src.addr(),
        c.addr(),
        8 * MIB as u64,
    )]));
    let r = tokio::time::timeout(Duration::from_secs(20), session.write_batch(bad))
        .await
        .expect("hang guard");
    let (pages, image) = (touched_pages(&a), snapshot(&a));
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
    assert!(
        pages < a.0.len() / 4096,
        "the rest of the failed batch must be cancelled, not sent ({pages} pages written)"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        touched_pages(&a),
        pages,
        "windows of the failed batch landed after it resolved"
    );
    assert!(
        a.0 == image,
        "the destination changed after the batch resolved"
    );
    assert!(b.0.iter().all(|&x| x == 0));

    assert_eq!(good.await.unwrap().unwrap().bytes, 8 * MIB as u64);
    assert!(c.0.iter().all(|&x| x == 0xa5));
    // A rejected write fails its batch, not the connections: the session still works.
    assert!(session.is_alive());
    let last = a.addr() + ((WINDOWS - 1) * MIB) as u64;
    session
        .write_batch(vec![TransferOp::new(src.addr(), last, 4096)])
        .await
        .unwrap();
    assert!(
        a.0[(WINDOWS - 1) * MIB..][..4096]
            .iter()
            .all(|&x| x == 0xa5)
    );
}

/// A fake peer ([`fake_peer`], region of 1 GiB) with a small receive buffer that reads nothing
/// until `go` is set, then reads (and counts in `received`) whatever comes, never acknowledging.
fn stalled_peer(go: Arc<AtomicBool>, received: Arc<AtomicU64>) -> String {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(64 << 10).unwrap();
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    sock.bind(&any.into()).unwrap();
    sock.listen(16).unwrap();
    fake_peer_on(sock.into(), 1 << 30, move |mut s| {
        while !go.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut sink = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = s.read(&mut sink) {
            received.fetch_add(n as u64, Ordering::Relaxed);
        }
    })
}

/// Waits until `n` has not changed for 300 ms (at most 10 s) and returns it.
async fn settled(n: &AtomicU64) -> u64 {
    let mut last = n.load(Ordering::Relaxed);
    for _ in 0..33 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = n.load(Ordering::Relaxed);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the peer kept receiving for 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batch_future_cancels_its_queued_windows() {
    // The peer reads nothing at first, so each connection's writer blocks inside one window
    // (small socket buffers) and the session queue fills up behind them. The batch's future is
    // then dropped: only the two windows already handed to a socket may reach the peer.
    const W: u64 = 4 << 20;
    let (go, received) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let peer = stalled_peer(go.clone(), received.clone());
    let mut src = Buf::pattern(W as usize, 0x11);
    let cfg = TcpConfig {
        connections: 2,
        slice_bytes: W as usize,
        window_bytes: W,
        queue_depth: 4,
        socket_buffer: Some(64 << 10),
        ack_timeout: Duration::from_secs(30),
        ..small_cfg()
    };
    let client = TcpTransport::client(cfg);
    src.register(&*client);
    let session = client.connect(&peer).await.unwrap();
    let ops: Vec<_> = (0..32)
        .map(|i| TransferOp::new(src.addr(), FAKE_BASE + i * W, W))
        .collect();
    let r = tokio::time::timeout(Duration::from_millis(500), session.write_batch(ops)).await;
    assert!(
        r.is_err(),
        "the stalled peer cannot have acknowledged the batch"
    );
    go.store(true, Ordering::Release);
    let got = settled(&received).await;
    // Per window: one vectored-write header, one entry, the payload, one fence.
    let per_window = W + 32 + 24 + 32;
    assert!(
        got >= W,
        "the windows on the wire are completed ({got} bytes)"
    );
    assert!(
        got <= 2 * per_window,
        "queued windows of a dropped batch were sent: {got} bytes, {:.1} windows",
        got as f64 / per_window as f64
    );
    assert!(session.is_alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_connection_fails_its_batch_only_once_the_other_windows_are_settled() {
    // The peer's first connection dies after 64 KiB (once the others carry a window); the
    // others read everything and never acknowledge. The batch fails with the lost connection, but may answer only once its
    // windows on the other connections are settled (here: those connections time out), and
    // nothing more of it is sent after the failure.
    let (idx, received) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU64::new(0)));
    let (idx2, received2) = (idx.clone(), received.clone());
    let peer = fake_peer(1 << 30, move |mut s| {
        let mut sink = vec![0u8; 1 << 16];
        if idx2.fetch_add(1, Ordering::Relaxed) == 0 {
            // Dies once another connection carries a window (which it never acknowledges).
            let _ = s.read_exact(&mut sink);
            let t = Instant::now();
            while received2.load(Ordering::Relaxed) == 0 && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
            return;
        }
        while let Ok(n @ 1..) = s.read(&mut sink) {
            received2.fetch_add(n as u64, Ordering::Relaxed);
        }
    });
    const W: u64 = 1 << 20;
    let ack_timeout = Duration::from_millis(1500);
    let cfg = TcpConfig {
        connections: 3,
        slice_bytes: W as usize,
        window_bytes: W,
        queue_depth: 4,
        socket_buffer: Some(64 << 10),
        ack_timeout,
        ..small_cfg()
    };
    let mut src = Buf::pattern(W as usize, 0x22);
    let client = TcpTransport::client(cfg);
    src.register(&*client);
    let session = client.connect(&peer).await.unwrap();
    let ops: Vec<_> = (0..512)
        .map(|i| TransferOp::new(src.addr(), FAKE_BASE + i * W, W))
        .collect();
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(20), session.write_batch(ops))
        .await
        .expect("hang guard");
    let took = t0.elapsed();
    assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
    assert!(
        took >= ack_timeout / 2,
        "answered after {took:?}, while windows on live connections were unsettled"
    );
    let at_answer = received.load(Ordering::Relaxed);
    let got = settled(&received).await;
    assert_eq!(
        got, at_answer,
        "bytes of the failed batch arrived after it resolved"
    );
    assert!(
        got < 512 * W / 2,
        "the rest of the failed batch must be cancelled ({got} bytes sent)"
    );
    assert!(!session.is_alive());
}

/// A decode that restarts on the same address is another instance: a sender holding the session
/// id the old process published is refused at the handshake (a peer failure, nothing written),
/// while the id the new process publishes works, and an id naming no instance accepts either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_listener_on_the_same_address_refuses_the_old_session_id() {
    let mut old_dst = Buf::zeroed(1 << 16);
    let mut new_dst = Buf::zeroed(1 << 16);
    let mut src = Buf::pattern(1 << 16, 7);
    let old = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    old_dst.register(&*old);
    let old_id = old.endpoint();
    let addr = kvx_rdma::instance::address(&old_id).to_owned();
    assert_ne!(old_id, addr, "a listener names its instance");
    old.shutdown().await;
    drop(old);
    let new = TcpTransport::bind(&addr, TcpConfig::default())
        .await
        .unwrap();
    new_dst.register(&*new);
    let new_id = new.endpoint();
    assert_eq!(kvx_rdma::instance::address(&new_id), addr);
    assert_ne!(new_id, old_id);

    let client = TcpTransport::client(TcpConfig::default());
    src.register(&*client);
    let err = client
        .open_session(&old_id)
        .await
        .err()
        .expect("the old instance's id is refused");
    assert!(matches!(err, TransportError::PeerRestarted { .. }), "{err}");
    assert!(err.is_peer_failure());

    // Same region offsets in the new process: only its own id writes there.
    let op = TransferOp::new(src.addr(), new_dst.addr() + 64, 512);
    let s = client.connect(&new_id).await.unwrap();
    s.write_batch(vec![op]).await.unwrap();
    assert_eq!(&new_dst.0[64..576], &src.0[..512]);
    let bare = client.connect(&addr).await.unwrap();
    bare.write_batch(vec![TransferOp::new(src.addr(), new_dst.addr() + 4096, 8)])
        .await
        .unwrap();
    assert!(old_dst.0.iter().all(|&b| b == 0));
    // The new listener counted what landed in its regions.
    assert_eq!(new.bytes_received(), Some(512 + 8));
}
