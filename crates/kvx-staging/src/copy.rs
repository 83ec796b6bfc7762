//! Gather and scatter of staged chunks on host memory, and the gather as data-plane writes.
//!
//! [`gather`] copies one writer's head slices of a chunk out of its KV pages into one contiguous
//! block laid out `[K layer0 | K layer1 | … | V layer0 | …]`, each layer slice `tokens × heads ×
//! bph` bytes, token-major. [`scatter`] is the inverse on the decode: it copies such a block into
//! the decode's KV pages at the writer's head offset. Together with a single write of the block
//! they leave the decode's pages exactly as the per-token head-slice path (spec §5.4) does.
//! Every page id and length is checked before any byte moves; nothing here is `unsafe`.

/// Why a gather or scatter was refused (checked before any byte moves).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CopyError {
    /// Page size zero, or the item length is not a whole number of slots.
    #[error("invalid slice spec: {0}")]
    Spec(&'static str),
    /// The head range does not fit in a token slot.
    #[error("heads {head}..{end} exceed the {slot_heads}-head slot")]
    Heads {
        /// First head.
        head: usize,
        /// One past the last head.
        end: usize,
        /// Heads that fit in one slot.
        slot_heads: usize,
    },
    /// A page id is negative or lies past its buffer.
    #[error("page {page} out of bounds of buffer {buffer} ({len} bytes)")]
    Page {
        /// The page id.
        page: i64,
        /// The buffer index.
        buffer: usize,
        /// The buffer length.
        len: usize,
    },
    /// The block is shorter than the chunk needs.
    #[error("block of {have} bytes, chunk needs {need}")]
    Block {
        /// Bytes available.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
}

/// How one side's KV pages are cut for a head slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceSpec {
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes of one head of one token.
    pub bytes_per_head_token: usize,
    /// Bytes per page of one buffer on this side.
    pub item_len: usize,
    /// First head on this side.
    pub head: usize,
    /// Number of heads.
    pub n_heads: usize,
}

impl SliceSpec {
    /// Bytes one token of the slice occupies in the block (saturating).
    pub fn token_bytes(&self) -> usize {
        self.n_heads.saturating_mul(self.bytes_per_head_token)
    }

    /// Block size for `buffers` buffers (2 × layers) and `pages` pages (saturating).
    pub fn block_len(&self, buffers: usize, pages: usize) -> usize {
        buffers
            .saturating_mul(pages)
            .saturating_mul(self.page_size)
            .saturating_mul(self.token_bytes())
    }

    /// True when the slice is whole token slots of this side's pages (every head of a slot): it
    /// is written page by page with [`gather_writes`], no gather and no staging buffer.
    pub fn whole_slots(&self) -> bool {
        self.slot().is_ok_and(|slot| self.token_bytes() == slot)
    }

    fn slot(&self) -> Result<usize, CopyError> {
        if self.page_size == 0 || !self.item_len.is_multiple_of(self.page_size) {
            return Err(CopyError::Spec(
                "page size 0 or item length not a multiple of it",
            ));
        }
        let slot = self.item_len / self.page_size;
        // A head range past usize counts as not fitting: no product below can wrap after this.
        let end = self.head.checked_add(self.n_heads);
        let bytes = end.and_then(|e| e.checked_mul(self.bytes_per_head_token));
        if bytes.is_none_or(|b| b > slot) {
            return Err(CopyError::Heads {
                head: self.head,
                end: end.unwrap_or(usize::MAX),
                slot_heads: slot / self.bytes_per_head_token.max(1),
            });
        }
        Ok(slot)
    }

    /// Checks everything a gather or scatter needs before a byte moves: the spec, the block
    /// size (`have` bytes) and every page of every buffer (`buf_lens`).
    pub(crate) fn cut(
        &self,
        buf_lens: impl ExactSizeIterator<Item = usize>,
        pages: &[i32],
        have: usize,
    ) -> Result<Cut, CopyError> {
        let slot = self.slot()?;
        let need = self.block_len(buf_lens.len(), pages.len());
        if have < need {
            return Err(CopyError::Block { have, need });
        }
        for (b, len) in buf_lens.enumerate() {
            for &page in pages {
                self.page_range(b, len, page)?;
            }
        }
        let tb = self.token_bytes();
        Ok(Cut {
            slot,
            tb,
            head_off: self.head * self.bytes_per_head_token,
            page_bytes: self.page_size * tb,
        })
    }

