//! Malformed input: every class of damage the issue lists (wrong frame count, bad ASCII int,
//! room 0, truncated arrays, unknown tag, oversized lengths, non-UTF-8 text) yields a typed error
//! with the expected stable kind, for each parser and through the inbox classifiers.

#![allow(clippy::unwrap_used)]

use kvx_bootstrap::codec::{
    Abort, AbortAck, AuxData, ChunkReady, CodecError, DecodeInbound, MAX_TEXT_LEN, MetadataRef,
    PackedError, PrefillInbound, StagingReq, StagingRsp, TransferStatus, Watermark,
    parse_registration,
};

const ROOM: &[u8] = b"1234567890123456789";

fn f(parts: &[&[u8]]) -> Vec<Vec<u8>> {
    parts.iter().map(|p| p.to_vec()).collect()
}

fn meta() -> Vec<Vec<u8>> {
    f(&[
        ROOM,
        b"10.0.0.2",
        b"41235",
        b"10.0.0.2:15234",
        &[5, 0, 0, 0, 6, 0, 0, 0],
        b"17",
        b"",
        b"1",
        b"0",
        b"",
    ])
}

fn reg() -> Vec<Vec<u8>> {
    let mut v = f(&[
        b"None",
        b"10.0.0.2",
        b"41235",
        b"10.0.0.2:15234",
        &[0; 16],
        &[0; 8],
        b"",
        b"0",
        b"1",
        b"2048",
    ]);
    v.extend(f(&[b"", b"", b"", b"", b"", b"", b"1", b"0"]));
    v
}

fn kind<T: std::fmt::Debug>(r: Result<T, CodecError>) -> &'static str {
    r.unwrap_err().kind()
}

fn with(mut frames: Vec<Vec<u8>>, i: usize, v: &[u8]) -> Vec<Vec<u8>> {
    frames[i] = v.to_vec();
    frames
}

#[test]
fn metadata_errors() {
    let m = meta();
    assert!(MetadataRef::parse(&m).is_ok());
    assert_eq!(kind(MetadataRef::parse(&m[..7])), "frame_count");
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 0, b"0"))),
        "bad_room"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(
            m.clone(),
            0,
            b"9223372036854775808"
        ))),
        "bad_room"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 1, b""))),
        "empty_text"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 1, b"\xc3\x28"))),
        "non_utf8"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(
            m.clone(),
            3,
            &vec![b'a'; MAX_TEXT_LEN + 1]
        ))),
        "oversized"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 2, b"70000"))),
        "int_range"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 2, b"4x"))),
        "bad_int"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 4, &[5, 0, 0]))),
        "truncated_array"
    );
    // Frame 4 set but frame 5 empty: not a dummy, and the aux index is missing.
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 5, b""))),
        "bad_int"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 6, &[1, 0, 0, 0]))),
        "packed_list"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 7, b"-1"))),
        "int_range"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 8, b"-64"))),
        "int_range"
    );
    assert_eq!(
        kind(MetadataRef::parse(&with(m.clone(), 9, &[1]))),
        "truncated_array"
    );
}

#[test]
fn registration_errors() {
    let r = reg();
    assert!(parse_registration(&r).is_ok());
    assert_eq!(kind(parse_registration(&r[..9])), "frame_count");
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 0, b"none"))),
        "unknown_tag"
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 2, b""))),
        "bad_int"
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 4, &[0; 15]))),
        "truncated_array"
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 6, &[9]))),
        "packed_list"
    );
    assert_eq!(
        parse_registration(&with(r.clone(), 10, &[2, 0, 0, 0, 4, 0, 0, 0])).unwrap_err(),
        CodecError::Packed {
            field: "registration.state_item_lens",
            reason: PackedError::LengthsTruncated { count: 2 }
        }
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 7, b"4294967296"))),
        "int_range"
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 12, &[1, 2]))),
        "truncated_array"
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 15, b"big"))),
        "bad_int"
    );
    assert_eq!(
        kind(parse_registration(&with(r.clone(), 16, b"-1"))),
        "int_range"
    );
    let mut l = r.clone();
    l.push(vec![1, 2, 3]);
    assert_eq!(kind(parse_registration(&l)), "truncated_array");
}

