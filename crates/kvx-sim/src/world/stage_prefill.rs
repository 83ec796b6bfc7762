//! The prefill side of staging in the simulated world: kvx-engine's real [`StagingDriver`]
//! (`prefill_staging.rs`), driven the way kvx-engine's loop drives it (`engine/staging.rs`), with
//! the simulated clock, network and data plane in place of real ones.
//!
//! The world opens a room's staging when its metadata names a session on the staging path, hands
//! the manager's `Stage` actions to the driver and performs the driver's [`Effect`]s: a `Send`'s
//! frames are parsed with kvx-engine's own wire parser (as the decode's inbox would read them)
//! into a simulated `STAGING_REQ`; a `Post` is gathered with kvx-staging's `gather` and written
//! with one op into the decode's ring, followed by the work's `CHUNK_READY` once the write landed;
//! `Done` and `Fail` go to the real `PrefillManager`. `STAGING_RSP` and `WATERMARK` go to the
//! driver as they arrive. A housekeeping runs every second while staged rooms exist: the driver
//! expires rooms parked past the wait timeout, rooms the manager dropped are concluded, and the
//! decodes the rooms wait on are probed — two failed connects in a row are
//! `PrefillEvent::SessionLost`.
//!
//! What the sim adds around the driver, from what it observes and never by re-deriving the
//! driver's rules: the ids of writes in flight, the probe schedule, and the *long wait* excuse of
//! the invariants (a chunk posted [`LONG_WAIT`] after the `Stage` action that completed it, or a
//! room failed by the wait timeout, waited behind a fault; in a fault-free seed that may not
//! happen). The `ignore-watermark` mutant is planted here too, around the real driver.

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::prefill::{BatchId, PrefillEvent, TransferPath};
use kvx_core::{Endpoint, PageSlice, Room, SessionId, TransferOp};
use kvx_engine::prefill_staging::{Effect, LocalShape, StageWork, StagingDriver};
use kvx_engine::wire::{DecodeInbound, parse_decode_inbound};
use kvx_staging::{ChunkGrid, ChunkKey, Watermark, WatermarkMsg};

use super::{Ev, World, decode_endpoint, session_decode};
use crate::clock::{MS, Nanos, dur};
use crate::data::{BatchResult, Job, Write};
use crate::memory::{KV_BUFFERS, PAGE_SIZE, TOTAL_HEADS, item_len};
use crate::net::{Msg, Node};

/// A chunk posted this long after the `Stage` action that completed it waited behind a fault (a
/// slow write or message, or a slot fenced for a dead rank, holding the watermark back); in a
/// fault-free seed none waits nearly as long.
const LONG_WAIT: Nanos = 500 * MS;

/// A chunk write posted to the simulated data plane.
#[derive(Clone, Debug)]
struct InFlight {
    /// The decode rank it goes to.
    d: u32,
    /// The driver's work (its batches, and the `CHUNK_READY` it is announced with).
    work: StageWork,
}

/// One prefill rank's staging: the real driver plus what the simulation keeps beside it.
#[derive(Debug)]
pub struct PrefillStager {
    /// kvx-engine's driver.
    driver: StagingDriver,
    /// The chunk grid (the driver's), to know which chunks a `Stage` action feeds.
    grid: ChunkGrid,
    /// Writes in flight, by the id their data-plane job carries.
    works: BTreeMap<u64, InFlight>,
    /// The next write id.
    next_work: u64,
    /// When each decode session staged rooms wait on was last probed.
    probed: BTreeMap<SessionId, Nanos>,
    /// When each chunk of an opened room was last fed by a `Stage` action (the completing one is
    /// when the driver polled it); forgotten when it is posted or its room concluded.
    fed: BTreeMap<ChunkKey, Nanos>,
    /// When the next housekeeping runs, if one is scheduled.
    pub housekeeping_at: Option<Nanos>,
    /// The `ignore-watermark` mutant: the driver is told every ring is free as soon as a
    /// session's placements arrive, so a chunk is written once its placement is known, whatever
    /// the decode's real watermark says.
    ignore_watermark: bool,
}

impl PrefillStager {
    /// Staged rooms held (per decode session).
    pub fn room_count(&self) -> usize {
        self.driver.room_count()
    }

    /// True when nothing is held: no room, batch, write or key.
    pub fn is_idle(&self) -> bool {
        self.driver.is_idle() && self.works.is_empty() && self.fed.is_empty()
    }

