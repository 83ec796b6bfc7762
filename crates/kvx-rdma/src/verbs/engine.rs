//! [`VerbsTransport`]: the verbs backend behind the crate's [`Transport`] trait.
//!
//! One transport opens one device and protection domain. Memory is registered once per region
//! (the region key is the rkey). A receiver listens on a TCP address for queue-pair handshakes;
//! a sender [`connect`](Transport::connect)s to it, creates `qps_per_peer` RC queue pairs on a
//! completion queue of its own, and both sides exchange one [`VerbsHandshake`] each (port
//! address, queue pairs, regions with rkeys). The TCP connection stays open for the life of the
//! session as its liveness signal.
//!
//! The handshake is the `tcp` backend's: its 16-byte hello (`docs/tcp-transport.md`) with bit 0
//! ([`HELLO_FLAG_VERBS`]) set in the client's flags, and a [`VerbsHandshake`] where the tcp
//! backend carries its segment descriptor. A tcp listener refuses such a hello (the payload is
//! not a descriptor) and this listener refuses a plain tcp hello. Seam: serving both backends
//! on one port needs the tcp server to hand flagged connections to the receiving code here.

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
use super::path::DevicePath;
use super::plan::Limits;
use super::qp::{QpConfig, RcQueuePair, RemotePort};
use super::sched::SchedConfig;
use super::session::{SessionParts, VerbsSession, to_transport_error};
use crate::error::TransportError;
use crate::segment::{RegionDesc, RegionKey, SegmentDescriptor};
use crate::tcp::wire::{HELLO_LEN, HELLO_OK, Hello, VERSION as TCP_VERSION};
use crate::transport::{BoxFuture, Session, Transport};

/// Most queue pairs a receiver creates for one peer.
pub const MAX_INBOUND_QPS: usize = 64;

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

/// Flag bit in the client hello's flags field (`status` of [`Hello`]) that marks a verbs
/// handshake: the payload after the hello is a [`VerbsHandshake`], not a segment descriptor.
pub const HELLO_FLAG_VERBS: u16 = 0x1;

/// Writes the tcp backend's 16-byte hello followed by the verbs payload. A client sets
/// [`HELLO_FLAG_VERBS`] in the flags; a server answers with status `HELLO_OK`.
pub async fn send_handshake<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    h: &VerbsHandshake,
    as_server: bool,
) -> Result<(), VerbsError> {
    let payload = h.encode();
    let hello = Hello {
        version: TCP_VERSION,
        status: if as_server {
            HELLO_OK
        } else {
            HELLO_FLAG_VERBS
        },
        param: 0,
        desc_len: payload.len() as u32,
    };
    let mut frame = Vec::with_capacity(HELLO_LEN + payload.len());
    frame.extend_from_slice(&hello.encode());
    frame.extend_from_slice(&payload);
    w.write_all(&frame)
        .await
        .map_err(|e| VerbsError::Handshake(format!("send: {e}")))
}

/// Reads a hello and its verbs payload. From a client the verbs flag must be set; from a server
/// the status must be `HELLO_OK`. Payload lengths above the hello's limit are refused unread.
pub async fn recv_handshake<R: AsyncReadExt + Unpin>(
    r: &mut R,
    from_server: bool,
) -> Result<VerbsHandshake, VerbsError> {
    let mut fixed = [0u8; HELLO_LEN];
    r.read_exact(&mut fixed)
        .await
        .map_err(|e| VerbsError::Handshake(format!("receive: {e}")))?;
    let hello = Hello::decode(&fixed).map_err(|e| VerbsError::Handshake(e.to_string()))?;
    if hello.version < TCP_VERSION {
        return Err(VerbsError::Handshake(format!(
            "unsupported hello version {}",
            hello.version
        )));
    }
    if from_server && hello.status != HELLO_OK {
        return Err(VerbsError::Handshake(format!(
            "peer refused the handshake (status {})",
            hello.status
        )));
    }
    if !from_server && hello.status & HELLO_FLAG_VERBS == 0 {
        return Err(VerbsError::Handshake(
            "hello without the verbs flag (a tcp client?)".into(),
        ));
    }
    let mut buf = vec![0u8; hello.desc_len as usize];
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
        let theirs =
            tokio::time::timeout(cfg.handshake_timeout, recv_handshake(&mut stream, false))
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
        send_handshake(&mut stream, &handshake_for(&dev, &qps), true).await?;
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
            let got = recv_handshake(&mut s, false).await.unwrap();
            send_handshake(&mut s, &got, true).await.unwrap();
            got
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        send_handshake(&mut c, &sample(), false).await.unwrap();
        assert_eq!(recv_handshake(&mut c, true).await.unwrap(), sample());
        assert_eq!(server.await.unwrap(), sample());
    }

    fn hello(status: u16, desc_len: u32) -> Vec<u8> {
        Hello {
            version: TCP_VERSION,
            status,
            param: 0,
            desc_len,
        }
        .encode()
        .to_vec()
    }

    #[tokio::test]
    async fn bad_hellos_are_refused() {
        // oversized payload: refused from the length alone
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello(HELLO_FLAG_VERBS, u32::MAX))
            .await
            .unwrap();
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
        // truncated payload
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello(HELLO_FLAG_VERBS, 100)).await.unwrap();
        a.write_all(&[0u8; 10]).await.unwrap();
        drop(a);
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
        // a plain tcp client (no verbs flag)
        let (mut a, mut b) = tokio::io::duplex(1024);
        let payload = sample().encode();
        a.write_all(&hello(0, payload.len() as u32)).await.unwrap();
        a.write_all(&payload).await.unwrap();
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
        // a server that refused
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello(1, 0)).await.unwrap();
        assert!(matches!(
            recv_handshake(&mut b, true).await,
            Err(VerbsError::Handshake(_))
        ));
        // bad magic
        let (mut a, mut b) = tokio::io::duplex(1024);
        let mut h = hello(HELLO_FLAG_VERBS, 0);
        h[0] = b'X';
        a.write_all(&h).await.unwrap();
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
    }

    proptest::proptest! {
        /// Whatever a peer sends, reading its hello ends in a value or a typed error.
        #[test]
        fn recv_handshake_never_panics(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            from_server in proptest::prelude::any::<bool>(),
            valid_prefix in proptest::prelude::any::<bool>(),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let (mut a, mut b) = tokio::io::duplex(4096);
                if valid_prefix {
                    let flags = if from_server { HELLO_OK } else { HELLO_FLAG_VERBS };
                    a.write_all(&hello(flags, bytes.len() as u32)).await.unwrap();
                }
                a.write_all(&bytes).await.unwrap();
                drop(a);
                let _ = recv_handshake(&mut b, from_server).await;
            });
        }
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
