//! The decode side of staging as a deterministic state machine: rooms registered for staging,
//! one ring allocation per `(room, chunk)` shared by all its writers, arrival counting, scatter
//! jobs, frees and watermark subscribers.
//!
//! Events go in (`STAGING_REQ`, `CHUNK_READY`, "scatter finished", "room released"), actions come
//! out ([`DecodeAction`]: a `STAGING_RSP` to send, a `WATERMARK` to send, a scatter to run). The
//! driver does the I/O and must only report a scatter finished once the ring region is no longer
//! read. `P` identifies a prefill rank (e.g. its ZMQ endpoint); messages for a room go to the
//! room's prefill ranks.
//!
//! Fixes over sglang (spec §6 "Known gaps", §8 item 8): a watermark subscriber *is* a staged
//! room, so releasing the room (success, failure or abort) removes it — no stale subscribers; a
//! room that subscribes is sent the current watermark at once; the ring restarts at offset 0 when
//! empty ([`StagingRing`]); and a `STAGING_REQ` whose chunk does not match the room's grid (cut
//! from the decode prefix) is refused instead of sized wrongly. Beyond sglang (spec §8 item 6):
//! [`DecodeStaging::abort_room`] keeps the regions a prefill may still be writing fenced until
//! every prefill rank of the room confirmed it stopped, so a late write never lands in a region
//! already handed to another room.

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::{Room, SessionId};

use crate::grid::RoomGrid;
use crate::heads::StagedLayout;
use crate::msg::{ChunkReady, RspPlacement, StagingReq, StagingRsp, WatermarkMsg};
use crate::ring::{AllocId, Placement, StagingRing, Watermark};

/// Why a decode-side staging event was refused. The driver logs and counts it; for the
/// `Chunk*` variants it should fail the room (the prefill would otherwise wait forever).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The room is not registered for staging (sglang drops such requests with a warning).
    #[error("room {0} is not registered for staging")]
    UnknownRoom(Room),
    /// The room is already registered.
    #[error("room {0} is already registered for staging")]
    RoomExists(Room),
    /// The message names another decode session.
    #[error("message for session {got}, this decode is {ours}")]
    WrongSession {
        /// The session in the message.
        got: SessionId,
        /// This decode's session.
        ours: SessionId,
    },
    /// The chunk index lies past the room's grid.
    #[error("room {room}: chunk {chunk_idx} outside the room's {chunks} chunks")]
    ChunkOutOfGrid {
        /// The room.
        room: Room,
        /// The chunk.
        chunk_idx: u32,
        /// Chunks of the room.
        chunks: u64,
    },
    /// The chunk's pages differ from the grid cut from the decode prefix (sglang #23797).
    #[error(
        "room {room}: chunk {chunk_idx} has {got} pages at {got_start}, grid says {expected} at {expected_start}"
    )]
    ChunkMismatch {
        /// The room.
        room: Room,
        /// The chunk.
        chunk_idx: u32,
        /// Pages the grid expects.
        expected: u64,
        /// Pages the message says.
        got: u64,
        /// First page the grid expects.
        expected_start: u64,
        /// First page the message says (equal to `expected_start` for `STAGING_REQ`).
        got_start: u64,
    },
    /// `CHUNK_READY` or a scatter completion for a chunk without a live allocation.
    #[error("room {room}: chunk {chunk_idx} has no live allocation")]
    ChunkNotAllocated {
        /// The room.
        room: Room,
        /// The chunk.
        chunk_idx: u32,
    },
    /// A scatter completion for a chunk whose scatter was never started.
    #[error("room {room}: chunk {chunk_idx} is not being scattered")]
    NotScattering {
        /// The room.
        room: Room,
        /// The chunk.
        chunk_idx: u32,
    },
}

