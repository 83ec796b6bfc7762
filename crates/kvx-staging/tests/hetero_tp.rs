//! End to end on host memory: a heterogeneous-TP room sent through staging (prefetch,
//! placement, watermarks, gather, one write per writer and chunk, CHUNK_READY, scatter) leaves
//! every decode rank's KV pages byte-identical to kvx-core's per-token head-slice plan.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Cluster, HostLink, Shape, run_staged_room};
use kvx_core::Room;
use proptest::prelude::*;

fn shape(heads: u32, pt: u32, dt: u32) -> Shape {
    Shape {
        heads,
        pt,
        dt,
        layers: 3,
        bph: 16,
        page_size: 4,
        pages: 64,
        pp: 1,
    }
}

/// Fragmented, distinct page ids (page 0 is the padding page and never used).
fn pages(n: usize, seed: u64, total: u64) -> Vec<i32> {
    let mut ids: Vec<i32> = (1..total as i32).collect();
    let mut x = seed | 1;
    for i in (1..ids.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids.swap(i, (x % (i as u64 + 1)) as usize);
    }
    ids.truncate(n);
    ids
}

fn check(
    shape: Shape,
    n_pages: usize,
    full_chunk_pages: u64,
    ring_chunks: f64,
    seed: u64,
) -> common::StagedStats {
    let src = pages(n_pages, seed, shape.pages);
    let dst = pages(n_pages, seed.wrapping_mul(31).wrapping_add(7), shape.pages);
    let mut cluster = Cluster::new(shape, seed);
    let (expected, baseline_ops) = cluster.head_slice_baseline(&src, &dst);
    // The ring holds about `ring_chunks` full chunks, so it wraps and writers wait.
    let layout = kvx_staging::StagedLayout::for_decode(
        &shape.geom(),
        0,
        shape.layers,
        shape.bph,
        shape.page_size,
    );
    let chunk = layout.chunk_bytes(full_chunk_pages);
    let ring_len = (chunk as f64 * ring_chunks) as u64;
    let staging_len = chunk as usize;
    let mut link = HostLink::new(
        shape.endpoints() as usize,
        staging_len,
        shape.dt as usize,
        ring_len as usize,
    );
    let stats = run_staged_room(
        &mut cluster,
        &mut link,
        Room::new(42).unwrap(),
        &src,
        &dst,
        full_chunk_pages,
        ring_len,
    );
    cluster.assert_decode_equals(&expected, "staged");
    for want in &expected {
        assert!(want.all().iter().any(|b| b.iter().any(|&x| x != 0)));
    }
    assert!(stats.write_ops <= baseline_ops);
    stats
}

#[test]
fn tp2_to_tp1_matches_head_slice_path() {
    let s = check(shape(8, 2, 1), 40, 8, 2.5, 1);
    // 5 chunks x 2 writers, one write each.
    assert_eq!(s.write_ops, 10);
    assert!(
        s.waits > 0 && s.wakes > 0,
        "the small ring made writers wait: {s:?}"
    );
}

#[test]
fn tp1_to_tp2_matches_head_slice_path() {
    let s = check(shape(8, 1, 2), 37, 8, 2.5, 2);
    assert_eq!(s.write_ops, 10);
    assert_eq!(s.scatters, 10);
}

#[test]
fn gqa_replication_tp4_to_tp1() {
    // 2 KV heads on prefill TP 4: ranks hold replicated heads; decode TP 1 holds both.
    check(shape(2, 4, 1), 20, 4, 1.5, 3);
}

#[test]
fn tp4_to_tp2_and_tp2_to_tp8() {
    check(shape(8, 4, 2), 33, 8, 3.0, 4);
    check(shape(8, 2, 8), 21, 8, 2.0, 5);
}

#[test]
fn prefill_pipeline_stages_write_their_layers() {
    // Prefill PP 3 (one layer per stage), decode PP 1: each stage writes its K and V slot.
    let s = check(
        Shape {
            pp: 3,
            ..shape(8, 2, 1)
        },
        40,
        8,
        2.5,
        7,
    );
    // 5 chunks x 2 TP writers x 3 stages x 2 writes (K part, V part).
    assert_eq!(s.write_ops, 60);
    assert_eq!(s.scatters, 5);
    check(
        Shape {
            pp: 2,
            ..shape(8, 1, 2)
        },
        37,
        8,
        2.0,
        8,
    );
}

#[test]
fn ring_of_exactly_one_chunk() {
    check(shape(8, 2, 1), 24, 8, 1.0, 6);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn staged_equals_head_slice(
        tp in prop::sample::select(vec![(2u32, 1u32), (1, 2), (4, 1), (1, 4), (4, 2), (2, 4)]),
        n in 1usize..48,
        full in 1u64..12,
        ring in 1.0f64..4.0,
        page_size in prop::sample::select(vec![1u64, 2, 4]),
        pp in 1u32..4,
        seed in any::<u64>(),
    ) {
        let s = Shape { page_size, pp, ..shape(8, tp.0, tp.1) };
        check(s, n, full, ring, seed);
    }
}
