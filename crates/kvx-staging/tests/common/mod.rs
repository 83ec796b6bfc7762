//! A heterogeneous-TP cluster on host memory: prefill ranks with KV pages, decode ranks with KV
//! pages and a staging ring, the staging state machines of every rank, and message queues
//! between them. The baseline fills a copy of the decode pages with kvx-core's per-token
//! head-slice plan; the staged run goes through STAGING_REQ/RSP, watermarks, gather, one write
//! per writer and chunk (through a pluggable [`Link`]), CHUNK_READY and scatter.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::VecDeque;

use kvx_core::layout::{Buffer, KvLayout};
use kvx_core::planner::{HeadSliceParams, plan_kv_head_slice};
use kvx_core::{Room, SessionId, TransferOp};
use kvx_staging::{
    ChunkGrid, ChunkKey, ChunkReady, DecodeAction, DecodeRoom, DecodeStaging, HostMemory,
    PrefillStaging, Readiness, RoomGrid, SliceSpec, StagedLayout, StagingReq, StagingRsp,
    TpGeometry, WatermarkMsg, gather, scatter,
};

/// Moves a gathered block from a prefill rank's staging buffer into a decode rank's ring.
pub trait Link {
    /// Prefill rank `p`'s staging buffer (the gather target).
    fn staging(&mut self, p: usize) -> &mut [u8];
    /// Writes `len` bytes at `src_off` of prefill `p`'s staging buffer to decode `d`'s ring at
    /// `ring_off`, as one write op; returns the number of ops used.
    fn write(&mut self, p: usize, d: usize, src_off: usize, len: usize, ring_off: u64) -> usize;
    /// Decode rank `d`'s ring (the scatter source).
    fn ring(&self, d: usize) -> &[u8];
}

/// Staging buffers and rings as host memory; writes are checked memcpy ops.
pub struct HostLink {
    staging: Vec<HostMemory>,
    staging_base: Vec<u64>,
    rings: Vec<HostMemory>,
    ring_base: Vec<u64>,
}

impl HostLink {
    /// `prefills` staging buffers of `staging_len` bytes, `decodes` rings of `ring_len` bytes.
    pub fn new(prefills: usize, staging_len: usize, decodes: usize, ring_len: usize) -> Self {
        let mut staging = Vec::new();
        let mut staging_base = Vec::new();
        for _ in 0..prefills {
            let mut m = HostMemory::new();
            staging_base.push(m.add(vec![0; staging_len]));
            staging.push(m);
        }
        let mut rings = Vec::new();
        let mut ring_base = Vec::new();
        for _ in 0..decodes {
            let mut m = HostMemory::new();
            ring_base.push(m.add(vec![0; ring_len]));
            rings.push(m);
        }
        HostLink {
            staging,
            staging_base,
            rings,
            ring_base,
        }
    }
}

impl Link for HostLink {
    fn staging(&mut self, p: usize) -> &mut [u8] {
        let base = self.staging_base[p];
        self.staging[p].region_mut(base).unwrap()
    }

    fn write(&mut self, p: usize, d: usize, src_off: usize, len: usize, ring_off: u64) -> usize {
        let op = TransferOp::new(
            self.staging_base[p] + src_off as u64,
            self.ring_base[d] + ring_off,
            len as u64,
        );
        self.rings[d].apply(&self.staging[p], &[op]).unwrap();
        1
    }

    fn ring(&self, d: usize) -> &[u8] {
        self.rings[d].region(self.ring_base[d]).unwrap()
    }
}

/// Model shape of a test cluster.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Total KV heads.
    pub heads: u32,
    /// Prefill TP.
    pub pt: u32,
    /// Decode TP.
    pub dt: u32,
    /// Layers.
    pub layers: u32,
    /// Bytes per head per token.
    pub bph: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Pages per KV buffer on every rank.
    pub pages: u64,
    /// Prefill pipeline stages (decode PP 1); each stage writes its layers' slices.
    pub pp: u32,
}

