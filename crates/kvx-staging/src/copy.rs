//! Gather and scatter of staged chunks on host memory.
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
    fn cut(
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

    fn page_range(&self, buffer: usize, len: usize, page: i32) -> Result<usize, CopyError> {
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
struct Cut {
    /// Bytes per token slot of a page.
    slot: usize,
    /// Bytes of the slice per token.
    tb: usize,
    /// Byte offset of the first head inside a token slot.
    head_off: usize,
    /// Bytes of the slice per page.
    page_bytes: usize,
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

    fn edge() -> impl proptest::strategy::Strategy<Value = usize> {
        use proptest::prelude::*;
        prop_oneof![0usize..=64, Just(usize::MAX), (usize::MAX / 4)..=usize::MAX]
    }

    proptest::proptest! {
        /// Any spec and page list: a typed error or a copy that stays inside every slice.
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
        }
    }
}
