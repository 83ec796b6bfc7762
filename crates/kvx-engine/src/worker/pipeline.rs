//! What a worker has in flight and how each job gets there: which job may start next
//! ([`next_job`]), starting it ([`start`]: checks, then a batch posted on the cached data
//! session, or the session opened first), and answering what completed ([`poll_posted`], or
//! [`drain`] when the worker stops or dies).
//!
//! Nothing here blocks on one decode: a session is opened by a future polled beside the batches
//! in flight (a decode whose data port does not answer holds only its own jobs until the connect
//! timeout), and a session's batches are answered in post order while different sessions'
//! complete independently.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TryRecvError;
use std::task::{Poll, Waker};
use std::time::Instant;

use kvx_core::SessionId;
use kvx_rdma::{BatchReport, BoxFuture, Session, TransportError};

use super::{
    Cached, DEPTH, Job, JobQueue, MAX_HELD, MAX_POSTED, Outcome, Sessions, Work, WorkerCtx,
    stage_writes,
};
use crate::busy::Busy;
use crate::fault::WorkerFault;

/// A posted batch, waiting for its completion.
pub(super) struct Writing {
    fut: BoxFuture<'static, Result<BatchReport, TransportError>>,
    /// When it was posted (`kvx_batch_latency_seconds`).
    t0: Instant,
    /// When the session it was posted on was opened.
    opened: Instant,
    /// Runs the rank's transfer busy clock until the completion was awaited.
    _busy: Busy,
}

/// A job waiting for its decode session to open (its batch is posted once it is).
pub(super) struct Opening {
    fut: BoxFuture<'static, Result<Arc<dyn Session>, TransportError>>,
    /// When the open began (a failure marks the session dead as of then).
    began: Instant,
}

/// What a posted job is waiting for.
pub(super) enum Slot {
    /// Its batch's completion.
    Writing(Writing),
    /// Its session's open.
    Opening(Opening),
}

/// The jobs a worker has in flight, in the order it started them.
pub(super) type Posted = VecDeque<(Job, Slot)>;

/// What starting a job came to.
pub(super) enum Started {
    /// A [`Work::Connect`] found its session open or marked dead: nothing to report.
    Connected,
    /// Nothing to wait for (skipped, failed before a write, or already complete).
    Done(Outcome),
    /// In flight: a batch posted, or a session being opened.
    Posted(Slot),
}

/// Jobs in flight towards `session`: a session being opened counts as [`DEPTH`] (its later jobs
/// wait for it).
fn posted_to(posted: &Posted, session: &SessionId) -> usize {
    let mut n = 0;
    for (j, slot) in posted {
        if &j.session == session {
            if matches!(slot, Slot::Opening(_)) {
                return DEPTH;
            }
            n += 1;
        }
    }
    n
}

/// The next job the worker may start, from the jobs it holds (in the order taken) or else from
/// its queue; `Ok(None)` when none may start now. A job whose session has [`DEPTH`] jobs in
/// flight (or is being opened), or an earlier job held, is held (at most [`MAX_HELD`]). A staged
/// chunk gathered into the staging buffer starts alone, once nothing is in flight, and nothing
/// passes it; nothing starts beside it. At most [`MAX_POSTED`] jobs are in flight.
pub(super) fn next_job(
    queue: &JobQueue,
    posted: &Posted,
    held: &mut VecDeque<Job>,
) -> Result<Option<Job>, TryRecvError> {
    if posted.len() >= MAX_POSTED || posted.iter().any(|(j, _)| j.work.uses_staging_buffer()) {
        return Ok(None);
    }
    // Sessions with a job held that may not start yet: their later jobs wait behind it.
    let mut waiting: Vec<SessionId> = Vec::new();
    for i in 0..held.len() {
        let job = &held[i];
        if job.work.uses_staging_buffer() {
            // A barrier: it starts once nothing is in flight (nothing held before it could
            // then be waiting), and nothing taken after it passes it.
            return Ok(posted.is_empty().then(|| held.remove(i)).flatten());
        }
        if waiting.contains(&job.session) {
            continue;
        }
        if posted_to(posted, &job.session) < DEPTH {
            return Ok(held.remove(i));
        }
        waiting.push(job.session.clone());
    }
    while held.len() < MAX_HELD {
        let job = queue.try_recv()?;
        let alone = job.work.uses_staging_buffer();
        if alone && !(posted.is_empty() && held.is_empty()) {
            held.push_back(job);
            return Ok(None);
        }
        if !alone && (waiting.contains(&job.session) || posted_to(posted, &job.session) >= DEPTH) {
            waiting.push(job.session.clone());
            held.push_back(job);
            continue;
        }
        return Ok(Some(job));
    }
    Ok(None)
}

