//! Plain Rust forms of the staging control messages (`STAGING_REQ`, `STAGING_RSP`, `WATERMARK`,
//! `CHUNK_READY`, spec §3.7).
//!
//! The byte-exact codec lives in `kvx-bootstrap`; these types carry only the content, so the
//! state machines here stay free of framing. Wire sentinels (`offset = -2` for an oversized
//! request, `end = -1`) are mapped to [`Placement`] / [`RspPlacement`] and back.

use kvx_core::{Room, SessionId};

use crate::ring::{Placement, Watermark};

/// The wire offset sglang sends when a request can never fit in the ring.
pub const ALLOC_OVERSIZED: i64 = -2;

/// Identifies one staged chunk of a room towards one decode session (the prefill's key).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey {
    /// The room.
    pub room: Room,
    /// Chunk index on the staging grid (see [`crate::ChunkGrid`]).
    pub chunk_idx: u32,
    /// The decode session the chunk goes to.
    pub session: SessionId,
}

/// `STAGING_REQ` (prefill → decode): please reserve ring space for one chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingReq {
    /// The room.
    pub room: Room,
    /// Chunk index on the staging grid.
    pub chunk_idx: u32,
    /// Pages in this chunk (`min(full_chunk_pages, remaining)`).
    pub chunk_pages: u64,
    /// The **decode** session id (the key of the room's transfer info on the prefill).
    pub session: SessionId,
    /// The requester's pipeline-parallel rank, when sent.
    pub pp_rank: Option<u32>,
}

impl StagingReq {
    /// The prefill-side key of the requested chunk.
    pub fn key(&self) -> ChunkKey {
        ChunkKey {
            room: self.room,
            chunk_idx: self.chunk_idx,
            session: self.session.clone(),
        }
    }
}

/// Where the decode placed a chunk, as carried by `STAGING_RSP`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RspPlacement {
    /// The chunk is larger than the whole ring (`offset = -2`): the room must fail.
    Oversized,
    /// The chunk's region in the ring.
    At(Placement),
}

impl RspPlacement {
    /// The wire triple `(offset, round, end)`.
    pub fn to_wire(self) -> (i64, i64, i64) {
        match self {
            RspPlacement::Oversized => (ALLOC_OVERSIZED, 0, -1),
            RspPlacement::At(p) => (wire_int(p.offset), wire_int(p.round), wire_int(p.end)),
        }
    }

    /// Builds a placement from the wire triple; `None` for values no decode can send
    /// (negative offsets other than `-2`, negative rounds, `end < offset`).
    pub fn from_wire(offset: i64, round: i64, end: i64) -> Option<Self> {
        if offset == ALLOC_OVERSIZED {
            return Some(RspPlacement::Oversized);
        }
        let offset = u64::try_from(offset).ok()?;
        let round = u64::try_from(round).ok()?;
        let end = u64::try_from(end).ok()?;
        (end >= offset).then_some(RspPlacement::At(Placement { offset, round, end }))
    }
}

fn wire_int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `STAGING_RSP` (decode → prefill): the placement of one chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingRsp {
    /// The room.
    pub room: Room,
    /// Chunk index on the staging grid.
    pub chunk_idx: u32,
    /// Where the chunk goes, or oversized.
    pub placement: RspPlacement,
    /// The decode session id.
    pub session: SessionId,
}

impl StagingRsp {
    /// The prefill-side key of the chunk.
    pub fn key(&self) -> ChunkKey {
        ChunkKey {
            room: self.room,
            chunk_idx: self.chunk_idx,
            session: self.session.clone(),
        }
    }
}

/// `WATERMARK` (decode → prefill): how far the decode's ring has been freed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatermarkMsg {
    /// The watermark.
    pub watermark: Watermark,
    /// The decode session id (`""` when the frame was absent).
    pub session: SessionId,
}

/// `CHUNK_READY` (prefill → decode): one writer finished writing its block of a chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkReady {
    /// The room.
    pub room: Room,
    /// Chunk index on the staging grid.
    pub chunk_idx: u32,
    /// First page of the chunk (suffix-relative page space).
    pub page_start: u64,
    /// Pages in the chunk.
    pub num_pages: u64,
    /// The decode session id.
    pub session: SessionId,
    /// The sending prefill's unique rank (frame 6, absent from some senders). The decode counts
    /// repeated arrivals of one rank once; arrivals without a rank each count.
    pub prefill_unique_rank: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wire_sentinels() {
        assert_eq!(RspPlacement::Oversized.to_wire(), (-2, 0, -1));
        assert_eq!(
            RspPlacement::from_wire(-2, 7, -1),
            Some(RspPlacement::Oversized)
        );
        let p = Placement {
            offset: 0,
            round: 0,
            end: 8_388_608,
        };
        assert_eq!(RspPlacement::At(p).to_wire(), (0, 0, 8_388_608));
        assert_eq!(RspPlacement::from_wire(-1, 0, 5), None);
        assert_eq!(RspPlacement::from_wire(5, -1, 6), None);
        assert_eq!(RspPlacement::from_wire(6, 0, 5), None);
    }

    proptest! {
        #[test]
        fn placement_round_trip(offset in 0u64..1 << 40, len in 0u64..1 << 30, round in 0u64..1 << 40) {
            let p = RspPlacement::At(Placement { offset, round, end: offset + len });
            let (o, r, e) = p.to_wire();
            prop_assert_eq!(RspPlacement::from_wire(o, r, e), Some(p));
        }

        #[test]
        fn from_wire_never_panics(o in any::<i64>(), r in any::<i64>(), e in any::<i64>()) {
            if let Some(RspPlacement::At(p)) = RspPlacement::from_wire(o, r, e) {
                prop_assert!(p.end >= p.offset);
            }
        }
    }
}
