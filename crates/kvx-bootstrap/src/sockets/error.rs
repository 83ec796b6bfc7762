//! Errors of the socket layer.

/// A socket operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketError {
    /// libzmq refused an operation (`what` says which).
    #[error("zmq {what} failed for {addr}: {source}")]
    Zmq {
        /// The operation (bind, connect, setsockopt, send, ...).
        what: &'static str,
        /// The address involved.
        addr: String,
        /// The libzmq error.
        source: zmq::Error,
    },
    /// A send did not complete within `SNDTIMEO` (no connected peer, or its queue is full).
    #[error("send to {addr} timed out")]
    SendTimeout {
        /// The destination.
        addr: String,
    },
    /// libzmq reported an endpoint it bound that kvx cannot parse.
    #[error("unexpected bound endpoint {0:?}")]
    BadEndpoint(String),
    /// The socket thread is gone (closed or dropped).
    #[error("socket thread stopped")]
    Closed,
    /// An inbox read in its consumer's task could not join the tokio runtime's reactor (no
    /// runtime on this thread, or the registration failed).
    #[error("registering the inbox with the tokio runtime: {0}")]
    Reactor(std::io::Error),
}

impl SocketError {
    pub(crate) fn zmq<'a>(
        what: &'static str,
        addr: &'a str,
    ) -> impl FnOnce(zmq::Error) -> Self + 'a {
        move |source| SocketError::Zmq {
            what,
            addr: addr.to_string(),
            source,
        }
    }

    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            SocketError::Zmq { what, .. } => what,
            SocketError::SendTimeout { .. } => "send_timeout",
            SocketError::BadEndpoint(_) => "bad_endpoint",
            SocketError::Closed => "closed",
            SocketError::Reactor(_) => "reactor",
        }
    }
}
