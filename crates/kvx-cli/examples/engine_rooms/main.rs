//! Whole rooms through the two engines alone, for `cargo xtask bench e2e` (issue 15, items 4
//! and 5): a bootstrap server, `--tp-size` [`PrefillEngine`]s and one [`DecodeEngine`] (decode
//! TP 1) in one process over loopback tcp, rooms one at a time, timed on one clock.
//!
//! The synthetic model is kept off the clock: before a room starts, every prefill rank takes its
//! source pages and writes the room's pattern into them; the clock starts when the decode opens
//! the room ([`DecodeEngine::open_room`]) and stops when the decode's event thread receives
//! `Done` with Success; the bytes are verified after that ([`verify_room`]). Per room it
//! records, on that one clock: `wall` (decode opens the room → decode sees Success: resolution,
//! metadata, the prefill's `Ready`, the transfer and the status), `ready` (→ the first prefill
//! rank's `Ready` event), `window` (the first chunk handed to a prefill engine, i.e. the first
//! write posted → decode sees Success) and `control` (the last chunk handed over by the last
//! rank → decode sees Success). With `--empty-rooms N` every room has no KV page (an empty last
//! chunk: the aux row and the status only), so `control` is the engines' fixed cost of a room.
//! One empty room runs first, off the record, so that the prefill is resolved and the data
//! connections are up before the first measured room, and the decode pool is written once before
//! it (a serving stack's pool is allocated and touched at start-up).
//!
//! After the rooms, with the engines stopped, it measures what the host allows ([`floors`]): for
//! rooms, `memcpy` into the decode's destination pattern (a rank's heads of each token at the
//! stride of a token row) against a contiguous copy; for empty rooms, the control path's floor
//! (a plain TCP write + acknowledgement, then one ZMQ message).
//!
//! With `--timeline` it also records kvx-engine's per-room stage events
//! (`kvx_engine::timeline`, through a tracing layer: [`timeline::Timeline`]) and prints where
//! `control` goes, stage by stage (p50 / p99 per hand-off).
//!
//! Run with `cargo run --release -p kvx-cli --example engine_rooms -- --model llama3-8b
//! --tokens 4096 --rooms 4 --json rooms.json`; it prints one line per room and a summary, and
//! `--json` writes every room's figures (`cargo xtask bench e2e` reads them). The exit code is
//! non-zero unless every room verified.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};
use kvx_cli::config::ModelArgs;
use kvx_cli::decode::{DecodeStagingConfig, percentile};
use kvx_cli::prefill_cmd::rank_registration;
use kvx_core::{Chunk, KVPoll, PageSlice, Room};
use kvx_engine::decode::engine::{
    DecodeEngine, DecodeEngineConfig, DecodeEngineEvent, DecodeMemory,
};
use kvx_engine::engine::{EngineEvent, PrefillConfig, PrefillEngine};
use kvx_engine::model::ModelPreset;
use kvx_engine::pages::PageAllocator;
use kvx_engine::plane::Backend;
use kvx_engine::region::Region;
use kvx_engine::synthetic::SyntheticModel;
use kvx_engine::synthetic::prefill_memory;
use kvx_engine::synthetic::verify_room;

mod floors;
mod timeline;

