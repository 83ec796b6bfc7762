//! # kvx-core
//!
//! The deterministic heart of kvx, a KV-cache transfer engine for prefill/decode-disaggregated LLM
//! serving that speaks sglang's Mooncake control plane. This crate owns the vocabulary every other
//! kvx crate shares — [`Room`], [`KVPoll`], chunks, KV layouts, transfer [`TransferOp`]s — and the
//! logic that decides what to do: the transfer planner and the prefill/decode room managers.
//!
//! Nothing here opens a socket, reads a clock or spawns a thread. State machines take events and
//! the current time and return actions; the drivers in `kvx-cli` do the I/O.
//!
//! ```
//! use kvx_core::{KVPoll, Room};
//!
//! let room: Room = "1234567890123456789".parse().unwrap();
//! assert_eq!(room.get(), 1_234_567_890_123_456_789);
//! assert!("0".parse::<Room>().is_err());
//!
//! // Failed is sticky; otherwise a status never goes down.
//! assert_eq!(KVPoll::Success.update(KVPoll::Bootstrapping), KVPoll::Success);
//! assert_eq!(KVPoll::Failed.update(KVPoll::Success), KVPoll::Failed);
//! ```
//!
//! Planning the spec's worked example (TP1, 2 layers, 2048 bytes per page): source pages
//! `[10, 11, 12, 40]` into destination pages `[5, 6, 7, 9]` merge into two runs, so 8 writes
//! (K0, K1, V0, V1 × 2 runs) instead of 16, cut into bounded batches:
//!
//! ```
//! use kvx_core::planner::plan_kv_equal;
//! use kvx_core::{BatchLimits, KvLayout, TransferOp};
//!
//! let (kp, kd) = (0x7f00_0000_0000u64, 0x7e00_0000_0000u64);
//! let src = KvLayout::mha_contiguous(kp, 2, 2048, 64, 1);
//! let dst = KvLayout::mha_contiguous(kd, 2, 2048, 64, 1);
//! let plan = plan_kv_equal(&src, &dst, &[10, 11, 12, 40], &[5, 6, 7, 9]).unwrap();
//! assert_eq!(plan.num_ops(), 8);
//! assert_eq!(plan.ops().next(), Some(TransferOp::new(kp + 20480, kd + 10240, 6144)));
//! // A page outside the registered buffer is a typed error, never an op.
//! assert!(plan_kv_equal(&src, &dst, &[64], &[0]).is_err());
//!
//! let mut whole = kvx_core::Plan::new();
//! whole.push(kvx_core::PlanPart::Paged(plan));
//! let batches: Vec<Vec<TransferOp>> = whole.batches(BatchLimits::new(3, 1 << 20).unwrap()).collect();
//! assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3, 2]);
//! ```
//!
//! The room managers ([`PrefillManager`], [`DecodeManager`]) are driven with
//! `handle(now, event, &mut actions)`; see their module docs.
//!
//! ## Stability
//!
//! Error and failure-reason enums ([`PlanError`], [`RoomError`](prefill::RoomError),
//! [`PrefillError`](prefill::PrefillError), [`DecodeFailure`](decode::DecodeFailure),
//! [`DecodeError`](decode::DecodeError), [`LayoutError`],
//! [`MappingError`](mapping::MappingError), [`RoomParseError`]) are `#[non_exhaustive]`: match them
//! with a wildcard arm that treats an unknown cause as a generic failure. The managers' events and
//! actions are not: a driver must perform every action, so a new one is a breaking change by
//! design. The config structs ([`PrefillConfig`], [`DecodeConfig`]) keep public fields; build them
//! as `PrefillConfig { max_sessions: 64, ..PrefillConfig::default() }` — a field added later comes
//! with a default that keeps the old behaviour, so such code keeps compiling.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod chunk;
pub mod decode;
pub mod layout;
pub mod mapping;
pub mod op;
pub mod peer;
pub mod planner;
pub mod poll;
pub mod prefill;
pub mod room;

pub use chunk::{Chunk, PageSlice};
pub use decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeManager};
pub use layout::{
    AttentionKind, AuxLayout, Buffer, KvLayout, LayoutError, StateComponent, StateKind,
    fill_room_row,
};
pub use op::TransferOp;
pub use peer::{
    DecodeRegistration, Destination, Endpoint, SessionId, StagingRingInfo, TransferRequest,
};
pub use planner::{BatchLimits, Plan, PlanError, PlanPart};
pub use poll::KVPoll;
pub use prefill::{PrefillAction, PrefillConfig, PrefillEvent, PrefillManager};
pub use room::{Room, RoomParseError};
