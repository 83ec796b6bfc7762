//! Batch completion shared by the socket backends (`tcp`, `mooncake`): a batch is answered only
//! when nothing of it can still reach the peer.
//!
//! A session cuts a batch into units (tcp windows, mooncake request groups) and [`post`]s them
//! through its bounded queue. Each unit carries a [`Ticket`] that finishes exactly once:
//! explicitly (acknowledged, rejected, failed with its connection — the caller finishes it only
//! after the connection's socket is shut down) or, dropped unfinished, as never sent. The first
//! failure marks the batch failed, so writers drop its units not yet on the wire
//! ([`Ticket::is_cancelled`], one atomic load) and [`post`] stops queueing; the batch's future
//! resolves once every ticket finished. A dropped future cancels the batch's queued units too.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};

use crate::error::TransportError;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One batch's completion state, shared by its units' tickets.
struct BatchState {
    /// Units not finished yet.
    left: AtomicUsize,
    /// Set on the first failure: the batch's units not yet sent are cancelled.
    failed: AtomicBool,
    /// The first failure.
    error: Mutex<Option<TransportError>>,
    /// Fired when the last unit finished.
    done: Mutex<Option<oneshot::Sender<()>>>,
}

impl BatchState {
    fn fail(&self, e: TransportError) {
        lock(&self.error).get_or_insert(e);
        self.failed.store(true, Ordering::Release);
    }

    fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn finish_one(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1
            && let Some(tx) = lock(&self.done).take()
        {
            let _ = tx.send(());
        }
    }
}

/// A unit's share of its batch; finishes exactly once (dropped unfinished: never sent).
pub(crate) struct Ticket {
    batch: Arc<BatchState>,
    finished: bool,
}

impl Ticket {
    /// Finishes the unit: `Ok` when the peer applied it, else the batch fails with `r`'s error
    /// (the first error of a batch is the one it reports). Later calls do nothing.
    pub(crate) fn finish(&mut self, r: Result<(), TransportError>) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        if let Err(e) = r {
            self.batch.fail(e);
        }
        self.batch.finish_one();
    }

    /// True once the batch failed: a unit not yet on the wire must be dropped, not sent.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.batch.is_failed()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Never sent: cancelled (its batch failed) or left without a live connection.
        self.finish(Err(TransportError::Closed));
    }
}

/// Marks a batch failed when its future is dropped before it resolved.
struct CancelOnDrop(Option<Arc<BatchState>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            b.fail(TransportError::Closed);
        }
    }
}

/// How long a caller whose units all went out inline waits for their completion on its own
/// thread (yielding the CPU between checks) before it parks. About a loopback round trip of
/// a 64 KiB write: parked, the caller is woken by a futex from the acknowledgement thread, and
/// on a virtual machine whose other vCPU idles that wake-up alone can take 40-60 us.
const INLINE_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Yields the thread until every unit of `batch` finished or [`INLINE_SPIN`] passed.
fn spin_until_done(batch: &BatchState) {
    let start = std::time::Instant::now();
    while batch.left.load(Ordering::Acquire) != 0 && start.elapsed() < INLINE_SPIN {
        std::thread::yield_now();
    }
}

/// True when the thread polling a batch's future is its own to block for a moment: it is not
/// running a tokio task (a runtime worker that other tasks wait for) nor inside a
/// current-thread runtime (whose only thread runs every task). That is a plain thread driving
/// the future with `Handle::block_on` on a multi-thread runtime — kvx-cli's prefill workers,
/// `kvx send` — or with no runtime at all (a `spawn_blocking` closure counts as a task). Only such a caller sends units inline (a partly
/// taken window is finished with a blocking write) and yields-spins for their completion.
fn caller_may_block() -> bool {
    if tokio::task::try_id().is_some() {
        return false;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(h) => h.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread,
        Err(_) => true,
    }
}

