//! The data port's wire format of Mooncake TE's TCP transport (sans I/O).
//!
//! Every request on a data connection starts with a 24-byte header: `size` (u64 LE, payload
//! length), `addr` (u64 LE, absolute address in the target process), one opcode byte and seven
//! padding bytes (sent as zeros here, ignored when received: the real initiator leaves them
//! uninitialised). Bit 7 of the opcode selects protocol v2, whose requests are answered by an
//! 8-byte status frame (u64 LE, magic `MCTV` in the high half, status code in the low half).
//! Opcode low bits 1 mean WRITE; anything else is a READ. See `docs/mooncake-transport.md`.

/// Size of a request header.
pub const HEADER_LEN: usize = 24;
/// Size of a status frame.
pub const STATUS_LEN: usize = 8;
/// The v2 flag of an opcode.
pub const V2_FLAG: u8 = 0x80;
/// READ, protocol v1 (no status frame; the target streams the bytes).
pub const OP_READ_V1: u8 = 0x00;
/// WRITE, protocol v1 (no reply at all).
pub const OP_WRITE_V1: u8 = 0x01;
/// READ, protocol v2 (status frame, then the bytes).
pub const OP_READ_V2: u8 = 0x80;
/// WRITE, protocol v2 (status frame once the payload is in destination memory).
pub const OP_WRITE_V2: u8 = 0x81;
/// The magic in the high 32 bits of every status frame (`"MCTV"`).
pub const STATUS_MAGIC: u32 = 0x4D43_5456;
/// Status code: applied (WRITE) / accepted, bytes follow (READ).
pub const STATUS_OK: u32 = 0;
/// Status code: the address range is not inside one registered buffer (or is empty).
pub const STATUS_ADDR_REJECTED: u32 = 1;

/// A malformed header or status frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the fixed size.
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// A request with `size == 0` (Mooncake rejects it like a bad address).
    #[error("zero-length request at {addr:#x}")]
    ZeroSize {
        /// The address in the header.
        addr: u64,
    },
    /// `addr + size` wraps around 2^64.
    #[error("request {addr:#x} (+{size}) wraps the address space")]
    Overflow {
        /// The address.
        addr: u64,
        /// The size.
        size: u64,
    },
    /// A status frame without the `MCTV` magic (a peer speaking legacy framing).
    #[error("status frame {0:#018x} has no MCTV magic")]
    BadMagic(u64),
}

impl WireError {
    /// A short stable label (metrics).
    pub fn cause(&self) -> &'static str {
        match self {
            WireError::Truncated { .. } => "truncated",
            WireError::ZeroSize { .. } => "zero_size",
            WireError::Overflow { .. } => "overflow",
            WireError::BadMagic(_) => "bad_magic",
        }
    }
}

/// One request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Payload length (WRITE) or bytes requested (READ).
    pub size: u64,
    /// Absolute destination (WRITE) or source (READ) address in the target.
    pub addr: u64,
    /// The opcode byte as sent.
    pub opcode: u8,
}

impl Header {
    /// A WRITE of `size` bytes to `addr`, v2 (acknowledged) or v1.
    pub fn write(addr: u64, size: u64, v2: bool) -> Self {
        Header {
            size,
            addr,
            opcode: if v2 { OP_WRITE_V2 } else { OP_WRITE_V1 },
        }
    }

    /// A READ of `size` bytes from `addr`, v2 or v1.
    pub fn read(addr: u64, size: u64, v2: bool) -> Self {
        Header {
            size,
            addr,
            opcode: if v2 { OP_READ_V2 } else { OP_READ_V1 },
        }
    }

    /// True for protocol v2 (bit 7 of the opcode).
    pub fn is_v2(&self) -> bool {
        self.opcode & V2_FLAG != 0
    }

    /// True for a WRITE (low bits equal to 1); every other opcode is a READ.
    pub fn is_write(&self) -> bool {
        self.opcode & !V2_FLAG == OP_WRITE_V1
    }

    /// The 24 bytes on the wire (padding zeroed).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = self.opcode;
        b
    }

    /// Decodes 24 bytes (the padding is ignored). Infallible: every byte pattern is a header;
    /// [`Header::check`] says whether its range is usable.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        let mut size = [0u8; 8];
        let mut addr = [0u8; 8];
        size.copy_from_slice(&b[0..8]);
        addr.copy_from_slice(&b[8..16]);
        Header {
            size: u64::from_le_bytes(size),
            addr: u64::from_le_bytes(addr),
            opcode: b[16],
        }
    }

    /// Decodes the first 24 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let fixed: &[u8; HEADER_LEN] =
            b.get(..HEADER_LEN)
                .and_then(|s| s.try_into().ok())
                .ok_or(WireError::Truncated {
                    need: HEADER_LEN,
                    have: b.len(),
                })?;
        Ok(Self::decode(fixed))
    }

    /// Checks the range: non-empty and not wrapping. Returns its end address.
    pub fn check(&self) -> Result<u64, WireError> {
        if self.size == 0 {
            return Err(WireError::ZeroSize { addr: self.addr });
        }
        self.addr.checked_add(self.size).ok_or(WireError::Overflow {
            addr: self.addr,
            size: self.size,
        })
    }
}

