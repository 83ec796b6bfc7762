//! The data server of the mooncake target: one blocking receive thread per connection.
//!
//! At most `max_data_connections` connections are served; beyond that a connection is closed
//! at once. Each request header is checked (non-empty, no overflow, inside one registered
//! region) before a payload byte is read; a WRITE is read with `readv` straight into the region
//! (the same call takes the next header's bytes), a READ is sent from the region with
//! `writev`; v1 and v2 requests may share a connection. A bad header is rejected (v2: the
//! reject frame, then the connection is closed; v1: just closed), counted and logged; nothing
//! else is affected. The range a thread is using is recorded, so that a deregistration can wait
//! until no thread touches the region ([`Conns::quiesce`]); [`Conns::close_all`] shuts every
//! connection and joins its thread, so none outlives the transport.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::mem::{self, IoPart, RecvTarget, RegionTable, Span};
use crate::mooncake::server::{ServeError, ServerCtx};
use crate::mooncake::wire::{HEADER_LEN, Header, STATUS_ADDR_REJECTED, Status, WireError};

/// How long writing one reply (status frame, READ bytes) may block before the connection drops.
const DATA_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// After a v2 reject: how long the unread body is drained so that the reject frame is not lost
/// to a reset, and how much of it at most.
const REJECT_DRAIN: Duration = Duration::from_millis(200);
const REJECT_DRAIN_BYTES: u64 = 16 << 20;
/// Stack of a receive thread (the loop keeps only a header on its stack).
const RX_STACK: usize = 256 << 10;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The live data connections of a target.
#[derive(Default)]
pub(crate) struct Conns {
    live: Mutex<HashMap<u64, Live>>,
    next: AtomicU64,
    closed: AtomicBool,
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
    /// Validates `h` and marks its range active, atomically with respect to
    /// [`Conns::quiesce`].
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

impl Conns {
    /// Number of live data connections.
    pub fn count(&self) -> usize {
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
    let mut live = lock(&ctx.conns.live);
    if ctx.conns.closed.load(Ordering::SeqCst) {
        return Err(io::Error::other("transport closed"));
    }
    if live.len() >= ctx.limits.max_data_connections.max(1) {
        return Err(io::Error::other(format!(
            "{} data connections already open",
            live.len()
        )));
    }
    let id = ctx.conns.next.fetch_add(1, Ordering::Relaxed);
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
            lock(&ctx2.conns.live).remove(&id);
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
