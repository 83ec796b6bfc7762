//! Scalar fields of control frames: ASCII decimal integers (Python's `str(n).encode()`), rooms,
//! UTF-8 text with a length cap, and frame access by index. Parsing is strict: an optional `-`
//! followed by 1–20 ASCII digits, nothing else (no `+`, no whitespace, no underscores), which is
//! exactly what sglang's encoders produce.

use kvx_core::Room;

use super::CodecError;

/// Longest host, session id or other short text field the codec accepts, in bytes.
pub const MAX_TEXT_LEN: usize = 1024;

/// Longest failure-reason text the codec accepts, in bytes.
pub const MAX_REASON_LEN: usize = 64 * 1024;

/// Frame `i` as bytes, or an empty slice when the message is shorter (for optional frames).
pub(crate) fn frame_or_empty<F: AsRef<[u8]>>(frames: &[F], i: usize) -> &[u8] {
    frames.get(i).map_or(&[][..], AsRef::as_ref)
}

/// Frame `i` as bytes if present.
pub(crate) fn frame_opt<F: AsRef<[u8]>>(frames: &[F], i: usize) -> Option<&[u8]> {
    frames.get(i).map(AsRef::as_ref)
}

/// Checks `lo <= frames.len() <= hi`.
pub(crate) fn check_count<F>(
    frames: &[F],
    message: &'static str,
    lo: usize,
    hi: usize,
    expected: &'static str,
) -> Result<(), CodecError> {
    let got = frames.len();
    if got < lo || got > hi {
        return Err(CodecError::FrameCount {
            message,
            expected,
            got,
        });
    }
    Ok(())
}

/// Parses sign and magnitude of a strict ASCII decimal integer.
fn parse_sign_magnitude(bytes: &[u8], field: &'static str) -> Result<(bool, u64), CodecError> {
    let (neg, digits) = match bytes.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, bytes),
    };
    if digits.is_empty() {
        return Err(CodecError::BadInt { field });
    }
    let mut value: u64 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return Err(CodecError::BadInt { field });
        }
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(b - b'0')))
            .ok_or(CodecError::IntRange { field })?;
    }
    Ok((neg, value))
}

/// Parses an ASCII decimal `i64`.
pub fn parse_i64(bytes: &[u8], field: &'static str) -> Result<i64, CodecError> {
    let (neg, mag) = parse_sign_magnitude(bytes, field)?;
    if neg {
        0i64.checked_sub_unsigned(mag)
            .ok_or(CodecError::IntRange { field })
    } else {
        i64::try_from(mag).map_err(|_| CodecError::IntRange { field })
    }
}

/// Parses an ASCII decimal `u64` (a leading `-` is accepted only for `-0`).
pub fn parse_u64(bytes: &[u8], field: &'static str) -> Result<u64, CodecError> {
    match parse_sign_magnitude(bytes, field)? {
        (true, mag) if mag != 0 => Err(CodecError::IntRange { field }),
        (_, mag) => Ok(mag),
    }
}

/// Parses an ASCII decimal `u32`.
pub fn parse_u32(bytes: &[u8], field: &'static str) -> Result<u32, CodecError> {
    u32::try_from(parse_u64(bytes, field)?).map_err(|_| CodecError::IntRange { field })
}

/// Parses an ASCII decimal TCP port.
pub fn parse_port(bytes: &[u8], field: &'static str) -> Result<u16, CodecError> {
    u16::try_from(parse_u64(bytes, field)?).map_err(|_| CodecError::IntRange { field })
}

/// Parses a room frame.
pub fn parse_room(bytes: &[u8], field: &'static str) -> Result<Room, CodecError> {
    Room::parse_ascii(bytes).map_err(|source| CodecError::BadRoom { field, source })
}

/// Parses UTF-8 text of at most `max` bytes.
pub fn parse_text<'a>(
    bytes: &'a [u8],
    field: &'static str,
    max: usize,
) -> Result<&'a str, CodecError> {
    if bytes.len() > max {
        return Err(CodecError::Oversized {
            field,
            len: bytes.len(),
            max,
        });
    }
    std::str::from_utf8(bytes).map_err(|_| CodecError::NonUtf8 { field })
}

