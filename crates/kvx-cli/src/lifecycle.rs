//! Process lifecycle of the long-running commands: signals, the drain deadline and readiness.
//!
//! [`Signals::install`] takes SIGINT and SIGTERM from the process on a thread of its own (with
//! a small runtime, so it answers whatever the command's runtime is doing): the first signal
//! asks the command to drain ([`Stop`] turns true), a second one exits the process at once with
//! `128 + signal` (130 for SIGINT, 143 for SIGTERM). [`Readiness`] is what `GET /ready`
//! answers: 200 once the command said it is ready and while it does not drain, 503 with the
//! reason otherwise (`/health` stays 200 while the process lives, so that peers' heartbeats do
//! not fail rooms during a drain).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::watch;

/// Why the signal handlers could not be installed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LifecycleError {
    /// The runtime or a handler could not be created.
    #[error("installing the signal handlers: {0}")]
    Io(#[from] std::io::Error),
    /// The signal thread stopped before it reported.
    #[error("the signal thread stopped before it installed its handlers")]
    ThreadGone,
}

/// A drain request: cloneable, cheap to check, awaitable.
#[derive(Clone)]
pub struct Stop {
    rx: watch::Receiver<Option<&'static str>>,
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("requested", &self.requested())
            .finish()
    }
}

impl Stop {
    /// A stop that never fires, and its trigger (for embedders and tests).
    pub fn manual() -> (StopTrigger, Stop) {
        let (tx, rx) = watch::channel(None);
        (StopTrigger { tx }, Stop { rx })
    }

    /// The signal's name once one came (`"SIGINT"`, `"SIGTERM"`, or a trigger's reason).
    pub fn requested(&self) -> Option<&'static str> {
        *self.rx.borrow()
    }

    /// Waits until a stop is requested; returns its name.
    pub async fn wait(&self) -> &'static str {
        let mut rx = self.rx.clone();
        loop {
            if let Some(s) = *rx.borrow_and_update() {
                return s;
            }
            if rx.changed().await.is_err() {
                // The trigger is gone without firing: never.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Fires a [`Stop`].
#[derive(Clone, Debug)]
pub struct StopTrigger {
    tx: watch::Sender<Option<&'static str>>,
}

impl StopTrigger {
    /// Requests the stop (the first request's name is kept).
    pub fn fire(&self, why: &'static str) {
        self.tx.send_if_modified(|v| {
            if v.is_none() {
                *v = Some(why);
                true
            } else {
                false
            }
        });
    }
}

/// SIGINT/SIGTERM handling for one command.
pub struct Signals;

impl Signals {
    /// Installs the handlers for `command` (named in the log lines) and returns the drain
    /// request they fire. The first signal fires it; the second exits at once.
    pub fn install(command: &'static str) -> Result<Stop, LifecycleError> {
        let (trigger, stop) = Stop::manual();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("kvx-signals".into())
            .spawn(move || signal_thread(command, &trigger, &ready_tx))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(stop),
            Ok(Err(e)) => Err(LifecycleError::Io(e)),
            Err(_) => Err(LifecycleError::ThreadGone),
        }
    }
}

fn signal_thread(
    command: &'static str,
    trigger: &StopTrigger,
    ready: &std::sync::mpsc::SyncSender<std::io::Result<()>>,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    rt.block_on(async {
        let handlers = signal(SignalKind::interrupt())
            .and_then(|i| signal(SignalKind::terminate()).map(|t| (i, t)));
        let (mut int, mut term) = match handlers {
            Ok(h) => {
                let _ = ready.send(Ok(()));
                h
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let mut seen = 0;
        loop {
            let (name, code) = tokio::select! {
                _ = int.recv() => ("SIGINT", 130),
                _ = term.recv() => ("SIGTERM", 143),
            };
            seen += 1;
            if seen == 1 {
                tracing::warn!(
                    signal = name,
                    "kvx {command}: draining (a second signal exits at once)"
                );
                trigger.fire(name);
            } else {
                eprintln!("kvx {command}: second signal ({name}): exiting now");
                std::process::exit(code);
            }
        }
    });
}

/// How long a drain may take: `--shutdown-timeout` from the moment the stop came.
#[derive(Clone, Copy, Debug)]
pub struct Deadline(Instant);

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now() + timeout)
    }

    /// Whether it passed.
    pub fn passed(&self) -> bool {
        Instant::now() >= self.0
    }

    /// Time left (zero once passed).
    pub fn left(&self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }
}

/// What `GET /ready` answers.
#[derive(Clone, Default)]
pub struct Readiness {
    inner: Arc<ReadyState>,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("check", &self.check())
            .finish()
    }
}

#[derive(Default)]
struct ReadyState {
    ready: AtomicBool,
    draining: AtomicBool,
    why_not: Mutex<String>,
}

impl Readiness {
    /// Not ready yet, with the reason `/ready` gives.
    pub fn new(why_not: &str) -> Readiness {
        let r = Readiness::default();
        r.not_ready(why_not);
        r
    }

    /// Ready (unless draining).
    pub fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
    }

    /// Not ready, with the reason.
    pub fn not_ready(&self, why: &str) {
        self.inner.ready.store(false, Ordering::Release);
        *self
            .inner
            .why_not
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = why.to_owned();
    }

    /// Draining: `/ready` answers 503 from now on.
    pub fn set_draining(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    /// `Ok` when ready, else the reason.
    pub fn check(&self) -> Result<(), String> {
        if self.inner.draining.load(Ordering::Acquire) {
            return Err("draining".into());
        }
        if self.inner.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(self
            .inner
            .why_not
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone())
    }

    /// A router serving `GET /ready`.
    pub fn router(&self) -> Router {
        let r = self.clone();
        Router::new().route(
            "/ready",
            get(move || {
                let r = r.clone();
                async move {
                    match r.check() {
                        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
                        Err(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn readiness_reports_the_reason_and_draining_wins() {
        let r = Readiness::new("not registered");
        assert_eq!(r.check(), Err("not registered".into()));
        r.set_ready();
        assert_eq!(r.check(), Ok(()));
        r.set_draining();
        assert_eq!(r.check(), Err("draining".into()));
    }

    #[test]
    fn a_stop_keeps_its_first_reason() {
        let (t, s) = Stop::manual();
        assert_eq!(s.requested(), None);
        t.fire("SIGTERM");
        t.fire("SIGINT");
        assert_eq!(s.requested(), Some("SIGTERM"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(s.wait()), "SIGTERM");
    }
}
