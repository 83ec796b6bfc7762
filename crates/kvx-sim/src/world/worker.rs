//! A prefill rank's transfer workers in the simulated world, played as kvx-engine's `worker.rs`
//! runs them: one FIFO queue per shard (the core picks the shard), each worker keeping up to
//! [`DEPTH`] jobs posted to the data plane per decode session and [`MAX_POSTED`] in all — a
//! job whose session is at its depth waits, with its session's later jobs, while other
//! sessions' jobs pass it (at most [`MAX_HELD`] passed over); a staged chunk gathered into the
//! staging buffer alone, and nothing passes it —, skipping a job whose room's
//! cancel flag (set by the core) is up when it takes it, and reporting each job to the core once
//! the data plane answered it (the engine answers a session's batches in post order; reporting
//! each at once is a superset of those timings: the data plane's answers are delayed at
//! random). A `Work::Connect` holds its session's later jobs for a handshake (two round trips
//! of the data plane) while other sessions' jobs go on, and is not reported. A worker hit by a
//! fatal fault stops taking jobs, answers what it posted and waits for its handshakes, then
//! reports its death; the core restarts it or buries its shard. (A batch towards a session not
//! open opens it at once here; the engine opens it first, as for a `Work::Connect`.)
//!
//! The workers' dead-session marks are kvx-engine's real [`SessionMarks`], one per prefill
//! process shared by its shards (as the engine's workers share theirs), with the seed's
//! failed-session TTL: a peer failure of a job (a lost batch, a failed connect) marks its
//! session with `began` = when the data session it went on was opened (as the engine's
//! `completed` and `opened` do), a job whose session is marked is reported
//! `Outcome::PeerFailed` without a write, and the core's `Output::Revive` (a registration)
//! clears the mark. Each shard caches its data sessions as the engine's worker does (opened
//! anew once idle [`SESSION_IDLE`], after its session registered again, or after a peer
//! failure on it), so `began` is what the engine would pass; a `Work::Connect` finding its
//! session marked dead, or open, does nothing, else it opens one: a handshake that fails
//! towards a decode that is down (after a connect timeout of up to `Scenario::crash_detect`
//! in seeds that draw one) or an id naming an earlier process.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;

use kvx_core::{Room, SessionId, TransferOp};
use kvx_engine::fault::WorkerFault;
use kvx_engine::worker::{
    DEPTH, Job, MAX_HELD, MAX_POSTED, Outcome, SESSION_IDLE, SessionMarks, Work,
};

use super::{Ev, World};
use crate::clock::{MS, Nanos, US};

/// A job that waited this long in its queue waited behind slow writes (a fault); in a fault-free
/// seed none waits nearly as long.
const QUEUED_LONG: Nanos = 500 * MS;
use crate::data::{Answer, BatchResult, Job as DataJob, Write};

/// A worker's open data session towards one decode (the engine's `Cached`).
#[derive(Clone, Copy, Debug)]
struct Cached {
    /// When it was opened (the `began` of a failure of a job posted on it).
    opened: Nanos,
    /// When a job last used it (closed after [`SESSION_IDLE`]).
    used: Nanos,
}

/// A `Work::Connect` whose handshake the worker waits for.
#[derive(Clone, Debug)]
struct Connecting {
    /// The connect job.
    id: u64,
    /// Its decode session.
    session: SessionId,
    /// The room whose metadata asked for it.
    room: Room,
    /// When the open began.
    began: Nanos,
    /// Why the open fails, decided as it began (the decode was down, or the id names an
    /// earlier process), reported when the handshake ends.
    failure: Option<String>,
}

