//! The prefill sender as a library: one [`PrefillEngine`] is one prefill rank.
//!
//! It binds the rank's ZMQ inbox (sglang's PULL socket), feeds every decode message, sender call,
//! completion and clock tick into `kvx-core`'s [`PrefillManager`] (the deterministic room state
//! machine and planner) and performs its actions: batches go to transfer workers on sharded
//! queues under a supervisor; status and `ABORT_ACK` messages go out from one notifier thread
//! that never blocks a worker. Towards a decode of another attention-TP size that advertises a
//! staging ring, and with [`PrefillConfig::staging`] on, chunks travel through the decode's ring
//! instead (see [`crate::prefill_staging`]). An embedding
//! engine registers its memory once ([`PrefillMemory`]), opens rooms, hands chunks to
//! [`PrefillEngine::send`] as its forward pass finishes them and polls [`PrefillEngine::poll`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvx_cli::engine::{PrefillConfig, PrefillEngine, PrefillMemory};
//! use kvx_cli::region::Region;
//! use kvx_core::{Chunk, KVPoll, PageSlice, Room};
//!
//! let kv = Arc::new(Region::new(64 * 4096));
//! let aux = Arc::new(Region::new(64 * 64));
//! // One layer: a K and a V buffer of 32 pages of 4 KiB each; one aux buffer of 8-byte room rows.
//! let kv_ptrs = vec![kv.base(), kv.base() + 32 * 4096];
//! let mem = PrefillMemory::new(kv.clone(), kv_ptrs, 4096, aux.clone(), vec![aux.base()], vec![8]);
//! let rt = tokio::runtime::Runtime::new().unwrap();
//! let engine = PrefillEngine::start(PrefillConfig::default(), mem, rt.handle().clone()).unwrap();
//! let room = Room::new(42).unwrap();
//! engine.open_room(room).unwrap(); // the request arrived: the sender exists
//! engine.init_room(room, 2, 0).unwrap(); // 2 pages, this rank's aux row 0
//! // ... once the decode's metadata arrived:
//! if engine.poll(room) == Some(KVPoll::WaitingForInput) {
//!     engine.send(room, Chunk::new(PageSlice::new(0, 2).unwrap(), vec![3, 4]).last()).unwrap();
//! }
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, SocketError, zmq};
use kvx_core::prefill::{LocalMemory, PrefillAction, PrefillError, PrefillEvent, PrefillManager};
use kvx_core::{AuxLayout, BatchLimits, Chunk, Endpoint, KVPoll, Room, SessionId, StateComponent};
use kvx_staging::ChunkGrid;

use crate::fault::TransferThreadFailed;
use crate::plane::DataPlane;
use crate::prefill_staging::{LocalShape, StagingDriver};
use crate::region::Region;
use crate::wire::{self, PrefillInbound};
use crate::worker::{self, Job, JobQueue, Work};

mod notifier;
mod staging;

pub(crate) use notifier::Notice;
use notifier::notifier;

/// Settings of one prefill rank.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// Host to bind the inbox on and advertise.
    pub host: String,
    /// Inbox port (0: random).
    pub inbox_port: u16,
    /// The instance's bootstrap port (named in the dead-worker message).
    pub bootstrap_port: u16,
    /// Transfer queues (= worker threads).
    pub queues: usize,
    /// Most writes per batch.
    pub max_batch_ops: usize,
    /// About the most bytes per batch.
    pub max_batch_bytes: u64,
    /// Rooms stuck in Bootstrapping longer than this fail.
    pub bootstrap_timeout: Duration,
    /// Restart a dead worker instead of stopping the rank.
    pub restart_workers: bool,
    /// Attention-TP rank of this prefill rank.
    pub tp_rank: u32,
    /// Attention-TP size of the prefill instance.
    pub tp_size: u32,
    /// KV heads of the whole model (for head-slice plans towards a different decode TP).
    pub total_kv_heads: u32,
    /// Create the sender of every room a decode announces (the synthetic forward pass) instead
    /// of waiting for [`PrefillEngine::open_room`].
    pub auto_open: bool,
    /// Deliver [`EngineEvent`]s through [`PrefillEngine::take_events`].
    pub events: bool,
    /// Data-plane connect and I/O timeout.
    pub connect_timeout: Duration,
    /// Data-plane connections per decode session.
    pub connections: usize,
    /// Tokens per KV page.
    pub page_size: u32,
    /// Data-plane backend (default `auto`: per decode session, Mooncake TE or kvx tcp).
    pub backend: crate::plane::Backend,
    /// Send through decodes' staging rings where they advertise one and the attention-TP sizes
    /// differ (sglang's `SGLANG_DISAGG_STAGING_BUFFER`); otherwise per-token head slices.
    pub staging: bool,
    /// `chunked_prefill_size` in tokens: the staging chunk grid (must match the decode's).
    pub chunked_prefill_size: i64,
    /// A staged chunk that waits longer than this for ring space fails its room.
    pub staging_wait_timeout: Duration,
    /// Send aux rows as `AUX_DATA` messages on the control plane instead of writing them
    /// (sglang's `SGLANG_MOONCAKE_SEND_AUX_TCP`).
    pub aux_over_tcp: bool,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            host: "127.0.0.1".into(),
            inbox_port: 0,
            bootstrap_port: 8998,
            queues: 4,
            max_batch_ops: 1024,
            max_batch_bytes: 64 << 20,
            bootstrap_timeout: Duration::from_secs(300),
            restart_workers: false,
            tp_rank: 0,
            tp_size: 1,
            total_kv_heads: 1,
            auto_open: false,
            events: false,
            connect_timeout: Duration::from_secs(10),
            connections: 2,
            page_size: 16,
            backend: crate::plane::Backend::Auto,
            staging: false,
            chunked_prefill_size: kvx_staging::grid::DEFAULT_CHUNKED_PREFILL_SIZE,
            staging_wait_timeout: Duration::from_secs(60),
            aux_over_tcp: false,
        }
    }
}

