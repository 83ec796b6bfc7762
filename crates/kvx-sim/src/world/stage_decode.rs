//! The decode side of staged rooms: a driver around kvx-staging's real [`DecodeStaging`] that
//! plays kvx-engine's decode stager (`decode_staging.rs`) — a byte-exact ring, rooms registered
//! before their metadata goes out, `STAGING_REQ` answered with placements (and the watermark),
//! a chunk scattered into the room's pages as soon as every writer's `CHUNK_READY` arrived (on
//! the inbox's thread, before the next message), its slot freed and the new watermark sent. A
//! room that ends Success is released at once; a failed one is aborted (the slots a prefill may
//! still write stay fenced) and its fences go when the decode releases its pages.
//!
//! Beside the real state machine the driver keeps a shadow of the ring: which live slot belongs
//! to which (room, chunk), and which slot's write last put each byte there, so that a write
//! into a freed or foreign slot ([`Inv::RingWriteInLiveSlot`]) and a scatter that copies out
//! another chunk's bytes ([`Inv::ScatterOwnBytes`]) are seen. The `early-slot-reuse` mutant frees
//! a chunk's slot before its copy-out ran.
//!
//! With `in_place` (kvx-engine's receive straight into the pages over tcp) a granted slot is
//! placed once no older live slot overlaps it, and a write into a placed slot's bytes goes
//! through kvx-staging's [`ScatterMap`] into the pages of the chunk that slot was granted to —
//! routed by address, as the engine's receiver routes it — so a write routed into another
//! chunk's pages ([`Inv::PlacedWriteOwnChunk`]) is seen; at the copy-out the blocks that arrived
//! in place are skipped. The `place-over-live` mutant places a slot as soon as it is granted.
//! Some seeds have prefill ranks that write around the receiver (RDMA, shared memory, a
//! Mooncake TE writer: `StagingConfig::around`): their blocks land in the ring even where a
//! placement covers it, and are scattered from there beside the in-place blocks of the chunk.

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::{Room, SessionId, StagingRingInfo, TransferOp};
use kvx_staging::{
    ChunkGrid, DecodeAction as StagingAction, DecodeError, DecodeRoom, DecodeStaging, Placement,
    RoomGrid, ScatterJob, ScatterMap, SliceSpec, StagedLayout, TpGeometry,
};

use super::{Ev, World};
use crate::clock::MS;
use crate::invariants::Inv;
use crate::memory::{HEAD_BYTES, KV_BUFFERS, PAGE_SIZE, TOTAL_HEADS, item_len};
use crate::mutants::Mutant;
use crate::net::{Msg, Node};

/// The staging state of one decode rank.
#[derive(Debug)]
pub struct DecodeStager {
    /// The real state machine (prefill ranks named by their TP rank).
    pub state: DecodeStaging<u32>,
    base: u64,
    grid: ChunkGrid,
    ring: Vec<u8>,
    /// Per ring byte: 1 + the id of the slot whose write last landed there (0: never written).
    tags: Vec<u64>,
    /// Live slots (allocation ids) and the chunk each was granted to.
    owners: BTreeMap<u64, (Room, u32)>,
    /// Staged rooms: destination pages and chunk layout.
    rooms: BTreeMap<Room, (Vec<u64>, StagedLayout)>,
    /// Whether blocks are received in place (see the module docs).
    in_place: bool,
    /// Placed slots: per writer of the chunk, the bytes received in place.
    placed: BTreeMap<u64, Vec<u64>>,
    /// Granted slots not placed yet (an older live slot overlaps them).
    waiting: BTreeSet<u64>,
}

impl DecodeStager {
    /// An empty ring of `size` bytes at `base` for session `session`.
    pub fn new(session: SessionId, base: u64, size: u64, grid: ChunkGrid, in_place: bool) -> Self {
        DecodeStager {
            in_place,
            placed: BTreeMap::new(),
            waiting: BTreeSet::new(),
            state: DecodeStaging::new(session, size),
            base,
            grid,
            ring: vec![0; size as usize],
            tags: vec![0; size as usize],
            owners: BTreeMap::new(),
            rooms: BTreeMap::new(),
        }
    }

