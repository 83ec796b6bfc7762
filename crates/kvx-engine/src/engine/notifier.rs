//! The notifier: how a prefill rank sends on ZMQ toward decodes (status, `ABORT_ACK`,
//! `AUX_DATA`, `STAGING_REQ`, `CHUNK_READY`), in the order the engine's loop queued them, through
//! one cache of PUSH sockets. It is the loop's own state, not a thread: its sends never block (a
//! zero send timeout), so the loop hands a status to ZMQ itself, without a thread hop. A decode
//! whose inbox is full gets its messages held, in order, and retried on the same socket (nothing
//! sent later overtakes them) every [`RETRY`] from the loop's deadlines; after 30 s without
//! progress, or 65 536 held messages, they are dropped, counted in `kvx_notice_failures_total`
//! and logged.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvx_bootstrap::sockets::{PushCache, PushOptions, zmq};
use kvx_core::Endpoint;

use crate::wire::Frames;

/// Sockets toward decodes idle this long are closed (a departed decode leaves nothing behind).
const SOCKET_IDLE: Duration = Duration::from_secs(2);
/// Most decode inboxes the notifier keeps a socket open to (least recently used closed first).
const NOTIFIER_SOCKETS: usize = 1024;
/// A decode whose inbox took nothing for this long loses what is held for it (counted, logged):
/// sglang's own prefill-to-decode send timeout.
const HOLD_LIMIT: Duration = Duration::from_secs(30);
/// Most messages held for one decode; beyond it the backlog is dropped (counted, logged).
const HOLD_MAX: usize = 1 << 16;
/// How often held messages are retried.
pub(crate) const RETRY: Duration = Duration::from_millis(2);

/// Options of the notifier's sockets: sglang's prefill-to-decode options (no reconnect, keepalive,
/// disconnect monitor), except that a send never waits — a message a decode cannot take right
/// now is held, in order, and retried on the same socket, so it holds up neither the other
/// decodes nor a worker — and a socket closed while idle gets a second to flush what it holds.
fn notifier_options() -> PushOptions {
    PushOptions {
        linger: Duration::from_secs(1),
        ..PushOptions::toward_decode().with_send_timeout(Duration::ZERO)
    }
}

/// Messages held for one decode whose inbox is full, oldest first.
struct Held {
    queue: VecDeque<Frames>,
    /// When the oldest held message was first refused.
    since: Instant,
}

/// The notifier's state: the socket cache, what is held per decode, when each socket was last
/// used.
pub(crate) struct Notifier {
    cache: PushCache,
    held: HashMap<Endpoint, Held>,
    used: HashMap<Endpoint, Instant>,
    /// When held messages are next retried (`None` while nothing is held).
    next_retry: Option<Instant>,
}

impl Notifier {
    /// A notifier with no socket open yet (they are opened, in the calling thread, on first use).
    pub(crate) fn new(ctx: &zmq::Context) -> Self {
        Notifier {
            cache: PushCache::new(ctx, notifier_options(), NOTIFIER_SOCKETS),
            held: HashMap::new(),
            used: HashMap::new(),
            next_retry: None,
        }
    }

    /// When [`Notifier::retry`] is next due (`None` while nothing is held).
    pub(crate) fn retry_due(&self) -> Option<Instant> {
        self.next_retry
    }

    /// Sends `frames` to `ep` after whatever is held for it; holds it when the inbox is full.
    /// False when the message was dropped now (the send failed, or too much is held for `ep`);
    /// a message held and dropped later goes with everything held after it.
    pub(crate) fn send(&mut self, ep: Endpoint, frames: Frames) -> bool {
        self.used.insert(ep.clone(), Instant::now());
        let kept = self.enqueue(ep, frames);
        if !self.held.is_empty() && self.next_retry.is_none() {
            self.next_retry = Some(Instant::now() + RETRY);
        }
        kept
    }

    /// Connects the socket toward `ep` ahead of its first message and restarts its idle clock:
    /// a room's metadata came from `ep`, and the room's status follows its forward pass, so the
    /// connection's handshake is done by then instead of delaying the status.
    pub(crate) fn prepare(&mut self, ep: &Endpoint) {
        self.used.insert(ep.clone(), Instant::now());
        if let Err(e) = self.cache.watch(ep) {
            // The status's own send reports a socket that cannot be made.
            tracing::debug!(%ep, error = %e, "cannot open a socket ahead of a status");
        }
    }

    fn enqueue(&mut self, ep: Endpoint, frames: Frames) -> bool {
        if let Some(h) = self.held.get_mut(&ep) {
            if h.queue.len() >= HOLD_MAX {
                let lost = h.queue.len() + 1;
                self.held.remove(&ep);
                self.give_up(&ep, lost, "too many messages held");
                return false;
            }
            h.queue.push_back(frames);
            return true;
        }
        match self.cache.send_or_hold(&ep, &frames) {
            Ok(true) => true,
            Ok(false) => {
                metrics::counter!("kvx_notices_held_total").increment(1);
                self.held.insert(
                    ep,
                    Held {
                        queue: VecDeque::from([frames]),
                        since: Instant::now(),
                    },
                );
                true
            }
            Err(e) => {
                metrics::counter!("kvx_notice_failures_total").increment(1);
                tracing::warn!(%ep, error = %e, "status message dropped");
                false
            }
        }
    }

