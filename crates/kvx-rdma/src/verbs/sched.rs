//! Per-peer scheduling of work requests over several queue pairs, and batch accounting.
//!
//! [`PeerScheduler`] is the deterministic core of one peer's send path. Batches are submitted as
//! a count of planned work requests; [`PeerScheduler::schedule`] hands out posts (a queue pair
//! and the work requests to chain on it behind one doorbell), spreading each batch over the
//! healthy queue pairs, never past a queue pair's free send slots or `max_wr_per_post`.
//! Completions come back through [`PeerScheduler::on_completion`], which returns the batches
//! that finished and how.
//!
//! Error attribution: a failed work request fails its own batch only. Work requests of other
//! batches that were flushed with it are re-queued on the peer's remaining healthy queue pairs
//! (RDMA WRITE is idempotent); only when no healthy queue pair is left do they fail, with
//! [`VerbsError::PeerLost`]. A batch reports its result once none of its work requests is still
//! on the wire, so a failed batch's memory is never written after the failure is reported.

use std::collections::{HashMap, VecDeque};

use super::error::{VerbsError, wc_status_name};
use super::sendq::{BatchId, CompletionOutcome, IgnoreReason, SendQueue, Slot};

/// Scheduler configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedConfig {
    /// Send-queue depth of every queue pair.
    pub depth: u32,
    /// Signal at least every this many work requests.
    pub signal_every: u32,
    /// Most work requests chained behind one doorbell.
    pub max_wr_per_post: u32,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            depth: 256,
            signal_every: 32,
            max_wr_per_post: 32,
        }
    }
}

/// One work request to post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostItem {
    /// The `wr_id` to post it with.
    pub wr_id: u64,
    /// Its batch.
    pub batch: BatchId,
    /// Its index in the batch's plan.
    pub wr: u32,
    /// Post it signalled.
    pub signaled: bool,
}

/// Work requests to chain on one queue pair and post with one doorbell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Post {
    /// Queue pair index.
    pub qp: usize,
    /// The work requests, in order.
    pub items: Vec<PostItem>,
}

/// A finished batch.
pub type BatchResult = (BatchId, Result<(), VerbsError>);

#[derive(Debug)]
struct BatchState {
    unposted: u32,
    inflight: u32,
    error: Option<VerbsError>,
}

/// Counters the driver exports as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStats {
    /// Completions that matched no outstanding work request.
    pub ignored: u64,
    /// Work requests re-queued after a flush.
    pub requeued: u64,
    /// Work requests that failed with an error completion.
    pub failed_wrs: u64,
}

/// The send-side scheduler of one peer.
#[derive(Debug)]
pub struct PeerScheduler {
    cfg: SchedConfig,
    qps: Vec<SendQueue>,
    qpns: Vec<u32>,
    pending: VecDeque<(BatchId, u32)>,
    batches: HashMap<BatchId, BatchState>,
    rr: usize,
    stats: SchedStats,
}

