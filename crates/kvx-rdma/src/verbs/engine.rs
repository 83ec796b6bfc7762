//! [`VerbsTransport`]: the verbs backend behind the crate's [`Transport`] trait.
//!
//! One transport opens one device and protection domain. Memory is registered once per region
//! (the region key is the rkey). A receiver listens on a TCP address for queue-pair handshakes;
//! a sender [`connect`](Transport::connect)s to it, creates `qps_per_peer` RC queue pairs on a
//! completion queue of its own, and both sides exchange one [`VerbsHandshake`] each (port
//! address, queue pairs, regions with rkeys) framed as `u32 length (LE) + payload`. The TCP
//! connection stays open for the life of the session as its liveness signal.
//!
//! Seam: the `tcp` backend's hello carries a [`SegmentDescriptor`]; when it grows an extension
//! field, the [`VerbsHandshake`] payload moves into it and this listener goes away. Until then
//! the verbs backend runs this small listener of its own with the same framing idea.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::cq::EventCq;
use super::device::{DeviceConfig, VerbsDevice};
use super::error::VerbsError;
use super::handshake::{MAX_QPS, VerbsHandshake};
use super::plan::Limits;
use super::qp::{QpConfig, RcQueuePair, RemotePort};
use super::sched::SchedConfig;
use super::session::{SessionParts, VerbsSession, to_transport_error};
use crate::error::TransportError;
use crate::segment::{RegionDesc, RegionKey, SegmentDescriptor};
use crate::transport::{BoxFuture, Session, Transport};

/// Most queue pairs a receiver creates for one peer.
pub const MAX_INBOUND_QPS: usize = 64;

/// Largest handshake payload accepted (a million regions fit).
pub const MAX_HANDSHAKE_LEN: u32 = 32 << 20;

/// Configuration of a [`VerbsTransport`].
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// Device and port.
    pub device: DeviceConfig,
    /// Where to listen for queue-pair handshakes (`"0.0.0.0:17100"`); `None` for a send-only
    /// side.
    pub listen: Option<String>,
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
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: DeviceConfig::default(),
            listen: None,
            qps_per_peer: 2,
            qp: QpConfig::default(),
            sched: SchedConfig::default(),
            max_wr_bytes: 2 << 20,
            handshake_timeout: Duration::from_secs(5),
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
                local.to_string()
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
            send_handshake(&mut ctrl, &self.my_handshake(&qps)).await?;
            recv_handshake(&mut ctrl).await
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
            regions: theirs
                .regions
                .regions()
                .iter()
                .map(|r| RegionDesc {
                    base: r.base,
                    len: r.len,
                    key: RegionKey(r.key),
                })
                .collect(),
        };
        tracing::info!(%peer, qps = qps.len(), ?limits, "verbs session connected");
        Ok(VerbsSession::start(SessionParts {
            peer: peer.to_owned(),
            dev: self.dev.clone(),
            qps,
            cq,
            ctrl,
            remote: theirs.regions,
            remote_desc,
            limits,
            sched,
        }))
    }
}

fn handshake_for(dev: &VerbsDevice, qps: &[RcQueuePair]) -> VerbsHandshake {
    let addr = dev.address();
    VerbsHandshake {
        lid: addr.lid,
        gid: addr.gid,
        mtu: addr.mtu,
        qps: qps.iter().map(|q| q.info()).collect(),
        regions: dev.remote_keys(),
    }
}

/// Writes one framed handshake (`u32` LE length, payload).
pub async fn send_handshake<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    h: &VerbsHandshake,
) -> Result<(), VerbsError> {
    let payload = h.encode();
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&payload);
    w.write_all(&frame)
        .await
        .map_err(|e| VerbsError::Handshake(format!("send: {e}")))
}

/// Reads one framed handshake; lengths above [`MAX_HANDSHAKE_LEN`] are refused unread.
pub async fn recv_handshake<R: AsyncReadExt + Unpin>(
    r: &mut R,
) -> Result<VerbsHandshake, VerbsError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .await
        .map_err(|e| VerbsError::Handshake(format!("receive: {e}")))?;
    let len = u32::from_le_bytes(len);
    if len > MAX_HANDSHAKE_LEN {
        return Err(VerbsError::Handshake(format!(
            "payload of {len} bytes too large"
        )));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)
        .await
        .map_err(|e| VerbsError::Handshake(format!("receive: {e}")))?;
    VerbsHandshake::decode(&buf)
}

