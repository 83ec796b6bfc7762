//! What a decode run reports: the [`Summary`] (printed, and written by `--summary-json`), the
//! merge of several decode ranks' summaries into one, and the latency percentile.

use std::collections::HashMap;

use serde::Serialize;

/// What a decode run did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// Requests attempted.
    pub requests: usize,
    /// Rooms that reached Success.
    pub succeeded: usize,
    /// Rooms that failed.
    pub failed: usize,
    /// Successful rooms whose every byte matched the pattern.
    pub verified: usize,
    /// Successful rooms with at least one wrong byte.
    pub corrupt: usize,
    /// KV and aux bytes of verified rooms.
    pub bytes: u64,
    /// Wall time of the run in seconds.
    pub seconds: f64,
    /// Verified bytes per second, in GB/s (10^9).
    pub gbps: f64,
    /// Median room latency (metadata sent → outcome), ms.
    pub p50_ms: f64,
    /// 99th percentile room latency, ms.
    pub p99_ms: f64,
    /// Every room's latency (metadata sent → outcome), ms, in request order (the latency CDF).
    pub latencies_ms: Vec<f64>,
    /// Failure reasons and how many rooms each.
    pub failure_reasons: HashMap<String, usize>,
    /// Rooms that failed or arrived corrupt, in request order.
    pub unverified_rooms: Vec<u64>,
    /// Chunks that arrived through the staging ring (0 without staging).
    pub staged_chunks: u64,
    /// Of their bytes, those received straight into the pages (not scattered from the ring).
    pub staged_bytes_in_place: u64,
    /// Messages at the decode's inbox that were malformed (dropped by the inbox or refused by
    /// the parser) or of a kind it does not use; every one dropped.
    pub dropped_messages: u64,
    /// Failed rooms this decode sent `ABORT` for.
    pub aborted_rooms: u64,
    /// Aborted rooms every prefill rank acknowledged before the release timeout.
    pub abort_acked_rooms: u64,
    /// Acknowledged rooms whose pages changed after the last `ABORT_ACK` (must be 0).
    pub late_writes: u64,
    /// The signal that stopped the run before every request ran (`null`: it ran to the end).
    pub interrupted: Option<String>,
    /// Requests never started because the run was stopped.
    pub not_started: usize,
    /// Rooms still in flight when the drain's `--shutdown-timeout` passed: failed here and
    /// ABORTed at the prefill (counted in `failed` too).
    pub shutdown_aborted: usize,
}

impl Summary {
    /// Whether the run went as asked: every request verified, or — stopped by a signal — every
    /// started room verified except those the drain deadline aborted.
    pub fn clean(&self) -> bool {
        if self.interrupted.is_some() {
            self.corrupt == 0 && self.failed == self.shutdown_aborted
        } else {
            self.verified == self.requests
        }
    }
}

impl Summary {
    /// One summary for the decode ranks of one instance that ran the same rooms (same seed):
    /// a room counts as verified only when no rank failed it or found it corrupt; bytes, staged
    /// chunks and dropped messages add up; a room's latency is its slowest rank's; `failed` and
    /// `corrupt` are the most on any one rank.
    pub fn merge_ranks(ranks: &[Summary]) -> Summary {
        let Some(first) = ranks.first() else {
            return Summary::default();
        };
        let mut out = Summary {
            requests: first.requests,
            ..Summary::default()
        };
        let mut unverified: Vec<u64> = ranks
            .iter()
            .flat_map(|r| r.unverified_rooms.iter().copied())
            .collect();
        unverified.sort_unstable();
        unverified.dedup();
        out.not_started = ranks.iter().map(|r| r.not_started).max().unwrap_or(0);
        out.interrupted = ranks.iter().find_map(|r| r.interrupted.clone());
        out.verified = out
            .requests
            .saturating_sub(out.not_started)
            .saturating_sub(unverified.len());
        out.unverified_rooms = unverified;
        for r in ranks {
            out.shutdown_aborted = out.shutdown_aborted.max(r.shutdown_aborted);
            out.failed = out.failed.max(r.failed);
            out.corrupt = out.corrupt.max(r.corrupt);
            out.bytes += r.bytes;
            out.seconds = out.seconds.max(r.seconds);
            out.staged_chunks += r.staged_chunks;
            out.staged_bytes_in_place += r.staged_bytes_in_place;
            out.dropped_messages += r.dropped_messages;
            out.aborted_rooms += r.aborted_rooms;
            out.abort_acked_rooms += r.abort_acked_rooms;
            out.late_writes += r.late_writes;
            for (why, n) in &r.failure_reasons {
                *out.failure_reasons.entry(why.clone()).or_default() += n;
            }
            if out.latencies_ms.len() < r.latencies_ms.len() {
                out.latencies_ms.resize(r.latencies_ms.len(), 0.0);
            }
            for (m, l) in out.latencies_ms.iter_mut().zip(&r.latencies_ms) {
                *m = m.max(*l);
            }
        }
        out.succeeded = out
            .requests
            .saturating_sub(out.not_started)
            .saturating_sub(out.failed);
        out.gbps = out.bytes as f64 / out.seconds.max(1e-9) / 1e9;
        let mut lat = out.latencies_ms.clone();
        lat.sort_by(f64::total_cmp);
        out.p50_ms = percentile(&lat, 0.50);
        out.p99_ms = percentile(&lat, 0.99);
        out
    }
}

/// The `q` quantile of sorted values (nearest rank), 0 for none.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_ranks_verify_a_room_only_when_every_rank_did() {
        let rank = |unverified: Vec<u64>, failed, lat: Vec<f64>| Summary {
            requests: 4,
            failed,
            verified: 4 - unverified.len(),
            unverified_rooms: unverified,
            bytes: 100,
            seconds: 2.0,
            latencies_ms: lat,
            staged_chunks: 3,
            ..Summary::default()
        };
        let m = Summary::merge_ranks(&[
            rank(vec![7], 1, vec![1.0, 5.0, 1.0, 1.0]),
            rank(vec![9], 1, vec![2.0, 1.0, 1.0, 1.0]),
        ]);
        // Rooms 7 and 9 each failed on one rank: 2 of 4 rooms arrived whole.
        assert_eq!((m.verified, m.unverified_rooms.clone()), (2, vec![7, 9]));
        assert_eq!((m.bytes, m.staged_chunks, m.failed), (200, 6, 1));
        assert_eq!(m.latencies_ms, vec![2.0, 5.0, 1.0, 1.0]);
        assert_eq!(m.p99_ms, 5.0);
        assert_eq!(Summary::merge_ranks(&[]).requests, 0);
    }
}
