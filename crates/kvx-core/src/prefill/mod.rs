//! The prefill room manager: a sans-IO state machine that turns decode metadata, local sender
//! events, chunks and write completions into write batches, status messages and ABORT_ACKs.
//!
//! Drive it with [`PrefillManager::handle`]: pass the current [`Instant`] and one
//! [`PrefillEvent`]; it appends [`PrefillAction`]s for the driver to perform in order. A room goes
//! Bootstrapping → WaitingForInput (metadata from `required_dst_info_num` decode sessions; it may
//! arrive before the local sender exists) → Success (last chunk handled and every posted batch of
//! every session succeeded) or Failed (first reason kept; every non-dummy decode is told with
//! status 0). Once a room is terminal, its sender known and nothing is outstanding, every
//! per-room entry is dropped ([`PrefillManager::live_entries`] counts them for leak tests).
//!
//! Nothing of a room reaches a decode after its Failed status: the status 0 goes out only once
//! the room's posted batches all came back (a fatal fault included), so the decode may reuse its
//! pages as soon as it reads it. Network-fed state is bounded: registrations
//! ([`PrefillConfig::max_sessions`], least recently used evicted; a decode inbox that registers
//! a new session replaces its old one), rooms waiting for their sender
//! ([`PrefillConfig::max_unopened_rooms`], dropped after [`PrefillConfig::unopened_room_ttl`]),
//! and metadata from an unregistered session is refused without sending anything to the endpoint
//! it names. Time reaches the manager as deadlines: [`PrefillManager::poll_timeout`] says when the
//! next [`PrefillEvent::Tick`] is due.
//!
//! Two peer generations are served side by side, told apart by what each decode sends: a
//! registration with frame 19 (sglang 0.5.23) or a 5-frame `ABORT` marks its session as taking a
//! failure reason as a 4th status frame; an `ABORT` with a generation is acknowledged with the
//! 4-frame `ABORT_ACK` echoing it, a 4-frame `ABORT` (sglang main) with the 3-frame one, both only
//! once the room's writes drained. A registration whose DCP size or rank does not pair with this
//! rank's (1, 0) is refused ([`PrefillError::DcpMismatch`]).

#[cfg(feature = "sim-mutants")]
pub mod mutant;
mod plan;
#[cfg(test)]
mod tests;
pub mod types;

/// `true` when the test-only planted bug `$m` is armed (feature `sim-mutants`, see [`mutant`]);
/// a constant `false` without the feature.
macro_rules! mutant {
    ($self:ident, $m:ident) => {{
        #[cfg(feature = "sim-mutants")]
        let armed = $self.sim_mutant == Some(mutant::SimMutant::$m);
        #[cfg(not(feature = "sim-mutants"))]
        let armed = false;
        armed
    }};
}

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Instant;

pub use types::{
    BatchId, DEFAULT_BOOTSTRAP_TIMEOUT, DEFAULT_FAILED_SESSION_TTL, DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_UNOPENED_ROOMS, LiveEntries, LocalMemory, PrefillAction, PrefillConfig,
    PrefillError, PrefillEvent, RoomError, TransferPath,
};

use crate::peer::{DecodeRegistration, Endpoint, SessionId, TransferRequest};
use crate::{Chunk, KVPoll, Room};
use plan::{Session, plan_chunk};

/// The local sender of a room.
#[derive(Clone, Copy, Debug)]
struct Sender {
    created: Instant,
    /// `(num_pages, aux_row)` once initialised.
    init: Option<(usize, u64)>,
}

/// Everything held for one room.
#[derive(Debug)]
struct RoomState {
    status: KVPoll,
    first_seen: Instant,
    sender: Option<Sender>,
    /// One per decode session, in arrival order.
    infos: Vec<TransferRequest>,
    required: u32,
    prefix_len: Option<u64>,
    inflight: usize,
    last_done: bool,
    failure: Option<RoomError>,
    /// ABORT_ACKs waiting for the room to drain: one per decode endpoint, with the generation
    /// of its latest `ABORT` (`None` for a 4-frame one).
    pending_acks: Vec<(Endpoint, Option<u64>)>,
    /// The room failed while batches were in flight: its decodes get status 0 once they drain.
    notify_pending: bool,
    /// Decode endpoints that ABORTed the room: they get an `ABORT_ACK`, never a status.
    aborted_by: Vec<Endpoint>,
    /// The room's entry in the deadline set (bootstrap timeout or unopened TTL).
    deadline: Option<Instant>,
    /// `AUX_DATA` rows (`aux_over_tcp`) held until every batch of the room succeeded, then sent
    /// just before the Success statuses: a row is never sent to a decode whose KV writes failed
    /// (a decode restarted on the same address would write it into another room's row).
    aux_out: Vec<PrefillAction>,
}

