//! The `auto` backend: one sending transport that speaks, per peer, whatever the peer's port
//! answers — Mooncake Transfer Engine's P2P handshake (an sglang decode) or kvx's own tcp
//! protocol (a kvx decode).
//!
//! A prefill serves sglang decodes and kvx decodes in the same process without being told which
//! is which: the session id a decode publishes is either a Mooncake TE handshake port or a kvx
//! tcp endpoint. [`AutoTransport`] registers every region on both of its backends and, the first
//! time it meets a peer, sends one Mooncake metadata request to it (padded so that a kvx tcp
//! server reads a whole hello, finds the wrong magic and closes at once). A Mooncake reply picks
//! the `mooncake` backend; an answer in another protocol (`TransportError::WrongProtocol`) picks
//! `tcp`; a peer that cannot be reached or does not answer in time, or a Mooncake target whose
//! descriptor kvx cannot use (an RDMA segment), is an error and nothing is remembered. The choice is kept per peer until a
//! connect to it fails.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::TransportError;
use crate::mooncake::{self, MooncakeConfig, MooncakeTransport};
use crate::segment::{RegionKey, SegmentDescriptor};
use crate::tcp::{TcpConfig, TcpTransport};
use crate::transport::{BoxFuture, Session, Transport};

/// Which protocol a peer speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerKind {
    /// kvx's own framed tcp protocol.
    Tcp,
    /// Mooncake Transfer Engine's P2P handshake and TCP transport.
    Mooncake,
}

impl PeerKind {
    /// The backend name (`"tcp"`, `"mooncake"`).
    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Tcp => "tcp",
            PeerKind::Mooncake => "mooncake",
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A send-only transport that picks `tcp` or `mooncake` per peer.
pub struct AutoTransport {
    tcp: Arc<TcpTransport>,
    mooncake: Arc<MooncakeTransport>,
    probe_timeout: Duration,
    /// Our key → the two backends' keys.
    keys: Mutex<HashMap<RegionKey, (RegionKey, RegionKey)>>,
    next_key: AtomicU32,
    kinds: Mutex<HashMap<String, PeerKind>>,
}

impl AutoTransport {
    /// A send-only transport over both backends; `probe_timeout` bounds the first metadata
    /// request to a peer.
    pub fn client(tcp: TcpConfig, mooncake: MooncakeConfig, probe_timeout: Duration) -> Arc<Self> {
        Arc::new(AutoTransport {
            tcp: TcpTransport::client(tcp),
            mooncake: MooncakeTransport::client(mooncake),
            probe_timeout,
            keys: Mutex::new(HashMap::new()),
            next_key: AtomicU32::new(1),
            kinds: Mutex::new(HashMap::new()),
        })
    }

    /// What `peer` speaks: remembered, else found out with one metadata request. A session id
    /// naming a process instance (`host:port#instance`) is a kvx listener's: tcp, no probe.
    pub async fn peer_kind(&self, peer: &str) -> Result<PeerKind, TransportError> {
        if let Some(k) = lock(&self.kinds).get(peer).copied() {
            return Ok(k);
        }
        let probe = if kvx_core::peer::split_instance(peer).1.is_some() {
            None
        } else {
            Some(mooncake::fetch_descriptor(peer, self.probe_timeout).await)
        };
        let kind = match probe {
            None => PeerKind::Tcp,
            Some(Ok(_)) => PeerKind::Mooncake,
            Some(Err(e @ TransportError::WrongProtocol { .. })) => {
                tracing::debug!(%peer, error = %e, "not a Mooncake TE handshake port; using kvx tcp");
                PeerKind::Tcp
            }
            // Unreachable, silent, or a Mooncake target whose descriptor kvx cannot use (an
            // RDMA segment, say): nothing to fall back to, and nothing to remember.
            Some(Err(e)) => return Err(e),
        };
        tracing::info!(%peer, backend = kind.name(), "data plane chosen for peer");
        metrics::counter!("kvx_auto_peers_total", "backend" => kind.name()).increment(1);
        lock(&self.kinds).insert(peer.to_owned(), kind);
        Ok(kind)
    }

    /// A fresh session to `peer` on the backend it speaks (not cached), so that dropping it
    /// closes its connections.
    pub async fn open_session(&self, peer: &str) -> Result<Arc<dyn Session>, TransportError> {
        let kind = self.peer_kind(peer).await?;
        let r = match kind {
            PeerKind::Tcp => self
                .tcp
                .open_session(peer)
                .await
                .map(|s| Arc::new(s) as Arc<dyn Session>),
            PeerKind::Mooncake => self
                .mooncake
                .open_session(peer)
                .await
                .map(|s| Arc::new(s) as Arc<dyn Session>),
        };
        if r.is_err() {
            // The peer may have restarted speaking the other protocol: ask again next time.
            lock(&self.kinds).remove(peer);
        }
        r
    }

    /// The tcp backend.
    pub fn tcp(&self) -> &Arc<TcpTransport> {
        &self.tcp
    }

    /// The mooncake backend.
    pub fn mooncake(&self) -> &Arc<MooncakeTransport> {
        &self.mooncake
    }
}

impl Transport for AutoTransport {
    fn kind(&self) -> &'static str {
        "auto"
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        // SAFETY: the caller's contract (see `Transport::register`) covers both backends: the
        // memory stays valid until `deregister`, which removes it from both.
        let t = unsafe { self.tcp.register(addr, len)? };
        // SAFETY: as above.
        let m = match unsafe { self.mooncake.register(addr, len) } {
            Ok(m) => m,
            Err(e) => {
                let _ = self.tcp.deregister(t);
                return Err(e);
            }
        };
        let key = RegionKey(self.next_key.fetch_add(1, Ordering::Relaxed));
        lock(&self.keys).insert(key, (t, m));
        Ok(key)
    }

    fn deregister(&self, key: RegionKey) -> Result<(), TransportError> {
        let Some((t, m)) = lock(&self.keys).remove(&key) else {
            return Err(TransportError::Registration {
                addr: 0,
                len: 0,
                detail: format!("unknown region key {key}"),
            });
        };
        let a = self.tcp.deregister(t);
        let b = self.mooncake.deregister(m);
        a.and(b)
    }

    fn descriptor(&self) -> SegmentDescriptor {
        self.tcp.descriptor()
    }

    fn endpoint(&self) -> String {
        String::new()
    }

    fn connect<'a>(
        &'a self,
        peer: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Session>, TransportError>> {
        Box::pin(async move {
            let kind = self.peer_kind(peer).await?;
            let r = match kind {
                PeerKind::Tcp => self.tcp.connect(peer).await,
                PeerKind::Mooncake => self.mooncake.connect(peer).await,
            };
            if r.is_err() {
                lock(&self.kinds).remove(peer);
            }
            r
        })
    }
}
