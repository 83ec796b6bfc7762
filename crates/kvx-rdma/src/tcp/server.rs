//! The receiving (decode) side of the tcp backend: accept, handshake, and apply writes.
//!
//! Every write header is checked against the region table (key, bounds, length) before a single
//! payload byte is read; accepted payloads are read with `readv` straight into the destination
//! region, chained with the next header so a stream of small writes costs one syscall each.
//! Rejected writes of acceptable length are drained into a small scratch buffer (nothing is
//! written to registered memory) and reported in the next acknowledgement; an oversized length
//! or a malformed header is reported and the connection closed (the stream cannot be resynced).
//! A connection's failure never affects the listener or other connections.
//!
//! Bounds: at most `max_handshakes` hellos are read at once (a newer connection closes the
//! oldest one still in its hello), each within the handshake timeout and at most
//! [`MAX_SENDER_DESC_LEN`] + [`MAX_SECRET_LEN`] bytes; at most `max_connections` connections get
//! a receive thread ([`ConnLimit`]: an idle one is closed to make room, or the newcomer is
//! refused). Every destination a thread writes into is leased from the region table while the
//! payload is read ([`crate::mem::Receiver`]), so a deregistration, `shutdown()` or drop
//! returns only once no thread writes into the memory concerned.

use std::collections::VecDeque;
use std::io;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::{AbortHandle, JoinSet};

use crate::conn_limit::{Conn, ConnLimit, Refused, Slot};
use crate::error::RejectReason;
use crate::mem::{self, Receiver, RecvTarget, RegionTable};
use crate::segment::SegmentDescriptor;
use crate::tcp::SharedSecret;
use crate::tcp::io::{read_full, write_all};
use crate::tcp::wire::{
    Ack, ClientFrame, ENTRY_LEN, Entry, HEADER_LEN, HELLO_BAD_SECRET, HELLO_BAD_VERSION, HELLO_LEN,
    HELLO_OK, Hello, HelloError, MAX_SECRET_LEN, MAX_SENDER_DESC_LEN, VERSION,
};

/// How long writing one acknowledgement may block before the connection is dropped.
const ACK_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Stack of a receive thread (the loop keeps only a header on its stack).
const RX_STACK: usize = 256 << 10;

/// What the accept loop needs.
pub(crate) struct ServerCtx {
    pub table: Arc<RegionTable>,
    pub endpoint: String,
    pub max_write_len: u32,
    pub handshake_timeout: Duration,
    pub socket_buffer: Option<usize>,
    /// Hellos read at once at most.
    pub max_handshakes: usize,
    /// The secret a sender's hello must carry, if any.
    pub secret: Option<SharedSecret>,
    /// The connections in their data phase (one receive thread each).
    pub conns: Arc<ConnLimit>,
}

impl ServerCtx {
    /// Shuts down every connection in its data phase (their receive threads see EOF and end)
    /// and refuses new ones.
    pub fn close_all(&self) {
        self.conns.close_all(false);
    }
}

