//! [`VerbsTransport`]: the verbs backend behind the crate's [`Transport`] trait.
//!
//! One transport opens one device and protection domain. Memory is registered once per region
//! (the region key is the rkey). A receiver listens on a TCP address for queue-pair handshakes;
//! a sender [`connect`](Transport::connect)s to it, creates `qps_per_peer` RC queue pairs on a
//! completion queue of its own, and both sides exchange one [`VerbsHandshake`] each (port
//! address, queue pairs, regions with rkeys). The TCP connection stays open for the life of the
//! session as its liveness signal.
//!
//! The handshake is the `tcp` backend's hello with a verbs payload (see [`super::hello`]); the
//! receiving side lives in [`super::listener`]. Seam: serving both backends on one port needs
//! the tcp server to hand connections whose hello carries the verbs flag to that listener code.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::cq::EventCq;
use super::device::{DeviceConfig, VerbsDevice};
use super::error::VerbsError;
use super::handshake::{MAX_QPS, VerbsHandshake};
use super::hello::{recv_handshake, send_handshake};
use super::listener::{accept_loop, handshake_for};
use super::path::DevicePath;
use super::plan::Limits;
use super::qp::{QpConfig, RcQueuePair, RemotePort};
use super::sched::SchedConfig;
use super::session::{SessionParts, VerbsSession, to_transport_error};
use crate::error::TransportError;
use crate::segment::{RegionKey, SegmentDescriptor};
use crate::transport::{BoxFuture, Session, Transport};

/// Configuration of a [`VerbsTransport`].
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// Device and port.
    pub device: DeviceConfig,
    /// Where to listen for queue-pair handshakes (`"0.0.0.0:17100"`); `None` for a send-only
    /// side.
    pub listen: Option<String>,
    /// Endpoint to advertise instead of the bound address (e.g. the routable IP when listening
    /// on `0.0.0.0`).
    pub advertise: Option<String>,
    /// Queue pairs per peer.
    pub qps_per_peer: usize,
    /// Queue-pair sizing.
    pub qp: QpConfig,
    /// Signalling and doorbell batching.
    pub sched: SchedConfig,
    /// Largest payload of one work request.
    pub max_wr_bytes: u32,
    /// Limit for connecting and handshaking.
    pub handshake_timeout: Duration,
    /// Most work requests queued or in flight per session before `write_batch` waits.
    pub max_queued_wrs: u32,
    /// Most queue pairs the receiver creates for one peer (a handshake asking more is refused).
    pub max_inbound_qps: usize,
    /// Most peers the receiver serves at once (handshaking or holding queue pairs); a peer
    /// beyond it is refused and counted (`kvx_verbs_peers_refused_total`).
    pub max_peers: usize,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: DeviceConfig::default(),
            listen: None,
            advertise: None,
            qps_per_peer: 2,
            qp: QpConfig::default(),
            sched: SchedConfig::default(),
            max_wr_bytes: 2 << 20,
            handshake_timeout: Duration::from_secs(5),
            max_queued_wrs: 1 << 16,
            max_inbound_qps: 16,
            max_peers: 1024,
        }
    }
}

/// The verbs [`Transport`].
pub struct VerbsTransport {
    dev: Arc<VerbsDevice>,
    cfg: VerbsConfig,
    endpoint: String,
    sessions: Mutex<HashMap<String, Arc<VerbsSession>>>,
    shutdown: watch::Sender<bool>,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("device", &self.dev.name())
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

impl VerbsTransport {
    /// Opens the device and, when configured, starts the handshake listener (inside a tokio
    /// runtime). On a host without RDMA this returns [`VerbsError::NoDevice`].
    pub async fn open(cfg: VerbsConfig) -> Result<Self, VerbsError> {
        if cfg.listen.is_none() {
            return Self::client(cfg);
        }
        let dev = VerbsDevice::open(&cfg.device)?;
        let (shutdown, stop) = watch::channel(false);
        let endpoint = match &cfg.listen {
            None => String::new(),
            Some(addr) => {
                let listener = TcpListener::bind(addr)
                    .await
                    .map_err(|e| VerbsError::verbs("bind", e))?;
                let local = listener
                    .local_addr()
                    .map_err(|e| VerbsError::verbs("local_addr", e))?;
                tokio::spawn(accept_loop(listener, dev.clone(), cfg.clone(), stop));
                cfg.advertise.clone().unwrap_or_else(|| local.to_string())
            }
        };
        Ok(VerbsTransport {
            dev,
            cfg,
            endpoint,
            sessions: Mutex::new(HashMap::new()),
            shutdown,
        })
    }

