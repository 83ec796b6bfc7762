//! The simulated world of one seed: prefill ranks running kvx-engine's real `PrefillCore` (the
//! prefill engine's owner-loop rules over the real kvx-core manager and, in staged seeds, the real
//! staging driver) with simulated workers, decode ranks running the real kvx-core manager, a
//! simulated control plane ([`crate::net`]), data plane ([`crate::data`]) and clock,
//! one event queue ordered by (time, sequence), and the invariant checks at every step.
//!
//! A step is one event taken from the queue. The workload (rooms, their pages and chunks) and
//! the faults (local aborts on either side, fatal worker faults, decode crashes and restarts,
//! lost and duplicated messages, failing connections, rejected and slow writes) are all drawn
//! from the seed's generator, so a seed replays exactly. When the queue runs dry every room must
//! be terminal on every rank and every manager and driver must hold nothing per room.

mod decode;
mod landing;
mod nodes;
mod prefill;
mod stage_decode;
mod stage_prefill;
mod worker;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Instant;

use kvx_core::mapping::{MappingInput, map_ranks};
use kvx_core::{DecodeAction, DecodeConfig, DecodeManager, Endpoint, KVPoll, Room, SessionId};

use crate::clock::{Clock, MS, Nanos, US};
use crate::data::{Answer, Data, DataEv};
use crate::invariants::{Checker, Inv};
use crate::memory::RankMemory;
use crate::mutants::Mutant;
use crate::net::{Msg, Net, Node};
use crate::rng::{Rng, mix};
use crate::scenario::Scenario;
use kvx_staging::ScatterJob;
pub use nodes::{DRoom, DecodeNode, PRoom, PrefillNode};

/// The prefill instance's bootstrap address (heartbeat key).
const BOOTSTRAP: &str = "10.0.0.100:8998";
/// A seed that has not quiesced after this many steps is a liveness violation.
const STEP_CAP: u64 = 3_000_000;

/// Something scheduled.
#[derive(Clone, Debug)]
pub enum Ev {
    /// The router starts the next room.
    Spawn,
    /// A control message reaches `to` (dropped if `to` restarted since it was sent).
    Deliver {
        /// Receiver.
        to: Node,
        /// Receiver incarnation at send time.
        inc: u32,
        /// Sender and its incarnation at send time.
        from: (Node, u32),
        /// The message.
        msg: Msg,
    },
    /// Prefill rank `p` creates and initialises the room's sender.
    Open {
        /// Rank.
        p: u32,
        /// Incarnation.
        inc: u32,
        /// Room.
        room: Room,
    },
    /// The forward pass of rank `p` finished chunk `k` of the room.
    Chunk {
        /// Rank.
        p: u32,
        /// Incarnation.
        inc: u32,
        /// Room.
        room: Room,
        /// Chunk index.
        k: usize,
    },
    /// Prefill rank `p`'s core deadline (the manager's, or the housekeeping's).
    PrefillTick {
        /// Rank.
        p: u32,
        /// Incarnation.
        inc: u32,
    },
    /// Decode rank `d`'s periodic tick.
    DecodeTick {
        /// Rank.
        d: u32,
        /// Incarnation.
        inc: u32,
    },
    /// The data plane.
    Data(DataEv),
    /// A batch's answer reaches its prefill driver.
    Answer(Answer),
    /// The decode scheduler aborts a room (on every TP rank: one scheduler drives them).
    DecodeAbort {
        /// Room.
        room: Room,
    },
    /// The prefill scheduler aborts a room (on every TP rank).
    PrefillAbort {
        /// Room.
        room: Room,
    },
    /// A failed decode room's release deadline.
    Release {
        /// Rank.
        d: u32,
        /// Incarnation.
        inc: u32,
        /// Room.
        room: Room,
    },
    /// The worker of prefill rank `p`'s `shard` takes its next jobs.
    Pump {
        /// Rank.
        p: u32,
        /// Incarnation.
        inc: u32,
        /// The queue shard.
        shard: usize,
    },
    /// The worker of prefill rank `p`'s `shard` finished opening a data session
    /// (`Work::Connect` number `id`) and takes its next jobs.
    Connected {
        /// Rank.
        p: u32,
        /// Incarnation.
        inc: u32,
        /// The queue shard.
        shard: usize,
        /// The connect job.
        id: u64,
    },
    /// A fatal fault hits a worker of prefill rank `p` (it dies once its posted jobs answered).
    Fatal {
        /// Rank.
        p: u32,
    },
    /// Prefill rank `p`'s process exits (after its batches drained).
    PrefillExit {
        /// Rank.
        p: u32,
    },
    /// Prefill rank `p` is back (a fresh manager; the decodes register again).
    PrefillRestart {
        /// Rank.
        p: u32,
    },
    /// Decode rank `d` probes the inboxes of a room's prefill ranks after a lost heartbeat.
    GoneProbe {
        /// Rank.
        d: u32,
        /// Incarnation.
        inc: u32,
        /// Room.
        room: Room,
    },
    /// Decode rank `d` sends a failed room's unanswered `ABORT` again (kvx-engine's decode:
    /// after 1 s, then doubling up to 8 s, until the pages go back).
    AbortResend {
        /// Rank.
        d: u32,
        /// Incarnation.
        inc: u32,
        /// Room.
        room: Room,
        /// The wait before this resend.
        gap: Nanos,
    },
    /// Decode rank `d` loses the prefill instance's heartbeat.
    HeartbeatLost {
        /// Rank.
        d: u32,
    },
    /// Decode rank `d` dies.
    DecodeCrash {
        /// Rank.
        d: u32,
    },
    /// Decode rank `d` restarts under the same address and session id.
    DecodeRestart {
        /// Rank.
        d: u32,
    },
    /// One connect of prefill rank `p`'s liveness probe of the decode behind `session`.
    Probe {
        /// Rank.
        p: u32,
        /// Incarnation.
        inc: u32,
        /// The decode session staged rooms wait on.
        session: SessionId,
        /// The second connect (a failure reports `SessionLost`).
        retry: bool,
    },
    /// The `early-slot-reuse` mutant's copy-out of a chunk whose slot was already freed.
    ScatterCopy {
        /// Decode rank.
        d: u32,
        /// Its incarnation.
        inc: u32,
        /// The scatter.
        job: ScatterJob,
        /// The slot it was written in.
        slot: u64,
        /// The bytes each writer's block took in place.
        routed: Vec<u64>,
    },
}