impl Shape {
    pub fn geom(&self) -> TpGeometry {
        TpGeometry::new(self.heads, self.pt, self.dt).unwrap()
    }
    pub fn src_item(&self) -> u64 {
        self.page_size * u64::from(self.geom().prefill_heads()) * self.bph
    }
    pub fn dst_item(&self) -> u64 {
        self.page_size * u64::from(self.geom().decode_heads()) * self.bph
    }
    fn buffers(&self) -> usize {
        2 * self.layers as usize
    }
    /// Prefill endpoints (TP rank × PP stage), the ids the decode sends to.
    pub fn endpoints(&self) -> u32 {
        self.pt * self.pp
    }
    /// Layers `[first, first + n)` of pipeline stage `st` (contiguous, near-equal split).
    pub fn stage_layers(&self, st: u32) -> (u32, u32) {
        let first = self.layers * st / self.pp;
        (first, self.layers * (st + 1) / self.pp - first)
    }
}

/// KV pages of every rank (prefill filled with a pattern, decode zeroed).
pub struct Cluster {
    pub shape: Shape,
    pub prefill_kv: Vec<HostMemory>,
    pub decode_kv: Vec<HostMemory>,
}

fn layout_of(mem: &HostMemory, item_len: u64, shape: &Shape) -> KvLayout {
    let bases: Vec<u64> = (0..shape.buffers() as u64).map(|i| (i + 1) << 40).collect();
    let len = item_len * shape.pages;
    debug_assert_eq!(mem.all().len(), shape.buffers());
    let l = shape.layers as usize;
    KvLayout::mha(
        bases[..l]
            .iter()
            .map(|&b| Buffer::new(b, item_len, len))
            .collect(),
        bases[l..]
            .iter()
            .map(|&b| Buffer::new(b, item_len, len))
            .collect(),
        shape.page_size as u32,
    )
}

impl Cluster {
    /// A cluster whose prefill pages hold bytes derived from `seed`.
    pub fn new(shape: Shape, seed: u64) -> Self {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        let prefill_kv = (0..shape.pt)
            .map(|_| {
                let mut m = HostMemory::new();
                for _ in 0..shape.buffers() {
                    let len = (shape.src_item() * shape.pages) as usize;
                    m.add((0..len).map(|_| next()).collect());
                }
                m
            })
            .collect();
        let decode_kv = (0..shape.dt)
            .map(|_| {
                let mut m = HostMemory::new();
                for _ in 0..shape.buffers() {
                    m.add(vec![0; (shape.dst_item() * shape.pages) as usize]);
                }
                m
            })
            .collect();
        Cluster {
            shape,
            prefill_kv,
            decode_kv,
        }
    }

    /// Asserts that every decode rank holds exactly the pages of the head-slice baseline
    /// `expected`; `case` names the case in the failure message.
    pub fn assert_decode_equals(&self, expected: &[HostMemory], case: &str) {
        assert_eq!(self.decode_kv.len(), expected.len(), "{case}: decode ranks");
        for (d, (got, want)) in self.decode_kv.iter().zip(expected).enumerate() {
            assert!(
                got.all() == want.all(),
                "{case}: decode rank {d} differs from the head-slice path"
            );
        }
    }

    /// The decode pages after the per-token head-slice path (kvx-core's planner): returns the
    /// decode memories and the number of write ops.
    pub fn head_slice_baseline(
        &self,
        src_pages: &[i32],
        dst_pages: &[i32],
    ) -> (Vec<HostMemory>, u64) {
        let s = &self.shape;
        let g = s.geom();
        let mut out: Vec<HostMemory> = self.decode_kv.clone();
        let mut ops_total = 0;
        for p in 0..s.pt {
            let src = layout_of(&self.prefill_kv[p as usize], s.src_item(), s);
            for d in g.decode_targets(p) {
                let dst = layout_of(&out[d as usize], s.dst_item(), s);
                let params = HeadSliceParams {
                    total_kv_heads: s.heads,
                    src_tp_size: s.pt,
                    src_tp_rank: p,
                    dst_tp_size: s.dt,
                    dst_tp_rank: d,
                };
                let plan = plan_kv_head_slice(&src, &dst, &params, src_pages, dst_pages).unwrap();
                let ops: Vec<TransferOp> = plan.ops().collect();
                ops_total += ops.len() as u64;
                out[d as usize]
                    .apply(&self.prefill_kv[p as usize], &ops)
                    .unwrap();
            }
        }
        (out, ops_total)
    }
}

/// Messages in flight.
enum ToDecode {
    Req(StagingReq),
    Ready(ChunkReady),
}

enum ToPrefill {
    Rsp(StagingRsp),
    Wm(WatermarkMsg),
}

/// What a staged run did.
#[derive(Debug, Default)]
pub struct StagedStats {
    pub write_ops: u64,
    pub bytes: u64,
    pub waits: u64,
    pub wakes: u64,
    pub scatters: u64,
}

