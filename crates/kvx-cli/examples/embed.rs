//! Embedding a kvx prefill rank in a serving stack: the stack allocates its own KV pool and aux
//! rows (as it allocates its tensors), hands them to the engine by address and length — nothing
//! is copied, the engine never frees them — and drives rooms from its own forward pass: on
//! `Ready` it takes pages, computes KV into them, opens the room and hands the chunks over; on
//! `Released` it gets the pages back. A kvx decode in the same process receives the rooms over
//! loopback TCP and checks every byte.
//!
//! Run with `cargo run --release -p kvx-cli --example embed`; the last line is
//! `verified: N/N rooms`, and the exit code is non-zero unless every room verified.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use kvx_bootstrap::http::{
    BootstrapClient, BootstrapServer, RankRegistration, RetryPolicy, ServerConfig,
};
use kvx_cli::decode::{self, DecodeConfig};
use kvx_cli::engine::{EngineEvent, PrefillConfig, PrefillEngine, PrefillMemory};
use kvx_cli::forward::SyntheticModel;
use kvx_cli::model::ModelPreset;
use kvx_cli::pages::PageAllocator;
use kvx_cli::plane::Backend;
use kvx_cli::region::Region;
use kvx_core::{Chunk, PageSlice};

const ROOMS: usize = 12;
const PAGE_SIZE: u64 = 16;
const POOL_PAGES: u64 = 512;

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let layout = ModelPreset::Tiny.layout(1, 0, PAGE_SIZE, POOL_PAGES);

    // The serving stack's own memory.
    let mut kv_pool = vec![0u8; usize::try_from(layout.pool_bytes())?];
    let mut aux_rows = vec![0u8; usize::try_from(layout.aux_bytes())?];
    // SAFETY: both vectors outlive the engine (it is shut down and dropped before them, at the
    // end of `main`), and this program touches their bytes only through the regions, page by
    // page, under the page-ownership contract.
    let (kv, aux) = unsafe {
        (
            Region::from_raw(kv_pool.as_mut_ptr() as u64, kv_pool.len()).context("kv pool")?,
            Region::from_raw(aux_rows.as_mut_ptr() as u64, aux_rows.len()).context("aux")?,
        )
    };
    let (kv, aux) = (Arc::new(kv), Arc::new(aux));
    let mem = PrefillMemory::new(
        kv.clone(),
        layout.kv_ptrs(kv.base()),
        layout.item_len,
        aux.clone(),
        layout.aux_ptrs(aux.base()),
        layout.aux_item_lens(),
    )
    .mla(layout.mla);
    let cfg = PrefillConfig {
        total_kv_heads: layout.total_kv_heads,
        page_size: PAGE_SIZE as u32,
        backend: Backend::Tcp,
        events: true,
        ..PrefillConfig::default()
    };
    let engine = PrefillEngine::start(cfg, mem, rt.handle().clone())?;
    let events = engine.take_events().context("event stream")?;

    // Bootstrap server and registration, as `kvx prefill --serve-bootstrap` does.
    let (server, port) = rt.block_on(async {
        let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default()).await?;
        let port = server.local_addr().port();
        let ep = engine.endpoint();
        let rank = RankRegistration {
            attn_tp_size: 1,
            attn_tp_rank: 0,
            attn_cp_size: 1,
            attn_cp_rank: 0,
            attn_dp_size: 1,
            attn_dp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            system_dp_size: 1,
            system_dp_rank: 0,
            rank_ip: ep.host.clone(),
            rank_port: ep.port,
            page_size: Some(PAGE_SIZE),
            kv_cache_dtype: Some("auto".into()),
            load_balance_method: None,
            enable_dsa_cache_layer_split: None,
            prefill_http_port: None,
            kv_layout: None,
            dsv41_spec_layout: None,
            enable_kv_cache_sharding: None,
            decode_allocation_policy: None,
        };
        BootstrapClient::new("127.0.0.1", port)?
            .register_rank(&rank, &RetryPolicy::sglang())
            .await?;
        anyhow::Ok((server, port))
    })?;

    // A kvx decode in this process: it registers, sends metadata per room and verifies bytes.
    let dcfg = DecodeConfig {
        requests: ROOMS,
        prompt_tokens: (200, 900),
        ..DecodeConfig::new("127.0.0.1", port, layout.clone())
    };
    let decode = rt.spawn(decode::run(dcfg));

    // The stack's forward pass. `SyntheticModel::fill` stands in for the model: it writes the
    // KV (and aux rows) the decode checks.
    let model = SyntheticModel {
        layout: layout.clone(),
        kv: kv.clone(),
        aux: aux.clone(),
        chunk_pages: 4,
        pages: PageAllocator::new(POOL_PAGES, 0.0, 1),
    };
    let mut pages = PageAllocator::new(POOL_PAGES, 0.3, 7);
    let mut rows: Vec<u64> = (0..layout.aux_rows).collect();
    let mut owned = HashMap::new();
    let mut released = 0;
    while released < ROOMS {
        let event = events
            .recv_timeout(std::time::Duration::from_secs(60))
            .context("no engine event for 60 s")?;
        match event {
            EngineEvent::Ready { room, pages: n } => {
                let (Some(mine), Some(row)) = (pages.alloc(n), rows.pop()) else {
                    bail!("the pool is too small for {n} pages");
                };
                model.fill(room, &mine, row);
                engine.open_room(room)?;
                engine.init_room(room, n, row)?;
                for (k, chunk) in mine.chunks(model.chunk_pages).enumerate() {
                    let start = k * model.chunk_pages;
                    let slice = PageSlice::new(start, start + chunk.len()).context("slice")?;
                    let mut c = Chunk::new(slice, chunk.to_vec());
                    if start + chunk.len() == n {
                        c = c.last();
                    }
                    engine.send(room, c)?;
                }
                owned.insert(room, (mine, row));
            }
            EngineEvent::Released { room, status } => {
                // Terminal and drained: nothing of the room can still be read from its pages.
                if let Some((mine, row)) = owned.remove(&room) {
                    pages.free(&mine);
                    rows.push(row);
                }
                released += 1;
                println!("{room}: {status}");
            }
        }
    }
    let summary = rt.block_on(decode)??;
    engine.shutdown();
    drop(engine);
    drop(server);
    println!(
        "verified: {}/{} rooms ({} failed, {} corrupt)",
        summary.verified, summary.requests, summary.failed, summary.corrupt
    );
    if summary.verified != summary.requests {
        std::process::exit(1);
    }
    Ok(())
}
