//! The queue-pair handshake payload: what each side tells the other to connect RC queue pairs.
//!
//! Each side sends one [`VerbsHandshake`]: its port's LID and GID, the path MTU it can use, one
//! [`QpInfo`] (queue pair number and initial packet sequence number) per queue pair it created
//! for this peer, and the regions (base, length, rkey) the peer may write. The payload rides in
//! the same TCP handshake as the `tcp` backend's descriptor exchange; this module only encodes
//! and decodes it (sans-IO).
//!
//! Layout, little endian:
//!
//! ```text
//! magic  "KVXV" (4)  version u16 (=1)  lid u16  gid [16]  mtu u8 (1=256 .. 5=4096)  reserved u8 (0)
//! qp_count u16, then per queue pair: qpn u32 (24 bits), psn u32 (24 bits)
//! region_count u32, then per region: base u64, len u64, rkey u32, reserved u32 (0)
//! ```

use super::error::VerbsError;
use super::regions::{Region, RegionTable};

/// Wire magic.
pub const MAGIC: [u8; 4] = *b"KVXV";
/// Wire version.
pub const VERSION: u16 = 1;
/// Most queue pairs one side may announce.
pub const MAX_QPS: usize = 256;
/// Most regions one side may announce.
pub const MAX_REGIONS: usize = 1 << 20;

/// One queue pair as announced to the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
}

/// One side's handshake payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsHandshake {
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (RoCE address, or the IB GID).
    pub gid: [u8; 16],
    /// Path MTU code (`IBV_MTU_256` = 1 … `IBV_MTU_4096` = 5).
    pub mtu: u8,
    /// The queue pairs created for this peer, in order; the i-th connects to the peer's i-th.
    pub qps: Vec<QpInfo>,
    /// Regions the peer may write, with their rkeys.
    pub regions: RegionTable,
}

