//! A room's metadata opens the data session its writes will take before the forward pass hands
//! the first chunk over: the connection handshake (one per transfer queue, and again after the
//! session idled out) is off the room's transfer window. A real ZMQ decode inbox and a real TCP
//! listener stand in for the decode; the listener counts every connect.

use std::time::Duration;

use kvx_bootstrap::sockets::zmq;
use kvx_core::{KVPoll, Room, SessionId};
use kvx_engine::engine::PrefillEngine;
use kvx_engine::model::ModelPreset;
use kvx_engine::synthetic::prefill_memory;
use kvx_engine::wire;

mod common;

#[test]
fn metadata_opens_the_data_session_before_the_first_chunk() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let cfg = common::tcp_prefill_config(&layout, 2);
    let engine = PrefillEngine::start(cfg, prefill_memory(&layout), rt.handle().clone()).unwrap();

    // The decode's data plane: counts connects and holds them (their handshake waits).
    let data = common::SilentPort::start();
    let data_addr = data.addr;
    // The decode's control plane.
    let ctx = zmq::Context::new();
    let decode = common::FakeDecodeInbox::new(&ctx, engine.endpoint());
    let me = decode.me.clone();
    let session = SessionId::new(data_addr.to_string());
    let reg = common::decode_registration(&layout, &me, &session);
    decode.send(wire::encode_registration(&reg).unwrap());
    // Registering opens nothing: which queue carries a room is known from its metadata.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(data.accepted(), 0);

    // Two rooms on the two queues (the queue is the session's port plus the room, modulo 2).
    let port = u64::from(data_addr.port());
    let rooms = [
        Room::new(port + 100).unwrap(),
        Room::new(port + 101).unwrap(),
    ];
    for (i, &room) in rooms.iter().enumerate() {
        engine.open_room(room).unwrap();
        let req = common::decode_metadata(room, &me, &session, vec![i as i32], i as i64);
        decode.send(wire::encode_metadata(&req).unwrap());
    }
    // No chunk was handed over, yet each queue's worker has connected.
    common::wait_until(Duration::from_secs(30), "a connect per queue", || {
        data.accepted() == 2
    });
    for room in rooms {
        assert_eq!(engine.poll(room), Some(KVPoll::WaitingForInput));
    }
    // The decode goes away: the held handshakes end and the engine shuts down cleanly.
    data.held.lock().unwrap().clear();
    engine.shutdown();
}
