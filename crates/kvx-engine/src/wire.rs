//! The sglang ZMQ multipart messages the drivers exchange, as byte frames.
//!
//! A thin adapter over `kvx_bootstrap::codec`: owned forms of what each inbox receives, and the
//! encoders the drivers use (registration, metadata, ABORT from a decode; status and ABORT_ACK
//! from a prefill; the staging messages both ways, converted to and from `kvx-staging`'s plain
//! forms). Every malformed frame is a typed [`WireError`]; nothing panics on input.

use kvx_core::{DecodeRegistration, Endpoint, KVPoll, Room, TransferRequest};

use kvx_bootstrap::codec::{self, Abort, AbortAck, AuxData, TransferStatus};
pub use kvx_bootstrap::codec::{CodecError as WireError, Frames};
use kvx_staging::{ChunkReady, RspPlacement, StagingReq, StagingRsp, Watermark, WatermarkMsg};

/// What a prefill inbox can receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillInbound {
    /// A decode's KV-args registration (`None`).
    Registration(Box<DecodeRegistration>),
    /// Per-request transfer metadata.
    Metadata(Box<TransferRequest>),
    /// `ABORT` for a room from a decode endpoint.
    Abort {
        /// The room.
        room: Room,
        /// Where the ack goes.
        endpoint: Endpoint,
        /// The 5th frame of sglang 0.5.23's `ABORT` (`None`: sglang main's 4-frame form).
        generation: Option<u64>,
    },
    /// `STAGING_RSP`: where a decode placed one staged chunk.
    StagingRsp(StagingRsp),
    /// `WATERMARK`: how far a decode's staging ring is free.
    Watermark(WatermarkMsg),
}

/// Parses a message received on a prefill inbox.
pub fn parse_prefill_inbound<F: AsRef<[u8]>>(frames: &[F]) -> Result<PrefillInbound, WireError> {
    Ok(match codec::PrefillInbound::parse(frames)? {
        codec::PrefillInbound::Registration(r) => PrefillInbound::Registration(r),
        codec::PrefillInbound::Metadata(m) => PrefillInbound::Metadata(Box::new(m.to_request())),
        codec::PrefillInbound::Abort(a) => PrefillInbound::Abort {
            room: a.room,
            endpoint: a.endpoint,
            generation: a.generation,
        },
        codec::PrefillInbound::StagingRsp(r) => PrefillInbound::StagingRsp(staging_rsp(r)?),
        codec::PrefillInbound::Watermark(w) => PrefillInbound::Watermark(WatermarkMsg {
            watermark: Watermark::from_wire(w.round, w.tail).ok_or(WireError::BadSentinel {
                field: "watermark.round",
                value: w.round,
            })?,
            session: w.session,
        }),
    })
}

/// A `STAGING_RSP` whose placement a decode can send (the codec already refused unknown
/// sentinels; a negative round or an end before the offset is refused here).
fn staging_rsp(r: codec::StagingRsp) -> Result<StagingRsp, WireError> {
    let placement =
        RspPlacement::from_wire(r.offset, r.round, r.end).ok_or(WireError::BadSentinel {
            field: "staging_rsp.round",
            value: r.round,
        })?;
    Ok(StagingRsp {
        room: r.room,
        chunk_idx: r.chunk_idx,
        placement,
        session: r.session,
    })
}

/// Encodes `STAGING_REQ` (6 frames: the requester's pp rank is always sent, as sglang does).
pub fn encode_staging_req(r: &StagingReq) -> Frames {
    codec::StagingReq {
        room: r.room,
        chunk_idx: r.chunk_idx,
        chunk_num_pages: r.chunk_pages,
        session: r.session.clone(),
        pp_rank: Some(r.pp_rank.unwrap_or(0)),
    }
    .encode()
}

/// Encodes `STAGING_RSP`.
pub fn encode_staging_rsp(r: &StagingRsp) -> Frames {
    let (offset, round, end) = r.placement.to_wire();
    codec::StagingRsp {
        room: r.room,
        chunk_idx: r.chunk_idx,
        offset,
        round,
        end,
        session: r.session.clone(),
    }
    .encode()
}

