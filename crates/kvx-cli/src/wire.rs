//! The sglang ZMQ multipart messages the drivers exchange, as byte frames.
//!
//! A thin adapter over `kvx_bootstrap::codec`: owned forms of what each inbox receives, and the
//! encoders the drivers use (registration, metadata, ABORT from a decode; status and ABORT_ACK
//! from a prefill). Every malformed frame is a typed [`WireError`]; nothing panics on input.

use kvx_core::{DecodeRegistration, Endpoint, KVPoll, Room, TransferRequest};

use kvx_bootstrap::codec::{self, Abort, AbortAck, TransferStatus};
pub use kvx_bootstrap::codec::{CodecError as WireError, Frames};

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
    },
    /// A staging message (`WATERMARK`, `STAGING_RSP`) this prefill does not use.
    Staging(&'static str),
}

/// Parses a message received on a prefill inbox.
pub fn parse_prefill_inbound<F: AsRef<[u8]>>(frames: &[F]) -> Result<PrefillInbound, WireError> {
    Ok(match codec::PrefillInbound::parse(frames)? {
        codec::PrefillInbound::Registration(r) => PrefillInbound::Registration(r),
        codec::PrefillInbound::Metadata(m) => PrefillInbound::Metadata(Box::new(m.to_request())),
        codec::PrefillInbound::Abort(a) => PrefillInbound::Abort {
            room: a.room,
            endpoint: a.endpoint,
        },
        codec::PrefillInbound::StagingRsp(_) => PrefillInbound::Staging("STAGING_RSP"),
        codec::PrefillInbound::Watermark(_) => PrefillInbound::Staging("WATERMARK"),
    })
}

/// Encodes a registration.
pub fn encode_registration(r: &DecodeRegistration) -> Result<Frames, WireError> {
    codec::encode_registration(r)
}

/// Encodes per-request metadata.
pub fn encode_metadata(t: &TransferRequest) -> Result<Frames, WireError> {
    codec::encode_metadata(t)
}

/// Encodes `ABORT` for a room from a decode endpoint.
pub fn encode_abort(room: Room, me: &Endpoint) -> Frames {
    Abort {
        room,
        endpoint: me.clone(),
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

/// Encodes the legacy 2-frame `ABORT_ACK`.
pub fn encode_abort_ack(room: Room) -> Frames {
    AbortAck {
        room,
        prefill_rank: None,
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
    /// `ABORT_ACK` for a room.
    AbortAck(Room),
    /// A message kind this decode does not use (`AUX_DATA`, `CHUNK_READY`, `STAGING_REQ`).
    Other(&'static str),
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
        codec::DecodeInbound::AbortAck(a) => DecodeInbound::AbortAck(a.room),
        other => DecodeInbound::Other(other.kind()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::{Destination, SessionId};
    use proptest::prelude::*;

    fn reg() -> DecodeRegistration {
        DecodeRegistration {
            endpoint: Endpoint::new("10.0.0.2", 41235),
            session: SessionId::new("10.0.0.2:15234"),
            kv_ptrs: vec![0x7f12_a000_0000, 0x7f12_b000_0000],
            aux_ptrs: vec![1, 2, 3],
            state_ptrs: vec![],
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            dst_kv_item_len: 2048,
            state_item_lens: vec![],
            state_dim_per_tensor: vec![],
            kv_layer_ids: vec![],
            state_layer_ids: vec![],
            staging: Default::default(),
            dcp_size: 1,
            dcp_rank: 0,
            staging_slot_layer_ids: None,
        }
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
        let a = encode_abort(room, &Endpoint::new("127.0.0.1", 9));
        assert_eq!(
            parse_prefill_inbound(&a),
            Ok(PrefillInbound::Abort {
                room,
                endpoint: Endpoint::new("127.0.0.1", 9)
            })
        );
        assert!(parse_decode_inbound(&[b"7".to_vec(), b"4".to_vec()]).is_err());
        assert!(parse_prefill_inbound(&[b"garbage".to_vec()]).is_err());
    }

    proptest! {
        #[test]
        fn parsers_never_panic(frames in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..24), 0..20)) {
            let _ = parse_prefill_inbound(&frames);
            let _ = parse_decode_inbound(&frames);
        }

        #[test]
        fn parsers_never_panic_on_tagged(tag in 0usize..4, rest in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..24), 0..20)) {
            let t: &[u8] = [b"None".as_slice(), b"ABORT", b"123", b"ABORT_ACK"][tag];
            let mut frames = vec![t.to_vec()];
            frames.extend(rest);
            let _ = parse_prefill_inbound(&frames);
            let _ = parse_decode_inbound(&frames);
        }
    }
}
