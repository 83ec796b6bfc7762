//! Transfer status (spec §3.3), prefill → decode: `[room, status, prefill_unique_rank]` plus, in
//! sglang 0.5.23 and the later revision, an optional failure-reason frame. Parsing accepts 3 or 4
//! frames. [`TransferStatus::encode`] writes exactly 3, because a sglang main decode dies on any
//! other count; [`TransferStatus::encode_with_reason`] adds the reason as a 4th frame, for a
//! decode known to accept one (the caller decides, from what the decode sent).

use kvx_core::{KVPoll, Room};

use super::scalar::{
    MAX_REASON_LEN, ascii_room, ascii_u64, check_count, frame_opt, frame_or_empty, parse_i64,
    parse_room, parse_text, parse_u32,
};
use super::{CodecError, Frames};

/// A transfer status message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferStatus {
    /// The room.
    pub room: Room,
    /// The status: sglang sends only `Success` (4) and `Failed` (0).
    pub status: KVPoll,
    /// The sender's `prefill_unique_rank`.
    pub prefill_rank: u32,
    /// Failure reason (4th frame; sglang 0.5.23 and later). Encoded only by
    /// [`encode_with_reason`](Self::encode_with_reason); `None` when absent or empty.
    pub reason: Option<String>,
}

impl TransferStatus {
    /// Parses a status message (3 or 4 frames).
    pub fn parse<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, CodecError> {
        check_count(frames, "status", 3, 4, "3 or 4")?;
        let f = |i| frame_or_empty(frames, i);
        let room = parse_room(f(0), "status.room")?;
        let value = parse_i64(f(1), "status.status")?;
        let status = KVPoll::from_i64(value).ok_or(CodecError::BadStatus { value })?;
        let prefill_rank = parse_u32(f(2), "status.prefill_rank")?;
        let reason = match frame_opt(frames, 3) {
            None | Some([]) => None,
            Some(b) => Some(parse_text(b, "status.reason", MAX_REASON_LEN)?.to_owned()),
        };
        Ok(TransferStatus {
            room,
            status,
            prefill_rank,
            reason,
        })
    }

    /// Encodes the message as exactly 3 frames (the reason is not sent).
    pub fn encode(&self) -> Frames {
        vec![
            ascii_room(self.room),
            ascii_u64(u64::from(self.status.as_u8())),
            ascii_u64(u64::from(self.prefill_rank)),
        ]
    }

    /// Encodes the message with its reason as a 4th frame (UTF-8, cut at a character boundary
    /// to [`MAX_REASON_LEN`] bytes so any kvx decode parses it back), or as 3 frames when there
    /// is no (non-empty) reason. Only for decodes that take a 4th frame: sglang 0.5.23 reads it
    /// as the failure reason; a sglang main decode dies on it.
    pub fn encode_with_reason(&self) -> Frames {
        let mut out = self.encode();
        if let Some(reason) = self.reason.as_deref().filter(|r| !r.is_empty()) {
            let mut end = reason.len().min(MAX_REASON_LEN);
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            out.push(reason.as_bytes()[..end].to_vec());
        }
        out
    }
}
