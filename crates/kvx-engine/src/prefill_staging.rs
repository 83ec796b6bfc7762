//! The prefill rank's staging driver: the glue between the room manager's `Stage` actions,
//! `kvx-staging`'s [`PrefillStaging`] state machine and the transfer workers.
//!
//! When a decode's metadata names a session on the staging path (different attention TP, the
//! decode advertised a ring, `--staging` on here), the room is *opened*: every chunk of its grid
//! is requested at once (`STAGING_REQ`, sglang's prefetch). Each `Stage` action of the manager is
//! cut at grid boundaries and its source pages are collected per grid chunk, so a forward pass
//! that hands over chunks of any size still writes whole grid chunks. A complete chunk is polled:
//! writable now → a [`StageWork`] for the worker (gather this rank's head slices into its staging
//! buffer, one write to `ring + offset + writer offset`, then `CHUNK_READY`); not yet → parked
//! until `STAGING_RSP` or `WATERMARK` wakes it; oversized → the room fails. A manager batch is
//! reported done once every grid chunk it fed is written (or dropped). A room-level problem
//! (oversized chunk, unusable geometry or placement) fails the room first and then completes its
//! batches without error, so the manager does not take it for a dead decode session; only a
//! transport failure of a posted chunk completes its batches with an error. Chunks parked longer than
//! the wait timeout fail their room instead of holding it forever (a decode that stopped
//! freeing its ring).
//!
//! Deterministic: no I/O and no clock reads, and ordered maps only, so the same calls give the
//! same effects in the same order; the engine passes `now` and performs the [`Effect`]s
//! (kvx-sim drives this very driver over simulated time).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kvx_core::prefill::BatchId;
use kvx_core::{DecodeRegistration, Endpoint, PageSlice, Room, SessionId};
use kvx_staging::{
    ChunkGrid, ChunkKey, Placement, PrefillError, PrefillStaging, Readiness, RoomGrid, SliceSpec,
    StagedLayout, StagingRsp, TpGeometry, WatermarkMsg,
};

use crate::wire::{self, Frames};

/// The shape of this rank's KV, as staging needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalShape {
    /// Attention-TP rank.
    pub tp_rank: u32,
    /// Attention-TP size.
    pub tp_size: u32,
    /// KV heads of the whole model.
    pub total_kv_heads: u32,
    /// Tokens per page.
    pub page_size: u64,
    /// Bytes per page of one local KV buffer.
    pub item_len: u64,
    /// Local KV buffers (K layers, then V layers).
    pub num_buffers: usize,
}

/// One grid chunk, gathered and ready to be written by a transfer worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageWork {
    /// The chunk.
    pub key: ChunkKey,
    /// First suffix-relative page of the chunk.
    pub page_start: u64,
    /// The chunk's source pages (local page ids, in order).
    pub src_pages: Vec<i32>,
    /// How this rank's head slice is cut out of its pages.
    pub spec: SliceSpec,
    /// Where the block goes in the decode's ring (absolute address).
    pub dst: u64,
    /// Bytes of the block.
    pub len: u64,
    /// The decode's inbox (for `CHUNK_READY`).
    pub endpoint: Endpoint,
    /// The manager batches this chunk completes a part of.
    pub batches: Vec<BatchId>,
}

impl StageWork {
    /// The `CHUNK_READY` this chunk's write is announced with.
    pub fn chunk_ready(&self, prefill_unique_rank: u32) -> kvx_staging::ChunkReady {
        kvx_staging::ChunkReady {
            room: self.key.room,
            chunk_idx: self.key.chunk_idx,
            page_start: self.page_start,
            num_pages: self.src_pages.len() as u64,
            session: self.key.session.clone(),
            prefill_unique_rank: Some(prefill_unique_rank),
        }
    }
}

/// What the engine must do for the driver.
#[derive(Debug)]
pub enum Effect {
    /// Send a message (`STAGING_REQ`) to a decode inbox.
    Send(Endpoint, Frames),
    /// Queue a chunk for the transfer worker of its session.
    Post(Box<StageWork>),
    /// Report a manager batch complete.
    Done(BatchId, Result<(), String>),
    /// Fail the room (its decodes get status 0).
    Fail(Room, String),
}

