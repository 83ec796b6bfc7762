//! The prefill rank's deterministic core: the rules of the engine's owner loop with no thread,
//! socket or clock of its own.
//!
//! [`PrefillCore`] owns the rank's [`PrefillManager`] and [`StagingDriver`] and the driver-side
//! room sets around them (rooms announced to the forward pass, rooms concluded but still held,
//! per-room cancel flags, worker shards that died, a fatal fault waiting for the batches to
//! drain). Each input — a decode's message, an embedder call, a worker's report, a lost session,
//! the passage of time — comes with `now` and appends [`Output`]s to a caller's vector, in the
//! order they must be performed: a room row is filled before any batch reading it is posted, a
//! status follows the `CHUNK_READY` and `AUX_DATA` that precede it, a room's pages are released
//! only once the manager dropped the room, the rank's fatal fault is handed out only once nothing
//! of any room is in flight. Which shard a job goes to, when a job is skipped (its room's cancel
//! flag), and what a dead worker does to the rank are decided here.
//!
//! Two drivers perform the outputs: the engine's loop thread (`engine/owner.rs`: real job
//! queues, ZMQ sockets, worker threads, probes over TCP) and kvx-sim (a simulated network, data
//! plane and clock), so what the simulation checks is the code that runs.
//!
//! ```
//! use std::time::Instant;
//! use kvx_core::{prefill::LocalMemory, AuxLayout, KvLayout, PrefillManager, Room};
//! use kvx_engine::prefill_core::{CoreConfig, Output, PrefillCore};
//!
//! // Two layers of 16 pages of 64 bytes, sglang's 10 aux buffers of 16 rows.
//! let kv = KvLayout::mha_contiguous(0x1000_0000, 2, 16, 64, 1);
//! let aux_ptrs: Vec<u64> = (0..10).map(|i| 0x2000_0000 + (i << 20)).collect();
//! let aux = AuxLayout::sglang_default(&aux_ptrs, Some(16)).unwrap();
//! let local = LocalMemory { kv, aux, state: Vec::new() };
//! let mgr = PrefillManager::new(kvx_core::PrefillConfig::default(), local);
//! let now = Instant::now();
//! let mut core = PrefillCore::new(CoreConfig::default(), mgr, None, now);
//! let (room, mut out) = (Room::new(7).unwrap(), Vec::new());
//! core.open_room(now, room, &mut out).unwrap();
//! core.init_room(now, room, 1, 0, &mut out).unwrap();
//! // No decode sent metadata yet: the room waits, nothing is posted or sent.
//! assert_eq!(core.poll(room), Some(kvx_core::KVPoll::Bootstrapping));
//! assert!(!out.iter().any(|o| matches!(o, Output::Post { .. } | Output::Send { .. })));
//! // Its bootstrap deadline is what the driver sleeps until.
//! assert!(core.poll_timeout().is_some());
//! ```

mod actions;
mod staging;
mod view;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvx_core::prefill::{PrefillError, PrefillEvent, PrefillManager, RoomError};
use kvx_core::{Chunk, Endpoint, KVPoll, Room, SessionId};

use crate::engine::EngineEvent;
use crate::fault::{TransferThreadFailed, WorkerFault};
use crate::prefill_staging::StagingDriver;
use crate::wire::{self, Frames, PrefillInbound};
use crate::worker::{Job, Outcome, SESSION_IDLE, Work};

pub use staging::PROBE_PERIOD;
pub(crate) use view::View;

/// How long a rank whose worker died waits for the other workers' batches before it reports
/// the fault anyway.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(30);
/// Housekeeping period (staging expiry, liveness probes, gauges, an overdue fatal fault).
pub const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// What the core needs to know of the rank's configuration.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// The instance's bootstrap port (named in the dead-worker message).
    pub bootstrap_port: u16,
    /// Transfer queue shards (one worker each).
    pub queues: usize,
    /// Open a sender for every room whose metadata arrives (the synthetic forward pass).
    pub auto_open: bool,
    /// Restart a worker that died instead of taking the rank down.
    pub restart_workers: bool,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            bootstrap_port: 8998,
            queues: 1,
            auto_open: false,
            restart_workers: false,
        }
    }
}

