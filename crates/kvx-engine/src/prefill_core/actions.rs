//! The manager's side of the core: feeds one event to the [`PrefillManager`], turns its actions
//! into [`Output`]s in the order produced, releases the rooms it dropped, and keeps the
//! embedder's view and the cancel flags up to date.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvx_core::prefill::{PrefillAction, PrefillError, PrefillEvent};
use kvx_core::{KVPoll, Room};

use super::{Output, PrefillCore};
use crate::engine::EngineEvent;
use crate::worker::Work;

impl PrefillCore {
    /// Feeds one event to the manager and performs its actions in order; `room` (the event's,
    /// when it has one) is the room whose view is refreshed beside those the actions name.
    pub(super) fn handle(
        &mut self,
        now: Instant,
        event: PrefillEvent,
        room: Option<Room>,
        out: &mut Vec<Output>,
    ) -> Result<(), PrefillError> {
        let wide = matches!(
            event,
            PrefillEvent::Tick | PrefillEvent::Fatal { .. } | PrefillEvent::BatchDone { .. }
        );
        let mut actions = Vec::new();
        let r = self.mgr.handle(now, event, &mut actions);
        let mut touched: Vec<Room> = room.into_iter().collect();
        touched.extend(actions.iter().map(PrefillAction::room));
        self.apply(now, actions, out);
        // Rooms the manager dropped are released: their pages may be reused.
        let released: Vec<(Room, KVPoll)> = self
            .concluded
            .iter()
            .filter(|(r, _)| self.mgr.poll(**r).is_none())
            .map(|(r, s)| (*r, *s))
            .collect();
        if wide {
            touched.extend(self.known.iter().copied());
        }
        touched.extend(released.iter().map(|(r, _)| *r));
        self.refresh(&touched);
        for (room, status) in released {
            self.last_chunk.remove(&room);
            self.concluded.remove(&room);
            self.announced.remove(&room);
            out.push(Output::Event(EngineEvent::Released { room, status }));
        }
        r
    }

    /// Brings the embedder's view (and the cancel flags) up to date for `rooms`.
    fn refresh(&mut self, rooms: &[Room]) {
        let mut view = self.view.rooms();
        for &room in rooms {
            match self.mgr.poll(room) {
                Some(status) => {
                    if status.is_terminal() {
                        self.cancel_room(room);
                    }
                    let reason = self.mgr.failure(room).map(ToString::to_string);
                    view.insert(room, (status, reason));
                }
                None => {
                    view.remove(&room);
                    self.known.remove(&room);
                    if let Some(flag) = self.cancel.remove(&room) {
                        flag.store(true, Ordering::Release);
                    }
                }
            }
        }
        drop(view);
        self.view.set_held(self.mgr.room_count());
    }

    /// Turns the manager's actions into outputs, in order.
    fn apply(&mut self, now: Instant, actions: Vec<PrefillAction>, out: &mut Vec<Output>) {
        for a in actions {
            match a {
                PrefillAction::PostBatch {
                    room,
                    session,
                    batch_id,
                    ops,
                    ..
                } => self.post(now, room, session, Work::Batch { batch_id, ops }, out),
                PrefillAction::Stage {
                    room,
                    session,
                    batch_id,
                    slice,
                    src_pages,
                    ..
                } => {
                    let staged = self.with_staging(now, out, |d, fx| {
                        d.stage(now, room, &session, batch_id, slice, &src_pages, fx);
                    });
                    if staged.is_none() {
                        let result = Err("staging is off on this prefill rank".into());
                        let event = PrefillEvent::BatchDone { batch_id, result };
                        let _ = self.handle(now, event, None, out);
                    }
                }
                PrefillAction::FillRoomRow { room, addr, len } => {
                    out.push(Output::FillRoomRow { room, addr, len });
                }
                PrefillAction::SendAuxData {
                    room,
                    endpoint,
                    index,
                    dst_row,
                    src_addr,
                    len,
                } => {
                    metrics::counter!("kvx_aux_messages_total").increment(1);
                    out.push(Output::SendAuxData {
                        room,
                        endpoint,
                        index,
                        dst_row,
                        src_addr,
                        len,
                    });
                }
                PrefillAction::SendStatus {
                    room,
                    endpoint,
                    status,
                    prefill_rank,
                    reason,
                    with_reason,
                } => {
                    // 4 frames only towards a decode known to take a reason (sglang 0.5.23).
                    let reason = reason.as_deref().filter(|_| with_reason);
                    metrics::counter!("kvx_status_sent_total", "status" => status_label(status))
                        .increment(1);
                    if let Some(t) = self.last_chunk.remove(&room) {
                        metrics::histogram!("kvx_room_latency_seconds")
                            .record(now.saturating_duration_since(t).as_secs_f64());
                    }
                    if reason.is_some() {
                        metrics::counter!("kvx_status_reason_frames_total").increment(1);
                    }
                    let frames =
                        crate::wire::encode_status_with_reason(room, status, prefill_rank, reason);
                    crate::timeline::stage!(room, "status_queued");
                    out.push(Output::Send {
                        endpoint,
                        frames,
                        status_of: Some(room),
                    });
                }
                PrefillAction::AbortAck {
                    endpoint,
                    room,
                    prefill_rank,
                    generation,
                } => {
                    // 4 frames echoing a 5-frame ABORT's generation (sglang 0.5.23), else the
                    // ranked 3-frame form of sglang main.
                    let form = if generation.is_some() { "4" } else { "3" };
                    metrics::counter!("kvx_abort_acks_total", "frames" => form).increment(1);
                    let frames = crate::wire::encode_abort_ack(room, prefill_rank, generation);
                    out.push(Output::Send {
                        endpoint,
                        frames,
                        status_of: None,
                    });
                }
                PrefillAction::Concluded {
                    room,
                    status,
                    reason,
                } => {
                    if status == KVPoll::Failed {
                        metrics::counter!("kvx_room_failures_total").increment(1);
                        if let Some(r) = &reason {
                            tracing::warn!(%room, reason = %r, "room failed");
                        }
                    }
                    metrics::counter!("kvx_rooms_finished_total", "status" => status_label(status))
                        .increment(1);
                    self.cancel_room(room);
                    self.concluded.insert(room, status);
                    out.push(Output::Concluded {
                        room,
                        status,
                        reason,
                    });
                    self.with_staging(now, out, |d, fx| d.conclude(room, fx));
                }
            }
        }
    }

    /// Room gauges (once a second, not per event).
    pub(super) fn gauges(&self) {
        let counts = self.view.counts();
        for s in KVPoll::ALL {
            metrics::gauge!("kvx_rooms", "state" => status_label(s))
                .set(counts[s.as_u8() as usize] as f64);
        }
        let live = self.mgr.live_entries();
        metrics::gauge!("kvx_room_entries").set(live.rooms as f64);
        metrics::gauge!("kvx_unopened_room_entries").set(live.unopened_rooms as f64);
        metrics::gauge!("kvx_session_entries").set(live.sessions as f64);
        metrics::gauge!("kvx_outstanding_batches").set(live.batches as f64);
    }
}

/// The metric label of a status: `failed`, `bootstrapping`, `waiting_for_input`,
/// `transferring`, `success` (no `KVPoll.` prefix).
pub(crate) fn status_label(s: KVPoll) -> &'static str {
    match s {
        KVPoll::Failed => "failed",
        KVPoll::Bootstrapping => "bootstrapping",
        KVPoll::WaitingForInput => "waiting_for_input",
        KVPoll::Transferring => "transferring",
        KVPoll::Success => "success",
    }
}