/// Where and how one decode session receives a room's staged chunks.
#[derive(Clone, Debug)]
struct Target {
    endpoint: Endpoint,
    ring_base: u64,
    ring_size: u64,
    layout: StagedLayout,
    writer: usize,
    spec: SliceSpec,
}

impl Target {
    fn new(local: &LocalShape, reg: &DecodeRegistration) -> Result<Target, String> {
        let (Some(ring_base), Some(ring_size)) = (reg.staging.base, reg.staging.size) else {
            return Err(format!(
                "decode session {} advertised no complete staging ring",
                reg.session
            ));
        };
        let geom = TpGeometry::new(local.total_kv_heads, local.tp_size, reg.dst_attn_tp_size)
            .map_err(|e| e.to_string())?;
        let bph = geom
            .bytes_per_head_token(reg.dst_kv_item_len, local.page_size)
            .ok_or("the decode's KV item length leaves no bytes per head")?;
        let layers = u32::try_from(local.num_buffers / 2).map_err(|_| "too many KV buffers")?;
        let layout = StagedLayout::for_decode(&geom, reg.dst_tp_rank, layers, bph, local.page_size);
        let writer = geom.writer_index(local.tp_rank) as usize;
        if layout.writers.get(writer).map(|w| w.prefill_rank) != Some(local.tp_rank % local.tp_size)
        {
            return Err(format!(
                "prefill rank {} does not write to decode rank {}",
                local.tp_rank, reg.dst_tp_rank
            ));
        }
        let slice = geom.slice(local.tp_rank, reg.dst_tp_rank);
        let usize_of = |v: u64| usize::try_from(v).map_err(|_| "size does not fit usize");
        let spec = SliceSpec {
            page_size: usize_of(local.page_size)?,
            bytes_per_head_token: usize_of(bph)?,
            item_len: usize_of(local.item_len)?,
            head: slice.src_head as usize,
            n_heads: slice.n_heads as usize,
        };
        Ok(Target {
            endpoint: reg.endpoint.clone(),
            ring_base,
            ring_size,
            layout,
            writer,
            spec,
        })
    }
}

/// The source pages of one grid chunk as sends deliver them.
#[derive(Debug)]
struct Assembly {
    /// One entry per page of the chunk; `None` until a send delivered it.
    src: Vec<Option<i32>>,
    have: usize,
    batches: Vec<BatchId>,
    /// When the complete chunk was first found not writable.
    parked: Option<Instant>,
}

impl Assembly {
    fn new(pages: u64) -> Self {
        Assembly {
            src: vec![None; usize::try_from(pages).unwrap_or(0)],
            have: 0,
            batches: Vec::new(),
            parked: None,
        }
    }

    fn complete(&self) -> bool {
        self.have == self.src.len()
    }
}

#[derive(Debug)]
struct RoomStage {
    target: Target,
    grid: RoomGrid,
    chunks: BTreeMap<u32, Assembly>,
    /// A posted chunk of the room towards this session failed in transport (why): nothing more
    /// of the room is sent to it, and later sends complete their batches with this error.
    lost: Option<String>,
}

#[derive(Debug)]
struct Pending {
    left: usize,
    error: Option<String>,
}

/// The staging state of one prefill rank.
#[derive(Debug)]
pub struct StagingDriver {
    local: LocalShape,
    grid: ChunkGrid,
    wait_timeout: Duration,
    state: PrefillStaging,
    rooms: BTreeMap<(Room, SessionId), RoomStage>,
    pending: BTreeMap<BatchId, Pending>,
}

impl StagingDriver {
    /// A driver for `local`'s KV with the chunk grid `grid`; parked chunks fail their room after
    /// `wait_timeout`.
    pub fn new(local: LocalShape, grid: ChunkGrid, wait_timeout: Duration) -> Self {
        StagingDriver {
            local,
            grid,
            wait_timeout,
            state: PrefillStaging::new(),
            rooms: BTreeMap::new(),
            pending: BTreeMap::new(),
        }
    }