impl DecodeError {
    /// A short stable label for metrics and logs (one per variant; a variant added later gets
    /// its own label, so drivers need not match on the variants).
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::UnknownRoom(_) => "unknown_room",
            DecodeError::RoomExists(_) => "room_exists",
            DecodeError::WrongSession { .. } => "wrong_session",
            DecodeError::ChunkOutOfGrid { .. } => "chunk_out_of_grid",
            DecodeError::ChunkMismatch { .. } => "chunk_mismatch",
            DecodeError::ChunkNotAllocated { .. } => "chunk_not_allocated",
            DecodeError::NotScattering { .. } => "not_scattering",
        }
    }
}

/// What the decode needs to know about one staged room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeRoom<P> {
    /// The prefill ranks of the room (receivers of its `STAGING_RSP` and watermarks).
    pub peers: Vec<P>,
    /// The room's chunk grid (from the decode prefix and the destination page count).
    pub grid: RoomGrid,
    /// How the room's chunk regions are laid out (writers, layers, bytes per head-token).
    pub layout: StagedLayout,
}

/// A scatter the driver must run: copy the ring region into the KV pages of the chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScatterJob {
    /// The room.
    pub room: Room,
    /// The chunk.
    pub chunk_idx: u32,
    /// The chunk's ring region.
    pub placement: Placement,
    /// First suffix-relative page of the chunk.
    pub page_start: u64,
    /// Pages in the chunk.
    pub num_pages: u64,
}

/// An action for the decode driver.
///
/// Deliberately not `#[non_exhaustive]`: a driver must perform every action, so its `match` has
/// no wildcard arm and a new variant is a breaking change by design (the compiler then points at
/// every driver that must learn it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeAction<P> {
    /// Send `STAGING_RSP` to these prefill ranks (only to `pp_rank` when set).
    Respond {
        /// Receivers.
        to: Vec<P>,
        /// Restrict to this requester pipeline rank.
        pp_rank: Option<u32>,
        /// The response.
        rsp: StagingRsp,
    },
    /// Send `WATERMARK` to these prefill ranks.
    Watermark {
        /// Receivers.
        to: Vec<P>,
        /// The message.
        msg: WatermarkMsg,
    },
    /// Run a scatter, then report [`DecodeStaging::on_scatter_done`].
    Scatter(ScatterJob),
}

/// Writers that reported a chunk: distinct ranks, plus reports that named no rank.
#[derive(Clone, Debug, Default)]
struct Arrivals {
    ranks: BTreeSet<u32>,
    anonymous: usize,
}

impl Arrivals {
    fn record(&mut self, rank: Option<u32>) {
        match rank {
            Some(r) => {
                self.ranks.insert(r);
            }
            None => self.anonymous += 1,
        }
    }

    fn count(&self) -> usize {
        self.ranks.len() + self.anonymous
    }
}

#[derive(Clone, Debug)]
enum Slot {
    Live {
        id: AllocId,
        placement: Placement,
        arrivals: Arrivals,
        scattering: bool,
    },
    Oversized,
    Scattered,
}

#[derive(Clone, Debug)]
struct RoomState<P> {
    cfg: DecodeRoom<P>,
    slots: BTreeMap<u32, Slot>,
    subscribed: bool,
}

/// The decode rank's staging state: its ring and its staged rooms.
#[derive(Clone, Debug)]
pub struct DecodeStaging<P> {
    session: SessionId,
    ring: StagingRing,
    rooms: BTreeMap<Room, RoomState<P>>,
    fenced: BTreeMap<Room, Fenced<P>>,
}

/// An aborted room's allocations that a prefill may still be writing.
#[derive(Clone, Debug)]
struct Fenced<P> {
    /// Prefill ranks that have not yet confirmed they stopped writing the room.
    waiting: BTreeSet<P>,
    allocs: Vec<(u32, AllocId)>,
}

impl<P: Clone + Ord> DecodeStaging<P> {
    /// A decode rank with session `session` and a ring of `ring_size` bytes.
    pub fn new(session: SessionId, ring_size: u64) -> Self {
        DecodeStaging {
            session,
            ring: StagingRing::new(ring_size),
            rooms: BTreeMap::new(),
            fenced: BTreeMap::new(),
        }
    }

