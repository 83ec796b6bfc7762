//! A room's timeline: one `TRACE` event per stage a room passes on its way from the embedder's
//! last chunk to the decode's `Done`, under the target [`TARGET`], each with the room (`room`,
//! as a `u64`) and the stage's name (`stage`, one of [`PREFILL_STAGES`] then
//! [`DECODE_STAGES`]). Off by default (one relaxed load per stage): `RUST_LOG=kvx::timeline=trace`
//! logs them, and a tracing layer that records them with its own clock breaks the control path
//! down (`kvx-cli`'s `engine_rooms --empty-rooms N --timeline` does).

/// The tracing target of timeline events.
pub const TARGET: &str = "kvx::timeline";

/// Prefill stages, in the order a room passes them: the embedder's `send` call; the loop took
/// it; a batch posted to a worker; the worker took the job; the write acknowledged; the loop
/// learned the completion; the status built; the status handed to ZMQ (or held for a full inbox).
pub const PREFILL_STAGES: [&str; 8] = [
    "send",
    "loop",
    "posted",
    "worker",
    "written",
    "completed",
    "status_queued",
    "status_sent",
];

/// Decode stages, in order: the inbox reader parsed the status; the room manager concluded the
/// room; the room's task recorded the outcome and emitted `Done`.
pub const DECODE_STAGES: [&str; 3] = ["status_received", "concluded", "done"];

/// Records that `room` (a [`kvx_core::Room`]) passed `stage` (a `&'static str` of
/// [`PREFILL_STAGES`] or [`DECODE_STAGES`]).
macro_rules! stage {
    ($room:expr, $stage:literal) => {
        tracing::trace!(target: "kvx::timeline", room = $room.get(), stage = $stage)
    };
}
pub(crate) use stage;
