//! The data plane as the drivers use it: a `kvx-rdma` transport plus the regions registered
//! with it, kept together so the memory outlives its registration.
//!
//! A [`DataPlane`] owns `Arc`s of the regions it registered and deregisters them when dropped,
//! before the regions can be freed. The decode's plane listens (its endpoint is the session id it
//! sends); the prefill's is send-only.

use std::sync::Arc;

use kvx_rdma::{
    LocalTransport, RegionKey, Session, TcpConfig, TcpTransport, Transport, TransportError,
};

use crate::region::Region;

/// A transport with the regions registered on it.
pub struct DataPlane {
    transport: Arc<dyn Transport>,
    tcp: Option<Arc<TcpTransport>>,
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

/// Which `kvx-rdma` backend a plane uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// kvx's framed TCP protocol (any two hosts).
    #[default]
    Tcp,
    /// memcpy into the peer's memory (both sides in one process).
    Local,
}

/// The tcp backend's settings for `connections` connections per peer.
pub fn tcp_config(connections: usize) -> TcpConfig {
    TcpConfig {
        connections: connections.max(1),
        ..TcpConfig::default()
    }
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
            tcp: None,
            keys,
            _regions: regions,
        })
    }

    /// A send-only tcp plane (a prefill rank).
    pub fn tcp_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = TcpTransport::client(tcp_config(connections));
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.tcp = Some(t);
        Ok(plane)
    }

    /// A listening tcp plane on `addr` (a decode rank, a link-test receiver).
    pub async fn tcp_server(
        addr: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = TcpTransport::bind(addr, tcp_config(connections)).await?;
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.tcp = Some(t);
        Ok(plane)
    }

    /// A session to `peer` owned by the caller alone (tcp: not cached by the transport), so
    /// that dropping it closes its connections; other backends share their cached session.
    pub async fn open_session(&self, peer: &str) -> Result<Arc<dyn Session>, TransportError> {
        match &self.tcp {
            Some(t) => Ok(Arc::new(t.open_session(peer).await?)),
            None => self.transport.connect(peer).await,
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
            Backend::Tcp => DataPlane::tcp_client(connections, regions),
            Backend::Local => DataPlane::new(LocalTransport::new(name)?, regions),
        }
    }

    /// A receiving plane on `backend`: tcp listens on `addr`; local publishes `name`.
    pub async fn server(
        backend: Backend,
        addr: &str,
        name: &str,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        match backend {
            Backend::Tcp => DataPlane::tcp_server(addr, 1, regions).await,
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
