//! The receiving (decode) side of the tcp backend: accept, handshake, and apply writes.
//!
//! Every write header is checked against the region table (key, bounds, length) before a single
//! payload byte is read; accepted payloads are read with `readv` straight into the destination
//! region, chained with the next header so a stream of small writes costs one syscall each.
//! Rejected writes of acceptable length are drained into a small scratch buffer (nothing is
//! written to registered memory) and reported in the next acknowledgement; an oversized length
//! or a malformed header is reported and the connection closed (the stream cannot be resynced).
//! A connection's failure never affects the listener or other connections.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::error::RejectReason;
use crate::mem::{self, RegionTable, Span};
use crate::segment::SegmentDescriptor;
use crate::tcp::io::{read_full, write_all};
use crate::tcp::wire::{
    Ack, ClientFrame, HEADER_LEN, HELLO_BAD_VERSION, HELLO_LEN, HELLO_OK, Hello, VERSION,
};

/// What the accept loop needs.
pub(crate) struct ServerCtx {
    pub table: Arc<RegionTable>,
    pub endpoint: String,
    pub max_write_len: u32,
    pub handshake_timeout: Duration,
}

/// Accepts connections until `stop` fires (or the task is aborted); then closes every inbound
/// connection and waits for their tasks to end.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => {
                drop(listener);
                conns.shutdown().await;
                return;
            }
            r = listener.accept() => match r {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    let ctx = ctx.clone();
                    conns.spawn(async move {
                        match serve(stream, &ctx).await {
                            Ok(()) => tracing::debug!(%addr, "tcp transport connection closed"),
                            Err(e) => {
                                metrics::counter!("kvx_tcp_server_conn_errors_total").increment(1);
                                tracing::warn!(%addr, error = %e, "tcp transport connection failed");
                            }
                        }
                    });
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

async fn handshake(stream: &TcpStream, ctx: &ServerCtx) -> io::Result<bool> {
    let mut fixed = [0u8; HELLO_LEN];
    read_full(stream, &mut fixed).await?;
    let hello = Hello::decode(&fixed).map_err(|e| proto_err(e.to_string()))?;
    let mut desc = vec![0u8; hello.desc_len as usize];
    read_full(stream, &mut desc).await?;
    if !desc.is_empty() {
        SegmentDescriptor::decode(&desc).map_err(|e| proto_err(e.to_string()))?;
    }
    let ok = hello.version >= VERSION;
    let mine = if ok {
        ctx.table.descriptor(&ctx.endpoint).encode()
    } else {
        Vec::new()
    };
    let reply = Hello {
        version: VERSION,
        status: if ok { HELLO_OK } else { HELLO_BAD_VERSION },
        param: ctx.max_write_len,
        desc_len: mine.len() as u32,
    };
    let mut out = reply.encode().to_vec();
    out.extend_from_slice(&mine);
    write_all(stream, &out).await?;
    Ok(ok)
}

/// What the receive loop is doing with the bytes after the current header.
enum Payload {
    None,
    Into { span: Span, done: usize },
    Drain { left: u64 },
}

/// Counters since the previous fence.
#[derive(Default)]
struct Window {
    bytes: u64,
    rejected: u32,
    first: Option<(RejectReason, u64)>,
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

    fn ack(&mut self, tag: u64) -> Ack {
        let w = std::mem::take(self);
        Ack {
            tag,
            status: w.first.map(|f| f.0),
            rejected: w.rejected,
            first_rejected_addr: w.first.map_or(0, |f| f.1),
            bytes: w.bytes,
        }
    }
}

async fn serve(stream: TcpStream, ctx: &ServerCtx) -> io::Result<()> {
    match tokio::time::timeout(ctx.handshake_timeout, handshake(&stream, ctx)).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return Ok(()),
        Ok(Err(e)) => {
            metrics::counter!("kvx_tcp_handshake_errors_total").increment(1);
            return Err(e);
        }
        Err(_) => {
            metrics::counter!("kvx_tcp_handshake_errors_total").increment(1);
            return Err(io::ErrorKind::TimedOut.into());
        }
    }
    let fd = stream.as_raw_fd();
    let mut hdr = [0u8; HEADER_LEN];
    let mut have = 0usize;
    let mut payload = Payload::None;
    let mut win = Window::default();
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        // One read: payload (into registered memory or the drain buffer), then header bytes.
        let n = match &payload {
            Payload::Into { span, done } => {
                let (span, done) = (*span, *done);
                let tail = &mut hdr[have..];
                read_some(&stream, || mem::readv_into(fd, Some((span, done)), tail)).await?
            }
            Payload::Drain { left } => {
                let take = (*left).min(scratch.len() as u64) as usize;
                let buf = &mut scratch[..take];
                read_some(&stream, || {
                    // Draining a rejected write: bytes go to scratch, never to registered memory.
                    mem::readv_into(fd, None, buf)
                })
                .await?
            }
            Payload::None => {
                let tail = &mut hdr[have..];
                read_some(&stream, || mem::readv_into(fd, None, tail)).await?
            }
        };
        if n == 0 {
            if have == 0 && matches!(payload, Payload::None) {
                return Ok(());
            }
            metrics::counter!("kvx_tcp_truncated_frames_total").increment(1);
            return Err(proto_err("connection closed inside a frame"));
        }
        let mut n = n;
        match &mut payload {
            Payload::Into { span, done } => {
                let k = n.min(span.len() - *done);
                *done += k;
                win.bytes += k as u64;
                n -= k;
                have += n;
                if *done == span.len() {
                    payload = Payload::None;
                }
            }
            Payload::Drain { left } => {
                *left -= n as u64;
                if *left == 0 {
                    payload = Payload::None;
                }
                continue;
            }
            Payload::None => have += n,
        }
        if have < HEADER_LEN {
            continue;
        }
        have = 0;
        let frame = match ClientFrame::decode(&hdr) {
            Ok(f) => f,
            Err(reason) => {
                win.reject(reason, 0);
                let _ = write_all(&stream, &win.ack(u64::MAX).encode()).await;
                return Err(proto_err("malformed frame header"));
            }
        };
        match frame {
            ClientFrame::Write { key, addr, len, .. } => {
                if len > u64::from(ctx.max_write_len) {
                    win.reject(RejectReason::TooLong, addr);
                    let _ = write_all(&stream, &win.ack(u64::MAX).encode()).await;
                    return Err(proto_err(format!("write of {len} bytes exceeds the limit")));
                }
                match ctx.table.check_keyed(key, addr, len) {
                    Ok(span) if span.is_empty() => {}
                    Ok(span) => payload = Payload::Into { span, done: 0 },
                    Err(reason) => {
                        tracing::warn!(%key, addr, len, %reason, "rejected write");
                        win.reject(reason, addr);
                        if len > 0 {
                            payload = Payload::Drain { left: len };
                        }
                    }
                }
            }
            ClientFrame::Fence { tag } => {
                let ack = win.ack(tag);
                metrics::counter!("kvx_tcp_bytes_received_total").increment(ack.bytes);
                write_all(&stream, &ack.encode()).await?;
            }
        }
    }
}

/// Runs `f` when the socket is readable until it stops returning `WouldBlock`.
async fn read_some(
    stream: &TcpStream,
    mut f: impl FnMut() -> io::Result<usize>,
) -> io::Result<usize> {
    loop {
        match stream.try_io(Interest::READABLE, &mut f) {
            Ok(n) => {
                // A busy connection must still yield now and then (fairness, prompt shutdown).
                tokio::task::consume_budget().await;
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => stream.readable().await?,
            Err(e) => return Err(e),
        }
    }
}
