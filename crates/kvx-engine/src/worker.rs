//! Transfer workers: one thread per queue shard, each executing the batches the engine's loop
//! hands it, in order, and reporting every one back.
//!
//! A worker keeps up to [`DEPTH`] batches posted at once towards each decode session: the next
//! batch's windows queue behind the current one's on the session's connections, so they do not
//! idle while a batch's last window is acknowledged. A session's batches are posted in queue
//! order (a room's chunks stay in order on the wire) and answered in that order. Sessions do not
//! wait for each other: a job whose session has [`DEPTH`] batches posted is held (with the
//! session's later jobs) while other sessions' jobs start and complete, up to [`MAX_POSTED`]
//! batches in all — a decode that stops answering, whose batches wait out the acknowledgement
//! timeout, holds only its own rooms. The worker sleeps on one [`Bell`], rung by new jobs
//! and by its batches' wakers. A staged chunk gathered into the shard's one staging buffer runs
//! alone: it starts once nothing is posted, and nothing starts beside it or passes it.
//!
//! A worker owns no room state: it pops a [`Job`] (a batch the `kvx-core` prefill manager
//! planned, or a staged chunk), posts it on its cached `kvx-rdma` session to the decode and sends
//! the [`Outcome`] back to the loop ([`crate::engine`]'s one owner), which feeds the manager. A
//! job whose room was failed meanwhile (its cancel flag is set by the loop) is reported
//! [`Outcome::Skipped`] without a write. A staged chunk ([`Work::Stage`]) whose slice is this
//! rank's every head is written page by page from the KV pages to its place in the decode's
//! ring; one that cuts token slots is first gathered into the worker's registered staging buffer
//! and written with one op; the loop sends its `CHUNK_READY`. A fatal fault — a panic, an injected fault — ends the worker:
//! it first waits for the other batches it has posted (each reported as usual), then reports the
//! job it died on and the fault in one [`Report::Died`], after which nothing more of that job can
//! be written by this thread. The loop turns it into
//! [`crate::fault::TransferThreadFailed`], fails every open room and restarts the worker or
//! stops the rank.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

use kvx_core::prefill::BatchId;
use kvx_core::{Room, SessionId, TransferOp};
use kvx_rdma::Session;

use crate::busy::BusyClock;
use crate::engine::PrefillMemory;
use crate::fault::WorkerFault;
use crate::plane::DataPlane;
use crate::prefill_staging::StageWork;
use crate::region::Region;

/// One unit of work for a transfer worker, towards one decode session.
#[derive(Debug)]
pub struct Job {
    /// The room.
    pub room: Room,
    /// The decode session.
    pub session: SessionId,
    /// What to write.
    pub work: Work,
    /// Set by the engine's loop once the room is terminal: the job is skipped, not written.
    pub cancel: Arc<AtomicBool>,
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
    /// A staged chunk: its block written into the decode's ring (the loop sends `CHUNK_READY`).
    Stage(Box<StageWork>),
    /// Open the worker's data session to the job's decode now unless it is open (and keep it
    /// from idling out): posted when a room's metadata arrives, so the connection handshake
    /// runs during the forward pass instead of before the room's first write. Nothing is
    /// written and the worker reports nothing; a session that cannot be opened is marked dead,
    /// as a batch's failed open would mark it.
    Connect,
}

impl Work {
    /// True for a staged chunk gathered on the CPU into the shard's staging buffer (a slice
    /// that cuts token slots): it is posted alone, after everything posted before it, and
    /// nothing starts beside it. Whole-slot chunks are written from the KV pages and pipeline
    /// like batches.
    pub fn uses_staging_buffer(&self) -> bool {
        matches!(self, Work::Stage(w) if !w.spec.whole_slots())
    }
}

mod pipeline;
mod queue;

use pipeline::{Polled, Posted, Started, drain, next_job, poll_posted, start};

pub use queue::{Bell, JobQueue, JobSender, job_queue};

