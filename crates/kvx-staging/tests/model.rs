//! Model-based test of the staging protocol: one decode (ring + state machine), two prefill
//! instances of `Pt` ranks each (their own state machines), FIFO message queues between them, and
//! a random schedule of rooms, prefetches (some failing), forward-pass chunks, deliveries,
//! scatter completions and aborts. A shadow of the ring records which chunk's writer owns each
//! byte. Checked after every step and at the end:
//! - watermark safety: a prefill only ever writes bytes nobody owns (freed by the decode), and
//!   the bytes a scatter reads were not overwritten since their writer wrote them;
//! - two live allocations that overlap are never both writable under the decode's watermark
//!   (same-round allocations never overlap);
//! - liveness: draining the queues completes every room (no stalled watermark, even after the
//!   ring empties and a fresh prefill instance joins);
//! - aborts race with the prefill: the decode fences the room's unreported regions, each prefill
//!   rank keeps writing until it processes the ABORT, then confirms; its late writes must still
//!   land in bytes nobody else owns;
//! - after every room is terminal: no allocation, fence, subscriber, room or prefetch key is left.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, VecDeque};

use kvx_core::{Room, SessionId};
use kvx_staging::{
    ChunkGrid, ChunkKey, ChunkReady, DecodeAction, DecodeError, DecodeRoom, DecodeStaging,
    Placement, PrefillError, PrefillStaging, Readiness, RoomGrid, ScatterJob, StagedLayout,
    StagingReq, StagingRsp, TpGeometry, Wake, WatermarkMsg,
};
use proptest::prelude::*;

const INSTANCES: u32 = 2;

#[derive(Clone, Debug)]
enum Action {
    NewRoom {
        instance: u32,
        pages: u64,
        full: u64,
    },
    Prefetch {
        room: usize,
        rank: usize,
        drop_one: bool,
    },
    Produce {
        room: usize,
        rank: usize,
    },
    DeliverDecode(usize),
    DeliverPrefill {
        peer: usize,
        n: usize,
    },
    FinishScatter(usize),
    Abort(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (0..INSTANCES, 1u64..20, 1u64..6).prop_map(|(instance, pages, full)| Action::NewRoom { instance, pages, full }),
        3 => (any::<usize>(), any::<usize>(), prop::bool::weighted(0.2)).prop_map(|(room, rank, drop_one)| Action::Prefetch { room, rank, drop_one }),
        4 => (any::<usize>(), any::<usize>()).prop_map(|(room, rank)| Action::Produce { room, rank }),
        4 => (1usize..6).prop_map(Action::DeliverDecode),
        4 => (any::<usize>(), 1usize..6).prop_map(|(peer, n)| Action::DeliverPrefill { peer, n }),
        3 => any::<usize>().prop_map(Action::FinishScatter),
        1 => any::<usize>().prop_map(Action::Abort),
    ]
}

enum ToDecode {
    Req(StagingReq),
    Ready(ChunkReady),
    /// A prefill rank stopped writing an aborted room (its ABORT_ACK).
    Quiesced(Room, u32),
}

enum ToPrefill {
    Rsp(StagingRsp),
    Wm(WatermarkMsg),
    Abort(Room),
}

struct RoomInfo {
    instance: u32,
    grid: RoomGrid,
    prefetched: Vec<bool>,
    produced: Vec<u32>,
    scattered: u64,
    aborted: bool,
    /// Prefill ranks that concluded the room (they write nothing more for it).
    concluded: Vec<bool>,
    /// Confirmations the decode has received.
    quiesced: u32,
}

type Owner = (Room, u32, usize);

struct Model {
    geom: TpGeometry,
    layout: StagedLayout,
    session: SessionId,
    decode: DecodeStaging<u32>,
    prefills: Vec<PrefillStaging>,
    to_decode: VecDeque<ToDecode>,
    to_prefill: Vec<VecDeque<ToPrefill>>,
    scatters: Vec<ScatterJob>,
    rooms: BTreeMap<Room, RoomInfo>,
    shadow: Vec<Option<Owner>>,
    next_room: u64,
    completed: u64,
    failed: u64,
}

