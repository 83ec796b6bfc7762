//! The prefill side of the world: a driver around the real `PrefillManager` that plays
//! kvx-engine's prefill engine — it opens senders, runs the forward pass chunk by chunk once a room
//! is bootstrapped, performs the manager's actions in order (room row, batches to the data
//! plane, status and `ABORT_ACK` to the network), reports every batch answer, ticks at
//! `poll_timeout()`, and frees a room's source memory only once the manager dropped it.

use kvx_core::prefill::LocalMemory;
use kvx_core::{
    Chunk, KVPoll, PageSlice, PrefillAction, PrefillConfig, PrefillEvent, PrefillManager, Room,
    SessionId, fill_room_row,
};

use super::{Ev, World, decode_endpoint};
use crate::clock::{MS, US, dur};
use crate::data::{Answer, BatchResult, Job, Write};
use crate::invariants::Inv;
use crate::memory::{RankMemory, TOTAL_HEADS};
use crate::net::{Msg, Node};

impl World {
    /// A fresh manager for rank `p` (with the run's mutant armed).
    pub(crate) fn new_prefill_manager(&self, p: u32, mem: &RankMemory) -> PrefillManager {
        let cfg = PrefillConfig {
            attn_tp_rank: p,
            attn_tp_size: self.sc.prefill_tp,
            total_kv_heads: TOTAL_HEADS,
            bootstrap_timeout: dur(self.sc.bootstrap_timeout),
            failed_session_ttl: dur(self.sc.failed_session_ttl),
            unopened_room_ttl: dur(self.sc.bootstrap_timeout),
            batch_limits: self.sc.limits,
            staging: self.sc.staging.is_some(),
            aux_over_tcp: self.sc.aux_tcp,
            ..PrefillConfig::default()
        };
        let local = LocalMemory {
            kv: mem.kv_layout(),
            aux: mem.aux_layout(),
            state: if self.sc.state {
                vec![mem.state_component()]
            } else {
                Vec::new()
            },
        };
        #[allow(unused_mut)]
        let mut mgr = PrefillManager::new(cfg, local);
        #[cfg(feature = "mutants")]
        mgr.set_sim_mutant(self.mutant.and_then(crate::mutants::Mutant::core));
        mgr
    }

    /// Feeds one event to rank `p`'s manager and performs what it asks.
    pub(crate) fn prefill_event(&mut self, p: u32, ev: PrefillEvent) -> bool {
        let room = event_room(&ev);
        let now = self.clock.instant();
        let mut out = std::mem::take(&mut self.pacts);
        out.clear();
        let res = self.prefills[p as usize].mgr.handle(now, ev, &mut out);
        if let Some(r) = room {
            self.observe_prefill(p, r);
        }
        let mut last = room;
        for a in &out {
            let r = a.room();
            if last != Some(r) {
                self.observe_prefill(p, r);
                last = Some(r);
            }
        }
        for a in out.drain(..) {
            self.prefill_action(p, a);
        }
        self.pacts = out;
        self.after_prefill(p);
        res.is_ok()
    }

    /// Status monotonic on the prefill side.
    fn observe_prefill(&mut self, p: u32, room: Room) {
        let n = &mut self.prefills[p as usize];
        let now = n.mgr.poll(room);
        if let Some((prev, now, ok)) = super::status_step(&mut n.last_poll, room, now) {
            self.check.check(Inv::StatusMonotonic, ok, Some(room), || {
                format!("prefill rank {p}: {prev} then {now}")
            });
        }
    }

