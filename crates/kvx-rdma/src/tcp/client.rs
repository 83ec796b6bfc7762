//! The sending (prefill) side of the tcp backend: sessions, connections, windows, completions.
//!
//! A session owns `connections` sockets to one peer. A batch is checked (every src in a local
//! region, every dst in one of the peer's regions) and cut into *windows* of at most
//! `window_bytes` (ops longer than `slice_bytes` are sliced). Windows go into one bounded queue
//! per session (backpressure: posting waits for room); each connection's writer takes the next
//! window when it is ready, so faster connections carry more. A writer sends a window as one
//! vectored stream — vectored-write header and entries, payloads straight from registered
//! memory, …, fence — and the connection's reader matches the peer's acknowledgements to windows
//! in order. A small window (at most [`INLINE_MAX`] payload bytes) posted while the queue is
//! empty goes on the wire from the caller's own thread when a connection is idle (nothing
//! unacknowledged, no writer on its socket) and its send buffer takes the window now: a
//! single small write then costs no wake-up of a parked writer thread, which on a loaded host
//! can wait for a scheduler tick. A window finishes exactly once: acknowledged, rejected (an acknowledgement with a
//! reject status), failed with its connection (only after the socket was shut down), or dropped
//! unsent. The first rejection or failure fails the batch, and a failed batch's windows are
//! cancelled instead of sent: no more are queued, and a writer drops a window of a failed batch
//! when it takes it (an atomic load per window, again just before it goes on the wire). The
//! batch's future resolves only once every window finished, so when it returns this side sends
//! nothing more of the batch; a dropped future fails its batch the same way. A failed batch may
//! therefore answer late: once the windows queued ahead of its own were taken, or after
//! `ack_timeout` when a connection carrying one of its windows falls silent. (On a connection
//! failed by this side — timeout, local error — the kernel may still deliver bytes it accepted
//! before the shutdown; a peer that closed or reset reads nothing more.) A connection with an
//! unacknowledged window older than `ack_timeout` is declared dead (silent peer); a dead
//! connection fails the windows it carries and stops taking new ones, and only that.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvx_core::TransferOp;
use std::io::Read;
use std::os::fd::AsRawFd;
use tokio::sync::mpsc;

use crate::batch::{self, Ticket};
use crate::error::TransportError;
use crate::mem::{self, IoPart, RegionTable, Span};
use crate::segment::{RegionKey, SegmentDescriptor};
use crate::tcp::TcpConfig;
use crate::tcp::wire::{Ack, ClientFrame, ENTRY_LEN, Entry, HEADER_LEN, MAX_ENTRIES};
use crate::transport::{BatchReport, BoxFuture, Session};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One write on the wire: checked source span, destination, key.
struct WireWrite {
    key: RegionKey,
    src: Span,
    dst: u64,
}

/// A window: writes followed by one fence.
struct Window {
    ticket: Ticket,
    writes: Vec<WireWrite>,
}

/// A window on the wire, waiting for its acknowledgement.
struct Pending {
    tag: u64,
    ticket: Ticket,
    since: Instant,
}

/// State shared by a connection's writer and reader tasks.
struct ConnShared {
    peer: String,
    stream: std::net::TcpStream,
    pending: Mutex<VecDeque<Pending>>,
    dead: Mutex<Option<TransportError>>,
    is_dead: AtomicBool,
    /// The next window's tag; held while a window goes on the wire (writer thread or an
    /// inline sender), so windows never interleave on the socket.
    wire: Mutex<u64>,
}

/// Largest window (payload bytes) sent from the caller's thread instead of the writer's.
pub(crate) const INLINE_MAX: usize = 64 << 10;

impl ConnShared {
    fn dead_error(&self) -> TransportError {
        lock(&self.dead).clone().unwrap_or(TransportError::Closed)
    }

    /// Marks the connection dead (first cause wins), shuts the socket down, and only then fails
    /// the windows it carries (nothing of them can be sent any more).
    fn fail(&self, e: TransportError) {
        self.fail_with(None, e);
    }

