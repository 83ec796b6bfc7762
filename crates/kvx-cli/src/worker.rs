//! Transfer workers: one thread per queue shard, each posting the room manager's batches in
//! order, and the supervisor that catches a dead worker.
//!
//! A worker pops a batch the `kvx-core` prefill manager planned, posts it on its cached
//! `kvx-rdma` session to the decode and feeds the completion back (`BatchDone`). A per-room error
//! (a failed or rejected write, a lost peer) comes back as `Ok(Err(reason))` and only fails that
//! room. A staged chunk ([`Work::Stage`]) is first gathered into the worker's registered staging
//! buffer, written with one op into the decode's ring, and announced with `CHUNK_READY` before
//! its completion goes back (so it precedes the room's status on the decode's socket). A fatal
//! fault — a panic, an injected fault — ends the worker; the supervisor turns it
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

use crate::engine::{Notice, Shared};
use crate::fault::{TransferThreadFailed, WorkerFault};
use crate::prefill_staging::StageWork;

/// One unit of work for a transfer worker, towards one decode session.
#[derive(Debug)]
pub struct Job {
    /// The room.
    pub room: Room,
    /// The decode session.
    pub session: SessionId,
    /// What to write.
    pub work: Work,
}

/// What a job writes.
#[derive(Debug)]
pub enum Work {
    /// A planned batch of writes, reported to the manager as `batch_id`.
    Batch {
        /// The manager's id for the completion.
        batch_id: BatchId,
        /// The writes.
        ops: Vec<TransferOp>,
    },
    /// A staged chunk: gather, one write into the decode's ring, `CHUNK_READY`.
    Stage(Box<StageWork>),
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
                std::panic::catch_unwind(AssertUnwindSafe(|| worker_loop(&shared, shard, &queue)))
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
        // The manager forgot every outstanding batch: the staging driver owes none either.
        shared.with_staging(|d, _| d.reset());
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

fn worker_loop(
    shared: &Shared,
    shard: usize,
    queue: &Mutex<Receiver<Job>>,
) -> Result<(), WorkerFault> {
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
        let Job {
            room,
            session,
            mut work,
        } = job;
        let result = execute(shared, shard, &mut sessions, room, &session, &mut work)?;
        match result {
            Outcome::Done => complete(shared, work, Ok(()), true),
            Outcome::Skipped => complete(shared, work, Ok(()), false),
            Outcome::PeerFailed(reason) => {
                // sglang's rule: a failed transfer blacklists the decode session; every other
                // open room writing to it fails now rather than one chunk at a time.
                complete(shared, work, Err(reason.clone()), false);
                shared.fail_session_rooms(&session, &reason);
            }
            Outcome::RoomFailed(reason) => {
                // One room's problem: fail it, tell every decode rank of the room (not only
                // this session's: the others would wait for their timeout), keep the session.
                let endpoint = lock(&shared.table)
                    .registration(&session)
                    .map(|r| r.endpoint.clone());
                shared.fail_room_and(room, &reason, endpoint.map(|e| (session.clone(), e)));
                complete(shared, work, Ok(()), false);
            }
        }
        sessions.retain(|_, (s, _)| s.is_alive());
    }
}

/// Reports a finished job: a batch to the manager; a staged chunk to the staging driver, after
/// its `CHUNK_READY` when it was `written`.
fn complete(shared: &Shared, work: Work, result: Result<(), String>, written: bool) {
    match work {
        Work::Batch { batch_id, .. } => {
            let _ = shared.handle(PrefillEvent::BatchDone { batch_id, result });
        }
        Work::Stage(w) => {
            if written {
                let rank = lock(&shared.table).prefill_unique_rank();
                let frames = crate::wire::encode_chunk_ready(&w.chunk_ready(rank));
                shared.notify(Notice::Send(w.endpoint.clone(), frames));
            }
            shared.with_staging(|d, fx| d.chunk_done(&w.batches, result, fx));
        }
    }
}

/// Gathers a staged chunk's head slices into this shard's staging buffer, page by page (only
/// the chunk's own pages are borrowed), and returns the one write that carries the block.
fn gather_chunk(shared: &Shared, shard: usize, w: &StageWork) -> Result<TransferOp, String> {
    let buf = shared
        .stage_bufs
        .get(shard)
        .ok_or("no staging buffer for this queue")?;
    let n = w.src_pages.len();
    let page_bytes = w.spec.block_len(1, 1);
    let need = w.spec.block_len(shared.mem.kv_ptrs.len(), n);
    if need as u64 != w.len || w.len > buf.len() {
        return Err(format!(
            "staged block of {} bytes does not match the slice ({need}) or the buffer ({})",
            w.len,
            buf.len()
        ));
    }
    let kv = &shared.mem.kv;
    let item = w.spec.item_len as u64;
    buf.write_with(buf.base(), w.len, |out| {
        for (b, &ptr) in shared.mem.kv_ptrs.iter().enumerate() {
            for (i, &page) in w.src_pages.iter().enumerate() {
                let page = u64::try_from(page).map_err(|_| format!("negative page {page}"))?;
                let addr = page
                    .checked_mul(item)
                    .and_then(|o| o.checked_add(ptr))
                    .ok_or_else(|| "page address overflows".to_owned())?;
                let src = kv.read(addr, item).map_err(|e| e.to_string())?;
                let at = (b * n + i) * page_bytes;
                kvx_staging::gather(&w.spec, &[src], &[0], &mut out[at..at + page_bytes])
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok::<(), String>(())
    })
    .map_err(|e| e.to_string())??;
    metrics::counter!("kvx_staged_bytes_total").increment(w.len);
    Ok(TransferOp::new(buf.base(), w.dst, w.len))
}

/// Data sessions idle this long are closed.
const SESSION_IDLE: Duration = Duration::from_secs(2);

/// How one batch ended (fatal faults leave through the outer `Err`).
enum Outcome {
    /// Every write landed.
    Done,
    /// Nothing written: the room is no longer waiting for input (failed or gone meanwhile).
    Skipped,
    /// The decode session is unusable (unreachable, lost): fails the room, blacklists the session.
    PeerFailed(String),
    /// Only this room is affected (rejected writes, an injected per-room fault).
    RoomFailed(String),
}

/// Posts one batch. Outer error: fatal for the worker; inner: fails the room (a peer failure
/// also drops the cached session so the next batch reconnects).
fn execute(
    shared: &Shared,
    shard: usize,
    sessions: &mut HashMap<SessionId, (Arc<dyn Session>, Instant)>,
    room: Room,
    session: &SessionId,
    work: &mut Work,
) -> Result<Outcome, WorkerFault> {
    // Batches queued before their room or session failed are completed without any work: a room
    // failed meanwhile needs nothing more, and a session already found dead fails the room at
    // once (sglang's "session is not alive") instead of waiting for a fresh connect attempt
    // each, so every room queued behind a dead decode fails as soon as the first one does.
    {
        let table = lock(&shared.table);
        if table.poll(room) != Some(KVPoll::WaitingForInput) {
            return Ok(Outcome::Skipped);
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
        return Ok(Outcome::Skipped);
    }
    let ops = match work {
        Work::Batch { ops, .. } => std::mem::take(ops),
        Work::Stage(w) => match gather_chunk(shared, shard, w) {
            Ok(op) => vec![op],
            Err(e) => {
                return Ok(Outcome::RoomFailed(format!(
                    "staging chunk {} of {room}: {e}",
                    w.key.chunk_idx
                )));
            }
        },
    };
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
