//! Transfer workers: one thread per queue shard, each moving chunks in order, and the supervisor
//! that catches a dead worker.
//!
//! A worker pops a chunk, asks the room table what to do, plans the writes, posts them in bounded
//! batches over its own data connections and reports the outcome back to the table. A per-room
//! error (bad indices, a failed write, an unknown session) is returned as `Ok(Err(reason))` and
//! only fails that room. A fatal fault — a panic, an injected fault — ends the worker; the
//! supervisor turns it into [`TransferThreadFailed`], fails every open room (its shard's, when
//! restarting), tells their decodes, counts the failure by cause, and restarts the worker or
//! hands the error to the process.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::planner::{BatchLimits, Plan, PlanPart, plan_kv_equal};
use kvx_core::{Chunk, Room, SessionId, TransferOp};
use kvx_rdma::{Session, TransportError};

use crate::engine::Shared;
use crate::fault::{TransferThreadFailed, WorkerFault};
use crate::rooms::{ChunkWork, Target};

/// One queued chunk.
#[derive(Debug)]
pub struct Job {
    /// The room.
    pub room: Room,
    /// The chunk.
    pub chunk: Chunk,
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
        // The chunk the worker was on never finishes: count it done (failed).
        let current = lock(&shared.current[shard]).take();
        let mut actions = Vec::new();
        {
            let mut table = lock(&shared.table);
            if let Some((room, last)) = current {
                actions.extend(table.done(room, last, Err(text.clone())));
            }
            let scope = if shared.cfg.restart_workers {
                Some(shard)
            } else {
                None
            };
            actions.extend(table.fail_all(scope, &text));
        }
        shared.apply(actions);
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
    let mut conns: HashMap<SessionId, Arc<dyn Session>> = HashMap::new();
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let job = match lock(queue).recv_timeout(Duration::from_millis(100)) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        *lock(&shared.current[shard]) = Some((job.room, job.chunk.is_last));
        let work = lock(&shared.table).begin(job.room);
        let result = match work {
            None => Ok(()),
            Some(work) => transfer(shared, &mut conns, &job, &work)?,
        };
        let actions = lock(&shared.table).done(job.room, job.chunk.is_last, result);
        *lock(&shared.current[shard]) = None;
        shared.apply(actions);
    }
}

/// Moves one chunk to every decode of its room. Outer error: fatal; inner: fails the room.
fn transfer(
    shared: &Shared,
    conns: &mut HashMap<SessionId, Arc<dyn Session>>,
    job: &Job,
    work: &ChunkWork,
) -> Result<Result<(), String>, WorkerFault> {
    fail::fail_point!("kvx::transfer_worker::chunk", |arg| Ok(Err(format!(
        "injected per-room fault: {}",
        arg.unwrap_or_default()
    ))));
    for t in &work.targets {
        if let Err(reason) = transfer_one(shared, conns, job, work, t)? {
            return Ok(Err(reason));
        }
    }
    Ok(Ok(()))
}

fn transfer_one(
    shared: &Shared,
    conns: &mut HashMap<SessionId, Arc<dyn Session>>,
    job: &Job,
    work: &ChunkWork,
    t: &Target,
) -> Result<Result<(), String>, WorkerFault> {
    let room = job.room;
    let Some(dst) = &t.request.dst else {
        return Ok(Ok(())); // dummy destination: nothing to write
    };
    if t.blacklisted {
        return Ok(Err(format!(
            "Decode instance could be dead, remote session {} is not alive",
            t.session
        )));
    }
    let Some(reg) = &t.registration else {
        return Ok(Err(format!(
            "metadata for room {room} from unregistered session {}",
            t.session
        )));
    };
    let mem = &shared.mem;
    let slice = job.chunk.slice;
    let Some(dst_pages) = dst.kv_pages.get(slice.start..slice.end) else {
        return Ok(Err(format!(
            "Chunk slice {}..{} of {room} exceeds the {} destination pages of {}",
            slice.start,
            slice.end,
            dst.kv_pages.len(),
            t.session
        )));
    };
    let src_layout = mem.kv_layout(shared.cfg.page_size);
    let dst_layout =
        kvx_core::KvLayout::from_registration(reg, src_layout.kind, None, shared.cfg.page_size);
    let mut plan = Plan::new();
    if !dst_pages.is_empty() {
        match plan_kv_equal(&src_layout, &dst_layout, &job.chunk.src_pages, dst_pages) {
            Ok(p) => plan.push(PlanPart::Paged(p)),
            Err(e) => return Ok(Err(format!("Failed to plan kv chunk of {room}: {e}"))),
        }
    }
    let mut ops = Vec::new();
    if job.chunk.is_last
        && let Some(src_row) = work.src_aux_index
    {
        if reg.aux_ptrs.len() != mem.aux_ptrs.len() {
            return Ok(Err(format!(
                "aux layout mismatch: decode has {} aux buffers, prefill {}",
                reg.aux_ptrs.len(),
                mem.aux_ptrs.len()
            )));
        }
        for ((&sp, &dp), &len) in mem
            .aux_ptrs
            .iter()
            .zip(&reg.aux_ptrs)
            .zip(&mem.aux_item_lens)
        {
            let (Ok(s), Ok(d)) = (u64::try_from(src_row), u64::try_from(dst.aux_index)) else {
                return Ok(Err(format!("negative aux row {src_row}/{}", dst.aux_index)));
            };
            ops.push(TransferOp::new(
                sp.wrapping_add(s.wrapping_mul(len)),
                dp.wrapping_add(d.wrapping_mul(len)),
                len,
            ));
        }
    }
    plan.push(PlanPart::Ops(ops));
    if plan.is_empty() {
        return Ok(Ok(()));
    }
    let limits = match BatchLimits::new(shared.cfg.max_batch_ops, shared.cfg.max_batch_bytes) {
        Ok(l) => l,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let session = match conns.get(&t.session) {
        Some(s) if s.is_alive() => s.clone(),
        _ => {
            let transport = shared.plane.transport();
            match shared.rt.block_on(transport.connect(t.session.as_str())) {
                Ok(s) => {
                    conns.insert(t.session.clone(), s.clone());
                    s
                }
                Err(e) => return Ok(Err(session_failed(shared, &t.session, &e))),
            }
        }
    };
    for batch in plan.batches(limits) {
        fail::fail_point!("kvx::transfer_worker::batch", |arg| Err(
            WorkerFault::Injected {
                point: "kvx::transfer_worker::batch",
                detail: arg.unwrap_or_default(),
            }
        ));
        let t0 = Instant::now();
        match shared.rt.block_on(session.write_batch(batch)) {
            Ok(report) => {
                metrics::histogram!("kvx_batch_latency_seconds").record(t0.elapsed().as_secs_f64());
                metrics::counter!("kvx_transfer_batches_total").increment(1);
                metrics::counter!("kvx_transfer_bytes_total").increment(report.bytes);
            }
            Err(e) if e.is_peer_failure() => {
                conns.remove(&t.session);
                return Ok(Err(session_failed(shared, &t.session, &e)));
            }
            Err(e) => return Ok(Err(format!("Failed to send kv chunk of {room}: {e}"))),
        }
    }
    Ok(Ok(()))
}

/// Blacklists a session after a transport failure and fails its other rooms.
fn session_failed(shared: &Shared, session: &SessionId, e: &TransportError) -> String {
    metrics::counter!("kvx_session_failures_total").increment(1);
    let actions = lock(&shared.table).fail_session(session, &e.to_string());
    shared.apply(actions);
    format!("Failed to send kv chunk to {session}: {e}")
}
