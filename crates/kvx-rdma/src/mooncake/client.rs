//! The initiator side of the mooncake backend: the metadata exchange and data sessions.
//!
//! [`fetch_descriptor`] asks a target's handshake port for its descriptor (one connection, one
//! request, one reply, closed at once). A [`MooncakeSession`] owns `connections` data sockets
//! to the target. A batch is checked first (every source inside a local region, every
//! destination inside one advertised buffer: nothing is sent otherwise), ops longer than
//! `slice_bytes` are split into several requests, and requests are cut into *groups* (at most
//! `group_bytes` / `group_requests`). Groups go through one bounded queue per session; each
//! connection's writer thread takes the next group, checks that its batch has not failed,
//! waits for room in its in-flight budget, and sends headers and payloads (straight from
//! registered memory) with vectored writes. Under protocol v2 each request is answered by a
//! status frame; under v1 the group ends with a one-byte READ whose reply is the fence. A
//! reader thread per connection consumes those replies concurrently with the writer.
//!
//! A reject frame, a frame without the magic, EOF, a socket error or no progress for
//! `status_timeout` fails that connection and every group pipelined on it, and only those. A
//! batch resolves once every one of its groups is acknowledged, cancelled before it was sent,
//! or was on a connection that has been shut down: when its future returns, nothing of the
//! batch can still be sent.

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::error::{RejectReason, TransportError};
use crate::mem::{self, IoPart, RegionTable, Span};
use crate::mooncake::MooncakeConfig;
use crate::mooncake::descriptor::MooncakeDescriptor;
use crate::mooncake::handshake::{self, LEN_PREFIX, RequestType};
use crate::mooncake::wire::{HEADER_LEN, Header, STATUS_ADDR_REJECTED, STATUS_LEN, Status};
use crate::mooncake::{split_session_id, unbracket};
use crate::segment::SegmentDescriptor;
use crate::transport::{BatchReport, BoxFuture, Session};

/// Bytes of the v1 fence READ.
const FENCE_LEN: u64 = 1;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn wrong(peer: &str, detail: impl Into<String>) -> TransportError {
    TransportError::WrongProtocol {
        peer: peer.to_owned(),
        expected: "mooncake handshake",
        detail: detail.into(),
    }
}

fn client_error(e: TransportError) -> TransportError {
    metrics::counter!("kvx_mooncake_handshake_errors_total", "side" => "client",
        "cause" => e.label())
    .increment(1);
    tracing::warn!(error = %e, "mooncake handshake failed");
    e
}

/// One request/reply on a handshake port; returns the reply's JSON.
async fn exchange(peer: &str, kind: RequestType, json: &[u8]) -> Result<Vec<u8>, TransportError> {
    let unreachable = |detail: String| TransportError::PeerUnreachable {
        peer: peer.to_owned(),
        detail,
    };
    let (host, port) = split_session_id(peer).map_err(unreachable)?;
    let mut s = TcpStream::connect((unbracket(&host), port))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let _ = s.set_nodelay(true);
    s.write_all(&handshake::encode_frame(Some(kind), json))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let mut prefix = [0u8; LEN_PREFIX];
    let mut have = 0;
    while have < LEN_PREFIX {
        match s.read(&mut prefix[have..]).await {
            Ok(0) if have == 0 => return Err(wrong(peer, "closed without a reply")),
            Ok(0) => return Err(wrong(peer, format!("reply ended after {have} bytes"))),
            Ok(n) => have += n,
            Err(e) if have == 0 => return Err(wrong(peer, format!("no reply: {e}"))),
            Err(e) => return Err(wrong(peer, format!("reply broken: {e}"))),
        }
    }
    if &prefix[..4] == crate::tcp::wire::MAGIC.as_slice() {
        return Err(wrong(peer, "the port speaks kvx's tcp backend"));
    }
    let len = handshake::body_len(&prefix).map_err(|e| wrong(peer, e.to_string()))?;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)
        .await
        .map_err(|e| wrong(peer, format!("reply truncated: {e}")))?;
    drop(s);
    let json = handshake::parse_reply(&body, kind).map_err(|e| wrong(peer, e.to_string()))?;
    Ok(json.to_vec())
}

async fn bounded<T>(
    peer: &str,
    timeout: Duration,
    f: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    tokio::time::timeout(timeout, f)
        .await
        .map_err(|_| TransportError::Timeout {
            peer: peer.to_owned(),
            after_ms: timeout.as_millis() as u64,
        })?
        .map_err(client_error)
}