/// How one job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every write landed.
    Done,
    /// Nothing written: the room is no longer waiting for input (failed or gone meanwhile).
    Skipped,
    /// The decode session is unusable (unreachable, lost): fails the room and blacklists the
    /// session (every other open room towards it fails too).
    PeerFailed(String),
    /// Only this room is affected (rejected writes, an injected per-room fault).
    RoomFailed(String),
}

/// What a worker tells the engine's loop.
#[derive(Debug)]
pub enum Report {
    /// A job finished; nothing of it can still reach the decode.
    Finished {
        /// The queue shard.
        shard: usize,
        /// The job (its ops already consumed).
        job: Job,
        /// How it ended.
        outcome: Outcome,
    },
    /// The worker died on `job` (if it held one) with `fault`; it writes nothing more.
    Died {
        /// The queue shard.
        shard: usize,
        /// The job it was executing.
        job: Option<Job>,
        /// Why.
        fault: WorkerFault,
    },
}

/// The transfer queues' staging buffers: one per queue, allocated and registered with the data
/// plane the first time its worker gathers a chunk (a rank whose staged slices are all whole
/// token slots never allocates one), as large as the blocks it gathered need (grown in
/// [`STAGE_GRANULE`] steps, never beyond the largest block the rank can stage), and
/// deregistered and freed once unused for [`STAGE_BUFFER_IDLE`].
pub(crate) struct StageBuffers {
    /// The largest block the rank can stage.
    len: usize,
    /// Per queue: its buffer and when a gather last took it.
    bufs: Vec<Mutex<Option<StageBuffer>>>,
    /// Bytes allocated now.
    bytes: std::sync::atomic::AtomicU64,
}

/// A queue's staging buffer and when a gather last took it.
type StageBuffer = (Arc<Region>, Instant);

/// A staging buffer no gather took for this long is given back (deregistered and freed): a rank
/// that stopped staging does not keep its memory.
pub(crate) const STAGE_BUFFER_IDLE: Duration = Duration::from_secs(60);

/// Staging buffers grow in steps of this many bytes.
pub(crate) const STAGE_GRANULE: usize = 2 << 20;