    fn prefill_action(&mut self, p: u32, a: PrefillAction) {
        if let Some(t) = &self.trace
            && t.room == Some(a.room())
        {
            let line = format!("  prefill {p} -> {}", brief_action(&a));
            self.trace_line(Some(a.room()), || line);
        }
        let now = self.clock.now();
        match a {
            PrefillAction::FillRoomRow { room, addr, len } => {
                let mem = &mut self.prefills[p as usize].mem;
                if let Some(loc) = mem.locate(addr, len) {
                    fill_room_row(mem.bytes_mut(loc, len), room);
                }
            }
            PrefillAction::PostBatch {
                room,
                session,
                batch_id,
                ops,
                ..
            } => {
                let write = Write {
                    room,
                    id: Job::Batch(batch_id),
                    ops,
                    payload: None,
                };
                self.post_write(p, &session, write);
            }
            PrefillAction::Stage {
                room,
                session,
                batch_id,
                slice,
                src_pages,
                ..
            } => self.prefill_stage(p, room, session, batch_id, slice, src_pages),
            PrefillAction::SendAuxData {
                room,
                endpoint,
                index,
                dst_row,
                src_addr,
                len,
            } => {
                let d = u32::from(endpoint.port - decode_endpoint(0).port);
                let mem = &self.prefills[p as usize].mem;
                let Some(loc) = mem.locate(src_addr, len) else {
                    self.check
                        .check(Inv::WriteInOwnedPage, false, Some(room), || {
                            format!("prefill rank {p} sends an aux row from outside its memory")
                        });
                    return;
                };
                let data = mem.bytes(loc, len).to_vec();
                let msg = Msg::AuxData {
                    room,
                    index,
                    row: dst_row,
                    data,
                };
                self.send(Node::Prefill(p), Node::Decode(d), msg);
            }
            PrefillAction::SendStatus {
                room,
                endpoint,
                status,
                prefill_rank,
                reason,
                ..
            } => {
                let d = u32::from(endpoint.port - decode_endpoint(0).port);
                let msg = Msg::Status {
                    room,
                    status,
                    rank: prefill_rank,
                    reason,
                };
                self.send(Node::Prefill(p), Node::Decode(d), msg);
            }
            PrefillAction::AbortAck {
                room,
                endpoint,
                prefill_rank,
                generation,
            } => {
                let d = u32::from(endpoint.port - decode_endpoint(0).port);
                let msg = Msg::AbortAck {
                    room,
                    rank: prefill_rank,
                    generation,
                };
                self.send(Node::Prefill(p), Node::Decode(d), msg);
            }
            PrefillAction::Concluded { room, status, .. } => {
                if let Some(rec) = self.rooms.get_mut(&room) {
                    let prev = rec.p_done.insert(p, (status, now));
                    let fatal = rec.fatal.contains(&p);
                    self.check.check(Inv::StatusMonotonic, prev.is_none(), Some(room), || {
                        format!("prefill rank {p} concluded the room twice ({prev:?}, then {status})")
                    });
                    self.check.check(
                        Inv::FatalFailsOpenRooms,
                        !fatal || status == KVPoll::Failed,
                        Some(room),
                        || format!("prefill rank {p} concluded {status} after its fatal fault"),
                    );
                }
                self.prefills[p as usize].concluded.insert(room);
                self.prefill_staging_concluded(p, room);
            }
        }
    }

    /// Posts a write to the decode its session names; the data plane's handshake refuses a
    /// session id naming an earlier incarnation of the process at that address
    /// (`TransportError::PeerRestarted`).
    pub(crate) fn post_write(&mut self, p: u32, session: &SessionId, write: Write) {
        let now = self.clock.now();
        let (d, named) =
            super::session_decode(session, self.sc.decode_tp).expect("sessions are the decodes'");
        let p_inc = self.prefills[p as usize].inc;
        let d_inc = self.decodes[d as usize].inc;
        if named != d_inc && self.mutant != Some(crate::mutants::Mutant::AnyInstance) {
            self.answer_later(Answer {
                p,
                p_inc,
                room: write.room,
                id: write.id,
                result: BatchResult::Lost(format!(
                    "peer {session} restarted: it is instance {d_inc:016x} now"
                )),
            });
            return;
        }
        let mut sched = Vec::new();
        let answer = self.data.post(
            &mut self.rng,
            now,
            (p, p_inc),
            (d, d_inc),
            write,
            &mut sched,
        );
        for (at, ev) in sched {
            self.schedule(at, Ev::Data(ev));
        }
        if let Some(a) = answer {
            self.answer_later(a);
        }
    }

