//! The prefill side of staging as a deterministic state machine: which chunks were requested
//! (prefetch), where the decode placed them, each decode session's watermark, and a scheduler
//! that parks a chunk that may not be written yet and wakes it when the event that unblocks it
//! arrives.
//!
//! sglang re-enqueues a blocked chunk at the tail of its transfer queue after a 1 ms wait, over
//! and over; here [`PrefillStaging::poll`] answers [`Readiness::Wait`] once and the chunk comes
//! back as a [`Wake`] from [`PrefillStaging::on_staging_rsp`] or
//! [`PrefillStaging::on_watermark`] exactly when it becomes writable. Waiting chunks are indexed
//! by the watermark they need, so a watermark wakes only what it admits.
//! [`PrefillStaging::conclude_room`] purges every key of a room (requested, placed, parked).

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::{Room, SessionId};

use crate::grid::RoomGrid;
use crate::msg::{ChunkKey, RspPlacement, StagingReq, StagingRsp, WatermarkMsg};
use crate::ring::{Placement, Watermark};

/// Whether a staged chunk may be written now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Write it at this placement.
    Ready(Placement),
    /// Not yet (no placement, or the watermark does not admit it); it will come back as a
    /// [`Wake`].
    Wait,
    /// The decode answered `ALLOC_OVERSIZED`: fail the room.
    Oversized,
}

/// A parked chunk that became writable (or learnt it never will be).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wake {
    /// The chunk.
    pub key: ChunkKey,
    /// [`Readiness::Ready`] or [`Readiness::Oversized`].
    pub readiness: Readiness,
}

/// Why a prefill-side staging event was refused (logged, counted and dropped by the driver).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrefillError {
    /// A `STAGING_RSP` for a room this rank has not prefetched (concluded, or not yet known;
    /// this rank's own request will be answered again).
    #[error("STAGING_RSP for room {0}, which this rank is not staging")]
    UnknownRoom(Room),
    /// A second `STAGING_RSP` for a chunk with a different placement.
    #[error("conflicting STAGING_RSP for room {} chunk {}", .0.room, .0.chunk_idx)]
    Conflict(ChunkKey),
    /// A chunk index does not fit the wire's integer.
    #[error("room {0} has more chunks than fit in u32")]
    TooManyChunks(Room),
}

impl PrefillError {
    /// A short stable label for metrics and logs (one per variant; a variant added later gets
    /// its own label, so drivers need not match on the variants).
    pub fn kind(&self) -> &'static str {
        match self {
            PrefillError::UnknownRoom(_) => "unknown_room",
            PrefillError::Conflict(_) => "conflict",
            PrefillError::TooManyChunks(_) => "too_many_chunks",
        }
    }
}

/// The prefill rank's staging state.
#[derive(Clone, Debug, Default)]
pub struct PrefillStaging {
    watermarks: BTreeMap<SessionId, Watermark>,
    requested: BTreeSet<ChunkKey>,
    rooms: BTreeSet<Room>,
    placed: BTreeMap<ChunkKey, RspPlacement>,
    waiting_rsp: BTreeSet<ChunkKey>,
    /// Per session, parked chunks keyed by the watermark they need `(round - 1, end)`.
    waiting_wm: BTreeMap<SessionId, BTreeSet<(u64, u64, ChunkKey)>>,
}

impl PrefillStaging {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// The `STAGING_REQ`s still to send for a room's destination `session` (every chunk of the
    /// grid neither requested nor already placed by another writer's request). The keys are recorded as requested; call
    /// [`PrefillStaging::prefetch_failed`] for any that could not be sent.
    pub fn prefetch(
        &mut self,
        room: Room,
        session: &SessionId,
        grid: &RoomGrid,
        pp_rank: Option<u32>,
    ) -> Result<Vec<StagingReq>, PrefillError> {
        self.rooms.insert(room);
        let n = u32::try_from(grid.num_chunks()).map_err(|_| PrefillError::TooManyChunks(room))?;
        let mut out = Vec::new();
        for chunk_idx in 0..n {
            let key = ChunkKey {
                room,
                chunk_idx,
                session: session.clone(),
            };
            if self.requested.contains(&key) || self.placed.contains_key(&key) {
                continue;
            }
            let chunk_pages = grid.chunk_pages(u64::from(chunk_idx)).unwrap_or(0);
            self.requested.insert(key);
            out.push(StagingReq {
                room,
                chunk_idx,
                chunk_pages,
                session: session.clone(),
                pp_rank,
            });
        }
        Ok(out)
    }