    /// Registers a room for staging (before its metadata is sent to the prefill).
    pub fn register_room(&mut self, room: Room, cfg: DecodeRoom<P>) -> Result<(), DecodeError> {
        if self.rooms.contains_key(&room) || self.fenced.contains_key(&room) {
            return Err(DecodeError::RoomExists(room));
        }
        self.rooms.insert(
            room,
            RoomState {
                cfg,
                slots: BTreeMap::new(),
                subscribed: false,
            },
        );
        Ok(())
    }

    fn check_session(&self, got: &SessionId) -> Result<(), DecodeError> {
        if *got != self.session {
            return Err(DecodeError::WrongSession {
                got: got.clone(),
                ours: self.session.clone(),
            });
        }
        Ok(())
    }

    /// Handles `STAGING_REQ`: allocate (or reuse) the chunk's region and answer. A request for
    /// a chunk already scattered is a late duplicate and answered with nothing.
    pub fn on_staging_req(
        &mut self,
        req: &StagingReq,
    ) -> Result<Vec<DecodeAction<P>>, DecodeError> {
        self.check_session(&req.session)?;
        let wm = self.ring.watermark();
        let st = self
            .rooms
            .get_mut(&req.room)
            .ok_or(DecodeError::UnknownRoom(req.room))?;
        let idx = u64::from(req.chunk_idx);
        let expected_start = st
            .cfg
            .grid
            .chunk_start(idx)
            .ok_or(DecodeError::ChunkOutOfGrid {
                room: req.room,
                chunk_idx: req.chunk_idx,
                chunks: st.cfg.grid.num_chunks(),
            })?;
        let expected = st.cfg.grid.chunk_pages(idx).unwrap_or(0);
        if expected != req.chunk_pages {
            return Err(DecodeError::ChunkMismatch {
                room: req.room,
                chunk_idx: req.chunk_idx,
                expected,
                got: req.chunk_pages,
                expected_start,
                got_start: expected_start,
            });
        }
        let placement = match st.slots.get(&req.chunk_idx) {
            Some(Slot::Live { placement, .. }) => RspPlacement::At(*placement),
            Some(Slot::Oversized) => RspPlacement::Oversized,
            // A late duplicate (another writer's request got this chunk placed, written and
            // scattered first; requests and CHUNK_READY travel on different sockets): the
            // requester already has the placement, so nothing is answered.
            Some(Slot::Scattered) => return Ok(Vec::new()),
            None => {
                let required = st.cfg.layout.chunk_bytes(req.chunk_pages);
                match self.ring.assign(required) {
                    Ok((id, placement)) => {
                        st.slots.insert(
                            req.chunk_idx,
                            Slot::Live {
                                id,
                                placement,
                                arrivals: Arrivals::default(),
                                scattering: false,
                            },
                        );
                        RspPlacement::At(placement)
                    }
                    Err(_) => {
                        st.slots.insert(req.chunk_idx, Slot::Oversized);
                        RspPlacement::Oversized
                    }
                }
            }
        };
        let mut actions = vec![DecodeAction::Respond {
            to: st.cfg.peers.clone(),
            pp_rank: req.pp_rank,
            rsp: StagingRsp {
                room: req.room,
                chunk_idx: req.chunk_idx,
                placement,
                session: self.session.clone(),
            },
        }];
        if !st.subscribed {
            st.subscribed = true;
            actions.push(DecodeAction::Watermark {
                to: st.cfg.peers.clone(),
                msg: WatermarkMsg {
                    watermark: wm,
                    session: self.session.clone(),
                },
            });
        }
        Ok(actions)
    }