impl StageBuffers {
    /// `queues` buffers for blocks of at most `len` bytes, none allocated yet.
    pub(crate) fn new(queues: usize, len: usize) -> Self {
        StageBuffers {
            len,
            bufs: (0..queues).map(|_| Mutex::new(None)).collect(),
            bytes: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Bytes allocated now.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The buffer of `shard`, at least `need` bytes long: the one it has when that is long
    /// enough, else a longer one, registered with `plane` (the shorter one deregistered and
    /// freed). The caller's shard has nothing in flight that reads its buffer.
    fn get(&self, shard: usize, plane: &DataPlane, need: usize) -> Result<Arc<Region>, String> {
        if need > self.len {
            return Err(format!(
                "a staged block of {need} bytes exceeds the rank's largest ({})",
                self.len
            ));
        }
        let slot = self
            .bufs
            .get(shard)
            .ok_or("no staging buffer for this queue")?;
        let mut slot = lock(slot);
        if let Some((b, used)) = &mut *slot
            && b.len() as usize >= need
        {
            *used = Instant::now();
            return Ok(b.clone());
        }
        if let Some((old, _)) = slot.take() {
            self.give_back(plane, &old)?;
        }
        let len = need
            .div_ceil(STAGE_GRANULE)
            .saturating_mul(STAGE_GRANULE)
            .min(self.len)
            .max(need);
        let buf = Arc::new(Region::new(len));
        plane
            .register_late(buf.clone())
            .map_err(|e| format!("registering a staging buffer: {e}"))?;
        self.bytes.fetch_add(buf.len(), Ordering::Relaxed);
        *slot = Some((buf.clone(), Instant::now()));
        Ok(buf)
    }

    /// Gives back `shard`'s buffer when no gather took it since `now - STAGE_BUFFER_IDLE`. The
    /// caller's shard has nothing in flight.
    fn release_idle(&self, shard: usize, plane: &DataPlane, now: Instant) {
        let Some(slot) = self.bufs.get(shard) else {
            return;
        };
        let mut slot = lock(slot);
        let idle = slot
            .as_ref()
            .is_some_and(|(_, used)| now.saturating_duration_since(*used) >= STAGE_BUFFER_IDLE);
        if !idle {
            return;
        }
        if let Some((buf, _)) = slot.take()
            && let Err(e) = self.give_back(plane, &buf)
        {
            tracing::warn!(shard, error = %e, "staging buffer kept");
            *slot = Some((buf, now));
        }
    }

    fn give_back(&self, plane: &DataPlane, buf: &Arc<Region>) -> Result<(), String> {
        plane
            .deregister_late(buf)
            .map_err(|e| format!("deregistering a staging buffer: {e}"))?;
        self.bytes.fetch_sub(buf.len(), Ordering::Relaxed);
        Ok(())
    }
}

/// What every worker of a rank shares (read-only).
pub(crate) struct WorkerCtx {
    pub(crate) mem: PrefillMemory,
    pub(crate) plane: DataPlane,
    pub(crate) rt: tokio::runtime::Handle,
    /// One staging buffer per transfer queue (gather target of its worker), on first use.
    pub(crate) stage_bufs: Arc<StageBuffers>,
    pub(crate) stop: Arc<AtomicBool>,
    /// Time with at least one batch of the rank in flight.
    pub(crate) busy: Arc<BusyClock>,
    /// Decode sessions a worker found dead, and when each last registered again.
    pub(crate) marks: Mutex<SessionMarks>,
}

impl WorkerCtx {
    /// Forgets that `session` was found dead: it registered again (a decode that restarted).
    pub(crate) fn revive(&self, session: &SessionId) {
        lock(&self.marks).revive(session, Instant::now());
    }

    /// Why `session` was found dead, while the mark lasts.
    fn dead_cause(&self, session: &SessionId) -> Option<String> {
        lock(&self.marks).dead_cause(session, Instant::now())
    }

    /// Marks `session` dead after an attempt on it that began at `began` failed.
    fn mark_dead(&self, session: &SessionId, cause: &str, began: Instant) {
        if !lock(&self.marks).mark_dead(session, cause, began, Instant::now()) {
            tracing::info!(%session, cause, "a failure of the session's earlier registration; not marked dead");
        }
    }

    /// True when `session` registered again after `t`: what was opened towards it before that
    /// went to the decode's earlier process.
    fn revived_since(&self, session: &SessionId, t: Instant) -> bool {
        lock(&self.marks).revived_since(session, t)
    }
}

/// How long a session found dead stays marked.
pub const MARK_TTL: Duration = kvx_core::prefill::DEFAULT_FAILED_SESSION_TTL;

/// How long a registration is remembered (at least): far longer than any attempt begun before it
/// can take to fail (connect and acknowledgement timeouts are seconds), so that a failure
/// detected late never marks the decode's new process. One entry per decode session id.
pub const REGISTRATION_MEMORY: Duration = Duration::from_secs(600);

/// Decode sessions the workers found dead, until when and why: the session's jobs queued on any
/// worker behind the failed one fail at once, without a connect attempt each, before the loop
/// has even seen the failure. A registration of the session (its decode restarted) clears its
/// mark, and a failure of an attempt that began before that registration — a connect or a
/// batch towards the earlier process, answered late — marks nothing: it says nothing of the
/// new process. Pure: every call takes `now`.
///
/// Public so that kvx-sim drives these very rules under simulated time (one per prefill
/// process, shared by its workers, as the workers' context holds it here); the engine's workers
/// are its only other user.
#[derive(Debug)]
pub struct SessionMarks {
    dead: HashMap<SessionId, (Instant, String)>,
    /// When each session last registered, for `memory`.
    revived: HashMap<SessionId, Instant>,
    /// How long a mark lasts ([`MARK_TTL`] in the engine).
    ttl: Duration,
    /// How long a registration is remembered (dropped at a later registration): at least
    /// [`REGISTRATION_MEMORY`], whatever `ttl` — it must outlast the attempts begun before it,
    /// which a shorter mark says nothing about.
    memory: Duration,
    /// kvx-sim's planted bug `stale-mark`: a failure marks the session even when the attempt
    /// began before its latest registration.
    #[cfg(feature = "sim-mutants")]
    stale: bool,
}

impl Default for SessionMarks {
    fn default() -> Self {
        SessionMarks::with_ttl(MARK_TTL)
    }
}

impl SessionMarks {
    /// No marks; a mark lasts `ttl`, a registration is remembered for the longer of `ttl` and
    /// [`REGISTRATION_MEMORY`]. The engine's workers use [`MARK_TTL`] (`Default`), the manager's default
    /// failed-session TTL; kvx-sim passes its seed's failed-session TTL, as the manager's and
    /// the workers' must agree.
    pub fn with_ttl(ttl: Duration) -> Self {
        SessionMarks {
            dead: HashMap::new(),
            revived: HashMap::new(),
            ttl,
            memory: ttl.max(REGISTRATION_MEMORY),
            #[cfg(feature = "sim-mutants")]
            stale: false,
        }
    }

    /// How long a mark lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Test-only (feature `sim-mutants`): arms kvx-sim's `stale-mark` mutant — a failure marks
    /// its session dead even when the attempt began before the session's latest registration
    /// (the decode's new process is marked dead for its old process's failure). Never in a
    /// product.
    #[cfg(feature = "sim-mutants")]
    pub fn set_sim_stale_mark(&mut self, on: bool) {
        self.stale = on;
    }

    /// `session` registered at `now` (its decode restarted, or registered again): its mark is
    /// cleared, and failures of attempts begun before `now` no longer mark it.
    pub fn revive(&mut self, session: &SessionId, now: Instant) {
        self.dead.remove(session);
        let memory = self.memory;
        self.revived
            .retain(|_, at| now.saturating_duration_since(*at) < memory);
        self.revived.insert(session.clone(), now);
    }

    /// Why `session` was found dead, while its mark lasts at `now` (expired marks are dropped).
    pub fn dead_cause(&mut self, session: &SessionId, now: Instant) -> Option<String> {
        self.dead.retain(|_, (until, _)| *until > now);
        self.dead.get(session).map(|(_, cause)| cause.clone())
    }

    /// Marks `session` dead with `cause` until `now` + the TTL, after an attempt on it that
    /// began at `began` failed at `now`. False (nothing marked) when the session registered
    /// again after `began`: the failure was the earlier process's.
    pub fn mark_dead(
        &mut self,
        session: &SessionId,
        cause: &str,
        began: Instant,
        now: Instant,
    ) -> bool {
        #[cfg(feature = "sim-mutants")]
        let stale = self.stale;
        #[cfg(not(feature = "sim-mutants"))]
        let stale = false;
        if self.revived_since(session, began) && !stale {
            return false;
        }
        self.dead
            .insert(session.clone(), (now + self.ttl, cause.to_owned()));
        true
    }

    /// True when `session` registered again after `t`: what was opened (or begun) towards it
    /// before that went to the decode's earlier process.
    pub fn revived_since(&self, session: &SessionId, t: Instant) -> bool {
        self.revived.get(session).is_some_and(|&at| at > t)
    }
}

/// A worker's open data session towards one decode.
struct Cached {
    session: Arc<dyn Session>,
    /// When a job last used it (closed after [`SESSION_IDLE`]).
    used: Instant,
    /// When it was opened.
    opened: Instant,
}

/// A worker's open data sessions.
type Sessions = HashMap<SessionId, Cached>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts the worker of `shard`, reporting to `reports`.
pub(crate) fn spawn_worker<R: From<Report> + Send + 'static>(
    ctx: Arc<WorkerCtx>,
    shard: usize,
    queue: Arc<JobQueue>,
    reports: SyncSender<R>,
) -> std::io::Result<()> {
    metrics::gauge!("kvx_live_workers").increment(1.0);
    std::thread::Builder::new()
        .name(format!("kvx-transfer-{shard}"))
        .spawn(move || {
            let died = worker_loop(&ctx, shard, &queue, &reports);
            metrics::gauge!("kvx_live_workers").decrement(1.0);
            if let Some(Death { job, fault, held }) = died {
                let _ = reports.send(Report::Died { shard, job, fault }.into());
                // Taken from the queue but never started: after the death (which fails every
                // open room), as the jobs still queued are when the shard is buried.
                for job in held {
                    let outcome = Outcome::Skipped;
                    let _ = reports.send(
                        Report::Finished {
                            shard,
                            job,
                            outcome,
                        }
                        .into(),
                    );
                }
            }
        })?;
    Ok(())
}

/// Batches a worker keeps posted at once towards one decode session (see the module docs).
pub const DEPTH: usize = 2;

/// Batches a worker keeps posted at once in all, towards several decode sessions.
pub const MAX_POSTED: usize = 4 * DEPTH;

/// Jobs a worker holds, taken from its queue while their session had [`DEPTH`] batches posted
/// (a slow or silent decode's later jobs), so that other sessions' jobs pass them. With this
/// many held it takes nothing more from its queue until one of them starts.
pub const MAX_HELD: usize = 256;

/// How long an idle worker sleeps before it looks after its idle sessions and staging buffer.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// How a worker ended on a fatal fault: the job it died on (if it held one), the fault, and the
/// jobs it had taken from its queue but not started (reported [`Outcome::Skipped`] after the
/// death).
struct Death {
    job: Option<Job>,
    fault: WorkerFault,
    held: VecDeque<Job>,
}

/// Runs jobs until the rank stops (`None`) or a fatal fault.
///
/// One loop, one place to sleep (the queue's [`Bell`], rung by a new job and by the waker of
/// every job in flight): start what may start ([`pipeline::next_job`], [`pipeline::start`]),
/// answer what completed ([`pipeline::poll_posted`]), else sleep. Jobs towards one decode
/// session are answered in the order they were started; different sessions' as each completes,
/// so a decode that stopped answering (its batches wait for the acknowledgement timeout, its
/// connect for the connect timeout) holds only its own.
fn worker_loop<R: From<Report>>(
    ctx: &Arc<WorkerCtx>,
    shard: usize,
    queue: &JobQueue,
    reports: &SyncSender<R>,
) -> Option<Death> {
    let mut sessions: Sessions = HashMap::new();
    let mut posted: Posted = VecDeque::new();
    let mut held: VecDeque<Job> = VecDeque::new();
    let waker = Waker::from(queue.bell().clone());
    let report = |job: Job, outcome: Outcome| {
        reports
            .send(
                Report::Finished {
                    shard,
                    job,
                    outcome,
                }
                .into(),
            )
            .is_ok()
    };
    // The job a fatal fault struck, and the fault.
    let (job, fault) = 'run: loop {
        if ctx.stop.load(Ordering::Relaxed) {
            // Jobs held, like those still queued, are not reported: the loop is stopping.
            drain(ctx, shard, &mut sessions, &mut posted, &report);
            return None;
        }
        let mut progressed = false;
        loop {
            let mut job = match next_job(queue, &posted, &mut held) {
                Ok(Some(job)) => job,
                Ok(None) => break,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    drain(ctx, shard, &mut sessions, &mut posted, &report);
                    return None;
                }
            };
            progressed = true;
            let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
                start(ctx, shard, &mut sessions, &mut job)
            }));
            let fault = match run {
                Ok(Ok(Started::Connected)) => continue,
                Ok(Ok(Started::Done(outcome))) => {
                    if !report(job, outcome) {
                        return None;
                    }
                    continue;
                }
                Ok(Ok(Started::Posted(slot))) => {
                    posted.push_back((job, slot));
                    continue;
                }
                Ok(Err(fault)) => fault,
                Err(p) => WorkerFault::from_panic(p.as_ref()),
            };
            break 'run (job, fault);
        }
        match poll_posted(ctx, shard, &mut sessions, &mut posted, &waker) {
            Polled::Done(job, outcome) => {
                if !report(job, outcome) {
                    return None;
                }
                sessions.retain(|_, c| c.session.is_alive());
                continue;
            }
            Polled::Moved => continue,
            Polled::Panicked(job, fault) => break 'run (job, fault),
            Polled::Pending => {}
        }
        if progressed {
            continue;
        }
        let rung = queue.bell().wait(IDLE_WAIT);
        if !rung && posted.is_empty() && held.is_empty() {
            // A departed decode leaves no connection behind.
            sessions.retain(|_, c| c.session.is_alive() && c.used.elapsed() < SESSION_IDLE);
            // Nothing in flight reads the staging buffer.
            ctx.stage_bufs
                .release_idle(shard, &ctx.plane, Instant::now());
        }
    };
    // Dying: what is in flight is answered first (nothing of it reaches the decode after its
    // report), then the death is reported with the jobs held.
    if !drain(ctx, shard, &mut sessions, &mut posted, &report) {
        return None;
    }
    Some(Death {
        job: Some(job),
        fault,
        held,
    })
}

