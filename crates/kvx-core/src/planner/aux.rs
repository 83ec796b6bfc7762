//! Aux (metadata) rows and state components, sent with a room's last chunk.
//!
//! Aux: for each metadata buffer i, one op from the prefill's row to the decode's row, both strided
//! by the **prefill's** row length (the decode publishes only pointers, so both builds must agree on
//! the buffer list and row sizes). The `bootstrap_room` row must hold the room id before this is
//! sent (see [`crate::layout::fill_room_row`]); the decode gates on it.
//!
//! State: slot-indexed components (MAMBA) copy one slot per entry pair; page-indexed ones (SWA, …)
//! are planned like KV with the component's own buffers and item lengths.

use std::collections::HashMap;

use super::paged::PagedPlan;
use super::pairing::LayerPair;
use super::runs::merge_runs;
use super::{PlanError, PlanPart, Side, check_span, nonneg};
use crate::TransferOp;
use crate::layout::{AuxLayout, StateComponent, StateKind};

/// Plans the aux rows: prefill row `src_row` of every buffer into decode row `dst_row` of the
/// decode's buffer at the same index.
pub fn plan_aux(
    src: &AuxLayout,
    src_row: u64,
    dst_ptrs: &[u64],
    dst_row: u64,
) -> Result<Vec<TransferOp>, PlanError> {
    if src.buffers.len() != dst_ptrs.len() {
        return Err(PlanError::AuxCount {
            src: src.buffers.len(),
            dst: dst_ptrs.len(),
        });
    }
    let mut ops = Vec::with_capacity(dst_ptrs.len());
    for (i, (b, &dptr)) in src.buffers.iter().zip(dst_ptrs).enumerate() {
        let item = b.item_len;
        let oob = |side| PlanError::OutOfBounds {
            side,
            buffer: i,
            end: u64::MAX,
            capacity: u64::MAX,
        };
        let soff = src_row.checked_mul(item).ok_or(oob(Side::Src))?;
        let doff = dst_row.checked_mul(item).ok_or(oob(Side::Dst))?;
        let s = check_span(Side::Src, i, b.addr, b.len, soff, item)?;
        let d = check_span(Side::Dst, i, dptr, None, doff, item)?;
        ops.push(TransferOp::new(s, d, item));
    }
    Ok(ops)
}

/// Pairs state entries: by (layer id, occurrence) when both sides publish ids, else by position.
fn pair_entries(src: &StateComponent, dst: &StateComponent) -> Result<Vec<LayerPair>, PlanError> {
    let mismatch = PlanError::StateEntryMismatch {
        src: src.buffers.len(),
        dst: dst.buffers.len(),
    };
    let pair = |i: usize, j: usize| LayerPair {
        src_index: i,
        dst_index: j,
        src: src.buffers[i],
        dst: dst.buffers[j],
        target: true,
    };
    let ids_ok =
        |c: &StateComponent| !c.layer_ids.is_empty() && c.layer_ids.len() == c.buffers.len();
    if ids_ok(src) && ids_ok(dst) {
        let mut by_id = HashMap::new();
        let mut occ: HashMap<u32, usize> = HashMap::new();
        for (j, &id) in dst.layer_ids.iter().enumerate() {
            let k = occ.entry(id).or_insert(0);
            by_id.insert((id, *k), j);
            *k += 1;
        }
        occ.clear();
        let mut out = Vec::with_capacity(src.buffers.len());
        for (i, &id) in src.layer_ids.iter().enumerate() {
            let k = occ.entry(id).or_insert(0);
            let j = *by_id.get(&(id, *k)).ok_or(mismatch.clone())?;
            *k += 1;
            out.push(pair(i, j));
        }
        Ok(out)
    } else if src.buffers.len() == dst.buffers.len() {
        Ok((0..src.buffers.len()).map(|i| pair(i, i)).collect())
    } else {
        Err(mismatch)
    }
}