/// One shard's worker and queue.
#[derive(Debug, Default)]
struct Shard {
    /// Job ids waiting for the worker, in post order.
    queue: VecDeque<u64>,
    /// Jobs posted to the data plane and not answered yet.
    posted: usize,
    /// Of `posted`, those towards each decode session.
    posted_to: BTreeMap<SessionId, usize>,
    /// The posted job is a staged chunk gathered into the staging buffer (it runs alone).
    alone: bool,
    /// A fatal fault hit the worker: it takes nothing more and dies once `posted` is 0.
    dying: bool,
    /// The worker is gone for good (its shard was buried).
    dead: bool,
    /// A pump of this shard is scheduled.
    pump: bool,
    /// The `Work::Connect`s whose handshake the worker waits for, by session (the session's
    /// later jobs wait for it; other sessions' go on).
    connecting: BTreeMap<SessionId, Connecting>,
    /// The worker's open data sessions.
    sessions: BTreeMap<SessionId, Cached>,
}

/// The workers of one prefill rank.
#[derive(Debug, Default)]
pub struct Workers {
    shards: Vec<Shard>,
    /// Every job between its post and its report, with its shard.
    jobs: BTreeMap<u64, (usize, Job)>,
    /// When each queued job was posted (until its worker takes it).
    queued_at: BTreeMap<u64, Nanos>,
    /// For each job posted to the data plane, when the data session it went on was opened.
    began: BTreeMap<u64, Nanos>,
    /// The rank's dead-session marks (kvx-engine's, shared by every shard).
    marks: SessionMarks,
    next: u64,
}

impl Workers {
    /// `queues` idle workers whose session marks are `marks`.
    pub fn new(queues: usize, marks: SessionMarks) -> Self {
        Workers {
            shards: (0..queues.max(1)).map(|_| Shard::default()).collect(),
            jobs: BTreeMap::new(),
            queued_at: BTreeMap::new(),
            began: BTreeMap::new(),
            marks,
            next: 0,
        }
    }

    /// Jobs posted or queued and not reported yet.
    pub fn posted(&self) -> usize {
        self.jobs.len()
    }

    /// Of [`Workers::posted`], the jobs that write (a `Work::Connect` still queued when the
    /// process exits writes nothing).
    pub fn writes_posted(&self) -> usize {
        self.jobs
            .values()
            .filter(|(_, j)| !matches!(j.work, Work::Connect))
            .count()
    }

    /// Shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }
}

impl World {
    /// The workers of a new prefill process: idle, no session marked, marks lasting the seed's
    /// failed-session TTL (the manager's, as the engine's marks last the manager's default),
    /// registrations remembered as long as the engine remembers them, the `stale-mark` mutant
    /// armed in them.
    pub(crate) fn new_workers(&self) -> Workers {
        #[allow(unused_mut)]
        let mut marks = SessionMarks::with_ttl(crate::clock::dur(self.sc.failed_session_ttl));
        #[cfg(feature = "mutants")]
        marks.set_sim_stale_mark(self.mutant == Some(crate::mutants::Mutant::StaleMark));
        Workers::new(self.sc.queues as usize, marks)
    }

    /// `Output::Revive`: `session` registered again; the workers forget that it failed.
    pub(crate) fn worker_revive(&mut self, p: u32, session: &SessionId) {
        let now = self.clock.instant();
        self.prefills[p as usize].workers.marks.revive(session, now);
    }

    /// A peer failure of prefill rank `p` towards `session` for `room` (a lost batch, a failed
    /// connect) was seen: the incarnation it was meant for may have its rooms failed as their
    /// session dead ([`crate::invariants::Inv::SessionDeadOwnIncarnation`]).
    fn note_peer_failure(&mut self, p: u32, session: &SessionId, room: Room) {
        if let Some((d, d_inc)) = self.write_target(session, room) {
            let now = self.clock.now();
            self.peer_failures.insert((p, d, d_inc), now);
            let n = &self.decodes[d as usize];
            if n.inc != d_inc && !n.down {
                self.stats.stale_failures += 1;
            }
        }
    }

