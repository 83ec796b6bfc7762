//! The heterogeneous attention-TP plan (sglang's `send_kvcache_slice`): per token, the slice of
//! KV heads one decode rank owns.
//!
//! With `T` total KV heads, prefill TP size `Pt` and decode TP size `Dt`: `hs = max(1, T/Pt)`
//! heads per prefill rank, `hd = max(1, T/Dt)` per decode rank, and `bph` bytes per head per token,
//! taken from the **decode** item length (`dst_item_len / page_size / hd`). When `Pt > Dt` a prefill
//! rank sends all its `hs` heads into the decode at head offset `((lr / max(1, Pt/T))·hs) % hd`;
//! when `Pt ≤ Dt` it sends `hd` heads starting at local head `((dr / max(1, Dt/T))·hd) % hs`.
//! Guard: the slice must fit in one token on both sides. One op per (K/V buffer, page, token slot);
//! coalescing (see [`super::batch::Coalesce`]) merges neighbours when the slice spans whole tokens.

use super::pairing::{LayerPair, pair_layers};
use super::{PlanError, Side, check_span, nonneg};
use crate::TransferOp;
use crate::layout::KvLayout;

/// Tensor-parallel geometry of one prefill rank and one decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadSliceParams {
    /// Total KV heads of the model (`T`).
    pub total_kv_heads: u32,
    /// Prefill attention-TP size (`Pt`).
    pub src_tp_size: u32,
    /// Prefill attention-TP rank.
    pub src_tp_rank: u32,
    /// Decode attention-TP size (`Dt`).
    pub dst_tp_size: u32,
    /// Decode attention-TP rank.
    pub dst_tp_rank: u32,
}

/// The derived slice geometry: which heads, how many bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadSlice {
    /// Byte offset of the slice inside a source token.
    pub src_offset: u64,
    /// Byte offset of the slice inside a destination token.
    pub dst_offset: u64,
    /// Bytes per token (`n_heads · bph`).
    pub len: u64,
}

impl HeadSliceParams {
    /// Computes the slice for source/destination page item lengths and the page size.
    pub fn slice(
        &self,
        src_item_len: u64,
        dst_item_len: u64,
        page_size: u32,
    ) -> Result<HeadSlice, PlanError> {
        let (t, pt, dt) = (
            u64::from(self.total_kv_heads),
            u64::from(self.src_tp_size),
            u64::from(self.dst_tp_size),
        );
        let ps = u64::from(page_size);
        if t == 0 || pt == 0 || dt == 0 || ps == 0 {
            return Err(PlanError::HeadSliceConfig(
                "zero heads, TP size or page size",
            ));
        }
        let hs = (t / pt).max(1);
        let hd = (t / dt).max(1);
        let bph = dst_item_len / ps / hd;
        if bph == 0 {
            return Err(PlanError::HeadSliceConfig(
                "decode item length below one head",
            ));
        }
        let lr = u64::from(self.src_tp_rank) % pt;
        let dr = u64::from(self.dst_tp_rank) % dt;
        let (n_heads, src_head, dst_head) = if pt > dt {
            (hs, 0, ((lr / (pt / t).max(1)) * hs) % hd)
        } else {
            (hd, ((dr / (dt / t).max(1)) * hd) % hs, 0)
        };
        // TP sizes, ranks and the decode item length come from a peer's registration: a wrapped
        // product counts as "does not fit" (need = u64::MAX), never as an overflow.
        let len = n_heads.checked_mul(bph);
        let dst_offset = dst_head.checked_mul(bph);
        let src_offset = src_head.checked_mul(bph);
        let need = |offset: Option<u64>| offset.zip(len).and_then(|(o, l)| o.checked_add(l));
        let dst_token = dst_item_len / ps;
        let src_token = src_item_len / ps;
        for (need, have) in [(need(dst_offset), dst_token), (need(src_offset), src_token)] {
            let need = need.unwrap_or(u64::MAX);
            if need > have {
                return Err(PlanError::HeadSliceGuard { need, have });
            }
        }
        // Both sums fit, so every product fits.
        Ok(HeadSlice {
            src_offset: src_offset.unwrap_or(0),
            dst_offset: dst_offset.unwrap_or(0),
            len: len.unwrap_or(0),
        })
    }
}

