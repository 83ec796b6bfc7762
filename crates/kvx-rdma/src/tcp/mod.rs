//! The `tcp` backend: kvx's own framed protocol over plain TCP (the default transport).
//!
//! [`TcpTransport::bind`] listens for peers that write into this side's registered memory;
//! [`TcpTransport::client`] only sends. Both register memory, describe themselves, and open
//! sessions ([`Transport::connect`]) that are cached per peer and replaced once broken. The wire
//! protocol is in `docs/tcp-transport.md` and [`wire`]; the receiving side in `server`, the
//! sending side in `client`.
//!
//! Teardown is safe for the registered memory: [`Transport::deregister`],
//! [`TcpTransport::shutdown`] and dropping the transport return only once no receive thread
//! writes into the memory concerned (see `crate::mem`'s leases). The receiver bounds what
//! peers can hold: hellos in progress, connections with a receive thread, hello size, and
//! optionally a [`SharedSecret`] every sender's hello must carry.

mod client;
mod io;
mod server;
pub mod wire;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use client::TcpSession;

use crate::conn_limit::ConnLimit;
use crate::error::TransportError;
use crate::instance;
use crate::mem::RegionTable;
use crate::segment::{RegionKey, SegmentDescriptor};
use crate::session_cache::SessionCache;
use crate::transport::{BoxFuture, Session, Transport};
use wire::{HELLO_BAD_SECRET, HELLO_LEN, HELLO_OK, Hello, MAX_SECRET_LEN, VERSION};

/// A shared secret for the tcp hello: a receiver configured with one serves only senders
/// whose hello carries the same bytes (others get status 2 and no descriptor, and are closed).
/// It keeps stray or unauthorized peers out of a trusted network; it is sent in clear, so it
/// is no protection against an eavesdropper. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct SharedSecret(Arc<[u8]>);

impl SharedSecret {
    /// A secret of 1 to [`MAX_SECRET_LEN`] (256) bytes; `None` otherwise.
    pub fn new(bytes: impl AsRef<[u8]>) -> Option<Self> {
        let b = bytes.as_ref();
        (!b.is_empty() && b.len() <= MAX_SECRET_LEN as usize).then(|| SharedSecret(b.into()))
    }

    /// The secret's bytes (sent in the hello).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Compares with `other` in time independent of where they differ.
    pub fn matches(&self, other: &[u8]) -> bool {
        if other.len() != self.0.len() {
            return false;
        }
        self.0
            .iter()
            .zip(other)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedSecret(<{} bytes>)", self.0.len())
    }
}

/// Tuning and limits of the tcp backend.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Connections per peer session.
    pub connections: usize,
    /// Ops longer than this are sliced into several writes.
    pub slice_bytes: usize,
    /// Bytes per acknowledged window (one fence and one ack per window).
    pub window_bytes: u64,
    /// Writes per window at most (bounds per-window header memory for tiny ops).
    pub max_writes_per_window: usize,
    /// Windows queued per connection before posting waits (backpressure).
    pub queue_depth: usize,
    /// A window not acknowledged this long after it started fails its connection (silent peer).
    pub ack_timeout: Duration,
    /// Connect (and handshake) timeout.
    pub connect_timeout: Duration,
    /// Largest single write payload this side accepts as a receiver.
    pub max_write_len: u32,
    /// Endpoint to advertise instead of the bound address (e.g. the routable IP).
    pub advertise: Option<String>,
    /// `SO_SNDBUF`/`SO_RCVBUF` for every connection; `None` keeps the kernel's autotuning.
    pub socket_buffer: Option<usize>,
    /// Receiver: connections served at once (one receive thread each). A connection beyond
    /// that closes an idle one (first one that never sent a write, else the longest idle)
    /// or, when all are busy, is refused (`kvx_tcp_conns_refused_total`).
    pub max_connections: usize,
    /// Receiver: hellos read at once; a newer connection closes the oldest one still in its
    /// hello. Each hello must arrive within `connect_timeout`.
    pub max_handshakes: usize,
    /// Both sides: the shared secret. A sender sends it in every hello; a receiver with one
    /// refuses hellos without it. `None` (default): no check, and no secret sent.
    pub secret: Option<SharedSecret>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections: 4,
            slice_bytes: 4 << 20,
            window_bytes: 16 << 20,
            max_writes_per_window: 8192,
            queue_depth: 8,
            ack_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_write_len: 16 << 20,
            advertise: None,
            socket_buffer: None,
            max_connections: 1024,
            max_handshakes: 64,
            secret: None,
        }
    }
}

