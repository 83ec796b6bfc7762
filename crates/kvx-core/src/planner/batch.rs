//! Coalescing, bounded batches and op validation.
//!
//! [`Coalesce`] merges consecutive ops that continue each other on both sides. [`Batches`] cuts
//! an op stream into batches of at most `max_ops` ops and `max_bytes` bytes; an op larger than
//! `max_bytes` is split into contiguous pieces, which copies exactly the same bytes. A transport
//! posts one batch at a time, so no peer ever sees an unbounded submission. [`validate_ops`]
//! checks arbitrary ops against registered regions.

use std::ops::ControlFlow;

use super::{PlanError, Side};
use crate::TransferOp;

/// Limits for one posted batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchLimits {
    max_ops: usize,
    max_bytes: u64,
}

impl BatchLimits {
    /// At most `max_ops` ops and `max_bytes` bytes per batch; both must be non-zero.
    pub fn new(max_ops: usize, max_bytes: u64) -> Result<Self, PlanError> {
        if max_ops == 0 || max_bytes == 0 {
            return Err(PlanError::ZeroBatchLimit);
        }
        Ok(BatchLimits { max_ops, max_bytes })
    }

    /// Maximum ops per batch.
    pub fn max_ops(&self) -> usize {
        self.max_ops
    }

    /// Maximum bytes per batch.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

impl Default for BatchLimits {
    /// 1024 ops (below the ~2048-entry queue of Mooncake's TCP path) and 256 MiB.
    fn default() -> Self {
        BatchLimits {
            max_ops: 1024,
            max_bytes: 256 << 20,
        }
    }
}

/// Iterator adapter that merges an op into its predecessor when both its source and destination
/// start where the predecessor's end.
#[derive(Clone, Debug)]
pub struct Coalesce<I: Iterator<Item = TransferOp>> {
    inner: I,
    pending: Option<TransferOp>,
}

impl<I: Iterator<Item = TransferOp>> Coalesce<I> {
    /// Wraps an op iterator.
    pub fn new(inner: I) -> Self {
        Coalesce {
            inner,
            pending: None,
        }
    }
}

impl<I: Iterator<Item = TransferOp>> Iterator for Coalesce<I> {
    type Item = TransferOp;

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Merging only shrinks the stream: at least one op if any is left, at most all of them.
        let pending = usize::from(self.pending.is_some());
        let (lower, upper) = self.inner.size_hint();
        let lower = usize::from(pending + lower > 0);
        (lower, upper.and_then(|u| u.checked_add(pending)))
    }

    fn next(&mut self) -> Option<TransferOp> {
        let mut cur = match self.pending.take() {
            Some(op) => op,
            None => self.inner.next()?,
        };
        for op in self.inner.by_ref() {
            let joins = cur.src.checked_add(cur.len) == Some(op.src)
                && cur.dst.checked_add(cur.len) == Some(op.dst);
            if joins && let Some(len) = cur.len.checked_add(op.len) {
                cur.len = len;
            } else {
                self.pending = Some(op);
                break;
            }
        }
        Some(cur)
    }
}

/// Iterator that yields bounded batches of ops.
#[derive(Clone, Debug)]
pub struct Batches<I: Iterator<Item = TransferOp>> {
    inner: I,
    limits: BatchLimits,
    /// Remainder of an op that did not fit in the previous batch.
    carry: Option<TransferOp>,
    /// Ops the stream may still yield at most (before splitting), when known.
    bound: Option<usize>,
}

impl<I: Iterator<Item = TransferOp>> Batches<I> {
    /// Wraps an op iterator.
    pub fn new(inner: I, limits: BatchLimits) -> Self {
        Batches {
            inner,
            limits,
            carry: None,
            bound: None,
        }
    }

    /// Tells the batcher that the stream yields at most `ops` ops (before splitting big ones),
    /// so the last batch is not allocated at the full batch size.
    #[must_use]
    pub fn with_ops_bound(mut self, ops: usize) -> Self {
        self.bound = Some(ops);
        self
    }

