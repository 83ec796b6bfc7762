//! The decode peer's staging side: its ring, `kvx-staging`'s [`DecodeStaging`] state machine,
//! and the scatter from the ring into the room's KV pages.
//!
//! The ring is a registered [`Region`] advertised in the registration (frames 14/15). A room on
//! the staging path is registered here before its metadata goes out; `STAGING_REQ`s are answered
//! with placements (`STAGING_RSP` to every prefill rank of the room, plus the current watermark
//! once); when every writer of a chunk sent `CHUNK_READY` its block is scattered into the room's
//! pages at once, on the caller's thread, before the next message of the inbox is read — so a
//! prefill rank's status, sent after its `CHUNK_READY`s on the same socket, always finds its
//! chunks in place. Each scatter frees its ring region and the new watermark goes to every
//! subscribed prefill rank. A failed room's regions a prefill may still be writing stay fenced
//! until the caller releases them after its grace period.
//!
//! When the data plane's own receive threads move the bytes (`tcp`), the copy out of the ring
//! is skipped: each writer's block is placed ([`kvx_rdma::place`]) when its chunk gets its ring
//! region, with a [`ScatterMap`] of where its bytes belong, so the receiver reads it straight
//! into the room's pages. At `CHUNK_READY` the placement ends and says how many bytes it took: a
//! whole block needs no scatter, a block that took none (written by RDMA, shared memory, or a
//! Mooncake TE peer) is scattered from the ring as before, and a block that took part of its
//! bytes fails the room (some of its bytes are in the ring, some in the pages).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvx_core::{Endpoint, Room, SessionId, StagingRingInfo};
use kvx_rdma::{Placement, Transport};
use kvx_staging::{
    ChunkGrid, ChunkReady, CopyError, DecodeAction, DecodeError, DecodeRoom, DecodeStaging,
    RoomGrid, RspPlacement, ScatterJob, ScatterMap, SliceSpec, StagedLayout, StagingReq,
    TpGeometry, Writer,
};

use crate::model::KvLayout;
use crate::region::{AccessError, Region};
use crate::wire::{self, Frames};

/// A message to send to a prefill rank's inbox.
pub type Outgoing = (Endpoint, Frames);

/// Why a staging message was refused (logged, counted and dropped by the decode).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagingError {
    /// The state machine refused it (unknown room, wrong session, chunk off the grid, …).
    #[error(transparent)]
    State(#[from] DecodeError),
    /// The scatter's geometry did not fit the pages.
    #[error("scatter: {0}")]
    Copy(#[from] CopyError),
    /// A ring or page range outside its region (or in device memory, which the CPU scatter
    /// cannot touch: the engines refuse staging with device KV at start).
    #[error("scatter: {0}")]
    Bounds(#[from] AccessError),
    /// The room's geometry is unusable.
    #[error("staging geometry: {0}")]
    Geometry(String),
    /// A writer's block came partly through its placement and partly around it (into the
    /// ring): neither the pages nor the ring hold all of it.
    #[error("writer {writer}'s block of {len} bytes took {placed} of them in place")]
    PartlyPlaced {
        /// The writer (its index in the chunk's layout).
        writer: usize,
        /// Bytes received in place.
        placed: u64,
        /// The block's length.
        len: u64,
    },
}

impl StagingError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StagingError::State(e) => e.kind(),
            StagingError::Copy(_) => "scatter_geometry",
            StagingError::Bounds(_) => "scatter_bounds",
            StagingError::Geometry(_) => "geometry",
            StagingError::PartlyPlaced { .. } => "partly_placed",
        }
    }
}

/// Most threads one chunk's scatter uses.
pub const SCATTER_THREADS: usize = 4;
/// Chunks at least this large (all writers' blocks) are scattered on several threads (kvx-cli's
/// `demo_runs_heterogeneous_tp_through_staging` sends chunks of exactly this size).
const PARALLEL_SCATTER_BYTES: usize = 8 << 20;

struct Inner {
    state: DecodeStaging<Endpoint>,
    /// Per staged room: its destination pages and chunk layout.
    rooms: HashMap<Room, (Vec<i32>, StagedLayout)>,
    /// Per placed chunk: each writer's block's ring address, where it is placed.
    placed: HashMap<(Room, u32), Vec<Option<u64>>>,
    /// Chunks whose ring region overlaps an older live one (the ring overcommits): placed once
    /// that one is freed, before the watermark that lets a prefill write them goes out — until
    /// then the range may still receive the older chunk's bytes.
    waiting: HashMap<(Room, u32), kvx_staging::Placement>,
}

/// One writer's block, received straight into the room's pages.
struct BlockPlacement(ScatterMap);

