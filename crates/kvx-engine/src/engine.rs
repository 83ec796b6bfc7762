//! The prefill sender as a library: one [`PrefillEngine`] is one prefill rank.
//!
//! The rank's state has one owner: a loop thread (`engine/owner.rs`) that receives every input — decode
//! messages from the rank's ZMQ inbox (sglang's PULL socket; parsed on the inbox thread),
//! embedder calls, worker reports and its own deadlines — feeds them to `kvx-core`'s
//! [`kvx_core::prefill::PrefillManager`] (the deterministic room state machine and planner) and
//! performs the actions in the order produced. Transfer workers ([`crate::worker`]) only execute
//! batches and report back; status and `ABORT_ACK` messages go out, in order, from the loop itself
//! through its notifier (PUSH sockets whose sends never block: a full decode inbox gets its
//! messages held and retried from the loop's deadlines). The embedder's [`PrefillEngine::poll`] reads a status view
//! the loop keeps, without a round trip. Towards a decode of another attention-TP size that advertises a
//! staging ring, and with [`PrefillConfig::staging`] on, chunks travel through the decode's ring
//! instead (see [`crate::prefill_staging`]). An embedding
//! engine registers its memory once ([`PrefillMemory`]), opens rooms, hands chunks to
//! [`PrefillEngine::send`] as its forward pass finishes them and polls [`PrefillEngine::poll`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvx_engine::engine::{PrefillConfig, PrefillEngine, PrefillMemory};
//! use kvx_engine::region::Region;
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
//!
//! # Caller-owned memory: the safety contract
//!
//! A serving stack hands its own buffers to an engine ([`PrefillEngine`] here,
//! [`crate::decode::engine::DecodeEngine`] on the decode side) as [`Region`]s made with the
//! `unsafe` [`Region::from_raw`] (host memory) or [`Region::from_raw_device`] (device memory);
//! nothing is copied and the engine never frees them. The contract has four parts, the first
//! two being the constructors' `# Safety`:
//!
//! 1. **Valid until shutdown; host or device as declared.** Each range is memory of this
//!    process — host memory readable and writable by the CPU (`from_raw`), or device memory such
//!    as a CUDA allocation (`from_raw_device`) — until [`PrefillEngine::shutdown`] returned
//!    `true` (it also runs on drop; `false` means threads were still running — leak the memory
//!    rather than free it), or `DecodeEngine::shutdown` returned. What is accepted where:
//!
//!    | memory | host | device |
//!    |---|---|---|
//!    | KV pool (both engines), prefill state buffers | every backend | `verbs` only (a GPUDirect-RDMA capable NIC and `nvidia-peermem`; untested by kvx) |
//!    | aux rows | every backend | never: [`MemoryError::DeviceAux`] (the engines write the room id and `AUX_DATA` rows with the CPU) |
//!    | KV pool with staging on ([`PrefillConfig::staging`], `DecodeEngineConfig::staging`) | every backend | never: [`MemoryError::StagingWithDeviceKv`] (staging gathers and scatters pages with the CPU) |
//!
//!    A device KV pool over `tcp`, `auto`, `mooncake`, `local` or `shm` fails at start with
//!    [`EngineError::Transport`]`(`[`kvx_rdma::TransportError::DeviceMemoryUnsupported`]`)`
//!    naming the backend (those backends move bytes with the CPU). The engines never touch a
//!    device region from the CPU: every [`Region`] accessor refuses it
//!    ([`crate::region::AccessError::Device`]), and the decode skips its check that an aborted
//!    room's pages stopped changing for a device pool (the release then rests on the
//!    `ABORT_ACK`s and the release timeout). What each data-plane backend registers is listed
//!    in `kvx-rdma`'s crate docs.
//! 2. **No references into live pages.** Peers and the data plane read and write the ranges
//!    from other threads at any time; code outside kvx holds no `&[u8]`/`&mut [u8]` over pages
//!    of a room in flight (for device memory: no GPU kernel writes them either). Move bytes with [`Region::copy_in`]/[`Region::copy_out`], or use the
//!    `unsafe` views [`Region::view`]/[`Region::with_mut`] only on pages the caller owns (3).
//! 3. **Per-room ownership.** Prefill: the pages a chunk names, and the room's aux row (the
//!    engine writes the room id into it), are read by the data plane from
//!    [`PrefillEngine::send`] until the room is released — [`EngineEvent::Released`] with
//!    [`PrefillConfig::events`] on, else [`PrefillEngine::poll`] returning `None` after a
//!    terminal status; the forward pass must not overwrite them before. Decode: a room's pages
//!    and aux row belong to the engine from `open_room` until its `Released` event (see
//!    [`crate::decode::engine`]); read them only after `Done` with status Success.
//! 4. **Disjoint ranges.** The KV, aux, state and staging regions of one engine do not overlap
//!    (the data plane refuses overlapping registrations); two engines in one process must not
//!    share a range either.
//!
//! The [`Region`] methods themselves are safe: every access is bounds-checked against the
//! region, so an index from the network can at worst fail a room.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvx_bootstrap::http::RankRegistration;
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, SocketError, zmq};
use kvx_core::prefill::{LocalMemory, PrefillError, PrefillManager};
use kvx_core::{AuxLayout, BatchLimits, Chunk, Endpoint, KVPoll, Room, StateComponent};
use kvx_staging::ChunkGrid;

