//! Inbox throughput: sglang-shaped metadata messages (10 frames) pushed over loopback TCP into
//! (a) a bare libzmq PULL loop (the baseline: receive and count) and (b) kvx's `Inbox`
//! (receive, classify with the codec, hand over a channel). Both consumers run on their own
//! thread; the ratio b/a is the cost of kvx's checking and hand-off.

#![allow(missing_docs, clippy::unwrap_used)]

use std::sync::mpsc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx_bootstrap::codec::encode_metadata;
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions};
use kvx_core::{Destination, Endpoint, Room, SessionId, TransferRequest};

const BATCH: usize = 10_000;

fn message() -> Vec<Vec<u8>> {
    encode_metadata(&TransferRequest {
        room: Room::new(1234567890123456789).unwrap(),
        endpoint: Endpoint::new("10.0.0.2", 41235),
        session: SessionId::new("10.0.0.2:15234"),
        dst: Some(Destination {
            kv_pages: (0..64).collect(),
            aux_index: 17,
            state_indices: vec![],
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: vec![],
    })
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let ctx = zmq::Context::new();
    let msg = message();
    let mut g = c.benchmark_group("inbox");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(8));

    // (a) bare PULL loop.
    let pull = ctx.socket(zmq::PULL).unwrap();
    pull.set_rcvhwm(0).unwrap();
    pull.bind("tcp://127.0.0.1:*").unwrap();
    let addr = pull.get_last_endpoint().unwrap().unwrap();
    let port: u16 = addr.rsplit_once(':').unwrap().1.parse().unwrap();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut n = 0;
        while let Ok(frames) = pull.recv_multipart(0) {
            std::hint::black_box(&frames);
            n += 1;
            if n % BATCH == 0 && done_tx.send(()).is_err() {
                break;
            }
        }
    });
    let mut push = PushCache::new(&ctx, PushOptions::toward_prefill(), 4);
    let ep = Endpoint::new("127.0.0.1", port);
    g.bench_function("bare_zmq_pull", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                push.send(&ep, &msg).unwrap();
            }
            done_rx.recv().unwrap();
        })
    });

    // (b) kvx Inbox with prefill classification.
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Prefill)).unwrap();
    let kvx_ep = inbox.endpoint().clone();
    let (kdone_tx, kdone_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut n = 0;
        while let Some(m) = inbox.blocking_recv() {
            std::hint::black_box(&m);
            n += 1;
            if n % BATCH == 0 && kdone_tx.send(()).is_err() {
                break;
            }
        }
    });
    g.bench_function("kvx_inbox_prefill", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                push.send(&kvx_ep, &msg).unwrap();
            }
            kdone_rx.recv().unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
