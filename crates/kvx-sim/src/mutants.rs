//! Planted bugs for the simulator's self-test: a simulator that cannot find a known bug proves
//! nothing, so every mutant here must produce a violation within the default step budget.
//!
//! `late-write` breaks the simulated transport (a failed batch is answered while some of its
//! windows are still in flight) and `any-instance` its handshake (a session id naming a process
//! instance reaches whatever process now listens at its address); `early-slot-reuse` breaks the
//! simulated decode's staging driver (a ring slot freed before its copy-out) and
//! `ignore-watermark` the prefill's (a chunk written before the watermark admits it: the world
//! feeds kvx-engine's real driver a watermark past every placement with each `STAGING_RSP`),
//! `place-over-live` the decode's in-place receive (a slot placed as soon as it is granted, over
//! an older slot whose chunk is still being written into the ring); the
//! others arm test-only hooks (feature `sim-mutants` of kvx-core and kvx-engine, enabled by this
//! crate's `mutants` feature): inside the real `PrefillManager` (`early-ack`, `lost-status`,
//! `leak`, `stale-blacklist`) and the real `PrefillCore` (`early-exit`). `stale-blacklist` needs
//! seeds whose decodes keep one session id across restarts (`Scenario::fixed_sessions`, as
//! sglang's do): a batch planned for a decode's earlier process that fails after the decode
//! registered again blacklists the session and fails the new process's rooms. `stale-mark` is
//! the same bug one layer down, in kvx-engine's workers (their real `SessionMarks`, which the
//! simulated workers drive): a failure of a batch or connect begun before the decode's latest
//! registration marks the session dead, so the new process's jobs are skipped as `PeerFailed`
//! and its rooms fail; it too needs `fixed_sessions` (with ids naming the process, the new
//! process's id is another session).

/// A deliberately broken rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// The transport answers a failing batch at its first failure, windows still in flight.
    LateWrite,
    /// The prefill manager sends `ABORT_ACK` before the room's batches drained.
    EarlyAck,
    /// The prefill manager drops one Success status without failing the room.
    LostStatus,
    /// The prefill manager keeps one room's entry after it concluded.
    Leak,
    /// The transport writes to whatever process listens at a session id's address, ignoring
    /// the instance the id names (a decode that restarted there gets the old rooms' chunks).
    AnyInstance,
    /// The decode frees a staged chunk's ring slot (and sends the new watermark) before its
    /// copy-out into the room's pages ran, so a later chunk may be written over it first.
    EarlySlotReuse,
    /// The prefill's staging driver writes a chunk as soon as its placement is known, without
    /// waiting for the decode's watermark to admit it (over an older slot still live).
    IgnoreWatermark,
    /// The prefill core hands out a dead worker's fatal fault (and the rank exits) before the
    /// rank's batches drained.
    EarlyExit,
    /// The decode places a staged slot (receives its writes straight into the pages) as soon
    /// as it is granted, though an older live slot overlaps it.
    PlaceOverLive,
    /// The prefill manager blacklists a decode session on any failed batch, even one planned
    /// for the session's earlier registration (a decode that restarted under the same session
    /// id since), failing the new process's open rooms.
    StaleBlacklist,
    /// kvx-engine's workers mark a decode session dead on any peer failure, even one of an
    /// attempt begun before the session's latest registration (`SessionMarks::mark_dead`
    /// ignoring `revived_since`): the restarted decode's jobs are skipped as `PeerFailed`.
    StaleMark,
}

impl Mutant {
    /// Every mutant, in report order.
    pub const ALL: [Mutant; 11] = [
        Mutant::LateWrite,
        Mutant::EarlyAck,
        Mutant::LostStatus,
        Mutant::Leak,
        Mutant::AnyInstance,
        Mutant::EarlySlotReuse,
        Mutant::IgnoreWatermark,
        Mutant::EarlyExit,
        Mutant::PlaceOverLive,
        Mutant::StaleBlacklist,
        Mutant::StaleMark,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::LateWrite => "late-write",
            Mutant::EarlyAck => "early-ack",
            Mutant::LostStatus => "lost-status",
            Mutant::Leak => "leak",
            Mutant::AnyInstance => "any-instance",
            Mutant::EarlySlotReuse => "early-slot-reuse",
            Mutant::IgnoreWatermark => "ignore-watermark",
            Mutant::EarlyExit => "early-exit",
            Mutant::PlaceOverLive => "place-over-live",
            Mutant::StaleBlacklist => "stale-blacklist",
            Mutant::StaleMark => "stale-mark",
        }
    }

    /// The mutant called `name`.
    pub fn parse(name: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == name)
    }

    /// True when the mutant lives in kvx-core or kvx-engine (needs the `mutants` feature).
    pub fn in_core(self) -> bool {
        !matches!(
            self,
            Mutant::LateWrite
                | Mutant::AnyInstance
                | Mutant::EarlySlotReuse
                | Mutant::IgnoreWatermark
                | Mutant::PlaceOverLive
        )
    }

    /// The kvx-core hook for this mutant, when it is one and the feature is on.
    #[cfg(feature = "mutants")]
    pub fn core(self) -> Option<kvx_core::prefill::mutant::SimMutant> {
        use kvx_core::prefill::mutant::SimMutant;
        match self {
            Mutant::LateWrite
            | Mutant::AnyInstance
            | Mutant::EarlySlotReuse
            | Mutant::IgnoreWatermark
            | Mutant::PlaceOverLive
            | Mutant::EarlyExit
            | Mutant::StaleMark => None,
            Mutant::EarlyAck => Some(SimMutant::EarlyAck),
            Mutant::LostStatus => Some(SimMutant::LostStatus),
            Mutant::Leak => Some(SimMutant::Leak),
            Mutant::StaleBlacklist => Some(SimMutant::StaleBlacklist),
        }
    }
}
