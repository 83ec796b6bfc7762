//! The prefill engine embedded as a library: the embedder opens rooms before the decode's
//! metadata arrives, initialises them once ready, writes its KV and hands chunks over, exactly as
//! a serving engine's forward pass would; an in-process decode peer verifies every byte.

mod common;

use std::time::{Duration, Instant};

use kvx_cli::decode::{self, DecodeConfig};
use kvx_core::{Chunk, KVPoll, PageSlice, Room};
use kvx_engine::engine::{PrefillConfig, PrefillEngine};
use kvx_engine::model::ModelPreset;
use kvx_engine::pages::PageAllocator;
use kvx_engine::synthetic::SyntheticModel;
use kvx_engine::synthetic::prefill_memory;

#[test]
fn embedded_sender_serves_a_decode() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 256);
    let mem = prefill_memory(&layout);
    let (server, port) = common::bootstrap_server(&rt);
    let cfg = PrefillConfig {
        bootstrap_port: port,
        total_kv_heads: layout.total_kv_heads,
        ..PrefillConfig::default()
    };
    let engine = PrefillEngine::start(cfg, mem.clone(), rt.handle().clone()).unwrap();
    common::register_tiny_rank(&rt, port, 256, engine.endpoint().port);

    // The router hands rooms 1000..1006 to both sides; the prefill's requests exist first.
    let rooms: Vec<Room> = (1000..1006).map(|r| Room::new(r).unwrap()).collect();
    for &r in &rooms {
        engine.open_room(r).unwrap();
        assert_eq!(engine.poll(r), Some(KVPoll::Bootstrapping));
    }
    let dcfg = DecodeConfig {
        requests: rooms.len(),
        prompt_tokens: (100, 100),
        concurrency: rooms.len(),
        waiting_timeout: Duration::from_secs(60),
        seed: 7,
        room_base: Some(1000),
        ..DecodeConfig::new("127.0.0.1", port, layout.clone())
    };
    let decode = rt.spawn(decode::run(dcfg));

    // The forward pass: once a room's metadata is complete, write its KV and send it in chunks.
    let model = SyntheticModel {
        layout: layout.clone(),
        kv: mem.kv.clone(),
        aux: mem.aux.clone(),
        chunk_pages: 2,
        pages: PageAllocator::new(256, 0.5, 1),
    };
    let mut pages = PageAllocator::new(256, 0.5, 1);
    let mut pending = rooms.clone();
    let t0 = Instant::now();
    while !pending.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(60), "hang guard");
        pending.retain(|&room| {
            if engine.poll(room) != Some(KVPoll::WaitingForInput) {
                return true;
            }
            let n = layout.pages_for(100) as usize;
            let src = pages.alloc(n).unwrap();
            let row = room.get() - 1000;
            model.fill(room, &src, row);
            engine.init_room(room, n, row).unwrap();
            for start in (0..n).step_by(2) {
                let end = (start + 2).min(n);
                let mut c = Chunk::new(
                    PageSlice::new(start, end).unwrap(),
                    src[start..end].to_vec(),
                );
                if end == n {
                    c = c.last();
                }
                engine.send(room, c).unwrap();
            }
            false
        });
        std::thread::sleep(Duration::from_millis(5));
    }
    let summary = rt.block_on(decode).unwrap().unwrap();
    assert_eq!(summary.verified, rooms.len(), "{summary:?}");
    assert_eq!(summary.failed, 0);
    // Every room concluded and drained: nothing per-room is left on the prefill.
    let t0 = Instant::now();
    while engine.live_rooms() > 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "hang guard");
        std::thread::sleep(Duration::from_millis(10));
    }
    engine.shutdown();
    drop(server);
}

#[test]
fn a_room_the_embedder_fails_reaches_its_decode_with_the_reason() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 256);
    let mem = prefill_memory(&layout);
    let (server, port) = common::bootstrap_server(&rt);
    let cfg = PrefillConfig {
        bootstrap_port: port,
        total_kv_heads: layout.total_kv_heads,
        ..PrefillConfig::default()
    };
    let engine = PrefillEngine::start(cfg, mem.clone(), rt.handle().clone()).unwrap();
    common::register_tiny_rank(&rt, port, 256, engine.endpoint().port);
    let rooms: Vec<Room> = (2000..2004).map(|r| Room::new(r).unwrap()).collect();
    for &r in &rooms {
        engine.open_room(r).unwrap();
    }
    // The decode would wait 30 s for a room nobody told it about; the test ends well before.
    let dcfg = DecodeConfig {
        requests: rooms.len(),
        prompt_tokens: (100, 100),
        concurrency: rooms.len(),
        waiting_timeout: Duration::from_secs(30),
        seed: 7,
        room_base: Some(2000),
        ..DecodeConfig::new("127.0.0.1", port, layout.clone())
    };
    let t0 = Instant::now();
    let decode = rt.spawn(decode::run(dcfg));
    let mut pending = rooms.clone();
    while !pending.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "hang guard");
        pending.retain(|&room| {
            if engine.poll(room) != Some(KVPoll::WaitingForInput) {
                return true;
            }
            assert!(engine.fail_room(room, "the embedder gave up on this request"));
            // Failed, and released at once (nothing of it was in flight).
            assert!(matches!(engine.poll(room), Some(KVPoll::Failed) | None));
            false
        });
        std::thread::sleep(Duration::from_millis(5));
    }
    let summary = rt.block_on(decode).unwrap().unwrap();
    assert_eq!(summary.failed, rooms.len(), "{summary:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the decode learnt of the failures only from its timeout: {summary:?}"
    );
    let reasons = format!("{:?}", summary.failure_reasons);
    assert!(
        reasons.contains("the embedder gave up on this request"),
        "{reasons}"
    );
    engine.shutdown();
    drop(server);
}