impl Ev {
    /// The room an event concerns, if one.
    fn room(&self) -> Option<Room> {
        match self {
            Ev::Deliver { msg, .. } => msg.room(),
            Ev::Open { room, .. }
            | Ev::Chunk { room, .. }
            | Ev::DecodeAbort { room, .. }
            | Ev::PrefillAbort { room, .. }
            | Ev::Release { room, .. }
            | Ev::GoneProbe { room, .. }
            | Ev::AbortResend { room, .. } => Some(*room),
            Ev::Answer(a) => Some(a.room),
            Ev::ScatterCopy { job, .. } => Some(job.room),
            _ => None,
        }
    }

    /// Events worth a trace line even when they name no room (faults of whole ranks).
    fn is_fault(&self) -> bool {
        matches!(
            self,
            Ev::Fatal { .. }
                | Ev::PrefillExit { .. }
                | Ev::PrefillRestart { .. }
                | Ev::HeartbeatLost { .. }
                | Ev::DecodeCrash { .. }
                | Ev::DecodeRestart { .. }
                | Ev::Data(DataEv::ConnFail { .. })
        )
    }
}

struct Item {
    at: Nanos,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    fn cmp(&self, o: &Self) -> Ordering {
        // BinaryHeap is a max-heap: the earliest (time, seq) first.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// What the world knows of a room across ranks.
#[derive(Clone, Debug, Default)]
pub struct RoomRec {
    /// When it was spawned.
    pub spawned: Nanos,
    /// Pages.
    pub n: usize,
    /// Chunk page ranges, the last one last.
    pub chunks: Vec<(usize, usize)>,
    /// A fault of the run explains a decode waiting timeout for this room.
    pub excused: bool,
    /// Prefill ranks that opened it, with their incarnation.
    pub p_open: BTreeMap<u32, u32>,
    /// Prefill conclusions.
    pub p_done: BTreeMap<u32, (KVPoll, Nanos)>,
    /// Decode ranks that created it.
    pub d_open: BTreeSet<u32>,
    /// The incarnation of each decode rank that created it (the process its pages belong to).
    pub d_inc: BTreeMap<u32, u32>,
    /// Decode conclusions.
    pub d_done: BTreeMap<u32, (KVPoll, Nanos)>,
    /// Decode ranks that died holding it.
    pub d_crashed: BTreeSet<u32>,
    /// Prefill ranks where it was open when a fatal fault hit.
    pub fatal: BTreeSet<u32>,
    /// Decode ranks a `CHUNK_READY` of the room was lost to (the send failed).
    pub chunk_ready_lost: BTreeSet<u32>,
}

/// How often the rarer paths of a run were taken (so a test can tell they are exercised).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Staged chunks landed in their pages (scattered from a ring or received in place).
    pub scattered: u64,
    /// Writers' blocks of those chunks received in place.
    pub in_place: u64,
    /// Chunks with blocks of both kinds: some received in place, some scattered from the ring
    /// (their writers wrote around the receiver).
    pub mixed_chunks: u64,
    /// `PrefillEvent::SessionLost` reports (a probed decode was gone).
    pub sessions_lost: u64,
    /// `AUX_DATA` rows written into a decode.
    pub aux_rows: u64,
    /// Successful rooms whose state slot was verified.
    pub state_slots: u64,
    /// Jobs a prefill worker skipped (their room's cancel flag was up when it took them).
    pub skipped_jobs: u64,
    /// `Work::Connect` jobs prefill workers took (a room's metadata found its worker's session
    /// possibly idle).
    pub preconnects: u64,
    /// Prefill workers restarted after a fatal fault.
    pub worker_restarts: u64,
    /// Staged rooms a decode reported failed because a `CHUNK_READY` was lost before Success.
    pub undrained_success: u64,
    /// Transfers meant for a decode's earlier process (incarnation) whose peer failure reached
    /// their prefill rank once the decode was back up: with fixed session ids, possibly after
    /// it registered again — the order in which the failure must not blacklist the new process.
    pub stale_failures: u64,
    /// Writes that reached a decode after it gave the room's pages back at its release timeout
    /// because the room's `ABORT` to the writing prefill rank was lost (sglang's protocol
    /// cannot stop them; the sim does not apply them).
    pub lost_abort_writes: u64,
    /// `ABORT`s a decode sent again because fewer ranks acknowledged than it went to.
    pub abort_resends: u64,
    /// Jobs a prefill worker failed as `PeerFailed` without a write because their session was
    /// marked dead (kvx-engine's `SessionMarks`).
    pub marked_skips: u64,
    /// Jobs a prefill worker started ahead of earlier queued jobs whose decode session had its
    /// depth of batches posted (kvx-engine's held jobs).
    pub passed_jobs: u64,
    /// Peer failures that marked nothing: the attempt began before the session's latest
    /// registration (a decode that restarted under the same session id since).
    pub unmarked_failures: u64,
    /// `Work::Connect` opens that failed (the decode down, or the id naming an earlier
    /// process).
    pub failed_connects: u64,
}

/// The trace of one room kept while replaying a failing seed.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// The room followed.
    pub room: Option<Room>,
    /// Stop after this step.
    pub until: u64,
    /// The lines.
    pub lines: Vec<String>,
}

