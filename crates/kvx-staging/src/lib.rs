//! # kvx-staging
//!
//! Staging for heterogeneous attention-TP KV transfer (sglang's `SGLANG_DISAGG_STAGING_BUFFER`,
//! spec §6): instead of one small write per (token, layer, K/V) — the head-slice path — the
//! prefill gathers a chunk's head slices into one contiguous block, writes it with one op into a
//! ring on the decode, and the decode scatters it into its KV pages.
//!
//! Everything here is deterministic: no I/O, no clocks, no threads.
//! - [`ring`]: the decode's overcommitting ring allocator and its [`Watermark`];
//! - [`decode`]: the decode-side state machine (allocation per chunk, arrivals, scatter jobs,
//!   subscribers tied to rooms, aborted rooms' regions fenced until the prefill confirms);
//! - [`prefill`]: the prefill-side state machine (prefetch keys, per-session watermarks, a
//!   scheduler that parks and wakes chunks);
//! - [`grid`]: the chunk grid both sides cut from the decode prefix;
//! - [`heads`]: TP geometry (which heads go where) and the writers' layout of a chunk region
//!   (TP writers, prefill pipeline stages, the write ops of a block);
//! - [`copy`]: gather and scatter on host memory, and the gather as page-run writes when the
//!   slice is whole token slots ([`gather_writes`]: no CPU copy), or as per-token writes for
//!   any slice ([`gather_writes_by_token`], for a transport that gathers sources itself);
//!   [`host`]: a checked op executor for tests;
//! - [`place`]: the scatter as a map from block offsets to page addresses ([`ScatterMap`]), so
//!   that a decode that receives a block itself reads it straight into its pages;
//! - [`msg`]: plain forms of `STAGING_REQ`, `STAGING_RSP`, `WATERMARK`, `CHUNK_READY`.
//!
//! ```
//! use kvx_core::{Room, SessionId};
//! use kvx_staging::{
//!     ChunkGrid, DecodeAction, DecodeRoom, DecodeStaging, PrefillStaging, Readiness, RoomGrid,
//!     StagedLayout, TpGeometry,
//! };
//!
//! let room = Room::new(7).unwrap();
//! let session = SessionId::new("10.0.0.2:15234");
//! // 8 KV heads, prefill TP 2 -> decode TP 1, 2 layers, 256 B per head-token, page size 1.
//! let geom = TpGeometry::new(8, 2, 1).unwrap();
//! let layout = StagedLayout::for_decode(&geom, 0, 2, 256, 1);
//! let grid = RoomGrid::from_pages(ChunkGrid::with_pages(64), 100);
//!
//! let mut decode = DecodeStaging::new(session.clone(), 16 << 20);
//! decode
//!     .register_room(room, DecodeRoom { peers: vec!["prefill-0"], grid, layout })
//!     .unwrap();
//! let mut prefill = PrefillStaging::new();
//! let reqs = prefill.prefetch(room, &session, &grid, None).unwrap();
//! assert_eq!(reqs.len(), 2); // pages 0..64 and 64..100
//!
//! for req in &reqs {
//!     for action in decode.on_staging_req(req).unwrap() {
//!         match action {
//!             DecodeAction::Respond { rsp, .. } => {
//!                 prefill.on_staging_rsp(&rsp).unwrap();
//!             }
//!             DecodeAction::Watermark { msg, .. } => {
//!                 prefill.on_watermark(&msg);
//!             }
//!             DecodeAction::Scatter(_) => unreachable!(),
//!         }
//!     }
//! }
//! // Round-0 placements are writable at once.
//! assert!(matches!(prefill.poll(&reqs[0].key()), Readiness::Ready(p) if p.offset == 0));
//! prefill.conclude_room(room);
//! decode.release_room(room);
//! assert!(prefill.is_idle() && decode.live_allocations() == 0);
//! ```
//!
//! ## Stability
//!
//! The error enums ([`PrefillError`], [`DecodeError`], [`GeometryError`], [`CopyError`]) are
//! `#[non_exhaustive]`; `PrefillError::kind` and `DecodeError::kind` give a stable label without a
//! match. [`DecodeAction`] is not: a driver must perform every action, so a new one is a breaking
//! change by design.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod copy;
pub mod decode;
pub mod grid;
pub mod heads;
pub mod host;
pub mod msg;
pub mod place;
pub mod prefill;
pub mod ring;

pub use copy::{CopyError, SliceSpec, gather, gather_writes, gather_writes_by_token, scatter};
pub use decode::{DecodeAction, DecodeError, DecodeRoom, DecodeStaging, ScatterJob};
pub use grid::{ChunkGrid, RoomGrid};
pub use heads::{GeometryError, HeadSlice, StagedLayout, TpGeometry, Writer};
pub use host::{HostMemory, OutOfRegion};
pub use msg::{
    ALLOC_OVERSIZED, ChunkKey, ChunkReady, RspPlacement, StagingReq, StagingRsp, WatermarkMsg,
};
pub use place::ScatterMap;
pub use prefill::{PrefillError, PrefillStaging, Readiness, Wake};
pub use ring::{AllocId, Oversized, Placement, StagingRing, Watermark};
