//! Embedding kvx in a serving stack, both sides in one process: each stack allocates its own KV
//! pool and aux rows (as it allocates its tensors) and hands them to its engine by address and
//! length — nothing is copied, the engines never free them.
//!
//! - The prefill stack's forward pass drives a `PrefillEngine`: on `Ready` (every decode sent
//!   metadata) it takes pages, computes KV into them, opens the room and hands the chunks over;
//!   on `Released` it gets the pages back.
//! - The decode stack's scheduler drives a `DecodeEngine`: it allocates each request's pages and
//!   aux row, opens the room, reads the KV on `Done` with Success (here: checks every byte) and
//!   takes the pages back on `Released`.
//!
//! The rooms travel over loopback TCP, found through a bootstrap server the prefill registers
//! with, as sglang's are.
//!
//! Run with `cargo run --release --example embed`; the last line is `verified: N/N rooms`, and
//! the exit code is non-zero unless every room verified.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};
use kvx_core::{Chunk, KVPoll, PageSlice, Room};
use kvx_engine::decode::engine::{
    DecodeEngine, DecodeEngineConfig, DecodeEngineEvent, DecodeMemory,
};
use kvx_engine::engine::{EngineEvent, PrefillConfig, PrefillEngine, PrefillMemory};
use kvx_engine::model::{KvLayout, ModelPreset};
use kvx_engine::pages::PageAllocator;
use kvx_engine::region::Region;
use kvx_engine::synthetic::{SyntheticModel, verify_room};

const ROOMS: u64 = 12;
const PAGE_SIZE: u64 = 16;
const POOL_PAGES: u64 = 512;

/// A stack's own KV pool and aux rows, and the regions over them.
struct Pools {
    /// The allocations behind the regions, kept alive with them.
    _kv_pool: Vec<u8>,
    _aux_rows: Vec<u8>,
    kv: Arc<Region>,
    aux: Arc<Region>,
}

impl Pools {
    fn new(layout: &KvLayout) -> Result<Pools> {
        let mut kv_pool = vec![0u8; usize::try_from(layout.pool_bytes())?];
        let mut aux_rows = vec![0u8; usize::try_from(layout.aux_bytes())?];
        // SAFETY: both vectors live in the returned `Pools`, which `main` drops only after the
        // engine using them was shut down and dropped; moving a `Vec` does not move its heap
        // buffer. This program touches their bytes only through the regions, under the
        // page-ownership contract (pages of a room are read only once the engine gave them
        // back, or before they were handed over).
        let (kv, aux) = unsafe {
            (
                Region::from_raw(kv_pool.as_mut_ptr() as u64, kv_pool.len()).context("kv pool")?,
                Region::from_raw(aux_rows.as_mut_ptr() as u64, aux_rows.len()).context("aux")?,
            )
        };
        Ok(Pools {
            _kv_pool: kv_pool,
            _aux_rows: aux_rows,
            kv: Arc::new(kv),
            aux: Arc::new(aux),
        })
    }
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let layout = ModelPreset::Tiny.layout(1, 0, PAGE_SIZE, POOL_PAGES);

