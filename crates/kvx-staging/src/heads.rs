//! Heterogeneous attention-TP geometry: which KV heads a prefill rank sends to which decode
//! rank, and how the staged writers of a chunk are laid out in the decode's ring region. The
//! head arithmetic is spec §5.4's (the same as `kvx_core::planner::HeadSliceParams`, whose
//! per-token plan is the baseline staging must reproduce byte for byte).
//!
//! Notation (spec §5.4): `T` total KV heads, `Pt`/`Dt` prefill/decode attention-TP sizes,
//! `hs = max(1, T/Pt)` heads per prefill rank, `hd = max(1, T/Dt)` heads per decode rank, `bph`
//! bytes of one head of one token. KV buffers are listed as sglang's MHA pool lists them:
//! `[K layer0 … K layer(L-1), V layer0 … V layer(L-1)]`, each page `item_len` bytes, token-major
//! (`page_size` slots of `item_len / page_size` bytes, heads inside a slot).

use kvx_core::TransferOp;

use crate::ring::Placement;

/// Why a TP geometry is invalid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    /// A size was zero or the TP sizes do not divide each other.
    #[error("invalid TP geometry: {0}")]
    Invalid(&'static str),
}

/// Attention-TP sizes of both sides and the model's KV head count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpGeometry {
    /// Total KV heads of the model (`T`).
    pub total_kv_heads: u32,
    /// Prefill attention-TP size (`Pt`).
    pub prefill_tp: u32,
    /// Decode attention-TP size (`Dt`).
    pub decode_tp: u32,
}

/// Which heads one prefill rank sends to one decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadSlice {
    /// First head in the prefill rank's local heads.
    pub src_head: u32,
    /// First head in the decode rank's local heads.
    pub dst_head: u32,
    /// Number of heads.
    pub n_heads: u32,
}

impl TpGeometry {
    /// A geometry; all sizes non-zero and the larger TP a multiple of the smaller.
    pub fn new(
        total_kv_heads: u32,
        prefill_tp: u32,
        decode_tp: u32,
    ) -> Result<Self, GeometryError> {
        if total_kv_heads == 0 || prefill_tp == 0 || decode_tp == 0 {
            return Err(GeometryError::Invalid("zero heads or TP size"));
        }
        if !prefill_tp
            .max(decode_tp)
            .is_multiple_of(prefill_tp.min(decode_tp))
        {
            return Err(GeometryError::Invalid("TP sizes do not divide"));
        }
        Ok(TpGeometry {
            total_kv_heads,
            prefill_tp,
            decode_tp,
        })
    }

    /// Heads held by one prefill rank (`hs`).
    pub fn prefill_heads(&self) -> u32 {
        (self.total_kv_heads / self.prefill_tp).max(1)
    }

    /// Heads held by one decode rank (`hd`).
    pub fn decode_heads(&self) -> u32 {
        (self.total_kv_heads / self.decode_tp).max(1)
    }

    /// Bytes of one head of one token, from the decode's KV item length (registration frame 9):
    /// `dst_kv_item_len / page_size / hd`; `None` when that is 0.
    pub fn bytes_per_head_token(&self, dst_kv_item_len: u64, page_size: u64) -> Option<u64> {
        let bph = dst_kv_item_len
            .checked_div(page_size)?
            .checked_div(u64::from(self.decode_heads()))?;
        (bph > 0).then_some(bph)
    }

    /// Staged writers per chunk: `Pt/Dt` when `Pt > Dt`, else 1.
    pub fn num_writers(&self) -> u32 {
        if self.prefill_tp > self.decode_tp {
            self.prefill_tp / self.decode_tp
        } else {
            1
        }
    }

    /// A prefill rank's writer index within its decode rank's chunk region.
    pub fn writer_index(&self, prefill_rank: u32) -> u32 {
        (prefill_rank % self.prefill_tp) % self.num_writers()
    }

    /// The spec §5.4 slice a prefill rank sends to a decode rank.
    pub fn slice(&self, prefill_rank: u32, decode_rank: u32) -> HeadSlice {
        let t = self.total_kv_heads;
        let (pt, dt) = (self.prefill_tp, self.decode_tp);
        let (hs, hd) = (self.prefill_heads(), self.decode_heads());
        let lr = prefill_rank % pt;
        let dr = decode_rank % dt;
        if pt > dt {
            HeadSlice {
                src_head: 0,
                dst_head: ((lr / (pt / t).max(1)) * hs) % hd,
                n_heads: hs,
            }
        } else {
            HeadSlice {
                src_head: ((dr / (dt / t).max(1)) * hd) % hs,
                dst_head: 0,
                n_heads: hd,
            }
        }
    }

    /// The prefill ranks that write to a decode rank, in writer-index order (spec §4.3).
    pub fn prefill_sources(&self, decode_rank: u32) -> Vec<u32> {
        let dr = decode_rank % self.decode_tp;
        if self.prefill_tp > self.decode_tp {
            let k = self.prefill_tp / self.decode_tp;
            (dr * k..(dr + 1) * k).collect()
        } else {
            vec![dr / (self.decode_tp / self.prefill_tp)]
        }
    }

