//! Send-queue accounting for one queue pair: window, selective signalling, completions.
//!
//! A send queue slot is freed only when a *signalled* completion arrives for that work request
//! or a later one, so [`SendQueue`] tracks every posted work request (in posting order, with its
//! `wr_id`) until a signalled completion retires it. It decides which work requests are
//! signalled: every `signal_every`-th one, the last of a batch and the last of a post, so the
//! unsignalled run never exceeds `signal_every - 1` and no posted work request is left without a
//! later signalled one. The window never exceeds `depth`.
//!
//! Completions are attributed here. On reliable-connected queue pairs work requests complete in
//! order, so a successful completion for `wr_id` retires every work request up to it. An error
//! completion names the work request that failed; those before it succeeded, those after it are
//! flushed (they did not fail themselves and may be retried elsewhere), and the queue pair is
//! broken from then on.

use std::collections::VecDeque;

use super::error::{WC_SUCCESS, WC_WR_FLUSH_ERR};

/// Identifier of a batch as the scheduler knows it.
pub type BatchId = u64;

/// One posted work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The `wr_id` it was posted with (per queue pair, increasing).
    pub wr_id: u64,
    /// The batch it belongs to.
    pub batch: BatchId,
    /// Its index in the batch's plan.
    pub wr: u32,
    /// Whether it was posted signalled.
    pub signaled: bool,
}

/// What one work completion meant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompletionOutcome {
    /// These work requests completed successfully.
    Retired(Vec<Slot>),
    /// A work request failed. `done` completed before it, `flushed` were posted after it and
    /// never ran; the queue pair is now broken.
    Failed {
        /// Completed successfully.
        done: Vec<Slot>,
        /// The work request that failed.
        failed: Slot,
        /// Flushed, not executed.
        flushed: Vec<Slot>,
    },
    /// The queue pair was flushed (moved to the error state without a failing work request of
    /// its own): every outstanding work request is returned, none is known to have failed.
    Flushed(Vec<Slot>),
    /// The completion does not match any outstanding work request (stale, duplicate, or after
    /// the queue pair broke); nothing changed.
    Ignored(IgnoreReason),
}

/// Why a completion was ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IgnoreReason {
    /// No outstanding work request has this `wr_id`.
    UnknownWrId,
    /// A successful completion for a work request posted unsignalled.
    Unsignaled,
    /// The queue pair already broke; late flush completions land here.
    Broken,
}

/// Send-queue state of one queue pair.
#[derive(Clone, Debug)]
pub struct SendQueue {
    depth: u32,
    signal_every: u32,
    next_wr_id: u64,
    outstanding: VecDeque<Slot>,
    unsignaled_run: u32,
    broken: bool,
}

impl SendQueue {
    /// A queue of `depth` slots (at least 1), signalling at least every `signal_every`-th work
    /// request (clamped to `1..=depth`).
    pub fn new(depth: u32, signal_every: u32) -> Self {
        let depth = depth.max(1);
        SendQueue {
            depth,
            signal_every: signal_every.clamp(1, depth),
            next_wr_id: 1,
            outstanding: VecDeque::with_capacity(depth as usize),
            unsignaled_run: 0,
            broken: false,
        }
    }

    /// Slots free for new work requests (0 once broken).
    pub fn free(&self) -> u32 {
        if self.broken {
            0
        } else {
            self.depth - self.outstanding.len() as u32
        }
    }

    /// Posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// True once an error completion arrived.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Marks the queue pair broken (asynchronous fatal event, failed post) and returns every
    /// outstanding work request as flushed.
    pub fn break_all(&mut self) -> Vec<Slot> {
        self.broken = true;
        self.unsignaled_run = 0;
        self.outstanding.drain(..).collect()
    }

    /// Records one work request about to be posted and returns its slot (`wr_id`, signalled).
    ///
    /// The caller must not push more than [`SendQueue::free`] work requests. `last_of_batch`
    /// and `last_of_post` force signalling.
    pub fn push(
        &mut self,
        batch: BatchId,
        wr: u32,
        last_of_batch: bool,
        last_of_post: bool,
    ) -> Slot {
        debug_assert!(self.free() > 0, "send queue overrun");
        let signaled =
            last_of_batch || last_of_post || self.unsignaled_run + 1 >= self.signal_every;
        self.unsignaled_run = if signaled { 0 } else { self.unsignaled_run + 1 };
        let slot = Slot {
            wr_id: self.next_wr_id,
            batch,
            wr,
            signaled,
        };
        self.next_wr_id += 1;
        self.outstanding.push_back(slot);
        slot
    }