    /// What the registration advertises.
    pub fn ring_info(&self) -> StagingRingInfo {
        StagingRingInfo {
            base: Some(self.base),
            size: Some(self.ring.len() as u64),
        }
    }

    /// Live slots, with their placement.
    fn live(&self) -> Vec<(u64, Placement)> {
        self.state
            .ring()
            .live()
            .map(|(id, p)| (id.get(), p))
            .collect()
    }

    /// Records the owner of slots granted since the last call (to `room`'s chunk `chunk`) and
    /// forgets freed ones.
    fn note_grants(&mut self, room: Room, chunk: u32) {
        let live = self.live();
        self.owners
            .retain(|id, _| live.iter().any(|(l, _)| l == id));
        for (id, _) in live {
            if let std::collections::btree_map::Entry::Vacant(e) = self.owners.entry(id) {
                e.insert((room, chunk));
                if self.in_place {
                    self.waiting.insert(id);
                }
            }
        }
    }

    /// Forgets the placements of freed slots and places every waiting slot no older live slot
    /// overlaps (any slot no placed one overlaps, under `place-over-live`), as kvx-engine's
    /// stager does after each grant and each free.
    pub fn place_waiting(&mut self, over_live: bool) {
        let live = self.live();
        let is_live = |id: &u64| live.iter().any(|(l, _)| l == id);
        self.placed.retain(|id, _| is_live(id));
        self.waiting.retain(is_live);
        let at = |id: u64| live.iter().find(|(l, _)| *l == id).map(|&(_, p)| p);
        let ready: Vec<u64> = self
            .waiting
            .iter()
            .copied()
            .filter(|&id| {
                let Some(p) = at(id) else { return false };
                if over_live {
                    // Only the region table's own rule: no two placements overlap.
                    return !self
                        .placed
                        .keys()
                        .any(|&q| at(q).is_some_and(|q| q.overlaps(&p)));
                }
                live.iter()
                    .all(|(_, q)| (q.round, q.offset) >= (p.round, p.offset) || !q.overlaps(&p))
            })
            .collect();
        for id in ready {
            self.waiting.remove(&id);
            let writers = self
                .owners
                .get(&id)
                .and_then(|(room, _)| self.rooms.get(room))
                .map_or(0, |(_, l)| l.writers.len());
            self.placed.insert(id, vec![0; writers]);
        }
    }

    /// Ends the placements of `room`'s slots (its writes from now on land in the ring).
    pub fn unplace_room(&mut self, room: Room) {
        let owners = &self.owners;
        let mine = |id: &u64| owners.get(id).is_some_and(|(r, _)| *r == room);
        self.placed.retain(|id, _| !mine(id));
        self.waiting.retain(|id| !mine(id));
    }

    /// The placed slot whose bytes a write by `op` touches, if any (what the engine's receiver
    /// routes it by: the address).
    pub fn placed_slot(&self, op: &TransferOp) -> Option<u64> {
        let off = op.dst.checked_sub(self.base)?;
        let end = off.saturating_add(op.len);
        self.live()
            .into_iter()
            .find(|(id, p)| self.placed.contains_key(id) && p.offset < end && off < p.end)
            .map(|(id, _)| id)
    }