pub fn session(d: usize) -> SessionId {
    SessionId::new(format!("10.0.0.{}:15234", d + 2))
}

/// Sends one room through staging over `link`: every prefill rank produces all its chunks
/// (in grid order) and the whole protocol runs until every chunk is scattered. Fills
/// `cluster.decode_kv`. `ring_len` bytes per decode ring, `full_chunk_pages` grid.
pub fn run_staged_room(
    cluster: &mut Cluster,
    link: &mut dyn Link,
    room: Room,
    src_pages: &[i32],
    dst_pages: &[i32],
    full_chunk_pages: u64,
    ring_len: u64,
) -> StagedStats {
    let s = cluster.shape;
    let g = s.geom();
    let grid = RoomGrid::from_pages(
        ChunkGrid::with_pages(full_chunk_pages),
        dst_pages.len() as u64,
    );
    let mut decodes: Vec<DecodeStaging<u32>> = (0..s.dt as usize)
        .map(|d| DecodeStaging::new(session(d), ring_len))
        .collect();
    // One state machine per prefill endpoint e = tp_rank * pp + stage.
    let pp = s.pp;
    let mut prefills: Vec<PrefillStaging> =
        (0..s.endpoints()).map(|_| PrefillStaging::new()).collect();
    let layouts: Vec<StagedLayout> = (0..s.dt)
        .map(|d| StagedLayout::for_decode(&g, d, s.layers, s.bph, s.page_size).with_pp_writers(pp))
        .collect();
    for d in 0..s.dt {
        decodes[d as usize]
            .register_room(
                room,
                DecodeRoom {
                    peers: g
                        .prefill_sources(d)
                        .into_iter()
                        .flat_map(|p| (0..pp).map(move |st| p * pp + st))
                        .collect(),
                    grid,
                    layout: layouts[d as usize].clone(),
                },
            )
            .unwrap();
    }
    let mut to_decode: Vec<VecDeque<ToDecode>> = (0..s.dt).map(|_| VecDeque::new()).collect();
    let mut to_prefill: Vec<VecDeque<ToPrefill>> =
        (0..s.endpoints()).map(|_| VecDeque::new()).collect();
    let mut stats = StagedStats::default();
    // Prefetch (before the forward pass).
    for e in 0..s.endpoints() {
        for d in g.decode_targets(e / pp) {
            let reqs = prefills[e as usize]
                .prefetch(room, &session(d as usize), &grid, None)
                .unwrap();
            to_decode[d as usize].extend(reqs.into_iter().map(ToDecode::Req));
        }
    }
    // The forward pass finishes every chunk; writable ones go now, the rest are parked.
    let mut ready: VecDeque<(u32, ChunkKey, kvx_staging::Placement)> = VecDeque::new();
    for e in 0..s.endpoints() {
        for d in g.decode_targets(e / pp) {
            for k in 0..grid.num_chunks() as u32 {
                let key = ChunkKey {
                    room,
                    chunk_idx: k,
                    session: session(d as usize),
                };
                match prefills[e as usize].poll(&key) {
                    Readiness::Ready(pl) => ready.push_back((e, key, pl)),
                    Readiness::Wait => stats.waits += 1,
                    Readiness::Oversized => panic!("oversized"),
                }
            }
        }
    }
    loop {
        let mut progress = false;
        while let Some((e, key, pl)) = ready.pop_front() {
            progress = true;
            let (p, stage) = (e / pp, e % pp);
            let d = (0..s.dt as usize)
                .find(|&d| session(d) == key.session)
                .unwrap();
            let layout = &layouts[d];
            let w = g.writer_index(p) as usize;
            let start = grid.chunk_start(u64::from(key.chunk_idx)).unwrap();
            let n = grid.chunk_pages(u64::from(key.chunk_idx)).unwrap();
            let pages = &src_pages[start as usize..(start + n) as usize];
            let slice = g.slice(p, d as u32);
            let spec = SliceSpec {
                page_size: s.page_size as usize,
                bytes_per_head_token: s.bph as usize,
                item_len: s.src_item() as usize,
                head: slice.src_head as usize,
                n_heads: slice.n_heads as usize,
            };
            // The stage's buffers: K of its layers, then V of its layers.
            let (first, nl) = s.stage_layers(stage);
            let all = cluster.prefill_kv[p as usize].all();
            let l = s.layers as usize;
            let (a, b) = (first as usize, (first + nl) as usize);
            let bufs: Vec<&[u8]> = all[a..b]
                .iter()
                .chain(&all[l + a..l + b])
                .copied()
                .collect();
            let len = gather(&spec, &bufs, pages, link.staging(e as usize)).unwrap();
            if pp == 1 {
                assert_eq!(len as u64, layout.writer_bytes(w, n));
                let op = layout.write_op(w, n, &pl, 0, ring_len, 0).unwrap();
                assert_eq!(op.len, len as u64);
                stats.write_ops += link.write(e as usize, d, 0, len, op.dst) as u64;
            } else {
                let ops = layout
                    .stage_write_ops(w, n, &pl, (0, ring_len), 0, first, nl)
                    .unwrap();
                assert_eq!(ops[0].len + ops[1].len, len as u64);
                for op in ops {
                    stats.write_ops +=
                        link.write(e as usize, d, op.src as usize, op.len as usize, op.dst) as u64;
                }
            }
            stats.bytes += len as u64;
            to_decode[d].push_back(ToDecode::Ready(ChunkReady {
                room,
                chunk_idx: key.chunk_idx,
                page_start: start,
                num_pages: n,
                session: key.session.clone(),
                prefill_unique_rank: Some(e),
            }));
        }
        for d in 0..s.dt as usize {
            while let Some(m) = to_decode[d].pop_front() {
                progress = true;
                let mut actions: VecDeque<_> = match m {
                    ToDecode::Req(r) => decodes[d].on_staging_req(&r).unwrap(),
                    ToDecode::Ready(r) => decodes[d].on_chunk_ready(&r).unwrap(),
                }
                .into();
                while let Some(a) = actions.pop_front() {
                    match a {
                        DecodeAction::Respond { to, rsp, .. } => {
                            for p in to {
                                to_prefill[p as usize].push_back(ToPrefill::Rsp(rsp.clone()));
                            }
                        }
                        DecodeAction::Watermark { to, msg } => {
                            for p in to {
                                to_prefill[p as usize].push_back(ToPrefill::Wm(msg.clone()));
                            }
                        }
                        DecodeAction::Scatter(job) => {
                            stats.scatters += 1;
                            let layout = &layouts[d];
                            let start = job.page_start as usize;
                            let pages = &dst_pages[start..start + job.num_pages as usize];
                            let ring = link.ring(d);
                            let mut kv = cluster.decode_kv[d].all_mut();
                            for (w, wr) in layout.writers.iter().enumerate() {
                                let off = (job.placement.offset
                                    + layout.writer_offset(w, job.num_pages))
                                    as usize;
                                let len = layout.writer_bytes(w, job.num_pages) as usize;
                                let spec = SliceSpec {
                                    page_size: s.page_size as usize,
                                    bytes_per_head_token: s.bph as usize,
                                    item_len: s.dst_item() as usize,
                                    head: wr.dst_head as usize,
                                    n_heads: wr.heads as usize,
                                };
                                scatter(&spec, &ring[off..off + len], &mut kv, pages).unwrap();
                            }
                            actions.extend(
                                decodes[d].on_scatter_done(job.room, job.chunk_idx).unwrap(),
                            );
                        }
                    }
                }
            }
        }
        for p in 0..s.endpoints() as usize {
            while let Some(m) = to_prefill[p].pop_front() {
                progress = true;
                let wakes = match m {
                    ToPrefill::Rsp(r) => prefills[p].on_staging_rsp(&r).unwrap(),
                    ToPrefill::Wm(w) => prefills[p].on_watermark(&w),
                };
                for w in wakes {
                    stats.wakes += 1;
                    match w.readiness {
                        Readiness::Ready(pl) => ready.push_back((p as u32, w.key, pl)),
                        _ => panic!("unexpected wake {w:?}"),
                    }
                }
            }
        }
        if !progress {
            break;
        }
    }
    for d in decodes.iter_mut() {
        assert!(d.room_drained(room), "room not drained on the decode");
        d.release_room(room);
        assert_eq!(
            (d.room_count(), d.subscriber_count(), d.live_allocations()),
            (0, 0, 0)
        );
    }
    for p in prefills.iter_mut() {
        assert_eq!(p.waiting_count(), 0, "chunks left parked");
        p.conclude_room(room);
        assert!(p.is_idle());
    }
    stats
}
