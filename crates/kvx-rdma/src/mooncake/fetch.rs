//! The metadata exchange on a target's handshake port, as an initiator: [`fetch_descriptor`]
//! (type 1, what a session starts with, and what `--backend auto` uses to tell a Mooncake
//! handshake port from anything else) and [`probe`] (type 3). One connection per request, one
//! reply frame read, closed at once; bounded by a timeout; typed errors.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::TransportError;
use crate::mooncake::descriptor::MooncakeDescriptor;
use crate::mooncake::handshake::{self, LEN_PREFIX, RequestType};
use crate::mooncake::{split_session_id, unbracket};

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
    if matches!(e, TransportError::WrongProtocol { .. }) {
        // Expected where `--backend auto` asks a kvx decode's port.
        tracing::debug!(error = %e, "not a Mooncake TE handshake port");
    } else {
        tracing::warn!(error = %e, "mooncake handshake failed");
    }
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