    /// Handles `CHUNK_READY` from one writer; once every writer of the chunk arrived, returns
    /// the scatter job (exactly once). Repeated arrivals of one prefill rank count once.
    pub fn on_chunk_ready(
        &mut self,
        msg: &ChunkReady,
    ) -> Result<Vec<DecodeAction<P>>, DecodeError> {
        self.check_session(&msg.session)?;
        let st = self
            .rooms
            .get_mut(&msg.room)
            .ok_or(DecodeError::UnknownRoom(msg.room))?;
        let idx = u64::from(msg.chunk_idx);
        let (expected_start, expected) =
            match (st.cfg.grid.chunk_start(idx), st.cfg.grid.chunk_pages(idx)) {
                (Some(s), Some(n)) => (s, n),
                _ => {
                    return Err(DecodeError::ChunkOutOfGrid {
                        room: msg.room,
                        chunk_idx: msg.chunk_idx,
                        chunks: st.cfg.grid.num_chunks(),
                    });
                }
            };
        if expected_start != msg.page_start || expected != msg.num_pages {
            return Err(DecodeError::ChunkMismatch {
                room: msg.room,
                chunk_idx: msg.chunk_idx,
                expected,
                got: msg.num_pages,
                expected_start,
                got_start: msg.page_start,
            });
        }
        let writers = st.cfg.layout.reports_per_chunk();
        match st.slots.get_mut(&msg.chunk_idx) {
            Some(Slot::Live {
                placement,
                arrivals,
                scattering,
                ..
            }) => {
                arrivals.record(msg.prefill_unique_rank);
                if arrivals.count() >= writers && !*scattering {
                    *scattering = true;
                    return Ok(vec![DecodeAction::Scatter(ScatterJob {
                        room: msg.room,
                        chunk_idx: msg.chunk_idx,
                        placement: *placement,
                        page_start: expected_start,
                        num_pages: expected,
                    })]);
                }
                Ok(Vec::new())
            }
            _ => Err(DecodeError::ChunkNotAllocated {
                room: msg.room,
                chunk_idx: msg.chunk_idx,
            }),
        }
    }

    /// The scatter of a chunk finished (the region is no longer read): free it and broadcast
    /// the new watermark to every subscribed room's prefill ranks.
    pub fn on_scatter_done(
        &mut self,
        room: Room,
        chunk_idx: u32,
    ) -> Result<Vec<DecodeAction<P>>, DecodeError> {
        let st = self
            .rooms
            .get_mut(&room)
            .ok_or(DecodeError::UnknownRoom(room))?;
        let id = match st.slots.get(&chunk_idx) {
            Some(Slot::Live {
                id,
                scattering: true,
                ..
            }) => *id,
            Some(Slot::Live { .. }) => return Err(DecodeError::NotScattering { room, chunk_idx }),
            _ => return Err(DecodeError::ChunkNotAllocated { room, chunk_idx }),
        };
        st.slots.insert(chunk_idx, Slot::Scattered);
        let wm = self.ring.free(id);
        Ok(wm.and_then(|wm| self.broadcast(wm)).into_iter().collect())
    }

    /// Releases a room (completed, or failed/aborted with no prefill write in flight): frees
    /// every allocation it still holds and drops its subscription (sglang's `release_room`).
    /// The driver must have stopped any scatter reading its regions. When a prefill may still
    /// be writing, use [`DecodeStaging::abort_room`] instead.
    /// Returns the watermark broadcast if anything was freed and some room is still subscribed.
    /// Unknown rooms are a no-op.
    pub fn release_room(&mut self, room: Room) -> Vec<DecodeAction<P>> {
        let Some(st) = self.rooms.remove(&room) else {
            return Vec::new();
        };
        let mut last = None;
        for slot in st.slots.values() {
            if let Slot::Live { id, .. } = slot {
                last = self.ring.free(*id).or(last);
            }
        }
        last.and_then(|wm| self.broadcast(wm)).into_iter().collect()
    }