impl Model {
    fn new(pt: u32, ring: u64) -> Self {
        let geom = TpGeometry::new(2, pt, 1).unwrap();
        let layout = StagedLayout::for_decode(&geom, 0, 1, 1, 1);
        let session = SessionId::new("10.0.0.2:15234");
        Model {
            geom,
            layout,
            decode: DecodeStaging::new(session.clone(), ring),
            prefills: (0..pt * INSTANCES).map(|_| PrefillStaging::new()).collect(),
            to_decode: VecDeque::new(),
            to_prefill: (0..pt * INSTANCES).map(|_| VecDeque::new()).collect(),
            scatters: Vec::new(),
            rooms: BTreeMap::new(),
            shadow: vec![None; ring as usize],
            session,
            next_room: 1,
            completed: 0,
            failed: 0,
        }
    }

    fn pt(&self) -> u32 {
        self.geom.prefill_tp
    }

    fn peer(&self, instance: u32, rank: u32) -> u32 {
        instance * self.pt() + rank
    }

    fn pick_room(&self, i: usize) -> Option<Room> {
        let n = self.rooms.len();
        (n > 0).then(|| *self.rooms.keys().nth(i % n).unwrap())
    }

    fn new_room(&mut self, instance: u32, pages: u64, full: u64) {
        let room = Room::new(self.next_room).unwrap();
        self.next_room += 1;
        let grid = RoomGrid::from_pages(ChunkGrid::with_pages(full), pages);
        let pt = self.pt();
        let peers = (0..pt).map(|r| self.peer(instance, r)).collect();
        self.decode
            .register_room(
                room,
                DecodeRoom {
                    peers,
                    grid,
                    layout: self.layout.clone(),
                },
            )
            .unwrap();
        self.rooms.insert(
            room,
            RoomInfo {
                instance,
                grid,
                prefetched: vec![false; pt as usize],
                produced: vec![0; pt as usize],
                scattered: 0,
                aborted: false,
                concluded: vec![false; pt as usize],
                quiesced: 0,
            },
        );
    }

    fn prefetch(&mut self, room: Room, rank: u32, drop_one: bool) {
        let info = &self.rooms[&room];
        if info.concluded[rank as usize] {
            return;
        }
        let peer = self.peer(info.instance, rank) as usize;
        let grid = info.grid;
        let reqs = self.prefills[peer]
            .prefetch(room, &self.session, &grid, None)
            .unwrap();
        self.rooms.get_mut(&room).unwrap().prefetched[rank as usize] = true;
        for (i, r) in reqs.into_iter().enumerate() {
            if drop_one && i == 0 {
                self.prefills[peer].prefetch_failed(&r.key());
            } else {
                self.to_decode.push_back(ToDecode::Req(r));
            }
        }
    }

    fn produce(&mut self, room: Room, rank: u32) {
        let info = &self.rooms[&room];
        if !info.prefetched[rank as usize]
            || info.concluded[rank as usize]
            || u64::from(info.produced[rank as usize]) >= info.grid.num_chunks()
        {
            return;
        }
        let peer = self.peer(info.instance, rank);
        let k = info.produced[rank as usize];
        self.rooms.get_mut(&room).unwrap().produced[rank as usize] += 1;
        let key = ChunkKey {
            room,
            chunk_idx: k,
            session: self.session.clone(),
        };
        let r = self.prefills[peer as usize].poll(&key);
        self.on_readiness(peer, key, r);
    }

    fn on_readiness(&mut self, peer: u32, key: ChunkKey, r: Readiness) {
        match r {
            Readiness::Wait => {}
            Readiness::Oversized => self.fail(key.room),
            Readiness::Ready(p) => self.write(peer, key, p),
        }
    }

