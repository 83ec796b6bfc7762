//! The prefill rank's owner loop: one thread that takes every input in arrival order — decode
//! messages, embedder calls, worker reports, probe results — and its own deadlines, feeds them to
//! the rank's [`PrefillCore`] (the rules, with no I/O of its own) and performs the core's
//! [`Output`]s in the order produced: jobs onto the workers' queues, messages through the
//! notifier (the loop's own ZMQ sends), room rows into the aux memory, events to the embedder,
//! worker restarts, liveness probes, and the fatal fault to the process.
//!
//! Nothing else touches the core, so action order is structural. The embedder reads room
//! statuses from a view the core refreshes after each event (no round trip).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::time::{Duration, Instant};

use kvx_core::prefill::PrefillError;
use kvx_core::{Chunk, KVPoll, Room, SessionId};

use super::notifier::Notifier;
use super::{EngineEvent, PrefillMemory};
use crate::fault::TransferThreadFailed;
use crate::prefill_core::{HOUSEKEEPING, Output, PrefillCore, View};
use crate::wire::{self, PrefillInbound};
use crate::worker::{self, JobQueue, JobSender, Outcome, Report, WorkerCtx};

/// The next message on `rx`, waiting at most `wait`: first polled, yielding the CPU between
/// polls, for up to `spin`, then slept for. A sleeping thread is woken through a futex, which on
/// a virtual machine whose other vCPU idles costs 30-60 µs at the tail; a polling one takes the
/// message at once and keeps its vCPU from idling (docs/benchmarks.md, sixth session). The loop
/// polls right after an input: one input is usually followed by another within tens of
/// microseconds — a worker's report after a post, the next chunk after a call.
fn poll_recv<T>(rx: &Receiver<T>, spin: Duration, wait: Duration) -> Result<T, RecvTimeoutError> {
    if !spin.is_zero() {
        let start = Instant::now();
        let until = spin.min(wait);
        loop {
            match rx.try_recv() {
                Ok(msg) => return Ok(msg),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return Err(RecvTimeoutError::Disconnected);
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
            let spent = start.elapsed();
            if spent >= until {
                return rx.recv_timeout(wait.saturating_sub(spent));
            }
            std::thread::yield_now();
        }
    }
    rx.recv_timeout(wait)
}

/// An embedder call, answered on `reply`.
pub(crate) enum Call {
    Open {
        room: Room,
        reply: SyncSender<Result<(), PrefillError>>,
    },
    Init {
        room: Room,
        num_pages: usize,
        aux_row: u64,
        reply: SyncSender<Result<(), PrefillError>>,
    },
    Send {
        room: Room,
        chunk: Chunk,
        reply: SyncSender<Result<(), PrefillError>>,
    },
    Fail {
        room: Room,
        reason: String,
        reply: SyncSender<bool>,
    },
    /// Answer once every notice queued so far went out (or `timeout` passed).
    Flush {
        timeout: Duration,
        reply: SyncSender<()>,
    },
}

/// Everything the loop receives.
pub(crate) enum Input {
    /// A well-formed message from a decode.
    Inbound(PrefillInbound),
    /// An embedder call.
    Call(Call),
    /// A transfer worker's report.
    Worker(Report),
    /// A liveness probe found the decode behind a session gone (see `engine/staging.rs`).
    SessionLost(SessionId),
    /// Stop the loop.
    Stop,
}

impl From<Report> for Input {
    fn from(r: Report) -> Self {
        Input::Worker(r)
    }
}

/// The failpoint `kvx::notifier::aux_data` (feature `failpoints`): an `AUX_DATA` send fails
/// as a ZMQ send error would (the message is dropped alone).
fn aux_send_fault() -> bool {
    fail::fail_point!("kvx::notifier::aux_data", |_| true);
    false
}

/// What [`Owner::new`] is built from.
pub(crate) struct Parts {
    pub mem: PrefillMemory,
    pub core: PrefillCore,
    pub queues: Vec<JobSender>,
    pub job_queues: Vec<Arc<JobQueue>>,
    pub workers: Arc<WorkerCtx>,
    pub inputs: SyncSender<Input>,
    pub notifier: Notifier,
    pub events: Option<Sender<EngineEvent>>,
    pub fatal_tx: Sender<Arc<TransferThreadFailed>>,
    pub stop: Arc<AtomicBool>,
    /// [`super::PrefillConfig::loop_spin`].
    pub spin: Duration,
}

/// The loop's state: the core and the I/O it performs outputs with.
pub(crate) struct Owner {
    mem: PrefillMemory,
    core: PrefillCore,
    queues: Vec<JobSender>,
    job_queues: Vec<Arc<JobQueue>>,
    pub(super) workers: Arc<WorkerCtx>,
    pub(super) inputs: SyncSender<Input>,
    /// The ZMQ sends toward decodes (status, `ABORT_ACK`, `AUX_DATA`, staging messages).
    notifier: Notifier,
    events: Option<Sender<EngineEvent>>,
    fatal_tx: Sender<Arc<TransferThreadFailed>>,
    view: Arc<View>,
    stop: Arc<AtomicBool>,
    /// When the notifier's idle sockets are next closed.
    next_housekeeping: Instant,
    /// How long the loop polls its queue after an input before it sleeps.
    spin: Duration,
}

impl Owner {
    pub(crate) fn new(p: Parts) -> Self {
        Owner {
            view: p.core.view(),
            mem: p.mem,
            core: p.core,
            queues: p.queues,
            job_queues: p.job_queues,
            workers: p.workers,
            inputs: p.inputs,
            notifier: p.notifier,
            events: p.events,
            fatal_tx: p.fatal_tx,
            stop: p.stop,
            next_housekeeping: Instant::now() + HOUSEKEEPING,
            spin: p.spin,
        }
    }

    /// Runs until [`Input::Stop`], the rank's stop flag, or every input sender is gone.
    pub(crate) fn run(mut self, inputs: &Receiver<Input>) {
        let mut busy = false;
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let mut due = self.next_housekeeping;
            if let Some(t) = self.core.poll_timeout() {
                due = due.min(t);
            }
            if let Some(t) = self.notifier.retry_due() {
                due = due.min(t);
            }
            let spin = if busy { self.spin } else { Duration::ZERO };
            match poll_recv(inputs, spin, due.saturating_duration_since(now)) {
                Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(input) => {
                    busy = true;
                    self.input(input);
                }
                Err(RecvTimeoutError::Timeout) => busy = false,
            }
            self.on_time(Instant::now());
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    fn input(&mut self, input: Input) {
        let now = Instant::now();
        let mut out = Vec::new();
        match input {
            Input::Inbound(msg) => {
                // Accepted metadata: the decode inbox it names gets the room's status after
                // the forward pass; its socket connects meanwhile.
                let status_to = match &msg {
                    PrefillInbound::Metadata(req) if req.dst.is_some() => {
                        Some(req.endpoint.clone())
                    }
                    _ => None,
                };
                // A refusal is logged and counted by the core.
                if self.core.inbound(now, msg, &mut out).is_ok()
                    && let Some(ep) = status_to
                {
                    self.notifier.prepare(&ep);
                }
            }
            Input::Call(call) => return self.call(now, call),
            Input::Worker(Report::Finished { job, outcome, .. }) => {
                self.core.finished(now, job, outcome, &mut out);
            }
            Input::Worker(Report::Died { shard, job, fault }) => {
                self.core.died(now, shard, job, fault, &mut out);
            }
            Input::SessionLost(session) => self.core.session_lost(now, session, &mut out),
            Input::Stop => {}
        }
        self.perform(out);
    }

    /// Deadlines and housekeeping due at `now`.
    fn on_time(&mut self, now: Instant) {
        let housekeeping = now >= self.next_housekeeping;
        if housekeeping || self.core.poll_timeout().is_some_and(|t| t <= now) {
            // The core runs its own housekeeping (gauges, staging expiry) once a second.
            let mut out = Vec::new();
            self.core.on_time(now, &mut out);
            self.perform(out);
        }
        if self.notifier.retry_due().is_some_and(|t| t <= now) {
            self.notifier.retry();
        }
        if housekeeping {
            self.next_housekeeping = now + HOUSEKEEPING;
            self.notifier.housekeeping();
        }
    }

    fn call(&mut self, now: Instant, call: Call) {
        let mut out = Vec::new();
        match call {
            Call::Open { room, reply } => {
                let r = self.core.open_room(now, room, &mut out);
                self.perform(out);
                let _ = reply.send(r);
            }
            Call::Init {
                room,
                num_pages,
                aux_row,
                reply,
            } => {
                let r = self.core.init_room(now, room, num_pages, aux_row, &mut out);
                self.perform(out);
                let _ = reply.send(r);
            }
            Call::Send { room, chunk, reply } => {
                let r = self.core.send(now, room, chunk, &mut out);
                self.perform(out);
                let _ = reply.send(r);
            }
            Call::Flush { timeout, reply } => {
                self.flush_notices(timeout);
                let _ = reply.send(());
            }
            Call::Fail {
                room,
                reason,
                reply,
            } => {
                let r = self.core.fail_room(now, room, &reason, &mut out);
                self.perform(out);
                let _ = reply.send(r);
            }
        }
    }

    /// Performs the core's outputs, in order (what performing one reports back to the core is
    /// performed before the next).
    fn perform(&mut self, out: Vec<Output>) {
        // Rooms whose `AUX_DATA` row to a decode could not be sent: that decode's Success
        // (the next send of the room to it, in the same batch of outputs) goes out as status
        // 0, so it never reports Success over a stale row.
        let mut aux_lost: Vec<(Room, kvx_core::Endpoint)> = Vec::new();
        for o in out {
            match o {
                Output::Post { shard, job } => {
                    let sent = self.queues.get(shard).map(|q| q.send(job));
                    let job = match sent {
                        Some(Ok(())) => continue,
                        Some(Err(e)) => e.0,
                        None => continue,
                    };
                    let mut more = Vec::new();
                    let outcome = Outcome::RoomFailed("transfer queue closed".into());
                    self.core.finished(Instant::now(), job, outcome, &mut more);
                    self.perform(more);
                }
                Output::Send {
                    endpoint,
                    mut frames,
                    status_of,
                } => {
                    if let Some(room) = status_of
                        && let Some(i) = aux_lost
                            .iter()
                            .position(|(r, e)| *r == room && *e == endpoint)
                    {
                        aux_lost.swap_remove(i);
                        let rank = self.core.manager().prefill_unique_rank();
                        frames = wire::encode_status_with_reason(room, KVPoll::Failed, rank, None);
                        metrics::counter!("kvx_aux_rows_lost_total").increment(1);
                        tracing::error!(%room, %endpoint, "AUX_DATA not sent: the decode is told Failed, not Success");
                    }
                    self.notifier.send(endpoint, frames);
                    if let Some(room) = status_of {
                        crate::timeline::stage!(room, "status_sent");
                    }
                }
                Output::FillRoomRow { room, addr, len } => {
                    let filled = usize::try_from(len).ok().is_some_and(|n| {
                        let mut row = vec![0u8; n];
                        kvx_core::fill_room_row(&mut row, room)
                            && self.mem.aux.copy_in(addr, &row).is_ok()
                    });
                    if !filled {
                        tracing::error!(%room, addr, len, "room row not filled");
                    }
                }
                Output::SendAuxData {
                    room,
                    endpoint,
                    index,
                    dst_row,
                    src_addr,
                    len,
                } => {
                    // The row (its room slot filled just before) goes on the notifier's socket
                    // to this decode, ahead of the room's status.
                    let frames = self
                        .mem
                        .aux
                        .to_vec(src_addr, len)
                        .map_err(|e| e.to_string());
                    let frames = frames.and_then(|row| {
                        let index = u32::try_from(index).map_err(|e| e.to_string())?;
                        wire::encode_aux_data(room, index, dst_row, &row).map_err(|e| e.to_string())
                    });
                    let sent = match frames {
                        Ok(_) if aux_send_fault() => false,
                        Ok(f) => self.notifier.send(endpoint.clone(), f),
                        Err(e) => {
                            tracing::error!(%room, error = %e, "AUX_DATA not sent");
                            false
                        }
                    };
                    if !sent {
                        aux_lost.push((room, endpoint));
                    }
                }
                Output::Event(e) => {
                    if let Some(tx) = &self.events {
                        let _ = tx.send(e);
                    }
                }
                Output::Concluded { .. } => {}
                Output::Revive(session) => self.workers.revive(&session),
                Output::RestartWorker(shard) => self.restart(shard),
                Output::Bury(shard) => self.bury(shard),
                Output::Probe { session, inbox } => self.probe(session, inbox),
                Output::Fatal(err) => {
                    self.flush_notices(Duration::from_millis(500));
                    self.view.publish_fatal(&err);
                    let _ = self.fatal_tx.send(err);
                }
            }
        }
    }

    /// Starts a new worker on `shard`; a rank that is stopping, or cannot spawn it, loses the
    /// shard.
    fn restart(&mut self, shard: usize) {
        let spawned = if self.stop.load(Ordering::Relaxed) {
            Err("the rank is stopping".to_owned())
        } else {
            let queue = self.job_queues[shard].clone();
            worker::spawn_worker(self.workers.clone(), shard, queue, self.inputs.clone())
                .map_err(|e| e.to_string())
        };
        if let Err(e) = spawned {
            tracing::error!(shard, error = %e, "cannot restart transfer worker");
            let mut out = Vec::new();
            self.core.worker_lost(Instant::now(), shard, &mut out);
            self.perform(out);
        }
    }

    /// Completes, unsent, every job queued on a shard whose worker is gone for good.
    fn bury(&mut self, shard: usize) {
        let Some(queue) = self.job_queues.get(shard).cloned() else {
            return;
        };
        loop {
            let next = queue.try_recv();
            let Ok(job) = next else { break };
            let mut out = Vec::new();
            self.core
                .finished(Instant::now(), job, Outcome::Skipped, &mut out);
            self.perform(out);
        }
    }

    /// Waits (bounded) until every held message went out to ZMQ.
    fn flush_notices(&mut self, timeout: Duration) {
        self.notifier.flush(timeout);
        // ZMQ writes asynchronously; give its I/O thread a moment on loopback.
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn an_input_after_the_spin_is_still_taken() {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(Input::Stop).unwrap();
            tx
        });
        let got = poll_recv(&rx, Duration::from_micros(100), Duration::from_secs(10));
        assert!(matches!(got, Ok(Input::Stop)));
        drop(sender.join().unwrap());
    }

    #[test]
    fn an_input_during_the_spin_is_taken_and_nothing_waits_its_wait_out() {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        tx.send(Input::Stop).unwrap();
        let got = poll_recv(&rx, Duration::from_secs(10), Duration::from_secs(10));
        assert!(matches!(got, Ok(Input::Stop)));
        // Nothing more: the wait ends at `wait`, spin or not.
        for spin in [
            Duration::ZERO,
            Duration::from_micros(100),
            Duration::from_secs(10),
        ] {
            let got = poll_recv(&rx, spin, Duration::from_millis(1));
            assert!(matches!(got, Err(RecvTimeoutError::Timeout)));
        }
        drop(tx);
        let got = poll_recv(&rx, Duration::from_secs(10), Duration::from_secs(10));
        assert!(matches!(got, Err(RecvTimeoutError::Disconnected)));
    }
}
