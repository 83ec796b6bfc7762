//! A transfer shard's job queue and the bell its worker sleeps on.
//!
//! The engine's loop sends jobs ([`JobSender::send`]); the shard's worker, and the worker that
//! replaces it after a fault, takes them ([`JobQueue::try_recv`]). A worker waits for two kinds
//! of event at once — a new job, and progress of a batch it posted (a window acknowledged, a
//! connection lost) — so both ring one [`Bell`]: every send rings it, and the batches are polled
//! with a waker that rings it. The worker therefore sleeps in one place and never blocks on one
//! decode's batch while another decode's job waits.

use std::sync::mpsc::{Receiver, SendError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::task::Wake;
use std::time::Duration;

use super::Job;

/// A flag with a condition variable: [`Bell::ring`] sets it and wakes the sleeper,
/// [`Bell::wait`] sleeps until it is set (or a timeout) and clears it. A ring before the wait
/// is not lost.
#[derive(Debug, Default)]
pub struct Bell {
    rung: Mutex<bool>,
    cv: Condvar,
}

impl Bell {
    /// Sets the flag and wakes the thread waiting on it.
    pub fn ring(&self) {
        let mut rung = self
            .rung
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if std::mem::replace(&mut *rung, true) {
            return;
        }
        // Woken after the lock is let go, so that the sleeper does not wake into a held lock.
        // Nothing is lost: the sleeper checks the flag under the lock before it sleeps.
        drop(rung);
        self.cv.notify_one();
    }

    /// Waits until the flag is set or `timeout` passes, then clears it; true when it was rung.
    pub fn wait(&self, timeout: Duration) -> bool {
        let rung = self
            .rung
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut rung, _) = self
            .cv
            .wait_timeout_while(rung, timeout, |r| !*r)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut *rung)
    }
}

impl Wake for Bell {
    fn wake(self: Arc<Self>) {
        self.ring();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ring();
    }
}

/// The end of a shard's queue that its worker (and its replacement) reads.
#[derive(Debug)]
pub struct JobQueue {
    rx: Mutex<Receiver<Job>>,
    bell: Arc<Bell>,
}

impl JobQueue {
    /// The next job, if one was sent; `Err(Disconnected)` once the loop's end is gone.
    pub fn try_recv(&self) -> Result<Job, TryRecvError> {
        self.rx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .try_recv()
    }

    /// The bell that every send rings (and the worker's batches ring through their waker).
    pub fn bell(&self) -> &Arc<Bell> {
        &self.bell
    }
}

/// The engine loop's end of a shard's queue.
#[derive(Debug, Clone)]
pub struct JobSender {
    tx: Sender<Job>,
    bell: Arc<Bell>,
}

impl JobSender {
    /// Queues `job` and rings the worker's bell; the job comes back when the queue's reading
    /// end is gone.
    pub fn send(&self, job: Job) -> Result<(), SendError<Job>> {
        self.tx.send(job)?;
        self.bell.ring();
        Ok(())
    }
}

/// A new, empty shard queue: the loop's end and the worker's.
pub fn job_queue() -> (JobSender, Arc<JobQueue>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let bell = Arc::new(Bell::default());
    (
        JobSender {
            tx,
            bell: bell.clone(),
        },
        Arc::new(JobQueue {
            rx: Mutex::new(rx),
            bell,
        }),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::task::Waker;

    use super::*;

    #[test]
    fn a_ring_before_the_wait_is_kept_and_cleared_by_it() {
        let bell = Bell::default();
        bell.ring();
        bell.ring();
        assert!(bell.wait(Duration::from_secs(5)));
        // Cleared: the next wait times out.
        assert!(!bell.wait(Duration::from_millis(1)));
    }

    #[test]
    fn a_waker_and_a_send_wake_the_sleeper() {
        let (tx, queue) = job_queue();
        let waker = Waker::from(queue.bell().clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            waker.wake_by_ref();
        });
        assert!(queue.bell().wait(Duration::from_secs(30)));
        t.join().unwrap();
        // Nothing was sent; a dropped sender disconnects the queue.
        assert!(matches!(queue.try_recv(), Err(TryRecvError::Empty)));
        drop(tx);
        assert!(matches!(queue.try_recv(), Err(TryRecvError::Disconnected)));
    }
}
