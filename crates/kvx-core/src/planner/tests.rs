//! Property tests across the planner: merging never changes the bytes copied, and no op of a
//! validated plan reaches outside its buffers.

use proptest::prelude::*;

use super::batch::Region;
use super::paged::{PagedPlan, plan_kv_equal};
use super::pairing::pair_layers;
use super::runs::unmerged_runs;
use super::slice::{HeadSliceParams, plan_kv_head_slice};
use super::{Coalesce, validate_ops};
use crate::TransferOp;
use crate::layout::KvLayout;

const PAGES: u64 = 48;

fn regions(l: &KvLayout) -> Vec<Region> {
    l.buffers
        .iter()
        .map(|b| Region {
            addr: b.addr,
            len: b.len.unwrap_or(0),
        })
        .collect()
}

/// Every (src byte, dst byte) a list of ops copies, sorted.
fn bytes(ops: impl Iterator<Item = TransferOp>) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = ops
        .flat_map(|o| (0..o.len).map(move |k| (o.src + k, o.dst + k)))
        .collect();
    v.sort_unstable();
    v
}

fn page_pairs() -> impl Strategy<Value = (Vec<i32>, Vec<i32>)> {
    proptest::collection::vec((0..PAGES as i32 + 4, 0..PAGES as i32 + 4), 0..24)
        .prop_map(|v| v.into_iter().unzip())
}

proptest! {
    #[test]
    fn merged_and_unmerged_plans_copy_the_same_bytes(
        (src_pages, dst_pages) in page_pairs(),
        layers in 1usize..4,
        item in prop::sample::select(vec![16u64, 48, 64]),
    ) {
        let src = KvLayout::mha_contiguous(0x10_0000, layers, item, PAGES, 1);
        let dst = KvLayout::mha_contiguous(0x90_0000, layers, item, PAGES, 1);
        let merged = plan_kv_equal(&src, &dst, &src_pages, &dst_pages);
        let unmerged = unmerged_runs(&src_pages, &dst_pages)
            .and_then(|runs| PagedPlan::new(pair_layers(&src, &dst, true)?, runs));
        match (merged, unmerged) {
            (Ok(m), Ok(u)) => {
                prop_assert!(m.num_ops() <= u.num_ops());
                prop_assert_eq!(m.total_bytes(), u.total_bytes());
                prop_assert_eq!(bytes(m.ops()), bytes(u.ops()));
                prop_assert_eq!(bytes(Coalesce::new(m.ops())), bytes(u.ops()));
                let ops: Vec<TransferOp> = m.ops().collect();
                prop_assert!(validate_ops(&ops, &regions(&src), &regions(&dst)).is_ok());
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            (m, u) => prop_assert!(false, "merged {:?} vs unmerged {:?}", m.is_ok(), u.is_ok()),
        }
        // Any page index at or past PAGES must have been rejected.
        let in_range = src_pages.iter().chain(&dst_pages).all(|&p| (p as u64) < PAGES);
        prop_assert_eq!(plan_kv_equal(&src, &dst, &src_pages, &dst_pages).is_ok(), in_range);
    }

    #[test]
    fn head_slice_ops_stay_inside_buffers(
        (src_pages, dst_pages) in page_pairs(),
        dst_tp in prop::sample::select(vec![1u32, 2, 4, 8]),
        rank in 0u32..8,
        page_size in 1u32..4,
    ) {
        // 8 KV heads, 32 bytes per head per token; prefill TP 2.
        let head = 32u64;
        let src_item = 4 * head * u64::from(page_size);
        let dst_item = (8 / u64::from(dst_tp)) * head * u64::from(page_size);
        let src = KvLayout::mha_contiguous(0x10_0000, 2, src_item, PAGES, page_size);
        let dst = KvLayout::mha_contiguous(0x90_0000, 2, dst_item, PAGES, page_size);
        let params = HeadSliceParams {
            total_kv_heads: 8,
            src_tp_size: 2,
            src_tp_rank: rank % 2,
            dst_tp_size: dst_tp,
            dst_tp_rank: rank % dst_tp,
        };
        if let Ok(plan) = plan_kv_head_slice(&src, &dst, &params, &src_pages, &dst_pages) {
            let ops: Vec<TransferOp> = plan.ops().collect();
            prop_assert_eq!(ops.len() as u64, plan.num_ops());
            prop_assert!(validate_ops(&ops, &regions(&src), &regions(&dst)).is_ok());
            prop_assert_eq!(bytes(Coalesce::new(ops.iter().copied())), bytes(ops.into_iter()));
        } else {
            let in_range = src_pages.iter().chain(&dst_pages).all(|&p| (p as u64) < PAGES);
            prop_assert!(!in_range);
        }
    }
}
