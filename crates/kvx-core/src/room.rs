//! Rooms: the per-request identifier of a KV transfer.
//!
//! The router picks a random non-zero integer below 2^63 for every request and both the prefill
//! and the decode key all their state on it. On the wire it is an ASCII decimal string. Room 0 can
//! never complete in sglang (it is the decode's "aux row not yet written" sentinel), so it is
//! rejected here as a typed error like every other malformed value.

use std::fmt;
use std::str::FromStr;

/// A transfer room: a non-zero integer in `1..=2^63-1` (`bootstrap_room` in sglang).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Room(std::num::NonZeroU64);

/// Why a byte string is not a valid [`Room`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RoomParseError {
    /// The input was empty.
    #[error("room is empty")]
    Empty,
    /// A byte other than an ASCII digit was found (signs included).
    #[error("room contains a non-digit byte at position {0}")]
    NonDigit(usize),
    /// The value is zero, which sglang reserves as "no room".
    #[error("room 0 is not a valid room")]
    Zero,
    /// The value does not fit in 63 bits.
    #[error("room does not fit in 63 bits")]
    TooLarge,
}

impl Room {
    /// The largest valid room, 2^63 - 1.
    pub const MAX: u64 = i64::MAX as u64;

    /// Builds a room from an integer; `None` for 0 or values above [`Room::MAX`].
    pub fn new(value: u64) -> Option<Self> {
        if value > Self::MAX {
            return None;
        }
        std::num::NonZeroU64::new(value).map(Room)
    }

    /// The room as an integer.
    pub fn get(self) -> u64 {
        self.0.get()
    }

    /// Parses a room from its wire form: ASCII decimal digits, no sign, no padding rules
    /// beyond what fits (leading zeros are accepted as Python's `int()` accepts them).
    pub fn parse_ascii(bytes: &[u8]) -> Result<Self, RoomParseError> {
        if bytes.is_empty() {
            return Err(RoomParseError::Empty);
        }
        let mut value: u64 = 0;
        for (i, &b) in bytes.iter().enumerate() {
            if !b.is_ascii_digit() {
                return Err(RoomParseError::NonDigit(i));
            }
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(u64::from(b - b'0')))
                .ok_or(RoomParseError::TooLarge)?;
        }
        if value > Self::MAX {
            return Err(RoomParseError::TooLarge);
        }
        Room::new(value).ok_or(RoomParseError::Zero)
    }

    /// The wire form: ASCII decimal, as Python's `str(room).encode("ascii")`.
    pub fn to_ascii(self) -> Vec<u8> {
        self.get().to_string().into_bytes()
    }
}

impl FromStr for Room {
    type Err = RoomParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Room::parse_ascii(s.as_bytes())
    }
}

impl fmt::Display for Room {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

impl TryFrom<u64> for Room {
    type Error = RoomParseError;
    fn try_from(value: u64) -> Result<Self, Self::Error> {
        if value == 0 {
            Err(RoomParseError::Zero)
        } else {
            Room::new(value).ok_or(RoomParseError::TooLarge)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_bad_rooms() {
        assert_eq!(Room::parse_ascii(b""), Err(RoomParseError::Empty));
        assert_eq!(Room::parse_ascii(b"0"), Err(RoomParseError::Zero));
        assert_eq!(Room::parse_ascii(b"-5"), Err(RoomParseError::NonDigit(0)));
        assert_eq!(Room::parse_ascii(b"12a"), Err(RoomParseError::NonDigit(2)));
        assert_eq!(
            Room::parse_ascii(b"9223372036854775808"),
            Err(RoomParseError::TooLarge)
        );
        assert_eq!(
            Room::parse_ascii(b"99999999999999999999999"),
            Err(RoomParseError::TooLarge)
        );
        assert_eq!(
            Room::parse_ascii(b"9223372036854775807").map(Room::get),
            Ok(Room::MAX)
        );
    }

    proptest! {
        #[test]
        fn ascii_round_trip(v in 1u64..=Room::MAX) {
            let room = Room::new(v).unwrap();
            prop_assert_eq!(Room::parse_ascii(&room.to_ascii()), Ok(room));
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            let _ = Room::parse_ascii(&bytes);
        }
    }
}
