//! Inbox classification (spec §3.8): what a prefill rank's PULL inbox and a decode rank's PULL
//! inbox must recognise, dispatched on frame 0. The prefill inbox takes `WATERMARK`,
//! `STAGING_RSP`, `ABORT`, `None` (registration) and otherwise a decimal room (metadata); the decode
//! inbox takes `AUX_DATA`, `CHUNK_READY`, `STAGING_REQ`, `ABORT_ACK` and otherwise a decimal room
//! (status). Anything else is [`CodecError::UnknownTag`]; the later revision's opt-in `BOOTSTRAP`
//! message is [`CodecError::Unsupported`].

use kvx_core::{DecodeRegistration, Room};

use super::abort::{ABORT_ACK_TAG, ABORT_TAG, Abort, AbortAck};
use super::aux_data::{AUX_DATA_TAG, AuxData};
use super::metadata::{MetadataRef, encode_metadata};
use super::registration::{REGISTRATION_TAG, encode_registration, parse_registration};
use super::staging::{
    CHUNK_READY_TAG, ChunkReady, STAGING_REQ_TAG, STAGING_RSP_TAG, StagingReq, StagingRsp,
    WATERMARK_TAG, Watermark,
};
use super::status::TransferStatus;
use super::{CodecError, Frames, unknown_tag};

/// Frame 0 of the later revision's opt-in decode-allocation handshake (not implemented).
pub const BOOTSTRAP_TAG: &[u8] = b"BOOTSTRAP";

fn is_decimal(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(u8::is_ascii_digit)
}

/// A message received on a prefill rank's inbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillInbound<'a> {
    /// KV-args registration (`None`), boxed because it is large and rare.
    Registration(Box<DecodeRegistration>),
    /// Per-request metadata, borrowing the frames.
    Metadata(MetadataRef<'a>),
    /// A decode's abort.
    Abort(Abort),
    /// A staging allocation response.
    StagingRsp(StagingRsp),
    /// A staging ring watermark.
    Watermark(Watermark),
}

impl<'a> PrefillInbound<'a> {
    /// Classifies and parses one multipart message.
    pub fn parse<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, CodecError> {
        let tag = frames.first().ok_or(CodecError::NoFrames)?.as_ref();
        match tag {
            REGISTRATION_TAG => {
                parse_registration(frames).map(|r| PrefillInbound::Registration(Box::new(r)))
            }
            ABORT_TAG => Abort::parse(frames).map(PrefillInbound::Abort),
            STAGING_RSP_TAG => StagingRsp::parse(frames).map(PrefillInbound::StagingRsp),
            WATERMARK_TAG => Watermark::parse(frames).map(PrefillInbound::Watermark),
            BOOTSTRAP_TAG => Err(CodecError::Unsupported {
                message: "BOOTSTRAP",
            }),
            t if is_decimal(t) => MetadataRef::parse(frames).map(PrefillInbound::Metadata),
            t => Err(unknown_tag(t)),
        }
    }

    /// Encodes the message back to frames (the canonical form of what was parsed).
    pub fn encode(&self) -> Result<Frames, CodecError> {
        match self {
            PrefillInbound::Registration(r) => encode_registration(r),
            PrefillInbound::Metadata(m) => encode_metadata(&m.to_request()),
            PrefillInbound::Abort(a) => Ok(a.encode()),
            PrefillInbound::StagingRsp(s) => Ok(s.encode()),
            PrefillInbound::Watermark(w) => Ok(w.encode()),
        }
    }

    /// A stable label for the message type (for metrics and logs).
    pub fn kind(&self) -> &'static str {
        match self {
            PrefillInbound::Registration(_) => "registration",
            PrefillInbound::Metadata(_) => "metadata",
            PrefillInbound::Abort(_) => "abort",
            PrefillInbound::StagingRsp(_) => "staging_rsp",
            PrefillInbound::Watermark(_) => "watermark",
        }
    }

    /// The room the message is about, if any.
    pub fn room(&self) -> Option<Room> {
        match self {
            PrefillInbound::Metadata(m) => Some(m.room),
            PrefillInbound::Abort(a) => Some(a.room),
            PrefillInbound::StagingRsp(s) => Some(s.room),
            PrefillInbound::Registration(_) | PrefillInbound::Watermark(_) => None,
        }
    }
}

/// A message received on a decode rank's inbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeInbound<'a> {
    /// A transfer status.
    Status(TransferStatus),
    /// An aux row sent over TCP, borrowing the payload frame.
    AuxData(AuxData<'a>),
    /// A staging chunk landed.
    ChunkReady(ChunkReady),
    /// A staging allocation request.
    StagingReq(StagingReq),
    /// An abort acknowledgement.
    AbortAck(AbortAck),
}

impl<'a> DecodeInbound<'a> {
    /// Classifies and parses one multipart message.
    pub fn parse<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, CodecError> {
        let tag = frames.first().ok_or(CodecError::NoFrames)?.as_ref();
        match tag {
            AUX_DATA_TAG => AuxData::parse(frames).map(DecodeInbound::AuxData),
            CHUNK_READY_TAG => ChunkReady::parse(frames).map(DecodeInbound::ChunkReady),
            STAGING_REQ_TAG => StagingReq::parse(frames).map(DecodeInbound::StagingReq),
            ABORT_ACK_TAG => AbortAck::parse(frames).map(DecodeInbound::AbortAck),
            t if is_decimal(t) => TransferStatus::parse(frames).map(DecodeInbound::Status),
            t => Err(unknown_tag(t)),
        }
    }

    /// Encodes the message back to frames (the canonical form of what was parsed: a status keeps
    /// its reason as a 4th frame, see [`TransferStatus::encode_with_reason`]).
    pub fn encode(&self) -> Result<Frames, CodecError> {
        match self {
            DecodeInbound::Status(s) => Ok(s.encode_with_reason()),
            DecodeInbound::AuxData(a) => a.encode(),
            DecodeInbound::ChunkReady(c) => Ok(c.encode()),
            DecodeInbound::StagingReq(s) => Ok(s.encode()),
            DecodeInbound::AbortAck(a) => Ok(a.encode()),
        }
    }

    /// A stable label for the message type (for metrics and logs).
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeInbound::Status(_) => "status",
            DecodeInbound::AuxData(_) => "aux_data",
            DecodeInbound::ChunkReady(_) => "chunk_ready",
            DecodeInbound::StagingReq(_) => "staging_req",
            DecodeInbound::AbortAck(_) => "abort_ack",
        }
    }

    /// The room the message is about.
    pub fn room(&self) -> Room {
        match self {
            DecodeInbound::Status(s) => s.room,
            DecodeInbound::AuxData(a) => a.room,
            DecodeInbound::ChunkReady(c) => c.room,
            DecodeInbound::StagingReq(s) => s.room,
            DecodeInbound::AbortAck(a) => a.room,
        }
    }
}