/// One seed's simulation.
pub struct World {
    pub(crate) rng: Rng,
    pub(crate) sc: Scenario,
    pub(crate) clock: Clock,
    queue: BinaryHeap<Item>,
    seq: u64,
    pub(crate) net: Net,
    pub(crate) data: Data,
    pub(crate) prefills: Vec<PrefillNode>,
    pub(crate) decodes: Vec<DecodeNode>,
    pub(crate) rooms: BTreeMap<Room, RoomRec>,
    spawned: u32,
    room_base: u64,
    /// Invariant checks and violations.
    pub check: Checker,
    /// Steps taken.
    pub steps: u64,
    /// How often the rarer paths ran.
    pub stats: Stats,
    pub(crate) mutant: Option<Mutant>,
    pub(crate) trace: Option<Trace>,
    pub(crate) dacts: Vec<DecodeAction>,
    /// When each prefill rank (its current process) was last told that a transfer towards a
    /// decode incarnation failed as a peer failure, by (prefill rank, decode rank, decode
    /// incarnation): what [`Inv::SessionDeadOwnIncarnation`] accepts as a reason for failing
    /// that incarnation's rooms as its session dead.
    pub(crate) peer_failures: BTreeMap<(u32, u32, u32), Nanos>,
}

/// Prefill rank `p`'s inbox.
pub fn prefill_endpoint(p: u32) -> Endpoint {
    Endpoint::new(format!("10.0.0.{}", p + 1), 16000 + p as u16)
}

