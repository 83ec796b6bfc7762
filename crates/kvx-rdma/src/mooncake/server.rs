//! The target side of the mooncake backend: the handshake server and the data server.
//!
//! The handshake server (tokio) accepts connections concurrently, at most
//! `max_handshake_connections` at a time (the rest wait in the listen backlog), reads one frame
//! within `handshake_timeout`, answers it with the same type (Metadata: this side's descriptor,
//! rebuilt from the region table on every request; Probe, Notify, Connection: Mooncake's fixed
//! replies), shuts its write side down and closes once the peer closes or after a short linger.
//!
//! The data server runs one blocking receive thread per connection (at most
//! `max_data_connections`; beyond that a connection is closed at once). Each request header is
//! checked (non-empty, no overflow, inside one registered region) before a payload byte is read;
//! a WRITE is read with `readv` straight into the region (chained with the next header), a READ
//! is sent from the region with `writev`. A bad header is rejected (v2: reject frame), counted,
//! logged, and its connection closed; nothing else is affected. `close_all` shuts every
//! connection and joins the threads, so none outlives the transport.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;

use crate::mem::{self, IoPart, RecvTarget, RegionTable, Span};
use crate::mooncake::descriptor::{MooncakeBuffer, MooncakeDescriptor, PROTOCOL_TCP};
use crate::mooncake::handshake::{
    self, CONNECTION_REPLY, HandshakeError, LEN_PREFIX, MAX_FRAME_LEN, NOTIFY_REPLY, PROBE_REPLY,
    RequestType,
};
use crate::mooncake::wire::{HEADER_LEN, Header, STATUS_ADDR_REJECTED, Status, WireError};

/// How long a handshake connection may stay open after the reply before it is closed.
const HANDSHAKE_LINGER: Duration = Duration::from_secs(1);
/// How long writing one reply (status frame, READ bytes) may block before the connection drops.
const DATA_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// After a v2 reject: how long the unread body is drained so that the reject frame is not lost
/// to a reset, and how much of it at most.
const REJECT_DRAIN: Duration = Duration::from_millis(200);
const REJECT_DRAIN_BYTES: u64 = 16 << 20;
/// Stack of a receive thread (the loop keeps only a header on its stack).
const RX_STACK: usize = 256 << 10;

/// Why one handshake or data connection was dropped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A malformed handshake frame.
    #[error(transparent)]
    Frame(#[from] HandshakeError),
    /// A request header outside registered memory (or empty, or wrapping).
    #[error("request {addr:#x} (+{size}) rejected: {detail}")]
    Rejected {
        /// The header's address.
        addr: u64,
        /// The header's size.
        size: u64,
        /// Why.
        detail: String,
        /// Metrics label.
        cause: &'static str,
    },
    /// The peer closed inside a header or a payload.
    #[error("connection closed after {got} of {need} bytes of a {what}")]
    Truncated {
        /// `"header"` or `"payload"`.
        what: &'static str,
        /// Bytes received.
        got: u64,
        /// Bytes expected.
        need: u64,
    },
    /// The peer was too slow.
    #[error("timed out")]
    Timeout,
    /// The reply would exceed the 1 MiB frame limit.
    #[error("descriptor of {0} bytes exceeds the frame limit")]
    DescriptorTooLarge(usize),
    /// A socket error.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl ServeError {
    /// A short stable label (metrics).
    pub fn cause(&self) -> &'static str {
        match self {
            ServeError::Frame(e) => e.cause(),
            ServeError::Rejected { cause, .. } => cause,
            ServeError::Truncated { what: "header", .. } => "truncated_header",
            ServeError::Truncated { .. } => "truncated_payload",
            ServeError::Timeout => "timeout",
            ServeError::DescriptorTooLarge(_) => "descriptor_too_large",
            ServeError::Io(_) => "io",
        }
    }
}

/// Limits of the servers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub handshake_timeout: Duration,
    pub max_handshake_connections: usize,
    pub max_data_connections: usize,
    pub socket_buffer: Option<usize>,
}