    /// Sending a request failed: forget the key so the next prefetch retries it.
    pub fn prefetch_failed(&mut self, key: &ChunkKey) {
        self.requested.remove(key);
    }

    /// The merged watermark of a decode session (`(0, 0)` before any arrived).
    pub fn watermark(&self, session: &SessionId) -> Watermark {
        self.watermarks.get(session).copied().unwrap_or_default()
    }

    fn readiness(&self, key: &ChunkKey, p: &RspPlacement) -> Readiness {
        match p {
            RspPlacement::Oversized => Readiness::Oversized,
            RspPlacement::At(pl) if self.watermark(&key.session).admits(pl) => {
                Readiness::Ready(*pl)
            }
            RspPlacement::At(_) => Readiness::Wait,
        }
    }

    fn park(&mut self, key: ChunkKey, p: &Placement) {
        let need = (p.round.saturating_sub(1), p.end, key);
        self.waiting_wm
            .entry(need.2.session.clone())
            .or_default()
            .insert(need);
    }

    /// Handles `STAGING_RSP`: records the placement; wakes the chunk if it was polled before.
    pub fn on_staging_rsp(&mut self, rsp: &StagingRsp) -> Result<Vec<Wake>, PrefillError> {
        if !self.rooms.contains(&rsp.room) {
            return Err(PrefillError::UnknownRoom(rsp.room));
        }
        let key = rsp.key();
        if let Some(old) = self.placed.get(&key) {
            return if *old == rsp.placement {
                Ok(Vec::new())
            } else {
                Err(PrefillError::Conflict(key))
            };
        }
        self.placed.insert(key.clone(), rsp.placement);
        if !self.waiting_rsp.remove(&key) {
            return Ok(Vec::new());
        }
        match (self.readiness(&key, &rsp.placement), rsp.placement) {
            (Readiness::Wait, RspPlacement::At(p)) => {
                self.park(key, &p);
                Ok(Vec::new())
            }
            (readiness, _) => Ok(vec![Wake { key, readiness }]),
        }
    }

    /// Handles `WATERMARK`: max-merges it into the session's watermark and wakes every parked
    /// chunk of that session it admits, in `(round, end)` order.
    pub fn on_watermark(&mut self, msg: &WatermarkMsg) -> Vec<Wake> {
        let wm = self.watermarks.entry(msg.session.clone()).or_default();
        *wm = (*wm).max(msg.watermark);
        let wm = *wm;
        let Some(parked) = self.waiting_wm.get_mut(&msg.session) else {
            return Vec::new();
        };
        let mut woken = Vec::new();
        while let Some(first) = parked.first() {
            if (first.0, first.1) > (wm.round, wm.tail) {
                break;
            }
            if let Some((_, _, key)) = parked.pop_first()
                && let Some(RspPlacement::At(p)) = self.placed.get(&key)
            {
                woken.push(Wake {
                    key,
                    readiness: Readiness::Ready(*p),
                });
            }
        }
        if parked.is_empty() {
            self.waiting_wm.remove(&msg.session);
        }
        woken
    }

    /// May this chunk be written now? `Wait` parks it until a [`Wake`] returns it.
    pub fn poll(&mut self, key: &ChunkKey) -> Readiness {
        let Some(p) = self.placed.get(key).copied() else {
            self.rooms.insert(key.room);
            self.waiting_rsp.insert(key.clone());
            return Readiness::Wait;
        };
        let r = self.readiness(key, &p);
        if let (Readiness::Wait, RspPlacement::At(pl)) = (r, p) {
            self.park(key.clone(), &pl);
        }
        r
    }

    /// Purges every key of a concluded room (requested, placed, parked): a later message for
    /// it is refused as [`PrefillError::UnknownRoom`].
    pub fn conclude_room(&mut self, room: Room) {
        self.rooms.remove(&room);
        self.requested.retain(|k| k.room != room);
        self.placed.retain(|k, _| k.room != room);
        self.waiting_rsp.retain(|k| k.room != room);
        self.waiting_wm.retain(|_, set| {
            set.retain(|(_, _, k)| k.room != room);
            !set.is_empty()
        });
    }

    /// True when no per-room state is left (every room concluded).
    pub fn is_idle(&self) -> bool {
        self.rooms.is_empty()
            && self.requested.is_empty()
            && self.placed.is_empty()
            && self.waiting_rsp.is_empty()
            && self.waiting_wm.is_empty()
    }

