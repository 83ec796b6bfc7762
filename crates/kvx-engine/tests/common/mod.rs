//! Helpers the engine tests share: free ports, a hang guard, a bootstrap server with a tiny
//! prefill rank registered.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};
use kvx_core::{DecodeRegistration, Destination, Endpoint, Room, SessionId, TransferRequest};
use kvx_engine::model::KvLayout;

/// A port free on loopback right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `f` every 50 ms until it holds; panics naming `what` after `guard`.
pub fn wait_until(guard: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < guard, "hang guard: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A decode's data port that takes every connection and answers nothing (a handshake towards it
/// hangs until the sender's connect timeout): it counts the connections and holds them.
pub struct SilentPort {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections taken so far.
    pub accepted: Arc<AtomicUsize>,
    /// The connections, open until cleared (or the port dropped).
    pub held: Arc<Mutex<Vec<TcpStream>>>,
}

impl SilentPort {
    /// Binds a loopback port and starts taking connections.
    pub fn start() -> SilentPort {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (a, h) = (accepted.clone(), held.clone());
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                a.fetch_add(1, Ordering::SeqCst);
                h.lock().unwrap().push(s);
            }
        });
        SilentPort {
            addr,
            accepted,
            held,
        }
    }

    /// Connections taken so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// A prefill rank of `layout` on kvx's `tcp` data plane (one connect per session open, no
/// probe as `auto` makes) with `queues` transfer queues and one connection per session.
pub fn tcp_prefill_config(layout: &KvLayout, queues: usize) -> kvx_engine::engine::PrefillConfig {
    kvx_engine::engine::PrefillConfig {
        queues,
        connections: 1,
        backend: kvx_engine::plane::Backend::Tcp,
        total_kv_heads: layout.total_kv_heads,
        ..kvx_engine::engine::PrefillConfig::default()
    }
}

/// A bootstrap server on a free loopback port, and the port.
pub fn bootstrap_server(rt: &tokio::runtime::Runtime) -> (BootstrapServer, u16) {
    let server = rt
        .block_on(BootstrapServer::bind(
            ("127.0.0.1", 0),
            ServerConfig::default(),
        ))
        .unwrap();
    let port = server.local_addr().port();
    (server, port)
}

/// Registers rank 0 of a TP1 instance (page size 16) whose inbox is on `inbox_port` with the
/// bootstrap server on `port`.
pub fn register_tiny_rank(rt: &tokio::runtime::Runtime, port: u16, inbox_port: u16) {
    let reg = kvx_engine::engine::rank_registration((1, 0), 16, "auto", "127.0.0.1", inbox_port);
    let client = BootstrapClient::new("127.0.0.1", port).unwrap();
    rt.block_on(client.register_rank(&reg, &RetryPolicy::immediate(3, Duration::from_secs(5))))
        .unwrap();
}

/// A TP1 decode's registration with inbox `me` and data session `session`, its KV pool at a
/// made-up address in `layout`'s shape.
pub fn decode_registration(
    layout: &KvLayout,
    me: &Endpoint,
    session: &SessionId,
) -> DecodeRegistration {
    let base = 0x4000_0000u64;
    DecodeRegistration::plain(
        me.clone(),
        session.clone(),
        layout.kv_ptrs(base),
        layout.aux_ptrs(base + layout.pool_bytes()),
        layout.item_len,
    )
}

/// That decode's metadata for `room`: `kv_pages` into aux row `aux_index`.
pub fn decode_metadata(
    room: Room,
    me: &Endpoint,
    session: &SessionId,
    kv_pages: Vec<i32>,
    aux_index: i64,
) -> TransferRequest {
    TransferRequest {
        room,
        endpoint: me.clone(),
        session: session.clone(),
        dst: Some(Destination {
            kv_pages,
            aux_index,
            state_indices: vec![],
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: vec![],
    }
}

/// A stand-in decode's control plane toward one prefill rank: a real PULL inbox on loopback
/// (100 ms receive timeout) and a PUSH to the rank's inbox; `register` sends its registration.
pub struct FakeDecodeInbox {
    /// The decode's inbox.
    pub inbox: kvx_bootstrap::sockets::zmq::Socket,
    /// Toward the prefill rank.
    pub push: kvx_bootstrap::sockets::zmq::Socket,
    /// The inbox's endpoint.
    pub me: Endpoint,
}

impl FakeDecodeInbox {
    /// Binds the inbox and connects toward `prefill`.
    pub fn new(ctx: &kvx_bootstrap::sockets::zmq::Context, prefill: &Endpoint) -> Self {
        use kvx_bootstrap::sockets::zmq;
        let inbox = ctx.socket(zmq::PULL).unwrap();
        inbox.set_rcvtimeo(100).unwrap();
        inbox.bind("tcp://127.0.0.1:*").unwrap();
        let bound = inbox.get_last_endpoint().unwrap().unwrap();
        let port: u16 = bound.rsplit(':').next().unwrap().parse().unwrap();
        let push = ctx.socket(zmq::PUSH).unwrap();
        push.set_linger(0).unwrap();
        push.connect(&prefill.zmq_addr()).unwrap();
        FakeDecodeInbox {
            inbox,
            push,
            me: Endpoint::new("127.0.0.1", port),
        }
    }

    /// Sends `frames` to the prefill rank.
    pub fn send(&self, frames: Vec<Vec<u8>>) {
        self.push.send_multipart(frames, 0).unwrap();
    }
}
