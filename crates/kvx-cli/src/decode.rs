//! `kvx decode`: a decode peer that generates load on a [`DecodeEngine`] and verifies bytes.
//!
//! The protocol — what sglang's decode does on the wire — is `kvx-engine`'s
//! ([`kvx_engine::decode`]): this driver allocates the decode's memory (in `/dev/shm` with the
//! shm backend), starts one engine over it, resolves the prefill instance before the first room,
//! and then runs the load: rooms with random (or consecutive) ids and prompt lengths, fragmented
//! page allocation ([`PageAllocator`]), `--concurrency` rooms in flight, every byte of a
//! successful room checked against the synthetic pattern ([`verify_room`]) before its pages are
//! reused, a failed room's pages reused only once the engine released them (every `ABORT_ACK`,
//! the release timeout, or a grace). A drain (SIGINT/SIGTERM) starts no new room and, after
//! `--shutdown-timeout`, fails and `ABORT`s the rooms still in flight. The run ends with a
//! [`Summary`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use kvx_core::{KVPoll, Room};
pub use kvx_engine::decode::DecodeStagingConfig;
use kvx_engine::decode::engine::{DecodeEngine, DecodeEngineConfig, DecodeMemory};
use kvx_engine::model::KvLayout;
use kvx_engine::pages::PageAllocator;
use kvx_engine::region::Region;
use kvx_engine::synthetic::verify_room;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{Notify, Semaphore};

mod summary;

pub use summary::{Summary, percentile};

/// Settings of one decode peer.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// Bootstrap server host.
    pub bootstrap_host: String,
    /// Bootstrap server port.
    pub bootstrap_port: u16,
    /// Host to bind and advertise.
    pub host: String,
    /// KV layout (must match the prefill's).
    pub layout: KvLayout,
    /// Decode attention-TP size.
    pub tp_size: u32,
    /// Decode attention-TP rank.
    pub tp_rank: u32,
    /// KV cache dtype the prefill must advertise (or none).
    pub kv_cache_dtype: String,
    /// Requests to run.
    pub requests: usize,
    /// Prompt tokens, drawn uniformly from this range.
    pub prompt_tokens: (u64, u64),
    /// Requests in flight.
    pub concurrency: usize,
    /// Page-list fragmentation.
    pub fragmentation: f64,
    /// Waiting timeout.
    pub waiting_timeout: Duration,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Heartbeat misses before the prefill is dead.
    pub heartbeat_max_failure: u32,
    /// ZMQ send timeout.
    pub zmq_send_timeout: Duration,
    /// How long an ABORTed room's pages wait for every rank's `ABORT_ACK` before reuse.
    pub abort_release_timeout: Duration,
    /// Seed for rooms and pages.
    pub seed: u64,
    /// Rooms `base, base+1, …` instead of random ones (as a router would hand them to both
    /// sides).
    pub room_base: Option<u64>,
    /// Draw a progress bar.
    pub progress: bool,
    /// Data-plane backend.
    pub backend: kvx_engine::plane::Backend,
    /// The RDMA device of the `verbs` backend.
    pub rdma: kvx_engine::plane::RdmaOptions,
    /// Staging ring for prefills of another attention-TP size (`None`: head slices only).
    pub staging: Option<DecodeStagingConfig>,
    /// A drain request (SIGINT/SIGTERM): no new rooms; rooms in flight get
    /// [`DecodeConfig::shutdown_timeout`], then are failed and ABORTed.
    pub stop: Option<crate::lifecycle::Stop>,
    /// How long rooms in flight may take once [`DecodeConfig::stop`] fired.
    pub shutdown_timeout: Duration,
    /// Set ready once the prefill's topology is known, draining on a stop (`GET /ready`).
    pub ready: Option<crate::lifecycle::Readiness>,
}

impl DecodeConfig {
    /// A decode of one room against the bootstrap server at `bootstrap_host:bootstrap_port`
    /// with `layout`, on loopback, with the CLI's defaults elsewhere (TP 1, 1024-token prompts,
    /// 4 in flight, sglang's timeouts, tcp, no staging); set the fields that matter.
    pub fn new(bootstrap_host: impl Into<String>, bootstrap_port: u16, layout: KvLayout) -> Self {
        DecodeConfig {
            bootstrap_host: bootstrap_host.into(),
            bootstrap_port,
            host: "127.0.0.1".into(),
            layout,
            tp_size: 1,
            tp_rank: 0,
            kv_cache_dtype: "auto".into(),
            requests: 1,
            prompt_tokens: (1024, 1024),
            concurrency: 4,
            fragmentation: 0.5,
            waiting_timeout: Duration::from_secs(300),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_max_failure: 2,
            zmq_send_timeout: Duration::from_secs(1),
            abort_release_timeout: Duration::from_secs(30),
            seed: 0,
            room_base: None,
            progress: false,
            backend: kvx_engine::plane::Backend::Tcp,
            rdma: kvx_engine::plane::RdmaOptions::default(),
            staging: None,
            stop: None,
            shutdown_timeout: Duration::from_secs(10),
            ready: None,
        }
    }

