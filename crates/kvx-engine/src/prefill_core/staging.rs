//! The core's side of staging: runs the [`StagingDriver`] and turns its effects into outputs
//! (messages to decodes, staged chunks to the workers, completions and room failures to the room
//! manager); opens a room's staging when its metadata names a session on the staging path;
//! routes `STAGING_RSP` and `WATERMARK`; once a second expires parked chunks and asks for
//! liveness probes.
//!
//! A staged room can wait on its decode with nothing in flight (for ring space, for a
//! watermark), so no failed write would reveal a decode that died. Every [`PROBE_PERIOD`]
//! while rooms wait on a session the core asks its driver to probe that decode's inbox
//! ([`Output::Probe`]); a dead one comes back as [`PrefillCore::session_lost`], and the manager
//! fails the session's open rooms at once instead of after the staging wait timeout.

use std::time::{Duration, Instant};

use kvx_core::prefill::{PrefillEvent, TransferPath};
use kvx_core::{Room, SessionId};
use kvx_staging::{StagingRsp, WatermarkMsg};

use super::{Output, PrefillCore};
use crate::prefill_staging::{Effect, StagingDriver};
use crate::worker::Work;

/// How often a session that staged rooms wait on is probed.
pub const PROBE_PERIOD: Duration = Duration::from_secs(2);

impl PrefillCore {
    /// Runs `f` on the staging driver (when staging is on) and performs its effects.
    pub(super) fn with_staging<R>(
        &mut self,
        now: Instant,
        out: &mut Vec<Output>,
        f: impl FnOnce(&mut StagingDriver, &mut Vec<Effect>) -> R,
    ) -> Option<R> {
        let d = self.staging.as_mut()?;
        let mut fx = Vec::new();
        let r = f(d, &mut fx);
        self.perform(now, fx, out);
        Some(r)
    }

    /// Performs the staging driver's effects, in order.
    fn perform(&mut self, now: Instant, effects: Vec<Effect>, out: &mut Vec<Output>) {
        for e in effects {
            match e {
                Effect::Send(endpoint, frames) => out.push(Output::Send {
                    endpoint,
                    frames,
                    status_of: None,
                }),
                Effect::Post(work) => {
                    metrics::counter!("kvx_staged_chunks_posted_total").increment(1);
                    let (room, session) = (work.key.room, work.key.session.clone());
                    self.post(now, room, session, Work::Stage(work), out);
                }
                Effect::Done(batch_id, result) => {
                    let event = PrefillEvent::BatchDone { batch_id, result };
                    let _ = self.handle(now, event, None, out);
                }
                Effect::Fail(room, reason) => {
                    if self.fail(now, room, &reason, out) {
                        metrics::counter!("kvx_staging_room_failures_total").increment(1);
                    }
                }
            }
        }
    }

    /// `STAGING_RSP` from a decode.
    pub(super) fn staging_rsp(&mut self, now: Instant, rsp: &StagingRsp, out: &mut Vec<Output>) {
        match self.with_staging(now, out, |d, fx| d.on_rsp(now, rsp, fx)) {
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
    pub(super) fn staging_watermark(
        &mut self,
        now: Instant,
        wm: &WatermarkMsg,
        out: &mut Vec<Output>,
    ) {
        if self
            .with_staging(now, out, |d, fx| d.on_watermark(now, wm, fx))
            .is_none()
        {
            metrics::counter!("kvx_ignored_messages_total", "kind" => "watermark").increment(1);
        }
    }

    /// Opens the room's staging towards `session` (requests ring space for every chunk) when its
    /// KV takes the staging path and the room is open.
    pub(super) fn staging_open(
        &mut self,
        now: Instant,
        room: Room,
        session: &SessionId,
        total_pages: usize,
        out: &mut Vec<Output>,
    ) {
        let open = self.mgr.poll(room).is_some_and(|p| !p.is_terminal());
        if !open || self.mgr.path_for(session) != Some(TransferPath::Staging) {
            return;
        }
        let (Some(d), Some(reg)) = (self.staging.as_mut(), self.mgr.registration(session)) else {
            return;
        };
        let mut fx = Vec::new();
        d.open(room, reg, total_pages, &mut fx);
        self.perform(now, fx, out);
    }

    /// Once a second: fails rooms with chunks parked too long, forgets rooms the manager no
    /// longer holds (a safety net behind conclusions), sets the staging gauges and asks for
    /// liveness probes.
    pub(super) fn staging_housekeeping(&mut self, now: Instant, out: &mut Vec<Output>) {
        let Some(d) = self.staging.as_ref() else {
            return;
        };
        let gone: Vec<Room> = d
            .rooms()
            .into_iter()
            .filter(|r| self.mgr.poll(*r).is_none())
            .collect();
        let staged = self.with_staging(now, out, |d, fx| {
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
        self.probe_staging_sessions(now, out);
    }

    /// Asks for a liveness probe of each session staged rooms wait on, at most one per
    /// [`PROBE_PERIOD`] per session; forgets sessions nothing waits on any more.
    fn probe_staging_sessions(&mut self, now: Instant, out: &mut Vec<Output>) {
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
            out.push(Output::Probe { session, inbox });
        }
    }
}