    /// The engine's `mark_dead` after an attempt of rank `p` on `session` that began at `began`
    /// failed now.
    fn mark_dead(&mut self, p: u32, session: &SessionId, cause: &str, began: Nanos) {
        let (began, now) = (self.clock.at(began), self.clock.instant());
        let marks = &mut self.prefills[p as usize].workers.marks;
        let marked = marks.mark_dead(session, cause, began, now);
        if !marked {
            // A failure of the session's earlier registration: nothing marked.
            self.stats.unmarked_failures += 1;
        }
        self.trace_line(None, || {
            let what = if marked {
                "marks it dead"
            } else {
                "marks nothing (it registered since)"
            };
            format!("  prefill {p}'s workers: an attempt on {session} failed ({cause}): {what}")
        });
    }

    /// True when a job of `room` has waited [`QUEUED_LONG`] in a prefill worker's queue in a
    /// faulty seed (behind slow writes of other rooms: its decode may time out).
    pub(crate) fn queued_long(&self, room: kvx_core::Room) -> bool {
        let now = self.clock.now();
        self.sc.faulty
            && self.prefills.iter().any(|n| {
                n.workers.queued_at.iter().any(|(id, &t)| {
                    now.saturating_sub(t) >= QUEUED_LONG
                        && n.workers.jobs.get(id).is_some_and(|(_, j)| j.room == room)
                })
            })
    }

    /// Job `id` of `room` leaves its queue (taken by the worker, or buried with the shard): one
    /// that waited [`QUEUED_LONG`] waited behind slow writes of other rooms on the same shard
    /// (one session's rooms share a queue, as in the engine), so its decode may time out.
    fn dequeued(&mut self, p: u32, id: u64, room: kvx_core::Room) {
        let queued = self.prefills[p as usize].workers.queued_at.remove(&id);
        if queued.is_some_and(|t| self.clock.now().saturating_sub(t) >= QUEUED_LONG)
            && self.sc.faulty
        {
            self.excuse(Some(room));
        }
    }

    /// `Output::Post`: the job joins its shard's queue.
    pub(crate) fn worker_post(&mut self, p: u32, shard: usize, job: Job) {
        let w = &mut self.prefills[p as usize].workers;
        let id = w.next;
        w.next += 1;
        w.jobs.insert(id, (shard, job));
        w.queued_at.insert(id, self.clock.now());
        if let Some(s) = w.shards.get_mut(shard) {
            s.queue.push_back(id);
        }
        self.schedule_pump(p, shard);
    }

    /// Wakes the worker of `shard` a moment later (the thread hop of a queue).
    fn schedule_pump(&mut self, p: u32, shard: usize) {
        let n = &mut self.prefills[p as usize];
        let Some(s) = n.workers.shards.get_mut(shard) else {
            return;
        };
        if s.pump {
            return;
        }
        s.pump = true;
        let inc = n.inc;
        let at = self.clock.now() + self.rng.range(US, 20 * US);
        self.schedule(at, Ev::Pump { p, inc, shard });
    }