/// What the driver performs, in order.
#[derive(Debug)]
pub enum Output {
    /// Write the room id into its aux row (`kvx_core::fill_room_row`), before anything reads it.
    FillRoomRow {
        /// The room.
        room: Room,
        /// The row's address.
        addr: u64,
        /// The row's length.
        len: u64,
    },
    /// Send the aux row at `src_addr` as `AUX_DATA` (`wire::encode_aux_data`) to `endpoint`,
    /// in order with the other sends to it.
    SendAuxData {
        /// The room.
        room: Room,
        /// The decode inbox.
        endpoint: Endpoint,
        /// The aux buffer index.
        index: usize,
        /// The decode's row.
        dst_row: u64,
        /// The prefill's row.
        src_addr: u64,
        /// The row's length.
        len: u64,
    },
    /// Send these frames to a decode inbox, after every earlier send to it.
    Send {
        /// The decode inbox.
        endpoint: Endpoint,
        /// The message.
        frames: Frames,
        /// The room when the message is its status (for the room's timeline).
        status_of: Option<Room>,
    },
    /// Queue a job on its shard's worker. If the queue is gone, the driver reports the job
    /// back with [`PrefillCore::finished`] as `Outcome::RoomFailed`.
    Post {
        /// The queue shard.
        shard: usize,
        /// The job.
        job: Job,
    },
    /// An event for the embedder.
    Event(EngineEvent),
    /// The manager concluded a room (its status is final; its entries go once drained).
    Concluded {
        /// The room.
        room: Room,
        /// Success or Failed.
        status: KVPoll,
        /// Why it failed.
        reason: Option<RoomError>,
    },
    /// A session registered again: the workers forget that it failed.
    Revive(SessionId),
    /// Start a new worker on `shard` (its predecessor died). If that fails, or the rank is
    /// stopping, the driver calls [`PrefillCore::worker_lost`] instead.
    RestartWorker(usize),
    /// The worker of `shard` is gone for good: report every job still queued on it back with
    /// [`PrefillCore::finished`] as `Outcome::Skipped` (later jobs for it never leave the core).
    Bury(usize),
    /// Probe the decode inbox behind `session` (staged rooms wait on it); report a dead one
    /// with [`PrefillCore::session_lost`].
    Probe {
        /// The session.
        session: SessionId,
        /// Its decode's inbox.
        inbox: Endpoint,
    },
    /// The rank's fatal fault, now that no batch is outstanding (or [`DRAIN_LIMIT`] passed):
    /// the driver flushes its sends and hands it to the process.
    Fatal(Arc<TransferThreadFailed>),
}

/// The rank's state, one owner.
pub struct PrefillCore {
    cfg: CoreConfig,
    mgr: PrefillManager,
    staging: Option<StagingDriver>,
    view: Arc<View>,
    /// Shards whose worker died and was not restarted: their jobs are completed unsent.
    dead_shards: BTreeSet<usize>,
    /// Every room the manager may hold.
    known: BTreeSet<Room>,
    /// Rooms announced to the forward pass (`EngineEvent::Ready`).
    announced: BTreeSet<Room>,
    /// Rooms concluded whose entries the manager still holds.
    concluded: BTreeMap<Room, KVPoll>,
    /// Per-room cancel flags shared with the jobs in the workers' queues.
    cancel: BTreeMap<Room, Arc<AtomicBool>>,
    /// When each room's last chunk was handed over (`kvx_room_latency_seconds` ends at its
    /// first status).
    last_chunk: BTreeMap<Room, Instant>,
    /// A worker died and is not restarted: the fault, handed out once the batches drained.
    dying: Option<(TransferThreadFailed, Instant)>,
    /// The fault once handed out.
    fatal: Option<Arc<TransferThreadFailed>>,
    next_housekeeping: Instant,
    /// Staging sessions probed for liveness, with when the last probe started.
    probed: BTreeMap<SessionId, Instant>,
    /// When a job last went to each (shard, decode session): a worker whose last job there is
    /// older than half its session idle limit may have closed the session, so a room's
    /// metadata sends it a [`Work::Connect`] first. Entries older than the limit are dropped.
    warm: BTreeMap<SessionId, Vec<Option<Instant>>>,
    /// kvx-sim's planted bug: the fatal fault is handed out before the batches drained.
    #[cfg(feature = "sim-mutants")]
    early_exit: bool,
}

