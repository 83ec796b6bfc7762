//! proptest strategies for the codec's message types, shared by the codec integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use kvx_bootstrap::codec::{
    Abort, AbortAck, ChunkReady, StagingReq, StagingRsp, TransferStatus, Watermark,
};
use kvx_core::{
    DecodeRegistration, Destination, Endpoint, KVPoll, Room, SessionId, StagingRingInfo,
    TransferRequest,
};
use proptest::collection::vec;
use proptest::prelude::*;

pub fn room() -> impl Strategy<Value = Room> {
    (1u64..=Room::MAX).prop_map(|v| Room::new(v).unwrap())
}

pub fn host() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9.-]{1,30}",
        "(fe80|2001|::)(:[0-9a-f]{1,4}){1,6}",
        (any::<u8>(), any::<u8>()).prop_map(|(a, b)| format!("10.{a}.{b}.2")),
    ]
}

pub fn endpoint() -> impl Strategy<Value = Endpoint> {
    (host(), any::<u16>()).prop_map(|(h, p)| Endpoint::new(h, p))
}

pub fn session() -> impl Strategy<Value = SessionId> {
    prop_oneof![
        (host(), any::<u16>()).prop_map(|(h, p)| SessionId::new(format!("{h}:{p}"))),
        "\\PC{0,24}".prop_map(SessionId::new),
    ]
}

fn lists<T: Arbitrary + std::fmt::Debug>() -> impl Strategy<Value = Vec<Vec<T>>> {
    vec(vec(any::<T>(), 0..5), 0..4)
}

pub fn registration() -> impl Strategy<Value = DecodeRegistration> {
    let a = (
        endpoint(),
        session(),
        vec(any::<u64>(), 0..12),
        vec(any::<u64>(), 0..12),
        lists::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
    );
    let b = (
        lists::<u32>(),
        lists::<u32>(),
        vec(any::<u32>(), 0..8),
        lists::<u32>(),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        any::<u32>(),
        any::<u32>(),
        proptest::option::of(vec(any::<u64>(), 0..6)),
        proptest::option::of(vec(any::<u64>(), 0..6)),
    );
    (a, b).prop_map(
        |(
            (endpoint, session, kv_ptrs, aux_ptrs, state_ptrs, dst_tp_rank, dst_attn_tp_size, item),
            (
                state_item_lens,
                state_dim_per_tensor,
                kv_layer_ids,
                state_layer_ids,
                base,
                size,
                dcp_size,
                dcp_rank,
                slots,
                item_lens,
            ),
        )| DecodeRegistration {
            endpoint,
            session,
            kv_ptrs,
            aux_ptrs,
            state_ptrs,
            dst_tp_rank,
            dst_attn_tp_size,
            dst_kv_item_len: item,
            state_item_lens,
            state_dim_per_tensor,
            kv_layer_ids,
            state_layer_ids,
            staging: StagingRingInfo { base, size },
            dcp_size,
            dcp_rank,
            // With frame 19 present, frame 18 is always on the wire (empty when no slots).
            staging_slot_layer_ids: if item_lens.is_some() {
                Some(slots.unwrap_or_default())
            } else {
                slots
            },
            kv_item_lens: item_lens,
        },
    )
}

pub fn destination() -> impl Strategy<Value = Destination> {
    (vec(any::<i32>(), 0..40), any::<i64>(), lists::<i32>()).prop_map(
        |(kv_pages, aux_index, state_indices)| Destination {
            kv_pages,
            aux_index,
            state_indices,
        },
    )
}

pub fn request() -> impl Strategy<Value = TransferRequest> {
    (
        room(),
        endpoint(),
        session(),
        proptest::option::of(destination()),
        any::<u32>(),
        proptest::option::of(any::<u64>()),
        vec(any::<i32>(), 0..6),
    )
        .prop_map(
            |(room, endpoint, session, dst, required, prefix, device)| TransferRequest {
                room,
                endpoint,
                session,
                dst,
                required_dst_info_num: required,
                decode_prefix_len: prefix,
                device_kv_pages: device,
            },
        )
}

pub fn poll() -> impl Strategy<Value = KVPoll> {
    proptest::sample::select(KVPoll::ALL.to_vec())
}

pub fn status() -> impl Strategy<Value = TransferStatus> {
    (room(), poll(), any::<u32>()).prop_map(|(room, status, prefill_rank)| TransferStatus {
        room,
        status,
        prefill_rank,
        reason: None,
    })
}

/// A status with an optional, non-empty failure reason (the 4-frame form when set).
pub fn status_with_reason() -> impl Strategy<Value = TransferStatus> {
    (status(), proptest::option::of(".{1,40}"))
        .prop_map(|(s, reason)| TransferStatus { reason, ..s })
}

pub fn abort() -> impl Strategy<Value = Abort> {
    (room(), endpoint(), proptest::option::of(any::<u64>())).prop_map(
        |(room, endpoint, generation)| Abort {
            room,
            endpoint,
            generation,
        },
    )
}

