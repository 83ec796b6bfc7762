//! `kvx demo`: a bootstrap server, one prefill rank and one decode peer in one process, over
//! loopback TCP, with Llama-3-8B-shaped rooms by default (`--tp-size` / `--decode-tp` run every
//! rank of both instances in the process, `--staging` sends between different TP sizes through
//! the decode rings). First it runs a link test over the same backend inside the process (1 GiB
//! of 16 MiB writes, as `kvx send` would), then the rooms; it prints rooms, bytes, GB/s, the
//! engines' own GB/s (bytes over the time the prefill had writes in flight) beside the link
//! test's, room latency percentiles, and as its last line `verified: N/N rooms …`; the exit code is non-zero
//! when any room failed or did not verify. SIGINT/SIGTERM drain it like `kvx decode` (no new
//! room, rooms in flight get `--shutdown-timeout`), then it prints its summary and exits 0
//! unless a started room failed for another reason or arrived corrupt.

use std::time::Duration;

use anyhow::{Context, Result};
use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};

use crate::config::{DemoArgs, LifecycleArgs, ModelArgs, PrefillArgs};
use crate::decode::{self, DecodeConfig};
use crate::lifecycle::Signals;
use crate::prefill_cmd::{rank_registration, start_rank};
use crate::{telemetry, validate};

