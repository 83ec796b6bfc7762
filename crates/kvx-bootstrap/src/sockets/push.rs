//! PUSH sockets cached per destination endpoint with sglang's options (spec §2, S3/S4).
//!
//! Toward decodes (S4) a socket never reconnects by itself (`RECONNECT_IVL=-1`); a monitor
//! socket reports `DISCONNECTED`, and the next send to that endpoint closes the dead socket and
//! connects a new one. A send that fails (e.g. `SNDTIMEO` expired) also drops the socket, so the
//! next send starts fresh. The cache holds at most `capacity` endpoints; when full, the least
//! recently used one is closed (each cached endpoint costs up to three libzmq sockets) with a
//! short linger, so messages still queued toward a live peer are flushed rather than dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvx_core::Endpoint;

use super::SocketError;

/// Options of every PUSH socket of a cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushOptions {
    /// `SNDTIMEO`: how long a send may block.
    pub send_timeout: Duration,
    /// `LINGER`: how long unsent messages survive a close (sglang: 0).
    pub linger: Duration,
    /// `RECONNECT_IVL` in ms; `Some(-1)` disables reconnection; `None` keeps libzmq's default.
    pub reconnect_ivl_ms: Option<i32>,
    /// TCP keepalive `(idle s, interval s, count)`; `None` keeps the OS default.
    pub keepalive: Option<(i32, i32, i32)>,
    /// Watch for `DISCONNECTED` with a monitor socket and recreate on next use.
    pub monitor: bool,
}

impl PushOptions {
    /// Prefill → decode (S4): `RECONNECT_IVL=-1`, `SNDTIMEO=30 s`, `LINGER=0`, keepalive
    /// 30/5/3, monitored.
    pub fn toward_decode() -> Self {
        PushOptions {
            send_timeout: Duration::from_secs(30),
            linger: Duration::ZERO,
            reconnect_ivl_ms: Some(-1),
            keepalive: Some((30, 5, 3)),
            monitor: true,
        }
    }

    /// Decode → prefill (S3): `LINGER=0`, `SNDTIMEO=1 s`, nothing else.
    pub fn toward_prefill() -> Self {
        PushOptions {
            send_timeout: Duration::from_secs(1),
            linger: Duration::ZERO,
            reconnect_ivl_ms: None,
            keepalive: None,
            monitor: false,
        }
    }

    /// The same options, with a monitor: a cache of such sockets reports peers whose
    /// connection dropped ([`PushCache::take_disconnected`]), e.g. to notice that the process
    /// behind an endpoint restarted even while nothing is sent to it.
    pub fn monitored(mut self) -> Self {
        self.monitor = true;
        self
    }

    /// The same options with another send timeout.
    pub fn with_send_timeout(mut self, t: Duration) -> Self {
        self.send_timeout = t;
        self
    }
}

struct Entry {
    push: zmq::Socket,
    monitor: Option<zmq::Socket>,
    last_used: u64,
}

/// PUSH sockets by destination, bounded, recreated after disconnects.
pub struct PushCache {
    ctx: zmq::Context,
    opts: PushOptions,
    capacity: usize,
    entries: HashMap<Endpoint, Entry>,
    clock: u64,
    /// Monitored sockets found disconnected when next used (and replaced), not yet taken by
    /// [`PushCache::take_disconnected`]; at most [`MAX_DROPPED`].
    dropped: Vec<Endpoint>,
}

/// Most disconnects a monitored cache remembers between two `take_disconnected` calls.
const MAX_DROPPED: usize = 1024;

impl std::fmt::Debug for PushCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushCache")
            .field("opts", &self.opts)
            .field("capacity", &self.capacity)
            .field("len", &self.entries.len())
            .finish()
    }
}

static MONITOR_SEQ: AtomicU64 = AtomicU64::new(0);

/// Linger given to a socket closed because the cache is full (its peer is alive).
const EVICT_LINGER_MS: i32 = 1000;