    /// [`ConnShared::fail`], where `front` (a window already taken off the pending list, whose
    /// acknowledgement was the fatal one) fails with `e` itself.
    fn fail_with(&self, front: Option<Pending>, e: TransportError) {
        let front = front.map(|p| (p, e.clone()));
        let sock = socket2::SockRef::from(&self.stream);
        {
            let mut d = lock(&self.dead);
            if d.is_none() && e == TransportError::Closed {
                *d = Some(e);
            } else if d.is_none() {
                metrics::counter!("kvx_tcp_conn_failures_total", "cause" => e.label()).increment(1);
                tracing::warn!(peer = %self.peer, error = %e, "tcp transport connection failed");
                // A broken connection is reset when its socket closes, not flushed.
                let _ = sock.set_linger(Some(std::time::Duration::ZERO));
                *d = Some(e);
            }
        }
        self.is_dead.store(true, Ordering::Release);
        let _ = sock.shutdown(std::net::Shutdown::Both);
        if let Some((mut p, e)) = front {
            p.ticket.finish(Err(e));
        }
        let err = self.dead_error();
        let drained: Vec<Pending> = lock(&self.pending).drain(..).collect();
        for mut p in drained {
            p.ticket.finish(Err(err.clone()));
        }
    }

    /// Records a window as in flight before its first byte is written; refused once the
    /// connection is dead (a window recorded here is finished by [`ConnShared::fail`]).
    fn push(&self, p: Pending) -> Result<(), Pending> {
        let mut q = lock(&self.pending);
        if self.is_dead.load(Ordering::Acquire) {
            return Err(p);
        }
        q.push_back(p);
        Ok(())
    }

    /// Hands a window this (dead) connection took back to the queue for a live one. A window of
    /// a failed batch is dropped (cancelled); one that cannot be queued fails with this
    /// connection's cause.
    fn hand_back(&self, w: Window, back: &mpsc::WeakSender<Window>) {
        if w.ticket.is_cancelled() {
            return;
        }
        let back = match back.upgrade() {
            Some(tx) => tx.try_send(w).map_err(|e| match e {
                mpsc::error::TrySendError::Full(w) | mpsc::error::TrySendError::Closed(w) => w,
            }),
            None => Err(w),
        };
        if let Err(mut w) = back {
            w.ticket.finish(Err(self.dead_error()));
        }
    }
}

/// The session's window queue, shared by the connections' writers: whichever connection is
/// ready takes the next window, so faster connections carry more.
type SharedQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<Window>>>;

/// A tcp session to one peer.
pub struct TcpSession {
    peer: String,
    remote: SegmentDescriptor,
    local: Arc<RegionTable>,
    conns: Vec<Arc<ConnShared>>,
    tx: mpsc::Sender<Window>,
    cfg: TcpConfig,
}

impl TcpSession {
    /// Wraps handshaken streams into a session and starts their tasks.
    pub(crate) fn start(
        peer: String,
        remote: SegmentDescriptor,
        local: Arc<RegionTable>,
        streams: Vec<std::net::TcpStream>,
        cfg: TcpConfig,
    ) -> Self {
        let n = streams.len().max(1);
        let (tx, rx) = mpsc::channel(cfg.queue_depth.max(1) * n);
        let queue: SharedQueue = Arc::new(tokio::sync::Mutex::new(rx));
        let conns = streams
            .into_iter()
            .map(|stream| {
                let shared = Arc::new(ConnShared {
                    peer: peer.clone(),
                    stream,
                    pending: Mutex::new(VecDeque::new()),
                    dead: Mutex::new(None),
                    is_dead: AtomicBool::new(false),
                    wire: Mutex::new(1),
                });
                let (w, q, rq) = (shared.clone(), queue.clone(), tx.downgrade());
                let r = shared.clone();
                let timeout = cfg.ack_timeout;
                let spawned = std::thread::Builder::new()
                    .name("kvx-tcp-tx".into())
                    .spawn(move || writer(w, q, rq))
                    .and_then(|_| {
                        std::thread::Builder::new()
                            .name("kvx-tcp-ack".into())
                            .spawn(move || reader(r, timeout))
                    });
                if let Err(e) = spawned {
                    shared.fail(TransportError::from(e));
                }
                shared
            })
            .collect();
        TcpSession {
            peer,
            remote,
            local,
            conns,
            tx,
            cfg,
        }
    }

    /// The cause to report when the connections cannot take a window any more.
    fn dead_error(conns: &[Arc<ConnShared>]) -> TransportError {
        conns
            .iter()
            .find_map(|c| {
                lock(&c.dead)
                    .clone()
                    .filter(|e| *e != TransportError::Closed)
            })
            .unwrap_or(TransportError::Closed)
    }