/// Flags.
#[derive(Parser, Debug)]
struct Args {
    /// Synthetic model shape.
    #[arg(long, value_enum, default_value = "llama3-8b")]
    model: ModelPreset,
    /// Prefill attention-TP size (the decode is TP 1; more than 1 sends per-token head slices).
    #[arg(long, default_value_t = 1)]
    tp_size: u32,
    /// Prompt tokens per room.
    #[arg(long, default_value_t = 4096)]
    tokens: u64,
    /// Rooms to measure.
    #[arg(long, default_value_t = 4)]
    rooms: u64,
    /// Measure this many empty rooms (no KV page) instead of `--rooms` rooms of `--tokens`.
    #[arg(long)]
    empty_rooms: Option<u64>,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    page_size: u64,
    /// Pages per chunk handed to the prefill engine (`kvx demo`'s default).
    #[arg(long, default_value_t = 32)]
    chunk_pages: usize,
    /// Fraction of page-list breaks on both sides (`kvx demo`'s default).
    #[arg(long, default_value_t = 0.5)]
    fragmentation: f64,
    /// Transfer queues per prefill rank.
    #[arg(long, default_value_t = 4)]
    queues: usize,
    /// Data-plane connections per decode session.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Write every room's figures here as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// With `--tp-size` above 1: send through a decode staging ring of this many MiB (sglang's
    /// staging path, `DecodeEngineConfig::staging`) instead of per-token head slices.
    #[arg(long)]
    staging_ring_mib: Option<u64>,
    /// With `--staging-ring-mib`: scatter every staged block from the ring instead of receiving
    /// it straight into the pages (`DecodeStagingConfig::in_place` off; for comparison).
    #[arg(long)]
    ring_scatter: bool,
    /// `chunked_prefill_size` in tokens: the staging chunk grid of both sides.
    #[arg(long, default_value_t = kvx_staging::grid::DEFAULT_CHUNKED_PREFILL_SIZE)]
    chunked_prefill_size: i64,
    /// Record the engines' per-room stage events and print the control path stage by stage.
    #[arg(long)]
    timeline: bool,
    /// Most writes per posted batch (`PrefillConfig::max_batch_ops`; default: the engine's).
    #[arg(long)]
    max_batch_ops: Option<usize>,
    /// Send aux rows as `AUX_DATA` on the status socket instead of writing them (sglang's
    /// `aux_over_tcp`): an empty room then has no data-plane write at all.
    #[arg(long)]
    aux_over_tcp: bool,
    /// `PrefillConfig::loop_spin` in microseconds (0: the loop sleeps at once).
    #[arg(long, default_value_t = kvx_engine::engine::DEFAULT_LOOP_SPIN_US)]
    loop_spin_us: u64,
    /// Idle this many milliseconds before each measured room (beyond the engines' data-session
    /// idle limit, every room finds its sessions closed).
    #[arg(long, default_value_t = 0)]
    gap_ms: u64,
    /// The forward pass: each prefill rank waits this many milliseconds after `Ready` before it
    /// opens the room and hands its chunks over (off the transfer window's clock).
    #[arg(long, default_value_t = 0)]
    forward_ms: u64,
}

/// One prefill rank's source pages for a room, written before the room's clock starts.
struct Prepared {
    room: Room,
    pages: Vec<i32>,
    row: u64,
}

/// What a prefill rank's thread tells the driver.
enum Report {
    /// The rank got `Ready` at `ready`, handed the first chunk over at `first` and the last at
    /// `last` (each taken just before the call).
    Sent {
        room: Room,
        ready: Instant,
        first: Instant,
        last: Instant,
    },
    /// The rank released the room: its source pages are free.
    Released { room: Room, rank: u32 },
    /// The rank could not serve the room.
    Error(String),
}

/// One measured room.
#[derive(serde::Serialize)]
struct RoomFigures {
    room: u64,
    verified: bool,
    bytes: u64,
    wall_s: f64,
    ready_s: f64,
    window_s: f64,
    control_s: f64,
}

/// A prefill rank's embedder thread: on `Ready` it opens the room and hands over the chunks of
/// the pages prepared for it (the pattern is already in them).
fn serve_rank(
    rank: u32,
    engine: &PrefillEngine,
    events: &Receiver<EngineEvent>,
    prepared: &Receiver<Prepared>,
    chunk_pages: usize,
    forward: Duration,
    reports: &Sender<Report>,
) {
    let mut ready_rooms: HashMap<Room, Prepared> = HashMap::new();
    while let Ok(event) = events.recv() {
        match event {
            EngineEvent::Ready { room, pages: n } => {
                let ready = Instant::now();
                // Sent before the decode opened the room, so it is here by now.
                while let Ok(p) = prepared.try_recv() {
                    ready_rooms.insert(p.room, p);
                }
                let Some(p) = ready_rooms.remove(&room) else {
                    let _ = reports.send(Report::Error(format!("rank {rank}: {room} unknown")));
                    continue;
                };
                if !forward.is_zero() {
                    std::thread::sleep(forward);
                }
                match hand_over(engine, &p, n, chunk_pages) {
                    Ok((first, last)) => {
                        let _ = reports.send(Report::Sent {
                            room,
                            ready,
                            first,
                            last,
                        });
                    }
                    Err(e) => {
                        let _ = reports.send(Report::Error(format!("rank {rank}: {e:#}")));
                    }
                }
            }
            EngineEvent::Released { room, .. } => {
                let _ = reports.send(Report::Released { room, rank });
            }
        }
    }
}