use crate::fault::TransferThreadFailed;
use crate::memory::MemoryError;
use crate::plane::DataPlane;
use crate::prefill_staging::{LocalShape, StagingDriver};
use crate::region::Region;
use crate::worker::{self, JobQueue, StageBuffers, WorkerCtx};

mod notifier;
mod owner;
mod staging;

use crate::prefill_core::{CoreConfig, PrefillCore, View};
use notifier::Notifier;
use owner::{Call, Input, Owner, Parts};

/// [`PrefillConfig::loop_spin`]'s default, in microseconds.
pub const DEFAULT_LOOP_SPIN_US: u64 = 100;

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
    /// Most writes per batch (default 32 768: a chunk of per-token head slices or page-size-1
    /// writes goes out as one batch spanning several tcp windows, which keeps every connection
    /// busy; with 1 024 such a chunk was 32 stop-and-wait batches of one window each).
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
    /// The RDMA device of the `verbs` backend (default: the first device, port 1).
    pub rdma: crate::plane::RdmaOptions,
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
    /// How long the rank's loop keeps polling its queue (yielding the CPU between polls) after
    /// it handled an input, before it sleeps (default [`DEFAULT_LOOP_SPIN_US`] µs; zero: it
    /// sleeps at once). The next input — a worker's completion after a post, the embedder's
    /// next chunk — is then taken without a wake-up, for at most that long of CPU per input
    /// (`docs/benchmarks.md`, sixth session: empty rooms and bulk rooms both gain on a
    /// 2-vCPU guest).
    pub loop_spin: Duration,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            host: "127.0.0.1".into(),
            inbox_port: 0,
            bootstrap_port: 8998,
            queues: 4,
            max_batch_ops: 32 * 1024,
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
            rdma: crate::plane::RdmaOptions::default(),
            staging: false,
            chunked_prefill_size: kvx_staging::grid::DEFAULT_CHUNKED_PREFILL_SIZE,
            staging_wait_timeout: Duration::from_secs(60),
            aux_over_tcp: false,
            loop_spin: Duration::from_micros(DEFAULT_LOOP_SPIN_US),
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
///
/// Deliberately not `#[non_exhaustive]`: an embedder must act on every event (pages are handed
/// back by them), so a new variant is a breaking change by design.
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
#[non_exhaustive]
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
    /// The memory is of a kind the engine cannot use there (device aux rows, staging over a
    /// device KV pool; see [`crate::memory`]).
    #[error("memory: {0}")]
    Memory(#[from] MemoryError),
}