/// Makes one unit per planned item (`make(item, ticket)`), queues them on `tx` in order and
/// waits until every unit finished. While the queue is empty and the caller's thread may block
/// (see [`caller_may_block`]), a unit is first offered to `inline` (a session may put it on an
/// idle connection from the caller's thread, saving the hand-off to a writer thread); `inline`
/// returns the units it did not take. Stops queueing once the batch failed (units never queued
/// are dropped, that is cancelled). A failure without a cause of its own (units dropped unsent
/// because no writer is left) is reported as `dead_error()`.
pub(crate) async fn post<P, T>(
    planned: Vec<P>,
    make: impl Fn(P, Ticket) -> T,
    mut inline: impl FnMut(T) -> Option<T>,
    tx: mpsc::Sender<T>,
    dead_error: impl Fn() -> TransportError,
) -> Result<(), TransportError> {
    if planned.is_empty() {
        return Ok(());
    }
    let (done_tx, done_rx) = oneshot::channel();
    let batch = Arc::new(BatchState {
        left: AtomicUsize::new(planned.len()),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        done: Mutex::new(Some(done_tx)),
    });
    let mut guard = CancelOnDrop(Some(batch.clone()));
    // Every unit exists before the first is queued, so each one finishes exactly once.
    let units: Vec<T> = planned
        .into_iter()
        .map(|p| {
            make(
                p,
                Ticket {
                    batch: batch.clone(),
                    finished: false,
                },
            )
        })
        .collect();
    let mut units = units.into_iter();
    let may_block = caller_may_block();
    let mut all_inline = may_block;
    for u in units.by_ref() {
        if batch.is_failed() {
            break;
        }
        let u = if may_block && tx.capacity() == tx.max_capacity() {
            match inline(u) {
                Some(u) => u,
                None => continue,
            }
        } else {
            u
        };
        all_inline = false;
        match tx.reserve().await {
            Ok(permit) if !batch.is_failed() => permit.send(u),
            Ok(_) => break,
            Err(_) => {
                batch.fail(dead_error());
                break;
            }
        }
    }
    // Not queued: cancelled here.
    drop(units);
    if all_inline {
        spin_until_done(&batch);
    }
    let _ = done_rx.await;
    guard.0 = None;
    let e = lock(&batch.error).take();
    match e {
        None => Ok(()),
        Some(TransportError::Closed) => Err(dead_error()),
        Some(e) => Err(e),
    }
}

/// A batch built outside [`post`], for the sessions' unit tests: its tickets, and its state.
#[cfg(test)]
pub(crate) struct TestBatch(Arc<BatchState>);

#[cfg(test)]
impl TestBatch {
    /// A batch of `n` units and their tickets.
    pub(crate) fn new(n: usize) -> (TestBatch, Vec<Ticket>) {
        let b = Arc::new(BatchState {
            left: AtomicUsize::new(n),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            done: Mutex::new(None),
        });
        let tickets = (0..n)
            .map(|_| Ticket {
                batch: b.clone(),
                finished: false,
            })
            .collect();
        (TestBatch(b), tickets)
    }

    /// Units not finished yet.
    pub(crate) fn left(&self) -> usize {
        self.0.left.load(Ordering::Acquire)
    }

    /// The batch's first failure, if any.
    pub(crate) fn error(&self) -> Option<TransportError> {
        lock(&self.0.error).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_thread_outside_every_task_may_block() {
        // A plain thread, and one driving a multi-thread runtime's `block_on` (a prefill
        // worker, `kvx send`), may; a runtime worker's task or a current-thread runtime may not.
        assert!(caller_may_block());
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        assert!(multi.block_on(async { caller_may_block() }));
        assert!(multi.handle().block_on(async { caller_may_block() }));
        let in_task = multi.block_on(async { tokio::spawn(async { caller_may_block() }).await });
        assert_eq!(in_task.ok(), Some(false));
        // A blocking-pool closure is a task too: conservatively, it may not.
        let in_blocking =
            multi.block_on(async { tokio::task::spawn_blocking(caller_may_block).await });
        assert_eq!(in_blocking.ok(), Some(false));
        let current = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        assert!(!current.block_on(async { caller_may_block() }));
    }
}
