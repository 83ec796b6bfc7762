//! A seed's world: topology, workload, fault rates and timeouts, all drawn from the seed.
//!
//! Rates are per seed, so some seeds run on a perfect network and data plane (where every room
//! must succeed or fail only by its planted faults) and others drown in faults.

use kvx_core::BatchLimits;

use crate::clock::{MS, Nanos, SEC, US};
use crate::data::DataConfig;
use crate::memory::{HEAD_BYTES, KV_BUFFERS, PAGE_SIZE, TOTAL_HEADS};
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
    /// Faults were drawn (a third of the seeds run without any).
    pub faulty: bool,
    /// Staged rooms (heterogeneous TP through the decodes' staging rings), when drawn.
    pub staging: Option<StagingConfig>,
    /// The prefills send aux rows as `AUX_DATA` messages (`aux_over_tcp`).
    pub aux_tcp: bool,
    /// The model has a state component (a MAMBA-like slot per room; equal-TP seeds only, as
    /// the manager moves state only between equal attention TP).
    pub state: bool,
    /// How long a crashed decode stays down before it restarts.
    pub decode_down: Nanos,
    /// Transfer queue shards (workers) per prefill rank.
    pub queues: u32,
    /// A prefill rank restarts a worker that died instead of going down.
    pub restart_workers: bool,
    /// The decodes publish one data-plane session id across restarts (their address, as
    /// sglang's decodes do) instead of one naming each process instance (kvx's listeners); a
    /// write planned for an earlier process of the decode fails as the new process's memory
    /// keys refuse it (the room it writes names the process it was planned for).
    pub fixed_sessions: bool,
    /// With `fixed_sessions`, the longest time a prefill's transport takes to notice that a
    /// crashed decode's connections are gone (a timeout, not a reset): each batch in flight at
    /// the crash fails that much later — after the decode may have restarted and registered
    /// again. 0: at once.
    pub crash_detect: Nanos,
}

/// The staging parameters of a seed whose rooms go through the decodes' rings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Pages per full grid chunk.
    pub grid_pages: u64,
    /// Bytes of each decode rank's ring.
    pub ring_bytes: u64,
    /// A chunk parked this long (no ring space) fails its room (kvx's `staging_wait_timeout`).
    pub wait_timeout: Nanos,
    /// The gap between the two connects of one probe.
    pub probe_retry: Nanos,
    /// The decodes receive staged blocks straight into the pages (kvx-engine's
    /// `DecodeStagingConfig::in_place` over tcp) instead of scattering them from the ring.
    pub in_place: bool,
    /// With `in_place`: the prefill ranks (bit `p` for TP rank `p`) whose writes reach the
    /// decodes around their tcp receivers (RDMA, shared memory, a Mooncake TE writer), so that
    /// no placement routes them: their blocks land in the ring and are scattered from it, beside
    /// the other writers' blocks of the same chunk received in place.
    pub around: u32,
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
            faulty,
            staging: None,
            aux_tcp: false,
            state: false,
            decode_down: 200 * MS,
            queues: 1,
            restart_workers: false,
            fixed_sessions: false,
            crash_detect: 0,
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

    /// Draws the features added after the first scenarios (staging, `AUX_DATA` over tcp, long
    /// decode outages, worker shards, session ids fixed across decode restarts) from `rng`, a
    /// generator of their own: a seed without them runs exactly as it did before they existed,
    /// so the seeds kept as regressions keep their meaning.
    pub fn draw_features(&mut self, rng: &mut Rng) {
        self.aux_tcp = rng.below(4) == 0;
        self.state = self.prefill_tp == self.decode_tp && rng.below(3) == 0;
        // Half of the heterogeneous-TP seeds stage their rooms.
        // Restart storms stay unstaged: they are where a data plane that ignores the instance
        // a session id names gets caught (staged chunks need a placement from the live
        // process, so staging hides that bug). Staged seeds draw their own outages below.
        let storm = self.decode_crash_ppm >= 50_000;
        if self.prefill_tp != self.decode_tp && rng.below(2) == 0 && !storm {
            let grid_pages = rng.range(1, 3);
            let heads = u64::from(TOTAL_HEADS / self.decode_tp);
            let page_bytes = u64::from(PAGE_SIZE) * heads * HEAD_BYTES * KV_BUFFERS as u64;
            let chunk = grid_pages * page_bytes;
            // From a ring smaller than one chunk (some rooms are oversized) to four chunks:
            // small rings wrap all the time, so writers wait for watermarks.
            let ring_bytes = if rng.below(10) == 0 {
                rng.range(chunk / 2, chunk)
            } else {
                rng.range(chunk, 4 * chunk)
            };
            self.staging = Some(StagingConfig {
                grid_pages,
                ring_bytes,
                wait_timeout: rng.range(2 * SEC, 5 * SEC),
                probe_retry: 500 * MS,
                in_place: false,
                around: 0,
            });
            // Crashed decodes stay down long enough for the prefill's probes to notice (the
            // staged rooms waiting on them fail by `SessionLost`); one faulty staged seed in
            // four loses decodes often.
            if self.decode_crash_ppm > 0 {
                self.decode_down = rng.range(200 * MS, 4 * SEC);
                if rng.below(4) == 0 {
                    self.decode_crash_ppm = rng.range(20_000, 100_000) as u32;
                }
            }
        }
        // The prefill engine's worker shards: one to three queues, and one rank in three
        // restarts a worker that died.
        self.queues = rng.range(1, 3) as u32;
        self.restart_workers = rng.below(3) == 0;
        // Drawn last, so that every draw above stays what it was: three staged seeds in four
        // receive their blocks in place, and half of those have some prefill ranks (not all,
        // where there are several) writing around the receivers.
        if let Some(s) = &mut self.staging {
            s.in_place = rng.below(4) != 0;
            if s.in_place && rng.below(2) == 0 {
                let all = (1u64 << self.prefill_tp) - 1;
                s.around = rng.range(1, all.saturating_sub(1).max(1)) as u32;
            }
        }
        // Drawn after everything above, for the same reason: a quarter of the unstaged seeds
        // have decodes that keep their session id across restarts (sglang's), and there a
        // crashed decode's batches in flight fail only after a drawn detection delay, often
        // past its restart (200 ms) and new registration — the order in which a failure
        // towards the decode's earlier process must not blacklist the new one.
        if self.staging.is_none() && rng.below(4) == 0 {
            self.fixed_sessions = true;
            if self.decode_crash_ppm > 0 {
                self.crash_detect = rng.range(50 * MS, 1500 * MS);
            }
        }
    }

    /// A room must be terminal on every rank this long after it was spawned.
    pub fn room_deadline(&self) -> Nanos {
        self.bootstrap_timeout + self.waiting_timeout + self.release_timeout + self.slack
    }
}
