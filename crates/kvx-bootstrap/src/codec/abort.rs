//! `ABORT` (spec §3.5, decode → prefill) and `ABORT_ACK` (spec §3.6, prefill → decode).
//! `ABORT` is exactly 4 frames; `ABORT_ACK` is 2 frames (legacy) or 3 with the acking prefill's
//! unique rank (deferred KV release), and a legacy decode reads only frame 1 of either form.

use kvx_core::{Endpoint, Room};

use super::scalar::{
    ascii_room, ascii_u64, check_count, frame_opt, frame_or_empty, parse_host, parse_port,
    parse_room, parse_u32,
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
}

impl Abort {
    /// Parses `[ABORT, room, host, port]`.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "abort", 4, 4, "4")?;
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
        })
    }

    /// Encodes the 4 frames.
    pub fn encode(&self) -> Frames {
        vec![
            ABORT_TAG.to_vec(),
            ascii_room(self.room),
            self.endpoint.host.as_bytes().to_vec(),
            ascii_u64(u64::from(self.endpoint.port)),
        ]
    }
}

/// A prefill's acknowledgement of an abort.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortAck {
    /// The room.
    pub room: Room,
    /// The acking prefill's unique rank (deferred-release form); `None` for the legacy form.
    pub prefill_rank: Option<u32>,
}

impl AbortAck {
    /// Parses `[ABORT_ACK, room]` or `[ABORT_ACK, room, prefill_rank]`.
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "abort_ack", 2, 3, "2 or 3")?;
        let f = |i| frame_or_empty(frames, i);
        if f(0) != ABORT_ACK_TAG {
            return Err(super::unknown_tag(f(0)));
        }
        Ok(AbortAck {
            room: parse_room(f(1), "abort_ack.room")?,
            prefill_rank: frame_opt(frames, 2)
                .map(|b| parse_u32(b, "abort_ack.prefill_rank"))
                .transpose()?,
        })
    }

    /// Encodes 2 frames, or 3 when the rank is set.
    pub fn encode(&self) -> Frames {
        let mut out = vec![ABORT_ACK_TAG.to_vec(), ascii_room(self.room)];
        if let Some(rank) = self.prefill_rank {
            out.push(ascii_u64(u64::from(rank)));
        }
        out
    }
}
