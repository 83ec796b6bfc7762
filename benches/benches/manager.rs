//! Prefill-manager event throughput: complete room lifecycles (sender created and initialised,
//! metadata, one 64-page chunk, last empty chunk, completions, Success) through one manager, no
//! I/O. Baseline in the same run: the same rooms' plans built directly with the planner, so the
//! ratio is the manager's bookkeeping overhead.
#![allow(clippy::unwrap_used)] // fixed, valid bench fixtures: a failure is a bench bug
use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx_core::planner::plan_kv_equal;
use kvx_core::prefill::{LocalMemory, PrefillAction};
use kvx_core::{
    AuxLayout, Chunk, DecodeRegistration, Destination, Endpoint, KvLayout, PageSlice,
    PrefillConfig, PrefillEvent, PrefillManager, Room, SessionId, TransferRequest,
};

const LAYERS: usize = 32;
const PAGES: usize = 64;

fn layout(base: u64) -> KvLayout {
    KvLayout::mha_contiguous(base, LAYERS, 2048, 4096, 1)
}

fn registration() -> DecodeRegistration {
    let kv = layout(0x5000_0000_0000);
    DecodeRegistration::plain(
        Endpoint::new("10.0.0.2", 41235),
        SessionId::new("10.0.0.2:15234"),
        kv.buffers.iter().map(|b| b.addr).collect(),
        (0..10).map(|i| 0x6000_0000_0000 + (i << 24)).collect(),
        2048,
    )
}

/// Pages with every fourth page breaking the run.
fn pages(room: u64) -> (Vec<i32>, Vec<i32>) {
    let base = (room % 32) as i32 * 100;
    let src = (0..PAGES as i32).map(|i| base + i + i / 4).collect();
    let dst = (0..PAGES as i32).map(|i| base + i).collect();
    (src, dst)
}

/// Drives one room from sender creation to Success with `pages` pages in one chunk plus an
/// empty last chunk; returns the number of batches posted.
fn lifecycle(
    mgr: &mut PrefillManager,
    now: Instant,
    reg: &DecodeRegistration,
    n: u64,
    pages_n: usize,
    out: &mut Vec<PrefillAction>,
) -> usize {
    let room = Room::new(n).unwrap();
    let (mut sp, mut dp) = pages(n);
    sp.truncate(pages_n);
    dp.truncate(pages_n);
    let mut ids = Vec::new();
    let mut feed = |e: PrefillEvent, out: &mut Vec<PrefillAction>| {
        out.clear();
        mgr.handle(now, e, out).unwrap();
        for a in out.iter() {
            if let PrefillAction::PostBatch { batch_id, .. } = a {
                ids.push(*batch_id);
            }
        }
    };
    feed(PrefillEvent::SenderCreated { room }, out);
    let aux_row = n % 1024;
    let init = PrefillEvent::SenderInit {
        room,
        num_pages: pages_n,
        aux_row,
    };
    feed(init, out);
    let meta = TransferRequest {
        room,
        endpoint: reg.endpoint.clone(),
        session: reg.session.clone(),
        dst: Some(Destination {
            kv_pages: dp,
            aux_index: 5,
            state_indices: Vec::new(),
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: Vec::new(),
    };
    feed(PrefillEvent::Metadata(meta), out);
    if pages_n > 0 {
        let chunk = Chunk::new(PageSlice::new(0, pages_n).unwrap(), sp);
        feed(PrefillEvent::Chunk { room, chunk }, out);
    }
    let last = Chunk::empty_last(pages_n);
    feed(PrefillEvent::Chunk { room, chunk: last }, out);
    let posted = ids.len();
    for batch_id in ids {
        out.clear();
        let done = PrefillEvent::BatchDone {
            batch_id,
            result: Ok(()),
        };
        mgr.handle(now, done, out).unwrap();
    }
    assert!(matches!(out.last(), Some(PrefillAction::Concluded { .. })));
    posted
}

fn bench(c: &mut Criterion) {
    let aux_ptrs: Vec<u64> = (0..10).map(|i| 0x2000_0000_0000 + (i << 24)).collect();
    let local = LocalMemory {
        kv: layout(0x1000_0000_0000),
        aux: AuxLayout::sglang_default(&aux_ptrs, Some(1024)).unwrap(),
        state: Vec::new(),
    };
    let mut mgr = PrefillManager::new(PrefillConfig::default(), local.clone());
    let now = Instant::now();
    let mut out = Vec::new();
    mgr.handle(now, PrefillEvent::Register(registration()), &mut out)
        .unwrap();
    let reg = registration();
    let mut next = 1u64;

    let mut g = c.benchmark_group("prefill_manager");
    // Events per room: created, init, metadata, chunk, last chunk, 2 completions.
    g.throughput(Throughput::Elements(7));
    g.bench_function("room_lifecycle", |b| {
        b.iter(|| {
            next += 1;
            black_box(lifecycle(&mut mgr, now, &reg, next, PAGES, &mut out))
        })
    });
    // Events per empty room: created, init, metadata, last chunk, 1 completion.
    g.throughput(Throughput::Elements(5));
    g.bench_function("empty_room_lifecycle", |b| {
        b.iter(|| {
            next += 1;
            black_box(lifecycle(&mut mgr, now, &reg, next, 0, &mut out))
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("baseline_plan_only", |b| {
        let dst = layout(0x5000_0000_0000);
        b.iter(|| {
            next += 1;
            let (sp, dp) = pages(next);
            let plan = plan_kv_equal(&local.kv, &dst, &sp, &dp).unwrap();
            black_box(plan.ops().collect::<Vec<_>>().len())
        })
    });
    g.finish();
    assert!(mgr.live_entries().is_empty(), "{:?}", mgr.live_entries());
}

criterion_group!(benches, bench);
criterion_main!(benches);