    /// Checks a batch and cuts it into windows (the writes of each; nothing is sent on error).
    fn plan(&self, ops: &[TransferOp]) -> Result<Vec<Vec<WireWrite>>, TransportError> {
        let slice = self.cfg.slice_bytes.max(1) as u64;
        let window_bytes = self.cfg.window_bytes.max(1);
        let max_writes = self.cfg.max_writes_per_window.max(1);
        let mut windows = Vec::new();
        let mut cur = Vec::new();
        let mut cur_bytes = 0u64;
        let mut srcs = Vec::with_capacity(ops.len());
        self.local
            .resolve_many(ops.iter().map(|o| (o.src, o.len)), |s| srcs.push(s))?;
        for (op, src) in ops.iter().zip(srcs) {
            let region =
                self.remote
                    .find(op.dst, op.len)
                    .ok_or(TransportError::RemoteNotRegistered {
                        addr: op.dst,
                        len: op.len,
                    })?;
            let mut off = 0u64;
            while off < op.len {
                let len = slice.min(op.len - off).min(window_bytes - cur_bytes);
                let Some(s) = src.sub(off as usize, len as usize) else {
                    return Err(TransportError::LocalNotRegistered {
                        addr: op.src,
                        len: op.len,
                    });
                };
                cur.push(WireWrite {
                    key: region.key,
                    src: s,
                    dst: op.dst + off,
                });
                cur_bytes += len;
                off += len;
                if cur_bytes >= window_bytes || cur.len() >= max_writes {
                    windows.push(std::mem::take(&mut cur));
                    cur_bytes = 0;
                }
            }
        }
        if !cur.is_empty() {
            windows.push(cur);
        }
        Ok(windows)
    }
}

impl Session for TcpSession {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn remote(&self) -> &SegmentDescriptor {
        &self.remote
    }

    fn gathers_sources(&self) -> bool {
        // Each connection's writer sends a window as one vectored stream from registered memory.
        true
    }

    fn is_alive(&self) -> bool {
        self.conns
            .iter()
            .all(|c| !c.is_dead.load(Ordering::Acquire))
    }

    fn write_batch(
        &self,
        ops: Vec<TransferOp>,
    ) -> BoxFuture<'static, Result<BatchReport, TransportError>> {
        let report = BatchReport {
            ops: ops.len() as u64,
            bytes: TransferOp::total_bytes(&ops),
        };
        let planned = self.plan(&ops);
        let tx = self.tx.clone();
        let conns = self.conns.clone();
        Box::pin(async move {
            let r = post(planned, tx, &conns).await;
            metrics::counter!("kvx_transport_batches_total", "backend" => "tcp",
                "result" => match &r { Ok(()) => "ok", Err(e) => e.label() })
            .increment(1);
            r.map(|()| report)
        })
    }
}

/// Queues a planned batch and waits until every window of it finished.
async fn post(
    planned: Result<Vec<Vec<WireWrite>>, TransportError>,
    tx: mpsc::Sender<Window>,
    conns: &[Arc<ConnShared>],
) -> Result<(), TransportError> {
    batch::post(
        planned?,
        |writes, ticket| Window { ticket, writes },
        |w| send_inline(conns, w),
        tx,
        || TcpSession::dead_error(conns),
    )
    .await
}

/// A connection's sending thread (blocking socket: the kernel sleeps and wakes it directly).
fn writer(c: Arc<ConnShared>, queue: SharedQueue, requeue: mpsc::WeakSender<Window>) {
    let mut meta: Vec<u8> = Vec::new();
    loop {
        if c.is_dead.load(Ordering::Acquire) {
            // Leave the queue to the live connections.
            return;
        }
        let Some(w) = queue.blocking_lock().blocking_recv() else {
            break;
        };
        if c.is_dead.load(Ordering::Acquire) {
            // Died while waiting for work: hand the window back for a live connection (if none
            // is left, the queue is dropped with it and the batch fails with the cause).
            c.hand_back(w, &requeue);
            return;
        }
        // A failed batch's windows are cancelled, never sent.
        if w.ticket.is_cancelled() {
            continue;
        }
        let Window { ticket, writes } = w;
        let mut wire = lock(&c.wire);
        let tag = *wire;
        *wire += 1;
        let parts = encode_window(&writes, tag, &mut meta);
        // Checked again as late as possible: past this point the window is on the wire and its
        // batch waits for its acknowledgement (or for this connection to be shut down).
        if ticket.is_cancelled() {
            continue;
        }
        let pending = Pending {
            tag,
            ticket,
            since: Instant::now(),
        };
        if let Err(p) = c.push(pending) {
            drop((parts, wire));
            c.hand_back(
                Window {
                    ticket: p.ticket,
                    writes,
                },
                &requeue,
            );
            return;
        }
        match write_parts_blocking(&c.stream, &parts, 0) {
            Ok(n) => {
                metrics::counter!("kvx_tcp_bytes_sent_total").increment(n);
            }
            Err(e) => {
                c.fail(TransportError::PeerLost {
                    peer: c.peer.clone(),
                    detail: e.to_string(),
                });
            }
        }
    }
    // Session dropped: close the socket so the reader ends.
    c.fail(TransportError::Closed);
}