/// Asks the target at `peer` (its session id, `host:rpc_port`) for its segment descriptor: one
/// Metadata request on the handshake port, one reply frame, connection closed at once. Bounded
/// by `timeout`. A port that answers with something other than a Mooncake frame echoing type 1
/// (closes, resets, sends a kvx tcp hello, an oversized or empty frame) gives
/// [`TransportError::WrongProtocol`]; a Mooncake reply with an unusable descriptor (bad JSON,
/// missing fields, a protocol other than `"tcp"`) gives [`TransportError::Handshake`].
pub async fn fetch_descriptor(
    peer: &str,
    timeout: Duration,
) -> Result<MooncakeDescriptor, TransportError> {
    bounded(peer, timeout, async {
        // At least 16 bytes in all, so that a kvx tcp server reads a whole hello, sees the bad
        // magic and closes at once instead of waiting for more.
        let json = exchange(peer, RequestType::Metadata, b"{\"name\":\"kvx\"}\n").await?;
        MooncakeDescriptor::parse(&json).map_err(|e| TransportError::Handshake {
            peer: peer.to_owned(),
            detail: format!("descriptor refused: {e}"),
        })
    })
    .await
}

/// Sends a Probe (type 3) to the target at `peer`; `Ok` when it answers `"success"`.
pub async fn probe(peer: &str, timeout: Duration) -> Result<(), TransportError> {
    bounded(peer, timeout, async {
        let json = exchange(peer, RequestType::Probe, b"{}\n").await?;
        let v: serde_json::Value =
            serde_json::from_slice(&json).map_err(|e| TransportError::Handshake {
                peer: peer.to_owned(),
                detail: format!("probe reply: {e}"),
            })?;
        match v.get("status").and_then(|s| s.as_str()) {
            Some("success") => Ok(()),
            _ => Err(TransportError::Handshake {
                peer: peer.to_owned(),
                detail: format!("probe answered {v}"),
            }),
        }
    })
    .await
}

/// One batch's completion state, shared by its groups.
struct BatchState {
    left: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<TransportError>>,
    done: Mutex<Option<oneshot::Sender<()>>>,
}

impl BatchState {
    fn fail(&self, e: TransportError) {
        lock(&self.error).get_or_insert(e);
        self.failed.store(true, Ordering::Release);
    }

    fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn finish_one(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1
            && let Some(tx) = lock(&self.done).take()
        {
            let _ = tx.send(());
        }
    }
}

/// Marks a batch failed if its future is dropped before it resolved (queued groups are then
/// cancelled instead of sent).
struct CancelOnDrop(Option<Arc<BatchState>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            b.fail(TransportError::Closed);
        }
    }
}

/// One request: a checked source span and its destination.
struct Req {
    src: Span,
    dst: u64,
}

/// Requests sent as one vectored stream; finishes exactly once (acked, failed or dropped).
struct Group {
    batch: Arc<BatchState>,
    reqs: Vec<Req>,
    bytes: u64,
    finished: bool,
}

impl Group {
    fn finish(&mut self, r: Result<(), TransportError>) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        if let Err(e) = r {
            self.batch.fail(e);
        }
        self.batch.finish_one();
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Never sent (cancelled, or no connection left to take it).
        self.finish(Err(TransportError::Closed));
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
struct Conn {
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

impl Conn {
    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
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
type SharedQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<Group>>>;

/// A session to one Mooncake TE target (or a kvx mooncake target).
pub struct MooncakeSession {
    peer: String,
    desc: MooncakeDescriptor,
    remote: SegmentDescriptor,
    local: Arc<RegionTable>,
    conns: Vec<Arc<Conn>>,
    tx: mpsc::Sender<Group>,
    v2: bool,
    cfg: MooncakeConfig,
}

impl MooncakeSession {
    /// Wraps connected data streams into a session and starts their threads.
    pub(crate) fn start(
        peer: String,
        desc: MooncakeDescriptor,
        local: Arc<RegionTable>,
        streams: Vec<std::net::TcpStream>,
        cfg: MooncakeConfig,
    ) -> Self {
        let v2 = desc.is_v2() && !cfg.force_v1;
        let n = streams.len().max(1);
        let (tx, rx) = mpsc::channel(cfg.queue_depth.max(1) * n);
        let queue: SharedQueue = Arc::new(tokio::sync::Mutex::new(rx));
        let name: Arc<str> = Arc::from(peer.as_str());
        let conns = streams
            .into_iter()
            .map(|stream| {
                let c = Arc::new(Conn {
                    peer: name.clone(),
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
                    v2,
                    max_bytes: cfg.max_inflight_bytes.max(1),
                    max_reqs: cfg.max_inflight_requests.max(1),
                });
                let (w, q, back) = (c.clone(), queue.clone(), tx.downgrade());
                let r = c.clone();
                let timeout = cfg.status_timeout;
                let spawned = std::thread::Builder::new()
                    .name("kvx-mc-tx".into())
                    .spawn(move || writer(w, q, back))
                    .and_then(|_| {
                        std::thread::Builder::new()
                            .name("kvx-mc-ack".into())
                            .spawn(move || reader(r, timeout))
                    });
                if let Err(e) = spawned {
                    c.fail_all(TransportError::from(e));
                }
                c
            })
            .collect();
        MooncakeSession {
            peer,
            remote: desc.to_segment(),
            desc,
            local,
            conns,
            tx,
            v2,
            cfg,
        }
    }

