//! The notifier: the one thread of a prefill rank that sends on ZMQ toward decodes (status,
//! `ABORT_ACK`, `AUX_DATA`, `STAGING_REQ`, `CHUNK_READY`), in the order the engine queued them,
//! through one cache of PUSH sockets; a send never blocks a transfer worker. A decode whose
//! inbox is full gets its messages held, in order, and retried on the same socket (nothing sent
//! later overtakes them); after 30 s without progress, or 65 536 held messages, they are dropped,
//! counted in `kvx_notice_failures_total` and logged.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use kvx_bootstrap::sockets::{PushCache, PushOptions, zmq};
use kvx_core::Endpoint;

use crate::wire::Frames;

/// What the notifier is asked to do.
pub(crate) enum Notice {
    /// Send a message to a decode inbox.
    Send(Endpoint, Frames),
    /// Report once every earlier notice went out.
    Flush(Sender<()>),
}

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
const RETRY: Duration = Duration::from_millis(2);

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

/// The notifier's state: the socket cache and what is held per decode.
struct Outgoing {
    cache: PushCache,
    held: HashMap<Endpoint, Held>,
    flushes: Vec<Sender<()>>,
}

impl Outgoing {
    /// Sends `frames` to `ep` after whatever is held for it; holds it when the inbox is full.
    fn send(&mut self, ep: Endpoint, frames: Frames) {
        if let Some(h) = self.held.get_mut(&ep) {
            if h.queue.len() >= HOLD_MAX {
                let lost = h.queue.len() + 1;
                self.held.remove(&ep);
                self.give_up(&ep, lost, "too many messages held");
            } else {
                h.queue.push_back(frames);
            }
            return;
        }
        match self.cache.send_or_hold(&ep, &frames) {
            Ok(true) => {}
            Ok(false) => {
                metrics::counter!("kvx_notices_held_total").increment(1);
                self.held.insert(
                    ep,
                    Held {
                        queue: VecDeque::from([frames]),
                        since: Instant::now(),
                    },
                );
            }
            Err(e) => {
                metrics::counter!("kvx_notice_failures_total").increment(1);
                tracing::warn!(%ep, error = %e, "status message dropped");
            }
        }
    }

    /// Retries every held message in order; gives up on decodes past [`HOLD_LIMIT`].
    fn retry(&mut self) {
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
        if self.held.is_empty() {
            for f in self.flushes.drain(..) {
                let _ = f.send(());
            }
        }
    }

    fn give_up(&mut self, ep: &Endpoint, lost: usize, why: &str) {
        metrics::counter!("kvx_notice_failures_total").increment(lost as u64);
        tracing::warn!(%ep, lost, why, "messages to a decode dropped");
        self.cache.disconnect(ep);
    }
}

/// Sends every notice in order through one PUSH socket cache (per decode in order, held while
/// its inbox is full); closes sockets idle for [`SOCKET_IDLE`] and those whose decode
/// disconnected.
pub(super) fn notifier(ctx: zmq::Context, rx: Receiver<Notice>) {
    let mut s = Outgoing {
        cache: PushCache::new(&ctx, notifier_options(), NOTIFIER_SOCKETS),
        held: HashMap::new(),
        flushes: Vec::new(),
    };
    let mut used: HashMap<Endpoint, Instant> = HashMap::new();
    loop {
        let wait = if s.held.is_empty() {
            Duration::from_millis(500)
        } else {
            RETRY
        };
        let n = match rx.recv_timeout(wait) {
            Ok(n) => n,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                s.retry();
                used.retain(|ep, t| {
                    let keep = t.elapsed() < SOCKET_IDLE || s.held.contains_key(ep);
                    if !keep {
                        s.cache.disconnect(ep);
                    }
                    keep
                });
                s.cache.reap_disconnected();
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match n {
            Notice::Flush(done) => {
                if s.held.is_empty() {
                    let _ = done.send(());
                } else {
                    s.flushes.push(done);
                }
            }
            Notice::Send(ep, frames) => {
                used.insert(ep.clone(), Instant::now());
                s.send(ep, frames);
            }
        }
        if !s.held.is_empty() {
            s.retry();
        }
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
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = {
            let ctx = ctx.clone();
            std::thread::spawn(move || notifier(ctx, rx))
        };
        const N: u32 = 20_000;
        for i in 0..N {
            let frames = vec![b"SEQ".to_vec(), i.to_le_bytes().to_vec()];
            tx.send(Notice::Send(ep.clone(), frames)).unwrap();
        }
        // The decode is busy for a while, then reads everything.
        std::thread::sleep(Duration::from_millis(300));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        tx.send(Notice::Flush(done_tx)).unwrap();
        pull.set_rcvtimeo(5000).unwrap();
        for i in 0..N {
            let m = pull.recv_multipart(0).unwrap();
            assert_eq!(m[1], i.to_le_bytes(), "message {i} lost or out of order");
        }
        done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        drop(tx);
        thread.join().unwrap();
    }
}