/// Parses a non-empty host name or address (IPv6 without brackets) of at most [`MAX_TEXT_LEN`].
pub fn parse_host<'a>(bytes: &'a [u8], field: &'static str) -> Result<&'a str, CodecError> {
    let s = parse_text(bytes, field, MAX_TEXT_LEN)?;
    if s.is_empty() {
        return Err(CodecError::EmptyText { field });
    }
    Ok(s)
}

/// Appends the ASCII decimal form of `v` (Python's `str(v)`).
pub(crate) fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        // `v % 10` is below 10, so the cast cannot truncate.
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// The ASCII decimal form of an unsigned integer.
pub fn ascii_u64(v: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(20);
    push_u64(&mut out, v);
    out
}

/// The ASCII decimal form of a signed integer.
pub fn ascii_i64(v: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(20);
    if v < 0 {
        out.push(b'-');
    }
    push_u64(&mut out, v.unsigned_abs());
    out
}

/// The wire form of a room.
pub fn ascii_room(room: Room) -> Vec<u8> {
    ascii_u64(room.get())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn strict_ints() {
        assert_eq!(parse_i64(b"-5", "f"), Ok(-5));
        assert_eq!(parse_i64(b"007", "f"), Ok(7));
        assert_eq!(parse_i64(b"-9223372036854775808", "f"), Ok(i64::MIN));
        assert_eq!(
            parse_i64(b"9223372036854775808", "f").map_err(|e| e.kind()),
            Err("int_range")
        );
        for bad in [
            &b""[..],
            b"-",
            b"+1",
            b" 1",
            b"1_0",
            b"1.0",
            b"--1",
            b"0x10",
        ] {
            assert_eq!(parse_i64(bad, "f").map_err(|e| e.kind()), Err("bad_int"));
        }
        assert_eq!(parse_u64(b"-0", "f"), Ok(0));
        assert_eq!(
            parse_u64(b"-1", "f").map_err(|e| e.kind()),
            Err("int_range")
        );
        assert_eq!(parse_u64(b"18446744073709551615", "f"), Ok(u64::MAX));
        assert_eq!(
            parse_u64(b"18446744073709551616", "f").map_err(|e| e.kind()),
            Err("int_range")
        );
        assert_eq!(
            parse_port(b"65536", "f").map_err(|e| e.kind()),
            Err("int_range")
        );
        assert_eq!(parse_room(b"0", "f").map_err(|e| e.kind()), Err("bad_room"));
    }

    #[test]
    fn text_limits() {
        assert_eq!(
            parse_host(b"", "h").map_err(|e| e.kind()),
            Err("empty_text")
        );
        assert_eq!(
            parse_host(b"\xff", "h").map_err(|e| e.kind()),
            Err("non_utf8")
        );
        let long = vec![b'a'; MAX_TEXT_LEN + 1];
        assert_eq!(
            parse_host(&long, "h").map_err(|e| e.kind()),
            Err("oversized")
        );
        assert_eq!(parse_host(b"fe80::1", "h"), Ok("fe80::1"));
    }

    proptest! {
        #[test]
        fn i64_round_trip(v in any::<i64>()) {
            let bytes = ascii_i64(v);
            prop_assert_eq!(&bytes, &v.to_string().into_bytes());
            prop_assert_eq!(parse_i64(&bytes, "f"), Ok(v));
        }

        #[test]
        fn u64_round_trip(v in any::<u64>()) {
            let bytes = ascii_u64(v);
            prop_assert_eq!(&bytes, &v.to_string().into_bytes());
            prop_assert_eq!(parse_u64(&bytes, "f"), Ok(v));
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            let _ = parse_i64(&bytes, "f");
            let _ = parse_u64(&bytes, "f");
            let _ = parse_host(&bytes, "f");
        }
    }
}