/// Most inputs queued for the loop (decode messages, calls, reports); the inbox waits beyond.
const INPUT_QUEUE: usize = 1 << 16;

/// One running prefill rank.
pub struct PrefillEngine {
    inputs: SyncSender<Input>,
    view: Arc<View>,
    endpoint: Endpoint,
    cfg: PrefillConfig,
    stop: Arc<AtomicBool>,
    events: Mutex<Option<Receiver<EngineEvent>>>,
    fatal_rx: Mutex<Receiver<Arc<TransferThreadFailed>>>,
    /// Alive while the loop or a worker holds the registered memory (and the data plane).
    threads: std::sync::Weak<WorkerCtx>,
    /// Set by [`PrefillEngine::begin_drain`]: the reason new rooms are refused with.
    drain: Mutex<Option<String>>,
    /// The transfer queues' staging buffers (allocated on first use; shared with the workers).
    stage_bufs: Arc<StageBuffers>,
    /// Time with at least one batch in flight (shared with the workers).
    busy: Arc<crate::busy::BusyClock>,
}

/// How long [`PrefillEngine::shutdown`] waits for its threads beyond the data-plane timeout (a
/// worker finishes the batch it is writing first).
const SHUTDOWN_SLACK: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PrefillEngine {
    /// Registers the memory with the data plane, binds the inbox, starts the loop, the workers
    /// and the inbox thread. Transfers run on the runtime behind `rt`.
    pub fn start(
        cfg: PrefillConfig,
        mem: PrefillMemory,
        rt: tokio::runtime::Handle,
    ) -> Result<PrefillEngine, EngineError> {
        crate::memory::check(
            &mem.kv,
            &mem.aux,
            cfg.staging.then_some("PrefillConfig::staging"),
            crate::memory::PREFILL_AUX,
        )?;
        let name = format!("kvx-prefill-{}-{}", std::process::id(), cfg.tp_rank);
        let page_size = u64::from(cfg.page_size.max(1));
        let grid = ChunkGrid::new(Some(cfg.chunked_prefill_size), page_size)
            .ok_or_else(|| EngineError::Config("page size 0".into()))?;
        // sglang's size: one full grid chunk of every local KV buffer (this rank's heads bound
        // every slice it stages), per transfer queue. Allocated and registered on first use:
        // only a slice that cuts token slots (a decode of larger attention-TP size) is gathered
        // into one; whole slots go from the KV pages, so a rank may never need any.
        let staging_on = cfg.staging && !mem.mla;
        let stage_bufs = Arc::new(if staging_on {
            let len = grid
                .full_chunk_pages()
                .checked_mul(mem.item_len)
                .and_then(|b| b.checked_mul(mem.kv_ptrs.len() as u64))
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| EngineError::Config("staging buffer size overflows".into()))?;
            StageBuffers::new(cfg.queues.max(1), len)
        } else {
            StageBuffers::new(0, 0)
        });
        let mut regions = vec![mem.kv.clone(), mem.aux.clone()];
        regions.extend(mem.state_regions.iter().cloned());
        let plane =
            DataPlane::client_with(cfg.backend, &cfg.rdma, &name, cfg.connections, regions)?;
        let ctx = zmq::Context::new();
        let inbox = Inbox::bind(
            &ctx,
            InboxConfig {
                port: (cfg.inbox_port != 0).then_some(cfg.inbox_port),
                ..InboxConfig::new(cfg.host.clone(), InboxKind::Prefill)
            },
        )?;
        let endpoint = inbox.endpoint().clone();

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
            staging: staging_on,
            aux_over_tcp: cfg.aux_over_tcp,
            ..kvx_core::PrefillConfig::default()
        };
        let staging = staging_on.then(|| {
            let shape = LocalShape {
                tp_rank: cfg.tp_rank,
                tp_size: cfg.tp_size.max(1),
                total_kv_heads: cfg.total_kv_heads.max(1),
                page_size,
                item_len: mem.item_len,
                num_buffers: mem.kv_ptrs.len(),
            };
            StagingDriver::new(shape, grid, cfg.staging_wait_timeout)
        });

        let (events_tx, events_rx) = std::sync::mpsc::channel();
        let (fatal_tx, fatal_rx) = std::sync::mpsc::channel();
        let (inputs_tx, inputs_rx) = std::sync::mpsc::sync_channel(INPUT_QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let mut senders = Vec::new();
        let mut queues: Vec<Arc<JobQueue>> = Vec::new();
        for _ in 0..cfg.queues.max(1) {
            let (tx, rx) = worker::job_queue();
            senders.push(tx);
            queues.push(rx);
        }
        let busy = Arc::new(crate::busy::BusyClock::default());
        let workers = Arc::new(WorkerCtx {
            mem: mem.clone(),
            plane,
            rt,
            stage_bufs: stage_bufs.clone(),
            stop: stop.clone(),
            busy: busy.clone(),
            marks: Mutex::default(),
        });
        let core = PrefillCore::new(
            CoreConfig {
                bootstrap_port: cfg.bootstrap_port,
                queues: cfg.queues.max(1),
                auto_open: cfg.auto_open,
                restart_workers: cfg.restart_workers,
            },
            PrefillManager::new(mcfg, local),
            staging,
            std::time::Instant::now(),
        );
        let view = core.view();
        let owner = Owner::new(Parts {
            mem,
            core,
            queues: senders,
            job_queues: queues.clone(),
            workers: workers.clone(),
            inputs: inputs_tx.clone(),
            notifier: Notifier::new(&ctx),
            events: cfg.events.then_some(events_tx),
            fatal_tx,
            stop: stop.clone(),
            spin: cfg.loop_spin,
        });
        for (shard, q) in queues.into_iter().enumerate() {
            worker::spawn_worker(workers.clone(), shard, q, inputs_tx.clone())?;
        }
        std::thread::Builder::new()
            .name("kvx-prefill-loop".into())
            .spawn(move || owner.run(&inputs_rx))?;
        let clock = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        let (tx, s) = (inputs_tx.clone(), stop.clone());
        std::thread::Builder::new()
            .name("kvx-inbox".into())
            .spawn(move || inbox_loop(&s, &tx, inbox, &clock))?;
        tracing::info!(%endpoint, "prefill rank inbox bound");
        Ok(PrefillEngine {
            stage_bufs,
            busy,
            threads: Arc::downgrade(&workers),
            inputs: inputs_tx,
            view,
            endpoint,
            cfg,
            stop,
            events: Mutex::new(Some(events_rx)),
            fatal_rx: Mutex::new(fatal_rx),
            drain: Mutex::new(None),
        })
    }

    /// The inbox endpoint decodes send to (what PUT /route advertises).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// How long this rank had at least one batch on the data plane since it started (the union
    /// over its transfer workers, from posting a batch to awaiting its completion; also the
    /// gauge `kvx_prefill_transfer_busy_seconds`). Bytes moved over this time is the rank's
    /// transfer throughput without the forward pass, queueing or idle time.
    pub fn transfer_busy(&self) -> Duration {
        self.busy.total()
    }

    /// Bytes of memory the engine holds allocated and registered itself now (with `staging`,
    /// the staging buffers of the transfer queues that gathered a block in the last minute),
    /// beside the caller's [`PrefillMemory`].
    pub fn own_memory_bytes(&self) -> u64 {
        self.stage_bufs.bytes()
    }

    /// The settings the engine runs with.
    pub fn config(&self) -> &PrefillConfig {
        &self.cfg
    }

    /// This rank's `PUT /route` body (see [`rank_registration`]) with its inbox as bound and its
    /// TP rank, TP size and page size as configured; `kv_cache_dtype` is what decodes compare
    /// with theirs (sglang's `auto` when unset).
    pub fn rank_registration(&self, kv_cache_dtype: &str) -> RankRegistration {
        let c = &self.cfg;
        rank_registration(
            (c.tp_size, c.tp_rank),
            u64::from(c.page_size),
            kv_cache_dtype,
            &self.endpoint.host,
            self.endpoint.port,
        )
    }

    /// Sends a call to the loop and waits for its answer; `None` once the loop stopped.
    fn call<T>(&self, make: impl FnOnce(SyncSender<T>) -> Call) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.inputs.send(Input::Call(make(tx))).ok()?;
        rx.recv().ok()
    }

    /// Creates the room's sender (sglang's `KVSender.__init__`): the bootstrap timeout starts.
    pub fn open_room(&self, room: Room) -> Result<(), PrefillError> {
        self.call(|reply| Call::Open { room, reply })
            .unwrap_or(Err(PrefillError::UnknownRoom(room)))
    }

    /// Sets the room's page count and this rank's aux row (sglang's sender `init`).
    pub fn init_room(
        &self,
        room: Room,
        num_pages: usize,
        aux_row: u64,
    ) -> Result<(), PrefillError> {
        self.call(|reply| Call::Init {
            room,
            num_pages,
            aux_row,
            reply,
        })
        .unwrap_or(Err(PrefillError::UnknownRoom(room)))
    }

    /// Hands over a finished chunk; its writes are planned and queued (chunks of a room are
    /// written in order, on one queue).
    pub fn send(&self, room: Room, chunk: Chunk) -> Result<(), PrefillError> {
        if chunk.is_last {
            crate::timeline::stage!(room, "send");
        }
        self.call(|reply| Call::Send { room, chunk, reply })
            .unwrap_or(Err(PrefillError::UnknownRoom(room)))
    }

    /// Fails an open room from the sender side: every decode that receives its KV gets status 0
    /// (and `reason` as the 4th frame where the decode takes one) once nothing of the room is in
    /// flight. False when the room was not open.
    pub fn fail_room(&self, room: Room, reason: &str) -> bool {
        let reason = reason.to_owned();
        self.call(|reply| Call::Fail {
            room,
            reason,
            reply,
        })
        .unwrap_or(false)
    }

    /// The room's status, `None` when unknown (or already released).
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        self.view.poll(room)
    }

    /// The first recorded failure reason of a room.
    pub fn failure(&self, room: Room) -> Option<String> {
        self.view.failure(room)
    }

    /// Live per-room entries.
    pub fn live_rooms(&self) -> usize {
        self.view.held()
    }

    /// The event stream (once; `None` afterwards or when `events` is off).
    pub fn take_events(&self) -> Option<Receiver<EngineEvent>> {
        if !self.cfg.events {
            return None;
        }
        lock(&self.events).take()
    }

    /// Waits up to `timeout` for a fatal worker failure (when workers are not restarted). It is
    /// reported once every open room was failed and its decodes told.
    pub fn wait_fatal(&self, timeout: Duration) -> Option<Arc<TransferThreadFailed>> {
        if let Some(f) = self.view.fatal() {
            return Some(f);
        }
        lock(&self.fatal_rx).recv_timeout(timeout).ok()
    }

    /// Starts a drain: from now on [`PrefillEngine::draining`] returns `reason`, which an
    /// embedder's forward pass checks before it starts a room (`kvx prefill`'s fails every room
    /// it has not started with it). Rooms already started go on.
    pub fn begin_drain(&self, reason: &str) {
        lock(&self.drain).get_or_insert_with(|| reason.to_owned());
    }

    /// The drain's reason once [`PrefillEngine::begin_drain`] was called.
    pub fn draining(&self) -> Option<String> {
        lock(&self.drain).clone()
    }

    /// Fails every room that is not terminal yet with `reason` (see
    /// [`PrefillEngine::fail_room`]: its decodes are told once nothing of it is in flight);
    /// returns how many.
    pub fn fail_open_rooms(&self, reason: &str) -> usize {
        self.view
            .open_rooms()
            .into_iter()
            .filter(|&room| self.fail_room(room, reason))
            .count()
    }

    /// Waits up to `timeout` until every status and `ABORT_ACK` queued so far went out to its
    /// decode (before the process exits).
    pub fn flush(&self, timeout: Duration) {
        let _ = self.call(|reply| Call::Flush { timeout, reply });
    }

    /// Stops the rank and returns once its loop and workers have let go of the registered memory
    /// and the data plane deregistered it (a worker first finishes the batch it is writing), so
    /// memory given with [`Region::from_raw`] may be freed afterwards. Waits at most the
    /// data-plane timeout plus a little; returns `false` if threads were still running then.
    /// Dropping the engine calls it.
    pub fn shutdown(&self) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.inputs.try_send(Input::Stop);
        let deadline = std::time::Instant::now() + self.cfg.connect_timeout + SHUTDOWN_SLACK;
        while self.threads.strong_count() > 0 {
            if std::time::Instant::now() >= deadline {
                tracing::error!("prefill engine threads still running after shutdown");
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }
}

