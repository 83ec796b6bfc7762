//! Deferred release of a failed room's pages on the decode (sglang's deferred KV release, made
//! checkable). A room this decode ABORTed keeps its pages until every prefill rank the `ABORT`
//! went to returned a ranked `ABORT_ACK` — a kvx prefill sends it only once nothing of the room
//! is in flight — or until the release timeout; then the pages must stay unchanged for
//! [`LATE_WRITE_WINDOW`], and a change is counted as a late write. With a device KV pool
//! ([`crate::region::Region::from_raw_device`]) that check is skipped — the CPU cannot read the
//! pages — and the release rests on the `ABORT_ACK`s and the release timeout alone (no late write
//! is ever counted). A room that failed without an `ABORT` (one of its ranks' inbox is gone)
//! keeps its pages for [`FAILED_GRACE`]; one a prefill rank reported Failed, or whose instance's
//! heartbeat was lost, is ABORTed on every rank (`kvx-core`'s decode manager), so with TP fan-in
//! the ranks that did not fail stop writing and acknowledge before its pages go back. After a
//! lost heartbeat the decode probes the ranks' inboxes (a TCP connect, twice): when none
//! answers, every rank is gone and the pages go back; when one does (one rank's process died,
//! or only the bootstrap server), the ranks that have not acknowledged keep the pages until they
//! do or the release timeout passes — kvx-sim seed 88 found pages released under a live rank's
//! writes when every rank was taken for dead after a 1 s grace.
//!
//! An `ABORT` is sent again while it is unanswered ([`ABORT_RESEND_FIRST`], doubling up to
//! [`ABORT_RESEND_MAX`], until the release timeout): a lost `ABORT` (a control connection cut
//! right after it was written) would otherwise leave a live rank writing the room's queued
//! batches after the timeout gave its pages back — the hole kvx-sim counts as
//! `lost_abort_writes`. Prefills treat a repeated `ABORT` as the first (the room is already
//! failed; the ACK goes out once it drained, or at once), and ACKs count once per rank, so a
//! repeat changes nothing where the first one arrived. Resending stops once as many `ABORT_ACK`s
//! (of any form) came back as inboxes were sent to: a sglang prefill without deferred release
//! answers with the legacy form, which never releases the pages but shows the `ABORT` arrived.
//!
//! An `ABORT` towards a sglang 0.5.23 prefill carries a generation; an ACK that names a
//! generation counts only when it is the room's current one (a late ACK of an earlier abort of a
//! reused room id must not release the new room's pages), one without (sglang main's ranked
//! 3-frame form) counts as it always did, and the legacy 2-frame form never does.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvx_core::{Endpoint, Room};

use super::{Peer, lock};

/// Where an `ABORT` went and which ranks acknowledged it.
#[derive(Debug, Default)]
pub(super) struct AbortWait {
    /// The prefill inboxes the `ABORT` went to.
    pub(super) sent_to: HashSet<Endpoint>,
    /// The generation the latest `ABORT` of the room carried (`None`: sent without one).
    pub(super) generation: Option<u64>,
    /// The ranks whose ranked `ABORT_ACK` came back.
    pub(super) acked: HashSet<u32>,
    /// `ABORT_ACK`s of any form received for the room's current `ABORT` (stale generations
    /// excluded): once there are as many as inboxes it went to, it is not sent again.
    pub(super) answers: usize,
    /// After the instance's heartbeat was lost, no inbox the `ABORT` went to accepted a
    /// connection: every rank's process is gone and writes nothing more.
    pub(super) all_gone: bool,
}

impl AbortWait {
    /// Records that an `ABORT` with `generation` went to `endpoint`.
    pub(super) fn sent(&mut self, endpoint: Endpoint, generation: Option<u64>) {
        if generation.is_some() && generation != self.generation {
            // A new abort of the room: only ACKs of this one count from now on.
            self.acked.clear();
            self.answers = 0;
        }
        self.generation = generation.or(self.generation);
        self.sent_to.insert(endpoint);
    }

    /// Records an `ABORT_ACK`; true when it counts (see the module docs).
    pub(super) fn on_ack(&mut self, rank: Option<u32>, generation: Option<u64>) -> bool {
        if generation.is_some() && generation != self.generation {
            return false;
        }
        self.answers += 1;
        let Some(rank) = rank else {
            return false;
        };
        self.acked.insert(rank);
        true
    }

    /// True while the `ABORT` may not have reached every inbox: fewer `ABORT_ACK`s (of any
    /// form) came back than inboxes it went to.
    pub(super) fn unanswered(&self) -> bool {
        self.answers < self.sent_to.len()
    }

