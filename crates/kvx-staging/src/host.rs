//! A host-memory model of registered regions, to execute [`TransferOp`] lists with `memcpy`.
//!
//! Tests and benches give every buffer a synthetic base address, build op lists against those
//! addresses (exactly as the planners do against real virtual addresses), and apply them here.
//! Every op is resolved against a region and bounds-checked before a byte moves.

use kvx_core::TransferOp;

/// An op that does not lie inside one region of its side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("op {index} ({addr:#x}+{len}) is outside every {side} region")]
pub struct OutOfRegion {
    /// Index of the op in its list.
    pub index: usize,
    /// `"source"` or `"destination"`.
    pub side: &'static str,
    /// The unresolved address.
    pub addr: u64,
    /// Its length.
    pub len: u64,
}

/// A set of disjoint byte regions at synthetic addresses.
#[derive(Clone, Debug, Default)]
pub struct HostMemory {
    regions: Vec<(u64, Vec<u8>)>,
}

impl HostMemory {
    /// No regions.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a region at the first 1 TiB-aligned address after the last one and returns its base.
    pub fn add(&mut self, bytes: Vec<u8>) -> u64 {
        let base = (self.regions.len() as u64 + 1) << 40;
        self.regions.push((base, bytes));
        base
    }

    /// The bytes of the region with base `base`.
    pub fn region(&self, base: u64) -> Option<&[u8]> {
        self.regions
            .iter()
            .find(|(b, _)| *b == base)
            .map(|(_, v)| v.as_slice())
    }

    /// The mutable bytes of the region with base `base`.
    pub fn region_mut(&mut self, base: u64) -> Option<&mut [u8]> {
        self.regions
            .iter_mut()
            .find(|(b, _)| *b == base)
            .map(|(_, v)| v.as_mut_slice())
    }

    /// Every region's bytes, in the order they were added.
    pub fn all(&self) -> Vec<&[u8]> {
        self.regions.iter().map(|(_, v)| v.as_slice()).collect()
    }

    /// Every region's bytes, mutable, in the order they were added.
    pub fn all_mut(&mut self) -> Vec<&mut [u8]> {
        self.regions
            .iter_mut()
            .map(|(_, v)| v.as_mut_slice())
            .collect()
    }

    fn resolve(&self, addr: u64, len: u64) -> Option<(usize, usize)> {
        let i = (addr >> 40).checked_sub(1)? as usize;
        let (base, bytes) = self.regions.get(i)?;
        let off = usize::try_from(addr - base).ok()?;
        let end = off.checked_add(usize::try_from(len).ok()?)?;
        (end <= bytes.len()).then_some((i, off))
    }

    /// Copies every op from `src` (this side's addresses in `src`) into `self`; checks every op
    /// first and copies nothing if one is out of bounds.
    pub fn apply(&mut self, src: &HostMemory, ops: &[TransferOp]) -> Result<(), OutOfRegion> {
        let mut resolved = Vec::with_capacity(ops.len());
        for (index, op) in ops.iter().enumerate() {
            let s = src.resolve(op.src, op.len).ok_or(OutOfRegion {
                index,
                side: "source",
                addr: op.src,
                len: op.len,
            })?;
            let d = self.resolve(op.dst, op.len).ok_or(OutOfRegion {
                index,
                side: "destination",
                addr: op.dst,
                len: op.len,
            })?;
            resolved.push((s, d, op.len as usize));
        }
        for ((si, so), (di, doff), len) in resolved {
            let from = &src.regions[si].1[so..so + len];
            self.regions[di].1[doff..doff + len].copy_from_slice(from);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applies_checked_ops() {
        let mut src = HostMemory::new();
        let a = src.add((0..16).collect());
        let mut dst = HostMemory::new();
        let b = dst.add(vec![0; 8]);
        dst.apply(&src, &[TransferOp::new(a + 4, b + 2, 3)])
            .unwrap();
        assert_eq!(dst.region(b).unwrap(), &[0, 0, 4, 5, 6, 0, 0, 0]);
        let err = dst
            .apply(&src, &[TransferOp::new(a, b + 6, 3)])
            .unwrap_err();
        assert_eq!(err.side, "destination");
        assert!(dst.apply(&src, &[TransferOp::new(a + 15, b, 2)]).is_err());
        assert!(dst.apply(&src, &[TransferOp::new(7, b, 1)]).is_err());
    }
}
