//! The ZMQ socket layer of sglang's control plane (spec §2), on libzmq through the `zmq` crate.
//!
//! * [`Inbox`]: a PULL socket bound to an explicit or random port (`RCVHWM=0`), read by a
//!   dedicated thread that checks every message with the codec's inbox classification
//!   ([`InboxKind`]) and hands the good ones to async code over a bounded channel; malformed
//!   messages are logged, counted and dropped, and the loop lives on. [`Inbox::bind_async`]
//!   reads it in the consumer's task instead, woken by tokio's reactor through the socket's
//!   `ZMQ_FD` (a PULL socket never blocks a read: no thread needed, one hand-off less).
//! * [`PushCache`]: PUSH sockets cached per endpoint with sglang's options ([`PushOptions`]),
//!   recreated after a disconnect (monitor socket) or a failed send, bounded in number (least
//!   recently used closed first) so a prefill cannot run out of file descriptors.
//! * [`Outbox`]: a [`PushCache`] on its own thread, so async code can send without blocking.
//!
//! Why threads and not `tmq`: libzmq sockets are blocking objects with timeouts (`SNDTIMEO`
//! up to 30 s, as sglang uses them), the disconnect monitor needs a second socket polled next to
//! each PUSH, and sends must be totally ordered per endpoint. A plain thread that owns the
//! sockets keeps all of that in one place, never blocks the tokio runtime, and costs one thread
//! per outbox (and per inbox read with [`Inbox::bind`]). IPv6 endpoints (`tcp://[::1]:p`) get `ZMQ_IPV6` on both sides.
//!
//! ```
//! use kvx_bootstrap::codec::{DecodeInbound, TransferStatus};
//! use kvx_bootstrap::sockets::{zmq, Inbox, InboxConfig, InboxKind, PushCache, PushOptions};
//! use kvx_core::{KVPoll, Room};
//!
//! let ctx = zmq::Context::new();
//! // A decode rank's inbox on a random port; a prefill rank's cached PUSH toward it.
//! let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Decode))?;
//! let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 1024);
//!
//! push.send(inbox.endpoint(), &[b"not a status".as_slice()])?; // dropped and counted
//! let status = TransferStatus {
//!     room: Room::new(42).unwrap(),
//!     status: KVPoll::Success,
//!     prefill_rank: 0,
//!     reason: None,
//! };
//! push.send(inbox.endpoint(), &status.encode())?;
//!
//! let msg = inbox.blocking_recv().expect("inbox open");
//! let DecodeInbound::Status(got) = DecodeInbound::parse(msg.frames())? else { unreachable!() };
//! assert_eq!(got, status);
//! assert_eq!(inbox.stats().dropped(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod frame;
mod inbox;
mod outbox;
mod push;

pub use error::SocketError;
pub use frame::{Frame, Multipart};
pub use inbox::{Inbox, InboxConfig, InboxKind, InboxStats};
pub use outbox::Outbox;
pub use push::{PushCache, PushOptions};
/// The `zmq` crate these sockets are built on (for `zmq::Context`).
pub use zmq;

/// Formats `tcp://host:port`, bracketing IPv6 literals (sglang's `format_tcp_address`).
pub fn tcp_addr(host: &str, port: u16) -> String {
    kvx_core::Endpoint::new(host.trim_start_matches('[').trim_end_matches(']'), port).zmq_addr()
}
