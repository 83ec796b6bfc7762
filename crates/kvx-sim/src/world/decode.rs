//! The decode side of the world: a driver around the real `DecodeManager` that plays kvx-engine's
//! decode — it allocates pages and an aux row per room, registers with its prefill ranks,
//! sends metadata, feeds statuses and heartbeat loss, ticks, sends the manager's `ABORT`s, and
//! releases a room's pages: at once after a verified Success; after a failure only once every
//! prefill rank that writes to it reported (a status or a current `ABORT_ACK`, both sent only
//! when its writes drained) or after the release timeout (`decode/release.rs` semantics).

use kvx_core::decode::DecodeFailure;
use kvx_core::{
    DecodeAction, DecodeEvent, DecodeRegistration, Destination, KVPoll, Room, TransferRequest,
};

use super::{BOOTSTRAP, DRoom, Ev, World, decode_endpoint, decode_session, prefill_endpoint};
use crate::clock::{MS, Nanos, SEC};

/// kvx-engine's decode: an `ABORT` unanswered this long is sent again (`decode/release.rs`).
const ABORT_RESEND_FIRST: Nanos = SEC;
/// The longest wait between two sends of one `ABORT`.
const ABORT_RESEND_MAX: Nanos = 8 * SEC;
use crate::invariants::Inv;
use crate::memory::{STATE_BUFFERS, STATE_ITEM};
use crate::net::{Msg, Node};

impl World {
    /// Decode rank `d`'s registration (sglang 0.5.23's form when the scenario says so).
    pub(crate) fn registration(&self, d: u32) -> DecodeRegistration {
        let n = &self.decodes[d as usize];
        DecodeRegistration {
            endpoint: decode_endpoint(d),
            session: decode_session(d, n.inc, self.sc.fixed_sessions),
            kv_ptrs: n.mem.kv_ptrs(),
            aux_ptrs: n.mem.aux_ptrs(),
            state_ptrs: if self.sc.state {
                vec![n.mem.state_ptrs()]
            } else {
                Vec::new()
            },
            dst_tp_rank: d,
            dst_attn_tp_size: self.sc.decode_tp,
            dst_kv_item_len: n.mem.item_len(),
            state_item_lens: if self.sc.state {
                vec![vec![STATE_ITEM as u32; STATE_BUFFERS]]
            } else {
                Vec::new()
            },
            state_dim_per_tensor: Vec::new(),
            kv_layer_ids: Vec::new(),
            state_layer_ids: Vec::new(),
            staging: n
                .stager
                .as_ref()
                .map(super::stage_decode::DecodeStager::ring_info)
                .unwrap_or_default(),
            dcp_size: 1,
            dcp_rank: 0,
            staging_slot_layer_ids: self.sc.v0523.then(Vec::new),
            kv_item_lens: self
                .sc
                .v0523
                .then(|| vec![n.mem.item_len(); n.mem.kv_ptrs().len()]),
        }
    }

    /// Feeds one event to rank `d`'s manager and performs what it asks.
    fn decode_event(&mut self, d: u32, ev: DecodeEvent) {
        let now = self.clock.instant();
        let mut out = std::mem::take(&mut self.dacts);
        out.clear();
        let room = match &ev {
            DecodeEvent::Created { room, .. }
            | DecodeEvent::Init { room, .. }
            | DecodeEvent::MetadataSent { room }
            | DecodeEvent::Status { room, .. }
            | DecodeEvent::LocalAbort { room } => Some(*room),
            _ => None,
        };
        let _ = self.decodes[d as usize].mgr.handle(now, ev, &mut out);
        if let Some(r) = room {
            self.observe_decode(d, r);
        }
        for a in out.drain(..) {
            self.decode_action(d, a);
        }
        self.dacts = out;
        self.ensure_decode_tick(d);
    }

    /// Status monotonic on the decode side.
    fn observe_decode(&mut self, d: u32, room: Room) {
        let n = &mut self.decodes[d as usize];
        let now = n.mgr.poll(room);
        if let Some((prev, now, ok)) = super::status_step(&mut n.last_poll, room, now) {
            self.check.check(Inv::StatusMonotonic, ok, Some(room), || {
                format!("decode rank {d}: {prev} then {now}")
            });
        }
    }

