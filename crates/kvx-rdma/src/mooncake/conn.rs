//! One data connection of an initiator session: its writer thread (request groups out, as
//! vectored writes straight from registered memory, within an in-flight budget), its reader
//! thread (status frames under v2, fence bytes under v1, matched to groups in order), and the
//! completion state the groups share with their batch.
//!
//! A group finishes exactly once: acknowledged, failed with its connection (only after the
//! socket was shut down, so nothing of it can still be sent), or dropped unsent (cancelled
//! because its batch failed, or left without a live connection). A connection fails on a
//! reject frame, a frame without the magic, EOF, a socket error, or no reply for
//! `status_timeout` while something is in flight; that fails every group pipelined on it.

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::batch::Ticket;
use crate::error::{RejectReason, TransportError};
use crate::mem::{self, IoPart, Span};
use crate::mooncake::wire::{HEADER_LEN, Header, STATUS_ADDR_REJECTED, STATUS_LEN, Status};

/// Bytes of the v1 fence READ.
const FENCE_LEN: u64 = 1;

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One request: a checked source span and its destination.
pub(super) struct Req {
    pub src: Span,
    pub dst: u64,
}

/// Requests sent as one vectored stream; its ticket finishes exactly once (acked, failed with
/// its connection, or dropped unsent).
pub(super) struct Group {
    pub ticket: Ticket,
    pub reqs: Vec<Req>,
    pub bytes: u64,
}

impl Group {
    fn finish(&mut self, r: Result<(), TransportError>) {
        self.ticket.finish(r);
    }
}

/// Why a connection fails: the error for its oldest group, and for the others.
type Failure = Box<(TransportError, TransportError)>;

/// A group on the wire.
struct Pending {
    group: Group,
    /// v2: status frames still due; v1: fence bytes still due.
    left: u64,
    /// v2: requests acknowledged so far.
    acked: usize,
}

struct Flight {
    pending: VecDeque<Pending>,
    bytes: u64,
    reqs: usize,
    progress: Instant,
}

/// One data connection, shared by its writer and reader threads.
pub(super) struct Conn {
    peer: Arc<str>,
    stream: std::net::TcpStream,
    flight: Mutex<Flight>,
    room: Condvar,
    dead: AtomicBool,
    cause: Mutex<Option<TransportError>>,
    v2: bool,
    max_bytes: u64,
    max_reqs: usize,
}

/// What a connection needs to know about its session.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// Protocol v2 (status frames) or v1 (fence READs).
    pub v2: bool,
    /// Unacknowledged bytes at most.
    pub max_bytes: u64,
    /// Unacknowledged requests at most.
    pub max_reqs: usize,
    /// No reply this long with something in flight fails the connection.
    pub status_timeout: Duration,
}

impl Conn {
    /// Wraps a connected (blocking) data stream and starts its writer and reader threads.
    pub fn start(
        peer: Arc<str>,
        stream: std::net::TcpStream,
        limits: Limits,
        queue: SharedQueue,
        back: mpsc::WeakSender<Group>,
    ) -> Arc<Conn> {
        let c = Arc::new(Conn {
            peer,
            stream,
            flight: Mutex::new(Flight {
                pending: VecDeque::new(),
                bytes: 0,
                reqs: 0,
                progress: Instant::now(),
            }),
            room: Condvar::new(),
            dead: AtomicBool::new(false),
            cause: Mutex::new(None),
            v2: limits.v2,
            max_bytes: limits.max_bytes,
            max_reqs: limits.max_reqs,
        });
        let (w, r) = (c.clone(), c.clone());
        let spawned = std::thread::Builder::new()
            .name("kvx-mc-tx".into())
            .spawn(move || writer(w, queue, back))
            .and_then(|_| {
                std::thread::Builder::new()
                    .name("kvx-mc-ack".into())
                    .spawn(move || reader(r, limits.status_timeout))
            });
        if let Err(e) = spawned {
            c.fail_all(TransportError::from(e));
        }
        c
    }

    /// False once the connection failed (or its session was dropped).
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Why the connection died (`None` while alive).
    pub fn cause(&self) -> Option<TransportError> {
        lock(&self.cause).clone()
    }