    /// The prefill writes its block of a chunk: every byte must be free.
    fn write(&mut self, peer: u32, key: ChunkKey, p: Placement) {
        let rank = peer % self.pt();
        if self
            .rooms
            .get(&key.room)
            .is_none_or(|i| i.concluded[rank as usize])
        {
            return; // concluded meanwhile: the driver drops the chunk
        }
        let w = self.geom.writer_index(rank) as usize;
        let grid = self.rooms[&key.room].grid;
        let pages = grid.chunk_pages(u64::from(key.chunk_idx)).unwrap();
        let off = p.offset + self.layout.writer_offset(w, pages);
        let len = self.layout.writer_bytes(w, pages);
        assert!(off + len <= p.end);
        for b in off..off + len {
            let cell = &mut self.shadow[b as usize];
            assert!(
                cell.is_none(),
                "writer {w} of {key:?} at {p:?} overwrites byte {b} still owned by {cell:?}"
            );
            *cell = Some((key.room, key.chunk_idx, w));
        }
        self.to_decode.push_back(ToDecode::Ready(ChunkReady {
            room: key.room,
            chunk_idx: key.chunk_idx,
            page_start: grid.chunk_start(u64::from(key.chunk_idx)).unwrap(),
            num_pages: pages,
            session: self.session.clone(),
            prefill_unique_rank: Some(peer),
        }));
    }

    fn clear_shadow(&mut self, room: Room, chunk: Option<u32>) {
        for cell in &mut self.shadow {
            if matches!(cell, Some((r, c, _)) if *r == room && chunk.is_none_or(|k| k == *c)) {
                *cell = None;
            }
        }
    }

    fn apply(&mut self, actions: Vec<DecodeAction<u32>>) {
        for a in actions {
            match a {
                DecodeAction::Respond { to, rsp, .. } => {
                    for p in to {
                        self.to_prefill[p as usize].push_back(ToPrefill::Rsp(rsp.clone()));
                    }
                }
                DecodeAction::Watermark { to, msg } => {
                    for p in to {
                        self.to_prefill[p as usize].push_back(ToPrefill::Wm(msg.clone()));
                    }
                }
                DecodeAction::Scatter(job) => self.scatters.push(job),
            }
        }
    }

    fn deliver_decode(&mut self) -> bool {
        let Some(m) = self.to_decode.pop_front() else {
            return false;
        };
        let (room, r) = match &m {
            ToDecode::Req(r) => (r.room, self.decode.on_staging_req(r)),
            ToDecode::Ready(r) => (r.room, self.decode.on_chunk_ready(r)),
            ToDecode::Quiesced(room, peer) => {
                let actions = self.decode.on_prefill_quiesced(*room, peer);
                self.apply(actions);
                if let Some(info) = self.rooms.get_mut(room) {
                    info.quiesced += 1;
                }
                self.settle_abort(*room);
                return true;
            }
        };
        match r {
            Ok(actions) => self.apply(actions),
            Err(DecodeError::UnknownRoom(x)) => assert!(
                x == room && self.rooms.get(&room).is_none_or(|i| i.aborted),
                "room {room} unknown to the decode"
            ),
            Err(e) => panic!("unexpected decode error {e}"),
        }
        true
    }

    fn deliver_prefill(&mut self, peer: u32) -> bool {
        let Some(m) = self.to_prefill[peer as usize].pop_front() else {
            return false;
        };
        let wakes: Vec<Wake> = match m {
            ToPrefill::Abort(room) => {
                // The rank stops writing the room, purges it and confirms.
                self.prefills[peer as usize].conclude_room(room);
                if let Some(info) = self.rooms.get_mut(&room) {
                    info.concluded[(peer % self.geom.prefill_tp) as usize] = true;
                }
                self.to_decode.push_back(ToDecode::Quiesced(room, peer));
                Vec::new()
            }
            ToPrefill::Wm(w) => self.prefills[peer as usize].on_watermark(&w),
            ToPrefill::Rsp(r) => match self.prefills[peer as usize].on_staging_rsp(&r) {
                Ok(w) => w,
                // Concluded, or this rank has not prefetched yet (its own request is answered again).
                Err(PrefillError::UnknownRoom(_)) => Vec::new(),
                Err(e) => panic!("unexpected prefill error {e}"),
            },
        };
        for w in wakes {
            self.on_readiness(peer, w.key, w.readiness);
        }
        true
    }

