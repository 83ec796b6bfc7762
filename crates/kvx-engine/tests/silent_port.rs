//! A decode whose data port takes connections and never answers the handshake (a stuck process,
//! a middlebox) holds only its own rooms: while the prefill's one transfer worker waits for that
//! session to open (up to the connect timeout), a second decode's room on the same worker is
//! written and succeeds. Real ZMQ inboxes stand in for both decodes' control planes; the silent
//! decode's data port is a real TCP listener that holds its connections; the second decode's is
//! kvx's real tcp receiver over registered memory, whose bytes are checked.

use std::sync::Arc;
use std::time::Duration;

use kvx_bootstrap::sockets::zmq;
use kvx_core::{Chunk, DecodeRegistration, KVPoll, PageSlice, Room, SessionId};
use kvx_engine::engine::PrefillEngine;
use kvx_engine::model::ModelPreset;
use kvx_engine::plane::DataPlane;
use kvx_engine::region::Region;
use kvx_engine::synthetic::prefill_memory;
use kvx_engine::wire::{self, DecodeInbound};

mod common;

fn wait(what: &str, f: impl FnMut() -> bool) {
    common::wait_until(Duration::from_secs(30), what, f);
}

#[test]
fn a_silent_data_port_does_not_hold_another_decodes_room() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let mem = prefill_memory(&layout);
    // One transfer queue: both decodes' rooms go through the same worker.
    let cfg = common::tcp_prefill_config(&layout, 1);
    // Source pages 0 and 1 of every buffer carry a pattern the live decode must receive.
    for (buf, &src) in mem.kv_ptrs.iter().enumerate() {
        let bytes: Vec<u8> = (0..2 * layout.item_len)
            .map(|i| (i as usize * 7 + buf * 13 + 1) as u8)
            .collect();
        mem.kv.copy_in(src, &bytes).unwrap();
    }
    let engine = PrefillEngine::start(cfg, mem.clone(), rt.handle().clone()).unwrap();
    let ctx = zmq::Context::new();

    // The silent decode: its data port accepts and holds every connection.
    let port = common::SilentPort::start();
    let silent_addr = port.addr;
    let silent = common::FakeDecodeInbox::new(&ctx, engine.endpoint());
    let silent_session = SessionId::new(silent_addr.to_string());
    let reg = common::decode_registration(&layout, &silent.me, &silent_session);
    silent.send(wire::encode_registration(&reg).unwrap());

    // The live decode: kvx's tcp receiver over its own KV pool and aux rows.
    let kv = Arc::new(Region::new(layout.pool_bytes() as usize));
    let aux = Arc::new(Region::new(layout.aux_bytes() as usize));
    let plane = rt
        .block_on(DataPlane::tcp_server(
            "127.0.0.1:0",
            1,
            vec![kv.clone(), aux.clone()],
        ))
        .unwrap();
    let live = common::FakeDecodeInbox::new(&ctx, engine.endpoint());
    let live_session = SessionId::new(plane.endpoint());
    let reg = DecodeRegistration::plain(
        live.me.clone(),
        live_session.clone(),
        layout.kv_ptrs(kv.base()),
        layout.aux_ptrs(aux.base()),
        layout.item_len,
    );
    live.send(wire::encode_registration(&reg).unwrap());

    let (stuck, served) = (Room::new(701).unwrap(), Room::new(702).unwrap());
    for (room, decode, session) in [
        (stuck, &silent, &silent_session),
        (served, &live, &live_session),
    ] {
        engine.open_room(room).unwrap();
        let req = common::decode_metadata(room, &decode.me, session, vec![4, 5], 0);
        decode.send(wire::encode_metadata(&req).unwrap());
        wait("metadata", || {
            engine.poll(room) == Some(KVPoll::WaitingForInput)
        });
    }
    let chunk = Chunk::new(PageSlice::new(0, 2).unwrap(), vec![0, 1]).last();
    // The stuck room's batch waits for its session's handshake, which never comes.
    engine.init_room(stuck, 2, 0).unwrap();
    engine.send(stuck, chunk.clone()).unwrap();
    wait("the silent decode's connect", || port.accepted() >= 1);
    // The other decode's room, behind it on the same worker, is written meanwhile.
    engine.init_room(served, 2, 0).unwrap();
    engine.send(served, chunk).unwrap();
    // The prefill tells the live decode its room succeeded.
    let mut status = None;
    wait("the live decode's status", || {
        if let Ok(frames) = live.inbox.recv_multipart(0)
            && let Ok(DecodeInbound::Status {
                room, status: s, ..
            }) = wire::parse_decode_inbound(&frames)
            && room == served
        {
            status = Some(s);
        }
        status.is_some()
    });
    assert_eq!(status, Some(KVPoll::Success));
    assert!(
        !matches!(
            engine.poll(stuck),
            Some(KVPoll::Success | KVPoll::Failed) | None
        ),
        "the silent decode's room ended before the live one's: {:?}",
        engine.poll(stuck)
    );
    // The live decode got the source pages' bytes in its pages 4 and 5.
    let pages = 2 * layout.item_len;
    for (buf, (&src, &dst)) in mem
        .kv_ptrs
        .iter()
        .zip(&layout.kv_ptrs(kv.base()))
        .enumerate()
    {
        let want = mem.kv.to_vec(src, pages).unwrap();
        let got = kv.to_vec(dst + 4 * layout.item_len, pages).unwrap();
        assert_eq!(got, want, "buffer {buf}");
    }
    // The silent decode's room fails once its connect times out.
    wait("the silent decode's room", || {
        matches!(engine.poll(stuck), Some(KVPoll::Failed) | None)
    });
    drop(port);
}
