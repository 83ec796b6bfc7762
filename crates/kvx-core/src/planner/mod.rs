//! The transfer planner: turns page lists and layouts into `(src, dst, len)` write ops.
//!
//! Plans are compact: a paged plan stores the merged page runs once plus one entry per buffer
//! pair, and generates ops lazily, so planning costs memory proportional to runs, not pages. Op
//! order is sglang's: layer-major (all runs of `K_0`, then `K_1`, …, then `V_0`, …). Every plan is
//! validated when it is built — pages non-negative and in range, every op inside its source and
//! destination buffers, no address arithmetic that wraps — so anything a plan yields is safe to
//! hand to a transport (which still checks registered regions before forming a pointer).
//!
//! Submodules: [`runs`] (contiguous-run merge), [`pairing`] (layer pairing, PP slicing),
//! [`paged`] (equal-TP / MLA plan), [`slice`](mod@slice) (heterogeneous-TP head slices), [`aux`] (aux rows and
//! state components), [`batch`] (coalescing, bounded batches, op validation).

pub mod aux;
pub mod batch;
pub mod paged;
pub mod pairing;
pub mod runs;
pub mod slice;
#[cfg(test)]
mod tests;

use crate::TransferOp;
use crate::layout::LayoutError;

pub use aux::{plan_aux, plan_state};
pub use batch::{BatchLimits, Batches, Coalesce, Region, validate_ops};
pub use paged::{PagedPlan, plan_kv_equal};
pub use pairing::{LayerPair, pair_layers};
pub use runs::{Run, merge_runs};
pub use slice::{HeadSliceParams, HeadSlicePlan, plan_kv_head_slice};

/// Which side of a transfer a value belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The local (prefill, source) side.
    Src,
    /// The remote (decode, destination) side.
    Dst,
}

/// Why a plan could not be built. Every variant is a per-room error: the room fails, the engine
/// keeps running.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A layout is inconsistent.
    #[error("invalid layout: {0}")]
    Layout(#[from] LayoutError),
    /// A page (or slot) index is negative.
    #[error("{side:?} page index {value} at position {index} is negative")]
    NegativePage {
        /// Which list.
        side: Side,
        /// Position in the list.
        index: usize,
        /// The value.
        value: i32,
    },
    /// Source and destination index lists differ in length where they must match.
    #[error("index lists differ in length: {src} source vs {dst} destination")]
    LengthMismatch {
        /// Source entries.
        src: usize,
        /// Destination entries.
        dst: usize,
    },
    /// An op would reach past the end of a buffer (or wrap the address space).
    #[error("{side:?} buffer {buffer}: access up to byte {end} exceeds its {capacity} bytes")]
    OutOfBounds {
        /// Which side.
        side: Side,
        /// Buffer index in its layout.
        buffer: usize,
        /// One past the last byte accessed, relative to the buffer base.
        end: u64,
        /// The buffer's length (u64::MAX when the address space itself was exceeded).
        capacity: u64,
    },
    /// A source buffer's layer has no counterpart on the decode.
    #[error("source buffer {buffer} (layer {layer}) has no matching decode buffer")]
    LayerNotOnDecode {
        /// Source buffer index.
        buffer: usize,
        /// Its global layer id.
        layer: u64,
    },
    /// Draft-model buffer counts differ and cannot be paired.
    #[error("prefill has {src} draft buffers, decode {dst}")]
    DraftMismatch {
        /// Source drafts.
        src: usize,
        /// Destination drafts.
        dst: usize,
    },
    /// The head-slice configuration is impossible (zero sizes, item lengths not divisible).
    #[error("invalid head-slice configuration: {0}")]
    HeadSliceConfig(&'static str),
    /// The head-slice guard (`n_heads·bytes_per_head <= token bytes`) failed.
    #[error("head slice of {need} bytes per token does not fit in {have} bytes")]
    HeadSliceGuard {
        /// Bytes the slice needs per token.
        need: u64,
        /// Bytes available per token on the tighter side.
        have: u64,
    },
    /// Aux buffer counts differ between prefill and decode.
    #[error("prefill has {src} aux buffers, decode {dst}")]
    AuxCount {
        /// Source buffers.
        src: usize,
        /// Destination buffers.
        dst: usize,
    },
    /// A slot-indexed state component needs exactly one index per side.
    #[error("slot state needs one index per side, got {src} and {dst}")]
    StateSlotCount {
        /// Source indices.
        src: usize,
        /// Destination indices.
        dst: usize,
    },
    /// State component entries cannot be paired.
    #[error("state entries cannot be paired: {src} source vs {dst} destination buffers")]
    StateEntryMismatch {
        /// Source buffers.
        src: usize,
        /// Destination buffers.
        dst: usize,
    },
    /// Batch limits of zero.
    #[error("batch limits must be non-zero")]
    ZeroBatchLimit,
}

/// Checks that `base + offset + len` stays inside a buffer of `capacity` bytes (when known) and
/// inside the address space; returns the absolute address of `base + offset`.
pub(crate) fn check_span(
    side: Side,
    buffer: usize,
    base: u64,
    capacity: Option<u64>,
    offset: u64,
    len: u64,
) -> Result<u64, PlanError> {
    let oob = |end: u64, capacity: u64| PlanError::OutOfBounds {
        side,
        buffer,
        end,
        capacity,
    };
    let end = offset.checked_add(len).ok_or(oob(u64::MAX, u64::MAX))?;
    if let Some(cap) = capacity.filter(|&cap| end > cap) {
        return Err(oob(end, cap));
    }
    base.checked_add(end).ok_or(oob(end, u64::MAX))?;
    Ok(base + offset)
}

/// Converts page (or slot) indices to u64, rejecting negative ones.
pub(crate) fn nonneg(side: Side, index: usize, value: i32) -> Result<u64, PlanError> {
    u64::try_from(value).map_err(|_| PlanError::NegativePage { side, index, value })
}

/// One part of a room's plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanPart {
    /// Merged page runs × buffer pairs (equal-TP / MLA KV, page-indexed state).
    Paged(PagedPlan),
    /// Per-token head slices (heterogeneous TP).
    HeadSlice(HeadSlicePlan),
    /// Explicit ops (aux rows, slot state).
    Ops(Vec<TransferOp>),
}

