//! Sans-IO codec for sglang's PD-disaggregation ZMQ multipart messages (spec §3), byte-exact
//! with the target revision and tolerant of the later one where the spec marks a delta.
//!
//! Frames come in as `&[impl AsRef<[u8]>]` (ZMQ messages, `Vec<u8>`, `&[u8]`, `bytes::Bytes`) and
//! go out as [`Frames`]. Every message type parses into a typed value and encodes back to the same
//! bytes; every malformed input is a [`CodecError`] with a stable [`CodecError::kind`] label, and
//! nothing panics. [`PrefillInbound`] and [`DecodeInbound`] classify what arrives on each inbox.
//! The hot per-request metadata path ([`MetadataRef`]) borrows its frames and copies nothing.
//!
//! ```
//! use kvx_bootstrap::codec::{PrefillInbound, TransferStatus, encode_metadata};
//! use kvx_core::{Destination, Endpoint, KVPoll, Room, SessionId, TransferRequest};
//!
//! let req = TransferRequest {
//!     room: Room::new(1234567890123456789).unwrap(),
//!     endpoint: Endpoint::new("10.0.0.2", 41235),
//!     session: SessionId::new("10.0.0.2:15234"),
//!     dst: Some(Destination { kv_pages: vec![5, 6, 7, 12], aux_index: 17, state_indices: vec![] }),
//!     required_dst_info_num: 1,
//!     decode_prefix_len: Some(0),
//!     device_kv_pages: vec![],
//! };
//! let frames = encode_metadata(&req).unwrap();
//! assert_eq!(frames[4], [5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 12, 0, 0, 0]);
//! match PrefillInbound::parse(&frames).unwrap() {
//!     PrefillInbound::Metadata(m) => {
//!         assert_eq!(m.dst.unwrap().kv_pages.to_vec(), [5, 6, 7, 12]);
//!         assert_eq!(m.to_request(), req);
//!     }
//!     other => panic!("unexpected {other:?}"),
//! }
//!
//! let status = TransferStatus { room: req.room, status: KVPoll::Success, prefill_rank: 0, reason: None };
//! assert_eq!(status.encode(), [&b"1234567890123456789"[..], b"4", b"0"]);
//! assert_eq!(PrefillInbound::parse(&[b"garbage"]).unwrap_err().kind(), "unknown_tag");
//! ```

mod abort;
mod aux_data;
pub mod check;
mod error;
mod inbox;
mod le;
mod metadata;
mod packed;
mod registration;
mod scalar;
mod staging;
mod status;

pub use abort::{ABORT_ACK_TAG, ABORT_TAG, Abort, AbortAck};
pub use aux_data::{AUX_DATA_TAG, AuxData};
pub use error::{CodecError, PackedError};
pub use inbox::{BOOTSTRAP_TAG, DecodeInbound, PrefillInbound};
pub use le::{LeInt, LeIter, LeSlice, encode_le};
pub use metadata::{DestinationRef, MetadataRef, encode_metadata, parse_metadata};
pub use packed::{PackedIter, PackedLists, encode_packed};
pub use registration::{REGISTRATION_TAG, encode_registration, parse_registration};
pub use scalar::{
    MAX_REASON_LEN, MAX_TEXT_LEN, ascii_i64, ascii_room, ascii_u64, parse_host, parse_i64,
    parse_port, parse_room, parse_text, parse_u32, parse_u64,
};
pub use staging::{
    CHUNK_READY_TAG, ChunkReady, STAGING_REQ_TAG, STAGING_RSP_TAG, StagingReq, StagingRsp,
    WATERMARK_TAG, Watermark,
};
pub use status::TransferStatus;

/// An encoded multipart message: one `Vec<u8>` per ZMQ frame.
pub type Frames = Vec<Vec<u8>>;

/// The error for an unrecognised frame 0, keeping at most 32 bytes of it for logs.
pub(crate) fn unknown_tag(tag: &[u8]) -> CodecError {
    let cut = &tag[..tag.len().min(32)];
    CodecError::UnknownTag {
        tag: String::from_utf8_lossy(cut).into_owned(),
    }
}
