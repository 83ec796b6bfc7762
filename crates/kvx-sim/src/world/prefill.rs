//! The prefill side of the world: kvx-engine's real [`PrefillCore`] — the rules of the prefill
//! engine's owner loop over the real `PrefillManager` and staging driver — driven the way the
//! engine's loop drives it, with the simulated clock, network, data plane and workers in place of
//! real ones.
//!
//! The world plays the embedder (it opens senders, runs the forward pass chunk by chunk once a
//! room is bootstrapped, frees a room's source memory on the core's `Released` event) and
//! performs the core's [`Output`]s in order: room rows into the rank's memory, messages onto the
//! simulated network (the frames parsed with kvx-engine's own wire parser, as the decode's inbox
//! reads them), jobs onto the simulated workers (`worker.rs`), liveness probes, and the rank's
//! exit once the core hands out its fatal fault. It re-derives none of the core's rules; it only
//! records what it observes for the invariants.

use std::time::Instant;

use kvx_core::prefill::{LocalMemory, RoomError};
use kvx_core::{Chunk, KVPoll, PageSlice, PrefillConfig, PrefillManager, Room, fill_room_row};
use kvx_engine::engine::EngineEvent;
use kvx_engine::prefill_core::{CoreConfig, Output, PrefillCore};
use kvx_engine::wire::{DecodeInbound, PrefillInbound, parse_decode_inbound};

use super::{Ev, World, decode_endpoint};
use crate::clock::{MS, US, dur};
use crate::invariants::Inv;
use crate::memory::{RankMemory, TOTAL_HEADS};
use crate::net::{Msg, Node};

impl World {
    /// A fresh core for rank `p` (with the run's mutant armed in its manager).
    pub(crate) fn new_prefill_core(&self, p: u32, mem: &RankMemory) -> PrefillCore {
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
        let core_cfg = CoreConfig {
            bootstrap_port: 8998,
            queues: self.sc.queues as usize,
            auto_open: false,
            restart_workers: self.sc.restart_workers,
        };
        #[allow(unused_mut)]
        let mut core = PrefillCore::new(
            core_cfg,
            mgr,
            self.new_staging_driver(p),
            self.clock.instant(),
        );
        #[cfg(feature = "mutants")]
        core.set_sim_early_exit(self.mutant == Some(crate::mutants::Mutant::EarlyExit));
        core
    }

    /// Runs one input on rank `p`'s core and performs its outputs; `room` is the input's room,
    /// whose status is observed beside those the outputs name.
    pub(crate) fn prefill_call<R>(
        &mut self,
        p: u32,
        room: Option<Room>,
        f: impl FnOnce(&mut PrefillCore, Instant, &mut Vec<Output>) -> R,
    ) -> R {
        let now = self.clock.instant();
        let mut out = Vec::new();
        let r = f(&mut self.prefills[p as usize].core, now, &mut out);
        if let Some(r) = room {
            self.observe_prefill(p, r);
        }
        let mut last = room;
        for o in &out {
            let r = output_room(o);
            if r.is_some() && r != last {
                if let Some(r) = r {
                    self.observe_prefill(p, r);
                }
                last = r;
            }
        }
        for o in out {
            self.prefill_output(p, o);
        }
        self.after_prefill(p);
        r
    }

    /// Status monotonic on the prefill side.
    fn observe_prefill(&mut self, p: u32, room: Room) {
        let n = &mut self.prefills[p as usize];
        let now = n.core.poll(room);
        if let Some((prev, now, ok)) = super::status_step(&mut n.last_poll, room, now) {
            self.check.check(Inv::StatusMonotonic, ok, Some(room), || {
                format!("prefill rank {p}: {prev} then {now}")
            });
        }
    }

