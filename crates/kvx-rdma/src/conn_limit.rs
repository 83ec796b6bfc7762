//! Bounds on inbound connections that are served by a thread each (the tcp receiver and the
//! mooncake data server).
//!
//! A [`ConnLimit`] hands out at most `max` slots. A connection that finds them all taken asks
//! the least useful idle connection to leave — first the oldest one that never carried a
//! request (a silent peer), then the one idle the longest — and waits (bounded) for its slot;
//! when every connection is in the middle of a request, the newcomer is refused. A slot is
//! freed only when its thread ends, so the number of receive threads never exceeds `max`.
//! Each [`Conn`] is also the [`Interrupt`] of its receiver: stopping it shuts its socket down,
//! and its loop checks [`Conn::stopped`] after every read.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::mem::Interrupt;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a connection was not given a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Every slot is held by a connection in the middle of a request.
    #[error("{0} connections open, all busy")]
    Full(usize),
    /// The server is shutting down.
    #[error("server closed")]
    Closed,
}

impl Refused {
    /// Metrics label.
    pub fn cause(&self) -> &'static str {
        match self {
            Refused::Full(_) => "limit",
            Refused::Closed => "closed",
        }
    }
}

/// One served connection, as the limit (and deregistration) sees it.
pub struct Conn {
    stream: TcpStream,
    stopped: AtomicBool,
    busy: AtomicBool,
    used: AtomicBool,
    last: AtomicU64,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl Conn {
    /// Shuts the connection down; its receive loop ends at its next read.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// True once stopped (evicted, interrupted, or the server closed).
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// The connection is inside a request (not evictable).
    pub fn busy(&self) {
        if !self.busy.swap(true, Ordering::Relaxed) {
            self.used.store(true, Ordering::Relaxed);
        }
    }

    /// The connection is between requests; `now` orders idleness (see [`ConnLimit::tick`]).
    pub fn idle(&self, now: u64) {
        if self.busy.swap(false, Ordering::Relaxed) {
            self.last.store(now, Ordering::Relaxed);
        }
    }

    /// Keeps the receive thread's handle (joined by [`ConnLimit::close_all`]).
    pub fn set_handle(&self, h: JoinHandle<()>) {
        *lock(&self.handle) = Some(h);
    }
}

impl Interrupt for Conn {
    fn interrupt(&self) {
        self.stop();
    }
}

/// A slot: the connection's entry and its permit, both released when dropped (at the end of
/// the receive thread).
pub struct Slot {
    limit: Arc<ConnLimit>,
    id: u64,
    conn: Arc<Conn>,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    /// The connection.
    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }

    /// The limit it belongs to (for [`ConnLimit::tick`]).
    pub fn limit(&self) -> &ConnLimit {
        &self.limit
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.limit.live).remove(&self.id);
    }
}

/// The slots of one server.
pub struct ConnLimit {
    max: usize,
    permits: Arc<Semaphore>,
    live: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    clock: AtomicU64,
    closed: AtomicBool,
    /// Metrics label of the server (`"tcp"`, `"mooncake_data"`).
    label: &'static str,
}

impl ConnLimit {
    /// At most `max` (at least 1) connections at once.
    pub fn new(max: usize, label: &'static str) -> Arc<Self> {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(ConnLimit {
            max,
            permits: Arc::new(Semaphore::new(max)),
            live: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            clock: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            label,
        })
    }

    /// A fresh activity stamp (for [`Conn::idle`]).
    pub fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// Connections holding a slot now.
    pub fn count(&self) -> usize {
        lock(&self.live).len()
    }

    /// Waits for a slot for a new connection: at once when one is free, else after asking one
    /// idle connection to leave (at most `wait`).
    pub async fn admit(&self, wait: Duration) -> Result<OwnedSemaphorePermit, Refused> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Refused::Closed);
        }
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Ok(p);
        }
        if !self.evict_one() {
            return Err(Refused::Full(self.max));
        }
        match tokio::time::timeout(wait, self.permits.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(_)) => Err(Refused::Closed),
            Err(_) => Err(Refused::Full(self.max)),
        }
    }

    /// Stops the least useful idle connection; false when every one is busy.
    fn evict_one(&self) -> bool {
        let victim = lock(&self.live)
            .values()
            .filter(|c| !c.busy.load(Ordering::Relaxed) && !c.stopped())
            .min_by_key(|c| {
                (
                    c.used.load(Ordering::Relaxed),
                    c.last.load(Ordering::Relaxed),
                )
            })
            .cloned();
        match victim {
            Some(c) => {
                let never_used = !c.used.load(Ordering::Relaxed);
                metrics::counter!("kvx_conns_evicted_total", "server" => self.label,
                    "idle" => if never_used { "never_used" } else { "lru" })
                .increment(1);
                tracing::debug!(server = self.label, peer = ?c.stream.peer_addr().ok(),
                    never_used, "connection limit reached: idle connection closed");
                c.stop();
                true
            }
            None => false,
        }
    }

    /// Records a connection that got `permit`; `stream` is a clone of its socket (for
    /// shutdown). Fails once the server closed.
    pub fn register(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        stream: TcpStream,
    ) -> Result<Slot, Refused> {
        let conn = Arc::new(Conn {
            stream,
            stopped: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            used: AtomicBool::new(false),
            last: AtomicU64::new(self.tick()),
            handle: Mutex::new(None),
        });
        let mut live = lock(&self.live);
        if self.closed.load(Ordering::SeqCst) {
            return Err(Refused::Closed);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        live.insert(id, conn.clone());
        Ok(Slot {
            limit: self.clone(),
            id,
            conn,
            _permit: permit,
        })
    }

    /// Stops taking connections and shuts every live one down; with `join`, also waits for
    /// their threads (never the calling one).
    pub fn close_all(&self, join: bool) {
        let conns: Vec<Arc<Conn>> = {
            let live = lock(&self.live);
            self.closed.store(true, Ordering::SeqCst);
            live.values().cloned().collect()
        };
        self.permits.close();
        for c in &conns {
            c.stop();
        }
        if join {
            for c in conns {
                let h = lock(&c.handle).take();
                if let Some(h) = h
                    && h.thread().id() != std::thread::current().id()
                {
                    let _ = h.join();
                }
            }
        }
    }
}
