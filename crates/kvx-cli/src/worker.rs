//! Transfer workers: one thread per queue shard, each posting the room manager's batches in
//! order, and the supervisor that catches a dead worker.
//!
//! A worker pops a batch the `kvx-core` prefill manager planned, posts it on its cached
//! `kvx-rdma` session to the decode and feeds the completion back (`BatchDone`). A per-room error
//! (a failed or rejected write, a lost peer) comes back as `Ok(Err(reason))` and only fails that
//! room. A fatal fault — a panic, an injected fault — ends the worker; the supervisor turns it
//! into [`TransferThreadFailed`], counts it by cause, fails every open room through the manager's
//! `Fatal` event (every decode gets status 0), and restarts the worker or hands the error to the
//! process.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::prefill::{BatchId, PrefillEvent};
use kvx_core::{KVPoll, Room, SessionId, TransferOp};
use kvx_rdma::{Session, TransportError};

use crate::engine::Shared;
use crate::fault::{TransferThreadFailed, WorkerFault};

/// One planned batch of writes to one decode session.
#[derive(Debug)]
pub struct Job {
    /// The room.
    pub room: Room,
    /// The decode session.
    pub session: SessionId,
    /// The manager's id for the completion.
    pub batch_id: BatchId,
    /// The writes.
    pub ops: Vec<TransferOp>,
}

/// The queue end a worker (and its replacement) reads.
pub type JobQueue = Arc<Mutex<Receiver<Job>>>;