    /// The engine settings these amount to (the protocol's; the rest is load generation).
    pub fn engine_config(&self, name: &str) -> DecodeEngineConfig {
        DecodeEngineConfig {
            host: self.host.clone(),
            tp_size: self.tp_size,
            tp_rank: self.tp_rank,
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            waiting_timeout: self.waiting_timeout,
            heartbeat_interval: self.heartbeat_interval,
            heartbeat_max_failure: self.heartbeat_max_failure,
            zmq_send_timeout: self.zmq_send_timeout,
            abort_release_timeout: self.abort_release_timeout,
            backend: self.backend,
            rdma: self.rdma.clone(),
            name: Some(name.to_owned()),
            bootstrap_tries: 15,
            events: false,
            staging: self.staging,
            ..DecodeEngineConfig::new(self.layout.clone())
        }
    }
}

/// The load generator's state beside the engine: its memory, free pages and rows, and what the
/// summary counts.
struct Load {
    cfg: DecodeConfig,
    engine: Arc<DecodeEngine>,
    kv: Arc<Region>,
    aux: Arc<Region>,
    pages: Mutex<PageAllocator>,
    rows: Mutex<Vec<u64>>,
    freed: Notify,
    /// Failed rooms still holding their pages (awaited before the summary).
    settling: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Bytes verified.
    bytes: AtomicU64,
    /// Rooms the drain deadline failed and ABORTed.
    shutdown_aborted: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs the decode peer to completion and returns its summary.
pub async fn run(cfg: DecodeConfig) -> Result<Summary> {
    let name = format!(
        "kvx-decode-{}-{}-{}",
        std::process::id(),
        cfg.seed,
        cfg.tp_rank
    );
    // With the shm backend the pages live in /dev/shm, where a prefill of this host maps them.
    let alloc = |part, len| kvx_engine::plane::alloc_region(cfg.backend, &name, part, len);
    let kv = Arc::new(alloc("kv", cfg.layout.pool_bytes() as usize)?);
    let aux = Arc::new(alloc("aux", cfg.layout.aux_bytes() as usize)?);
    // The rooms run on a decode engine, as an embedder's would; this driver allocates their
    // pages, verifies them and keeps the summary. The memory lives as long as the process:
    // dropping the engine closes it without waiting.
    let mem = DecodeMemory::new(kv.clone(), aux.clone());
    let engine = Arc::new(
        DecodeEngine::start_async(cfg.engine_config(&name), mem)
            .await?
            .close_on_drop(),
    );
    let layout = &cfg.layout;
    let load = Arc::new(Load {
        pages: Mutex::new(PageAllocator::new(
            layout.pool_pages,
            cfg.fragmentation,
            cfg.seed,
        )),
        rows: Mutex::new((0..layout.aux_rows).rev().collect()),
        freed: Notify::new(),
        settling: Mutex::new(Vec::new()),
        bytes: AtomicU64::new(0),
        shutdown_aborted: AtomicU64::new(0),
        engine: engine.clone(),
        kv,
        aux,
        cfg,
    });
    let cfg = &load.cfg;
    let bootstrap_addr = format!("{}:{}", cfg.bootstrap_host, cfg.bootstrap_port);
    // Resolved before the first room (its heartbeat starts with it), as sglang's decode does.
    let connect = engine.resolve(&bootstrap_addr);
    match &cfg.stop {
        Some(stop) => tokio::select! {
            t = connect => t?,
            sig = stop.wait() => {
                engine.close();
                return Ok(Summary {
                    requests: cfg.requests,
                    not_started: cfg.requests,
                    interrupted: Some(sig.to_owned()),
                    ..Summary::default()
                });
            }
        },
        None => connect.await?,
    }
    if let Some(r) = &cfg.ready {
        r.set_ready();
    }
    let addr: Arc<str> = bootstrap_addr.into();
    let drain = cfg
        .stop
        .clone()
        .map(|stop| tokio::spawn(drain(load.clone(), stop)));
    metrics::gauge!("kvx_decode_rooms_in_flight").set(0.0);

    let bar = progress_bar(cfg.progress, cfg.requests as u64);
    let sem = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(cfg.requests);
    let stopped = || cfg.stop.as_ref().is_some_and(|s| s.requested().is_some());
    for _ in 0..cfg.requests {
        if stopped() {
            break;
        }
        let given = cfg
            .room_base
            .and_then(|b| Room::new(b.wrapping_add(tasks.len() as u64)));
        let room = match given {
            Some(r) => r,
            None => loop {
                if let Some(r) = Room::new(rng.random_range(1..=Room::MAX)) {
                    break r;
                }
            },
        };
        let tokens =
            rng.random_range(cfg.prompt_tokens.0..=cfg.prompt_tokens.1.max(cfg.prompt_tokens.0));
        let acquire = sem.clone().acquire_owned();
        let permit = match &cfg.stop {
            Some(stop) => tokio::select! {
                p = acquire => p?,
                _ = stop.wait() => break,
            },
            None => acquire.await?,
        };
        let (load, addr, bar) = (load.clone(), addr.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let in_flight = metrics::gauge!("kvx_decode_rooms_in_flight");
            in_flight.increment(1.0);
            let (result, latency) = one_request(&load, &addr, room, tokens).await;
            in_flight.decrement(1.0);
            let label = match &result {
                RoomResult::Verified => Some("verified"),
                RoomResult::Corrupt => Some("corrupt"),
                RoomResult::Failed(_) => Some("failed"),
                RoomResult::NotStarted => None,
            };
            if let Some(label) = label {
                metrics::counter!("kvx_decode_rooms_total", "result" => label).increment(1);
                metrics::histogram!("kvx_decode_room_latency_seconds")
                    .record(latency.as_secs_f64());
            }
            drop(permit);
            if let Some(b) = &bar {
                b.inc(1);
            }
            (room, result, latency)
        }));
    }
    let mut s = Summary {
        requests: cfg.requests,
        not_started: cfg.requests - tasks.len(),
        ..Summary::default()
    };
    let mut lat = Vec::new();
    for t in tasks {
        let (room, outcome, latency) = t.await?;
        if matches!(outcome, RoomResult::NotStarted) {
            s.not_started += 1;
            continue;
        }
        lat.push(latency.as_secs_f64() * 1e3);
        match outcome {
            RoomResult::NotStarted => {}
            RoomResult::Verified => {
                s.succeeded += 1;
                s.verified += 1;
            }
            RoomResult::Corrupt => {
                s.succeeded += 1;
                s.corrupt += 1;
                s.unverified_rooms.push(room.get());
            }
            RoomResult::Failed(reason) => {
                s.failed += 1;
                *s.failure_reasons.entry(reason).or_default() += 1;
                s.unverified_rooms.push(room.get());
            }
        }
    }
    // Failed rooms still holding their pages: their ACKs (or timeouts) decide the counts below.
    // A drain waits for them only briefly (the process is going away with its pages).
    let interrupted = cfg.stop.as_ref().and_then(|st| st.requested());
    let settling = std::mem::take(&mut *lock(&load.settling));
    let settle = async {
        for t in settling {
            let _ = t.await;
        }
    };
    if interrupted.is_some() {
        if tokio::time::timeout(SETTLE_ON_DRAIN, settle).await.is_err() {
            tracing::warn!("drain: failed rooms' pages released without every ABORT_ACK");
        }
    } else {
        settle.await;
    }
    if let Some(d) = drain {
        d.abort();
    }
    s.interrupted = interrupted.map(str::to_owned);
    s.shutdown_aborted = load.shutdown_aborted.load(Ordering::Relaxed) as usize;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    engine.close();
    s.seconds = t0.elapsed().as_secs_f64();
    let stats = engine.stats();
    s.bytes = load.bytes.load(Ordering::Relaxed);
    s.staged_chunks = stats.staged_chunks;
    s.staged_bytes_in_place = stats.staged_bytes_in_place;
    s.dropped_messages = stats.dropped_messages;
    s.aborted_rooms = stats.aborted_rooms;
    s.abort_acked_rooms = stats.abort_acked_rooms;
    s.late_writes = stats.late_writes;
    s.gbps = s.bytes as f64 / s.seconds.max(1e-9) / 1e9;
    s.latencies_ms = lat.clone();
    lat.sort_by(f64::total_cmp);
    s.p50_ms = percentile(&lat, 0.50);
    s.p99_ms = percentile(&lat, 0.99);
    Ok(s)
}