    /// Receives a write into placed slot `slot` straight into its chunk's pages (`kv`, pages of
    /// `item` bytes) through the writer's [`ScatterMap`], and counts it for that writer.
    pub fn route(
        &mut self,
        slot: u64,
        op: &TransferOp,
        bytes: &[u8],
        kv: &mut [Vec<u8>],
        item: u64,
    ) -> Result<(), String> {
        let p = (self.live().into_iter())
            .find(|(id, _)| *id == slot)
            .map(|(_, p)| p)
            .ok_or("the slot is not live")?;
        let (room, chunk) = *self.owners.get(&slot).ok_or("the slot has no owner")?;
        let (pages, layout) = self.rooms.get(&room).ok_or("the room is not staged")?;
        let grid = RoomGrid::from_pages(self.grid, pages.len() as u64);
        let c = u64::from(chunk);
        let (Some(start), Some(n)) = (grid.chunk_start(c), grid.chunk_pages(c)) else {
            return Err("the chunk is off the grid".into());
        };
        let rel = op.dst - self.base - p.offset;
        let w = (0..layout.writers.len())
            .find(|&w| {
                let o = layout.writer_offset(w, n);
                rel >= o && rel + op.len <= o + layout.writer_bytes(w, n)
            })
            .ok_or("the write is not inside one writer's block")?;
        let wr = &layout.writers[w];
        let spec = SliceSpec {
            page_size: PAGE_SIZE as usize,
            bytes_per_head_token: HEAD_BYTES as usize,
            item_len: item as usize,
            head: wr.dst_head as usize,
            n_heads: wr.heads as usize,
        };
        let chunk_pages: Vec<i32> = (pages.iter().skip(start as usize).take(n as usize))
            .map(|&pg| pg as i32)
            .collect();
        let bufs: Vec<(u64, usize)> = (kv.iter().enumerate())
            .map(|(b, v)| ((b as u64) << 40, v.len()))
            .collect();
        let map = ScatterMap::new(&spec, &bufs, &chunk_pages).map_err(|e| e.to_string())?;
        let mut at = 0usize;
        map.pieces(rel - layout.writer_offset(w, n), op.len, |addr, len| {
            let (b, o, len) = (
                (addr >> 40) as usize,
                (addr & ((1 << 40) - 1)) as usize,
                len as usize,
            );
            kv[b][o..o + len].copy_from_slice(&bytes[at..at + len]);
            at += len;
        });
        if let Some(r) = self.placed.get_mut(&slot).and_then(|v| v.get_mut(w)) {
            *r += op.len;
        }
        Ok(())
    }

    /// Ends slot `slot`'s placement: the bytes each writer's block took in place (empty when
    /// it was not placed).
    pub fn take_placed(&mut self, slot: u64) -> Vec<u64> {
        self.waiting.remove(&slot);
        self.placed.remove(&slot).unwrap_or_default()
    }

    /// The live slot of `room`'s chunk `chunk`.
    fn slot_of(&self, room: Room, chunk: u32) -> Option<(u64, Placement)> {
        self.live()
            .into_iter()
            .find(|(id, _)| self.owners.get(id) == Some(&(room, chunk)))
    }

    /// Where a write of `len` bytes by `op` for `room`'s chunk `chunk` may land: the id of the
    /// live slot granted to that chunk containing it, provided no older live slot overlaps it.
    pub fn check_write(
        &self,
        room: Room,
        chunk: u32,
        op: &TransferOp,
        len: usize,
    ) -> Result<u64, String> {
        let off = op.dst.checked_sub(self.base).ok_or("below the ring")?;
        let end = off
            .checked_add(op.len)
            .filter(|&e| e <= self.ring.len() as u64 && op.len == len as u64)
            .ok_or("beyond the ring")?;
        let live = self.live();
        let Some(&(mine, _)) = live.iter().find(|(id, p)| {
            self.owners.get(id) == Some(&(room, chunk)) && p.offset <= off && end <= p.end
        }) else {
            let at = live
                .iter()
                .filter(|(_, p)| p.offset < end && off < p.end)
                .map(|(id, p)| (self.owners.get(id), p))
                .collect::<Vec<_>>();
            return Err(format!(
                "bytes {off}..{end} lie in no live slot of that chunk (released, or never granted); live slots there: {at:?}"
            ));
        };
        if let Some((older, p)) = live
            .iter()
            .find(|(id, p)| *id < mine && p.offset < end && off < p.end)
        {
            return Err(format!(
                "bytes {off}..{end} overlap slot {older} {p:?} of {:?}, older and still live",
                self.owners.get(older)
            ));
        }
        Ok(mine)
    }

