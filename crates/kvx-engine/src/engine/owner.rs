//! The one owner of a prefill rank's state: a loop that takes every input in arrival order —
//! decode messages, embedder calls, worker reports — and its own deadlines, feeds them to the
//! [`PrefillManager`] (and the staging driver) and performs their actions in the order produced.
//!
//! Nothing else touches the manager, so action order is structural: a status goes to the
//! notifier (the loop's own ZMQ sends) after the `CHUNK_READY` and `AUX_DATA` that precede it, a batch is queued to its
//! worker in plan order, and a room's pages are released (`EngineEvent::Released`) only once the
//! manager dropped the room — terminal, drained, known to its sender. Workers learn that a room
//! failed through its cancel flag and skip its queued jobs. Time reaches the manager as
//! deadlines ([`PrefillManager::poll_timeout`]); housekeeping (staging expiry, gauges) runs once
//! a second. A worker's fatal fault fails every open room; the rank then either restarts the
//! worker or, once every outstanding batch came back (nothing can still reach a decode), hands
//! [`TransferThreadFailed`] to the process.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::prefill::{PrefillAction, PrefillError, PrefillEvent, PrefillManager};
use kvx_core::{Chunk, KVPoll, Room, SessionId};

use super::notifier::Notifier;
use super::{EngineEvent, PrefillConfig, PrefillMemory};
use crate::fault::TransferThreadFailed;
use crate::prefill_staging::StagingDriver;
use crate::wire::{self, PrefillInbound};
use crate::worker::{self, Job, JobQueue, Outcome, Report, Work, WorkerCtx};

/// An embedder call, answered on `reply`.
pub(crate) enum Call {
    Open {
        room: Room,
        reply: SyncSender<Result<(), PrefillError>>,
    },
    Init {
        room: Room,
        num_pages: usize,
        aux_row: u64,
        reply: SyncSender<Result<(), PrefillError>>,
    },
    Send {
        room: Room,
        chunk: Chunk,
        reply: SyncSender<Result<(), PrefillError>>,
    },
    Fail {
        room: Room,
        reason: String,
        reply: SyncSender<bool>,
    },
    /// Answer once every notice queued so far went out (or `timeout` passed).
    Flush {
        timeout: Duration,
        reply: SyncSender<()>,
    },
}

/// Everything the loop receives.
pub(crate) enum Input {
    /// A well-formed message from a decode.
    Inbound(PrefillInbound),
    /// An embedder call.
    Call(Call),
    /// A transfer worker's report.
    Worker(Report),
    /// A liveness probe found the decode behind a session gone (see `engine/staging.rs`).
    SessionLost(SessionId),
    /// Stop the loop.
    Stop,
}

impl From<Report> for Input {
    fn from(r: Report) -> Self {
        Input::Worker(r)
    }
}

