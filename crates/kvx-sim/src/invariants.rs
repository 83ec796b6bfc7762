//! The invariants a run checks, each with its own name in the report, and the violation record.
//!
//! The checks themselves sit where the facts are known (the world calls [`Checker::check`] at
//! every step that could break one); this module names them, counts how often each was checked,
//! and keeps the violations.

use std::fmt;

use kvx_core::Room;

/// A named invariant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Inv {
    /// A room's status never goes down and Failed sticks, on every prefill and decode rank.
    StatusMonotonic,
    /// Every room ends terminal on every rank that held it, within its deadline.
    TerminalInTime,
    /// A decode room ends by its prefills' statuses, never by its waiting timeout, unless a
    /// fault of the run (a lost message, a local abort, a dead rank) explains it.
    OutcomeDelivered,
    /// No byte of prefill rank P lands in a room's pages after the decode received P's status.
    NoWriteAfterStatus,
    /// No byte of prefill rank P lands after the decode received P's `ABORT_ACK`.
    NoWriteAfterAck,
    /// No byte lands in a page after the decode released it.
    NoWriteAfterRelease,
    /// No byte lands outside a page (or aux row) the room owns.
    WriteInOwnedPage,
    /// Success only once every byte of the room landed, and the bytes are the prefill's.
    SuccessBytes,
    /// Once rooms are terminal and drained, no per-room or per-batch entry is left anywhere.
    NoLeak,
    /// After a fatal worker fault, every room open on that rank ends Failed on both sides.
    FatalFailsOpenRooms,
    /// A staged chunk's write lands only in a live ring slot granted to that chunk, and never
    /// over an older slot still live there (the watermark admitted it).
    RingWriteInLiveSlot,
    /// A scatter copies out only bytes its own chunk's writers put in the slot (no later write
    /// reused the slot before the copy-out finished).
    ScatterOwnBytes,
    /// A staged room's decode Success comes only once every chunk was scattered into its pages.
    StagedSuccessDrained,
    /// A staged write the decode receives in place (a placed ring slot) goes into the pages of
    /// its own chunk, and each writer's block arrives wholly in place or wholly in the ring.
    PlacedWriteOwnChunk,
    /// A prefill rank fails a room for its decode session being dead (`SessionDead`: the
    /// session lost or blacklisted) only when the decode process (incarnation) that opened the
    /// room is gone, or a transfer of that rank's process towards that very incarnation failed
    /// before: never for a failure towards an earlier process of a decode that restarted under
    /// the same session id.
    SessionDeadOwnIncarnation,
}

impl Inv {
    /// Every invariant, in report order.
    pub const ALL: [Inv; 15] = [
        Inv::StatusMonotonic,
        Inv::TerminalInTime,
        Inv::OutcomeDelivered,
        Inv::NoWriteAfterStatus,
        Inv::NoWriteAfterAck,
        Inv::NoWriteAfterRelease,
        Inv::WriteInOwnedPage,
        Inv::SuccessBytes,
        Inv::NoLeak,
        Inv::FatalFailsOpenRooms,
        Inv::RingWriteInLiveSlot,
        Inv::ScatterOwnBytes,
        Inv::StagedSuccessDrained,
        Inv::PlacedWriteOwnChunk,
        Inv::SessionDeadOwnIncarnation,
    ];

    /// The report name.
    pub fn name(self) -> &'static str {
        match self {
            Inv::StatusMonotonic => "status-monotonic",
            Inv::TerminalInTime => "terminal-in-time",
            Inv::OutcomeDelivered => "outcome-delivered",
            Inv::NoWriteAfterStatus => "no-write-after-status",
            Inv::NoWriteAfterAck => "no-write-after-ack",
            Inv::NoWriteAfterRelease => "no-write-after-release",
            Inv::WriteInOwnedPage => "write-in-owned-page",
            Inv::SuccessBytes => "success-bytes",
            Inv::NoLeak => "no-leak",
            Inv::FatalFailsOpenRooms => "fatal-fails-open-rooms",
            Inv::RingWriteInLiveSlot => "ring-write-in-live-slot",
            Inv::ScatterOwnBytes => "scatter-own-bytes",
            Inv::StagedSuccessDrained => "staged-success-drained",
            Inv::PlacedWriteOwnChunk => "placed-write-own-chunk",
            Inv::SessionDeadOwnIncarnation => "session-dead-own-incarnation",
        }
    }
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Which.
    pub inv: Inv,
    /// The step at which it was seen.
    pub step: u64,
    /// The room concerned, if one.
    pub room: Option<Room>,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at step {}", self.inv.name(), self.step)?;
        if let Some(r) = self.room {
            write!(f, " (room {r})")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// Counts checks and keeps violations of one seed.
#[derive(Clone, Debug, Default)]
pub struct Checker {
    /// Checks per invariant (index = position in [`Inv::ALL`]).
    pub checks: [u64; Inv::ALL.len()],
    /// Violations, in order.
    pub violations: Vec<Violation>,
    /// The current step (set by the world).
    pub step: u64,
}

impl Checker {
    /// Records one check of `inv`; `ok == false` records a violation built by `detail`.
    pub fn check(
        &mut self,
        inv: Inv,
        ok: bool,
        room: Option<Room>,
        detail: impl FnOnce() -> String,
    ) {
        self.checks[inv as usize] += 1;
        if !ok {
            self.violations.push(Violation {
                inv,
                step: self.step,
                room,
                detail: detail(),
            });
        }
    }
}