/// How long a drain waits for failed rooms' `ABORT_ACK`s before the summary.
const SETTLE_ON_DRAIN: Duration = Duration::from_secs(2);

/// The decode's drain: once `stop` fires, `/ready` says draining and no room starts; rooms
/// still in flight after `--shutdown-timeout` fail with the reason and are ABORTed at the
/// prefill (which stops writing them and acknowledges).
async fn drain(load: Arc<Load>, stop: crate::lifecycle::Stop) {
    let sig = stop.wait().await;
    let cfg = &load.cfg;
    if let Some(r) = &cfg.ready {
        r.set_draining();
    }
    let in_flight = load.engine.open_rooms().len();
    tracing::warn!(
        signal = sig,
        in_flight,
        timeout_s = cfg.shutdown_timeout.as_secs_f64(),
        "decode draining: no new rooms"
    );
    tokio::time::sleep(cfg.shutdown_timeout).await;
    let rooms = load.engine.open_rooms();
    if rooms.is_empty() {
        return;
    }
    let why =
        format!("decode shutting down ({sig}): room still in flight after --shutdown-timeout");
    tracing::warn!(rooms = rooms.len(), "{why}");
    for room in rooms {
        if load.engine.abort_room(room, &why).await {
            load.shutdown_aborted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn progress_bar(enabled: bool, n: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal as _;
    if !enabled || !std::io::stderr().is_terminal() {
        return None;
    }
    let b = indicatif::ProgressBar::new(n);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} rooms {pos}/{len} [{bar:30}] {elapsed_precise} eta {eta}",
    ) {
        b.set_style(style.progress_chars("=> "));
    }
    Some(b)
}

enum RoomResult {
    Verified,
    Corrupt,
    Failed(String),
    /// The run was stopped before the room sent its metadata.
    NotStarted,
}

async fn alloc(load: &Load, n: usize) -> Option<(Vec<i32>, u64)> {
    if n >= load.cfg.layout.pool_pages as usize {
        return None;
    }
    loop {
        let notified = load.freed.notified();
        {
            let mut pages = lock(&load.pages);
            let mut rows = lock(&load.rows);
            if pages.available() >= n
                && let Some(row) = rows.pop()
            {
                if let Some(p) = pages.alloc(n) {
                    return Some((p, row));
                }
                rows.push(row);
            }
        }
        match &load.cfg.stop {
            // A drain starts no room: stop waiting for pages.
            Some(stop) => tokio::select! {
                () = notified => {}
                _ = stop.wait() => return None,
            },
            None => notified.await,
        }
    }
}

fn release(load: &Load, pages: &[i32], row: u64) {
    lock(&load.pages).free(pages);
    lock(&load.rows).push(row);
    load.freed.notify_waiters();
}

async fn one_request(
    load: &Arc<Load>,
    addr: &str,
    room: Room,
    tokens: u64,
) -> (RoomResult, Duration) {
    let engine = &load.engine;
    let cfg = &load.cfg;
    let n = cfg.layout.pages_for(tokens) as usize;
    let t0 = Instant::now();
    let Some((pages, row)) = alloc(load, n).await else {
        if load
            .cfg
            .stop
            .as_ref()
            .is_some_and(|s| s.requested().is_some())
        {
            return (RoomResult::NotStarted, t0.elapsed());
        }
        return (
            RoomResult::Failed("room larger than the decode pool".into()),
            t0.elapsed(),
        );
    };
    if load
        .cfg
        .stop
        .as_ref()
        .is_some_and(|s| s.requested().is_some())
    {
        release(load, &pages, row);
        return (RoomResult::NotStarted, t0.elapsed());
    }
    let t0 = Instant::now();
    let handle = match engine.open_room(room, addr, pages.clone(), row) {
        Ok(h) => h,
        Err(e) => {
            release(load, &pages, row);
            return (RoomResult::Failed(format!("{e:#}")), t0.elapsed());
        }
    };
    let (status, reason) = handle.wait().await;
    let latency = t0.elapsed();
    if status == KVPoll::Success {
        let p = load.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let r = verify_room(&p.cfg.layout, &p.kv, &p.aux, room, &pages, row);
            release(&p, &pages, row);
            r
        })
        .await
        .ok()
        .flatten();
        return match checked {
            Some(bytes) => {
                load.bytes.fetch_add(bytes, Ordering::Relaxed);
                (RoomResult::Verified, latency)
            }
            None => (RoomResult::Corrupt, latency),
        };
    }
    // A failed room's pages may still receive writes: the engine holds them until nothing can
    // land in them (every ABORT_ACK, the release timeout, or a grace).
    let p = load.clone();
    let task = tokio::spawn(async move {
        handle.wait_released().await;
        release(&p, &pages, row);
    });
    let mut settling = lock(&load.settling);
    settling.retain(|t| !t.is_finished());
    settling.push(task);
    (
        RoomResult::Failed(reason.unwrap_or_else(|| "failed".into())),
        latency,
    )
}
