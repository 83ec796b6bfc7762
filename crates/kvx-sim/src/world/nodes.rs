//! The per-rank state the simulated drivers keep beside the real managers: memories, page and
//! row allocators, and what each driver knows about its rooms.

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::mapping::PrefillTarget;
use kvx_core::{DecodeManager, KVPoll, Room};
use kvx_engine::prefill_core::PrefillCore;

use crate::clock::Nanos;
use crate::memory::RankMemory;

use super::stage_decode::DecodeStager;
use super::worker::Workers;

/// What a prefill driver holds for one opened room.
#[derive(Clone, Debug)]
pub struct PRoom {
    /// Source pages, one per room page.
    pub src: Vec<u64>,
    /// The prefill's aux row.
    pub row: u64,
}

/// One prefill rank: kvx-engine's real core (room manager, staging driver, the owner loop's
/// rules) plus what the simulated embedder and workers hold.
pub struct PrefillNode {
    /// The real core.
    pub core: PrefillCore,
    /// Registered memory.
    pub mem: RankMemory,
    /// Process incarnation (bumped when it exits).
    pub inc: u32,
    /// Free source pages.
    pub free_pages: Vec<u64>,
    /// Free aux rows.
    pub free_rows: Vec<u64>,
    /// Opened rooms whose source memory is held.
    pub rooms: BTreeMap<Room, PRoom>,
    /// Opened rooms waiting for their metadata before the forward pass starts.
    pub awaiting: BTreeSet<Room>,
    /// Last status seen per held room.
    pub last_poll: BTreeMap<Room, KVPoll>,
    /// A worker died and is not restarted: the rank exits once the core hands out the fault.
    pub fatal: bool,
    /// Its exit is scheduled.
    pub exiting: bool,
    /// The process is gone (until it restarts).
    pub down: bool,
    /// When the next `Tick` is scheduled.
    pub tick_at: Option<Nanos>,
    /// The transfer workers.
    pub workers: Workers,
    /// When the forward pass last fed each (room, grid chunk) of a staged room, and whether a
    /// worker gathered a copy of it since, until the room concludes (the long-wait excuse,
    /// `stage_prefill.rs`).
    pub fed: BTreeMap<(Room, u32), (Nanos, bool)>,
}

/// What a decode driver holds for one room (kept after release, for the write checks).
#[derive(Clone, Debug, Default)]
pub struct DRoom {
    /// Destination pages.
    pub pages: Vec<u64>,
    /// Aux row.
    pub row: u64,
    /// Prefill ranks whose status arrived.
    pub status_from: BTreeSet<u32>,
    /// Prefill ranks whose (current) `ABORT_ACK` arrived.
    pub acked: BTreeSet<u32>,
    /// Generation of the room's latest `ABORT`.
    pub abort_gen: Option<u64>,
    /// The manager's conclusion.
    pub concluded: Option<KVPoll>,
    /// Pages and row given back.
    pub released: bool,
    /// Prefill ranks the room's latest `ABORT` towards was lost on the way (the network dropped
    /// it): they may still write, and only the release timeout gives the pages back.
    pub abort_lost: BTreeSet<u32>,
    /// The pages went back at the release timeout, not on every writing rank's word.
    pub timed_out: bool,
    /// Prefill ranks the room's `ABORT` went to (kvx-engine's decode sends it again to each
    /// while fewer ACKs than ranks came back).
    pub abort_to: BTreeSet<u32>,
}

/// One decode rank: the real manager plus the driver's state.
#[derive(Debug)]
pub struct DecodeNode {
    /// The real room manager.
    pub mgr: DecodeManager,
    /// Registered memory.
    pub mem: RankMemory,
    /// Process incarnation (bumped when it dies).
    pub inc: u32,
    /// Which room owns each KV page.
    pub page_owner: Vec<Option<Room>>,
    /// Which room owns each aux row.
    pub row_owner: Vec<Option<Room>>,
    /// Free pages.
    pub free_pages: Vec<u64>,
    /// Free aux rows.
    pub free_rows: Vec<u64>,
    /// Rooms of this incarnation.
    pub rooms: BTreeMap<Room, DRoom>,
    /// Last status seen per held room.
    pub last_poll: BTreeMap<Room, KVPoll>,
    /// The process is gone (until it restarts).
    pub down: bool,
    /// When the scheduled `Tick` runs (the manager's `poll_timeout()`), if one is.
    pub tick_at: Option<Nanos>,
    /// Prefill ranks this decode rank talks to (spec §4.3).
    pub targets: Vec<PrefillTarget>,
    /// `required_dst_info_num` of its metadata.
    pub required_dst: u32,
    /// `required_prefill_response_num`.
    pub required_resp: u32,
    /// The staging ring and its driver, when the seed stages.
    pub stager: Option<DecodeStager>,
}

impl DecodeNode {
    /// Resets the allocators and owners (a fresh process).
    pub fn reset_pools(&mut self) {
        let (pages, rows) = (self.mem.pages, self.mem.rows);
        self.page_owner = vec![None; pages as usize];
        self.row_owner = vec![None; rows as usize];
        self.free_pages = (0..pages).collect();
        self.free_rows = (0..rows).collect();
    }

    /// True when prefill rank `p` writes real data to this rank.
    pub fn real_target(&self, p: u32) -> bool {
        self.targets.iter().any(|t| t.tp_rank == p && !t.dummy)
    }
}

impl PrefillNode {
    /// Resets the allocators (a fresh process).
    pub fn reset_pools(&mut self) {
        self.free_pages = (0..self.mem.pages).collect();
        self.free_rows = (0..self.mem.rows).collect();
    }
}
