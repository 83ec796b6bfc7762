//! The prefill side of staging in the simulated world. The rules run inside the rank's real
//! `PrefillCore` (kvx-engine's `StagingDriver` under it); what stays here is what the engine's
//! workers and probe tasks do around it: a staged chunk's job is gathered with kvx-staging's
//! `gather` from the rank's memory when its worker takes it (`worker.rs` then writes it with one
//! op into the decode's ring), and a liveness probe is two connects to the decode's inbox.
//!
//! What the sim adds, from what it observes and never by re-deriving the driver's rules: the
//! *long wait* excuse of the invariants (a chunk gathered [`LONG_WAIT`] after the forward pass fed
//! its last pages, a chunk still parked that long when a decode times out on its room, a room
//! failed by the staging wait timeout, or a room failed with a chunk fed that long before and
//! never gathered, waited behind a fault; in a fault-free seed that may not happen), and the
//! `ignore-watermark` mutant's lie
//! ([`everything_free`]).

use kvx_core::prefill::RoomError;
use kvx_core::{PageSlice, Room, SessionId};
use kvx_engine::prefill_staging::{LocalShape, StageWork, StagingDriver};
use kvx_staging::{ChunkGrid, Watermark, WatermarkMsg};

use super::{Ev, World, session_decode};
use crate::clock::{MS, Nanos, dur};
use crate::memory::{KV_BUFFERS, PAGE_SIZE, TOTAL_HEADS, item_len};

/// A chunk gathered this long after the forward pass fed its last pages waited behind a fault (a
/// slow write or message, or a slot fenced for a dead rank, holding the watermark back); in a
/// fault-free seed none waits nearly as long.
const LONG_WAIT: Nanos = 500 * MS;

/// A watermark past every placement: the `ignore-watermark` mutant's lie.
pub(crate) fn everything_free(session: &SessionId) -> WatermarkMsg {
    WatermarkMsg {
        watermark: Watermark {
            round: u64::MAX,
            tail: u64::MAX,
        },
        session: session.clone(),
    }
}

impl World {
    /// A fresh staging driver for prefill rank `p`, when the seed stages.
    pub(crate) fn new_staging_driver(&self, p: u32) -> Option<StagingDriver> {
        let cfg = self.sc.staging?;
        let local = LocalShape {
            tp_rank: p,
            tp_size: self.sc.prefill_tp,
            total_kv_heads: TOTAL_HEADS,
            page_size: u64::from(PAGE_SIZE),
            item_len: item_len(self.sc.prefill_tp),
            num_buffers: KV_BUFFERS,
        };
        let grid = ChunkGrid::with_pages(cfg.grid_pages);
        Some(StagingDriver::new(local, grid, dur(cfg.wait_timeout)))
    }

    /// The forward pass fed `slice` of `room`: notes when each grid chunk it touches was fed
    /// (the last feed of a chunk completes it), for staged rooms.
    pub(crate) fn prefill_staging_fed(&mut self, p: u32, room: Room, slice: PageSlice) {
        let now = self.clock.now();
        let Some(cfg) = self.sc.staging else {
            return;
        };
        let n = &mut self.prefills[p as usize];
        let staged = n.core.staging().is_some_and(|d| d.rooms().contains(&room));
        if !staged {
            return;
        }
        for (idx, _) in ChunkGrid::with_pages(cfg.grid_pages).split(slice) {
            if let Ok(idx) = u32::try_from(idx) {
                n.fed.insert((room, idx), (now, false));
            }
        }
    }

    /// True when a staged chunk of `room` has been parked [`LONG_WAIT`] in a prefill rank's
    /// staging driver in a faulty seed (waiting for ring space behind a fault, its room not yet
    /// failed by the wait timeout, which the driver checks only once a second): a decode that
    /// times out on the room meanwhile waited behind that fault, as one whose chunk is gathered
    /// late or whose room the wait timeout fails did (kvx-sim seed 131871).
    pub(crate) fn parked_long(&self, room: Room) -> bool {
        let now = self.clock.now();
        self.sc.faulty
            && self.prefills.iter().any(|n| {
                !n.down
                    && n.core
                        .staging()
                        .and_then(|d| d.parked_since(room))
                        .is_some_and(|t| now.saturating_sub(self.clock.offset(t)) >= LONG_WAIT)
            })
    }

    /// A staged chunk's worker gathers its head slices from the rank's memory.
    pub(crate) fn stage_gather(&mut self, p: u32, w: &StageWork) -> Result<Vec<u8>, String> {
        let now = self.clock.now();
        let n = &mut self.prefills[p as usize];
        // Kept until the room concludes: every decode session's copy of the chunk is gathered
        // against it.
        let fed = n.fed.get_mut(&(w.key.room, w.key.chunk_idx));
        let long = fed.is_some_and(|(t, gathered)| {
            *gathered = true;
            now.saturating_sub(*t) >= LONG_WAIT
        });
        let mut bytes = vec![0u8; usize::try_from(w.len).unwrap_or(0)];
        let gathered = kvx_staging::gather(&w.spec, n.mem.kv_bufs(), &w.src_pages, &mut bytes);
        if long && self.sc.faulty {
            self.excuse(Some(w.key.room));
        }
        gathered
            .map(|_| bytes)
            .map_err(|e| format!("staging chunk {}: {e}", w.key.chunk_idx))
    }

    /// The core concluded a room: the sim forgets its notes; a room the staging wait timeout
    /// failed waited behind a fault, and so did one failed with a chunk the forward pass fed
    /// [`LONG_WAIT`] before that no worker gathered (parked for ring space behind a fault until
    /// the room failed — e.g. as its session dead, at the housekeeping tick that ran the staging
    /// wait timeout after a chunk towards that decode failed: the manager hears of a staged
    /// chunk's failure only once its batch is done; kvx-sim seed 343305).
    pub(crate) fn prefill_staging_concluded(
        &mut self,
        p: u32,
        room: Room,
        reason: Option<&RoomError>,
    ) {
        let now = self.clock.now();
        let n = &mut self.prefills[p as usize];
        let mut stuck = false;
        n.fed.retain(|&(r, _), &mut (t, gathered)| {
            if r == room {
                stuck |= !gathered && now.saturating_sub(t) >= LONG_WAIT;
            }
            r != room
        });
        let waited = reason.is_some_and(|r| r.to_string().contains("granted no ring space"))
            || (reason.is_some() && stuck);
        if waited && self.sc.faulty {
            self.excuse(Some(room));
        }
    }

    /// One connect of a liveness probe to the inbox of the decode behind `session`: a decode
    /// that is down fails it; two failures in a row are reported as `SessionLost`. A decode
    /// restarted on the same address answers (its inbox is back), as a real connect would.
    pub(crate) fn prefill_probe(&mut self, p: u32, inc: u32, session: SessionId, retry: bool) {
        let n = &self.prefills[p as usize];
        if n.inc != inc || n.down {
            return;
        }
        let Some((d, _)) = session_decode(&session, self.sc.decode_tp) else {
            return;
        };
        if !self.decodes[d as usize].down {
            return;
        }
        if !retry {
            let at = self.clock.now() + self.sc.staging.map_or(0, |c| c.probe_retry);
            let ev = Ev::Probe {
                p,
                inc,
                session,
                retry: true,
            };
            self.schedule(at, ev);
            return;
        }
        self.trace_line(None, || format!("  prefill {p} -> SessionLost {session}"));
        self.stats.sessions_lost += 1;
        self.prefill_call(p, None, |c, now, out| c.session_lost(now, session, out));
    }
}
