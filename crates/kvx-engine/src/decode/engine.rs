//! `DecodeEngine`: one decode rank, embeddable — what sglang's decode manager does for a decode
//! scheduler, over memory the scheduler owns. The scheduler allocates a room's KV pages and aux
//! row itself and calls [`DecodeEngine::open_room`]; the engine resolves the room's prefill
//! instance (sentinel, §4.3 rank mapping and per-rank routes, one registration per prefill rank,
//! once per bootstrap address, then a heartbeat to it and a watcher of its ranks), sends the
//! room's metadata to every target rank and tracks its status (`kvx-core`'s `DecodeManager`:
//! distinct-rank success counting, waiting timeout with `ABORT`, heartbeat loss, a lost rank).
//! Recovery: an instance whose heartbeats failed is resolved again by the next room; a rank
//! whose inbox stops answering fails its rooms, and once the bootstrap server names its new
//! inbox (it restarted) or the old one answers again, the engine registers with it again. The outcome is read by polling
//! ([`DecodeEngine::poll`], [`RoomHandle::poll`]), from the event channel
//! ([`DecodeEngine::take_events`]: [`DecodeEngineEvent::Done`], then
//! [`DecodeEngineEvent::Released`]) or by awaiting [`RoomHandle::wait`].
//!
//! Page ownership: a room's pages and aux row belong to the engine from `open_room` until its
//! `Released` event (or [`RoomHandle::wait_released`]). A successful room releases them at once
//! (`Done` and `Released` together); a failed one only when nothing can land in them any more —
//! an `ABORT`ed room once every prefill rank it went to returned its `ABORT_ACK` (sent only once
//! its writes drained; host pages are then checked unchanged for a moment, device pages are
//! not — the CPU does not read them) or after `abort_release_timeout`, another failed room after
//! a grace (sglang's deferred KV release).
//! Dropping a room's [`RoomHandle`] before the room is terminal fails it locally: `ABORT` to its
//! prefill ranks, pages held as above. The protocol itself is the `kvx decode` peer's
//! (`Peer::drive_room`, `Peer::settle_room`): the same messages, byte for byte.
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvx_engine::decode::engine::{DecodeEngine, DecodeEngineConfig, DecodeMemory};
//! use kvx_engine::model::ModelPreset;
//! use kvx_engine::region::Region;
//! use kvx_core::{KVPoll, Room};
//!
//! let rt = tokio::runtime::Runtime::new()?;
//! let layout = ModelPreset::Tiny.layout(1, 0, 16, 256);
//! let mem = DecodeMemory::new(
//!     Arc::new(Region::new(layout.pool_bytes() as usize)),
//!     Arc::new(Region::new(layout.aux_bytes() as usize)),
//! );
//! let engine = DecodeEngine::start(DecodeEngineConfig::new(layout), mem, rt.handle().clone())?;
//! let room = Room::new(1000).unwrap();
//! let handle = engine.open_room(room, "127.0.0.1:8998", vec![3, 4, 9], 0)?;
//! let (status, reason) = rt.block_on(handle.wait());
//! assert_eq!(status, KVPoll::Success, "{reason:?}");
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvx_bootstrap::http::BootstrapClient;
use kvx_core::decode::DecodeEvent;
use kvx_core::{KVPoll, Room};
use tokio::sync::{Notify, OnceCell, watch};
use tokio::task::JoinHandle;

use super::Topology;
use super::liveness::{heartbeat, ticker, watch_ranks};
use super::{DecodeStagingConfig, Peer, connect_prefill, lock, start_peer};
use crate::model::KvLayout;
use crate::plane::{Backend, DataPlane, RdmaOptions};
use crate::region::Region;

