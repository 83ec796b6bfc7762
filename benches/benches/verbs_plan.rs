//! Verbs backend decision costs (device-free): planning a KV-shaped batch into RDMA WRITE work
//! requests and running it through the per-peer scheduler.
//!
//! Batch: Llama-3-8B TP1 (32 layers, K and V: 64 buffers, 2048 bytes per token per buffer),
//! 4k tokens, page size 1, sources fragmented in runs of two pages, destinations contiguous:
//! 131072 ops of 4 KiB. Baseline in the same run: planning with one SGE per work request (no
//! gather packing). Run with `cargo bench -p kvx-benches --features verbs --bench verbs_plan`.
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvx_core::TransferOp;
use kvx_rdma::verbs::sched::Post;
use kvx_rdma::verbs::{Limits, PeerScheduler, Region, RegionTable, SchedConfig, plan_writes};

const TOKENS: u64 = 4096;
const BUFFERS: u64 = 64;
const ITEM: u64 = 2048;
const SRC: u64 = 0x1000_0000_0000;
const DST: u64 = 0x5000_0000_0000;
const BUF_SPAN: u64 = 2 * TOKENS * ITEM;

fn ops() -> Vec<TransferOp> {
    let mut v = Vec::new();
    for b in 0..BUFFERS {
        for run in 0..TOKENS / 2 {
            // source runs of two pages with a one-page gap; destination contiguous
            let s = SRC + b * BUF_SPAN + run * 3 * ITEM;
            let d = DST + b * BUF_SPAN + run * 2 * ITEM;
            v.push(TransferOp::new(s, d, 2 * ITEM));
        }
    }
    v
}

fn tables() -> (RegionTable, RegionTable) {
    let local = (0..BUFFERS)
        .map(|b| Region {
            base: SRC + b * BUF_SPAN,
            len: BUF_SPAN,
            key: b as u32 + 1,
        })
        .collect();
    let remote = (0..BUFFERS)
        .map(|b| Region {
            base: DST + b * BUF_SPAN,
            len: BUF_SPAN,
            key: b as u32 + 100,
        })
        .collect();
    (
        RegionTable::from_regions(local).expect("local"),
        RegionTable::from_regions(remote).expect("remote"),
    )
}

fn run_scheduler(n_wrs: u32) -> usize {
    let mut s = PeerScheduler::new(
        SchedConfig {
            depth: 256,
            signal_every: 32,
            max_wr_per_post: 32,
        },
        vec![1, 2],
    );
    let mut posts_n = 0;
    assert!(s.submit(1, n_wrs).is_none());
    loop {
        let posts: Vec<Post> = s.schedule();
        if posts.is_empty() {
            break;
        }
        posts_n += posts.len();
        for p in posts {
            for i in p.items.iter().filter(|i| i.signaled) {
                black_box(s.on_completion(p.qp, i.wr_id, 0, 0));
            }
        }
    }
    assert_eq!(s.open_batches(), 0);
    posts_n
}

fn bench(c: &mut Criterion) {
    let ops = ops();
    let (local, remote) = tables();
    let sge8 = Limits {
        max_sge: 8,
        max_inline: 0,
        max_wr_bytes: 2 << 20,
    };
    let sge1 = Limits { max_sge: 1, ..sge8 };
    let p8 = plan_writes(&ops, &local, &remote, sge8).expect("plan");
    let p1 = plan_writes(&ops, &local, &remote, sge1).expect("plan");
    eprintln!(
        "verbs_plan: {} ops -> {} work requests with 8 SGEs, {} with 1 SGE; {} posts",
        ops.len(),
        p8.wrs.len(),
        p1.wrs.len(),
        run_scheduler(p8.wrs.len() as u32)
    );
    let mut g = c.benchmark_group("verbs_plan_llama8b_4k");
    g.bench_function("plan_sge8", |b| {
        b.iter(|| plan_writes(black_box(&ops), &local, &remote, sge8).map(|p| p.wrs.len()))
    });
    g.bench_function("baseline_plan_sge1", |b| {
        b.iter(|| plan_writes(black_box(&ops), &local, &remote, sge1).map(|p| p.wrs.len()))
    });
    g.bench_function("schedule_and_complete_sge8", |b| {
        b.iter(|| run_scheduler(black_box(p8.wrs.len() as u32)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
