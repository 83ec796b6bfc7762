//! Planner benchmark: one 32k-token room of a 64-layer MHA model (page size 1, 2048 bytes per
//! page per buffer, so 128 buffers), half of the pages starting a new run (runs of 2 pages).
//!
//! Baseline, measured in the same run: the naive per-page triple list (one op per page per
//! buffer, written into a preallocated Vec), i.e. what an unmerged planner must at least do.
//!
//! `planner_head_slice`: the heterogeneous-TP plan (prefill TP 1 → decode TP 2, 8 KV heads,
//! 4k tokens at page size 16, 64 layers: 524 288 per-token ops), iterated and cut into posted
//! batches; its per-op cost is printed beside the paged plan's.
#![allow(clippy::unwrap_used)] // fixed, valid bench fixtures: a failure is a bench bug
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvx_core::planner::{Coalesce, HeadSliceParams, merge_runs, plan_kv_equal, plan_kv_head_slice};
use kvx_core::{BatchLimits, KvLayout, Plan, PlanPart, TransferOp};

const TOKENS: usize = 32 * 1024;
const LAYERS: usize = 64;
const ITEM: u64 = 2048;
const CAPACITY_PAGES: u64 = 65_536;

fn pages() -> (Vec<i32>, Vec<i32>) {
    // Source pages in runs of two with a one-page gap: [1,2, 4,5, 7,8, ...]; destination
    // contiguous. Every second page starts a new run.
    let src = (0..TOKENS as i32).map(|i| 1 + i + i / 2).collect();
    let dst = (0..TOKENS as i32).map(|i| 1 + i).collect();
    (src, dst)
}

fn bench(c: &mut Criterion) {
    let src = KvLayout::mha_contiguous(0x1000_0000_0000, LAYERS, ITEM, CAPACITY_PAGES, 1);
    let dst = KvLayout::mha_contiguous(0x5000_0000_0000, LAYERS, ITEM, CAPACITY_PAGES, 1);
    let (sp, dp) = pages();

    let mut g = c.benchmark_group("planner_32k_x64");
    g.bench_function("merge_runs", |b| {
        b.iter(|| merge_runs(black_box(&sp), black_box(&dp)))
    });
    g.bench_function("plan", |b| {
        b.iter(|| {
            plan_kv_equal(
                black_box(&src),
                black_box(&dst),
                black_box(&sp),
                black_box(&dp),
            )
        })
    });
    g.bench_function("baseline_naive_page_triples", |b| {
        let mut out: Vec<TransferOp> = Vec::with_capacity(TOKENS * 2 * LAYERS);
        b.iter(|| {
            out.clear();
            for (s, d) in src.buffers.iter().zip(&dst.buffers) {
                for (&p, &q) in sp.iter().zip(&dp) {
                    out.push(TransferOp::new(
                        s.addr + p as u64 * ITEM,
                        d.addr + q as u64 * ITEM,
                        ITEM,
                    ));
                }
            }
            black_box(out.len())
        })
    });
    g.bench_function("plan_and_all_ops", |b| {
        b.iter(|| {
            let plan = plan_kv_equal(&src, &dst, black_box(&sp), black_box(&dp)).unwrap();
            plan.ops().fold(0u64, |acc, op| acc ^ op.src ^ op.len)
        })
    });
    g.bench_function("plan_and_batch_1024", |b| {
        b.iter(|| {
            let mut plan = Plan::new();
            plan.push(PlanPart::Paged(
                plan_kv_equal(&src, &dst, black_box(&sp), black_box(&dp)).unwrap(),
            ));
            plan.batches(BatchLimits::default())
                .map(|b| b.len())
                .sum::<usize>()
        })
    });
    g.finish();

    // Heterogeneous TP: per-token head slices (prefill TP1 holds 8 heads, decode rank 1 of TP2
    // takes heads 4..8), page size 16.
    let hs_src = KvLayout::mha_contiguous(0x1000_0000_0000, LAYERS, 8 * 128 * 16, 512, 16);
    let hs_dst = KvLayout::mha_contiguous(0x5000_0000_0000, LAYERS, 4 * 128 * 16, 512, 16);
    let params = HeadSliceParams {
        total_kv_heads: 8,
        src_tp_size: 1,
        src_tp_rank: 0,
        dst_tp_size: 2,
        dst_tp_rank: 1,
    };
    let hp: Vec<i32> = (0..256).map(|i| 1 + i * 2).collect();
    let hd: Vec<i32> = (0..256).collect();
    let hs_plan = plan_kv_head_slice(&hs_src, &hs_dst, &params, &hp, &hd).unwrap();
    let hs_ops = hs_plan.num_ops();
    let mut g = c.benchmark_group("planner_head_slice");
    g.bench_function("all_ops", |b| {
        b.iter(|| {
            black_box(&hs_plan)
                .ops()
                .fold(0u64, |acc, op| acc ^ op.src ^ op.len)
        })
    });
    g.bench_function("batch_1024", |b| {
        b.iter(|| {
            let mut plan = Plan::new();
            plan.push(PlanPart::HeadSlice(black_box(&hs_plan).clone()));
            plan.batches(BatchLimits::default())
                .map(|b| b.len())
                .sum::<usize>()
        })
    });
    g.finish();
    println!("planner_head_slice: {hs_ops} ops per room");

    // Run counts, printed once for the record.
    let plan = plan_kv_equal(&src, &dst, &sp, &dp).unwrap();
    let coalesced = Coalesce::new(plan.ops()).count();
    println!(
        "planner_32k_x64: {} runs, {} ops, {} ops after coalescing, {} bytes",
        plan.runs().len(),
        plan.num_ops(),
        coalesced,
        plan.total_bytes()
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