    /// Capacity for the next batch: the batch limit, or less when the stream is known to be
    /// shorter, so a batch never grows while it is filled (except by split ops).
    fn capacity(&self) -> usize {
        let (lower, upper) = self.inner.size_hint();
        let left = match (upper, self.bound) {
            (Some(u), Some(b)) => u.min(b),
            (u, b) => u.or(b).unwrap_or(usize::MAX),
        };
        let left = left
            .max(lower)
            .saturating_add(usize::from(self.carry.is_some()));
        self.limits.max_ops.min(left.max(1))
    }
}

impl<I: Iterator<Item = TransferOp>> Iterator for Batches<I> {
    type Item = Vec<TransferOp>;

    fn next(&mut self) -> Option<Vec<TransferOp>> {
        let mut batch = Vec::with_capacity(self.capacity());
        let mut bytes = 0u64;
        let limits = self.limits;
        // The remainder of a split op goes first.
        if let Some(op) = self.carry.take()
            && add(&mut batch, &mut bytes, op, limits, &mut self.carry).is_break()
        {
            return Some(batch);
        }
        // Internal iteration: the op streams (flat maps over parts, runs and buffers) fill a
        // batch several times faster through `try_for_each` than one `next` at a time.
        let Batches {
            inner,
            carry,
            bound,
            ..
        } = self;
        let _ = inner.try_for_each(|op| {
            if let Some(b) = bound.as_mut() {
                *b = b.saturating_sub(1);
            }
            add(&mut batch, &mut bytes, op, limits, carry)
        });
        (!batch.is_empty()).then_some(batch)
    }
}

/// Adds `op` to `batch`; `Break` once the batch is full. An op that does not fit is split: what
/// fits goes in, the contiguous rest waits in `carry` (the same bytes, in the same order).
#[inline]
fn add(
    batch: &mut Vec<TransferOp>,
    bytes: &mut u64,
    op: TransferOp,
    limits: BatchLimits,
    carry: &mut Option<TransferOp>,
) -> ControlFlow<()> {
    if op.len == 0 {
        return ControlFlow::Continue(());
    }
    let room = limits.max_bytes - *bytes;
    if op.len <= room {
        *bytes += op.len;
        batch.push(op);
        if batch.len() == limits.max_ops || *bytes == limits.max_bytes {
            return ControlFlow::Break(());
        }
        return ControlFlow::Continue(());
    }
    if batch.is_empty() || room > 0 {
        batch.push(TransferOp::new(op.src, op.dst, room));
        *carry = Some(TransferOp::new(op.src + room, op.dst + room, op.len - room));
    } else {
        *carry = Some(op);
    }
    ControlFlow::Break(())
}

/// A registered memory region `[addr, addr+len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Region {
    /// Base address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Region {
    /// True when `[addr, addr+len)` lies inside this region (`len > 0`).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr.saturating_add(self.len))
    }
}

/// Why an op failed validation against regions.
fn outside(side: Side, index: usize) -> PlanError {
    PlanError::OutOfBounds {
        side,
        buffer: index,
        end: u64::MAX,
        capacity: 0,
    }
}