/// Starts one job: checks (cancelled, session marked dead, fault points), then posts its batch on
/// the cached session, or begins opening the session. Outer error: fatal for the worker.
pub(super) fn start(
    ctx: &Arc<WorkerCtx>,
    shard: usize,
    sessions: &mut Sessions,
    job: &mut Job,
) -> Result<Started, WorkerFault> {
    let session = &job.session;
    if matches!(job.work, Work::Connect) {
        // Open the session ahead of a room unless it is open or marked dead.
        if ctx.dead_cause(session).is_some() {
            preconnect_outcome("dead");
            return Ok(Started::Connected);
        }
        if cached(ctx, sessions, session).is_some() {
            preconnect_outcome("open");
            return Ok(Started::Connected);
        }
        return Ok(Started::Posted(open(ctx, session)));
    }
    // A job queued before its room failed is completed without any work.
    if job.cancel.load(Ordering::Acquire) {
        return Ok(Started::Done(Outcome::Skipped));
    }
    crate::timeline::stage!(job.room, "worker");
    if let Some(done) = dead(ctx, sessions, job) {
        return Ok(done);
    }
    fail::fail_point!("kvx::transfer_worker::batch", |arg| Err(
        WorkerFault::Injected {
            point: "kvx::transfer_worker::batch",
            detail: arg.unwrap_or_default(),
        }
    ));
    fail::fail_point!("kvx::transfer_worker::chunk", |arg| Ok(Started::Done(
        Outcome::RoomFailed(format!(
            "injected per-room fault: {}",
            arg.unwrap_or_default()
        ))
    )));
    if job.cancel.load(Ordering::Acquire) {
        // Failed (or gone) while the fault points ran: nothing to write.
        return Ok(Started::Done(Outcome::Skipped));
    }
    Ok(match cached(ctx, sessions, &job.session) {
        Some((s, opened)) => post_on(ctx, shard, sessions, job, &s, opened),
        None => Started::Posted(open(ctx, &job.session)),
    })
}

/// `Done(PeerFailed)` when `job`'s session is marked dead (nothing written, no connect).
fn dead(ctx: &WorkerCtx, sessions: &mut Sessions, job: &Job) -> Option<Started> {
    let session = &job.session;
    let cause = ctx.dead_cause(session)?;
    sessions.remove(session);
    metrics::counter!("kvx_batches_skipped_total", "reason" => "session_dead").increment(1);
    Some(Started::Done(Outcome::PeerFailed(format!(
        "Decode instance could be dead, remote session {session} is not alive ({cause})"
    ))))
}

/// The cached session to `session`'s decode while it is alive and its decode did not register
/// again since it was opened (its idle clock restarted), with when it was opened; `None` (and
/// the stale entry dropped) otherwise.
fn cached(
    ctx: &WorkerCtx,
    sessions: &mut Sessions,
    session: &SessionId,
) -> Option<(Arc<dyn Session>, Instant)> {
    match sessions.get_mut(session) {
        Some(c) if c.session.is_alive() && !ctx.revived_since(session, c.opened) => {
            c.used = Instant::now();
            Some((c.session.clone(), c.opened))
        }
        Some(_) => {
            sessions.remove(session);
            None
        }
        None => None,
    }
}

/// Begins opening a data session to `session`'s decode.
fn open(ctx: &Arc<WorkerCtx>, session: &SessionId) -> Slot {
    let (ctx, peer) = (ctx.clone(), session.to_string());
    Slot::Opening(Opening {
        fut: Box::pin(async move { ctx.plane.open_session(&peer).await }),
        began: Instant::now(),
    })
}

fn preconnect_outcome(outcome: &'static str) {
    metrics::counter!("kvx_session_preconnects_total", "outcome" => outcome).increment(1);
}

