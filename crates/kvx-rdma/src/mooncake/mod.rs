//! The `mooncake` backend: Mooncake Transfer Engine's P2P handshake and TCP transport, wire
//! compatible with the real engine (`mooncake-transfer-engine` 0.3.x), as initiator and target.
//!
//! A target listens on two ports: the handshake (RPC) port, whose `host:port` is the session id
//! a decode publishes, and the data port, which the handshake's descriptor names. An initiator
//! fetches the descriptor once per session, opens `connections` data connections and sends
//! 24-byte request headers followed by payloads straight from registered memory; protocol v2
//! targets acknowledge each write with a status frame, v1 targets get a trailing READ as a
//! fence. Everything a peer sends is checked before it is used. Wire format and behaviour:
//! `docs/mooncake-transport.md`. The layers: [`handshake`], [`descriptor`] and [`wire`] are sans
//! I/O; `fetch` is the initiator's metadata exchange, `client` its sessions and `conn` their
//! data connections; `server` is the target's handshake server and `data` its data server.
//!
//! ```
//! use kvx_core::TransferOp;
//! use kvx_rdma::{MooncakeConfig, MooncakeTransport, Transport};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let rt = tokio::runtime::Runtime::new()?;
//! let mut kv = vec![0u8; 4096];
//! let mut pages = vec![7u8; 4096];
//! rt.block_on(async {
//!     let decode = MooncakeTransport::bind("127.0.0.1", MooncakeConfig::default()).await?;
//!     let prefill = MooncakeTransport::client(MooncakeConfig::default());
//!     // SAFETY: both buffers outlive the transports (dropped at the end of this block).
//!     unsafe {
//!         decode.register(kv.as_mut_ptr() as u64, 4096)?;
//!         prefill.register(pages.as_mut_ptr() as u64, 4096)?;
//!     }
//!     let session = prefill.connect(&decode.endpoint()).await?;
//!     let op = TransferOp::new(pages.as_ptr() as u64, kv.as_ptr() as u64 + 100, 200);
//!     session.write_batch(vec![op]).await?;
//!     Ok::<_, kvx_rdma::TransportError>(())
//! })?;
//! assert_eq!(&kv[100..300], &[7u8; 200][..]);
//! # Ok(())
//! # }
//! ```

mod client;
mod conn;
mod data;
pub mod descriptor;
mod fetch;
pub mod handshake;
mod server;
pub mod wire;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use client::MooncakeSession;
pub use descriptor::{MooncakeBuffer, MooncakeDescriptor, MooncakeDescriptorError};
pub use fetch::{fetch_descriptor, probe};
pub use server::ServeError;

use crate::error::TransportError;
use crate::mem::RegionTable;
use crate::segment::{RegionKey, SegmentDescriptor};
use crate::session_cache::SessionCache;
use crate::transport::{BoxFuture, Session, Transport};

/// Tuning and limits of the mooncake backend.
#[derive(Clone, Debug)]
pub struct MooncakeConfig {
    /// Data connections per session (Mooncake itself uses 4 lanes per peer).
    pub connections: usize,
    /// Ops longer than this are split into several requests (each with its own header).
    pub slice_bytes: u64,
    /// Bytes per request group: one vectored send, one "has the batch failed?" check.
    pub group_bytes: u64,
    /// Requests per group at most.
    pub group_requests: usize,
    /// Unacknowledged bytes per connection at most (a group larger than this goes alone).
    pub max_inflight_bytes: u64,
    /// Unacknowledged requests per connection at most.
    pub max_inflight_requests: usize,
    /// Groups queued per connection before posting waits (backpressure).
    pub queue_depth: usize,
    /// A connection with requests in flight and no reply for this long fails (silent peer).
    pub status_timeout: Duration,
    /// Bound on the metadata exchange and on each data connect.
    pub connect_timeout: Duration,
    /// Target: how long a handshake peer may take to send its request.
    pub handshake_timeout: Duration,
    /// Target: handshake connections served at once; a newer one closes the oldest still
    /// being served (no thread is used for them).
    pub max_handshake_connections: usize,
    /// Target: data connections (receive threads) at once. A connection beyond that closes an
    /// idle one (first one that never sent a request, else the longest idle) or, when every
    /// one is inside a request, is closed at once.
    pub max_data_connections: usize,
    /// Target: host written into the session id and `tcp_data_host` instead of the bound one.
    pub advertise_host: Option<String>,
    /// Target: handshake port to bind (0 = any free port).
    pub rpc_port: u16,
    /// Target: data port to bind (0 = any free port).
    pub data_port: u16,
    /// Initiator: speak protocol v1 (fence READs) even to v2 targets, like `MC_TCP_PROTO=1`.
    pub force_v1: bool,
    /// `SO_SNDBUF`/`SO_RCVBUF` for data connections; `None` keeps the kernel's autotuning.
    pub socket_buffer: Option<usize>,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        MooncakeConfig {
            connections: 4,
            slice_bytes: 4 << 20,
            group_bytes: 8 << 20,
            group_requests: 1024,
            max_inflight_bytes: 32 << 20,
            max_inflight_requests: 4096,
            queue_depth: 4,
            status_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            max_handshake_connections: 64,
            max_data_connections: 1024,
            advertise_host: None,
            rpc_port: 0,
            data_port: 0,
            force_v1: false,
            socket_buffer: None,
        }
    }
}

