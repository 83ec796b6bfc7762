//! The `kvx` binary: see `kvx --help`.

use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use kvx_cli::config::{Cli, Command, DecodeArgs};
use kvx_cli::decode::{self, DecodeConfig};
use kvx_cli::{demo, link, prefill_cmd, telemetry};

fn main() {
    let cli = Cli::parse();
    // Failpoints (feature `failpoints`) are configured by the FAILPOINTS environment variable.
    let _failpoints = fail::FailScenario::setup();
    let quiet = matches!(cli.command, Command::Demo(_) | Command::Send(_));
    // The demo's decode leaves while the prefill still holds its session: that is no news.
    telemetry::init_tracing(if quiet {
        "warn,kvx_rdma::tcp::client=error"
    } else {
        "info"
    });
    let code = match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvx: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cmd: Command) -> Result<i32> {
    match cmd {
        Command::Prefill(a) => prefill_cmd::run(a),
        Command::Decode(a) => run_decode(a),
        Command::Bootstrap(a) => kvx_cli::bootstrap_cmd::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Send(a) => link::send(a),
        Command::Recv(a) => link::recv(a),
    }
}

fn run_decode(a: DecodeArgs) -> Result<i32> {
    telemetry::install_metrics();
    let (host, port) = a
        .bootstrap_addr
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("--bootstrap-addr must be host:port"))?;
    let m = &a.model;
    let cfg = DecodeConfig {
        bootstrap_host: host.trim_matches(['[', ']']).to_owned(),
        bootstrap_port: port.parse()?,
        host: a.host.clone(),
        layout: m
            .model
            .layout(m.tp_size, m.tp_rank, m.page_size, m.pool_pages),
        tp_size: m.tp_size,
        tp_rank: m.tp_rank,
        kv_cache_dtype: m.kv_cache_dtype.clone(),
        requests: a.requests,
        prompt_tokens: (
            a.prompt_tokens,
            a.prompt_tokens_max.unwrap_or(a.prompt_tokens),
        ),
        concurrency: a.concurrency,
        fragmentation: a.fragmentation,
        waiting_timeout: Duration::from_secs_f64(a.waiting_timeout.max(0.0)),
        heartbeat_interval: Duration::from_secs_f64(a.heartbeat_interval.max(0.0)),
        heartbeat_max_failure: a.heartbeat_max_failure,
        zmq_send_timeout: Duration::from_secs_f64(a.zmq_send_timeout.max(0.0)),
        abort_release_timeout: Duration::from_secs_f64(a.abort_release_timeout.max(0.0)),
        seed: a.seed.unwrap_or_else(rand::random),
        room_base: a.room_base,
        progress: !a.no_progress,
        backend: a.backend,
        staging: a.staging.staging.then_some(decode::DecodeStagingConfig {
            ring_bytes: a.staging_ring_mib.max(1) << 20,
            chunked_prefill_size: a.staging.chunked_prefill_size,
        }),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let s = rt.block_on(async {
        if let Some(p) = a.metrics_port {
            let addr: std::net::SocketAddr = format!("{}:{p}", a.host).parse()?;
            let bound = telemetry::serve_metrics(addr).await?;
            eprintln!("kvx decode: metrics on http://{bound}/metrics");
        }
        decode::run(cfg).await
    })?;
    if let Some(p) = &a.summary_json {
        std::fs::write(p, serde_json::to_vec_pretty(&s)?)?;
    }
    for (reason, n) in &s.failure_reasons {
        println!("failed: {n} rooms: {reason}");
    }
    println!(
        "rooms: {} succeeded, {} failed, {} corrupt; {:.1} MiB verified at {:.2} GB/s; p50 {:.1} ms, p99 {:.1} ms",
        s.succeeded,
        s.failed,
        s.corrupt,
        s.bytes as f64 / (1 << 20) as f64,
        s.gbps,
        s.p50_ms,
        s.p99_ms
    );
    if s.staged_chunks > 0 {
        println!(
            "staging: {} chunks through the ring, scattered",
            s.staged_chunks
        );
    }
    println!("verified: {}/{} rooms", s.verified, s.requests);
    Ok(if s.verified == s.requests { 0 } else { 1 })
}
