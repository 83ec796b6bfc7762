//! `kvx demo`: a bootstrap server, one prefill rank and one decode peer in one process, over
//! loopback TCP, with Llama-3-8B-shaped rooms by default. Prints rooms, bytes, GB/s and room
//! latency percentiles, and as its last line `verified: N/N rooms …`; the exit code is non-zero
//! when any room failed or did not verify.

use std::time::Duration;

use anyhow::{Context, Result};
use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};

use crate::config::{DemoArgs, PrefillArgs};
use crate::decode::{self, DecodeConfig};
use crate::prefill_cmd::{rank_registration, start_rank};
use crate::telemetry;

/// Runs the demo; returns the process exit code.
pub fn run(args: DemoArgs) -> Result<i32> {
    telemetry::install_metrics();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let m = args.model.clone();
    let layout = m
        .model
        .layout(m.tp_size, m.tp_rank, m.page_size, m.pool_pages);
    let (summary, fatal) = rt.block_on(async {
        let server = BootstrapServer::bind_with(
            ("127.0.0.1", 0),
            ServerConfig::default(),
            telemetry::metrics_router(),
        )
        .await
        .context("binding the bootstrap server")?;
        let port = server.local_addr().port();
        let pargs = PrefillArgs {
            model: m.clone(),
            bootstrap_host: "127.0.0.1".into(),
            bootstrap_port: port,
            serve_bootstrap: false,
            host: "127.0.0.1".into(),
            inbox_port: 0,
            metrics_port: None,
            queues: args.queues,
            bootstrap_timeout: 300.0,
            max_batch_ops: 1024,
            max_batch_mib: 64,
            chunk_pages: args.chunk_pages,
            fragmentation: args.fragmentation,
            restart_workers: false,
            backend: "tcp".into(),
            connections: 2,
            staging: crate::config::StagingArgs {
                staging: false,
                chunked_prefill_size: 8192,
            },
            staging_wait_timeout: 60.0,
            aux_over_tcp: false,
        };
        let engine = start_rank(&pargs, args.backend, tokio::runtime::Handle::current())?;
        let client = BootstrapClient::new("127.0.0.1", port)?;
        let reg = rank_registration(&m, &engine.endpoint().host, engine.endpoint().port);
        client
            .register_rank(&reg, &RetryPolicy::sglang())
            .await
            .context("registering the prefill rank")?;
        let cfg = DecodeConfig {
            tp_size: m.tp_size,
            tp_rank: m.tp_rank,
            kv_cache_dtype: m.kv_cache_dtype.clone(),
            requests: args.rooms,
            prompt_tokens: (args.prompt_tokens, args.prompt_tokens),
            concurrency: args.concurrency,
            fragmentation: args.fragmentation,
            seed: 0xdec0de,
            progress: true,
            backend: args.backend,
            ..DecodeConfig::new("127.0.0.1", port, layout.clone())
        };
        let summary = decode::run(cfg).await?;
        let fatal = engine.wait_fatal(Duration::ZERO);
        engine.shutdown();
        anyhow::Ok((summary, fatal))
    })?;
    if let Some(path) = &args.summary_json {
        std::fs::write(path, serde_json::to_vec_pretty(&summary)?)?;
    }
    if let Some(f) = fatal {
        eprintln!("{f}");
    }
    for (reason, n) in &summary.failure_reasons {
        println!("failed: {n} rooms: {reason}");
    }
    println!(
        "model: {:?}, {} buffers × {} B/page, page size {}",
        m.model, layout.num_buffers, layout.item_len, layout.page_size
    );
    println!(
        "rooms: {} × {} tokens, concurrency {}",
        summary.requests, args.prompt_tokens, args.concurrency
    );
    println!(
        "bytes: {:.1} MiB in {:.2} s = {:.2} GB/s",
        summary.bytes as f64 / (1 << 20) as f64,
        summary.seconds,
        summary.gbps
    );
    println!(
        "room latency: p50 {:.1} ms, p99 {:.1} ms",
        summary.p50_ms, summary.p99_ms
    );
    println!(
        "verified: {}/{} rooms ({} failed, {} corrupt)",
        summary.verified, summary.requests, summary.failed, summary.corrupt
    );
    Ok(if summary.verified == summary.requests {
        0
    } else {
        1
    })
}