/// Everything both servers need.
pub(crate) struct ServerCtx {
    pub table: Arc<RegionTable>,
    /// The session id (descriptor `name`, every buffer's `name`).
    pub name: String,
    pub data_host: String,
    pub data_port: u16,
    pub limits: Limits,
    live: Mutex<HashMap<u64, Live>>,
    next_conn: AtomicU64,
    closed: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A live data connection as the server tracks it.
struct Live {
    stream: std::net::TcpStream,
    handle: Option<JoinHandle<()>>,
    slot: Arc<Slot>,
}

/// The memory range a receive thread is reading into or sending from right now.
#[derive(Default)]
struct Slot {
    active: Mutex<Option<(u64, u64)>>,
    idle: Condvar,
}

impl Slot {
    /// Validates `h` and marks its range active, atomically with respect to [`ServerCtx::quiesce`].
    fn enter(&self, table: &RegionTable, h: &Header) -> Result<Span, ServeError> {
        let mut a = lock(&self.active);
        let span = validate(table, h)?;
        *a = Some((span.addr(), span.len() as u64));
        Ok(span)
    }

    fn leave(&self) {
        *lock(&self.active) = None;
        self.idle.notify_all();
    }
}

/// Clears a slot when the request ends, however it ends.
struct Active<'a>(&'a Slot);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

fn overlaps(a: Option<(u64, u64)>, base: u64, len: u64) -> bool {
    a.is_some_and(|(addr, n)| addr < base.saturating_add(len) && base < addr.saturating_add(n))
}

impl ServerCtx {
    pub fn new(
        table: Arc<RegionTable>,
        name: String,
        data_host: String,
        data_port: u16,
        limits: Limits,
    ) -> Self {
        ServerCtx {
            table,
            name,
            data_host,
            data_port,
            limits,
            live: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        }
    }

    /// The descriptor as of now.
    pub fn descriptor(&self) -> MooncakeDescriptor {
        let regions = self.table.descriptor(&self.name).regions;
        MooncakeDescriptor {
            name: self.name.clone(),
            protocol: PROTOCOL_TCP.to_owned(),
            tcp_data_host: Some(self.data_host.clone()),
            tcp_data_port: self.data_port,
            tcp_proto_version: 2,
            buffers: regions
                .iter()
                .map(|r| MooncakeBuffer {
                    name: self.name.clone(),
                    addr: r.base,
                    length: r.len,
                })
                .collect(),
        }
    }

    /// Number of live data connections.
    pub fn data_connections(&self) -> usize {
        lock(&self.live).len()
    }

