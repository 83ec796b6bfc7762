//! The data plane as the drivers use it: a `kvx-rdma` transport plus the regions registered
//! with it, kept together so the memory outlives its registration.
//!
//! A [`DataPlane`] owns `Arc`s of the regions it registered and deregisters them when dropped,
//! before the regions can be freed. The decode's plane listens (its endpoint is the session id it
//! sends); the prefill's is send-only. A prefill's default plane is `auto`: per decode session it
//! speaks Mooncake TE's protocol to an sglang decode and kvx's tcp protocol to a kvx decode.

use std::sync::Arc;

use std::time::Duration;

use kvx_rdma::{
    AutoTransport, LocalTransport, MooncakeConfig, MooncakeTransport, RegionKey, Session,
    TcpConfig, TcpTransport, Transport, TransportError,
};

use crate::region::Region;

/// A transport with the regions registered on it.
pub struct DataPlane {
    transport: Arc<dyn Transport>,
    sessions: SessionSource,
    keys: Vec<RegionKey>,
    _regions: Vec<Arc<Region>>,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane")
            .field("kind", &self.transport.kind())
            .field("endpoint", &self.transport.endpoint())
            .finish()
    }
}

/// Where [`DataPlane::open_session`] gets sessions the caller owns alone.
enum SessionSource {
    /// The transport's shared, cached sessions.
    Cached,
    Tcp(Arc<TcpTransport>),
    Mooncake(Arc<MooncakeTransport>),
    Auto(Arc<AutoTransport>),
}

/// Which `kvx-rdma` backend a plane uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Sending: per peer, Mooncake TE's protocol when the peer's port answers it (an sglang
    /// decode), else kvx's tcp. Receiving: kvx's tcp.
    Auto,
    /// kvx's framed TCP protocol (any two hosts).
    #[default]
    Tcp,
    /// Mooncake Transfer Engine's P2P handshake and TCP transport (sglang's peers).
    Mooncake,
    /// memcpy into the peer's memory (both sides in one process).
    Local,
}

impl Backend {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Tcp => "tcp",
            Backend::Mooncake => "mooncake",
            Backend::Local => "local",
        }
    }
}

/// How long the `auto` backend waits for a peer's answer to its first metadata request.
pub const AUTO_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The mooncake backend's settings for `connections` connections per peer.
pub fn mooncake_config(connections: usize) -> MooncakeConfig {
    MooncakeConfig {
        connections: connections.max(1),
        ..MooncakeConfig::default()
    }
}

/// The environment variable holding the kvx tcp shared secret (off when unset): a receiver with
/// one answers a hello without it with no descriptor; a sender sends it in its hello. Set it on
/// both sides. It keeps stray peers out; it travels in clear, so it is no defence against an
/// eavesdropper.
pub const TCP_SECRET_ENV: &str = "KVX_TCP_SECRET";

/// The tcp backend's settings for `connections` connections per peer, with the shared secret of
/// [`TCP_SECRET_ENV`] when set (an empty or over-long one, more than 256 bytes, is refused).
pub fn tcp_config(connections: usize) -> Result<TcpConfig, TransportError> {
    let secret = match std::env::var_os(TCP_SECRET_ENV) {
        None => None,
        Some(v) => {
            let bytes = v.into_encoded_bytes();
            let secret = kvx_rdma::SharedSecret::new(&bytes).ok_or_else(|| TransportError::Io {
                kind: std::io::ErrorKind::InvalidInput,
                detail: format!(
                    "{TCP_SECRET_ENV} must hold 1 to 256 bytes (it holds {})",
                    bytes.len()
                ),
            })?;
            Some(secret)
        }
    };
    Ok(TcpConfig {
        connections: connections.max(1),
        secret,
        ..TcpConfig::default()
    })
}

impl DataPlane {
    /// Registers `regions` with `transport`.
    pub fn new(
        transport: Arc<dyn Transport>,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let mut keys = Vec::with_capacity(regions.len());
        for r in &regions {
            // SAFETY: the region is a live heap allocation owned through the `Arc` this plane
            // keeps until after `Drop` deregisters it; its bytes are interior-mutable
            // (`UnsafeCell`), so peers and the transport may write them from other threads.
            let key = unsafe { transport.register(r.base(), r.len())? };
            keys.push(key);
        }
        Ok(DataPlane {
            transport,
            sessions: SessionSource::Cached,
            keys,
            _regions: regions,
        })
    }

    /// A send-only tcp plane (a prefill rank).
    pub fn tcp_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = TcpTransport::client(tcp_config(connections)?);
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Tcp(t);
        Ok(plane)
    }

    /// A send-only plane that picks the protocol per peer (a prefill rank's default).
    pub fn auto_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = AutoTransport::client(
            tcp_config(connections)?,
            mooncake_config(connections),
            AUTO_PROBE_TIMEOUT,
        );
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Auto(t);
        Ok(plane)
    }

    /// A send-only Mooncake TE initiator plane.
    pub fn mooncake_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = MooncakeTransport::client(mooncake_config(connections));
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Mooncake(t);
        Ok(plane)
    }

    /// A Mooncake-TE-compatible target on `host` (its endpoint is `host:rpc_port`, the session
    /// id an sglang prefill dials).
    pub async fn mooncake_server(
        host: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = MooncakeTransport::bind(host, mooncake_config(connections)).await?;
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Mooncake(t);
        Ok(plane)
    }

    /// A listening tcp plane on `addr` (a decode rank, a link-test receiver).
    pub async fn tcp_server(
        addr: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = TcpTransport::bind(addr, tcp_config(connections)?).await?;
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Tcp(t);
        Ok(plane)
    }

    /// A session to `peer` owned by the caller alone (tcp, mooncake, auto: not cached by the
    /// transport), so that dropping it closes its connections; the local backend shares its
    /// cached session.
    pub async fn open_session(&self, peer: &str) -> Result<Arc<dyn Session>, TransportError> {
        match &self.sessions {
            SessionSource::Tcp(t) => Ok(Arc::new(t.open_session(peer).await?)),
            SessionSource::Mooncake(t) => Ok(Arc::new(t.open_session(peer).await?)),
            SessionSource::Auto(t) => t.open_session(peer).await,
            SessionSource::Cached => self.transport.connect(peer).await,
        }
    }

    /// A sending plane on `backend` (`name` names a local transport).
    pub fn client(
        backend: Backend,
        name: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        match backend {
            Backend::Auto => DataPlane::auto_client(connections, regions),
            Backend::Tcp => DataPlane::tcp_client(connections, regions),
            Backend::Mooncake => DataPlane::mooncake_client(connections, regions),
            Backend::Local => DataPlane::new(LocalTransport::new(name)?, regions),
        }
    }

    /// A receiving plane on `backend`: tcp (also for `auto`) listens on `host:0`; mooncake
    /// binds a handshake and a data port on `host`; local publishes `name`.
    pub async fn server(
        backend: Backend,
        host: &str,
        name: &str,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        match backend {
            Backend::Auto | Backend::Tcp => {
                DataPlane::tcp_server(&format!("{host}:0"), 1, regions).await
            }
            Backend::Mooncake => DataPlane::mooncake_server(host, 1, regions).await,
            Backend::Local => DataPlane::new(LocalTransport::new(name)?, regions),
        }
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// What peers use to reach this side (the decode's session id).
    pub fn endpoint(&self) -> String {
        self.transport.endpoint()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        for k in self.keys.drain(..) {
            let _ = self.transport.deregister(k);
        }
    }
}