/// K/V buffer pairs × page pairs × token slots, validated; ops generated on demand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadSlicePlan {
    pairs: Vec<LayerPair>,
    pages: Vec<(u64, u64)>,
    page_size: u64,
    src_item: u64,
    dst_item: u64,
    slice: HeadSlice,
}

impl HeadSlicePlan {
    /// Number of ops (`pairs × pages × page_size`, saturating).
    pub fn num_ops(&self) -> u64 {
        (self.pairs.len() as u64)
            .saturating_mul(self.pages.len() as u64)
            .saturating_mul(self.page_size)
    }

    /// Total bytes copied (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.num_ops().saturating_mul(self.slice.len)
    }

    /// The slice geometry.
    pub fn slice(&self) -> HeadSlice {
        self.slice
    }

    /// True when consecutive slices may touch on both sides (a slice spans a whole token on
    /// both), so coalescing can merge them; otherwise every op stays apart.
    pub fn may_coalesce(&self) -> bool {
        let ps = self.page_size.max(1);
        self.slice.len == self.src_item / ps && self.slice.len == self.dst_item / ps
    }

    /// The ops: per buffer pair, per page pair, per token slot (see [`HeadSliceOps`]).
    pub fn ops(&self) -> HeadSliceOps<'_> {
        HeadSliceOps::new(self)
    }
}

/// The ops of a [`HeadSlicePlan`] in order (buffer pair, then page, then token slot): the next
/// op's addresses are the last one's plus one token stride, and the size hint is exact, so
/// batches are allocated at their final size.
#[derive(Clone, Debug)]
pub struct HeadSliceOps<'a> {
    plan: &'a HeadSlicePlan,
    /// Token strides on each side.
    src_tok: u64,
    dst_tok: u64,
    pair: usize,
    page: usize,
    /// Token slots left in the current page, and the current op's addresses.
    tokens_left: u64,
    src: u64,
    dst: u64,
    left: usize,
}

impl<'a> HeadSliceOps<'a> {
    fn new(plan: &'a HeadSlicePlan) -> Self {
        let ps = plan.page_size.max(1);
        let mut it = HeadSliceOps {
            plan,
            src_tok: plan.src_item / ps,
            dst_tok: plan.dst_item / ps,
            pair: 0,
            page: 0,
            tokens_left: 0,
            src: 0,
            dst: 0,
            left: usize::try_from(plan.num_ops()).unwrap_or(usize::MAX),
        };
        it.start_page();
        it
    }

    /// Points at token 0 of the current (pair, page), if any is left.
    fn start_page(&mut self) {
        let p = self.plan;
        if let (Some(pair), Some(&(sp, dp))) = (p.pairs.get(self.pair), p.pages.get(self.page)) {
            // Every address was bounds-checked when the plan was built (the last page and token
            // included), so none of these sums wraps.
            self.src = pair.src.addr + sp * p.src_item + p.slice.src_offset;
            self.dst = pair.dst.addr + dp * p.dst_item + p.slice.dst_offset;
            self.tokens_left = p.page_size;
        } else {
            self.tokens_left = 0;
        }
    }
}