impl PrefillCore {
    /// A core over `mgr` (and `staging`, when the rank stages), started at `now`.
    pub fn new(
        cfg: CoreConfig,
        mgr: PrefillManager,
        staging: Option<StagingDriver>,
        now: Instant,
    ) -> Self {
        PrefillCore {
            cfg,
            mgr,
            staging,
            view: Arc::default(),
            dead_shards: BTreeSet::new(),
            known: BTreeSet::new(),
            announced: BTreeSet::new(),
            concluded: BTreeMap::new(),
            cancel: BTreeMap::new(),
            last_chunk: BTreeMap::new(),
            dying: None,
            fatal: None,
            next_housekeeping: now + HOUSEKEEPING,
            probed: BTreeMap::new(),
            warm: BTreeMap::new(),
            #[cfg(feature = "sim-mutants")]
            early_exit: false,
        }
    }

    /// Test-only (feature `sim-mutants`): arms kvx-sim's `early-exit` mutant — the rank hands
    /// out its fatal fault at once, batches still in flight. Never in a product.
    #[cfg(feature = "sim-mutants")]
    pub fn set_sim_early_exit(&mut self, on: bool) {
        self.early_exit = on;
    }

    /// The room manager (read only).
    pub fn manager(&self) -> &PrefillManager {
        &self.mgr
    }

    /// The staging driver, when the rank stages (read only).
    pub fn staging(&self) -> Option<&StagingDriver> {
        self.staging.as_ref()
    }