/// What the embedder reads without a round trip: room statuses and failure reasons as of the
/// loop's last step, the number of rooms held, the fatal error once published.
#[derive(Default)]
pub(crate) struct View {
    rooms: Mutex<HashMap<Room, (KVPoll, Option<String>)>>,
    held: AtomicUsize,
    fatal: Mutex<Option<Arc<TransferThreadFailed>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl View {
    pub(crate) fn poll(&self, room: Room) -> Option<KVPoll> {
        lock(&self.rooms).get(&room).map(|v| v.0)
    }

    pub(crate) fn failure(&self, room: Room) -> Option<String> {
        lock(&self.rooms).get(&room).and_then(|v| v.1.clone())
    }

    /// Rooms the view holds that are not terminal yet.
    pub(crate) fn open_rooms(&self) -> Vec<Room> {
        lock(&self.rooms)
            .iter()
            .filter(|(_, (status, _))| !status.is_terminal())
            .map(|(room, _)| *room)
            .collect()
    }

    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub(crate) fn fatal(&self) -> Option<Arc<TransferThreadFailed>> {
        lock(&self.fatal).clone()
    }
}

/// What [`Owner::new`] is built from.
pub(crate) struct Parts {
    pub cfg: PrefillConfig,
    pub mem: PrefillMemory,
    pub mgr: PrefillManager,
    pub staging: Option<StagingDriver>,
    pub queues: Vec<Sender<Job>>,
    pub job_queues: Vec<JobQueue>,
    pub workers: Arc<WorkerCtx>,
    pub inputs: SyncSender<Input>,
    pub notifier: Notifier,
    pub events: Option<Sender<EngineEvent>>,
    pub fatal_tx: Sender<Arc<TransferThreadFailed>>,
    pub view: Arc<View>,
    pub stop: Arc<AtomicBool>,
}

/// How long a rank whose worker died waits for the other workers' batches before it reports
/// the fault anyway.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);
/// Housekeeping period (staging expiry, forgotten rooms, gauges).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// The loop's state: the manager, the staging driver and the driver-side room sets.
pub(crate) struct Owner {
    pub(super) cfg: PrefillConfig,
    pub(super) mem: PrefillMemory,
    pub(super) mgr: PrefillManager,
    pub(super) staging: Option<StagingDriver>,
    queues: Vec<Sender<Job>>,
    job_queues: Vec<JobQueue>,
    /// Shards whose worker died and was not restarted: their jobs are completed unsent.
    dead_shards: HashSet<usize>,
    pub(super) workers: Arc<WorkerCtx>,
    pub(super) inputs: SyncSender<Input>,
    /// The ZMQ sends toward decodes (status, `ABORT_ACK`, `AUX_DATA`, staging messages).
    notifier: Notifier,
    events: Option<Sender<EngineEvent>>,
    fatal_tx: Sender<Arc<TransferThreadFailed>>,
    view: Arc<View>,
    stop: Arc<AtomicBool>,
    /// Every room the manager may hold.
    known: HashSet<Room>,
    /// Rooms announced to the forward pass (`EngineEvent::Ready`).
    announced: HashSet<Room>,
    /// Rooms concluded whose entries the manager still holds.
    concluded: HashMap<Room, KVPoll>,
    /// Per-room cancel flags shared with the jobs in the workers' queues.
    cancel: HashMap<Room, Arc<AtomicBool>>,
    /// When each room's last chunk was handed over (`kvx_room_latency_seconds` ends at its
    /// first status).
    last_chunk: HashMap<Room, Instant>,
    /// A worker died and is not restarted: the fault, published once the batches drained.
    dying: Option<(TransferThreadFailed, Instant)>,
    next_housekeeping: Instant,
    /// Staging sessions probed for liveness, with when the last probe started.
    pub(super) probed: HashMap<SessionId, Instant>,
}

impl Owner {
    pub(crate) fn new(p: Parts) -> Self {
        Owner {
            cfg: p.cfg,
            mem: p.mem,
            mgr: p.mgr,
            staging: p.staging,
            queues: p.queues,
            job_queues: p.job_queues,
            dead_shards: HashSet::new(),
            workers: p.workers,
            inputs: p.inputs,
            notifier: p.notifier,
            events: p.events,
            fatal_tx: p.fatal_tx,
            view: p.view,
            stop: p.stop,
            known: HashSet::new(),
            announced: HashSet::new(),
            concluded: HashMap::new(),
            cancel: HashMap::new(),
            last_chunk: HashMap::new(),
            dying: None,
            next_housekeeping: Instant::now() + HOUSEKEEPING,
            probed: HashMap::new(),
        }
    }

