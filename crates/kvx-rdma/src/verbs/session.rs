//! One peer's sending session: a tokio task that owns its [`SendPath`] (queue pairs and completion
//! queue) and the scheduler, and the [`Session`] handle that feeds it.
//!
//! [`VerbsSession::write_batch`] plans the batch on the caller's task (every range checked
//! against the local lkey table and the peer's advertised regions, so a bad batch fails before
//! anything is posted) and hands the plan to the session task. The task is a thin driver: it
//! moves submissions into [`PeerScheduler`], posts what the scheduler hands out (one doorbell
//! per post), feeds completions from the [`SendPath`] back, and answers each batch once. It also
//! watches the handshake's TCP connection: when the peer process dies the connection closes and
//! every open batch fails at once instead of waiting for the queue pairs' retry timeout.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvx_core::TransferOp;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use super::cq::Wc;
use super::error::{VerbsError, WC_SUCCESS, WC_WR_FLUSH_ERR, wc_status_name};
use super::path::{LocalKeys, SendPath};
use super::plan::{Limits, WritePlan, plan_writes};
use super::post::decode_wr_id;
use super::regions::RegionTable;
use super::sched::{BatchResult, PeerScheduler, SchedConfig};
use super::sendq::BatchId;
use crate::error::{RejectReason, TransportError};
use crate::segment::SegmentDescriptor;
use crate::transport::{BatchReport, BoxFuture, Session};

/// `IBV_WC_REM_ACCESS_ERR`: the responder refused the rkey or the range.
const WC_REM_ACCESS_ERR: u32 = 10;
/// `IBV_WC_RETRY_EXC_ERR`: the peer stopped acknowledging.
const WC_RETRY_EXC_ERR: u32 = 12;
/// `IBV_WC_RNR_RETRY_EXC_ERR`.
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

/// Maps a verbs error to the data plane's error type, naming `peer` where it matters.
pub fn to_transport_error(e: VerbsError, peer: &str) -> TransportError {
    match e {
        VerbsError::NoDevice { reason } => TransportError::NoDevice(reason),
        e @ VerbsError::DeviceNotFound { .. } => TransportError::NoDevice(e.to_string()),
        VerbsError::LocalNotRegistered { addr, len } => {
            TransportError::LocalNotRegistered { addr, len }
        }
        VerbsError::RemoteNotRegistered { addr, len } => {
            TransportError::RemoteNotRegistered { addr, len }
        }
        VerbsError::BadRegions(detail) => TransportError::Registration {
            addr: 0,
            len: 0,
            detail: detail.into(),
        },
        VerbsError::Handshake(detail) => TransportError::Handshake {
            peer: peer.into(),
            detail,
        },
        VerbsError::Completion {
            status: WC_REM_ACCESS_ERR,
            ..
        } => TransportError::RemoteRejected {
            reason: RejectReason::OutOfBounds,
            addr: 0,
            len: 0,
        },
        e @ VerbsError::Completion {
            status: WC_RETRY_EXC_ERR | WC_RNR_RETRY_EXC_ERR,
            ..
        } => TransportError::PeerLost {
            peer: peer.into(),
            detail: e.to_string(),
        },
        VerbsError::PeerLost(detail) => TransportError::PeerLost {
            peer: peer.into(),
            detail,
        },
        VerbsError::Closed => TransportError::Closed,
        e @ (VerbsError::Verbs { .. } | VerbsError::Completion { .. }) => TransportError::Io {
            kind: std::io::ErrorKind::Other,
            detail: e.to_string(),
        },
    }
}

type Reply = oneshot::Sender<Result<BatchReport, TransportError>>;

enum Cmd {
    Submit {
        plan: WritePlan,
        ops: u64,
        reply: Reply,
        permit: OwnedSemaphorePermit,
    },
}

/// What a session needs besides its [`SendPath`].
pub struct SessionParts {
    /// The peer as named in `connect`.
    pub peer: String,
    /// Where source ranges are resolved.
    pub local: Arc<dyn LocalKeys>,
    /// The handshake connection, kept open as the liveness signal.
    pub ctrl: TcpStream,
    /// The peer's regions with their rkeys.
    pub remote: RegionTable,
    /// The same regions as a descriptor.
    pub remote_desc: SegmentDescriptor,
    /// Planner limits.
    pub limits: Limits,
    /// Scheduler configuration.
    pub sched: SchedConfig,
    /// Most work requests queued or in flight in this session; `write_batch` waits for room
    /// beyond that (backpressure). A larger batch waits for the session to drain.
    pub max_queued_wrs: u32,
}

/// The [`Session`] handle of one peer.
pub struct VerbsSession {
    peer: String,
    local: Arc<dyn LocalKeys>,
    remote: RegionTable,
    remote_desc: SegmentDescriptor,
    limits: Limits,
    alive: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<Cmd>,
    room: Arc<Semaphore>,
    max_queued: u32,
}