    /// A scatter finished: its bytes must still be its writers', then they are freed.
    fn finish_scatter(&mut self, i: usize) -> bool {
        if self.scatters.is_empty() {
            return false;
        }
        let job = self.scatters.swap_remove(i % self.scatters.len());
        let (p, n) = (job.placement, job.num_pages);
        for w in 0..self.layout.writers.len() {
            let off = p.offset + self.layout.writer_offset(w, n);
            for b in off..off + self.layout.writer_bytes(w, n) {
                assert_eq!(
                    self.shadow[b as usize],
                    Some((job.room, job.chunk_idx, w)),
                    "scatter of {job:?} reads clobbered byte {b}"
                );
            }
        }
        self.clear_shadow(job.room, Some(job.chunk_idx));
        let actions = self
            .decode
            .on_scatter_done(job.room, job.chunk_idx)
            .unwrap();
        self.apply(actions);
        let info = self.rooms.get_mut(&job.room).unwrap();
        info.scattered += 1;
        if info.scattered == info.grid.num_chunks() {
            assert!(self.decode.room_drained(job.room));
            self.conclude(job.room);
            self.completed += 1;
        }
        true
    }

    fn conclude(&mut self, room: Room) {
        let actions = self.decode.release_room(room);
        self.apply(actions);
        self.scatters.retain(|j| j.room != room);
        self.clear_shadow(room, None);
        for p in &mut self.prefills {
            p.conclude_room(room);
        }
        self.rooms.remove(&room);
    }

    /// Decode-side abort (or a failure one prefill rank reported): fence, tell every rank.
    fn abort(&mut self, room: Room) {
        let Some(info) = self.rooms.get_mut(&room) else {
            return;
        };
        if info.aborted {
            return;
        }
        info.aborted = true;
        let instance = info.instance;
        self.failed += 1;
        self.scatters.retain(|j| j.room != room);
        let actions = self.decode.abort_room(room);
        self.apply(actions);
        // Chunks freed at once (every writer had reported) are no longer owned by anyone.
        let fenced = self.decode.fenced_chunks(room);
        for cell in &mut self.shadow {
            if matches!(cell, Some((r, c, _)) if *r == room && !fenced.contains(c)) {
                *cell = None;
            }
        }
        for rank in 0..self.pt() {
            let peer = self.peer(instance, rank);
            self.to_prefill[peer as usize].push_back(ToPrefill::Abort(room));
        }
    }

    /// An aborted room is terminal once every prefill rank confirmed and the fence is gone.
    fn settle_abort(&mut self, room: Room) {
        let Some(info) = self.rooms.get(&room) else {
            return;
        };
        if info.aborted && info.quiesced == self.geom.prefill_tp {
            assert!(self.decode.fenced_chunks(room).is_empty());
            self.clear_shadow(room, None);
            self.rooms.remove(&room);
        }
    }

    fn fail(&mut self, room: Room) {
        if self.rooms.get(&room).is_some_and(|i| !i.aborted) {
            assert!(self.decode.room_oversized(room));
            self.abort(room);
        }
    }

    fn step(&mut self, a: &Action) {
        match *a {
            Action::NewRoom {
                instance,
                pages,
                full,
            } => self.new_room(instance, pages, full),
            Action::Prefetch {
                room,
                rank,
                drop_one,
            } => {
                if let Some(r) = self.pick_room(room) {
                    self.prefetch(r, (rank % self.pt() as usize) as u32, drop_one);
                }
            }
            Action::Produce { room, rank } => {
                if let Some(r) = self.pick_room(room) {
                    self.produce(r, (rank % self.pt() as usize) as u32);
                }
            }
            Action::DeliverDecode(n) => {
                for _ in 0..n {
                    self.deliver_decode();
                }
            }
            Action::DeliverPrefill { peer, n } => {
                let peer = (peer % self.prefills.len()) as u32;
                for _ in 0..n {
                    self.deliver_prefill(peer);
                }
            }
            Action::FinishScatter(i) => {
                self.finish_scatter(i);
            }
            Action::Abort(i) => {
                if let Some(r) = self.pick_room(i) {
                    self.abort(r);
                }
            }
        }
        self.check_live_allocations();
    }

