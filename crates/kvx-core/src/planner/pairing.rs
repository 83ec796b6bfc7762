//! Layer pairing: which decode buffer receives each prefill KV buffer.
//!
//! When either side publishes layer ids, buffers pair by (layer id, occurrence): the k-th prefill
//! buffer of layer L goes to the k-th decode buffer of layer L (so K pairs with K and V with V).
//! A side without ids gets implied ids from its position and `start_layer`. Without ids on either
//! side this reduces to sglang's PP slicing: equal layer counts pair halves; a decode holding all
//! layers (PP=1) receives prefill stage layers `[start, start+n)` for K and `T+start..` for V.
//! Draft buffers without ids pair by position when both sides have the same number.

use std::collections::HashMap;

use super::PlanError;
use crate::layout::{AttentionKind, Buffer, KvLayout};

/// One prefill buffer and the decode buffer it is written to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerPair {
    /// Source buffer index in the prefill layout.
    pub src_index: usize,
    /// Destination buffer index in the decode layout.
    pub dst_index: usize,
    /// Source buffer.
    pub src: Buffer,
    /// Destination buffer.
    pub dst: Buffer,
    /// True for K/V (or MLA latent) buffers of the target model, false for drafts.
    pub target: bool,
}

/// Implied global layer id of target buffer `i` of a layout whose first layer is `start`.
fn implied_id(layout: &KvLayout, start: usize, i: usize) -> u64 {
    let pos = match layout.kind {
        AttentionKind::Mha => i % layout.num_layers.max(1),
        AttentionKind::Mla => i,
    };
    (start + pos) as u64
}

/// Pairs every prefill buffer (target layers, then drafts when `include_drafts`) with a decode
/// buffer, in prefill buffer order (layer-major: K_0..K_{n-1}, V_0..V_{n-1}, drafts).
pub fn pair_layers(
    src: &KvLayout,
    dst: &KvLayout,
    include_drafts: bool,
) -> Result<Vec<LayerPair>, PlanError> {
    src.validate()?;
    dst.validate()?;
    // The decode's implied first layer: same stage layout ⇒ the prefill's; otherwise its own
    // (0 for a decode that holds every layer).
    let dst_start = if dst.num_layers == src.num_layers && dst.kind == src.kind {
        src.start_layer
    } else {
        dst.start_layer
    };
    let ids = |layout: &KvLayout, start: usize| -> Vec<Option<u64>> {
        if layout.layer_ids.is_empty() {
            (0..layout.buffers.len())
                .map(|i| (i < layout.target_buffers()).then(|| implied_id(layout, start, i)))
                .collect()
        } else {
            layout
                .layer_ids
                .iter()
                .map(|&x| Some(u64::from(x)))
                .collect()
        }
    };
    let src_ids = ids(src, src.start_layer);
    let dst_ids = ids(dst, dst_start);

    let mut by_id: HashMap<(u64, usize), usize> = HashMap::with_capacity(dst.buffers.len());
    let mut seen: HashMap<u64, usize> = HashMap::with_capacity(dst.buffers.len());
    for (j, id) in dst_ids.iter().enumerate() {
        if let Some(id) = *id {
            let occ = seen.entry(id).or_insert(0);
            by_id.insert((id, *occ), j);
            *occ += 1;
        }
    }
    seen.clear();

    let mut pairs = Vec::with_capacity(src.buffers.len());
    let mut src_drafts = Vec::new();
    for (i, id) in src_ids.iter().enumerate() {
        let Some(id) = *id else {
            src_drafts.push(i);
            continue;
        };
        let target = i < src.target_buffers();
        if !target && !include_drafts {
            continue;
        }
        let occ = seen.entry(id).or_insert(0);
        let key = (id, *occ);
        *occ += 1;
        let j = *by_id.get(&key).ok_or(PlanError::LayerNotOnDecode {
            buffer: i,
            layer: id,
        })?;
        pairs.push(LayerPair {
            src_index: i,
            dst_index: j,
            src: src.buffers[i],
            dst: dst.buffers[j],
            target,
        });
    }
    if include_drafts && !src_drafts.is_empty() {
        let dst_drafts: Vec<usize> = (0..dst.buffers.len())
            .filter(|&j| dst_ids[j].is_none())
            .collect();
        if dst_drafts.len() != src_drafts.len() {
            return Err(PlanError::DraftMismatch {
                src: src_drafts.len(),
                dst: dst_drafts.len(),
            });
        }
        for (i, j) in src_drafts.into_iter().zip(dst_drafts) {
            pairs.push(LayerPair {
                src_index: i,
                dst_index: j,
                src: src.buffers[i],
                dst: dst.buffers[j],
                target: false,
            });
        }
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bufs(base: u64, n: usize) -> Vec<Buffer> {
        (0..n)
            .map(|i| Buffer::remote(base + 0x1000 * i as u64, 64))
            .collect()
    }

    fn mha(base: u64, layers: usize) -> KvLayout {
        KvLayout::mha(bufs(base, layers), bufs(base + 0x100_0000, layers), 1)
    }

    #[test]
    fn equal_layers_pair_halves() {
        let p = pair_layers(&mha(0, 3), &mha(1 << 32, 3), true).unwrap();
        let idx: Vec<(usize, usize)> = p.iter().map(|x| (x.src_index, x.dst_index)).collect();
        assert_eq!(idx, vec![(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]);
    }

    #[test]
    fn pp_stage_into_full_decode() {
        // Prefill stage holds layers 2..4 of 6; decode (PP=1) holds all 6.
        let src = mha(0, 2).with_start_layer(2);
        let dst = mha(1 << 32, 6);
        let p = pair_layers(&src, &dst, true).unwrap();
        let idx: Vec<(usize, usize)> = p.iter().map(|x| (x.src_index, x.dst_index)).collect();
        assert_eq!(idx, vec![(0, 2), (1, 3), (2, 8), (3, 9)]);
    }

    #[test]
    fn layer_ids_and_drafts() {
        let src = KvLayout::mla(bufs(0, 3), 1).with_layer_ids(vec![7, 3, 5]);
        let dst = KvLayout::mla(bufs(1 << 32, 3), 1).with_layer_ids(vec![3, 5, 7]);
        let p = pair_layers(&src, &dst, true).unwrap();
        let idx: Vec<usize> = p.iter().map(|x| x.dst_index).collect();
        assert_eq!(idx, vec![2, 0, 1]);
        let missing = KvLayout::mla(bufs(1 << 32, 3), 1).with_layer_ids(vec![3, 5, 8]);
        assert_eq!(
            pair_layers(&src, &missing, true),
            Err(PlanError::LayerNotOnDecode {
                buffer: 0,
                layer: 7
            })
        );
        let src = mha(0, 2).with_drafts(bufs(0x9000_0000, 2));
        let dst = mha(1 << 32, 2).with_drafts(bufs(0xa000_0000, 2));
        let p = pair_layers(&src, &dst, true).unwrap();
        assert_eq!(p.len(), 6);
        assert!(!p[5].target);
        assert_eq!(pair_layers(&src, &dst, false).unwrap().len(), 4);
        assert_eq!(
            pair_layers(&src, &mha(1 << 32, 2), true),
            Err(PlanError::DraftMismatch { src: 2, dst: 0 })
        );
    }
}
