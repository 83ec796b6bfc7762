//! Staging vs the per-token head-slice path on the same heterogeneous-TP room.
//!
//! Room: Llama-3-8B-shaped KV (32 layers, 8 KV heads × 128 dims bf16 = 256 bytes per head per
//! token), 1024 tokens, page size 16, fragmented page lists, prefill TP 2 → decode TP 1 (each
//! prefill rank owns 4 heads and writes them into the decode's 8-head pages).
//!
//! - `head_slice`: kvx-core's per-token plan (`plan_kv_head_slice`) for both prefill ranks,
//!   executed as checked memcpy ops on host memory: 2 × 64 buffers × 1024 tokens = 131 072 ops
//!   of 1 KiB.
//! - `staging`: per 256-token chunk and writer, gather the head slices into one block, one
//!   checked memcpy write into the ring (at the offset the ring allocator gives), scatter into
//!   the decode's pages: 8 write ops in all.
//!
//! Both move the same KV bytes into the decode (throughput is reported per KV byte delivered).
//! Group `…_host`: ops executed as checked memcpy on host memory (nothing sent); staging does
//! three copies where the head-slice path does one, so memcpy bandwidth favours the head-slice
//! path there. Group `…_tcp`: the same room with every write op sent through kvx-rdma's `tcp`
//! backend over loopback (both prefill ranks' batches in flight at once; staging pipelined two
//! chunks deep: gather and scatter overlap the writes), which is where the op count matters;
//! `staging_page_writes` skips the CPU gather and writes each chunk's block from the KV pages as
//! page runs (`kvx_staging::gather_writes`, what kvx-engine does when a prefill rank sends all
//! its heads). Every variant is checked byte for byte against the host head-slice result
//! before timing.
use std::hint::black_box;

use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx_core::TransferOp;
use kvx_core::layout::{Buffer, KvLayout};
use kvx_core::planner::{HeadSliceParams, plan_kv_head_slice};
use kvx_rdma::{Session, TcpConfig, TcpTransport, Transport};
use kvx_staging::{
    HostMemory, SliceSpec, StagedLayout, StagingRing, TpGeometry, gather, gather_writes, scatter,
};
use tokio::runtime::Runtime;

const LAYERS: u32 = 32;
const HEADS: u32 = 8;
const BPH: u64 = 256;
const PAGE: u64 = 16;
const TOKENS: u64 = 1024;
const PAGES: u64 = TOKENS / PAGE;
const CAP_PAGES: u64 = PAGES + 1;
const CHUNK_PAGES: u64 = 16;
const PT: u32 = 2;
const DT: u32 = 1;

struct Room {
    geom: TpGeometry,
    prefill: Vec<HostMemory>,
    decode: HostMemory,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
}

fn kv_mem(item: u64, fill: Option<u8>) -> HostMemory {
    let mut m = HostMemory::new();
    for b in 0..2 * LAYERS {
        let len = (item * CAP_PAGES) as usize;
        m.add(match fill {
            Some(seed) => (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ b as u8)
                .collect(),
            None => vec![0; len],
        });
    }
    m
}

/// Bytes of one page of one layer on a prefill rank (its share of the heads).
fn src_item(geom: &TpGeometry) -> u64 {
    PAGE * u64::from(geom.prefill_heads()) * BPH
}

/// Bytes of one page of one layer on the decode rank.
fn dst_item(geom: &TpGeometry) -> u64 {
    PAGE * u64::from(geom.decode_heads()) * BPH
}

/// Head-slice parameters for prefill rank `p` writing to decode rank 0.
fn head_params(p: u32) -> HeadSliceParams {
    HeadSliceParams {
        total_kv_heads: HEADS,
        src_tp_size: PT,
        src_tp_rank: p,
        dst_tp_size: DT,
        dst_tp_rank: 0,
    }
}

/// The gather/scatter view of `n_heads` heads from `head` on, in pages of `item_len` bytes.
fn slice_spec(item_len: usize, head: u32, n_heads: u32) -> SliceSpec {
    SliceSpec {
        page_size: PAGE as usize,
        bytes_per_head_token: BPH as usize,
        item_len,
        head: head as usize,
        n_heads: n_heads as usize,
    }
}

