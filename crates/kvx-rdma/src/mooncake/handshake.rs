//! Framing of Mooncake TE's handshake (RPC) port, sans I/O.
//!
//! One request and one reply per TCP connection, both framed as an 8-byte little-endian length
//! `L` followed by `L` bytes: a type byte (0 Connection, 1 Metadata, 2 Notify, 3 Probe) and JSON
//! text. A frame whose first byte is above 3 (and below 0x80) is an "old protocol" frame: all
//! `L` bytes are JSON, it is handled like a Connection request, and the reply carries no type
//! byte. Replies echo the request type. This module decodes and encodes frames and holds the
//! fixed reply bodies; `server` and `client` do the socket work.

/// Largest `L` accepted (Mooncake's default `MC_HANDSHAKE_MAX_LENGTH`).
pub const MAX_FRAME_LEN: u64 = 1 << 20;
/// Size of the length prefix.
pub const LEN_PREFIX: usize = 8;

/// Reply to a Probe (type 3).
pub const PROBE_REPLY: &str = "{\"status\":\"success\"}\n";
/// Reply to a Notify (type 2).
pub const NOTIFY_REPLY: &str = "{\"name\":\"\",\"notify_msg\":\"success\"}\n";
/// Reply to a Connection (type 0) from a TCP-only engine: an empty RDMA `HandShakeDesc`.
pub const CONNECTION_REPLY: &str = "{\"local_gid\":\"\",\"local_lid\":0,\"local_nic_path\":\"\",\
\"payload\":\"\",\"peer_nic_path\":\"\",\"qp_num\":[],\"reply_msg\":\"\"}\n";

/// The request types of the handshake port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestType {
    /// 0: RDMA queue-pair handshake.
    Connection,
    /// 1: segment descriptor exchange.
    Metadata,
    /// 2: notification message.
    Notify,
    /// 3: liveness probe.
    Probe,
}

impl RequestType {
    /// The type byte.
    pub const fn byte(self) -> u8 {
        match self {
            RequestType::Connection => 0,
            RequestType::Metadata => 1,
            RequestType::Notify => 2,
            RequestType::Probe => 3,
        }
    }

    /// The type for a byte (`None` above 3).
    pub const fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(RequestType::Connection),
            1 => Some(RequestType::Metadata),
            2 => Some(RequestType::Notify),
            3 => Some(RequestType::Probe),
            _ => None,
        }
    }

    /// A short stable label (metrics).
    pub const fn as_str(self) -> &'static str {
        match self {
            RequestType::Connection => "connection",
            RequestType::Metadata => "metadata",
            RequestType::Notify => "notify",
            RequestType::Probe => "probe",
        }
    }
}

/// A malformed handshake frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Fewer bytes than the frame needs.
    #[error("truncated frame: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: u64,
        /// Bytes present.
        have: u64,
    },
    /// `L == 0`.
    #[error("empty frame")]
    Empty,
    /// `L` above [`MAX_FRAME_LEN`].
    #[error("frame length {0} above the {MAX_FRAME_LEN}-byte limit")]
    TooLong(u64),
    /// A type byte Mooncake does not know (0x80 and above).
    #[error("unknown request type {0:#04x}")]
    UnknownType(u8),
    /// The reply's type is not the request's.
    #[error("reply type {got:#04x} does not echo request type {expected:#04x}")]
    TypeMismatch {
        /// The request's type byte.
        expected: u8,
        /// What came back.
        got: u8,
    },
    /// The body is not JSON.
    #[error("bad JSON: {0}")]
    BadJson(String),
}

impl HandshakeError {
    /// A short stable label (metrics).
    pub fn cause(&self) -> &'static str {
        match self {
            HandshakeError::Truncated { .. } => "truncated",
            HandshakeError::Empty => "empty",
            HandshakeError::TooLong(_) => "too_long",
            HandshakeError::UnknownType(_) => "unknown_type",
            HandshakeError::TypeMismatch { .. } => "type_mismatch",
            HandshakeError::BadJson(_) => "bad_json",
        }
    }
}

/// A decoded frame body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The type; `None` for an old-protocol frame (no type byte).
    pub kind: Option<RequestType>,
    /// The JSON text.
    pub json: &'a [u8],
}

impl Frame<'_> {
    /// The type the frame is handled as (old-protocol frames are Connection requests).
    pub fn handled_as(&self) -> RequestType {
        self.kind.unwrap_or(RequestType::Connection)
    }
}

/// Checks the 8-byte length prefix; returns `L` (the body length).
pub fn body_len(prefix: &[u8; LEN_PREFIX]) -> Result<usize, HandshakeError> {
    let l = u64::from_le_bytes(*prefix);
    if l == 0 {
        return Err(HandshakeError::Empty);
    }
    if l > MAX_FRAME_LEN {
        return Err(HandshakeError::TooLong(l));
    }
    // At most 1 MiB: fits every usize this crate builds for.
    usize::try_from(l).map_err(|_| HandshakeError::TooLong(l))
}

/// Splits a body into type and JSON (the JSON itself is not parsed here).
pub fn parse_body(body: &[u8]) -> Result<Frame<'_>, HandshakeError> {
    let (&first, rest) = body.split_first().ok_or(HandshakeError::Empty)?;
    if let Some(kind) = RequestType::from_byte(first) {
        return Ok(Frame {
            kind: Some(kind),
            json: rest,
        });
    }
    if first >= 0x80 {
        return Err(HandshakeError::UnknownType(first));
    }
    Ok(Frame {
        kind: None,
        json: body,
    })
}