    fn lost(&self, detail: impl Into<String>) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer.to_string(),
            detail: detail.into(),
        }
    }

    /// Kills the connection: the socket is shut down first, then every pipelined group fails
    /// (the oldest with `front`, the others with `rest`).
    fn fail(&self, front: TransportError, rest: TransportError) {
        {
            let mut c = lock(&self.cause);
            if c.is_none() {
                if front != TransportError::Closed {
                    metrics::counter!("kvx_mooncake_conn_failures_total", "cause" => front.label())
                        .increment(1);
                    tracing::warn!(peer = %self.peer, error = %front,
                        "mooncake data connection failed");
                }
                *c = Some(front.clone());
            }
        }
        self.dead.store(true, Ordering::Release);
        let sock = socket2::SockRef::from(&self.stream);
        let _ = sock.set_linger(Some(Duration::ZERO));
        let _ = sock.shutdown(std::net::Shutdown::Both);
        let drained: Vec<Pending> = {
            let mut f = lock(&self.flight);
            f.bytes = 0;
            f.reqs = 0;
            f.pending.drain(..).collect()
        };
        self.room.notify_all();
        for (i, mut p) in drained.into_iter().enumerate() {
            p.group
                .finish(Err(if i == 0 { front.clone() } else { rest.clone() }));
        }
    }

    fn fail_all(&self, e: TransportError) {
        self.fail(e.clone(), e);
    }

    /// Waits until a group of `bytes`/`reqs` fits the in-flight budget; false once dead.
    fn wait_room(&self, bytes: u64, reqs: usize) -> bool {
        let mut f = lock(&self.flight);
        loop {
            if self.is_dead() {
                return false;
            }
            if f.pending.is_empty()
                || (f.bytes + bytes <= self.max_bytes && f.reqs + reqs <= self.max_reqs)
            {
                return true;
            }
            f = self
                .room
                .wait_timeout(f, Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Records a group as in flight (before its first byte is written).
    fn push(&self, group: Group) -> Result<(), Group> {
        let mut f = lock(&self.flight);
        if self.is_dead() {
            return Err(group);
        }
        if f.pending.is_empty() {
            f.progress = Instant::now();
        }
        f.bytes += group.bytes;
        f.reqs += group.reqs.len();
        let left = if self.v2 {
            group.reqs.len() as u64
        } else {
            FENCE_LEN
        };
        f.pending.push_back(Pending {
            group,
            left,
            acked: 0,
        });
        Ok(())
    }

    /// Applies replies from the peer; returns the bytes consumed, or the failure.
    fn on_replies(&self, buf: &[u8]) -> Result<usize, Failure> {
        let mut done = Vec::new();
        let used = {
            let mut f = lock(&self.flight);
            let r = if self.v2 {
                self.on_status_frames(&mut f, buf, &mut done)
            } else {
                self.on_fence_bytes(&mut f, buf, &mut done)
            };
            f.progress = Instant::now();
            r
        };
        if !done.is_empty() {
            self.room.notify_all();
        }
        for mut g in done {
            g.finish(Ok(()));
        }
        used
    }

    fn on_status_frames(
        &self,
        f: &mut Flight,
        buf: &[u8],
        done: &mut Vec<Group>,
    ) -> Result<usize, Failure> {
        let mut at = 0;
        while buf.len() - at >= STATUS_LEN {
            let status = Status::parse(&buf[at..]).map_err(|e| {
                let e = self.lost(format!("protocol error: {e}"));
                Box::new((e.clone(), e))
            })?;
            at += STATUS_LEN;
            let Some(front) = f.pending.front_mut() else {
                let e = self.lost("status frame with no request in flight");
                return Err(Box::new((e.clone(), e)));
            };
            let Some(req) = front.group.reqs.get(front.acked) else {
                let e = self.lost("more status frames than requests");
                return Err(Box::new((e.clone(), e)));
            };
            if let Status::Rejected(code) = status {
                let reason = if code == STATUS_ADDR_REJECTED {
                    RejectReason::OutOfBounds
                } else {
                    RejectReason::BadFrame
                };
                let front = TransportError::RemoteRejected {
                    reason,
                    addr: req.dst,
                    len: req.src.len() as u64,
                };
                let rest = self.lost(format!("connection closed after a rejected write: {front}"));
                return Err(Box::new((front, rest)));
            }
            let len = req.src.len() as u64;
            front.acked += 1;
            front.left -= 1;
            f.bytes = f.bytes.saturating_sub(len);
            f.reqs = f.reqs.saturating_sub(1);
            if front.left == 0
                && let Some(p) = f.pending.pop_front()
            {
                done.push(p.group);
            }
        }
        Ok(at)
    }

    fn on_fence_bytes(
        &self,
        f: &mut Flight,
        buf: &[u8],
        done: &mut Vec<Group>,
    ) -> Result<usize, Failure> {
        let mut at = 0;
        while at < buf.len() {
            let Some(front) = f.pending.front_mut() else {
                let e = self.lost("bytes with no fence in flight");
                return Err(Box::new((e.clone(), e)));
            };
            let take = front.left.min((buf.len() - at) as u64);
            front.left -= take;
            at += take as usize;
            if front.left == 0
                && let Some(p) = f.pending.pop_front()
            {
                f.bytes = f.bytes.saturating_sub(p.group.bytes);
                f.reqs = f.reqs.saturating_sub(p.group.reqs.len());
                done.push(p.group);
            }
        }
        Ok(at)
    }

    fn expired(&self, timeout: Duration) -> bool {
        let f = lock(&self.flight);
        !f.pending.is_empty() && f.progress.elapsed() >= timeout
    }
}

/// The session's group queue, shared by the connections' writers.
pub(super) type SharedQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<Group>>>;

/// Hands a group taken by a dead connection back to the queue (for a live one); dropped (and
/// so failed) when the queue is full or gone.
fn hand_back(g: Group, back: &mpsc::WeakSender<Group>) {
    if let Some(tx) = back.upgrade() {
        let _ = tx.try_send(g);
    }
}

/// A connection's sending thread (blocking socket).
fn writer(c: Arc<Conn>, queue: SharedQueue, back: mpsc::WeakSender<Group>) {
    let fd = c.stream.as_raw_fd();
    let mut hdrs: Vec<[u8; HEADER_LEN]> = Vec::new();
    loop {
        if c.is_dead() {
            return;
        }
        let Some(g) = queue.blocking_lock().blocking_recv() else {
            break;
        };
        if c.is_dead() {
            hand_back(g, &back);
            return;
        }
        // A failed batch's groups are cancelled, never sent.
        if g.ticket.is_cancelled() {
            continue;
        }
        if !c.wait_room(g.bytes, g.reqs.len()) {
            hand_back(g, &back);
            return;
        }
        if g.ticket.is_cancelled() {
            continue;
        }
        hdrs.clear();
        hdrs.extend(
            g.reqs
                .iter()
                .map(|r| Header::write(r.dst, r.src.len() as u64, c.v2).encode()),
        );
        if !c.v2
            && let Some(last) = g.reqs.last()
        {
            hdrs.push(Header::read(last.dst, FENCE_LEN, false).encode());
        }
        let mut parts = Vec::with_capacity(2 * g.reqs.len() + 1);
        for (h, r) in hdrs.iter().zip(&g.reqs) {
            parts.push(IoPart::Bytes(h));
            parts.push(IoPart::Span(r.src));
        }
        if !c.v2
            && let Some(fence) = hdrs.last()
        {
            parts.push(IoPart::Bytes(fence));
        }
        let payload = g.bytes;
        if let Err(g) = c.push(g) {
            hand_back(g, &back);
            return;
        }
        match mem::writev_all(fd, &parts) {
            Ok(_) => metrics::counter!("kvx_mooncake_bytes_sent_total").increment(payload),
            Err(e) => c.fail_all(c.lost(e.to_string())),
        }
    }
    // Session dropped: close the socket so the reader ends.
    c.fail_all(TransportError::Closed);
}

/// A connection's reply thread: status frames (v2) or fence bytes (v1), matched in order; no
/// progress for `timeout` with something in flight fails the connection.
fn reader(c: Arc<Conn>, timeout: Duration) {
    let tick = (timeout / 4).clamp(Duration::from_millis(1), Duration::from_millis(100));
    let _ = c.stream.set_read_timeout(Some(tick));
    let mut buf = [0u8; 4096];
    let mut have = 0usize;
    loop {
        if c.is_dead() {
            return;
        }
        match (&c.stream).read(&mut buf[have..]) {
            Ok(0) => {
                c.fail_all(c.lost("connection closed by peer"));
                return;
            }
            Ok(n) => {
                have += n;
                match c.on_replies(&buf[..have]) {
                    Ok(used) => {
                        buf.copy_within(used..have, 0);
                        have -= used;
                    }
                    Err(f) => {
                        let (front, rest) = *f;
                        c.fail(front, rest);
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
                if c.expired(timeout) {
                    c.fail_all(TransportError::Timeout {
                        peer: c.peer.to_string(),
                        after_ms: timeout.as_millis() as u64,
                    });
                    return;
                }
            }
            Err(e) => {
                c.fail_all(c.lost(e.to_string()));
                return;
            }
        }
    }
}
