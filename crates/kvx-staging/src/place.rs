//! Where each byte of a staged block lands on the decode: [`scatter`](crate::scatter) as a map
//! from block offsets to destination addresses.
//!
//! A decode that receives a writer's block itself (a tcp receiver, not a NIC) can read it
//! straight into the KV pages as it arrives instead of into the ring and then copying it out:
//! [`ScatterMap::pieces`] names the destination ranges of any byte range of the block, in block
//! order, adjacent ranges merged. Applying the pieces of every byte of a block leaves the pages
//! exactly as [`scatter`](crate::scatter) of that block does (property-tested). Every page is
//! checked when the map is made, so every piece lies inside its buffer.

use crate::copy::{CopyError, SliceSpec};

/// The destination of every byte of one writer's block (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScatterMap {
    /// Address of each buffer (`[K…, V…]`).
    bases: Vec<u64>,
    /// Byte offset of each destination page inside a buffer.
    pages: Vec<u64>,
    /// Bytes per token slot of a page.
    slot: u64,
    /// Bytes of the slice per token.
    tb: u64,
    /// Offset of the writer's first head inside a slot.
    head_off: u64,
    /// Bytes of the slice per page.
    page_bytes: u64,
    /// Block length.
    len: u64,
    /// Lowest and one-past-highest address a piece can touch.
    bounds: (u64, u64),
}

impl ScatterMap {
    /// The map of `spec`'s block for `pages` of `buffers` (each an address and a length, `[K…,
    /// V…]`, as [`crate::gather_writes`] takes them), checked as [`scatter`](crate::scatter)
    /// checks: every page of every buffer in bounds, and no buffer's end past `u64`.
    pub fn new(
        spec: &SliceSpec,
        buffers: &[(u64, usize)],
        pages: &[i32],
    ) -> Result<Self, CopyError> {
        let need = spec.block_len(buffers.len(), pages.len());
        let cut = spec.cut(buffers.iter().map(|&(_, len)| len), pages, need)?;
        let mut lo = u64::MAX;
        let mut hi = 0u64;
        for (b, &(addr, len)) in buffers.iter().enumerate() {
            let end = u64::try_from(len)
                .ok()
                .and_then(|l| addr.checked_add(l))
                .ok_or(CopyError::Page {
                    page: 0,
                    buffer: b,
                    len,
                })?;
            lo = lo.min(addr);
            hi = hi.max(end);
        }
        let mut offs = Vec::with_capacity(pages.len());
        if let Some(&(_, first)) = buffers.first() {
            for &p in pages {
                // In bounds of every buffer: checked by `cut`.
                offs.push(spec.page_range(0, first, p)? as u64);
            }
        }
        Ok(ScatterMap {
            bases: buffers.iter().map(|&(a, _)| a).collect(),
            pages: offs,
            slot: cut.slot as u64,
            tb: cut.tb as u64,
            head_off: cut.head_off as u64,
            page_bytes: cut.page_bytes as u64,
            len: need as u64,
            bounds: if lo <= hi { (lo, hi) } else { (0, 0) },
        })
    }

    /// Length of the block.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty block (no page or no head).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The lowest and one-past-highest address any piece can touch (the buffers' span).
    pub fn bounds(&self) -> (u64, u64) {
        self.bounds
    }

    /// Calls `f(addr, len)` for the destination ranges of block bytes `[off, off + len)`, in
    /// block order, adjacent ranges merged. Bytes past the block's end are not mapped; returns
    /// the bytes mapped.
    pub fn pieces(&self, off: u64, len: u64, mut f: impl FnMut(u64, u64)) -> u64 {
        let end = off.saturating_add(len).min(self.len);
        let n = self.pages.len() as u64;
        if off >= end || n == 0 || self.page_bytes == 0 || self.tb == 0 {
            return 0;
        }
        let whole_slot = self.tb == self.slot;
        let mut run: Option<(u64, u64)> = None;
        let mut at = off;
        while at < end {
            let (idx, pos) = (at / self.page_bytes, at % self.page_bytes);
            // `at < len = buffers × pages × page_bytes`: both indices are in range.
            let page_base = self.bases[(idx / n) as usize] + self.pages[(idx % n) as usize];
            let (dst, room) = if whole_slot {
                (page_base + pos, self.page_bytes - pos)
            } else {
                let (t, w) = (pos / self.tb, pos % self.tb);
                (page_base + t * self.slot + self.head_off + w, self.tb - w)
            };
            let l = room.min(end - at);
            run = match run {
                Some((a, rl)) if a + rl == dst => Some((a, rl + l)),
                Some((a, rl)) => {
                    f(a, rl);
                    Some((dst, l))
                }
                None => Some((dst, l)),
            };
            at += l;
        }
        if let Some((a, rl)) = run {
            f(a, rl);
        }
        end - off
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gather, scatter};

