//! The target side of the mooncake backend: what both servers share (the region table, the
//! names, the limits, [`ServeError`]) and the handshake server (the data server is `data`).
//!
//! The handshake server (tokio) accepts connections concurrently, at most
//! `max_handshake_connections` at a time (a newer connection closes the oldest one still being
//! served — a real request takes one round trip, so a flood of silent peers cannot keep a good
//! one waiting; none of this uses a thread), reads one frame within `handshake_timeout` (its
//! body buffer grows with the bytes that arrive, up to 1 MiB), answers it with the
//! same type (Metadata: this side's descriptor, rebuilt from the region table on every request;
//! Probe, Notify, Connection: Mooncake's fixed replies; an old-protocol frame is a Connection
//! answered without a type byte), shuts its write side down and closes once the peer closes or
//! after a short linger. A malformed request is counted, logged and dropped without a reply.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{AbortHandle, JoinSet};

use crate::conn_limit::ConnLimit;
use crate::mem::RegionTable;
use crate::mooncake::descriptor::{MooncakeBuffer, MooncakeDescriptor, PROTOCOL_TCP};
use crate::mooncake::handshake::{
    self, CONNECTION_REPLY, HandshakeError, LEN_PREFIX, MAX_FRAME_LEN, NOTIFY_REPLY, PROBE_REPLY,
    RequestType,
};

/// How long a handshake connection may stay open after the reply before it is closed.
const HANDSHAKE_LINGER: Duration = Duration::from_secs(1);

/// Why one handshake or data connection was dropped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// The live data connections.
    pub conns: Arc<ConnLimit>,
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
            conns: ConnLimit::new(limits.max_data_connections, "mooncake_data"),
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
        self.conns.count()
    }

    /// Stops taking data connections, shuts every live one down and joins its thread.
    pub fn close_all(&self) {
        self.conns.close_all(true);
        self.table.close_receive();
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
    let max = ctx.limits.max_handshake_connections.max(1);
    let mut tasks = JoinSet::new();
    // Connections being served, oldest first (finished ones are skipped lazily).
    let mut open: VecDeque<AbortHandle> = VecDeque::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok((stream, addr)) => {
                    open.retain(|h| !h.is_finished());
                    if open.len() >= max
                        && let Some(oldest) = open.pop_front()
                    {
                        oldest.abort();
                        metrics::counter!("kvx_mooncake_handshake_errors_total", "side" => "server",
                            "cause" => "evicted").increment(1);
                        tracing::debug!("mooncake handshake limit reached: oldest connection closed");
                    }
                    let ctx = ctx.clone();
                    open.push_back(tasks.spawn(async move {
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
                    }));
                }
                Err(e) => {
                    metrics::counter!("kvx_mooncake_accept_errors_total", "port" => "handshake")
                        .increment(1);
                    tracing::warn!(error = %e, "mooncake handshake accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
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
    // Grown as bytes arrive: a peer that announces 1 MiB and sends nothing costs nothing.
    let mut body = vec![0u8; len.min(16 << 10)];
    let mut have = 0;
    while have < len {
        if have == body.len() {
            body.resize(len.min(have.saturating_mul(2)), 0);
        }
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