impl Placement for BlockPlacement {
    fn len(&self) -> u64 {
        self.0.len()
    }

    fn bounds(&self) -> (u64, u64) {
        self.0.bounds()
    }

    fn pieces(&self, off: u64, len: u64, f: &mut dyn FnMut(u64, u64)) -> u64 {
        self.0.pieces(off, len, f)
    }
}

/// The decode's staging ring and staged rooms.
pub struct DecodeStager {
    inner: Mutex<Inner>,
    ring: Arc<Region>,
    kv: Arc<Region>,
    layout: KvLayout,
    grid: ChunkGrid,
    /// The data plane that places blocks (`None`: every block is scattered from the ring).
    plane: Option<Arc<dyn Transport>>,
    scattered: AtomicU64,
    placed_bytes: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl DecodeStager {
    /// A stager for session `session` scattering into `kv` (laid out as `layout`) from `ring`
    /// (registered by the caller), on the grid of `chunked_prefill_size` tokens.
    pub fn new(
        session: SessionId,
        ring: Arc<Region>,
        kv: Arc<Region>,
        layout: KvLayout,
        chunked_prefill_size: i64,
    ) -> Result<Self, StagingError> {
        let grid = ChunkGrid::new(Some(chunked_prefill_size), layout.page_size)
            .ok_or_else(|| StagingError::Geometry("page size 0".into()))?;
        Ok(DecodeStager {
            inner: Mutex::new(Inner {
                state: DecodeStaging::new(session, ring.len()),
                rooms: HashMap::new(),
                placed: HashMap::new(),
                waiting: HashMap::new(),
            }),
            ring,
            kv,
            layout,
            grid,
            plane: None,
            scattered: AtomicU64::new(0),
            placed_bytes: AtomicU64::new(0),
        })
    }

    /// With `Some(plane)` (the data plane `ring` and the KV pool are registered with), places
    /// each writer's block on it when its chunk gets a ring region, so that a backend whose own
    /// threads receive (`tcp`) reads it straight into the pages; other backends' blocks (and all,
    /// with `None`) are scattered from the ring.
    pub fn with_placement(mut self, plane: Option<Arc<dyn Transport>>) -> Self {
        self.plane = plane;
        self
    }

    /// What the registration advertises (frames 14/15).
    pub fn ring_info(&self) -> StagingRingInfo {
        StagingRingInfo {
            base: Some(self.ring.base()),
            size: Some(self.ring.len()),
        }
    }

    /// Registers a room before its metadata goes out: `peers` are the prefill ranks that write
    /// its KV (non-dummy targets), `pages` its destination pages, `geom` the two TP sizes and
    /// `decode_rank` this rank.
    pub fn register_room(
        &self,
        room: Room,
        peers: Vec<Endpoint>,
        pages: &[i32],
        geom: &TpGeometry,
        decode_rank: u32,
    ) -> Result<(), StagingError> {
        let layers = u32::try_from(self.layout.num_buffers / 2)
            .map_err(|_| StagingError::Geometry("too many KV buffers".into()))?;
        let layout = StagedLayout::for_decode(
            geom,
            decode_rank,
            layers,
            self.layout.head_bytes,
            self.layout.page_size,
        );
        let grid = RoomGrid::from_pages(self.grid, pages.len() as u64);
        let mut inner = lock(&self.inner);
        inner.state.register_room(
            room,
            DecodeRoom {
                peers,
                grid,
                layout: layout.clone(),
            },
        )?;
        inner.rooms.insert(room, (pages.to_vec(), layout));
        Ok(())
    }

    /// `STAGING_REQ`: the placement (and, on the room's first request, the watermark) to send.
    /// A chunk's blocks are placed on the data plane before the first message that lets a
    /// prefill write them goes out (this placement, or a later watermark).
    pub fn on_staging_req(&self, req: &StagingReq) -> Result<Vec<Outgoing>, StagingError> {
        let mut inner = lock(&self.inner);
        let actions = inner.state.on_staging_req(req)?;
        metrics::counter!("kvx_decode_staging_requests_total").increment(1);
        if self.plane.is_some() {
            for a in &actions {
                if let DecodeAction::Respond { rsp, .. } = a
                    && let RspPlacement::At(p) = rsp.placement
                {
                    let key = (rsp.room, rsp.chunk_idx);
                    if !inner.placed.contains_key(&key) {
                        inner.waiting.insert(key, p);
                    }
                }
            }
            self.place_waiting(&mut inner);
        }
        Ok(outgoing(actions))
    }

    /// Places every waiting chunk whose ring region no longer overlaps an older live one.
    fn place_waiting(&self, inner: &mut Inner) {
        let ring = inner.state.ring();
        let free: Vec<((Room, u32), u64)> = inner
            .waiting
            .iter()
            // Allocations come in (round, offset) order. A newer region over this one is
            // written only once this one is freed (the watermark), an older one may still be.
            .filter(|&(_, p)| {
                ring.live()
                    .all(|(_, q)| (q.round, q.offset) >= (p.round, p.offset) || !q.overlaps(p))
            })
            .map(|(&key, p)| (key, p.offset))
            .collect();
        for (key, offset) in free {
            inner.waiting.remove(&key);
            let placed = self.place_chunk(inner, key.0, key.1, offset);
            inner.placed.insert(key, placed);
        }
    }

    /// Places every writer's block of a chunk whose ring region starts at `offset`; returns
    /// each block's ring address where it is placed.
    fn place_chunk(
        &self,
        inner: &Inner,
        room: Room,
        chunk_idx: u32,
        offset: u64,
    ) -> Vec<Option<u64>> {
        let Some(plane) = &self.plane else {
            return Vec::new();
        };
        let Some((pages, layout)) = inner.rooms.get(&room) else {
            return Vec::new();
        };
        let l = &self.layout;
        let grid = RoomGrid::from_pages(self.grid, pages.len() as u64);
        let idx = u64::from(chunk_idx);
        let (Some(start), Some(n)) = (grid.chunk_start(idx), grid.chunk_pages(idx)) else {
            return Vec::new();
        };
        let chunk_pages = usize::try_from(start)
            .ok()
            .zip(usize::try_from(n).ok())
            .and_then(|(s, n)| pages.get(s..s.checked_add(n)?));
        let (Some(chunk_pages), Ok(buffer_len)) = (
            chunk_pages,
            usize::try_from(l.pool_pages.saturating_mul(l.item_len)),
        ) else {
            return Vec::new();
        };
        let buffers: Vec<(u64, usize)> = (0..l.num_buffers)
            .map(|b| (l.buffer_addr(self.kv.base(), b), buffer_len))
            .collect();
        let mut placed = Vec::with_capacity(layout.writers.len());
        for (w, wr) in layout.writers.iter().enumerate() {
            let at = self
                .ring
                .base()
                .checked_add(offset)
                .and_then(|a| a.checked_add(layout.writer_offset(w, n)));
            let map = (|| {
                let spec = self.writer_spec(wr).ok()?;
                ScatterMap::new(&spec, &buffers, chunk_pages)
                    .ok()
                    .filter(|m| !m.is_empty() && m.len() == layout.writer_bytes(w, n))
            })();
            let r = match (at, map) {
                (Some(at), Some(map)) => plane
                    .place(at, Arc::new(BlockPlacement(map)))
                    .map(|ok| ok.then_some(at)),
                _ => Ok(None),
            };
            placed.push(r.unwrap_or_else(|e| {
                let why = "block not placed; it is scattered from the ring";
                tracing::debug!(%room, chunk_idx, writer = w, error = %e, "{why}");
                None
            }));
        }
        placed
    }

    /// How writer `wr`'s heads are cut out of this decode's pages (the scatter's and the
    /// placement's geometry).
    fn writer_spec(&self, wr: &Writer) -> Result<SliceSpec, StagingError> {
        let l = &self.layout;
        let usize_of = |v: u64| {
            usize::try_from(v).map_err(|_| StagingError::Geometry("size overflows".into()))
        };
        Ok(SliceSpec {
            page_size: usize_of(l.page_size)?,
            bytes_per_head_token: usize_of(l.head_bytes)?,
            item_len: usize_of(l.item_len)?,
            head: wr.dst_head as usize,
            n_heads: wr.heads as usize,
        })
    }

    /// Ends a chunk's placements; returns the bytes each writer's block took in place.
    fn unplace_chunk(&self, inner: &mut Inner, room: Room, chunk_idx: u32) -> Vec<u64> {
        inner.waiting.remove(&(room, chunk_idx));
        let placed = inner.placed.remove(&(room, chunk_idx)).unwrap_or_default();
        let Some(plane) = &self.plane else {
            return Vec::new();
        };
        placed
            .into_iter()
            .map(|at| at.and_then(|a| plane.unplace(a)).unwrap_or(0))
            .collect()
    }

    /// `CHUNK_READY`: once every writer of the chunk reported, scatters it (on this thread) and
    /// returns the watermark broadcast that frees its region.
    pub fn on_chunk_ready(&self, msg: &ChunkReady) -> Result<Vec<Outgoing>, StagingError> {
        let mut inner = lock(&self.inner);
        let mut out = Vec::new();
        for a in inner.state.on_chunk_ready(msg)? {
            let DecodeAction::Scatter(job) = a else {
                out.push(a);
                continue;
            };
            // Every writer reported: nothing more arrives through the placements.
            let placed = self.unplace_chunk(&mut inner, job.room, job.chunk_idx);
            // The state machine keeps the region live until `on_scatter_done`: a failed scatter
            // still frees it (the room fails by its bytes, not by a stuck ring).
            let scattered = match inner.rooms.get(&job.room) {
                Some((pages, layout)) => self.scatter(&job, pages, layout, &placed),
                None => Err(DecodeError::UnknownRoom(job.room).into()),
            };
            out.extend(inner.state.on_scatter_done(job.room, job.chunk_idx)?);
            // The freed region may clear a waiting chunk, before the watermark goes out.
            self.place_waiting(&mut inner);
            scattered?;
            self.scattered.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("kvx_decode_staged_chunks_total").increment(1);
        }
        Ok(outgoing(out))
    }

    /// Copies every writer's block of a chunk that did not arrive in place (`placed[w]`: the
    /// bytes writer `w`'s block took in place) from the ring into the room's pages, one page of
    /// one buffer at a time (only the room's own pages are borrowed). A large chunk is split by
    /// KV buffer over up to [`SCATTER_THREADS`] threads (distinct buffers are distinct memory):
    /// the last chunk's scatter is on the room's critical path.
    fn scatter(
        &self,
        job: &ScatterJob,
        pages: &[i32],
        layout: &StagedLayout,
        placed: &[u64],
    ) -> Result<(), StagingError> {
        let l = &self.layout;
        let start = usize::try_from(job.page_start).unwrap_or(usize::MAX);
        let n = usize::try_from(job.num_pages).unwrap_or(usize::MAX);
        let chunk_pages = start
            .checked_add(n)
            .and_then(|end| pages.get(start..end))
            .ok_or_else(|| StagingError::Geometry("chunk pages beyond the room".into()))?;
        let chunk_pages = chunk_pages
            .iter()
            .map(|&p| {
                u64::try_from(p).map_err(|_| StagingError::Geometry(format!("negative page {p}")))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        // Every writer's slice and block, checked before any byte moves.
        let mut writers = Vec::with_capacity(layout.writers.len());
        for (w, wr) in layout.writers.iter().enumerate() {
            let spec = self.writer_spec(wr)?;
            let off = job
                .placement
                .offset
                .checked_add(layout.writer_offset(w, job.num_pages))
                .ok_or_else(|| StagingError::Geometry("ring offset overflows".into()))?;
            let len = layout.writer_bytes(w, job.num_pages);
            match placed.get(w).copied().unwrap_or(0) {
                0 => {}
                p if p == len => {
                    self.placed_bytes.fetch_add(p, Ordering::Relaxed);
                    metrics::counter!("kvx_decode_staged_blocks_total", "path" => "placed")
                        .increment(1);
                    continue;
                }
                p => {
                    return Err(StagingError::PartlyPlaced {
                        writer: w,
                        placed: p,
                        len,
                    });
                }
            }
            metrics::counter!("kvx_decode_staged_blocks_total", "path" => "ring").increment(1);
            // Read in place: a copy of the block would cost a payload-sized allocation (and its
            // page faults) per chunk and writer.
            // SAFETY: every prefill writer of this chunk reported CHUNK_READY, so its data-plane
            // write into this ring region is complete, and the state machine hands the region
            // out again only after `on_scatter_done` (after `scatter` returned and this view is
            // gone).
            let block = unsafe { self.ring.view(self.ring.base().saturating_add(off), len) }?;
            if spec.block_len(l.num_buffers, n) != block.len() {
                return Err(StagingError::Geometry(format!(
                    "writer block of {} bytes for {n} pages of {} buffers",
                    block.len(),
                    l.num_buffers
                )));
            }
            writers.push((spec, block));
        }
        if writers.is_empty() {
            // Every block arrived in place.
            return Ok(());
        }
        let scatter_buffers = |buffers: std::ops::Range<usize>| -> Result<(), StagingError> {
            for b in buffers {
                let base = l.buffer_addr(self.kv.base(), b);
                for (spec, block) in &writers {
                    let page_bytes = spec.block_len(1, 1);
                    for (i, &page) in chunk_pages.iter().enumerate() {
                        let addr = base.saturating_add(page.saturating_mul(l.item_len));
                        let at = (b * n + i) * page_bytes;
                        let src = &block[at..at + page_bytes];
                        // SAFETY: the room's pages are written here only: every prefill writer
                        // of this chunk reported CHUNK_READY (its data-plane write into the ring
                        // is done), no prefill writes KV pages of a staged room directly, and
                        // each scatter thread owns distinct buffers.
                        unsafe {
                            self.kv.with_mut(addr, l.item_len, |dst| {
                                kvx_staging::scatter(spec, src, &mut [dst], &[0])
                            })
                        }??;
                    }
                }
            }
            Ok(())
        };
        let bytes: usize = writers.iter().map(|(_, b)| b.len()).sum();
        let threads = if bytes >= PARALLEL_SCATTER_BYTES {
            std::thread::available_parallelism()
                .map_or(1, |p| p.get())
                .clamp(1, SCATTER_THREADS)
                .min(l.num_buffers.max(1))
        } else {
            1
        };
        if threads <= 1 {
            return scatter_buffers(0..l.num_buffers);
        }
        let per = l.num_buffers.div_ceil(threads);
        let range = |t: usize| (t * per).min(l.num_buffers)..((t + 1) * per).min(l.num_buffers);
        let (scatter_buffers, range) = (&scatter_buffers, &range);
        std::thread::scope(|scope| {
            let mut r = Ok(());
            let mut parts = Vec::new();
            for t in 1..threads {
                let spawned = std::thread::Builder::new()
                    .name("kvx-scatter".into())
                    .spawn_scoped(scope, move || scatter_buffers(range(t)));
                match spawned {
                    Ok(h) => parts.push(h),
                    // No thread to be had: this one does that share too.
                    Err(_) => r = r.and(scatter_buffers(range(t))),
                }
            }
            r = r.and(scatter_buffers(range(0)));
            for p in parts {
                let done = p.join().unwrap_or_else(|_| {
                    Err(StagingError::Geometry("scatter thread panicked".into()))
                });
                r = r.and(done);
            }
            r
        })
    }

    /// The room concluded: on success its regions are freed; on failure those a prefill may
    /// still be writing stay fenced until [`DecodeStager::release_fenced`]. Returns the
    /// watermark broadcast, and on success whether every chunk was scattered.
    pub fn finish_room(&self, room: Room, success: bool) -> (Vec<Outgoing>, bool) {
        let mut inner = lock(&self.inner);
        let drained = inner.state.room_drained(room) && !inner.state.room_oversized(room);
        inner.rooms.remove(&room);
        // Writes still arriving for the room's chunks land in their (fenced) ring regions.
        let chunks: Vec<u32> = (inner.placed.keys())
            .chain(inner.waiting.keys())
            .filter(|(r, _)| *r == room)
            .map(|&(_, c)| c)
            .collect();
        for c in chunks {
            self.unplace_chunk(&mut inner, room, c);
        }
        let actions = if success {
            inner.state.release_room(room)
        } else {
            inner.state.abort_room(room)
        };
        self.place_waiting(&mut inner);
        (outgoing(actions), drained)
    }

    /// Frees a failed room's fenced regions (its grace period is over).
    pub fn release_fenced(&self, room: Room) -> Vec<Outgoing> {
        let mut inner = lock(&self.inner);
        let actions = inner.state.release_fenced(room);
        self.place_waiting(&mut inner);
        outgoing(actions)
    }

    /// Chunks landed in rooms' pages so far (scattered from the ring or received in place).
    pub fn scattered(&self) -> u64 {
        self.scattered.load(Ordering::Relaxed)
    }

    /// Bytes of writers' blocks received straight into rooms' pages (no copy out of the ring).
    pub fn placed_bytes(&self) -> u64 {
        self.placed_bytes.load(Ordering::Relaxed)
    }

    /// Staged rooms, live ring allocations and fenced rooms.
    pub fn counts(&self) -> (usize, usize, usize) {
        let inner = lock(&self.inner);
        (
            inner.state.room_count(),
            inner.state.live_allocations(),
            inner.state.fenced_count(),
        )
    }
}

/// The messages behind the state machine's send actions.
fn outgoing(actions: Vec<DecodeAction<Endpoint>>) -> Vec<Outgoing> {
    let mut out = Vec::new();
    for a in actions {
        match a {
            DecodeAction::Respond { to, rsp, .. } => {
                let frames = wire::encode_staging_rsp(&rsp);
                out.extend(to.into_iter().map(|ep| (ep, frames.clone())));
            }
            DecodeAction::Watermark { to, msg } => {
                let frames = wire::encode_watermark(&msg);
                out.extend(to.into_iter().map(|ep| (ep, frames.clone())));
            }
            DecodeAction::Scatter(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests;