    /// Copies a checked write into the ring and tags its bytes with `slot`.
    pub fn write(&mut self, slot: u64, op: &TransferOp, bytes: &[u8]) {
        let off = (op.dst - self.base) as usize;
        self.ring[off..off + bytes.len()].copy_from_slice(bytes);
        self.tags[off..off + bytes.len()].fill(slot + 1);
    }

    /// Held state, for a leak report (`None` when nothing is held).
    pub fn held(&self) -> Option<String> {
        let s = &self.state;
        let n = (
            s.room_count(),
            s.live_allocations(),
            s.fenced_count(),
            s.subscriber_count(),
            self.rooms.len(),
        );
        (n != (0, 0, 0, 0, 0)).then(|| {
            format!(
                "{} staged rooms, {} live slots, {} fenced rooms, {} subscribers, {} driver rooms",
                n.0, n.1, n.2, n.3, n.4
            )
        })
    }
}

impl World {
    /// A fresh stager for decode rank `d` in its current incarnation, when the seed stages.
    pub(crate) fn new_decode_stager(&self, d: u32) -> Option<DecodeStager> {
        let cfg = self.sc.staging?;
        let inc = self.decodes.get(d as usize).map_or(0, |n| n.inc);
        let base = 0x2000_0000_0000 + (u64::from(d) << 34) + 0xc000_0000;
        let grid = ChunkGrid::with_pages(cfg.grid_pages);
        let session = super::decode_session(d, inc, self.sc.fixed_sessions);
        Some(DecodeStager::new(
            session,
            base,
            cfg.ring_bytes,
            grid,
            cfg.in_place,
        ))
    }

    /// Registers a room with the ring before its metadata goes out (rooms of a heterogeneous
    /// TP pair only: equal TP never stages).
    pub(crate) fn decode_staging_register(&mut self, d: u32, room: Room, pages: &[u64]) {
        let (pt, dt) = (self.sc.prefill_tp, self.sc.decode_tp);
        let n = &mut self.decodes[d as usize];
        let Some(st) = n.stager.as_mut() else {
            return;
        };
        if pt == dt {
            return;
        }
        let Ok(geom) = TpGeometry::new(TOTAL_HEADS, pt, dt) else {
            return;
        };
        let layers = (KV_BUFFERS / 2) as u32;
        let layout = StagedLayout::for_decode(&geom, d, layers, HEAD_BYTES, u64::from(PAGE_SIZE));
        let peers = n
            .targets
            .iter()
            .filter(|t| !t.dummy)
            .map(|t| t.tp_rank)
            .collect();
        let grid = RoomGrid::from_pages(st.grid, pages.len() as u64);
        let cfg = DecodeRoom {
            peers,
            grid,
            layout: layout.clone(),
        };
        if st.state.register_room(room, cfg).is_ok() {
            st.rooms.insert(room, (pages.to_vec(), layout));
        } else {
            self.decode_local_abort(d, room);
        }
    }

    /// Sends what the state machine asked and runs its scatters.
    fn decode_staging_perform(&mut self, d: u32, actions: Vec<StagingAction<u32>>) {
        for a in actions {
            match a {
                StagingAction::Respond { to, rsp, .. } => {
                    for p in to {
                        let msg = Msg::StagingRsp(rsp.clone());
                        self.send(Node::Decode(d), Node::Prefill(p), msg);
                    }
                }
                StagingAction::Watermark { to, msg } => {
                    for p in to {
                        let msg = Msg::Watermark(msg.clone());
                        self.send(Node::Decode(d), Node::Prefill(p), msg);
                    }
                }
                StagingAction::Scatter(job) => self.decode_scatter(d, job),
            }
        }
    }