/// Encodes `WATERMARK` (4 frames).
pub fn encode_watermark(w: &WatermarkMsg) -> Frames {
    codec::Watermark {
        round: i64::try_from(w.watermark.round).unwrap_or(i64::MAX),
        tail: w.watermark.tail,
        session: w.session.clone(),
    }
    .encode()
}

/// Encodes `CHUNK_READY` (7 frames when the rank is known).
pub fn encode_chunk_ready(c: &ChunkReady) -> Frames {
    codec::ChunkReady {
        room: c.room,
        chunk_idx: c.chunk_idx,
        page_start: c.page_start,
        num_pages: c.num_pages,
        session: c.session.clone(),
        prefill_rank: c.prefill_unique_rank,
    }
    .encode()
}

/// Encodes a registration.
pub fn encode_registration(r: &DecodeRegistration) -> Result<Frames, WireError> {
    codec::encode_registration(r)
}

/// Encodes per-request metadata.
pub fn encode_metadata(t: &TransferRequest) -> Result<Frames, WireError> {
    codec::encode_metadata(t)
}

/// Encodes `ABORT` for a room from a decode endpoint: 4 frames, or 5 with `generation` (for a
/// sglang 0.5.23 prefill, which acknowledges only an `ABORT` that carries one).
pub fn encode_abort(room: Room, me: &Endpoint, generation: Option<u64>) -> Frames {
    Abort {
        room,
        endpoint: me.clone(),
        generation,
    }
    .encode()
}

/// Encodes the 3-frame status message every sglang decode accepts.
pub fn encode_status(room: Room, status: KVPoll, prefill_unique_rank: u32) -> Frames {
    TransferStatus {
        room,
        status,
        prefill_rank: prefill_unique_rank,
        reason: None,
    }
    .encode()
}

/// Encodes a status with `reason` as a 4th frame (3 frames when `reason` is `None` or empty):
/// only for a decode known to accept it (sglang 0.5.23, or a kvx decode); a sglang main decode's
/// receive thread dies on 4 frames.
pub fn encode_status_with_reason(
    room: Room,
    status: KVPoll,
    prefill_unique_rank: u32,
    reason: Option<&str>,
) -> Frames {
    TransferStatus {
        room,
        status,
        prefill_rank: prefill_unique_rank,
        reason: reason.map(str::to_owned),
    }
    .encode_with_reason()
}

/// Encodes the `ABORT_ACK` of sglang's deferred KV release: this prefill sends it only once
/// nothing of the room is in flight, and names its `prefill_unique_rank` so the decode can count
/// distinct ranks (a legacy decode reads frame 1 only). 3 frames, or 4 echoing the `ABORT`'s
/// `generation` (sglang 0.5.23, whose decode ignores an ACK without one).
pub fn encode_abort_ack(room: Room, prefill_unique_rank: u32, generation: Option<u64>) -> Frames {
    AbortAck {
        room,
        prefill_rank: Some(prefill_unique_rank),
        generation,
    }
    .encode()
}

/// Encodes `AUX_DATA`: the bytes of one aux row for buffer `index`, to be written at the
/// decode's row `dst_row`.
pub fn encode_aux_data(
    room: Room,
    index: u32,
    dst_row: u64,
    row: &[u8],
) -> Result<Frames, WireError> {
    AuxData {
        room,
        aux_index: index,
        dst_row: i64::try_from(dst_row).unwrap_or(i64::MAX),
        payload: row,
    }
    .encode()
}

/// What a decode inbox can receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeInbound {
    /// A status from a prefill rank.
    Status {
        /// The room.
        room: Room,
        /// Success or Failed.
        status: KVPoll,
        /// The sender's `prefill_unique_rank`.
        rank: u32,
        /// Optional reason (4th frame).
        reason: Option<String>,
    },
    /// `ABORT_ACK` for a room, with the acking rank in the deferred-release form.
    AbortAck {
        /// The room.
        room: Room,
        /// The acking prefill's unique rank (`None`: the legacy 2-frame form).
        rank: Option<u32>,
        /// The acknowledged `ABORT`'s generation (sglang 0.5.23's 4-frame form).
        generation: Option<u64>,
    },
    /// `STAGING_REQ`: a prefill rank asks for ring space for one chunk.
    StagingReq(StagingReq),
    /// `CHUNK_READY`: a prefill rank finished writing its block of a chunk.
    ChunkReady(ChunkReady),
    /// `AUX_DATA`: one aux row sent over the control plane instead of written.
    AuxData {
        /// The room.
        room: Room,
        /// Aux buffer index.
        index: u32,
        /// The decode's row.
        row: i64,
        /// The row's bytes.
        data: Vec<u8>,
    },
}