/// Records `now` as `room`'s status in `last` (dropping it once the manager no longer holds the
/// room) and returns the previous and new status with whether the step keeps the status
/// monotonic (it never goes down, and Failed sticks).
pub(crate) fn status_step(
    last: &mut BTreeMap<Room, KVPoll>,
    room: Room,
    now: Option<KVPoll>,
) -> Option<(KVPoll, KVPoll, bool)> {
    let prev = match now {
        Some(s) => last.insert(room, s),
        None => last.remove(&room),
    }?;
    let now = now?;
    let ok = if prev == KVPoll::Failed {
        now == KVPoll::Failed
    } else {
        now == KVPoll::Failed || now >= prev
    };
    Some((prev, now, ok))
}

/// Decode rank `d`'s inbox.
pub fn decode_endpoint(d: u32) -> Endpoint {
    Endpoint::new(format!("10.1.0.{}", d + 1), 17000 + d as u16)
}

/// Decode rank `d`'s data-plane session id in incarnation `inc`: the same address across
/// restarts, naming the incarnation as kvx's listeners name their process instance
/// (`host:port#instance`, `kvx_core::peer::split_instance`) — or, when `fixed`, the address
/// alone in every incarnation, as sglang's decodes publish their Mooncake session.
pub fn decode_session(d: u32, inc: u32, fixed: bool) -> SessionId {
    let addr = format!("10.1.0.{}:{}", d + 1, 18000 + d);
    if fixed {
        SessionId::new(addr)
    } else {
        SessionId::new(format!("{addr}#{inc:016x}"))
    }
}

/// The decode rank a session id names, with the incarnation when the id names one (`None` for
/// an id no decode publishes).
pub fn session_decode(session: &SessionId, decodes: u32) -> Option<(u32, Option<u32>)> {
    let d = (0..decodes).find(|&d| decode_session(d, 0, true).address() == session.address())?;
    let inc = match session.instance() {
        Some(i) => Some(u32::from_str_radix(i, 16).ok()?),
        None => None,
    };
    Some((d, inc))
}

