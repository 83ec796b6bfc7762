//! Embedding a kvx decode rank in a serving stack: the stack owns its KV pool and aux rows (as
//! it owns its tensors) and hands them to a `DecodeEngine` by address and length — nothing is
//! copied, the engine never frees them. Its scheduler allocates each request's pages and aux row,
//! opens the room on the engine, and takes the pages back on `Released`; on `Done` with Success
//! it reads the KV (here: checks every byte). A kvx prefill rank in the same process
//! (`PrefillEngine`, fed by a synthetic forward pass) serves the rooms over loopback TCP.
//!
//! Run with `cargo run --release -p kvx-cli --example embed_decode`; the last line is
//! `verified: N/N rooms`, and the exit code is non-zero unless every room verified.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvx_bootstrap::http::{BootstrapServer, ServerConfig};
use kvx_cli::config::ModelArgs;
use kvx_cli::decode::engine::{DecodeEngine, DecodeEngineConfig, DecodeEngineEvent, DecodeMemory};
use kvx_cli::decode::verify_room;
use kvx_cli::engine::{EngineEvent, PrefillConfig, PrefillEngine};
use kvx_cli::forward::SyntheticModel;
use kvx_cli::model::ModelPreset;
use kvx_cli::pages::PageAllocator;
use kvx_cli::plane::Backend;
use kvx_cli::prefill_cmd::{prefill_memory, rank_registration};
use kvx_cli::region::Region;
use kvx_core::{Chunk, KVPoll, PageSlice, Room};

const ROOMS: u64 = 12;
const PAGE_SIZE: u64 = 16;
const POOL_PAGES: u64 = 512;

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let layout = ModelPreset::Tiny.layout(1, 0, PAGE_SIZE, POOL_PAGES);

    // The prefill side: an engine, its bootstrap server, a synthetic forward pass.
    let pmem = prefill_memory(&layout);
    let pcfg = PrefillConfig {
        total_kv_heads: layout.total_kv_heads,
        page_size: PAGE_SIZE as u32,
        backend: Backend::Tcp,
        events: true,
        ..PrefillConfig::default()
    };
    let prefill = PrefillEngine::start(pcfg, pmem.clone(), rt.handle().clone())?;
    let prefill_events = prefill.take_events().context("prefill events")?;
    let (server, port) = rt.block_on(async {
        let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default()).await?;
        let port = server.local_addr().port();
        let args = ModelArgs {
            model: ModelPreset::Tiny,
            tp_size: 1,
            tp_rank: 0,
            page_size: PAGE_SIZE,
            pool_pages: POOL_PAGES,
            kv_cache_dtype: "auto".into(),
        };
        let ep = prefill.endpoint();
        kvx_bootstrap::http::BootstrapClient::new("127.0.0.1", port)?
            .register_rank(
                &rank_registration(&args, &ep.host, ep.port),
                &kvx_bootstrap::http::RetryPolicy::sglang(),
            )
            .await?;
        anyhow::Ok((server, port))
    })?;
    let model = SyntheticModel {
        layout: layout.clone(),
        kv: pmem.kv.clone(),
        aux: pmem.aux.clone(),
        chunk_pages: 4,
        pages: PageAllocator::new(POOL_PAGES, 0.0, 1),
    };
    let mut src_pages = PageAllocator::new(POOL_PAGES, 0.0, 3);

    // The decode side: the stack's own memory, handed over by address.
    let mut kv_pool = vec![0u8; usize::try_from(layout.pool_bytes())?];
    let mut aux_rows = vec![0u8; usize::try_from(layout.aux_bytes())?];
    // SAFETY: both vectors outlive the engine (it is shut down before they drop, at the end of
    // `main`), and this program reads their bytes only through the regions, and only for rooms
    // whose pages the engine handed back.
    let (kv, aux) = unsafe {
        (
            Region::from_raw(kv_pool.as_mut_ptr() as u64, kv_pool.len()).context("kv pool")?,
            Region::from_raw(aux_rows.as_mut_ptr() as u64, aux_rows.len()).context("aux")?,
        )
    };
    let mem = DecodeMemory::new(Arc::new(kv), Arc::new(aux));
    let (kv, aux) = (mem.kv.clone(), mem.aux.clone());
    let decode = DecodeEngine::start(
        DecodeEngineConfig::new(layout.clone()),
        mem,
        rt.handle().clone(),
    )?;
    let decode_events = decode.take_events().context("decode events")?;

    // The decode scheduler: a page and a row per request, one room each.
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

    let (mut verified, mut released) = (0, 0);
    while released < ROOMS {
        // The prefill's forward pass: a room whose decode sent metadata gets its KV and chunks.
        while let Ok(event) = prefill_events.try_recv() {
            match event {
                EngineEvent::Ready { room, pages: n } => {
                    let mine = src_pages.alloc(n).context("prefill pool")?;
                    let row = room.get() % layout.aux_rows;
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
                }
                EngineEvent::Released { .. } => {}
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
                    && verify_room(&layout, &kv, &aux, room, mine, *row).is_some()
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
    prefill.shutdown();
    drop(prefill);
    drop(server);
    drop((kv_pool, aux_rows));
    println!("verified: {verified}/{ROOMS} rooms");
    if verified != ROOMS {
        std::process::exit(1);
    }
    Ok(())
}
