//! The tcp backend's wire format: hello messages and fixed 32-byte frame headers (sans I/O).
//!
//! All integers are little endian. `docs/tcp-transport.md` is the normative description; this
//! module is its executable form and every decoder here returns a typed error, never panics.

use crate::error::RejectReason;
use crate::segment::RegionKey;

/// Magic at the start of both hello messages.
pub const MAGIC: [u8; 4] = *b"KVXT";
/// The only protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Size of the fixed part of a hello message.
pub const HELLO_LEN: usize = 16;
/// Size of every frame header (client and server).
pub const HEADER_LEN: usize = 32;
/// Largest descriptor accepted in a hello (the receiver's reply lists all its regions).
pub const MAX_DESC_LEN: u32 = 32 << 20;
/// Largest descriptor a receiver accepts in a *sender's* hello. A sender's descriptor is its
/// endpoint (at most 1024 bytes) and, from older senders, its regions; the receiver does not
/// use them, and kvx senders send none. 64 KiB still admits an older sender with ~2 700 regions.
pub const MAX_SENDER_DESC_LEN: u32 = 64 << 10;
/// Longest shared secret a sender's hello may carry.
pub const MAX_SECRET_LEN: u32 = 256;

/// Frame kind: a write (header followed by `len` payload bytes).
pub const KIND_WRITE: u8 = 1;
/// Frame kind: a fence (asks for an acknowledgement of everything since the last fence).
pub const KIND_FENCE: u8 = 2;
/// Frame kind: a vectored write (header, `count` entries, then the payloads back to back).
pub const KIND_WRITEV: u8 = 3;
/// Frame kind: an acknowledgement (server to client).
pub const KIND_ACK: u8 = 0x81;

/// Size of one entry of a vectored write.
pub const ENTRY_LEN: usize = 24;
/// Most entries in one vectored write.
pub const MAX_ENTRIES: u32 = 1024;

/// Hello status: accepted.
pub const HELLO_OK: u16 = 0;
/// Hello status: version not supported (the server closes after sending its hello).
pub const HELLO_BAD_VERSION: u16 = 1;
/// Hello status: the receiver requires a shared secret and the sender's is missing or wrong
/// (the server closes after sending its hello, with no descriptor).
pub const HELLO_BAD_SECRET: u16 = 2;

/// The fixed part of a hello (either direction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version (client: highest it speaks; server: the one chosen).
    pub version: u16,
    /// Client: flags (0). Server: status ([`HELLO_OK`] or [`HELLO_BAD_VERSION`]).
    pub status: u16,
    /// Client: length of the shared secret that follows the descriptor (0: none). Server: the
    /// largest write payload it accepts in one frame.
    pub param: u32,
    /// Length of the encoded segment descriptor that follows.
    pub desc_len: u32,
}

/// A malformed hello.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HelloError {
    /// The magic is not `KVXT`.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// The descriptor length is above [`MAX_DESC_LEN`].
    #[error("descriptor length {0} too large")]
    DescTooLarge(u32),
}

impl Hello {
    /// Encodes the 16 fixed bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..12].copy_from_slice(&self.param.to_le_bytes());
        b[12..16].copy_from_slice(&self.desc_len.to_le_bytes());
        b
    }

    /// Decodes the 16 fixed bytes.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, HelloError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(HelloError::BadMagic(magic));
        }
        let h = Hello {
            version: u16::from_le_bytes([b[4], b[5]]),
            status: u16::from_le_bytes([b[6], b[7]]),
            param: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            desc_len: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
        };
        if h.desc_len > MAX_DESC_LEN {
            return Err(HelloError::DescTooLarge(h.desc_len));
        }
        Ok(h)
    }
}

