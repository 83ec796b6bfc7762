//! The world's side of the prefill's staging driver ([`super::prefill_stager`]), as kvx-engine's
//! loop runs it (`engine/staging.rs`): it opens a room's staging when its metadata names a
//! session on the staging path, hands the manager's `Stage` actions to the driver, performs the
//! driver's effects (`STAGING_REQ`s, chunk writes — the head slices gathered and written with one
//! op into the decode's ring —, batch completions, room failures), sends `CHUNK_READY` once a
//! chunk's write landed, routes `STAGING_RSP` and `WATERMARK`, and runs the housekeeping every
//! second while staged rooms exist: rooms parked past the wait timeout fail, rooms the manager
//! dropped are forgotten, and the decodes the rooms wait on are probed — two failed connects in
//! a row are `PrefillEvent::SessionLost`.

use kvx_core::prefill::{BatchId, PrefillEvent, TransferPath};
use kvx_core::{PageSlice, Room, SessionId};
use kvx_staging::{ChunkGrid, ChunkReady, RspPlacement};

use super::prefill_stager::{Effect, PostWork, PrefillStager, Target};
use super::{Ev, World, session_decode};
use crate::data::{BatchResult, Job, Write};
use crate::net::{Msg, Node};

impl World {
    /// A fresh stager for a prefill rank, when the seed stages.
    pub(crate) fn new_prefill_stager(&self) -> Option<PrefillStager> {
        let cfg = self.sc.staging?;
        let grid = ChunkGrid::with_pages(cfg.grid_pages);
        let mutant = self.mutant == Some(crate::mutants::Mutant::IgnoreWatermark);
        Some(PrefillStager::new(grid, cfg.wait_timeout, mutant))
    }