    /// The `ABORT`s to send again: (inbox, generation) for every inbox it went to.
    pub(super) fn resends(&self) -> Vec<(Endpoint, Option<u64>)> {
        self.sent_to
            .iter()
            .map(|ep| (ep.clone(), self.generation))
            .collect()
    }
}

/// A failed room that was not ABORTed keeps its pages this long (its prefill may still have a
/// write in flight when it reports the failure).
const FAILED_GRACE: Duration = Duration::from_secs(1);
/// How long a probe of a rank's inbox may take to connect (see `mark_gone_ranks`).
const GONE_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// After the last `ABORT_ACK`, the room's pages must stay unchanged this long.
const LATE_WRITE_WINDOW: Duration = Duration::from_millis(200);
/// An `ABORT` still unanswered this long after it went out is sent again; each later resend
/// waits twice as long as the one before, up to [`ABORT_RESEND_MAX`]. A kvx prefill answers
/// once the room's queued writes drained, so a slow answer is normal for a room with much in
/// flight: the first resend comes after the time a few hundred MiB take on a fast link.
pub(super) const ABORT_RESEND_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two sends of one `ABORT`.
pub(super) const ABORT_RESEND_MAX: Duration = Duration::from_secs(8);

impl Peer {
    /// True once every rank the room's `ABORT` went to acknowledged it, or all of them are gone.
    fn abort_acked(&self, room: Room) -> bool {
        lock(&self.aborts)
            .get(&room)
            .is_some_and(|w| w.all_gone || w.acked.len() >= w.sent_to.len())
    }

    /// The instance's heartbeat is lost: probes each inbox the room's `ABORT` went to (a TCP
    /// connect, twice, half a second apart). When none answers, every rank is gone. When one
    /// does (one rank's process died, or only the bootstrap server), the ranks that have not
    /// acknowledged still owe their ACK: a live one may have the room's writes queued, and an
    /// ACK names a rank, not the inbox, so a dead rank cannot be told from a live one here.
    async fn mark_gone_ranks(&self, room: Room) {
        let inboxes: Vec<Endpoint> = lock(&self.aborts)
            .get(&room)
            .map(|w| w.sent_to.iter().cloned().collect())
            .unwrap_or_default();
        let mut any_alive = false;
        for ep in inboxes {
            for attempt in 0..2 {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                if kvx_bootstrap::http::tcp_alive(&ep.host, ep.port, GONE_PROBE_TIMEOUT).await {
                    any_alive = true;
                    break;
                }
            }
            if any_alive {
                break;
            }
        }
        if !any_alive && let Some(w) = lock(&self.aborts).get_mut(&room) {
            w.all_gone = true;
        }
        self.acked.notify_waiters();
    }