#[test]
fn small_message_errors() {
    assert_eq!(
        kind(TransferStatus::parse(&f(&[ROOM, b"4"]))),
        "frame_count"
    );
    assert_eq!(
        kind(TransferStatus::parse(&f(&[ROOM, b"4", b"0", b"r", b"x"]))),
        "frame_count"
    );
    assert_eq!(
        kind(TransferStatus::parse(&f(&[ROOM, b"7", b"0"]))),
        "bad_status"
    );
    assert_eq!(
        kind(TransferStatus::parse(&f(&[ROOM, b"4", b"0", b"\xff"]))),
        "non_utf8"
    );
    assert_eq!(
        kind(TransferStatus::parse(&f(&[b"0", b"4", b"0"]))),
        "bad_room"
    );
    assert_eq!(
        kind(Abort::parse(&f(&[b"ABORT", ROOM, b"h"]))),
        "frame_count"
    );
    assert_eq!(
        kind(Abort::parse(&f(&[b"ABORT", b"0", b"h", b"1"]))),
        "bad_room"
    );
    // sglang 0.5.23's 5th ABORT frame and 4th ABORT_ACK frame are ASCII u64 generations.
    assert_eq!(
        kind(Abort::parse(&f(&[b"ABORT", ROOM, b"h", b"1", b"g"]))),
        "bad_int"
    );
    assert_eq!(
        kind(Abort::parse(&f(&[b"ABORT", ROOM, b"h", b"1", b""]))),
        "bad_int"
    );
    assert_eq!(
        kind(Abort::parse(&f(&[b"ABORT", ROOM, b"h", b"1", b"-3"]))),
        "int_range"
    );
    assert_eq!(
        kind(Abort::parse(&f(&[
            b"ABORT",
            ROOM,
            b"h",
            b"1",
            b"18446744073709551616"
        ]))),
        "int_range"
    );
    assert_eq!(
        kind(Abort::parse(&f(&[b"ABORT", ROOM, b"h", b"1", b"2", b"3"]))),
        "frame_count"
    );
    assert_eq!(kind(AbortAck::parse(&f(&[b"ABORT_ACK"]))), "frame_count");
    assert_eq!(
        kind(AbortAck::parse(&f(&[b"ABORT_ACK", ROOM, b"x"]))),
        "bad_int"
    );
    assert_eq!(
        kind(AbortAck::parse(&f(&[b"ABORT_ACK", ROOM, b"0", b"x"]))),
        "bad_int"
    );
    assert_eq!(
        kind(AbortAck::parse(&f(&[b"ABORT_ACK", ROOM, b"", b"1"]))),
        "bad_int"
    );
    assert_eq!(
        kind(AbortAck::parse(&f(&[b"ABORT_ACK", ROOM, b"0", b"1", b"2"]))),
        "frame_count"
    );
    // sglang 0.5.23's registration frame 19 is u64 LE item lengths.
    let mut r20 = reg();
    r20.push(Vec::new());
    r20.push(vec![1, 2, 3]);
    assert_eq!(kind(parse_registration(&r20)), "truncated_array");
    r20[19] = 2048u64.to_le_bytes().to_vec();
    assert_eq!(
        parse_registration(&r20).unwrap().kv_item_lens,
        Some(vec![2048])
    );
    let aux = |len: &[u8], payload: &[u8]| {
        AuxData::parse(&f(&[b"AUX_DATA", ROOM, b"0", b"1", len, payload])).map(|a| a.payload.len())
    };
    assert_eq!(aux(&[0, 0, 0, 2], b"ab"), Ok(2));
    assert_eq!(kind(aux(&[0, 0, 0, 3], b"ab")), "length_mismatch");
    assert_eq!(kind(aux(&[2, 0, 0, 0], b"ab")), "length_mismatch");
    assert_eq!(kind(aux(&[0, 0, 2], b"ab")), "length_mismatch");
    assert_eq!(
        kind(aux(&[0xff, 0xff, 0xff, 0xff], b"ab")),
        "length_mismatch"
    );
    assert_eq!(
        kind(StagingReq::parse(&f(&[b"STAGING_REQ", ROOM, b"0", b"64"]))),
        "frame_count"
    );
    assert_eq!(
        kind(StagingRsp::parse(&f(&[
            b"STAGING_RSP",
            ROOM,
            b"0",
            b"-3",
            b"0",
            b"-1",
            b"s"
        ]))),
        "bad_sentinel"
    );
    assert_eq!(
        kind(StagingRsp::parse(&f(&[
            b"STAGING_RSP",
            ROOM,
            b"0",
            b"0",
            b"0",
            b"-2",
            b"s"
        ]))),
        "bad_sentinel"
    );
    assert_eq!(
        kind(Watermark::parse(&f(&[b"WATERMARK", b"1", b"-5"]))),
        "int_range"
    );
    assert_eq!(
        kind(ChunkReady::parse(&f(&[
            b"CHUNK_READY",
            ROOM,
            b"0",
            b"0",
            b"64",
            b"\xfe"
        ]))),
        "non_utf8"
    );
}

#[test]
fn inbox_errors() {
    let none: [&[u8]; 0] = [];
    assert_eq!(kind(PrefillInbound::parse(&none)), "no_frames");
    assert_eq!(kind(DecodeInbound::parse(&none)), "no_frames");
    for tag in [
        &b"garbage"[..],
        b"",
        b"-5",
        b"none",
        b"KV_STATUS",
        b"\xff\xfe",
    ] {
        assert_eq!(
            kind(PrefillInbound::parse(&[tag, b"1", b"2"])),
            "unknown_tag"
        );
        assert_eq!(
            kind(DecodeInbound::parse(&[tag, b"1", b"2"])),
            "unknown_tag"
        );
    }
    assert_eq!(
        kind(PrefillInbound::parse(&[b"BOOTSTRAP", ROOM])),
        "unsupported"
    );
    // Decode-bound tags on the prefill inbox, and the other way round, are unknown there.
    assert_eq!(
        kind(PrefillInbound::parse(&[b"ABORT_ACK", ROOM])),
        "unknown_tag"
    );
    assert_eq!(
        kind(DecodeInbound::parse(&[&b"WATERMARK"[..], b"1", b"2"])),
        "unknown_tag"
    );
    // A room-led message with the wrong frame count for each inbox.
    assert_eq!(
        kind(PrefillInbound::parse(&[ROOM, b"4", b"0"])),
        "frame_count"
    );
    assert_eq!(kind(DecodeInbound::parse(&meta())), "frame_count");
    assert_eq!(
        kind(DecodeInbound::parse(&[&b"0"[..], b"4", b"0"])),
        "bad_room"
    );
    // Unknown-tag text is cut for logs.
    let long = vec![b'Z'; 500];
    match PrefillInbound::parse(&[long]).unwrap_err() {
        CodecError::UnknownTag { tag } => assert_eq!(tag.len(), 32),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn kinds_are_listed_and_unique() {
    let mut k = CodecError::KINDS.to_vec();
    k.sort_unstable();
    k.dedup();
    assert_eq!(k.len(), CodecError::KINDS.len());
}