    fn check_live_allocations(&self) {
        let wm = self.decode.ring().watermark();
        let live: Vec<Placement> = self.decode.ring().live().map(|(_, p)| p).collect();
        for (i, a) in live.iter().enumerate() {
            for b in &live[i + 1..] {
                if a.overlaps(b) && !a.is_empty() && !b.is_empty() {
                    assert_ne!(a.round, b.round, "same-round overlap {a:?} {b:?}");
                    assert!(
                        !(wm.admits(a) && wm.admits(b)),
                        "both writable: {a:?} {b:?} under {wm:?}"
                    );
                }
            }
        }
    }

    /// Runs everything to completion: every room must finish (or fail as oversized).
    fn drain(&mut self) {
        let rooms: Vec<Room> = self.rooms.keys().copied().collect();
        for room in rooms {
            for rank in 0..self.pt() {
                if self
                    .rooms
                    .get(&room)
                    .is_some_and(|i| !i.prefetched[rank as usize])
                {
                    self.prefetch(room, rank, false);
                }
            }
        }
        loop {
            let mut progress = false;
            // Retry failed prefetches (as the scheduler does on its next batch).
            let rooms: Vec<Room> = self.rooms.keys().copied().collect();
            for room in &rooms {
                for rank in 0..self.pt() {
                    if self.rooms.contains_key(room) {
                        let before = self.to_decode.len();
                        self.prefetch(*room, rank, false);
                        progress |= self.to_decode.len() != before;
                    }
                }
            }
            for room in &rooms {
                for rank in 0..self.pt() {
                    while let Some(info) = self.rooms.get(room) {
                        let r = rank as usize;
                        if !info.prefetched[r]
                            || info.concluded[r]
                            || u64::from(info.produced[r]) >= info.grid.num_chunks()
                        {
                            break;
                        }
                        self.produce(*room, rank);
                        progress = true;
                    }
                }
            }
            while self.deliver_decode() {
                progress = true;
            }
            for p in 0..self.prefills.len() as u32 {
                while self.deliver_prefill(p) {
                    progress = true;
                }
            }
            while self.finish_scatter(0) {
                progress = true;
            }
            self.check_live_allocations();
            if !progress {
                break;
            }
        }
        assert!(
            self.rooms.is_empty(),
            "stalled rooms: {:?}",
            self.rooms.keys().collect::<Vec<_>>()
        );
        assert_eq!(self.decode.live_allocations(), 0);
        assert_eq!(self.decode.subscriber_count(), 0);
        assert_eq!(self.decode.room_count(), 0);
        assert_eq!(self.decode.fenced_count(), 0);
        for p in &self.prefills {
            assert!(p.is_idle(), "prefill keeps per-room state");
            assert_eq!(p.key_count(), 0);
        }
        assert!(self.shadow.iter().all(Option::is_none));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]
    #[test]
    fn staging_protocol_model(
        pt in 1u32..3,
        ring in 8u64..64,
        actions in prop::collection::vec(action(), 1..200),
    ) {
        let mut m = Model::new(pt, ring);
        for a in &actions {
            m.step(a);
        }
        m.drain();
    }
}

/// The empty-ring stall sglang users hit: a big chunk after a small one on an empty ring.
#[test]
fn empty_ring_then_large_chunk_does_not_stall() {
    let mut m = Model::new(1, 40);
    m.new_room(0, 3, 3); // 12 bytes at 0..12, freed: ring empty with head 12
    m.drain();
    m.new_room(1, 9, 9); // 36 bytes: sglang wraps to round 1 needing tail >= 36 in round 0
    m.drain();
    assert_eq!(m.completed, 2);
}