    /// The room's metadata from `reg`'s session arrived with `total_pages` destination pages:
    /// sends the `STAGING_REQ` of every grid chunk not requested yet.
    pub fn open(
        &mut self,
        room: Room,
        reg: &DecodeRegistration,
        total_pages: usize,
        out: &mut Vec<Effect>,
    ) {
        let key = (room, reg.session.clone());
        if !self.rooms.contains_key(&key) {
            match Target::new(&self.local, reg) {
                Ok(target) => {
                    let grid = RoomGrid::from_pages(self.grid, total_pages as u64);
                    self.rooms.insert(
                        key.clone(),
                        RoomStage {
                            target,
                            grid,
                            chunks: BTreeMap::new(),
                            lost: None,
                        },
                    );
                }
                Err(why) => {
                    out.push(Effect::Fail(room, format!("staging: {why}")));
                    return;
                }
            }
        }
        let Some(rs) = self.rooms.get(&key) else {
            return;
        };
        match self.state.prefetch(room, &reg.session, &rs.grid, Some(0)) {
            Ok(reqs) => {
                metrics::counter!("kvx_staging_requests_total").increment(reqs.len() as u64);
                for r in reqs {
                    out.push(Effect::Send(
                        rs.target.endpoint.clone(),
                        wire::encode_staging_req(&r),
                    ));
                }
            }
            Err(e) => out.push(Effect::Fail(room, format!("staging: {e}"))),
        }
    }

    /// A `Stage` action: the pages `slice` of the room (source pages `src_pages`) go to
    /// `session` through its ring as part of manager batch `batch`.
    #[allow(clippy::too_many_arguments)]
    pub fn stage(
        &mut self,
        now: Instant,
        room: Room,
        session: &SessionId,
        batch: BatchId,
        slice: PageSlice,
        src_pages: &[i32],
        out: &mut Vec<Effect>,
    ) {
        let key = (room, session.clone());
        let Some(rs) = self.rooms.get_mut(&key) else {
            out.push(Effect::Fail(
                room,
                format!("staging: room {room} was not opened towards {session}"),
            ));
            out.push(Effect::Done(batch, Ok(())));
            return;
        };
        if let Some(why) = &rs.lost {
            // An earlier chunk of the room failed towards this session: not sent (the manager
            // hears the failure from this batch too).
            out.push(Effect::Done(batch, Err(why.clone())));
            return;
        }
        let parts = self.grid.split(slice);
        if parts.is_empty() {
            out.push(Effect::Done(batch, Ok(())));
            return;
        }
        self.pending.insert(
            batch,
            Pending {
                left: parts.len(),
                error: None,
            },
        );
        let mut complete = Vec::new();
        let mut bad = Vec::new();
        for (idx, seg) in parts {
            let placed = u32::try_from(idx)
                .ok()
                .and_then(|i| Some((i, rs.grid.chunk_start(idx)?, rs.grid.chunk_pages(idx)?)));
            let Some((i, start, n)) = placed else {
                bad.push(format!(
                    "pages {}..{} lie outside the room's grid",
                    seg.start, seg.end
                ));
                continue;
            };
            let asm = rs.chunks.entry(i).or_insert_with(|| Assembly::new(n));
            let mut ok = true;
            for page in seg.start..seg.end {
                let src = src_pages.get(page - slice.start).copied();
                let at = (page as u64).checked_sub(start).map(|a| a as usize);
                match (src, at.and_then(|a| asm.src.get_mut(a))) {
                    (Some(s), Some(slot)) => {
                        if slot.replace(s).is_none() {
                            asm.have += 1;
                        }
                    }
                    _ => ok = false,
                }
            }
            if !ok {
                bad.push(format!("chunk {i}: source pages missing"));
                continue;
            }
            asm.batches.push(batch);
            if asm.complete() {
                complete.push(i);
            }
        }
        for why in bad {
            out.push(Effect::Fail(room, format!("staging: {why}")));
            self.resolve(batch, Ok(()), out);
        }
        for chunk_idx in complete {
            let key = ChunkKey {
                room,
                chunk_idx,
                session: session.clone(),
            };
            let r = self.state.poll(&key);
            self.act(now, key, r, out);
        }
    }

