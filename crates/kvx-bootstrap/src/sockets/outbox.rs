//! A [`PushCache`] owned by one thread, fed by a channel: async code sends without blocking
//! the runtime, and all messages to one endpoint leave in the order they were submitted
//! (sglang relies on that order: registration before metadata, `AUX_DATA` before status).
//!
//! One slow destination (a send blocking until `SNDTIMEO`) delays the others behind it in the
//! same outbox; drivers that need isolation use several outboxes (e.g. one per transfer shard).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvx_core::Endpoint;
use tokio::sync::oneshot;

use super::SocketError;
use super::push::{PushCache, PushOptions};

type Reply = oneshot::Sender<Result<(), SocketError>>;

enum Cmd {
    Send {
        ep: Endpoint,
        frames: Vec<Vec<u8>>,
        reply: Option<Reply>,
    },
    Disconnect(Endpoint),
}

/// A sending thread with its own PUSH socket cache.
#[derive(Debug)]
pub struct Outbox {
    tx: Option<mpsc::Sender<Cmd>>,
    thread: Option<JoinHandle<()>>,
}

impl Outbox {
    /// Starts the thread; sockets get `opts`, at most `capacity` endpoints are cached.
    pub fn new(
        ctx: &zmq::Context,
        opts: PushOptions,
        capacity: usize,
    ) -> Result<Self, SocketError> {
        Self::start(ctx, opts, capacity, None)
    }

    /// Like [`Outbox::new`] with monitored sockets, also reporting every endpoint whose
    /// connection dropped (within about 250 ms, or at the next send to it): the process behind
    /// it died or restarted, so what was sent there before (a registration) may be gone.
    pub fn reporting_disconnects(
        ctx: &zmq::Context,
        opts: PushOptions,
        capacity: usize,
    ) -> Result<(Self, tokio::sync::mpsc::UnboundedReceiver<Endpoint>), SocketError> {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let outbox = Self::start(ctx, opts.monitored(), capacity, Some(events))?;
        Ok((outbox, rx))
    }

    fn start(
        ctx: &zmq::Context,
        opts: PushOptions,
        capacity: usize,
        events: Option<tokio::sync::mpsc::UnboundedSender<Endpoint>>,
    ) -> Result<Self, SocketError> {
        let mut cache = PushCache::new(ctx, opts, capacity);
        let poll = if events.is_some() {
            Duration::from_millis(250)
        } else {
            Duration::from_secs(1)
        };
        let (tx, rx) = mpsc::channel::<Cmd>();
        let thread = std::thread::Builder::new()
            .name("kvx-outbox".into())
            .spawn(move || {
                let mut checked = std::time::Instant::now();
                loop {
                    let got = rx.recv_timeout(poll);
                    // Every socket's monitor is read at most once per poll period, not per
                    // message (a send to a dropped peer still reports it, from the cache).
                    if let Some(ev) = &events
                        && checked.elapsed() >= poll
                    {
                        checked = std::time::Instant::now();
                        for ep in cache.take_disconnected() {
                            let _ = ev.send(ep);
                        }
                    }
                    match got {
                        Ok(Cmd::Send { ep, frames, reply }) => {
                            let res = cache.send(&ep, &frames);
                            match reply {
                                Some(r) => {
                                    let _ = r.send(res);
                                }
                                None => {
                                    // Already logged and counted by the cache.
                                    drop(res);
                                }
                            }
                        }
                        Ok(Cmd::Disconnect(ep)) => {
                            cache.disconnect(&ep);
                        }
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            if events.is_none() {
                                cache.reap_disconnected();
                            }
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
            })
            .map_err(|_| SocketError::Closed)?;
        Ok(Outbox {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    fn submit(&self, cmd: Cmd) -> Result<(), SocketError> {
        self.tx
            .as_ref()
            .ok_or(SocketError::Closed)?
            .send(cmd)
            .map_err(|_| SocketError::Closed)
    }

    /// Sends `frames` to `ep` and waits for libzmq to accept them.
    pub async fn send(&self, ep: Endpoint, frames: Vec<Vec<u8>>) -> Result<(), SocketError> {
        let (reply, done) = oneshot::channel();
        self.submit(Cmd::Send {
            ep,
            frames,
            reply: Some(reply),
        })?;
        done.await.map_err(|_| SocketError::Closed)?
    }

    /// Queues `frames` for `ep` without waiting; a failure is logged and counted only.
    pub fn send_detached(&self, ep: Endpoint, frames: Vec<Vec<u8>>) -> Result<(), SocketError> {
        self.submit(Cmd::Send {
            ep,
            frames,
            reply: None,
        })
    }

    /// Closes the cached socket toward `ep` (after messages queued before this call).
    pub fn disconnect(&self, ep: Endpoint) -> Result<(), SocketError> {
        self.submit(Cmd::Disconnect(ep))
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
