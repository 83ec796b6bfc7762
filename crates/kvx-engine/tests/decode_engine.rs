//! The decode engine embedded as a library: a decode scheduler owns its KV pool and aux rows
//! (plain vectors wrapped with `Region::from_raw`), allocates each room's pages and row itself,
//! opens rooms on a `DecodeEngine` against an in-process `PrefillEngine` and checks every byte
//! it received; a room whose handle is dropped mid-transfer fails with an `ABORT` and gives its
//! pages back only after the prefill's `ABORT_ACK`.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Chunk, KVPoll, PageSlice, Room};
use kvx_engine::decode::engine::{
    DecodeEngine, DecodeEngineConfig, DecodeEngineEvent, DecodeMemory,
};
use kvx_engine::engine::{PrefillConfig, PrefillEngine};
use kvx_engine::model::{KvLayout, ModelPreset};
use kvx_engine::pages::PageAllocator;
use kvx_engine::region::Region;
use kvx_engine::synthetic::SyntheticModel;
use kvx_engine::synthetic::prefill_memory;
use kvx_engine::synthetic::verify_room;

const POOL: u64 = 256;

/// A prefill rank with its bootstrap server, serving the synthetic pattern.
struct Prefill {
    engine: PrefillEngine,
    model: SyntheticModel,
    pages: PageAllocator,
    port: u16,
    _server: kvx_bootstrap::http::BootstrapServer,
}

impl Prefill {
    fn start(rt: &tokio::runtime::Runtime, layout: &KvLayout) -> Prefill {
        let mem = prefill_memory(layout);
        let (server, port) = common::bootstrap_server(rt);
        let cfg = PrefillConfig {
            bootstrap_port: port,
            total_kv_heads: layout.total_kv_heads,
            ..PrefillConfig::default()
        };
        let engine =
            PrefillEngine::start(cfg, mem.clone(), rt.handle().clone()).expect("prefill engine");
        common::register_tiny_rank(rt, port, engine.endpoint().port);
        let model = SyntheticModel {
            layout: layout.clone(),
            kv: mem.kv.clone(),
            aux: mem.aux.clone(),
            chunk_pages: 2,
            pages: PageAllocator::new(POOL, 0.5, 1),
        };
        Prefill {
            engine,
            model,
            pages: PageAllocator::new(POOL, 0.5, 1),
            port,
            _server: server,
        }
    }

    /// The forward pass of one room whose metadata arrived: KV written, sent in 2-page chunks.
    fn serve(&mut self, room: Room, n: usize, row: u64) {
        let src = self.pages.alloc(n).expect("prefill pages");
        self.model.fill(room, &src, row);
        self.engine.init_room(room, n, row).expect("init_room");
        for start in (0..n).step_by(2) {
            let end = (start + 2).min(n);
            let mut c = Chunk::new(
                PageSlice::new(start, end).expect("slice"),
                src[start..end].to_vec(),
            );
            if end == n {
                c = c.last();
            }
            self.engine.send(room, c).expect("send");
        }
    }
}

/// The decode scheduler's own memory, handed to the engine by address.
struct Owned {
    kv: Vec<u8>,
    aux: Vec<u8>,
}

impl Owned {
    fn new(layout: &KvLayout) -> Owned {
        Owned {
            kv: vec![0; layout.pool_bytes() as usize],
            aux: vec![0; layout.aux_bytes() as usize],
        }
    }

    fn memory(&mut self) -> DecodeMemory {
        // SAFETY: the vectors outlive the engine (each test shuts it down before they drop) and
        // are touched only through these regions.
        let (kv, aux) = unsafe {
            (
                Region::from_raw(self.kv.as_mut_ptr() as u64, self.kv.len()).expect("kv"),
                Region::from_raw(self.aux.as_mut_ptr() as u64, self.aux.len()).expect("aux"),
            )
        };
        DecodeMemory::new(Arc::new(kv), Arc::new(aux))
    }
}

fn next_event(
    rx: &std::sync::mpsc::Receiver<DecodeEngineEvent>,
    prefill: &mut Prefill,
    pending: &mut Vec<(Room, usize)>,
) -> DecodeEngineEvent {
    let t0 = Instant::now();
    loop {
        assert!(t0.elapsed() < Duration::from_secs(60), "hang guard");
        pending.retain(|&(room, n)| {
            if prefill.engine.poll(room) != Some(KVPoll::WaitingForInput) {
                return true;
            }
            prefill.serve(room, n, room.get() - 1000);
            false
        });
        if let Ok(e) = rx.recv_timeout(Duration::from_millis(5)) {
            return e;
        }
    }
}

