//! Staging-ring messages (spec §3.7, semantics §6): `STAGING_REQ` (prefill → decode),
//! `STAGING_RSP` and `WATERMARK` (decode → prefill) and `CHUNK_READY` (prefill → decode). All
//! fields are ASCII except the tag; session ids are UTF-8 text.

use kvx_core::{Room, SessionId};

use super::scalar::{
    MAX_TEXT_LEN, ascii_i64, ascii_room, ascii_u64, check_count, frame_opt, frame_or_empty,
    parse_i64, parse_room, parse_text, parse_u32, parse_u64,
};
use super::{CodecError, Frames};

/// Frame 0 of a staging allocation request.
pub const STAGING_REQ_TAG: &[u8] = b"STAGING_REQ";
/// Frame 0 of a staging allocation response.
pub const STAGING_RSP_TAG: &[u8] = b"STAGING_RSP";
/// Frame 0 of a ring watermark.
pub const WATERMARK_TAG: &[u8] = b"WATERMARK";
/// Frame 0 of a chunk-ready notification.
pub const CHUNK_READY_TAG: &[u8] = b"CHUNK_READY";

fn check_tag(got: &[u8], want: &[u8]) -> Result<(), CodecError> {
    if got == want {
        Ok(())
    } else {
        Err(super::unknown_tag(got))
    }
}

fn session(bytes: &[u8], field: &'static str) -> Result<SessionId, CodecError> {
    parse_text(bytes, field, MAX_TEXT_LEN).map(SessionId::new)
}

/// A prefill's request for a staging allocation for one chunk of a room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingReq {
    /// The room.
    pub room: Room,
    /// The chunk index.
    pub chunk_idx: u32,
    /// Pages in the chunk.
    pub chunk_num_pages: u64,
    /// The decode session id (key of the room's transfer infos).
    pub session: SessionId,
    /// The requesting prefill's pp rank (always sent by the target revision).
    pub pp_rank: Option<u32>,
}

impl StagingReq {
    /// Parses 5 or 6 frames.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "staging_req", 5, 6, "5 or 6")?;
        let f = |i| frame_or_empty(frames, i);
        check_tag(f(0), STAGING_REQ_TAG)?;
        Ok(StagingReq {
            room: parse_room(f(1), "staging_req.room")?,
            chunk_idx: parse_u32(f(2), "staging_req.chunk_idx")?,
            chunk_num_pages: parse_u64(f(3), "staging_req.chunk_num_pages")?,
            session: session(f(4), "staging_req.session")?,
            pp_rank: frame_opt(frames, 5)
                .map(|b| parse_u32(b, "staging_req.pp_rank"))
                .transpose()?,
        })
    }

    /// Encodes 6 frames, or 5 without a pp rank.
    pub fn encode(&self) -> Frames {
        let mut out = vec![
            STAGING_REQ_TAG.to_vec(),
            ascii_room(self.room),
            ascii_u64(u64::from(self.chunk_idx)),
            ascii_u64(self.chunk_num_pages),
            self.session.as_str().as_bytes().to_vec(),
        ];
        if let Some(pp) = self.pp_rank {
            out.push(ascii_u64(u64::from(pp)));
        }
        out
    }
}

/// A decode's answer to a staging request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingRsp {
    /// The room.
    pub room: Room,
    /// The chunk index.
    pub chunk_idx: u32,
    /// Byte offset in the decode ring, or [`StagingRsp::ALLOC_OVERSIZED`].
    pub offset: i64,
    /// Ring round of the allocation.
    pub round: i64,
    /// `offset + size`, or [`StagingRsp::NO_END`].
    pub end: i64,
    /// The decode session id.
    pub session: SessionId,
}

impl StagingRsp {
    /// `offset` sentinel: the chunk can never fit in the ring.
    pub const ALLOC_OVERSIZED: i64 = -2;
    /// `end` sentinel: no allocation.
    pub const NO_END: i64 = -1;

    /// True when the decode answered "oversized".
    pub fn is_oversized(&self) -> bool {
        self.offset == Self::ALLOC_OVERSIZED
    }