    fn decode_action(&mut self, d: u32, a: DecodeAction) {
        if let Some(t) = &self.trace {
            let room = match &a {
                DecodeAction::SendAbort { room, .. } | DecodeAction::Concluded { room, .. } => {
                    *room
                }
            };
            if t.room == Some(room) {
                let line = format!("  decode {d} -> {a:?}");
                self.trace_line(Some(room), || line);
            }
        }
        let now = self.clock.now();
        match a {
            DecodeAction::SendAbort {
                room,
                endpoint,
                generation,
            } => {
                let p = u32::from(endpoint.port - prefill_endpoint(0).port);
                if let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room) {
                    if generation.is_some() && generation != dr.abort_gen {
                        dr.acked.clear();
                    }
                    dr.abort_gen = generation.or(dr.abort_gen);
                    dr.abort_to.insert(p);
                }
                let msg = Msg::Abort {
                    room,
                    from: d,
                    generation,
                };
                self.send(Node::Decode(d), Node::Prefill(p), msg);
            }
            DecodeAction::Concluded {
                room,
                status,
                reason,
            } => {
                self.decodes[d as usize].last_poll.remove(&room);
                let mut excused = self.queued_long(room) || self.parked_long(room);
                if let Some(rec) = self.rooms.get_mut(&room) {
                    let prev = rec.d_done.insert(d, (status, now));
                    excused |= rec.excused;
                    let fatal: Vec<u32> = rec.fatal.iter().copied().collect();
                    self.check
                        .check(Inv::StatusMonotonic, prev.is_none(), Some(room), || {
                            format!(
                                "decode rank {d} concluded the room twice ({prev:?}, then {status})"
                            )
                        });
                    let node = &self.decodes[d as usize];
                    let hit = fatal.iter().any(|&p| node.real_target(p));
                    self.check.check(Inv::FatalFailsOpenRooms, !hit || status == KVPoll::Failed, Some(room), || {
                        format!("decode rank {d} concluded {status} though prefill ranks {fatal:?} hit a fatal fault with it open")
                    });
                }
                let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room) else {
                    return;
                };
                dr.concluded = Some(status);
                let success = status == KVPoll::Success;
                let drained = self.decode_staging_concluded(d, room, success);
                let lost = self
                    .rooms
                    .get(&room)
                    .is_some_and(|r| r.chunk_ready_lost.contains(&d));
                self.check.check(Inv::StagedSuccessDrained, !success || drained || lost, Some(room), || {
                    format!("decode rank {d} got Success before every staged chunk was scattered, though no CHUNK_READY of the room was lost")
                });
                // kvx-engine's decode: a Success before every staged chunk was scattered (a
                // CHUNK_READY was lost) reports the room failed; every prefill rank already said
                // it is done, so the pages go back at once.
                let success = success && drained;
                if !success && status == KVPoll::Success {
                    self.stats.undrained_success += 1;
                    if let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room) {
                        dr.concluded = Some(KVPoll::Failed);
                    }
                    if let Some(rec) = self.rooms.get_mut(&room) {
                        rec.d_done.insert(d, (KVPoll::Failed, now));
                    }
                    self.decode_release(d, room);
                    return;
                }
                if success {
                    let Some(dr) = self.decodes[d as usize].rooms.get(&room) else {
                        return;
                    };
                    let (pages, row) = (dr.pages.clone(), dr.row);
                    let mem = &mut self.decodes[d as usize].mem;
                    let bad_page =
                        (0..pages.len()).find(|&k| !mem.kv_page(room, k as u64, pages[k], true));
                    let aux_ok = mem.aux_row(room, row, true)
                        && (!self.sc.state || mem.state_slot(room, row, true));
                    self.stats.state_slots += u64::from(self.sc.state);
                    self.check.check(Inv::SuccessBytes, bad_page.is_none() && aux_ok, Some(room), || {
                        format!("decode rank {d} reports Success but page {bad_page:?} of {pages:?} / aux row and state slot ok {aux_ok} differ from the prefill's")
                    });
                    self.decode_release(d, room);
                } else {
                    let timeout = matches!(reason, Some(DecodeFailure::WaitingTimeout { .. }));
                    self.check.check(Inv::OutcomeDelivered, !timeout || excused, Some(room), || {
                        format!("decode rank {d} timed out waiting, though no fault of the run explains it: {reason:?}")
                    });
                    let inc = self.decodes[d as usize].inc;
                    self.schedule(now + self.sc.release_timeout, Ev::Release { d, inc, room });
                    let gap = ABORT_RESEND_FIRST;
                    self.schedule(now + gap, Ev::AbortResend { d, inc, room, gap });
                    if matches!(reason, Some(DecodeFailure::LostConnection { .. })) {
                        // kvx-engine's decode probes the ranks' inboxes once the heartbeat is
                        // lost: when none answers, every rank counts as stopped.
                        self.schedule(now + 1000 * MS, Ev::GoneProbe { d, inc, room });
                    }
                    self.maybe_release(d, room);
                }
            }
        }
    }

    /// Releases a failed room once every prefill rank that writes to it has reported.
    fn maybe_release(&mut self, d: u32, room: Room) {
        let n = &self.decodes[d as usize];
        let Some(dr) = n.rooms.get(&room) else {
            return;
        };
        if dr.released || dr.concluded != Some(KVPoll::Failed) {
            return;
        }
        let quiet = n
            .targets
            .iter()
            .filter(|t| !t.dummy)
            .all(|t| dr.status_from.contains(&t.tp_rank) || dr.acked.contains(&t.tp_rank));
        if quiet {
            self.decode_release(d, room);
        }
    }

    /// kvx-engine's decode sends a failed room's `ABORT` again, to every rank it went to with
    /// its generation, while its pages are held and fewer ranks acknowledged than it went to;
    /// the next resend waits twice as long, at most [`ABORT_RESEND_MAX`].
    pub(crate) fn decode_abort_resend(&mut self, d: u32, inc: u32, room: Room, gap: Nanos) {
        if self.decodes[d as usize].inc != inc {
            return;
        }
        let Some(dr) = self.decodes[d as usize].rooms.get(&room) else {
            return;
        };
        if dr.released || dr.acked.len() >= dr.abort_to.len() {
            return;
        }
        let (to, generation) = (dr.abort_to.clone(), dr.abort_gen);
        for p in to {
            self.stats.abort_resends += 1;
            let msg = Msg::Abort {
                room,
                from: d,
                generation,
            };
            self.send(Node::Decode(d), Node::Prefill(p), msg);
        }
        let gap = (2 * gap).min(ABORT_RESEND_MAX);
        let at = self.clock.now() + gap;
        self.schedule(at, Ev::AbortResend { d, inc, room, gap });
    }

    /// The probe after a lost heartbeat (kvx-engine's decode): when no prefill rank of the
    /// room is up any more, every one counts as stopped; while one is, those that have not
    /// answered still owe their word.
    pub(crate) fn decode_gone_probe(&mut self, d: u32, inc: u32, room: Room) {
        if self.decodes[d as usize].inc != inc {
            return;
        }
        let ranks: Vec<u32> = self.decodes[d as usize]
            .targets
            .iter()
            .map(|t| t.tp_rank)
            .collect();
        if ranks.iter().any(|&p| !self.prefills[p as usize].down) {
            return;
        }
        if let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room) {
            dr.acked.extend(ranks);
        }
        self.maybe_release(d, room);
    }

    /// A failed room's release timeout: its pages go back even without every writing prefill
    /// rank's word (marked for the write checks, `late_after_lost_abort` in `landing.rs`).
    pub(crate) fn decode_release_timeout(&mut self, d: u32, room: Room) {
        if let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room)
            && !dr.released
            && dr.concluded.is_some()
        {
            dr.timed_out = true;
        }
        self.decode_release(d, room);
    }

    /// Gives a room's pages and row back.
    pub(crate) fn decode_release(&mut self, d: u32, room: Room) {
        let n = &mut self.decodes[d as usize];
        let Some(dr) = n.rooms.get_mut(&room) else {
            return;
        };
        if dr.released || dr.concluded.is_none() {
            return;
        }
        dr.released = true;
        for &pg in &dr.pages {
            n.page_owner[pg as usize] = None;
            n.free_pages.push(pg);
        }
        n.row_owner[dr.row as usize] = None;
        n.free_rows.push(dr.row);
        self.decode_staging_release(d, room);
    }

    /// Creates the room on rank `d`: pages, metadata to every target, waiting timeout armed.
    pub(crate) fn decode_create(&mut self, d: u32, room: Room) {
        let pages = self.rooms.get(&room).map_or(0, |r| r.n);
        let n = &mut self.decodes[d as usize];
        let mut got = Vec::with_capacity(pages);
        for _ in 0..pages {
            let i = self.rng.below(n.free_pages.len() as u64) as usize;
            let pg = n.free_pages.swap_remove(i);
            n.page_owner[pg as usize] = Some(room);
            got.push(pg);
        }
        let row = n.free_rows.pop().expect("the spawner checked the rows");
        n.row_owner[row as usize] = Some(room);
        n.rooms.insert(
            room,
            DRoom {
                pages: got.clone(),
                row,
                ..DRoom::default()
            },
        );
        let targets = n.targets.clone();
        let (required_dst, required_resp) = (n.required_dst, n.required_resp);
        let inc = self.decodes[d as usize].inc;
        if let Some(rec) = self.rooms.get_mut(&room) {
            rec.d_open.insert(d);
            rec.d_inc.insert(d, inc);
        }
        // A staged room is registered with the ring before its metadata goes out.
        self.decode_staging_register(d, room, &got);
        self.decode_event(
            d,
            DecodeEvent::Created {
                room,
                bootstrap_addr: BOOTSTRAP.into(),
            },
        );
        self.decode_event(
            d,
            DecodeEvent::Init {
                room,
                required_prefill_response_num: required_resp,
                prefill_endpoints: targets
                    .iter()
                    .map(|t| prefill_endpoint(t.tp_rank))
                    .collect(),
                generational_aborts: self.sc.v0523,
            },
        );
        let state = self.sc.state;
        for t in &targets {
            let req = TransferRequest {
                room,
                endpoint: decode_endpoint(d),
                session: decode_session(d, self.decodes[d as usize].inc, self.sc.fixed_sessions),
                dst: (!t.dummy).then(|| Destination {
                    kv_pages: got.iter().map(|&p| p as i32).collect(),
                    aux_index: row as i64,
                    state_indices: if state {
                        vec![vec![row as i32]]
                    } else {
                        Vec::new()
                    },
                }),
                required_dst_info_num: required_dst,
                decode_prefix_len: Some(0),
                device_kv_pages: Vec::new(),
            };
            self.send(
                Node::Decode(d),
                Node::Prefill(t.tp_rank),
                Msg::Metadata(Box::new(req)),
            );
        }
        self.decode_event(d, DecodeEvent::MetadataSent { room });
    }

    /// Schedules a `Tick` at the manager's `poll_timeout()` unless one runs no later (kvx-engine's
    /// decode engine sleeps until then, not on a fixed period).
    fn ensure_decode_tick(&mut self, d: u32) {
        let now = self.clock.now();
        let n = &mut self.decodes[d as usize];
        if n.down {
            return;
        }
        let Some(t) = n.mgr.poll_timeout().map(|t| self.clock.offset(t).max(now)) else {
            return;
        };
        if n.tick_at.is_none_or(|at| t < at) {
            n.tick_at = Some(t);
            let inc = n.inc;
            self.schedule(t, Ev::DecodeTick { d, inc });
        }
    }

    pub(crate) fn decode_tick(&mut self, d: u32, inc: u32) {
        let n = &mut self.decodes[d as usize];
        if n.inc != inc || n.down {
            return;
        }
        if n.tick_at.is_some_and(|at| at <= self.clock.now()) {
            n.tick_at = None;
        }
        self.decode_event(d, DecodeEvent::Tick);
    }

    pub(crate) fn decode_receive(&mut self, d: u32, from: u32, msg: Msg) {
        match msg {
            Msg::Status {
                room,
                status,
                rank,
                reason,
            } => {
                if let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room) {
                    dr.status_from.insert(rank);
                }
                self.decode_event(
                    d,
                    DecodeEvent::Status {
                        room,
                        status,
                        prefill_rank: rank,
                        reason,
                    },
                );
                self.maybe_release(d, room);
            }
            Msg::AbortAck {
                room,
                rank,
                generation,
            } => {
                if let Some(dr) = self.decodes[d as usize].rooms.get_mut(&room)
                    && (generation.is_none() || generation == dr.abort_gen)
                {
                    dr.acked.insert(rank);
                }
                self.maybe_release(d, room);
            }
            Msg::AuxData {
                room,
                index,
                row,
                data,
            } => {
                // The rule kvx-engine's decode applies (`AuxError::NotTheRoomsRow`): a row is written
                // only while the room it names holds that row. A prefill may send a row of a room
                // of an earlier incarnation of this process (same address), or after the room
                // was released (kvx-sim seed 121).
                let n = &self.decodes[d as usize];
                let owns = n
                    .rooms
                    .get(&room)
                    .is_some_and(|r| r.row == row && !r.released);
                if owns {
                    self.apply_aux_data(from, d, room, (index, row), &data);
                } else {
                    self.trace_line(Some(room), || {
                        format!("  decode {d} drops AUX_DATA row {row}: not its room's")
                    });
                }
            }
            Msg::StagingReq(_) | Msg::ChunkReady(_) => self.decode_staging_receive(d, msg),
            Msg::Register(_)
            | Msg::Metadata(_)
            | Msg::Abort { .. }
            | Msg::StagingRsp(_)
            | Msg::Watermark(_) => {}
        }
    }

    pub(crate) fn decode_local_abort(&mut self, d: u32, room: Room) {
        if self.decodes[d as usize].down || self.decodes[d as usize].mgr.poll(room).is_none() {
            return;
        }
        self.decode_event(d, DecodeEvent::LocalAbort { room });
    }

    pub(crate) fn decode_heartbeat_lost(&mut self, d: u32) {
        if self.decodes[d as usize].down {
            return;
        }
        self.decode_event(
            d,
            DecodeEvent::HeartbeatLost {
                bootstrap_addr: BOOTSTRAP.into(),
            },
        );
    }

    /// The decode process dies: its connections fail, its rooms and memory are gone.
    pub(crate) fn decode_crash(&mut self, d: u32) {
        if self.decodes[d as usize].down {
            return;
        }
        let mut answers = Vec::new();
        self.data.crash(d, &mut answers);
        let detect = self.sc.crash_detect;
        for a in answers {
            if detect > 0 {
                // The transport notices the dead peer only after a timeout (`crash_detect`):
                // nothing of the batch lands meanwhile, and its failure may reach the prefill
                // after the decode restarted and registered again.
                let at = self.clock.now() + self.rng.range(0, detect);
                self.schedule(at, Ev::Answer(a));
            } else {
                self.answer_later(a);
            }
        }
        let held: Vec<Room> = self.decodes[d as usize]
            .rooms
            .iter()
            .filter(|(_, r)| r.concluded.is_none())
            .map(|(r, _)| *r)
            .collect();
        for room in held {
            if let Some(rec) = self.rooms.get_mut(&room) {
                rec.d_crashed.insert(d);
            }
        }
        let mgr = self.new_decode_manager();
        let n = &mut self.decodes[d as usize];
        n.inc += 1;
        let stager = self.new_decode_stager(d);
        let n = &mut self.decodes[d as usize];
        n.stager = stager;
        n.down = true;
        n.tick_at = None;
        n.mgr = mgr;
        n.mem.wipe();
        n.reset_pools();
        n.rooms.clear();
        n.last_poll.clear();
        let at = self.clock.now() + self.sc.decode_down;
        self.schedule(at, Ev::DecodeRestart { d });
    }

    /// The decode is back under the same address and session id, and registers again.
    pub(crate) fn decode_restart(&mut self, d: u32) {
        self.decodes[d as usize].down = false;
        self.data.revive(d);
        self.register_everywhere(d);
    }
}
