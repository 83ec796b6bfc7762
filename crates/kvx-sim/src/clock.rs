//! Simulated time: every timeout, heartbeat, TTL and deadline of a run reads this clock.
//!
//! The managers take [`std::time::Instant`]s, so simulated time is a fixed base `Instant` (taken
//! once; only differences are ever observed) plus a nanosecond offset that moves only when the
//! scheduler takes the next event.

use std::time::{Duration, Instant};

/// Nanoseconds of simulated time since the start of a run.
pub type Nanos = u64;

/// One microsecond in [`Nanos`].
pub const US: Nanos = 1_000;
/// One millisecond in [`Nanos`].
pub const MS: Nanos = 1_000 * US;
/// One second in [`Nanos`].
pub const SEC: Nanos = 1_000 * MS;

/// The simulated clock of one run.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    base: Instant,
    now: Nanos,
}

impl Clock {
    /// A clock at offset 0 over `base`.
    pub fn new(base: Instant) -> Self {
        Clock { base, now: 0 }
    }

    /// The current offset.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// The current time as the managers see it.
    pub fn instant(&self) -> Instant {
        self.at(self.now)
    }

    /// The `Instant` of offset `t`.
    pub fn at(&self, t: Nanos) -> Instant {
        self.base + Duration::from_nanos(t)
    }

    /// The offset of an `Instant` (saturating at 0 before the base).
    pub fn offset(&self, t: Instant) -> Nanos {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Moves time forward to `t` (never backwards).
    pub fn advance_to(&mut self, t: Nanos) {
        self.now = self.now.max(t);
    }
}

/// A [`Duration`] from [`Nanos`].
pub fn dur(t: Nanos) -> Duration {
    Duration::from_nanos(t)
}