    /// Performs one of the core's outputs.
    fn prefill_output(&mut self, p: u32, o: Output) {
        if let Some(t) = &self.trace
            && (output_room(&o).is_none() || t.room == output_room(&o))
        {
            let line = format!("  prefill {p} -> {}", brief_output(&o));
            self.trace_line(output_room(&o), || line);
        }
        let now = self.clock.now();
        match o {
            Output::FillRoomRow { room, addr, len } => {
                let mem = &mut self.prefills[p as usize].mem;
                if let Some(loc) = mem.locate(addr, len) {
                    fill_room_row(mem.bytes_mut(loc, len), room);
                }
            }
            Output::Post { shard, job } => self.worker_post(p, shard, job),
            Output::SendAuxData {
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
            Output::Send {
                endpoint, frames, ..
            } => self.prefill_send(p, &endpoint, &frames),
            Output::Event(EngineEvent::Released { room, .. }) => {
                // The manager dropped the room: its source memory may be reused.
                let n = &mut self.prefills[p as usize];
                if let Some(pr) = n.rooms.remove(&room) {
                    n.free_pages.extend(pr.src);
                    n.free_rows.push(pr.row);
                }
            }
            Output::Event(EngineEvent::Ready { .. }) => {}
            Output::Revive(session) => self.worker_revive(p, &session),
            Output::Concluded {
                room,
                status,
                reason,
            } => {
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
                self.check_session_dead(p, room, status, reason.as_ref());
                self.prefill_staging_concluded(p, room, reason.as_ref());
            }
            Output::RestartWorker(shard) => self.worker_restart(p, shard),
            Output::Bury(shard) => self.worker_bury(p, shard),
            Output::Probe { session, .. } => {
                let inc = self.prefills[p as usize].inc;
                let ev = Ev::Probe {
                    p,
                    inc,
                    session,
                    retry: false,
                };
                self.schedule(now, ev);
            }
            Output::Fatal(_) => {
                // Every batch drained: the process exits.
                let n = &mut self.prefills[p as usize];
                if !n.exiting {
                    n.exiting = true;
                    self.schedule(now + MS, Ev::PrefillExit { p });
                }
            }
        }
    }

    /// [`Inv::SessionDeadOwnIncarnation`]: rank `p` concluded `room` Failed for its decode
    /// session being dead; the decode process that opened the room must be gone, or a transfer
    /// of this rank's process towards that very process must have failed before. (Not bounded
    /// by the failed-session TTL: the manager hears of a staged transfer's failure only once
    /// every chunk of its batch is done, which may be seconds after the write failed.)
    fn check_session_dead(
        &mut self,
        p: u32,
        room: Room,
        status: KVPoll,
        reason: Option<&RoomError>,
    ) {
        let Some(RoomError::SessionDead { session, .. }) = reason else {
            return;
        };
        if status != KVPoll::Failed {
            return;
        }
        let Some((d, _)) = super::session_decode(session, self.sc.decode_tp) else {
            return;
        };
        let Some(&inc) = self.rooms.get(&room).and_then(|r| r.d_inc.get(&d)) else {
            return;
        };
        let now = self.clock.now();
        let gone = self.decodes[d as usize].inc != inc;
        let failed = self.peer_failures.get(&(p, d, inc)).copied();
        self.check.check(
            Inv::SessionDeadOwnIncarnation,
            gone || failed.is_some(),
            Some(room),
            || {
                let last = failed.map_or_else(
                    || "never".to_owned(),
                    |t| format!("{} ms ago", now.saturating_sub(t) / MS),
                );
                format!(
                    "prefill rank {p} failed the room as session {session} dead, though decode \
                     rank {d}'s incarnation {inc} that opened it is alive and a transfer towards \
                     it last failed {last}"
                )
            },
        );
    }

    /// A message to a decode: its frames as the decode's inbox parses them.
    fn prefill_send(&mut self, p: u32, endpoint: &kvx_core::Endpoint, frames: &[Vec<u8>]) {
        let d = (0..self.sc.decode_tp).find(|&d| decode_endpoint(d) == *endpoint);
        let parsed = parse_decode_inbound(frames);
        let msg = match &parsed {
            Ok(DecodeInbound::Status {
                room,
                status,
                rank,
                reason,
            }) => Some(Msg::Status {
                room: *room,
                status: *status,
                rank: *rank,
                reason: reason.clone(),
            }),
            Ok(DecodeInbound::AbortAck {
                room,
                rank: Some(rank),
                generation,
            }) => Some(Msg::AbortAck {
                room: *room,
                rank: *rank,
                generation: *generation,
            }),
            Ok(DecodeInbound::StagingReq(req)) => Some(Msg::StagingReq(req.clone())),
            Ok(DecodeInbound::ChunkReady(c)) => Some(Msg::ChunkReady(c.clone())),
            _ => None,
        };
        // The core sends only these, and only to inboxes decodes registered: anything else is
        // a wiring bug of the simulation, loud in debug builds (the regression tests).
        debug_assert!(
            d.is_some() && msg.is_some(),
            "prefill {p}: unexpected send to {endpoint}: {parsed:?}"
        );
        match (d, msg) {
            (Some(d), Some(msg)) => self.send(Node::Prefill(p), Node::Decode(d), msg),
            _ => self.trace_line(None, || {
                format!("  prefill {p}: unexpected send to {endpoint}: {parsed:?}")
            }),
        }
    }

    /// Starts the forward pass of bootstrapped rooms and schedules the core's next deadline.
    fn after_prefill(&mut self, p: u32) {
        let now = self.clock.now();
        let n = &mut self.prefills[p as usize];
        let mut start = Vec::new();
        n.awaiting.retain(|&room| match n.core.poll(room) {
            Some(KVPoll::Bootstrapping) => true,
            Some(KVPoll::WaitingForInput | KVPoll::Transferring) => {
                start.push(room);
                false
            }
            _ => false,
        });
        let tick = n.core.poll_timeout().map(|t| self.clock.offset(t).max(now));
        let inc = n.inc;
        if let Some(t) = tick
            && !n.down
            && n.tick_at.is_none_or(|at| t < at)
        {
            n.tick_at = Some(t);
            self.schedule(t, Ev::PrefillTick { p, inc });
        }
        for room in start {
            let at = now + self.rng.range(0, 3 * MS);
            self.schedule(at, Ev::Chunk { p, inc, room, k: 0 });
        }
    }

    pub(crate) fn prefill_receive(&mut self, p: u32, msg: Msg) {
        let inbound =
            match msg {
                Msg::Register(reg) => PrefillInbound::Registration(reg),
                Msg::Metadata(req) => {
                    let room = req.room;
                    // Metadata reaching a rank that concluded the room is answered status 0 at once
                    // (the manager remembers concluded rooms) — unless the rank restarted since:
                    // the new process never heard of the room and its decode times out.
                    let inc = self.prefills[p as usize].inc;
                    if self.rooms.get(&room).is_some_and(|r| {
                        r.p_done.contains_key(&p) && r.p_open.get(&p) != Some(&inc)
                    }) {
                        self.excuse(Some(room));
                    }
                    PrefillInbound::Metadata(req)
                }
                Msg::Abort {
                    room,
                    from,
                    generation,
                } => PrefillInbound::Abort {
                    room,
                    endpoint: decode_endpoint(from),
                    generation,
                },
                Msg::StagingRsp(rsp) => {
                    let session = rsp.session.clone();
                    self.prefill_call(p, None, |c, now, out| {
                        c.inbound(now, PrefillInbound::StagingRsp(rsp), out)
                    })
                    .ok();
                    if self.mutant == Some(crate::mutants::Mutant::IgnoreWatermark) {
                        // The planted bug: the rank acts as if every ring were free as soon as a
                        // session's placements arrive, whatever the decode's watermark says.
                        let wm = super::stage_prefill::everything_free(&session);
                        self.prefill_call(p, None, |c, now, out| {
                            c.inbound(now, PrefillInbound::Watermark(wm), out)
                        })
                        .ok();
                    }
                    return;
                }
                Msg::Watermark(wm) => PrefillInbound::Watermark(wm),
                Msg::Status { .. }
                | Msg::AbortAck { .. }
                | Msg::AuxData { .. }
                | Msg::StagingReq(_)
                | Msg::ChunkReady(_) => return,
            };
        let (room, metadata) = match &inbound {
            PrefillInbound::Metadata(m) => (Some(m.room), true),
            PrefillInbound::Abort { room, .. } => (Some(*room), false),
            _ => (None, false),
        };
        let r = self.prefill_call(p, room, |c, now, out| c.inbound(now, inbound, out));
        if metadata && r.is_err() {
            // Refused metadata (an unregistered session, too many unopened rooms): its decode
            // hears nothing and times out.
            self.excuse(room);
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
        self.prefill_call(p, Some(room), |c, now, out| {
            let _ = c.open_room(now, room, out);
            let _ = c.init_room(now, room, pages, row, out);
        });
    }

    pub(crate) fn prefill_chunk(&mut self, p: u32, inc: u32, room: Room, k: usize) {
        let n = &self.prefills[p as usize];
        if n.inc != inc || n.down || n.core.poll(room).is_none() {
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
        self.prefill_staging_fed(p, room, slice);
        self.prefill_call(p, Some(room), |c, now, out| {
            let _ = c.send(now, room, chunk, out);
        });
        if !last && self.prefills[p as usize].core.poll(room).is_some() {
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
        self.prefill_call(p, None, |c, now, out| c.on_time(now, out));
    }

    /// The prefill scheduler aborts a room: the embedder's `fail_room`.
    pub(crate) fn prefill_local_abort(&mut self, p: u32, room: Room) {
        let n = &self.prefills[p as usize];
        if n.down || n.core.poll(room).is_none() {
            return;
        }
        // Its decodes are told Failed once the room drained; a decode that has not sent its
        // metadata yet is not known to the rank and times out.
        self.excuse(Some(room));
        self.prefill_call(p, Some(room), |c, now, out| {
            c.fail_room(now, room, "aborted by the prefill scheduler", out);
        });
    }

    /// The process exits (its batches drained): what the core still holds must be rooms that
    /// never had a sender; the decodes lose the heartbeat for a while.
    pub(crate) fn prefill_exit(&mut self, p: u32) {
        let n = &mut self.prefills[p as usize];
        let live = n.core.manager().live_entries();
        let ok = live.batches == 0 && live.pending_acks == 0 && live.rooms == live.unopened_rooms;
        self.check.check(Inv::NoLeak, ok, None, || {
            format!("prefill rank {p} exits after its fatal fault holding {live:?}")
        });
        let posted = n.workers.writes_posted();
        self.check.check(Inv::NoLeak, posted == 0, None, || {
            format!("prefill rank {p} exits with {posted} jobs still posted")
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
        let core = self.new_prefill_core(p, &mem);
        let workers = self.new_workers();
        let n = &mut self.prefills[p as usize];
        n.core = core;
        n.workers = workers;
        n.fed.clear();
        n.mem.wipe();
        n.reset_pools();
        n.rooms.clear();
        n.awaiting.clear();
        n.last_poll.clear();
        n.fatal = false;
        n.exiting = false;
        n.down = false;
        n.tick_at = None;
        // The new process heard of no failure.
        self.peer_failures.retain(|k, _| k.0 != p);
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

/// The room an output is about.
fn output_room(o: &Output) -> Option<Room> {
    match o {
        Output::FillRoomRow { room, .. }
        | Output::SendAuxData { room, .. }
        | Output::Concluded { room, .. }
        | Output::Event(EngineEvent::Ready { room, .. } | EngineEvent::Released { room, .. }) => {
            Some(*room)
        }
        Output::Send { status_of, .. } => *status_of,
        Output::Post { job, .. } => Some(job.room),
        _ => None,
    }
}

/// A one-line form of an output for traces.
fn brief_output(o: &Output) -> String {
    match o {
        Output::Post { shard, job } => {
            let what = match &job.work {
                kvx_engine::worker::Work::Batch { batch_id, ops } => {
                    format!("batch {batch_id:?} ({} ops)", ops.len())
                }
                kvx_engine::worker::Work::Stage(w) => format!("staged chunk {:?}", w.key),
                kvx_engine::worker::Work::Connect => "connect".to_owned(),
            };
            format!("Post {what} to {:?} on shard {shard}", job.session)
        }
        Output::Send {
            endpoint, frames, ..
        } => {
            let parsed = parse_decode_inbound(frames);
            format!("Send to {}:{}: {parsed:?}", endpoint.host, endpoint.port)
        }
        Output::Fatal(e) => format!("Fatal: {e}"),
        other => format!("{other:?}"),
    }
}