    /// What is held, for a leak report.
    pub fn held(&self) -> String {
        format!(
            "{} rooms, {} writes, {} parked, {} fed chunks, driver idle: {}",
            self.driver.room_count(),
            self.works.len(),
            self.driver.parked_count(),
            self.fed.len(),
            self.driver.is_idle()
        )
    }

    /// Forgets the sim's notes on `room`.
    fn forget(&mut self, room: Room) {
        self.fed.retain(|k, _| k.room != room);
    }
}

/// The decode rank whose inbox is `endpoint` (`None` for an address no decode listens on).
fn endpoint_decode(endpoint: &Endpoint, decodes: u32) -> Option<u32> {
    (0..decodes).find(|&d| decode_endpoint(d) == *endpoint)
}

/// A watermark past every placement: the `ignore-watermark` mutant's lie.
fn everything_free(session: &SessionId) -> WatermarkMsg {
    WatermarkMsg {
        watermark: Watermark {
            round: u64::MAX,
            tail: u64::MAX,
        },
        session: session.clone(),
    }
}

impl World {
    /// A fresh stager for prefill rank `p`, when the seed stages.
    pub(crate) fn new_prefill_stager(&self, p: u32) -> Option<PrefillStager> {
        let cfg = self.sc.staging?;
        let grid = ChunkGrid::with_pages(cfg.grid_pages);
        let local = LocalShape {
            tp_rank: p,
            tp_size: self.sc.prefill_tp,
            total_kv_heads: TOTAL_HEADS,
            page_size: u64::from(PAGE_SIZE),
            item_len: item_len(self.sc.prefill_tp),
            num_buffers: KV_BUFFERS,
        };
        Some(PrefillStager {
            driver: StagingDriver::new(local, grid, dur(cfg.wait_timeout)),
            grid,
            works: BTreeMap::new(),
            next_work: 0,
            probed: BTreeMap::new(),
            fed: BTreeMap::new(),
            housekeeping_at: None,
            ignore_watermark: self.mutant == Some(crate::mutants::Mutant::IgnoreWatermark),
        })
    }

    /// Runs `f` on rank `p`'s stager (when it stages) and performs the driver's effects.
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

    /// Performs the driver's effects, in order.
    fn stage_perform(&mut self, p: u32, fx: Vec<Effect>) {
        for e in fx {
            match e {
                Effect::Send(endpoint, frames) => self.stage_send(p, &endpoint, &frames),
                Effect::Post(w) => self.stage_post(p, *w),
                Effect::Done(batch_id, result) => {
                    self.prefill_event(p, PrefillEvent::BatchDone { batch_id, result });
                }
                Effect::Fail(room, reason) => self.prefill_fail_room(p, room, reason),
            }
        }
    }