    /// `STAGING_RSP`: records the placement and posts the chunk it unblocks, if any.
    pub fn on_rsp(
        &mut self,
        now: Instant,
        rsp: &StagingRsp,
        out: &mut Vec<Effect>,
    ) -> Result<(), PrefillError> {
        for w in self.state.on_staging_rsp(rsp)? {
            self.act(now, w.key, w.readiness, out);
        }
        Ok(())
    }

    /// `WATERMARK`: posts every parked chunk of the session it admits.
    pub fn on_watermark(&mut self, now: Instant, msg: &WatermarkMsg, out: &mut Vec<Effect>) {
        for w in self.state.on_watermark(msg) {
            self.act(now, w.key, w.readiness, out);
        }
    }

    fn act(&mut self, now: Instant, key: ChunkKey, r: Readiness, out: &mut Vec<Effect>) {
        match r {
            Readiness::Ready(p) => self.post(key, &p, out),
            Readiness::Wait => {
                if let Some(a) = self.assembly(&key) {
                    a.parked.get_or_insert(now);
                }
            }
            Readiness::Oversized => {
                let why = format!(
                    "staging: chunk {} of room {} does not fit in the ring of decode {}",
                    key.chunk_idx, key.room, key.session
                );
                out.push(Effect::Fail(key.room, why));
                self.drop_chunk(&key, out);
            }
        }
    }

    fn assembly(&mut self, key: &ChunkKey) -> Option<&mut Assembly> {
        self.rooms
            .get_mut(&(key.room, key.session.clone()))?
            .chunks
            .get_mut(&key.chunk_idx)
    }

    /// Drops a chunk of a room that was just failed; its batches complete (nothing in flight).
    fn drop_chunk(&mut self, key: &ChunkKey, out: &mut Vec<Effect>) {
        let asm = self
            .rooms
            .get_mut(&(key.room, key.session.clone()))
            .and_then(|rs| rs.chunks.remove(&key.chunk_idx));
        if let Some(a) = asm {
            for b in a.batches {
                self.resolve(b, Ok(()), out);
            }
        }
    }

    fn post(&mut self, key: ChunkKey, p: &Placement, out: &mut Vec<Effect>) {
        let Some(rs) = self.rooms.get_mut(&(key.room, key.session.clone())) else {
            return;
        };
        if !rs
            .chunks
            .get(&key.chunk_idx)
            .is_some_and(Assembly::complete)
        {
            return;
        }
        let Some(asm) = rs.chunks.remove(&key.chunk_idx) else {
            return;
        };
        let t = &rs.target;
        let n = asm.src.len() as u64;
        let start = rs.grid.chunk_start(u64::from(key.chunk_idx));
        let op = t
            .layout
            .write_op(t.writer, n, p, t.ring_base, t.ring_size, 0);
        let (Some(op), Some(page_start)) = (op, start) else {
            let why = format!(
                "staging: placement {p:?} of chunk {} of room {} does not fit its layout",
                key.chunk_idx, key.room
            );
            out.push(Effect::Fail(key.room, why));
            for b in asm.batches {
                self.resolve(b, Ok(()), out);
            }
            return;
        };
        let work = StageWork {
            page_start,
            src_pages: asm.src.into_iter().flatten().collect(),
            spec: t.spec,
            dst: op.dst,
            len: op.len,
            endpoint: t.endpoint.clone(),
            batches: asm.batches,
            key,
        };
        out.push(Effect::Post(Box::new(work)));
    }

    /// A posted chunk finished (written, or not written because the room or its session
    /// failed): reports the manager batches it completes. A transport failure (`Err`) also
    /// drops, unsent, every chunk not posted yet that shares a batch with it, completing their
    /// batches with the same error: a chunk parked for ring space would otherwise hold its batch,
    /// and with it the manager's news of the failed session, until the wait timeout — while the
    /// decode waits for the lost chunk's `CHUNK_READY` and frees no ring space (found by
    /// kvx-sim). Later sends of those rooms towards that session complete at once with the error.
    pub fn chunk_done(
        &mut self,
        batches: &[BatchId],
        result: Result<(), String>,
        out: &mut Vec<Effect>,
    ) {
        if let Err(why) = &result {
            let mut dropped = Vec::new();
            for rs in self.rooms.values_mut() {
                let hit: Vec<u32> = rs
                    .chunks
                    .iter()
                    .filter(|(_, a)| a.batches.iter().any(|b| batches.contains(b)))
                    .map(|(&i, _)| i)
                    .collect();
                if hit.is_empty() {
                    continue;
                }
                rs.lost.get_or_insert_with(|| why.clone());
                for i in hit {
                    if let Some(a) = rs.chunks.remove(&i) {
                        dropped.extend(a.batches);
                    }
                }
            }
            for b in dropped {
                self.resolve(b, Err(why.clone()), out);
            }
        }
        for &b in batches {
            self.resolve(b, result.clone(), out);
        }
    }