/// Why a connection was dropped during its hello.
#[derive(Debug, thiserror::Error)]
pub enum HelloRefusal {
    /// The fixed part of the hello is malformed.
    #[error(transparent)]
    Malformed(#[from] HelloError),
    /// The sender's descriptor is larger than a sender's hello needs.
    #[error("sender descriptor of {0} bytes above the {MAX_SENDER_DESC_LEN}-byte limit")]
    DescTooLarge(u32),
    /// The announced secret is longer than any secret this side accepts.
    #[error("secret of {0} bytes above the {MAX_SECRET_LEN}-byte limit")]
    SecretTooLong(u32),
    /// The sender's descriptor does not decode.
    #[error("bad sender descriptor: {0}")]
    BadDescriptor(String),
    /// This side requires a shared secret and the sender's is missing or wrong.
    #[error("shared secret missing or wrong")]
    BadSecret,
    /// A Mooncake TE handshake request (an `auto` prefill probing the port), not a hello.
    #[error("a Mooncake TE handshake request, not a kvx hello")]
    Foreign,
    /// The hello did not arrive within the handshake timeout.
    #[error("hello timed out")]
    Timeout,
    /// No receive slot (connection limit).
    #[error("refused: {0}")]
    Refused(#[from] Refused),
    /// A socket error.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl HelloRefusal {
    /// A short stable label (metrics).
    pub fn cause(&self) -> &'static str {
        match self {
            HelloRefusal::Malformed(_) => "malformed",
            HelloRefusal::DescTooLarge(_) => "desc_too_large",
            HelloRefusal::SecretTooLong(_) => "secret_too_long",
            HelloRefusal::BadDescriptor(_) => "bad_descriptor",
            HelloRefusal::BadSecret => "bad_secret",
            HelloRefusal::Foreign => "foreign_probe",
            HelloRefusal::Timeout => "timeout",
            HelloRefusal::Refused(r) => r.cause(),
            HelloRefusal::Io(_) => "io",
        }
    }
}

/// Accepts connections until `stop` fires (or the task is aborted); then closes every inbound
/// connection and waits for their tasks to end.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut conns = JoinSet::new();
    // Connections in their hello, oldest first (finished ones are skipped lazily).
    let mut hellos: VecDeque<AbortHandle> = VecDeque::new();
    loop {
        tokio::select! {
            _ = &mut stop => {
                drop(listener);
                ctx.close_all();
                conns.shutdown().await;
                return;
            }
            r = listener.accept() => match r {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    if let Some(n) = ctx.socket_buffer {
                        let sock = socket2::SockRef::from(&stream);
                        let _ = sock.set_send_buffer_size(n);
                        let _ = sock.set_recv_buffer_size(n);
                    }
                    hellos.retain(|h| !h.is_finished());
                    if hellos.len() >= ctx.max_handshakes.max(1)
                        && let Some(oldest) = hellos.pop_front()
                    {
                        // Many peers in their hello at once: the oldest is the likeliest to be
                        // silent; a real sender's hello takes one round trip.
                        oldest.abort();
                        metrics::counter!("kvx_tcp_conns_refused_total", "cause" => "hello_evicted")
                            .increment(1);
                        tracing::debug!("tcp transport: too many hellos at once, oldest closed");
                    }
                    let ctx = ctx.clone();
                    hellos.push_back(conns.spawn(async move {
                        match serve(stream, &ctx).await {
                            Ok(()) => tracing::debug!(%addr, "tcp transport connection closed"),
                            Err(HelloRefusal::Foreign) => {
                                // A prefill on the `auto` backend asking whether this port is
                                // Mooncake TE's: it is not, and the peer falls back to kvx's tcp.
                                metrics::counter!("kvx_tcp_foreign_probes_total").increment(1);
                                tracing::debug!(%addr, "tcp transport: foreign probe closed");
                            }
                            Err(HelloRefusal::Refused(r)) => {
                                metrics::counter!("kvx_tcp_conns_refused_total", "cause" => r.cause())
                                    .increment(1);
                                tracing::warn!(%addr, error = %r, "tcp transport connection refused");
                            }
                            Err(e) => {
                                metrics::counter!("kvx_tcp_handshake_errors_total", "cause" => e.cause())
                                    .increment(1);
                                if matches!(e, HelloRefusal::BadSecret) {
                                    metrics::counter!("kvx_tcp_auth_failures_total").increment(1);
                                }
                                tracing::warn!(%addr, error = %e, "tcp transport hello refused");
                            }
                        }
                    }));
                }
                Err(e) => {
                    metrics::counter!("kvx_tcp_accept_errors_total").increment(1);
                    tracing::warn!(error = %e, "tcp transport accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

fn proto_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// True when the first bytes of a connection are a Mooncake TE handshake frame (a
/// little-endian length of at most 1 MiB, then a request type 0–3) rather than a kvx hello.
fn looks_like_mooncake_request(first: &[u8; HELLO_LEN]) -> bool {
    let mut len = [0u8; 8];
    len.copy_from_slice(&first[..8]);
    let len = u64::from_le_bytes(len);
    first[..4] != crate::tcp::wire::MAGIC && (2..=1 << 20).contains(&len) && first[8] <= 3
}

/// Reads the sender's hello and answers it; an accepted sender is answered only once it has a
/// receive slot (so a flood is paced by the server). `Ok(None)`: answered with a refusal
/// status (the connection closes).
async fn handshake(
    stream: &TcpStream,
    ctx: &ServerCtx,
) -> Result<Option<OwnedSemaphorePermit>, HelloRefusal> {
    let mut fixed = [0u8; HELLO_LEN];
    read_full(stream, &mut fixed).await?;
    if looks_like_mooncake_request(&fixed) {
        return Err(HelloRefusal::Foreign);
    }
    let hello = Hello::decode(&fixed)?;
    if hello.desc_len > MAX_SENDER_DESC_LEN {
        return Err(HelloRefusal::DescTooLarge(hello.desc_len));
    }
    if hello.param > MAX_SECRET_LEN {
        return Err(HelloRefusal::SecretTooLong(hello.param));
    }
    let mut desc = vec![0u8; hello.desc_len as usize];
    read_full(stream, &mut desc).await?;
    if !desc.is_empty() {
        SegmentDescriptor::decode(&desc).map_err(|e| HelloRefusal::BadDescriptor(e.to_string()))?;
    }
    let mut secret = vec![0u8; hello.param as usize];
    read_full(stream, &mut secret).await?;
    let authorized = ctx.secret.as_ref().is_none_or(|s| s.matches(&secret));
    let status = if !authorized {
        HELLO_BAD_SECRET
    } else if hello.version < VERSION {
        HELLO_BAD_VERSION
    } else {
        HELLO_OK
    };
    let permit = if status == HELLO_OK {
        Some(ctx.conns.admit(ctx.handshake_timeout).await?)
    } else {
        None
    };
    let mine = if status == HELLO_OK {
        ctx.table.descriptor(&ctx.endpoint).encode()
    } else {
        Vec::new()
    };
    let reply = Hello {
        version: VERSION,
        status,
        param: ctx.max_write_len,
        desc_len: mine.len() as u32,
    };
    let mut out = reply.encode().to_vec();
    out.extend_from_slice(&mine);
    write_all(stream, &out).await?;
    if !authorized {
        return Err(HelloRefusal::BadSecret);
    }
    Ok(permit)
}
/// What the receive loop is reading.
enum State {
    /// A frame header (into `hdr`).
    Header,
    /// The entries of a vectored write.
    Entries { buf: Vec<u8>, have: usize },
    /// Payloads: `targets[idx..]`, the first from byte `off`; then the next header.
    Payload {
        targets: Vec<RecvTarget>,
        idx: usize,
        off: usize,
    },
}

/// Counters since the previous fence.
#[derive(Default)]
struct Window {
    bytes: u64,
    rejected: u32,
    first: Option<(RejectReason, u64)>,
    /// A rejection that closes the connection; reported in place of `first`.
    fatal: Option<(RejectReason, u64)>,
}

impl Window {
    fn reject(&mut self, reason: RejectReason, addr: u64) {
        metrics::counter!("kvx_tcp_rejected_writes_total", "reason" => reason.as_str())
            .increment(1);
        self.rejected = self.rejected.saturating_add(1);
        if self.first.is_none() {
            self.first = Some((reason, addr));
        }
    }

    fn reject_fatal(&mut self, reason: RejectReason, addr: u64) {
        self.reject(reason, addr);
        self.fatal = Some((reason, addr));
    }

    fn ack(&mut self, tag: u64) -> Ack {
        let w = std::mem::take(self);
        let shown = w.fatal.or(w.first);
        Ack {
            tag,
            status: shown.map(|f| f.0),
            rejected: w.rejected,
            first_rejected_addr: shown.map_or(0, |f| f.1),
            bytes: w.bytes,
        }
    }
}

async fn serve(stream: TcpStream, ctx: &Arc<ServerCtx>) -> Result<(), HelloRefusal> {
    let permit = match tokio::time::timeout(ctx.handshake_timeout, handshake(&stream, ctx)).await {
        Ok(Ok(Some(permit))) => permit,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(HelloRefusal::Timeout),
    };
    // The data phase runs on a blocking thread with a blocking socket: the kernel sleeps and
    // wakes the thread directly (no readiness round trips), as a plain socket loop does.
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    // A sender that stops reading its acknowledgements cannot pin this thread forever.
    stream.set_write_timeout(Some(ACK_WRITE_TIMEOUT))?;
    let slot = ctx.conns.register(permit, stream.try_clone()?)?;
    let rx = ctx.table.receiver(slot.conn().clone());
    // A plain thread, not the runtime's blocking pool: a runtime being dropped must not wait
    // for connections; the transport's shutdown and drop end them by closing their sockets.
    let ctx2 = ctx.clone();
    let peer = stream.peer_addr().ok();
    let conn = slot.conn().clone();
    let handle = std::thread::Builder::new()
        .name("kvx-tcp-rx".into())
        .stack_size(RX_STACK)
        .spawn(move || {
            match receive(&stream, &ctx2, &slot, &rx) {
                Ok(()) => tracing::debug!(?peer, "tcp transport connection closed"),
                Err(e) if slot.conn().stopped() => {
                    tracing::debug!(?peer, error = %e, "tcp transport connection stopped")
                }
                Err(e) => {
                    metrics::counter!("kvx_tcp_server_conn_errors_total").increment(1);
                    tracing::warn!(?peer, error = %e, "tcp transport connection failed");
                }
            }
            drop(rx);
            drop(slot);
        })?;
    conn.set_handle(handle);
    Ok(())
}

/// The receive loop of one connection (blocking).
fn receive(
    stream: &std::net::TcpStream,
    ctx: &ServerCtx,
    slot: &Slot,
    rx: &Receiver,
) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let conn: &Conn = slot.conn();
    let mut hdr = [0u8; HEADER_LEN];
    let mut have = 0usize;
    let mut state = State::Header;
    let mut win = Window::default();
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        // One read: payload (into registered memory, or scratch for rejected writes), then as
        // much of the next header as is there.
        let n = match &mut state {
            State::Header => {
                let tail = &mut hdr[have..];
                read_blocking(|| mem::readv_targets(fd, &[], 0, &mut [], tail))?
            }
            State::Entries { buf, have: got } => {
                let tail = &mut buf[*got..];
                read_blocking(|| mem::readv_targets(fd, &[], 0, &mut [], tail))?
            }
            State::Payload { targets, idx, off } => {
                let (t, o) = (&targets[*idx..], *off);
                let tail = &mut hdr[have..];
                let scratch = &mut scratch[..];
                read_blocking(|| mem::readv_targets(fd, t, o, scratch, tail))?
            }
        };
        if conn.stopped() {
            // Evicted, or a region it writes into is being deregistered: not one more read.
            return Err(io::Error::new(
                io::ErrorKind::Interrupted,
                "connection stopped",
            ));
        }
        if n == 0 {
            if have == 0 && matches!(state, State::Header) {
                return Ok(());
            }
            metrics::counter!("kvx_tcp_truncated_frames_total").increment(1);
            return Err(proto_err("connection closed inside a frame"));
        }
        conn.busy();
        let mut n = n;
        match &mut state {
            State::Header => have += n,
            State::Entries { buf, have: got } => {
                *got += n;
                if *got == buf.len() {
                    let buf = std::mem::take(buf);
                    state = match entries_to_payload(&buf, ctx, rx, &mut win) {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = (&*stream).write_all(&win.ack(u64::MAX).encode());
                            return Err(e);
                        }
                    };
                    if let State::Payload { targets, idx, .. } = &state
                        && *idx >= targets.len()
                    {
                        rx.release();
                        state = State::Header;
                    }
                }
                continue;
            }
            State::Payload { targets, idx, off } => {
                while n > 0 && *idx < targets.len() {
                    let t = targets[*idx];
                    let k = n.min(t.len() as usize - *off);
                    if let RecvTarget::Mem(_) = t {
                        win.bytes += k as u64;
                    }
                    *off += k;
                    n -= k;
                    if *off == t.len() as usize {
                        *idx += 1;
                        *off = 0;
                    }
                }
                while *idx < targets.len() && targets[*idx].is_empty() {
                    *idx += 1;
                }
                have += n;
                if *idx < targets.len() {
                    continue;
                }
                // Every payload of the frame is in: the regions are free to go.
                rx.release();
                state = State::Header;
            }
        }
        if have < HEADER_LEN {
            if have == 0 {
                conn.idle(slot.limit().tick());
            }
            continue;
        }
        have = 0;
        let frame = match ClientFrame::decode(&hdr) {
            Ok(f) => f,
            Err(reason) => {
                win.reject_fatal(reason, 0);
                let _ = (&*stream).write_all(&win.ack(u64::MAX).encode());
                return Err(proto_err("malformed frame header"));
            }
        };
        match frame {
            ClientFrame::Write { key, addr, len, .. } => {
                let t = check_write(ctx, rx, &mut win, Entry { key, addr, len });
                match t {
                    Some(targets) if len > 0 => {
                        let idx = targets.iter().take_while(|t| t.is_empty()).count();
                        state = State::Payload {
                            targets,
                            idx,
                            off: 0,
                        }
                    }
                    Some(_) => conn.idle(slot.limit().tick()),
                    None => {
                        let _ = (&*stream).write_all(&win.ack(u64::MAX).encode());
                        return Err(proto_err(format!("write of {len} bytes exceeds the limit")));
                    }
                }
            }
            ClientFrame::WriteV { count, .. } => {
                state = State::Entries {
                    buf: vec![0u8; count as usize * ENTRY_LEN],
                    have: 0,
                };
            }
            ClientFrame::Fence { tag } => {
                let ack = win.ack(tag);
                metrics::counter!("kvx_tcp_bytes_received_total").increment(ack.bytes);
                ctx.table.note_received(ack.bytes);
                (&*stream).write_all(&ack.encode())?;
                // Sending the acknowledgement so soon after receiving makes the kernel take the
                // connection for request/response traffic and delay its TCP ACKs of the next
                // window (delayed-ACK "ping-pong" mode); the sender, waiting on them to free its
                // send buffer, then writes in bursts. Asking for quick ACKs again after each
                // acknowledgement keeps the bulk flow ACKed as it arrives.
                mem::quick_acks(stream);
                conn.idle(slot.limit().tick());
            }
        }
    }
}

/// Checks one write: its receive targets (more than one when it lands in a placed range; a
/// rejected one is drained), `None` when its length is above the limit (the connection must
/// close).
fn check_write(
    ctx: &ServerCtx,
    rx: &Receiver,
    win: &mut Window,
    e: Entry,
) -> Option<Vec<RecvTarget>> {
    if e.len > u64::from(ctx.max_write_len) {
        win.reject_fatal(RejectReason::TooLong, e.addr);
        return None;
    }
    Some(lease_targets(ctx, rx, win, &[e]))
}

/// The receive targets of a frame's checked writes, under one look at the region table.
fn lease_targets(
    ctx: &ServerCtx,
    rx: &Receiver,
    win: &mut Window,
    entries: &[Entry],
) -> Vec<RecvTarget> {
    let mut targets = Vec::with_capacity(entries.len());
    ctx.table.lease_keyed_frame(
        rx,
        entries.iter().map(|e| (e.key, e.addr, e.len)),
        |i, len, checked| {
            if let Some(&e) = entries.get(i) {
                targets.push(target(win, Entry { len, ..e }, checked));
            }
        },
    );
    targets
}

/// The receive target of a checked write; a rejected one is logged, counted and drained.
fn target(win: &mut Window, e: Entry, checked: Result<mem::Span, RejectReason>) -> RecvTarget {
    match checked {
        Ok(span) => RecvTarget::Mem(span),
        Err(reason) => {
            // One warning per window (the rest are counted and logged at debug level).
            if win.first.is_none() {
                tracing::warn!(key = %e.key, addr = e.addr, len = e.len, %reason, "rejected write");
            } else {
                tracing::debug!(key = %e.key, addr = e.addr, len = e.len, %reason, "rejected write");
            }
            win.reject(reason, e.addr);
            RecvTarget::Discard(e.len)
        }
    }
}

/// Turns the entries of a vectored write into receive targets (checked before any payload
/// byte is read): every entry is decoded and its length checked, then the whole frame is
/// leased under one look at the region table.
fn entries_to_payload(
    buf: &[u8],
    ctx: &ServerCtx,
    rx: &Receiver,
    win: &mut Window,
) -> io::Result<State> {
    let mut entries = Vec::with_capacity(buf.len() / ENTRY_LEN);
    for raw in buf.chunks_exact(ENTRY_LEN) {
        let e = match Entry::decode(raw) {
            Ok(e) => e,
            Err(reason) => {
                win.reject_fatal(reason, 0);
                return Err(proto_err("malformed vectored-write entry"));
            }
        };
        if e.len > u64::from(ctx.max_write_len) {
            win.reject_fatal(RejectReason::TooLong, e.addr);
            return Err(proto_err(format!(
                "write of {} bytes exceeds the limit",
                e.len
            )));
        }
        entries.push(e);
    }
    let targets = lease_targets(ctx, rx, win, &entries);
    let idx = targets.iter().take_while(|t| t.is_empty()).count();
    Ok(State::Payload {
        targets,
        idx,
        off: 0,
    })
}

/// Runs one blocking read, retrying on `EINTR`.
fn read_blocking(mut f: impl FnMut() -> io::Result<usize>) -> io::Result<usize> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}