/// Parses a message received on a decode inbox.
pub fn parse_decode_inbound<F: AsRef<[u8]>>(frames: &[F]) -> Result<DecodeInbound, WireError> {
    Ok(match codec::DecodeInbound::parse(frames)? {
        codec::DecodeInbound::Status(s) => DecodeInbound::Status {
            room: s.room,
            status: s.status,
            rank: s.prefill_rank,
            reason: s.reason,
        },
        codec::DecodeInbound::AbortAck(a) => DecodeInbound::AbortAck {
            room: a.room,
            rank: a.prefill_rank,
            generation: a.generation,
        },
        codec::DecodeInbound::StagingReq(r) => DecodeInbound::StagingReq(StagingReq {
            room: r.room,
            chunk_idx: r.chunk_idx,
            chunk_pages: r.chunk_num_pages,
            session: r.session,
            pp_rank: r.pp_rank,
        }),
        codec::DecodeInbound::AuxData(a) => DecodeInbound::AuxData {
            room: a.room,
            index: a.aux_index,
            row: a.dst_row,
            data: a.payload.to_vec(),
        },
        codec::DecodeInbound::ChunkReady(c) => DecodeInbound::ChunkReady(ChunkReady {
            room: c.room,
            chunk_idx: c.chunk_idx,
            page_start: c.page_start,
            num_pages: c.num_pages,
            session: c.session,
            prefill_unique_rank: c.prefill_rank,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::{Destination, SessionId};
    use proptest::prelude::*;

    fn reg() -> DecodeRegistration {
        DecodeRegistration::plain(
            Endpoint::new("10.0.0.2", 41235),
            SessionId::new("10.0.0.2:15234"),
            vec![0x7f12_a000_0000, 0x7f12_b000_0000],
            vec![1, 2, 3],
            2048,
        )
    }

    #[test]
    fn registration_matches_spec_example_and_round_trips() {
        let f = encode_registration(&reg()).unwrap();
        assert!(f.len() >= 18);
        assert_eq!(f[0], b"None");
        assert_eq!(
            f[4],
            [
                0, 0, 0, 0xa0, 0x12, 0x7f, 0, 0, 0, 0, 0, 0xb0, 0x12, 0x7f, 0, 0
            ]
        );
        assert_eq!(f[9], b"2048");
        assert!(f[6].is_empty() && f[14].is_empty() && f[15].is_empty());
        assert_eq!(
            parse_prefill_inbound(&f),
            Ok(PrefillInbound::Registration(Box::new(reg())))
        );
    }

    #[test]
    fn metadata_matches_spec_example() {
        let t = TransferRequest {
            room: Room::new(1_234_567_890_123_456_789).unwrap(),
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
        };
        let f = encode_metadata(&t).unwrap();
        assert_eq!(f[4], [5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 12, 0, 0, 0]);
        assert_eq!(f[5], b"17");
        assert_eq!(f[8], b"0");
        assert_eq!(
            parse_prefill_inbound(&f),
            Ok(PrefillInbound::Metadata(Box::new(t)))
        );
    }

    #[test]
    fn status_and_abort() {
        let room = Room::new(7).unwrap();
        let s = encode_status(room, KVPoll::Success, 0);
        assert_eq!(s, vec![b"7".to_vec(), b"4".to_vec(), b"0".to_vec()]);
        assert_eq!(
            parse_decode_inbound(&s),
            Ok(DecodeInbound::Status {
                room,
                status: KVPoll::Success,
                rank: 0,
                reason: None
            })
        );
        let a = encode_abort(room, &Endpoint::new("127.0.0.1", 9), None);
        assert_eq!(a.len(), 4);
        assert_eq!(
            parse_prefill_inbound(&a),
            Ok(PrefillInbound::Abort {
                room,
                endpoint: Endpoint::new("127.0.0.1", 9),
                generation: None,
            })
        );
        // sglang 0.5.23's 5-frame ABORT carries the generation.
        let a = encode_abort(room, &Endpoint::new("127.0.0.1", 9), Some(12));
        assert_eq!(a[4], b"12");
        assert_eq!(
            parse_prefill_inbound(&a),
            Ok(PrefillInbound::Abort {
                room,
                endpoint: Endpoint::new("127.0.0.1", 9),
                generation: Some(12),
            })
        );
        // A status with its reason, for a decode that takes one.
        let s = encode_status_with_reason(room, KVPoll::Failed, 1, Some("boom"));
        assert_eq!(strs(&s), ["7", "0", "1", "boom"]);
        assert_eq!(
            parse_decode_inbound(&s),
            Ok(DecodeInbound::Status {
                room,
                status: KVPoll::Failed,
                rank: 1,
                reason: Some("boom".into())
            })
        );
        assert_eq!(
            encode_status_with_reason(room, KVPoll::Success, 1, None),
            encode_status(room, KVPoll::Success, 1)
        );
        assert!(parse_decode_inbound(&[b"7".to_vec(), b"4".to_vec()]).is_err());
        // AUX_DATA: the length frame is big-endian (spec §3.4).
        let aux = encode_aux_data(room, 1, 17, &[1, 2, 3]).unwrap();
        assert_eq!(aux[4], [0, 0, 0, 3]);
        assert_eq!(
            parse_decode_inbound(&aux),
            Ok(DecodeInbound::AuxData {
                room,
                index: 1,
                row: 17,
                data: vec![1, 2, 3]
            })
        );
        // The deferred-release ABORT_ACK names the rank; the legacy one does not.
        let ack = encode_abort_ack(room, 3, None);
        assert_eq!(
            ack,
            vec![b"ABORT_ACK".to_vec(), b"7".to_vec(), b"3".to_vec()]
        );
        assert_eq!(
            parse_decode_inbound(&ack),
            Ok(DecodeInbound::AbortAck {
                room,
                rank: Some(3),
                generation: None,
            })
        );
        assert_eq!(
            parse_decode_inbound(&[b"ABORT_ACK".to_vec(), b"7".to_vec()]),
            Ok(DecodeInbound::AbortAck {
                room,
                rank: None,
                generation: None
            })
        );
        // sglang 0.5.23's 4-frame ACK echoes the ABORT's generation.
        let ack = encode_abort_ack(room, 3, Some(12));
        assert_eq!(strs(&ack), ["ABORT_ACK", "7", "3", "12"]);
        assert_eq!(
            parse_decode_inbound(&ack),
            Ok(DecodeInbound::AbortAck {
                room,
                rank: Some(3),
                generation: Some(12),
            })
        );
        assert!(parse_prefill_inbound(&[b"garbage".to_vec()]).is_err());
    }

    fn strs(f: &Frames) -> Vec<&str> {
        f.iter().map(|x| std::str::from_utf8(x).unwrap()).collect()
    }

    #[test]
    fn staging_messages_match_spec_examples() {
        let room = Room::new(1_234_567_890_123_456_789).unwrap();
        let s = SessionId::new("10.0.0.2:15234");
        let req = StagingReq {
            room,
            chunk_idx: 0,
            chunk_pages: 64,
            session: s.clone(),
            pp_rank: None,
        };
        let f = encode_staging_req(&req);
        assert_eq!(
            strs(&f),
            [
                "STAGING_REQ",
                "1234567890123456789",
                "0",
                "64",
                "10.0.0.2:15234",
                "0"
            ]
        );
        assert_eq!(
            parse_decode_inbound(&f),
            Ok(DecodeInbound::StagingReq(StagingReq {
                pp_rank: Some(0),
                ..req
            }))
        );
        let rsp = StagingRsp {
            room,
            chunk_idx: 0,
            placement: RspPlacement::At(kvx_staging::Placement {
                offset: 0,
                round: 0,
                end: 8_388_608,
            }),
            session: s.clone(),
        };
        let f = encode_staging_rsp(&rsp);
        assert_eq!(
            strs(&f),
            [
                "STAGING_RSP",
                "1234567890123456789",
                "0",
                "0",
                "0",
                "8388608",
                "10.0.0.2:15234"
            ]
        );
        assert_eq!(
            parse_prefill_inbound(&f),
            Ok(PrefillInbound::StagingRsp(rsp))
        );
        let wm = WatermarkMsg {
            watermark: Watermark {
                round: 3,
                tail: 16_777_216,
            },
            session: s.clone(),
        };
        let f = encode_watermark(&wm);
        assert_eq!(strs(&f), ["WATERMARK", "3", "16777216", "10.0.0.2:15234"]);
        assert_eq!(parse_prefill_inbound(&f), Ok(PrefillInbound::Watermark(wm)));
        let ready = ChunkReady {
            room,
            chunk_idx: 0,
            page_start: 0,
            num_pages: 64,
            session: s,
            prefill_unique_rank: Some(1),
        };
        let f = encode_chunk_ready(&ready);
        assert_eq!(
            strs(&f),
            [
                "CHUNK_READY",
                "1234567890123456789",
                "0",
                "0",
                "64",
                "10.0.0.2:15234",
                "1"
            ]
        );
        assert_eq!(
            parse_decode_inbound(&f),
            Ok(DecodeInbound::ChunkReady(ready))
        );
        // Oversized round-trips; a negative round or an end before the offset is refused.
        let over = StagingRsp {
            room,
            chunk_idx: 1,
            placement: RspPlacement::Oversized,
            session: SessionId::new("d:1"),
        };
        assert_eq!(
            parse_prefill_inbound(&encode_staging_rsp(&over)),
            Ok(PrefillInbound::StagingRsp(over))
        );
        let bad =
            |f: &[&str]| parse_prefill_inbound(&f.iter().map(|x| x.as_bytes()).collect::<Vec<_>>());
        assert!(bad(&["STAGING_RSP", "7", "0", "8", "-1", "16", "d:1"]).is_err());
        assert!(bad(&["STAGING_RSP", "7", "0", "8", "0", "4", "d:1"]).is_err());
        assert!(bad(&["WATERMARK", "-1", "0", "d:1"]).is_err());
    }

    proptest! {
        #[test]
        fn parsers_never_panic(frames in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..24), 0..20)) {
            let _ = parse_prefill_inbound(&frames);
            let _ = parse_decode_inbound(&frames);
        }

        #[test]
        fn parsers_never_panic_on_tagged(tag in 0usize..9, rest in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..24), 0..20)) {
            let t: &[u8] = [
                b"None".as_slice(),
                b"ABORT",
                b"123",
                b"ABORT_ACK",
                b"STAGING_REQ",
                b"STAGING_RSP",
                b"WATERMARK",
                b"CHUNK_READY",
                b"AUX_DATA",
            ][tag];
            let mut frames = vec![t.to_vec()];
            frames.extend(rest);
            let _ = parse_prefill_inbound(&frames);
            let _ = parse_decode_inbound(&frames);
        }

        /// Staging messages with integer fields of any sign and size: the conversions into
        /// `kvx-staging`'s forms refuse what no decode sends, never panic.
        #[test]
        fn staging_conversions_never_panic(tag in 0usize..4, ints in proptest::collection::vec(any::<i64>(), 3..6)) {
            let t: &[u8] = [
                b"STAGING_REQ".as_slice(),
                b"STAGING_RSP",
                b"WATERMARK",
                b"CHUNK_READY",
            ][tag];
            let mut frames = vec![t.to_vec(), b"7".to_vec()];
            frames.extend(ints.iter().map(|i| i.to_string().into_bytes()));
            frames.push(b"10.0.0.2:1".to_vec());
            if let Ok(PrefillInbound::StagingRsp(r)) = parse_prefill_inbound(&frames)
                && let RspPlacement::At(p) = r.placement
            {
                prop_assert!(p.end >= p.offset);
            }
            let _ = parse_decode_inbound(&frames);
        }
    }
}
