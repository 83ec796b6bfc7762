//! Fatal worker faults and the one error the supervisor builds from them.
//!
//! A per-room error fails one room; a [`WorkerFault`] is different: the worker cannot go on (it
//! panicked, it returned a fatal error, its transport is poisoned). The supervisor wraps it in
//! [`TransferThreadFailed`], whose text is sglang's, so operators can grep for it, while the inner
//! cause stays reachable through `source()`.

/// Why a transfer worker stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerFault {
    /// The worker panicked; the payload text.
    #[error("panic: {0}")]
    Panic(String),
    /// A transport connection is in an unusable state.
    #[error("transport poisoned: {0}")]
    TransportPoisoned(String),
    /// A fault injected through a failpoint.
    #[error("injected fault at {point}: {detail}")]
    Injected {
        /// The failpoint name.
        point: &'static str,
        /// The failpoint's argument.
        detail: String,
    },
    /// The room table lock was poisoned by another thread's panic.
    #[error("room table poisoned")]
    TablePoisoned,
}

impl WorkerFault {
    /// A short, stable label for the failures-by-cause metric.
    pub fn cause(&self) -> &'static str {
        match self {
            WorkerFault::Panic(_) => "panic",
            WorkerFault::TransportPoisoned(_) => "transport_poisoned",
            WorkerFault::Injected { .. } => "injected",
            WorkerFault::TablePoisoned => "table_poisoned",
        }
    }

    /// Text of a panic payload.
    pub fn from_panic(payload: &(dyn std::any::Any + Send)) -> Self {
        let text = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic payload".to_owned());
        WorkerFault::Panic(text)
    }
}

/// A transfer worker died: sglang's message, made true (every open room is failed and reported).
#[derive(Debug, thiserror::Error)]
#[error(
    "Transfer thread failed because of {inner}. Prefill instance with bootstrap_port={bootstrap_port} is dead."
)]
pub struct TransferThreadFailed {
    /// The inner cause.
    #[source]
    pub inner: WorkerFault,
    /// The prefill instance's bootstrap port.
    pub bootstrap_port: u16,
    /// The queue shard the worker served.
    pub shard: usize,
}

/// Process exit code when a transfer worker fails and workers are not restarted (`EX_SOFTWARE`).
pub const EXIT_WORKER_FAILED: i32 = 70;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn message_is_sglangs_and_keeps_the_cause() {
        let e = TransferThreadFailed {
            inner: WorkerFault::Injected {
                point: "kvx::transfer_worker::batch",
                detail: "boom".into(),
            },
            bootstrap_port: 8998,
            shard: 2,
        };
        assert_eq!(
            e.to_string(),
            "Transfer thread failed because of injected fault at kvx::transfer_worker::batch: boom. \
             Prefill instance with bootstrap_port=8998 is dead."
        );
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("injected fault at kvx::transfer_worker::batch: boom")
        );
        let p = std::panic::catch_unwind(|| panic!("bad {}", 1)).unwrap_err();
        assert_eq!(
            WorkerFault::from_panic(p.as_ref()).to_string(),
            "panic: bad 1"
        );
    }
}