    /// A send-only transport (`cfg.listen` is ignored): opens the device, starts no listener,
    /// so it needs no tokio runtime until its first [`connect`](Transport::connect). On a host
    /// without RDMA this returns [`VerbsError::NoDevice`]; with `cfg.device.name` naming no
    /// device, [`VerbsError::DeviceNotFound`] with the names that exist.
    pub fn client(cfg: VerbsConfig) -> Result<Self, VerbsError> {
        let dev = VerbsDevice::open(&cfg.device)?;
        let (shutdown, _stop) = watch::channel(false);
        Ok(VerbsTransport {
            dev,
            cfg: VerbsConfig {
                listen: None,
                ..cfg
            },
            endpoint: String::new(),
            sessions: Mutex::new(HashMap::new()),
            shutdown,
        })
    }

    /// The opened device.
    pub fn device(&self) -> &Arc<VerbsDevice> {
        &self.dev
    }

    fn my_handshake(&self, qps: &[RcQueuePair]) -> VerbsHandshake {
        handshake_for(&self.dev, qps)
    }

    async fn open_session(&self, peer: &str) -> Result<Arc<VerbsSession>, VerbsError> {
        let n = self.cfg.qps_per_peer.clamp(1, MAX_QPS);
        let timeout = self.cfg.handshake_timeout;
        let mut ctrl = tokio::time::timeout(timeout, TcpStream::connect(peer))
            .await
            .map_err(|_| VerbsError::PeerLost(format!("connect to {peer} timed out")))?
            .map_err(|e| VerbsError::PeerLost(format!("connect to {peer}: {e}")))?;
        let _ = ctrl.set_nodelay(true);
        let depth = self.cfg.qp.depth.max(1);
        let cq = EventCq::new(&self.dev, depth.saturating_mul(n as u32).saturating_add(1))?;
        let mut qps = (0..n)
            .map(|_| RcQueuePair::create(&self.dev, cq.queue(), self.cfg.qp))
            .collect::<Result<Vec<_>, _>>()?;
        let theirs = tokio::time::timeout(timeout, async {
            send_handshake(&mut ctrl, &self.my_handshake(&qps), false).await?;
            recv_handshake(&mut ctrl, true).await
        })
        .await
        .map_err(|_| VerbsError::Handshake(format!("handshake with {peer} timed out")))??;
        if theirs.qps.len() != qps.len() {
            return Err(VerbsError::Handshake(format!(
                "peer answered with {} queue pairs, expected {}",
                theirs.qps.len(),
                qps.len()
            )));
        }
        let port = RemotePort {
            lid: theirs.lid,
            gid: theirs.gid,
            mtu: theirs.mtu,
        };
        for (qp, info) in qps.iter_mut().zip(&theirs.qps) {
            qp.connect(&self.dev, *info, port)?;
        }
        let caps = qps
            .iter()
            .map(|q| q.caps())
            .fold((u32::MAX, u32::MAX, u32::MAX), |(d, s, i), c| {
                (d.min(c.depth), s.min(c.max_sge), i.min(c.max_inline))
            });
        let limits = Limits {
            max_sge: caps.1,
            max_inline: caps.2,
            max_wr_bytes: self.cfg.max_wr_bytes,
        };
        let sched = SchedConfig {
            depth: caps.0,
            ..self.cfg.sched
        };
        let remote_desc = SegmentDescriptor {
            endpoint: peer.to_owned(),
            regions: theirs.regions.descs(),
        };
        tracing::info!(%peer, qps = qps.len(), ?limits, "verbs session connected");
        Ok(VerbsSession::start(
            DevicePath { qps, cq },
            SessionParts {
                peer: peer.to_owned(),
                local: self.dev.clone(),
                ctrl,
                remote: theirs.regions,
                remote_desc,
                limits,
                sched,
                max_queued_wrs: self.cfg.max_queued_wrs,
            },
        ))
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> &'static str {
        "verbs"
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        // SAFETY: forwarded contract: the caller keeps the range mapped while registered.
        let (_lkey, rkey) =
            unsafe { self.dev.register(addr, len) }.map_err(|e| TransportError::Registration {
                addr,
                len,
                detail: e.to_string(),
            })?;
        Ok(RegionKey(rkey))
    }