    /// The worker of `shard` takes jobs while it may post more.
    pub(crate) fn worker_pump(&mut self, p: u32, inc: u32, shard: usize) {
        if self.prefills[p as usize].inc != inc || self.prefills[p as usize].down {
            return;
        }
        if let Some(s) = self.prefills[p as usize].workers.shards.get_mut(shard) {
            s.pump = false;
        }
        loop {
            let w = &mut self.prefills[p as usize].workers;
            let Some(s) = w.shards.get_mut(shard) else {
                return;
            };
            if s.dying || s.dead || s.alone || s.posted + s.connecting.len() >= MAX_POSTED {
                return;
            }
            // The engine's `next_job`: the first job in queue order that may start — its
            // session has fewer than DEPTH batches posted and no earlier job waiting; the jobs
            // passed over are the ones the engine holds (at most MAX_HELD); a chunk gathered
            // into the staging buffer starts once nothing is posted, and nothing passes it.
            let mut pick = None;
            let mut waiting: Vec<&SessionId> = Vec::new();
            for (i, id) in s.queue.iter().enumerate() {
                let Some((_, job)) = w.jobs.get(id) else {
                    // Reported meanwhile (buried): dropped below.
                    pick = Some(i);
                    break;
                };
                if job.work.uses_staging_buffer() {
                    if s.posted == 0 && s.connecting.is_empty() {
                        pick = Some(i);
                    }
                    break;
                }
                let posted = s.posted_to.get(&job.session).copied().unwrap_or(0);
                let opening = s.connecting.contains_key(&job.session);
                if !waiting.contains(&&job.session) && !opening && posted < DEPTH {
                    pick = Some(i);
                    break;
                }
                waiting.push(&job.session);
                if waiting.len() >= MAX_HELD {
                    break;
                }
            }
            let Some(i) = pick else {
                return;
            };
            let Some(id) = s.queue.remove(i) else {
                return;
            };
            let Some((_, job)) = w.jobs.get(&id) else {
                continue;
            };
            if i > 0 {
                self.stats.passed_jobs += 1;
            }
            let staged = job.work.uses_staging_buffer();
            let room = job.room;
            let connect = matches!(job.work, Work::Connect);
            self.dequeued(p, id, room);
            if connect {
                // The worker opens its session unless it is marked dead or open (a handshake:
                // two round trips of the data plane), while the session's later jobs wait and
                // other sessions' go on; it reports nothing.
                if let Some((_, job)) = self.prefills[p as usize].workers.jobs.remove(&id) {
                    self.stats.preconnects += 1;
                    self.worker_connect(p, shard, id, &job);
                }
                continue;
            }
            let w = &mut self.prefills[p as usize].workers;
            let Some(s) = w.shards.get_mut(shard) else {
                return;
            };
            let Some((_, job)) = w.jobs.get(&id) else {
                continue;
            };
            if job.cancel.load(Ordering::Acquire) {
                // The room turned terminal while the job was queued: skipped, not written.
                if let Some((_, job)) = w.jobs.remove(&id) {
                    self.stats.skipped_jobs += 1;
                    let room = job.room;
                    self.prefill_call(p, Some(room), |c, now, out| {
                        c.finished(now, job, Outcome::Skipped, out);
                    });
                }
                continue;
            }
            let now = self.clock.instant();
            if let Some(cause) = w.marks.dead_cause(&job.session, now) {
                // A peer failure towards the session was seen (by any shard of the rank):
                // failed without a connect attempt, nothing written.
                s.sessions.remove(&job.session);
                if let Some((_, job)) = w.jobs.remove(&id) {
                    self.stats.marked_skips += 1;
                    let reason = format!(
                        "Decode instance could be dead, remote session {} is not alive ({cause})",
                        job.session
                    );
                    let room = job.room;
                    self.trace_line(Some(room), || {
                        format!("  prefill {p}'s worker {shard}: {reason}")
                    });
                    self.prefill_call(p, Some(room), |c, now, out| {
                        c.finished(now, job, Outcome::PeerFailed(reason), out);
                    });
                }
                continue;
            }
            s.posted += 1;
            *s.posted_to.entry(job.session.clone()).or_default() += 1;
            s.alone = staged;
            self.worker_start(p, id);
        }
    }

