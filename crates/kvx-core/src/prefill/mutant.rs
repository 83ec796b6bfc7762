//! Test-only planted bugs for kvx-sim's self-test (feature `sim-mutants`).
//!
//! A deterministic simulator that cannot find a planted bug proves nothing, so `cargo xtask sim
//! --mutant NAME` arms one of these in every [`super::PrefillManager`] of a run and must report a
//! violation. Nothing here has any effect until [`super::PrefillManager::set_sim_mutant`] is
//! called; without the feature the hook is not compiled.

/// A deliberately broken rule of the prefill manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimMutant {
    /// `ABORT_ACK` goes out at once, even while batches of the room are in flight.
    EarlyAck,
    /// The first Success status this manager emits is dropped (the room is not failed).
    LostStatus,
    /// The first room this manager releases keeps its entry forever.
    Leak,
    /// A failed batch blacklists its decode session even when it was planned for an earlier
    /// registration of the session (the decode restarted and registered again since), failing
    /// the new process's open rooms: the rule before the registration check.
    StaleBlacklist,
}
