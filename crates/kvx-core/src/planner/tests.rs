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

proptest! {
    /// Geometry as a decode's registration can carry it (any TP size, rank, item length):
    /// computing the slice never panics, and an accepted slice fits one token on both sides.
    #[test]
    fn head_slice_geometry_from_a_peer_never_panics(
        total_kv_heads in any::<u32>(),
        src_tp_size in any::<u32>(),
        src_tp_rank in any::<u32>(),
        dst_tp_size in any::<u32>(),
        dst_tp_rank in any::<u32>(),
        src_item in any::<u64>(),
        dst_item in prop_oneof![any::<u64>(), (u64::MAX - 1024)..=u64::MAX],
        page_size in prop_oneof![Just(1u32), any::<u32>()],
    ) {
        let params = HeadSliceParams {
            total_kv_heads,
            src_tp_size,
            src_tp_rank,
            dst_tp_size,
            dst_tp_rank,
        };
        if let Ok(s) = params.slice(src_item, dst_item, page_size) {
            let ps = u64::from(page_size);
            prop_assert!(s.len > 0);
            prop_assert!(s.src_offset.checked_add(s.len).is_some_and(|e| e <= src_item / ps));
            prop_assert!(s.dst_offset.checked_add(s.len).is_some_and(|e| e <= dst_item / ps));
        }
    }
}

/// Fake registered memory: bytes based at a virtual address. Applying an op outside it panics
/// (the test fails), so these tests also prove bounds.
struct Mem {
    base: u64,
    bytes: Vec<u8>,
}

impl Mem {
    fn of(layout: &KvLayout) -> Self {
        let base = layout.buffers[0].addr;
        let end = layout
            .buffers
            .iter()
            .map(|b| b.addr + b.len.unwrap_or(0))
            .max()
            .unwrap();
        Mem {
            base,
            bytes: vec![0; (end - base) as usize],
        }
    }

    fn range(&self, addr: u64, len: u64) -> std::ops::Range<usize> {
        let start = (addr - self.base) as usize;
        start..start + len as usize
    }
}

/// Executes ops as memcpy from `src` into `dst`.
fn execute(ops: impl Iterator<Item = TransferOp>, src: &Mem, dst: &mut Mem) {
    for op in ops {
        let from = src.range(op.src, op.len);
        let to = dst.range(op.dst, op.len);
        dst.bytes[to].copy_from_slice(&src.bytes[from]);
    }
}

/// A recognisable byte for (buffer, page, slot, global head, byte).
fn enc(k: usize, page: u64, slot: u64, head: u64, byte: u64) -> u8 {
    (k as u64 * 131 + page * 31 + slot * 17 + head * 7 + byte * 3 + 1) as u8
}

fn distinct_dst_pages() -> impl Strategy<Value = (Vec<i32>, Vec<i32>)> {
    (
        proptest::collection::vec(0..PAGES as i32, 0..16),
        Just((0..PAGES as i32).collect::<Vec<i32>>()).prop_shuffle(),
    )
        .prop_map(|(src, dst)| {
            let n = src.len();
            (src, dst[..n].to_vec())
        })
}