/// Plans one state component for the last chunk.
pub fn plan_state(
    src: &StateComponent,
    dst: &StateComponent,
    src_idx: &[i32],
    dst_idx: &[i32],
) -> Result<PlanPart, PlanError> {
    let pairs = pair_entries(src, dst)?;
    match src.kind {
        StateKind::Slot => {
            let (&[s], &[d]) = (src_idx, dst_idx) else {
                return Err(PlanError::StateSlotCount {
                    src: src_idx.len(),
                    dst: dst_idx.len(),
                });
            };
            let s = nonneg(Side::Src, 0, s)?;
            let d = nonneg(Side::Dst, 0, d)?;
            let mut ops = Vec::with_capacity(pairs.len());
            for p in &pairs {
                let item = p.src.item_len;
                let oob = |side, buffer| PlanError::OutOfBounds {
                    side,
                    buffer,
                    end: u64::MAX,
                    capacity: u64::MAX,
                };
                let soff = s.checked_mul(item).ok_or(oob(Side::Src, p.src_index))?;
                let doff = d.checked_mul(item).ok_or(oob(Side::Dst, p.dst_index))?;
                let sa = check_span(Side::Src, p.src_index, p.src.addr, p.src.len, soff, item)?;
                let da = check_span(Side::Dst, p.dst_index, p.dst.addr, p.dst.len, doff, item)?;
                ops.push(TransferOp::new(sa, da, item));
            }
            Ok(PlanPart::Ops(ops))
        }
        StateKind::Paged | StateKind::PagedExact => {
            let n = if src.kind == StateKind::Paged {
                src_idx.len().min(dst_idx.len())
            } else if src_idx.len() == dst_idx.len() {
                src_idx.len()
            } else {
                return Err(PlanError::LengthMismatch {
                    src: src_idx.len(),
                    dst: dst_idx.len(),
                });
            };
            let runs = merge_runs(&src_idx[..n], &dst_idx[..n])?;
            Ok(PlanPart::Paged(PagedPlan::new(pairs, runs)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Buffer;

    #[test]
    fn aux_rows_use_prefill_row_lengths() {
        let ptrs: Vec<u64> = (0..10).map(|i| 0x100_0000 * (i + 1)).collect();
        let aux = AuxLayout::sglang_default(&ptrs, Some(32)).unwrap();
        let dst: Vec<u64> = (0..10).map(|i| 0x8000_0000 + 0x10_0000 * i).collect();
        let ops = plan_aux(&aux, 3, &dst, 17).unwrap();
        assert_eq!(ops.len(), 10);
        assert_eq!(
            ops[4],
            TransferOp::new(0x500_0000 + 3 * 512, 0x8040_0000 + 17 * 512, 512)
        );
        assert_eq!(ops[9].len, 64);
        assert!(matches!(
            plan_aux(&aux, 32, &dst, 0),
            Err(PlanError::OutOfBounds {
                side: Side::Src,
                ..
            })
        ));
        assert_eq!(
            plan_aux(&aux, 0, &dst[..9], 0),
            Err(PlanError::AuxCount { src: 10, dst: 9 })
        );
    }

    #[test]
    fn mamba_slot_and_swa_pages() {
        let src = StateComponent::new(
            StateKind::Slot,
            vec![Buffer::new(0x1000, 100, 1000), Buffer::new(0x9000, 40, 400)],
        );
        let dst = StateComponent::new(
            StateKind::Slot,
            vec![
                Buffer::remote(0x10_0000, 100),
                Buffer::remote(0x20_0000, 40),
            ],
        );
        let PlanPart::Ops(ops) = plan_state(&src, &dst, &[2], &[42]).unwrap() else {
            panic!("slot state plans explicit ops");
        };
        assert_eq!(
            ops,
            vec![
                TransferOp::new(0x1000 + 200, 0x10_0000 + 4200, 100),
                TransferOp::new(0x9000 + 80, 0x20_0000 + 1680, 40)
            ]
        );
        assert!(matches!(
            plan_state(&src, &dst, &[1, 2], &[3]),
            Err(PlanError::StateSlotCount { src: 2, dst: 1 })
        ));
        assert!(plan_state(&src, &dst, &[10], &[0]).is_err());

        let swa = StateComponent::new(StateKind::Paged, vec![Buffer::new(0x1000, 64, 64 * 8)]);
        let swa_dst = StateComponent::new(StateKind::Paged, vec![Buffer::remote(0x5000, 64)]);
        let part = plan_state(&swa, &swa_dst, &[1, 2, 3], &[4, 5]).unwrap();
        assert_eq!(
            part.ops().collect::<Vec<_>>(),
            vec![TransferOp::new(0x1040, 0x5100, 128)]
        );
        let mut exact = swa.clone();
        exact.kind = StateKind::PagedExact;
        assert!(plan_state(&exact, &swa_dst, &[1, 2, 3], &[4, 5]).is_err());
    }
}