    /// The target's descriptor as fetched when the session opened.
    pub fn descriptor(&self) -> &MooncakeDescriptor {
        &self.desc
    }

    /// True when writes are acknowledged (protocol v2); false for the v1 fence path.
    pub fn is_v2(&self) -> bool {
        self.v2
    }

    /// Number of data connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    fn dead_error(conns: &[Arc<Conn>]) -> TransportError {
        conns
            .iter()
            .find_map(|c| {
                lock(&c.cause)
                    .clone()
                    .filter(|e| *e != TransportError::Closed)
            })
            .unwrap_or(TransportError::Closed)
    }

    /// Checks a whole batch and cuts it into groups of requests (nothing is sent on error).
    fn plan(&self, ops: &[TransferOp]) -> Result<Vec<(Vec<Req>, u64)>, TransportError> {
        let slice = self.cfg.slice_bytes.max(1);
        let group_bytes = self.cfg.group_bytes.max(1);
        let group_reqs = self.cfg.group_requests.max(1);
        let mut srcs = Vec::with_capacity(ops.len());
        self.local
            .resolve_many(ops.iter().map(|o| (o.src, o.len)), |s| srcs.push(s))?;
        if let Some(op) = ops.iter().find(|o| self.desc.find(o.dst, o.len).is_none()) {
            return Err(TransportError::RemoteNotRegistered {
                addr: op.dst,
                len: op.len,
            });
        }
        let mut groups = Vec::new();
        let (mut cur, mut cur_bytes) = (Vec::new(), 0u64);
        for (op, src) in ops.iter().zip(srcs) {
            let mut off = 0u64;
            while off < op.len {
                let len = slice.min(op.len - off);
                let s = src.sub(off as usize, len as usize).ok_or(
                    TransportError::LocalNotRegistered {
                        addr: op.src,
                        len: op.len,
                    },
                )?;
                cur.push(Req {
                    src: s,
                    dst: op.dst + off,
                });
                cur_bytes += len;
                off += len;
                if cur_bytes >= group_bytes || cur.len() >= group_reqs {
                    groups.push((std::mem::take(&mut cur), std::mem::take(&mut cur_bytes)));
                }
            }
        }
        if !cur.is_empty() {
            groups.push((cur, cur_bytes));
        }
        Ok(groups)
    }
}

impl Session for MooncakeSession {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn remote(&self) -> &SegmentDescriptor {
        &self.remote
    }

    fn is_alive(&self) -> bool {
        self.conns.iter().all(|c| !c.is_dead())
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
            metrics::counter!("kvx_transport_batches_total", "backend" => "mooncake",
                "result" => match &r { Ok(()) => "ok", Err(e) => e.label() })
            .increment(1);
            if r.is_ok() {
                metrics::counter!("kvx_mooncake_bytes_sent_total").increment(report.bytes);
            }
            r.map(|()| report)
        })
    }
}

/// Queues a planned batch and waits until every group of it is finished.
async fn post(
    planned: Result<Vec<(Vec<Req>, u64)>, TransportError>,
    tx: mpsc::Sender<Group>,
    conns: &[Arc<Conn>],
) -> Result<(), TransportError> {
    let chunks = planned?;
    if chunks.is_empty() {
        return Ok(());
    }
    let (done_tx, done_rx) = oneshot::channel();
    let batch = Arc::new(BatchState {
        left: AtomicUsize::new(chunks.len()),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        done: Mutex::new(Some(done_tx)),
    });
    let mut guard = CancelOnDrop(Some(batch.clone()));
    // Every group exists before the first is queued, so each one finishes exactly once
    // (acknowledged, failed on its connection, or dropped unsent).
    let groups: Vec<Group> = chunks
        .into_iter()
        .map(|(reqs, bytes)| Group {
            batch: batch.clone(),
            reqs,
            bytes,
            finished: false,
        })
        .collect();
    let mut groups = groups.into_iter();
    for g in groups.by_ref() {
        if batch.is_failed() {
            break;
        }
        match tx.reserve().await {
            Ok(permit) if !batch.is_failed() => permit.send(g),
            Ok(_) => break,
            Err(_) => {
                batch.fail(MooncakeSession::dead_error(conns));
                break;
            }
        }
    }
    // Not queued: cancelled here.
    drop(groups);
    let _ = done_rx.await;
    guard.0 = None;
    let e = lock(&batch.error).take();
    match e {
        None => Ok(()),
        Some(TransportError::Closed) => Err(MooncakeSession::dead_error(conns)),
        Some(e) => Err(e),
    }
}

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
        if g.batch.is_failed() {
            continue;
        }
        if !c.wait_room(g.bytes, g.reqs.len()) {
            hand_back(g, &back);
            return;
        }
        if g.batch.is_failed() {
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
        if let Err(g) = c.push(g) {
            hand_back(g, &back);
            return;
        }
        if let Err(e) = mem::writev_all(fd, &parts) {
            c.fail_all(c.lost(e.to_string()));
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
