//! `ABORT` (spec §3.5, decode → prefill) and `ABORT_ACK` (spec §3.6, prefill → decode).
//!
//! `ABORT` is 4 frames from sglang main, 5 from sglang 0.5.23 (deferred KV release on by default:
//! the 5th frame is the decode's abort `generation`). `ABORT_ACK` is 2 frames (legacy), 3 with the
//! acking prefill's unique rank (sglang main's deferred release), or 4 with the generation of the
//! `ABORT` it answers (sglang 0.5.23, whose decode ignores an ACK without one); a legacy decode
//! reads only frame 1 of any form. The generation is an ASCII decimal u64.

use kvx_core::{Endpoint, Room};

use super::scalar::{
    ascii_room, ascii_u64, check_count, frame_opt, frame_or_empty, parse_host, parse_port,
    parse_room, parse_u32, parse_u64,
};
use super::{CodecError, Frames};

/// Frame 0 of an abort.
pub const ABORT_TAG: &[u8] = b"ABORT";
/// Frame 0 of an abort acknowledgement.
pub const ABORT_ACK_TAG: &[u8] = b"ABORT_ACK";

/// A decode's request to abort a room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The room.
    pub room: Room,
    /// The aborting decode rank's inbox, where the ack goes.
    pub endpoint: Endpoint,
    /// The 5th frame (sglang 0.5.23): the decode's abort generation, to be echoed by the ack.
    /// `None` for the 4-frame form.
    pub generation: Option<u64>,
}

impl Abort {
    /// Parses `[ABORT, room, host, port]` or `[ABORT, room, host, port, generation]`.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "abort", 4, 5, "4 or 5")?;
        let f = |i| frame_or_empty(frames, i);
        if f(0) != ABORT_TAG {
            return Err(super::unknown_tag(f(0)));
        }
        Ok(Abort {
            room: parse_room(f(1), "abort.room")?,
            endpoint: Endpoint::new(
                parse_host(f(2), "abort.host")?,
                parse_port(f(3), "abort.port")?,
            ),
            generation: frame_opt(frames, 4)
                .map(|b| parse_u64(b, "abort.generation"))
                .transpose()?,
        })
    }

    /// Encodes 4 frames, or 5 when the generation is set.
    pub fn encode(&self) -> Frames {
        let mut out = vec![
            ABORT_TAG.to_vec(),
            ascii_room(self.room),
            self.endpoint.host.as_bytes().to_vec(),
            ascii_u64(u64::from(self.endpoint.port)),
        ];
        if let Some(g) = self.generation {
            out.push(ascii_u64(g));
        }
        out
    }
}

/// A prefill's acknowledgement of an abort.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortAck {
    /// The room.
    pub room: Room,
    /// The acking prefill's unique rank (deferred-release form); `None` for the legacy form.
    pub prefill_rank: Option<u32>,
    /// The generation of the acknowledged `ABORT` (sglang 0.5.23's 4-frame form). Encoded only
    /// with a rank: the 4-frame form always has one.
    pub generation: Option<u64>,
}

impl AbortAck {
    /// Parses `[ABORT_ACK, room]`, `[ABORT_ACK, room, prefill_rank]` or
    /// `[ABORT_ACK, room, prefill_rank, generation]`.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "abort_ack", 2, 4, "2, 3 or 4")?;
        let f = |i| frame_or_empty(frames, i);
        if f(0) != ABORT_ACK_TAG {
            return Err(super::unknown_tag(f(0)));
        }
        Ok(AbortAck {
            room: parse_room(f(1), "abort_ack.room")?,
            prefill_rank: frame_opt(frames, 2)
                .map(|b| parse_u32(b, "abort_ack.prefill_rank"))
                .transpose()?,
            generation: frame_opt(frames, 3)
                .map(|b| parse_u64(b, "abort_ack.generation"))
                .transpose()?,
        })
    }

    /// Encodes 2 frames, 3 when the rank is set, 4 when the generation is set too (a
    /// generation without a rank is not encodable on the wire and is left out).
    pub fn encode(&self) -> Frames {
        let mut out = vec![ABORT_ACK_TAG.to_vec(), ascii_room(self.room)];
        if let Some(rank) = self.prefill_rank {
            out.push(ascii_u64(u64::from(rank)));
            if let Some(g) = self.generation {
                out.push(ascii_u64(g));
            }
        }
        out
    }
}
