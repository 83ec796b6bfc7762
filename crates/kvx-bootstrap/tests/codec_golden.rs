//! Golden byte vectors: every example of the wire spec (§3.1–§3.7 and the packed-int-lists
//! examples), parsed into typed values and encoded back to exactly the same bytes.

#![allow(clippy::unwrap_used)]

use kvx_bootstrap::codec::{
    Abort, AbortAck, AuxData, ChunkReady, DecodeInbound, MetadataRef, PrefillInbound, StagingReq,
    StagingRsp, TransferStatus, Watermark, encode_metadata, encode_packed, encode_registration,
    parse_metadata, parse_registration,
};
use kvx_core::{
    DecodeRegistration, Destination, Endpoint, KVPoll, Room, SessionId, StagingRingInfo,
    TransferRequest,
};

const ROOM: &[u8] = b"1234567890123456789";

fn room() -> Room {
    Room::new(1_234_567_890_123_456_789).unwrap()
}

fn frames(parts: &[&[u8]]) -> Vec<Vec<u8>> {
    parts.iter().map(|p| p.to_vec()).collect()
}

fn aux_ptrs() -> Vec<u64> {
    (0..10).map(|i| 0x7f12_c000_0000 + i * 0x1000).collect()
}

/// §3.1: 1 layer MHA → 2 KV buffers, 10 aux buffers, no state, no staging, TP1, DCP1.
fn registration_frames() -> Vec<Vec<u8>> {
    let f5: Vec<u8> = aux_ptrs().iter().flat_map(|p| p.to_le_bytes()).collect();
    let mut f = frames(&[
        b"None",
        b"10.0.0.2",
        b"41235",
        b"10.0.0.2:15234",
        &[
            0x00, 0x00, 0x00, 0xa0, 0x12, 0x7f, 0x00, 0x00, 0x00, 0x00, 0x00, 0xb0, 0x12, 0x7f,
            0x00, 0x00,
        ],
        &f5,
        b"",
        b"0",
        b"1",
        b"2048",
        b"",
        b"",
        b"",
        b"",
        b"",
        b"",
        b"1",
        b"0",
    ]);
    assert_eq!(f[0], [0x4e, 0x6f, 0x6e, 0x65]);
    f.shrink_to_fit();
    f
}

fn registration_value() -> DecodeRegistration {
    DecodeRegistration {
        endpoint: Endpoint::new("10.0.0.2", 41235),
        session: SessionId::new("10.0.0.2:15234"),
        kv_ptrs: vec![0x7f12_a000_0000, 0x7f12_b000_0000],
        aux_ptrs: aux_ptrs(),
        state_ptrs: vec![],
        dst_tp_rank: 0,
        dst_attn_tp_size: 1,
        dst_kv_item_len: 2048,
        state_item_lens: vec![],
        state_dim_per_tensor: vec![],
        kv_layer_ids: vec![],
        state_layer_ids: vec![],
        staging: StagingRingInfo::default(),
        dcp_size: 1,
        dcp_rank: 0,
        staging_slot_layer_ids: None,
        kv_item_lens: None,
    }
}

#[test]
fn registration_example_k_form() {
    let f = registration_frames();
    let reg = parse_registration(&f).unwrap();
    assert_eq!(reg, registration_value());
    assert_eq!(encode_registration(&reg).unwrap(), f);
    assert!(matches!(
        PrefillInbound::parse(&f).unwrap(),
        PrefillInbound::Registration(r) if *r == reg
    ));
}

