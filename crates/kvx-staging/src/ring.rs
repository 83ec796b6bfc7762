//! The decode-side staging ring: sglang's overcommitting allocator and the watermark it yields.
//!
//! `assign` never waits: if a request does not fit between `head` and the end of the ring, the
//! ring wraps (`round += 1`, offset 0) even though older allocations may still be live there.
//! Overlap safety is enforced by the *writer*: a prefill writes an allocation of round `r` only
//! once the decode's [`Watermark`] says the bytes it covers in round `r - 1` are free
//! ([`Watermark::admits`]). `free` returns the new watermark: the `(round, offset)` of the oldest
//! live allocation, or the ring's restart point when nothing is live.
//!
//! Difference from sglang (its "empty ring never reusable" bug, spec §6/§8 item 8): when the last
//! live allocation is freed the ring restarts at offset 0 of a fresh round and the watermark says
//! so, so the next allocation is admitted at once whatever its size. sglang keeps `head` where it
//! was and can wrap into a round whose readiness needs a free that never comes.

use std::collections::{BTreeMap, VecDeque};

/// Identifies one live allocation of a [`StagingRing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocId(u64);

impl AllocId {
    /// The id as an integer (allocation sequence number).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Where an allocation lies: bytes `[offset, end)` of the ring in round `round`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Placement {
    /// First byte in the ring.
    pub offset: u64,
    /// Wrap count of the ring when the allocation was made.
    pub round: u64,
    /// One past the last byte.
    pub end: u64,
}

impl Placement {
    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.end - self.offset
    }

    /// True for a zero-byte allocation.
    pub fn is_empty(&self) -> bool {
        self.end == self.offset
    }

    /// True when the two byte ranges intersect (rounds are ignored: the ring reuses bytes).
    pub fn overlaps(&self, other: &Placement) -> bool {
        self.offset < other.end && other.offset < self.end
    }
}

/// "Every byte before `tail` in round `round`, and everything of older rounds, is free."
///
/// Ordered lexicographically on `(round, tail)`; the prefill keeps the maximum it has seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Watermark {
    /// Ring round.
    pub round: u64,
    /// Byte offset within that round.
    pub tail: u64,
}

impl Watermark {
    /// A watermark from the wire's `(round, tail)`; `None` for a negative round, which no decode
    /// sends.
    pub fn from_wire(round: i64, tail: u64) -> Option<Self> {
        Some(Watermark {
            round: u64::try_from(round).ok()?,
            tail,
        })
    }

    /// sglang's readiness rule (spec §6): an allocation of round 0 is always writable; one of
    /// round `r > 0` ending at `e` is writable iff `r - 1 < round`, or `r - 1 == round` and
    /// `e <= tail`.
    pub fn admits(&self, p: &Placement) -> bool {
        match p.round.checked_sub(1) {
            None => true,
            Some(prev) => (prev, p.end) <= (self.round, self.tail),
        }
    }
}

/// Why an allocation was refused: it is larger than the whole ring (wire `ALLOC_OVERSIZED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("staging request of {required} bytes exceeds the ring size {total}")]
pub struct Oversized {
    /// Requested bytes.
    pub required: u64,
    /// Ring size.
    pub total: u64,
}

/// The decode's staging ring allocator (no memory, only offsets).
#[derive(Clone, Debug)]
pub struct StagingRing {
    total: u64,
    head: u64,
    round: u64,
    next_id: u64,
    live: BTreeMap<AllocId, Placement>,
    order: VecDeque<AllocId>,
    watermark: Watermark,
}

impl StagingRing {
    /// An empty ring of `total` bytes, at round 0, offset 0.
    pub fn new(total: u64) -> Self {
        StagingRing {
            total,
            head: 0,
            round: 0,
            next_id: 0,
            live: BTreeMap::new(),
            order: VecDeque::new(),
            watermark: Watermark::default(),
        }
    }