fn ms(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

impl PushCache {
    /// A cache on `ctx` holding at most `capacity` endpoints (at least 1).
    pub fn new(ctx: &zmq::Context, opts: PushOptions, capacity: usize) -> Self {
        PushCache {
            ctx: ctx.clone(),
            opts,
            capacity: capacity.max(1),
            entries: HashMap::new(),
            clock: 0,
            dropped: Vec::new(),
        }
    }

    /// Endpoints currently cached.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when a socket toward `ep` is cached.
    pub fn contains(&self, ep: &Endpoint) -> bool {
        self.entries.contains_key(ep)
    }

    fn open(&self, ep: &Endpoint) -> Result<Entry, SocketError> {
        let addr = ep.zmq_addr();
        let z = |what| SocketError::zmq(what, &addr);
        let push = self.ctx.socket(zmq::PUSH).map_err(z("socket"))?;
        push.set_linger(ms(self.opts.linger))
            .map_err(z("setsockopt LINGER"))?;
        push.set_sndtimeo(ms(self.opts.send_timeout))
            .map_err(z("setsockopt SNDTIMEO"))?;
        if let Some(ivl) = self.opts.reconnect_ivl_ms {
            push.set_reconnect_ivl(ivl)
                .map_err(z("setsockopt RECONNECT_IVL"))?;
        }
        if let Some((idle, intvl, cnt)) = self.opts.keepalive {
            push.set_tcp_keepalive(1)
                .map_err(z("setsockopt TCP_KEEPALIVE"))?;
            push.set_tcp_keepalive_idle(idle)
                .map_err(z("setsockopt TCP_KEEPALIVE_IDLE"))?;
            push.set_tcp_keepalive_intvl(intvl)
                .map_err(z("setsockopt TCP_KEEPALIVE_INTVL"))?;
            push.set_tcp_keepalive_cnt(cnt)
                .map_err(z("setsockopt TCP_KEEPALIVE_CNT"))?;
        }
        if ep.is_ipv6() {
            push.set_ipv6(true).map_err(z("setsockopt IPV6"))?;
        }
        let monitor = if self.opts.monitor {
            let name = format!(
                "inproc://kvx-push-monitor-{}",
                MONITOR_SEQ.fetch_add(1, Ordering::Relaxed)
            );
            push.monitor(&name, zmq::SocketEvent::DISCONNECTED as i32)
                .map_err(z("monitor"))?;
            let pair = self.ctx.socket(zmq::PAIR).map_err(z("socket"))?;
            pair.set_linger(0).map_err(z("setsockopt LINGER"))?;
            pair.connect(&name).map_err(z("connect monitor"))?;
            Some(pair)
        } else {
            None
        };
        push.connect(&addr).map_err(z("connect"))?;
        Ok(Entry {
            push,
            monitor,
            last_used: 0,
        })
    }

    /// True when the monitor of `e` reported a disconnect (drains its events).
    fn disconnected(e: &Entry) -> bool {
        let Some(mon) = &e.monitor else {
            return false;
        };
        let mut seen = false;
        while let Ok(parts) = mon.recv_multipart(zmq::DONTWAIT) {
            if parts.first().is_some_and(|f| f.len() >= 2) {
                seen = true;
            }
        }
        seen
    }

    /// Drops every cached socket whose monitor reported a disconnect; returns how many.
    pub fn reap_disconnected(&mut self) -> usize {
        self.take_disconnected().len()
    }

    /// Drops every cached socket whose monitor reported a disconnect since it was opened (or
    /// since the last call) and returns their endpoints, sorted, each once, together with those
    /// a send found disconnected (and reconnected) since the last call.
    pub fn take_disconnected(&mut self) -> Vec<Endpoint> {
        let dead: Vec<Endpoint> = self
            .entries
            .iter()
            .filter(|(_, e)| Self::disconnected(e))
            .map(|(k, _)| k.clone())
            .collect();
        for ep in &dead {
            self.entries.remove(ep);
            tracing::info!(endpoint = %ep, "peer disconnected; socket closed");
            metrics::counter!("kvx_bootstrap_push_disconnected_total").increment(1);
        }
        let mut all = std::mem::take(&mut self.dropped);
        all.extend(dead);
        all.sort_by(|a, b| (&a.host, a.port).cmp(&(&b.host, b.port)));
        all.dedup();
        all
    }

    /// Connects a socket toward `ep` (cached) without sending anything: with a monitored cache,
    /// a later drop of that connection shows in [`PushCache::take_disconnected`]. Call that
    /// first: a socket found disconnected here is replaced and its report lost.
    pub fn watch(&mut self, ep: &Endpoint) -> Result<(), SocketError> {
        self.entry(ep).map(|_| ())
    }

    fn evict_lru(&mut self) {
        if let Some(victim) = self
            .entries
            .iter()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| k.clone())
        {
            if let Some(entry) = self.entries.remove(&victim) {
                // Eviction is housekeeping, not a failure: give queued messages a moment to
                // leave (libzmq flushes in the background) instead of discarding them.
                let _ = entry.push.set_linger(EVICT_LINGER_MS);
            }
            tracing::debug!(endpoint = %victim, "push socket evicted (cache full)");
            metrics::counter!("kvx_bootstrap_push_evicted_total").increment(1);
        }
    }

    /// The cached socket toward `ep`, connected (or reconnected after a disconnect) as needed.
    fn entry(&mut self, ep: &Endpoint) -> Result<&mut Entry, SocketError> {
        self.clock += 1;
        let stale = self.entries.get(ep).is_some_and(Self::disconnected);
        if stale {
            self.entries.remove(ep);
            tracing::info!(endpoint = %ep, "peer disconnected; reconnecting");
            metrics::counter!("kvx_bootstrap_push_disconnected_total").increment(1);
            if self.dropped.len() >= MAX_DROPPED {
                self.dropped.remove(0);
            }
            self.dropped.push(ep.clone());
        }
        if !self.entries.contains_key(ep) {
            if self.entries.len() >= self.capacity {
                self.evict_lru();
            }
            let entry = self.open(ep)?;
            self.entries.insert(ep.clone(), entry);
        }
        let clock = self.clock;
        let Some(entry) = self.entries.get_mut(ep) else {
            return Err(SocketError::Closed);
        };
        entry.last_used = clock;
        Ok(entry)
    }

    /// Drops the socket toward `ep` after a failed send and returns the error to report.
    fn failed(&mut self, ep: &Endpoint, e: zmq::Error) -> SocketError {
        self.entries.remove(ep);
        let err = match e {
            zmq::Error::EAGAIN => SocketError::SendTimeout {
                addr: ep.zmq_addr(),
            },
            other => SocketError::Zmq {
                what: "send",
                addr: ep.zmq_addr(),
                source: other,
            },
        };
        tracing::warn!(endpoint = %ep, error = %err, "send failed; socket dropped");
        metrics::counter!("kvx_bootstrap_push_send_errors_total", "kind" => err.kind())
            .increment(1);
        err
    }

    /// Sends one multipart message to `ep`, connecting (or reconnecting) as needed. Blocks up
    /// to the send timeout. On failure the socket is dropped so the next send starts fresh.
    pub fn send<F: AsRef<[u8]>>(&mut self, ep: &Endpoint, frames: &[F]) -> Result<(), SocketError> {
        let res = send_all(&self.entry(ep)?.push, frames);
        res.map_err(|e| self.failed(ep, e))
    }

    /// Like [`PushCache::send`], but when the message cannot be queued within the send timeout
    /// (the peer's queue is full: `EAGAIN` on the first frame, so nothing of it was queued) the
    /// socket is kept and `Ok(false)` returned, so that the caller can retry the same message
    /// later on the same socket and nothing sent after it overtakes it. `Ok(true)`: queued.
    pub fn send_or_hold<F: AsRef<[u8]>>(
        &mut self,
        ep: &Endpoint,
        frames: &[F],
    ) -> Result<bool, SocketError> {
        let Some((first, rest)) = frames.split_first() else {
            return Ok(true);
        };
        let push = &self.entry(ep)?.push;
        let flags = if rest.is_empty() { 0 } else { zmq::SNDMORE };
        let res = match push.send(first.as_ref(), flags) {
            Err(zmq::Error::EAGAIN) => return Ok(false),
            // libzmq takes a multipart message whole once its first frame is in.
            Ok(()) => rest.iter().enumerate().try_for_each(|(i, f)| {
                let flags = if i + 1 < rest.len() { zmq::SNDMORE } else { 0 };
                push.send(f.as_ref(), flags)
            }),
            Err(e) => Err(e),
        };
        res.map(|()| true).map_err(|e| self.failed(ep, e))
    }

    /// Closes the socket toward `ep` (e.g. after a heartbeat declared the peer dead).
    pub fn disconnect(&mut self, ep: &Endpoint) -> bool {
        self.entries.remove(ep).is_some()
    }
}

fn send_all<F: AsRef<[u8]>>(sock: &zmq::Socket, frames: &[F]) -> Result<(), zmq::Error> {
    let n = frames.len();
    if n == 0 {
        return Ok(());
    }
    for (i, f) in frames.iter().enumerate() {
        let flags = if i + 1 < n { zmq::SNDMORE } else { 0 };
        sock.send(f.as_ref(), flags)?;
    }
    Ok(())
}