/// The writes that put a staged chunk's block into the decode's ring. A slice of whole token
/// slots (this rank's every head) is written page by page straight from the KV pages to its
/// place in the block ([`kvx_staging::gather_writes`]: no CPU copy, the staging buffer unused);
/// so is a slice that cuts token slots, token by token, through a session that gathers
/// scattered sources itself (`by_token`, kvx's `tcp`: [`kvx_staging::gather_writes_by_token`]);
/// through any other it is gathered on the CPU first ([`gather_chunk`]), into one write.
fn stage_writes(
    ctx: &WorkerCtx,
    shard: usize,
    w: &StageWork,
    by_token: bool,
) -> Result<Vec<TransferOp>, String> {
    let kv = &ctx.mem.kv;
    let end = kv.base().saturating_add(kv.len());
    // Each buffer runs at most to the end of the KV region (pages past it are refused).
    let bufs: Vec<(u64, usize)> = ctx
        .mem
        .kv_ptrs
        .iter()
        .map(|&p| {
            (
                p,
                usize::try_from(end.saturating_sub(p)).unwrap_or(usize::MAX),
            )
        })
        .collect();
    let direct = if by_token {
        kvx_staging::gather_writes_by_token(&w.spec, &bufs, &w.src_pages, w.dst).map(Some)
    } else {
        kvx_staging::gather_writes(&w.spec, &bufs, &w.src_pages, w.dst)
    }
    .map_err(|e| e.to_string())?;
    let ops = match direct {
        Some(ops) => {
            let len: u64 = ops.iter().map(|o| o.len).sum();
            if len != w.len {
                return Err(format!(
                    "staged block of {} bytes does not match the slice ({len})",
                    w.len
                ));
            }
            metrics::counter!("kvx_staged_bytes_total").increment(w.len);
            ops
        }
        None => vec![gather_chunk(ctx, shard, w)?],
    };
    Ok(ops)
}

