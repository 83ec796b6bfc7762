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
//! Two peer generations are served side by side, told apart by what each decode sends: a
//! registration with frame 19 (sglang 0.5.23) or a 5-frame `ABORT` marks its session as taking a
//! failure reason as a 4th status frame; an `ABORT` with a generation is acknowledged with the
//! 4-frame `ABORT_ACK` echoing it, a 4-frame `ABORT` (sglang main) with the 3-frame one, both only
//! once the room's writes drained. A registration whose DCP size or rank does not pair with this
//! rank's (1, 0) is refused ([`PrefillError::DcpMismatch`]).

mod plan;
#[cfg(test)]
mod tests;
pub mod types;

use std::collections::HashMap;
use std::time::Instant;

pub use types::{
    BatchId, DEFAULT_BOOTSTRAP_TIMEOUT, DEFAULT_FAILED_SESSION_TTL, LiveEntries, LocalMemory,
    PrefillAction, PrefillConfig, PrefillError, PrefillEvent, RoomError, TransferPath,
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
        }
    }

    fn endpoint_of(&self, session: &SessionId) -> Option<&Endpoint> {
        self.infos
            .iter()
            .find(|i| &i.session == session)
            .map(|i| &i.endpoint)
    }
}

/// The prefill side's room manager (one per prefill rank).
#[derive(Debug)]
pub struct PrefillManager {
    cfg: PrefillConfig,
    local: LocalMemory,
    rank: u32,
    sessions: HashMap<SessionId, Session>,
    failed: HashMap<SessionId, Instant>,
    rooms: HashMap<Room, RoomState>,
    batches: HashMap<BatchId, (Room, SessionId)>,
    next_batch: u64,
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
            failed: HashMap::new(),
            rooms: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 0,
        }
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
        self.sessions.get(session).map(|s| &s.reg)
    }

    /// True when a Failed status towards `session` may carry the reason as a 4th frame (the
    /// decode is known to be sglang 0.5.23-shaped; see [`PrefillAction::SendStatus`]).
    pub fn accepts_status_reason(&self, session: &SessionId) -> bool {
        self.sessions.get(session).is_some_and(|s| s.status_reason)
    }

    /// The KV path towards a registered session (for metrics and the staging hook).
    pub fn path_for(&self, session: &SessionId) -> Option<TransferPath> {
        self.sessions
            .get(session)
            .map(|s| s.path(&self.cfg, &self.local))
    }

    /// True while a session is marked failed at `now`.
    pub fn session_failed(&self, session: &SessionId, now: Instant) -> bool {
        self.failed.get(session).is_some_and(|&until| now < until)
    }

    /// Counts of live per-room entries.
    pub fn live_entries(&self) -> LiveEntries {
        LiveEntries {
            rooms: self.rooms.len(),
            transfer_infos: self.rooms.values().map(|r| r.infos.len()).sum(),
            batches: self.batches.len(),
            pending_acks: self.rooms.values().map(|r| r.pending_acks.len()).sum(),
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
                self.failed.remove(&reg.session);
                let session = Session::new(reg, &self.local);
                self.sessions.insert(session.reg.session.clone(), session);
                Ok(())
            }
            PrefillEvent::Metadata(req) => {
                self.metadata(now, req, out);
                Ok(())
            }
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
                self.fail(room, RoomError::FailedBySender { reason }, false, out);
                self.try_release(room, out);
                Ok(())
            }
            PrefillEvent::Tick => {
                self.tick(now, out);
                Ok(())
            }
            PrefillEvent::Fatal { reason } => {
                self.batches.clear();
                let rooms: Vec<Room> = self.rooms.keys().copied().collect();
                for room in rooms {
                    if let Some(rs) = self.rooms.get_mut(&room) {
                        rs.inflight = 0;
                    }
                    self.fail(room, RoomError::Fatal(reason.clone()), true, out);
                    self.try_release(room, out);
                }
                Ok(())
            }
        }
    }

    fn metadata(&mut self, now: Instant, req: TransferRequest, out: &mut Vec<PrefillAction>) {
        let room = req.room;
        let rs = self
            .rooms
            .entry(room)
            .or_insert_with(|| RoomState::new(now));
        if rs.status.is_terminal() {
            return;
        }
        let problem = if req.required_dst_info_num == 0 {
            Some(RoomError::BadMetadata {
                room,
                session: req.session.clone(),
                what: "required_dst_info_num is 0",
            })
        } else if !req.is_dummy() && !self.sessions.contains_key(&req.session) {
            Some(RoomError::UnregisteredSession {
                room,
                session: req.session.clone(),
            })
        } else {
            None
        };
        rs.required = req.required_dst_info_num;
        match rs.infos.iter_mut().find(|i| i.session == req.session) {
            Some(slot) => *slot = req,
            None => rs.infos.push(req),
        }
        if let Some(err) = problem {
            self.fail(room, err, true, out);
            self.try_release(room, out);
            return;
        }
        if rs.infos.len() >= rs.required as usize {
            rs.prefix_len = rs.infos.iter().find_map(|i| i.decode_prefix_len);
            rs.status = rs.status.update(KVPoll::WaitingForInput);
        }
    }

    fn sender_created(
        &mut self,
        now: Instant,
        room: Room,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        let rs = self
            .rooms
            .entry(room)
            .or_insert_with(|| RoomState::new(now));
        if rs.sender.is_some() {
            return Err(PrefillError::DuplicateSender(room));
        }
        rs.sender = Some(Sender {
            created: now,
            init: None,
        });
        rs.status = rs.status.update(KVPoll::Bootstrapping);
        if rs.status.is_terminal() {
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
            let Some(session) = self.sessions.get(sid) else {
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
        for (session, work) in works {
            if !work.aux_rows.is_empty()
                && let Some(endpoint) = self.rooms.get(&room).and_then(|r| r.endpoint_of(&session))
            {
                for row in &work.aux_rows {
                    out.push(PrefillAction::SendAuxData {
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
        }
        self.maybe_succeed(room, out);
        Ok(())
    }

    fn new_batch(&mut self, room: Room, session: &SessionId) -> BatchId {
        let id = BatchId(self.next_batch);
        self.next_batch += 1;
        self.batches.insert(id, (room, session.clone()));
        id
    }

    fn batch_done(
        &mut self,
        now: Instant,
        batch_id: BatchId,
        result: Result<(), String>,
        out: &mut Vec<PrefillAction>,
    ) -> Result<(), PrefillError> {
        let (room, session) = self
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
            if let Some(until) = now.checked_add(self.cfg.failed_session_ttl) {
                self.failed.insert(session, until);
            }
            let err = RoomError::Transfer {
                room,
                endpoint,
                cause,
            };
            self.fail(room, err, true, out);
        }
        self.maybe_succeed(room, out);
        self.try_release(room, out);
        Ok(())
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
                if let Some(s) = self.sessions.get_mut(&info.session) {
                    s.status_reason = true;
                }
            }
        }
        let reason = RoomError::AbortedByDecode {
            endpoint: endpoint.clone(),
        };
        self.fail(room, reason, false, out);
        if let Some(rs) = self.rooms.get_mut(&room) {
            if rs.inflight > 0 {
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

    fn tick(&mut self, now: Instant, out: &mut Vec<PrefillAction>) {
        self.failed.retain(|_, &mut until| now < until);
        let timeout = self.cfg.bootstrap_timeout;
        let mut timed_out = Vec::new();
        let mut orphans = Vec::new();
        for (&room, rs) in &self.rooms {
            match rs.sender {
                Some(s) if rs.status == KVPoll::Bootstrapping => {
                    let elapsed = now.saturating_duration_since(s.created);
                    if elapsed >= timeout {
                        timed_out.push((room, elapsed));
                    }
                }
                None if now.saturating_duration_since(rs.first_seen) >= timeout => {
                    orphans.push(room);
                }
                _ => {}
            }
        }
        for (room, elapsed) in timed_out {
            let err = RoomError::BootstrapTimeout { room, elapsed };
            self.fail(room, err, true, out);
            self.try_release(room, out);
        }
        // Metadata that never got a local sender: nobody will ever ask for it.
        for room in orphans {
            if self.rooms.get(&room).is_some_and(|r| r.inflight == 0) {
                self.rooms.remove(&room);
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
        if notify {
            let reason = err.to_string();
            for info in rs.infos.iter().filter(|i| !i.is_dummy()) {
                out.push(PrefillAction::SendStatus {
                    room,
                    endpoint: info.endpoint.clone(),
                    status: KVPoll::Failed,
                    prefill_rank: self.rank,
                    reason: Some(reason.clone()),
                    with_reason: self
                        .sessions
                        .get(&info.session)
                        .is_some_and(|s| s.status_reason),
                });
            }
        }
        rs.failure = Some(err.clone());
        if rs.sender.is_some() {
            out.push(PrefillAction::Concluded {
                room,
                status: KVPoll::Failed,
                reason: Some(err),
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
        for info in rs.infos.iter().filter(|i| !i.is_dummy()) {
            out.push(PrefillAction::SendStatus {
                room,
                endpoint: info.endpoint.clone(),
                status: KVPoll::Success,
                prefill_rank: self.rank,
                reason: None,
                with_reason: false,
            });
        }
        out.push(PrefillAction::Concluded {
            room,
            status: KVPoll::Success,
            reason: None,
        });
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
        for (endpoint, generation) in rs.pending_acks.drain(..) {
            out.push(PrefillAction::AbortAck {
                room,
                endpoint,
                prefill_rank: self.rank,
                generation,
            });
        }
        if rs.status.is_terminal() && rs.sender.is_some() {
            self.rooms.remove(&room);
        }
    }
}
