//! Segment descriptors: what one side tells the other about its memory.
//!
//! A *segment* is everything a transport instance registered: its listen endpoint and its
//! regions, each with a base address, a length and a key. The receiver sends its descriptor in
//! the handshake; the sender resolves every destination address to the region containing it and
//! puts that region's key on the write. The binary encoding here is the one carried in the TCP
//! handshake (little endian, see `docs/tcp-transport.md`).

use std::fmt;

/// The key naming one registered region (an rkey for verbs, an index for tcp/local).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionKey(pub u32);

impl fmt::Display for RegionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// One registered region as advertised to peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionDesc {
    /// First address of the region.
    pub base: u64,
    /// Length in bytes (non-zero).
    pub len: u64,
    /// The key writes into this region must carry.
    pub key: RegionKey,
}

impl RegionDesc {
    /// True when `[addr, addr + len)` lies inside this region (`len` may be 0).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        addr >= self.base && end <= self.base + self.len
    }
}

/// Everything a peer needs to write into this side: endpoint and regions.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SegmentDescriptor {
    /// Where this side listens (`host:port` for tcp, a name for local); may be empty for a
    /// side that only sends.
    pub endpoint: String,
    /// Registered regions, sorted by base, non-overlapping.
    pub regions: Vec<RegionDesc>,
}

/// Largest endpoint string accepted when decoding.
pub const MAX_ENDPOINT_LEN: usize = 1024;
/// Largest region count accepted when decoding.
pub const MAX_REGIONS: usize = 1 << 20;
/// Encoded size of one region entry.
const REGION_WIRE_LEN: usize = 24;

/// A descriptor that could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// The input ended early.
    #[error("descriptor truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Bytes were left after the last region.
    #[error("{0} trailing bytes after descriptor")]
    Trailing(usize),
    /// The endpoint is too long or not UTF-8.
    #[error("bad endpoint: {0}")]
    BadEndpoint(&'static str),
    /// Too many regions.
    #[error("too many regions: {0}")]
    TooManyRegions(u64),
    /// A region is empty, overflows, or overlaps / is out of order with the previous one.
    #[error("bad region #{index}: {detail}")]
    BadRegion {
        /// Index of the region.
        index: usize,
        /// What is wrong.
        detail: &'static str,
    },
}

impl SegmentDescriptor {
    /// The region containing `[addr, addr + len)`, if any (binary search over sorted regions).
    pub fn find(&self, addr: u64, len: u64) -> Option<&RegionDesc> {
        let i = self.regions.partition_point(|r| r.base <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        r.contains(addr, len).then_some(r)
    }

    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        2 + self.endpoint.len() + 4 + REGION_WIRE_LEN * self.regions.len()
    }

    /// Appends the wire encoding to `out`.
    ///
    /// Layout: `u16 endpoint_len, endpoint bytes, u32 region_count, then per region
    /// u64 base, u64 len, u32 key, u32 reserved (0)`; all little endian. Endpoints longer than
    /// [`MAX_ENDPOINT_LEN`] are truncated at a character boundary.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let mut ep = self.endpoint.as_str();
        while ep.len() > MAX_ENDPOINT_LEN {
            let mut cut = MAX_ENDPOINT_LEN;
            while !ep.is_char_boundary(cut) {
                cut -= 1;
            }
            ep = &ep[..cut];
        }
        out.reserve(self.encoded_len());
        out.extend_from_slice(&(ep.len() as u16).to_le_bytes());
        out.extend_from_slice(ep.as_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.base.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.extend_from_slice(&r.key.0.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
        }
    }