    /// Starts the forward pass of bootstrapped rooms, frees dropped rooms, schedules the tick,
    /// and lets a fatally faulted rank exit once nothing is outstanding.
    fn after_prefill(&mut self, p: u32) {
        let now = self.clock.now();
        let n = &mut self.prefills[p as usize];
        let mut start = Vec::new();
        n.awaiting.retain(|&room| match n.mgr.poll(room) {
            Some(KVPoll::Bootstrapping) => true,
            Some(KVPoll::WaitingForInput | KVPoll::Transferring) => {
                start.push(room);
                false
            }
            _ => false,
        });
        let dropped: Vec<Room> = n
            .concluded
            .iter()
            .copied()
            .filter(|&r| n.mgr.poll(r).is_none())
            .collect();
        for room in dropped {
            n.concluded.remove(&room);
            if let Some(pr) = n.rooms.remove(&room) {
                n.free_pages.extend(pr.src);
                n.free_rows.push(pr.row);
            }
        }
        let tick = n.mgr.poll_timeout().map(|t| self.clock.offset(t).max(now));
        let inc = n.inc;
        let exit = n.fatal && !n.exiting && n.mgr.live_entries().batches == 0;
        if let Some(t) = tick
            && n.tick_at.is_none_or(|at| t < at)
        {
            n.tick_at = Some(t);
            self.schedule(t, Ev::PrefillTick { p, inc });
        }
        if exit {
            self.prefills[p as usize].exiting = true;
            self.schedule(now + MS, Ev::PrefillExit { p });
        }
        for room in start {
            let at = now + self.rng.range(0, 3 * MS);
            self.schedule(at, Ev::Chunk { p, inc, room, k: 0 });
        }
        self.ensure_staging_housekeeping(p);
    }

    pub(crate) fn prefill_receive(&mut self, p: u32, msg: Msg) {
        match msg {
            Msg::Register(reg) => {
                self.prefill_event(p, PrefillEvent::Register(*reg));
            }
            Msg::Metadata(req) => {
                let room = req.room;
                // Metadata reaching a rank that already concluded the room: the prefill cannot
                // tell a decode it had not heard from; that decode falls back to its timeout.
                // (Known gap, not a corruption: the status could go to it at once.)
                let terminal = self.prefills[p as usize]
                    .mgr
                    .poll(room)
                    .is_some_and(KVPoll::is_terminal);
                if terminal
                    || self
                        .rooms
                        .get(&room)
                        .is_some_and(|r| r.p_done.contains_key(&p))
                {
                    self.excuse(Some(room));
                }
                let session = req.session.clone();
                let pages = req.dst.as_ref().map(|d| d.kv_pages.len());
                if !self.prefill_event(p, PrefillEvent::Metadata(*req)) {
                    self.excuse(Some(room));
                } else if let Some(pages) = pages {
                    self.prefill_staging_open(p, room, &session, pages);
                }
            }
            Msg::Abort {
                room,
                from,
                generation,
            } => {
                let endpoint = decode_endpoint(from);
                self.prefill_event(
                    p,
                    PrefillEvent::Abort {
                        room,
                        endpoint,
                        generation,
                    },
                );
            }
            Msg::StagingRsp(_) | Msg::Watermark(_) => self.prefill_staging_receive(p, msg),
            Msg::Status { .. }
            | Msg::AbortAck { .. }
            | Msg::AuxData { .. }
            | Msg::StagingReq(_)
            | Msg::ChunkReady(_) => {}
        }
    }

