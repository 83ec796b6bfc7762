//! A seed's world: topology, workload, fault rates and timeouts, all drawn from the seed.
//!
//! Rates are per seed, so some seeds run on a perfect network and data plane (where every room
//! must succeed or fail only by its planted faults) and others drown in faults.

use kvx_core::BatchLimits;

use crate::clock::{MS, Nanos, SEC, US};
use crate::data::DataConfig;
use crate::net::NetConfig;
use crate::rng::Rng;

/// Everything a seed decides before its first event.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Prefill attention-TP size (one prefill rank per TP rank).
    pub prefill_tp: u32,
    /// Decode attention-TP size.
    pub decode_tp: u32,
    /// Rooms to run.
    pub rooms: u32,
    /// Mean gap between two new rooms.
    pub spawn_gap: Nanos,
    /// Most pages of one room.
    pub max_pages: u64,
    /// Pages per decode rank's pool.
    pub decode_pages: u64,
    /// Aux rows per decode rank.
    pub decode_rows: u64,
    /// Batch limits of the prefill managers.
    pub limits: BatchLimits,
    /// The decodes are sglang 0.5.23 (generational ABORTs, registration frame 19).
    pub v0523: bool,
    /// Control-plane faults.
    pub net: NetConfig,
    /// Data-plane faults.
    pub data: DataConfig,
    /// Chance (ppm per room) of a decode-side local abort.
    pub decode_abort_ppm: u32,
    /// Chance (ppm per room) of a prefill-side local abort.
    pub prefill_abort_ppm: u32,
    /// Chance (ppm per room spawned) of a fatal worker fault on a random prefill rank.
    pub fatal_ppm: u32,
    /// Chance (ppm per room spawned) that a random decode rank dies (and comes back).
    pub decode_crash_ppm: u32,
    /// Prefill bootstrap timeout.
    pub bootstrap_timeout: Nanos,
    /// Decode waiting timeout.
    pub waiting_timeout: Nanos,
    /// Failed-session TTL.
    pub failed_session_ttl: Nanos,
    /// How long a failed decode room keeps its pages without every prefill's word.
    pub release_timeout: Nanos,
    /// Slack beyond the timeouts before a room must be terminal (message delays).
    pub slack: Nanos,
}

impl Scenario {
    /// The scenario of `seed` (drawn from `rng`, the seed's generator).
    pub fn draw(rng: &mut Rng) -> Self {
        let tps = [1u32, 1, 2, 2, 4];
        let prefill_tp = rng.pick(&tps);
        let decode_tp = rng.pick(&tps);
        // A third of the seeds are fault-free on the wire, so every room there must end by its
        // statuses alone.
        let faulty = rng.below(3) != 0;
        let f = |rng: &mut Rng, ppm: u32| {
            if faulty {
                rng.range(0, u64::from(ppm)) as u32
            } else {
                0
            }
        };
        let max_ops = rng.range(2, 24) as usize;
        let max_bytes = rng.range(16, 2048);
        let net = NetConfig {
            min_delay: 20 * US,
            max_delay: rng.range(100 * US, 3 * MS),
            slow_ppm: f(rng, 50_000),
            slow_max: 300 * MS,
            drop_ppm: f(rng, 10_000),
            dup_ppm: f(rng, 30_000),
        };
        let data = DataConfig {
            conns: rng.range(1, 3) as usize,
            window_ops: rng.range(1, 6) as usize,
            min_lat: 10 * US,
            max_lat: rng.range(100 * US, 5 * MS),
            slow_ppm: f(rng, 50_000),
            slow_max: 2 * SEC,
            conn_fail_ppm: f(rng, 60_000),
            reject_ppm: f(rng, 5_000),
            late_write: false,
        };
        let mut sc = Scenario {
            prefill_tp,
            decode_tp,
            rooms: rng.range(10, 120) as u32,
            spawn_gap: rng.range(200 * US, 20 * MS),
            max_pages: rng.range(0, 8),
            decode_pages: 48,
            decode_rows: 24,
            limits: BatchLimits::new(max_ops, max_bytes).unwrap_or_default(),
            v0523: rng.below(2) == 0,
            net,
            data,
            decode_abort_ppm: f(rng, 80_000),
            prefill_abort_ppm: f(rng, 40_000),
            fatal_ppm: f(rng, 8_000),
            decode_crash_ppm: f(rng, 8_000),
            bootstrap_timeout: 3 * SEC,
            waiting_timeout: 6 * SEC,
            failed_session_ttl: rng.range(100 * MS, 2 * SEC),
            release_timeout: 8 * SEC,
            slack: 400 * MS,
        };
        // One faulty seed in six is a restart storm: decodes crash and come back often while
        // many control messages crawl, so metadata sent by one incarnation keeps reaching
        // prefill ranks after the next one started (the ordering that needs the data plane to
        // refuse a restarted peer, which ordinary rates reach about once per 30,000 seeds).
        if faulty && rng.below(6) == 0 {
            sc.decode_crash_ppm = rng.range(50_000, 200_000) as u32;
            sc.net.slow_ppm = rng.range(100_000, 300_000) as u32;
        }
        sc
    }

    /// A room must be terminal on every rank this long after it was spawned.
    pub fn room_deadline(&self) -> Nanos {
        self.bootstrap_timeout + self.waiting_timeout + self.release_timeout + self.slack
    }
}
