//! Building blocks the scenarios share: start a bootstrap server, prefill ranks and decode peers
//! of the `kvx` binary on chosen hosts, wait for them to be ready, read a decode's JSON summary
//! and poll a process's `/metrics` until a condition holds (bounded in time).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::integration::metrics::{Absent, Metrics};
use crate::integration::proc::Proc;
use crate::integration::{Ctx, Profile};

/// How long a process may take to say it is ready (debug build, 2 busy cores).
pub const READY: Duration = Duration::from_secs(60);

/// Model flags shared by prefill and decode: a preset, its TP size, page size and pool.
#[derive(Debug, Clone)]
pub struct Model {
    /// `--model` preset.
    pub preset: &'static str,
    /// `--tp-size`.
    pub tp_size: u32,
    /// `--page-size`.
    pub page_size: u32,
    /// `--pool-pages`.
    pub pool_pages: u32,
}

impl Model {
    /// A preset at TP 1 with page size 16 and `pool_pages` pages.
    pub fn new(preset: &'static str, pool_pages: u32) -> Model {
        Model {
            preset,
            tp_size: 1,
            page_size: 16,
            pool_pages,
        }
    }

    /// The same model at another TP size.
    pub fn tp(&self, tp_size: u32) -> Model {
        Model {
            tp_size,
            ..self.clone()
        }
    }