    /// The decode ranks a prefill rank writes to.
    pub fn decode_targets(&self, prefill_rank: u32) -> Vec<u32> {
        let lr = prefill_rank % self.prefill_tp;
        if self.prefill_tp > self.decode_tp {
            vec![lr / (self.prefill_tp / self.decode_tp)]
        } else {
            let k = self.decode_tp / self.prefill_tp;
            (lr * k..(lr + 1) * k).collect()
        }
    }
}

/// One writer's share of a staged chunk region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Writer {
    /// The writing prefill rank.
    pub prefill_rank: u32,
    /// Heads it writes.
    pub heads: u32,
    /// Where they go among the decode rank's heads.
    pub dst_head: u32,
}

/// How a decode rank's staged chunk region is laid out: one block per writer, back to back in
/// writer-index order; each block `[K layer0 | … | K layer(L-1) | V layer0 | …]`, each layer
/// `tokens × heads × bph` bytes, token-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedLayout {
    /// KV layers `L` (the block holds `2L` layer slices).
    pub layers: u32,
    /// Bytes of one head of one token (`bph`).
    pub bytes_per_head_token: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Writers in writer-index order.
    pub writers: Vec<Writer>,
    /// Prefill pipeline stages writing into each writer's block (`Ppp / Dpp`; 1 without PP).
    /// Stage writes cover its layers' K and V slices of the block, so a chunk is complete once
    /// `writers × pp_writers` reports arrived.
    pub pp_writers: u32,
}

impl StagedLayout {
    /// The layout of `decode_rank`'s chunks under `geom`.
    pub fn for_decode(
        geom: &TpGeometry,
        decode_rank: u32,
        layers: u32,
        bytes_per_head_token: u64,
        page_size: u64,
    ) -> Self {
        let writers = geom
            .prefill_sources(decode_rank)
            .into_iter()
            .map(|pr| {
                let s = geom.slice(pr, decode_rank);
                Writer {
                    prefill_rank: pr,
                    heads: s.n_heads,
                    dst_head: s.dst_head,
                }
            })
            .collect();
        StagedLayout {
            layers,
            bytes_per_head_token,
            page_size,
            writers,
            pp_writers: 1,
        }
    }

    /// The same layout written by `pp_writers` prefill pipeline stages per writer (decode PP 1,
    /// prefill PP `pp_writers`).
    #[must_use]
    pub fn with_pp_writers(mut self, pp_writers: u32) -> Self {
        self.pp_writers = pp_writers.max(1);
        self
    }

    /// `CHUNK_READY` reports that complete a chunk: `writers × pp_writers`.
    pub fn reports_per_chunk(&self) -> usize {
        self.writers.len() * self.pp_writers as usize
    }

    /// Bytes of one layer's K (or V) slice of writer `w`'s block for `pages` pages.
    pub fn layer_bytes(&self, w: usize, pages: u64) -> u64 {
        self.writer_bytes(w, pages) / (2 * u64::from(self.layers)).max(1)
    }

    /// The two writes of a pipeline stage holding layers `first..first + n` (global ids) of
    /// writer `w`'s block: its gathered block at `src` is `[K first.. | V first..]` (what
    /// [`crate::gather`] produces from the stage's `2n` buffers); the K part goes to the K slots
    /// of those layers, the V part to their V slots. `None` when the layers or the block do not
    /// fit the placement or the ring.
    #[allow(clippy::too_many_arguments)]
    pub fn stage_write_ops(
        &self,
        w: usize,
        pages: u64,
        placement: &Placement,
        ring: (u64, u64),
        src: u64,
        first: u32,
        n: u32,
    ) -> Option<[TransferOp; 2]> {
        let (ring_base, ring_size) = ring;
        if w >= self.writers.len() || first.checked_add(n)? > self.layers {
            return None;
        }
        let lb = self.layer_bytes(w, pages);
        let block = placement.offset.checked_add(self.writer_offset(w, pages))?;
        let len = lb.checked_mul(u64::from(n))?;
        let k = block.checked_add(lb.checked_mul(u64::from(first))?)?;
        let v = block.checked_add(lb.checked_mul(u64::from(self.layers) + u64::from(first))?)?;
        let v_end = v.checked_add(len)?;
        if v_end > placement.end || v_end > ring_size {
            return None;
        }
        Some([
            TransferOp::new(src, ring_base.checked_add(k)?, len),
            TransferOp::new(src.checked_add(len)?, ring_base.checked_add(v)?, len),
        ])
    }

    /// Bytes writer `w` stages for a chunk of `pages` pages (0 for an unknown writer).
    pub fn writer_bytes(&self, w: usize, pages: u64) -> u64 {
        self.writers.get(w).map_or(0, |wr| {
            pages
                .saturating_mul(self.page_size)
                .saturating_mul(u64::from(wr.heads))
                .saturating_mul(self.bytes_per_head_token)
                .saturating_mul(2 * u64::from(self.layers))
        })
    }