/// Settings of an embedded decode rank.
#[derive(Clone, Debug)]
pub struct DecodeEngineConfig {
    /// Host to bind the inbox and the data plane on, and to advertise.
    pub host: String,
    /// KV layout of the memory (must match the prefill's); its pool and aux sizes bound the
    /// pages and rows a room may name.
    pub layout: KvLayout,
    /// Decode attention-TP size.
    pub tp_size: u32,
    /// Decode attention-TP rank.
    pub tp_rank: u32,
    /// KV cache dtype the prefill must advertise (or none).
    pub kv_cache_dtype: String,
    /// Waiting timeout: a room not concluded this long after its metadata went out fails and is
    /// `ABORT`ed.
    pub waiting_timeout: Duration,
    /// Heartbeat period (at least 2 s is used).
    pub heartbeat_interval: Duration,
    /// Heartbeat misses before a prefill instance is dead (its rooms fail).
    pub heartbeat_max_failure: u32,
    /// ZMQ send timeout towards prefill ranks.
    pub zmq_send_timeout: Duration,
    /// How long an `ABORT`ed room's pages wait for every rank's `ABORT_ACK`.
    pub abort_release_timeout: Duration,
    /// Data-plane backend the prefill writes through (`Tcp`, `Mooncake`, `Verbs`, `Shm`).
    pub backend: Backend,
    /// The RDMA device of the `Verbs` backend.
    pub rdma: RdmaOptions,
    /// Names the engine's data plane and its own memory (with the `Shm` backend, the staging
    /// ring's `/dev/shm` file); `None`: `kvx-decode-engine-<pid>-<n>`.
    pub name: Option<String>,
    /// Sentinel tries (1 s apart) when resolving a bootstrap address.
    pub bootstrap_tries: u32,
    /// Send [`DecodeEngineEvent`]s to the receiver [`DecodeEngine::take_events`] returns.
    pub events: bool,
    /// A staging ring for rooms from a prefill of another attention-TP size (sglang's
    /// staging path: the prefill writes whole chunks into the ring, the engine scatters them
    /// into the room's pages before Success). The ring is the engine's own memory, allocated and
    /// registered at start (`ring_bytes`); `None`: such rooms take the per-head-slice path.
    pub staging: Option<DecodeStagingConfig>,
}

impl DecodeEngineConfig {
    /// A decode rank with `layout` on loopback, TP 1, sglang's timeouts, tcp, events on.
    pub fn new(layout: KvLayout) -> Self {
        DecodeEngineConfig {
            host: "127.0.0.1".into(),
            layout,
            tp_size: 1,
            tp_rank: 0,
            kv_cache_dtype: "auto".into(),
            waiting_timeout: Duration::from_secs(300),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_max_failure: 2,
            zmq_send_timeout: Duration::from_secs(1),
            abort_release_timeout: Duration::from_secs(30),
            backend: Backend::Tcp,
            rdma: RdmaOptions::default(),
            name: None,
            bootstrap_tries: 15,
            events: true,
            staging: None,
        }
    }
}

/// The caller's memory: the KV pool and the aux rows, laid out as
/// [`DecodeEngineConfig::layout`] says (KV buffers back to back from `kv.base()`, aux buffers
/// from `aux.base()`). Either may wrap the caller's own allocation ([`Region::from_raw`]); the
/// engine registers both with its data plane and never frees them.
#[derive(Clone, Debug)]
pub struct DecodeMemory {
    /// The KV pool (at least `layout.pool_bytes()` bytes).
    pub kv: Arc<Region>,
    /// The aux rows (at least `layout.aux_bytes()` bytes).
    pub aux: Arc<Region>,
}

impl DecodeMemory {
    /// Memory made of these two regions.
    pub fn new(kv: Arc<Region>, aux: Arc<Region>) -> Self {
        DecodeMemory { kv, aux }
    }
}

/// What the engine tells its embedder (with [`DecodeEngineConfig::events`]).
///
/// Deliberately not `#[non_exhaustive]`: an embedder must act on every event (pages are handed
/// back by them), so a new variant is a breaking change by design.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeEngineEvent {
    /// The room is terminal.
    Done {
        /// The room.
        room: Room,
        /// [`KVPoll::Success`] or [`KVPoll::Failed`].
        status: KVPoll,
        /// Why it failed (`None` on success).
        reason: Option<String>,
    },
    /// The room's pages and aux row are the caller's again.
    Released {
        /// The room.
        room: Room,
        /// The pages waited for every prefill rank's `ABORT_ACK` of the room (false: a
        /// successful room, a failure without `ABORT`, or the release timeout).
        acked: bool,
    },
}

/// A room's progress as its handle sees it.
#[derive(Clone, Debug, Default)]
struct Phase {
    outcome: Option<(KVPoll, Option<String>)>,
    /// `Some(acked)` once the pages are released.
    released: Option<bool>,
}

/// The engine's record of an open room (until it is released and its handle dropped).
struct Slot {
    phase: watch::Sender<Phase>,
    /// Set when the handle was dropped before the room was terminal.
    abandoned: Arc<Notify>,
    abandoned_flag: bool,
    handle_alive: bool,
}

