//! The `kvx` binary: see `kvx --help`.

#![forbid(unsafe_code)]

use anyhow::{Context, Result};
use kvx_cli::config::file::CliError;
use kvx_cli::config::{Cli, Command, DecodeArgs};
use kvx_cli::decode::{self, DecodeConfig};
use kvx_cli::lifecycle::{Readiness, Signals};
use kvx_cli::validate::duration;
use kvx_cli::{demo, link, prefill_cmd, telemetry};

fn main() {
    // Flags: command line > environment > --config file > default.
    let cli = match kvx_cli::config::file::parse(std::env::args_os().collect()) {
        Ok((cli, _)) => cli,
        Err(CliError::Clap(e, file_note)) => {
            let argv: Vec<String> = std::env::args().collect();
            let _ = e.print();
            let note = file_note.or_else(|| {
                kvx_cli::validate::env_note(&e, &<Cli as clap::CommandFactory>::command(), &argv)
            });
            if let Some(note) = note {
                eprintln!("{note}");
            }
            std::process::exit(e.exit_code());
        }
        Err(CliError::File(e)) => {
            eprintln!("kvx: {e}");
            std::process::exit(2);
        }
        // `CliError` is non-exhaustive: a cause added later is still a usage error.
        Err(e) => {
            eprintln!("kvx: {e:?}");
            std::process::exit(2);
        }
    };
    // Failpoints (feature `failpoints`) are configured by the FAILPOINTS environment variable.
    let _failpoints = fail::FailScenario::setup();
    let quiet = matches!(cli.command, Command::Demo(_) | Command::Send(_));
    // The demo's decode leaves while the prefill still holds its session: that is no news.
    telemetry::init_tracing(
        if quiet {
            "warn,kvx_rdma::tcp::client=error"
        } else {
            "info"
        },
        cli.log_format,
    );
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
    // Checks across flags, before anything is bound or sent (clap checked each value).
    match &cmd {
        Command::Prefill(a) => a.validate()?,
        Command::Decode(a) => a.validate()?,
        Command::Demo(a) => a.validate()?,
        _ => {}
    }
    // A backend this host or build cannot run fails here, naming the flag.
    if let Some((backend, rdma)) = cmd.backend() {
        kvx_engine::plane::check_backend(backend, &rdma)?;
    }
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
    telemetry::zero_counters(telemetry::Role::Decode);
    let stop = Signals::install("decode")?;
    let ready = Readiness::new("not connected to the prefill instance yet");
    let m = &a.model;
    let cfg = DecodeConfig {
        bootstrap_host: a.bootstrap_addr.host.clone(),
        bootstrap_port: a.bootstrap_addr.port,
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
        waiting_timeout: duration(a.waiting_timeout),
        heartbeat_interval: duration(a.heartbeat_interval),
        heartbeat_max_failure: a.heartbeat_max_failure,
        zmq_send_timeout: duration(a.zmq_send_timeout),
        abort_release_timeout: duration(a.abort_release_timeout),
        seed: a.seed.unwrap_or_else(rand::random),
        room_base: a.room_base,
        progress: !a.no_progress,
        backend: a.backend,
        rdma: a.rdma.options(),
        staging: a.staging.staging.then_some(decode::DecodeStagingConfig {
            ring_bytes: a.staging_ring_mib.saturating_mul(1 << 20),
            chunked_prefill_size: a.staging.chunked_prefill_size,
            in_place: true,
        }),
        stop: Some(stop),
        shutdown_timeout: duration(a.lifecycle.shutdown_timeout),
        ready: Some(ready.clone()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let s = rt.block_on(async {
        if let Some(p) = a.metrics_port {
            let addr = kvx_cli::prefill_cmd::listen_addr(&a.host, p, "--host")?;
            let bound = telemetry::serve(addr, telemetry::ops_router(&ready))
                .await
                .with_context(|| format!("--metrics-port {p}: binding {addr}"))?;
            eprintln!("kvx decode: metrics on http://{bound}/metrics (and /ready, /health)");
        }
        decode::run(cfg).await
    })?;
    if let Some(p) = &a.summary_json {
        std::fs::write(p, serde_json::to_vec_pretty(&s)?)
            .with_context(|| format!("--summary-json {}", p.display()))?;
    }
    if let Some(sig) = &s.interrupted {
        println!(
            "interrupted by {sig}: {} requests not started, {} rooms aborted by the drain deadline",
            s.not_started, s.shutdown_aborted
        );
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
            "staging: {} chunks through the ring, {:.1} MiB received straight into the pages",
            s.staged_chunks,
            s.staged_bytes_in_place as f64 / (1 << 20) as f64
        );
    }
    println!("verified: {}/{} rooms", s.verified, s.requests);
    Ok(if s.clean() { 0 } else { 1 })
}