    /// `STAGING_REQ` or `CHUNK_READY` reaches decode rank `d`.
    pub(crate) fn decode_staging_receive(&mut self, d: u32, msg: Msg) {
        let Some(st) = self.decodes[d as usize].stager.as_mut() else {
            return;
        };
        let r = match &msg {
            Msg::StagingReq(req) => {
                let r = st.state.on_staging_req(req);
                st.note_grants(req.room, req.chunk_idx);
                st.place_waiting(self.mutant == Some(Mutant::PlaceOverLive));
                r
            }
            Msg::ChunkReady(m) => st.state.on_chunk_ready(m),
            _ => return,
        };
        match r {
            Ok(actions) => self.decode_staging_perform(d, actions),
            Err(
                DecodeError::ChunkMismatch { room, .. } | DecodeError::ChunkOutOfGrid { room, .. },
            ) => {
                // The prefill cuts the room on another grid: no chunk can land; fail it now.
                self.decode_local_abort(d, room);
            }
            // Unknown (released) rooms and late duplicates: dropped, as kvx's decode does.
            Err(_) => {}
        }
    }

    /// Every writer of a chunk reported: its block is copied out of the ring into the room's
    /// pages, then its slot is freed (under `early-slot-reuse`, freed first and copied later).
    fn decode_scatter(&mut self, d: u32, job: ScatterJob) {
        let Some(st) = self.decodes[d as usize].stager.as_mut() else {
            return;
        };
        let Some((slot, _)) = st.slot_of(job.room, job.chunk_idx) else {
            self.check
                .check(Inv::ScatterOwnBytes, false, Some(job.room), || {
                    format!(
                        "decode rank {d} scatters chunk {} without a live slot",
                        job.chunk_idx
                    )
                });
            return;
        };
        // Every writer reported: the placement ends (kvx-engine unplaces before the scatter).
        let routed = st.take_placed(slot);
        if self.mutant == Some(Mutant::EarlySlotReuse) {
            self.decode_scatter_done(d, &job);
            let at = self.clock.now() + self.rng.range(0, 20 * MS);
            let inc = self.decodes[d as usize].inc;
            let ev = Ev::ScatterCopy {
                d,
                inc,
                job,
                slot,
                routed,
            };
            self.schedule(at, ev);
            return;
        }
        self.decode_copy_out(d, &job, slot, &routed);
        self.decode_scatter_done(d, &job);
    }

    fn decode_scatter_done(&mut self, d: u32, job: &ScatterJob) {
        let Some(st) = self.decodes[d as usize].stager.as_mut() else {
            return;
        };
        if let Ok(actions) = st.state.on_scatter_done(job.room, job.chunk_idx) {
            st.place_waiting(self.mutant == Some(Mutant::PlaceOverLive));
            self.decode_staging_perform(d, actions);
        }
    }