    /// Byte offset of writer `w`'s block: Σ bytes of writers with a lower index.
    pub fn writer_offset(&self, w: usize, pages: u64) -> u64 {
        (0..w.min(self.writers.len()))
            .map(|i| self.writer_bytes(i, pages))
            .fold(0u64, u64::saturating_add)
    }

    /// The single write of writer `w`'s gathered block (at local address `src`) for a chunk of
    /// `pages` pages placed at `placement` in a ring of `ring_size` bytes at `ring_base`:
    /// `ring_base + offset + writer_offset`. `None` when the block would leave its placement or
    /// the ring (a placement that does not match this layout).
    pub fn write_op(
        &self,
        w: usize,
        pages: u64,
        placement: &Placement,
        ring_base: u64,
        ring_size: u64,
        src: u64,
    ) -> Option<TransferOp> {
        let len = self.writer_bytes(w, pages);
        let off = placement.offset.checked_add(self.writer_offset(w, pages))?;
        let end = off.checked_add(len)?;
        if w >= self.writers.len() || end > placement.end || end > ring_size {
            return None;
        }
        Some(TransferOp::new(src, ring_base.checked_add(off)?, len))
    }

    /// Bytes of the whole chunk region (all writers).
    pub fn chunk_bytes(&self, pages: u64) -> u64 {
        self.writer_offset(self.writers.len(), pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_many_to_one_and_one_to_many() {
        // 8 heads, TP2 -> TP1: each prefill rank sends its 4 heads to offsets 0 and 4.
        let g = TpGeometry::new(8, 2, 1).unwrap();
        assert_eq!(g.num_writers(), 2);
        assert_eq!(
            g.slice(1, 0),
            HeadSlice {
                src_head: 0,
                dst_head: 4,
                n_heads: 4
            }
        );
        assert_eq!(g.prefill_sources(0), vec![0, 1]);
        // 8 heads, TP1 -> TP2: rank 0 sends heads 4..8 to decode rank 1.
        let g = TpGeometry::new(8, 1, 2).unwrap();
        assert_eq!(
            g.slice(0, 1),
            HeadSlice {
                src_head: 4,
                dst_head: 0,
                n_heads: 4
            }
        );
        assert_eq!(g.decode_targets(0), vec![0, 1]);
        // GQA replication: 2 heads on TP4 -> TP1; ranks 0,1 hold head 0, ranks 2,3 head 1.
        let g = TpGeometry::new(2, 4, 1).unwrap();
        assert_eq!(g.slice(3, 0).dst_head, 1);
        assert_eq!(g.slice(1, 0).dst_head, 0);
        assert!(TpGeometry::new(8, 3, 2).is_err());
    }

    #[test]
    fn layout_offsets() {
        let g = TpGeometry::new(8, 2, 1).unwrap();
        let l = StagedLayout::for_decode(&g, 0, 3, 256, 16);
        assert_eq!(l.writer_bytes(0, 2), 2 * 16 * 4 * 256 * 6);
        assert_eq!(l.writer_offset(1, 2), l.writer_bytes(0, 2));
        assert_eq!(l.chunk_bytes(2), 2 * l.writer_bytes(0, 2));
        let wb = l.writer_bytes(0, 2);
        let p = Placement {
            offset: 100,
            round: 0,
            end: 100 + 2 * wb,
        };
        assert_eq!(
            l.write_op(1, 2, &p, 1 << 20, 1 << 30, 7),
            Some(TransferOp::new(7, (1 << 20) + 100 + wb, wb))
        );
        assert_eq!(l.write_op(2, 2, &p, 1 << 20, 1 << 30, 7), None);
        assert_eq!(l.write_op(1, 3, &p, 1 << 20, 1 << 30, 7), None);
        assert_eq!(l.write_op(1, 2, &p, 1 << 20, 100 + wb, 7), None);
        // Pipeline stage holding layer 1 of 3: K slot 1 and V slot 4 of writer 1's block.
        let lb = l.layer_bytes(1, 2);
        assert_eq!(lb * 6, wb);
        let [k, v] = l
            .stage_write_ops(1, 2, &p, (1 << 20, 1 << 30), 7, 1, 1)
            .unwrap();
        assert_eq!(k, TransferOp::new(7, (1 << 20) + 100 + wb + lb, lb));
        assert_eq!(
            v,
            TransferOp::new(7 + lb, (1 << 20) + 100 + wb + 4 * lb, lb)
        );
        assert_eq!(
            l.stage_write_ops(1, 2, &p, (1 << 20, 1 << 30), 7, 2, 2),
            None
        );
        // A layer count near u32::MAX: the V slot index (layers + first) leaves u32 and must
        // not wrap; the block is far larger than the placement, so nothing is written.
        let huge = StagedLayout::for_decode(&g, 0, u32::MAX, 256, 16);
        assert_eq!(
            huge.stage_write_ops(0, 2, &p, (1 << 20, 1 << 30), 7, u32::MAX - 1, 1),
            None
        );
        // 8 heads on decode TP 1, page 16: item 16 * 8 * 256.
        assert_eq!(g.bytes_per_head_token(16 * 8 * 256, 16), Some(256));
        assert_eq!(g.bytes_per_head_token(16, 0), None);
    }
}
