//! The engine's side of staging: runs the [`StagingDriver`] under its lock and performs its
//! effects outside it (messages to the notifier, chunks to the transfer workers, completions and
//! room failures to the room manager); opens a room's staging when its metadata names a session
//! on the staging path; routes `STAGING_RSP` and `WATERMARK`; expires parked chunks each tick.
//!
//! Lock order: the room manager's lock may be held while the driver's is taken (opening a
//! room), never the reverse; effects are performed under neither.

use std::time::Instant;

use kvx_core::prefill::{PrefillEvent, TransferPath};
use kvx_core::{Room, SessionId};
use kvx_staging::{StagingRsp, WatermarkMsg};

use super::{Notice, Shared, lock};
use crate::prefill_staging::{Effect, StagingDriver};
use crate::worker::{Job, Work};

impl Shared {
    /// Runs `f` on the staging driver (when staging is on) and performs its effects.
    pub(crate) fn with_staging<R>(
        &self,
        f: impl FnOnce(&mut StagingDriver, &mut Vec<Effect>) -> R,
    ) -> Option<R> {
        let st = self.staging.as_ref()?;
        let mut fx = Vec::new();
        let r = f(&mut lock(st), &mut fx);
        self.perform(fx);
        Some(r)
    }

    /// Performs the staging driver's effects (never under its lock: completions re-enter the
    /// room manager, which may conclude rooms and call back into the driver).
    pub(crate) fn perform(&self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Send(endpoint, frames) => {
                    let _ = lock(&self.notices).send(Notice::Send(endpoint, frames));
                }
                Effect::Post(work) => {
                    metrics::counter!("kvx_staged_chunks_posted_total").increment(1);
                    let shard = self.shard_of(&work.key.session);
                    let job = Job {
                        room: work.key.room,
                        session: work.key.session.clone(),
                        work: Work::Stage(work),
                    };
                    if let Err(e) = self.queues[shard].send(job)
                        && let Work::Stage(w) = e.0.work
                    {
                        self.with_staging(|d, fx| {
                            d.chunk_done(&w.batches, Err("transfer queue closed".into()), fx)
                        });
                    }
                }
                Effect::Done(batch_id, result) => {
                    let _ = self.handle(PrefillEvent::BatchDone { batch_id, result });
                }
                Effect::Fail(room, reason) => {
                    if self.fail_room(room, &reason) {
                        metrics::counter!("kvx_staging_room_failures_total").increment(1);
                    }
                }
            }
        }
    }
}

/// `STAGING_RSP` from a decode.
pub(super) fn on_rsp(shared: &Shared, rsp: &StagingRsp) {
    let now = Instant::now();
    match shared.with_staging(|d, fx| d.on_rsp(now, rsp, fx)) {
        None => {
            metrics::counter!("kvx_ignored_messages_total", "kind" => "staging_rsp").increment(1);
        }
        Some(Err(e)) => {
            // Mostly a response to another rank's request for a room this rank already
            // concluded: every prefill rank of a room gets every response.
            metrics::counter!("kvx_staging_dropped_total", "kind" => error_kind(&e)).increment(1);
            tracing::debug!(error = %e, "STAGING_RSP dropped");
        }
        Some(Ok(())) => {}
    }
}

/// `WATERMARK` from a decode.
pub(super) fn on_watermark(shared: &Shared, wm: &WatermarkMsg) {
    let now = Instant::now();
    if shared
        .with_staging(|d, fx| d.on_watermark(now, wm, fx))
        .is_none()
    {
        metrics::counter!("kvx_ignored_messages_total", "kind" => "watermark").increment(1);
    }
}

fn error_kind(e: &kvx_staging::PrefillError) -> &'static str {
    match e {
        kvx_staging::PrefillError::UnknownRoom(_) => "unknown_room",
        kvx_staging::PrefillError::Conflict(_) => "conflict",
        kvx_staging::PrefillError::TooManyChunks(_) => "too_many_chunks",
    }
}

/// Opens the room's staging towards `session` (requests ring space for every chunk) when its
/// KV takes the staging path. Checked and opened under the manager's lock, so a room that
/// concludes meanwhile is either not opened or cleaned up by its conclusion.
pub(super) fn open(shared: &Shared, room: Room, session: &SessionId, total_pages: usize) {
    let Some(st) = &shared.staging else {
        return;
    };
    let mut fx = Vec::new();
    {
        let table = lock(&shared.table);
        let open = table.poll(room).is_some_and(|p| !p.is_terminal());
        if !open || table.path_for(session) != Some(TransferPath::Staging) {
            return;
        }
        if let Some(reg) = table.registration(session) {
            lock(st).open(room, reg, total_pages, &mut fx);
        }
    }
    shared.perform(fx);
}

/// Once per timer tick: fails rooms with chunks parked too long, forgets rooms the manager no
/// longer holds (a safety net behind conclusions), and sets the staging gauges.
pub(super) fn tick(shared: &Shared) {
    let now = Instant::now();
    // Rooms the manager no longer holds are forgotten (a safety net behind conclusions);
    // the manager's lock is never taken under the driver's.
    let held = shared.with_staging(|d, _| d.rooms()).unwrap_or_default();
    let gone: Vec<Room> = {
        let table = lock(&shared.table);
        held.into_iter()
            .filter(|r| table.poll(*r).is_none())
            .collect()
    };
    let staged = shared.with_staging(|d, fx| {
        d.expire(now, fx);
        for room in gone {
            d.conclude(room, fx);
        }
        (d.room_count(), d.parked_count())
    });
    if let Some((rooms, parked)) = staged {
        metrics::gauge!("kvx_staging_rooms").set(rooms as f64);
        metrics::gauge!("kvx_staging_parked_chunks").set(parked as f64);
    }
}