impl World {
    /// The world of `seed`, with `mutant` armed.
    pub fn new(seed: u64, mutant: Option<Mutant>, base: Instant) -> Self {
        let mut rng = Rng::new(seed);
        let mut sc = Scenario::draw(&mut rng);
        sc.draw_features(&mut Rng::new(mix(&[seed, 0x0057_a9e5])));
        sc.data.late_write = mutant == Some(Mutant::LateWrite);
        let mut w = World {
            room_base: (mix(&[seed]) & 0x7fff_ffff) << 24,
            clock: Clock::new(base),
            queue: BinaryHeap::new(),
            seq: 0,
            net: Net::new(sc.net),
            data: Data::new(sc.data),
            prefills: Vec::new(),
            decodes: Vec::new(),
            rooms: BTreeMap::new(),
            spawned: 0,
            check: Checker::default(),
            steps: 0,
            stats: Stats::default(),
            mutant,
            trace: None,
            dacts: Vec::new(),
            peer_failures: BTreeMap::new(),
            rng,
            sc,
        };
        for p in 0..w.sc.prefill_tp {
            let mem = RankMemory::new(
                0x1000_0000_0000 + (u64::from(p) << 34),
                w.sc.prefill_tp,
                p,
                96,
                48,
            );
            let mut node = PrefillNode {
                core: w.new_prefill_core(p, &mem),
                mem,
                inc: 0,
                free_pages: Vec::new(),
                free_rows: Vec::new(),
                rooms: BTreeMap::new(),
                awaiting: BTreeSet::new(),
                last_poll: BTreeMap::new(),
                fatal: false,
                exiting: false,
                down: false,
                tick_at: None,
                workers: w.new_workers(),
                fed: BTreeMap::new(),
            };
            node.reset_pools();
            w.prefills.push(node);
        }
        for d in 0..w.sc.decode_tp {
            let m = map_ranks(&MappingInput {
                prefill_tp: w.sc.prefill_tp,
                prefill_cp: 1,
                prefill_pp: 1,
                decode_tp: w.sc.decode_tp,
                decode_cp: 1,
                decode_pp: 1,
                decode_rank: d,
                decode_pp_rank: 0,
                mla: false,
                all_cp_ranks: false,
            })
            .expect("the simulated TP sizes divide");
            let mem = RankMemory::new(
                0x2000_0000_0000 + (u64::from(d) << 34),
                w.sc.decode_tp,
                d,
                w.sc.decode_pages,
                w.sc.decode_rows,
            );
            let mut node = DecodeNode {
                mgr: w.new_decode_manager(),
                mem,
                inc: 0,
                page_owner: Vec::new(),
                row_owner: Vec::new(),
                free_pages: Vec::new(),
                free_rows: Vec::new(),
                rooms: BTreeMap::new(),
                last_poll: BTreeMap::new(),
                down: false,
                tick_at: None,
                targets: m.targets,
                required_dst: m.required_dst_info_num,
                required_resp: m.required_prefill_response_num,
                stager: None,
            };
            node.reset_pools();
            w.decodes.push(node);
            let stager = w.new_decode_stager(d);
            w.decodes[d as usize].stager = stager;
        }
        for d in 0..w.sc.decode_tp {
            w.register_everywhere(d);
        }
        w.schedule(MS, Ev::Spawn);
        w
    }

    fn new_decode_manager(&self) -> DecodeManager {
        DecodeManager::new(DecodeConfig {
            waiting_timeout: crate::clock::dur(self.sc.waiting_timeout),
        })
    }

    /// Puts `ev` on the queue at `at` (never in the past).
    pub(crate) fn schedule(&mut self, at: Nanos, ev: Ev) {
        let at = at.max(self.clock.now());
        self.seq += 1;
        self.queue.push(Item {
            at,
            seq: self.seq,
            ev,
        });
    }

    /// Sends a control message (through the simulated network).
    pub(crate) fn send(&mut self, from: Node, to: Node, msg: Msg) {
        let now = self.clock.now();
        let times = self.net.send(&mut self.rng, now, from, to, &msg);
        if times.is_empty() {
            self.excuse(msg.room());
            if let (Msg::ChunkReady(c), Node::Decode(d)) = (&msg, to)
                && let Some(rec) = self.rooms.get_mut(&c.room)
            {
                rec.chunk_ready_lost.insert(d);
            }
            self.note_abort(from, to, &msg, true);
            self.trace_line(msg.room(), || {
                format!("  net drops {msg:?} {from:?}->{to:?}")
            });
            return;
        }
        self.note_abort(from, to, &msg, false);
        let (inc, from_inc) = (self.inc_of(to), self.inc_of(from));
        for at in times {
            self.schedule(
                at,
                Ev::Deliver {
                    to,
                    inc,
                    from: (from, from_inc),
                    msg: msg.clone(),
                },
            );
        }
    }

    /// Notes whether a decode's `ABORT` of a room towards a prefill rank was lost (`lost`) or
    /// is on its way (a later one that gets through supersedes a lost one).
    fn note_abort(&mut self, from: Node, to: Node, msg: &Msg, lost: bool) {
        let (Msg::Abort { room, .. }, Node::Decode(d), Node::Prefill(p)) = (msg, from, to) else {
            return;
        };
        if let Some(dr) = self.decodes[d as usize].rooms.get_mut(room) {
            if lost {
                dr.abort_lost.insert(p);
            } else {
                dr.abort_lost.remove(&p);
            }
        }
    }

    fn inc_of(&self, n: Node) -> u32 {
        match n {
            Node::Prefill(p) => self.prefills[p as usize].inc,
            Node::Decode(d) => self.decodes[d as usize].inc,
        }
    }

    /// True while node `n` is down.
    fn is_down(&self, n: Node) -> bool {
        match n {
            Node::Prefill(p) => self.prefills[p as usize].down,
            Node::Decode(d) => self.decodes[d as usize].down,
        }
    }

