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

pub mod chunk;
pub mod layout;
pub mod op;
pub mod peer;
pub mod planner;
pub mod poll;
pub mod prefill;
pub mod room;

pub use chunk::{Chunk, PageSlice};
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