/// Why a dropped handle's room failed.
const ABANDONED: &str = "room handle dropped before the room was terminal";

struct Inner {
    peer: Arc<Peer>,
    plane: Mutex<Option<DataPlane>>,
    rt: tokio::runtime::Handle,
    /// Resolved prefill instances by bootstrap address (`host:port`); a failed resolution is
    /// retried by the next room.
    prefills: Mutex<HashMap<String, Arc<OnceCell<Arc<Topology>>>>>,
    /// When each lost instance's bootstrap server was last asked whether it is back.
    revive_checks: Mutex<HashMap<String, Instant>>,
    rooms: Mutex<HashMap<Room, Slot>>,
    events: Option<Sender<DecodeEngineEvent>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    bootstrap_tries: u32,
}

/// One running decode rank (see the module docs).
pub struct DecodeEngine {
    inner: Arc<Inner>,
    events: Mutex<Option<Receiver<DecodeEngineEvent>>>,
    /// Drop runs [`DecodeEngine::shutdown`] (else [`DecodeEngine::close`]).
    wait_on_drop: bool,
}

/// A room opened with [`DecodeEngine::open_room`]. Dropping it before the room is terminal fails
/// the room (local abort); after, it only lets the engine forget the room once released.
pub struct RoomHandle {
    inner: Arc<Inner>,
    room: Room,
    phase: watch::Receiver<Phase>,
}

impl DecodeEngine {
    /// Registers `mem` with a data-plane server, binds the ZMQ inbox and the outbox, and starts
    /// the inbox reader and the room ticker on the runtime behind `rt`. Must not be called from
    /// within that runtime (it blocks on it); use [`DecodeEngine::start_async`] there.
    pub fn start(
        cfg: DecodeEngineConfig,
        mem: DecodeMemory,
        rt: tokio::runtime::Handle,
    ) -> Result<DecodeEngine> {
        rt.clone().block_on(Self::start_async(cfg, mem))
    }