    /// Runs until [`Input::Stop`], the rank's stop flag, or every input sender is gone.
    pub(crate) fn run(mut self, inputs: &Receiver<Input>) {
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let mut due = self.next_housekeeping;
            if let Some(t) = self.mgr.poll_timeout() {
                due = due.min(t);
            }
            if let Some(t) = self.notifier.retry_due() {
                due = due.min(t);
            }
            match inputs.recv_timeout(due.saturating_duration_since(now)) {
                Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(input) => self.input(input),
                Err(RecvTimeoutError::Timeout) => {}
            }
            self.on_time(Instant::now());
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    fn input(&mut self, input: Input) {
        match input {
            Input::Inbound(msg) => self.inbound(msg),
            Input::Call(call) => self.call(call),
            Input::Worker(Report::Finished { job, outcome, .. }) => self.finished(job, outcome),
            Input::Worker(Report::Died { shard, job, fault }) => self.died(shard, job, fault),
            Input::SessionLost(session) => self.session_lost(session),
            Input::Stop => {}
        }
        self.check_dying(false);
    }

    /// Deadlines and housekeeping due at `now`.
    fn on_time(&mut self, now: Instant) {
        if self.mgr.poll_timeout().is_some_and(|t| t <= now) {
            let _ = self.handle(PrefillEvent::Tick, None);
        }
        if self.notifier.retry_due().is_some_and(|t| t <= now) {
            self.notifier.retry();
        }
        if now >= self.next_housekeeping {
            self.next_housekeeping = now + HOUSEKEEPING;
            self.staging_housekeeping(now);
            self.notifier.housekeeping();
            self.gauges();
            self.check_dying(true);
        }
    }

    fn call(&mut self, call: Call) {
        match call {
            Call::Open { room, reply } => {
                self.known.insert(room);
                let r = self.handle(PrefillEvent::SenderCreated { room }, Some(room));
                let _ = reply.send(r);
            }
            Call::Init {
                room,
                num_pages,
                aux_row,
                reply,
            } => {
                let event = PrefillEvent::SenderInit {
                    room,
                    num_pages,
                    aux_row,
                };
                let _ = reply.send(self.handle(event, Some(room)));
            }
            Call::Send { room, chunk, reply } => {
                let last = chunk.is_last;
                if last {
                    crate::timeline::stage!(room, "loop");
                }
                let r = self.handle(PrefillEvent::Chunk { room, chunk }, Some(room));
                if last && r.is_ok() && self.mgr.poll(room).is_some() {
                    self.last_chunk.entry(room).or_insert_with(Instant::now);
                }
                let _ = reply.send(r);
            }
            Call::Flush { timeout, reply } => {
                self.flush_notices(timeout);
                let _ = reply.send(());
            }
            Call::Fail {
                room,
                reason,
                reply,
            } => {
                let _ = reply.send(self.fail_room(room, &reason));
            }
        }
    }

    /// Dispatches one message from a decode.
    fn inbound(&mut self, msg: PrefillInbound) {
        match msg {
            PrefillInbound::Registration(reg) => {
                let (session, endpoint) = (reg.session.clone(), reg.endpoint.clone());
                let v0523 = reg.accepts_status_reason();
                match self.handle(PrefillEvent::Register(*reg), None) {
                    Ok(()) => {
                        self.workers.revive(&session);
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
            }
            PrefillInbound::Metadata(req) => self.metadata(*req),
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
                let _ = self.handle(event, Some(room));
            }
            PrefillInbound::StagingRsp(rsp) => self.staging_rsp(&rsp),
            PrefillInbound::Watermark(wm) => self.staging_watermark(&wm),
        }
    }

    fn metadata(&mut self, req: kvx_core::TransferRequest) {
        let room = req.room;
        let pages = req.dst.as_ref().map_or(0, |d| d.kv_pages.len());
        let total_pages = req.dst.as_ref().map(|d| d.kv_pages.len());
        let session = req.session.clone();
        self.known.insert(room);
        if let Err(e) = self.handle(PrefillEvent::Metadata(req), Some(room)) {
            // An unregistered session, or too many rooms waiting for their sender: nothing is
            // sent anywhere.
            metrics::counter!("kvx_metadata_refused_total", "reason" => e.kind()).increment(1);
            tracing::warn!(%room, %session, error = %e, "metadata refused");
            return;
        }
        if let Some(total_pages) = total_pages {
            self.staging_open(room, &session, total_pages);
        }
        if self.cfg.auto_open {
            // The synthetic forward pass: every announced room gets a sender.
            let _ = self.handle(PrefillEvent::SenderCreated { room }, Some(room));
        }
        if let Some(reason) = self.fatal_text() {
            // The rank is going down: a room opened now can never be served.
            let _ = self.handle(PrefillEvent::Fatal { reason }, None);
            return;
        }
        if self.mgr.poll(room) == Some(KVPoll::WaitingForInput) && self.announced.insert(room) {
            self.event(EngineEvent::Ready { room, pages });
        }
    }

    /// Feeds one event to the manager and performs its actions in order; `room` (the event's,
    /// when it has one) is the room whose view is refreshed beside those the actions name.
    pub(super) fn handle(
        &mut self,
        event: PrefillEvent,
        room: Option<Room>,
    ) -> Result<(), PrefillError> {
        let wide = matches!(
            event,
            PrefillEvent::Tick | PrefillEvent::Fatal { .. } | PrefillEvent::BatchDone { .. }
        );
        let mut out = Vec::new();
        let r = self.mgr.handle(Instant::now(), event, &mut out);
        let mut touched: Vec<Room> = room.into_iter().collect();
        touched.extend(out.iter().map(PrefillAction::room));
        self.apply(out);
        // Rooms the manager dropped are released: their pages may be reused.
        let released: Vec<(Room, KVPoll)> = self
            .concluded
            .iter()
            .filter(|(r, _)| self.mgr.poll(**r).is_none())
            .map(|(r, s)| (*r, *s))
            .collect();
        if wide {
            touched.extend(self.known.iter().copied());
        }
        touched.extend(released.iter().map(|(r, _)| *r));
        self.refresh(&touched);
        for (room, status) in released {
            self.last_chunk.remove(&room);
            self.concluded.remove(&room);
            self.announced.remove(&room);
            self.event(EngineEvent::Released { room, status });
        }
        r
    }

    /// Brings the embedder's view (and the cancel flags) up to date for `rooms`.
    fn refresh(&mut self, rooms: &[Room]) {
        let mut view = lock(&self.view.rooms);
        for &room in rooms {
            match self.mgr.poll(room) {
                Some(status) => {
                    if status.is_terminal()
                        && let Some(flag) = self.cancel.get(&room)
                    {
                        flag.store(true, Ordering::Release);
                    }
                    let reason = self.mgr.failure(room).map(ToString::to_string);
                    view.insert(room, (status, reason));
                }
                None => {
                    view.remove(&room);
                    self.known.remove(&room);
                    if let Some(flag) = self.cancel.remove(&room) {
                        flag.store(true, Ordering::Release);
                    }
                }
            }
        }
        drop(view);
        self.view
            .held
            .store(self.mgr.room_count(), Ordering::Relaxed);
    }

    /// Fails an open room from this side; every decode of the room is told once it drained.
    /// False when the room was not open.
    pub(super) fn fail_room(&mut self, room: Room, reason: &str) -> bool {
        if self.mgr.poll(room).is_none_or(KVPoll::is_terminal) {
            return false;
        }
        let event = PrefillEvent::SenderFailed {
            room,
            reason: reason.to_owned(),
        };
        self.handle(event, Some(room)).is_ok()
    }

    /// Queues a job on its session's shard (completing it unsent when that shard's worker is
    /// dead).
    pub(super) fn post(&mut self, room: Room, session: SessionId, work: Work) {
        let shard = self.shard_of(&session);
        let cancel = self.cancel.entry(room).or_default().clone();
        let job = Job {
            room,
            session,
            work,
            cancel,
        };
        if self.dead_shards.contains(&shard) {
            self.finished(job, Outcome::Skipped);
            return;
        }
        crate::timeline::stage!(room, "posted");
        if let Err(e) = self.queues[shard].send(job) {
            self.finished(e.0, Outcome::RoomFailed("transfer queue closed".into()));
        }
    }

    /// The transfer queue of a decode session: all chunks of a room stay on one queue, in order.
    fn shard_of(&self, session: &SessionId) -> usize {
        (session.port().unwrap_or(0) % self.queues.len().max(1) as u64) as usize
    }

    /// A job came back: reports its batch (or staged chunk) to the manager.
    fn finished(&mut self, job: Job, outcome: Outcome) {
        let Job { room, work, .. } = job;
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
                self.fail_room(room, &reason);
                Ok(())
            }
        };
        match work {
            Work::Batch { batch_id, .. } => {
                let _ = self.handle(PrefillEvent::BatchDone { batch_id, result }, Some(room));
            }
            Work::Stage(w) => {
                if written {
                    let rank = self.mgr.prefill_unique_rank();
                    let frames = wire::encode_chunk_ready(&w.chunk_ready(rank));
                    self.notify(w.endpoint.clone(), frames);
                }
                self.with_staging(|d, fx| d.chunk_done(&w.batches, result, fx));
            }
        }
    }

