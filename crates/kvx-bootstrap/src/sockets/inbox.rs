//! A rank's PULL inbox (sglang's S1/S2): bound once, read by its own thread, every message
//! classified with the codec before it is handed on, malformed ones dropped with a log line and
//! a count, so no peer can stop the loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvx_core::Endpoint;
use tokio::sync::mpsc;

use super::SocketError;
use super::frame::{Frame, Multipart};
use crate::codec::{DecodeInbound, PrefillInbound};

/// Which messages an inbox accepts (spec §3.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboxKind {
    /// A prefill rank's inbox: registration, metadata, `ABORT`, `WATERMARK`, `STAGING_RSP`.
    Prefill,
    /// A decode rank's inbox: status, `AUX_DATA`, `CHUNK_READY`, `STAGING_REQ`, `ABORT_ACK`.
    Decode,
    /// Anything (no classification; for tools and tests).
    Raw,
}

impl InboxKind {
    fn check(self, frames: &[Frame]) -> Result<&'static str, crate::codec::CodecError> {
        match self {
            InboxKind::Prefill => PrefillInbound::parse(frames).map(|m| m.kind()),
            InboxKind::Decode => DecodeInbound::parse(frames).map(|m| m.kind()),
            InboxKind::Raw => Ok("raw"),
        }
    }

    fn label(self) -> &'static str {
        match self {
            InboxKind::Prefill => "prefill",
            InboxKind::Decode => "decode",
            InboxKind::Raw => "raw",
        }
    }
}

/// How to bind an inbox.
#[derive(Clone, Debug)]
pub struct InboxConfig {
    /// Local host to bind (IPv4, IPv6 with or without brackets, or `0.0.0.0`).
    pub host: String,
    /// Port to bind; `None` picks a free one (sglang's `bind_to_random_port`).
    pub port: Option<u16>,
    /// Which messages are accepted.
    pub kind: InboxKind,
    /// Messages buffered between the socket thread and the consumer (libzmq queues the rest,
    /// `RCVHWM=0`: unbounded).
    pub channel_capacity: usize,
    /// How often the socket thread checks whether it should stop.
    pub poll_interval: Duration,
    /// Largest message accepted (libzmq's `MAXMSGSIZE`, all frames together): a peer that sends
    /// a bigger one is disconnected by libzmq before the message is buffered. sglang's largest
    /// message, metadata with one page index per token of a 1 M-token prompt at page size 1,
    /// is 4 MiB.
    pub max_message_bytes: i64,
}

/// Default of [`InboxConfig::max_message_bytes`].
pub const DEFAULT_MAX_MESSAGE_BYTES: i64 = 64 << 20;