proptest! {
    #[test]
    fn equal_tp_batches_move_exactly_the_planned_pages(
        (src_pages, dst_pages) in distinct_dst_pages(),
        max_ops in 1usize..8,
        max_bytes in prop::sample::select(vec![7u64, 64, 1000, 1 << 20]),
    ) {
        let item = 32u64;
        let src = KvLayout::mha_contiguous(0x10_0000, 2, item, PAGES, 1);
        let dst = KvLayout::mha_contiguous(0x90_0000, 2, item, PAGES, 1);
        let mut smem = Mem::of(&src);
        for (k, b) in src.buffers.iter().enumerate() {
            for p in 0..PAGES {
                for x in 0..item {
                    let i = smem.range(b.addr + p * item + x, 1).start;
                    smem.bytes[i] = enc(k, p, 0, 0, x);
                }
            }
        }
        let mut dmem = Mem::of(&dst);
        let mut plan = super::Plan::new();
        plan.push(super::PlanPart::Paged(plan_kv_equal(&src, &dst, &src_pages, &dst_pages).unwrap()));
        let limits = super::BatchLimits::new(max_ops, max_bytes).unwrap();
        for batch in plan.batches(limits) {
            execute(batch.into_iter(), &smem, &mut dmem);
        }
        let mut expected = vec![0u8; dmem.bytes.len()];
        for (k, b) in dst.buffers.iter().enumerate() {
            for (&s, &d) in src_pages.iter().zip(&dst_pages) {
                for x in 0..item {
                    let i = dmem.range(b.addr + d as u64 * item + x, 1).start;
                    expected[i] = enc(k, s as u64, 0, 0, x);
                }
            }
        }
        prop_assert!(dmem.bytes == expected);
    }

    #[test]
    fn head_slices_reassemble_every_decode_token(
        (src_pages, dst_pages) in distinct_dst_pages(),
        (pt, dt) in prop::sample::select(vec![(1u32, 1u32), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 2)]),
        page_size in 1u32..3,
    ) {
        const T: u64 = 8; // total KV heads
        const H: u64 = 4; // bytes per head per token
        let ps = u64::from(page_size);
        let hs = (T / u64::from(pt)).max(1);
        let hd = (T / u64::from(dt)).max(1);
        let src_layout = KvLayout::mha_contiguous(0x10_0000, 2, hs * H * ps, PAGES, page_size);
        let dst_layout = KvLayout::mha_contiguous(0x90_0000, 2, hd * H * ps, PAGES, page_size);
        // Every prefill rank holds heads [r·hs, (r+1)·hs) of every token of every page.
        let prefill: Vec<Mem> = (0..u64::from(pt))
            .map(|r| {
                let mut m = Mem::of(&src_layout);
                for (k, b) in src_layout.buffers.iter().enumerate() {
                    for p in 0..PAGES {
                        for t in 0..ps {
                            for h in 0..hs {
                                for x in 0..H {
                                    let a = b.addr + p * b.item_len + t * hs * H + h * H + x;
                                    let i = m.range(a, 1).start;
                                    m.bytes[i] = enc(k, p, t, r * hs + h, x);
                                }
                            }
                        }
                    }
                }
                m
            })
            .collect();
        for q in 0..u64::from(dt) {
            // sglang's rank mapping (spec §4.3): which prefill ranks write to decode rank q.
            let targets: Vec<u64> = if pt == dt {
                vec![q]
            } else if dt > pt {
                vec![q / u64::from(dt / pt)]
            } else {
                let f = u64::from(pt / dt);
                (q * f..(q + 1) * f).collect()
            };
            let mut dmem = Mem::of(&dst_layout);
            for &r in &targets {
                let params = HeadSliceParams {
                    total_kv_heads: T as u32,
                    src_tp_size: pt,
                    src_tp_rank: r as u32,
                    dst_tp_size: dt,
                    dst_tp_rank: q as u32,
                };
                let plan = plan_kv_head_slice(&src_layout, &dst_layout, &params, &src_pages, &dst_pages).unwrap();
                execute(Coalesce::new(plan.ops()), &prefill[r as usize], &mut dmem);
            }
            for (k, b) in dst_layout.buffers.iter().enumerate() {
                for (&s, &d) in src_pages.iter().zip(&dst_pages) {
                    for t in 0..ps {
                        for h in 0..hd {
                            for x in 0..H {
                                let a = b.addr + d as u64 * b.item_len + t * hd * H + h * H + x;
                                let got = dmem.bytes[dmem.range(a, 1).start];
                                let want = enc(k, s as u64, t, q * hd + h, x);
                                prop_assert_eq!(got, want, "decode {} buffer {} page {} slot {} head {}", q, k, d, t, h);
                            }
                        }
                    }
                }
            }
        }
    }
}