#[test]
fn registration_example_l_form_with_frame_18() {
    let mut f = registration_frames();
    f.push(Vec::new());
    let reg = parse_registration(&f).unwrap();
    assert_eq!(reg.staging_slot_layer_ids, Some(vec![]));
    assert_eq!(encode_registration(&reg).unwrap(), f);
    f[18] = [3u64, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
    let reg = parse_registration(&f).unwrap();
    assert_eq!(reg.staging_slot_layer_ids, Some(vec![3, 7]));
    assert_eq!(encode_registration(&reg).unwrap(), f);
}

/// sglang 0.5.23's `build_receiver_registration_message`: 20 frames, frame 18 the (empty)
/// staging slot ids, frame 19 `struct.pack("2Q", 2048, 2048)`, one item length per KV buffer.
#[test]
fn registration_example_0523_form_with_frames_18_and_19() {
    let mut f = registration_frames();
    f.push(Vec::new());
    f.push(vec![
        0x00, 0x08, 0, 0, 0, 0, 0, 0, //
        0x00, 0x08, 0, 0, 0, 0, 0, 0,
    ]);
    let reg = parse_registration(&f).unwrap();
    let want = DecodeRegistration {
        staging_slot_layer_ids: Some(vec![]),
        kv_item_lens: Some(vec![2048, 2048]),
        ..registration_value()
    };
    assert_eq!(reg, want);
    assert!(reg.accepts_status_reason());
    assert!(!registration_value().accepts_status_reason());
    assert_eq!(encode_registration(&reg).unwrap(), f);
    // A pool without full-token KV sends `struct.pack("0Q")`: an empty frame 19.
    f[19].clear();
    let reg = parse_registration(&f).unwrap();
    assert_eq!(reg.kv_item_lens, Some(vec![]));
    assert!(reg.accepts_status_reason());
    assert_eq!(encode_registration(&reg).unwrap(), f);
    // Item lengths without slot ids still put frame 18 (empty) on the wire.
    let only_lens = DecodeRegistration {
        kv_item_lens: Some(vec![7]),
        ..registration_value()
    };
    let g = encode_registration(&only_lens).unwrap();
    assert_eq!(g.len(), 20);
    assert!(g[18].is_empty());
    assert_eq!(g[19], 7u64.to_le_bytes());
}

#[test]
fn registration_older_and_tolerant_forms() {
    // Frames 10–17 are optional: a 10-frame registration gets the defaults.
    let f = registration_frames();
    let reg = parse_registration(&f[..10]).unwrap();
    assert_eq!(reg, registration_value());
    // Staging advertised: an 8-byte base and a size.
    let mut g = f.clone();
    g[14] = 0x7f00_0000_1000u64.to_le_bytes().to_vec();
    g[15] = b"16777216".to_vec();
    let reg = parse_registration(&g).unwrap();
    assert_eq!(
        reg.staging,
        StagingRingInfo {
            base: Some(0x7f00_0000_1000),
            size: Some(16_777_216)
        }
    );
    assert!(reg.staging.advertised());
    assert_eq!(encode_registration(&reg).unwrap(), g);
    // A frame 14 that is not 8 bytes means "no ring", not an error.
    g[14] = vec![1, 2, 3];
    g[15] = Vec::new();
    assert!(!parse_registration(&g).unwrap().staging.advertised());
    // Empty DCP frames take the defaults.
    let mut h = f.clone();
    h[16].clear();
    h[17].clear();
    let reg = parse_registration(&h).unwrap();
    assert_eq!((reg.dcp_size, reg.dcp_rank), (1, 0));
    // With state and layer ids.
    let mut reg = registration_value();
    reg.state_ptrs = vec![vec![0x1000, 0x2000], vec![]];
    reg.state_item_lens = vec![vec![64, 128], vec![]];
    reg.state_dim_per_tensor = vec![vec![4, 8], vec![]];
    reg.kv_layer_ids = vec![0, 0];
    reg.state_layer_ids = vec![vec![1, 3]];
    let enc = encode_registration(&reg).unwrap();
    assert_eq!(
        enc[6],
        [
            2, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x20, 0, 0, 0, 0, 0,
            0
        ]
    );
    assert_eq!(enc[12], [0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(parse_registration(&enc).unwrap(), reg);
}

fn metadata_frames() -> Vec<Vec<u8>> {
    frames(&[
        ROOM,
        b"10.0.0.2",
        b"41235",
        b"10.0.0.2:15234",
        &[
            0x05, 0x00, 0x00, 0x00, 0x06, 0x00, 0x00, 0x00, 0x07, 0x00, 0x00, 0x00, 0x0c, 0x00,
            0x00, 0x00,
        ],
        b"17",
        b"",
        b"1",
        b"0",
        b"",
    ])
}

fn metadata_value() -> TransferRequest {
    TransferRequest {
        room: room(),
        endpoint: Endpoint::new("10.0.0.2", 41235),
        session: SessionId::new("10.0.0.2:15234"),
        dst: Some(Destination {
            kv_pages: vec![5, 6, 7, 12],
            aux_index: 17,
            state_indices: vec![],
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: vec![],
    }
}

#[test]
fn metadata_example() {
    let f = metadata_frames();
    let m = MetadataRef::parse(&f).unwrap();
    assert_eq!(m.room, room());
    assert_eq!(
        (m.host, m.port, m.session),
        ("10.0.0.2", 41235, "10.0.0.2:15234")
    );
    let dst = m.dst.unwrap();
    assert_eq!(dst.kv_pages.to_vec(), [5, 6, 7, 12]);
    assert_eq!(dst.kv_pages.as_bytes(), f[4].as_slice());
    assert_eq!(m.to_request(), metadata_value());
    assert_eq!(encode_metadata(&metadata_value()).unwrap(), f);
    assert!(matches!(PrefillInbound::parse(&f).unwrap(), PrefillInbound::Metadata(x) if x == m));
}

#[test]
fn metadata_example_with_mamba_state() {
    let mut f = metadata_frames();
    f[6] = vec![
        0x01, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x2a, 0x00, 0x00, 0x00,
    ];
    let mut want = metadata_value();
    want.dst.as_mut().unwrap().state_indices = vec![vec![42]];
    assert_eq!(parse_metadata(&f).unwrap(), want);
    assert_eq!(encode_metadata(&want).unwrap(), f);
}

#[test]
fn metadata_dummy_and_optional_frames() {
    let mut f = metadata_frames();
    f[4].clear();
    f[5].clear();
    f[6] = b"ignored for dummies".to_vec();
    let m = MetadataRef::parse(&f).unwrap();
    assert!(m.is_dummy());
    f[6].clear();
    let mut want = metadata_value();
    want.dst = None;
    assert_eq!(encode_metadata(&want).unwrap(), f);
    // Frames 8 and 9 are optional; an absent or empty frame 8 is an unknown prefix.
    let base = metadata_frames();
    let r = parse_metadata(&base[..8]).unwrap();
    assert_eq!(r.decode_prefix_len, None);
    assert_eq!(r.device_kv_pages, Vec::<i32>::new());
    let mut g = base.clone();
    g[8].clear();
    g[9] = [9i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
    let r = parse_metadata(&g).unwrap();
    assert_eq!(r.decode_prefix_len, None);
    assert_eq!(r.device_kv_pages, [9, -1]);
    assert_eq!(encode_metadata(&r).unwrap(), g);
    // IPv6 decode host, as sglang writes it (no brackets).
    let mut v6 = base;
    v6[1] = b"fe80::1".to_vec();
    let r = parse_metadata(&v6).unwrap();
    assert_eq!(r.endpoint.zmq_addr(), "tcp://[fe80::1]:41235");
}

#[test]
fn status_example() {
    let f = frames(&[ROOM, b"4", b"0"]);
    let s = TransferStatus::parse(&f).unwrap();
    assert_eq!(
        s,
        TransferStatus {
            room: room(),
            status: KVPoll::Success,
            prefill_rank: 0,
            reason: None
        }
    );
    assert_eq!(s.encode(), f);
    // The later revision's 4th reason frame is accepted, never emitted.
    let g = frames(&[ROOM, b"0", b"3", b"transfer failed: peer gone"]);
    let s = TransferStatus::parse(&g).unwrap();
    assert_eq!(s.status, KVPoll::Failed);
    assert_eq!(s.reason.as_deref(), Some("transfer failed: peer gone"));
    assert_eq!(s.encode(), frames(&[ROOM, b"0", b"3"]));
    assert!(matches!(DecodeInbound::parse(&g).unwrap(), DecodeInbound::Status(x) if x == s));
    // ... and emitted on request, for a decode known to take it (sglang 0.5.23 parses
    // `msg[3].decode("utf-8")` as the failure reason).
    assert_eq!(s.encode_with_reason(), g);
    // An empty 4th frame is no reason (0.5.23: `if len(msg) > 3 and msg[3]`).
    let e = frames(&[ROOM, b"0", b"3", b""]);
    assert_eq!(TransferStatus::parse(&e).unwrap().reason, None);
    assert_eq!(
        TransferStatus::parse(&e).unwrap().encode_with_reason(),
        frames(&[ROOM, b"0", b"3"])
    );
    // Success has no reason: 3 frames even in the 4-frame-capable form, as sglang sends it.
    assert_eq!(TransferStatus::parse(&f).unwrap().encode_with_reason(), f);
    // A reason past the codec's limit is cut at a character boundary, so it parses back.
    let long = TransferStatus {
        reason: Some("é".repeat(40_000)),
        ..s.clone()
    };
    let enc = long.encode_with_reason();
    assert_eq!(enc[3].len(), kvx_bootstrap::codec::MAX_REASON_LEN);
    assert_eq!(
        TransferStatus::parse(&enc)
            .unwrap()
            .reason
            .unwrap()
            .chars()
            .count(),
        kvx_bootstrap::codec::MAX_REASON_LEN / 2
    );
    // The pre-2025-06 two-frame form is refused.
    assert_eq!(
        TransferStatus::parse(&frames(&[ROOM, b"4"]))
            .unwrap_err()
            .kind(),
        "frame_count"
    );
}

#[test]
fn aux_data_example() {
    let payload = [1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    let f = frames(&[b"AUX_DATA", ROOM, b"2", b"17", &[0, 0, 0, 10], &payload]);
    let a = AuxData::parse(&f).unwrap();
    assert_eq!(
        a,
        AuxData {
            room: room(),
            aux_index: 2,
            dst_row: 17,
            payload: &payload
        }
    );
    assert_eq!(a.encode().unwrap(), f);
    // Big-endian: 0x0102 bytes.
    let big = vec![0xabu8; 0x0102];
    let a = AuxData { payload: &big, ..a };
    assert_eq!(a.encode().unwrap()[4], [0, 0, 1, 2]);
    assert!(matches!(
        DecodeInbound::parse(&f).unwrap(),
        DecodeInbound::AuxData(_)
    ));
}

#[test]
fn abort_and_ack_examples() {
    let f = frames(&[b"ABORT", ROOM, b"10.0.0.2", b"41235"]);
    let a = Abort::parse(&f).unwrap();
    assert_eq!(
        a,
        Abort {
            room: room(),
            endpoint: Endpoint::new("10.0.0.2", 41235),
            generation: None,
        }
    );
    assert_eq!(a.encode(), f);
    assert!(matches!(PrefillInbound::parse(&f).unwrap(), PrefillInbound::Abort(x) if x == a));

    let legacy = frames(&[b"ABORT_ACK", ROOM]);
    let ack = AbortAck::parse(&legacy).unwrap();
    assert_eq!(ack.prefill_rank, None);
    assert_eq!(ack.encode(), legacy);
    let deferred = frames(&[b"ABORT_ACK", ROOM, b"5"]);
    let ack = AbortAck::parse(&deferred).unwrap();
    assert_eq!(ack.prefill_rank, Some(5));
    assert_eq!(ack.generation, None);
    assert_eq!(ack.encode(), deferred);
    assert!(matches!(
        DecodeInbound::parse(&deferred).unwrap(),
        DecodeInbound::AbortAck(x) if x == ack
    ));
}

/// sglang 0.5.23's `AbortNotification.to_zmq` with deferred KV release on (its default): the
/// generation after the K fields; and `AbortAck.to_zmq`: `[ABORT_ACK, room, rank, generation]`.
#[test]
fn abort_and_ack_0523_examples() {
    let f = frames(&[b"ABORT", ROOM, b"10.0.0.2", b"41235", b"17"]);
    let a = Abort::parse(&f).unwrap();
    assert_eq!(
        a,
        Abort {
            room: room(),
            endpoint: Endpoint::new("10.0.0.2", 41235),
            generation: Some(17),
        }
    );
    assert_eq!(a.encode(), f);
    assert!(matches!(PrefillInbound::parse(&f).unwrap(), PrefillInbound::Abort(x) if x == a));
    // IPv6 decode host, unbracketed as sglang sends it.
    let v6 = frames(&[b"ABORT", ROOM, b"fe80::1", b"41235", b"1"]);
    let a6 = Abort::parse(&v6).unwrap();
    assert_eq!(a6.endpoint.zmq_addr(), "tcp://[fe80::1]:41235");
    assert_eq!(a6.encode(), v6);

    let g = frames(&[b"ABORT_ACK", ROOM, b"5", b"17"]);
    let ack = AbortAck::parse(&g).unwrap();
    assert_eq!(
        ack,
        AbortAck {
            room: room(),
            prefill_rank: Some(5),
            generation: Some(17),
        }
    );
    assert_eq!(ack.encode(), g);
    assert!(matches!(
        DecodeInbound::parse(&g).unwrap(),
        DecodeInbound::AbortAck(x) if x == ack
    ));
    // The largest generation a u64 holds.
    let max = frames(&[b"ABORT_ACK", ROOM, b"0", b"18446744073709551615"]);
    assert_eq!(AbortAck::parse(&max).unwrap().generation, Some(u64::MAX));
    assert_eq!(AbortAck::parse(&max).unwrap().encode(), max);
}

#[test]
fn staging_examples() {
    let session = SessionId::new("10.0.0.2:15234");
    let req = frames(&[b"STAGING_REQ", ROOM, b"0", b"64", b"10.0.0.2:15234", b"0"]);
    let r = StagingReq::parse(&req).unwrap();
    assert_eq!(
        r,
        StagingReq {
            room: room(),
            chunk_idx: 0,
            chunk_num_pages: 64,
            session: session.clone(),
            pp_rank: Some(0)
        }
    );
    assert_eq!(r.encode(), req);
    assert!(matches!(
        DecodeInbound::parse(&req).unwrap(),
        DecodeInbound::StagingReq(_)
    ));
    assert_eq!(StagingReq::parse(&req[..5]).unwrap().pp_rank, None);

    let rsp = frames(&[
        b"STAGING_RSP",
        ROOM,
        b"0",
        b"0",
        b"0",
        b"8388608",
        b"10.0.0.2:15234",
    ]);
    let r = StagingRsp::parse(&rsp).unwrap();
    assert_eq!(
        r,
        StagingRsp {
            room: room(),
            chunk_idx: 0,
            offset: 0,
            round: 0,
            end: 8_388_608,
            session: session.clone()
        }
    );
    assert!(!r.is_oversized());
    assert_eq!(r.encode(), rsp);
    assert!(matches!(
        PrefillInbound::parse(&rsp).unwrap(),
        PrefillInbound::StagingRsp(_)
    ));
    let oversized = frames(&[b"STAGING_RSP", ROOM, b"1", b"-2", b"0", b"-1", b"s"]);
    let o = StagingRsp::parse(&oversized).unwrap();
    assert!(o.is_oversized());
    assert_eq!(o.encode(), oversized);

    let wm = frames(&[b"WATERMARK", b"3", b"16777216", b"10.0.0.2:15234"]);
    let w = Watermark::parse(&wm).unwrap();
    assert_eq!(
        w,
        Watermark {
            round: 3,
            tail: 16_777_216,
            session: session.clone()
        }
    );
    assert_eq!(w.encode(), wm);
    assert!(matches!(
        PrefillInbound::parse(&wm).unwrap(),
        PrefillInbound::Watermark(_)
    ));
    assert_eq!(
        Watermark::parse(&wm[..3]).unwrap().session,
        SessionId::new("")
    );

    let cr = frames(&[
        b"CHUNK_READY",
        ROOM,
        b"0",
        b"0",
        b"64",
        b"10.0.0.2:15234",
        b"1",
    ]);
    let c = ChunkReady::parse(&cr).unwrap();
    assert_eq!(
        c,
        ChunkReady {
            room: room(),
            chunk_idx: 0,
            page_start: 0,
            num_pages: 64,
            session,
            prefill_rank: Some(1)
        }
    );
    assert_eq!(c.encode(), cr);
    assert!(matches!(
        DecodeInbound::parse(&cr).unwrap(),
        DecodeInbound::ChunkReady(_)
    ));
}

#[test]
fn packed_int_lists_examples() {
    let none: Vec<Vec<u32>> = vec![];
    assert!(encode_packed(&none, "t").unwrap().is_empty());
    let one_empty: Vec<Vec<u32>> = vec![vec![]];
    assert_eq!(
        encode_packed(&one_empty, "t").unwrap(),
        [0x01, 0, 0, 0, 0, 0, 0, 0]
    );
}