impl VerbsHandshake {
    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        4 + 2 + 2 + 16 + 2 + 2 + 8 * self.qps.len() + 4 + 24 * self.regions.len()
    }

    /// The wire encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.push(self.mtu);
        out.push(0);
        out.extend_from_slice(&(self.qps.len().min(MAX_QPS) as u16).to_le_bytes());
        for q in self.qps.iter().take(MAX_QPS) {
            out.extend_from_slice(&q.qpn.to_le_bytes());
            out.extend_from_slice(&q.psn.to_le_bytes());
        }
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in self.regions.regions() {
            out.extend_from_slice(&r.base.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.extend_from_slice(&r.key.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        out
    }

    /// Decodes exactly one payload, validating every field.
    pub fn decode(buf: &[u8]) -> Result<Self, VerbsError> {
        let bad = |m: &str| VerbsError::Handshake(m.to_owned());
        let mut r = Reader { buf, pos: 0 };
        if r.take(4)? != MAGIC {
            return Err(bad("bad magic"));
        }
        let version = r.u16()?;
        if version != VERSION {
            return Err(VerbsError::Handshake(format!(
                "unsupported version {version}"
            )));
        }
        let lid = r.u16()?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(r.take(16)?);
        let mtu = r.u8()?;
        if !(1..=5).contains(&mtu) {
            return Err(VerbsError::Handshake(format!("bad mtu code {mtu}")));
        }
        if r.u8()? != 0 {
            return Err(bad("non-zero reserved byte"));
        }
        let n_qps = r.u16()? as usize;
        if n_qps == 0 || n_qps > MAX_QPS {
            return Err(VerbsError::Handshake(format!(
                "bad queue pair count {n_qps}"
            )));
        }
        r.need(8 * n_qps)?;
        let mut qps = Vec::with_capacity(n_qps);
        for _ in 0..n_qps {
            let qpn = r.u32()?;
            let psn = r.u32()?;
            if qpn > 0xff_ffff || psn > 0xff_ffff {
                return Err(bad("queue pair number or psn wider than 24 bits"));
            }
            qps.push(QpInfo { qpn, psn });
        }
        let n_regions = r.u32()? as usize;
        if n_regions > MAX_REGIONS {
            return Err(VerbsError::Handshake(format!(
                "too many regions: {n_regions}"
            )));
        }
        r.need(24 * n_regions)?;
        let mut regions = Vec::with_capacity(n_regions);
        for _ in 0..n_regions {
            let base = r.u64()?;
            let len = r.u64()?;
            let key = r.u32()?;
            if r.u32()? != 0 {
                return Err(bad("non-zero reserved field in region"));
            }
            regions.push(Region { base, len, key });
        }
        if r.pos != buf.len() {
            return Err(VerbsError::Handshake(format!(
                "{} trailing bytes",
                buf.len() - r.pos
            )));
        }
        let regions =
            RegionTable::from_regions(regions).map_err(|e| VerbsError::Handshake(e.to_string()))?;
        Ok(VerbsHandshake {
            lid,
            gid,
            mtu,
            qps,
            regions,
        })
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn need(&self, n: usize) -> Result<(), VerbsError> {
        if self.buf.len() - self.pos < n {
            return Err(VerbsError::Handshake(format!(
                "truncated: need {} bytes, have {}",
                self.pos + n,
                self.buf.len()
            )));
        }
        Ok(())
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], VerbsError> {
        self.need(n)?;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], VerbsError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, VerbsError> {
        Ok(self.arr::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, VerbsError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32, VerbsError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, VerbsError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> VerbsHandshake {
        VerbsHandshake {
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            mtu: 5,
            qps: vec![
                QpInfo {
                    qpn: 0x123,
                    psn: 0x456,
                },
                QpInfo {
                    qpn: 0x124,
                    psn: 0xff_ffff,
                },
            ],
            regions: RegionTable::from_regions(vec![Region {
                base: 0x7f00_0000_0000,
                len: 1 << 30,
                key: 0xdead,
            }])
            .unwrap(),
        }
    }

    #[test]
    fn round_trip_and_layout() {
        let h = sample();
        let enc = h.encode();
        assert_eq!(enc.len(), h.encoded_len());
        assert_eq!(&enc[..4], b"KVXV");
        assert_eq!(&enc[4..6], &[1, 0]);
        assert_eq!(&enc[6..8], &[7, 0]);
        assert_eq!(enc[24], 5);
        assert_eq!(&enc[26..28], &[2, 0]);
        assert_eq!(&enc[28..32], &0x123u32.to_le_bytes());
        assert_eq!(VerbsHandshake::decode(&enc).unwrap(), h);
    }

    #[test]
    fn rejects_bad_fields() {
        let enc = sample().encode();
        let mut e = enc.clone();
        e[0] = b'X';
        assert!(VerbsHandshake::decode(&e).is_err());
        let mut e = enc.clone();
        e[4] = 2;
        assert!(VerbsHandshake::decode(&e).is_err());
        let mut e = enc.clone();
        e[24] = 9;
        assert!(VerbsHandshake::decode(&e).is_err());
        let mut e = enc.clone();
        e[31] = 1; // qpn wider than 24 bits
        assert!(VerbsHandshake::decode(&e).is_err());
        let mut e = enc.clone();
        e.push(0);
        assert!(VerbsHandshake::decode(&e).is_err());
        let mut e = enc.clone();
        e[26] = 0;
        e[27] = 0;
        assert!(VerbsHandshake::decode(&e).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = VerbsHandshake::decode(&bytes);
        }

        #[test]
        fn truncations_and_corruptions_are_errors_or_valid(cut in 0usize..100, flip in 0usize..100, bit in 0u8..8) {
            let enc = sample().encode();
            if cut < enc.len() {
                prop_assert!(VerbsHandshake::decode(&enc[..cut]).is_err());
            }
            let mut e = enc.clone();
            let i = flip % e.len();
            e[i] ^= 1 << bit;
            if let Ok(h) = VerbsHandshake::decode(&e) {
                prop_assert_eq!(h.encode(), e);
            }
        }

        #[test]
        fn round_trips(
            lid in any::<u16>(), gid in any::<[u8; 16]>(), mtu in 1u8..=5,
            qps in proptest::collection::vec((0u32..=0xff_ffff, 0u32..=0xff_ffff), 1..8),
            lens in proptest::collection::vec(1u64..1 << 30, 0..8),
        ) {
            let mut base = 4096u64;
            let regions = lens.iter().enumerate().map(|(i, &len)| {
                let r = Region { base, len, key: i as u32 * 3 };
                base += len + 4096;
                r
            }).collect();
            let h = VerbsHandshake {
                lid, gid, mtu,
                qps: qps.into_iter().map(|(qpn, psn)| QpInfo { qpn, psn }).collect(),
                regions: RegionTable::from_regions(regions).unwrap(),
            };
            prop_assert_eq!(VerbsHandshake::decode(&h.encode()).unwrap(), h);
        }
    }
}
