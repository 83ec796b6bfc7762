//! The simulated data plane: kvx-rdma's `Transport` contract with faults.
//!
//! A batch posted to a decode session is cut into windows of at most `window_ops` ops, spread
//! round-robin over the session's connections; on one connection windows land in order, each
//! after its own latency (some slow). Faults: a write the decode rejects (the window lands
//! nothing; a per-room error), a connection that fails (every window on it that has not landed
//! fails; the others keep landing), and a peer that dies (every connection to it fails, and a
//! batch posted while it is down fails at once; in seeds with `Scenario::crash_detect` the world
//! delivers the failures of the batches in flight only after a detection delay). The contract
//! — what the managers rely on — is that a batch is answered only once nothing of it can still
//! reach the peer, i.e. when every window landed or failed. The `late-write` mutant breaks exactly that. A staged chunk is one
//! write whose bytes were gathered when its worker started it ([`Job::Stage`], [`Write::payload`]).

use std::collections::{BTreeMap, BTreeSet};

use kvx_core::{Room, TransferOp};

use crate::clock::{Nanos, US};
use crate::rng::Rng;

/// Latencies and faults of the data plane.
#[derive(Clone, Copy, Debug)]
pub struct DataConfig {
    /// Connections per session.
    pub conns: usize,
    /// Ops per window.
    pub window_ops: usize,
    /// Shortest window latency.
    pub min_lat: Nanos,
    /// Longest ordinary window latency.
    pub max_lat: Nanos,
    /// Chance (ppm per window) of a slow window.
    pub slow_ppm: u32,
    /// Longest slow latency.
    pub slow_max: Nanos,
    /// Chance (ppm per batch) that one of its connections fails while it is in flight.
    pub conn_fail_ppm: u32,
    /// Chance (ppm per window) that the decode rejects it.
    pub reject_ppm: u32,
    /// Answer a failing batch at its first failure (the `late-write` mutant).
    pub late_write: bool,
}

/// How a batch ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchResult {
    /// Every window landed.
    Ok,
    /// A connection failed (a peer failure: the driver reports `BatchDone(Err)`).
    Lost(String),
    /// The decode rejected a write (a per-room failure: `SenderFailed`, then `BatchDone(Ok)`).
    Rejected(String),
}

/// What a posted batch carries out for the prefill driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Job {
    /// A manager batch (`PostBatch`): its ops copy prefill memory to decode memory; `job` is the
    /// prefill worker's id for it.
    Batch {
        /// The worker's job id.
        job: u64,
    },
    /// A staged chunk's one write into the decode's ring (the worker's job `job`, the chunk
    /// `chunk` of the grid); its bytes were gathered when the worker started it.
    Stage {
        /// The worker's job id.
        job: u64,
        /// The chunk index.
        chunk: u32,
    },
}

impl Job {
    /// The prefill worker's id for the job.
    pub fn job(&self) -> u64 {
        match self {
            Job::Batch { job } | Job::Stage { job, .. } => *job,
        }
    }
}

/// A post to the data plane.
#[derive(Clone, Debug)]
pub struct Write {
    /// The room.
    pub room: Room,
    /// What it carries out.
    pub id: Job,
    /// The writes.
    pub ops: Vec<TransferOp>,
    /// For a staged chunk, the gathered bytes of its one op.
    pub payload: Option<Vec<u8>>,
}

/// A batch's answer, for the prefill driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Prefill rank.
    pub p: u32,
    /// Its incarnation at post time.
    pub p_inc: u32,
    /// The room.
    pub room: Room,
    /// What the batch carried out.
    pub id: Job,
    /// The outcome.
    pub result: BatchResult,
}

