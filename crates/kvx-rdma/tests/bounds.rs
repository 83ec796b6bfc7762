//! Bounds on what peers can hold on the receiving side: floods of connections that go silent
//! (after the kvx tcp hello, on the mooncake data port, on the mooncake handshake port) leave
//! the process with a bounded number of threads and still serving a good client; hello size
//! and the optional shared secret of the tcp hello.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream as StdStream};
use std::sync::Arc;
use std::time::Duration;

use kvx_core::TransferOp;
use kvx_rdma::mooncake::{fetch_descriptor, split_session_id};
use kvx_rdma::tcp::wire::{self, HELLO_LEN, Hello};
use kvx_rdma::{
    MooncakeConfig, MooncakeTransport, SharedSecret, TcpConfig, TcpTransport, Transport,
    TransportError,
};

const FLOOD: usize = 5000;
/// Threads a server may add beyond its connection cap (runtime, blocking pool, test).
const SLACK: usize = 48;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Raises the soft open-files limit to the hard one; false when that is below `need`.
fn raise_nofile(need: u64) -> bool {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return false;
        }
        lim.rlim_cur = lim.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            return false;
        }
    }
    lim.rlim_cur >= need
}

struct Buf(Vec<u8>);

impl Buf {
    fn register(&mut self, t: &dyn Transport) {
        // SAFETY: every buffer outlives the transports of its test (declared before them).
        unsafe { t.register(self.0.as_mut_ptr() as u64, self.0.len() as u64) }.unwrap();
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

/// One good write of `len` bytes through `client` into `dst` (registered with the target at
/// `endpoint`), bytes verified.
async fn good_write(client: &dyn Transport, endpoint: &str, src: &Buf, dst: &Buf, seed: u8) {
    let session = client.connect(endpoint).await.unwrap();
    let len = src.0.len().min(dst.0.len()) as u64;
    session
        .write_batch(vec![TransferOp::new(src.addr(), dst.addr(), len)])
        .await
        .unwrap();
    // `dst` is only read once the batch has completed.
    assert!(dst.0.iter().all(|&b| b == seed), "bytes not as sent");
}

/// `n` connections that complete a kvx hello and then stay silent (kept open).
fn tcp_hello_flood(addr: SocketAddr, n: usize) -> Vec<StdStream> {
    let hello = Hello {
        version: wire::VERSION,
        status: 0,
        param: 0,
        desc_len: 0,
    }
    .encode();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let Ok(mut s) = StdStream::connect_timeout(&addr, Duration::from_secs(2)) else {
            continue;
        };
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = s.write_all(&hello);
        let mut fixed = [0u8; HELLO_LEN];
        if s.read_exact(&mut fixed).is_ok()
            && let Ok(h) = Hello::decode(&fixed)
        {
            let mut desc = vec![0u8; h.desc_len as usize];
            let _ = s.read_exact(&mut desc);
        }
        out.push(s);
    }
    out
}

/// `n` connections that send nothing (kept open), in bursts small enough for the listen
/// backlog (a connect beyond it waits for a SYN retransmission, a second or more).
fn silent_flood(addr: SocketAddr, n: usize) -> Vec<StdStream> {
    let mut all = Vec::with_capacity(n);
    while all.len() < n {
        let burst = (n - all.len()).min(256);
        all.extend(
            (0..burst)
                .filter_map(|_| StdStream::connect_timeout(&addr, Duration::from_secs(2)).ok()),
        );
        std::thread::sleep(Duration::from_millis(40));
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_hello_flood_keeps_threads_bounded_and_serves_a_good_client() {
    if !raise_nofile(3 * FLOOD as u64 + 1000) {
        eprintln!(
            "skipped: RLIMIT_NOFILE cannot be raised to {}",
            3 * FLOOD + 1000
        );
        return;
    }
    let cap = TcpConfig::default().max_connections;
    let mut dst = Buf(vec![0u8; 1 << 20]);
    let mut src = Buf(vec![0x3C; 1 << 20]);
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    dst.register(&*server);
    let base = threads();
    let addr: SocketAddr = kvx_rdma::instance::address(&server.endpoint())
        .parse()
        .unwrap();
    let flood = tokio::task::spawn_blocking(move || tcp_hello_flood(addr, FLOOD))
        .await
        .unwrap();
    assert!(flood.len() > FLOOD / 2, "the flood itself failed");
    let t = threads();
    assert!(
        t <= base + cap + SLACK,
        "{t} threads after {FLOOD} silent hellos (base {base}, cap {cap})"
    );
    assert!(server.inbound_connections() <= cap);

    // A good client after the flood, then while a second flood runs.
    let client = TcpTransport::client(TcpConfig {
        connections: 1,
        ..TcpConfig::default()
    });
    src.register(&*client);
    good_write(&*client, &server.endpoint(), &src, &dst, 0x3C).await;
    let second = std::thread::spawn(move || tcp_hello_flood(addr, FLOOD / 2));
    for i in 0..20u8 {
        src.0.fill(i);
        good_write(&*client, &server.endpoint(), &src, &dst, i).await;
    }
    let second = second.join().unwrap();
    let t = threads();
    assert!(
        t <= base + cap + SLACK,
        "{t} threads after the second flood"
    );
    drop((flood, second));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_data_port_flood_keeps_threads_bounded_and_serves_a_good_client() {
    if !raise_nofile(3 * FLOOD as u64 + 1000) {
        eprintln!(
            "skipped: RLIMIT_NOFILE cannot be raised to {}",
            3 * FLOOD + 1000
        );
        return;
    }
    let cap = MooncakeConfig::default().max_data_connections;
    let mut dst = Buf(vec![0u8; 1 << 20]);
    let mut src = Buf(vec![0x6D; 1 << 20]);
    let target = MooncakeTransport::bind("127.0.0.1", MooncakeConfig::default())
        .await
        .unwrap();
    dst.register(&*target);
    let base = threads();
    let addr: SocketAddr = format!("127.0.0.1:{}", target.data_port()).parse().unwrap();
    let flood = tokio::task::spawn_blocking(move || silent_flood(addr, FLOOD))
        .await
        .unwrap();
    assert!(flood.len() > FLOOD / 2, "the flood itself failed");
    // Let the target take in the whole flood before counting.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while target.inbound_connections() < cap && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t = threads();
    assert!(
        t <= base + cap + SLACK,
        "{t} threads after {FLOOD} silent data connections (base {base}, cap {cap})"
    );
    assert!(target.inbound_connections() <= cap);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    good_write(&*client, &target.endpoint(), &src, &dst, 0x6D).await;
    drop(flood);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_handshake_port_flood_keeps_threads_bounded_and_serves_a_good_client() {
    if !raise_nofile(3 * FLOOD as u64 + 1000) {
        eprintln!(
            "skipped: RLIMIT_NOFILE cannot be raised to {}",
            3 * FLOOD + 1000
        );
        return;
    }
    let mut dst = Buf(vec![0u8; 1 << 20]);
    let mut src = Buf(vec![0x4B; 1 << 20]);
    let target = MooncakeTransport::bind("127.0.0.1", MooncakeConfig::default())
        .await
        .unwrap();
    dst.register(&*target);
    let base = threads();
    let port = split_session_id(&target.endpoint()).unwrap().1;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let flood = tokio::task::spawn_blocking(move || silent_flood(addr, FLOOD))
        .await
        .unwrap();
    assert!(flood.len() > FLOOD / 2, "the flood itself failed");
    let t = threads();
    assert!(
        t <= base + SLACK,
        "{t} threads after {FLOOD} silent handshakes"
    );
    // The silent peers are still connected; a real request gets its answer.
    let d = fetch_descriptor(&target.endpoint(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(d.buffers.len(), 1);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    good_write(&*client, &target.endpoint(), &src, &dst, 0x4B).await;
    drop(flood);
}

/// Sends a raw hello with `desc_len` and `secret`; returns the reply's status, or `None` when
/// the server closed without replying.
fn raw_hello(endpoint: &str, desc_len: u32, secret: &[u8]) -> Option<u16> {
    let mut s = StdStream::connect(kvx_rdma::instance::address(endpoint)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Hello {
        version: wire::VERSION,
        status: 0,
        param: secret.len() as u32,
        desc_len,
    };
    let _ = s.write_all(&hello.encode());
    let _ = s.write_all(secret);
    let mut fixed = [0u8; HELLO_LEN];
    s.read_exact(&mut fixed).ok()?;
    let h = Hello::decode(&fixed).unwrap();
    if h.status != wire::HELLO_OK {
        assert_eq!(h.desc_len, 0, "a refused hello got a descriptor");
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "not closed");
    }
    Some(h.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_hellos_are_closed_without_reply() {
    let server = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    let ep = server.endpoint();
    let ep2 = ep.clone();
    tokio::task::spawn_blocking(move || {
        // A descriptor above the 64 KiB a sender's hello may carry: closed before it is read.
        assert_eq!(raw_hello(&ep2, wire::MAX_SENDER_DESC_LEN + 1, &[]), None);
        // A secret longer than any secret: closed.
        let mut s = StdStream::connect(kvx_rdma::instance::address(&ep2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let h = Hello {
            version: wire::VERSION,
            status: 0,
            param: wire::MAX_SECRET_LEN + 1,
            desc_len: 0,
        };
        s.write_all(&h.encode()).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
        // Still serving.
        assert_eq!(raw_hello(&ep2, 0, &[]), Some(wire::HELLO_OK));
    })
    .await
    .unwrap();
    let mut dst = Buf(vec![0u8; 4096]);
    let mut src = Buf(vec![9u8; 4096]);
    dst.register(&*server);
    let client = TcpTransport::client(TcpConfig::default());
    src.register(&*client);
    good_write(&*client, &ep, &src, &dst, 9).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_secret_is_required_when_configured() {
    let secret = SharedSecret::new(b"correct horse").unwrap();
    assert!(SharedSecret::new(b"").is_none());
    assert!(SharedSecret::new([0u8; 257]).is_none());
    assert!(!format!("{secret:?}").contains("horse"));
    let server = TcpTransport::bind(
        "127.0.0.1:0",
        TcpConfig {
            secret: Some(secret.clone()),
            ..TcpConfig::default()
        },
    )
    .await
    .unwrap();
    let mut dst = Buf(vec![0u8; 4096]);
    dst.register(&*server);
    let ep = server.endpoint();

    // Raw peers: no secret, a wrong one, a prefix of the right one: status 2, no descriptor.
    let ep2 = ep.clone();
    tokio::task::spawn_blocking(move || {
        assert_eq!(raw_hello(&ep2, 0, b""), Some(wire::HELLO_BAD_SECRET));
        assert_eq!(
            raw_hello(&ep2, 0, b"wrong horse!!"),
            Some(wire::HELLO_BAD_SECRET)
        );
        assert_eq!(raw_hello(&ep2, 0, b"correct"), Some(wire::HELLO_BAD_SECRET));
        assert_eq!(raw_hello(&ep2, 0, b"correct horse"), Some(wire::HELLO_OK));
    })
    .await
    .unwrap();

    // kvx clients: without a secret or with a wrong one, a handshake error; with it, bytes.
    for bad in [None, SharedSecret::new(b"wrong horse!!")] {
        let client = TcpTransport::client(TcpConfig {
            secret: bad,
            ..TcpConfig::default()
        });
        let r = client.open_session(&ep).await;
        assert!(
            matches!(&r, Err(TransportError::Handshake { detail, .. }) if detail.contains("secret")),
            "{:?}",
            r.err()
        );
    }
    let mut src = Buf(vec![5u8; 4096]);
    let client = TcpTransport::client(TcpConfig {
        secret: Some(secret),
        ..TcpConfig::default()
    });
    src.register(&*client);
    good_write(&*client, &ep, &src, &dst, 5).await;

    // A receiver without a secret accepts a sender that sends one.
    let open = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    let mut dst2 = Buf(vec![0u8; 4096]);
    dst2.register(&*open);
    good_write(&*client, &open.endpoint(), &src, &dst2, 5).await;
    let _ = Arc::clone(&server);
}