    /// Copies a chunk's blocks that did not arrive in place (`routed[w]`: the bytes writer
    /// `w`'s block took in place) from the ring into its pages, checking first that every byte
    /// of those blocks was written for the slot.
    pub(crate) fn decode_copy_out(&mut self, d: u32, job: &ScatterJob, slot: u64, routed: &[u64]) {
        let dt = self.sc.decode_tp;
        let n = &mut self.decodes[d as usize];
        let Some(st) = n.stager.as_mut() else {
            return;
        };
        let pl = job.placement;
        let Some((pages, layout)) = st.rooms.get(&job.room) else {
            return;
        };
        let whole = |w: usize| layout.writer_bytes(w, job.num_pages);
        let in_place = |w: usize| routed.get(w).copied().unwrap_or(0);
        let partial =
            (0..layout.writers.len()).find(|&w| in_place(w) != 0 && in_place(w) != whole(w));
        self.check
            .check(Inv::PlacedWriteOwnChunk, partial.is_none(), Some(job.room), || {
                format!(
                    "decode rank {d}: writer {partial:?} of chunk {} (slot {slot}) took {routed:?} bytes in place, not all of its block",
                    job.chunk_idx
                )
            });
        let copied: Vec<usize> = (0..layout.writers.len())
            .filter(|&w| in_place(w) == 0)
            .collect();
        let foreign = copied.iter().find_map(|&w| {
            let off = (pl.offset + layout.writer_offset(w, job.num_pages)) as usize;
            let len = whole(w) as usize;
            st.tags[off..off + len]
                .iter()
                .position(|&t| t != slot + 1)
                .map(|i| off + i)
        });
        self.check
            .check(Inv::ScatterOwnBytes, foreign.is_none(), Some(job.room), || {
                format!(
                    "decode rank {d} copies chunk {} out of slot {slot} {pl:?}, but byte {:?} of it was last written for another slot",
                    job.chunk_idx, foreign
                )
            });
        self.stats.scattered += 1;
        self.stats.in_place += (layout.writers.len() - copied.len()) as u64;
        if !copied.is_empty() && copied.len() < layout.writers.len() {
            self.stats.mixed_chunks += 1;
        }
        let (start, count) = (job.page_start as usize, job.num_pages as usize);
        let Some(chunk_pages) = pages.get(start..start + count) else {
            return;
        };
        let chunk_pages: Vec<i32> = chunk_pages.iter().map(|&p| p as i32).collect();
        for (w, wr) in layout.writers.iter().enumerate() {
            if !copied.contains(&w) {
                continue;
            }
            let spec = SliceSpec {
                page_size: PAGE_SIZE as usize,
                bytes_per_head_token: HEAD_BYTES as usize,
                item_len: item_len(dt) as usize,
                head: wr.dst_head as usize,
                n_heads: wr.heads as usize,
            };
            let off = (pl.offset + layout.writer_offset(w, job.num_pages)) as usize;
            let len = layout.writer_bytes(w, job.num_pages) as usize;
            let Some(block) = st.ring.get(off..off + len) else {
                return;
            };
            // The pattern check at Success reports any byte a failed scatter left out.
            let _ = kvx_staging::scatter(&spec, block, n.mem.kv_bufs_mut(), &chunk_pages);
        }
    }

    /// The manager concluded a staged room: Success releases its slots (true when every chunk
    /// was scattered), a failure aborts it (what a prefill may still write stays fenced).
    pub(crate) fn decode_staging_concluded(&mut self, d: u32, room: Room, success: bool) -> bool {
        let Some(st) = self.decodes[d as usize].stager.as_mut() else {
            return true;
        };
        // Writes still arriving for the room land in its (fenced) slots in the ring.
        st.unplace_room(room);
        if st.rooms.remove(&room).is_none() {
            return true;
        }
        let drained = st.state.room_drained(room) && !st.state.room_oversized(room);
        let actions = if success {
            st.state.release_room(room)
        } else {
            st.state.abort_room(room)
        };
        st.place_waiting(self.mutant == Some(Mutant::PlaceOverLive));
        self.decode_staging_perform(d, actions);
        drained
    }

    /// The room's pages are released: its fenced slots go too (kvx's `settle_room`).
    pub(crate) fn decode_staging_release(&mut self, d: u32, room: Room) {
        let Some(st) = self.decodes[d as usize].stager.as_mut() else {
            return;
        };
        let actions = st.state.release_fenced(room);
        st.place_waiting(self.mutant == Some(Mutant::PlaceOverLive));
        self.decode_staging_perform(d, actions);
    }

    /// The `early-slot-reuse` mutant's late copy-out.
    pub(crate) fn decode_late_copy(
        &mut self,
        d: u32,
        inc: u32,
        job: &ScatterJob,
        slot: u64,
        routed: &[u64],
    ) {
        if self.decodes[d as usize].inc == inc && !self.decodes[d as usize].down {
            self.decode_copy_out(d, job, slot, routed);
        }
    }
}
