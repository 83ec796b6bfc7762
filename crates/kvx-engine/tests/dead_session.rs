//! A decode session found dead fails every room that writes to it at once: batches already
//! queued for the same session do not each try a fresh data-plane connect (which, towards a host
//! that is gone, would cost a connect timeout per batch), and rooms still waiting for their
//! forward pass fail without one. A real ZMQ decode inbox and a real TCP listener stand in for
//! the decode; the listener counts every connect attempt.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_bootstrap::sockets::zmq;
use kvx_core::{Chunk, KVPoll, PageSlice, Room, SessionId};
use kvx_engine::engine::PrefillEngine;
use kvx_engine::model::ModelPreset;
use kvx_engine::synthetic::prefill_memory;
use kvx_engine::wire::{self, DecodeInbound};

mod common;

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(30), "hang guard: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn rooms_of_a_dead_session_fail_at_once_without_reconnecting() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let mem = prefill_memory(&layout);
    // One queue and one connection per session: the second room's batch waits behind the first.
    // kvx's tcp backend, so that each session open is one connect (`auto` probes first).
    let cfg = common::tcp_prefill_config(&layout, 1);
    let engine = PrefillEngine::start(cfg, mem, rt.handle().clone()).unwrap();

    // The decode's data plane: holds the first connection open (its handshake waits) until
    // released, then closes it and every later one at once.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let data_addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(AtomicBool::new(false));
    let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
    {
        let (accepted, release, held) = (accepted.clone(), release.clone(), held.clone());
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                accepted.fetch_add(1, Ordering::SeqCst);
                if !release.load(Ordering::SeqCst) {
                    held.lock().unwrap().push(s);
                }
            }
        });
    }

    // The decode's control plane: a real PULL inbox and a PUSH to the prefill.
    let ctx = zmq::Context::new();
    let decode = common::FakeDecodeInbox::new(&ctx, engine.endpoint());
    let (inbox, me) = (&decode.inbox, decode.me.clone());
    let session = SessionId::new(data_addr.to_string());
    let reg = common::decode_registration(&layout, &me, &session);
    decode.send(wire::encode_registration(&reg).unwrap());
    // Rooms A and B get chunks; room C is ready but its forward pass has not run yet.
    let rooms = [Room::new(501).unwrap(), Room::new(502).unwrap()];
    let waiting = Room::new(503).unwrap();
    for (i, &room) in rooms.iter().chain([&waiting]).enumerate() {
        engine.open_room(room).unwrap();
        let req = common::decode_metadata(
            room,
            &me,
            &session,
            vec![2 * i as i32, 2 * i as i32 + 1],
            i as i64,
        );
        decode.send(wire::encode_metadata(&req).unwrap());
    }
    for &room in rooms.iter().chain([&waiting]) {
        wait("metadata", || {
            engine.poll(room) == Some(KVPoll::WaitingForInput)
        });
    }
    let chunk =
        |first: i32| Chunk::new(PageSlice::new(0, 2).unwrap(), vec![first, first + 1]).last();

    // Room A's metadata had the worker connect (the session is opened ahead of the forward
    // pass); the handshake hangs while room A's and room B's batches queue behind it.
    engine.init_room(rooms[0], 2, 0).unwrap();
    engine.send(rooms[0], chunk(10)).unwrap();
    wait("first connect", || accepted.load(Ordering::SeqCst) == 1);
    engine.init_room(rooms[1], 2, 1).unwrap();
    engine.send(rooms[1], chunk(20)).unwrap();
    // The decode dies: the held connection closes, every later one is refused at once.
    release.store(true, Ordering::SeqCst);
    held.lock().unwrap().clear();

    // Room C fails with them although no chunk of it ever reached a worker.
    for &room in rooms.iter().chain([&waiting]) {
        wait("rooms failed", || {
            matches!(engine.poll(room), Some(KVPoll::Failed) | None)
        });
    }
    // The decode is told about every room.
    let mut failed = Vec::new();
    wait("every status", || {
        if let Ok(frames) = inbox.recv_multipart(0)
            && let Ok(DecodeInbound::Status { room, status, .. }) =
                wire::parse_decode_inbound(&frames)
        {
            assert_eq!(status, KVPoll::Failed);
            failed.push(room);
        }
        failed.len() == 3
    });
    failed.sort();
    assert_eq!(failed, [rooms[0], rooms[1], waiting]);
    // One connect in all: the failed open marked the session dead, and both batches failed on
    // that mark without a connect of their own.
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}
