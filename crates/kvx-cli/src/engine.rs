//! The prefill sender as a library: one [`PrefillEngine`] is one prefill rank.
//!
//! It binds the rank's ZMQ inbox (sglang's PULL socket), feeds every decode message into the
//! [`RoomTable`], runs the transfer workers on sharded queues under a supervisor, and sends status
//! and `ABORT_ACK` messages from one notifier thread that never blocks a worker. An embedding
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
//! let mem = PrefillMemory::new(kv.clone(), vec![kv.base()], 4096, aux.clone(), vec![aux.base()], vec![64]);
//! let rt = tokio::runtime::Runtime::new().unwrap();
//! let engine = PrefillEngine::start(PrefillConfig::default(), mem, rt.handle().clone()).unwrap();
//! let room = Room::new(42).unwrap();
//! engine.open_room(room, 0);
//! // ... once the decode's metadata arrived:
//! if engine.poll(room) == Some(KVPoll::WaitingForInput) {
//!     engine.send(room, Chunk::new(PageSlice::new(0, 2).unwrap(), vec![3, 4]).last()).unwrap();
//! }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::{Chunk, Endpoint, KVPoll, Room};

use crate::fault::TransferThreadFailed;
use crate::plane::DataPlane;
use crate::region::Region;
use crate::rooms::{Action, RoomTable, SendError};
use crate::wire::{self, Frames, PrefillInbound};
use crate::worker::{self, Job, JobQueue};

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
    /// `prefill_unique_rank` sent in status messages.
    pub unique_rank: u32,
    /// Drop room entries as soon as they are released (no `clear` calls needed).
    pub auto_clear: bool,
    /// Deliver [`EngineEvent`]s through [`PrefillEngine::take_events`].
    pub events: bool,
    /// Data-plane connect and I/O timeout.
    pub connect_timeout: Duration,
    /// Data-plane connections per decode session.
    pub connections: usize,
    /// Tokens per KV page.
    pub page_size: u32,
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
            unique_rank: 0,
            auto_clear: false,
            events: false,
            connect_timeout: Duration::from_secs(10),
            connections: 2,
            page_size: 16,
        }
    }
}

/// The memory a prefill rank registers once: KV buffers and aux rows.
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
    /// Bytes per row of each aux buffer.
    pub aux_item_lens: Vec<u64>,
}

