//! Initiator sessions of the mooncake backend.
//!
//! A [`MooncakeSession`] owns `connections` data connections to one target (see `conn`). A
//! batch is checked first — every source inside a local region, every destination inside one
//! buffer the target advertised — so a bad address never leaves kvx. Ops longer than
//! `slice_bytes` are split into several requests (each its own header) and requests are cut
//! into groups (at most `group_bytes` / `group_requests`), queued in one bounded queue per
//! session (posting waits for room: batches of any size are accepted). Each connection's
//! writer takes the next group when its in-flight budget allows, so faster connections carry
//! more. When a batch fails, its groups not yet sent are cancelled, and its future resolves
//! only after every group that was handed to a socket is acknowledged or its connection is
//! shut down: once it returns, nothing of the batch can still be sent.

use std::sync::Arc;

use kvx_core::TransferOp;
use tokio::sync::mpsc;

use crate::batch;
use crate::error::TransportError;
use crate::mem::RegionTable;
use crate::mooncake::MooncakeConfig;
use crate::mooncake::conn::{self, Conn, Group, Req, SharedQueue};
use crate::mooncake::descriptor::MooncakeDescriptor;
use crate::segment::SegmentDescriptor;
use crate::transport::{BatchReport, BoxFuture, Session};

/// A session to one Mooncake TE target (or a kvx mooncake target).
pub struct MooncakeSession {
    peer: String,
    desc: MooncakeDescriptor,
    remote: SegmentDescriptor,
    local: Arc<RegionTable>,
    conns: Vec<Arc<Conn>>,
    tx: mpsc::Sender<Group>,
    v2: bool,
    cfg: MooncakeConfig,
}

impl MooncakeSession {
    /// Wraps connected data streams into a session and starts their threads.
    pub(crate) fn start(
        peer: String,
        desc: MooncakeDescriptor,
        local: Arc<RegionTable>,
        streams: Vec<std::net::TcpStream>,
        cfg: MooncakeConfig,
    ) -> Self {
        let v2 = desc.is_v2() && !cfg.force_v1;
        let n = streams.len().max(1);
        let (tx, rx) = mpsc::channel(cfg.queue_depth.max(1) * n);
        let queue: SharedQueue = Arc::new(tokio::sync::Mutex::new(rx));
        let name: Arc<str> = Arc::from(peer.as_str());
        let limits = conn::Limits {
            v2,
            max_bytes: cfg.max_inflight_bytes.max(1),
            max_reqs: cfg.max_inflight_requests.max(1),
            status_timeout: cfg.status_timeout,
        };
        let conns = streams
            .into_iter()
            .map(|stream| Conn::start(name.clone(), stream, limits, queue.clone(), tx.downgrade()))
            .collect();
        MooncakeSession {
            peer,
            remote: desc.to_segment(),
            desc,
            local,
            conns,
            tx,
            v2,
            cfg,
        }
    }

    /// The target's descriptor as fetched when the session opened.
    pub fn descriptor(&self) -> &MooncakeDescriptor {
        &self.desc
    }

    /// True when writes are acknowledged (protocol v2); false for the v1 fence path.
    pub fn is_v2(&self) -> bool {
        self.v2
    }

    /// Number of data connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    fn dead_error(conns: &[Arc<Conn>]) -> TransportError {
        conns
            .iter()
            .find_map(|c| c.cause().filter(|e| *e != TransportError::Closed))
            .unwrap_or(TransportError::Closed)
    }

    /// Checks a whole batch and cuts it into groups of requests (nothing is sent on error).
    fn plan(&self, ops: &[TransferOp]) -> Result<Vec<(Vec<Req>, u64)>, TransportError> {
        let slice = self.cfg.slice_bytes.max(1);
        let group_bytes = self.cfg.group_bytes.max(1);
        let group_reqs = self.cfg.group_requests.max(1);
        let mut srcs = Vec::with_capacity(ops.len());
        self.local
            .resolve_many(ops.iter().map(|o| (o.src, o.len)), |s| srcs.push(s))?;
        if let Some(op) = ops.iter().find(|o| self.desc.find(o.dst, o.len).is_none()) {
            return Err(TransportError::RemoteNotRegistered {
                addr: op.dst,
                len: op.len,
            });
        }
        let mut groups = Vec::new();
        let (mut cur, mut cur_bytes) = (Vec::new(), 0u64);
        for (op, src) in ops.iter().zip(srcs) {
            let mut off = 0u64;
            while off < op.len {
                let len = slice.min(op.len - off);
                let s = src.sub(off as usize, len as usize).ok_or(
                    TransportError::LocalNotRegistered {
                        addr: op.src,
                        len: op.len,
                    },
                )?;
                cur.push(Req {
                    src: s,
                    dst: op.dst + off,
                });
                cur_bytes += len;
                off += len;
                if cur_bytes >= group_bytes || cur.len() >= group_reqs {
                    groups.push((std::mem::take(&mut cur), std::mem::take(&mut cur_bytes)));
                }
            }
        }
        if !cur.is_empty() {
            groups.push((cur, cur_bytes));
        }
        Ok(groups)
    }
}

impl Session for MooncakeSession {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn remote(&self) -> &SegmentDescriptor {
        &self.remote
    }

    fn is_alive(&self) -> bool {
        self.conns.iter().all(|c| !c.is_dead())
    }

    fn write_batch(
        &self,
        ops: Vec<TransferOp>,
    ) -> BoxFuture<'static, Result<BatchReport, TransportError>> {
        let report = BatchReport {
            ops: ops.len() as u64,
            bytes: TransferOp::total_bytes(&ops),
        };
        let planned = self.plan(&ops);
        let tx = self.tx.clone();
        let conns = self.conns.clone();
        Box::pin(async move {
            let r = post(planned, tx, &conns).await;
            metrics::counter!("kvx_transport_batches_total", "backend" => "mooncake",
                "result" => match &r { Ok(()) => "ok", Err(e) => e.label() })
            .increment(1);
            r.map(|()| report)
        })
    }
}

/// Queues a planned batch and waits until every group of it is finished.
async fn post(
    planned: Result<Vec<(Vec<Req>, u64)>, TransportError>,
    tx: mpsc::Sender<Group>,
    conns: &[Arc<Conn>],
) -> Result<(), TransportError> {
    batch::post(
        planned?,
        |(reqs, bytes), ticket| Group {
            ticket,
            reqs,
            bytes,
        },
        Some,
        tx,
        || MooncakeSession::dead_error(conns),
    )
    .await
}