/// An ack in any of its wire forms: 2 frames, 3 with a rank, 4 with a rank and a generation.
pub fn abort_ack() -> impl Strategy<Value = AbortAck> {
    (
        room(),
        proptest::option::of((any::<u32>(), proptest::option::of(any::<u64>()))),
    )
        .prop_map(|(room, ranked)| AbortAck {
            room,
            prefill_rank: ranked.map(|(r, _)| r),
            generation: ranked.and_then(|(_, g)| g),
        })
}

pub fn staging_req() -> impl Strategy<Value = StagingReq> {
    (
        room(),
        any::<u32>(),
        any::<u64>(),
        session(),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(
            |(room, chunk_idx, chunk_num_pages, session, pp_rank)| StagingReq {
                room,
                chunk_idx,
                chunk_num_pages,
                session,
                pp_rank,
            },
        )
}

pub fn staging_rsp() -> impl Strategy<Value = StagingRsp> {
    (
        room(),
        any::<u32>(),
        prop_oneof![Just(StagingRsp::ALLOC_OVERSIZED), 0i64..=i64::MAX],
        any::<i64>(),
        prop_oneof![Just(StagingRsp::NO_END), 0i64..=i64::MAX],
        session(),
    )
        .prop_map(
            |(room, chunk_idx, offset, round, end, session)| StagingRsp {
                room,
                chunk_idx,
                offset,
                round,
                end,
                session,
            },
        )
}

pub fn watermark() -> impl Strategy<Value = Watermark> {
    (any::<i64>(), any::<u64>(), session()).prop_map(|(round, tail, session)| Watermark {
        round,
        tail,
        session,
    })
}

pub fn chunk_ready() -> impl Strategy<Value = ChunkReady> {
    (
        room(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        session(),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(
            |(room, chunk_idx, page_start, num_pages, session, prefill_rank)| ChunkReady {
                room,
                chunk_idx,
                page_start,
                num_pages,
                session,
                prefill_rank,
            },
        )
}

/// Any valid message for either inbox, as encoded frames.
pub fn valid_frames() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop_oneof![
        registration().prop_map(|r| kvx_bootstrap::codec::encode_registration(&r).unwrap()),
        request().prop_map(|r| kvx_bootstrap::codec::encode_metadata(&r).unwrap()),
        status().prop_map(|s| s.encode()),
        status_with_reason().prop_map(|s| s.encode_with_reason()),
        abort().prop_map(|a| a.encode()),
        abort_ack().prop_map(|a| a.encode()),
        staging_req().prop_map(|s| s.encode()),
        staging_rsp().prop_map(|s| s.encode()),
        watermark().prop_map(|w| w.encode()),
        chunk_ready().prop_map(|c| c.encode()),
        (room(), any::<u32>(), any::<i64>(), vec(any::<u8>(), 0..64)).prop_map(
            |(room, aux_index, dst_row, payload)| kvx_bootstrap::codec::AuxData {
                room,
                aux_index,
                dst_row,
                payload: &payload,
            }
            .encode()
            .unwrap()
        ),
    ]
}

/// One way of damaging a valid message.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Drop frame `i`.
    DropFrame(usize),
    /// Append an extra frame.
    Append(Vec<u8>),
    /// Truncate frame `i` to `n` bytes.
    Truncate(usize, usize),
    /// Replace frame `i`.
    Replace(usize, Vec<u8>),
    /// Flip a bit in frame `i`.
    Flip(usize, usize, u8),
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    let junk = prop_oneof![
        vec(any::<u8>(), 0..12),
        Just(b"0".to_vec()),
        Just(b"-1".to_vec()),
        Just(b"-2".to_vec()),
        Just(b"None".to_vec()),
        Just(b"99999999999999999999999".to_vec()),
        Just(vec![0xff, 0xfe]),
        Just(Vec::new()),
    ];
    prop_oneof![
        any::<usize>().prop_map(Mutation::DropFrame),
        junk.clone().prop_map(Mutation::Append),
        (any::<usize>(), 0usize..16).prop_map(|(i, n)| Mutation::Truncate(i, n)),
        (any::<usize>(), junk).prop_map(|(i, j)| Mutation::Replace(i, j)),
        (any::<usize>(), any::<usize>(), 0u8..8).prop_map(|(i, j, b)| Mutation::Flip(i, j, b)),
    ]
}

pub fn apply(frames: &mut Vec<Vec<u8>>, m: &Mutation) {
    let n = frames.len().max(1);
    match m {
        Mutation::DropFrame(i) => {
            if !frames.is_empty() {
                frames.remove(i % n);
            }
        }
        Mutation::Append(j) => frames.push(j.clone()),
        Mutation::Truncate(i, len) => {
            if let Some(f) = frames.get_mut(i % n) {
                f.truncate(*len);
            }
        }
        Mutation::Replace(i, j) => {
            if let Some(f) = frames.get_mut(i % n) {
                *f = j.clone();
            }
        }
        Mutation::Flip(i, j, b) => {
            if let Some(f) = frames.get_mut(i % n)
                && !f.is_empty()
            {
                let k = j % f.len();
                f[k] ^= 1 << b;
            }
        }
    }
}
