//! The prefill's staging driver as plain state, around kvx-staging's real [`PrefillStaging`]:
//! kvx-engine's `StagingDriver` rules (`prefill_staging.rs`) without I/O. Rooms are opened towards a
//! decode session (every grid chunk requested at once), `Stage` actions are cut at grid
//! boundaries and collected per grid chunk, a complete chunk is polled (written, parked until
//! `STAGING_RSP` or `WATERMARK` wakes it, or failed as oversized), and a manager batch is done
//! once every grid chunk it fed is written or dropped. The world performs the [`Effect`]s
//! (`world/stage_prefill.rs`).

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::prefill::BatchId;
use kvx_core::{DecodeRegistration, PageSlice, Room, SessionId, TransferOp};
use kvx_staging::{
    ChunkGrid, ChunkKey, Placement, PrefillStaging, Readiness, RoomGrid, SliceSpec, StagedLayout,
    TpGeometry,
};

use crate::clock::Nanos;
use crate::memory::{KV_BUFFERS, PAGE_SIZE, TOTAL_HEADS, item_len};
use crate::net::Msg;

/// A chunk parked this long waited behind a fault (a slow write or message, or a slot fenced
/// for a dead rank, holding the watermark back); in a fault-free seed none waits nearly as long.
const LONG_WAIT: Nanos = 500 * crate::clock::MS;

/// Where one decode session receives a room's staged chunks.
#[derive(Clone, Debug)]
pub(super) struct Target {
    d: u32,
    ring_base: u64,
    ring_size: u64,
    layout: StagedLayout,
    writer: usize,
    spec: SliceSpec,
}

impl Target {
    /// kvx-engine's checks: a complete ring, a usable geometry, and this rank among the writers.
    pub(super) fn new(
        p: u32,
        prefill_tp: u32,
        d: u32,
        reg: &DecodeRegistration,
    ) -> Result<Target, String> {
        let (Some(ring_base), Some(ring_size)) = (reg.staging.base, reg.staging.size) else {
            return Err(format!("decode session {} advertised no ring", reg.session));
        };
        let geom = TpGeometry::new(TOTAL_HEADS, prefill_tp, reg.dst_attn_tp_size)
            .map_err(|e| e.to_string())?;
        let page = u64::from(PAGE_SIZE);
        let bph = geom
            .bytes_per_head_token(reg.dst_kv_item_len, page)
            .ok_or("the decode's KV item length leaves no bytes per head")?;
        let layers = (KV_BUFFERS / 2) as u32;
        let layout = StagedLayout::for_decode(&geom, reg.dst_tp_rank, layers, bph, page);
        let writer = geom.writer_index(p) as usize;
        if layout.writers.get(writer).map(|w| w.prefill_rank) != Some(p) {
            return Err(format!(
                "prefill rank {p} does not write to decode rank {d}"
            ));
        }
        let slice = geom.slice(p, reg.dst_tp_rank);
        let spec = SliceSpec {
            page_size: PAGE_SIZE as usize,
            bytes_per_head_token: bph as usize,
            item_len: item_len(prefill_tp) as usize,
            head: slice.src_head as usize,
            n_heads: slice.n_heads as usize,
        };
        Ok(Target {
            d,
            ring_base,
            ring_size,
            layout,
            writer,
            spec,
        })
    }
}

/// The source pages of one grid chunk as `Stage` actions deliver them.
#[derive(Debug)]
struct Assembly {
    src: Vec<Option<i32>>,
    have: usize,
    batches: Vec<BatchId>,
    parked: Option<Nanos>,
}

#[derive(Debug)]
struct RoomStage {
    target: Target,
    grid: RoomGrid,
    chunks: BTreeMap<u32, Assembly>,
}

#[derive(Debug)]
struct Pending {
    left: usize,
    error: Option<String>,
}

/// A chunk write posted to the data plane.
#[derive(Clone, Debug)]
pub struct Work {
    /// The chunk.
    pub key: ChunkKey,
    /// The decode rank.
    pub d: u32,
    /// First suffix page of the chunk.
    pub page_start: u64,
    /// Pages of the chunk.
    pub pages: u64,
    /// The manager batches it completes a part of.
    pub batches: Vec<BatchId>,
}

/// A chunk to gather and post.
#[derive(Clone, Debug)]
pub struct PostWork {
    pub(super) work: Work,
    pub(super) src_pages: Vec<i32>,
    pub(super) spec: SliceSpec,
    pub(super) op: TransferOp,
}

