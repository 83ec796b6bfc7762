//! Proof against a real sglang-style peer: `tests/py/sglang_peer.py` (pyzmq + requests)
//! encodes and parses frames the way sglang's Mooncake connector does. kvx plays the prefill
//! (Python decodes), then the decode (Python prefills); both sides check every frame's bytes.
//! The HTTP check has Python parse the sentinel as sglang does (`PrefillServerInfo(**json)`).

#![allow(clippy::unwrap_used)]

mod py_support;
mod reg_support;

use std::time::Duration;

use kvx_bootstrap::codec::{
    Abort, AbortAck, DecodeInbound, PrefillInbound, TransferStatus, encode_metadata,
    encode_registration,
};
use kvx_bootstrap::http::{
    BootstrapClient, BootstrapServer, RankRegistration, RetryPolicy, RouteQuery, ServerConfig,
};
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions};
use kvx_core::{
    DecodeRegistration, Destination, Endpoint, KVPoll, Room, SessionId, StagingRingInfo,
    TransferRequest,
};
use py_support::{Peer, event_frames, hex_frames};
use serde_json::json;

const ROOM: u64 = 1234567890123456789;
const DUMMY_ROOM: u64 = 987654321;

fn room(n: u64) -> Room {
    Room::new(n).unwrap()
}

/// The registration the peer sends / expects (same values as `REG` in the script).
fn registration(endpoint: Endpoint, session: &str) -> DecodeRegistration {
    DecodeRegistration {
        endpoint,
        session: SessionId::new(session),
        kv_ptrs: vec![0x7F12A0000000, 0x7F12B0000000],
        aux_ptrs: (0..3).map(|i| 0x7F1300000000 + 0x1000 * i).collect(),
        state_ptrs: vec![vec![0x7F1400000000]],
        dst_tp_rank: 0,
        dst_attn_tp_size: 1,
        dst_kv_item_len: 2048,
        state_item_lens: vec![vec![4096]],
        state_dim_per_tensor: vec![vec![128]],
        kv_layer_ids: vec![0, 0],
        state_layer_ids: vec![vec![3]],
        staging: StagingRingInfo::default(),
        dcp_size: 1,
        dcp_rank: 0,
        staging_slot_layer_ids: None,
        kv_item_lens: None,
    }
}