    /// The engine's `Work::Connect` `id` on `shard`: nothing when its session is marked dead or
    /// open, else a handshake that holds the session's later jobs (not the worker) and ends in
    /// [`World::worker_connected`].
    fn worker_connect(&mut self, p: u32, shard: usize, id: u64, job: &Job) {
        let (now, at_now) = (self.clock.now(), self.clock.instant());
        let session = &job.session;
        let w = &mut self.prefills[p as usize].workers;
        if w.marks.dead_cause(session, at_now).is_some() {
            return;
        }
        let Some(s) = w.shards.get_mut(shard) else {
            return;
        };
        if let Some(c) = s.sessions.get_mut(session) {
            let open = now.saturating_sub(c.used) < SESSION_IDLE.as_nanos() as Nanos
                && !w.marks.revived_since(session, self.clock.at(c.opened));
            if open {
                c.used = now;
                return;
            }
        }
        // The open reaches the decode at the address now, or finds it down; an id naming an
        // earlier process is refused by the new one (`PeerRestarted`).
        let target = super::session_decode(session, self.sc.decode_tp);
        let failure = target.and_then(|(d, named)| {
            let n = &self.decodes[d as usize];
            if n.down {
                Some(format!("connecting to {session}: peer unreachable"))
            } else if named.is_some_and(|i| i != n.inc) {
                Some(format!(
                    "peer {session} restarted: it is instance {:016x} now",
                    n.inc
                ))
            } else {
                None
            }
        });
        let down = target.is_some_and(|(d, _)| self.decodes[d as usize].down);
        let d = self.sc.data;
        let rtt = self.rng.range(d.min_lat, d.max_lat.max(d.min_lat + 1));
        let mut at = now + 2 * rtt;
        if down && self.sc.crash_detect > 0 {
            // A dead host answers nothing: the connect times out.
            at += self.rng.range(0, self.sc.crash_detect);
        }
        let n = &mut self.prefills[p as usize];
        if let Some(s) = n.workers.shards.get_mut(shard) {
            let c = Connecting {
                id,
                session: session.clone(),
                room: job.room,
                began: now,
                failure,
            };
            s.connecting.insert(session.clone(), c);
        }
        let inc = n.inc;
        self.schedule(at, Ev::Connected { p, inc, shard, id });
    }

    /// Posts job `id` to the data plane (a staged chunk gathered first).
    fn worker_start(&mut self, p: u32, id: u64) {
        // Out of the table while it is started (the gather reads the rank's memory).
        let Some((shard, mut job)) = self.prefills[p as usize].workers.jobs.remove(&id) else {
            return;
        };
        let (room, session) = (job.room, job.session.clone());
        // The engine's `cached`: the shard's cached session unless it idled out or its
        // decode registered again since it was opened, else a fresh one.
        let now = self.clock.now();
        let w = &mut self.prefills[p as usize].workers;
        if let Some(s) = w.shards.get_mut(shard) {
            let cached = s.sessions.get_mut(&session).filter(|c| {
                now.saturating_sub(c.used) < SESSION_IDLE.as_nanos() as Nanos
                    && !w.marks.revived_since(&session, self.clock.at(c.opened))
            });
            let opened = match cached {
                Some(c) => {
                    c.used = now;
                    c.opened
                }
                None => {
                    let c = Cached {
                        opened: now,
                        used: now,
                    };
                    s.sessions.insert(session.clone(), c);
                    now
                }
            };
            w.began.insert(id, opened);
        }
        let write = match &mut job.work {
            Work::Batch { ops, .. } => Write {
                room,
                id: DataJob::Batch { job: id },
                ops: std::mem::take(ops),
                payload: None,
            },
            // Taken off the queue by the pump, never started.
            Work::Connect => return,
            Work::Stage(w) => match self.stage_gather(p, w) {
                Ok(bytes) => Write {
                    room,
                    id: DataJob::Stage {
                        job: id,
                        chunk: w.key.chunk_idx,
                    },
                    ops: vec![TransferOp::new(0, w.dst, w.len)],
                    payload: Some(bytes),
                },
                Err(reason) => {
                    self.prefills[p as usize]
                        .workers
                        .jobs
                        .insert(id, (shard, job));
                    let p_inc = self.prefills[p as usize].inc;
                    let result = BatchResult::Rejected(reason);
                    let id = DataJob::Batch { job: id };
                    self.answer_later(Answer {
                        p,
                        p_inc,
                        room,
                        id,
                        result,
                    });
                    return;
                }
            },
        };
        self.prefills[p as usize]
            .workers
            .jobs
            .insert(id, (shard, job));
        self.post_write(p, &session, write);
    }