    /// Applies the pieces of `block[off..off + len]` to `mem` (buffers at `b << 20`).
    fn apply(map: &ScatterMap, block: &[u8], off: usize, len: usize, mem: &mut [Vec<u8>]) -> u64 {
        let mut at = off;
        map.pieces(off as u64, len as u64, |addr, n| {
            let (b, o, n) = (
                (addr >> 20) as usize,
                (addr & 0xf_ffff) as usize,
                n as usize,
            );
            mem[b][o..o + n].copy_from_slice(&block[at..at + n]);
            at += n;
        })
    }

    #[test]
    fn pieces_of_a_head_slice_are_token_slices() {
        // 2 buffers, page size 2, 4 heads of 2 bytes per slot; the writer has heads 1..3.
        let spec = SliceSpec {
            page_size: 2,
            bytes_per_head_token: 2,
            item_len: 16,
            head: 1,
            n_heads: 2,
        };
        let bufs = [(0u64, 48usize), (1 << 20, 48)];
        let map = ScatterMap::new(&spec, &bufs, &[1, 2]).unwrap();
        assert_eq!(map.len(), 32);
        assert_eq!(map.bounds(), (0, (1 << 20) + 48));
        let mut got = Vec::new();
        assert_eq!(map.pieces(0, 6, |a, n| got.push((a, n))), 6);
        // Page 1 token 0 heads 1..3 at 16 + 2, token 1 at 16 + 8 + 2, page 2 token 0 at 32 + 2.
        assert_eq!(got, vec![(18, 4), (26, 2)]);
        // Past the end: nothing mapped.
        assert_eq!(map.pieces(32, 4, |_, _| panic!("mapped past the end")), 0);
        assert_eq!(map.pieces(30, 10, |_, _| {}), 2);
        // Pages are checked as the scatter checks them.
        assert!(matches!(
            ScatterMap::new(&spec, &bufs, &[3]),
            Err(CopyError::Page { page: 3, .. })
        ));
        assert!(ScatterMap::new(&spec, &[(u64::MAX - 8, 48)], &[0]).is_err());
    }

    #[test]
    fn whole_slot_pages_in_a_run_are_one_piece() {
        let spec = SliceSpec {
            page_size: 2,
            bytes_per_head_token: 4,
            item_len: 8,
            head: 0,
            n_heads: 1,
        };
        let map = ScatterMap::new(&spec, &[(1 << 20, 64)], &[2, 3, 4, 0]).unwrap();
        let mut got = Vec::new();
        map.pieces(0, map.len(), |a, n| got.push((a, n)));
        assert_eq!(got, vec![((1 << 20) + 16, 24), (1 << 20, 8)]);
    }

    proptest::proptest! {
        /// Any geometry, any cut of the block into received ranges: the pieces build exactly
        /// the pages `scatter` builds, and never leave the buffers.
        #[test]
        fn pieces_match_scatter(
            page_size in 1usize..5,
            slot_heads in 1usize..5,
            head in 0usize..4,
            n_heads in 1usize..4,
            bph in 1usize..5,
            buffers in 1usize..4,
            pages in proptest::collection::vec(0i32..6, 0..8),
            cuts in proptest::collection::vec(0usize..4096, 0..6),
        ) {
            proptest::prop_assume!(head + n_heads <= slot_heads);
            let spec = SliceSpec {
                page_size,
                bytes_per_head_token: bph,
                item_len: page_size * slot_heads * bph,
                head,
                n_heads,
            };
            let len = 6 * spec.item_len;
            let src: Vec<Vec<u8>> = (0..buffers)
                .map(|b| (0..len).map(|i| (b * 31 + i * 7 + 1) as u8).collect())
                .collect();
            let mut block = vec![0u8; spec.block_len(buffers, pages.len())];
            gather(&spec, &src, &pages, &mut block).unwrap();
            let mut want = vec![vec![0u8; len]; buffers];
            scatter(&spec, &block, &mut want, &pages).unwrap();
            let addrs: Vec<(u64, usize)> = (0..buffers).map(|b| ((b as u64) << 20, len)).collect();
            let map = ScatterMap::new(&spec, &addrs, &pages).unwrap();
            proptest::prop_assert_eq!(map.len() as usize, block.len());
            let mut got = vec![vec![0u8; len]; buffers];
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (block.len() + 1)).collect();
            bounds.push(0);
            bounds.push(block.len());
            bounds.sort_unstable();
            let mut mapped = 0;
            for w in bounds.windows(2) {
                mapped += apply(&map, &block, w[0], w[1] - w[0], &mut got);
            }
            proptest::prop_assert_eq!(mapped as usize, block.len());
            proptest::prop_assert_eq!(got, want);
        }
    }
}