/// The memory a prefill rank registers once: KV buffers, aux rows and state components.
#[derive(Clone, Debug)]
pub struct PrefillMemory {
    /// MLA (one latent buffer per layer) instead of MHA (K layers then V layers).
    pub mla: bool,
    /// The region holding every KV buffer.
    pub kv: Arc<Region>,
    /// One address per KV buffer.
    pub kv_ptrs: Vec<u64>,
    /// Bytes per page of one KV buffer.
    pub item_len: u64,
    /// The region holding the aux rows.
    pub aux: Arc<Region>,
    /// One address per aux buffer.
    pub aux_ptrs: Vec<u64>,
    /// Bytes per row of each aux buffer; the last buffer's rows carry the room (at least 8
    /// bytes, sglang's `bootstrap_room`).
    pub aux_item_lens: Vec<u64>,
    /// State components (MAMBA slots, SWA pages, …; empty for plain models), in the order the
    /// decode registers its state buffers. Chunks name their indices in `src_state`.
    pub state: Vec<StateComponent>,
    /// The regions holding the state buffers (registered with the KV and aux regions).
    pub state_regions: Vec<Arc<Region>>,
}

impl PrefillMemory {
    /// Marks the KV buffers as MLA latents (one per layer).
    #[must_use]
    pub fn mla(mut self, mla: bool) -> Self {
        self.mla = mla;
        self
    }

    /// Adds state components whose buffers live in `regions`.
    #[must_use]
    pub fn with_state(
        mut self,
        regions: Vec<Arc<Region>>,
        components: Vec<StateComponent>,
    ) -> Self {
        self.state_regions = regions;
        self.state = components;
        self
    }

    /// The KV layout the planner pairs against a decode's.
    pub fn kv_layout(&self, page_size: u32) -> kvx_core::KvLayout {
        let bufs: Vec<kvx_core::Buffer> = self
            .kv_ptrs
            .iter()
            .map(|&p| kvx_core::Buffer::remote(p, self.item_len))
            .collect();
        if self.mla {
            kvx_core::KvLayout::mla(bufs, page_size)
        } else {
            let half = bufs.len() / 2;
            let (k, v) = bufs.split_at(half);
            kvx_core::KvLayout::mha(k.to_vec(), v.to_vec(), page_size)
        }
    }

    /// Bundles the registered memory.
    pub fn new(
        kv: Arc<Region>,
        kv_ptrs: Vec<u64>,
        item_len: u64,
        aux: Arc<Region>,
        aux_ptrs: Vec<u64>,
        aux_item_lens: Vec<u64>,
    ) -> Self {
        PrefillMemory {
            mla: false,
            kv,
            kv_ptrs,
            item_len,
            aux,
            aux_ptrs,
            aux_item_lens,
            state: Vec::new(),
            state_regions: Vec::new(),
        }
    }
}