impl PlanPart {
    /// Number of ops this part yields before coalescing (an upper bound for head slices).
    pub fn num_ops(&self) -> u64 {
        match self {
            PlanPart::Paged(p) => p.num_ops(),
            PlanPart::HeadSlice(p) => p.num_ops(),
            PlanPart::Ops(v) => v.len() as u64,
        }
    }

    /// Total bytes this part copies.
    pub fn total_bytes(&self) -> u64 {
        match self {
            PlanPart::Paged(p) => p.total_bytes(),
            PlanPart::HeadSlice(p) => p.total_bytes(),
            PlanPart::Ops(v) => TransferOp::total_bytes(v),
        }
    }

    /// The ops, in order.
    pub fn ops(&self) -> PartOps<'_> {
        match self {
            PlanPart::Paged(p) => PartOps::Paged(p.ops()),
            // Neighbouring slices touch only when a slice is a whole token on both sides.
            PlanPart::HeadSlice(p) if p.may_coalesce() => {
                PartOps::HeadSlice(Coalesce::new(p.ops()))
            }
            PlanPart::HeadSlice(p) => PartOps::HeadSliceApart(p.ops()),
            PlanPart::Ops(v) => PartOps::Ops(v.iter()),
        }
    }
}

/// Iterator over one [`PlanPart`]'s ops.
pub enum PartOps<'a> {
    /// A paged part.
    Paged(paged::PagedOps<'a>),
    /// A head-slice part, coalesced (neighbouring token slices merge when they touch).
    HeadSlice(Coalesce<slice::HeadSliceOps<'a>>),
    /// A head-slice part whose slices never touch (no coalescing to try).
    HeadSliceApart(slice::HeadSliceOps<'a>),
    /// Explicit ops.
    Ops(std::slice::Iter<'a, TransferOp>),
}

impl Iterator for PartOps<'_> {
    type Item = TransferOp;

    #[inline]
    fn next(&mut self) -> Option<TransferOp> {
        match self {
            PartOps::Paged(it) => it.next(),
            PartOps::HeadSlice(it) => it.next(),
            PartOps::HeadSliceApart(it) => it.next(),
            PartOps::Ops(it) => it.next().copied(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            PartOps::Paged(it) => it.size_hint(),
            PartOps::HeadSlice(it) => it.size_hint(),
            PartOps::HeadSliceApart(it) => it.size_hint(),
            PartOps::Ops(it) => it.size_hint(),
        }
    }
}

/// A validated plan: parts in the order they must be written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The parts, in order.
    pub parts: Vec<PlanPart>,
}

impl Plan {
    /// An empty plan.
    pub fn new() -> Self {
        Plan::default()
    }

    /// Appends a part (empty parts are dropped).
    pub fn push(&mut self, part: PlanPart) {
        if part.num_ops() > 0 {
            self.parts.push(part);
        }
    }

    /// Number of ops before coalescing (an upper bound on what [`Plan::ops`] yields).
    pub fn num_ops(&self) -> u64 {
        self.parts.iter().map(PlanPart::num_ops).sum()
    }

    /// Total bytes.
    pub fn total_bytes(&self) -> u64 {
        self.parts.iter().map(PlanPart::total_bytes).sum()
    }

    /// True when the plan writes nothing.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Every op, in order.
    pub fn ops(&self) -> impl Iterator<Item = TransferOp> + '_ {
        self.parts.iter().flat_map(PlanPart::ops)
    }

    /// The ops split into bounded batches. Paged parts are already merged into runs and
    /// head-slice parts come out coalesced, so no op stream is scanned twice; each batch is
    /// allocated once, at its final size (the plan's op count bounds the last one).
    pub fn batches(&self, limits: BatchLimits) -> Batches<impl Iterator<Item = TransferOp> + '_> {
        let bound = usize::try_from(self.num_ops()).unwrap_or(usize::MAX);
        Batches::new(self.ops(), limits).with_ops_bound(bound)
    }
}