    pub(crate) fn page_range(
        &self,
        buffer: usize,
        len: usize,
        page: i32,
    ) -> Result<usize, CopyError> {
        let bad = || CopyError::Page {
            page: i64::from(page),
            buffer,
            len,
        };
        let p = usize::try_from(page).map_err(|_| bad())?;
        let start = p.checked_mul(self.item_len).ok_or_else(bad)?;
        if start.checked_add(self.item_len).is_none_or(|e| e > len) {
            return Err(bad());
        }
        Ok(start)
    }
}

/// The checked geometry of one gather or scatter (every product fits: see [`SliceSpec::cut`]).
pub(crate) struct Cut {
    /// Bytes per token slot of a page.
    pub(crate) slot: usize,
    /// Bytes of the slice per token.
    pub(crate) tb: usize,
    /// Byte offset of the first head inside a token slot.
    pub(crate) head_off: usize,
    /// Bytes of the slice per page.
    pub(crate) page_bytes: usize,
}

/// Gathers the slice of `pages` from every buffer in `bufs` (`[K…, V…]`) into `out`; returns
/// the bytes written (`spec.block_len(bufs.len(), pages.len())`).
pub fn gather<B: AsRef<[u8]>>(
    spec: &SliceSpec,
    bufs: &[B],
    pages: &[i32],
    out: &mut [u8],
) -> Result<usize, CopyError> {
    let Cut {
        slot,
        tb,
        head_off,
        page_bytes,
    } = spec.cut(bufs.iter().map(|b| b.as_ref().len()), pages, out.len())?;
    let whole_slot = tb == slot;
    let mut at = 0;
    for (b, buf) in bufs.iter().enumerate() {
        let buf = buf.as_ref();
        for &page in pages {
            let base = spec.page_range(b, buf.len(), page)?;
            let dst = &mut out[at..at + page_bytes];
            if whole_slot {
                dst.copy_from_slice(&buf[base..base + page_bytes]);
            } else {
                for (t, d) in dst.chunks_exact_mut(tb).enumerate() {
                    let s = base + t * slot + head_off;
                    d.copy_from_slice(&buf[s..s + tb]);
                }
            }
            at += page_bytes;
        }
    }
    Ok(at)
}

/// The gather as data-plane writes, when the slice is a whole token slot (this side's every
/// head: a prefill of larger attention-TP size writes all its heads into one decode rank): one
/// write per page of every buffer, from the KV page straight to its place in the block at
/// `block` (adjacent pages merged), so the block is assembled by the transport at the far end
/// and no staging buffer or CPU copy is needed. `bufs` are the buffers' base addresses and
/// lengths (`[K…, V…]`, as in [`gather`]). `Ok(None)`: the slice cuts token slots (a subset of
/// the heads), so it is gathered on the CPU with [`gather`]. The writes leave the block exactly
/// as [`gather`] fills it; every page is checked first.
pub fn gather_writes(
    spec: &SliceSpec,
    bufs: &[(u64, usize)],
    pages: &[i32],
    block: u64,
) -> Result<Option<Vec<kvx_core::TransferOp>>, CopyError> {
    block_writes(spec, bufs, pages, block, false)
}

/// The gather as data-plane writes for any slice: [`gather_writes`]'s page writes for whole
/// token slots, and for a slice that cuts token slots (a subset of the heads: a prefill of
/// smaller attention-TP size) one write per token of every page, from its heads in the KV page
/// to its place in the block (runs lying end to end at both ends merged). For a transport that
/// gathers scattered sources itself (kvx's `tcp`: vectored socket writes), the block is then
/// assembled with no CPU copy on this side; one with a cost per write (RDMA) does better with
/// [`gather`] into a staging buffer and one write. The writes leave the block exactly as
/// [`gather`] fills it; every page is checked first.
pub fn gather_writes_by_token(
    spec: &SliceSpec,
    bufs: &[(u64, usize)],
    pages: &[i32],
    block: u64,
) -> Result<Vec<kvx_core::TransferOp>, CopyError> {
    Ok(block_writes(spec, bufs, pages, block, true)?.unwrap_or_default())
}

