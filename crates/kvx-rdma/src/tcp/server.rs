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
use crate::mem::{self, RecvTarget, RegionTable};
use crate::segment::SegmentDescriptor;
use crate::tcp::io::{read_full, write_all};
use crate::tcp::wire::{
    Ack, ClientFrame, ENTRY_LEN, Entry, HEADER_LEN, HELLO_BAD_VERSION, HELLO_LEN, HELLO_OK, Hello,
    VERSION,
};

/// What the accept loop needs.
pub(crate) struct ServerCtx {
    pub table: Arc<RegionTable>,
    pub endpoint: String,
    pub max_write_len: u32,
    pub handshake_timeout: Duration,
    pub socket_buffer: Option<usize>,
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
                    if let Some(n) = ctx.socket_buffer {
                        let sock = socket2::SockRef::from(&stream);
                        let _ = sock.set_send_buffer_size(n);
                        let _ = sock.set_recv_buffer_size(n);
                    }
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
    let mut state = State::Header;
    let mut win = Window::default();
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        // One read: payload (into registered memory, or scratch for rejected writes), then as
        // much of the next header as is there.
        let n = match &mut state {
            State::Header => {
                let tail = &mut hdr[have..];
                read_some(&stream, || mem::readv_targets(fd, &[], 0, &mut [], tail)).await?
            }
            State::Entries { buf, have: got } => {
                let tail = &mut buf[*got..];
                read_some(&stream, || mem::readv_targets(fd, &[], 0, &mut [], tail)).await?
            }
            State::Payload { targets, idx, off } => {
                let (t, o) = (&targets[*idx..], *off);
                let tail = &mut hdr[have..];
                let scratch = &mut scratch[..];
                read_some(&stream, || mem::readv_targets(fd, t, o, scratch, tail)).await?
            }
        };
        if n == 0 {
            if have == 0 && matches!(state, State::Header) {
                return Ok(());
            }
            metrics::counter!("kvx_tcp_truncated_frames_total").increment(1);
            return Err(proto_err("connection closed inside a frame"));
        }
        let mut n = n;
        match &mut state {
            State::Header => have += n,
            State::Entries { buf, have: got } => {
                *got += n;
                if *got == buf.len() {
                    let buf = std::mem::take(buf);
                    state = match entries_to_payload(&buf, ctx, &mut win) {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = write_all(&stream, &win.ack(u64::MAX).encode()).await;
                            return Err(e);
                        }
                    };
                    if let State::Payload { targets, idx, .. } = &state
                        && *idx >= targets.len()
                    {
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
                state = State::Header;
            }
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
                let t = check_write(ctx, &mut win, Entry { key, addr, len });
                match t {
                    Some(t) if !t.is_empty() => {
                        state = State::Payload {
                            targets: vec![t],
                            idx: 0,
                            off: 0,
                        }
                    }
                    Some(_) => {}
                    None => {
                        let _ = write_all(&stream, &win.ack(u64::MAX).encode()).await;
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
                write_all(&stream, &ack.encode()).await?;
            }
        }
    }
}

/// Checks one write: `Some(Mem)` to receive it, `Some(Discard)` when rejected (its payload is
/// drained), `None` when its length is above the limit (the connection must close).
fn check_write(ctx: &ServerCtx, win: &mut Window, e: Entry) -> Option<RecvTarget> {
    if e.len > u64::from(ctx.max_write_len) {
        win.reject(RejectReason::TooLong, e.addr);
        return None;
    }
    match ctx.table.check_keyed(e.key, e.addr, e.len) {
        Ok(span) => Some(RecvTarget::Mem(span)),
        Err(reason) => {
            tracing::warn!(key = %e.key, addr = e.addr, len = e.len, %reason, "rejected write");
            win.reject(reason, e.addr);
            Some(RecvTarget::Discard(e.len))
        }
    }
}

/// Turns the entries of a vectored write into receive targets (checked before any payload
/// byte is read).
fn entries_to_payload(buf: &[u8], ctx: &ServerCtx, win: &mut Window) -> io::Result<State> {
    let mut targets = Vec::with_capacity(buf.len() / ENTRY_LEN);
    for raw in buf.chunks_exact(ENTRY_LEN) {
        let e = match Entry::decode(raw) {
            Ok(e) => e,
            Err(reason) => {
                win.reject(reason, 0);
                return Err(proto_err("malformed vectored-write entry"));
            }
        };
        match check_write(ctx, win, e) {
            Some(t) => targets.push(t),
            None => {
                return Err(proto_err(format!(
                    "write of {} bytes exceeds the limit",
                    e.len
                )));
            }
        }
    }
    let idx = targets.iter().take_while(|t| t.is_empty()).count();
    Ok(State::Payload {
        targets,
        idx,
        off: 0,
    })
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