    pub(crate) fn prefill_open(&mut self, p: u32, inc: u32, room: Room) {
        let n = &self.prefills[p as usize];
        if n.inc != inc || n.down || n.fatal {
            // A dead rank's scheduler never opens it: its decodes time out.
            self.excuse(Some(room));
            return;
        }
        let pages = self.rooms.get(&room).map_or(0, |r| r.n);
        let n = &mut self.prefills[p as usize];
        if n.free_rows.is_empty() || n.free_pages.len() < pages {
            // Rooms spawned together outran the memory freed since: the scheduler queues the
            // request until some frees.
            let at = self.clock.now() + MS;
            self.schedule(at, Ev::Open { p, inc, room });
            return;
        }
        let mut src = Vec::with_capacity(pages);
        for _ in 0..pages {
            let i = self.rng.below(n.free_pages.len() as u64) as usize;
            src.push(n.free_pages.swap_remove(i));
        }
        let Some(row) = n.free_rows.pop() else {
            return;
        };
        n.mem.aux_row(room, row, false);
        if self.sc.state {
            n.mem.state_slot(room, row, false);
        }
        n.rooms.insert(room, super::PRoom { src, row });
        n.awaiting.insert(room);
        if let Some(rec) = self.rooms.get_mut(&room) {
            rec.p_open.insert(p, inc);
        }
        self.prefill_event(p, PrefillEvent::SenderCreated { room });
        self.prefill_event(
            p,
            PrefillEvent::SenderInit {
                room,
                num_pages: pages,
                aux_row: row,
            },
        );
    }

    pub(crate) fn prefill_chunk(&mut self, p: u32, inc: u32, room: Room, k: usize) {
        let n = &self.prefills[p as usize];
        if n.inc != inc || n.down || n.mgr.poll(room).is_none() {
            return;
        }
        let Some(rec) = self.rooms.get(&room) else {
            return;
        };
        let (a, b) = rec.chunks[k];
        let last = k + 1 == rec.chunks.len();
        let n = &mut self.prefills[p as usize];
        let Some(pr) = n.rooms.get(&room) else {
            return;
        };
        let src: Vec<u64> = pr.src[a..b].to_vec();
        let slot = pr.row as i32;
        for (i, &page) in src.iter().enumerate() {
            n.mem.kv_page(room, (a + i) as u64, page, false);
        }
        let slice = PageSlice::new(a, b).expect("ordered chunk");
        let mut chunk = Chunk::new(slice, src.iter().map(|&s| s as i32).collect());
        if last {
            chunk = chunk.last();
            if self.sc.state {
                chunk.src_state = vec![vec![slot]];
            }
        }
        self.prefill_event(p, PrefillEvent::Chunk { room, chunk });
        if !last && self.prefills[p as usize].mgr.poll(room).is_some() {
            let at = self.clock.now() + self.rng.range(10 * US, 3 * MS);
            self.schedule(
                at,
                Ev::Chunk {
                    p,
                    inc,
                    room,
                    k: k + 1,
                },
            );
        }
    }

    pub(crate) fn prefill_tick(&mut self, p: u32, inc: u32) {
        let n = &mut self.prefills[p as usize];
        if n.inc != inc || n.down {
            return;
        }
        if n.tick_at.is_some_and(|at| at <= self.clock.now()) {
            n.tick_at = None;
        }
        self.prefill_event(p, PrefillEvent::Tick);
    }

    /// A batch answer: a lost connection is a `BatchDone(Err)` (the session is blacklisted),
    /// a rejected write fails only the room (`SenderFailed`, then `BatchDone(Ok)`).
    pub(crate) fn prefill_answer(&mut self, a: Answer) {
        let n = &self.prefills[a.p as usize];
        if n.inc != a.p_inc || n.down {
            return;
        }
        let batch_id = match a.id {
            Job::Batch(id) => id,
            Job::Stage { work, .. } => return self.prefill_stage_answer(a.p, work, a.result),
        };
        let result = match a.result {
            BatchResult::Ok => Ok(()),
            BatchResult::Lost(e) => Err(e),
            BatchResult::Rejected(reason) => {
                self.prefill_event(
                    a.p,
                    PrefillEvent::SenderFailed {
                        room: a.room,
                        reason,
                    },
                );
                Ok(())
            }
        };
        self.prefill_event(a.p, PrefillEvent::BatchDone { batch_id, result });
    }