/// Decodes one whole frame at the start of `buf`: the frame and the bytes it took.
pub fn decode_frame(buf: &[u8]) -> Result<(Frame<'_>, usize), HandshakeError> {
    let prefix: &[u8; LEN_PREFIX] = buf
        .get(..LEN_PREFIX)
        .and_then(|p| p.try_into().ok())
        .ok_or(HandshakeError::Truncated {
            need: LEN_PREFIX as u64,
            have: buf.len() as u64,
        })?;
    let n = body_len(prefix)?;
    let body = buf
        .get(LEN_PREFIX..LEN_PREFIX + n)
        .ok_or(HandshakeError::Truncated {
            need: (LEN_PREFIX + n) as u64,
            have: buf.len() as u64,
        })?;
    Ok((parse_body(body)?, LEN_PREFIX + n))
}

/// Checks that a frame's JSON parses (any JSON value).
pub fn check_json(json: &[u8]) -> Result<(), HandshakeError> {
    serde_json::from_slice::<serde::de::IgnoredAny>(json)
        .map(|_| ())
        .map_err(|e| HandshakeError::BadJson(e.to_string()))
}

/// Encodes a frame: `kind` `None` writes an old-protocol frame (no type byte).
pub fn encode_frame(kind: Option<RequestType>, json: &[u8]) -> Vec<u8> {
    let l = json.len() + usize::from(kind.is_some());
    let mut out = Vec::with_capacity(LEN_PREFIX + l);
    out.extend_from_slice(&(l as u64).to_le_bytes());
    if let Some(k) = kind {
        out.push(k.byte());
    }
    out.extend_from_slice(json);
    out
}

/// Checks a reply body against the request type; returns its JSON.
pub fn parse_reply(body: &[u8], expected: RequestType) -> Result<&[u8], HandshakeError> {
    let (&got, rest) = body.split_first().ok_or(HandshakeError::Empty)?;
    if got != expected.byte() {
        return Err(HandshakeError::TypeMismatch {
            expected: expected.byte(),
            got,
        });
    }
    Ok(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn typed_and_old_frames() {
        let f = encode_frame(Some(RequestType::Metadata), b"{}\n");
        assert_eq!(&f[..9], &[4, 0, 0, 0, 0, 0, 0, 0, 1]);
        let (fr, n) = decode_frame(&f).unwrap();
        assert_eq!(n, f.len());
        assert_eq!(fr.kind, Some(RequestType::Metadata));
        assert_eq!(fr.json, b"{}\n");
        check_json(fr.json).unwrap();

        let old = encode_frame(None, b"{\"a\":1}");
        let (fr, _) = decode_frame(&old).unwrap();
        assert_eq!(fr.kind, None);
        assert_eq!(fr.handled_as(), RequestType::Connection);
        assert_eq!(fr.json, b"{\"a\":1}");

        for t in 0..4u8 {
            let k = RequestType::from_byte(t).unwrap();
            assert_eq!(k.byte(), t);
        }
        check_json(CONNECTION_REPLY.as_bytes()).unwrap();
        check_json(PROBE_REPLY.as_bytes()).unwrap();
        check_json(NOTIFY_REPLY.as_bytes()).unwrap();
    }

    #[test]
    fn bad_frames() {
        assert_eq!(body_len(&[0; 8]), Err(HandshakeError::Empty));
        let big = (MAX_FRAME_LEN + 1).to_le_bytes();
        assert_eq!(
            body_len(&big),
            Err(HandshakeError::TooLong(MAX_FRAME_LEN + 1))
        );
        assert_eq!(body_len(&MAX_FRAME_LEN.to_le_bytes()), Ok(1 << 20));
        assert_eq!(
            parse_body(&[0x80, b'{', b'}']),
            Err(HandshakeError::UnknownType(0x80))
        );
        assert!(matches!(
            decode_frame(&[5, 0, 0, 0, 0, 0, 0, 0, 1, b'{']),
            Err(HandshakeError::Truncated { need: 13, have: 10 })
        ));
        assert!(matches!(
            check_json(b"{nope"),
            Err(HandshakeError::BadJson(_))
        ));
        assert_eq!(
            parse_reply(&[3, b'{', b'}'], RequestType::Metadata),
            Err(HandshakeError::TypeMismatch {
                expected: 1,
                got: 3
            })
        );
        assert_eq!(
            parse_reply(&[1, b'{', b'}'], RequestType::Metadata),
            Ok(&b"{}"[..])
        );
        assert_eq!(
            parse_reply(&[], RequestType::Probe),
            Err(HandshakeError::Empty)
        );
    }

    proptest! {
        #[test]
        fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Ok((f, n)) = decode_frame(&b) {
                prop_assert!(n <= b.len());
                let _ = check_json(f.json);
                let again = encode_frame(f.kind, f.json);
                prop_assert_eq!(&again[..], &b[..n]);
            }
            let _ = parse_body(&b);
            let _ = parse_reply(&b, RequestType::Metadata);
        }

        #[test]
        fn roundtrip(t in 0u8..4, json in proptest::collection::vec(any::<u8>(), 0..64)) {
            let k = RequestType::from_byte(t);
            let f = encode_frame(k, &json);
            let (fr, n) = decode_frame(&f).unwrap();
            prop_assert_eq!(n, f.len());
            prop_assert_eq!(fr.kind, k);
            prop_assert_eq!(fr.json, &json[..]);
        }
    }
}