    /// Called after `[base, base + len)` left the region table: connections reading into or
    /// sending from it right now are shut down, and this returns once none touches it.
    pub fn quiesce(&self, base: u64, len: u64) {
        let busy: Vec<Arc<Slot>> = lock(&self.live)
            .values()
            .filter(|l| overlaps(*lock(&l.slot.active), base, len))
            .map(|l| {
                let _ = l.stream.shutdown(std::net::Shutdown::Both);
                l.slot.clone()
            })
            .collect();
        for slot in busy {
            let mut a = lock(&slot.active);
            while overlaps(*a, base, len) {
                a = slot
                    .idle
                    .wait_timeout(a, Duration::from_millis(50))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        }
    }

    /// Stops taking data connections, shuts every live one down and joins its thread.
    pub fn close_all(&self) {
        let conns: Vec<Live> = {
            let mut live = lock(&self.live);
            self.closed.store(true, Ordering::SeqCst);
            live.drain().map(|(_, v)| v).collect()
        };
        for l in &conns {
            let _ = l.stream.shutdown(std::net::Shutdown::Both);
        }
        for l in conns {
            if let Some(h) = l.handle
                && h.thread().id() != std::thread::current().id()
            {
                let _ = h.join();
            }
        }
    }
}

fn handshake_error(e: &ServeError) {
    metrics::counter!("kvx_mooncake_handshake_errors_total", "side" => "server",
        "cause" => e.cause())
    .increment(1);
}

/// Accepts handshake connections until `stop` fires (or the task is aborted).
pub(crate) async fn handshake_loop(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    mut stop: oneshot::Receiver<()>,
) {
    let permits = Arc::new(Semaphore::new(ctx.limits.max_handshake_connections.max(1)));
    let mut tasks = JoinSet::new();
    loop {
        let accept = async {
            let permit = permits.clone().acquire_owned().await;
            (permit, listener.accept().await)
        };
        tokio::select! {
            _ = &mut stop => break,
            (permit, r) = accept => match (permit, r) {
                (Ok(permit), Ok((stream, addr))) => {
                    let ctx = ctx.clone();
                    tasks.spawn(async move {
                        let _permit = permit;
                        match serve_handshake(stream, &ctx).await {
                            Ok(kind) => {
                                metrics::counter!("kvx_mooncake_handshake_requests_total",
                                    "type" => kind.as_str()).increment(1);
                                tracing::debug!(%addr, kind = kind.as_str(), "mooncake handshake");
                            }
                            Err(e) => {
                                handshake_error(&e);
                                tracing::warn!(%addr, error = %e, "mooncake handshake dropped");
                            }
                        }
                    });
                }
                (_, Err(e)) => {
                    metrics::counter!("kvx_mooncake_accept_errors_total", "port" => "handshake")
                        .increment(1);
                    tracing::warn!(error = %e, "mooncake handshake accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                (Err(_), Ok(_)) => break,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    tasks.shutdown().await;
}

async fn read_request(
    stream: &mut TcpStream,
) -> Result<(Option<RequestType>, Vec<u8>), ServeError> {
    let mut prefix = [0u8; LEN_PREFIX];
    let mut have = 0;
    while have < LEN_PREFIX {
        let n = stream.read(&mut prefix[have..]).await?;
        if n == 0 {
            return Err(HandshakeError::Truncated {
                need: LEN_PREFIX as u64,
                have: have as u64,
            }
            .into());
        }
        have += n;
    }
    let len = handshake::body_len(&prefix)?;
    let mut body = vec![0u8; len];
    let mut have = 0;
    while have < len {
        let n = stream.read(&mut body[have..]).await?;
        if n == 0 {
            return Err(HandshakeError::Truncated {
                need: (LEN_PREFIX + len) as u64,
                have: (LEN_PREFIX + have) as u64,
            }
            .into());
        }
        have += n;
    }
    let frame = handshake::parse_body(&body)?;
    handshake::check_json(frame.json)?;
    Ok((frame.kind, body))
}

/// One handshake connection: one request, one reply, then close.
async fn serve_handshake(
    mut stream: TcpStream,
    ctx: &ServerCtx,
) -> Result<RequestType, ServeError> {
    let _ = stream.set_nodelay(true);
    let timeout = ctx.limits.handshake_timeout;
    let (kind, _body) = tokio::time::timeout(timeout, read_request(&mut stream))
        .await
        .map_err(|_| ServeError::Timeout)??;
    let handled = kind.unwrap_or(RequestType::Connection);
    let json = match handled {
        RequestType::Metadata => ctx.descriptor().to_json(),
        RequestType::Probe => PROBE_REPLY.to_owned(),
        RequestType::Notify => NOTIFY_REPLY.to_owned(),
        RequestType::Connection => CONNECTION_REPLY.to_owned(),
    };
    if json.len() as u64 + 1 > MAX_FRAME_LEN {
        return Err(ServeError::DescriptorTooLarge(json.len()));
    }
    let reply = handshake::encode_frame(kind, json.as_bytes());
    tokio::time::timeout(timeout, stream.write_all(&reply))
        .await
        .map_err(|_| ServeError::Timeout)??;
    let _ = stream.shutdown().await;
    // Wait (briefly) for the peer to close; whatever it still sends is dropped.
    let mut sink = [0u8; 512];
    let _ = tokio::time::timeout(HANDSHAKE_LINGER, async {
        while let Ok(n) = stream.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    Ok(handled)
}

/// Accepts data connections until `stop` fires; each gets its own receive thread.
pub(crate) async fn data_loop(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok((stream, addr)) => {
                    if let Err(e) = start_data_conn(stream, &ctx) {
                        metrics::counter!("kvx_mooncake_data_conn_errors_total",
                            "cause" => "refused").increment(1);
                        tracing::warn!(%addr, error = %e, "mooncake data connection refused");
                    }
                }
                Err(e) => {
                    metrics::counter!("kvx_mooncake_accept_errors_total", "port" => "data")
                        .increment(1);
                    tracing::warn!(error = %e, "mooncake data accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
}

fn start_data_conn(stream: TcpStream, ctx: &Arc<ServerCtx>) -> io::Result<()> {
    let _ = stream.set_nodelay(true);
    if let Some(n) = ctx.limits.socket_buffer {
        let sock = socket2::SockRef::from(&stream);
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(DATA_WRITE_TIMEOUT))?;
    let mut live = lock(&ctx.live);
    if ctx.closed.load(Ordering::SeqCst) {
        return Err(io::Error::other("transport closed"));
    }
    if live.len() >= ctx.limits.max_data_connections.max(1) {
        return Err(io::Error::other(format!(
            "{} data connections already open",
            live.len()
        )));
    }
    let id = ctx.next_conn.fetch_add(1, Ordering::Relaxed);
    let clone = stream.try_clone()?;
    let slot = Arc::new(Slot::default());
    let slot2 = slot.clone();
    let ctx2 = ctx.clone();
    let handle = std::thread::Builder::new()
        .name("kvx-mc-rx".into())
        .stack_size(RX_STACK)
        .spawn(move || {
            let peer = stream.peer_addr().ok();
            match receive(&stream, &ctx2, &slot2) {
                Ok(bytes) => tracing::debug!(?peer, bytes, "mooncake data connection closed"),
                Err(e) => {
                    metrics::counter!("kvx_mooncake_data_conn_errors_total", "cause" => e.cause())
                        .increment(1);
                    tracing::warn!(?peer, error = %e, "mooncake data connection dropped");
                }
            }
            let _ = stream.shutdown(std::net::Shutdown::Both);
            lock(&ctx2.live).remove(&id);
        })?;
    live.insert(
        id,
        Live {
            stream: clone,
            handle: Some(handle),
            slot,
        },
    );
    Ok(())
}

fn retry<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

fn write_all(stream: &std::net::TcpStream, parts: &[IoPart<'_>]) -> io::Result<u64> {
    mem::writev_all(stream.as_raw_fd(), parts)
}

/// Checks a header: non-empty, no overflow, inside one registered region.
fn validate(table: &RegionTable, h: &Header) -> Result<Span, ServeError> {
    let rejected = |detail: String, cause| ServeError::Rejected {
        addr: h.addr,
        size: h.size,
        detail,
        cause,
    };
    h.check()
        .map_err(|e: WireError| rejected(e.to_string(), e.cause()))?;
    table
        .resolve(h.addr, h.size)
        .map_err(|_| rejected("not within any registered buffer".into(), "not_registered"))
}

/// After a v2 reject: send the frame, stop writing, and drain what the peer still sends (for a
/// short while) so that the frame reaches it before the close.
fn reject_v2(stream: &std::net::TcpStream) {
    let frame = Status::Rejected(STATUS_ADDR_REJECTED).encode();
    if write_all(stream, &[IoPart::Bytes(&frame)]).is_err() {
        return;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(REJECT_DRAIN));
    let deadline = std::time::Instant::now() + REJECT_DRAIN;
    let mut sink = [0u8; 16 << 10];
    let mut drained = 0u64;
    while drained < REJECT_DRAIN_BYTES && std::time::Instant::now() < deadline {
        match (&*stream).read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n as u64,
        }
    }
}

/// The receive loop of one data connection (blocking). Returns the bytes written into memory.
fn receive(stream: &std::net::TcpStream, ctx: &ServerCtx, slot: &Slot) -> Result<u64, ServeError> {
    let fd = stream.as_raw_fd();
    let mut hdr = [0u8; HEADER_LEN];
    let mut have = 0usize;
    let mut total = 0u64;
    loop {
        while have < HEADER_LEN {
            let n = retry(|| mem::readv_targets(fd, &[], 0, &mut [], &mut hdr[have..]))?;
            if n == 0 {
                if have == 0 {
                    return Ok(total);
                }
                return Err(ServeError::Truncated {
                    what: "header",
                    got: have as u64,
                    need: HEADER_LEN as u64,
                });
            }
            have += n;
        }
        have = 0;
        let h = Header::decode(&hdr);
        let span = match slot.enter(&ctx.table, &h) {
            Ok(s) => s,
            Err(e) => {
                metrics::counter!("kvx_mooncake_rejects_total", "cause" => e.cause()).increment(1);
                if h.is_v2() {
                    reject_v2(stream);
                }
                return Err(e);
            }
        };
        let _active = Active(slot);
        if h.is_write() {
            // Payload straight into the region; the same readv takes the next header's bytes.
            let target = [RecvTarget::Mem(span)];
            let mut off = 0usize;
            while off < span.len() {
                let n = retry(|| mem::readv_targets(fd, &target, off, &mut [], &mut hdr))?;
                if n == 0 {
                    metrics::counter!("kvx_mooncake_bytes_received_total").increment(off as u64);
                    return Err(ServeError::Truncated {
                        what: "payload",
                        got: off as u64,
                        need: h.size,
                    });
                }
                let k = n.min(span.len() - off);
                off += k;
                have = n - k;
            }
            total += h.size;
            metrics::counter!("kvx_mooncake_bytes_received_total").increment(h.size);
            if h.is_v2() {
                write_all(stream, &[IoPart::Bytes(&Status::Ok.encode())])?;
            }
        } else {
            let ok = Status::Ok.encode();
            let mut parts = Vec::with_capacity(2);
            if h.is_v2() {
                parts.push(IoPart::Bytes(&ok));
            }
            parts.push(IoPart::Span(span));
            write_all(stream, &parts)?;
            metrics::counter!("kvx_mooncake_bytes_sent_total").increment(h.size);
        }
    }
}