/// Checks that every op lies entirely inside one source region and one destination region (and
/// is non-empty). The error names the op's index in `buffer`.
pub fn validate_ops(ops: &[TransferOp], src: &[Region], dst: &[Region]) -> Result<(), PlanError> {
    let sorted = |r: &[Region]| {
        let mut v = r.to_vec();
        v.sort_unstable();
        v
    };
    let (src, dst) = (sorted(src), sorted(dst));
    let inside = |regions: &[Region], addr: u64, len: u64| {
        let i = regions.partition_point(|r| r.addr <= addr);
        // Overlapping regions: any region starting at or before addr may contain the op.
        regions[..i].iter().rev().any(|r| r.contains(addr, len))
    };
    for (i, op) in ops.iter().enumerate() {
        if !inside(&src, op.src, op.len) {
            return Err(outside(Side::Src, i));
        }
        if !inside(&dst, op.dst, op.len) {
            return Err(outside(Side::Dst, i));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn coalesce_merges_neighbours_only() {
        let ops = [
            TransferOp::new(0, 100, 10),
            TransferOp::new(10, 110, 5),
            TransferOp::new(15, 200, 5),
            TransferOp::new(20, 205, 5),
        ];
        let merged: Vec<_> = Coalesce::new(ops.into_iter()).collect();
        assert_eq!(
            merged,
            vec![TransferOp::new(0, 100, 15), TransferOp::new(15, 200, 10)]
        );
    }

    #[test]
    fn batches_respect_limits_and_split_big_ops() {
        let limits = BatchLimits::new(2, 100).unwrap();
        let ops = [
            TransferOp::new(0, 0, 30),
            TransferOp::new(1000, 1000, 250),
            TransferOp::new(5000, 5000, 10),
        ];
        let batches: Vec<_> = Batches::new(ops.into_iter(), limits).collect();
        assert_eq!(
            batches,
            vec![
                vec![TransferOp::new(0, 0, 30), TransferOp::new(1000, 1000, 70)],
                vec![TransferOp::new(1070, 1070, 100)],
                vec![
                    TransferOp::new(1170, 1170, 80),
                    TransferOp::new(5000, 5000, 10)
                ],
            ]
        );
        assert_eq!(BatchLimits::new(0, 1), Err(PlanError::ZeroBatchLimit));
    }

    #[test]
    fn validate_against_regions() {
        let src = [Region { addr: 100, len: 50 }, Region { addr: 0, len: 10 }];
        let dst = [Region {
            addr: 1000,
            len: 100,
        }];
        assert!(validate_ops(&[TransferOp::new(100, 1000, 50)], &src, &dst).is_ok());
        assert!(validate_ops(&[TransferOp::new(5, 1090, 5)], &src, &dst).is_ok());
        assert!(validate_ops(&[TransferOp::new(5, 1090, 11)], &src, &dst).is_err());
        assert!(validate_ops(&[TransferOp::new(99, 1000, 2)], &src, &dst).is_err());
        assert!(validate_ops(&[TransferOp::new(100, 1000, 0)], &src, &dst).is_err());
        assert!(validate_ops(&[TransferOp::new(u64::MAX, 1000, 1)], &src, &dst).is_err());
    }

    /// Expands ops to (src byte, dst byte) pairs.
    fn bytes(ops: &[TransferOp]) -> Vec<(u64, u64)> {
        ops.iter()
            .flat_map(|o| (0..o.len).map(move |k| (o.src + k, o.dst + k)))
            .collect()
    }

    proptest! {
        #[test]
        fn batching_and_coalescing_copy_the_same_bytes(
            raw in proptest::collection::vec((0u64..64, 0u64..64, 0u64..40), 0..40),
            max_ops in 1usize..6,
            max_bytes in 1u64..64,
        ) {
            let ops: Vec<TransferOp> = raw.iter().map(|&(s, d, l)| TransferOp::new(s * 8, d * 8, l)).collect();
            let coalesced: Vec<_> = Coalesce::new(ops.iter().copied()).collect();
            prop_assert_eq!(bytes(&coalesced), bytes(&ops));
            let limits = BatchLimits::new(max_ops, max_bytes).unwrap();
            let batches: Vec<Vec<TransferOp>> = Batches::new(ops.iter().copied(), limits).collect();
            for b in &batches {
                prop_assert!(!b.is_empty() && b.len() <= max_ops);
                prop_assert!(TransferOp::total_bytes(b) <= max_bytes);
            }
            let flat: Vec<TransferOp> = batches.into_iter().flatten().collect();
            prop_assert_eq!(bytes(&flat), bytes(&ops));
        }
    }
}