fn layout(item: u64) -> KvLayout {
    let l = LAYERS as u64;
    let buf = |i: u64| Buffer::new((i + 1) << 40, item, item * CAP_PAGES);
    KvLayout::mha(
        (0..l).map(buf).collect(),
        (l..2 * l).map(buf).collect(),
        PAGE as u32,
    )
}

impl Room {
    fn new() -> Self {
        let geom = TpGeometry::new(HEADS, PT, DT).unwrap_or_else(|e| panic!("{e}"));
        let (src_item, dst_item) = (src_item(&geom), dst_item(&geom));
        Room {
            geom,
            prefill: (0..PT)
                .map(|p| kv_mem(src_item, Some(p as u8 + 1)))
                .collect(),
            decode: kv_mem(dst_item, None),
            // Permutations of 1..=PAGES (strides coprime with PAGES): no two neighbours adjacent.
            src_pages: (0..PAGES as i32)
                .map(|i| 1 + (i * 5) % PAGES as i32)
                .collect(),
            dst_pages: (0..PAGES as i32)
                .map(|i| 1 + (i * 7 + 3) % PAGES as i32)
                .collect(),
        }
    }

    /// The head-slice path: plan and execute every op; returns the op count.
    fn head_slice(&mut self) -> u64 {
        let (src, dst) = (layout(src_item(&self.geom)), layout(dst_item(&self.geom)));
        let mut n = 0;
        for p in 0..PT {
            let plan = plan_kv_head_slice(
                &src,
                &dst,
                &head_params(p),
                &self.src_pages,
                &self.dst_pages,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let ops: Vec<TransferOp> = plan.ops().collect();
            n += ops.len() as u64;
            self.decode
                .apply(&self.prefill[p as usize], &ops)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        n
    }

    /// The staged path: gather, one write per writer and chunk, scatter; returns the write ops.
    fn staged(&mut self, st: &mut Staging) -> u64 {
        let lay = StagedLayout::for_decode(&self.geom, 0, LAYERS, BPH, PAGE);
        let (src_item, dst_item) = (src_item(&self.geom) as usize, dst_item(&self.geom) as usize);
        let mut writes = 0;
        for start in (0..PAGES).step_by(CHUNK_PAGES as usize) {
            let n = CHUNK_PAGES.min(PAGES - start);
            let (s, e) = (start as usize, (start + n) as usize);
            let (id, pl) = st
                .ring
                .assign(lay.chunk_bytes(n))
                .unwrap_or_else(|e| panic!("{e}"));
            for p in 0..PT {
                let w = self.geom.writer_index(p) as usize;
                let slice = self.geom.slice(p, 0);
                let spec = slice_spec(src_item, slice.src_head, slice.n_heads);
                let out = st.staging.region_mut(st.staging_base).unwrap_or_default();
                let len = gather(
                    &spec,
                    &self.prefill[p as usize].all(),
                    &self.src_pages[s..e],
                    out,
                )
                .unwrap_or_else(|e| panic!("{e}"));
                let dst = st.ring_base + pl.offset + lay.writer_offset(w, n);
                st.ring_mem
                    .apply(
                        &st.staging,
                        &[TransferOp::new(st.staging_base, dst, len as u64)],
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                writes += 1;
            }
            let ring = st.ring_mem.region(st.ring_base).unwrap_or_default();
            let mut kv = self.decode.all_mut();
            for (w, wr) in lay.writers.iter().enumerate() {
                let off = (pl.offset + lay.writer_offset(w, n)) as usize;
                let len = lay.writer_bytes(w, n) as usize;
                let spec = slice_spec(dst_item, wr.dst_head, wr.heads);
                scatter(&spec, &ring[off..off + len], &mut kv, &self.dst_pages[s..e])
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            st.ring.free(id);
        }
        writes
    }
}

struct Staging {
    ring: StagingRing,
    ring_mem: HostMemory,
    ring_base: u64,
    staging: HostMemory,
    staging_base: u64,
}

impl Staging {
    fn new(geom: &TpGeometry) -> Self {
        let lay = StagedLayout::for_decode(geom, 0, LAYERS, BPH, PAGE);
        let chunk = lay.chunk_bytes(CHUNK_PAGES);
        let mut ring_mem = HostMemory::new();
        let ring_base = ring_mem.add(vec![0; 2 * chunk as usize]);
        let mut staging = HostMemory::new();
        let staging_base = staging.add(vec![0; lay.writer_bytes(0, CHUNK_PAGES) as usize]);
        Staging {
            ring: StagingRing::new(2 * chunk),
            ring_mem,
            ring_base,
            staging,
            staging_base,
        }
    }
}

/// The same room with real sockets: prefill ranks and the decode as tcp transports on loopback,
/// KV pages, staging buffers and the ring registered with them.
struct NetRoom {
    // Field order is drop order: sessions and transports go before the memory they registered.
    sessions: Vec<Arc<dyn Session>>,
    _transports: Vec<Arc<dyn Transport>>,
    rt: Runtime,
    geom: TpGeometry,
    prefill_kv: Vec<Vec<Vec<u8>>>,
    staging: Vec<Vec<u8>>,
    decode_kv: Vec<Vec<u8>>,
    ring: Vec<u8>,
    ring_alloc: StagingRing,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
}

/// A posted batch.
type Flight = tokio::task::JoinHandle<Result<kvx_rdma::BatchReport, kvx_rdma::TransportError>>;

/// A staged chunk: its ring allocation and its page range.
type Chunk = (kvx_staging::AllocId, kvx_staging::Placement, usize, usize);

fn register(t: &dyn Transport, buf: &mut [u8]) {
    // SAFETY: every registered buffer is owned by the `NetRoom` whose transports registered it,
    // is never resized, and outlives them (the transports are dropped first); the bench touches
    // bytes of a buffer only when no batch in flight reads or writes those bytes.
    unsafe { t.register(buf.as_mut_ptr() as u64, buf.len() as u64) }
        .unwrap_or_else(|e| panic!("{e}"));
}

fn layout_at(bufs: &[Vec<u8>], item: u64) -> KvLayout {
    let b: Vec<Buffer> = bufs
        .iter()
        .map(|v| Buffer::new(v.as_ptr() as u64, item, v.len() as u64))
        .collect();
    let l = LAYERS as usize;
    KvLayout::mha(b[..l].to_vec(), b[l..].to_vec(), PAGE as u32)
}

impl NetRoom {
    fn new(host: &Room) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let lay = StagedLayout::for_decode(&host.geom, 0, LAYERS, BPH, PAGE);
        let chunk = lay.chunk_bytes(CHUNK_PAGES);
        let mut prefill_kv: Vec<Vec<Vec<u8>>> = host
            .prefill
            .iter()
            .map(|m| m.all().iter().map(|b| b.to_vec()).collect())
            .collect();
        // Two staging buffers per prefill rank: gather chunk k+1 while chunk k is on the wire.
        let mut staging: Vec<Vec<u8>> = (0..2 * PT)
            .map(|_| vec![0; lay.writer_bytes(0, CHUNK_PAGES) as usize])
            .collect();
        let mut decode_kv: Vec<Vec<u8>> =
            host.decode.all().iter().map(|b| vec![0; b.len()]).collect();
        let mut ring = vec![0; 2 * chunk as usize];
        let decode: Arc<dyn Transport> = rt
            .block_on(TcpTransport::bind("127.0.0.1:0", TcpConfig::default()))
            .unwrap_or_else(|e| panic!("{e}"));
        for b in decode_kv.iter_mut() {
            register(&*decode, b);
        }
        register(&*decode, &mut ring);
        let mut transports = vec![decode.clone()];
        let mut sessions = Vec::new();
        for (kv, st) in prefill_kv.iter_mut().zip(staging.chunks_mut(2)) {
            let t: Arc<dyn Transport> = {
                let _g = rt.enter();
                TcpTransport::client(TcpConfig::default())
            };
            for b in kv.iter_mut() {
                register(&*t, b);
            }
            for b in st.iter_mut() {
                register(&*t, b);
            }
            sessions.push(
                rt.block_on(t.connect(&decode.endpoint()))
                    .unwrap_or_else(|e| panic!("{e}")),
            );
            transports.push(t);
        }
        NetRoom {
            sessions,
            _transports: transports,
            rt,
            geom: host.geom,
            prefill_kv,
            staging,
            decode_kv,
            ring,
            ring_alloc: StagingRing::new(2 * chunk),
            src_pages: host.src_pages.clone(),
            dst_pages: host.dst_pages.clone(),
        }
    }

    /// Posts one batch per prefill rank, all in flight together.
    fn spawn(&self, batches: Vec<Vec<TransferOp>>) -> Vec<Flight> {
        batches
            .into_iter()
            .zip(&self.sessions)
            .map(|(ops, s)| self.rt.spawn(s.write_batch(ops)))
            .collect()
    }

    /// Waits for posted batches.
    fn wait(&self, flights: Vec<Flight>) {
        self.rt.block_on(async {
            for h in flights {
                h.await
                    .unwrap_or_else(|e| panic!("{e}"))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        });
    }

    fn head_slice(&mut self) -> u64 {
        let (src_item, dst_item) = (src_item(&self.geom), dst_item(&self.geom));
        let dst = layout_at(&self.decode_kv, dst_item);
        let mut batches = Vec::new();
        for p in 0..PT {
            let src = layout_at(&self.prefill_kv[p as usize], src_item);
            let plan = plan_kv_head_slice(
                &src,
                &dst,
                &head_params(p),
                &self.src_pages,
                &self.dst_pages,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            batches.push(plan.ops().collect::<Vec<_>>());
        }
        let n = batches.iter().map(|b| b.len() as u64).sum();
        let flights = self.spawn(batches);
        self.wait(flights);
        n
    }

    /// Staged path, two-deep pipeline: gather chunk k and post its writes, then (while they are
    /// on the wire) wait for chunk k-1, scatter it and free its ring region. `direct`: no CPU
    /// gather, the block is written from the KV pages as page runs (`gather_writes`, what the
    /// engine does when a prefill rank sends all its heads, as here).
    fn staged(&mut self, direct: bool) -> u64 {
        let lay = StagedLayout::for_decode(&self.geom, 0, LAYERS, BPH, PAGE);
        let src_item = src_item(&self.geom) as usize;
        let ring_base = self.ring.as_ptr() as u64;
        let mut writes = 0;
        let mut in_flight: Option<(Chunk, Vec<Flight>)> = None;
        for (k, start) in (0..PAGES).step_by(CHUNK_PAGES as usize).enumerate() {
            let n = CHUNK_PAGES.min(PAGES - start);
            let (s, e) = (start as usize, (start + n) as usize);
            let (id, pl) = self
                .ring_alloc
                .assign(lay.chunk_bytes(n))
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                self.ring_alloc.watermark().admits(&pl),
                "ring region not free yet"
            );
            let mut batches = Vec::new();
            for p in 0..PT {
                let w = self.geom.writer_index(p) as usize;
                let slice = self.geom.slice(p, 0);
                let spec = slice_spec(src_item, slice.src_head, slice.n_heads);
                let dst = ring_base + pl.offset + lay.writer_offset(w, n);
                if direct {
                    let bufs: Vec<(u64, usize)> = self.prefill_kv[p as usize]
                        .iter()
                        .map(|b| (b.as_ptr() as u64, b.len()))
                        .collect();
                    let ops = gather_writes(&spec, &bufs, &self.src_pages[s..e], dst)
                        .unwrap_or_else(|e| panic!("{e}"))
                        .unwrap_or_else(|| panic!("TP 2 -> 1 slices are whole token slots"));
                    writes += ops.len() as u64;
                    batches.push(ops);
                    continue;
                }
                let out = &mut self.staging[2 * p as usize + k % 2];
                let len = gather(
                    &spec,
                    &self.prefill_kv[p as usize],
                    &self.src_pages[s..e],
                    out,
                )
                .unwrap_or_else(|e| panic!("{e}"));
                batches.push(vec![TransferOp::new(out.as_ptr() as u64, dst, len as u64)]);
                writes += 1;
            }
            let flights = self.spawn(batches);
            if let Some((prev, prev_flights)) = in_flight.replace(((id, pl, s, e), flights)) {
                self.wait(prev_flights);
                self.scatter_chunk(&lay, prev);
            }
        }
        if let Some((last, flights)) = in_flight {
            self.wait(flights);
            self.scatter_chunk(&lay, last);
        }
        writes
    }

    fn scatter_chunk(&mut self, lay: &StagedLayout, (id, pl, s, e): Chunk) {
        let dst_item = dst_item(&self.geom) as usize;
        let n = (e - s) as u64;
        for (w, wr) in lay.writers.iter().enumerate() {
            let off = (pl.offset + lay.writer_offset(w, n)) as usize;
            let len = lay.writer_bytes(w, n) as usize;
            let spec = slice_spec(dst_item, wr.dst_head, wr.heads);
            assert!(off + len <= self.ring.len());
            // SAFETY: `off..off + len` lies inside the ring (checked above) and inside this
            // chunk's allocation, whose writes have completed; the only batch still in flight
            // writes the next chunk's allocation, which the ring allocator placed elsewhere (its
            // placement was admitted by the watermark, which excludes live regions). `as_ptr`
            // forms no reference to the rest of the ring.
            let block = unsafe { std::slice::from_raw_parts(self.ring.as_ptr().add(off), len) };
            scatter(&spec, block, &mut self.decode_kv, &self.dst_pages[s..e])
                .unwrap_or_else(|e| panic!("{e}"));
        }
        self.ring_alloc.free(id);
    }

    fn reset_decode(&mut self) {
        for b in self.decode_kv.iter_mut() {
            b.fill(0);
        }
    }
}

fn bench(c: &mut Criterion) {
    let mut base = Room::new();
    let mut staged = Room::new();
    let mut st = Staging::new(&staged.geom);
    let ops_head_slice = base.head_slice();
    let ops_staged = staged.staged(&mut st);
    assert!(
        base.decode.all() == staged.decode.all(),
        "staged decode pages differ from the head-slice path"
    );
    let kv_bytes = TOKENS * u64::from(HEADS) * BPH * 2 * u64::from(LAYERS);
    println!(
        "staging_room: {kv_bytes} KV bytes; write ops: head_slice {ops_head_slice}, staging {ops_staged} ({}x fewer)",
        ops_head_slice / ops_staged.max(1)
    );

    let mut g = c.benchmark_group("staging_room_tp2_to_tp1_1k_tokens_host");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(kv_bytes));
    g.bench_function("head_slice", |b| b.iter(|| black_box(base.head_slice())));
    g.bench_function("staging", |b| b.iter(|| black_box(staged.staged(&mut st))));
    g.finish();

    let mut net = NetRoom::new(&base);
    let want: Vec<Vec<u8>> = base.decode.all().iter().map(|b| b.to_vec()).collect();
    assert_eq!(net.head_slice(), ops_head_slice);
    assert!(net.decode_kv == want, "tcp head-slice result differs");
    net.reset_decode();
    assert_eq!(net.staged(false), ops_staged);
    assert!(net.decode_kv == want, "tcp staged result differs");
    net.reset_decode();
    let ops_direct = net.staged(true);
    assert!(
        net.decode_kv == want,
        "tcp staged (page-run writes) result differs"
    );
    println!("staging_room: page-run writes {ops_direct} (no CPU gather)");
    let mut g = c.benchmark_group("staging_room_tp2_to_tp1_1k_tokens_tcp");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(kv_bytes));
    g.bench_function("head_slice", |b| b.iter(|| black_box(net.head_slice())));
    g.bench_function("staging", |b| b.iter(|| black_box(net.staged(false))));
    g.bench_function("staging_page_writes", |b| {
        b.iter(|| black_box(net.staged(true)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
