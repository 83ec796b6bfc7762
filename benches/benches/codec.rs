//! Codec benchmark: per-request metadata messages (spec §3.2) parsed and encoded, the control
//! plane's hot path. Two shapes: the spec's example (4 pages) and a 2048-page request (page size
//! 1, 2k-token prompt, 8 KiB page frame). Throughput is in messages.
//!
//! Baseline, measured in the same run: cloning the message's frames (one allocation and copy
//! per frame), i.e. what merely taking ownership of the frames costs.
#![allow(clippy::unwrap_used)] // fixed, valid bench fixtures: a failure is a bench bug
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx_bootstrap::codec::{MetadataRef, PrefillInbound, TransferStatus, encode_metadata};
use kvx_core::{Destination, Endpoint, KVPoll, Room, SessionId, TransferRequest};

fn request(pages: i32) -> TransferRequest {
    TransferRequest {
        room: Room::new(1_234_567_890_123_456_789).unwrap(),
        endpoint: Endpoint::new("10.0.0.2", 41235),
        session: SessionId::new("10.0.0.2:15234"),
        dst: Some(Destination {
            kv_pages: (0..pages).map(|i| 5 + i * 3).collect(),
            aux_index: 17,
            state_indices: vec![],
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: vec![],
    }
}

fn bench(c: &mut Criterion) {
    for (name, pages) in [("metadata_4_pages", 4), ("metadata_2048_pages", 2048)] {
        let req = request(pages);
        let frames = encode_metadata(&req).unwrap();
        let mut g = c.benchmark_group(name);
        g.throughput(Throughput::Elements(1));
        g.bench_function("baseline_clone_frames", |b| {
            b.iter(|| black_box(&frames).clone())
        });
        g.bench_function("parse_borrowed", |b| {
            b.iter(|| MetadataRef::parse(black_box(&frames)).unwrap().room)
        });
        g.bench_function("parse_borrowed_sum_pages", |b| {
            b.iter(|| {
                let m = MetadataRef::parse(black_box(&frames)).unwrap();
                m.dst
                    .map_or(0i64, |d| d.kv_pages.iter().map(i64::from).sum())
            })
        });
        g.bench_function("classify_prefill_inbox", |b| {
            b.iter(|| PrefillInbound::parse(black_box(&frames)).unwrap().kind())
        });
        g.bench_function("parse_owned", |b| {
            b.iter(|| MetadataRef::parse(black_box(&frames)).unwrap().to_request())
        });
        g.bench_function("encode", |b| {
            b.iter(|| encode_metadata(black_box(&req)).unwrap())
        });
        g.finish();
    }

    let status = TransferStatus {
        room: Room::new(1_234_567_890_123_456_789).unwrap(),
        status: KVPoll::Success,
        prefill_rank: 3,
        reason: None,
    };
    let sframes = status.encode();
    let mut g = c.benchmark_group("status");
    g.throughput(Throughput::Elements(1));
    g.bench_function("encode", |b| b.iter(|| black_box(&status).encode()));
    g.bench_function("parse", |b| {
        b.iter(|| TransferStatus::parse(black_box(&sframes)).unwrap().room)
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