impl InboxConfig {
    /// An inbox of `kind` on `host`, random port.
    pub fn new(host: impl Into<String>, kind: InboxKind) -> Self {
        InboxConfig {
            host: host.into(),
            port: None,
            kind,
            channel_capacity: 4096,
            poll_interval: Duration::from_millis(100),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// Counters of one inbox.
#[derive(Debug, Default)]
pub struct InboxStats {
    received: AtomicU64,
    dropped: AtomicU64,
}

impl InboxStats {
    /// Messages accepted and handed on.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Malformed messages dropped.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A bound PULL inbox.
#[derive(Debug)]
pub struct Inbox {
    endpoint: Endpoint,
    rx: mpsc::Receiver<Multipart>,
    stop: Arc<AtomicBool>,
    stats: Arc<InboxStats>,
    thread: Option<JoinHandle<()>>,
}

/// Upper bound on frames per message: far above any sglang message (19 frames), low enough
/// that a peer cannot make the loop hoard frames of one endless message.
const MAX_FRAMES: usize = 64;

impl Inbox {
    /// Binds a PULL socket per `cfg` and starts its thread.
    pub fn bind(ctx: &zmq::Context, cfg: InboxConfig) -> Result<Self, SocketError> {
        let host = cfg.host.trim_start_matches('[').trim_end_matches(']');
        let ipv6 = host.contains(':');
        let addr = match cfg.port {
            Some(p) => super::tcp_addr(host, p),
            None if ipv6 => format!("tcp://[{host}]:*"),
            None => format!("tcp://{host}:*"),
        };
        let sock = ctx
            .socket(zmq::PULL)
            .map_err(SocketError::zmq("socket", &addr))?;
        sock.set_rcvhwm(0)
            .map_err(SocketError::zmq("setsockopt RCVHWM", &addr))?;
        sock.set_linger(0)
            .map_err(SocketError::zmq("setsockopt LINGER", &addr))?;
        sock.set_maxmsgsize(cfg.max_message_bytes.max(1))
            .map_err(SocketError::zmq("setsockopt MAXMSGSIZE", &addr))?;
        if ipv6 {
            sock.set_ipv6(true)
                .map_err(SocketError::zmq("setsockopt IPV6", &addr))?;
        }
        sock.bind(&addr).map_err(SocketError::zmq("bind", &addr))?;
        let bound = sock
            .get_last_endpoint()
            .map_err(SocketError::zmq("getsockopt LAST_ENDPOINT", &addr))?
            .map_err(|raw| SocketError::BadEndpoint(String::from_utf8_lossy(&raw).into_owned()))?;
        let port = bound
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .ok_or_else(|| SocketError::BadEndpoint(bound.clone()))?;
        let endpoint = Endpoint::new(host, port);

        let (tx, rx) = mpsc::channel(cfg.channel_capacity.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(InboxStats::default());
        let (t_stop, t_stats) = (stop.clone(), stats.clone());
        let kind = cfg.kind;
        let poll_ms = i64::try_from(cfg.poll_interval.as_millis())
            .unwrap_or(100)
            .max(1);
        let thread = std::thread::Builder::new()
            .name(format!("kvx-inbox-{port}"))
            .spawn(move || run(sock, kind, poll_ms, tx, &t_stop, &t_stats))
            .map_err(|_| SocketError::Closed)?;
        tracing::info!(%endpoint, kind = kind.label(), "inbox bound");
        Ok(Inbox {
            endpoint,
            rx,
            stop,
            stats,
            thread: Some(thread),
        })
    }

    /// Where peers connect (the host as configured, the bound port).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The counters.
    pub fn stats(&self) -> &InboxStats {
        &self.stats
    }

    /// The next accepted message; `None` once the inbox stopped.
    pub async fn recv(&mut self) -> Option<Multipart> {
        self.rx.recv().await
    }

    /// The next accepted message, blocking the calling (non-async) thread.
    pub fn blocking_recv(&mut self) -> Option<Multipart> {
        self.rx.blocking_recv()
    }

    /// Stops the socket thread and closes the socket.
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.rx.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn drop_message(
    kind: InboxKind,
    reason: &'static str,
    detail: &dyn std::fmt::Display,
    stats: &InboxStats,
) {
    stats.dropped.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(inbox = kind.label(), reason, %detail, "dropped malformed message");
    metrics::counter!("kvx_bootstrap_inbox_dropped_total", "inbox" => kind.label(), "reason" => reason)
        .increment(1);
}

fn run(
    sock: zmq::Socket,
    kind: InboxKind,
    poll_ms: i64,
    tx: mpsc::Sender<Multipart>,
    stop: &AtomicBool,
    stats: &InboxStats,
) {
    while !stop.load(Ordering::Relaxed) {
        match sock.poll(zmq::POLLIN, poll_ms) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "inbox poll failed; inbox stops");
                break;
            }
        }
        let mut frames = Vec::new();
        let mut too_many = false;
        loop {
            match sock.recv_msg(zmq::DONTWAIT) {
                Ok(msg) => {
                    let more = msg.get_more();
                    if frames.len() < MAX_FRAMES {
                        frames.push(Frame(msg));
                    } else {
                        too_many = true;
                    }
                    if !more {
                        break;
                    }
                }
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) if frames.is_empty() => break,
                Err(zmq::Error::EINTR) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "inbox receive failed");
                    break;
                }
            }
        }
        if frames.is_empty() {
            continue;
        }
        if too_many {
            drop_message(kind, "too_many_frames", &MAX_FRAMES, stats);
            continue;
        }
        match kind.check(&frames) {
            Ok(_) => {}
            Err(e) => {
                drop_message(kind, e.kind(), &e, stats);
                continue;
            }
        }
        stats.received.fetch_add(1, Ordering::Relaxed);
        if tx.blocking_send(Multipart::new(frames)).is_err() {
            break;
        }
    }
    tracing::debug!(inbox = kind.label(), "inbox thread stopped");
}
