//! The mooncake target's two ports under malformed and hostile input from raw sockets: every
//! bad request is dropped without touching memory outside the addressed region (registered
//! memory stays as it was, guard bytes around it intact), and both ports keep serving; plus
//! concurrency of the handshake port, the data-connection limit, shutdown and drop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod mc_fake;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::mooncake::handshake::{
    self, CONNECTION_REPLY, NOTIFY_REPLY, PROBE_REPLY, RequestType,
};
use kvx_rdma::mooncake::wire::{Header, Status};
use kvx_rdma::mooncake::{MooncakeDescriptor, fetch_descriptor, probe, split_session_id};
use kvx_rdma::{MooncakeConfig, MooncakeTransport, Transport};
use mc_fake::Buf;

const GUARD: usize = 4096;
const REGION: usize = 4096;

fn cfg() -> MooncakeConfig {
    MooncakeConfig {
        handshake_timeout: Duration::from_millis(800),
        ..MooncakeConfig::default()
    }
}

fn port_of(t: &MooncakeTransport) -> u16 {
    split_session_id(&t.endpoint()).unwrap().1
}

fn raw(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Everything the peer sends until it closes (a reset counts as closed).
fn drain(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return out,
            Err(e) => panic!("peer neither answered nor closed: {e}"),
        }
    }
}

/// Sends `bytes` on a fresh handshake connection and returns everything sent back.
fn hs(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut s = raw(port);
    let _ = s.write_all(bytes);
    drain(&mut s)
}