impl RoomState {
    fn new(now: Instant) -> Self {
        RoomState {
            status: KVPoll::Bootstrapping,
            first_seen: now,
            sender: None,
            infos: Vec::new(),
            required: 0,
            prefix_len: None,
            inflight: 0,
            last_done: false,
            failure: None,
            pending_acks: Vec::new(),
            notify_pending: false,
            aborted_by: Vec::new(),
            deadline: None,
            aux_out: Vec::new(),
        }
    }

    fn endpoint_of(&self, session: &SessionId) -> Option<&Endpoint> {
        self.infos
            .iter()
            .find(|i| &i.session == session)
            .map(|i| &i.endpoint)
    }
}

/// How many concluded rooms a manager remembers to answer late metadata (see
/// [`PrefillManager`]'s `recent`).
pub const RECENT_ROOMS: usize = 4096;

/// The prefill side's room manager (one per prefill rank).
#[derive(Debug)]
pub struct PrefillManager {
    cfg: PrefillConfig,
    local: LocalMemory,
    rank: u32,
    /// Registered sessions with their last use (registration or metadata), for LRU eviction.
    sessions: HashMap<SessionId, (Session, u64)>,
    /// Monotonic use counter for `sessions`.
    use_clock: u64,
    /// Registrations recorded so far; each session holds the number of its own.
    registrations: u64,
    failed: HashMap<SessionId, Instant>,
    rooms: HashMap<Room, RoomState>,
    /// Rooms held without a local sender.
    unopened: usize,
    /// Room deadlines (mirrors each room's `deadline`).
    deadlines: BTreeSet<(Instant, Room)>,
    /// Batches in flight: their room, session and the session's registration they were
    /// planned for.
    batches: HashMap<BatchId, (Room, SessionId, u64)>,
    next_batch: u64,
    /// Rooms this rank concluded and dropped, the [`RECENT_ROOMS`] latest (oldest first): late
    /// metadata for one is answered status 0 at once, not left to wait for a sender that will
    /// never come (its decode would time out).
    recent: HashSet<Room>,
    recent_order: VecDeque<Room>,
    /// Test-only planted bug (see [`mutant`]).
    #[cfg(feature = "sim-mutants")]
    sim_mutant: Option<mutant::SimMutant>,
    /// The one-shot planted bug already fired (`LostStatus`), or the room it leaks (`Leak`).
    #[cfg(feature = "sim-mutants")]
    sim_fired: Option<Option<Room>>,
}

impl PrefillManager {
    /// A manager for one prefill rank with its registered memory.
    pub fn new(cfg: PrefillConfig, local: LocalMemory) -> Self {
        let rank = cfg.prefill_unique_rank();
        PrefillManager {
            cfg,
            local,
            rank,
            sessions: HashMap::new(),
            use_clock: 0,
            registrations: 0,
            failed: HashMap::new(),
            rooms: HashMap::new(),
            unopened: 0,
            deadlines: BTreeSet::new(),
            batches: HashMap::new(),
            next_batch: 0,
            recent: HashSet::new(),
            recent_order: VecDeque::new(),
            #[cfg(feature = "sim-mutants")]
            sim_mutant: None,
            #[cfg(feature = "sim-mutants")]
            sim_fired: None,
        }
    }

    /// Test-only (feature `sim-mutants`): arms a planted bug for kvx-sim's self-test. Never
    /// call it outside a simulation.
    #[cfg(feature = "sim-mutants")]
    pub fn set_sim_mutant(&mut self, m: Option<mutant::SimMutant>) {
        self.sim_mutant = m;
        self.sim_fired = None;
    }

    /// The configuration.
    pub fn config(&self) -> &PrefillConfig {
        &self.cfg
    }

    /// `prefill_unique_rank` (frame 2 of every status message).
    pub fn prefill_unique_rank(&self) -> u32 {
        self.rank
    }