    /// The decode rank and incarnation a write of `room` on `session` is meant for: the process
    /// the session id names, or, for an id that names none (`Scenario::fixed_sessions`), the
    /// process that opened the room (its pages are what the write was planned for).
    pub(crate) fn write_target(
        &self,
        session: &kvx_core::SessionId,
        room: kvx_core::Room,
    ) -> Option<(u32, u32)> {
        let (d, named) = super::session_decode(session, self.sc.decode_tp)?;
        let inc = match named {
            Some(inc) => inc,
            None => *self.rooms.get(&room)?.d_inc.get(&d)?,
        };
        Some((d, inc))
    }

    /// Posts a write to the decode its session names; the data plane refuses a write meant for
    /// an earlier incarnation of the process at that address ([`World::write_target`]): the
    /// handshake of a session id naming it (`TransportError::PeerRestarted`), or the new
    /// process's memory keys when the id names no process.
    pub(crate) fn post_write(&mut self, p: u32, session: &kvx_core::SessionId, write: Write) {
        let now = self.clock.now();
        let (d, named) = self
            .write_target(session, write.room)
            .expect("sessions are the decodes', rooms the world's");
        let p_inc = self.prefills[p as usize].inc;
        let d_inc = self.decodes[d as usize].inc;
        if named != d_inc && self.mutant != Some(crate::mutants::Mutant::AnyInstance) {
            self.answer_later(Answer {
                p,
                p_inc,
                room: write.room,
                id: write.id,
                result: BatchResult::Lost(format!(
                    "peer {session} restarted: it is instance {d_inc:016x} now"
                )),
            });
            return;
        }
        let mut sched = Vec::new();
        let answer = self.data.post(
            &mut self.rng,
            now,
            (p, p_inc),
            (d, d_inc),
            write,
            &mut sched,
        );
        for (at, ev) in sched {
            self.schedule(at, Ev::Data(ev));
        }
        if let Some(a) = answer {
            self.answer_later(a);
        }
    }