/// A client-to-server frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientFrame {
    /// Write `len` bytes (which follow the header) at `addr` in the region named by `key`.
    Write {
        /// Region key.
        key: RegionKey,
        /// Destination address.
        addr: u64,
        /// Payload length.
        len: u64,
        /// Sender's tag (the window it belongs to), echoed in nothing; for tracing.
        tag: u64,
    },
    /// `count` [`Entry`]s follow the header, then their payloads in order.
    WriteV {
        /// Number of entries (1..=[`MAX_ENTRIES`]).
        count: u32,
        /// Sender's tag.
        tag: u64,
    },
    /// Acknowledge everything since the previous fence, echoing `tag`.
    Fence {
        /// Window tag.
        tag: u64,
    },
}

fn u32_at(b: &[u8; HEADER_LEN], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl ClientFrame {
    /// Encodes the 32-byte header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        match *self {
            ClientFrame::Write {
                key,
                addr,
                len,
                tag,
            } => {
                b[0] = KIND_WRITE;
                b[4..8].copy_from_slice(&key.0.to_le_bytes());
                b[8..16].copy_from_slice(&addr.to_le_bytes());
                b[16..24].copy_from_slice(&len.to_le_bytes());
                b[24..32].copy_from_slice(&tag.to_le_bytes());
            }
            ClientFrame::WriteV { count, tag } => {
                b[0] = KIND_WRITEV;
                b[4..8].copy_from_slice(&count.to_le_bytes());
                b[24..32].copy_from_slice(&tag.to_le_bytes());
            }
            ClientFrame::Fence { tag } => {
                b[0] = KIND_FENCE;
                b[24..32].copy_from_slice(&tag.to_le_bytes());
            }
        }
        b
    }

    /// Decodes a header; unknown kinds and non-zero reserved bytes are [`RejectReason::BadFrame`].
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, RejectReason> {
        if b[1..4] != [0, 0, 0] {
            return Err(RejectReason::BadFrame);
        }
        match b[0] {
            KIND_WRITE => Ok(ClientFrame::Write {
                key: RegionKey(u32_at(b, 4)),
                addr: u64_at(b, 8),
                len: u64_at(b, 16),
                tag: u64_at(b, 24),
            }),
            KIND_WRITEV
                if b[8..24].iter().all(|&x| x == 0)
                    && (1..=MAX_ENTRIES).contains(&u32_at(b, 4)) =>
            {
                Ok(ClientFrame::WriteV {
                    count: u32_at(b, 4),
                    tag: u64_at(b, 24),
                })
            }
            KIND_FENCE if b[4..24].iter().all(|&x| x == 0) => {
                Ok(ClientFrame::Fence { tag: u64_at(b, 24) })
            }
            _ => Err(RejectReason::BadFrame),
        }
    }
}

/// One entry of a vectored write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Region key.
    pub key: RegionKey,
    /// Destination address.
    pub addr: u64,
    /// Payload length.
    pub len: u64,
}

impl Entry {
    /// Encodes the 24-byte entry.
    pub fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut b = [0u8; ENTRY_LEN];
        b[0..4].copy_from_slice(&self.key.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes one entry (`b` must hold [`ENTRY_LEN`] bytes); reserved bytes must be zero.
    pub fn decode(b: &[u8]) -> Result<Self, RejectReason> {
        if b.len() != ENTRY_LEN || b[4..8] != [0, 0, 0, 0] {
            return Err(RejectReason::BadFrame);
        }
        let mut k = [0u8; 4];
        k.copy_from_slice(&b[0..4]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[8..16]);
        let mut l = [0u8; 8];
        l.copy_from_slice(&b[16..24]);
        Ok(Entry {
            key: RegionKey(u32::from_le_bytes(k)),
            addr: u64::from_le_bytes(a),
            len: u64::from_le_bytes(l),
        })
    }
}

/// A server-to-client acknowledgement of one fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    /// The fence's tag.
    pub tag: u64,
    /// `None` when every write since the previous fence was applied; otherwise the first
    /// rejection's reason.
    pub status: Option<RejectReason>,
    /// Number of writes rejected since the previous fence.
    pub rejected: u32,
    /// Destination address of the first rejected write (0 when none).
    pub first_rejected_addr: u64,
    /// Payload bytes written into memory since the previous fence.
    pub bytes: u64,
}