async fn still_serves(t: &MooncakeTransport) {
    let d = fetch_descriptor(&t.endpoint(), Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(d.name, t.endpoint());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_port_drops_bad_frames_and_answers_good_ones() {
    let t = MooncakeTransport::bind("127.0.0.1", cfg()).await.unwrap();
    let port = port_of(&t);
    let bad: Vec<(&str, Vec<u8>)> = vec![
        ("huge length", (2u64 << 20).to_le_bytes().to_vec()),
        ("u64::MAX length", u64::MAX.to_le_bytes().to_vec()),
        ("zero length", 0u64.to_le_bytes().to_vec()),
        (
            "bad JSON",
            handshake::encode_frame(Some(RequestType::Metadata), b"{nope"),
        ),
        ("unknown type", {
            let mut f = 3u64.to_le_bytes().to_vec();
            f.extend_from_slice(&[0x90, b'{', b'}']);
            f
        }),
        ("truncated body", {
            let mut f = 100u64.to_le_bytes().to_vec();
            f.extend_from_slice(&[1, b'{', b'}']);
            f
        }),
        ("truncated prefix", vec![5, 0, 0]),
    ];
    for (what, frame) in &bad {
        let mut s = raw(port);
        s.write_all(frame).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        assert!(drain(&mut s).is_empty(), "{what}: got a reply");
        still_serves(&t).await;
    }
    // A truncated frame from a peer that keeps the socket open: closed after the timeout.
    let mut s = raw(port);
    s.write_all(&[40, 0, 0, 0, 0, 0, 0, 0, 1]).unwrap();
    let t0 = Instant::now();
    assert!(drain(&mut s).is_empty());
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());

    // The good ones, each echoing its type.
    let reply = |kind: Option<RequestType>, json: &[u8]| {
        let r = hs(port, &handshake::encode_frame(kind, json));
        let (f, n) = handshake::decode_frame(&r).unwrap();
        assert_eq!(n, r.len());
        (f.kind, String::from_utf8(f.json.to_vec()).unwrap())
    };
    assert_eq!(
        reply(Some(RequestType::Probe), b"{}"),
        (Some(RequestType::Probe), PROBE_REPLY.to_owned())
    );
    assert_eq!(
        reply(
            Some(RequestType::Notify),
            br#"{"name":"x","notify_msg":"hi"}"#
        ),
        (Some(RequestType::Notify), NOTIFY_REPLY.to_owned())
    );
    assert_eq!(
        reply(
            Some(RequestType::Connection),
            br#"{"local_nic_path":"a@b"}"#
        ),
        (Some(RequestType::Connection), CONNECTION_REPLY.to_owned())
    );
    // An old-protocol frame (JSON only): a Connection request, answered without a type byte.
    assert_eq!(
        reply(None, br#"{"local_nic_path":"a@b"}"#),
        (None, CONNECTION_REPLY.to_owned())
    );
    let (kind, json) = reply(Some(RequestType::Metadata), b"{}");
    assert_eq!(kind, Some(RequestType::Metadata));
    let d = MooncakeDescriptor::parse(json.as_bytes()).unwrap();
    assert_eq!(d.tcp_data_port, t.data_port());
    assert_eq!(d.tcp_proto_version, 2);
    probe(&t.endpoint(), Duration::from_secs(2)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handshake_peer_does_not_stall_others() {
    let t = MooncakeTransport::bind("127.0.0.1", cfg()).await.unwrap();
    let port = port_of(&t);
    // One peer sends half a frame and waits; another has its reply and keeps the socket open.
    let mut slow = raw(port);
    slow.write_all(&[9, 0, 0]).unwrap();
    let mut lingering = raw(port);
    lingering
        .write_all(&handshake::encode_frame(Some(RequestType::Probe), b"{}"))
        .unwrap();
    let mut got = [0u8; 9];
    lingering.read_exact(&mut got).unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        still_serves(&t).await;
    }
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "other peers waited {:?}",
        t0.elapsed()
    );
    // The slow one is dropped after the timeout.
    assert!(drain(&mut slow).is_empty());
}

/// A kvx target with two adjacent regions between guard areas of 0xEE bytes.
struct Guarded {
    t: Arc<MooncakeTransport>,
    mem: Buf,
}

impl Guarded {
    async fn new(cfg: MooncakeConfig) -> Guarded {
        let mut mem = Buf::filled(GUARD + 2 * REGION + GUARD, 0xEE);
        mem.0[GUARD..GUARD + 2 * REGION].fill(0);
        let t = MooncakeTransport::bind("127.0.0.1", cfg).await.unwrap();
        mem.register_range(&*t, GUARD, REGION);
        mem.register_range(&*t, GUARD + REGION, REGION);
        Guarded { t, mem }
    }
    fn r1(&self) -> u64 {
        self.mem.addr() + GUARD as u64
    }
    fn data(&self) -> TcpStream {
        raw(self.t.data_port())
    }
    fn guards_intact(&self) -> bool {
        let m = &self.mem.0;
        m[..GUARD]
            .iter()
            .chain(&m[GUARD + 2 * REGION..])
            .all(|&b| b == 0xEE)
    }
    fn regions(&self) -> &[u8] {
        &self.mem.0[GUARD..GUARD + 2 * REGION]
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_port_rejects_bad_headers_before_any_byte() {
    let g = Guarded::new(cfg()).await;
    let (r1, r2) = (g.r1(), g.r1() + REGION as u64);
    let reject = Status::Rejected(1).encode().to_vec();
    let cases: Vec<(&str, Header, bool)> = vec![
        (
            "guard before",
            Header::write(g.mem.addr() + 16, 64, true),
            true,
        ),
        (
            "guard after",
            Header::write(r2 + REGION as u64, 64, true),
            true,
        ),
        (
            "straddles the end",
            Header::write(r2 + REGION as u64 - 8, 64, true),
            true,
        ),
        (
            "straddles the seam of adjacent regions",
            Header::write(r2 - 8, 64, true),
            true,
        ),
        ("zero size", Header::write(r1, 0, true), true),
        ("wraps", Header::write(u64::MAX - 10, 100, true), true),
        ("huge", Header::write(r1, 1 << 40, true), true),
        ("v1 outside", Header::write(g.mem.addr(), 64, false), false),
        (
            "v2 read outside",
            Header::read(g.mem.addr(), 64, true),
            true,
        ),
        (
            "v1 read outside",
            Header::read(g.mem.addr(), 64, false),
            false,
        ),
    ];
    for (what, h, v2) in cases {
        let mut s = g.data();
        s.write_all(&h.encode()).unwrap();
        // Payload bytes that must not land anywhere.
        let _ = s.write_all(&[0xAB; 64]);
        let got = drain(&mut s);
        assert_eq!(got, if v2 { reject.clone() } else { Vec::new() }, "{what}");
        assert!(g.guards_intact(), "{what}: guard bytes changed");
        assert!(
            g.regions().iter().all(|&b| b == 0),
            "{what}: region changed"
        );
    }
    // Truncated header, then truncated payload: the connection is dropped; only the bytes that
    // came (inside the validated range) landed.
    let mut s = g.data();
    s.write_all(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(drain(&mut s).is_empty());
    let mut s = g.data();
    s.write_all(&Header::write(r1, 1000, true).encode())
        .unwrap();
    s.write_all(&[0x11; 10]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(drain(&mut s).is_empty());
    assert!(g.guards_intact());
    assert!(g.regions()[10..].iter().all(|&b| b == 0));
    let landed = g.regions()[..10].to_vec();

    // The port keeps serving: v1 and v2 writes and reads on one connection.
    let mut s = g.data();
    s.write_all(&Header::write(r1 + 100, 5, false).encode())
        .unwrap();
    s.write_all(b"hello").unwrap();
    s.write_all(&Header::write(r2, 3, true).encode()).unwrap();
    s.write_all(b"abc").unwrap();
    let mut ok = [0u8; 8];
    s.read_exact(&mut ok).unwrap();
    assert_eq!(Status::decode(&ok), Ok(Status::Ok));
    s.write_all(&Header::read(r1 + 100, 5, true).encode())
        .unwrap();
    let mut back = [0u8; 13];
    s.read_exact(&mut back).unwrap();
    assert_eq!(&back[..8], &Status::Ok.encode());
    assert_eq!(&back[8..], b"hello");
    // Any opcode that is not a WRITE is a READ (v1 here: bytes only).
    let mut odd = Header::read(r2, 3, false);
    odd.opcode = 0x06;
    s.write_all(&odd.encode()).unwrap();
    let mut back = [0u8; 3];
    s.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"abc");
    drop(s);
    assert_eq!(&g.regions()[..10], &landed[..]);
    assert!(g.guards_intact());

    // And a kvx initiator still writes.
    let mut src = Buf::pattern(REGION, 4);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    let session = client.connect(&g.t.endpoint()).await.unwrap();
    session
        .write_batch(vec![TransferOp::new(src.addr(), r2, REGION as u64)])
        .await
        .unwrap();
    assert_eq!(&g.regions()[REGION..], &src.0[..]);
    assert!(g.guards_intact());
    still_serves(&g.t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_connections_are_bounded() {
    let g = Guarded::new(MooncakeConfig {
        max_data_connections: 2,
        ..cfg()
    })
    .await;
    let wait_until = |n: usize| {
        let t = g.t.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            while t.inbound_connections() != n {
                assert!(Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    // `a` is inside a request (its payload half sent and landed), `b` never sends anything.
    let mut a = g.data();
    a.write_all(&Header::write(g.r1(), 8, true).encode())
        .unwrap();
    a.write_all(&[1; 4]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    // SAFETY: a volatile read of registered memory another thread writes.
    while unsafe { std::ptr::read_volatile(g.r1() as *const u8).wrapping_add(3) } != 4 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut b = g.data();
    wait_until(2).await;
    // At the cap, a newcomer closes the silent one, not the busy one, and is served.
    let mut c = g.data();
    assert!(drain(&mut b).is_empty(), "the silent connection was kept");
    c.write_all(&Header::write(g.r1() + 100, 1, true).encode())
        .unwrap();
    c.write_all(&[7]).unwrap();
    let mut ok = [0u8; 8];
    c.read_exact(&mut ok).unwrap();
    assert_eq!(Status::decode(&ok), Ok(Status::Ok));
    assert_eq!(g.t.inbound_connections(), 2);
    // The busy one finishes its request.
    a.write_all(&[1; 4]).unwrap();
    a.read_exact(&mut ok).unwrap();
    assert_eq!(Status::decode(&ok), Ok(Status::Ok));
    assert_eq!(&g.regions()[..8], &[1; 8]);
    assert_eq!(g.regions()[100], 7);
    drop((a, c));
    wait_until(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_and_drop_close_every_connection() {
    let g = Guarded::new(cfg()).await;
    let mut a = g.data();
    let mut h = raw(port_of(&g.t));
    let deadline = Instant::now() + Duration::from_secs(5);
    while g.t.inbound_connections() < 1 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    g.t.shutdown().await;
    assert_eq!(g.t.inbound_connections(), 0);
    assert!(drain(&mut a).is_empty());
    assert!(drain(&mut h).is_empty());
    assert!(TcpStream::connect(("127.0.0.1", g.t.data_port())).is_err());
    assert!(TcpStream::connect(("127.0.0.1", port_of(&g.t))).is_err());

    // Dropping the transport ends its receive threads too.
    let g = Guarded::new(cfg()).await;
    let mut a = g.data();
    let deadline = Instant::now() + Duration::from_secs(5);
    while g.t.inbound_connections() < 1 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let Guarded { t, mem } = g;
    drop(t);
    assert!(drain(&mut a).is_empty());
    drop(mem);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_waits_for_a_payload_in_progress() {
    let g = Guarded::new(cfg()).await;
    // A peer that started a big write into region 1 and stalls inside the payload.
    let mut s = g.data();
    s.write_all(&Header::write(g.r1(), REGION as u64, true).encode())
        .unwrap();
    s.write_all(&[0x22; 100]).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let key = g.t.descriptor().regions[0].key;
    let t0 = Instant::now();
    g.t.deregister(key).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Its connection was cut: the rest of the payload never lands.
    let _ = s.write_all(&[0x33; 1000]);
    assert!(drain(&mut s).is_empty());
    assert!(g.regions()[100..].iter().all(|&b| b == 0));
    assert!(g.guards_intact());
}