    /// Holds a failed room's pages until nothing can land in them any more (see the module
    /// docs; `dead`: the room's prefill instance is gone, its ACKs will not come); the caller
    /// releases them afterwards. True when every rank acknowledged the room's `ABORT`.
    pub(super) async fn settle_failed(
        self: &Arc<Self>,
        room: Room,
        pages: &[i32],
        dead: &AtomicBool,
    ) -> bool {
        if !lock(&self.aborts).contains_key(&room) {
            tokio::time::sleep(FAILED_GRACE).await;
            return false;
        }
        self.aborted_rooms.fetch_add(1, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + self.cfg.abort_release_timeout;
        let mut probed = false;
        let mut gap = ABORT_RESEND_FIRST;
        let mut resend_at = tokio::time::Instant::now() + gap;
        let acked = loop {
            let notified = self.acked.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.abort_acked(room) {
                break true;
            }
            if dead.load(Ordering::Relaxed) && !probed {
                // Heartbeat lost: ranks that are gone count as stopped; the others still owe
                // their ACK (kvx-sim found pages released under a live rank's queued writes
                // when every rank was taken for dead here).
                probed = true;
                self.mark_gone_ranks(room).await;
                continue;
            }
            let wake = resend_at.min(deadline);
            if tokio::time::timeout_at(wake, notified).await.is_ok() {
                continue;
            }
            if wake >= deadline {
                break false;
            }
            self.resend_abort(room, gap).await;
            gap = (gap * 2).min(ABORT_RESEND_MAX);
            resend_at = tokio::time::Instant::now() + gap;
        };
        lock(&self.aborts).remove(&room);
        if !acked {
            metrics::counter!("kvx_decode_abort_release_timeouts_total").increment(1);
            tracing::warn!(%room, "not every prefill rank acknowledged the ABORT; pages released after a grace");
            tokio::time::sleep(FAILED_GRACE).await;
            return false;
        }
        self.abort_acked_rooms.fetch_add(1, Ordering::Relaxed);
        if self.kv.is_device() {
            // The CPU cannot read device pages: the check is skipped, and the release rests on
            // the ABORT_ACKs (and the release timeout) alone.
            tracing::debug!(%room, "device KV pool: late-write check skipped");
            return true;
        }
        let digest = |p: Arc<Peer>, pages: Vec<i32>| {
            tokio::task::spawn_blocking(move || p.pages_digest(&pages))
        };
        let before = digest(self.clone(), pages.to_vec()).await.ok();
        tokio::time::sleep(LATE_WRITE_WINDOW).await;
        let after = digest(self.clone(), pages.to_vec()).await.ok();
        if before != after {
            self.late_writes.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("kvx_decode_late_writes_total").increment(1);
            tracing::error!(%room, "a write landed in the room's pages after every prefill rank acknowledged its ABORT");
        }
        true
    }

    /// Sends the room's `ABORT` again to every inbox it went to, with its generation, unless
    /// enough `ABORT_ACK`s came back to show it arrived everywhere (`waited`: how long it has
    /// gone unanswered since it was last sent).
    async fn resend_abort(&self, room: Room, waited: Duration) {
        let resends = lock(&self.aborts)
            .get(&room)
            .filter(|w| w.unanswered())
            .map(AbortWait::resends)
            .unwrap_or_default();
        if resends.is_empty() {
            return;
        }
        tracing::info!(%room, ?waited, inboxes = resends.len(), "ABORT unanswered; sending it again");
        for (ep, generation) in resends {
            metrics::counter!("kvx_decode_abort_resends_total").increment(1);
            let _ = self
                .send(&ep, crate::wire::encode_abort(room, &self.me, generation))
                .await;
        }
    }

    /// A digest of every byte of the room's pages in every KV buffer. Read after every prefill
    /// rank promised to write nothing more into them: a write racing this read is exactly the
    /// late write it exists to detect.
    fn pages_digest(&self, pages: &[i32]) -> u64 {
        use std::hash::Hasher as _;
        let l = &self.cfg.layout;
        let mut h = std::hash::DefaultHasher::new();
        for b in 0..l.num_buffers {
            let base = l.buffer_addr(self.kv.base(), b);
            for &p in pages {
                let addr = base.saturating_add(
                    u64::try_from(p)
                        .unwrap_or(u64::MAX)
                        .saturating_mul(l.item_len),
                );
                match self.kv.to_vec(addr, l.item_len) {
                    Ok(bytes) => h.write(&bytes),
                    Err(_) => h.write_u8(0),
                }
            }
        }
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(n: u16) -> Endpoint {
        Endpoint::new("10.0.0.1", n)
    }

    #[test]
    fn acks_count_by_form_and_generation() {
        let mut w = AbortWait::default();
        w.sent(ep(1), Some(3));
        w.sent(ep(2), Some(3));
        // Legacy 2-frame: promises nothing. Another generation: a stale ACK.
        assert!(!w.on_ack(None, None));
        assert!(!w.on_ack(Some(0), Some(2)));
        assert!(w.acked.is_empty());
        // sglang 0.5.23's 4-frame form with the right generation, and sglang main's 3-frame one.
        assert!(w.on_ack(Some(0), Some(3)));
        assert!(w.on_ack(Some(1), None));
        assert_eq!(w.acked.len(), w.sent_to.len());
        // A later abort of the room starts the count over.
        w.sent(ep(1), Some(4));
        assert!(w.acked.is_empty());
        assert!(!w.on_ack(Some(0), Some(3)));
        assert!(w.on_ack(Some(0), Some(4)));
    }

    #[test]
    fn an_abort_is_resent_until_every_inbox_answered_in_any_form() {
        let mut w = AbortWait::default();
        w.sent(ep(1), Some(7));
        w.sent(ep(2), Some(7));
        assert!(w.unanswered());
        let mut r = w.resends();
        r.sort_by_key(|(e, _)| e.port);
        assert_eq!(r, [(ep(1), Some(7)), (ep(2), Some(7))]);
        // A stale ACK shows nothing of this ABORT; a legacy one shows it arrived somewhere.
        assert!(!w.on_ack(Some(0), Some(6)));
        assert!(w.unanswered());
        assert!(!w.on_ack(None, None));
        assert!(w.unanswered());
        assert!(w.on_ack(Some(1), Some(7)));
        assert!(!w.unanswered());
        // A new abort of the room is unanswered again.
        w.sent(ep(1), Some(8));
        assert!(w.unanswered());
        assert_eq!(w.resends()[0].1, Some(8));
    }

    #[test]
    fn without_a_generation_a_generational_ack_is_stale() {
        let mut w = AbortWait::default();
        w.sent(ep(1), None);
        assert!(!w.on_ack(Some(0), Some(1)));
        assert!(w.on_ack(Some(0), None));
    }
}