async fn accept_loop(
    listener: TcpListener,
    dev: Arc<VerbsDevice>,
    cfg: VerbsConfig,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            r = listener.accept() => match r {
                Ok((stream, from)) => {
                    tokio::spawn(serve_peer(stream, from.to_string(), dev.clone(), cfg.clone(), stop.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "verbs handshake accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// The receiving side of one peer: answer its handshake with as many connected queue pairs,
/// then keep them until the control connection closes or the transport shuts down.
async fn serve_peer(
    mut stream: TcpStream,
    from: String,
    dev: Arc<VerbsDevice>,
    cfg: VerbsConfig,
    mut stop: watch::Receiver<bool>,
) {
    let setup = async {
        let theirs = tokio::time::timeout(cfg.handshake_timeout, recv_handshake(&mut stream))
            .await
            .map_err(|_| VerbsError::Handshake("timed out".into()))??;
        // responder queue pairs see no completions for incoming RDMA WRITEs; the queue only
        // exists because a queue pair needs one
        let cq = dev
            .context()
            .create_cq_builder()
            .setup_cqe(1)
            .build_ex()
            .map_err(|e| VerbsError::verbs("ibv_create_cq_ex", e))?;
        let port = RemotePort {
            lid: theirs.lid,
            gid: theirs.gid,
            mtu: theirs.mtu,
        };
        if theirs.qps.len() > MAX_INBOUND_QPS {
            return Err(VerbsError::Handshake(format!(
                "{} queue pairs asked, at most {MAX_INBOUND_QPS} served",
                theirs.qps.len()
            )));
        }
        let mut qps = Vec::with_capacity(theirs.qps.len());
        for info in &theirs.qps {
            let mut qp = RcQueuePair::create(&dev, &cq, cfg.qp)?;
            qp.connect(&dev, *info, port)?;
            qps.push(qp);
        }
        send_handshake(&mut stream, &handshake_for(&dev, &qps)).await?;
        Ok::<_, VerbsError>((qps, cq))
    };
    let held = match setup.await {
        Ok(held) => held,
        Err(e) => {
            metrics::counter!("kvx_verbs_handshake_errors_total", "kind" => e.label()).increment(1);
            tracing::warn!(peer = %from, error = %e, "verbs handshake refused");
            return;
        }
    };
    tracing::info!(peer = %from, qps = held.0.len(), "verbs peer connected");
    let mut buf = [0u8; 64];
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            n = stream.read(&mut buf) => if matches!(n, Ok(0) | Err(_)) { break },
        }
    }
    tracing::info!(peer = %from, "verbs peer disconnected");
    drop(held);
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
            regions: self
                .dev
                .remote_keys()
                .regions()
                .iter()
                .map(|r| RegionDesc {
                    base: r.base,
                    len: r.len,
                    key: RegionKey(r.key),
                })
                .collect(),
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
    use crate::verbs::handshake::QpInfo;
    use crate::verbs::regions::{Region, RegionTable};

    fn sample() -> VerbsHandshake {
        VerbsHandshake {
            lid: 3,
            gid: [1; 16],
            mtu: 3,
            qps: vec![QpInfo { qpn: 9, psn: 10 }],
            regions: RegionTable::from_regions(vec![Region {
                base: 4096,
                len: 4096,
                key: 5,
            }])
            .unwrap(),
        }
    }

    #[tokio::test]
    async fn framed_handshake_over_a_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let got = recv_handshake(&mut s).await.unwrap();
            send_handshake(&mut s, &got).await.unwrap();
            got
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        send_handshake(&mut c, &sample()).await.unwrap();
        assert_eq!(recv_handshake(&mut c).await.unwrap(), sample());
        assert_eq!(server.await.unwrap(), sample());
    }

    #[tokio::test]
    async fn oversized_and_truncated_handshakes_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&(MAX_HANDSHAKE_LEN + 1).to_le_bytes())
            .await
            .unwrap();
        assert!(matches!(
            recv_handshake(&mut b).await,
            Err(VerbsError::Handshake(_))
        ));
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&100u32.to_le_bytes()).await.unwrap();
        a.write_all(&[0u8; 10]).await.unwrap();
        drop(a);
        assert!(matches!(
            recv_handshake(&mut b).await,
            Err(VerbsError::Handshake(_))
        ));
    }

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