/// Posts `job`'s batch (a staged chunk's writes gathered first) on `s`, opened at `opened`: its
/// first poll queues its windows, or sends a small one from this thread.
fn post_on(
    ctx: &WorkerCtx,
    shard: usize,
    sessions: &mut Sessions,
    job: &mut Job,
    s: &Arc<dyn Session>,
    opened: Instant,
) -> Started {
    let room = job.room;
    let ops = match &mut job.work {
        Work::Batch { ops, .. } => std::mem::take(ops),
        Work::Stage(w) => match stage_writes(ctx, shard, w, s.gathers_sources()) {
            Ok(ops) => ops,
            Err(e) => {
                return Started::Done(Outcome::RoomFailed(format!(
                    "staging chunk {} of {room}: {e}",
                    w.key.chunk_idx
                )));
            }
        },
        Work::Connect => return Started::Connected,
    };
    let busy = ctx.busy.enter();
    let t0 = Instant::now();
    let mut fut = s.write_batch(ops);
    // The first poll posts the batch; a batch that completes at once needs no second wait.
    let first = {
        let _rt = ctx.rt.enter();
        let mut cx = std::task::Context::from_waker(Waker::noop());
        fut.as_mut().poll(&mut cx)
    };
    let w = Writing {
        fut,
        t0,
        opened,
        _busy: busy,
    };
    match first {
        Poll::Ready(r) => Started::Done(completed(ctx, sessions, job, &w, r)),
        Poll::Pending => Started::Posted(Slot::Writing(w)),
    }
}

/// `job`'s session open ended with `r`: the session is cached and the job goes on (a
/// [`Work::Connect`] is done; a batch is posted unless its room failed or its session was marked
/// dead meanwhile), or the session is marked dead and the job fails with it.
fn opened(
    ctx: &WorkerCtx,
    shard: usize,
    sessions: &mut Sessions,
    job: &mut Job,
    began: Instant,
    r: Result<Arc<dyn Session>, TransportError>,
) -> Started {
    let session = job.session.clone();
    let connect = matches!(job.work, Work::Connect);
    match r {
        Ok(s) => {
            let c = Cached {
                session: s.clone(),
                used: Instant::now(),
                opened: began,
            };
            sessions.insert(session, c);
            if connect {
                preconnect_outcome("opened");
                return Started::Connected;
            }
            if job.cancel.load(Ordering::Acquire) {
                return Started::Done(Outcome::Skipped);
            }
            if let Some(done) = dead(ctx, sessions, job) {
                return done;
            }
            post_on(ctx, shard, sessions, job, &s, began)
        }
        Err(e) => {
            sessions.remove(&session);
            ctx.mark_dead(&session, &e.to_string(), began);
            let reason = peer_failed(&session, &e);
            if connect {
                // The session is marked dead: the room's first batch reports it.
                tracing::warn!(%session, "{reason} (opening it ahead of a room)");
                preconnect_outcome("failed");
                return Started::Connected;
            }
            Started::Done(Outcome::PeerFailed(reason))
        }
    }
}

/// What polling the jobs in flight came to.
pub(super) enum Polled {
    /// A job completed and was taken out of the posted ones: report it.
    Done(Job, Outcome),
    /// Something moved without a report (a session opened and its batch posted, a
    /// [`Work::Connect`] done): poll again.
    Moved,
    /// Polling a job panicked (the worker dies on it).
    Panicked(Job, WorkerFault),
    /// Nothing completed; every job that may be answered next has the bell's waker.
    Pending,
}

/// Polls each session's oldest job in flight (a session's batches are answered in post order)
/// with `waker`, and handles the first that completed.
pub(super) fn poll_posted(
    ctx: &WorkerCtx,
    shard: usize,
    sessions: &mut Sessions,
    posted: &mut Posted,
    waker: &Waker,
) -> Polled {
    let mut cx = std::task::Context::from_waker(waker);
    let _rt = ctx.rt.enter();
    for i in 0..posted.len() {
        let first = match posted.get(i) {
            Some((job, _)) => !posted.iter().take(i).any(|(j, _)| j.session == job.session),
            None => break,
        };
        if !first {
            continue;
        }
        let Some((job, slot)) = posted.get_mut(i) else {
            break;
        };
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| match slot {
            Slot::Writing(w) => match w.fut.as_mut().poll(&mut cx) {
                Poll::Ready(r) => Some(Started::Done(completed(ctx, sessions, job, w, r))),
                Poll::Pending => None,
            },
            Slot::Opening(o) => match o.fut.as_mut().poll(&mut cx) {
                Poll::Ready(r) => Some(opened(ctx, shard, sessions, job, o.began, r)),
                Poll::Pending => None,
            },
        }));
        match step {
            Ok(None) => {}
            Ok(Some(Started::Posted(slot))) => {
                if let Some(entry) = posted.get_mut(i) {
                    entry.1 = slot;
                }
                return Polled::Moved;
            }
            Ok(Some(Started::Connected)) => {
                posted.remove(i);
                return Polled::Moved;
            }
            Ok(Some(Started::Done(outcome))) => {
                let Some((job, _)) = posted.remove(i) else {
                    break;
                };
                return Polled::Done(job, outcome);
            }
            Err(p) => {
                let Some((job, _)) = posted.remove(i) else {
                    break;
                };
                return Polled::Panicked(job, WorkerFault::from_panic(p.as_ref()));
            }
        }
    }
    Polled::Pending
}

