//! The equal-TP / MLA plan (sglang's `send_kvcache`): merged page runs × buffer pairs.
//!
//! For every buffer pair and every run: `src = src_ptr + src_start·item_len`,
//! `dst = dst_ptr + dst_start·item_len`, `len = run_len·item_len`, where `item_len` is the
//! **prefill's** bytes per page for that buffer (prefill and decode must have identical per-page
//! item lengths on this path). Ops come out layer-major: all runs of pair 0, then pair 1, ….

use super::pairing::{LayerPair, pair_layers};
use super::runs::{Run, merge_runs};
use super::{PlanError, Side, check_span};
use crate::TransferOp;
use crate::layout::KvLayout;

/// Buffer pairs × page runs, validated; ops are generated on demand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagedPlan {
    pairs: Vec<LayerPair>,
    runs: Vec<Run>,
}

impl PagedPlan {
    /// Builds and validates a plan: for every pair, the highest source and destination page end
    /// (times the source item length) must lie inside the respective buffer.
    pub fn new(pairs: Vec<LayerPair>, runs: Vec<Run>) -> Result<Self, PlanError> {
        let src_end = runs.iter().map(|r| r.src + r.len).max().unwrap_or(0);
        let dst_end = runs.iter().map(|r| r.dst + r.len).max().unwrap_or(0);
        if !runs.is_empty() {
            for p in &pairs {
                let item = p.src.item_len;
                let span = |side, index, end: u64| {
                    end.checked_mul(item).ok_or(PlanError::OutOfBounds {
                        side,
                        buffer: index,
                        end: u64::MAX,
                        capacity: u64::MAX,
                    })
                };
                let s = span(Side::Src, p.src_index, src_end)?;
                check_span(Side::Src, p.src_index, p.src.addr, p.src.len, 0, s)?;
                let d = span(Side::Dst, p.dst_index, dst_end)?;
                check_span(Side::Dst, p.dst_index, p.dst.addr, p.dst.len, 0, d)?;
            }
        }
        Ok(PagedPlan { pairs, runs })
    }

    /// The buffer pairs, in write order.
    pub fn pairs(&self) -> &[LayerPair] {
        &self.pairs
    }

    /// The merged runs.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Number of ops (`pairs × runs`).
    pub fn num_ops(&self) -> u64 {
        self.pairs.len() as u64 * self.runs.len() as u64
    }

    /// Total bytes copied.
    pub fn total_bytes(&self) -> u64 {
        let pages: u64 = self.runs.iter().map(|r| r.len).sum();
        self.pairs.iter().map(|p| p.src.item_len * pages).sum()
    }

    /// The ops, layer-major.
    pub fn ops(&self) -> PagedOps<'_> {
        PagedOps {
            plan: self,
            pair: 0,
            run: 0,
        }
    }
}

/// Iterator over a [`PagedPlan`]'s ops.
#[derive(Clone, Debug)]
pub struct PagedOps<'a> {
    plan: &'a PagedPlan,
    pair: usize,
    run: usize,
}

impl Iterator for PagedOps<'_> {
    type Item = TransferOp;

    fn next(&mut self) -> Option<TransferOp> {
        let p = self.plan.pairs.get(self.pair)?;
        let r = self.plan.runs.get(self.run)?;
        self.run += 1;
        if self.run == self.plan.runs.len() {
            self.run = 0;
            self.pair += 1;
        }
        let item = p.src.item_len;
        // Bounds and overflow were checked in `PagedPlan::new`.
        Some(TransferOp::new(
            p.src.addr + r.src * item,
            p.dst.addr + r.dst * item,
            r.len * item,
        ))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let runs = self.plan.runs.len();
        let left = if runs == 0 {
            0
        } else {
            (self.plan.pairs.len().saturating_sub(self.pair)) * runs - self.run
        };
        (left, Some(left))
    }
}

/// Plans one chunk on the equal-TP / MLA path: every prefill buffer (drafts included) paired with
/// its decode buffer, pages merged into runs.
pub fn plan_kv_equal(
    src: &KvLayout,
    dst: &KvLayout,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<PagedPlan, PlanError> {
    let runs = merge_runs(src_pages, dst_pages)?;
    let pairs = pair_layers(src, dst, true)?;
    PagedPlan::new(pairs, runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Buffer;

    const KP: u64 = 0x7f00_0000_0000;
    const KD: u64 = 0x7e00_0000_0000;

    /// TP1, 2 layers, bf16, 8 KV heads × 128 dims, page size 1 ⇒ item_len 2048 (spec §5.3).
    fn layout(base: u64, pages: u64) -> KvLayout {
        KvLayout::mha_contiguous(base, 2, 2048, pages, 1)
    }

    #[test]
    fn spec_worked_example() {
        let src = layout(KP, 64);
        let dst = layout(KD, 64);
        let plan = plan_kv_equal(&src, &dst, &[10, 11, 12, 40], &[5, 6, 7, 9]).unwrap();
        let ops: Vec<TransferOp> = plan.ops().collect();
        assert_eq!(ops.len(), 8);
        assert_eq!(plan.num_ops(), 8);
        assert_eq!(ops[0], TransferOp::new(KP + 20480, KD + 10240, 6144));
        assert_eq!(ops[1], TransferOp::new(KP + 40 * 2048, KD + 9 * 2048, 2048));
        // Layer-major: K0 runs, K1 runs, V0 runs, V1 runs.
        let k1 = src.buffers[1].addr;
        assert_eq!(ops[2].src, k1 + 20480);
        let v0 = src.buffers[2].addr;
        assert_eq!(ops[4].src, v0 + 20480);
        assert_eq!(plan.total_bytes(), 4 * 4 * 2048);
        assert_eq!(TransferOp::total_bytes(&ops), plan.total_bytes());
        assert_eq!(plan.ops().size_hint(), (8, Some(8)));
    }

    #[test]
    fn rejects_out_of_range_pages() {
        let src = layout(KP, 16);
        let dst = layout(KD, 64);
        let err = plan_kv_equal(&src, &dst, &[15, 16], &[0, 1]).unwrap_err();
        assert!(matches!(
            err,
            PlanError::OutOfBounds {
                side: Side::Src,
                end: 34816,
                capacity: 32768,
                ..
            }
        ));
        assert!(plan_kv_equal(&src, &dst, &[15], &[0]).is_ok());
        // Destination bounds are enforced when the decode's buffer lengths are known.
        assert!(matches!(
            plan_kv_equal(&dst, &src, &[0], &[16]),
            Err(PlanError::OutOfBounds {
                side: Side::Dst,
                ..
            })
        ));
        // Unknown remote lengths still reject address-space wrap-around.
        let remote = KvLayout::mha(
            vec![Buffer::remote(u64::MAX - 4096, 2048); 2],
            vec![Buffer::remote(u64::MAX - 4096, 2048); 2],
            1,
        );
        assert!(plan_kv_equal(&src, &remote, &[0], &[1]).is_ok());
        assert!(matches!(
            plan_kv_equal(&src, &remote, &[0], &[2]),
            Err(PlanError::OutOfBounds {
                side: Side::Dst,
                ..
            })
        ));
    }
}