    /// Marks a room as explained if its decode times out.
    pub(crate) fn excuse(&mut self, room: Option<Room>) {
        if let Some(rec) = room.and_then(|r| self.rooms.get_mut(&r)) {
            rec.excused = true;
        }
    }

    /// Adds a trace line for `room` while replaying.
    pub(crate) fn trace_line(&mut self, room: Option<Room>, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace
            && (room.is_none() || room == t.room)
        {
            let at = self.clock.now();
            t.lines.push(format!(
                "{:>4}.{:06}s step {:>7} {}",
                at / 1_000_000_000,
                (at % 1_000_000_000) / 1_000,
                self.steps,
                line()
            ));
        }
    }

    /// Every decode rank registers with each prefill rank it targets.
    fn register_everywhere(&mut self, d: u32) {
        let targets: Vec<u32> = self.decodes[d as usize]
            .targets
            .iter()
            .map(|t| t.tp_rank)
            .collect();
        for p in targets {
            if !self.prefills[p as usize].down {
                let reg = self.registration(d);
                self.send(
                    Node::Decode(d),
                    Node::Prefill(p),
                    Msg::Register(Box::new(reg)),
                );
            }
        }
    }

    /// Runs until the queue is empty, the first violation, or the trace's stop step.
    pub fn run(&mut self) {
        while let Some(item) = self.queue.pop() {
            self.clock.advance_to(item.at);
            self.steps += 1;
            self.check.step = self.steps;
            if self.trace.is_some() && (item.ev.is_fault() || item.ev.room().is_some()) {
                let ev = item.ev.clone();
                let room = if ev.is_fault() { None } else { ev.room() };
                self.trace_line(room, || format!("{ev:?}"));
            }
            self.handle(item.ev);
            if !self.check.violations.is_empty() {
                return;
            }
            if self.trace.as_ref().is_some_and(|t| self.steps >= t.until) {
                return;
            }
            if self.steps >= STEP_CAP {
                self.check.check(Inv::TerminalInTime, false, None, || {
                    format!("the seed did not quiesce within {STEP_CAP} steps")
                });
                return;
            }
        }
        self.final_checks();
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Spawn => self.spawn(),
            // A dead process's messages still in flight arrive while it is down, never after
            // its next incarnation started (its connection was reset before that).
            Ev::Deliver { from, msg, .. }
                if self.inc_of(from.0) != from.1 && !self.is_down(from.0) =>
            {
                self.excuse(msg.room());
            }
            Ev::Deliver { to, inc, msg, from } => match to {
                Node::Prefill(p) => {
                    let n = &self.prefills[p as usize];
                    if n.inc != inc || n.down {
                        self.excuse(msg.room());
                    } else {
                        self.prefill_receive(p, msg);
                    }
                }
                Node::Decode(d) => {
                    let n = &self.decodes[d as usize];
                    if n.inc != inc || n.down {
                        self.excuse(msg.room());
                    } else {
                        let p = match from.0 {
                            Node::Prefill(p) => p,
                            Node::Decode(_) => return,
                        };
                        self.decode_receive(d, p, msg);
                    }
                }
            },
            Ev::Open { p, inc, room } => self.prefill_open(p, inc, room),
            Ev::Chunk { p, inc, room, k } => self.prefill_chunk(p, inc, room, k),
            Ev::PrefillTick { p, inc } => self.prefill_tick(p, inc),
            Ev::DecodeTick { d, inc } => self.decode_tick(d, inc),
            Ev::Data(DataEv::Land { key, win }) => {
                let (landing, answer) = self.data.land(key, win);
                if let Some(l) = landing {
                    self.apply_landing(&l);
                }
                if let Some(a) = answer {
                    self.answer_later(a);
                }
            }
            Ev::Data(DataEv::ConnFail { p, d, conn, gen_ }) => {
                let mut out = Vec::new();
                self.data.conn_fail(p, d, conn, gen_, &mut out);
                for a in out {
                    self.answer_later(a);
                }
            }
            Ev::Answer(a) => self.prefill_answer(a),
            Ev::DecodeAbort { room } => {
                for d in 0..self.sc.decode_tp {
                    self.decode_local_abort(d, room);
                }
            }
            Ev::PrefillAbort { room } => {
                for p in 0..self.sc.prefill_tp {
                    self.prefill_local_abort(p, room);
                }
            }
            Ev::Release { d, inc, room } => {
                if self.decodes[d as usize].inc == inc {
                    self.decode_release_timeout(d, room);
                }
            }
            Ev::Fatal { p } => self.prefill_fatal(p),
            Ev::PrefillExit { p } => self.prefill_exit(p),
            Ev::PrefillRestart { p } => self.prefill_restart(p),
            Ev::HeartbeatLost { d } => self.decode_heartbeat_lost(d),
            Ev::GoneProbe { d, inc, room } => self.decode_gone_probe(d, inc, room),
            Ev::AbortResend { d, inc, room, gap } => self.decode_abort_resend(d, inc, room, gap),
            Ev::DecodeCrash { d } => self.decode_crash(d),
            Ev::DecodeRestart { d } => self.decode_restart(d),
            Ev::Pump { p, inc, shard } => self.worker_pump(p, inc, shard),
            Ev::Connected { p, inc, shard, id } => self.worker_connected(p, inc, shard, id),
            Ev::Probe {
                p,
                inc,
                session,
                retry,
            } => self.prefill_probe(p, inc, session, retry),
            Ev::ScatterCopy {
                d,
                inc,
                job,
                slot,
                routed,
            } => self.decode_late_copy(d, inc, &job, slot, &routed),
        }
    }

    /// Schedules a batch answer at the prefill driver (the worker → loop hop).
    pub(crate) fn answer_later(&mut self, a: Answer) {
        let at = self.clock.now() + self.rng.range(US, 20 * US);
        self.schedule(at, Ev::Answer(a));
    }

    /// The router starts a room on every decode and prefill rank.
    fn spawn(&mut self) {
        if self.spawned >= self.sc.rooms {
            return;
        }
        let now = self.clock.now();
        let n = self.rng.range(0, self.sc.max_pages) as usize;
        let busy =
            self.prefills.iter().any(|x| x.down || x.fatal) || self.decodes.iter().any(|x| x.down);
        let fits = self
            .decodes
            .iter()
            .all(|x| x.free_pages.len() >= n && !x.free_rows.is_empty())
            && self
                .prefills
                .iter()
                .all(|x| x.free_pages.len() >= n && !x.free_rows.is_empty());
        if busy || !fits {
            self.schedule(now + 5 * MS, Ev::Spawn);
            return;
        }
        self.spawned += 1;
        let room = Room::new(self.room_base | u64::from(self.spawned)).expect("non-zero room");
        // Chunks: up to three, cut at random pages; sometimes an extra empty last chunk.
        let mut cuts: Vec<usize> = Vec::new();
        if n > 1 {
            for _ in 0..self.rng.below(3) {
                cuts.push(self.rng.range(1, n as u64 - 1) as usize);
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = Vec::new();
        let mut at = 0;
        for c in cuts.into_iter().chain([n]) {
            chunks.push((at, c));
            at = c;
        }
        if self.rng.below(4) == 0 {
            chunks.push((n, n));
        }
        self.rooms.insert(
            room,
            RoomRec {
                spawned: now,
                n,
                chunks,
                ..RoomRec::default()
            },
        );
        for d in 0..self.sc.decode_tp {
            self.decode_create(d, room);
        }
        for p in 0..self.sc.prefill_tp {
            let at = now + self.rng.range(0, 2 * MS);
            let inc = self.prefills[p as usize].inc;
            self.schedule(at, Ev::Open { p, inc, room });
        }
        let window = 40 * MS;
        if self.rng.chance(self.sc.decode_abort_ppm) {
            let at = now + self.rng.range(0, window);
            self.schedule(at, Ev::DecodeAbort { room });
        }
        if self.rng.chance(self.sc.prefill_abort_ppm) {
            let at = now + self.rng.range(0, window);
            self.schedule(at, Ev::PrefillAbort { room });
        }
        if self.rng.chance(self.sc.fatal_ppm) {
            let p = self.rng.below(u64::from(self.sc.prefill_tp)) as u32;
            let at = now + self.rng.range(0, window);
            self.schedule(at, Ev::Fatal { p });
        }
        if self.rng.chance(self.sc.decode_crash_ppm) {
            let d = self.rng.below(u64::from(self.sc.decode_tp)) as u32;
            let at = now + self.rng.range(0, window);
            self.schedule(at, Ev::DecodeCrash { d });
        }
        let gap = self.rng.range(0, 2 * self.sc.spawn_gap);
        self.schedule(now + gap, Ev::Spawn);
    }

    /// Every room terminal in time, nothing left anywhere.
    fn final_checks(&mut self) {
        let deadline = self.sc.room_deadline();
        let rooms = std::mem::take(&mut self.rooms);
        for (room, rec) in &rooms {
            for (&p, &inc) in &rec.p_open {
                let done = rec.p_done.get(&p);
                let gone = self.prefills[p as usize].inc != inc;
                self.check.check(
                    Inv::TerminalInTime,
                    done.is_some() || gone,
                    Some(*room),
                    || format!("prefill rank {p} never concluded the room"),
                );
                if let Some(&(_, at)) = done {
                    self.check.check(
                        Inv::TerminalInTime,
                        at - rec.spawned <= deadline,
                        Some(*room),
                        || {
                            format!(
                                "prefill rank {p} concluded {} ms after the spawn",
                                (at - rec.spawned) / MS
                            )
                        },
                    );
                }
            }
            for &d in &rec.d_open {
                let done = rec.d_done.get(&d);
                let ok = done.is_some() || rec.d_crashed.contains(&d);
                self.check.check(Inv::TerminalInTime, ok, Some(*room), || {
                    format!("decode rank {d} never concluded the room")
                });
                if let Some(&(_, at)) = done {
                    self.check.check(
                        Inv::TerminalInTime,
                        at - rec.spawned <= deadline,
                        Some(*room),
                        || {
                            format!(
                                "decode rank {d} concluded {} ms after the spawn",
                                (at - rec.spawned) / MS
                            )
                        },
                    );
                }
            }
        }
        self.rooms = rooms;
        for p in 0..self.prefills.len() {
            let n = &self.prefills[p];
            if n.down {
                continue;
            }
            let live = n.core.manager().live_entries();
            let held = n.rooms.len() + n.awaiting.len();
            let free =
                n.free_pages.len() as u64 == n.mem.pages && n.free_rows.len() as u64 == n.mem.rows;
            self.check.check(Inv::NoLeak, live.is_empty(), None, || {
                format!("prefill rank {p}: manager holds {live:?}")
            });
            self.check.check(Inv::NoLeak, held == 0 && free, None, || {
                format!("prefill rank {p}: driver holds {held} rooms, pages/rows all free: {free}")
            });
            if let Some(st) = n.core.staging() {
                let idle = st.is_idle() && n.fed.is_empty();
                self.check.check(Inv::NoLeak, idle, None, || {
                    format!(
                        "prefill rank {p}: its staging holds {} rooms, {} parked chunks, {} fed chunks",
                        st.room_count(),
                        st.parked_count(),
                        n.fed.len()
                    )
                });
            }
            let jobs = n.workers.posted();
            self.check.check(Inv::NoLeak, jobs == 0, None, || {
                format!("prefill rank {p}: its workers hold {jobs} jobs")
            });
        }
        for d in 0..self.decodes.len() {
            let n = &self.decodes[d];
            let live = n.mgr.live_entries();
            let unreleased = n.rooms.values().filter(|r| !r.released).count();
            self.check.check(Inv::NoLeak, live == 0, None, || {
                format!("decode rank {d}: manager holds {live} entries")
            });
            self.check.check(Inv::NoLeak, unreleased == 0, None, || {
                format!("decode rank {d}: {unreleased} rooms still hold pages")
            });
            if let Some(st) = &n.stager {
                let held = st.held();
                self.check.check(Inv::NoLeak, held.is_none(), None, || {
                    format!(
                        "decode rank {d}: its ring holds {}",
                        held.unwrap_or_default()
                    )
                });
            }
        }
        let out = self.data.outstanding();
        self.check.check(Inv::NoLeak, out == 0, None, || {
            format!("{out} batches outstanding in the data plane")
        });
    }
}