/// Gathers a staged chunk's head slices into this shard's staging buffer, page by page (only
/// the chunk's own pages are read), and returns the one write that carries the block.
fn gather_chunk(ctx: &WorkerCtx, shard: usize, w: &StageWork) -> Result<TransferOp, String> {
    let buf = ctx.stage_bufs.get(
        shard,
        &ctx.plane,
        usize::try_from(w.len).unwrap_or(usize::MAX),
    )?;
    let n = w.src_pages.len();
    let page_bytes = w.spec.block_len(1, 1);
    let need = w.spec.block_len(ctx.mem.kv_ptrs.len(), n);
    if need as u64 != w.len || w.len > buf.len() {
        return Err(format!(
            "staged block of {} bytes does not match the slice ({need}) or the buffer ({})",
            w.len,
            buf.len()
        ));
    }
    let kv = &ctx.mem.kv;
    let item = w.spec.item_len as u64;
    let gather_all = |out: &mut [u8]| -> Result<(), String> {
        for (b, &ptr) in ctx.mem.kv_ptrs.iter().enumerate() {
            for (i, &page) in w.src_pages.iter().enumerate() {
                let page = u64::try_from(page).map_err(|_| format!("negative page {page}"))?;
                let addr = page
                    .checked_mul(item)
                    .and_then(|o| o.checked_add(ptr))
                    .ok_or_else(|| "page address overflows".to_owned())?;
                // SAFETY: the forward pass finished the chunk's source pages before it handed
                // the chunk over, and nothing writes them until the room is released.
                let src = unsafe { kv.view(addr, item) }.map_err(|e| e.to_string())?;
                let at = (b * n + i) * page_bytes;
                kvx_staging::gather(&w.spec, &[src], &[0], &mut out[at..at + page_bytes])
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    // SAFETY: this shard's staging buffer is written by this worker only, and the data plane
    // reads it only during the write this function returns, after `with_mut` ended.
    unsafe { buf.with_mut(buf.base(), w.len, gather_all) }.map_err(|e| e.to_string())??;
    metrics::counter!("kvx_staged_bytes_total").increment(w.len);
    metrics::counter!("kvx_staged_cpu_gathers_total").increment(1);
    Ok(TransferOp::new(buf.base(), w.dst, w.len))
}

/// Data sessions idle this long are closed.
pub const SESSION_IDLE: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::plane::Backend;

    const MIB: usize = 1 << 20;

    fn registered(plane: &DataPlane) -> Vec<(u64, u64)> {
        let d = plane.transport().descriptor();
        d.regions.iter().map(|r| (r.base, r.len)).collect()
    }

    #[test]
    fn staging_buffers_grow_to_the_blocks_and_go_back_when_idle() {
        let plane = DataPlane::client(Backend::Local, "stage-bufs-test", 1, Vec::new()).unwrap();
        let bufs = StageBuffers::new(2, 16 * MIB);
        // The first gather allocates what its block needs, in granules.
        let a = bufs.get(0, &plane, 3 * MIB).unwrap();
        assert_eq!(a.len() as usize, 4 * MIB);
        assert_eq!(bufs.bytes() as usize, 4 * MIB);
        assert_eq!(registered(&plane), [(a.base(), a.len())]);
        // A block that fits takes the same buffer.
        assert!(Arc::ptr_eq(&a, &bufs.get(0, &plane, 4 * MIB).unwrap()));
        // A longer one replaces it: the shorter one is deregistered.
        let b = bufs.get(0, &plane, 5 * MIB + 1).unwrap();
        assert_eq!(b.len() as usize, 6 * MIB);
        assert_eq!(bufs.bytes() as usize, 6 * MIB);
        assert_eq!(registered(&plane), [(b.base(), b.len())]);
        // Never beyond the rank's largest block.
        assert!(bufs.get(1, &plane, 16 * MIB + 1).is_err());
        assert_eq!(
            bufs.get(1, &plane, 15 * MIB).unwrap().len() as usize,
            16 * MIB
        );
        assert_eq!(bufs.bytes() as usize, 22 * MIB);
        // Idle buffers go back; a buffer used within the limit stays.
        let now = Instant::now();
        bufs.release_idle(0, &plane, now);
        assert_eq!(bufs.bytes() as usize, 22 * MIB);
        bufs.release_idle(0, &plane, now + STAGE_BUFFER_IDLE);
        assert_eq!(bufs.bytes() as usize, 16 * MIB);
        assert!(!registered(&plane).contains(&(b.base(), b.len())));
        bufs.release_idle(1, &plane, now + STAGE_BUFFER_IDLE);
        assert_eq!(bufs.bytes(), 0);
        assert!(registered(&plane).is_empty());
        // The next gather allocates again.
        assert_eq!(bufs.get(0, &plane, MIB).unwrap().len() as usize, 2 * MIB);
    }

    #[test]
    fn a_failure_from_before_a_registration_marks_nothing() {
        let s = SessionId::new("10.0.0.2:17000");
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut m = SessionMarks::default();
        // A connect to the decode's first process begins; the decode restarts and registers;
        // then the connect fails: the new process is not marked dead.
        m.revive(&s, at(10));
        assert!(!m.mark_dead(&s, "connection refused", at(5), at(20)));
        assert_eq!(m.dead_cause(&s, at(20)), None);
        assert!(m.revived_since(&s, at(5)));
        assert!(!m.revived_since(&s, at(10)));
        // A failure of an attempt begun after the registration marks it, until the TTL.
        assert!(m.mark_dead(&s, "connection reset", at(15), at(30)));
        assert_eq!(
            m.dead_cause(&s, at(31)).as_deref(),
            Some("connection reset")
        );
        assert_eq!(m.dead_cause(&s, at(30) + MARK_TTL), None);
        // A registration clears a mark. A failure detected long after a registration, of an
        // attempt begun before it, still marks nothing; registrations older than the memory
        // are forgotten.
        assert!(m.mark_dead(&s, "connection reset", at(40), at(41)));
        m.revive(&s, at(50));
        assert_eq!(m.dead_cause(&s, at(51)), None);
        let other = SessionId::new("10.0.0.3:17000");
        m.revive(&other, at(50) + MARK_TTL);
        assert!(!m.mark_dead(&s, "connection reset", at(45), at(60) + MARK_TTL));
        m.revive(&other, at(50) + REGISTRATION_MEMORY);
        assert!(!m.revived.contains_key(&s));
        assert!(m.mark_dead(&s, "connection reset", at(45), at(60) + REGISTRATION_MEMORY));
    }

    #[test]
    fn marks_last_their_ttl() {
        let s = SessionId::new("10.0.0.2:17000");
        let t0 = Instant::now();
        let ttl = Duration::from_millis(100);
        let mut m = SessionMarks::with_ttl(ttl);
        assert_eq!(m.ttl(), ttl);
        assert_eq!(SessionMarks::default().ttl(), MARK_TTL);
        assert!(m.mark_dead(&s, "reset", t0, t0));
        assert!(
            m.dead_cause(&s, t0 + ttl - Duration::from_nanos(1))
                .is_some()
        );
        assert_eq!(m.dead_cause(&s, t0 + ttl), None);
        // A registration is remembered for `REGISTRATION_MEMORY` however short the marks: a
        // failure of an attempt begun before it, detected long after, marks nothing.
        m.revive(&s, t0 + ttl);
        let other = SessionId::new("10.0.0.3:17000");
        m.revive(&other, t0 + 2 * ttl);
        assert!(m.revived_since(&s, t0));
        assert!(!m.mark_dead(&s, "reset", t0, t0 + 3 * ttl));
        m.revive(&other, t0 + ttl + REGISTRATION_MEMORY);
        assert!(!m.revived_since(&s, t0));
    }

    #[cfg(feature = "sim-mutants")]
    #[test]
    fn the_stale_mark_mutant_marks_the_new_process() {
        let s = SessionId::new("10.0.0.2:17000");
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut m = SessionMarks::default();
        m.set_sim_stale_mark(true);
        m.revive(&s, at(10));
        assert!(m.mark_dead(&s, "connection refused", at(5), at(20)));
        assert_eq!(
            m.dead_cause(&s, at(21)).as_deref(),
            Some("connection refused")
        );
    }
}