    /// Retries every held message in order; gives up on decodes past [`HOLD_LIMIT`].
    pub(crate) fn retry(&mut self) {
        let eps: Vec<Endpoint> = self.held.keys().cloned().collect();
        for ep in eps {
            let Some(mut h) = self.held.remove(&ep) else {
                continue;
            };
            while let Some(front) = h.queue.front() {
                match self.cache.send_or_hold(&ep, front) {
                    Ok(true) => {
                        h.queue.pop_front();
                        h.since = Instant::now();
                    }
                    Ok(false) => break,
                    Err(e) => {
                        let lost = h.queue.len();
                        h.queue.clear();
                        self.give_up(&ep, lost, &e.to_string());
                    }
                }
            }
            if h.queue.is_empty() {
                continue;
            }
            if h.since.elapsed() >= HOLD_LIMIT {
                let lost = h.queue.len();
                self.give_up(&ep, lost, "its inbox took nothing for 30 s");
            } else {
                self.held.insert(ep, h);
            }
        }
        self.next_retry = (!self.held.is_empty()).then(|| Instant::now() + RETRY);
    }

    /// Retries until nothing is held or `timeout` passed; true when nothing is held.
    pub(crate) fn flush(&mut self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while !self.held.is_empty() && Instant::now() < until {
            self.retry();
            if !self.held.is_empty() {
                std::thread::sleep(RETRY);
            }
        }
        self.held.is_empty()
    }

    /// Closes sockets idle for [`SOCKET_IDLE`] (unless messages are held for them) and those
    /// whose decode disconnected.
    pub(crate) fn housekeeping(&mut self) {
        let (cache, held) = (&mut self.cache, &self.held);
        self.used.retain(|ep, t| {
            let keep = t.elapsed() < SOCKET_IDLE || held.contains_key(ep);
            if !keep {
                cache.disconnect(ep);
            }
            keep
        });
        self.cache.reap_disconnected();
    }

    fn give_up(&mut self, ep: &Endpoint, lost: usize, why: &str) {
        metrics::counter!("kvx_notice_failures_total").increment(lost as u64);
        tracing::warn!(%ep, lost, why, "messages to a decode dropped");
        self.cache.disconnect(ep);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A burst far above the sockets' high-water marks toward a decode that is not reading yet:
    /// every message arrives, in order, once it reads (with a zero send timeout and
    /// drop-on-EAGAIN, everything above the HWMs was lost).
    #[test]
    fn a_burst_to_a_slow_decode_arrives_whole_and_in_order() {
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).unwrap();
        pull.set_rcvhwm(10).unwrap();
        pull.bind("tcp://127.0.0.1:*").unwrap();
        let addr = pull.get_last_endpoint().unwrap().unwrap();
        let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
        let ep = Endpoint::new("127.0.0.1", port);
        const N: u32 = 20_000;
        let sender = {
            let (ctx, ep) = (ctx.clone(), ep.clone());
            std::thread::spawn(move || {
                let mut n = Notifier::new(&ctx);
                for i in 0..N {
                    n.send(ep.clone(), vec![b"SEQ".to_vec(), i.to_le_bytes().to_vec()]);
                }
                assert!(n.retry_due().is_some(), "a burst above the HWMs is held");
                // The decode is busy for a while, then reads everything.
                std::thread::sleep(Duration::from_millis(300));
                assert!(n.flush(Duration::from_secs(5)), "held messages left");
                n
            })
        };
        pull.set_rcvtimeo(5000).unwrap();
        for i in 0..N {
            let m = pull.recv_multipart(0).unwrap();
            assert_eq!(m[1], i.to_le_bytes(), "message {i} lost or out of order");
        }
        let n = sender.join().unwrap();
        assert!(n.retry_due().is_none());
    }

    /// `prepare` connects toward a decode's inbox with nothing to send yet, and the socket is
    /// not closed as idle right after.
    #[test]
    fn prepare_connects_before_the_first_message() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let ep = Endpoint::new("127.0.0.1", listener.local_addr().unwrap().port());
        let ctx = zmq::Context::new();
        let mut n = Notifier::new(&ctx);
        n.prepare(&ep);
        let t0 = Instant::now();
        // The accepted connection stays open: dropped, the socket's monitor would report the
        // disconnect and housekeeping would rightly close the socket.
        let _peer = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(t0.elapsed() < Duration::from_secs(10), "no connect");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("{e}"),
            }
        };
        n.housekeeping();
        assert!(n.cache.contains(&ep), "a prepared socket closed as idle");
    }
}