impl PrefillMemory {
    /// Marks the KV buffers as MLA latents (one per layer).
    #[must_use]
    pub fn mla(mut self, mla: bool) -> Self {
        self.mla = mla;
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
    /// A ZMQ call failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// A thread could not be spawned.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The data plane refused the memory.
    #[error("transport: {0}")]
    Transport(#[from] kvx_rdma::TransportError),
    /// The bound endpoint could not be read back.
    #[error("cannot read the bound inbox endpoint")]
    Endpoint,
}

pub(crate) enum Notice {
    Send(Endpoint, Frames),
    Flush(Sender<()>),
}

/// State shared by the engine's threads.
pub(crate) struct Shared {
    pub(crate) cfg: PrefillConfig,
    pub(crate) mem: PrefillMemory,
    pub(crate) table: Mutex<RoomTable>,
    pub(crate) stop: AtomicBool,
    pub(crate) current: Vec<Mutex<Option<(Room, bool)>>>,
    pub(crate) plane: DataPlane,
    pub(crate) rt: tokio::runtime::Handle,
    notices: Mutex<Sender<Notice>>,
    events: Option<Mutex<Sender<EngineEvent>>>,
    fatal: Mutex<Option<Arc<TransferThreadFailed>>>,
    fatal_tx: Mutex<Sender<Arc<TransferThreadFailed>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Executes the table's actions.
    pub(crate) fn apply(&self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Status {
                    endpoint,
                    room,
                    status,
                } => {
                    metrics::counter!("kvx_status_sent_total", "status" => status.to_string())
                        .increment(1);
                    let f = wire::encode_status(room, status, self.cfg.unique_rank);
                    let _ = lock(&self.notices).send(Notice::Send(endpoint, f));
                }
                Action::AbortAck { endpoint, room } => {
                    let _ = lock(&self.notices)
                        .send(Notice::Send(endpoint, wire::encode_abort_ack(room)));
                }
                Action::Ready { room, pages } => self.event(EngineEvent::Ready { room, pages }),
                Action::Released { room, status } => {
                    metrics::counter!("kvx_rooms_finished_total", "status" => status.to_string())
                        .increment(1);
                    self.event(EngineEvent::Released { room, status })
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
    queues: Vec<Sender<Job>>,
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
        let plane = DataPlane::tcp_client(cfg.connections, vec![mem.kv.clone(), mem.aux.clone()])?;
        let ctx = zmq::Context::new();
        let inbox = ctx.socket(zmq::PULL)?;
        inbox.set_rcvhwm(0)?;
        inbox.set_rcvtimeo(100)?;
        if cfg.host.contains(':') {
            inbox.set_ipv6(true)?;
        }
        let host = if cfg.host.contains(':') {
            format!("[{}]", cfg.host)
        } else {
            cfg.host.clone()
        };
        let port = if cfg.inbox_port == 0 {
            "*".to_owned()
        } else {
            cfg.inbox_port.to_string()
        };
        inbox.bind(&format!("tcp://{host}:{port}"))?;
        let bound = inbox
            .get_last_endpoint()?
            .map_err(|_| EngineError::Endpoint)?;
        let port: u16 = bound
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or(EngineError::Endpoint)?;
        let endpoint = Endpoint::new(cfg.host.clone(), port);

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
        let shared = Arc::new(Shared {
            table: Mutex::new(RoomTable::new(
                cfg.bootstrap_timeout,
                queues.len(),
                cfg.auto_clear,
            )),
            stop: AtomicBool::new(false),
            current: (0..queues.len()).map(|_| Mutex::new(None)).collect(),
            plane,
            rt,
            notices: Mutex::new(notice_tx),
            events: cfg.events.then(|| Mutex::new(events_tx)),
            fatal: Mutex::new(None),
            fatal_tx: Mutex::new(fatal_tx),
            cfg,
            mem,
        });
        let notifier_ctx = ctx.clone();
        std::thread::Builder::new()
            .name("kvx-notifier".into())
            .spawn(move || notifier(notifier_ctx, notice_rx))?;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("kvx-inbox".into())
            .spawn(move || inbox_loop(&s, inbox))?;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("kvx-timer".into())
            .spawn(move || timer_loop(&s))?;
        worker::spawn_all(shared.clone(), queues)?;
        tracing::info!(%endpoint, "prefill rank inbox bound");
        Ok(PrefillEngine {
            shared,
            queues: senders,
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

    /// Opens a room (sglang's sender `init`): `aux_index` is this rank's aux row for it.
    pub fn open_room(&self, room: Room, aux_index: i64) {
        lock(&self.shared.table).open(room, aux_index, Instant::now());
    }

    /// Sets this rank's aux row for a room the decodes already opened (the synthetic forward
    /// pass); false when the room is unknown or terminal.
    pub fn attach_room(&self, room: Room, aux_index: i64) -> bool {
        lock(&self.shared.table).attach(room, aux_index)
    }

    /// Queues a finished chunk of a room; chunks of a room are written in order.
    pub fn send(&self, room: Room, chunk: Chunk) -> Result<(), SendError> {
        let shard = lock(&self.shared.table).enqueue(room, &chunk)?;
        if self.queues[shard].send(Job { room, chunk }).is_err() {
            let actions = lock(&self.shared.table).done(room, false, Err("queue closed".into()));
            self.shared.apply(actions);
        }
        Ok(())
    }

    /// Fails a room from the sender side (its decodes get status 0).
    pub fn fail_room(&self, room: Room, reason: String) {
        let actions = lock(&self.shared.table).fail(room, reason);
        self.shared.apply(actions);
    }

    /// The room's status, `None` when unknown (or already cleared).
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        lock(&self.shared.table).poll(room)
    }

    /// The first recorded failure reason of a room.
    pub fn failure(&self, room: Room) -> Option<String> {
        lock(&self.shared.table).failure(room).map(str::to_owned)
    }

    /// Forgets a terminal room (sglang's sender `clear`).
    pub fn clear(&self, room: Room) {
        lock(&self.shared.table).clear(room);
    }

    /// Live per-room entries.
    pub fn live_rooms(&self) -> usize {
        lock(&self.shared.table).len()
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

fn notifier(ctx: zmq::Context, rx: Receiver<Notice>) {
    let mut sockets: HashMap<Endpoint, zmq::Socket> = HashMap::new();
    while let Ok(n) = rx.recv() {
        match n {
            Notice::Flush(done) => {
                let _ = done.send(());
            }
            Notice::Send(ep, frames) => {
                let sock = match sockets.entry(ep.clone()) {
                    std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => match push_socket(&ctx, &ep) {
                        Ok(s) => v.insert(s),
                        Err(e) => {
                            metrics::counter!("kvx_notice_failures_total").increment(1);
                            tracing::warn!(%ep, error = %e, "cannot connect to decode inbox");
                            continue;
                        }
                    },
                };
                if let Err(e) = sock.send_multipart(frames, zmq::DONTWAIT) {
                    metrics::counter!("kvx_notice_failures_total").increment(1);
                    tracing::warn!(%ep, error = %e, "status message dropped");
                }
            }
        }
    }
}

/// A PUSH socket toward a decode inbox (sglang's options, minus blocking sends).
pub(crate) fn push_socket(ctx: &zmq::Context, ep: &Endpoint) -> Result<zmq::Socket, zmq::Error> {
    let s = ctx.socket(zmq::PUSH)?;
    s.set_linger(1000)?;
    s.set_tcp_keepalive(1)?;
    s.set_tcp_keepalive_idle(30)?;
    s.set_tcp_keepalive_intvl(5)?;
    s.set_tcp_keepalive_cnt(3)?;
    if ep.is_ipv6() {
        s.set_ipv6(true)?;
    }
    s.connect(&ep.zmq_addr())?;
    Ok(s)
}

fn inbox_loop(shared: &Shared, inbox: zmq::Socket) {
    while !shared.stop.load(Ordering::Relaxed) {
        let frames = match inbox.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "inbox receive failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        handle_inbound(shared, &frames);
    }
}

/// Dispatches one message from a decode; malformed input is logged, counted and dropped.
fn handle_inbound(shared: &Shared, frames: &[Vec<u8>]) {
    let msg = match wire::parse_prefill_inbound(frames) {
        Ok(m) => m,
        Err(e) => {
            metrics::counter!("kvx_malformed_frames_total", "kind" => e.kind()).increment(1);
            tracing::warn!(error = %e, frames = frames.len(), "malformed message dropped");
            return;
        }
    };
    let actions = match msg {
        PrefillInbound::Registration(reg) => {
            if reg.dcp_size > 1 {
                metrics::counter!("kvx_malformed_frames_total", "kind" => "unsupported_dcp")
                    .increment(1);
                tracing::warn!(session = %reg.session, dcp = reg.dcp_size, "registration with decode context parallelism rejected");
                return;
            }
            metrics::counter!("kvx_registrations_total").increment(1);
            tracing::info!(session = %reg.session, endpoint = %reg.endpoint, "decode registered");
            lock(&shared.table).register(*reg);
            Vec::new()
        }
        PrefillInbound::Metadata(req) => {
            let room = req.room;
            let dead = lock(&shared.fatal).clone();
            let mut t = lock(&shared.table);
            let mut actions = t.metadata(*req, Instant::now());
            if let Some(err) = dead {
                // The rank is going down: a room opened now can never be served.
                actions.extend(t.fail(room, err.to_string()));
            }
            actions
        }
        PrefillInbound::Abort { room, endpoint } => {
            metrics::counter!("kvx_aborts_total").increment(1);
            lock(&shared.table).abort(room, endpoint)
        }
        PrefillInbound::Staging(kind) => {
            metrics::counter!("kvx_ignored_messages_total", "kind" => kind).increment(1);
            Vec::new()
        }
    };
    shared.apply(actions);
}

fn timer_loop(shared: &Shared) {
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let (actions, counts, live) = {
            let mut t = lock(&shared.table);
            let a = t.tick(Instant::now());
            (a, t.counts(), t.len())
        };
        shared.apply(actions);
        for s in KVPoll::ALL {
            metrics::gauge!("kvx_rooms", "state" => s.to_string())
                .set(counts[s.as_u8() as usize] as f64);
        }
        metrics::gauge!("kvx_room_entries").set(live as f64);
    }
}