    /// The room's status, `None` when the room is not (or no longer) held.
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        self.rooms.get(&room).map(|r| r.status)
    }

    /// The room's first failure reason, while the room is held.
    pub fn failure(&self, room: Room) -> Option<&RoomError> {
        self.rooms.get(&room).and_then(|r| r.failure.as_ref())
    }

    /// The decode prefix length recorded when the room's metadata completed.
    pub fn decode_prefix_len(&self, room: Room) -> Option<u64> {
        self.rooms.get(&room).and_then(|r| r.prefix_len)
    }

    /// A session's registration.
    pub fn registration(&self, session: &SessionId) -> Option<&DecodeRegistration> {
        self.sessions.get(session).map(|s| &s.0.reg)
    }

    /// True when a Failed status towards `session` may carry the reason as a 4th frame (the
    /// decode is known to be sglang 0.5.23-shaped; see [`PrefillAction::SendStatus`]).
    pub fn accepts_status_reason(&self, session: &SessionId) -> bool {
        self.sessions
            .get(session)
            .is_some_and(|s| s.0.status_reason)
    }

    /// The KV path towards a registered session (for metrics and the staging hook).
    pub fn path_for(&self, session: &SessionId) -> Option<TransferPath> {
        self.sessions
            .get(session)
            .map(|s| s.0.path(&self.cfg, &self.local))
    }

    /// True while a session is marked failed at `now`.
    pub fn session_failed(&self, session: &SessionId, now: Instant) -> bool {
        self.failed.get(session).is_some_and(|&until| now < until)
    }

    /// Rooms held (O(1); [`PrefillManager::live_entries`] has every count).
    pub fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// Counts of live per-room entries.
    pub fn live_entries(&self) -> LiveEntries {
        LiveEntries {
            rooms: self.rooms.len(),
            transfer_infos: self.rooms.values().map(|r| r.infos.len()).sum(),
            batches: self.batches.len(),
            pending_acks: self.rooms.values().map(|r| r.pending_acks.len()).sum(),
            unopened_rooms: self.unopened,
            deadlines: self.deadlines.len(),
            sessions: self.sessions.len(),
            failed_sessions: self.failed.len(),
            recent_rooms: self.recent.len(),
        }
    }

    /// When the next [`PrefillEvent::Tick`] is due: the earliest room deadline (bootstrap
    /// timeout, unopened-room TTL) or failed-session expiry; `None` when nothing is timed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let room = self.deadlines.first().map(|(at, _)| *at);
        let session = self.failed.values().min().copied();
        match (room, session) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Feeds one event; appends the actions to perform, in order, to `out`. An `Err` means the
    /// event was dropped without any state change.
    pub fn handle(
        &mut self,
        now: Instant,
        event: PrefillEvent,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        match event {
            PrefillEvent::Register(reg) => {
                if reg.dcp_size != 1 || reg.dcp_rank != 0 {
                    return Err(PrefillError::DcpMismatch {
                        session: reg.session,
                        dcp_size: reg.dcp_size,
                        dcp_rank: reg.dcp_rank,
                    });
                }
                self.register(reg, out);
                Ok(())
            }
            PrefillEvent::Metadata(req) => self.metadata(now, req, out),
            PrefillEvent::SenderCreated { room } => self.sender_created(now, room, out),
            PrefillEvent::SenderInit {
                room,
                num_pages,
                aux_row,
            } => {
                let sender = self
                    .rooms
                    .get_mut(&room)
                    .and_then(|r| r.sender.as_mut())
                    .ok_or(PrefillError::UnknownRoom(room))?;
                sender.init = Some((num_pages, aux_row));
                Ok(())
            }
            PrefillEvent::Chunk { room, chunk } => self.chunk(now, room, &chunk, out),
            PrefillEvent::BatchDone { batch_id, result } => {
                self.batch_done(now, batch_id, result, out)
            }
            PrefillEvent::Abort {
                room,
                endpoint,
                generation,
            } => {
                self.abort(room, endpoint, generation, out);
                Ok(())
            }
            PrefillEvent::LocalAbort { room } => {
                if !self.rooms.contains_key(&room) {
                    return Err(PrefillError::UnknownRoom(room));
                }
                self.fail(room, RoomError::AbortedLocally, false, out);
                self.try_release(room, out);
                Ok(())
            }
            PrefillEvent::SenderFailed { room, reason } => {
                if !self.rooms.contains_key(&room) {
                    return Err(PrefillError::UnknownRoom(room));
                }
                self.fail(room, RoomError::FailedBySender { reason }, true, out);
                self.try_release(room, out);
                Ok(())
            }
            PrefillEvent::Tick => {
                self.tick(now, out);
                Ok(())
            }
            PrefillEvent::SessionLost { session } => {
                self.session_lost(now, &session, out);
                Ok(())
            }
            PrefillEvent::Fatal { reason } => {
                // Batches stay outstanding: a room is released (and its decodes told) only once
                // the driver reported every one of its batches.
                let mut rooms: Vec<Room> = self.rooms.keys().copied().collect();
                // Room order, not hash order: the same inputs give the same actions (replay).
                rooms.sort_unstable();
                for room in rooms {
                    self.fail(room, RoomError::Fatal(reason.clone()), true, out);
                    self.try_release(room, out);
                }
                Ok(())
            }
        }
    }

    /// Records a registration: clears the session's failed mark, replaces older sessions of the
    /// same decode inbox (a restarted decode), and evicts the least recently used session when
    /// [`PrefillConfig::max_sessions`] are held (failing the open rooms writing to a session it
    /// drops: none of them could be planned again).
    ///
    /// A decode registers once per prefill rank when it starts, so a registration of a session
    /// already held means the decode restarted under the same session id: its memory is new,
    /// and the page lists of its earlier rooms no longer belong to them. Every open room writing
    /// to the session fails (its decode is told, which the new process ignores) before a later
    /// chunk could write the old pages into the new process (found by kvx-sim, seed 65). A
    /// restarted decode that registers a new session from the same inbox (kvx's own decodes:
    /// the session names the process instance) ends its old session the same way: the rooms
    /// writing to it fail at once rather than wait, with nothing in flight, for a decode that is
    /// gone — while their other decode ranks time out (found by kvx-sim, seed 3298).
    fn register(&mut self, reg: DecodeRegistration, out: &mut Vec<PrefillAction>) {
        if self.sessions.contains_key(&reg.session) {
            self.fail_rooms_writing_to(&reg.session, out);
        }
        self.failed.remove(&reg.session);
        let stale: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(id, (s, _))| s.reg.endpoint == reg.endpoint && **id != reg.session)
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            self.fail_rooms_writing_to(&id, out);
            self.sessions.remove(&id);
            self.failed.remove(&id);
        }
        if !self.sessions.contains_key(&reg.session)
            && self.sessions.len() >= self.cfg.max_sessions.max(1)
            && let Some(lru) = self
                .sessions
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(id, _)| id.clone())
        {
            // Rooms still writing to it could never be planned again.
            self.fail_rooms_writing_to(&lru, out);
            self.sessions.remove(&lru);
            self.failed.remove(&lru);
        }
        self.use_clock += 1;
        self.registrations += 1;
        let mut session = Session::new(reg, &self.local);
        session.registration = self.registrations;
        self.sessions
            .insert(session.reg.session.clone(), (session, self.use_clock));
    }

    /// Sets the room's deadline by its state: unopened rooms expire after the unopened TTL,
    /// opened rooms still Bootstrapping after the bootstrap timeout; others have none.
    fn refresh_deadline(&mut self, room: Room) {
        let Some(rs) = self.rooms.get_mut(&room) else {
            return;
        };
        let want = match rs.sender {
            None => rs.first_seen.checked_add(self.cfg.unopened_room_ttl),
            Some(s) if rs.status == KVPoll::Bootstrapping => {
                s.created.checked_add(self.cfg.bootstrap_timeout)
            }
            Some(_) => None,
        };
        if want == rs.deadline {
            return;
        }
        if let Some(old) = rs.deadline.take() {
            self.deadlines.remove(&(old, room));
        }
        if let Some(at) = want {
            rs.deadline = Some(at);
            self.deadlines.insert((at, room));
        }
    }

    /// Drops every entry of a room.
    fn remove_room(&mut self, room: Room) {
        #[cfg(feature = "sim-mutants")]
        if mutant!(self, Leak) {
            match self.sim_fired {
                None => {
                    self.sim_fired = Some(Some(room));
                    return;
                }
                Some(Some(leaked)) if leaked == room => return,
                _ => {}
            }
        }
        if let Some(rs) = self.rooms.remove(&room) {
            if rs.sender.is_none() {
                self.unopened = self.unopened.saturating_sub(1);
            }
            if let Some(at) = rs.deadline {
                self.deadlines.remove(&(at, room));
            }
            if rs.sender.is_some() && rs.status.is_terminal() && self.recent.insert(room) {
                self.recent_order.push_back(room);
                if self.recent_order.len() > RECENT_ROOMS
                    && let Some(old) = self.recent_order.pop_front()
                {
                    self.recent.remove(&old);
                }
            }
        }
    }

    /// Status 0 at once to a decode whose metadata reached this rank after the room concluded
    /// here: nothing was or will be written to it (its pages are not in the room's plan).
    fn late_metadata(&self, req: &TransferRequest, out: &mut Vec<PrefillAction>) {
        if req.is_dummy() {
            return;
        }
        out.push(PrefillAction::SendStatus {
            room: req.room,
            endpoint: req.endpoint.clone(),
            status: KVPoll::Failed,
            prefill_rank: self.rank,
            reason: Some(format!(
                "Metadata for {} reached prefill rank {} after the room concluded there",
                req.room, self.rank
            )),
            with_reason: self
                .sessions
                .get(&req.session)
                .is_some_and(|s| s.0.status_reason),
        });
    }

    fn metadata(
        &mut self,
        now: Instant,
        req: TransferRequest,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        let room = req.room;
        if !req.is_dummy() {
            // Only a registered decode is ever written to or told anything: metadata naming an
            // unknown session is dropped (no status to the endpoint it names).
            let Some(entry) = self.sessions.get_mut(&req.session) else {
                return Err(PrefillError::UnregisteredSession {
                    room,
                    session: req.session,
                });
            };
            self.use_clock += 1;
            entry.1 = self.use_clock;
        }
        if !self.rooms.contains_key(&room) && self.recent.contains(&room) {
            self.late_metadata(&req, out);
            return Ok(());
        }
        if !self.rooms.contains_key(&room) {
            if self.unopened >= self.cfg.max_unopened_rooms {
                return Err(PrefillError::TooManyRooms(room));
            }
            self.unopened += 1;
            self.rooms.insert(room, RoomState::new(now));
            self.refresh_deadline(room);
        }
        let Some(rs) = self.rooms.get_mut(&room) else {
            return Ok(());
        };
        if rs.status.is_terminal() {
            // A decode this room never heard from (a restarted one, or one whose metadata was
            // slow) gets its status now; one it knows gets it with the others.
            let known = rs.infos.iter().any(|i| i.session == req.session);
            if !known {
                self.late_metadata(&req, out);
            }
            return Ok(());
        }
        let problem = (req.required_dst_info_num == 0).then(|| RoomError::BadMetadata {
            room,
            session: req.session.clone(),
            what: "required_dst_info_num is 0",
        });
        rs.required = req.required_dst_info_num;
        match rs.infos.iter_mut().find(|i| i.session == req.session) {
            Some(slot) => *slot = req,
            None => rs.infos.push(req),
        }
        if let Some(err) = problem {
            self.fail(room, err, true, out);
            self.try_release(room, out);
            return Ok(());
        }
        if rs.infos.len() >= rs.required as usize {
            rs.prefix_len = rs.infos.iter().find_map(|i| i.decode_prefix_len);
            rs.status = rs.status.update(KVPoll::WaitingForInput);
        }
        self.refresh_deadline(room);
        Ok(())
    }

    fn sender_created(
        &mut self,
        now: Instant,
        room: Room,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        let rs = match self.rooms.get_mut(&room) {
            Some(rs) if rs.sender.is_some() => return Err(PrefillError::DuplicateSender(room)),
            Some(rs) => {
                self.unopened = self.unopened.saturating_sub(1);
                rs
            }
            None => self
                .rooms
                .entry(room)
                .or_insert_with(|| RoomState::new(now)),
        };
        rs.sender = Some(Sender {
            created: now,
            init: None,
        });
        rs.status = rs.status.update(KVPoll::Bootstrapping);
        let terminal = rs.status.is_terminal();
        self.refresh_deadline(room);
        let Some(rs) = self.rooms.get(&room) else {
            return Ok(());
        };
        if terminal {
            // The room failed before its sender existed: tell the sender now.
            out.push(PrefillAction::Concluded {
                room,
                status: rs.status,
                reason: rs.failure.clone(),
            });
            self.try_release(room, out);
        }
        Ok(())
    }

    fn chunk(
        &mut self,
        now: Instant,
        room: Room,
        chunk: &Chunk,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        let rs = self
            .rooms
            .get_mut(&room)
            .ok_or(PrefillError::UnknownRoom(room))?;
        if rs.last_done || rs.status == KVPoll::Success {
            return Err(PrefillError::ChunkAfterLast(room));
        }
        if chunk.is_last {
            rs.last_done = true;
        }
        if rs.status == KVPoll::Failed {
            return Ok(());
        }
        let Some((num_pages, aux_row)) = rs.sender.and_then(|s| s.init) else {
            let what = "sender not initialised";
            self.fail(room, RoomError::NotReady { room, what }, true, out);
            self.try_release(room, out);
            return Ok(());
        };
        if chunk.slice.end > num_pages {
            let err = RoomError::ChunkPastEnd {
                room,
                start: chunk.slice.start,
                end: chunk.slice.end,
                num_pages,
            };
            self.fail(room, err, true, out);
            self.try_release(room, out);
            return Ok(());
        }
        if rs.status == KVPoll::Bootstrapping {
            let what = "metadata from every decode session";
            self.fail(room, RoomError::NotReady { room, what }, true, out);
            self.try_release(room, out);
            return Ok(());
        }
        // Plan every session first; post only if all of them planned.
        let mut works = Vec::with_capacity(rs.infos.len());
        let mut error = None;
        for info in &rs.infos {
            let Some(dst) = &info.dst else { continue };
            let sid = &info.session;
            if self.failed.get(sid).is_some_and(|&until| now < until) {
                error = Some(RoomError::SessionDead {
                    room,
                    session: sid.clone(),
                });
                break;
            }
            let Some((session, _)) = self.sessions.get(sid) else {
                error = Some(RoomError::UnregisteredSession {
                    room,
                    session: sid.clone(),
                });
                break;
            };
            match plan_chunk(&self.cfg, &self.local, room, session, dst, chunk, aux_row) {
                Ok(work) => works.push((sid.clone(), work)),
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        if let Some(err) = error {
            self.fail(room, err, true, out);
            self.try_release(room, out);
            return Ok(());
        }
        if chunk.is_last
            && !works.is_empty()
            && let Some((addr, len)) = self.local.aux.room_row(aux_row)
        {
            out.push(PrefillAction::FillRoomRow { room, addr, len });
        }
        let mut posted = 0;
        let mut aux_out = Vec::new();
        for (session, work) in works {
            if !work.aux_rows.is_empty()
                && let Some(endpoint) = self.rooms.get(&room).and_then(|r| r.endpoint_of(&session))
            {
                for row in &work.aux_rows {
                    aux_out.push(PrefillAction::SendAuxData {
                        room,
                        endpoint: endpoint.clone(),
                        index: row.index,
                        dst_row: row.dst_row,
                        src_addr: row.src_addr,
                        len: row.len,
                    });
                }
            }
            if let Some((src_pages, dst_pages)) = work.staged {
                let batch_id = self.new_batch(room, &session);
                out.push(PrefillAction::Stage {
                    room,
                    session: session.clone(),
                    batch_id,
                    slice: chunk.slice,
                    src_pages,
                    dst_pages,
                });
                posted += 1;
            }
            for ops in work.plan.batches(self.cfg.batch_limits) {
                let batch_id = self.new_batch(room, &session);
                out.push(PrefillAction::PostBatch {
                    room,
                    session: session.clone(),
                    batch_id,
                    path: work.path,
                    ops,
                });
                posted += 1;
            }
        }
        if let Some(rs) = self.rooms.get_mut(&room) {
            rs.inflight += posted;
            rs.aux_out.append(&mut aux_out);
        }
        self.maybe_succeed(room, out);
        Ok(())
    }

    fn new_batch(&mut self, room: Room, session: &SessionId) -> BatchId {
        let id = BatchId(self.next_batch);
        self.next_batch += 1;
        let registration = self.registration_of(session);
        self.batches
            .insert(id, (room, session.clone(), registration));
        id
    }

    /// The number of `session`'s current registration (0: not registered).
    fn registration_of(&self, session: &SessionId) -> u64 {
        self.sessions
            .get(session)
            .map_or(0, |(s, _)| s.registration)
    }

    fn batch_done(
        &mut self,
        now: Instant,
        batch_id: BatchId,
        result: Result<(), String>,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        let (room, session, registration) = self
            .batches
            .remove(&batch_id)
            .ok_or(PrefillError::UnknownBatch(batch_id))?;
        let Some(rs) = self.rooms.get_mut(&room) else {
            return Err(PrefillError::UnknownRoom(room));
        };
        rs.inflight = rs.inflight.saturating_sub(1);
        if let Err(cause) = result {
            let endpoint = rs
                .endpoint_of(&session)
                .cloned()
                .unwrap_or_else(|| Endpoint::new(session.as_str(), 0));
            let err = RoomError::Transfer {
                room,
                endpoint,
                cause,
            };
            self.fail(room, err, true, out);
            // sglang's rule: a failed transfer blacklists the decode session; every other open
            // room writing to it fails now rather than one chunk at a time. Not a batch of an
            // earlier registration of the session: its decode restarted since (the rooms of the
            // old process failed then), and the old process's failure says nothing of the new.
            if registration == self.registration_of(&session) || mutant!(self, StaleBlacklist) {
                self.session_lost(now, &session, out);
            }
        }
        self.maybe_succeed(room, out);
        self.try_release(room, out);
        Ok(())
    }

    /// Fails every open room writing to `session` (in room order), each released once nothing
    /// of it is in flight.
    fn fail_rooms_writing_to(&mut self, session: &SessionId, out: &mut Vec<PrefillAction>) {
        for room in self.open_rooms_writing_to(session) {
            let err = RoomError::SessionDead {
                room,
                session: session.clone(),
            };
            self.fail(room, err, true, out);
            self.try_release(room, out);
        }
    }

    /// The open rooms with a non-dummy destination on `session`, in room order (the same
    /// inputs give the same actions).
    fn open_rooms_writing_to(&self, session: &SessionId) -> Vec<Room> {
        let mut rooms: Vec<Room> = self
            .rooms
            .iter()
            .filter(|(_, rs)| {
                !rs.status.is_terminal()
                    && rs
                        .infos
                        .iter()
                        .any(|i| i.session == *session && !i.is_dummy())
            })
            .map(|(r, _)| *r)
            .collect();
        rooms.sort_unstable();
        rooms
    }

    /// Blacklists `session` for the failed-session TTL and fails every open room writing to it
    /// (in room order), each released once nothing of it is in flight.
    fn session_lost(&mut self, now: Instant, session: &SessionId, out: &mut Vec<PrefillAction>) {
        if let Some(until) = now.checked_add(self.cfg.failed_session_ttl) {
            self.failed.insert(session.clone(), until);
        }
        self.fail_rooms_writing_to(session, out);
    }

    /// A decode's `ABORT`: the room fails (unless already terminal) and its ACK goes out once
    /// nothing of the room is in flight — at once for an unknown or drained room. A 5-frame
    /// `ABORT` (with `generation`) is answered with the 4-frame ACK echoing it, and marks the
    /// decode's sessions in the room as taking a status reason frame (only sglang 0.5.23 sends
    /// it).
    fn abort(
        &mut self,
        room: Room,
        endpoint: Endpoint,
        generation: Option<u64>,
        out: &mut Vec<PrefillAction>,
    ) {
        let prefill_rank = self.rank;
        let Some(rs) = self.rooms.get(&room) else {
            out.push(PrefillAction::AbortAck {
                room,
                endpoint,
                prefill_rank,
                generation,
            });
            return;
        };
        if generation.is_some() {
            for info in rs.infos.iter().filter(|i| i.endpoint == endpoint) {
                if let Some((s, _)) = self.sessions.get_mut(&info.session) {
                    s.status_reason = true;
                }
            }
        }
        if let Some(rs) = self.rooms.get_mut(&room)
            && !rs.aborted_by.contains(&endpoint)
        {
            rs.aborted_by.push(endpoint.clone());
        }
        let reason = RoomError::AbortedByDecode {
            endpoint: endpoint.clone(),
        };
        // The room's other decodes (TP fan-out: ranks that did not abort) are told Failed once it
        // drained, rather than left to their waiting timeout; the aborting one gets its ACK.
        self.fail(room, reason, true, out);
        if let Some(rs) = self.rooms.get_mut(&room) {
            if rs.inflight > 0 && !mutant!(self, EarlyAck) {
                // One ACK per decode endpoint, for its latest ABORT (as sglang keeps them).
                match rs.pending_acks.iter_mut().find(|(e, _)| *e == endpoint) {
                    Some(slot) => slot.1 = generation,
                    None => rs.pending_acks.push((endpoint, generation)),
                }
            } else {
                out.push(PrefillAction::AbortAck {
                    room,
                    endpoint,
                    prefill_rank,
                    generation,
                });
            }
        }
        self.try_release(room, out);
    }

    /// Handles every deadline due at `now` (only those: the cost is the rooms that expire).
    fn tick(&mut self, now: Instant, out: &mut Vec<PrefillAction>) {
        self.failed.retain(|_, &mut until| now < until);
        while let Some(&(at, room)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.remove(&(at, room));
            let Some(rs) = self.rooms.get_mut(&room) else {
                continue;
            };
            rs.deadline = None;
            match rs.sender {
                Some(s) if rs.status == KVPoll::Bootstrapping => {
                    let elapsed = now.saturating_duration_since(s.created);
                    let err = RoomError::BootstrapTimeout { room, elapsed };
                    self.fail(room, err, true, out);
                    self.try_release(room, out);
                }
                // Metadata that never got a local sender: nobody will ever ask for it.
                None if rs.inflight == 0 => self.remove_room(room),
                _ => self.refresh_deadline(room),
            }
        }
    }

    /// Fails a non-terminal room (first reason wins), optionally telling every non-dummy decode.
    fn fail(&mut self, room: Room, err: RoomError, notify: bool, out: &mut Vec<PrefillAction>) {
        let Some(rs) = self.rooms.get_mut(&room) else {
            return;
        };
        if rs.status.is_terminal() {
            return;
        }
        rs.status = KVPoll::Failed;
        rs.failure = Some(err.clone());
        let opened = rs.sender.is_some();
        if notify {
            // Status 0 only once nothing of the room can still land in the decode's pages.
            rs.notify_pending = true;
            if rs.inflight == 0 {
                self.notify_failed(room, out);
            }
        }
        if opened {
            out.push(PrefillAction::Concluded {
                room,
                status: KVPoll::Failed,
                reason: Some(err),
            });
        }
        self.refresh_deadline(room);
    }

    /// Tells every non-dummy decode of a failed room (status 0 with the reason), once.
    fn notify_failed(&mut self, room: Room, out: &mut Vec<PrefillAction>) {
        let Some(rs) = self.rooms.get_mut(&room) else {
            return;
        };
        if !std::mem::take(&mut rs.notify_pending) {
            return;
        }
        let reason = rs.failure.as_ref().map(ToString::to_string);
        for info in rs
            .infos
            .iter()
            .filter(|i| !i.is_dummy() && !rs.aborted_by.contains(&i.endpoint))
        {
            out.push(PrefillAction::SendStatus {
                room,
                endpoint: info.endpoint.clone(),
                status: KVPoll::Failed,
                prefill_rank: self.rank,
                reason: reason.clone(),
                with_reason: self
                    .sessions
                    .get(&info.session)
                    .is_some_and(|s| s.0.status_reason),
            });
        }
    }

    /// Success once the last chunk is handled, nothing is in flight and every required session
    /// reported metadata.
    fn maybe_succeed(&mut self, room: Room, out: &mut Vec<PrefillAction>) {
        let Some(rs) = self.rooms.get_mut(&room) else {
            return;
        };
        let done = !rs.status.is_terminal()
            && rs.last_done
            && rs.inflight == 0
            && rs.required > 0
            && rs.infos.len() >= rs.required as usize;
        if !done {
            return;
        }
        rs.status = KVPoll::Success;
        // The aux rows go on the status socket ahead of the statuses (found by kvx-sim, seed
        // 121: sent with the last chunk, a row reached a decode that had restarted on the same
        // address meanwhile, and landed in a row of one of its new rooms).
        out.append(&mut rs.aux_out);
        for info in rs
            .infos
            .iter()
            .filter(|i| !i.is_dummy() && !rs.aborted_by.contains(&i.endpoint))
        {
            out.push(PrefillAction::SendStatus {
                room,
                endpoint: info.endpoint.clone(),
                status: KVPoll::Success,
                prefill_rank: self.rank,
                reason: None,
                with_reason: false,
            });
        }
        #[cfg(feature = "sim-mutants")]
        if mutant!(self, LostStatus)
            && self.sim_fired.is_none()
            && matches!(out.last(), Some(PrefillAction::SendStatus { .. }))
        {
            self.sim_fired = Some(None);
            out.pop();
        }
        out.push(PrefillAction::Concluded {
            room,
            status: KVPoll::Success,
            reason: None,
        });
        self.refresh_deadline(room);
        self.try_release(room, out);
    }

    /// Flushes deferred ABORT_ACKs once drained, and drops the room once terminal, drained and
    /// known to its sender.
    fn try_release(&mut self, room: Room, out: &mut Vec<PrefillAction>) {
        let Some(rs) = self.rooms.get_mut(&room) else {
            return;
        };
        if rs.inflight > 0 {
            return;
        }
        let acks = std::mem::take(&mut rs.pending_acks);
        let release = rs.status.is_terminal() && rs.sender.is_some();
        self.notify_failed(room, out);
        for (endpoint, generation) in acks {
            out.push(PrefillAction::AbortAck {
                room,
                endpoint,
                prefill_rank: self.rank,
                generation,
            });
        }
        if release {
            self.remove_room(room);
        }
    }
}