/// The writes that assemble the block at `block`; `None` when the slice cuts token slots and
/// `by_token` is off.
fn block_writes(
    spec: &SliceSpec,
    bufs: &[(u64, usize)],
    pages: &[i32],
    block: u64,
    by_token: bool,
) -> Result<Option<Vec<kvx_core::TransferOp>>, CopyError> {
    let need = spec.block_len(bufs.len(), pages.len());
    let Cut {
        slot,
        tb,
        head_off,
        page_bytes,
    } = spec.cut(bufs.iter().map(|b| b.1), pages, need)?;
    let whole_slot = tb == slot;
    if !whole_slot && !by_token {
        return Ok(None);
    }
    // A write per page, or per token of each page when the slice cuts token slots.
    let (pieces, piece_len, stride, first) = if whole_slot {
        (1, page_bytes, 0, 0)
    } else {
        (spec.page_size, tb, slot, head_off)
    };
    let mut ops: Vec<kvx_core::TransferOp> = Vec::with_capacity(
        bufs.len()
            .saturating_mul(pages.len())
            .saturating_mul(pieces),
    );
    let mut at = 0u64;
    let len = piece_len as u64;
    for (b, &(base, buf_len)) in bufs.iter().enumerate() {
        for &page in pages {
            let off = spec.page_range(b, buf_len, page)?;
            let bad = || CopyError::Page {
                page: i64::from(page),
                buffer: b,
                len: buf_len,
            };
            for t in 0..pieces {
                // In bounds: `cut` checked that a page's slots and the heads fit its item.
                let src = base
                    .checked_add((off + first + t * stride) as u64)
                    .ok_or_else(bad)?;
                let dst = block.checked_add(at).ok_or_else(bad)?;
                match ops.last_mut() {
                    Some(l)
                        if l.src.checked_add(l.len) == Some(src)
                            && l.dst.checked_add(l.len) == Some(dst) =>
                    {
                        l.len += len;
                    }
                    _ => ops.push(kvx_core::TransferOp::new(src, dst, len)),
                }
                at += len;
            }
        }
    }
    Ok(Some(ops))
}