/// Opens `p.room` on `engine` and hands over its `n` pages in chunks; returns when the first and
/// the last chunk were handed over.
fn hand_over(
    engine: &PrefillEngine,
    p: &Prepared,
    n: usize,
    chunk_pages: usize,
) -> Result<(Instant, Instant)> {
    if p.pages.len() != n {
        bail!("{}: {n} pages asked, {} prepared", p.room, p.pages.len());
    }
    engine.open_room(p.room)?;
    engine.init_room(p.room, n, p.row)?;
    if n == 0 {
        let t = Instant::now();
        engine.send(p.room, Chunk::empty_last(0))?;
        return Ok((t, t));
    }
    let step = chunk_pages.max(1);
    let (mut first, mut last) = (None, Instant::now());
    for (k, chunk) in p.pages.chunks(step).enumerate() {
        let start = k * step;
        let slice = PageSlice::new(start, start + chunk.len()).context("page slice")?;
        let mut c = Chunk::new(slice, chunk.to_vec());
        if start + chunk.len() == n {
            c = c.last();
        }
        last = Instant::now();
        first.get_or_insert(last);
        engine.send(p.room, c)?;
    }
    Ok((first.unwrap_or(last), last))
}

/// The process's peak resident set (`VmHWM` of `/proc/self/status`), where Linux reports it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let timeline = a.timeline.then(timeline::Timeline::install);
    if a.tp_size == 0 || a.page_size == 0 {
        bail!("--tp-size and --page-size must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dlayout0 = a.model.layout(1, 0, a.page_size, 1);
    let (measured, pages_per_room) = match a.empty_rooms {
        Some(n) => (n, 0),
        None => (a.rooms, dlayout0.pages_for(a.tokens)),
    };
    let pool_pages = pages_per_room + 64;
    let dlayout = a.model.layout(1, 0, a.page_size, pool_pages);

    // The prefill instance: a bootstrap server and `tp_size` ranks, each with an embedder thread.
    let server = rt.block_on(BootstrapServer::bind(
        "127.0.0.1:0",
        ServerConfig::default(),
    ))?;
    let port = server.local_addr().port();
    let client = BootstrapClient::new("127.0.0.1", port)?;
    let (report_tx, reports) = std::sync::mpsc::channel();
    let mut ranks = Vec::new();
    // Memory registered with the engines: the caller's KV pools and aux buffers on both sides,
    // and what the engines allocate themselves (staging buffers, the decode's ring).
    let mut registered = 0u64;
    for r in 0..a.tp_size {
        let layout = a.model.layout(a.tp_size, r, a.page_size, pool_pages);
        let mem = prefill_memory(&layout);
        registered += mem.kv.len() + mem.aux.len();
        let cfg = PrefillConfig {
            tp_rank: r,
            tp_size: a.tp_size,
            total_kv_heads: layout.total_kv_heads,
            page_size: u32::try_from(a.page_size)?,
            queues: a.queues.max(1),
            connections: a.connections.max(1),
            backend: Backend::Tcp,
            events: true,
            staging: a.staging_ring_mib.is_some(),
            chunked_prefill_size: a.chunked_prefill_size,
            aux_over_tcp: a.aux_over_tcp,
            loop_spin: Duration::from_micros(a.loop_spin_us),
            max_batch_ops: a
                .max_batch_ops
                .unwrap_or(PrefillConfig::default().max_batch_ops),
            ..PrefillConfig::default()
        };
        let engine = Arc::new(PrefillEngine::start(cfg, mem.clone(), rt.handle().clone())?);
        let events = engine.take_events().context("prefill events")?;
        let args = ModelArgs {
            model: a.model,
            tp_size: a.tp_size,
            tp_rank: r,
            page_size: a.page_size,
            pool_pages,
            kv_cache_dtype: "auto".into(),
        };
        let ep = engine.endpoint().clone();
        rt.block_on(client.register_rank(
            &rank_registration(&args, &ep.host, ep.port),
            &RetryPolicy::sglang(),
        ))?;
        let (prep_tx, prep_rx) = std::sync::mpsc::channel();
        let (e, tx, step) = (engine.clone(), report_tx.clone(), a.chunk_pages);
        let forward = Duration::from_millis(a.forward_ms);
        std::thread::Builder::new()
            .name(format!("embedder-{r}"))
            .spawn(move || serve_rank(r, &e, &events, &prep_rx, step, forward, &tx))?;
        let model = SyntheticModel {
            layout: layout.clone(),
            kv: mem.kv.clone(),
            aux: mem.aux.clone(),
            chunk_pages: a.chunk_pages,
            pages: PageAllocator::new(pool_pages, a.fragmentation, 0x5eed + u64::from(r)),
        };
        ranks.push((engine, model, prep_tx));
    }
    drop(report_tx);

    // The decode: one engine over its own pool.
    let dmem = DecodeMemory::new(
        Arc::new(Region::new(usize::try_from(dlayout.pool_bytes())?)),
        Arc::new(Region::new(usize::try_from(dlayout.aux_bytes())?)),
    );
    registered += dmem.kv.len() + dmem.aux.len();
    let (dkv, daux) = (dmem.kv.clone(), dmem.aux.clone());
    // Touched once, as a serving stack's pool (allocated, zeroed or pinned at start-up) would
    // be: the first room would otherwise pay the kernel's first-touch page faults.
    for r in [&dkv, &daux] {
        r.fill(r.base(), r.len(), 0)?;
    }
    let decode = DecodeEngine::start(
        DecodeEngineConfig {
            staging: a.staging_ring_mib.map(|mib| DecodeStagingConfig {
                ring_bytes: mib << 20,
                chunked_prefill_size: a.chunked_prefill_size,
                in_place: !a.ring_scatter,
            }),
            ..DecodeEngineConfig::new(dlayout.clone())
        },
        dmem,
        rt.handle().clone(),
    )?;
    let devents = decode.take_events().context("decode events")?;
    let addr = format!("127.0.0.1:{port}");
    let mut dpages = PageAllocator::new(pool_pages, a.fragmentation, 7);

    let mut rooms = Vec::new();
    let (mut fill_s, mut verify_s) = (0.0, 0.0);
    // Room 1 is the warm-up (empty): it resolves the prefill and opens the data connections.
    for k in 0..=measured {
        let room = Room::new(k + 1).context("room id")?;
        let n = if k == 0 { 0 } else { pages_per_room as usize };
        if k > 0 && a.gap_ms > 0 {
            std::thread::sleep(Duration::from_millis(a.gap_ms));
        }
        let row = k % dlayout.aux_rows;
        let t = Instant::now();
        let mut src = Vec::new();
        for (model, prep) in ranks.iter_mut().map(|(_, m, p)| (m, p)) {
            let pages = model.pages.alloc(n).context("prefill pool")?;
            model.fill(room, &pages, row);
            src.push(pages.clone());
            prep.send(Prepared { room, pages, row })
                .context("embedder thread gone")?;
        }
        fill_s += t.elapsed().as_secs_f64();
        let dst = dpages.alloc(n).context("decode pool")?;

        let open = Instant::now();
        let handle = decode.open_room(room, &addr, dst.clone(), row)?;
        let done = loop {
            match devents.recv_timeout(Duration::from_secs(600)) {
                Ok(DecodeEngineEvent::Done {
                    room: r,
                    status,
                    reason,
                }) if r == room => {
                    let at = Instant::now();
                    if let Some(t) = &timeline {
                        t.mark(room.get(), "event", at);
                    }
                    if status != KVPoll::Success {
                        bail!("{room} failed: {}", reason.unwrap_or_default());
                    }
                    break at;
                }
                Ok(_) => {}
                Err(e) => bail!("{room}: no outcome from the decode: {e}"),
            }
        };
        let t = Instant::now();
        let bytes = verify_room(&dlayout, &dkv, &daux, room, &dst, row);
        verify_s += t.elapsed().as_secs_f64();

        // Every rank's hand-over, then every rank's release of its source pages.
        let (mut ready, mut first, mut last) = (None::<Instant>, None::<Instant>, None::<Instant>);
        let mut sent = 0;
        let mut released = vec![false; ranks.len()];
        while sent < ranks.len() || released.contains(&false) {
            match reports.recv_timeout(Duration::from_secs(60)) {
                Ok(Report::Sent {
                    room: r,
                    ready: rd,
                    first: f,
                    last: l,
                }) if r == room => {
                    sent += 1;
                    ready = Some(ready.map_or(rd, |x| x.min(rd)));
                    first = Some(first.map_or(f, |x| x.min(f)));
                    last = Some(last.map_or(l, |x| x.max(l)));
                }
                Ok(Report::Released { room: r, rank }) if r == room => {
                    if let Some(x) = released.get_mut(rank as usize) {
                        *x = true;
                    }
                }
                Ok(Report::Error(e)) => bail!("{room}: {e}"),
                Ok(_) => {}
                Err(e) => bail!("{room}: the prefill ranks did not report: {e}"),
            }
        }
        for ((_, model, _), pages) in ranks.iter_mut().zip(&src) {
            model.pages.free(pages);
        }
        drop(handle);
        dpages.free(&dst);
        let since = |t: Option<Instant>| done.saturating_duration_since(t.unwrap_or(open));
        let f = RoomFigures {
            room: room.get(),
            verified: bytes.is_some(),
            bytes: bytes.unwrap_or(0),
            wall_s: done.saturating_duration_since(open).as_secs_f64(),
            ready_s: ready.map_or(0.0, |r| r.saturating_duration_since(open).as_secs_f64()),
            window_s: since(first).as_secs_f64(),
            control_s: since(last).as_secs_f64(),
        };
        if k == 0 {
            continue;
        }
        if a.empty_rooms.is_none() {
            println!(
                "{room}: {} B in {:.1} ms (ready after {:.2} ms, transfer window {:.1} ms, \
                 last chunk → Success {:.0} µs){}",
                f.bytes,
                f.wall_s * 1e3,
                f.ready_s * 1e3,
                f.window_s * 1e3,
                f.control_s * 1e6,
                if f.verified { "" } else { " NOT VERIFIED" }
            );
        }
        rooms.push(f);
    }

    // What the engines allocated for themselves, once every room ran (a prefill allocates a
    // staging buffer on a queue's first gather).
    registered += decode.own_memory_bytes();
    let stats = decode.stats();
    if stats.staged_chunks > 0 {
        println!(
            "staging: {} chunks, {:.1} MiB of blocks received straight into the pages",
            stats.staged_chunks,
            stats.staged_bytes_in_place as f64 / (1 << 20) as f64
        );
    }
    registered += ranks
        .iter()
        .map(|(e, _, _)| e.own_memory_bytes())
        .sum::<u64>();
    decode.shutdown();
    for (engine, _, _) in &ranks {
        engine.shutdown();
    }
    drop(server);

    let verified = rooms.iter().filter(|r| r.verified).count();
    let bytes: u64 = rooms.iter().map(|r| r.bytes).sum();
    let sum = |f: fn(&RoomFigures) -> f64| rooms.iter().map(f).sum::<f64>();
    let pct = |f: fn(&RoomFigures) -> f64, q| {
        let mut v: Vec<f64> = rooms.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, q)
    };
    println!(
        "model {:?}, prefill TP {} → decode TP 1, {} rooms × {} pages; fill {fill_s:.2} s and \
         verification {verify_s:.2} s off the clock",
        a.model,
        a.tp_size,
        rooms.len(),
        pages_per_room
    );
    println!(
        "engine: {:.2} GB/s over open → Success, {:.2} GB/s over the transfer windows",
        bytes as f64 / sum(|r| r.wall_s).max(1e-9) / 1e9,
        bytes as f64 / sum(|r| r.window_s).max(1e-9) / 1e9
    );
    println!(
        "room wall p50 {:.2} ms p99 {:.2} ms; transfer window p50 {:.0} µs p99 {:.0} µs; last \
         chunk → Success p50 {:.0} µs p99 {:.0} µs",
        pct(|r| r.wall_s, 0.5) * 1e3,
        pct(|r| r.wall_s, 0.99) * 1e3,
        pct(|r| r.window_s, 0.5) * 1e6,
        pct(|r| r.window_s, 0.99) * 1e6,
        pct(|r| r.control_s, 0.5) * 1e6,
        pct(|r| r.control_s, 0.99) * 1e6
    );
    // Issue 15 item 7: no payload-sized copies means the process's peak resident memory stays
    // near the memory the caller registered (both engines live in this one process). Read
    // before the copy pattern below allocates its own buffers.
    let peak = peak_rss_bytes();
    // What the host allows, measured now that the engines are stopped.
    let mut copy_ratio = None;
    let mut floor = None;
    if a.empty_rooms.is_some() {
        let rounds = floors::control_floor(2000)?;
        let us = |f: fn(&floors::FloorRound) -> Duration| {
            let mut v: Vec<f64> = rounds.iter().map(|r| f(r).as_secs_f64() * 1e6).collect();
            v.sort_by(f64::total_cmp);
            (percentile(&v, 0.5), percentile(&v, 0.99))
        };
        let (p50, p99) = us(|r| r.total());
        let (w50, w99) = us(|r| r.write_ack);
        let (m50, m99) = us(|r| r.message);
        println!(
            "floor: a plain TCP write + ack, then one ZMQ message: p50 {p50:.0} µs p99 {p99:.0} µs \
             (write + ack p50 {w50:.0} p99 {w99:.0}, message p50 {m50:.0} p99 {m99:.0}; {} \
             rounds)",
            rounds.len()
        );
        floor = Some(serde_json::json!({
            "p50_us": p50, "p99_us": p99,
            "write_ack_p50_us": w50, "write_ack_p99_us": w99,
            "message_p50_us": m50, "message_p99_us": m99,
        }));
    } else {
        // A prefill rank's heads of one token in one buffer, at the decode's token-row stride.
        let prefill0 = a.model.layout(a.tp_size, 0, a.page_size, 1);
        let piece = prefill0.item_len / a.page_size;
        let stride = dlayout.item_len / a.page_size;
        if piece < stride {
            let (strided, contiguous) =
                floors::copy_pattern(usize::try_from(piece)?, usize::try_from(stride)?);
            let r = strided / contiguous;
            println!(
                "copy pattern: memcpy into {piece} B pieces at a {stride} B stride {strided:.2} \
                 GB/s, contiguous {contiguous:.2} GB/s (ratio {r:.2})"
            );
            copy_ratio = Some(r);
        }
    }
    let mut segments = Vec::new();
    if let Some(t) = &timeline {
        let ids: Vec<u64> = rooms.iter().map(|r| r.room).collect();
        println!(
            "control path, stage by stage (µs over {} rooms):",
            ids.len()
        );
        for (name, v) in t.segments(&ids) {
            let (p50, p99) = (percentile(&v, 0.5), percentile(&v, 0.99));
            println!(
                "  {name:<32} p50 {p50:>7.1}  p99 {p99:>7.1}  ({} rooms)",
                v.len()
            );
            segments.push(serde_json::json!({"segment": name, "p50_us": p50, "p99_us": p99}));
        }
    }
    if let Some(peak) = peak {
        // Registered memory never touched (a staging buffer's unused tail) is not resident: the
        // difference may be negative.
        println!(
            "memory: peak RSS {:.0} MiB, registered {:.0} MiB (RSS - registered: {:+.0} MiB)",
            peak as f64 / (1 << 20) as f64,
            registered as f64 / (1 << 20) as f64,
            (peak as f64 - registered as f64) / (1 << 20) as f64
        );
    }
    if let Some(path) = &a.json {
        let out = serde_json::json!({
            "registered_bytes": registered,
            "peak_rss_bytes": peak,
            "model": format!("{:?}", a.model),
            "prefill_tp": a.tp_size,
            "decode_tp": 1,
            "tokens": if a.empty_rooms.is_some() { 0 } else { a.tokens },
            "pages_per_room": pages_per_room,
            "fill_s": fill_s,
            "verify_s": verify_s,
            "rooms": rooms,
            "timeline": segments,
            "copy_pattern_ratio": copy_ratio,
            "floor": floor,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)
            .with_context(|| format!("--json {}", path.display()))?;
    }
    println!("verified: {verified}/{} rooms", rooms.len());
    if verified != rooms.len() {
        std::process::exit(1);
    }
    Ok(())
}