/// A malformed acknowledgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AckError {
    /// Kind is not [`KIND_ACK`] or reserved bytes are set.
    #[error("not an ack frame (kind {0:#x})")]
    NotAck(u8),
    /// Unknown status code.
    #[error("unknown ack status {0}")]
    BadStatus(u8),
}

impl Ack {
    /// Encodes the 32-byte header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = KIND_ACK;
        b[1] = self.status.map_or(0, RejectReason::code);
        b[4..8].copy_from_slice(&self.rejected.to_le_bytes());
        b[8..16].copy_from_slice(&self.first_rejected_addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    /// Decodes the 32-byte header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, AckError> {
        if b[0] != KIND_ACK || b[2..4] != [0, 0] {
            return Err(AckError::NotAck(b[0]));
        }
        let status = match b[1] {
            0 => None,
            c => Some(RejectReason::from_code(c).ok_or(AckError::BadStatus(c))?),
        };
        Ok(Ack {
            tag: u64_at(b, 24),
            status,
            rejected: u32_at(b, 4),
            first_rejected_addr: u64_at(b, 8),
            bytes: u64_at(b, 16),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layouts() {
        let w = ClientFrame::Write {
            key: RegionKey(0x0403_0201),
            addr: 0x1122,
            len: 5,
            tag: 9,
        }
        .encode();
        assert_eq!(&w[..8], &[1, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(&w[8..10], &[0x22, 0x11]);
        assert_eq!(w[16], 5);
        assert_eq!(w[24], 9);
        let h = Hello {
            version: 1,
            status: 0,
            param: 2,
            desc_len: 3,
        }
        .encode();
        assert_eq!(&h, b"KVXT\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00");
        let v = ClientFrame::WriteV { count: 2, tag: 3 }.encode();
        assert_eq!(&v[..8], &[3, 0, 0, 0, 2, 0, 0, 0]);
        let mut zero = v;
        zero[4] = 0;
        assert_eq!(ClientFrame::decode(&zero), Err(RejectReason::BadFrame));
        let mut many = v;
        many[4..8].copy_from_slice(&(MAX_ENTRIES + 1).to_le_bytes());
        assert_eq!(ClientFrame::decode(&many), Err(RejectReason::BadFrame));
    }

    proptest! {
        #[test]
        fn client_frames_round_trip(key in any::<u32>(), addr in any::<u64>(), len in any::<u64>(), tag in any::<u64>()) {
            let w = ClientFrame::Write { key: RegionKey(key), addr, len, tag };
            prop_assert_eq!(ClientFrame::decode(&w.encode()), Ok(w));
            let f = ClientFrame::Fence { tag };
            prop_assert_eq!(ClientFrame::decode(&f.encode()), Ok(f));
            let count = key % MAX_ENTRIES + 1;
            let v = ClientFrame::WriteV { count, tag };
            prop_assert_eq!(ClientFrame::decode(&v.encode()), Ok(v));
            let e = Entry { key: RegionKey(key), addr, len };
            prop_assert_eq!(Entry::decode(&e.encode()), Ok(e));
        }

        #[test]
        fn acks_round_trip(tag in any::<u64>(), code in 0u8..5, rejected in any::<u32>(), a in any::<u64>(), bytes in any::<u64>()) {
            let ack = Ack { tag, status: RejectReason::from_code(code), rejected, first_rejected_addr: a, bytes };
            prop_assert_eq!(Ack::decode(&ack.encode()), Ok(ack));
        }

        #[test]
        fn decoders_never_panic(b in proptest::array::uniform32(any::<u8>())) {
            let _ = ClientFrame::decode(&b);
            let _ = Ack::decode(&b);
            let _ = Entry::decode(&b[..ENTRY_LEN]);
            let mut h = [0u8; HELLO_LEN];
            h.copy_from_slice(&b[..HELLO_LEN]);
            let _ = Hello::decode(&h);
        }
    }
}