impl std::fmt::Debug for VerbsSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsSession")
            .field("peer", &self.peer)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl VerbsSession {
    /// Starts the session task over `path` (inside a tokio runtime) and returns its handle.
    pub fn start<P: SendPath>(path: P, parts: SessionParts) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let alive = Arc::new(AtomicBool::new(true));
        let qpns = path.qpns();
        let max_queued = parts.max_queued_wrs.max(1);
        let room = Arc::new(Semaphore::new(max_queued as usize));
        let task = SessionTask {
            room: room.clone(),
            peer: parts.peer.clone(),
            path,
            ctrl: parts.ctrl,
            sched: PeerScheduler::new(parts.sched, qpns),
            batches: HashMap::new(),
            next_id: 1,
            alive: alive.clone(),
        };
        tokio::spawn(task.run(rx));
        Arc::new(VerbsSession {
            peer: parts.peer,
            local: parts.local,
            remote: parts.remote,
            remote_desc: parts.remote_desc,
            limits: parts.limits,
            alive,
            tx,
            room,
            max_queued,
        })
    }

    /// The planner limits this session uses.
    pub fn limits(&self) -> Limits {
        self.limits
    }
}

impl Session for VerbsSession {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn remote(&self) -> &SegmentDescriptor {
        &self.remote_desc
    }

    fn write_batch(
        &self,
        ops: Vec<TransferOp>,
    ) -> BoxFuture<'static, Result<BatchReport, TransportError>> {
        let peer = self.peer.clone();
        let mut planned = plan_writes(&ops, &self.local.local_regions(), &self.remote, self.limits);
        if self.limits.max_inline > 0
            && let Ok(plan) = &mut planned
        {
            // Device-memory sources are read by the NIC only, never copied inline by the CPU.
            plan.no_inline_from(&self.local.device_lkeys());
        }
        let n_ops = ops.len() as u64;
        let plan = match planned {
            Ok(plan) => plan,
            Err(e) => {
                metrics::counter!("kvx_verbs_batch_errors_total", "kind" => e.label()).increment(1);
                tracing::debug!(%peer, error = %e, "verbs batch refused before posting");
                return Box::pin(std::future::ready(Err(to_transport_error(e, &peer))));
            }
        };
        let want = (plan.wrs.len() as u32).min(self.max_queued);
        let submit = move |tx: &mpsc::UnboundedSender<Cmd>, plan, permit| {
            let (reply, rx) = oneshot::channel();
            let cmd = Cmd::Submit {
                plan,
                ops: n_ops,
                reply,
                permit,
            };
            tx.send(cmd).ok().map(|()| rx)
        };
        // submit at once when there is room (the common case), else wait for room
        let (tx, room) = (self.tx.clone(), self.room.clone());
        let early = match room.clone().try_acquire_many_owned(want) {
            Ok(permit) => Some(submit(&tx, plan, permit)),
            Err(_) => {
                let late = async move {
                    let permit = room
                        .acquire_many_owned(want)
                        .await
                        .map_err(|_| TransportError::Closed)?;
                    submit(&tx, plan, permit).ok_or(TransportError::Closed)
                };
                return Box::pin(async move {
                    late.await?.await.unwrap_or(Err(TransportError::Closed))
                });
            }
        };
        Box::pin(async move {
            match early.flatten() {
                Some(rx) => rx.await.unwrap_or(Err(TransportError::Closed)),
                None => Err(TransportError::Closed),
            }
        })
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && !self.tx.is_closed()
    }
}

struct OpenBatch {
    plan: WritePlan,
    ops: u64,
    reply: Reply,
    /// Room in the session's queue, released when the batch is answered.
    _permit: OwnedSemaphorePermit,
}

struct SessionTask<P> {
    room: Arc<Semaphore>,
    peer: String,
    path: P,
    ctrl: TcpStream,
    sched: PeerScheduler,
    batches: HashMap<BatchId, OpenBatch>,
    next_id: BatchId,
    alive: Arc<AtomicBool>,
}