/// The wire form of a window: per group of up to `MAX_ENTRIES` writes a vectored-write header
/// and its entries (control bytes built in `meta`), the payloads straight from registered
/// memory, then the fence.
fn encode_window<'a>(writes: &'a [WireWrite], tag: u64, meta: &'a mut Vec<u8>) -> Vec<IoPart<'a>> {
    meta.clear();
    let groups = writes.chunks(MAX_ENTRIES as usize);
    for g in groups.clone() {
        meta.extend_from_slice(
            &ClientFrame::WriteV {
                count: g.len() as u32,
                tag,
            }
            .encode(),
        );
        for ww in g {
            meta.extend_from_slice(
                &Entry {
                    key: ww.key,
                    addr: ww.dst,
                    len: ww.src.len() as u64,
                }
                .encode(),
            );
        }
    }
    meta.extend_from_slice(&ClientFrame::Fence { tag }.encode());
    let meta: &'a [u8] = meta;
    let mut parts = Vec::with_capacity(writes.len() + 2 * groups.len() + 1);
    let mut at = 0;
    for g in groups {
        let n = HEADER_LEN + g.len() * ENTRY_LEN;
        parts.push(IoPart::Bytes(&meta[at..at + n]));
        at += n;
        for ww in g.iter().filter(|ww| !ww.src.is_empty()) {
            parts.push(IoPart::Span(ww.src));
        }
    }
    parts.push(IoPart::Bytes(&meta[at..]));
    parts
}

/// Puts a small window on an idle connection from the caller's thread; gives the window back
/// when it is too big, no connection is idle, or the send buffer takes nothing right now (the
/// window is then queued for the writers as usual). The window is recorded as in flight before
/// its first byte is written, exactly as a writer does. Once the send buffer took part of it,
/// the rest is written blocking: at most `INLINE_MAX` bytes onto a connection whose peer has
/// acknowledged everything sent before. A peer that stops reading meanwhile is bounded like a
/// writer's: the reader fails the connection once the window is `ack_timeout` old, and the
/// shutdown ends the write. Only called on a thread that may block (`batch::post` checks).
fn send_inline(conns: &[Arc<ConnShared>], w: Window) -> Option<Window> {
    let bytes: usize = w.writes.iter().map(|ww| ww.src.len()).sum();
    if bytes > INLINE_MAX || w.writes.len() > MAX_ENTRIES as usize || w.ticket.is_cancelled() {
        return Some(w);
    }
    let mut w = w;
    for c in conns {
        if c.is_dead.load(Ordering::Acquire) || !lock(&c.pending).is_empty() {
            continue;
        }
        let Ok(mut wire) = c.wire.try_lock() else {
            continue;
        };
        if !lock(&c.pending).is_empty() {
            continue;
        }
        // As late as a writer checks: another window of the batch may have failed meanwhile.
        if w.ticket.is_cancelled() {
            return Some(w);
        }
        let tag = *wire;
        let Window { ticket, writes } = w;
        let pending = Pending {
            tag,
            ticket,
            since: Instant::now(),
        };
        if let Err(p) = c.push(pending) {
            w = Window {
                ticket: p.ticket,
                writes,
            };
            continue;
        }
        let mut meta = Vec::with_capacity(2 * HEADER_LEN + writes.len() * ENTRY_LEN);
        let parts = encode_window(&writes, tag, &mut meta);
        let sent = loop {
            match mem::writev_nowait(c.stream.as_raw_fd(), &parts, 0) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r,
            }
        };
        let r = match sent {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Nothing written: take the window back (only this holder of `wire` pushes,
                // and no acknowledgement can come for a window not sent). A connection that
                // failed meanwhile already finished it.
                drop(parts);
                let back = lock(&c.pending).pop_back();
                return back.map(|p| Window {
                    ticket: p.ticket,
                    writes,
                });
            }
            Err(e) => Err(e),
            Ok(n) => write_parts_blocking(&c.stream, &parts, n).map(|m| m + n as u64),
        };
        *wire += 1;
        match r {
            Ok(n) => metrics::counter!("kvx_tcp_bytes_sent_total").increment(n),
            Err(e) => c.fail(TransportError::PeerLost {
                peer: c.peer.clone(),
                detail: e.to_string(),
            }),
        }
        return None;
    }
    Some(w)
}

