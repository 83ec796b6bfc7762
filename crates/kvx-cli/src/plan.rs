//! Turns a chunk's page lists into merged `(src, dst, len)` writes, in bounded batches.
//!
//! Equal-TP / MLA plan (sglang's `send_kvcache`): pair source and destination pages, cut runs
//! wherever either side is not consecutive, and emit one write per run per KV buffer with the
//! prefill's item length as stride on both sides (layouts must match, which is checked first).

use kvx_core::TransferOp;

/// Why a chunk cannot be planned (a per-room error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The decode's KV layout differs from ours.
    #[error(
        "layout mismatch: decode has {dst_buffers} buffers of {dst_item_len} B/page, prefill {src_buffers} of {src_item_len}"
    )]
    LayoutMismatch {
        /// Decode buffers.
        dst_buffers: usize,
        /// Decode item length.
        dst_item_len: u64,
        /// Prefill buffers.
        src_buffers: usize,
        /// Prefill item length.
        src_item_len: u64,
    },
    /// A page id is negative.
    #[error("negative page index {0}")]
    NegativePage(i32),
    /// The chunk's slice is outside the destination page list.
    #[error("chunk pages {start}..{end} outside the {len} destination pages")]
    SliceOutOfRange {
        /// Slice start.
        start: usize,
        /// Slice end.
        end: usize,
        /// Destination pages.
        len: usize,
    },
}

/// Contiguous runs `(src_start, dst_start, pages)` of paired page lists.
pub fn runs(src: &[i32], dst: &[i32]) -> Result<Vec<(u64, u64, u64)>, PlanError> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        let s = u64::try_from(s).map_err(|_| PlanError::NegativePage(s))?;
        let d = u64::try_from(d).map_err(|_| PlanError::NegativePage(d))?;
        match out.last_mut() {
            Some((s0, d0, n)) if *s0 + *n == s && *d0 + *n == d => *n += 1,
            _ => out.push((s, d, 1)),
        }
    }
    Ok(out)
}

/// The writes of one chunk to one decode: per buffer, one op per run.
pub fn plan_kv(
    src_ptrs: &[u64],
    dst_ptrs: &[u64],
    item_len: u64,
    dst_item_len: u64,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<Vec<TransferOp>, PlanError> {
    if src_ptrs.len() != dst_ptrs.len() || item_len != dst_item_len {
        return Err(PlanError::LayoutMismatch {
            dst_buffers: dst_ptrs.len(),
            dst_item_len,
            src_buffers: src_ptrs.len(),
            src_item_len: item_len,
        });
    }
    let n = src_pages.len().min(dst_pages.len());
    let runs = runs(&src_pages[..n], &dst_pages[..n])?;
    let mut ops = Vec::with_capacity(runs.len() * src_ptrs.len());
    for (&sp, &dp) in src_ptrs.iter().zip(dst_ptrs) {
        for &(s, d, len) in &runs {
            ops.push(TransferOp::new(
                sp.wrapping_add(s.wrapping_mul(item_len)),
                dp.wrapping_add(d.wrapping_mul(item_len)),
                len * item_len,
            ));
        }
    }
    Ok(ops)
}

/// Splits ops into batches of at most `max_ops` ops and about `max_bytes` bytes (a single larger
/// op gets a batch of its own).
pub fn batches(ops: &[TransferOp], max_ops: usize, max_bytes: u64) -> Vec<&[TransferOp]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, op) in ops.iter().enumerate() {
        if i > start && (i - start >= max_ops.max(1) || bytes + op.len > max_bytes) {
            out.push(&ops[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += op.len;
    }
    if start < ops.len() {
        out.push(&ops[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn merges_runs_per_buffer() {
        let ops = plan_kv(
            &[1000, 2000],
            &[5000, 6000],
            10,
            10,
            &[1, 2, 3, 7],
            &[4, 5, 9, 10],
        )
        .unwrap();
        assert_eq!(
            ops,
            vec![
                TransferOp::new(1010, 5040, 20),
                TransferOp::new(1030, 5090, 10),
                TransferOp::new(1070, 5100, 10),
                TransferOp::new(2010, 6040, 20),
                TransferOp::new(2030, 6090, 10),
                TransferOp::new(2070, 6100, 10),
            ]
        );
        assert!(plan_kv(&[1], &[1, 2], 10, 10, &[], &[]).is_err());
        assert!(plan_kv(&[1], &[1], 10, 10, &[-1], &[1]).is_err());
    }

    proptest! {
        #[test]
        fn runs_cover_every_page_once(pairs in proptest::collection::vec((0i32..64, 0i32..64), 0..100)) {
            let (s, d): (Vec<i32>, Vec<i32>) = pairs.into_iter().unzip();
            let r = runs(&s, &d).unwrap();
            let mut i = 0;
            for (s0, d0, n) in r {
                for k in 0..n {
                    prop_assert_eq!(s[i] as u64, s0 + k);
                    prop_assert_eq!(d[i] as u64, d0 + k);
                    i += 1;
                }
            }
            prop_assert_eq!(i, s.len());
        }

        #[test]
        fn batches_partition(lens in proptest::collection::vec(1u64..100, 0..50), max_ops in 1usize..8) {
            let ops: Vec<TransferOp> = lens.iter().map(|&l| TransferOp::new(0, 0, l)).collect();
            let b = batches(&ops, max_ops, 150);
            prop_assert_eq!(b.iter().map(|x| x.len()).sum::<usize>(), ops.len());
            for x in b {
                prop_assert!(x.len() <= max_ops);
                prop_assert!(x.len() == 1 || TransferOp::total_bytes(x) <= 150);
            }
        }
    }
}