    /// The wire encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode_into(&mut v);
        v
    }

    /// Decodes exactly one descriptor from `buf`, validating every region (non-empty, no
    /// overflow, sorted and non-overlapping).
    pub fn decode(buf: &[u8]) -> Result<Self, DescriptorError> {
        let mut r = Reader { buf, pos: 0 };
        let ep_len = r.u16()? as usize;
        if ep_len > MAX_ENDPOINT_LEN {
            return Err(DescriptorError::BadEndpoint("too long"));
        }
        let endpoint = std::str::from_utf8(r.take(ep_len)?)
            .map_err(|_| DescriptorError::BadEndpoint("not utf-8"))?
            .to_owned();
        let count = r.u32()? as u64;
        if count > MAX_REGIONS as u64 {
            return Err(DescriptorError::TooManyRegions(count));
        }
        let count = count as usize;
        let need = count * REGION_WIRE_LEN;
        if r.remaining() < need {
            return Err(DescriptorError::Truncated {
                need: r.pos + need,
                have: buf.len(),
            });
        }
        let mut regions = Vec::with_capacity(count);
        let mut prev_end = 0u64;
        for index in 0..count {
            let base = r.u64()?;
            let len = r.u64()?;
            let key = RegionKey(r.u32()?);
            let _reserved = r.u32()?;
            let bad = |detail| DescriptorError::BadRegion { index, detail };
            if len == 0 {
                return Err(bad("empty"));
            }
            let end = base.checked_add(len).ok_or(bad("overflows"))?;
            if index > 0 && base < prev_end {
                return Err(bad("overlaps or out of order"));
            }
            prev_end = end;
            regions.push(RegionDesc { base, len, key });
        }
        if r.remaining() != 0 {
            return Err(DescriptorError::Trailing(r.remaining()));
        }
        Ok(SegmentDescriptor { endpoint, regions })
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DescriptorError> {
        if self.remaining() < n {
            return Err(DescriptorError::Truncated {
                need: self.pos + n,
                have: self.buf.len(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], DescriptorError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16, DescriptorError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32, DescriptorError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, DescriptorError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn desc() -> SegmentDescriptor {
        SegmentDescriptor {
            endpoint: "127.0.0.1:4000".into(),
            regions: vec![
                RegionDesc {
                    base: 0x1000,
                    len: 0x100,
                    key: RegionKey(1),
                },
                RegionDesc {
                    base: 0x2000,
                    len: 0x1000,
                    key: RegionKey(7),
                },
            ],
        }
    }

    #[test]
    fn round_trip_and_find() {
        let d = desc();
        let enc = d.encode();
        assert_eq!(enc.len(), d.encoded_len());
        assert_eq!(SegmentDescriptor::decode(&enc).unwrap(), d);
        assert_eq!(d.find(0x1000, 0x100).unwrap().key, RegionKey(1));
        assert!(d.find(0x1000, 0x101).is_none());
        assert!(d.find(0xfff, 1).is_none());
        assert_eq!(d.find(0x2fff, 1).unwrap().key, RegionKey(7));
        assert!(d.find(0x3000, 1).is_none());
        assert!(d.find(u64::MAX, 2).is_none());
    }

    #[test]
    fn rejects_bad_regions() {
        let mut d = desc();
        d.regions.swap(0, 1);
        assert!(matches!(
            SegmentDescriptor::decode(&d.encode()),
            Err(DescriptorError::BadRegion { index: 1, .. })
        ));
        let mut d = desc();
        d.regions[0].len = 0;
        assert!(SegmentDescriptor::decode(&d.encode()).is_err());
        let mut enc = desc().encode();
        enc.push(0);
        assert_eq!(
            SegmentDescriptor::decode(&enc),
            Err(DescriptorError::Trailing(1))
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = SegmentDescriptor::decode(&bytes);
        }

        #[test]
        fn truncations_are_errors(cut in 0usize..66) {
            let enc = desc().encode();
            prop_assume!(cut < enc.len());
            prop_assert!(SegmentDescriptor::decode(&enc[..cut]).is_err());
        }

        #[test]
        fn round_trips(ep in "[a-z0-9.:]{0,40}", lens in proptest::collection::vec(1u64..1 << 20, 0..20)) {
            let mut base = 4096u64;
            let regions = lens.iter().enumerate().map(|(i, &len)| {
                let r = RegionDesc { base, len, key: RegionKey(i as u32) };
                base += len + 7;
                r
            }).collect();
            let d = SegmentDescriptor { endpoint: ep, regions };
            prop_assert_eq!(SegmentDescriptor::decode(&d.encode()).unwrap(), d);
        }
    }
}