/// Waits for every job in flight, in order, and reports each (a session being opened is waited
/// for and its batch posted and waited for too; a [`Work::Connect`] is not reported); false
/// when the loop is gone. A job whose wait panics is reported [`Outcome::RoomFailed`] (the
/// worker is dying anyway).
pub(super) fn drain(
    ctx: &WorkerCtx,
    shard: usize,
    sessions: &mut Sessions,
    posted: &mut Posted,
    report: &impl Fn(Job, Outcome) -> bool,
) -> bool {
    while let Some((mut job, slot)) = posted.pop_front() {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut slot = slot;
            loop {
                match slot {
                    Slot::Writing(mut w) => {
                        let r = ctx.rt.block_on(w.fut.as_mut());
                        return Some(completed(ctx, sessions, &job, &w, r));
                    }
                    Slot::Opening(mut o) => {
                        let r = ctx.rt.block_on(o.fut.as_mut());
                        match opened(ctx, shard, sessions, &mut job, o.began, r) {
                            Started::Posted(next) => slot = next,
                            Started::Connected => return None,
                            Started::Done(outcome) => return Some(outcome),
                        }
                    }
                }
            }
        }))
        .unwrap_or_else(|p| {
            Some(Outcome::RoomFailed(format!(
                "transfer worker failed while awaiting the batch: {}",
                WorkerFault::from_panic(p.as_ref())
            )))
        });
        if let Some(outcome) = outcome
            && !report(job, outcome)
        {
            return false;
        }
    }
    true
}

/// The outcome of a batch's completion `r`.
fn completed(
    ctx: &WorkerCtx,
    sessions: &mut Sessions,
    job: &Job,
    w: &Writing,
    r: Result<BatchReport, TransportError>,
) -> Outcome {
    let (room, session) = (job.room, &job.session);
    match r {
        Ok(report) => {
            crate::timeline::stage!(room, "written");
            metrics::histogram!("kvx_batch_latency_seconds").record(w.t0.elapsed().as_secs_f64());
            metrics::counter!("kvx_transfer_batches_total").increment(1);
            metrics::counter!("kvx_transfer_bytes_total").increment(report.bytes);
            Outcome::Done
        }
        Err(e) if e.is_peer_failure() => {
            // Not a session opened since, towards the decode's new process.
            if sessions.get(session).is_some_and(|c| c.opened == w.opened) {
                sessions.remove(session);
            }
            ctx.mark_dead(session, &e.to_string(), w.opened);
            Outcome::PeerFailed(peer_failed(session, &e))
        }
        Err(e) => Outcome::RoomFailed(format!(
            "Failed to send kv chunk of {room} to {session}: {e}"
        )),
    }
}