    pub(crate) fn prefill_local_abort(&mut self, p: u32, room: Room) {
        let n = &self.prefills[p as usize];
        if n.down || n.mgr.poll(room).is_none() {
            return;
        }
        // The prefill tells the decode nothing on a local abort: its decodes may time out.
        self.excuse(Some(room));
        self.prefill_event(p, PrefillEvent::LocalAbort { room });
    }

    pub(crate) fn prefill_fatal(&mut self, p: u32) {
        let n = &self.prefills[p as usize];
        if n.down || n.fatal {
            return;
        }
        let open: Vec<Room> = n
            .rooms
            .keys()
            .copied()
            .filter(|&r| n.mgr.poll(r).is_some_and(|s| !s.is_terminal()))
            .collect();
        for room in open {
            if let Some(rec) = self.rooms.get_mut(&room) {
                rec.fatal.insert(p);
            }
        }
        self.prefills[p as usize].fatal = true;
        let reason = "TransferThreadFailed: worker 0 died".to_string();
        self.prefill_event(p, PrefillEvent::Fatal { reason });
    }

    /// The process exits (its batches drained): what the manager still holds must be rooms
    /// that never had a sender; the decodes lose the heartbeat for a while.
    pub(crate) fn prefill_exit(&mut self, p: u32) {
        let n = &mut self.prefills[p as usize];
        let live = n.mgr.live_entries();
        let ok = live.batches == 0 && live.pending_acks == 0 && live.rooms == live.unopened_rooms;
        self.check.check(Inv::NoLeak, ok, None, || {
            format!("prefill rank {p} exits after its fatal fault holding {live:?}")
        });
        n.down = true;
        n.inc += 1;
        let now = self.clock.now();
        for d in 0..self.sc.decode_tp {
            if self.rng.below(2) == 0 {
                let at = now + self.rng.range(50 * MS, 400 * MS);
                self.schedule(at, Ev::HeartbeatLost { d });
            }
        }
        self.schedule(now + 500 * MS, Ev::PrefillRestart { p });
    }

    pub(crate) fn prefill_restart(&mut self, p: u32) {
        let mem = self.prefills[p as usize].mem.clone();
        let mgr = self.new_prefill_manager(p, &mem);
        let stager = self.new_prefill_stager(p);
        let n = &mut self.prefills[p as usize];
        n.mgr = mgr;
        n.stager = stager;
        n.mem.wipe();
        n.reset_pools();
        n.rooms.clear();
        n.awaiting.clear();
        n.concluded.clear();
        n.last_poll.clear();
        n.fatal = false;
        n.exiting = false;
        n.down = false;
        n.tick_at = None;
        for d in 0..self.sc.decode_tp {
            let targets = self.decodes[d as usize]
                .targets
                .iter()
                .any(|t| t.tp_rank == p);
            if targets && !self.decodes[d as usize].down {
                let reg = self.registration(d);
                self.send(
                    Node::Decode(d),
                    Node::Prefill(p),
                    Msg::Register(Box::new(reg)),
                );
            }
        }
    }
}

/// The room a prefill event is about.
fn event_room(ev: &PrefillEvent) -> Option<Room> {
    match ev {
        PrefillEvent::Metadata(m) => Some(m.room),
        PrefillEvent::SenderCreated { room }
        | PrefillEvent::SenderInit { room, .. }
        | PrefillEvent::Chunk { room, .. }
        | PrefillEvent::Abort { room, .. }
        | PrefillEvent::LocalAbort { room }
        | PrefillEvent::SenderFailed { room, .. } => Some(*room),
        _ => None,
    }
}

/// A one-line form of an action for traces.
fn brief_action(a: &PrefillAction) -> String {
    match a {
        PrefillAction::PostBatch {
            batch_id,
            ops,
            session,
            ..
        } => {
            format!("PostBatch {batch_id:?} ({} ops) to {session:?}", ops.len())
        }
        PrefillAction::SendStatus {
            endpoint,
            status,
            reason,
            ..
        } => {
            format!(
                "SendStatus {status} to {}:{} ({reason:?})",
                endpoint.host, endpoint.port
            )
        }
        other => format!("{other:?}"),
    }
}