    /// Ring size in bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Reserves `required` bytes with overcommit semantics (never blocks, may overlap live
    /// allocations of the previous round; the watermark protects them).
    pub fn assign(&mut self, required: u64) -> Result<(AllocId, Placement), Oversized> {
        if required > self.total {
            return Err(Oversized {
                required,
                total: self.total,
            });
        }
        let placement = if self.total - self.head >= required {
            let p = Placement {
                offset: self.head,
                round: self.round,
                end: self.head + required,
            };
            self.head += required;
            p
        } else {
            self.round += 1;
            self.head = required;
            Placement {
                offset: 0,
                round: self.round,
                end: required,
            }
        };
        let id = AllocId(self.next_id);
        self.next_id += 1;
        self.live.insert(id, placement);
        self.order.push_back(id);
        Ok((id, placement))
    }

    /// Frees an allocation and returns the watermark after it; `None` for an id that is not
    /// live (already freed or never assigned), which changes nothing.
    pub fn free(&mut self, id: AllocId) -> Option<Watermark> {
        self.live.remove(&id)?;
        while let Some(front) = self.order.front() {
            if self.live.contains_key(front) {
                break;
            }
            self.order.pop_front();
        }
        let next = match self.order.front().and_then(|id| self.live.get(id)) {
            Some(oldest) => Watermark {
                round: oldest.round,
                tail: oldest.offset,
            },
            None => {
                // Nothing live: restart at offset 0 of a fresh round, and say so.
                if self.head != 0 {
                    self.round += 1;
                    self.head = 0;
                }
                Watermark {
                    round: self.round,
                    tail: 0,
                }
            }
        };
        self.watermark = self.watermark.max(next);
        Some(self.watermark)
    }

    /// The current watermark (what a new subscriber must be told).
    pub fn watermark(&self) -> Watermark {
        self.watermark
    }

    /// The placement of a live allocation.
    pub fn placement(&self, id: AllocId) -> Option<Placement> {
        self.live.get(&id).copied()
    }

    /// Number of live allocations.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Live allocations, oldest first.
    pub fn live(&self) -> impl Iterator<Item = (AllocId, Placement)> + '_ {
        self.live.iter().map(|(id, p)| (*id, *p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assign_wraps_with_overcommit() {
        let mut ring = StagingRing::new(100);
        let (a, pa) = ring.assign(60).unwrap();
        assert_eq!((pa.offset, pa.round, pa.end), (0, 0, 60));
        let (_b, pb) = ring.assign(40).unwrap();
        assert_eq!((pb.offset, pb.round, pb.end), (60, 0, 100));
        // Does not fit before the end: wraps although `a` is still live.
        let (_c, pc) = ring.assign(30).unwrap();
        assert_eq!((pc.offset, pc.round, pc.end), (0, 1, 30));
        assert!(!ring.watermark().admits(&pc));
        assert_eq!(ring.free(a), Some(Watermark { round: 0, tail: 60 }));
        assert!(ring.watermark().admits(&pc));
        assert_eq!(ring.free(a), None);
        assert_eq!(
            ring.assign(101),
            Err(Oversized {
                required: 101,
                total: 100
            })
        );
    }

    #[test]
    fn watermark_from_wire() {
        assert_eq!(
            Watermark::from_wire(3, 16),
            Some(Watermark { round: 3, tail: 16 })
        );
        assert_eq!(Watermark::from_wire(-1, 0), None);
    }

    #[test]
    fn empty_ring_restarts_at_zero() {
        let mut ring = StagingRing::new(100);
        let (a, _) = ring.assign(70).unwrap();
        let wm = ring.free(a).unwrap();
        assert_eq!(wm, Watermark { round: 1, tail: 0 });
        // sglang would wrap this to round 1 needing tail >= 90 in round 0: a stall forever.
        let (_b, pb) = ring.assign(90).unwrap();
        assert_eq!((pb.offset, pb.round), (0, 1));
        assert!(wm.admits(&pb));
    }

    #[test]
    fn out_of_order_free_keeps_watermark_at_oldest() {
        let mut ring = StagingRing::new(100);
        let (a, _) = ring.assign(10).unwrap();
        let (b, _) = ring.assign(10).unwrap();
        let (c, _) = ring.assign(10).unwrap();
        assert_eq!(ring.free(b), Some(Watermark::default()));
        assert_eq!(ring.free(a), Some(Watermark { round: 0, tail: 20 }));
        assert_eq!(ring.free(c), Some(Watermark { round: 1, tail: 0 }));
        assert_eq!(ring.live_count(), 0);
    }
}