    fn resolve(&mut self, batch: BatchId, result: Result<(), String>, out: &mut Vec<Effect>) {
        let Some(p) = self.pending.get_mut(&batch) else {
            return;
        };
        p.left = p.left.saturating_sub(1);
        if let Err(e) = result {
            p.error.get_or_insert(e);
        }
        if p.left == 0
            && let Some(p) = self.pending.remove(&batch)
        {
            out.push(Effect::Done(batch, p.error.map_or(Ok(()), Err)));
        }
    }

    /// The room concluded: forgets it; batches waiting on chunks never posted complete (the
    /// room is terminal, nothing of them is in flight; chunks already posted complete through
    /// [`StagingDriver::chunk_done`]).
    pub fn conclude(&mut self, room: Room, out: &mut Vec<Effect>) {
        self.state.conclude_room(room);
        let keys: Vec<_> = self.rooms.keys().filter(|k| k.0 == room).cloned().collect();
        for k in keys {
            if let Some(rs) = self.rooms.remove(&k) {
                for a in rs.chunks.into_values() {
                    for b in a.batches {
                        self.resolve(b, Ok(()), out);
                    }
                }
            }
        }
    }

    /// Rooms with staging state, sorted, each once (to check against the manager; see
    /// [`StagingDriver::conclude`]).
    pub fn rooms(&self) -> Vec<Room> {
        let set: BTreeSet<Room> = self.rooms.keys().map(|k| k.0).collect();
        set.into_iter().collect()
    }

    /// Fails every room with a chunk parked for longer than the wait timeout.
    pub fn expire(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let mut late: BTreeMap<Room, SessionId> = BTreeMap::new();
        for ((room, session), rs) in &self.rooms {
            let stuck = rs.chunks.values().any(|a| {
                a.parked
                    .is_some_and(|t| now.saturating_duration_since(t) > self.wait_timeout)
            });
            if stuck {
                late.insert(*room, session.clone());
            }
        }
        for (room, session) in late {
            metrics::counter!("kvx_staging_wait_timeouts_total").increment(1);
            out.push(Effect::Fail(
                room,
                format!(
                    "staging: decode {session} granted no ring space within {:?}",
                    self.wait_timeout
                ),
            ));
        }
    }

    /// Since when the room's longest-parked chunk (complete, waiting for a placement or a
    /// watermark, towards any of its decode sessions) has waited; `None` when none is parked.
    /// What [`StagingDriver::expire`] measures against the wait timeout, for an observer (kvx-sim
    /// asks it when a decode times out on the room).
    pub fn parked_since(&self, room: Room) -> Option<Instant> {
        self.rooms
            .iter()
            .filter(|((r, _), _)| *r == room)
            .flat_map(|(_, rs)| rs.chunks.values().filter_map(|a| a.parked))
            .min()
    }

    /// Decode sessions that rooms with staging state wait on (sorted, each once).
    pub fn sessions(&self) -> Vec<SessionId> {
        let set: BTreeSet<&SessionId> = self.rooms.keys().map(|(_, s)| s).collect();
        set.into_iter().cloned().collect()
    }

    /// Rooms (per decode session) with staging state.
    pub fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// Complete chunks waiting for a placement or a watermark.
    pub fn parked_count(&self) -> usize {
        self.state.waiting_count()
    }

    /// True when nothing is held: no room, no batch, no key.
    pub fn is_idle(&self) -> bool {
        self.rooms.is_empty() && self.pending.is_empty() && self.state.is_idle()
    }
}

#[cfg(test)]
mod tests;