#[test]
fn embedded_decode_engine_receives_rooms_into_caller_memory() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, POOL);
    let mut prefill = Prefill::start(&rt, &layout);
    let mut owned = Owned::new(&layout);
    let mem = owned.memory();
    let (kv, aux) = (mem.kv.clone(), mem.aux.clone());
    let engine = DecodeEngine::start(
        DecodeEngineConfig::new(layout.clone()),
        mem,
        rt.handle().clone(),
    )
    .unwrap();
    let events = engine.take_events().unwrap();
    let addr = format!("127.0.0.1:{}", prefill.port);

    // The scheduler's allocator: fragmented pages, one aux row per room.
    let mut alloc = PageAllocator::new(POOL, 0.5, 9);
    let rooms: Vec<Room> = (1000..1006).map(|r| Room::new(r).unwrap()).collect();
    let mut handles = HashMap::new();
    let mut held = HashMap::new();
    let mut pending = Vec::new();
    for (i, &room) in rooms.iter().enumerate() {
        prefill.engine.open_room(room).unwrap();
        let tokens = 100 + 40 * i as u64;
        let n = layout.pages_for(tokens) as usize;
        let pages = alloc.alloc(n).unwrap();
        let row = i as u64 + 3;
        let h = engine.open_room(room, &addr, pages.clone(), row).unwrap();
        assert!(matches!(
            h.poll(),
            KVPoll::Bootstrapping | KVPoll::WaitingForInput
        ));
        handles.insert(room, h);
        held.insert(room, (pages, row));
        pending.push((room, n));
    }
    assert!(
        engine.open_room(rooms[0], &addr, vec![0], 0).is_err(),
        "room open twice"
    );
    assert!(
        engine
            .open_room(Room::new(7).unwrap(), &addr, vec![POOL as i32], 0)
            .is_err()
    );

    let mut verified = 0;
    let mut released = 0;
    while released < rooms.len() {
        match next_event(&events, &mut prefill, &mut pending) {
            DecodeEngineEvent::Done {
                room,
                status,
                reason,
            } => {
                assert_eq!(status, KVPoll::Success, "{room}: {reason:?}");
                assert_eq!(engine.poll(room), Some(KVPoll::Success));
                let (pages, row) = &held[&room];
                let bytes = verify_room(&layout, &kv, &aux, room, pages, *row);
                assert!(bytes.is_some(), "{room}: bytes differ from the pattern");
                verified += 1;
            }
            DecodeEngineEvent::Released { room, acked } => {
                assert!(!acked);
                let (pages, _) = held.remove(&room).unwrap();
                alloc.free(&pages);
                released += 1;
            }
        }
    }
    assert_eq!(verified, rooms.len());
    // The async face: a finished room's handle resolves at once.
    let h = &handles[&rooms[0]];
    assert_eq!(rt.block_on(h.wait()), (KVPoll::Success, None));
    assert!(!rt.block_on(h.wait_released()));
    drop(handles);
    assert_eq!(
        engine.poll(rooms[0]),
        None,
        "released and dropped: forgotten"
    );
    assert_eq!(engine.live_rooms(), 0);
    engine.shutdown();
    drop(engine);
    prefill.engine.shutdown();
    drop(owned);
}

#[test]
fn dropping_a_handle_mid_room_aborts_it_and_releases_after_the_ack() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, POOL);
    let prefill = Prefill::start(&rt, &layout);
    let mut owned = Owned::new(&layout);
    let cfg = DecodeEngineConfig {
        // Far beyond the test's guards: a release within them came from the ACK.
        abort_release_timeout: Duration::from_secs(120),
        ..DecodeEngineConfig::new(layout.clone())
    };
    let engine = DecodeEngine::start(cfg, owned.memory(), rt.handle().clone()).unwrap();
    let events = engine.take_events().unwrap();
    let addr = format!("127.0.0.1:{}", prefill.port);
    let room = Room::new(1000).unwrap();
    prefill.engine.open_room(room).unwrap();
    let h = engine.open_room(room, &addr, vec![5, 6, 7], 1).unwrap();

    // The metadata reached the prefill; its forward pass never runs the room.
    common::wait_until(Duration::from_secs(30), "metadata at the prefill", || {
        prefill.engine.poll(room) == Some(KVPoll::WaitingForInput)
            && h.poll() == KVPoll::WaitingForInput
    });
    let dropped = Instant::now();
    drop(h);

    let guard = Duration::from_secs(30);
    let e = events.recv_timeout(guard).expect("Done");
    let DecodeEngineEvent::Done {
        room: r,
        status,
        reason,
    } = e
    else {
        panic!("expected Done first, got {e:?}");
    };
    assert_eq!((r, status), (room, KVPoll::Failed));
    assert!(reason.unwrap().contains("handle dropped"));
    // Failed, but the pages are still held: the room is live until released.
    assert_eq!(engine.poll(room), Some(KVPoll::Failed));
    assert_eq!(engine.live_rooms(), 1);

    let e = events.recv_timeout(guard).expect("Released");
    let released = dropped.elapsed();
    assert_eq!(e, DecodeEngineEvent::Released { room, acked: true });
    // The ABORT reached the prefill, which failed the room and acknowledged it; the pages came
    // back only after the ACK and the late-write window that follows it, long before the
    // release timeout.
    assert!(matches!(
        prefill.engine.poll(room),
        Some(KVPoll::Failed) | None
    ));
    assert!(
        released >= Duration::from_millis(200) && released < Duration::from_secs(30),
        "{released:?}"
    );
    assert_eq!(engine.poll(room), None);
    assert_eq!(engine.live_rooms(), 0);
    engine.shutdown();
    drop(engine);
    prefill.engine.shutdown();
    drop(owned);
}