/// Scatters a block produced by [`gather`] (with the same buffer count and page count) into
/// the slice of `pages` of every buffer in `bufs`; returns the bytes consumed.
pub fn scatter<B: AsMut<[u8]>>(
    spec: &SliceSpec,
    block: &[u8],
    bufs: &mut [B],
    pages: &[i32],
) -> Result<usize, CopyError> {
    let Cut {
        slot,
        tb,
        head_off,
        page_bytes,
    } = spec.cut(
        bufs.iter_mut().map(|b| b.as_mut().len()),
        pages,
        block.len(),
    )?;
    let whole_slot = tb == slot;
    let mut at = 0;
    for (b, buf) in bufs.iter_mut().enumerate() {
        let buf = buf.as_mut();
        for &page in pages {
            let base = spec.page_range(b, buf.len(), page)?;
            let src = &block[at..at + page_bytes];
            if whole_slot {
                buf[base..base + page_bytes].copy_from_slice(src);
            } else {
                for (t, s) in src.chunks_exact(tb).enumerate() {
                    let d = base + t * slot + head_off;
                    buf[d..d + tb].copy_from_slice(s);
                }
            }
            at += page_bytes;
        }
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_then_scatter_moves_the_slice() {
        // 2 buffers, page_size 2, 4 heads of 2 bytes per slot; send heads 1..3.
        let spec = SliceSpec {
            page_size: 2,
            bytes_per_head_token: 2,
            item_len: 16,
            head: 1,
            n_heads: 2,
        };
        let bufs: Vec<Vec<u8>> = (0..2u8)
            .map(|b| (0..48u8).map(|i| b * 100 + i).collect())
            .collect();
        let mut block = vec![0u8; spec.block_len(2, 2)];
        assert_eq!(gather(&spec, &bufs, &[2, 0], &mut block), Ok(32));
        // buffer 0, page 2, token 0, heads 1..3 = bytes 32+2..32+6
        assert_eq!(&block[..4], &[34, 35, 36, 37]);
        let mut dst = vec![vec![0u8; 48]; 2];
        assert_eq!(scatter(&spec, &block, &mut dst, &[1, 2]), Ok(32));
        assert_eq!(&dst[0][16..24], &[0, 0, 34, 35, 36, 37, 0, 0]);
        assert_eq!(&dst[1][40..48], &[0, 0, 110, 111, 112, 113, 0, 0]);
        assert!(matches!(
            gather(&spec, &bufs, &[3], &mut block),
            Err(CopyError::Page { page: 3, .. })
        ));
        assert!(matches!(
            scatter(&spec, &block, &mut dst, &[-1]),
            Err(CopyError::Page { page: -1, .. })
        ));
        let wide = SliceSpec { head: 3, ..spec };
        assert!(matches!(
            gather(&wide, &bufs, &[0], &mut block),
            Err(CopyError::Heads { .. })
        ));
        // Head ranges whose end or byte offset leaves usize are refused, not wrapped.
        for bad in [
            SliceSpec {
                head: usize::MAX,
                ..spec
            },
            SliceSpec {
                head: usize::MAX / 2,
                ..spec
            },
        ] {
            assert!(matches!(
                gather(&bad, &bufs, &[0], &mut block),
                Err(CopyError::Heads { .. })
            ));
            assert!(matches!(
                scatter(&bad, &block, &mut dst, &[0]),
                Err(CopyError::Heads { .. })
            ));
        }
        // A block size past usize saturates and is refused as too short.
        assert_eq!(spec.block_len(usize::MAX, 2), usize::MAX);
    }

    /// Applies `ops` with `bufs[b]` at address `b << 32` and the block at `1 << 40`.
    fn apply(ops: &[kvx_core::TransferOp], bufs: &[Vec<u8>], block: &mut [u8]) {
        for op in ops {
            let (b, off) = ((op.src >> 32) as usize, (op.src & 0xffff_ffff) as usize);
            let at = (op.dst - (1 << 40)) as usize;
            let n = op.len as usize;
            block[at..at + n].copy_from_slice(&bufs[b][off..off + n]);
        }
    }

    #[test]
    fn gather_writes_assemble_the_block_gather_makes() {
        // 3 buffers, page size 2, 2 heads of 4 bytes: the whole slot (a prefill's every head).
        let spec = SliceSpec {
            page_size: 2,
            bytes_per_head_token: 4,
            item_len: 16,
            head: 0,
            n_heads: 2,
        };
        let bufs: Vec<Vec<u8>> = (0..3u8)
            .map(|b| {
                (0..96u8)
                    .map(|i| b.wrapping_mul(100).wrapping_add(i))
                    .collect()
            })
            .collect();
        let addrs: Vec<(u64, usize)> = (0..3).map(|b| ((b as u64) << 32, 96)).collect();
        let pages = [4, 5, 1, 2, 3];
        let mut want = vec![0u8; spec.block_len(3, pages.len())];
        gather(&spec, &bufs, &pages, &mut want).unwrap();
        let ops = gather_writes(&spec, &addrs, &pages, 1 << 40)
            .unwrap()
            .unwrap();
        // Pages 4,5 and 1,2,3 are runs in every buffer (adjacent in the block too): 2 per buffer.
        assert_eq!(ops.len(), 6);
        assert_eq!(ops[0], kvx_core::TransferOp::new(4 * 16, 1 << 40, 32));
        let mut got = vec![0u8; want.len()];
        apply(&ops, &bufs, &mut got);
        assert_eq!(got, want);
        // A subset of the heads cuts token slots: gathered on the CPU instead, or written
        // token by token.
        let part = SliceSpec { n_heads: 1, ..spec };
        assert_eq!(gather_writes(&part, &addrs, &pages, 1 << 40), Ok(None));
        let mut want = vec![0u8; part.block_len(3, pages.len())];
        gather(&part, &bufs, &pages, &mut want).unwrap();
        let ops = gather_writes_by_token(&part, &addrs, &pages, 1 << 40).unwrap();
        // 3 buffers × 5 pages × 2 tokens, 4 bytes each; no two lie end to end at the source.
        assert_eq!(ops.len(), 30);
        assert_eq!(ops[0], kvx_core::TransferOp::new(4 * 16, 1 << 40, 4));
        assert_eq!(
            ops[1],
            kvx_core::TransferOp::new(4 * 16 + 8, (1 << 40) + 4, 4)
        );
        let mut got = vec![0u8; want.len()];
        apply(&ops, &bufs, &mut got);
        assert_eq!(got, want);
        assert!(matches!(
            gather_writes_by_token(&part, &addrs, &[6], 1 << 40),
            Err(CopyError::Page { page: 6, .. })
        ));
        // Pages are checked as the copies check them.
        assert!(matches!(
            gather_writes(&spec, &addrs, &[6], 1 << 40),
            Err(CopyError::Page { page: 6, .. })
        ));
        assert!(matches!(
            gather_writes(&spec, &addrs, &[-1], 1 << 40),
            Err(CopyError::Page { page: -1, .. })
        ));
    }

    fn edge() -> impl proptest::strategy::Strategy<Value = usize> {
        use proptest::prelude::*;
        prop_oneof![0usize..=64, Just(usize::MAX), (usize::MAX / 4)..=usize::MAX]
    }

    proptest::proptest! {
        /// Any spec and page list: a typed error or a copy (a gather, a scatter, the gather's
        /// writes, the scatter's map) that stays inside every slice.
        #[test]
        fn any_spec_is_refused_or_copies_in_bounds(
            page_size in edge(),
            bytes_per_head_token in edge(),
            item_len in edge(),
            head in edge(),
            n_heads in edge(),
            pages in proptest::collection::vec(-2i32..6, 0..4),
        ) {
            let spec = SliceSpec { page_size, bytes_per_head_token, item_len, head, n_heads };
            let bufs = vec![vec![7u8; 256]; 2];
            let mut block = vec![0u8; 1024];
            if let Ok(n) = gather(&spec, &bufs, &pages, &mut block) {
                proptest::prop_assert_eq!(n, spec.block_len(2, pages.len()));
            }
            let mut dst = vec![vec![0u8; 256]; 2];
            if let Ok(n) = scatter(&spec, &block, &mut dst, &pages) {
                proptest::prop_assert_eq!(n, spec.block_len(2, pages.len()));
            }
            let addrs = [(0u64, 256usize), (1 << 32, 256)];
            if let Ok(Some(ops)) = gather_writes(&spec, &addrs, &pages, 1 << 40) {
                let total: u64 = ops.iter().map(|o| o.len).sum();
                proptest::prop_assert_eq!(total as usize, spec.block_len(2, pages.len()));
            }
            if let Ok(ops) = gather_writes_by_token(&spec, &addrs, &pages, 1 << 40) {
                let total: u64 = ops.iter().map(|o| o.len).sum();
                proptest::prop_assert_eq!(total as usize, spec.block_len(2, pages.len()));
                for o in &ops {
                    proptest::prop_assert!(addrs.iter().any(|&(b, l)| o.src >= b && o.src + o.len <= b + l as u64));
                }
            }
            if let Ok(map) = crate::ScatterMap::new(&spec, &addrs, &pages) {
                proptest::prop_assert_eq!(map.len() as usize, spec.block_len(2, pages.len()));
                let (lo, hi) = map.bounds();
                let mut total = 0;
                for (off, len) in [(0, u64::MAX), (3, 1000), (map.len(), 8)] {
                    total += map.pieces(off, len, |a, n| {
                        assert!(a >= lo && a + n <= hi, "piece {a}+{n} outside {lo}..{hi}");
                        assert!(addrs.iter().any(|&(b, l)| a >= b && a + n <= b + l as u64));
                    });
                }
                proptest::prop_assert!(total <= map.len() + 1000);
            }
        }

        /// Any slice, whole token slots or a subset of the heads: the token-by-token writes
        /// build exactly the block `gather` builds, and so do the page writes, which only a
        /// whole-slot slice gets.
        #[test]
        fn writes_match_gather(
            page_size in 1usize..5,
            heads in 1usize..5,
            head in 0usize..4,
            n_heads in 1usize..5,
            bph in 1usize..5,
            buffers in 1usize..4,
            pages in proptest::collection::vec(0i32..6, 0..8),
        ) {
            let spec = SliceSpec {
                page_size,
                bytes_per_head_token: bph,
                item_len: page_size * heads * bph,
                head,
                n_heads,
            };
            let len = 6 * spec.item_len;
            let bufs: Vec<Vec<u8>> = (0..buffers)
                .map(|b| (0..len).map(|i| (b * 31 + i * 7) as u8).collect())
                .collect();
            let addrs: Vec<(u64, usize)> = (0..buffers).map(|b| ((b as u64) << 32, len)).collect();
            let mut want = vec![0u8; spec.block_len(buffers, pages.len())];
            let gathered = gather(&spec, &bufs, &pages, &mut want);
            let by_token = gather_writes_by_token(&spec, &addrs, &pages, 1 << 40);
            let by_page = gather_writes(&spec, &addrs, &pages, 1 << 40);
            // The heads must fit the slot; all three refuse alike when they do not.
            proptest::prop_assert_eq!(gathered.is_ok(), by_token.is_ok());
            proptest::prop_assert_eq!(gathered.is_ok(), by_page.is_ok());
            let whole = head == 0 && n_heads == heads;
            for ops in [by_token.ok(), by_page.ok().flatten()].into_iter().flatten() {
                let mut got = vec![0u8; want.len()];
                apply(&ops, &bufs, &mut got);
                proptest::prop_assert_eq!(&got, &want);
            }
            if let Ok(by_page) = gather_writes(&spec, &addrs, &pages, 1 << 40) {
                proptest::prop_assert_eq!(by_page.is_some(), whole);
            }
        }
    }
}
