//! A rank's PULL inbox (sglang's S1/S2): bound once, every message classified with the codec
//! before it is handed on, malformed ones dropped with a log line and a count, so no peer can
//! stop the loop. [`Inbox::bind`] reads the socket on a thread of its own (for blocking
//! consumers); [`Inbox::bind_async`] reads it in the consumer's task on the tokio runtime,
//! woken through the socket's `ZMQ_FD` — one thread hand-off less per message.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvx_core::Endpoint;
use tokio::io::unix::AsyncFd;
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
    reader: Reader,
    stop: Arc<AtomicBool>,
    stats: Arc<InboxStats>,
    thread: Option<JoinHandle<()>>,
}

/// Who reads the socket.
enum Reader {
    /// Its own thread, handing messages over a channel.
    Thread(mpsc::Receiver<Multipart>),
    /// The consumer's task, woken by the runtime's reactor through `ZMQ_FD`. The fd is the
    /// socket's: it leaves the reactor (dropped first) before the socket closes.
    Direct {
        fd: AsyncFd<ZmqFd>,
        sock: zmq::Socket,
        kind: InboxKind,
    },
    /// Closed.
    Closed,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reader::Thread(_) => "Thread",
            Reader::Direct { .. } => "Direct",
            Reader::Closed => "Closed",
        })
    }
}

/// A socket's `ZMQ_FD`: readable when the socket has commands to process (check its events).
struct ZmqFd(RawFd);

/// Registers a socket's `ZMQ_FD` with the current runtime's reactor (the caller checked that
/// there is one).
#[allow(unsafe_code)]
fn register_fd(raw: RawFd) -> std::io::Result<AsyncFd<ZmqFd>> {
    // SAFETY: `raw` is the `ZMQ_FD` of a socket that owns it and keeps it open until the socket
    // closes. The `AsyncFd` is kept beside that socket in `Reader::Direct` and declared before
    // it, so it is dropped (and leaves the reactor) first: the descriptor stays open and names
    // the same file description for the `AsyncFd`'s whole life.
    let fd = unsafe { AsyncFd::register_with_interest(ZmqFd(raw), tokio::io::Interest::READABLE) };
    fd.map_err(Into::into)
}

impl AsRawFd for ZmqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Upper bound on frames per message: far above any sglang message (19 frames), low enough
/// that a peer cannot make the loop hoard frames of one endless message.
const MAX_FRAMES: usize = 64;