#[test]
fn an_unreachable_prefill_fails_the_room_and_releases_its_pages_at_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, POOL);
    let mut owned = Owned::new(&layout);
    let cfg = DecodeEngineConfig {
        bootstrap_tries: 1,
        ..DecodeEngineConfig::new(layout.clone())
    };
    let engine = DecodeEngine::start(cfg, owned.memory(), rt.handle().clone()).unwrap();
    let addr = format!("127.0.0.1:{}", common::free_port());
    let room = Room::new(77).unwrap();
    assert!(engine.open_room(room, "no-port", vec![1], 0).is_err());
    let h = engine.open_room(room, &addr, vec![1, 2], 0).unwrap();
    let (status, reason) = rt.block_on(h.wait());
    assert_eq!(status, KVPoll::Failed);
    assert!(reason.unwrap().contains("unreachable"));
    // Nothing was sent for the room: its pages come back without waiting for anything.
    assert!(!rt.block_on(h.wait_released()));
    drop(h);
    assert_eq!(engine.live_rooms(), 0);
    engine.shutdown();
    drop(engine);
    drop(owned);
}

/// `AUX_DATA` is written only into the row its room holds while the room is open: a row naming
/// another row, or a room not open here (never opened, or concluded — its row may be another
/// room's by now), is dropped and counted, and the decode's rows stay as they were.
#[test]
fn aux_data_lands_only_in_the_row_its_open_room_holds() {
    use kvx_bootstrap::sockets::zmq;
    use kvx_engine::model::SGLANG_AUX_ROW_LENS;

    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, POOL);
    let prefill = Prefill::start(&rt, &layout);
    let mut owned = Owned::new(&layout);
    let mem = owned.memory();
    let aux = mem.aux.clone();
    let engine = DecodeEngine::start(
        DecodeEngineConfig::new(layout.clone()),
        mem,
        rt.handle().clone(),
    )
    .unwrap();
    let addr = format!("127.0.0.1:{}", prefill.port);
    let room = Room::new(4242).unwrap();
    prefill.engine.open_room(room).unwrap();
    let h = engine.open_room(room, &addr, vec![5, 6], 3).unwrap();
    common::wait_until(Duration::from_secs(30), "metadata sent", || {
        h.poll() == KVPoll::WaitingForInput
    });

    // A prefill's AUX_DATA messages, straight to the decode's inbox (buffer 0, 64-byte rows).
    let ctx = zmq::Context::new();
    let push = ctx.socket(zmq::PUSH).unwrap();
    push.connect(&engine.endpoint().zmq_addr()).unwrap();
    let row_len = SGLANG_AUX_ROW_LENS[0] as usize;
    let send = |room: Room, row: u64, byte: u8| {
        let frames = kvx_engine::wire::encode_aux_data(room, 0, row, &vec![byte; row_len]).unwrap();
        push.send_multipart(frames, 0).unwrap();
    };
    let row_bytes = |row: u64| {
        let at = layout.aux_ptrs(aux.base())[0] + row * row_len as u64;
        aux.to_vec(at, row_len as u64).unwrap()
    };
    let other = Room::new(9999).unwrap();
    send(room, 4, 0xAA); // another row than the room's
    send(other, 3, 0xBB); // a room not open here, naming this room's row
    send(room, 3, 0xCC); // the room's own row: written
    common::wait_until(Duration::from_secs(10), "the room's row written", || {
        row_bytes(3) == vec![0xCC; row_len]
    });
    assert_eq!(
        row_bytes(4),
        vec![0; row_len],
        "a row the room does not hold"
    );
    assert_eq!(engine.stats().dropped_messages, 2);

    // Concluded (the handle dropped: failed, ABORTed): its row is no longer its own.
    drop(h);
    common::wait_until(Duration::from_secs(30), "room concluded", || {
        engine.open_rooms().is_empty()
    });
    send(room, 3, 0xDD);
    common::wait_until(Duration::from_secs(10), "late row dropped", || {
        engine.stats().dropped_messages == 3
    });
    assert_eq!(row_bytes(3), vec![0xCC; row_len]);
    engine.shutdown();
    drop(engine);
    prefill.engine.shutdown();
    drop(owned);
}