fn metadata(room_id: u64, endpoint: Endpoint, session: &str, dummy: bool) -> TransferRequest {
    TransferRequest {
        room: room(room_id),
        endpoint,
        session: SessionId::new(session),
        dst: (!dummy).then(|| Destination {
            kv_pages: vec![5, 6, 7, 12],
            aux_index: 17,
            state_indices: vec![vec![42]],
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: vec![],
    }
}

/// The prefill rank Python reads back: page size 64, sglang's default load balancing.
fn rank(port: u16) -> RankRegistration {
    RankRegistration {
        page_size: Some(64),
        load_balance_method: Some("follow_bootstrap_room".into()),
        ..reg_support::loopback_rank(1, 0, port)
    }
}

async fn next(inbox: &mut Inbox) -> Vec<Vec<u8>> {
    tokio::time::timeout(Duration::from_secs(30), inbox.recv())
        .await
        .expect("nothing within 30 s")
        .expect("inbox closed")
        .to_vecs()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_checks_the_http_server_like_sglang() {
    let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let room_arg = ROOM.to_string();
    let body = tokio::task::spawn_blocking(move || {
        let mut peer = Peer::spawn("http", &addr, &["--room", &room_arg]);
        let sentinel = peer.expect("sentinel");
        peer.expect("done");
        peer.finish();
        sentinel["body"].as_str().unwrap().to_string()
    })
    .await
    .unwrap();
    // Python checked the bytes against its own json.dumps; check the keys here too.
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v.as_object().unwrap().len(), 15);
    assert_eq!(server.state().lock().registered(), 2);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decode_against_kvx_prefill() {
    decode_peer_against_kvx_prefill("127.0.0.1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decode_against_kvx_prefill_over_ipv6() {
    decode_peer_against_kvx_prefill("::1").await;
}

/// kvx plays a prefill rank on `host` (HTTP server, PULL inbox, PUSH replies); the Python peer
/// plays a decode rank on the same host.
async fn decode_peer_against_kvx_prefill(host: &str) {
    let bind = if host.contains(':') {
        format!("[{host}]:0")
    } else {
        format!("{host}:0")
    };
    let server = BootstrapServer::bind(bind, ServerConfig::default())
        .await
        .unwrap();
    let ctx = zmq::Context::new();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new(host, InboxKind::Prefill)).unwrap();
    let client = BootstrapClient::new(host, server.local_addr().port()).unwrap();
    let mut prefill_rank = rank(inbox.endpoint().port);
    prefill_rank.rank_ip = host.to_string();
    client
        .register_rank(&prefill_rank, &RetryPolicy::sglang())
        .await
        .unwrap();

    let mut peer = Peer::spawn(
        "decode",
        &server.local_addr().to_string(),
        &["--host", host],
    );
    let route = peer.expect("route");
    assert_eq!(
        route["rank"],
        json!({"rank_ip": host, "rank_port": inbox.endpoint().port})
    );
    assert_eq!(route["info"]["page_size"], 64);
    let sent: Vec<Vec<String>> = (0..5).map(|_| event_frames(&peer.expect("sent"))).collect();

    // 1. Registration: byte-identical to kvx's own encoding of the same values.
    let frames = next(&mut inbox).await;
    assert_eq!(hex_frames(&frames), sent[1]);
    let PrefillInbound::Registration(reg) = PrefillInbound::parse(&frames).unwrap() else {
        panic!("not a registration")
    };
    let decode_ep = reg.endpoint.clone();
    assert_eq!(decode_ep.host, host);
    let session = &if host.contains(':') {
        format!("[{host}]:15234")
    } else {
        format!("{host}:15234")
    };
    let expected = registration(decode_ep.clone(), session);
    assert_eq!(*reg, expected);
    assert_eq!(frames.len(), 18);
    assert_eq!(encode_registration(&expected).unwrap(), frames);

    // 2. Metadata for a real destination, 3. for a dummy one.
    for (i, dummy) in [(2, false), (3, true)] {
        let frames = next(&mut inbox).await;
        assert_eq!(hex_frames(&frames), sent[i]);
        let id = if dummy { DUMMY_ROOM } else { ROOM };
        let want = metadata(id, decode_ep.clone(), session, dummy);
        assert_eq!(encode_metadata(&want).unwrap(), frames);
        let PrefillInbound::Metadata(m) = PrefillInbound::parse(&frames).unwrap() else {
            panic!("not metadata")
        };
        assert_eq!(m.is_dummy(), dummy);
        assert_eq!(m.to_request(), want);
    }

    // 4. ABORT.
    let frames = next(&mut inbox).await;
    assert_eq!(hex_frames(&frames), sent[4]);
    let want = Abort {
        room: room(DUMMY_ROOM),
        endpoint: decode_ep.clone(),
        generation: None,
    };
    assert_eq!(Abort::parse(&frames).unwrap(), want);
    assert_eq!(want.encode(), frames);
    // The garbage message the peer sent first was dropped; the loop went on.
    assert_eq!(inbox.stats().dropped(), 1);
    assert_eq!(inbox.stats().received(), 4);

    // Replies over a PUSH socket with sglang's prefill→decode options.
    let status = TransferStatus {
        room: room(ROOM),
        status: KVPoll::Success,
        prefill_rank: 0,
        reason: None,
    }
    .encode();
    let ack = AbortAck {
        room: room(DUMMY_ROOM),
        prefill_rank: None,
        generation: None,
    }
    .encode();
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 16);
    push.send(&decode_ep, &status).unwrap();
    push.send(&decode_ep, &ack).unwrap();

    let peer = tokio::task::spawn_blocking(move || {
        let got = peer.expect("recv");
        assert_eq!(event_frames(&got), hex_frames(&status));
        assert_eq!(
            got["parsed"],
            json!({"kind": "status", "room": ROOM, "status": 4, "prefill_rank": 0})
        );
        let got = peer.expect("recv");
        assert_eq!(event_frames(&got), hex_frames(&ack));
        assert_eq!(
            got["parsed"],
            json!({"kind": "abort_ack", "room": DUMMY_ROOM})
        );
        peer.expect("done");
        peer
    })
    .await
    .unwrap();
    peer.finish();
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_prefill_against_kvx_decode() {
    let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let mut peer = Peer::spawn("prefill", &server.local_addr().to_string(), &[]);
    let registered = peer.expect("registered");
    let py_port = u16::try_from(registered["port"].as_u64().unwrap()).unwrap();

    // The decode's bootstrap: sentinel (strict keys), then the rank's inbox.
    let client = BootstrapClient::new("127.0.0.1", server.local_addr().port()).unwrap();
    let info = client.prefill_info().await.unwrap();
    assert_eq!((info.attn_tp_size, info.page_size), (1, Some(64)));
    assert_eq!(info.kv_cache_dtype.as_deref(), Some("auto"));
    assert!(info.follow_bootstrap_room);
    let inbox_info = client
        .rank_info(RouteQuery {
            dp_rank: 0,
            cp_rank: 0,
            tp_rank: 0,
            pp_rank: 0,
        })
        .await
        .unwrap();
    assert_eq!(inbox_info.rank_port, py_port);
    let prefill_ep = Endpoint::new(inbox_info.rank_ip, inbox_info.rank_port);

    let ctx = zmq::Context::new();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Decode)).unwrap();
    let me = inbox.endpoint().clone();
    let session = "127.0.0.1:15234";
    let reg = encode_registration(&registration(me.clone(), session)).unwrap();
    let meta = encode_metadata(&metadata(ROOM, me.clone(), session, false)).unwrap();
    let abort = Abort {
        room: room(DUMMY_ROOM),
        endpoint: me.clone(),
        generation: None,
    }
    .encode();
    let mut push = PushCache::new(&ctx, PushOptions::toward_prefill(), 16);
    for m in [&reg, &meta, &abort] {
        push.send(&prefill_ep, m).unwrap();
    }

    let (peer, sent) = tokio::task::spawn_blocking({
        let (reg, meta, abort) = (reg.clone(), meta.clone(), abort.clone());
        let port = me.port;
        move || {
            // Python parsed our frames the way sglang's prefill does.
            let got = peer.expect("recv");
            assert_eq!(event_frames(&got), hex_frames(&reg));
            let p = &got["parsed"];
            assert_eq!(p["room"], "None");
            assert_eq!(
                (p["endpoint"].clone(), p["dst_port"].clone()),
                (json!("127.0.0.1"), json!(port))
            );
            assert_eq!(p["kv_ptrs"], json!([0x7F12A0000000u64, 0x7F12B0000000u64]));
            assert_eq!(p["state_ptrs"], json!([[0x7F1400000000u64]]));
            assert_eq!(p["kv_item_len"], 2048);
            assert_eq!(p["state_item_lens"], json!([[4096]]));
            assert_eq!(p["state_dims"], json!([[128]]));
            assert_eq!(p["kv_layer_ids"], json!([0, 0]));
            assert_eq!(p["state_layer_ids"], json!([[3]]));
            assert_eq!(p["staging"], false);
            assert_eq!(
                (p["dcp_size"].clone(), p["dcp_rank"].clone()),
                (json!(1), json!(0))
            );
            assert_eq!(p["frames"], 18);
            let got = peer.expect("recv");
            assert_eq!(event_frames(&got), hex_frames(&meta));
            let p = &got["parsed"];
            assert_eq!(p["room"], ROOM);
            assert_eq!(p["dst_kv_indices"], json!([5, 6, 7, 12]));
            assert_eq!(p["dst_aux_index"], 17);
            assert_eq!(p["dst_state_indices"], json!([[42]]));
            assert_eq!(p["required_dst_info_num"], 1);
            assert_eq!(p["is_dummy"], false);
            assert_eq!(p["decode_prefix_len"], 0);
            let got = peer.expect("recv");
            assert_eq!(event_frames(&got), hex_frames(&abort));
            assert_eq!(got["parsed"]["room"], DUMMY_ROOM);
            let sent: Vec<Vec<String>> =
                (0..6).map(|_| event_frames(&peer.expect("sent"))).collect();
            peer.expect("done");
            (peer, sent)
        }
    })
    .await
    .unwrap();

    // What the Python prefill sent, as the kvx decode inbox sees it (garbage at index 2).
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(next(&mut inbox).await);
    }
    let expected_hex: Vec<&Vec<String>> = sent
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, s)| s)
        .collect();
    for (g, want) in got.iter().zip(&expected_hex) {
        assert_eq!(&hex_frames(g), *want);
    }
    assert_eq!(inbox.stats().dropped(), 1);

    let DecodeInbound::AuxData(aux) = DecodeInbound::parse(&got[0]).unwrap() else {
        panic!("not AUX_DATA")
    };
    assert_eq!(
        (aux.room, aux.aux_index, aux.dst_row, aux.payload),
        (room(ROOM), 0, 17, &[0u8, 1, 2, 3, 4, 5, 6, 7][..])
    );
    let DecodeInbound::Status(st) = DecodeInbound::parse(&got[1]).unwrap() else {
        panic!("not a status")
    };
    assert_eq!(
        (st.room, st.status, st.prefill_rank),
        (room(ROOM), KVPoll::Success, 0)
    );
    assert_eq!(st.encode(), got[1]);
    let DecodeInbound::AbortAck(ack) = DecodeInbound::parse(&got[2]).unwrap() else {
        panic!("not ABORT_ACK")
    };
    assert_eq!(
        ack,
        AbortAck {
            room: room(DUMMY_ROOM),
            prefill_rank: Some(0),
            generation: None,
        }
    );
    assert_eq!(ack.encode(), got[2]);
    let DecodeInbound::Status(failed) = DecodeInbound::parse(&got[3]).unwrap() else {
        panic!("not a status")
    };
    assert_eq!(failed.status, KVPoll::Failed);
    assert_eq!(failed.reason.as_deref(), Some("Aborted by the decode."));
    let DecodeInbound::ChunkReady(cr) = DecodeInbound::parse(&got[4]).unwrap() else {
        panic!("not CHUNK_READY")
    };
    assert_eq!(
        (cr.room, cr.num_pages, cr.prefill_rank),
        (room(ROOM), 4, Some(0))
    );
    assert_eq!(cr.encode(), got[4]);

    push.send(&prefill_ep, &[b"bye"]).unwrap();
    tokio::task::spawn_blocking(move || peer.finish())
        .await
        .unwrap();
    server.shutdown().await.unwrap();
}