/// What the world performs for the stager, in order.
#[derive(Debug)]
pub enum Effect {
    /// A message to decode rank `d`.
    Send(u32, Msg),
    /// Gather and write a chunk.
    Post(Box<PostWork>),
    /// A manager batch is complete.
    Done(BatchId, Result<(), String>),
    /// Fail the room (`SenderFailed`).
    Fail(Room, String),
    /// A chunk of the room waited long for ring space: its decode may time out before the
    /// room completes or its wait times out. In a seed with faults that is explained (slow
    /// writes and messages, or slots fenced for a dead rank, hold the watermark back); in a
    /// fault-free seed nothing may wait that long.
    Waited(Room),
}

/// The staging state of one prefill rank.
#[derive(Debug)]
pub struct PrefillStager {
    grid: ChunkGrid,
    wait_timeout: Nanos,
    pub(super) state: PrefillStaging,
    rooms: BTreeMap<(Room, SessionId), RoomStage>,
    pending: BTreeMap<BatchId, Pending>,
    pub(super) works: BTreeMap<u64, Work>,
    pub(super) next_work: u64,
    pub(super) probed: BTreeMap<SessionId, Nanos>,
    /// When the next housekeeping runs, if one is scheduled.
    pub housekeeping_at: Option<Nanos>,
    /// The `ignore-watermark` mutant: a complete chunk is written as soon as its placement is
    /// known, whatever the decode's watermark says.
    pub(super) ignore_watermark: bool,
    /// Placements seen, for the `ignore-watermark` mutant only.
    pub(super) seen: BTreeMap<ChunkKey, Placement>,
}

impl PrefillStager {
    /// An idle stager cutting rooms on `grid`.
    pub fn new(grid: ChunkGrid, wait_timeout: Nanos, ignore_watermark: bool) -> Self {
        PrefillStager {
            ignore_watermark,
            seen: BTreeMap::new(),
            grid,
            wait_timeout,
            state: PrefillStaging::new(),
            rooms: BTreeMap::new(),
            pending: BTreeMap::new(),
            works: BTreeMap::new(),
            next_work: 0,
            probed: BTreeMap::new(),
            housekeeping_at: None,
        }
    }

    /// Staged rooms held (per decode session).
    pub fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// Rooms with staging state (each once).
    pub(super) fn room_ids(&self) -> BTreeSet<Room> {
        self.rooms.keys().map(|k| k.0).collect()
    }

    /// True when nothing is held: no room, batch, write or key.
    pub fn is_idle(&self) -> bool {
        self.rooms.is_empty()
            && self.pending.is_empty()
            && self.works.is_empty()
            && self.state.is_idle()
    }

    /// What is held, for a leak report.
    pub fn held(&self) -> String {
        format!(
            "{} rooms, {} batches, {} writes, {} parked, idle state: {}",
            self.rooms.len(),
            self.pending.len(),
            self.works.len(),
            self.state.waiting_count(),
            self.state.is_idle()
        )
    }