    /// A job's answer: a lost connection is `Outcome::PeerFailed` (the core blacklists the
    /// session), a rejected write `Outcome::RoomFailed` (only the room fails).
    pub(crate) fn prefill_answer(&mut self, a: Answer) {
        let n = &mut self.prefills[a.p as usize];
        if n.inc != a.p_inc || n.down {
            return;
        }
        let Some((shard, job)) = n.workers.jobs.remove(&a.id.job()) else {
            return;
        };
        let began = n.workers.began.remove(&a.id.job());
        let mut died = false;
        if let Some(s) = n.workers.shards.get_mut(shard) {
            s.posted = s.posted.saturating_sub(1);
            if let Some(n) = s.posted_to.get_mut(&job.session) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    s.posted_to.remove(&job.session);
                }
            }
            s.alone = false;
            died = s.dying && s.posted == 0 && s.connecting.is_empty();
            if matches!(a.result, BatchResult::Lost(_)) {
                // The engine's `completed`: the session is dropped unless it is one opened
                // since, towards the decode's new process.
                let opened = s.sessions.get(&job.session).map(|c| c.opened);
                if opened.is_some() && opened == began {
                    s.sessions.remove(&job.session);
                }
            }
        }
        if let BatchResult::Lost(e) = &a.result {
            let began = began.unwrap_or_else(|| self.clock.now());
            self.mark_dead(a.p, &job.session, e, began);
            self.note_peer_failure(a.p, &job.session, job.room);
        }
        let outcome = match a.result {
            BatchResult::Ok => Outcome::Done,
            BatchResult::Lost(e) => Outcome::PeerFailed(e),
            BatchResult::Rejected(reason) => Outcome::RoomFailed(reason),
        };
        let room = job.room;
        self.prefill_call(a.p, Some(room), |c, now, out| {
            c.finished(now, job, outcome, out);
        });
        if died {
            self.worker_died(a.p, shard);
        } else {
            self.schedule_pump(a.p, shard);
        }
    }

    /// A fatal fault hits one worker of rank `p`: it answers what it posted, then dies.
    pub(crate) fn prefill_fatal(&mut self, p: u32) {
        let n = &self.prefills[p as usize];
        if n.down || n.fatal {
            return;
        }
        let shard = self.rng.below(n.workers.shards() as u64) as usize;
        let n = &mut self.prefills[p as usize];
        let Some(s) = n.workers.shards.get_mut(shard) else {
            return;
        };
        if s.dying || s.dead {
            return;
        }
        s.dying = true;
        if s.posted == 0 && s.connecting.is_empty() {
            self.worker_died(p, shard);
        }
    }

    /// The dying worker of `shard` reports its fault: every room open now must fail.
    fn worker_died(&mut self, p: u32, shard: usize) {
        let n = &mut self.prefills[p as usize];
        let open: Vec<kvx_core::Room> = n
            .rooms
            .keys()
            .copied()
            .filter(|&r| n.core.poll(r).is_some_and(|s| !s.is_terminal()))
            .collect();
        if !self.sc.restart_workers {
            n.fatal = true;
        }
        for room in open {
            if let Some(rec) = self.rooms.get_mut(&room) {
                rec.fatal.insert(p);
            }
        }
        let fault = WorkerFault::Panic(format!("simulated fault in worker {shard}"));
        self.prefill_call(p, None, |c, now, out| {
            c.died(now, shard, None, fault, out);
        });
    }

    /// The worker of `shard` opened the session of `Work::Connect` `id`.
    pub(crate) fn worker_connected(&mut self, p: u32, inc: u32, shard: usize, id: u64) {
        let n = &mut self.prefills[p as usize];
        if n.inc != inc || n.down {
            return;
        }
        let Some(s) = n.workers.shards.get_mut(shard) else {
            return;
        };
        let Some(session) = s
            .connecting
            .iter()
            .find(|(_, c)| c.id == id)
            .map(|(k, _)| k.clone())
        else {
            return;
        };
        let Some(c) = s.connecting.remove(&session) else {
            return;
        };
        let died = s.dying && s.posted == 0 && s.connecting.is_empty();
        match &c.failure {
            None => {
                let now = self.clock.now();
                let cached = Cached {
                    opened: c.began,
                    used: now,
                };
                s.sessions.insert(c.session.clone(), cached);
            }
            Some(cause) => {
                // The engine's `opened`: a failed open marks the session dead (unless it
                // registered again since the open began); the room's first batch reports it.
                s.sessions.remove(&c.session);
                self.stats.failed_connects += 1;
                self.mark_dead(p, &c.session, cause, c.began);
                self.note_peer_failure(p, &c.session, c.room);
            }
        }
        if died {
            self.worker_died(p, shard);
        } else {
            self.schedule_pump(p, shard);
        }
    }

    /// `Output::RestartWorker`: a fresh worker takes the shard's queue.
    pub(crate) fn worker_restart(&mut self, p: u32, shard: usize) {
        self.stats.worker_restarts += 1;
        if let Some(s) = self.prefills[p as usize].workers.shards.get_mut(shard) {
            s.dying = false;
            s.connecting.clear();
            // A fresh thread: no open data session.
            s.sessions.clear();
        }
        self.schedule_pump(p, shard);
    }

    /// `Output::Bury`: the shard's worker is gone; every job queued on it is reported unsent.
    pub(crate) fn worker_bury(&mut self, p: u32, shard: usize) {
        let w = &mut self.prefills[p as usize].workers;
        let Some(s) = w.shards.get_mut(shard) else {
            return;
        };
        s.dead = true;
        let queued: Vec<u64> = s.queue.drain(..).collect();
        for id in queued {
            let Some((_, job)) = self.prefills[p as usize].workers.jobs.remove(&id) else {
                continue;
            };
            let room = job.room;
            self.dequeued(p, id, room);
            self.prefill_call(p, Some(room), |c, now, out| {
                c.finished(now, job, Outcome::Skipped, out);
            });
        }
    }
}