    /// [`DecodeEngine::start`] from within a tokio runtime (the current one runs the engine).
    pub async fn start_async(cfg: DecodeEngineConfig, mem: DecodeMemory) -> Result<DecodeEngine> {
        let l = &cfg.layout;
        if mem.kv.len() < l.pool_bytes() {
            bail!(
                "KV region of {} bytes, the layout needs {}",
                mem.kv.len(),
                l.pool_bytes()
            );
        }
        if mem.aux.len() < l.aux_bytes() {
            bail!(
                "aux region of {} bytes, the layout needs {}",
                mem.aux.len(),
                l.aux_bytes()
            );
        }
        // A typed error (`MemoryError`, reachable with `downcast_ref`) before anything is bound.
        crate::memory::check(
            &mem.kv,
            &mem.aux,
            cfg.staging
                .is_some()
                .then_some("DecodeEngineConfig::staging"),
            crate::memory::DECODE_AUX,
        )?;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = cfg.name.clone().unwrap_or_else(|| {
            format!(
                "kvx-decode-engine-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            )
        });
        let (bootstrap_tries, events) = (cfg.bootstrap_tries, cfg.events);
        let (peer, plane) = start_peer(cfg, mem.kv, mem.aux, &name).await?;
        let (tx, rx) = std::sync::mpsc::channel();
        let inner = Arc::new(Inner {
            tasks: Mutex::new(vec![tokio::spawn(ticker(peer.clone()))]),
            peer,
            plane: Mutex::new(Some(plane)),
            rt: tokio::runtime::Handle::current(),
            prefills: Mutex::new(HashMap::new()),
            revive_checks: Mutex::new(HashMap::new()),
            rooms: Mutex::new(HashMap::new()),
            events: events.then_some(tx),
            bootstrap_tries,
        });
        Ok(DecodeEngine {
            inner,
            events: Mutex::new(events.then_some(rx)),
            wait_on_drop: true,
        })
    }

    /// Makes dropping the engine [`DecodeEngine::close`] it instead of
    /// [`DecodeEngine::shutdown`]: for a driver that owns its memory for the life of the
    /// process and drops the engine inside an async task, where `shutdown` must not block.
    pub fn close_on_drop(mut self) -> Self {
        self.wait_on_drop = false;
        self
    }

    /// Resolves the prefill instance whose bootstrap server is `bootstrap_addr` (`host:port`)
    /// now, as the first room naming it would (sentinel, rank routes, one registration per
    /// target rank; its heartbeat and rank watcher start): a decode that knows its prefill can
    /// learn of a bad address or mismatched layout before the first request.
    pub async fn resolve(&self, bootstrap_addr: &str) -> Result<()> {
        let client = bootstrap_client(bootstrap_addr)?;
        self.inner.topology(bootstrap_addr, &client).await.map(drop)
    }

    /// Stops at once, without failing rooms or waiting for the engine's tasks to let go of the
    /// memory: for a process that owns its memory and is about to exit (use
    /// [`DecodeEngine::shutdown`] to hand the memory back while the process lives on). Rooms'
    /// handles resolve `Failed`.
    pub fn close(&self) {
        let inner = &self.inner;
        if inner.peer.stop.swap(true, Ordering::Relaxed) {
            return;
        }
        for t in lock(&inner.tasks).drain(..) {
            t.abort();
        }
        drop(lock(&inner.plane).take());
        lock(&inner.rooms).clear();
    }

    /// Fails `room` locally with `reason` (if it is not terminal yet): `ABORT` to each of its
    /// prefill ranks, its pages held until every rank acknowledged, as for a waiting timeout.
    /// True when an `ABORT` went out.
    pub async fn abort_room(&self, room: Room, reason: &str) -> bool {
        let peer = &self.inner.peer;
        let aborts = peer.handle(DecodeEvent::LocalAbort { room }, Some(reason));
        let sent = !aborts.is_empty();
        peer.send_aborts(aborts).await;
        sent
    }

    /// Rooms opened and not terminal yet.
    pub fn open_rooms(&self) -> Vec<Room> {
        lock(&self.inner.peer.waiters).keys().copied().collect()
    }

    /// Counters since the engine started (see [`DecodeStats`]).
    pub fn stats(&self) -> DecodeStats {
        let p = &self.inner.peer;
        DecodeStats {
            dropped_messages: p.dropped.load(Ordering::Relaxed),
            aborted_rooms: p.aborted_rooms.load(Ordering::Relaxed),
            abort_acked_rooms: p.abort_acked_rooms.load(Ordering::Relaxed),
            late_writes: p.late_writes.load(Ordering::Relaxed),
            staged_chunks: p.stager.as_ref().map_or(0, |st| st.scattered()),
            staged_bytes_in_place: p.stager.as_ref().map_or(0, |st| st.placed_bytes()),
        }
    }

    /// Bytes of memory the engine allocated and registered itself (the staging ring, faulted
    /// in at start), beside the caller's [`DecodeMemory`].
    pub fn own_memory_bytes(&self) -> u64 {
        let stager = self.inner.peer.stager.as_ref();
        stager.and_then(|st| st.ring_info().size).unwrap_or(0)
    }

    /// The data-plane session id the prefill writes to (`ip:port`).
    pub fn session(&self) -> &str {
        self.inner.peer.session.as_str()
    }

    /// The ZMQ inbox prefill ranks send statuses, `ABORT_ACK`s and `AUX_DATA` to (what the
    /// registration and each room's metadata advertise).
    pub fn endpoint(&self) -> &kvx_core::Endpoint {
        &self.inner.peer.me
    }

    /// Opens `room`, received from the prefill instance whose bootstrap server is
    /// `bootstrap_addr` (`host:port`), into `kv_pages` of the KV pool and row `aux_row` of the
    /// aux buffers, which belong to the engine until the room is released. Returns at once; the
    /// room is `Bootstrapping` while its prefill is resolved (once per address) and its metadata
    /// sent, `WaitingForInput` after. Refused: a room already open (until released), pages or a
    /// row outside the memory, an address that is not `host:port`, a shut-down engine.
    pub fn open_room(
        &self,
        room: Room,
        bootstrap_addr: &str,
        kv_pages: Vec<i32>,
        aux_row: u64,
    ) -> Result<RoomHandle> {
        let l = &self.inner.peer.cfg.layout;
        if let Some(p) = kv_pages
            .iter()
            .find(|&&p| p < 0 || p as u64 >= l.pool_pages)
        {
            bail!("page {p} outside the KV pool of {} pages", l.pool_pages);
        }
        if aux_row >= l.aux_rows {
            bail!("aux row {aux_row} outside the {} rows", l.aux_rows);
        }
        let client = bootstrap_client(bootstrap_addr)?;
        if self.inner.peer.stop.load(Ordering::Relaxed) {
            bail!("decode engine shut down");
        }
        let (phase, rx) = watch::channel(Phase::default());
        let abandoned = Arc::new(Notify::new());
        {
            let mut rooms = lock(&self.inner.rooms);
            if rooms.contains_key(&room) {
                bail!("room {room} is already open");
            }
            rooms.insert(
                room,
                Slot {
                    phase,
                    abandoned: abandoned.clone(),
                    abandoned_flag: false,
                    handle_alive: true,
                },
            );
        }
        let task = self.inner.rt.spawn(room_task(
            self.inner.clone(),
            room,
            bootstrap_addr.to_owned(),
            client,
            kv_pages,
            aux_row,
            abandoned,
        ));
        let mut tasks = lock(&self.inner.tasks);
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
        Ok(RoomHandle {
            inner: self.inner.clone(),
            room,
            phase: rx,
        })
    }

    /// The room's status: `Bootstrapping`, `WaitingForInput`, then `Success` or `Failed`
    /// (sticky); `None` for a room not open, or released and its handle dropped.
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        self.inner.poll(room)
    }