    /// Parses the 7 frames; negative offsets other than -2 and negative ends other than -1 are
    /// rejected.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "staging_rsp", 7, 7, "7")?;
        let f = |i| frame_or_empty(frames, i);
        check_tag(f(0), STAGING_RSP_TAG)?;
        let offset = parse_i64(f(3), "staging_rsp.offset")?;
        if offset < 0 && offset != Self::ALLOC_OVERSIZED {
            return Err(CodecError::BadSentinel {
                field: "staging_rsp.offset",
                value: offset,
            });
        }
        let end = parse_i64(f(5), "staging_rsp.end")?;
        if end < 0 && end != Self::NO_END {
            return Err(CodecError::BadSentinel {
                field: "staging_rsp.end",
                value: end,
            });
        }
        Ok(StagingRsp {
            room: parse_room(f(1), "staging_rsp.room")?,
            chunk_idx: parse_u32(f(2), "staging_rsp.chunk_idx")?,
            offset,
            round: parse_i64(f(4), "staging_rsp.round")?,
            end,
            session: session(f(6), "staging_rsp.session")?,
        })
    }

    /// Encodes the 7 frames.
    pub fn encode(&self) -> Frames {
        vec![
            STAGING_RSP_TAG.to_vec(),
            ascii_room(self.room),
            ascii_u64(u64::from(self.chunk_idx)),
            ascii_i64(self.offset),
            ascii_i64(self.round),
            ascii_i64(self.end),
            self.session.as_str().as_bytes().to_vec(),
        ]
    }
}

/// A decode ring's watermark: everything before `tail` in round `round`, and all older rounds,
/// is free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watermark {
    /// Watermark round.
    pub round: i64,
    /// Watermark tail (byte offset).
    pub tail: u64,
    /// The decode session id (`""` when the 4th frame is missing).
    pub session: SessionId,
}

impl Watermark {
    /// Parses 3 or 4 frames.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "watermark", 3, 4, "3 or 4")?;
        let f = |i| frame_or_empty(frames, i);
        check_tag(f(0), WATERMARK_TAG)?;
        Ok(Watermark {
            round: parse_i64(f(1), "watermark.round")?,
            tail: parse_u64(f(2), "watermark.tail")?,
            session: session(f(3), "watermark.session")?,
        })
    }

    /// Encodes 4 frames.
    pub fn encode(&self) -> Frames {
        vec![
            WATERMARK_TAG.to_vec(),
            ascii_i64(self.round),
            ascii_u64(self.tail),
            self.session.as_str().as_bytes().to_vec(),
        ]
    }
}

/// A prefill's notice that a chunk landed in the decode's staging ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkReady {
    /// The room.
    pub room: Room,
    /// The chunk index.
    pub chunk_idx: u32,
    /// First page of the chunk (suffix-relative page units).
    pub page_start: u64,
    /// The prefill's page count for the chunk (after truncation to the destination).
    pub num_pages: u64,
    /// The decode session id.
    pub session: SessionId,
    /// The sender's `prefill_unique_rank` (frame 6; decodes do not read it).
    pub prefill_rank: Option<u32>,
}

impl ChunkReady {
    /// Parses 6 or 7 frames.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "chunk_ready", 6, 7, "6 or 7")?;
        let f = |i| frame_or_empty(frames, i);
        check_tag(f(0), CHUNK_READY_TAG)?;
        Ok(ChunkReady {
            room: parse_room(f(1), "chunk_ready.room")?,
            chunk_idx: parse_u32(f(2), "chunk_ready.chunk_idx")?,
            page_start: parse_u64(f(3), "chunk_ready.page_start")?,
            num_pages: parse_u64(f(4), "chunk_ready.num_pages")?,
            session: session(f(5), "chunk_ready.session")?,
            prefill_rank: frame_opt(frames, 6)
                .map(|b| parse_u32(b, "chunk_ready.prefill_rank"))
                .transpose()?,
        })
    }

    /// Encodes 7 frames, or 6 without a rank.
    pub fn encode(&self) -> Frames {
        let mut out = vec![
            CHUNK_READY_TAG.to_vec(),
            ascii_room(self.room),
            ascii_u64(u64::from(self.chunk_idx)),
            ascii_u64(self.page_start),
            ascii_u64(self.num_pages),
            self.session.as_str().as_bytes().to_vec(),
        ];
        if let Some(rank) = self.prefill_rank {
            out.push(ascii_u64(u64::from(rank)));
        }
        out
    }
}