impl<P: SendPath> SessionTask<P> {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        let mut wcs: Vec<Wc> = Vec::new();
        let mut ctrl_buf = [0u8; 64];
        let reason = loop {
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    None => break VerbsError::Closed,
                    Some(Cmd::Submit { plan, ops, reply, permit }) => self.submit(plan, ops, reply, permit),
                },
                r = self.path.next_completions(&mut wcs) => {
                    if let Err(e) = r {
                        tracing::error!(peer = %self.peer, error = %e, "verbs completion queue failed");
                        break e;
                    }
                    let before = self.sched.stats();
                    for wc in wcs.drain(..) {
                        let (slot, seq) = decode_wr_id(wc.wr_id);
                        if wc.status != WC_SUCCESS && wc.status != WC_WR_FLUSH_ERR {
                            tracing::warn!(peer = %self.peer, slot, status = wc.status,
                                status_name = wc_status_name(wc.status),
                                vendor_err = wc.vendor_err, "verbs work completion error");
                        }
                        let done = self.sched.on_completion(slot as usize, seq, wc.status, wc.vendor_err);
                        self.deliver(done);
                    }
                    let after = self.sched.stats();
                    metrics::counter!("kvx_verbs_completions_ignored_total")
                        .increment(after.ignored - before.ignored);
                    metrics::counter!("kvx_verbs_wrs_requeued_total")
                        .increment(after.requeued - before.requeued);
                    metrics::counter!("kvx_verbs_wrs_failed_total")
                        .increment(after.failed_wrs - before.failed_wrs);
                },
                n = self.ctrl.read(&mut ctrl_buf) => {
                    if matches!(n, Ok(0) | Err(_)) {
                        tracing::warn!(peer = %self.peer, "verbs peer closed its control connection");
                        break VerbsError::PeerLost("control connection closed".into());
                    }
                },
            }
            self.post_ready();
        };
        self.alive.store(false, Ordering::Release);
        self.room.close();
        let done = self.sched.close(reason);
        self.deliver(done);
        rx.close();
        while let Some(Cmd::Submit { reply, .. }) = rx.recv().await {
            let _ = reply.send(Err(TransportError::Closed));
        }
    }

    fn submit(&mut self, plan: WritePlan, ops: u64, reply: Reply, permit: OwnedSemaphorePermit) {
        let id = self.next_id;
        self.next_id += 1;
        let n = plan.wrs.len() as u32;
        self.batches.insert(
            id,
            OpenBatch {
                plan,
                ops,
                reply,
                _permit: permit,
            },
        );
        if let Some(done) = self.sched.submit(id, n) {
            self.deliver(vec![done]);
        }
    }

    fn post_ready(&mut self) {
        // a failed post re-queues its work: schedule again until nothing more can go out
        loop {
            let posts = self.sched.schedule();
            if posts.is_empty() {
                return;
            }
            self.post_all(posts);
        }
    }

    fn post_all(&mut self, posts: Vec<super::sched::Post>) {
        for post in posts {
            if self.sched.send_queue(post.qp).is_none_or(|q| q.is_broken()) {
                continue; // an earlier post on it failed; its work was re-queued
            }
            let batches = &self.batches;
            let r = self.path.post(&post, &|b| batches.get(&b).map(|o| &o.plan));
            match r {
                Ok(()) => metrics::counter!("kvx_verbs_posts_total").increment(1),
                Err(e) => {
                    tracing::error!(peer = %self.peer, qp = post.qp, error = %e, "verbs post failed");
                    metrics::counter!("kvx_verbs_post_errors_total").increment(1);
                    let done = self.sched.post_failed(post.qp);
                    self.deliver(done);
                }
            }
        }
    }

    fn deliver(&mut self, done: Vec<BatchResult>) {
        for (id, r) in done {
            let Some(b) = self.batches.remove(&id) else {
                continue;
            };
            let r = match r {
                Ok(()) => {
                    metrics::counter!("kvx_verbs_batches_total", "result" => "ok").increment(1);
                    Ok(BatchReport {
                        ops: b.ops,
                        bytes: b.plan.total_bytes(),
                    })
                }
                Err(e) => {
                    metrics::counter!("kvx_verbs_batches_total", "result" => e.label())
                        .increment(1);
                    tracing::warn!(peer = %self.peer, batch = id, error = %e, "verbs batch failed");
                    Err(to_transport_error(e, &self.peer))
                }
            };
            let _ = b.reply.send(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_mapping() {
        let e = to_transport_error(VerbsError::NoDevice { reason: "x".into() }, "p");
        assert_eq!(e, TransportError::NoDevice("x".into()));
        let c = |status| VerbsError::Completion {
            qpn: 1,
            status,
            status_name: "",
            vendor_err: 0,
        };
        assert!(matches!(
            to_transport_error(c(10), "p"),
            TransportError::RemoteRejected { .. }
        ));
        assert!(matches!(
            to_transport_error(c(12), "p"),
            TransportError::PeerLost { .. }
        ));
        assert!(to_transport_error(c(12), "p").is_peer_failure());
        assert!(matches!(
            to_transport_error(c(4), "p"),
            TransportError::Io { .. }
        ));
        assert_eq!(
            to_transport_error(VerbsError::RemoteNotRegistered { addr: 1, len: 2 }, "p"),
            TransportError::RemoteNotRegistered { addr: 1, len: 2 }
        );
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod sim_tests;