    /// Number of `(room, chunk, session)` keys held (requested or placed).
    pub fn key_count(&self) -> usize {
        self.requested
            .union(&self.placed.keys().cloned().collect())
            .count()
    }

    /// Number of parked chunks.
    pub fn waiting_count(&self) -> usize {
        self.waiting_rsp.len() + self.waiting_wm.values().map(BTreeSet::len).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grid::ChunkGrid;

    fn rsp(room: Room, chunk_idx: u32, placement: RspPlacement, s: &SessionId) -> StagingRsp {
        StagingRsp {
            room,
            chunk_idx,
            placement,
            session: s.clone(),
        }
    }

    fn at(offset: u64, round: u64, end: u64) -> RspPlacement {
        RspPlacement::At(Placement { offset, round, end })
    }

    #[test]
    fn parks_and_wakes_without_polling() {
        let s = SessionId::new("d:1");
        let room = Room::new(5).unwrap();
        let grid = RoomGrid::from_pages(ChunkGrid::with_pages(4), 10);
        let mut p = PrefillStaging::new();
        let reqs = p.prefetch(room, &s, &grid, Some(0)).unwrap();
        assert_eq!(
            reqs.iter().map(|r| r.chunk_pages).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        assert!(p.prefetch(room, &s, &grid, None).unwrap().is_empty());
        p.prefetch_failed(&reqs[2].key());
        assert_eq!(p.prefetch(room, &s, &grid, None).unwrap().len(), 1);

        // Polled before its placement arrived: woken by the response.
        let k0 = reqs[0].key();
        assert_eq!(p.poll(&k0), Readiness::Wait);
        let w = p.on_staging_rsp(&rsp(room, 0, at(0, 0, 40), &s)).unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(
            w[0].readiness,
            Readiness::Ready(Placement {
                offset: 0,
                round: 0,
                end: 40
            })
        );
        // Duplicate response (another writer's request): nothing; conflicting: an error.
        assert!(
            p.on_staging_rsp(&rsp(room, 0, at(0, 0, 40), &s))
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            p.on_staging_rsp(&rsp(room, 0, at(8, 0, 48), &s)),
            Err(PrefillError::Conflict(k0))
        );

        // Round 1 chunks wait for the watermark they need, and wake in order.
        p.on_staging_rsp(&rsp(room, 1, at(0, 1, 40), &s)).unwrap();
        p.on_staging_rsp(&rsp(room, 2, at(40, 1, 60), &s)).unwrap();
        assert_eq!(p.poll(&reqs[2].key()), Readiness::Wait);
        assert_eq!(p.poll(&reqs[1].key()), Readiness::Wait);
        assert_eq!(p.waiting_count(), 2);
        let wm = |round, tail| WatermarkMsg {
            watermark: Watermark { round, tail },
            session: s.clone(),
        };
        assert!(p.on_watermark(&wm(0, 39)).is_empty());
        let w = p.on_watermark(&wm(0, 50));
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].key.chunk_idx, 1);
        // An older watermark never lowers the merged one.
        assert!(p.on_watermark(&wm(0, 10)).is_empty());
        assert_eq!(p.watermark(&s), Watermark { round: 0, tail: 50 });
        let w = p.on_watermark(&wm(1, 0));
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].key.chunk_idx, 2);
        assert_eq!(p.waiting_count(), 0);

        p.conclude_room(room);
        assert!(p.is_idle());
        assert_eq!(
            p.on_staging_rsp(&rsp(room, 0, at(0, 0, 40), &s)),
            Err(PrefillError::UnknownRoom(room))
        );
    }

    #[test]
    fn oversized_wakes_and_conclude_drops_parked() {
        let s = SessionId::new("d:1");
        let room = Room::new(6).unwrap();
        let grid = RoomGrid::from_pages(ChunkGrid::with_pages(4), 8);
        let mut p = PrefillStaging::new();
        let reqs = p.prefetch(room, &s, &grid, None).unwrap();
        assert_eq!(p.poll(&reqs[0].key()), Readiness::Wait);
        let w = p
            .on_staging_rsp(&rsp(room, 0, RspPlacement::Oversized, &s))
            .unwrap();
        assert_eq!(w[0].readiness, Readiness::Oversized);
        p.on_staging_rsp(&rsp(room, 1, at(0, 3, 10), &s)).unwrap();
        assert_eq!(p.poll(&reqs[1].key()), Readiness::Wait);
        p.conclude_room(room);
        assert!(p.is_idle());
        assert_eq!(p.waiting_count(), 0);
    }
}