impl Drop for PrefillEngine {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// Parses every accepted message of the inbox and hands it to the loop until the rank stops.
/// Malformed messages are counted and dropped here (`kvx_malformed_frames_total`, with the inbox's
/// own reasons in `kvx_bootstrap_inbox_dropped_total`); the loop only sees well-formed ones.
///
/// `clock` is a small runtime of the thread's own, only for the receive timeout (so the thread
/// notices a shutdown whatever runtime the embedder passed).
fn inbox_loop(
    stop: &AtomicBool,
    inputs: &SyncSender<Input>,
    mut inbox: Inbox,
    clock: &tokio::runtime::Runtime,
) {
    let mut dropped = 0;
    while !stop.load(Ordering::Relaxed) {
        // The timer is created inside `block_on`, in the clock's context.
        let next = clock.block_on(async {
            tokio::time::timeout(Duration::from_millis(100), inbox.recv()).await
        });
        count_dropped(&inbox, &mut dropped, "kvx_malformed_frames_total");
        match next {
            Ok(Some(msg)) => match crate::wire::parse_prefill_inbound(msg.frames()) {
                Ok(m) => {
                    if inputs.send(Input::Inbound(m)).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    metrics::counter!("kvx_malformed_frames_total", "kind" => e.kind())
                        .increment(1);
                    tracing::warn!(error = %e, frames = msg.frames().len(), "malformed message dropped");
                }
            },
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

/// The `PUT /route` body of a TP-only prefill rank (`(tp_size, tp_rank)`) whose inbox is
/// `ip:port`, in sglang main's form: none of sglang 0.5.23's keys, so a bootstrap server (kvx's
/// or sglang's) keeps serving its decodes the 15-key sentinel both releases' decodes accept
/// (0.5.23's decode defaults the four it adds). `prefill_http_port` is `None`.
pub fn rank_registration(
    (tp_size, tp_rank): (u32, u32),
    page_size: u64,
    kv_cache_dtype: &str,
    ip: &str,
    port: u16,
) -> RankRegistration {
    RankRegistration {
        attn_tp_size: tp_size.max(1),
        attn_tp_rank: tp_rank,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        attn_dp_size: 1,
        attn_dp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        system_dp_size: 1,
        system_dp_rank: 0,
        rank_ip: ip.to_owned(),
        rank_port: port,
        page_size: Some(page_size),
        kv_cache_dtype: Some(kv_cache_dtype.to_owned()),
        load_balance_method: Some("follow_bootstrap_room".into()),
        enable_dsa_cache_layer_split: Some(false),
        prefill_http_port: None,
        kv_layout: None,
        dsv41_spec_layout: None,
        enable_kv_cache_sharding: None,
        decode_allocation_policy: None,
    }
}