    /// A worker died on `job` with `fault`: every open room fails; the worker is restarted, or
    /// the rank reports the fault once nothing of any room is in flight.
    fn died(&mut self, shard: usize, job: Option<Job>, fault: crate::fault::WorkerFault) {
        let cause = fault.cause();
        let err = TransferThreadFailed {
            inner: fault,
            bootstrap_port: self.cfg.bootstrap_port,
            shard,
        };
        tracing::error!(shard, cause, "{err}");
        metrics::counter!("kvx_worker_failures_total", "cause" => cause).increment(1);
        let _ = self.handle(
            PrefillEvent::Fatal {
                reason: err.to_string(),
            },
            None,
        );
        // The job the worker died on: nothing more of it is written by that thread.
        if let Some(job) = job {
            self.finished(job, Outcome::Skipped);
        }
        if self.cfg.restart_workers && !self.stop.load(Ordering::Relaxed) {
            metrics::counter!("kvx_worker_restarts_total").increment(1);
            let queue = self.job_queues[shard].clone();
            if let Err(e) =
                worker::spawn_worker(self.workers.clone(), shard, queue, self.inputs.clone())
            {
                tracing::error!(error = %e, "cannot restart transfer worker");
                self.bury(shard);
            }
        } else {
            self.bury(shard);
            if self.dying.is_none() {
                self.dying = Some((err, Instant::now()));
            }
        }
    }