    /// A room's status, `None` once the manager dropped it.
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        self.mgr.poll(room)
    }

    /// The fatal fault once handed out.
    pub fn fatal(&self) -> Option<Arc<TransferThreadFailed>> {
        self.fatal.clone()
    }

    /// The view the embedder reads without a round trip.
    pub(crate) fn view(&self) -> Arc<View> {
        self.view.clone()
    }

    /// When [`on_time`](Self::on_time) next has work: the manager's next deadline, or the
    /// housekeeping while staging holds state or a fatal fault waits for the batches to drain
    /// (`None`: nothing is due; a driver may still call `on_time` on its own period).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let busy = self.dying.is_some() || self.staging.as_ref().is_some_and(|d| !d.is_idle());
        let housekeeping = busy.then_some(self.next_housekeeping);
        match (self.mgr.poll_timeout(), housekeeping) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Deadlines and housekeeping due at `now`.
    pub fn on_time(&mut self, now: Instant, out: &mut Vec<Output>) {
        if self.mgr.poll_timeout().is_some_and(|t| t <= now) {
            let _ = self.handle(now, PrefillEvent::Tick, None, out);
        }
        if now >= self.next_housekeeping {
            self.next_housekeeping = now + HOUSEKEEPING;
            self.staging_housekeeping(now, out);
            self.warm.retain(|_, shards| {
                shards.iter_mut().for_each(|t| {
                    *t = t.filter(|t| now.saturating_duration_since(*t) < SESSION_IDLE);
                });
                shards.iter().any(Option::is_some)
            });
            self.gauges();
            self.check_dying(now, true, out);
        }
    }

    /// The embedder opened a sender for `room` (its request arrived).
    pub fn open_room(
        &mut self,
        now: Instant,
        room: Room,
        out: &mut Vec<Output>,
    ) -> Result<(), PrefillError> {
        self.known.insert(room);
        let r = self.handle(now, PrefillEvent::SenderCreated { room }, Some(room), out);
        self.check_dying(now, false, out);
        r
    }

    /// The embedder initialised `room`'s sender: `num_pages` source pages, aux row `aux_row`.
    pub fn init_room(
        &mut self,
        now: Instant,
        room: Room,
        num_pages: usize,
        aux_row: u64,
        out: &mut Vec<Output>,
    ) -> Result<(), PrefillError> {
        let event = PrefillEvent::SenderInit {
            room,
            num_pages,
            aux_row,
        };
        let r = self.handle(now, event, Some(room), out);
        self.check_dying(now, false, out);
        r
    }

    /// The forward pass handed over one chunk of `room`.
    pub fn send(
        &mut self,
        now: Instant,
        room: Room,
        chunk: Chunk,
        out: &mut Vec<Output>,
    ) -> Result<(), PrefillError> {
        let last = chunk.is_last;
        if last {
            crate::timeline::stage!(room, "loop");
        }
        let r = self.handle(now, PrefillEvent::Chunk { room, chunk }, Some(room), out);
        if last && r.is_ok() && self.mgr.poll(room).is_some() {
            self.last_chunk.entry(room).or_insert(now);
        }
        self.check_dying(now, false, out);
        r
    }

    /// Fails an open room from this side; every decode of the room is told once it drained.
    /// False when the room was not open.
    pub fn fail_room(
        &mut self,
        now: Instant,
        room: Room,
        reason: &str,
        out: &mut Vec<Output>,
    ) -> bool {
        let r = self.fail(now, room, reason, out);
        self.check_dying(now, false, out);
        r
    }

    fn fail(&mut self, now: Instant, room: Room, reason: &str, out: &mut Vec<Output>) -> bool {
        if self.mgr.poll(room).is_none_or(KVPoll::is_terminal) {
            return false;
        }
        let event = PrefillEvent::SenderFailed {
            room,
            reason: reason.to_owned(),
        };
        self.handle(now, event, Some(room), out).is_ok()
    }

    /// A message from a decode. An error is the manager's refusal (logged and counted here; the
    /// message is dropped and nothing is sent).
    pub fn inbound(
        &mut self,
        now: Instant,
        msg: PrefillInbound,
        out: &mut Vec<Output>,
    ) -> Result<(), PrefillError> {
        let r = match msg {
            PrefillInbound::Registration(reg) => {
                let (session, endpoint) = (reg.session.clone(), reg.endpoint.clone());
                let v0523 = reg.accepts_status_reason();
                let r = self.handle(now, PrefillEvent::Register(*reg), None, out);
                match &r {
                    Ok(()) => {
                        out.push(Output::Revive(session.clone()));
                        metrics::counter!("kvx_registrations_total").increment(1);
                        tracing::info!(%session, %endpoint, sglang_0_5_23 = v0523, "decode registered");
                    }
                    Err(e) => {
                        // A DCP size or rank this rank cannot pair with (sglang 0.5.23 refuses
                        // DCP 1 with a non-zero rank too): dropped, the session stays unknown.
                        metrics::counter!("kvx_malformed_frames_total", "kind" => e.kind())
                            .increment(1);
                        tracing::warn!(%session, %endpoint, error = %e, "registration refused");
                    }
                }
                r
            }
            PrefillInbound::Metadata(req) => self.metadata(now, *req, out),
            PrefillInbound::Abort {
                room,
                endpoint,
                generation,
            } => {
                let form = if generation.is_some() { "5" } else { "4" };
                metrics::counter!("kvx_aborts_total", "frames" => form).increment(1);
                let event = PrefillEvent::Abort {
                    room,
                    endpoint,
                    generation,
                };
                self.handle(now, event, Some(room), out)
            }
            PrefillInbound::StagingRsp(rsp) => {
                self.staging_rsp(now, &rsp, out);
                Ok(())
            }
            PrefillInbound::Watermark(wm) => {
                self.staging_watermark(now, &wm, out);
                Ok(())
            }
        };
        self.check_dying(now, false, out);
        r
    }

    fn metadata(
        &mut self,
        now: Instant,
        req: kvx_core::TransferRequest,
        out: &mut Vec<Output>,
    ) -> Result<(), PrefillError> {
        let room = req.room;
        let pages = req.dst.as_ref().map_or(0, |d| d.kv_pages.len());
        let total_pages = req.dst.as_ref().map(|d| d.kv_pages.len());
        let writes = req.dst.is_some();
        let session = req.session.clone();
        self.known.insert(room);
        if let Err(e) = self.handle(now, PrefillEvent::Metadata(req), Some(room), out) {
            // An unregistered session, or too many rooms waiting for their sender: nothing is
            // sent anywhere.
            metrics::counter!("kvx_metadata_refused_total", "reason" => e.kind()).increment(1);
            tracing::warn!(%room, %session, error = %e, "metadata refused");
            return Err(e);
        }
        if writes && self.mgr.poll(room).is_some_and(|s| !s.is_terminal()) {
            self.preconnect(now, room, &session, out);
        }
        if let Some(total_pages) = total_pages {
            self.staging_open(now, room, &session, total_pages, out);
        }
        if self.cfg.auto_open && self.mgr.poll(room).is_some_and(|s| !s.is_terminal()) {
            // The synthetic forward pass: every announced room gets a sender (not one that
            // concluded already: its late metadata was answered status 0).
            let _ = self.handle(now, PrefillEvent::SenderCreated { room }, Some(room), out);
        }
        if let Some(reason) = self.fatal_text() {
            // The rank is going down: a room opened now can never be served.
            let _ = self.handle(now, PrefillEvent::Fatal { reason }, None, out);
            return Ok(());
        }
        if self.mgr.poll(room) == Some(KVPoll::WaitingForInput) && self.announced.insert(room) {
            out.push(Output::Event(EngineEvent::Ready { room, pages }));
        }
        Ok(())
    }

    /// A worker finished `job` (nothing of it can still reach the decode): reports its batch,
    /// or its staged chunk, to the manager.
    pub fn finished(&mut self, now: Instant, job: Job, outcome: Outcome, out: &mut Vec<Output>) {
        self.complete(now, job, outcome, out);
        self.check_dying(now, false, out);
    }

    fn complete(&mut self, now: Instant, job: Job, outcome: Outcome, out: &mut Vec<Output>) {
        let Job { room, work, .. } = job;
        if matches!(work, Work::Connect) {
            // Only ever reported when its worker is gone: the room's own jobs meet the same fate.
            return;
        }
        crate::timeline::stage!(room, "completed");
        let written = matches!(outcome, Outcome::Done);
        let result = match outcome {
            Outcome::Done | Outcome::Skipped => Ok(()),
            // A failed transfer blacklists the session (the manager fails every open room
            // writing to it).
            Outcome::PeerFailed(reason) => Err(reason),
            Outcome::RoomFailed(reason) => {
                // One room's problem: fail it (every decode rank of the room is told once it
                // drained); the session stays usable.
                self.fail(now, room, &reason, out);
                Ok(())
            }
        };
        match work {
            Work::Batch { batch_id, .. } => {
                let event = PrefillEvent::BatchDone { batch_id, result };
                let _ = self.handle(now, event, Some(room), out);
            }
            Work::Connect => {}
            Work::Stage(w) => {
                if written {
                    let rank = self.mgr.prefill_unique_rank();
                    let frames = wire::encode_chunk_ready(&w.chunk_ready(rank));
                    out.push(Output::Send {
                        endpoint: w.endpoint.clone(),
                        frames,
                        status_of: None,
                    });
                }
                self.with_staging(now, out, |d, fx| d.chunk_done(&w.batches, result, fx));
            }
        }
    }

    /// The worker of `shard` died on `job` (if it held one) with `fault`: every open room
    /// fails; the worker is restarted ([`Output::RestartWorker`]) when the rank restarts
    /// workers, else its shard is buried and the rank reports the fault once nothing of any room
    /// is in flight ([`Output::Fatal`]).
    pub fn died(
        &mut self,
        now: Instant,
        shard: usize,
        job: Option<Job>,
        fault: WorkerFault,
        out: &mut Vec<Output>,
    ) {
        let cause = fault.cause();
        let err = TransferThreadFailed {
            inner: fault,
            bootstrap_port: self.cfg.bootstrap_port,
            shard,
        };
        tracing::error!(shard, cause, "{err}");
        metrics::counter!("kvx_worker_failures_total", "cause" => cause).increment(1);
        let reason = err.to_string();
        let _ = self.handle(now, PrefillEvent::Fatal { reason }, None, out);
        // The job the worker died on: nothing more of it is written by that thread.
        if let Some(job) = job {
            self.complete(now, job, Outcome::Skipped, out);
        }
        if self.cfg.restart_workers {
            metrics::counter!("kvx_worker_restarts_total").increment(1);
            out.push(Output::RestartWorker(shard));
        } else {
            self.dead_shards.insert(shard);
            out.push(Output::Bury(shard));
            if self.dying.is_none() {
                self.dying = Some((err, now));
            }
        }
        self.check_dying(now, false, out);
    }

    /// The worker of `shard` could not be restarted (or the rank is stopping): its shard is
    /// buried. A rank that restarts workers keeps serving on the other shards.
    pub fn worker_lost(&mut self, now: Instant, shard: usize, out: &mut Vec<Output>) {
        self.dead_shards.insert(shard);
        out.push(Output::Bury(shard));
        self.check_dying(now, false, out);
    }

    /// A liveness probe found `session`'s decode gone: the manager fails its open rooms.
    pub fn session_lost(&mut self, now: Instant, session: SessionId, out: &mut Vec<Output>) {
        let _ = self.handle(now, PrefillEvent::SessionLost { session }, None, out);
        self.check_dying(now, false, out);
    }

    /// Hands out a pending fatal fault once no batch is outstanding (or after [`DRAIN_LIMIT`]).
    fn check_dying(&mut self, now: Instant, timed: bool, out: &mut Vec<Output>) {
        let Some((_, since)) = &self.dying else {
            return;
        };
        let drained = self.mgr.live_entries().batches == 0;
        #[cfg(feature = "sim-mutants")]
        let drained = drained || self.early_exit;
        let overdue = timed && now.saturating_duration_since(*since) >= DRAIN_LIMIT;
        if !drained && !overdue {
            return;
        }
        let Some((err, _)) = self.dying.take() else {
            return;
        };
        if !drained {
            tracing::error!("batches still outstanding after {DRAIN_LIMIT:?}; reporting anyway");
        }
        let err = Arc::new(err);
        self.fatal = Some(err.clone());
        out.push(Output::Fatal(err));
    }

    fn fatal_text(&self) -> Option<String> {
        self.dying
            .as_ref()
            .map(|(e, _)| e.to_string())
            .or_else(|| self.fatal.as_ref().map(|e| e.to_string()))
    }

    /// Queues a job on its room's shard (completing it unsent when that shard's worker is
    /// dead).
    fn post(
        &mut self,
        now: Instant,
        room: Room,
        session: SessionId,
        work: Work,
        out: &mut Vec<Output>,
    ) {
        let shard = self.shard_of(&session, room);
        let cancel = self.cancel.entry(room).or_default().clone();
        let job = Job {
            room,
            session,
            work,
            cancel,
        };
        if self.dead_shards.contains(&shard) {
            self.complete(now, job, Outcome::Skipped, out);
            return;
        }
        crate::timeline::stage!(room, "posted");
        self.touch(shard, &job.session, now);
        out.push(Output::Post { shard, job });
    }

    /// Asks the worker that will carry `room`'s writes to `session` to open its data session
    /// now ([`Work::Connect`]) unless a job went to it recently enough that the session is
    /// still open: the handshake then runs while the forward pass computes the room.
    fn preconnect(&mut self, now: Instant, room: Room, session: &SessionId, out: &mut Vec<Output>) {
        let shard = self.shard_of(session, room);
        let recent = self
            .warm
            .get(session)
            .and_then(|shards| shards.get(shard).copied().flatten())
            .is_some_and(|t| now.saturating_duration_since(t) < SESSION_IDLE / 2);
        if recent || self.dead_shards.contains(&shard) {
            return;
        }
        self.touch(shard, session, now);
        let job = Job {
            room,
            session: session.clone(),
            work: Work::Connect,
            cancel: Arc::default(),
        };
        out.push(Output::Post { shard, job });
    }

    /// Notes that a job went to `session` on `shard` at `now`.
    fn touch(&mut self, shard: usize, session: &SessionId, now: Instant) {
        let queues = self.cfg.queues.max(1);
        let shards = match self.warm.get_mut(session) {
            Some(shards) => shards,
            None => self
                .warm
                .entry(session.clone())
                .or_insert_with(|| vec![None; queues]),
        };
        if let Some(t) = shards.get_mut(shard) {
            *t = Some(now);
        }
    }

    /// The transfer queue of a room's jobs towards a decode session: every chunk of a room stays
    /// on one queue, in order, and one decode's rooms spread over every queue (sglang keys the
    /// queue by session alone, so one decode's rooms all wait on one worker).
    fn shard_of(&self, session: &SessionId, room: Room) -> usize {
        let key = session.port().unwrap_or(0).wrapping_add(room.get());
        (key % self.cfg.queues.max(1) as u64) as usize
    }

    /// Sets a room's cancel flag: its queued jobs are skipped.
    fn cancel_room(&self, room: Room) {
        if let Some(flag) = self.cancel.get(&room) {
            flag.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvx_core::prefill::LocalMemory;
    use kvx_core::{
        AuxLayout, DecodeRegistration, Destination, Endpoint, KvLayout, TransferRequest,
    };

    use super::*;

    const QUEUES: usize = 4;

    /// A core of `QUEUES` shards (two layers of 16 pages of 64 bytes) with one decode
    /// registered; the decode's session and inbox.
    fn core_with_decode(now: Instant) -> (PrefillCore, SessionId, Endpoint) {
        let kv = KvLayout::mha_contiguous(0x1000_0000, 2, 64, 16, 1);
        let aux_ptrs: Vec<u64> = (0..10).map(|i| 0x2000_0000 + (i << 20)).collect();
        let aux = AuxLayout::sglang_default(&aux_ptrs, Some(16)).unwrap();
        let local = LocalMemory {
            kv,
            aux,
            state: Vec::new(),
        };
        let mgr = PrefillManager::new(kvx_core::PrefillConfig::default(), local);
        let cfg = CoreConfig {
            queues: QUEUES,
            auto_open: true,
            ..CoreConfig::default()
        };
        let mut core = PrefillCore::new(cfg, mgr, None, now);
        let (session, inbox) = (
            SessionId::new("127.0.0.1:7000"),
            Endpoint::new("127.0.0.1", 7001),
        );
        let reg = DecodeRegistration::plain(
            inbox.clone(),
            session.clone(),
            (0..4).map(|i| 0x3000_0000 + (i << 20)).collect(),
            (0..10).map(|i| 0x4000_0000 + (i << 20)).collect(),
            64,
        );
        let mut out = Vec::new();
        core.inbound(now, PrefillInbound::Registration(Box::new(reg)), &mut out)
            .unwrap();
        (core, session, inbox)
    }

    /// The decode's metadata for `room` (`None` pages: a dummy rank's); the shards of the
    /// `Work::Connect` jobs it posted.
    fn metadata(
        core: &mut PrefillCore,
        now: Instant,
        (session, inbox): (&SessionId, &Endpoint),
        room: u64,
        pages: Option<Vec<i32>>,
    ) -> Vec<usize> {
        let room = Room::new(room).unwrap();
        let req = TransferRequest {
            room,
            endpoint: inbox.clone(),
            session: session.clone(),
            dst: pages.map(|kv_pages| Destination {
                kv_pages,
                aux_index: 0,
                state_indices: vec![],
            }),
            required_dst_info_num: 1,
            decode_prefix_len: Some(0),
            device_kv_pages: vec![],
        };
        let mut out = Vec::new();
        core.inbound(now, PrefillInbound::Metadata(Box::new(req)), &mut out)
            .unwrap();
        out.iter()
            .filter_map(|o| match o {
                Output::Post { shard, job } if matches!(job.work, Work::Connect) => {
                    assert_eq!(job.room, room);
                    assert_eq!(&job.session, session);
                    Some(*shard)
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn metadata_opens_the_rooms_data_session_once_per_idle_period() {
        let t0 = Instant::now();
        let (mut core, session, inbox) = core_with_decode(t0);
        let d = (&session, &inbox);
        let shard_of = |room: u64| ((7000 + room) % QUEUES as u64) as usize;
        // A room's metadata asks the worker that will carry its writes to connect.
        assert_eq!(metadata(&mut core, t0, d, 1, Some(vec![0])), [shard_of(1)]);
        // Another room on that shard does not while the session is surely open; one on another
        // shard does.
        assert_eq!(
            metadata(&mut core, t0, d, 5, Some(vec![1])),
            Vec::<usize>::new()
        );
        assert_eq!(metadata(&mut core, t0, d, 2, Some(vec![2])), [shard_of(2)]);
        // A dummy rank's metadata writes nothing, so opens nothing.
        assert_eq!(metadata(&mut core, t0, d, 3, None), Vec::<usize>::new());
        // Once half the idle limit passed with no job on the shard, the worker may close its
        // session before the room's first write: connect again.
        let later = t0 + SESSION_IDLE / 2;
        assert_eq!(
            metadata(&mut core, later, d, 9, Some(vec![3])),
            [shard_of(9)]
        );
        // Housekeeping forgets shards idle past the limit; nothing else stays behind.
        let mut out = Vec::new();
        core.on_time(t0 + SESSION_IDLE + HOUSEKEEPING, &mut out);
        assert!(core.warm.is_empty());
    }

    #[test]
    fn a_dead_shard_gets_no_connect() {
        let t0 = Instant::now();
        let (mut core, session, inbox) = core_with_decode(t0);
        let shard = ((7000 + 1) % QUEUES as u64) as usize;
        let mut out = Vec::new();
        core.worker_lost(t0, shard, &mut out);
        let connects = metadata(&mut core, t0, (&session, &inbox), 1, Some(vec![0]));
        assert!(connects.is_empty(), "{connects:?}");
    }
}
