//! # kvx-sim
//!
//! Deterministic simulation of kvx's prefill and decode ranks: each prefill rank is kvx-engine's
//! real `PrefillCore` (the prefill engine's owner-loop rules over kvx-core's `PrefillManager` and,
//! in staged seeds, kvx-engine's `StagingDriver`) with simulated transfer workers, each decode rank
//! kvx-core's real `DecodeManager` under a driver that follows kvx-engine's decode. They run
//! against a simulated control plane (per-link FIFO ZMQ messages, delayed, reordered across links,
//! lost and duplicated where the real sockets can), a simulated data plane implementing the
//! `Transport` contract with faults (rejected writes, failing connections, slow windows, decodes
//! that die and come back on the same address — under a session id naming the new process, or,
//! in some seeds, as sglang's do, under the very same id, their old batches failing only after
//! a detection delay), and simulated time — with several prefill
//! and decode ranks (TP fan-in and fan-out), local aborts on both sides, and fatal worker faults
//! (a worker restarted, or the rank going down once drained). Some seeds stage their
//! heterogeneous-TP rooms through the decodes' rings with kvx-staging's real state machines
//! (`STAGING_REQ/RSP`, `WATERMARK`, `CHUNK_READY`, the prefill's probes reporting `SessionLost`
//! for a dead decode), some send aux rows as `AUX_DATA`, and some carry a state component (a
//! slot per room). Everything derives from one `u64` seed; invariants ([`invariants::Inv`]) are
//! checked at every step, and a failing seed is replayed with a trace of the events of the room
//! that broke one.
//!
//! `cargo xtask sim [--seed S] [--steps N] [--mutant NAME]` runs the `kvx-sim` binary.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod clock;
pub mod data;
pub mod invariants;
pub mod memory;
pub mod mutants;
pub mod net;
pub mod rng;
pub mod scenario;
pub mod world;

use std::time::Instant;

use invariants::{Inv, Violation};
use mutants::Mutant;
pub use world::Stats;
use world::{Trace, World};

/// The outcome of one seed.
#[derive(Clone, Debug)]
pub struct SeedOutcome {
    /// The seed.
    pub seed: u64,
    /// Steps taken.
    pub steps: u64,
    /// Checks per invariant.
    pub checks: [u64; Inv::ALL.len()],
    /// Violations (the run stops at the first).
    pub violations: Vec<Violation>,
    /// How often the rarer paths ran.
    pub stats: Stats,
}

/// Runs one seed to quiescence (or its first violation).
pub fn run_seed(seed: u64, mutant: Option<Mutant>) -> SeedOutcome {
    let mut w = World::new(seed, mutant, Instant::now());
    w.run();
    SeedOutcome {
        seed,
        steps: w.steps,
        checks: w.check.checks,
        violations: w.check.violations,
        stats: w.stats,
    }
}

/// Replays `seed` up to the step of `v`, keeping the trace of `v`'s room (and of the faults
/// of whole ranks). Returns the trace lines and whether the replay hit the same violation.
pub fn replay(seed: u64, mutant: Option<Mutant>, v: &Violation) -> (Vec<String>, bool) {
    let mut w = World::new(seed, mutant, Instant::now());
    w.trace = Some(Trace {
        room: v.room,
        until: v.step,
        lines: Vec::new(),
    });
    w.run();
    let same = w.check.violations.first() == Some(v);
    let mut lines = vec![format!("scenario: {:?}", w.sc)];
    lines.extend(w.trace.map(|t| t.lines).unwrap_or_default());
    (lines, same)
}