/// `host` without the brackets of a bracketed IPv6 literal.
pub fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// A session id (`host:port`), IPv6 literals in brackets, as Mooncake names segments.
pub fn session_id(host: &str, port: u16) -> String {
    let h = unbracket(host);
    if h.contains(':') {
        format!("[{h}]:{port}")
    } else {
        format!("{h}:{port}")
    }
}

/// Splits a session id into host (brackets kept off) and port, as Mooncake does: a bracketed
/// IPv6 literal, else the last `:`; a name without a port means Mooncake's default handshake
/// port 12001.
pub fn split_session_id(id: &str) -> Result<(String, u16), String> {
    let port = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("bad port {p:?} in session id {id:?}"))
    };
    if let Some(rest) = id.strip_prefix('[') {
        let (host, tail) = rest
            .split_once(']')
            .ok_or_else(|| format!("unclosed bracket in session id {id:?}"))?;
        return match tail.strip_prefix(':') {
            Some(p) => Ok((host.to_owned(), port(p)?)),
            None if tail.is_empty() => Ok((host.to_owned(), 12001)),
            None => Err(format!("bad session id {id:?}")),
        };
    }
    let (host, p) = match id.rsplit_once(':') {
        Some((h, p)) => (h, port(p)?),
        None => (id, 12001),
    };
    if host.is_empty() {
        return Err(format!("no host in session id {id:?}"));
    }
    Ok((host.to_owned(), p))
}

struct Server {
    ctx: Arc<server::ServerCtx>,
    tasks: Mutex<Vec<(JoinHandle<()>, oneshot::Sender<()>)>>,
}

struct Inner {
    cfg: MooncakeConfig,
    table: Arc<RegionTable>,
    endpoint: String,
    sessions: SessionCache<MooncakeSession>,
    server: Option<Server>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(s) = &self.server {
            for (h, _) in lock(&s.tasks).drain(..) {
                h.abort();
            }
            // Receive threads must not outlive the transport (its regions may be freed next).
            s.ctx.close_all();
        }
    }
}

/// The mooncake transport: a Mooncake TE compatible target ([`MooncakeTransport::bind`]) and
/// initiator, or an initiator only ([`MooncakeTransport::client`]).
pub struct MooncakeTransport {
    inner: Inner,
}

impl MooncakeTransport {
    /// Binds a handshake port and a data port on `host` (ports from `cfg`, 0 = any) and serves
    /// peers' writes into this side's registered regions. The endpoint (session id) is
    /// `host:rpc_port` with `cfg.advertise_host` in place of `host` when set. Must be called
    /// inside a tokio runtime.
    pub async fn bind(host: &str, cfg: MooncakeConfig) -> Result<Arc<Self>, TransportError> {
        let bind_host = unbracket(host);
        let hs = TcpListener::bind((bind_host, cfg.rpc_port)).await?;
        let data = TcpListener::bind((bind_host, cfg.data_port)).await?;
        let rpc_port = hs.local_addr()?.port();
        let data_port = data.local_addr()?.port();
        let adv = cfg.advertise_host.as_deref().map_or(bind_host, unbracket);
        let endpoint = session_id(adv, rpc_port);
        let table = Arc::new(RegionTable::new());
        let limits = server::Limits {
            handshake_timeout: cfg.handshake_timeout,
            max_handshake_connections: cfg.max_handshake_connections,
            max_data_connections: cfg.max_data_connections,
            socket_buffer: cfg.socket_buffer,
        };
        let ctx = Arc::new(server::ServerCtx::new(
            table.clone(),
            endpoint.clone(),
            adv.to_owned(),
            data_port,
            limits,
        ));
        let (hs_stop, hs_stopped) = oneshot::channel();
        let (data_stop, data_stopped) = oneshot::channel();
        let tasks = vec![
            (
                tokio::spawn(server::handshake_loop(hs, ctx.clone(), hs_stopped)),
                hs_stop,
            ),
            (
                tokio::spawn(data::data_loop(data, ctx.clone(), data_stopped)),
                data_stop,
            ),
        ];
        tracing::info!(%endpoint, data_port, "mooncake transport listening");
        Ok(Arc::new(MooncakeTransport {
            inner: Inner {
                cfg,
                table,
                endpoint,
                sessions: SessionCache::new(),
                server: Some(Server {
                    ctx,
                    tasks: Mutex::new(tasks),
                }),
            },
        }))
    }