/// A status frame's meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// [`STATUS_OK`].
    Ok,
    /// Any other code ([`STATUS_ADDR_REJECTED`] from Mooncake).
    Rejected(u32),
}

impl Status {
    /// The 8 bytes on the wire.
    pub fn encode(self) -> [u8; STATUS_LEN] {
        let code = match self {
            Status::Ok => STATUS_OK,
            Status::Rejected(c) => c,
        };
        ((u64::from(STATUS_MAGIC) << 32) | u64::from(code)).to_le_bytes()
    }

    /// Decodes 8 bytes; a frame without the magic is [`WireError::BadMagic`].
    pub fn decode(b: &[u8; STATUS_LEN]) -> Result<Self, WireError> {
        let v = u64::from_le_bytes(*b);
        if (v >> 32) as u32 != STATUS_MAGIC {
            return Err(WireError::BadMagic(v));
        }
        Ok(match v as u32 {
            STATUS_OK => Status::Ok,
            c => Status::Rejected(c),
        })
    }

    /// Decodes the first 8 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let fixed: &[u8; STATUS_LEN] =
            b.get(..STATUS_LEN)
                .and_then(|s| s.try_into().ok())
                .ok_or(WireError::Truncated {
                    need: STATUS_LEN,
                    have: b.len(),
                })?;
        Self::decode(fixed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn observed_bytes() {
        // A 100-byte v2 write as the real initiator sends it (spec §4.1).
        let h = Header::write(0x7fc9_6813_0000, 100, true);
        let b = h.encode();
        assert_eq!(
            b,
            [
                0x64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x13, 0x68, 0xc9, 0x7f, 0, 0, 0x81, 0, 0, 0, 0, 0,
                0, 0
            ]
        );
        assert_eq!(Status::Ok.encode(), [0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]);
        assert_eq!(
            Status::Rejected(STATUS_ADDR_REJECTED).encode(),
            [1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]
        );
        assert_eq!(
            u64::from_le_bytes(Status::Rejected(1).encode()),
            0x4D43_5456_0000_0001
        );
    }

    #[test]
    fn opcodes_and_checks() {
        let mut b = Header::read(0x1000, 8, true).encode();
        b[17..].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3]); // garbage padding
        let h = Header::decode(&b);
        assert!(h.is_v2() && !h.is_write());
        assert_eq!(h.check(), Ok(0x1008));
        for (op, v2, w) in [
            (0x00, false, false),
            (0x01, true, true),
            (0x80, true, false),
            (0x81, true, true),
            (0x05, false, false),
            (0x7f, false, false),
        ] {
            let h = Header {
                size: 1,
                addr: 1,
                opcode: op,
            };
            assert_eq!(h.is_write(), w, "{op:#x}");
            if op != 0x01 {
                assert_eq!(h.is_v2(), v2, "{op:#x}");
            }
        }
        assert_eq!(
            Header::write(5, 0, true).check(),
            Err(WireError::ZeroSize { addr: 5 })
        );
        assert!(matches!(
            Header::write(u64::MAX, 2, true).check(),
            Err(WireError::Overflow { .. })
        ));
        assert!(matches!(
            Header::parse(&[0u8; 23]),
            Err(WireError::Truncated { need: 24, have: 23 })
        ));
        assert!(matches!(
            Status::parse(&[0u8; 8]),
            Err(WireError::BadMagic(0))
        ));
        assert!(matches!(
            Status::parse(&[0u8; 3]),
            Err(WireError::Truncated { .. })
        ));
    }

    proptest! {
        #[test]
        fn header_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(h) = Header::parse(&b) {
                let _ = h.check();
                let again = Header::decode(&h.encode());
                prop_assert_eq!(again, h);
                prop_assert_eq!(&h.encode()[..17], &b[..17]);
            }
        }

        #[test]
        fn status_never_panics(b in proptest::collection::vec(any::<u8>(), 0..16)) {
            if let Ok(s) = Status::parse(&b) {
                prop_assert_eq!(Status::decode(&s.encode()), Ok(s));
            }
        }

        #[test]
        fn header_roundtrip(size in any::<u64>(), addr in any::<u64>(), v2 in any::<bool>(),
                            write in any::<bool>()) {
            let h = if write { Header::write(addr, size, v2) } else { Header::read(addr, size, v2) };
            let d = Header::decode(&h.encode());
            prop_assert_eq!(d, h);
            prop_assert_eq!(d.is_v2(), v2);
            prop_assert_eq!(d.is_write(), write);
            prop_assert_eq!(d.check().is_ok(), size > 0 && addr.checked_add(size).is_some());
        }
    }
}