impl Inbox {
    /// Binds a PULL socket per `cfg` and starts its thread.
    pub fn bind(ctx: &zmq::Context, cfg: InboxConfig) -> Result<Self, SocketError> {
        let (sock, endpoint, port) = bind_socket(ctx, &cfg)?;
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
            reader: Reader::Thread(rx),
            stop,
            stats,
            thread: Some(thread),
        })
    }

    /// Binds a PULL socket per `cfg` that [`Inbox::recv`] reads in the calling task, without
    /// a thread (`channel_capacity` and `poll_interval` are unused: libzmq queues what is not
    /// read yet). Must be called on a tokio runtime (the socket's `ZMQ_FD` is registered with
    /// its reactor); [`Inbox::blocking_recv`] is not available on it.
    pub fn bind_async(ctx: &zmq::Context, cfg: InboxConfig) -> Result<Self, SocketError> {
        tokio::runtime::Handle::try_current()
            .map_err(|e| SocketError::Reactor(std::io::Error::other(e)))?;
        let (sock, endpoint, _) = bind_socket(ctx, &cfg)?;
        let addr = endpoint.to_string();
        let raw = sock
            .get_fd()
            .map_err(SocketError::zmq("getsockopt FD", &addr))?;
        let fd = register_fd(raw).map_err(SocketError::Reactor)?;
        tracing::info!(%endpoint, kind = cfg.kind.label(), "inbox bound (read in task)");
        Ok(Inbox {
            endpoint,
            reader: Reader::Direct {
                fd,
                sock,
                kind: cfg.kind,
            },
            stop: Arc::new(AtomicBool::new(false)),
            stats: Arc::new(InboxStats::default()),
            thread: None,
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

    /// The next accepted message; `None` once the inbox stopped. Cancel safe: a message is
    /// read whole or not at all.
    pub async fn recv(&mut self) -> Option<Multipart> {
        match &mut self.reader {
            Reader::Thread(rx) => rx.recv().await,
            Reader::Direct { fd, sock, kind } => loop {
                // `ZMQ_FD` only says "look again": the events tell whether a message is there.
                match sock.get_events() {
                    Ok(ev) if ev.contains(zmq::POLLIN) => match read_message(sock) {
                        Read::Message(frames) => {
                            if let Some(m) = accept(*kind, frames, &self.stats) {
                                return Some(m);
                            }
                        }
                        Read::TooManyFrames => {
                            drop_message(*kind, "too_many_frames", &MAX_FRAMES, &self.stats)
                        }
                        Read::Nothing => {}
                        Read::Failed => return None,
                    },
                    Ok(_) => {
                        let mut ready = fd.readable().await.ok()?;
                        ready.clear_ready();
                    }
                    Err(zmq::Error::EINTR) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "inbox events failed; inbox stops");
                        return None;
                    }
                }
            },
            Reader::Closed => None,
        }
    }

    /// The next accepted message, blocking the calling (non-async) thread; `None` once the
    /// inbox stopped, and always for an inbox made by [`Inbox::bind_async`].
    pub fn blocking_recv(&mut self) -> Option<Multipart> {
        match &mut self.reader {
            Reader::Thread(rx) => rx.blocking_recv(),
            Reader::Direct { .. } | Reader::Closed => None,
        }
    }

    /// Stops the socket thread and closes the socket.
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Reader::Thread(rx) = &mut self.reader {
            rx.close();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // A direct reader's socket closes here (its fd leaves the reactor first).
        self.reader = Reader::Closed;
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Binds a PULL socket per `cfg`: the socket, the endpoint peers connect to, the bound port.
fn bind_socket(
    ctx: &zmq::Context,
    cfg: &InboxConfig,
) -> Result<(zmq::Socket, Endpoint, u16), SocketError> {
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
    Ok((sock, Endpoint::new(host, port), port))
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
        let frames = match read_message(&sock) {
            Read::Message(frames) => frames,
            Read::TooManyFrames => {
                drop_message(kind, "too_many_frames", &MAX_FRAMES, stats);
                continue;
            }
            Read::Nothing | Read::Failed => continue,
        };
        let Some(m) = accept(kind, frames, stats) else {
            continue;
        };
        if tx.blocking_send(m).is_err() {
            break;
        }
    }
    tracing::debug!(inbox = kind.label(), "inbox thread stopped");
}

/// One read of a message off the socket.
enum Read {
    /// A whole message.
    Message(Vec<Frame>),
    /// A message of more than [`MAX_FRAMES`] frames (read whole, kept none).
    TooManyFrames,
    /// Nothing was there.
    Nothing,
    /// The socket failed (logged).
    Failed,
}

/// Reads the next message without waiting (libzmq delivers a multipart message whole).
fn read_message(sock: &zmq::Socket) -> Read {
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
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) if frames.is_empty() => {
                return Read::Nothing;
            }
            Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "inbox receive failed");
                return if frames.is_empty() {
                    Read::Failed
                } else {
                    Read::Nothing
                };
            }
        }
    }
    if too_many {
        Read::TooManyFrames
    } else {
        Read::Message(frames)
    }
}

/// Classifies a message: the message to hand on, or `None` when it was dropped (logged and
/// counted).
fn accept(kind: InboxKind, frames: Vec<Frame>, stats: &InboxStats) -> Option<Multipart> {
    if let Err(e) = kind.check(&frames) {
        drop_message(kind, e.kind(), &e, stats);
        return None;
    }
    stats.received.fetch_add(1, Ordering::Relaxed);
    Some(Multipart::new(frames))
}