    /// Completes, unsent, every job queued on a shard whose worker is gone for good.
    fn bury(&mut self, shard: usize) {
        self.dead_shards.insert(shard);
        loop {
            let next = lock(&self.job_queues[shard]).try_recv();
            match next {
                Ok(job) => self.finished(job, Outcome::Skipped),
                Err(_) => break,
            }
        }
    }

    /// Publishes a pending fatal fault once no batch is outstanding (or after [`DRAIN_LIMIT`]).
    fn check_dying(&mut self, timed: bool) {
        let Some((_, since)) = &self.dying else {
            return;
        };
        let drained = self.mgr.live_entries().batches == 0;
        let overdue = timed && since.elapsed() >= DRAIN_LIMIT;
        if !drained && !overdue {
            return;
        }
        let Some((err, _)) = self.dying.take() else {
            return;
        };
        if !drained {
            tracing::error!("batches still outstanding after {DRAIN_LIMIT:?}; reporting anyway");
        }
        self.flush_notices(Duration::from_millis(500));
        let err = Arc::new(err);
        lock(&self.view.fatal).get_or_insert_with(|| err.clone());
        let _ = self.fatal_tx.send(err);
    }

    fn fatal_text(&self) -> Option<String> {
        self.dying
            .as_ref()
            .map(|(e, _)| e.to_string())
            .or_else(|| self.view.fatal().map(|e| e.to_string()))
    }