    pub(super) fn open(
        &mut self,
        room: Room,
        target: Result<Target, String>,
        reg: &DecodeRegistration,
        total_pages: usize,
        out: &mut Vec<Effect>,
    ) {
        let key = (room, reg.session.clone());
        if !self.rooms.contains_key(&key) {
            match target {
                Ok(target) => {
                    let grid = RoomGrid::from_pages(self.grid, total_pages as u64);
                    let chunks = BTreeMap::new();
                    let rs = RoomStage {
                        target,
                        grid,
                        chunks,
                    };
                    self.rooms.insert(key.clone(), rs);
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
                for r in reqs {
                    out.push(Effect::Send(rs.target.d, Msg::StagingReq(r)));
                }
            }
            Err(e) => out.push(Effect::Fail(room, format!("staging: {e}"))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage(
        &mut self,
        now: Nanos,
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
                format!("staging: room {room} not opened"),
            ));
            out.push(Effect::Done(batch, Ok(())));
            return;
        };
        let parts = self.grid.split(slice);
        if parts.is_empty() {
            out.push(Effect::Done(batch, Ok(())));
            return;
        }
        let left = parts.len();
        self.pending.insert(batch, Pending { left, error: None });
        let mut complete = Vec::new();
        let mut bad = Vec::new();
        for (idx, seg) in parts {
            let placed = u32::try_from(idx)
                .ok()
                .and_then(|i| Some((i, rs.grid.chunk_start(idx)?, rs.grid.chunk_pages(idx)?)));
            let Some((i, start, n)) = placed else {
                bad.push(format!("pages {}..{} outside the grid", seg.start, seg.end));
                continue;
            };
            let asm = rs.chunks.entry(i).or_insert_with(|| Assembly {
                src: vec![None; n as usize],
                have: 0,
                batches: Vec::new(),
                parked: None,
            });
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
            if asm.have == asm.src.len() {
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

    pub(super) fn act(&mut self, now: Nanos, key: ChunkKey, r: Readiness, out: &mut Vec<Effect>) {
        match r {
            Readiness::Ready(p) => {
                let rs = self.rooms.get(&(key.room, key.session.clone()));
                let parked = rs
                    .and_then(|rs| rs.chunks.get(&key.chunk_idx))
                    .and_then(|a| a.parked);
                if parked.is_some_and(|t| now - t >= LONG_WAIT) {
                    out.push(Effect::Waited(key.room));
                }
                self.post(key, &p, out);
            }
            Readiness::Wait if self.ignore_watermark => {
                if let Some(p) = self.seen.get(&key).copied() {
                    self.post(key, &p, out);
                }
            }
            Readiness::Wait => {
                let rs = self.rooms.get_mut(&(key.room, key.session.clone()));
                if let Some(a) = rs.and_then(|rs| rs.chunks.get_mut(&key.chunk_idx)) {
                    a.parked.get_or_insert(now);
                }
            }
            Readiness::Oversized => {
                let why = format!(
                    "staging: chunk {} of room {} does not fit the ring of {}",
                    key.chunk_idx, key.room, key.session
                );
                out.push(Effect::Fail(key.room, why));
                let asm = self
                    .rooms
                    .get_mut(&(key.room, key.session.clone()))
                    .and_then(|rs| rs.chunks.remove(&key.chunk_idx));
                for b in asm.map(|a| a.batches).unwrap_or_default() {
                    self.resolve(b, Ok(()), out);
                }
            }
        }
    }

    pub(super) fn post(&mut self, key: ChunkKey, p: &Placement, out: &mut Vec<Effect>) {
        let Some(rs) = self.rooms.get_mut(&(key.room, key.session.clone())) else {
            return;
        };
        let complete = rs
            .chunks
            .get(&key.chunk_idx)
            .is_some_and(|a| a.have == a.src.len());
        if !complete {
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
                "staging: placement {p:?} of chunk {} does not fit its layout",
                key.chunk_idx
            );
            out.push(Effect::Fail(key.room, why));
            for b in asm.batches {
                self.resolve(b, Ok(()), out);
            }
            return;
        };
        let work = Work {
            d: t.d,
            page_start,
            pages: n,
            batches: asm.batches,
            key,
        };
        out.push(Effect::Post(Box::new(PostWork {
            work,
            src_pages: asm.src.into_iter().flatten().collect(),
            spec: t.spec,
            op,
        })));
    }

    pub(super) fn chunk_done(
        &mut self,
        batches: &[BatchId],
        r: Result<(), String>,
        out: &mut Vec<Effect>,
    ) {
        for &b in batches {
            self.resolve(b, r.clone(), out);
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

    /// The room concluded: forget it; batches waiting on chunks never posted complete.
    pub(super) fn conclude(&mut self, room: Room, out: &mut Vec<Effect>) {
        self.state.conclude_room(room);
        self.seen.retain(|k, _| k.room != room);
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

    /// Fails every room with a chunk parked longer than the wait timeout.
    pub(super) fn expire(&mut self, now: Nanos, out: &mut Vec<Effect>) {
        let mut late = BTreeSet::new();
        for ((room, _), rs) in &self.rooms {
            let stuck = rs
                .chunks
                .values()
                .any(|a| a.parked.is_some_and(|t| now - t > self.wait_timeout));
            if stuck {
                late.insert(*room);
            }
        }
        for room in late {
            out.push(Effect::Waited(room));
            out.push(Effect::Fail(room, "staging: no ring space in time".into()));
        }
    }

    pub(super) fn sessions(&self) -> BTreeSet<SessionId> {
        self.rooms.keys().map(|(_, s)| s.clone()).collect()
    }
}