    /// An initiator only (no listeners; its endpoint is empty).
    pub fn client(cfg: MooncakeConfig) -> Arc<Self> {
        Arc::new(MooncakeTransport {
            inner: Inner {
                cfg,
                table: Arc::new(RegionTable::new()),
                endpoint: String::new(),
                sessions: SessionCache::new(),
                server: None,
            },
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MooncakeConfig {
        &self.inner.cfg
    }

    /// The data port (0 for an initiator only).
    pub fn data_port(&self) -> u16 {
        self.inner.server.as_ref().map_or(0, |s| s.ctx.data_port)
    }

    /// The descriptor a Metadata request gets right now (`None` for an initiator only).
    pub fn mooncake_descriptor(&self) -> Option<MooncakeDescriptor> {
        self.inner.server.as_ref().map(|s| s.ctx.descriptor())
    }

    /// Inbound data connections open right now.
    pub fn inbound_connections(&self) -> usize {
        self.inner
            .server
            .as_ref()
            .map_or(0, |s| s.ctx.data_connections())
    }

    /// Stops serving: closes both listeners and every inbound connection, and returns once
    /// every receive thread has ended.
    pub async fn shutdown(&self) {
        let Some(s) = &self.inner.server else {
            return;
        };
        let tasks: Vec<_> = lock(&s.tasks).drain(..).collect();
        for (h, stop) in tasks {
            let _ = stop.send(());
            let _ = h.await;
        }
        let ctx = s.ctx.clone();
        if tokio::task::spawn_blocking(move || ctx.close_all())
            .await
            .is_err()
        {
            s.ctx.close_all();
        }
    }

    /// Opens a fresh session to the target whose session id is `peer` (not cached).
    pub async fn open_session(&self, peer: &str) -> Result<MooncakeSession, TransportError> {
        let cfg = &self.inner.cfg;
        let desc = fetch_descriptor(peer, cfg.connect_timeout).await?;
        let host = match &desc.tcp_data_host {
            Some(h) => h.clone(),
            None => {
                split_session_id(peer)
                    .map_err(|detail| TransportError::PeerUnreachable {
                        peer: peer.to_owned(),
                        detail,
                    })?
                    .0
            }
        };
        let unreachable = |detail: String| TransportError::PeerUnreachable {
            peer: peer.to_owned(),
            detail: format!("data port {host}:{}: {detail}", desc.tcp_data_port),
        };
        let mut streams = Vec::with_capacity(cfg.connections.max(1));
        for _ in 0..cfg.connections.max(1) {
            let connect = TcpStream::connect((unbracket(&host), desc.tcp_data_port));
            let s = tokio::time::timeout(cfg.connect_timeout, connect)
                .await
                .map_err(|_| unreachable("connect timed out".into()))?
                .map_err(|e| unreachable(e.to_string()))?;
            s.set_nodelay(true)
                .map_err(|e| unreachable(e.to_string()))?;
            let sock = socket2::SockRef::from(&s);
            let ka = socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(5))
                .with_interval(Duration::from_secs(1))
                .with_retries(3);
            let _ = sock.set_tcp_keepalive(&ka);
            if let Some(n) = cfg.socket_buffer {
                let _ = sock.set_send_buffer_size(n);
                let _ = sock.set_recv_buffer_size(n);
            }
            let s = s
                .into_std()
                .and_then(|s| s.set_nonblocking(false).map(|()| s))?;
            streams.push(s);
        }
        tracing::debug!(%peer, v2 = desc.is_v2(), buffers = desc.buffers.len(),
            "mooncake session open");
        Ok(MooncakeSession::start(
            peer.to_owned(),
            desc,
            self.inner.table.clone(),
            streams,
            cfg.clone(),
        ))
    }
}

impl Transport for MooncakeTransport {
    fn kind(&self) -> &'static str {
        "mooncake"
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        self.inner.table.insert(addr, len)
    }

    /// Forgets a region; returns once no receive thread reads into or sends from it (a
    /// connection doing so right now is shut down).
    fn deregister(&self, key: RegionKey) -> Result<(), TransportError> {
        self.inner.table.deregister(key).map(|_| ())
    }

    fn descriptor(&self) -> SegmentDescriptor {
        self.inner.table.descriptor(&self.inner.endpoint)
    }

    fn endpoint(&self) -> String {
        self.inner.endpoint.clone()
    }

    fn bytes_received(&self) -> Option<u64> {
        Some(self.inner.table.received())
    }

    fn connect<'a>(
        &'a self,
        peer: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Session>, TransportError>> {
        Box::pin(
            self.inner
                .sessions
                .get_or_open(peer, || self.open_session(peer)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids() {
        assert_eq!(session_id("127.0.0.1", 15066), "127.0.0.1:15066");
        assert_eq!(session_id("::1", 5), "[::1]:5");
        assert_eq!(session_id("[::1]", 5), "[::1]:5");
        assert_eq!(
            split_session_id("127.0.0.1:15066"),
            Ok(("127.0.0.1".into(), 15066))
        );
        assert_eq!(split_session_id("[::1]:7"), Ok(("::1".into(), 7)));
        assert_eq!(split_session_id("[fe80::1]"), Ok(("fe80::1".into(), 12001)));
        assert_eq!(split_session_id("host"), Ok(("host".into(), 12001)));
        assert!(split_session_id("host:0").is_err());
        assert!(split_session_id("host:x").is_err());
        assert!(split_session_id(":80").is_err());
        assert!(split_session_id("[::1").is_err());
        assert!(split_session_id("[::1]x").is_err());
        assert_eq!(unbracket("[::1]"), "::1");
    }
}