    fn args(&self, tp_rank: u32) -> Vec<String> {
        [
            "--model",
            self.preset,
            "--tp-size",
            &self.tp_size.to_string(),
            "--tp-rank",
            &tp_rank.to_string(),
            "--page-size",
            &self.page_size.to_string(),
            "--pool-pages",
            &self.pool_pages.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

/// Turns string slices into owned arguments.
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A running bootstrap server.
pub struct Bootstrap {
    /// The process.
    pub proc: Proc,
    /// Where it listens.
    pub addr: SocketAddr,
}

/// Starts `kvx bootstrap` on host `host`.
pub fn bootstrap(ctx: &Ctx, host: usize) -> Result<Bootstrap> {
    let addr = ctx.addr(host);
    let mut proc = ctx.spawn_kvx(
        "bootstrap",
        host,
        &args(&[
            "bootstrap",
            "--host",
            &addr.ip().to_string(),
            "--port",
            &addr.port().to_string(),
        ]),
    )?;
    if !proc.wait_for_log("listening on", READY) {
        bail!("bootstrap server not ready: {}", proc.log_tail(5));
    }
    Ok(Bootstrap { proc, addr })
}

/// A running prefill rank.
pub struct Prefill {
    /// The process.
    pub proc: Proc,
    /// Its host.
    pub host: usize,
    /// Its `/metrics` address.
    pub metrics: SocketAddr,
    /// Runs with `--staging` (so it exports `kvx_staging_rooms`).
    pub staging: bool,
}

/// What a prefill rank runs with.
#[derive(Debug, Clone, Default)]
pub struct PrefillOpts {
    /// Extra flags.
    pub extra: Vec<String>,
    /// Environment (`FAILPOINTS`).
    pub env: Vec<(String, String)>,
    /// Serve the bootstrap server (and `/metrics`) in the prefill process itself, at the
    /// bootstrap address, as sglang's prefill does; decodes then heartbeat the prefill itself.
    pub serve_bootstrap: bool,
    /// `--inbox-port` (pinned so that a restarted rank registers the same endpoint).
    pub inbox_port: Option<u16>,
}

/// Starts `kvx prefill` rank `tp_rank` of `model` on `host`, registered with `boot`; waits until
/// it is ready.
pub fn prefill(
    ctx: &Ctx,
    name: &str,
    host: usize,
    boot: SocketAddr,
    model: &Model,
    tp_rank: u32,
    opts: &PrefillOpts,
) -> Result<Prefill> {
    let mut a = args(&[
        "prefill",
        "--host",
        &ctx.ip(host).to_string(),
        "--bootstrap-host",
        &boot.ip().to_string(),
        "--bootstrap-port",
        &boot.port().to_string(),
    ]);
    let metrics = if opts.serve_bootstrap {
        a.push("--serve-bootstrap".into());
        boot
    } else {
        let m = ctx.addr(host);
        a.extend(args(&["--metrics-port", &m.port().to_string()]));
        m
    };
    if let Some(p) = opts.inbox_port {
        a.extend(args(&["--inbox-port", &p.to_string()]));
    }
    a.extend(model.args(tp_rank));
    a.extend(opts.extra.iter().cloned());
    let bin = ctx.kvx().map_err(anyhow::Error::msg)?.path.clone();
    let mut cmd = ctx.command(host, &bin);
    cmd.args(&a)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or("info".into()),
        )
        .env("NO_COLOR", "1");
    for (k, v) in &opts.env {
        cmd.env(k, v);
    }
    let mut proc = ctx.spawn(name, cmd)?;
    if !proc.wait_for_log(" ready", READY) {
        bail!("{name} not ready: {}", proc.log_tail(8));
    }
    Ok(Prefill {
        proc,
        host,
        metrics,
        staging: opts.extra.iter().any(|a| a == "--staging"),
    })
}

/// `kvx bootstrap` on host 0 and a prefill rank 0 of `model` beside it, with default options.
pub fn bootstrap_and_prefill(ctx: &Ctx, model: &Model) -> Result<(Bootstrap, Prefill)> {
    let boot = bootstrap(ctx, 0)?;
    let p = prefill(
        ctx,
        "prefill",
        0,
        boot.addr,
        model,
        0,
        &PrefillOpts::default(),
    )?;
    Ok((boot, p))
}

/// What a decode peer runs.
#[derive(Debug, Clone)]
pub struct DecodeOpts {
    /// `--requests`.
    pub requests: usize,
    /// `--prompt-tokens`.
    pub tokens: usize,
    /// `--prompt-tokens-max`.
    pub tokens_max: Option<usize>,
    /// `--concurrency`.
    pub concurrency: usize,
    /// `--tp-rank`.
    pub tp_rank: u32,
    /// `--seed` (fixed so that decode ranks of one instance pick the same rooms).
    pub seed: u64,
    /// Extra flags.
    pub extra: Vec<String>,
    /// `RUST_LOG` for this decode (the caller's, else `info`, when absent).
    pub log: Option<String>,
}

impl DecodeOpts {
    /// `requests` rooms of `tokens` tokens, 4 in flight.
    pub fn new(requests: usize, tokens: usize) -> DecodeOpts {
        DecodeOpts {
            requests,
            tokens,
            tokens_max: None,
            concurrency: 4,
            tp_rank: 0,
            seed: 7,
            extra: Vec::new(),
            log: None,
        }
    }
}

/// A running decode peer.
pub struct Decode {
    /// The process.
    pub proc: Proc,
    /// Where it writes its summary.
    pub summary: PathBuf,
}

/// Starts `kvx decode` on `host` against the bootstrap server `boot`.
pub fn decode(
    ctx: &Ctx,
    name: &str,
    host: usize,
    boot: SocketAddr,
    model: &Model,
    o: &DecodeOpts,
) -> Result<Decode> {
    std::fs::create_dir_all(&ctx.logs)?;
    let summary = ctx.logs.join(format!("{name}.summary.json"));
    let _ = std::fs::remove_file(&summary);
    let mut a = args(&[
        "decode",
        "--host",
        &ctx.ip(host).to_string(),
        "--bootstrap-addr",
        &boot.to_string(),
        "--requests",
        &o.requests.to_string(),
        "--prompt-tokens",
        &o.tokens.to_string(),
        "--concurrency",
        &o.concurrency.to_string(),
        "--seed",
        &o.seed.to_string(),
        "--no-progress",
    ]);
    a.push("--summary-json".into());
    a.push(summary.display().to_string());
    if let Some(m) = o.tokens_max {
        a.extend(args(&["--prompt-tokens-max", &m.to_string()]));
    }
    a.extend(model.args(o.tp_rank));
    a.extend(o.extra.iter().cloned());
    let bin = ctx.kvx().map_err(anyhow::Error::msg)?.path.clone();
    let mut cmd = ctx.command(host, &bin);
    cmd.args(&a)
        .env(
            "RUST_LOG",
            o.log
                .clone()
                .unwrap_or_else(|| std::env::var("RUST_LOG").unwrap_or("info".into())),
        )
        .env("NO_COLOR", "1");
    let proc = ctx.spawn(name, cmd)?;
    Ok(Decode { proc, summary })
}

/// A decode's summary (`--summary-json`).
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Rooms attempted.
    pub requests: u64,
    /// Rooms that reached Success.
    pub succeeded: u64,
    /// Rooms that failed.
    pub failed: u64,
    /// Successful rooms with every byte right.
    pub verified: u64,
    /// Successful rooms with a wrong byte.
    pub corrupt: u64,
    /// Verified bytes.
    pub bytes: u64,
    /// Seconds the run took.
    pub seconds: f64,
    /// GB/s.
    pub gbps: f64,
    /// Median room latency, ms.
    pub p50_ms: f64,
    /// p99 room latency, ms.
    pub p99_ms: f64,
    /// Every room's latency when the summary lists them.
    pub latencies_ms: Vec<f64>,
    /// Failure reason → rooms.
    pub failure_reasons: Vec<(String, u64)>,
    /// Chunks that came through the decode's staging ring.
    pub staged_chunks: u64,
    /// Messages the decode's inbox dropped (malformed or unused kinds).
    pub dropped_messages: u64,
    /// Rooms the decode sent `ABORT` for.
    pub aborted_rooms: u64,
    /// Aborted rooms every prefill rank acknowledged.
    pub abort_acked_rooms: u64,
    /// Acknowledged rooms whose pages changed after the last `ABORT_ACK`.
    pub late_writes: u64,
}

impl Summary {
    /// Parses the JSON summary.
    pub fn parse(text: &str) -> Result<Summary> {
        let v: Value = serde_json::from_str(text).context("summary is not JSON")?;
        let u = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        if v.get("requests").is_none() || v.get("verified").is_none() {
            bail!("summary lacks requests/verified");
        }
        Ok(Summary {
            requests: u("requests"),
            succeeded: u("succeeded"),
            failed: u("failed"),
            verified: u("verified"),
            corrupt: u("corrupt"),
            bytes: u("bytes"),
            seconds: f("seconds"),
            gbps: f("gbps"),
            p50_ms: f("p50_ms"),
            p99_ms: f("p99_ms"),
            staged_chunks: u("staged_chunks"),
            dropped_messages: u("dropped_messages"),
            aborted_rooms: u("aborted_rooms"),
            abort_acked_rooms: u("abort_acked_rooms"),
            late_writes: u("late_writes"),
            latencies_ms: v
                .get("latencies_ms")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default(),
            failure_reasons: v
                .get("failure_reasons")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    /// Every room terminal: succeeded + failed = requests.
    pub fn all_terminal(&self) -> bool {
        self.succeeded + self.failed == self.requests
    }

    /// `verified=a/b corrupt=c failed=d GB/s p50 p99` for verdict lines.
    pub fn figures(&self) -> String {
        format!(
            "verified {}/{}, corrupt {}, failed {}, {:.1} MiB at {:.2} GB/s, p50 {:.1} ms, p99 {:.1} ms",
            self.verified,
            self.requests,
            self.corrupt,
            self.failed,
            self.bytes as f64 / (1u64 << 20) as f64,
            self.gbps,
            self.p50_ms,
            self.p99_ms
        )
    }

    /// The most frequent failure reason (for messages).
    pub fn top_reason(&self) -> String {
        self.failure_reasons
            .iter()
            .max_by_key(|(_, n)| *n)
            .map(|(r, n)| format!("{n}x {r}"))
            .unwrap_or_default()
    }
}

impl Decode {
    /// Waits for the decode to exit (at most `timeout`) and reads its summary.
    pub fn finish(&mut self, timeout: Duration) -> Result<(i32, Summary)> {
        let Some(status) = self.proc.wait_timeout(timeout) else {
            bail!(
                "{} still running after {} s: {}",
                self.proc.name(),
                timeout.as_secs(),
                self.proc.log_tail(5)
            );
        };
        let code = status.code().unwrap_or(-1);
        let text = std::fs::read_to_string(&self.summary).with_context(|| {
            format!(
                "{} exited with {status} and wrote no summary: {}",
                self.proc.name(),
                self.proc.log_tail(5)
            )
        })?;
        Ok((code, Summary::parse(&text)?))
    }
}

/// Polls `/metrics` of a process on `host` until `pred` holds or `timeout` passes; returns the
/// last scrape and the time it took (`None` for the time when it never held).
pub fn wait_metrics(
    ctx: &Ctx,
    host: usize,
    addr: SocketAddr,
    timeout: Duration,
    pred: impl Fn(&Metrics) -> bool,
) -> Result<(Metrics, Option<Duration>)> {
    let t0 = Instant::now();
    loop {
        match ctx.scrape(host, addr) {
            Ok(m) if pred(&m) => return Ok((m, Some(t0.elapsed()))),
            Ok(m) if t0.elapsed() >= timeout => return Ok((m, None)),
            Err(e) if t0.elapsed() >= timeout => return Err(e.context(format!("scraping {addr}"))),
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits up to 60 s for the prefill `p` to report at least `batches` transfer batches
/// (`kvx_transfer_batches_total`); `false` when transfers never got that far.
pub fn transfers_flowing(ctx: &Ctx, p: &Prefill, batches: f64) -> Result<bool> {
    let (_, flowing) = wait_metrics(ctx, p.host, p.metrics, Duration::from_secs(60), |m| {
        m.get("kvx_transfer_batches_total")
            .is_ok_and(|n| n >= batches)
    })?;
    Ok(flowing.is_some())
}

/// The prefill's live per-room entries (`kvx_room_entries`, plus the staging driver's
/// `kvx_staging_rooms` when it runs with `--staging`), read until they reach 0 or `timeout`. A
/// gauge missing from `/metrics` is an error, never 0 entries.
pub fn drained(ctx: &Ctx, p: &Prefill, timeout: Duration) -> Result<f64> {
    let staging = p.staging;
    let left = move |m: &Metrics| -> Result<f64, Absent> {
        let mut n = m.get("kvx_room_entries")?;
        if staging {
            n += m.get("kvx_staging_rooms")?;
        }
        Ok(n)
    };
    let (m, _) = wait_metrics(ctx, p.host, p.metrics, timeout, |m| left(m) == Ok(0.0))?;
    left(&m).with_context(|| format!("reading {}'s room entries", p.proc.name()))
}

/// The prefill's live transfer workers (`kvx_live_workers`); an error when the gauge is absent.
pub fn live_workers(ctx: &Ctx, p: &Prefill) -> Result<f64> {
    let m = ctx.scrape(p.host, p.metrics)?;
    m.get("kvx_live_workers")
        .with_context(|| format!("reading {}'s workers", p.proc.name()))
}

/// The reason of the first room a process logged as failed (`room failed … reason=…`).
pub fn first_failure_reason(p: &Proc) -> Option<String> {
    let log = super::flood::strip_ansi(&p.log_text());
    log.lines()
        .find(|l| l.contains("room failed"))
        .and_then(|l| l.split_once("reason=").map(|(_, r)| r.trim().to_string()))
}

/// How long a decode may take to declare a prefill dead: `max_fail` heartbeats, each one
/// interval apart and each failing at the latest after sglang's 3 s read timeout, plus one
/// interval of slack for the rooms to be failed and the process to exit.
pub fn heartbeat_window(interval: u64, max_fail: u64) -> Duration {
    Duration::from_secs(max_fail * (interval + 3) + interval)
}

/// Decode arguments for a heartbeat every `interval` seconds that declares the prefill dead
/// after `max_fail` failed heartbeats (see [`heartbeat_window`]).
pub fn heartbeat_args(interval: u64, max_fail: u64) -> Vec<String> {
    args(&[
        "--heartbeat-interval",
        &interval.to_string(),
        "--heartbeat-max-failure",
        &max_fail.to_string(),
    ])
}

/// Scaled count for the profile.
pub fn sized(ctx: &Ctx, short: usize, long: usize) -> usize {
    match ctx.profile {
        Profile::Short => short,
        Profile::Long => long,
    }
}