    /// A `Send`: the frames as the decode's inbox parses them, to the decode at `endpoint`.
    fn stage_send(&mut self, p: u32, endpoint: &Endpoint, frames: &[Vec<u8>]) {
        let d = endpoint_decode(endpoint, self.sc.decode_tp);
        let parsed = parse_decode_inbound(frames);
        // The driver sends only STAGING_REQ, and only to inboxes decodes registered: anything
        // else is a wiring bug of the simulation, loud in debug builds (the regression tests).
        debug_assert!(
            d.is_some() && matches!(parsed, Ok(DecodeInbound::StagingReq(_))),
            "prefill {p}: unexpected staging send to {endpoint}: {parsed:?}"
        );
        if let (Some(d), Ok(DecodeInbound::StagingReq(req))) = (d, &parsed) {
            let msg = Msg::StagingReq(req.clone());
            self.send(Node::Prefill(p), Node::Decode(d), msg);
        } else {
            self.trace_line(None, || {
                format!("  prefill {p}: unexpected staging send to {endpoint}: {parsed:?}")
            });
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

    /// A `Post`: gathers the chunk's head slices and writes the block into the decode's ring.
    fn stage_post(&mut self, p: u32, work: StageWork) {
        let now = self.clock.now();
        let d = endpoint_decode(&work.endpoint, self.sc.decode_tp);
        let n = &mut self.prefills[p as usize];
        let Some(st) = n.stager.as_mut() else {
            return;
        };
        let long = st
            .fed
            .remove(&work.key)
            .is_some_and(|t| now.saturating_sub(t) >= LONG_WAIT);
        let mut bytes = vec![0u8; usize::try_from(work.len).unwrap_or(0)];
        let gathered =
            kvx_staging::gather(&work.spec, n.mem.kv_bufs(), &work.src_pages, &mut bytes);
        if long && self.sc.faulty {
            self.excuse(Some(work.key.room));
        }
        let d = match (gathered, d) {
            (Ok(_), Some(d)) => d,
            (gathered, _) => {
                let reason = match gathered {
                    Err(e) => format!("staging gather: {e}"),
                    Ok(_) => format!("staging: no decode listens at {}", work.endpoint),
                };
                self.prefill_fail_room(p, work.key.room, reason);
                self.with_stager(p, |st, fx| st.driver.chunk_done(&work.batches, Ok(()), fx));
                return;
            }
        };
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return;
        };
        let id = st.next_work;
        st.next_work += 1;
        let write = Write {
            room: work.key.room,
            id: Job::Stage {
                work: id,
                chunk: work.key.chunk_idx,
            },
            ops: vec![TransferOp::new(0, work.dst, work.len)],
            payload: Some(bytes),
        };
        let session = work.key.session.clone();
        st.works.insert(id, InFlight { d, work });
        self.post_write(p, &session, write);
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
        let at = self.clock.instant();
        let staged = self.with_stager(p, |st, fx| {
            if st.driver.rooms().contains(&room) {
                for (idx, _) in st.grid.split(slice) {
                    if let Ok(chunk_idx) = u32::try_from(idx) {
                        let key = ChunkKey {
                            room,
                            chunk_idx,
                            session: session.clone(),
                        };
                        st.fed.insert(key, now);
                    }
                }
            }
            st.driver
                .stage(at, room, &session, batch_id, slice, &src_pages, fx);
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
        self.with_stager(p, |st, fx| st.driver.open(room, &reg, pages, fx));
    }

    /// A staged chunk's write was answered: `CHUNK_READY` once it landed, then its batches.
    pub(crate) fn prefill_stage_answer(&mut self, p: u32, work: u64, result: BatchResult) {
        let rank = self.prefills[p as usize].mgr.prefill_unique_rank();
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return;
        };
        let Some(InFlight { d, work }) = st.works.remove(&work) else {
            return;
        };
        let r = match result {
            BatchResult::Ok => {
                let msg = Msg::ChunkReady(work.chunk_ready(rank));
                self.send(Node::Prefill(p), Node::Decode(d), msg);
                Ok(())
            }
            BatchResult::Lost(e) => Err(e),
            BatchResult::Rejected(reason) => {
                self.prefill_fail_room(p, work.key.room, reason);
                Ok(())
            }
        };
        self.with_stager(p, |st, fx| st.driver.chunk_done(&work.batches, r, fx));
    }

    /// `STAGING_RSP` or `WATERMARK` from a decode.
    pub(crate) fn prefill_staging_receive(&mut self, p: u32, msg: Msg) {
        let now = self.clock.instant();
        match msg {
            Msg::StagingRsp(rsp) => {
                self.with_stager(p, |st, fx| {
                    // An error is mostly a response to another rank's request for a room this
                    // rank already concluded (every rank of a room gets every response): dropped,
                    // as kvx-engine drops it.
                    let _ = st.driver.on_rsp(now, &rsp, fx);
                    if st.ignore_watermark {
                        st.driver
                            .on_watermark(now, &everything_free(&rsp.session), fx);
                    }
                });
            }
            Msg::Watermark(wm) => {
                self.with_stager(p, |st, fx| st.driver.on_watermark(now, &wm, fx));
            }
            _ => {}
        }
    }

    /// The manager concluded a room: the stager forgets it.
    pub(crate) fn prefill_staging_concluded(&mut self, p: u32, room: Room) {
        self.with_stager(p, |st, fx| {
            st.forget(room);
            st.driver.conclude(room, fx);
        });
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
        let at = self.clock.instant();
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
            .driver
            .rooms()
            .into_iter()
            .filter(|&r| n.mgr.poll(r).is_none())
            .collect();
        // Rooms the wait timeout fails waited behind a fault (see `LONG_WAIT`).
        let mut expired = Vec::new();
        st.driver.expire(at, &mut expired);
        if self.sc.faulty {
            for e in &expired {
                if let Effect::Fail(room, _) = e {
                    self.excuse(Some(*room));
                }
            }
        }
        self.stage_perform(p, expired);
        self.with_stager(p, |st, fx| {
            for room in gone {
                st.forget(room);
                st.driver.conclude(room, fx);
            }
        });
        let Some(st) = self.prefills[p as usize].stager.as_mut() else {
            return;
        };
        let sessions: BTreeSet<SessionId> = st.driver.sessions().into_iter().collect();
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