/// What a worker thread reports when it ends.
struct Exit {
    shard: usize,
    result: Result<(), WorkerFault>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts `queues.len()` workers and their supervisor.
pub(crate) fn spawn_all(shared: Arc<Shared>, queues: Vec<JobQueue>) -> std::io::Result<()> {
    let (exit_tx, exit_rx) = std::sync::mpsc::channel::<Exit>();
    for (shard, q) in queues.iter().enumerate() {
        spawn_worker(shared.clone(), shard, q.clone(), exit_tx.clone())?;
    }
    std::thread::Builder::new()
        .name("kvx-supervisor".into())
        .spawn(move || supervise(shared, queues, exit_rx, exit_tx))?;
    Ok(())
}

fn spawn_worker(
    shared: Arc<Shared>,
    shard: usize,
    queue: JobQueue,
    exit: Sender<Exit>,
) -> std::io::Result<()> {
    metrics::gauge!("kvx_live_workers").increment(1.0);
    std::thread::Builder::new()
        .name(format!("kvx-transfer-{shard}"))
        .spawn(move || {
            let result =
                std::panic::catch_unwind(AssertUnwindSafe(|| worker_loop(&shared, &queue)))
                    .unwrap_or_else(|p| Err(WorkerFault::from_panic(p.as_ref())));
            metrics::gauge!("kvx_live_workers").decrement(1.0);
            let _ = exit.send(Exit { shard, result });
        })?;
    Ok(())
}

fn supervise(
    shared: Arc<Shared>,
    queues: Vec<JobQueue>,
    exits: Receiver<Exit>,
    exit_tx: Sender<Exit>,
) {
    while let Ok(Exit { shard, result }) = exits.recv() {
        let Err(inner) = result else {
            continue;
        };
        let cause = inner.cause();
        let err = TransferThreadFailed {
            inner,
            bootstrap_port: shared.cfg.bootstrap_port,
            shard,
        };
        tracing::error!(shard, cause, "{err}");
        metrics::counter!("kvx_worker_failures_total", "cause" => cause).increment(1);
        let text = err.to_string();
        // Every open room fails and its decodes are told (status 0); the manager forgets the
        // outstanding batches, the one the worker died on included. The decode sessions stay
        // usable: the fault was ours, not theirs.
        let _ = shared.handle(PrefillEvent::Fatal { reason: text });
        if shared.cfg.restart_workers && !shared.stop.load(Ordering::Relaxed) {
            metrics::counter!("kvx_worker_restarts_total").increment(1);
            if let Err(e) = spawn_worker(
                shared.clone(),
                shard,
                queues[shard].clone(),
                exit_tx.clone(),
            ) {
                tracing::error!(error = %e, "cannot restart transfer worker");
            }
        } else {
            shared.flush_notices(Duration::from_millis(500));
            shared.set_fatal(err);
        }
    }
}

fn worker_loop(shared: &Shared, queue: &Mutex<Receiver<Job>>) -> Result<(), WorkerFault> {
    let mut sessions: HashMap<SessionId, (Arc<dyn Session>, Instant)> = HashMap::new();
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let job = match lock(queue).recv_timeout(Duration::from_millis(100)) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => {
                // A departed decode leaves no connection behind.
                sessions.retain(|_, (s, used)| s.is_alive() && used.elapsed() < SESSION_IDLE);
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        let result = execute(shared, &mut sessions, job.room, &job.session, job.ops)?;
        match result {
            Outcome::Done => {
                let _ = shared.handle(PrefillEvent::BatchDone {
                    batch_id: job.batch_id,
                    result: Ok(()),
                });
            }
            Outcome::PeerFailed(reason) => {
                // sglang's rule: a failed transfer blacklists the decode session; every other
                // open room writing to it fails now rather than one chunk at a time.
                let _ = shared.handle(PrefillEvent::BatchDone {
                    batch_id: job.batch_id,
                    result: Err(reason.clone()),
                });
                shared.fail_session_rooms(&job.session, &reason);
            }
            Outcome::RoomFailed(reason) => {
                // One room's problem: fail it, tell its decode, keep the session usable.
                tracing::warn!(room = %job.room, %reason, "room failed");
                let endpoint = lock(&shared.table)
                    .registration(&job.session)
                    .map(|r| r.endpoint.clone());
                let _ = shared.handle(PrefillEvent::LocalAbort { room: job.room });
                if let Some(endpoint) = endpoint {
                    shared.send_status(job.room, endpoint, KVPoll::Failed);
                }
                let _ = shared.handle(PrefillEvent::BatchDone {
                    batch_id: job.batch_id,
                    result: Ok(()),
                });
            }
        }
        sessions.retain(|_, (s, _)| s.is_alive());
    }
}

/// Data sessions idle this long are closed.
const SESSION_IDLE: Duration = Duration::from_secs(2);

/// How one batch ended (fatal faults leave through the outer `Err`).
enum Outcome {
    /// Every write landed.
    Done,
    /// The decode session is unusable (unreachable, lost): fails the room, blacklists the session.
    PeerFailed(String),
    /// Only this room is affected (rejected writes, an injected per-room fault).
    RoomFailed(String),
}

/// Posts one batch. Outer error: fatal for the worker; inner: fails the room (a peer failure
/// also drops the cached session so the next batch reconnects).
fn execute(
    shared: &Shared,
    sessions: &mut HashMap<SessionId, (Arc<dyn Session>, Instant)>,
    room: Room,
    session: &SessionId,
    ops: Vec<TransferOp>,
) -> Result<Outcome, WorkerFault> {
    // Batches queued before their room or session failed are completed without any work: a room
    // failed meanwhile needs nothing more, and a session already found dead fails the room at
    // once (sglang's "session is not alive") instead of waiting for a fresh connect attempt
    // each, so every room queued behind a dead decode fails as soon as the first one does.
    {
        let table = lock(&shared.table);
        if table.poll(room) != Some(KVPoll::WaitingForInput) {
            return Ok(Outcome::Done);
        }
        if table.session_failed(session, Instant::now()) {
            drop(table);
            sessions.remove(session);
            metrics::counter!("kvx_batches_skipped_total", "reason" => "session_dead").increment(1);
            return Ok(Outcome::PeerFailed(format!(
                "Decode instance could be dead, remote session {session} is not alive"
            )));
        }
    }
    fail::fail_point!("kvx::transfer_worker::batch", |arg| Err(
        WorkerFault::Injected {
            point: "kvx::transfer_worker::batch",
            detail: arg.unwrap_or_default(),
        }
    ));
    fail::fail_point!("kvx::transfer_worker::chunk", |arg| Ok(
        Outcome::RoomFailed(format!(
            "injected per-room fault: {}",
            arg.unwrap_or_default()
        ))
    ));
    if lock(&shared.table).poll(room) != Some(KVPoll::WaitingForInput) {
        // Failed (or gone) while the fault points ran: nothing to write.
        return Ok(Outcome::Done);
    }
    let s = match sessions.get_mut(session) {
        Some((s, used)) if s.is_alive() => {
            *used = Instant::now();
            s.clone()
        }
        _ => match shared
            .rt
            .block_on(shared.plane.open_session(session.as_str()))
        {
            Ok(s) => {
                sessions.insert(session.clone(), (s.clone(), Instant::now()));
                s
            }
            Err(e) => return Ok(Outcome::PeerFailed(peer_failed(session, &e))),
        },
    };
    let t0 = Instant::now();
    match shared.rt.block_on(s.write_batch(ops)) {
        Ok(report) => {
            metrics::histogram!("kvx_batch_latency_seconds").record(t0.elapsed().as_secs_f64());
            metrics::counter!("kvx_transfer_batches_total").increment(1);
            metrics::counter!("kvx_transfer_bytes_total").increment(report.bytes);
            Ok(Outcome::Done)
        }
        Err(e) if e.is_peer_failure() => {
            sessions.remove(session);
            Ok(Outcome::PeerFailed(peer_failed(session, &e)))
        }
        Err(e) => Ok(Outcome::RoomFailed(format!(
            "Failed to send kv chunk of {room} to {session}: {e}"
        ))),
    }
}

fn peer_failed(session: &SessionId, e: &TransportError) -> String {
    metrics::counter!("kvx_session_failures_total").increment(1);
    format!("decode session {session} failed: {e}")
}