    /// Runs `f` on rank `p`'s stager (when it stages) and performs its effects.
    fn with_stager(
        &mut self,
        p: u32,
        f: impl FnOnce(&mut PrefillStager, &mut Vec<Effect>),
    ) -> bool {
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return false;
        };
        let mut fx = Vec::new();
        f(st, &mut fx);
        self.stage_perform(p, fx);
        true
    }

    fn stage_perform(&mut self, p: u32, fx: Vec<Effect>) {
        for e in fx {
            match e {
                Effect::Send(d, msg) => self.send(Node::Prefill(p), Node::Decode(d), msg),
                Effect::Post(w) => self.stage_post(p, *w),
                Effect::Done(batch_id, result) => {
                    self.prefill_event(p, PrefillEvent::BatchDone { batch_id, result });
                }
                Effect::Fail(room, reason) => self.prefill_fail_room(p, room, reason),
                Effect::Waited(room) if self.sc.faulty => self.excuse(Some(room)),
                Effect::Waited(_) => {}
            }
        }
    }

    /// kvx-engine's `fail_room`: `SenderFailed` for a room still open.
    fn prefill_fail_room(&mut self, p: u32, room: Room, reason: String) {
        let open = self.prefills[p as usize]
            .mgr
            .poll(room)
            .is_some_and(|s| !s.is_terminal());
        if open {
            self.prefill_event(p, PrefillEvent::SenderFailed { room, reason });
        }
    }

    /// Gathers a chunk's head slices and writes the block into the decode's ring.
    fn stage_post(&mut self, p: u32, w: PostWork) {
        let PostWork {
            work,
            src_pages,
            spec,
            op,
        } = w;
        let mut bytes = vec![0u8; op.len as usize];
        let mem = &self.prefills[p as usize].mem;
        if let Err(e) = kvx_staging::gather(&spec, mem.kv_bufs(), &src_pages, &mut bytes) {
            let room = work.key.room;
            self.prefill_fail_room(p, room, format!("staging gather: {e}"));
            self.with_stager(p, |st, fx| st.chunk_done(&work.batches, Ok(()), fx));
            return;
        }
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return;
        };
        let id = st.next_work;
        st.next_work += 1;
        st.works.insert(id, work.clone());
        let job = Job::Stage {
            work: id,
            chunk: work.key.chunk_idx,
        };
        let write = Write {
            room: work.key.room,
            id: job,
            ops: vec![op],
            payload: Some(bytes),
        };
        self.post_write(p, &work.key.session, write);
    }

    /// `Stage`: the manager hands over a chunk's pages for a staged session.
    pub(crate) fn prefill_stage(
        &mut self,
        p: u32,
        room: Room,
        session: SessionId,
        batch_id: BatchId,
        slice: PageSlice,
        src_pages: Vec<i32>,
    ) {
        let now = self.clock.now();
        let staged = self.with_stager(p, |st, fx| {
            st.stage(now, room, &session, batch_id, slice, &src_pages, fx);
        });
        if !staged {
            let result = Err("staging is off on this prefill rank".into());
            self.prefill_event(p, PrefillEvent::BatchDone { batch_id, result });
        }
    }

    /// The room's metadata was accepted: opens its staging when its session stages.
    pub(crate) fn prefill_staging_open(
        &mut self,
        p: u32,
        room: Room,
        session: &SessionId,
        pages: usize,
    ) {
        let n = &self.prefills[p as usize];
        let open = n.mgr.poll(room).is_some_and(|s| !s.is_terminal());
        if !open || n.mgr.path_for(session) != Some(TransferPath::Staging) {
            return;
        }
        let Some(reg) = n.mgr.registration(session).cloned() else {
            return;
        };
        let Some((d, _)) = session_decode(session, self.sc.decode_tp) else {
            return;
        };
        let target = Target::new(p, self.sc.prefill_tp, d, &reg);
        self.with_stager(p, |st, fx| st.open(room, target, &reg, pages, fx));
    }

    /// A staged chunk's write was answered: `CHUNK_READY` once it landed, then its batches.
    pub(crate) fn prefill_stage_answer(&mut self, p: u32, work: u64, result: BatchResult) {
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return;
        };
        let Some(w) = st.works.remove(&work) else {
            return;
        };
        let r = match result {
            BatchResult::Ok => {
                let msg = ChunkReady {
                    room: w.key.room,
                    chunk_idx: w.key.chunk_idx,
                    page_start: w.page_start,
                    num_pages: w.pages,
                    session: w.key.session.clone(),
                    prefill_unique_rank: Some(self.prefills[p as usize].mgr.prefill_unique_rank()),
                };
                self.send(Node::Prefill(p), Node::Decode(w.d), Msg::ChunkReady(msg));
                Ok(())
            }
            BatchResult::Lost(e) => Err(e),
            BatchResult::Rejected(reason) => {
                self.prefill_fail_room(p, w.key.room, reason);
                Ok(())
            }
        };
        self.with_stager(p, |st, fx| st.chunk_done(&w.batches, r, fx));
    }

    /// `STAGING_RSP` or `WATERMARK` from a decode.
    pub(crate) fn prefill_staging_receive(&mut self, p: u32, msg: Msg) {
        let now = self.clock.now();
        match msg {
            Msg::StagingRsp(rsp) => {
                self.with_stager(p, |st, fx| {
                    // Mostly a response to another rank's request for a room this rank already
                    // concluded (every rank of a room gets every response): dropped.
                    if let Ok(wakes) = st.state.on_staging_rsp(&rsp) {
                        for w in wakes {
                            st.act(now, w.key, w.readiness, fx);
                        }
                    }
                    if let (true, RspPlacement::At(p)) = (st.ignore_watermark, rsp.placement) {
                        st.seen.insert(rsp.key(), p);
                        st.post(rsp.key(), &p, fx);
                    }
                });
            }
            Msg::Watermark(wm) => {
                self.with_stager(p, |st, fx| {
                    for w in st.state.on_watermark(&wm) {
                        st.act(now, w.key, w.readiness, fx);
                    }
                });
            }
            _ => {}
        }
    }

    /// The manager concluded a room: the stager forgets it.
    pub(crate) fn prefill_staging_concluded(&mut self, p: u32, room: Room) {
        self.with_stager(p, |st, fx| st.conclude(room, fx));
    }

    /// Schedules the staging housekeeping while staged rooms exist.
    pub(crate) fn ensure_staging_housekeeping(&mut self, p: u32) {
        let now = self.clock.now();
        let n = &mut self.prefills[p as usize];
        let (Some(st), Some(cfg)) = (n.stager.as_mut(), self.sc.staging) else {
            return;
        };
        if st.room_count() == 0 || st.housekeeping_at.is_some() {
            return;
        }
        let at = now + cfg.housekeeping;
        st.housekeeping_at = Some(at);
        let inc = n.inc;
        self.schedule(at, Ev::StagingHousekeeping { p, inc });
    }

    /// Once a second: fails rooms parked too long, forgets rooms the manager dropped, and
    /// probes the decodes staged rooms wait on.
    pub(crate) fn prefill_staging_housekeeping(&mut self, p: u32, inc: u32) {
        let now = self.clock.now();
        let n = &mut self.prefills[p as usize];
        let Some(cfg) = self.sc.staging else {
            return;
        };
        if n.inc != inc || n.down {
            return;
        }
        let Some(st) = n.stager.as_mut() else {
            return;
        };
        st.housekeeping_at = None;
        let gone: Vec<Room> = st
            .room_ids()
            .into_iter()
            .filter(|&r| n.mgr.poll(r).is_none())
            .collect();
        self.with_stager(p, |st, fx| {
            st.expire(now, fx);
            for room in gone {
                st.conclude(room, fx);
            }
        });
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return;
        };
        let sessions = st.sessions();
        st.probed.retain(|s, _| sessions.contains(s));
        let mut probes = Vec::new();
        for session in sessions {
            if st
                .probed
                .get(&session)
                .is_some_and(|&at| now - at < cfg.probe_period)
            {
                continue;
            }
            st.probed.insert(session.clone(), now);
            probes.push(session);
        }
        for session in probes {
            self.schedule(
                now,
                Ev::Probe {
                    p,
                    inc,
                    session,
                    retry: false,
                },
            );
        }
        self.ensure_staging_housekeeping(p);
    }

    /// One connect of a liveness probe to the inbox of the decode behind `session`: a decode
    /// that is down fails it; two failures in a row are reported as `SessionLost`. A decode
    /// restarted on the same address answers (its inbox is back), as a real connect would.
    pub(crate) fn prefill_probe(&mut self, p: u32, inc: u32, session: SessionId, retry: bool) {
        let n = &self.prefills[p as usize];
        if n.inc != inc || n.down {
            return;
        }
        let Some((d, _)) = session_decode(&session, self.sc.decode_tp) else {
            return;
        };
        if !self.decodes[d as usize].down {
            return;
        }
        if !retry {
            let at = self.clock.now() + self.sc.staging.map_or(0, |c| c.probe_retry);
            let ev = Ev::Probe {
                p,
                inc,
                session,
                retry: true,
            };
            self.schedule(at, ev);
            return;
        }
        self.trace_line(None, || format!("  prefill {p} -> SessionLost {session}"));
        self.stats.sessions_lost += 1;
        self.prefill_event(p, PrefillEvent::SessionLost { session });
    }
}
