//! The data server of the mooncake target: one blocking receive thread per connection.
//!
//! At most `max_data_connections` connections are served (`crate::conn_limit`); a connection beyond
//! that closes an idle one (first one that never sent a request — a silent peer —, else the
//! longest idle) or, when every one is inside a request, is closed at once. Each request header
//! is checked (non-empty, no overflow, inside one registered region) before a payload byte is
//! read; a WRITE is read with `readv` straight into the region (the same call takes the next
//! header's bytes), a READ is sent from the region with `writev`; v1 and v2 requests may share
//! a connection. A bad header is rejected (v2: the reject frame, then the connection is closed;
//! v1: just closed), counted and logged; nothing else is affected. A request leases its region
//! from the table ([`crate::mem::Receiver`]) until it ends, so a deregistration shuts down a
//! connection using the region and waits until it is done; [`ConnLimit::close_all`] shuts every
//! connection and joins its thread, so none outlives the transport.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::conn_limit::{Refused, Slot};
use crate::mem::{self, IoPart, Receiver, RecvTarget, RegionTable, Span};
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
                    let admitted = tokio::select! {
                        _ = &mut stop => break,
                        p = ctx.conns.admit(ctx.limits.handshake_timeout) => p,
                    };
                    let started = admitted
                        .map_err(io::Error::other)
                        .and_then(|permit| start_data_conn(stream, &ctx, permit));
                    if let Err(e) = started {
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

fn start_data_conn(
    stream: TcpStream,
    ctx: &Arc<ServerCtx>,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> io::Result<()> {
    let _ = stream.set_nodelay(true);
    if let Some(n) = ctx.limits.socket_buffer {
        let sock = socket2::SockRef::from(&stream);
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(DATA_WRITE_TIMEOUT))?;
    let slot = ctx
        .conns
        .register(permit, stream.try_clone()?)
        .map_err(|e: Refused| io::Error::other(e.to_string()))?;
    let rx = ctx.table.receiver(slot.conn().clone());
    let conn = slot.conn().clone();
    let ctx2 = ctx.clone();
    let handle = std::thread::Builder::new()
        .name("kvx-mc-rx".into())
        .stack_size(RX_STACK)
        .spawn(move || {
            let peer = stream.peer_addr().ok();
            match receive(&stream, &ctx2, &slot, &rx) {
                Ok(bytes) => tracing::debug!(?peer, bytes, "mooncake data connection closed"),
                Err(e) if slot.conn().stopped() => {
                    tracing::debug!(?peer, error = %e, "mooncake data connection stopped")
                }
                Err(e) => {
                    metrics::counter!("kvx_mooncake_data_conn_errors_total", "cause" => e.cause())
                        .increment(1);
                    tracing::warn!(?peer, error = %e, "mooncake data connection dropped");
                }
            }
            let _ = stream.shutdown(std::net::Shutdown::Both);
            drop(rx);
            drop(slot);
        })?;
    conn.set_handle(handle);
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

/// Checks a header: non-empty, no overflow, inside one registered region (leased by `rx`).
fn validate(table: &RegionTable, rx: &Receiver, h: &Header) -> Result<Span, ServeError> {
    let rejected = |detail: String, cause| ServeError::Rejected {
        addr: h.addr,
        size: h.size,
        detail,
        cause,
    };
    h.check()
        .map_err(|e: WireError| rejected(e.to_string(), e.cause()))?;
    table
        .lease_range(rx, h.addr, h.size)
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
fn receive(
    stream: &std::net::TcpStream,
    ctx: &ServerCtx,
    slot: &Slot,
    rx: &Receiver,
) -> Result<u64, ServeError> {
    let fd = stream.as_raw_fd();
    let conn = slot.conn();
    let stopped = || {
        ServeError::Io(io::Error::new(
            io::ErrorKind::Interrupted,
            "connection stopped",
        ))
    };
    let mut hdr = [0u8; HEADER_LEN];
    let mut have = 0usize;
    let mut total = 0u64;
    loop {
        // Leases end with the request that took them.
        rx.release();
        if have == 0 {
            conn.idle(slot.limit().tick());
        }
        while have < HEADER_LEN {
            let n = retry(|| mem::readv_targets(fd, &[], 0, &mut [], &mut hdr[have..]))?;
            if conn.stopped() {
                return Err(stopped());
            }
            conn.busy();
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
        let span = match validate(&ctx.table, rx, &h) {
            Ok(s) => s,
            Err(e) => {
                metrics::counter!("kvx_mooncake_rejects_total", "cause" => e.cause()).increment(1);
                if h.is_v2() {
                    reject_v2(stream);
                }
                return Err(e);
            }
        };
        if h.is_write() {
            // Payload straight into the region; the same readv takes the next header's bytes.
            let target = [RecvTarget::Mem(span)];
            let mut off = 0usize;
            while off < span.len() {
                let n = retry(|| mem::readv_targets(fd, &target, off, &mut [], &mut hdr))?;
                if conn.stopped() {
                    return Err(stopped());
                }
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
            ctx.table.note_received(h.size);
            if h.is_v2() {
                write_all(stream, &[IoPart::Bytes(&Status::Ok.encode())])?;
                // The status right after each write would otherwise delay the TCP ACKs the
                // initiator waits on (`mem::quick_acks`).
                mem::quick_acks(stream);
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