/// A connection's acknowledgement thread: reads ACKs, and fails the connection when the oldest
/// window waits longer than `ack_timeout` (the socket's receive timeout bounds each wait).
fn reader(c: Arc<ConnShared>, ack_timeout: std::time::Duration) {
    let mut buf = [0u8; HEADER_LEN];
    let mut have = 0usize;
    let tick = (ack_timeout / 4).clamp(
        std::time::Duration::from_millis(1),
        std::time::Duration::from_millis(100),
    );
    let fd = c.stream.as_raw_fd();
    loop {
        if c.is_dead.load(Ordering::Acquire) {
            return;
        }
        // Wait for input with `poll`: a thread blocked in `read` would also be woken each time
        // the writer's send buffer drains (one wait queue per socket).
        let ready = match crate::mem::wait_readable(fd, tick) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
            Err(e) => {
                c.fail(TransportError::PeerLost {
                    peer: c.peer.clone(),
                    detail: e.to_string(),
                });
                return;
            }
        };
        let read = if ready {
            (&c.stream).read(&mut buf[have..])
        } else {
            Err(std::io::ErrorKind::TimedOut.into())
        };
        match read {
            Ok(0) => {
                c.fail(TransportError::PeerLost {
                    peer: c.peer.clone(),
                    detail: "connection closed by peer".into(),
                });
                return;
            }
            Ok(n) => {
                have += n;
                if have == HEADER_LEN {
                    have = 0;
                    if let Err(f) = on_ack(&c, &buf) {
                        let (front, e) = *f;
                        c.fail_with(front, e);
                        return;
                    }
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                let expired = lock(&c.pending)
                    .front()
                    .is_some_and(|p| p.since.elapsed() >= ack_timeout);
                if expired {
                    c.fail(TransportError::Timeout {
                        peer: c.peer.clone(),
                        after_ms: ack_timeout.as_millis() as u64,
                    });
                    return;
                }
            }
            Err(e) => {
                c.fail(TransportError::PeerLost {
                    peer: c.peer.clone(),
                    detail: e.to_string(),
                });
                return;
            }
        }
    }
}

/// Writes every byte of `parts` after the first `skip` on a blocking socket, at most
/// [`mem::BULK_WRITE`] bytes per call (a 16 MiB window in one call would reach the receiver in
/// megabyte bursts); returns the bytes it wrote.
fn write_parts_blocking(
    stream: &std::net::TcpStream,
    parts: &[IoPart<'_>],
    skip: usize,
) -> std::io::Result<u64> {
    let fd = stream.as_raw_fd();
    let (mut idx, mut off) = super::io::advance(parts, 0, 0, skip);
    let mut total = 0u64;
    while idx < parts.len() {
        if parts[idx].len() == off {
            idx += 1;
            off = 0;
            continue;
        }
        let n = match mem::writev_at_most(fd, &parts[idx..], off, mem::BULK_WRITE) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        total += n as u64;
        (idx, off) = super::io::advance(parts, idx, off, n);
    }
    Ok(total)
}

/// Why an acknowledgement fails its connection, with the window it was for when that window
/// is to fail with this very error (a fatal rejection).
type AckFailure = Box<(Option<Pending>, TransportError)>;

fn on_ack(c: &ConnShared, buf: &[u8; HEADER_LEN]) -> Result<(), AckFailure> {
    let ack = Ack::decode(buf).map_err(|e| {
        Box::new((
            None,
            TransportError::PeerLost {
                peer: c.peer.clone(),
                detail: format!("protocol error: {e}"),
            },
        ))
    })?;
    let rejected = |reason| TransportError::RemoteRejected {
        reason,
        addr: ack.first_rejected_addr,
        len: 0,
    };
    let front = lock(&c.pending).pop_front();
    let Some(mut p) = front else {
        return Err(Box::new((
            None,
            TransportError::PeerLost {
                peer: c.peer.clone(),
                detail: format!("unexpected ack {}", ack.tag),
            },
        )));
    };
    if ack.tag != p.tag {
        // The window fails with the connection, once its socket is shut down.
        return Err(Box::new(match ack.status {
            // A fatal rejection (tag u64::MAX): the peer closes after it.
            Some(reason) => (Some(p), rejected(reason)),
            None => {
                let e = TransportError::PeerLost {
                    peer: c.peer.clone(),
                    detail: format!("ack {} does not match window {}", ack.tag, p.tag),
                };
                (Some(p), e)
            }
        }));
    }
    p.ticket.finish(match ack.status {
        Some(reason) => Err(rejected(reason)),
        None => Ok(()),
    });
    Ok(())
}

#[cfg(test)]
#[path = "client_tests.rs"]
mod tests;
