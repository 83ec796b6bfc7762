//! The notifier: the one thread of a prefill rank that sends on ZMQ toward decodes (status,
//! `ABORT_ACK`, `AUX_DATA`, `STAGING_REQ`, `CHUNK_READY`), in the order the engine queued them,
//! through one cache of PUSH sockets; a send never blocks a transfer worker.

use std::collections::HashMap;
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

/// Options of the notifier's sockets: sglang's prefill-to-decode options (no reconnect, keepalive,
/// disconnect monitor), except that a send never waits (a decode that cannot take a status right
/// now loses it, counted, instead of holding up every other decode's) and a socket closed while
/// idle gets a second to flush what it still holds.
fn notifier_options() -> PushOptions {
    PushOptions {
        linger: Duration::from_secs(1),
        ..PushOptions::toward_decode().with_send_timeout(Duration::ZERO)
    }
}

/// Sends every notice in order through one PUSH socket cache; closes sockets idle for
/// [`SOCKET_IDLE`] and those whose decode disconnected.
pub(super) fn notifier(ctx: zmq::Context, rx: Receiver<Notice>) {
    let mut cache = PushCache::new(&ctx, notifier_options(), NOTIFIER_SOCKETS);
    let mut used: HashMap<Endpoint, Instant> = HashMap::new();
    loop {
        let n = match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(n) => n,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                used.retain(|ep, t| {
                    let keep = t.elapsed() < SOCKET_IDLE;
                    if !keep {
                        cache.disconnect(ep);
                    }
                    keep
                });
                cache.reap_disconnected();
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match n {
            Notice::Flush(done) => {
                let _ = done.send(());
            }
            Notice::Send(ep, frames) => {
                used.insert(ep.clone(), Instant::now());
                if let Err(e) = cache.send(&ep, &frames) {
                    metrics::counter!("kvx_notice_failures_total").increment(1);
                    tracing::warn!(%ep, error = %e, "status message dropped");
                }
            }
        }
    }
}
