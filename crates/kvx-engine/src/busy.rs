//! The transfer busy clock: how long a prefill rank had at least one batch on the data plane.
//!
//! Each posted batch holds a [`Busy`] guard from just before it is posted until its completion
//! was awaited (or it was abandoned); the clock adds up the time during which at least one guard
//! lived, the union over the rank's transfer workers. Bytes over that time is the rank's
//! transfer throughput with the forward pass, queueing and idle time taken out (`kvx demo`
//! prints it beside its link test), and its growth rate is the data plane's utilisation
//! (`kvx_prefill_transfer_busy_seconds`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Batches in flight, since when, and the busy time accumulated before that.
#[derive(Default)]
struct State {
    in_flight: usize,
    since: Option<Instant>,
    total: Duration,
}

/// The union of the spans during which at least one batch was in flight.
#[derive(Default)]
pub struct BusyClock {
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl BusyClock {
    /// A batch is about to be posted: the clock runs until the guard is dropped.
    pub fn enter(self: &Arc<Self>) -> Busy {
        self.enter_at(Instant::now());
        Busy(self.clone())
    }

    fn enter_at(&self, now: Instant) {
        let mut s = lock(&self.state);
        if s.in_flight == 0 {
            s.since = Some(now);
        }
        s.in_flight += 1;
    }

    fn leave_at(&self, now: Instant) {
        let mut s = lock(&self.state);
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0
            && let Some(t) = s.since.take()
        {
            let span = now.saturating_duration_since(t);
            s.total += span;
            // Added, not set: a process with several ranks (the demo) reports their sum.
            metrics::gauge!("kvx_prefill_transfer_busy_seconds").increment(span.as_secs_f64());
        }
    }

    /// Busy time so far (the running span included).
    pub fn total(&self) -> Duration {
        self.total_at(Instant::now())
    }

    fn total_at(&self, now: Instant) -> Duration {
        let s = lock(&self.state);
        s.total
            + s.since
                .map_or(Duration::ZERO, |t| now.saturating_duration_since(t))
    }
}

/// Keeps its clock running while it lives (one per batch in flight).
pub struct Busy(Arc<BusyClock>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.leave_at(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_spans_count_once_and_gaps_not_at_all() {
        let c = BusyClock::default();
        let t = Instant::now();
        let ms = Duration::from_millis;
        // [0, 10) and [5, 20) overlap: 20 ms; idle [20, 30); [30, 35): 5 ms.
        c.enter_at(t);
        c.enter_at(t + ms(5));
        c.leave_at(t + ms(10));
        assert_eq!(c.total_at(t + ms(15)), ms(15));
        c.leave_at(t + ms(20));
        assert_eq!(c.total_at(t + ms(30)), ms(20));
        c.enter_at(t + ms(30));
        c.leave_at(t + ms(35));
        assert_eq!(c.total_at(t + ms(99)), ms(25));
        // An unmatched leave does not underflow or start a span.
        c.leave_at(t + ms(100));
        assert_eq!(c.total_at(t + ms(200)), ms(25));
    }

    #[test]
    fn the_guard_stops_the_clock_when_dropped() {
        let c = Arc::new(BusyClock::default());
        let g = c.enter();
        let h = c.enter();
        drop(g);
        std::thread::sleep(Duration::from_millis(2));
        let running = c.total();
        assert!(running >= Duration::from_millis(2));
        drop(h);
        let stopped = c.total();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(c.total(), stopped);
    }
}