    /// Aborts a room (decode-side abort, timeout, or a failure reported by one prefill rank)
    /// while other prefill ranks may still be writing its chunks: the room and its subscription
    /// go at once, allocations every writer already reported (`CHUNK_READY`) are freed, and the
    /// others stay **fenced** — live in the ring, so the watermark keeps their bytes from being
    /// reused — until every prefill rank of the room confirmed it stopped writing
    /// ([`DecodeStaging::on_prefill_quiesced`]) or the driver gives up
    /// ([`DecodeStaging::release_fenced`]). This closes the window in which sglang reuses a
    /// region a late RDMA write still lands in. The driver must have stopped running scatters.
    pub fn abort_room(&mut self, room: Room) -> Vec<DecodeAction<P>> {
        let Some(st) = self.rooms.remove(&room) else {
            return Vec::new();
        };
        let writers = st.cfg.layout.reports_per_chunk();
        let mut last = None;
        let mut allocs = Vec::new();
        for (&chunk, slot) in &st.slots {
            if let Slot::Live { id, arrivals, .. } = slot {
                if arrivals.count() >= writers {
                    last = self.ring.free(*id).or(last);
                } else {
                    allocs.push((chunk, *id));
                }
            }
        }
        if !allocs.is_empty() {
            let waiting = st.cfg.peers.into_iter().collect();
            self.fenced.insert(room, Fenced { waiting, allocs });
        }
        last.and_then(|wm| self.broadcast(wm)).into_iter().collect()
    }

    /// A prefill rank of an aborted room will write nothing more for it (it acknowledged the
    /// abort, or reported the room's final status after its writes completed). Once every rank
    /// of the room did, its fenced allocations are freed.
    pub fn on_prefill_quiesced(&mut self, room: Room, peer: &P) -> Vec<DecodeAction<P>> {
        let Some(f) = self.fenced.get_mut(&room) else {
            return Vec::new();
        };
        f.waiting.remove(peer);
        if f.waiting.is_empty() {
            self.release_fenced(room)
        } else {
            Vec::new()
        }
    }

    /// Frees an aborted room's fenced allocations now (the driver's deadline for the prefill's
    /// confirmation passed, or the prefill is known dead).
    pub fn release_fenced(&mut self, room: Room) -> Vec<DecodeAction<P>> {
        let Some(f) = self.fenced.remove(&room) else {
            return Vec::new();
        };
        let mut last = None;
        for (_, id) in f.allocs {
            last = self.ring.free(id).or(last);
        }
        last.and_then(|wm| self.broadcast(wm)).into_iter().collect()
    }

    /// Chunks of an aborted room whose regions are still fenced.
    pub fn fenced_chunks(&self, room: Room) -> Vec<u32> {
        self.fenced
            .get(&room)
            .map(|f| f.allocs.iter().map(|(c, _)| *c).collect())
            .unwrap_or_default()
    }

    /// Aborted rooms with fenced allocations.
    pub fn fenced_count(&self) -> usize {
        self.fenced.len()
    }

    /// The watermark for every subscribed room's prefill ranks (`None` when there is none).
    fn broadcast(&self, wm: Watermark) -> Option<DecodeAction<P>> {
        let to: BTreeSet<P> = self
            .rooms
            .values()
            .filter(|r| r.subscribed)
            .flat_map(|r| r.cfg.peers.iter().cloned())
            .collect();
        (!to.is_empty()).then(|| DecodeAction::Watermark {
            to: to.into_iter().collect(),
            msg: WatermarkMsg {
                watermark: wm,
                session: self.session.clone(),
            },
        })
    }

    /// True when the room holds no live allocation (every requested chunk was scattered or was
    /// oversized): a room that reported Success may complete.
    pub fn room_drained(&self, room: Room) -> bool {
        self.rooms
            .get(&room)
            .is_none_or(|st| !st.slots.values().any(|s| matches!(s, Slot::Live { .. })))
    }

    /// True when a chunk of the room was answered `ALLOC_OVERSIZED` (the room must fail).
    pub fn room_oversized(&self, room: Room) -> bool {
        self.rooms
            .get(&room)
            .is_some_and(|st| st.slots.values().any(|s| matches!(s, Slot::Oversized)))
    }

    /// The ring.
    pub fn ring(&self) -> &StagingRing {
        &self.ring
    }

    /// This decode's session id.
    pub fn session(&self) -> &SessionId {
        &self.session
    }

    /// Registered rooms.
    pub fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// Rooms subscribed to watermarks.
    pub fn subscriber_count(&self) -> usize {
        self.rooms.values().filter(|r| r.subscribed).count()
    }

    /// Live ring allocations.
    pub fn live_allocations(&self) -> usize {
        self.ring.live_count()
    }
}

#[cfg(test)]
mod tests;
