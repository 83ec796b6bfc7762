//! The loop's side of staging: runs the [`StagingDriver`] and performs its effects (messages to
//! the loop's notifier, chunks to the transfer workers, completions and room failures to the room
//! manager); opens a room's staging when its metadata names a session on the staging path;
//! routes `STAGING_RSP` and `WATERMARK`; expires parked chunks once a second. Everything runs on
//! the loop's thread, so no lock orders exist: effects are performed after the driver returned.
//!
//! A staged room can wait on its decode with nothing in flight (for ring space, for a
//! watermark), so no failed write would reveal a decode that died. Every [`PROBE_PERIOD`]
//! while rooms wait on a session, a task tries a TCP connection to that decode's inbox (closed
//! at once, which ZMQ ignores); two refused or silent ones in a row are reported as
//! [`Input::SessionLost`](super::owner::Input::SessionLost), and the manager fails the session's
//! open rooms at once instead of after the staging wait timeout.

use std::time::{Duration, Instant};

use kvx_core::prefill::{PrefillEvent, TransferPath};
use kvx_core::{Room, SessionId};
use kvx_staging::{StagingRsp, WatermarkMsg};

use super::owner::{Input, Owner};
use crate::prefill_staging::{Effect, StagingDriver};
use crate::worker::Work;

impl Owner {
    /// Runs `f` on the staging driver (when staging is on) and performs its effects.
    pub(super) fn with_staging<R>(
        &mut self,
        f: impl FnOnce(&mut StagingDriver, &mut Vec<Effect>) -> R,
    ) -> Option<R> {
        let d = self.staging.as_mut()?;
        let mut fx = Vec::new();
        let r = f(d, &mut fx);
        self.perform(fx);
        Some(r)
    }

    /// Performs the staging driver's effects, in order.
    fn perform(&mut self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Send(endpoint, frames) => self.notify(endpoint, frames),
                Effect::Post(work) => {
                    metrics::counter!("kvx_staged_chunks_posted_total").increment(1);
                    let (room, session) = (work.key.room, work.key.session.clone());
                    self.post(room, session, Work::Stage(work));
                }
                Effect::Done(batch_id, result) => {
                    let _ = self.handle(PrefillEvent::BatchDone { batch_id, result }, None);
                }
                Effect::Fail(room, reason) => {
                    if self.fail_room(room, &reason) {
                        metrics::counter!("kvx_staging_room_failures_total").increment(1);
                    }
                }
            }
        }
    }

    /// `STAGING_RSP` from a decode.
    pub(super) fn staging_rsp(&mut self, rsp: &StagingRsp) {
        let now = Instant::now();
        match self.with_staging(|d, fx| d.on_rsp(now, rsp, fx)) {
            None => {
                metrics::counter!("kvx_ignored_messages_total", "kind" => "staging_rsp")
                    .increment(1);
            }
            Some(Err(e)) => {
                // Mostly a response to another rank's request for a room this rank already
                // concluded: every prefill rank of a room gets every response.
                metrics::counter!("kvx_staging_dropped_total", "kind" => e.kind()).increment(1);
                tracing::debug!(error = %e, "STAGING_RSP dropped");
            }
            Some(Ok(())) => {}
        }
    }

    /// `WATERMARK` from a decode.
    pub(super) fn staging_watermark(&mut self, wm: &WatermarkMsg) {
        let now = Instant::now();
        if self
            .with_staging(|d, fx| d.on_watermark(now, wm, fx))
            .is_none()
        {
            metrics::counter!("kvx_ignored_messages_total", "kind" => "watermark").increment(1);
        }
    }

    /// Opens the room's staging towards `session` (requests ring space for every chunk) when its
    /// KV takes the staging path and the room is open.
    pub(super) fn staging_open(&mut self, room: Room, session: &SessionId, total_pages: usize) {
        let open = self.mgr.poll(room).is_some_and(|p| !p.is_terminal());
        if !open || self.mgr.path_for(session) != Some(TransferPath::Staging) {
            return;
        }
        let (Some(d), Some(reg)) = (self.staging.as_mut(), self.mgr.registration(session)) else {
            return;
        };
        let mut fx = Vec::new();
        d.open(room, reg, total_pages, &mut fx);
        self.perform(fx);
    }

    /// Once a second: fails rooms with chunks parked too long, forgets rooms the manager no
    /// longer holds (a safety net behind conclusions), and sets the staging gauges.
    pub(super) fn staging_housekeeping(&mut self, now: Instant) {
        let Some(d) = self.staging.as_ref() else {
            return;
        };
        let gone: Vec<Room> = d
            .rooms()
            .into_iter()
            .filter(|r| self.mgr.poll(*r).is_none())
            .collect();
        let staged = self.with_staging(|d, fx| {
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
        self.probe_staging_sessions(now);
    }

    /// Starts a liveness probe of each session staged rooms wait on, at most one per
    /// [`PROBE_PERIOD`] per session; forgets sessions nothing waits on any more.
    fn probe_staging_sessions(&mut self, now: Instant) {
        let sessions = self
            .staging
            .as_ref()
            .map(StagingDriver::sessions)
            .unwrap_or_default();
        self.probed.retain(|s, _| sessions.contains(s));
        for session in sessions {
            if self
                .probed
                .get(&session)
                .is_some_and(|at| now.saturating_duration_since(*at) < PROBE_PERIOD)
            {
                continue;
            }
            let Some(inbox) = self.mgr.registration(&session).map(|r| r.endpoint.clone()) else {
                continue;
            };
            self.probed.insert(session.clone(), now);
            let inputs = self.inputs.clone();
            self.workers.rt.spawn(async move {
                // Two failed connects in a row, half a second apart: one refused SYN on a busy
                // host does not fail rooms.
                for attempt in 0..2 {
                    if attempt > 0 {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    if kvx_bootstrap::http::tcp_alive(&inbox.host, inbox.port, PROBE_TIMEOUT).await
                    {
                        return;
                    }
                }
                metrics::counter!("kvx_staging_sessions_lost_total").increment(1);
                tracing::warn!(
                    %session,
                    inbox = %inbox,
                    "decode inbox does not answer: failing the staged rooms waiting on it"
                );
                // A full input queue drops the report; the next probe repeats it.
                let _ = inputs.try_send(Input::SessionLost(session));
            });
        }
    }

    /// A probe found `session`'s decode gone: the manager fails its open rooms.
    pub(super) fn session_lost(&mut self, session: SessionId) {
        let _ = self.handle(PrefillEvent::SessionLost { session }, None);
    }
}

/// How often a session that staged rooms wait on is probed.
pub(super) const PROBE_PERIOD: Duration = Duration::from_secs(2);

/// How long a probe's TCP connect may take before the decode counts as gone.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
