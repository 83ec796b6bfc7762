//! Typed errors of the data plane.
//!
//! Every failure a transport can report is one [`TransportError`] variant. Errors are `Clone` so a
//! connection that dies can fail every batch it carried with the same cause; I/O causes are kept
//! as their [`std::io::ErrorKind`] plus the message.

use std::fmt;
use std::io;

/// Why a receiver refused a write (or why the sender refused to post it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// The destination range is not inside the region that the key names.
    OutOfBounds,
    /// No region is registered under the key.
    BadKey,
    /// The write is longer than the largest write the receiver accepts in one frame.
    TooLong,
    /// The frame itself was malformed (unknown kind, non-zero reserved bytes, truncated).
    BadFrame,
}

impl RejectReason {
    /// The wire code of this reason (see `docs/tcp-transport.md`).
    pub const fn code(self) -> u8 {
        match self {
            RejectReason::OutOfBounds => 1,
            RejectReason::BadKey => 2,
            RejectReason::TooLong => 3,
            RejectReason::BadFrame => 4,
        }
    }

    /// The reason for a wire code; `None` for 0 (success) and unknown codes.
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(RejectReason::OutOfBounds),
            2 => Some(RejectReason::BadKey),
            3 => Some(RejectReason::TooLong),
            4 => Some(RejectReason::BadFrame),
            _ => None,
        }
    }

    /// A short stable label (used as a metrics label).
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectReason::OutOfBounds => "out_of_bounds",
            RejectReason::BadKey => "bad_key",
            RejectReason::TooLong => "too_long",
            RejectReason::BadFrame => "bad_frame",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A data-plane error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The backend has no usable device (verbs without an RDMA NIC, for instance).
    #[error("no device: {0}")]
    NoDevice(String),
    /// The peer could not be reached (connect failed, name did not resolve).
    #[error("peer {peer} unreachable: {detail}")]
    PeerUnreachable {
        /// The peer address as given.
        peer: String,
        /// The cause.
        detail: String,
    },
    /// The peer answered but the handshake failed (bad magic, version, descriptor).
    #[error("handshake with {peer} failed: {detail}")]
    Handshake {
        /// The peer address.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The remote side refused a write; nothing of that write was stored.
    #[error("remote rejected write to {addr:#x} (+{len}): {reason}")]
    RemoteRejected {
        /// Why.
        reason: RejectReason,
        /// The first rejected remote address.
        addr: u64,
        /// Its length (0 when the receiver did not say).
        len: u64,
    },
    /// A source range is not inside any locally registered region.
    #[error("local range {addr:#x} (+{len}) is not registered")]
    LocalNotRegistered {
        /// Source address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A destination range is not inside any region the peer advertised.
    #[error("remote range {addr:#x} (+{len}) is not inside a region the peer registered")]
    RemoteNotRegistered {
        /// Destination address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Registration was refused (null address, zero or overflowing length, overlap).
    #[error("cannot register {addr:#x} (+{len}): {detail}")]
    Registration {
        /// Address.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        detail: String,
    },
    /// The peer did not acknowledge in time (silent peer).
    #[error("peer {peer} timed out after {after_ms} ms")]
    Timeout {
        /// The peer address.
        peer: String,
        /// How long we waited.
        after_ms: u64,
    },
    /// The connection to the peer broke while the batch was in flight.
    #[error("peer {peer} lost: {detail}")]
    PeerLost {
        /// The peer address.
        peer: String,
        /// The cause (EOF, reset, ...).
        detail: String,
    },
    /// A local I/O error outside a connection (bind, socket options).
    #[error("i/o error ({kind:?}): {detail}")]
    Io {
        /// The error kind.
        kind: io::ErrorKind,
        /// The message.
        detail: String,
    },
    /// The address answered, but as another process instance than the session id names: the
    /// peer restarted since it published the id, and its memory is not the memory the id's
    /// owner offered. Nothing was written.
    #[error(
        "peer {peer} restarted: it is instance {found:?} now, not the one its session id names"
    )]
    PeerRestarted {
        /// The session id as given (with the instance it names).
        peer: String,
        /// The instance the address answers as now (empty when it names none).
        found: String,
    },
    /// The transport or session was shut down.
    #[error("transport closed")]
    Closed,
    /// The peer's port speaks another protocol than the one this backend expected (e.g. a
    /// Mooncake handshake sent to a kvx tcp server, which closes without a reply).
    #[error("peer {peer} does not speak {expected}: {detail}")]
    WrongProtocol {
        /// The peer address.
        peer: String,
        /// The protocol that was expected.
        expected: &'static str,
        /// What came back instead.
        detail: String,
    },
    /// Device (GPU) memory was offered to a backend whose CPU reads and writes registered
    /// bytes (`tcp`, `mooncake`, `auto`, `local`): nothing was registered. Only `verbs`
    /// registers device memory (see [`crate::Transport::register_device`]).
    #[error(
        "the {backend} backend cannot register device memory (its CPU reads and writes \
         registered bytes); device memory needs the `verbs` backend (an RDMA NIC with \
         GPUDirect RDMA)"
    )]
    DeviceMemoryUnsupported {
        /// The backend that refused ([`crate::Transport::kind`]).
        backend: &'static str,
    },
}

impl TransportError {
    /// A short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            TransportError::NoDevice(_) => "no_device",
            TransportError::PeerUnreachable { .. } => "peer_unreachable",
            TransportError::Handshake { .. } => "handshake",
            TransportError::RemoteRejected { .. } => "remote_rejected",
            TransportError::LocalNotRegistered { .. } => "local_not_registered",
            TransportError::RemoteNotRegistered { .. } => "remote_not_registered",
            TransportError::Registration { .. } => "registration",
            TransportError::Timeout { .. } => "timeout",
            TransportError::PeerLost { .. } => "peer_lost",
            TransportError::PeerRestarted { .. } => "peer_restarted",
            TransportError::Io { .. } => "io",
            TransportError::Closed => "closed",
            TransportError::WrongProtocol { .. } => "wrong_protocol",
            TransportError::DeviceMemoryUnsupported { .. } => "device_memory_unsupported",
        }
    }

    /// True when the error means the peer (or the connection to it) is gone, as opposed to a
    /// problem with one batch. Callers typically blacklist the peer's session on these.
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            TransportError::PeerUnreachable { .. }
                | TransportError::Handshake { .. }
                | TransportError::Timeout { .. }
                | TransportError::PeerLost { .. }
                | TransportError::PeerRestarted { .. }
                | TransportError::Closed
                | TransportError::WrongProtocol { .. }
        )
    }
}

impl From<io::Error> for TransportError {
    fn from(e: io::Error) -> Self {
        TransportError::Io {
            kind: e.kind(),
            detail: e.to_string(),
        }
    }
}