impl Iterator for HeadSliceOps<'_> {
    type Item = TransferOp;

    #[inline]
    fn next(&mut self) -> Option<TransferOp> {
        if self.tokens_left == 0 {
            return None;
        }
        let op = TransferOp::new(self.src, self.dst, self.plan.slice.len);
        self.left = self.left.saturating_sub(1);
        self.tokens_left -= 1;
        if self.tokens_left > 0 {
            self.src += self.src_tok;
            self.dst += self.dst_tok;
        } else {
            self.page += 1;
            if self.page == self.plan.pages.len() {
                self.page = 0;
                self.pair += 1;
            }
            self.start_page();
        }
        Some(op)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// Plans one chunk on the head-slice path. Only target K/V buffers are sent (no drafts), paired
/// as on the equal-TP path; source item length from the prefill layout, destination item length
/// from the decode's registration (`dst.item_len()`).
pub fn plan_kv_head_slice(
    src: &KvLayout,
    dst: &KvLayout,
    params: &HeadSliceParams,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<HeadSlicePlan, PlanError> {
    if src_pages.len() != dst_pages.len() {
        return Err(PlanError::LengthMismatch {
            src: src_pages.len(),
            dst: dst_pages.len(),
        });
    }
    let pairs = pair_layers(src, dst, false)?;
    let src_item = src.item_len();
    let dst_item = dst.item_len();
    let slice = params.slice(src_item, dst_item, src.page_size)?;
    let mut pages = Vec::with_capacity(src_pages.len());
    let (mut src_end, mut dst_end) = (0u64, 0u64);
    for (i, (&s, &d)) in src_pages.iter().zip(dst_pages).enumerate() {
        let s = nonneg(Side::Src, i, s)?;
        let d = nonneg(Side::Dst, i, d)?;
        src_end = src_end.max(s + 1);
        dst_end = dst_end.max(d + 1);
        pages.push((s, d));
    }
    if !pages.is_empty() {
        let mul = |side, buffer, a: u64, b: u64| {
            a.checked_mul(b).ok_or(PlanError::OutOfBounds {
                side,
                buffer,
                end: u64::MAX,
                capacity: u64::MAX,
            })
        };
        for p in &pairs {
            if p.src.item_len != src_item || p.dst.item_len != dst_item {
                return Err(PlanError::HeadSliceConfig(
                    "head-slice path needs one item length per side",
                ));
            }
            let s = mul(Side::Src, p.src_index, src_end, src_item)?;
            check_span(Side::Src, p.src_index, p.src.addr, p.src.len, 0, s)?;
            let d = mul(Side::Dst, p.dst_index, dst_end, dst_item)?;
            check_span(Side::Dst, p.dst_index, p.dst.addr, p.dst.len, 0, d)?;
        }
    }
    Ok(HeadSlicePlan {
        pairs,
        pages,
        page_size: u64::from(src.page_size),
        src_item,
        dst_item,
        slice,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 8 KV heads × 128 dims bf16 = 256 bytes per head per token.
    const HEAD: u64 = 256;

    /// The ops as the definition states them: per pair, per page, per token slot.
    fn reference_ops(plan: &HeadSlicePlan) -> Vec<TransferOp> {
        let ps = plan.page_size;
        let (src_tok, dst_tok) = (plan.src_item / ps, plan.dst_item / ps);
        let s = plan.slice;
        let mut v = Vec::new();
        for p in &plan.pairs {
            for &(sp, dp) in &plan.pages {
                for t in 0..ps {
                    v.push(TransferOp::new(
                        p.src.addr + sp * plan.src_item + t * src_tok + s.src_offset,
                        p.dst.addr + dp * plan.dst_item + t * dst_tok + s.dst_offset,
                        s.len,
                    ));
                }
            }
        }
        v
    }

    proptest::proptest! {
        #[test]
        fn ops_follow_the_definition_with_an_exact_size_hint(
            layers in 1usize..4,
            page_size in 1u32..5,
            dst_tp in prop_oneof_tp(),
            dst_rank in 0u32..8,
            pages in proptest::collection::vec((0i32..16, 0i32..16), 0..12),
        ) {
            let src = KvLayout::mha_contiguous(0x1000_0000, layers, 8 * HEAD * u64::from(page_size), 16, page_size);
            let hd = 8 / u64::from(dst_tp);
            let dst = KvLayout::mha_contiguous(0x9000_0000, layers, hd * HEAD * u64::from(page_size), 16, page_size);
            let params = HeadSliceParams {
                total_kv_heads: 8,
                src_tp_size: 1,
                src_tp_rank: 0,
                dst_tp_size: dst_tp,
                dst_tp_rank: dst_rank % dst_tp,
            };
            let (sp, dp): (Vec<i32>, Vec<i32>) = pages.into_iter().unzip();
            let plan = plan_kv_head_slice(&src, &dst, &params, &sp, &dp).unwrap();
            let mut it = plan.ops();
            let mut got = Vec::new();
            loop {
                let (lo, hi) = it.size_hint();
                proptest::prop_assert_eq!(Some(lo), hi);
                let Some(op) = it.next() else {
                    proptest::prop_assert_eq!(lo, 0);
                    break;
                };
                proptest::prop_assert!(lo >= 1);
                got.push(op);
            }
            proptest::prop_assert_eq!(got.len() as u64, plan.num_ops());
            proptest::prop_assert_eq!(got, reference_ops(&plan));
        }
    }

    fn prop_oneof_tp() -> impl proptest::strategy::Strategy<Value = u32> {
        proptest::sample::select(vec![1u32, 2, 4, 8])
    }

    #[test]
    fn one_prefill_to_two_decodes() {
        // Pt=1 holds 8 heads; Dt=2, each decode rank holds 4 heads. Page size 2.
        let src = KvLayout::mha_contiguous(0x1000_0000, 1, 8 * HEAD * 2, 16, 2);
        let dst = KvLayout::mha_contiguous(0x9000_0000, 1, 4 * HEAD * 2, 16, 2);
        let params = HeadSliceParams {
            total_kv_heads: 8,
            src_tp_size: 1,
            src_tp_rank: 0,
            dst_tp_size: 2,
            dst_tp_rank: 1,
        };
        let plan = plan_kv_head_slice(&src, &dst, &params, &[3], &[5]).unwrap();
        assert_eq!(
            plan.slice(),
            HeadSlice {
                src_offset: 4 * HEAD,
                dst_offset: 0,
                len: 4 * HEAD
            }
        );
        let ops: Vec<TransferOp> = plan.ops().collect();
        assert_eq!(ops.len(), 4); // K, V × 2 token slots
        assert_eq!(
            ops[1],
            TransferOp::new(
                0x1000_0000 + 3 * 4096 + 2048 + 1024,
                0x9000_0000 + 5 * 2048 + 1024,
                1024
            )
        );
        assert_eq!(plan.total_bytes(), 4 * 1024);
    }

    #[test]
    fn peer_geometry_that_overflows_is_a_guard_error() {
        // A decode claiming a huge TP group, a high rank and an item length near u64::MAX:
        // the source head offset (rank × bytes per head) does not fit in u64.
        let params = HeadSliceParams {
            total_kv_heads: u32::MAX,
            src_tp_size: 1,
            src_tp_rank: 0,
            dst_tp_size: u32::MAX,
            dst_tp_rank: u32::MAX - 1,
        };
        assert!(matches!(
            params.slice(8 * HEAD, u64::MAX, 1),
            Err(PlanError::HeadSliceGuard { need: u64::MAX, .. })
        ));
        // Prefill TP 3 to decode TP 2 with 7 heads: offset + len passes the token end, and the
        // sum itself wraps when the decode's item length is near u64::MAX.
        let params = HeadSliceParams {
            total_kv_heads: 7,
            src_tp_size: 3,
            src_tp_rank: 1,
            dst_tp_size: 2,
            dst_tp_rank: 0,
        };
        assert!(matches!(
            params.slice(8 * HEAD, u64::MAX, 1),
            Err(PlanError::HeadSliceGuard { .. })
        ));
    }

    #[test]
    fn two_prefills_to_one_decode_and_guard() {
        let src = KvLayout::mha_contiguous(0x1000_0000, 2, 4 * HEAD, 16, 1);
        let dst = KvLayout::mha_contiguous(0x9000_0000, 2, 8 * HEAD, 16, 1);
        let params = HeadSliceParams {
            total_kv_heads: 8,
            src_tp_size: 2,
            src_tp_rank: 1,
            dst_tp_size: 1,
            dst_tp_rank: 0,
        };
        let s = params.slice(4 * HEAD, 8 * HEAD, 1).unwrap();
        assert_eq!((s.src_offset, s.dst_offset, s.len), (0, 4 * HEAD, 4 * HEAD));
        let plan = plan_kv_head_slice(&src, &dst, &params, &[1, 2], &[7, 8]).unwrap();
        assert_eq!(plan.num_ops(), 2 * 2 * 2);
        // Prefill tokens too small for the slice the decode expects: the guard trips.
        let tiny = KvLayout::mha_contiguous(0x1000_0000, 2, 2 * HEAD, 16, 1);
        assert!(matches!(
            plan_kv_head_slice(&tiny, &dst, &params, &[1], &[7]),
            Err(PlanError::HeadSliceGuard { .. })
        ));
        assert!(matches!(
            plan_kv_head_slice(&src, &dst, &params, &[16], &[7]),
            Err(PlanError::OutOfBounds {
                side: Side::Src,
                ..
            })
        ));
    }
}