/// Something the data plane schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataEv {
    /// Window `win` of batch `key` reaches the peer.
    Land {
        /// Batch key.
        key: u64,
        /// Window index.
        win: usize,
    },
    /// Connection `conn` of session (p, d) fails, if still at generation `gen`.
    ConnFail {
        /// Prefill rank.
        p: u32,
        /// Decode rank.
        d: u32,
        /// Connection index.
        conn: usize,
        /// Connection generation.
        gen_: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WinState {
    Pending,
    Landed,
    Failed,
}

#[derive(Clone, Debug)]
struct Window {
    ops: Vec<TransferOp>,
    conn: usize,
    state: WinState,
    reject: bool,
}

/// One posted batch.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Prefill rank.
    pub p: u32,
    /// Prefill incarnation.
    pub p_inc: u32,
    /// Decode rank.
    pub d: u32,
    /// Decode incarnation the windows go to.
    pub d_inc: u32,
    /// The room.
    pub room: Room,
    /// What it carries out.
    pub id: Job,
    payload: Option<Vec<u8>>,
    windows: Vec<Window>,
    pending: usize,
    lost: bool,
    rejected: bool,
    answered: bool,
}

#[derive(Clone, Debug, Default)]
struct Conn {
    gen_: u64,
    last: Nanos,
    inflight: BTreeSet<(u64, usize)>,
}

/// The data plane of one run.
#[derive(Clone, Debug)]
pub struct Data {
    cfg: DataConfig,
    next_key: u64,
    batches: BTreeMap<u64, Batch>,
    conns: BTreeMap<(u32, u32), Vec<Conn>>,
    down: BTreeSet<u32>,
}

/// What a landing window does.
#[derive(Clone, Debug)]
pub struct Landing {
    /// Prefill rank (source memory).
    pub p: u32,
    /// Decode rank (destination memory).
    pub d: u32,
    /// Decode incarnation.
    pub d_inc: u32,
    /// The room.
    pub room: Room,
    /// The writes.
    pub ops: Vec<TransferOp>,
    /// What the batch carries out.
    pub id: Job,
    /// A staged chunk's bytes (its one op's source), else `None`: the ops read prefill memory.
    pub payload: Option<Vec<u8>>,
}

impl Data {
    /// A data plane with `cfg`.
    pub fn new(cfg: DataConfig) -> Self {
        Data {
            cfg,
            next_key: 0,
            batches: BTreeMap::new(),
            conns: BTreeMap::new(),
            down: BTreeSet::new(),
        }
    }

    /// Batches not yet answered or with windows still pending.
    pub fn outstanding(&self) -> usize {
        self.batches.len()
    }

    /// Posts a batch; returns what to schedule, or an immediate answer (peer down).
    pub fn post(
        &mut self,
        rng: &mut Rng,
        now: Nanos,
        (p, p_inc): (u32, u32),
        (d, d_inc): (u32, u32),
        write: Write,
        sched: &mut Vec<(Nanos, DataEv)>,
    ) -> Option<Answer> {
        let Write {
            room,
            id,
            ops,
            payload,
        } = write;
        if self.down.contains(&d) {
            return Some(Answer {
                p,
                p_inc,
                room,
                id,
                result: BatchResult::Lost("peer unreachable".into()),
            });
        }
        let c = self.cfg;
        let key = self.next_key;
        self.next_key += 1;
        let conns = self
            .conns
            .entry((p, d))
            .or_insert_with(|| vec![Conn::default(); c.conns]);
        let first = rng.below(c.conns as u64) as usize;
        let mut windows = Vec::new();
        for (i, chunk) in ops.chunks(c.window_ops.max(1)).enumerate() {
            let conn = (first + i) % c.conns;
            let lat = if rng.chance(c.slow_ppm) {
                rng.range(c.max_lat, c.slow_max)
            } else {
                rng.range(c.min_lat, c.max_lat)
            };
            let at = (now + lat).max(conns[conn].last + US);
            conns[conn].last = at;
            conns[conn].inflight.insert((key, i));
            sched.push((at, DataEv::Land { key, win: i }));
            windows.push(Window {
                ops: chunk.to_vec(),
                conn,
                state: WinState::Pending,
                reject: rng.chance(c.reject_ppm),
            });
        }
        if !windows.is_empty() && rng.chance(c.conn_fail_ppm) {
            let conn = rng.below(c.conns as u64) as usize;
            let at = now + rng.range(0, 2 * c.max_lat);
            sched.push((
                at,
                DataEv::ConnFail {
                    p,
                    d,
                    conn,
                    gen_: conns[conn].gen_,
                },
            ));
        }
        let pending = windows.len();
        let batch = Batch {
            p,
            p_inc,
            d,
            d_inc,
            room,
            id,
            payload,
            windows,
            pending,
            lost: false,
            rejected: false,
            answered: false,
        };
        if pending == 0 {
            return Some(Answer {
                p,
                p_inc,
                room,
                id,
                result: BatchResult::Ok,
            });
        }
        self.batches.insert(key, batch);
        None
    }