/// Runs the demo; returns the process exit code.
pub fn run(args: DemoArgs) -> Result<i32> {
    telemetry::install_metrics();
    telemetry::zero_counters(telemetry::Role::Prefill);
    telemetry::zero_counters(telemetry::Role::Decode);
    let stop = Signals::install("demo")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let m = args.model.clone();
    let prefill_tp = m.tp_size.max(1);
    let decode_tp = args.decode_tp.unwrap_or(prefill_tp).max(1);
    let layout = m.model.layout(decode_tp, 0, m.page_size, m.pool_pages);
    // The baseline: the data plane alone, same backend, same process, before the rooms.
    let link = rt.block_on(crate::link::loopback(
        args.backend,
        &args.rdma.options(),
        2,
        256 << 20,
        1 << 30,
    ));
    let (summary, fatal, busy) = rt.block_on(async {
        let server = BootstrapServer::bind_with(
            ("127.0.0.1", 0),
            ServerConfig::default(),
            telemetry::metrics_router(),
        )
        .await
        .context("binding the bootstrap server")?;
        let port = server.local_addr().port();
        let client = BootstrapClient::new("127.0.0.1", port)?;
        let mut engines = Vec::new();
        for rank in 0..prefill_tp {
            let model = ModelArgs {
                tp_size: prefill_tp,
                tp_rank: rank,
                ..m.clone()
            };
            let pargs = PrefillArgs {
                model: model.clone(),
                bootstrap_host: "127.0.0.1".into(),
                bootstrap_port: port,
                serve_bootstrap: false,
                host: "127.0.0.1".into(),
                inbox_port: 0,
                metrics_port: None,
                queues: args.queues,
                bootstrap_timeout: 300.0,
                max_batch_ops: kvx_engine::engine::PrefillConfig::default().max_batch_ops,
                max_batch_mib: 64,
                chunk_pages: args.chunk_pages,
                fragmentation: args.fragmentation,
                restart_workers: false,
                backend: args.backend,
                rdma: args.rdma.clone(),
                connections: 2,
                staging: args.staging.clone(),
                staging_wait_timeout: 60.0,
                aux_over_tcp: false,
                loop_spin_us: kvx_engine::engine::DEFAULT_LOOP_SPIN_US,
                lifecycle: LifecycleArgs::default(),
                reregister_interval: 5.0,
                rank_health_interval: 5.0,
            };
            let engine = start_rank(&pargs, args.backend, tokio::runtime::Handle::current())?;
            let reg = rank_registration(&model, &engine.endpoint().host, engine.endpoint().port);
            client
                .register_rank(&reg, &RetryPolicy::sglang())
                .await
                .context("registering the prefill rank")?;
            engines.push(engine);
        }
        // Every decode rank draws the same rooms (same seed), as one instance's ranks would.
        let mut runs = Vec::new();
        for rank in 0..decode_tp {
            let cfg = DecodeConfig {
                tp_size: decode_tp,
                tp_rank: rank,
                kv_cache_dtype: m.kv_cache_dtype.clone(),
                requests: args.rooms,
                prompt_tokens: (args.prompt_tokens, args.prompt_tokens),
                concurrency: args.concurrency,
                fragmentation: args.fragmentation,
                seed: 0xdec0de,
                progress: rank == 0,
                backend: args.backend,
                rdma: args.rdma.options(),
                staging: args.staging.staging.then_some(decode::DecodeStagingConfig {
                    ring_bytes: args.staging_ring_mib.saturating_mul(1 << 20),
                    chunked_prefill_size: args.staging.chunked_prefill_size,
                    in_place: true,
                }),
                stop: Some(stop.clone()),
                shutdown_timeout: validate::duration(args.lifecycle.shutdown_timeout),
                ..DecodeConfig::new(
                    "127.0.0.1",
                    port,
                    m.model.layout(decode_tp, rank, m.page_size, m.pool_pages),
                )
            };
            runs.push(tokio::spawn(decode::run(cfg)));
        }
        let mut ranks = Vec::new();
        for run in runs {
            ranks.push(run.await??);
        }
        let fatal = engines.iter().find_map(|e| e.wait_fatal(Duration::ZERO));
        // The ranks write in parallel: the busiest one's time bounds the transfers.
        let busy = engines.iter().map(|e| e.transfer_busy()).max();
        for e in &engines {
            e.shutdown();
        }
        anyhow::Ok((decode::Summary::merge_ranks(&ranks), fatal, busy))
    })?;
    if let Some(path) = &args.summary_json {
        std::fs::write(path, serde_json::to_vec_pretty(&summary)?)
            .with_context(|| format!("--summary-json {}", path.display()))?;
    }
    if let Some(sig) = &summary.interrupted {
        println!(
            "interrupted by {sig}: {} rooms not started, {} aborted by the drain deadline",
            summary.not_started, summary.shutdown_aborted
        );
    }
    if let Some(f) = fatal {
        eprintln!("{f}");
    }
    for (reason, n) in &summary.failure_reasons {
        println!("failed: {n} rooms: {reason}");
    }
    println!(
        "model: {:?}, {} buffers × {} B/page, page size {}; prefill TP {prefill_tp}, decode TP {decode_tp}",
        m.model, layout.num_buffers, layout.item_len, layout.page_size
    );
    if summary.staged_chunks > 0 {
        println!(
            "staging: {} chunks through the ring, {:.1} MiB received straight into the pages",
            summary.staged_chunks,
            summary.staged_bytes_in_place as f64 / (1 << 20) as f64
        );
    }
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
    // The engines alone: bytes over the time the prefill had writes in flight (the forward
    // pass, verification and idle time taken out).
    let engine_gbps = busy
        .filter(|b| !b.is_zero() && summary.bytes > 0)
        .map(|b| summary.bytes as f64 / b.as_secs_f64() / 1e9);
    if let (Some(gbps), Some(b)) = (engine_gbps, busy) {
        println!(
            "engine: {:.2} GB/s over the {:.2} s the prefill had writes in flight (the synthetic \
             model and the verification share the CPUs meanwhile)",
            gbps,
            b.as_secs_f64()
        );
    }
    match &link {
        Ok(l) => println!(
            "link test ({} backend, this process, 16 MiB writes): {:.2} GB/s; engine at {}, rooms \
             at {:.2}× the link (the rooms' time includes the synthetic forward pass and byte \
             verification)",
            args.backend.name(),
            l.gbps(),
            engine_gbps.map_or("-".to_owned(), |g| format!(
                "{:.2}×",
                g / l.gbps().max(1e-9)
            )),
            summary.gbps / l.gbps().max(1e-9)
        ),
        Err(e) => println!(
            "link test ({} backend): not run: {e:#}",
            args.backend.name()
        ),
    }
    println!(
        "room latency: p50 {:.1} ms, p99 {:.1} ms",
        summary.p50_ms, summary.p99_ms
    );
    println!(
        "verified: {}/{} rooms ({} failed, {} corrupt)",
        summary.verified, summary.requests, summary.failed, summary.corrupt
    );
    Ok(if summary.clean() { 0 } else { 1 })
}