fn peer_failed(session: &SessionId, e: &TransportError) -> String {
    metrics::counter!("kvx_session_failures_total").increment(1);
    format!("decode session {session} failed: {e}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvx_core::Room;

    use super::super::job_queue;
    use super::*;
    use crate::busy::BusyClock;

    /// A job of `session` numbered `n` (its room).
    fn job(session: &str, n: u64) -> Job {
        Job {
            room: Room::new(n).unwrap(),
            session: SessionId::new(session),
            work: Work::Connect,
            cancel: Arc::default(),
        }
    }

    /// `job` as posted: a batch that never completes.
    fn posting(job: Job, busy: &Arc<BusyClock>) -> (Job, Slot) {
        let fut: BoxFuture<'static, Result<BatchReport, TransportError>> =
            Box::pin(std::future::pending());
        let now = Instant::now();
        let w = Writing {
            fut,
            t0: now,
            opened: now,
            _busy: busy.enter(),
        };
        (job, Slot::Writing(w))
    }

    /// The room of the job [`next_job`] gives.
    fn next_room(queue: &JobQueue, posted: &Posted, held: &mut VecDeque<Job>) -> u64 {
        next_job(queue, posted, held).unwrap().unwrap().room.get()
    }

    fn rooms(held: &VecDeque<Job>) -> Vec<u64> {
        held.iter().map(|j| j.room.get()).collect()
    }

    #[test]
    fn a_session_at_its_depth_holds_its_own_jobs_and_no_one_else_s() {
        let busy = Arc::new(BusyClock::default());
        let (tx, queue) = job_queue();
        let mut posted: Posted = (1..=DEPTH as u64)
            .map(|n| posting(job("a:1", n), &busy))
            .collect();
        let mut held = VecDeque::new();
        for (s, n) in [("a:1", 10), ("b:2", 20), ("a:1", 11), ("b:2", 21)] {
            tx.send(job(s, n)).unwrap();
        }
        // `a` has DEPTH posted: its jobs are held, in order, and `b`'s pass them.
        let next = next_job(&queue, &posted, &mut held).unwrap().unwrap();
        assert_eq!(next.room.get(), 20);
        assert_eq!(rooms(&held), [10]);
        let next = next_job(&queue, &posted, &mut held).unwrap().unwrap();
        assert_eq!(next.room.get(), 21);
        assert_eq!(rooms(&held), [10, 11]);
        assert!(matches!(
            next_job(&queue, &posted, &mut held),
            Err(TryRecvError::Empty)
        ));
        // One of `a`'s batches answered: its held jobs start in the order they were taken.
        posted.pop_front();
        let next = next_job(&queue, &posted, &mut held).unwrap().unwrap();
        assert_eq!(next.room.get(), 10);
        posted.push_back(posting(next, &busy));
        // `a` is at its depth again: 11 stays held, and a new job of `a` waits behind it.
        tx.send(job("a:1", 12)).unwrap();
        assert!(matches!(
            next_job(&queue, &posted, &mut held),
            Err(TryRecvError::Empty)
        ));
        assert_eq!(rooms(&held), [11, 12]);
        posted.pop_front();
        let next = next_job(&queue, &posted, &mut held).unwrap().unwrap();
        assert_eq!(next.room.get(), 11);
        posted.push_back(posting(next, &busy));
        // The loop's end gone: seen even with a job held (the worker stops).
        drop(tx);
        assert!(matches!(
            next_job(&queue, &posted, &mut held),
            Err(TryRecvError::Disconnected)
        ));
    }

    #[test]
    fn posted_and_held_jobs_are_bounded() {
        let busy = Arc::new(BusyClock::default());
        let (tx, queue) = job_queue();
        // MAX_POSTED batches posted over several sessions: nothing more starts.
        let sessions = MAX_POSTED / DEPTH;
        let mut posted: Posted = (0..MAX_POSTED as u64)
            .map(|n| posting(job(&format!("s:{}", n as usize % sessions), n + 1), &busy))
            .collect();
        let mut held = VecDeque::new();
        tx.send(job("b:2", 1000)).unwrap();
        assert!(next_job(&queue, &posted, &mut held).unwrap().is_none());
        // A silent session's jobs fill the held list: then nothing passes them.
        let silent = "silent:9";
        posted = (1..=DEPTH as u64)
            .map(|n| posting(job(silent, n), &busy))
            .collect();
        assert_eq!(next_room(&queue, &posted, &mut held), 1000);
        for n in 0..MAX_HELD as u64 {
            tx.send(job(silent, 2000 + n)).unwrap();
        }
        tx.send(job("b:2", 1001)).unwrap();
        assert!(next_job(&queue, &posted, &mut held).unwrap().is_none());
        assert_eq!(held.len(), MAX_HELD);
        // One of the silent session's batches answered: its first held job starts, and the
        // next call may take from the queue again.
        posted.pop_front();
        assert_eq!(next_room(&queue, &posted, &mut held), 2000);
        assert_eq!(next_room(&queue, &posted, &mut held), 2001);
    }
}