    /// A window reaches the peer: the writes to apply (none when it was rejected or had
    /// failed before), and the batch's answer when it was the last thing pending.
    pub fn land(&mut self, key: u64, win: usize) -> (Option<Landing>, Option<Answer>) {
        let Some(b) = self.batches.get_mut(&key) else {
            return (None, None);
        };
        let w = &mut b.windows[win];
        if w.state != WinState::Pending {
            return (None, None);
        }
        if let Some(conns) = self.conns.get_mut(&(b.p, b.d)) {
            conns[w.conn].inflight.remove(&(key, win));
        }
        b.pending -= 1;
        let landing = if w.reject {
            w.state = WinState::Failed;
            b.rejected = true;
            None
        } else {
            w.state = WinState::Landed;
            Some(Landing {
                p: b.p,
                d: b.d,
                d_inc: b.d_inc,
                room: b.room,
                ops: w.ops.clone(),
                id: b.id,
                payload: b.payload.clone(),
            })
        };
        let answer = self.settle(key);
        (landing, answer)
    }

    /// Connection `conn` of (p, d) fails (if still at `gen_`): its pending windows fail.
    pub fn conn_fail(&mut self, p: u32, d: u32, conn: usize, gen_: u64, out: &mut Vec<Answer>) {
        let Some(conns) = self.conns.get_mut(&(p, d)) else {
            return;
        };
        let Some(c) = conns.get_mut(conn) else {
            return;
        };
        if c.gen_ != gen_ {
            return;
        }
        c.gen_ += 1;
        let failed = std::mem::take(&mut c.inflight);
        for (key, win) in failed {
            if let Some(b) = self.batches.get_mut(&key) {
                let w = &mut b.windows[win];
                if w.state == WinState::Pending {
                    w.state = WinState::Failed;
                    b.pending -= 1;
                    b.lost = true;
                }
            }
            out.extend(self.settle(key));
        }
    }

    /// Decode rank `d` dies: every connection to it fails; posts fail until [`Data::revive`].
    pub fn crash(&mut self, d: u32, out: &mut Vec<Answer>) {
        self.down.insert(d);
        let sessions: Vec<(u32, u32)> = self.conns.keys().copied().filter(|k| k.1 == d).collect();
        for (p, d) in sessions {
            let n = self.conns.get(&(p, d)).map_or(0, Vec::len);
            for conn in 0..n {
                let gen_ = self.conns[&(p, d)][conn].gen_;
                self.conn_fail(p, d, conn, gen_, out);
            }
        }
    }

    /// Decode rank `d` is back (same session id): new connections on the next post.
    pub fn revive(&mut self, d: u32) {
        self.down.remove(&d);
    }

    /// Answers a batch once nothing of it is pending (or at its first failure under the
    /// `late-write` mutant); forgets it once answered and drained.
    fn settle(&mut self, key: u64) -> Option<Answer> {
        let b = self.batches.get_mut(&key)?;
        let failed = b.lost || b.rejected;
        let due = b.pending == 0 || (self.cfg.late_write && failed);
        let mut answer = None;
        if due && !b.answered {
            b.answered = true;
            let result = if b.lost {
                BatchResult::Lost("connection reset by peer".into())
            } else if b.rejected {
                BatchResult::Rejected("remote rejected the write".into())
            } else {
                BatchResult::Ok
            };
            answer = Some(Answer {
                p: b.p,
                p_inc: b.p_inc,
                room: b.room,
                id: b.id,
                result,
            });
        }
        if b.pending == 0 {
            self.batches.remove(&key);
        }
        answer
    }
}