    // The prefill stack: its memory, its engine, its registration with a bootstrap server.
    let ppools = Pools::new(&layout)?;
    let pmem = PrefillMemory::new(
        ppools.kv.clone(),
        layout.kv_ptrs(ppools.kv.base()),
        layout.item_len,
        ppools.aux.clone(),
        layout.aux_ptrs(ppools.aux.base()),
        layout.aux_item_lens(),
    )
    .mla(layout.mla);
    let pcfg = PrefillConfig {
        total_kv_heads: layout.total_kv_heads,
        page_size: PAGE_SIZE as u32,
        events: true,
        ..PrefillConfig::default()
    };
    let prefill = PrefillEngine::start(pcfg, pmem, rt.handle().clone())?;
    let prefill_events = prefill.take_events().context("prefill events")?;
    let (server, port) = rt.block_on(async {
        let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default()).await?;
        let port = server.local_addr().port();
        BootstrapClient::new("127.0.0.1", port)?
            .register_rank(&prefill.rank_registration("auto"), &RetryPolicy::sglang())
            .await?;
        anyhow::Ok((server, port))
    })?;
    // `SyntheticModel::fill` stands in for the model: it writes the KV (and aux rows) the decode
    // checks.
    let model = SyntheticModel {
        layout: layout.clone(),
        kv: ppools.kv.clone(),
        aux: ppools.aux.clone(),
        chunk_pages: 4,
        pages: PageAllocator::new(POOL_PAGES, 0.0, 1),
    };
    let mut prefill_pages = PageAllocator::new(POOL_PAGES, 0.3, 3);
    let mut prefill_rows: Vec<u64> = (0..layout.aux_rows).collect();
    let mut prefill_held = HashMap::new();

    // The decode stack: its memory and its engine.
    let dpools = Pools::new(&layout)?;
    let mem = DecodeMemory::new(dpools.kv.clone(), dpools.aux.clone());
    let decode = DecodeEngine::start(
        DecodeEngineConfig::new(layout.clone()),
        mem,
        rt.handle().clone(),
    )?;
    let decode_events = decode.take_events().context("decode events")?;

    // The decode scheduler: pages and a row per request, one room each.
    let addr = format!("127.0.0.1:{port}");
    let mut pages = PageAllocator::new(POOL_PAGES, 0.3, 7);
    let mut rows: Vec<u64> = (0..layout.aux_rows).collect();
    let mut held = HashMap::new();
    let mut handles = Vec::new();
    for k in 1..=ROOMS {
        let room = Room::new(k).context("room")?;
        let n = layout.pages_for(200 + 60 * k) as usize;
        let (Some(mine), Some(row)) = (pages.alloc(n), rows.pop()) else {
            bail!("the decode pool is too small for {n} pages");
        };
        handles.push(decode.open_room(room, &addr, mine.clone(), row)?);
        held.insert(room, (mine, row));
    }

    let (mut verified, mut released, mut prefill_released) = (0, 0, 0);
    while released < ROOMS || prefill_released < ROOMS {
        // The prefill's forward pass.
        while let Ok(event) = prefill_events.try_recv() {
            match event {
                EngineEvent::Ready { room, pages: n } => {
                    let (Some(mine), Some(row)) = (prefill_pages.alloc(n), prefill_rows.pop())
                    else {
                        bail!("the prefill pool is too small for {n} pages");
                    };
                    model.fill(room, &mine, row);
                    prefill.open_room(room)?;
                    prefill.init_room(room, n, row)?;
                    for (k, chunk) in mine.chunks(model.chunk_pages).enumerate() {
                        let start = k * model.chunk_pages;
                        let slice = PageSlice::new(start, start + chunk.len()).context("slice")?;
                        let mut c = Chunk::new(slice, chunk.to_vec());
                        if start + chunk.len() == n {
                            c = c.last();
                        }
                        prefill.send(room, c)?;
                    }
                    prefill_held.insert(room, (mine, row));
                }
                EngineEvent::Released { room, .. } => {
                    // Terminal and drained: nothing of the room can still be read from its pages.
                    if let Some((mine, row)) = prefill_held.remove(&room) {
                        prefill_pages.free(&mine);
                        prefill_rows.push(row);
                    }
                    prefill_released += 1;
                }
            }
        }
        // The decode scheduler.
        match decode_events.recv_timeout(Duration::from_millis(5)) {
            Ok(DecodeEngineEvent::Done {
                room,
                status,
                reason,
            }) => {
                let (mine, row) = &held[&room];
                if status == KVPoll::Success
                    && verify_room(&layout, &dpools.kv, &dpools.aux, room, mine, *row).is_some()
                {
                    verified += 1;
                }
                println!("{room}: {status} {}", reason.unwrap_or_default());
            }
            Ok(DecodeEngineEvent::Released { room, .. }) => {
                if let Some((mine, row)) = held.remove(&room) {
                    pages.free(&mine);
                    rows.push(row);
                }
                released += 1;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => bail!("decode events: {e}"),
        }
    }
    drop(handles);
    decode.shutdown();
    drop(decode);
    if !prefill.shutdown() {
        // Engine threads still run: leak the memory rather than free it under them.
        std::mem::forget(ppools);
        bail!("prefill engine threads did not stop");
    }
    drop(prefill);
    drop(server);
    drop(model);
    drop((ppools, dpools));
    println!("verified: {verified}/{ROOMS} rooms");
    if verified != ROOMS {
        std::process::exit(1);
    }
    Ok(())
}