    fn accepts_device_memory(&self) -> bool {
        true
    }

    unsafe fn register_device(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        // SAFETY: forwarded contract: the caller keeps the device range allocated while it is
        // registered. Nothing in the verbs path forms a CPU pointer into a device range, reads,
        // writes or zeroes it: registration hands the address to ibv_reg_mr (pinned and mapped
        // through the peer-memory module), work requests carry it in SGEs for the NIC's DMA, and
        // the one CPU copy of the backend, an inline payload in `post`, is never used for a
        // device lkey (`WritePlan::no_inline_from`). The receiving side is passive (RDMA WRITE
        // lands without the CPU). Ranges are bounds-checked against the lkey/rkey tables as for
        // host memory.
        let (_lkey, rkey) = unsafe { self.dev.register_device(addr, len) }.map_err(|e| {
            TransportError::Registration {
                addr,
                len,
                detail: format!(
                    "device memory: {e} (needs a GPUDirect-RDMA capable NIC and nvidia-peermem)"
                ),
            }
        })?;
        Ok(RegionKey(rkey))
    }

    fn deregister(&self, key: RegionKey) -> Result<(), TransportError> {
        let base = self
            .dev
            .remote_keys()
            .regions()
            .iter()
            .find(|r| r.key == key.0)
            .map(|r| r.base)
            .ok_or_else(|| TransportError::Registration {
                addr: 0,
                len: 0,
                detail: format!("no region with key {key}"),
            })?;
        self.dev
            .deregister(base)
            .map_err(|e| to_transport_error(e, ""))
    }

    fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            endpoint: self.endpoint.clone(),
            regions: self.dev.remote_keys().descs(),
        }
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn connect<'a>(
        &'a self,
        peer: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Session>, TransportError>> {
        Box::pin(async move {
            let cached = self
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(peer)
                .filter(|s| s.is_alive())
                .cloned();
            if let Some(s) = cached {
                return Ok(s as Arc<dyn Session>);
            }
            // Sessions of departed peers are not kept (the cache is bounded by live peers).
            self.sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|_, s| s.is_alive());
            let s = self.open_session(peer).await.map_err(|e| {
                metrics::counter!("kvx_verbs_connect_errors_total", "kind" => e.label())
                    .increment(1);
                match e {
                    VerbsError::PeerLost(detail) => TransportError::PeerUnreachable {
                        peer: peer.to_owned(),
                        detail,
                    },
                    e => to_transport_error(e, peer),
                }
            })?;
            self.sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(peer.to_owned(), s.clone());
            Ok(s as Arc<dyn Session>)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn open_without_device_is_a_typed_error() {
        // on a host with a device this opens it; either way it must not panic
        match VerbsTransport::open(VerbsConfig::default()).await {
            Ok(t) => assert_eq!(t.kind(), "verbs"),
            Err(e) => assert!(
                matches!(e, VerbsError::NoDevice { .. } | VerbsError::Verbs { .. }),
                "{e}"
            ),
        }
    }
}