    /// The event receiver (once; `None` afterwards or without [`DecodeEngineConfig::events`]).
    pub fn take_events(&self) -> Option<Receiver<DecodeEngineEvent>> {
        lock(&self.events).take()
    }

    /// Rooms the engine still holds (open, or failed and waiting to release their pages).
    pub fn live_rooms(&self) -> usize {
        lock(&self.inner.rooms)
            .values()
            .filter(|s| s.phase.borrow().released.is_none())
            .count()
    }

    /// Stops the engine: every room not yet terminal fails and is `ABORT`ed, room tasks and the
    /// heartbeats stop, the data plane deregisters the memory (nothing lands in it any more) and
    /// the engine forgets every room (handles' [`RoomHandle::wait`] resolves `Failed`); returns
    /// once no engine task touches the memory (at most a few seconds), after which all of it is
    /// the caller's again. Blocks: call it off the runtime's worker threads. Also run on drop.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        if inner.peer.stop.swap(true, Ordering::Relaxed) {
            return;
        }
        let open: Vec<Room> = lock(&inner.peer.waiters).keys().copied().collect();
        let peer = inner.peer.clone();
        let abort = inner.rt.spawn(async move {
            for room in open {
                let aborts = peer.handle(
                    DecodeEvent::LocalAbort { room },
                    Some("decode engine shut down"),
                );
                peer.send_aborts(aborts).await;
            }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while !abort.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for t in lock(&inner.tasks).drain(..) {
            t.abort();
        }
        // The inbox reader leaves within its 100 ms poll; aborted tasks let go of the peer.
        while Arc::strong_count(&inner.peer) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(lock(&inner.plane).take());
        // Handles still held learn of it: `wait` resolves Failed, `wait_released` false.
        lock(&inner.rooms).clear();
    }
}

/// A client of the bootstrap server at `addr` (`host:port`).
fn bootstrap_client(addr: &str) -> Result<BootstrapClient> {
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        .with_context(|| format!("bootstrap address {addr:?} is not host:port"))?;
    Ok(BootstrapClient::new(host, port)?)
}

/// What a decode engine counted since it started ([`DecodeEngine::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DecodeStats {
    /// Inbox messages dropped as malformed or not for this decode (counted and logged).
    pub dropped_messages: u64,
    /// Failed rooms whose `ABORT` went out.
    pub aborted_rooms: u64,
    /// Of those, rooms every prefill rank acknowledged before the release timeout.
    pub abort_acked_rooms: u64,
    /// Writes seen in an acknowledged room's pages after its last `ABORT_ACK` (always 0 with a
    /// device KV pool, whose pages the CPU does not read).
    pub late_writes: u64,
    /// Staged chunks landed in rooms' pages (scattered from the staging ring or received in
    /// place).
    pub staged_chunks: u64,
    /// Bytes of staged blocks received straight into rooms' pages, not copied out of the ring
    /// ([`crate::decode::DecodeStagingConfig::in_place`]).
    pub staged_bytes_in_place: u64,
}

impl Drop for DecodeEngine {
    fn drop(&mut self) {
        if self.wait_on_drop {
            self.shutdown();
        } else {
            self.close();
        }
    }
}

impl RoomHandle {
    /// The room.
    pub fn room(&self) -> Room {
        self.room
    }