    /// Undoes the last `n` pushes (the post that was to carry them failed before any reached
    /// the device).
    pub fn unpush(&mut self, n: usize) -> Vec<Slot> {
        let keep = self.outstanding.len().saturating_sub(n);
        let undone: Vec<Slot> = self.outstanding.drain(keep..).collect();
        self.unsignaled_run = 0;
        undone
    }

    /// Accounts one work completion.
    pub fn complete(&mut self, wr_id: u64, status: u32) -> CompletionOutcome {
        if self.broken {
            return CompletionOutcome::Ignored(IgnoreReason::Broken);
        }
        // wr_ids are increasing along the queue
        let Ok(pos) = self.outstanding.binary_search_by_key(&wr_id, |s| s.wr_id) else {
            return CompletionOutcome::Ignored(IgnoreReason::UnknownWrId);
        };
        match status {
            WC_SUCCESS => {
                if !self.outstanding[pos].signaled {
                    return CompletionOutcome::Ignored(IgnoreReason::Unsignaled);
                }
                CompletionOutcome::Retired(self.outstanding.drain(..=pos).collect())
            }
            WC_WR_FLUSH_ERR => CompletionOutcome::Flushed(self.break_all()),
            _ => {
                let done: Vec<Slot> = self.outstanding.drain(..pos).collect();
                let mut rest = self.break_all().into_iter();
                match rest.next() {
                    Some(failed) => CompletionOutcome::Failed {
                        done,
                        failed,
                        flushed: rest.collect(),
                    },
                    None => CompletionOutcome::Retired(done),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_every_nth_and_last() {
        let mut q = SendQueue::new(16, 4);
        let flags: Vec<bool> = (0..10)
            .map(|i| q.push(1, i, i == 9, false).signaled)
            .collect();
        assert_eq!(
            flags,
            [
                false, false, false, true, false, false, false, true, false, true
            ]
        );
        assert_eq!(q.free(), 6);
    }

    #[test]
    fn signalled_completion_retires_prefix() {
        let mut q = SendQueue::new(8, 2);
        let s: Vec<Slot> = (0..4).map(|i| q.push(7, i, i == 3, false)).collect();
        assert!(!s[0].signaled && s[1].signaled);
        assert_eq!(
            q.complete(s[0].wr_id, WC_SUCCESS),
            CompletionOutcome::Ignored(IgnoreReason::Unsignaled)
        );
        match q.complete(s[1].wr_id, WC_SUCCESS) {
            CompletionOutcome::Retired(r) => assert_eq!(r, s[..2]),
            o => panic!("{o:?}"),
        }
        assert_eq!(q.free(), 6);
        assert_eq!(
            q.complete(s[1].wr_id, WC_SUCCESS),
            CompletionOutcome::Ignored(IgnoreReason::UnknownWrId)
        );
    }

    #[test]
    fn error_splits_done_failed_flushed() {
        let mut q = SendQueue::new(8, 8);
        let s: Vec<Slot> = (0..5).map(|i| q.push(i as u64, 0, true, false)).collect();
        match q.complete(s[2].wr_id, 10) {
            CompletionOutcome::Failed {
                done,
                failed,
                flushed,
            } => {
                assert_eq!(done, s[..2]);
                assert_eq!(failed, s[2]);
                assert_eq!(flushed, s[3..]);
            }
            o => panic!("{o:?}"),
        }
        assert!(q.is_broken());
        assert_eq!(q.free(), 0);
        assert_eq!(
            q.complete(s[3].wr_id, WC_WR_FLUSH_ERR),
            CompletionOutcome::Ignored(IgnoreReason::Broken)
        );
    }

    #[test]
    fn flush_without_failure_returns_everything() {
        let mut q = SendQueue::new(8, 8);
        let s: Vec<Slot> = (0..3).map(|i| q.push(1, i, i == 2, false)).collect();
        assert_eq!(
            q.complete(s[2].wr_id, WC_WR_FLUSH_ERR),
            CompletionOutcome::Flushed(s)
        );
    }
}