struct Inner {
    cfg: TcpConfig,
    table: Arc<RegionTable>,
    endpoint: String,
    sessions: SessionCache<TcpSession>,
    server: Mutex<Option<(JoinHandle<()>, oneshot::Sender<()>)>>,
    server_ctx: Option<Arc<server::ServerCtx>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(h) = self
            .server
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            h.0.abort();
        }
        // No receive thread may write into the regions once the transport is gone (they may
        // be freed next): close every connection, then wait for writes in progress.
        if let Some(ctx) = &self.server_ctx {
            ctx.close_all();
        }
        self.table.close_receive();
    }
}

/// The tcp transport. Cheap to share (`Arc<TcpTransport>` or `Arc<dyn Transport>`).
pub struct TcpTransport {
    inner: Inner,
}

impl TcpTransport {
    /// Listens on `addr` (`host:port`, port 0 for any) and serves peers' writes into this
    /// side's registered regions. Must be called inside a tokio runtime.
    pub async fn bind(addr: &str, cfg: TcpConfig) -> Result<Arc<Self>, TransportError> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        // The endpoint names this listener's instance: a sender holding an id published before
        // a restart on the same address is refused at the handshake (`crate::instance`).
        let addr = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
        let endpoint = instance::name(instance::address(&addr), &instance::fresh());
        let table = Arc::new(RegionTable::new());
        let ctx = Arc::new(server::ServerCtx {
            table: table.clone(),
            endpoint: endpoint.clone(),
            max_write_len: cfg.max_write_len,
            handshake_timeout: cfg.connect_timeout,
            socket_buffer: cfg.socket_buffer,
            max_handshakes: cfg.max_handshakes,
            secret: cfg.secret.clone(),
            conns: ConnLimit::new(cfg.max_connections, "tcp"),
        });
        let (stop, stopped) = oneshot::channel();
        let handle = tokio::spawn(server::accept_loop(listener, ctx.clone(), stopped));
        tracing::info!(%endpoint, "tcp transport listening");
        Ok(Arc::new(TcpTransport {
            inner: Inner {
                cfg,
                table,
                endpoint,
                sessions: SessionCache::new(),
                server: Mutex::new(Some((handle, stop))),
                server_ctx: Some(ctx),
            },
        }))
    }

    /// A send-only transport (no listener; its descriptor has an empty endpoint).
    pub fn client(cfg: TcpConfig) -> Arc<Self> {
        Arc::new(TcpTransport {
            inner: Inner {
                cfg,
                table: Arc::new(RegionTable::new()),
                endpoint: String::new(),
                sessions: SessionCache::new(),
                server: Mutex::new(None),
                server_ctx: None,
            },
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TcpConfig {
        &self.inner.cfg
    }

    /// Inbound connections with a receive thread right now.
    pub fn inbound_connections(&self) -> usize {
        self.inner
            .server_ctx
            .as_ref()
            .map_or(0, |c| c.conns.count())
    }

    /// Stops serving: closes the listener and every inbound connection (peers see EOF) and
    /// returns once they are closed and no receive thread writes into registered memory any
    /// more (the regions stay registered).
    pub async fn shutdown(&self) {
        let server = self
            .inner
            .server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((handle, stop)) = server {
            let _ = stop.send(());
            let _ = handle.await;
        }
        if let Some(ctx) = &self.inner.server_ctx {
            ctx.close_all();
            let table = self.inner.table.clone();
            if tokio::task::spawn_blocking(move || table.close_receive())
                .await
                .is_err()
            {
                self.inner.table.close_receive();
            }
        }
    }

    /// Opens a fresh session (not cached).
    pub async fn open_session(&self, peer: &str) -> Result<TcpSession, TransportError> {
        let cfg = &self.inner.cfg;
        // The receiver does not use the sender's regions: the hello names the endpoint only.
        let mine = SegmentDescriptor {
            endpoint: self.inner.endpoint.clone(),
            regions: Vec::new(),
        }
        .encode();
        let mut streams = Vec::with_capacity(cfg.connections.max(1));
        let mut remote = None;
        for _ in 0..cfg.connections.max(1) {
            let (s, d) = tokio::time::timeout(cfg.connect_timeout, connect_one(peer, &mine, cfg))
                .await
                .map_err(|_| TransportError::PeerUnreachable {
                    peer: peer.to_owned(),
                    detail: "connect timed out".into(),
                })??;
            // Data phase on blocking sockets driven by the connection's own threads.
            let s = s
                .into_std()
                .and_then(|s| s.set_nonblocking(false).map(|()| s))?;
            streams.push(s);
            remote.get_or_insert(d);
        }
        let remote = remote.unwrap_or_default();
        Ok(TcpSession::start(
            peer.to_owned(),
            remote,
            self.inner.table.clone(),
            streams,
            cfg.clone(),
        ))
    }
}

async fn connect_one(
    peer: &str,
    mine: &[u8],
    cfg: &TcpConfig,
) -> Result<(TcpStream, SegmentDescriptor), TransportError> {
    let unreachable = |e: std::io::Error| TransportError::PeerUnreachable {
        peer: peer.to_owned(),
        detail: e.to_string(),
    };
    let hs = |detail: String| TransportError::Handshake {
        peer: peer.to_owned(),
        detail,
    };
    let stream = TcpStream::connect(instance::address(peer))
        .await
        .map_err(unreachable)?;
    stream.set_nodelay(true).map_err(unreachable)?;
    let sock = socket2::SockRef::from(&stream);
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    let _ = sock.set_tcp_keepalive(&ka);
    let _ = sock.set_tcp_user_timeout(Some(cfg.ack_timeout));
    if let Some(n) = cfg.socket_buffer {
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
    let secret = cfg.secret.as_ref().map_or(&[][..], SharedSecret::as_bytes);
    let hello = Hello {
        version: VERSION,
        status: 0,
        param: secret.len() as u32,
        desc_len: mine.len() as u32,
    };
    let mut out = hello.encode().to_vec();
    out.extend_from_slice(mine);
    out.extend_from_slice(secret);
    io::write_all(&stream, &out).await.map_err(unreachable)?;
    let mut fixed = [0u8; HELLO_LEN];
    io::read_full(&stream, &mut fixed)
        .await
        .map_err(|e| hs(format!("reading hello: {e}")))?;
    let reply = Hello::decode(&fixed).map_err(|e| hs(e.to_string()))?;
    if reply.status == HELLO_BAD_SECRET {
        return Err(hs(
            "peer refused the shared secret (missing or wrong)".into()
        ));
    }
    if reply.status != HELLO_OK || reply.version != VERSION {
        return Err(hs(format!(
            "peer refused: status {} version {}",
            reply.status, reply.version
        )));
    }
    let mut desc = vec![0u8; reply.desc_len as usize];
    io::read_full(&stream, &mut desc)
        .await
        .map_err(|e| hs(format!("reading descriptor: {e}")))?;
    let d = SegmentDescriptor::decode(&desc).map_err(|e| hs(e.to_string()))?;
    instance::check(peer, &d.endpoint)?;
    tracing::debug!(%peer, regions = d.regions.len(), "tcp handshake done");
    Ok((stream, d))
}

impl Transport for TcpTransport {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        self.inner.table.insert(addr, len)
    }

    /// Forgets a region; returns once no receive thread writes into it (a connection doing
    /// so right now is shut down).
    fn deregister(&self, key: RegionKey) -> Result<(), TransportError> {
        self.inner.table.deregister(key).map(|_| ())
    }

    fn descriptor(&self) -> SegmentDescriptor {
        self.inner.table.descriptor(&self.inner.endpoint)
    }

    fn place(
        &self,
        addr: u64,
        map: Arc<dyn crate::place::Placement>,
    ) -> Result<bool, TransportError> {
        self.inner.table.place(addr, map).map(|()| true)
    }

    fn unplace(&self, addr: u64) -> Option<u64> {
        self.inner.table.unplace(addr)
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