    /// The room's status (see [`DecodeEngine::poll`]; `Failed` once the engine shut down).
    pub fn poll(&self) -> KVPoll {
        self.inner.poll(self.room).unwrap_or(KVPoll::Failed)
    }

    /// Resolves once the room is terminal: its status and, when failed, the reason.
    pub async fn wait(&self) -> (KVPoll, Option<String>) {
        let mut rx = self.phase.clone();
        match rx.wait_for(|p| p.outcome.is_some()).await {
            Ok(p) => p.outcome.clone().unwrap_or((KVPoll::Failed, None)),
            Err(_) => (KVPoll::Failed, Some("decode engine shut down".into())),
        }
    }

    /// Resolves once the room's pages and aux row are the caller's again; true when they
    /// waited for every prefill rank's `ABORT_ACK` (see [`DecodeEngineEvent::Released`]).
    pub async fn wait_released(&self) -> bool {
        let mut rx = self.phase.clone();
        match rx.wait_for(|p| p.released.is_some()).await {
            Ok(p) => p.released.unwrap_or(false),
            Err(_) => false,
        }
    }
}

impl Drop for RoomHandle {
    fn drop(&mut self) {
        let mut rooms = lock(&self.inner.rooms);
        let Some(slot) = rooms.get_mut(&self.room) else {
            return;
        };
        slot.handle_alive = false;
        let phase = slot.phase.borrow().clone();
        if phase.released.is_some() {
            rooms.remove(&self.room);
        } else if phase.outcome.is_none() {
            slot.abandoned_flag = true;
            slot.abandoned.notify_one();
        }
    }
}

impl Inner {
    fn poll(&self, room: Room) -> Option<KVPoll> {
        let rooms = lock(&self.rooms);
        let slot = rooms.get(&room)?;
        if let Some((status, _)) = &slot.phase.borrow().outcome {
            return Some(*status);
        }
        drop(rooms);
        Some(
            lock(&self.peer.rooms)
                .poll(room)
                .unwrap_or(KVPoll::Bootstrapping),
        )
    }

    fn emit(&self, event: DecodeEngineEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }

    /// Records the room's outcome and tells the embedder.
    fn conclude(&self, room: Room, status: KVPoll, reason: Option<String>) {
        if let Some(slot) = lock(&self.rooms).get(&room) {
            slot.phase
                .send_modify(|p| p.outcome = Some((status, reason.clone())));
        }
        crate::timeline::stage!(room, "done");
        self.emit(DecodeEngineEvent::Done {
            room,
            status,
            reason,
        });
    }

    /// Hands the room's pages back; the engine forgets the room once its handle is gone too.
    fn release(&self, room: Room, acked: bool) {
        {
            let mut rooms = lock(&self.rooms);
            if let Some(slot) = rooms.get(&room) {
                slot.phase.send_modify(|p| p.released = Some(acked));
                if !slot.handle_alive {
                    rooms.remove(&room);
                }
            }
        }
        self.emit(DecodeEngineEvent::Released { room, acked });
    }

    fn abandoned(&self, room: Room) -> bool {
        lock(&self.rooms)
            .get(&room)
            .is_some_and(|s| s.abandoned_flag)
    }

