//! The codec's one error type: every way a received message can be malformed, each with a stable
//! [`CodecError::kind`] label for metrics. Drivers log the error, count it by kind and drop the
//! message; nothing in the codec panics on input.

use kvx_core::RoomParseError;

/// Why a packed-int-lists field (spec §3, `CU:37-67`) could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PackedError {
    /// Fewer than 4 bytes where the list count should be.
    #[error("count header truncated")]
    HeaderTruncated,
    /// The per-list byte-length table runs past the end of the frame.
    #[error("declares {count} lists but the length table is truncated")]
    LengthsTruncated {
        /// The declared number of lists.
        count: u32,
    },
    /// The payloads declared by the length table run past the end of the frame.
    #[error("payloads need {needed} bytes but only {available} remain")]
    PayloadTruncated {
        /// Bytes the length table asks for.
        needed: u64,
        /// Bytes actually present after the table.
        available: u64,
    },
    /// A payload's byte length is not a multiple of the element width.
    #[error("list {index} has {len} bytes, not a multiple of {width}")]
    Misaligned {
        /// Which list.
        index: u32,
        /// Its declared byte length.
        len: u32,
        /// Element width in bytes.
        width: usize,
    },
    /// Bytes are left over after the last payload.
    #[error("{extra} trailing bytes after the last list")]
    Trailing {
        /// How many bytes are left over.
        extra: u64,
    },
}

/// A malformed or unrecognised multipart message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// A message with no frames at all.
    #[error("message has no frames")]
    NoFrames,
    /// The number of frames is outside what the message allows.
    #[error("{message}: expected {expected} frames, got {got}")]
    FrameCount {
        /// The message being parsed.
        message: &'static str,
        /// The allowed counts, as text (e.g. `"3 or 4"`).
        expected: &'static str,
        /// How many frames arrived.
        got: usize,
    },
    /// Frame 0 is neither a known tag nor a room.
    #[error("unknown message tag {tag:?}")]
    UnknownTag {
        /// Frame 0, lossily decoded and cut to 32 bytes.
        tag: String,
    },
    /// A message that sglang may send but that kvx deliberately does not implement.
    #[error("{message} messages are not supported")]
    Unsupported {
        /// The tag.
        message: &'static str,
    },
    /// A field that must be an ASCII decimal integer is not one (empty, sign misuse, non-digit).
    #[error("{field}: not an ascii decimal integer")]
    BadInt {
        /// The field, as `message.field`.
        field: &'static str,
    },
    /// An ASCII integer that does not fit the field's type or range.
    #[error("{field}: integer out of range")]
    IntRange {
        /// The field.
        field: &'static str,
    },
    /// A room frame that is not a valid room.
    #[error("{field}: {source}")]
    BadRoom {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        #[source]
        source: RoomParseError,
    },
    /// A text field that is not UTF-8.
    #[error("{field}: not valid UTF-8")]
    NonUtf8 {
        /// The field.
        field: &'static str,
    },
    /// A text field that must not be empty is empty.
    #[error("{field}: must not be empty")]
    EmptyText {
        /// The field.
        field: &'static str,
    },
    /// A field longer than the codec accepts.
    #[error("{field}: {len} bytes exceeds the limit of {max}")]
    Oversized {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A little-endian array whose length is not a multiple of its element width.
    #[error("{field}: {len} bytes is not a multiple of {width}")]
    TruncatedArray {
        /// The field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// Element width in bytes.
        width: usize,
    },
    /// A malformed packed-int-lists field.
    #[error("{field}: packed int lists: {reason}")]
    Packed {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: PackedError,
    },
    /// A declared length that disagrees with the bytes that came with it.
    #[error("{field}: declared {declared} bytes, got {actual}")]
    LengthMismatch {
        /// The field.
        field: &'static str,
        /// The length the message declares.
        declared: u64,
        /// The length actually present.
        actual: u64,
    },
    /// A status value that is not a `KVPoll` state.
    #[error("status value {value} is not a KVPoll state")]
    BadStatus {
        /// The value received.
        value: i64,
    },
    /// A negative value that is not one of the field's known sentinels.
    #[error("{field}: unknown sentinel {value}")]
    BadSentinel {
        /// The field.
        field: &'static str,
        /// The value received.
        value: i64,
    },
}

impl CodecError {
    /// A short, stable label for metrics (`kvx_codec_errors_total{kind=...}`).
    pub fn kind(&self) -> &'static str {
        match self {
            CodecError::NoFrames => "no_frames",
            CodecError::FrameCount { .. } => "frame_count",
            CodecError::UnknownTag { .. } => "unknown_tag",
            CodecError::Unsupported { .. } => "unsupported",
            CodecError::BadInt { .. } => "bad_int",
            CodecError::IntRange { .. } => "int_range",
            CodecError::BadRoom { .. } => "bad_room",
            CodecError::NonUtf8 { .. } => "non_utf8",
            CodecError::EmptyText { .. } => "empty_text",
            CodecError::Oversized { .. } => "oversized",
            CodecError::TruncatedArray { .. } => "truncated_array",
            CodecError::Packed { .. } => "packed_list",
            CodecError::LengthMismatch { .. } => "length_mismatch",
            CodecError::BadStatus { .. } => "bad_status",
            CodecError::BadSentinel { .. } => "bad_sentinel",
        }
    }

    /// Every label [`CodecError::kind`] can return, e.g. to pre-register metric series.
    pub const KINDS: [&'static str; 15] = [
        "no_frames",
        "frame_count",
        "unknown_tag",
        "unsupported",
        "bad_int",
        "int_range",
        "bad_room",
        "non_utf8",
        "empty_text",
        "oversized",
        "truncated_array",
        "packed_list",
        "length_mismatch",
        "bad_status",
        "bad_sentinel",
    ];
}