/// What the engine tells its embedder (when `events` is on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// Every decode of the room sent metadata; the room has `pages` destination pages.
    Ready {
        /// The room.
        room: Room,
        /// Destination pages.
        pages: usize,
    },
    /// The room is terminal and nothing of it is in flight: its source pages are free.
    Released {
        /// The room.
        room: Room,
        /// Final status.
        status: KVPoll,
    },
}

/// Why the engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The inbox could not be bound.
    #[error("inbox: {0}")]
    Socket(#[from] SocketError),
    /// A thread could not be spawned.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The data plane refused the memory.
    #[error("transport: {0}")]
    Transport(#[from] kvx_rdma::TransportError),
    /// The memory layout or limits are unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// The aux layout is unusable.
    #[error("aux layout: {0}")]
    Layout(#[from] kvx_core::LayoutError),
}

/// Rooms as the driver tracks them beside the manager.
#[derive(Default)]
struct RoomSets {
    /// Every room the manager may hold (for gauges).
    known: HashSet<Room>,
    /// Rooms announced to the forward pass.
    announced: HashSet<Room>,
    /// Rooms concluded whose entries the manager still holds.
    concluded: HashMap<Room, KVPoll>,
    /// The decode sessions each room's metadata named, with their inbox endpoints and whether
    /// they receive KV (not dummies).
    sessions: HashMap<Room, Vec<(SessionId, Endpoint, bool)>>,
}

/// State shared by the engine's threads.
pub(crate) struct Shared {
    pub(crate) cfg: PrefillConfig,
    pub(crate) mem: PrefillMemory,
    pub(crate) table: Mutex<PrefillManager>,
    rooms: Mutex<RoomSets>,
    queues: Vec<Sender<Job>>,
    pub(crate) stop: AtomicBool,
    pub(crate) plane: DataPlane,
    pub(crate) rt: tokio::runtime::Handle,
    notices: Mutex<Sender<Notice>>,
    events: Option<Mutex<Sender<EngineEvent>>>,
    fatal: Mutex<Option<Arc<TransferThreadFailed>>>,
    fatal_tx: Mutex<Sender<Arc<TransferThreadFailed>>>,
    /// The staging driver (with [`PrefillConfig::staging`]).
    pub(crate) staging: Option<Mutex<StagingDriver>>,
    /// One registered staging buffer per transfer queue (gather target of its worker).
    pub(crate) stage_bufs: Vec<Arc<Region>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Feeds one event to the room manager under its lock and performs the actions.
    pub(crate) fn handle(&self, event: PrefillEvent) -> Result<(), PrefillError> {
        let mut out = Vec::new();
        let mut m = lock(&self.table);
        let r = m.handle(Instant::now(), event, &mut out);
        // Rooms whose entries the manager dropped are released: their pages may be reused.
        let mut rooms = lock(&self.rooms);
        for a in &out {
            if let PrefillAction::Concluded { room, status, .. } = a {
                rooms.concluded.insert(*room, *status);
            }
        }
        let released: Vec<(Room, KVPoll)> = rooms
            .concluded
            .iter()
            .filter(|(room, _)| m.poll(**room).is_none())
            .map(|(r, s)| (*r, *s))
            .collect();
        for (room, _) in &released {
            rooms.concluded.remove(room);
            rooms.announced.remove(room);
        }
        rooms.known.retain(|r| m.poll(*r).is_some());
        rooms.sessions.retain(|r, _| m.poll(*r).is_some());
        drop(rooms);
        drop(m);
        self.apply(out);
        for (room, status) in released {
            self.event(EngineEvent::Released { room, status });
        }
        r
    }

    /// Fails at once every open room whose metadata names `session`, a decode session just found
    /// dead: without this, each such room would wait for its next chunk (or, behind a forward
    /// pass short of pages, for its turn to compute) before failing. The room's other decodes
    /// are told (status 0) as sglang tells them when a room fails on a dead session, the dead one
    /// included (its inbox may outlive its data plane).
    pub(crate) fn fail_session_rooms(&self, session: &SessionId, reason: &str) {
        let affected: Vec<(Room, Vec<(SessionId, Endpoint)>)> = lock(&self.rooms)
            .sessions
            .iter()
            .filter(|(_, ss)| ss.iter().any(|(s, _, real)| *real && s == session))
            .map(|(room, ss)| {
                let targets = ss
                    .iter()
                    .filter(|(_, _, real)| *real)
                    .map(|(s, e, _)| (s.clone(), e.clone()))
                    .collect();
                (*room, targets)
            })
            .collect();
        for (room, targets) in affected {
            if self.fail_room_with(room, targets, reason) {
                metrics::counter!("kvx_rooms_failed_with_session_total").increment(1);
                tracing::warn!(%room, %session, reason, "room failed: its decode session is dead");
            }
        }
    }

    /// Fails an open room from this side and tells every decode that receives its KV
    /// (status 0). False when the room was not open.
    pub(crate) fn fail_room(&self, room: Room, reason: &str) -> bool {
        self.fail_room_and(room, reason, None)
    }

    /// [`Shared::fail_room`], telling `also` (a session known to take part, e.g. the one whose
    /// write failed) even if the room's session list does not name it.
    pub(crate) fn fail_room_and(
        &self,
        room: Room,
        reason: &str,
        also: Option<(SessionId, Endpoint)>,
    ) -> bool {
        let mut targets: Vec<(SessionId, Endpoint)> = lock(&self.rooms)
            .sessions
            .get(&room)
            .map(|ss| {
                ss.iter()
                    .filter(|(_, _, real)| *real)
                    .map(|(s, e, _)| (s.clone(), e.clone()))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(t) = also
            && !targets.iter().any(|(s, _)| *s == t.0)
        {
            targets.push(t);
        }
        let failed = self.fail_room_with(room, targets, reason);
        if failed {
            tracing::warn!(%room, reason, "room failed");
        }
        failed
    }

    /// Fails an open room and sends status 0 to each target; `reason` goes as a 4th frame to
    /// the sessions known to take one (sglang 0.5.23), never to the others.
    fn fail_room_with(
        &self,
        room: Room,
        targets: Vec<(SessionId, Endpoint)>,
        reason: &str,
    ) -> bool {
        let live = lock(&self.table)
            .poll(room)
            .is_some_and(|p| !p.is_terminal());
        let event = PrefillEvent::SenderFailed {
            room,
            reason: reason.to_owned(),
        };
        if !live || self.handle(event).is_err() {
            return false;
        }
        for (session, endpoint) in targets {
            self.send_failed(room, &session, endpoint, reason);
        }
        true
    }

    /// The transfer queue of a decode session: all chunks of a room stay on one queue, in order.
    pub(crate) fn shard_of(&self, session: &SessionId) -> usize {
        (session.port().unwrap_or(0) % self.queues.len().max(1) as u64) as usize
    }

    /// Queues a message for the notifier (sent in order after every earlier one).
    pub(crate) fn notify(&self, notice: Notice) {
        let _ = lock(&self.notices).send(notice);
    }

    /// Queues status 0 for `session`'s decode at `endpoint`, with `reason` as a 4th frame when
    /// that decode is known to take one (sglang 0.5.23), as 3 frames otherwise.
    pub(crate) fn send_failed(
        &self,
        room: Room,
        session: &SessionId,
        endpoint: Endpoint,
        reason: &str,
    ) {
        let with_reason = lock(&self.table).accepts_status_reason(session);
        let reason = with_reason.then_some(reason);
        self.send_status_with(room, endpoint, KVPoll::Failed, reason);
    }

    /// Queues a status message for the notifier: 3 frames, or 4 with `reason` (only for a
    /// decode known to take a reason frame; see `PrefillAction::SendStatus::with_reason`).
    pub(crate) fn send_status_with(
        &self,
        room: Room,
        endpoint: Endpoint,
        status: KVPoll,
        reason: Option<&str>,
    ) {
        metrics::counter!("kvx_status_sent_total", "status" => status.to_string()).increment(1);
        if reason.is_some() {
            metrics::counter!("kvx_status_reason_frames_total").increment(1);
        }
        let rank = lock(&self.table).prefill_unique_rank();
        let f = wire::encode_status_with_reason(room, status, rank, reason);
        let _ = lock(&self.notices).send(Notice::Send(endpoint, f));
    }

    /// Performs the manager's actions.
    fn apply(&self, actions: Vec<PrefillAction>) {
        for a in actions {
            match a {
                PrefillAction::PostBatch {
                    room,
                    session,
                    batch_id,
                    ops,
                    ..
                } => {
                    let shard = self.shard_of(&session);
                    let job = Job {
                        room,
                        session,
                        work: Work::Batch { batch_id, ops },
                    };
                    if self.queues[shard].send(job).is_err() {
                        let _ = self.handle(PrefillEvent::BatchDone {
                            batch_id,
                            result: Err("transfer queue closed".into()),
                        });
                    }
                }
                PrefillAction::Stage {
                    room,
                    session,
                    batch_id,
                    slice,
                    src_pages,
                    ..
                } => {
                    let now = Instant::now();
                    let staged = self.with_staging(|d, fx| {
                        d.stage(now, room, &session, batch_id, slice, &src_pages, fx);
                    });
                    if staged.is_none() {
                        let _ = self.handle(PrefillEvent::BatchDone {
                            batch_id,
                            result: Err("staging is off on this prefill rank".into()),
                        });
                    }
                }
                PrefillAction::FillRoomRow { room, addr, len } => {
                    let _ = self
                        .mem
                        .aux
                        .write_with(addr, len, |row| kvx_core::fill_room_row(row, room));
                }
                PrefillAction::SendAuxData {
                    room,
                    endpoint,
                    index,
                    dst_row,
                    src_addr,
                    len,
                } => {
                    // The row (its room slot filled just before) goes on the notifier's socket
                    // to this decode, ahead of the room's status.
                    let frames = self.mem.aux.read(src_addr, len).map_err(|e| e.to_string());
                    let frames = frames.and_then(|row| {
                        let index = u32::try_from(index).map_err(|e| e.to_string())?;
                        wire::encode_aux_data(room, index, dst_row, row).map_err(|e| e.to_string())
                    });
                    match frames {
                        Ok(f) => {
                            metrics::counter!("kvx_aux_messages_total").increment(1);
                            self.notify(Notice::Send(endpoint, f));
                        }
                        Err(e) => tracing::error!(%room, error = %e, "AUX_DATA not sent"),
                    }
                }
                PrefillAction::SendStatus {
                    room,
                    endpoint,
                    status,
                    reason,
                    with_reason,
                    ..
                } => {
                    let reason = reason.as_deref().filter(|_| with_reason);
                    self.send_status_with(room, endpoint, status, reason);
                }
                PrefillAction::AbortAck {
                    endpoint,
                    room,
                    prefill_rank,
                    generation,
                } => {
                    // 4 frames echoing a 5-frame ABORT's generation (sglang 0.5.23), else the
                    // ranked 3-frame form of sglang main.
                    let form = if generation.is_some() { "4" } else { "3" };
                    metrics::counter!("kvx_abort_acks_total", "frames" => form).increment(1);
                    let frames = wire::encode_abort_ack(room, prefill_rank, generation);
                    let _ = lock(&self.notices).send(Notice::Send(endpoint, frames));
                }
                PrefillAction::Concluded {
                    room,
                    status,
                    reason,
                } => {
                    if status == KVPoll::Failed {
                        metrics::counter!("kvx_room_failures_total").increment(1);
                        if let Some(r) = &reason {
                            tracing::warn!(%room, reason = %r, "room failed");
                        }
                    }
                    metrics::counter!("kvx_rooms_finished_total", "status" => status.to_string())
                        .increment(1);
                    self.with_staging(|d, fx| d.conclude(room, fx));
                }
            }
        }
    }

    fn event(&self, e: EngineEvent) {
        if let Some(tx) = &self.events {
            let _ = lock(tx).send(e);
        }
    }

    /// Waits (bounded) until every queued notice went out to ZMQ.
    pub(crate) fn flush_notices(&self, timeout: Duration) {
        let (tx, rx) = std::sync::mpsc::channel();
        let _ = lock(&self.notices).send(Notice::Flush(tx));
        let _ = rx.recv_timeout(timeout);
        // ZMQ writes asynchronously; give its I/O thread a moment on loopback.
        std::thread::sleep(Duration::from_millis(200));
    }

    pub(crate) fn set_fatal(&self, err: TransferThreadFailed) {
        let err = Arc::new(err);
        lock(&self.fatal).get_or_insert_with(|| err.clone());
        let _ = lock(&self.fatal_tx).send(err);
    }
}

/// One running prefill rank.
pub struct PrefillEngine {
    shared: Arc<Shared>,
    endpoint: Endpoint,
    events: Mutex<Option<Receiver<EngineEvent>>>,
    fatal_rx: Mutex<Receiver<Arc<TransferThreadFailed>>>,
}

impl PrefillEngine {
    /// Registers the memory with a tcp data plane, binds the inbox, starts the workers, the
    /// supervisor, the notifier and the timer. Transfers run on the runtime behind `rt`.
    pub fn start(
        cfg: PrefillConfig,
        mem: PrefillMemory,
        rt: tokio::runtime::Handle,
    ) -> Result<PrefillEngine, EngineError> {
        let name = format!("kvx-prefill-{}-{}", std::process::id(), cfg.tp_rank);
        let page_size = u64::from(cfg.page_size.max(1));
        let grid = ChunkGrid::new(Some(cfg.chunked_prefill_size), page_size)
            .ok_or_else(|| EngineError::Config("page size 0".into()))?;
        // sglang's size: one full grid chunk of every local KV buffer (this rank's heads bound
        // every slice it stages). Zeroed lazily by the allocator: untouched pages cost nothing.
        let stage_bufs: Vec<Arc<Region>> = if cfg.staging && !mem.mla {
            let len = grid
                .full_chunk_pages()
                .checked_mul(mem.item_len)
                .and_then(|b| b.checked_mul(mem.kv_ptrs.len() as u64))
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| EngineError::Config("staging buffer size overflows".into()))?;
            (0..cfg.queues.max(1))
                .map(|_| Arc::new(Region::new(len)))
                .collect()
        } else {
            Vec::new()
        };
        let mut regions = vec![mem.kv.clone(), mem.aux.clone()];
        regions.extend(mem.state_regions.iter().cloned());
        regions.extend(stage_bufs.iter().cloned());
        let plane = DataPlane::client(cfg.backend, &name, cfg.connections, regions)?;
        let ctx = zmq::Context::new();
        let inbox = Inbox::bind(
            &ctx,
            InboxConfig {
                port: (cfg.inbox_port != 0).then_some(cfg.inbox_port),
                ..InboxConfig::new(cfg.host.clone(), InboxKind::Prefill)
            },
        )?;
        let endpoint = inbox.endpoint().clone();

        let (notice_tx, notice_rx) = std::sync::mpsc::channel();
        let (events_tx, events_rx) = std::sync::mpsc::channel();
        let (fatal_tx, fatal_rx) = std::sync::mpsc::channel();
        let mut senders = Vec::new();
        let mut queues: Vec<JobQueue> = Vec::new();
        for _ in 0..cfg.queues.max(1) {
            let (tx, rx) = std::sync::mpsc::channel();
            senders.push(tx);
            queues.push(Arc::new(Mutex::new(rx)));
        }
        let local = LocalMemory {
            kv: mem.kv_layout(cfg.page_size),
            aux: AuxLayout::new(
                &mem.aux_ptrs,
                &mem.aux_item_lens,
                mem.aux_item_lens.len().saturating_sub(1),
                None,
            )?,
            state: mem.state.clone(),
        };
        let mcfg = kvx_core::PrefillConfig {
            attn_tp_rank: cfg.tp_rank,
            attn_tp_size: cfg.tp_size.max(1),
            total_kv_heads: cfg.total_kv_heads.max(1),
            bootstrap_timeout: cfg.bootstrap_timeout,
            batch_limits: BatchLimits::new(cfg.max_batch_ops.max(1), cfg.max_batch_bytes.max(1))
                .map_err(|e| EngineError::Config(e.to_string()))?,
            staging: !stage_bufs.is_empty(),
            aux_over_tcp: cfg.aux_over_tcp,
            ..kvx_core::PrefillConfig::default()
        };
        let staging = (!stage_bufs.is_empty()).then(|| {
            let shape = LocalShape {
                tp_rank: cfg.tp_rank,
                tp_size: cfg.tp_size.max(1),
                total_kv_heads: cfg.total_kv_heads.max(1),
                page_size,
                item_len: mem.item_len,
                num_buffers: mem.kv_ptrs.len(),
            };
            Mutex::new(StagingDriver::new(shape, grid, cfg.staging_wait_timeout))
        });
        let shared = Arc::new(Shared {
            table: Mutex::new(PrefillManager::new(mcfg, local)),
            rooms: Mutex::new(RoomSets::default()),
            queues: senders.clone(),
            stop: AtomicBool::new(false),
            plane,
            rt,
            notices: Mutex::new(notice_tx),
            events: cfg.events.then(|| Mutex::new(events_tx)),
            fatal: Mutex::new(None),
            fatal_tx: Mutex::new(fatal_tx),
            staging,
            stage_bufs,
            cfg,
            mem,
        });
        let notifier_ctx = ctx.clone();
        std::thread::Builder::new()
            .name("kvx-notifier".into())
            .spawn(move || notifier(notifier_ctx, notice_rx))?;
        let s = shared.clone();
        let clock = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        std::thread::Builder::new()
            .name("kvx-inbox".into())
            .spawn(move || inbox_loop(&s, inbox, &clock))?;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("kvx-timer".into())
            .spawn(move || timer_loop(&s))?;
        worker::spawn_all(shared.clone(), queues)?;
        tracing::info!(%endpoint, "prefill rank inbox bound");
        Ok(PrefillEngine {
            shared,
            endpoint,
            events: Mutex::new(Some(events_rx)),
            fatal_rx: Mutex::new(fatal_rx),
        })
    }

    /// The inbox endpoint decodes send to (what PUT /route advertises).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The settings the engine runs with.
    pub fn config(&self) -> &PrefillConfig {
        &self.shared.cfg
    }

    /// Creates the room's sender (sglang's `KVSender.__init__`): the bootstrap timeout starts.
    pub fn open_room(&self, room: Room) -> Result<(), PrefillError> {
        self.shared.handle(PrefillEvent::SenderCreated { room })
    }

    /// Sets the room's page count and this rank's aux row (sglang's sender `init`).
    pub fn init_room(
        &self,
        room: Room,
        num_pages: usize,
        aux_row: u64,
    ) -> Result<(), PrefillError> {
        self.shared.handle(PrefillEvent::SenderInit {
            room,
            num_pages,
            aux_row,
        })
    }

    /// Hands over a finished chunk; its writes are planned and queued (chunks of a room are
    /// written in order, on one queue).
    pub fn send(&self, room: Room, chunk: Chunk) -> Result<(), PrefillError> {
        self.shared.handle(PrefillEvent::Chunk { room, chunk })
    }

    /// Fails an open room from the sender side: every decode that receives its KV gets status 0
    /// (and `reason` as the 4th frame where the decode takes one). False when the room was not
    /// open.
    pub fn fail_room(&self, room: Room, reason: &str) -> bool {
        self.shared.fail_room(room, reason)
    }

    /// The room's status, `None` when unknown (or already released).
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        lock(&self.shared.table).poll(room)
    }

    /// The first recorded failure reason of a room.
    pub fn failure(&self, room: Room) -> Option<String> {
        lock(&self.shared.table)
            .failure(room)
            .map(ToString::to_string)
    }

    /// Live per-room entries.
    pub fn live_rooms(&self) -> usize {
        lock(&self.shared.table).live_entries().rooms
    }

    /// The event stream (once; `None` afterwards or when `events` is off).
    pub fn take_events(&self) -> Option<Receiver<EngineEvent>> {
        if !self.shared.cfg.events {
            return None;
        }
        lock(&self.events).take()
    }

    /// Waits up to `timeout` for a fatal worker failure (when workers are not restarted).
    pub fn wait_fatal(&self, timeout: Duration) -> Option<Arc<TransferThreadFailed>> {
        if let Some(f) = lock(&self.shared.fatal).clone() {
            return Some(f);
        }
        lock(&self.fatal_rx).recv_timeout(timeout).ok()
    }

    /// Stops the threads (best effort; they notice within ~100 ms).
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

impl Drop for PrefillEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Feeds every accepted message of the inbox to the engine until it stops. Malformed messages
/// never get here: the inbox drops them; their count is mirrored into
/// `kvx_malformed_frames_total` (with the inbox's reasons in `kvx_bootstrap_inbox_dropped_total`).
///
/// `clock` is a small runtime of the thread's own, only for the receive timeout (so the loop
/// notices a shutdown whatever runtime the embedder passed).
fn inbox_loop(shared: &Shared, mut inbox: Inbox, clock: &tokio::runtime::Runtime) {
    let mut dropped = 0;
    while !shared.stop.load(Ordering::Relaxed) {
        // The timer is created inside `block_on`, in the clock's context.
        let next = clock.block_on(async {
            tokio::time::timeout(Duration::from_millis(100), inbox.recv()).await
        });
        count_dropped(&inbox, &mut dropped, "kvx_malformed_frames_total");
        match next {
            Ok(Some(msg)) => handle_inbound(shared, msg.frames()),
            Ok(None) => {
                tracing::error!("prefill inbox stopped");
                return;
            }
            Err(_) => {}
        }
    }
    inbox.close();
}

/// Adds the inbox's newly dropped messages to `counter` (label `kind="inbox"`).
pub(crate) fn count_dropped(inbox: &Inbox, seen: &mut u64, counter: &'static str) {
    let now = inbox.stats().dropped();
    if now > *seen {
        metrics::counter!(counter, "kind" => "inbox").increment(now - *seen);
        *seen = now;
    }
}

/// Dispatches one message from a decode; malformed input is logged, counted and dropped.
fn handle_inbound<F: AsRef<[u8]>>(shared: &Shared, frames: &[F]) {
    let msg = match wire::parse_prefill_inbound(frames) {
        Ok(m) => m,
        Err(e) => {
            metrics::counter!("kvx_malformed_frames_total", "kind" => e.kind()).increment(1);
            tracing::warn!(error = %e, frames = frames.len(), "malformed message dropped");
            return;
        }
    };
    match msg {
        PrefillInbound::Registration(reg) => {
            let (session, endpoint) = (reg.session.clone(), reg.endpoint.clone());
            let v0523 = reg.accepts_status_reason();
            match shared.handle(PrefillEvent::Register(*reg)) {
                Ok(()) => {
                    metrics::counter!("kvx_registrations_total").increment(1);
                    tracing::info!(%session, %endpoint, sglang_0_5_23 = v0523, "decode registered");
                }
                Err(e) => {
                    // A DCP size or rank this rank cannot pair with (sglang 0.5.23 refuses DCP 1
                    // with a non-zero rank too): dropped, the session stays unregistered.
                    metrics::counter!("kvx_malformed_frames_total", "kind" => e.kind())
                        .increment(1);
                    tracing::warn!(%session, %endpoint, error = %e, "registration refused");
                }
            }
        }
        PrefillInbound::Metadata(req) => {
            let room = req.room;
            let pages = req.dst.as_ref().map_or(0, |d| d.kv_pages.len());
            {
                let mut rooms = lock(&shared.rooms);
                rooms.known.insert(room);
                let ss = rooms.sessions.entry(room).or_default();
                if !ss.iter().any(|(s, _, _)| *s == req.session) {
                    ss.push((req.session.clone(), req.endpoint.clone(), !req.is_dummy()));
                }
            }
            let total_pages = req.dst.as_ref().map(|d| d.kv_pages.len());
            let session = req.session.clone();
            let target = (req.session.clone(), req.endpoint.clone(), !req.is_dummy());
            let _ = shared.handle(PrefillEvent::Metadata(*req));
            {
                // Again now that the manager knows the room: another thread's `handle` may have
                // pruned the entry in between (it keeps only rooms the manager knows).
                // (Lock order: the table before the room sets, never both here.)
                let known = lock(&shared.table).poll(room).is_some();
                let mut rooms = lock(&shared.rooms);
                if known {
                    let ss = rooms.sessions.entry(room).or_default();
                    if !ss.iter().any(|(s, _, _)| *s == target.0) {
                        ss.push(target);
                    }
                }
            }
            if let Some(total_pages) = total_pages {
                staging::open(shared, room, &session, total_pages);
            }
            if shared.cfg.auto_open {
                // The synthetic forward pass: every announced room gets a sender.
                let _ = shared.handle(PrefillEvent::SenderCreated { room });
            }
            if let Some(err) = lock(&shared.fatal).clone() {
                // The rank is going down: a room opened now can never be served.
                let _ = shared.handle(PrefillEvent::Fatal {
                    reason: err.to_string(),
                });
                return;
            }
            let ready = lock(&shared.table).poll(room) == Some(KVPoll::WaitingForInput)
                && lock(&shared.rooms).announced.insert(room);
            if ready {
                shared.event(EngineEvent::Ready { room, pages });
            }
        }
        PrefillInbound::Abort {
            room,
            endpoint,
            generation,
        } => {
            let form = if generation.is_some() { "5" } else { "4" };
            metrics::counter!("kvx_aborts_total", "frames" => form).increment(1);
            let _ = shared.handle(PrefillEvent::Abort {
                room,
                endpoint,
                generation,
            });
        }
        PrefillInbound::StagingRsp(rsp) => staging::on_rsp(shared, &rsp),
        PrefillInbound::Watermark(wm) => staging::on_watermark(shared, &wm),
    }
}

fn timer_loop(shared: &Shared) {
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let _ = shared.handle(PrefillEvent::Tick);
        staging::tick(shared);
        let mut counts = [0usize; 5];
        let live = {
            let m = lock(&shared.table);
            for r in &lock(&shared.rooms).known {
                if let Some(p) = m.poll(*r) {
                    counts[p.as_u8() as usize] += 1;
                }
            }
            m.live_entries().rooms
        };
        for s in KVPoll::ALL {
            metrics::gauge!("kvx_rooms", "state" => s.to_string())
                .set(counts[s.as_u8() as usize] as f64);
        }
        metrics::gauge!("kvx_room_entries").set(live as f64);
    }
}
