//! The ZMQ socket layer of sglang's control plane (spec §2), on libzmq through the `zmq` crate.
//!
//! * [`Inbox`]: a PULL socket bound to an explicit or random port (`RCVHWM=0`), read by a
//!   dedicated thread that checks every message with the codec's inbox classification
//!   ([`InboxKind`]) and hands the good ones to async code over a bounded channel; malformed
//!   messages are logged, counted and dropped, and the loop lives on.
//! * [`PushCache`]: PUSH sockets cached per endpoint with sglang's options ([`PushOptions`]),
//!   recreated after a disconnect (monitor socket) or a failed send, bounded in number (least
//!   recently used closed first) so a prefill cannot run out of file descriptors.
//! * [`Outbox`]: a [`PushCache`] on its own thread, so async code can send without blocking.
//!
//! Why threads and not `tmq`: libzmq sockets are blocking objects with timeouts (`SNDTIMEO`
//! up to 30 s, as sglang uses them), the disconnect monitor needs a second socket polled next to
//! each PUSH, and sends must be totally ordered per endpoint. A plain thread that owns the
//! sockets keeps all of that in one place, never blocks the tokio runtime, and costs one thread
//! per inbox/outbox. IPv6 endpoints (`tcp://[::1]:p`) get `ZMQ_IPV6` on both sides.

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