    /// The prefill instance at `addr`, resolved once (registrations sent, heartbeat started).
    async fn topology(
        self: &Arc<Self>,
        addr: &str,
        client: &BootstrapClient,
    ) -> Result<Arc<Topology>> {
        let lost = {
            let prefills = lock(&self.prefills);
            prefills
                .get(addr)
                .and_then(|c| c.get().cloned())
                .filter(|t| t.dead.load(Ordering::Relaxed))
        };
        // A lost instance (heartbeats failed) is resolved again once its bootstrap server
        // answers: its ranks may be back, at other inboxes, and need this decode's registration
        // again. Until then its rooms fail at once, and a background task asks the server at
        // most every REVIVE_CHECK_PERIOD (each within REVIVE_CHECK_TIMEOUT) whether it is back.
        if let Some(dead) = lost {
            let now = Instant::now();
            let due = {
                let mut checks = lock(&self.revive_checks);
                let due = checks
                    .get(addr)
                    .is_none_or(|at| now.saturating_duration_since(*at) >= REVIVE_CHECK_PERIOD);
                if due {
                    checks.insert(addr.to_owned(), now);
                }
                due
            };
            if due {
                let (inner, client, addr) = (self.clone(), client.clone(), addr.to_owned());
                let dead = dead.clone();
                let task = tokio::spawn(async move {
                    let back = matches!(
                        tokio::time::timeout(REVIVE_CHECK_TIMEOUT, client.health()).await,
                        Ok(Ok(()))
                    );
                    if !back {
                        return;
                    }
                    tracing::info!(bootstrap_addr = %addr, "lost prefill instance answers again: the next room resolves it");
                    let mut prefills = lock(&inner.prefills);
                    if let Some(cell) = prefills.get_mut(&addr)
                        && cell.get().is_some_and(|t| Arc::ptr_eq(t, &dead))
                    {
                        *cell = Arc::default();
                    }
                });
                let mut tasks = lock(&self.tasks);
                tasks.retain(|t| !t.is_finished());
                tasks.push(task);
            }
            return Ok(dead);
        }
        let cell = lock(&self.prefills)
            .entry(addr.to_owned())
            .or_default()
            .clone();
        let topo = cell
            .get_or_try_init(|| async {
                let tries = self.bootstrap_tries;
                let topo =
                    Arc::new(connect_prefill(&self.peer, client, addr.to_owned(), tries).await?);
                let hb = tokio::spawn(heartbeat(self.peer.clone(), client.clone(), topo.clone()));
                let watch =
                    tokio::spawn(watch_ranks(self.peer.clone(), client.clone(), topo.clone()));
                lock(&self.tasks).extend([hb, watch]);
                anyhow::Ok(topo)
            })
            .await?;
        Ok(topo.clone())
    }
}

/// How often a lost prefill instance's bootstrap server is asked whether it is back.
const REVIVE_CHECK_PERIOD: Duration = Duration::from_secs(2);

/// How long that question may take.
const REVIVE_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// One room, from its prefill's resolution to the release of its pages.
async fn room_task(
    inner: Arc<Inner>,
    room: Room,
    addr: String,
    client: BootstrapClient,
    pages: Vec<i32>,
    row: u64,
    abandoned: Arc<Notify>,
) {
    let topo = match inner.topology(&addr, &client).await {
        Ok(t) => t,
        Err(e) => {
            let why = format!("prefill at {addr}: {e:#}");
            inner.conclude(room, KVPoll::Failed, Some(why));
            inner.release(room, false);
            return;
        }
    };
    // A rank known down: its route is looked at again now; the room waits for it as long as
    // a resolution would (the rank may be restarting), then fails.
    if topo.down_target().is_some() {
        topo.check.notify_one();
        let deadline =
            Instant::now() + Duration::from_secs(u64::from(inner.bootstrap_tries.max(1)));
        while topo.down_target().is_some()
            && Instant::now() < deadline
            && !inner.abandoned(room)
            && !topo.dead.load(Ordering::Relaxed)
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Nothing went out for the room yet: a dropped handle or a dead prefill fails it quietly.
    let early = if inner.abandoned(room) {
        Some(ABANDONED.to_owned())
    } else if topo.dead.load(Ordering::Relaxed) {
        Some("Lost connection with prefill instance".to_owned())
    } else if let Some(t) = topo.down_target() {
        Some(format!(
            "prefill rank {} at {} unreachable (its route is being resolved again)",
            t.tp_rank, t.endpoint
        ))
    } else {
        None
    };
    if let Some(why) = early {
        inner.conclude(room, KVPoll::Failed, Some(why));
        inner.release(room, false);
        return;
    }
    let peer = inner.peer.clone();
    let drive = peer.drive_room(&topo, room, &pages, row);
    tokio::pin!(drive);
    let mut watching = true;
    let (outcome, staged) = loop {
        tokio::select! {
            // The room is driven first: once it was polled, the manager knows the room and a
            // local abort finds it.
            biased;
            r = &mut drive => break r,
            () = abandoned.notified(), if watching => {
                watching = false;
                let aborts = peer.handle(DecodeEvent::LocalAbort { room }, Some(ABANDONED));
                peer.send_aborts(aborts).await;
            }
        }
    };
    match outcome {
        Ok(()) => {
            inner.conclude(room, KVPoll::Success, None);
            inner.release(room, false);
        }
        Err(reason) => {
            tracing::warn!(%room, %reason, "room failed");
            inner.conclude(room, KVPoll::Failed, Some(reason));
            let acked = peer.settle_room(room, &pages, &topo, staged).await;
            inner.release(room, acked);
        }
    }
}