impl PeerScheduler {
    /// A scheduler over queue pairs numbered `qpns` (used in error messages).
    pub fn new(cfg: SchedConfig, qpns: Vec<u32>) -> Self {
        let qps = qpns
            .iter()
            .map(|_| SendQueue::new(cfg.depth, cfg.signal_every))
            .collect();
        PeerScheduler {
            cfg: SchedConfig {
                max_wr_per_post: cfg.max_wr_per_post.max(1),
                ..cfg
            },
            qps,
            qpns,
            pending: VecDeque::new(),
            batches: HashMap::new(),
            rr: 0,
            stats: SchedStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    /// Batches submitted and not yet finished.
    pub fn open_batches(&self) -> usize {
        self.batches.len()
    }

    /// The send queue of queue pair `qp`.
    pub fn send_queue(&self, qp: usize) -> Option<&SendQueue> {
        self.qps.get(qp)
    }

    fn healthy(&self) -> usize {
        self.qps.iter().filter(|q| !q.is_broken()).count()
    }

    /// Submits a batch of `n_wrs` planned work requests. Returns its result at once when it is
    /// empty or the peer has no healthy queue pair left.
    pub fn submit(&mut self, batch: BatchId, n_wrs: u32) -> Option<BatchResult> {
        if n_wrs == 0 {
            return Some((batch, Ok(())));
        }
        if self.healthy() == 0 {
            return Some((batch, Err(self.peer_lost())));
        }
        self.batches.insert(
            batch,
            BatchState {
                unposted: n_wrs,
                inflight: 0,
                error: None,
            },
        );
        self.pending.extend((0..n_wrs).map(|wr| (batch, wr)));
        None
    }

    fn peer_lost(&self) -> VerbsError {
        VerbsError::PeerLost(format!(
            "all {} queue pairs to the peer failed",
            self.qps.len()
        ))
    }

    fn live(&self, batch: BatchId) -> bool {
        self.batches.get(&batch).is_some_and(|b| b.error.is_none())
    }

    /// Hands out the next posts: each healthy queue pair gets its share of the pending work
    /// requests, bounded by its free slots and `max_wr_per_post`.
    pub fn schedule(&mut self) -> Vec<Post> {
        let mut posts = Vec::new();
        let n = self.qps.len();
        loop {
            let healthy = self.healthy();
            if healthy == 0 || self.pending.is_empty() {
                break;
            }
            let share = self.pending.len().div_ceil(healthy);
            let mut progressed = false;
            for k in 0..n {
                let qp = (self.rr + k) % n;
                let take = (self.qps[qp].free() as usize)
                    .min(self.cfg.max_wr_per_post as usize)
                    .min(share);
                let mut items = Vec::with_capacity(take);
                while items.len() < take {
                    let Some((batch, wr)) = self.pending.pop_front() else {
                        break;
                    };
                    if !self.live(batch) {
                        continue; // its batch already failed
                    }
                    let Some(b) = self.batches.get_mut(&batch) else {
                        continue;
                    };
                    b.unposted -= 1;
                    b.inflight += 1;
                    let last_of_batch = b.unposted == 0;
                    let last_of_post = items.len() + 1 == take || self.pending.is_empty();
                    let slot = self.qps[qp].push(batch, wr, last_of_batch, last_of_post);
                    items.push(PostItem {
                        wr_id: slot.wr_id,
                        batch,
                        wr,
                        signaled: slot.signaled,
                    });
                }
                if let Some(last) = items.last() {
                    if !last.signaled {
                        // the pending queue ran dry of live items early: the post's last work
                        // request must still be signalled; re-flag it
                        self.force_signal_last(qp, &mut items);
                    }
                    progressed = true;
                    posts.push(Post { qp, items });
                }
            }
            self.rr = (self.rr + 1) % n.max(1);
            if !progressed {
                break;
            }
        }
        posts
    }

    fn force_signal_last(&mut self, qp: usize, items: &mut [PostItem]) {
        if let Some(last) = items.last_mut() {
            let undone = self.qps[qp].unpush(1);
            if let Some(s) = undone.first() {
                let again = self.qps[qp].push(s.batch, s.wr, true, true);
                last.wr_id = again.wr_id;
                last.signaled = again.signaled;
            }
        }
    }

    /// Accounts a work completion from queue pair `qp`; returns the batches that finished.
    pub fn on_completion(
        &mut self,
        qp: usize,
        wr_id: u64,
        status: u32,
        vendor_err: u32,
    ) -> Vec<BatchResult> {
        let Some(q) = self.qps.get_mut(qp) else {
            self.stats.ignored += 1;
            return Vec::new();
        };
        let mut out = Vec::new();
        match q.complete(wr_id, status) {
            CompletionOutcome::Retired(slots) => self.retire(&slots, &mut out),
            CompletionOutcome::Failed {
                done,
                failed,
                flushed,
            } => {
                self.retire(&done, &mut out);
                self.stats.failed_wrs += 1;
                let err = VerbsError::Completion {
                    qpn: self.qpns.get(qp).copied().unwrap_or(0),
                    status,
                    status_name: wc_status_name(status),
                    vendor_err,
                };
                self.fail_slot(failed, err, &mut out);
                self.requeue(&flushed, &mut out);
            }
            CompletionOutcome::Flushed(slots) => self.requeue(&slots, &mut out),
            CompletionOutcome::Ignored(IgnoreReason::Broken) => {}
            CompletionOutcome::Ignored(_) => self.stats.ignored += 1,
        }
        self.fail_all_if_no_qp(&mut out);
        out
    }

    /// The post carrying `n` work requests on `qp` (the last `n` handed out for it) failed
    /// before reaching the device: the queue pair is treated as broken and everything on it is
    /// re-queued elsewhere or failed.
    pub fn post_failed(&mut self, qp: usize) -> Vec<BatchResult> {
        self.qp_broken(qp)
    }

    /// Queue pair `qp` is unusable (fatal asynchronous event, failed post): its outstanding work
    /// requests are re-queued on the others, or failed when none is left.
    pub fn qp_broken(&mut self, qp: usize) -> Vec<BatchResult> {
        let mut out = Vec::new();
        if let Some(q) = self.qps.get_mut(qp) {
            let slots = q.break_all();
            self.requeue(&slots, &mut out);
        }
        self.fail_all_if_no_qp(&mut out);
        out
    }

    /// Fails every open batch (shutdown).
    pub fn close(&mut self, err: VerbsError) -> Vec<BatchResult> {
        self.pending.clear();
        let mut out: Vec<BatchResult> = self
            .batches
            .drain()
            .map(|(id, b)| (id, Err(b.error.unwrap_or_else(|| err.clone()))))
            .collect();
        out.sort_by_key(|r| r.0);
        out
    }

    fn retire(&mut self, slots: &[Slot], out: &mut Vec<BatchResult>) {
        for s in slots {
            if let Some(b) = self.batches.get_mut(&s.batch) {
                b.inflight = b.inflight.saturating_sub(1);
            }
            self.maybe_finish(s.batch, out);
        }
    }

    fn fail_slot(&mut self, slot: Slot, err: VerbsError, out: &mut Vec<BatchResult>) {
        if let Some(b) = self.batches.get_mut(&slot.batch) {
            b.inflight = b.inflight.saturating_sub(1);
            b.unposted = 0; // its pending entries are skipped lazily
            b.error.get_or_insert(err);
        }
        self.maybe_finish(slot.batch, out);
    }

    fn requeue(&mut self, slots: &[Slot], out: &mut Vec<BatchResult>) {
        let healthy = self.healthy() > 0;
        for s in slots.iter().rev() {
            let Some(b) = self.batches.get_mut(&s.batch) else {
                continue;
            };
            b.inflight = b.inflight.saturating_sub(1);
            if b.error.is_some() {
                continue;
            }
            if healthy {
                b.unposted += 1;
                self.pending.push_front((s.batch, s.wr));
                self.stats.requeued += 1;
            } else {
                b.unposted = 0;
                b.error = Some(VerbsError::PeerLost(format!(
                    "all {} queue pairs to the peer failed",
                    self.qps.len()
                )));
            }
        }
        for s in slots {
            self.maybe_finish(s.batch, out);
        }
    }

    fn fail_all_if_no_qp(&mut self, out: &mut Vec<BatchResult>) {
        if self.healthy() > 0 {
            return;
        }
        let err = self.peer_lost();
        self.pending.clear();
        let ids: Vec<BatchId> = self.batches.keys().copied().collect();
        for id in ids {
            if let Some(b) = self.batches.get_mut(&id) {
                b.unposted = 0;
                b.error.get_or_insert_with(|| err.clone());
            }
            self.maybe_finish(id, out);
        }
    }

    fn maybe_finish(&mut self, batch: BatchId, out: &mut Vec<BatchResult>) {
        let finished = self
            .batches
            .get(&batch)
            .is_some_and(|b| b.inflight == 0 && (b.unposted == 0 || b.error.is_some()));
        if finished && let Some(b) = self.batches.remove(&batch) {
            out.push((batch, b.error.map_or(Ok(()), Err)));
        }
    }
}

#[cfg(test)]
#[path = "sched_tests.rs"]
mod tests;