    /// Performs the manager's actions, in order.
    fn apply(&mut self, actions: Vec<PrefillAction>) {
        for a in actions {
            match a {
                PrefillAction::PostBatch {
                    room,
                    session,
                    batch_id,
                    ops,
                    ..
                } => self.post(room, session, Work::Batch { batch_id, ops }),
                PrefillAction::Stage {
                    room,
                    session,
                    batch_id,
                    slice,
                    src_pages,
                    ..
                } => {
                    let now = Instant::now();
                    let staged = self.with_staging(|d, fx| {
                        d.stage(now, room, &session, batch_id, slice, &src_pages, fx);
                    });
                    if staged.is_none() {
                        let result = Err("staging is off on this prefill rank".into());
                        let _ = self.handle(PrefillEvent::BatchDone { batch_id, result }, None);
                    }
                }
                PrefillAction::FillRoomRow { room, addr, len } => {
                    let filled = usize::try_from(len).ok().is_some_and(|n| {
                        let mut row = vec![0u8; n];
                        kvx_core::fill_room_row(&mut row, room)
                            && self.mem.aux.copy_in(addr, &row).is_ok()
                    });
                    if !filled {
                        tracing::error!(%room, addr, len, "room row not filled");
                    }
                }
                PrefillAction::SendAuxData {
                    room,
                    endpoint,
                    index,
                    dst_row,
                    src_addr,
                    len,
                } => {
                    // The row (its room slot filled just before) goes on the notifier's socket
                    // to this decode, ahead of the room's status.
                    let frames = self
                        .mem
                        .aux
                        .to_vec(src_addr, len)
                        .map_err(|e| e.to_string());
                    let frames = frames.and_then(|row| {
                        let index = u32::try_from(index).map_err(|e| e.to_string())?;
                        wire::encode_aux_data(room, index, dst_row, &row).map_err(|e| e.to_string())
                    });
                    match frames {
                        Ok(f) => {
                            metrics::counter!("kvx_aux_messages_total").increment(1);
                            self.notify(endpoint, f);
                        }
                        Err(e) => tracing::error!(%room, error = %e, "AUX_DATA not sent"),
                    }
                }
                PrefillAction::SendStatus {
                    room,
                    endpoint,
                    status,
                    prefill_rank,
                    reason,
                    with_reason,
                } => {
                    // 4 frames only towards a decode known to take a reason (sglang 0.5.23).
                    let reason = reason.as_deref().filter(|_| with_reason);
                    metrics::counter!("kvx_status_sent_total", "status" => status_label(status))
                        .increment(1);
                    if let Some(t) = self.last_chunk.remove(&room) {
                        metrics::histogram!("kvx_room_latency_seconds")
                            .record(t.elapsed().as_secs_f64());
                    }
                    if reason.is_some() {
                        metrics::counter!("kvx_status_reason_frames_total").increment(1);
                    }
                    let f = wire::encode_status_with_reason(room, status, prefill_rank, reason);
                    crate::timeline::stage!(room, "status_queued");
                    self.notify(endpoint, f);
                    crate::timeline::stage!(room, "status_sent");
                }
                PrefillAction::AbortAck {
                    endpoint,
                    room,
                    prefill_rank,
                    generation,
                } => {
                    // 4 frames echoing a 5-frame ABORT's generation (sglang 0.5.23), else the
                    // ranked 3-frame form of sglang main.
                    let form = if generation.is_some() { "4" } else { "3" };
                    metrics::counter!("kvx_abort_acks_total", "frames" => form).increment(1);
                    let frames = wire::encode_abort_ack(room, prefill_rank, generation);
                    self.notify(endpoint, frames);
                }
                PrefillAction::Concluded {
                    room,
                    status,
                    reason,
                } => {
                    if status == KVPoll::Failed {
                        metrics::counter!("kvx_room_failures_total").increment(1);
                        if let Some(r) = &reason {
                            tracing::warn!(%room, reason = %r, "room failed");
                        }
                    }
                    metrics::counter!("kvx_rooms_finished_total", "status" => status_label(status))
                        .increment(1);
                    if let Some(flag) = self.cancel.get(&room) {
                        flag.store(true, Ordering::Release);
                    }
                    self.concluded.insert(room, status);
                    self.with_staging(|d, fx| d.conclude(room, fx));
                }
            }
        }
    }

    pub(super) fn event(&self, e: EngineEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    /// Sends a message to a decode inbox, in order after every earlier one to it (held, and
    /// retried from the loop's deadlines, while that inbox is full).
    pub(super) fn notify(&mut self, endpoint: kvx_core::Endpoint, frames: crate::wire::Frames) {
        self.notifier.send(endpoint, frames);
    }

    /// Waits (bounded) until every held message went out to ZMQ.
    fn flush_notices(&mut self, timeout: Duration) {
        self.notifier.flush(timeout);
        // ZMQ writes asynchronously; give its I/O thread a moment on loopback.
        std::thread::sleep(Duration::from_millis(200));
    }

    /// Room gauges (once a second, not per event).
    fn gauges(&self) {
        let mut counts = [0usize; 5];
        for (status, _) in lock(&self.view.rooms).values() {
            counts[status.as_u8() as usize] += 1;
        }
        for s in KVPoll::ALL {
            metrics::gauge!("kvx_rooms", "state" => status_label(s))
                .set(counts[s.as_u8() as usize] as f64);
        }
        let live = self.mgr.live_entries();
        metrics::gauge!("kvx_room_entries").set(live.rooms as f64);
        metrics::gauge!("kvx_unopened_room_entries").set(live.unopened_rooms as f64);
        metrics::gauge!("kvx_session_entries").set(live.sessions as f64);
        metrics::gauge!("kvx_outstanding_batches").set(live.batches as f64);
    }
}

/// The metric label of a status: `failed`, `bootstrapping`, `waiting_for_input`,
/// `transferring`, `success` (no `KVPoll.` prefix).
pub(crate) fn status_label(s: KVPoll) -> &'static str {
    match s {
        KVPoll::Failed => "failed",
        KVPoll::Bootstrapping => "bootstrapping",
        KVPoll::WaitingForInput => "waiting_for_input",
        KVPoll::Transferring => "transferring",
        KVPoll::Success => "success",
    }
}
