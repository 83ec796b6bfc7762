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
    /// Bytes one token of the slice occupies in the block.
    pub fn token_bytes(&self) -> usize {
        self.n_heads * self.bytes_per_head_token
    }

    /// Block size for `buffers` buffers (2 × layers) and `pages` pages.
    pub fn block_len(&self, buffers: usize, pages: usize) -> usize {
        buffers * pages * self.page_size * self.token_bytes()
    }

    fn slot(&self) -> Result<usize, CopyError> {
        if self.page_size == 0 || !self.item_len.is_multiple_of(self.page_size) {
            return Err(CopyError::Spec(
                "page size 0 or item length not a multiple of it",
            ));
        }
        let slot = self.item_len / self.page_size;
        let end = self.head + self.n_heads;
        if end * self.bytes_per_head_token > slot {
            return Err(CopyError::Heads {
                head: self.head,
                end,
                slot_heads: slot / self.bytes_per_head_token.max(1),
            });
        }
        Ok(slot)
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

/// Gathers the slice of `pages` from every buffer in `bufs` (`[K…, V…]`) into `out`; returns
/// the bytes written (`spec.block_len(bufs.len(), pages.len())`).
pub fn gather<B: AsRef<[u8]>>(
    spec: &SliceSpec,
    bufs: &[B],
    pages: &[i32],
    out: &mut [u8],
) -> Result<usize, CopyError> {
    let slot = spec.slot()?;
    let need = spec.block_len(bufs.len(), pages.len());
    if out.len() < need {
        return Err(CopyError::Block {
            have: out.len(),
            need,
        });
    }
    let tb = spec.token_bytes();
    let head_off = spec.head * spec.bytes_per_head_token;
    let whole_slot = tb == slot;
    let page_bytes = spec.page_size * tb;
    for (b, buf) in bufs.iter().enumerate() {
        for &page in pages {
            spec.page_range(b, buf.as_ref().len(), page)?;
        }
    }
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
    let slot = spec.slot()?;
    let need = spec.block_len(bufs.len(), pages.len());
    if block.len() < need {
        return Err(CopyError::Block {
            have: block.len(),
            need,
        });
    }
    let tb = spec.token_bytes();
    let head_off = spec.head * spec.bytes_per_head_token;
    let whole_slot = tb == slot;
    let page_bytes = spec.page_size * tb;
    for (b, buf) in bufs.iter_mut().enumerate() {
        for &page in pages {
            spec.page_range(b, buf.as_mut().len(), page)?;
        }
    }
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
    }
}
