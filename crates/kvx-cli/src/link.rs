//! `kvx send` / `kvx recv`: a link test in the style of ib_write_bw / iperf3 over the data plane.
//!
//! `recv` registers a region with a listening transport and serves writes into it, printing
//! what it received every `--interval` (its own figures, counted where the writes land) and the
//! total when interrupted (SIGINT or SIGTERM; a second one exits at once). `send` learns the
//! region from the session handshake, then posts batches of `--batch` writes of `--size` bytes
//! over `--connections` connections (one completion per batch, `--depth` batches in flight,
//! default 2) until `--total-mib` were written or `--duration` passed, and reports GB/s and the
//! percentiles of each batch's latency, from `write_batch` to its completion (`--depth 1
//! --batch 1` gives the round trip of a single write), with a line per `--interval`. `--sizes 4K,64K,1M` sweeps block sizes (one
//! run each), and `--json` prints every figure as one JSON document. With `--backend mooncake`
//! either side speaks Mooncake TE's protocol, so each can be tested against a real Mooncake
//! engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvx_core::TransferOp;
use kvx_rdma::{BatchReport, BoxFuture, Session, TransportError};
use serde_json::json;

use crate::config::{RecvArgs, SendArgs};
use kvx_engine::plane::{Backend, DataPlane};
use kvx_engine::region::Region;

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// `kvx recv`: serves until interrupted.
pub fn recv(args: RecvArgs) -> Result<i32> {
    let shm_name = match args.backend {
        Backend::Shm => kvx_engine::plane::shm_link_name("--listen", &args.listen)?,
        _ => String::new(),
    };
    let region = Arc::new(
        kvx_engine::plane::alloc_region(args.backend, &shm_name, "recv", args.region as usize)
            .context("allocating the receive region")?,
    );
    // Installed once, before anything is bound: a signal is never missed between two waits.
    let stop = crate::lifecycle::Signals::install("recv")?;
    runtime()?.block_on(async {
        let plane = match args.backend {
            Backend::Shm => DataPlane::shm_server(&shm_name, vec![region]),
            Backend::Verbs => {
                DataPlane::verbs_server(&args.listen, &args.rdma.options(), vec![region]).await
            }
            Backend::Mooncake => {
                // Mooncake TE picks its own ports: only the host of --listen is used.
                let host = args
                    .listen
                    .rsplit_once(':')
                    .map_or(args.listen.as_str(), |(h, _)| h);
                DataPlane::mooncake_server(host.trim_matches(['[', ']']), 1, vec![region]).await
            }
            _ => DataPlane::tcp_server(&args.listen, 1, vec![region]).await,
        }
        .context("binding the data plane")?;
        eprintln!(
            "kvx recv: {} listening on {}",
            plane.transport().kind(),
            plane.endpoint()
        );
        report_received(&plane, args.interval, args.json, &stop).await;
        drop(plane);
        anyhow::Ok(0)
    })
}

/// Prints what arrives every `interval` seconds (while bytes arrive) until `stop` (SIGINT or
/// SIGTERM), then the total: bytes, and the rate over the time from the first to the last
/// interval that saw any.
async fn report_received(
    plane: &DataPlane,
    interval: f64,
    json: bool,
    stop: &crate::lifecycle::Stop,
) {
    let t = plane.transport().clone();
    let Some(mut last) = t.bytes_received() else {
        eprintln!(
            "kvx recv: the {} backend does not count received bytes",
            t.kind()
        );
        stop.wait().await;
        return;
    };
    let start = Instant::now();
    let period = crate::validate::duration(if interval > 0.0 { interval } else { 3600.0 });
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let (mut at, mut active) = (0.0f64, 0.0f64);
    let total_at_start = last;
    let mut stopping = false;
    while !stopping {
        tokio::select! {
            _ = stop.wait() => stopping = true,
            _ = tick.tick() => {}
        }
        // On Ctrl-C the partial interval since the last line is reported too.
        let now = start.elapsed().as_secs_f64();
        let got = t.bytes_received().unwrap_or(last);
        let delta = got.saturating_sub(last);
        if delta > 0 {
            active += now - at;
            if interval > 0.0 {
                let rate = delta as f64 / (now - at).max(1e-9) / 1e9;
                if json {
                    println!(
                        "{}",
                        json!({"start": at, "end": now, "bytes": delta, "gbps": rate})
                    );
                } else {
                    println!(
                        "[{at:7.2}-{now:7.2} s] received {:10.1} MiB  {rate:6.2} GB/s",
                        delta as f64 / (1 << 20) as f64
                    );
                }
            }
        }
        (last, at) = (got, now);
    }
    let total = t
        .bytes_received()
        .unwrap_or(last)
        .saturating_sub(total_at_start);
    let rate = total as f64 / active.max(1e-9) / 1e9;
    if json {
        println!(
            "{}",
            json!({"total_bytes": total, "active_seconds": active, "gbps": rate})
        );
    } else {
        println!(
            "received {:.1} MiB in total; {rate:.2} GB/s over the {active:.1} s that saw writes",
            total as f64 / (1 << 20) as f64
        );
    }
}

/// A batch posted by `kvx send`: when, its future, and once it resolved, its result and latency.
struct InFlight {
    at: Instant,
    fut: BoxFuture<'static, Result<BatchReport, TransportError>>,
    done: Option<(Result<BatchReport, TransportError>, std::time::Duration)>,
}

/// One block size's run, as `kvx send` reports it.
struct Run {
    size: u64,
    bytes: u64,
    secs: f64,
    /// Batch latencies, sorted.
    lat_ns: Vec<u64>,
    intervals: Vec<serde_json::Value>,
}

impl Run {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9) / 1e9
    }

    /// The latency at quantile `q`, in µs.
    fn pct(&self, q: f64) -> f64 {
        percentile(&self.lat_ns, q)
    }
}

/// The value at quantile `q` of sorted `ns`, in µs (0 when empty).
fn percentile(ns: &[u64], q: f64) -> f64 {
    let i = ((ns.len() as f64 * q).ceil() as usize).clamp(1, ns.len().max(1)) - 1;
    ns.get(i).copied().unwrap_or(0) as f64 / 1e3
}

/// `kvx send`: returns the exit code.
pub fn send(args: SendArgs) -> Result<i32> {
    let sizes: Vec<u64> = if args.sizes.is_empty() {
        vec![args.size.max(1)]
    } else {
        args.sizes.clone()
    };
    let batch = args.batch.max(1) as u64;
    let largest = sizes.iter().copied().max().unwrap_or(1);
    let src = Arc::new(Region::new((largest * batch) as usize));
    let pattern: Vec<u8> = (0..src.len()).map(|i| (i % 251) as u8).collect();
    let _ = src.copy_in(src.base(), &pattern);
    let runs = runtime()?.block_on(async {
        let plane = DataPlane::client_with(
            args.backend,
            &args.rdma.options(),
            "kvx-send",
            args.connections,
            vec![src.clone()],
        )?;
        let to = match args.backend {
            Backend::Shm => format!(
                "{}{}",
                kvx_rdma::local::SCHEME,
                kvx_engine::plane::shm_link_name("--to", &args.to)?
            ),
            _ => args.to.clone(),
        };
        let session = plane
            .transport()
            .connect(&to)
            .await
            .with_context(|| format!("connecting to {to}"))?;
        let mut runs = Vec::with_capacity(sizes.len());
        for &size in &sizes {
            let run = run_size(&args, &*session, &src, size).await?;
            if !args.json {
                print_run(&args, &run);
            }
            runs.push(run);
        }
        drop(plane);
        anyhow::Ok(runs)
    })?;
    if args.json {
        let doc = json!({
            "backend": args.backend.name(),
            "to": args.to,
            "connections": args.connections.max(1),
            "batch": batch,
            "depth": args.depth.max(1),
            "runs": runs.iter().map(|r| json!({
                "size": r.size,
                "bytes": r.bytes,
                "seconds": r.secs,
                "gbps": r.gbps(),
                "batches": r.lat_ns.len(),
                "latency_us": {"p50": r.pct(0.50), "p99": r.pct(0.99), "max": r.pct(1.0)},
                "intervals": r.intervals,
            })).collect::<Vec<_>>(),
        });
        println!("{doc}");
    }
    Ok(0)
}

fn print_run(args: &SendArgs, r: &Run) {
    println!(
        "sent {:.1} MiB in {:.2} s over {} connection(s), {} B writes x {}/batch: {:.2} GB/s",
        r.bytes as f64 / (1 << 20) as f64,
        r.secs,
        args.connections.max(1),
        r.size,
        args.batch.max(1),
        r.gbps()
    );
    println!(
        "batch latency over {} batches (depth {}): p50 {:.0} us, p99 {:.0} us, max {:.0} us",
        r.lat_ns.len(),
        args.depth.max(1),
        r.pct(0.50),
        r.pct(0.99),
        r.pct(1.0)
    );
}

/// Writes blocks of `size` until `--total-mib` or `--duration`, `--depth` batches in flight,
/// printing a line per `--interval` (unless `--json`, which keeps them in the run).
async fn run_size(args: &SendArgs, session: &dyn Session, src: &Region, size: u64) -> Result<Run> {
    let batch = args.batch.max(1) as u64;
    let total = args.total_mib.max(1) << 20;
    let deadline = args.duration.map(crate::validate::duration);
    let Some(dst) = session.remote().regions.first().cloned() else {
        bail!("peer registered no memory");
    };
    if dst.len < size {
        bail!(
            "peer region ({} B) smaller than one write ({size} B)",
            dst.len
        );
    }
    let slots = dst.len / size;
    let batch_ops = |k: u64| -> Vec<TransferOp> {
        (0..batch)
            .map(|i| {
                TransferOp::new(
                    src.base() + i * size,
                    dst.base + ((k + i) % slots) * size,
                    size,
                )
            })
            .collect()
    };
    let bar = {
        use std::io::IsTerminal as _;
        (!args.no_progress && !args.json && deadline.is_none() && std::io::stderr().is_terminal())
            .then(|| {
                let b = indicatif::ProgressBar::new(total);
                if let Ok(s) = indicatif::ProgressStyle::with_template(
                    "{bytes}/{total_bytes} [{bar:30}] {binary_bytes_per_sec}",
                ) {
                    b.set_style(s.progress_chars("=> "));
                }
                b
            })
    };
    let more = |sent: u64, t0: Instant| match deadline {
        Some(d) => t0.elapsed() < d,
        None => sent < total,
    };
    let interval = (args.interval > 0.0).then(|| crate::validate::duration(args.interval));
    let depth = args.depth.max(1);
    let t0 = Instant::now();
    let (mut sent, mut done_bytes, mut k) = (0u64, 0u64, 0u64);
    let mut lat_ns: Vec<u64> = Vec::new();
    let mut intervals = Vec::new();
    let (mut iv_start, mut iv_bytes, mut iv_lat) = (Duration::ZERO, 0u64, Vec::<u64>::new());
    // Every batch in flight is polled, not only the oldest: a future that is not polled
    // posts nothing, so awaiting them one by one would keep a single batch in flight.
    let mut inflight = std::collections::VecDeque::new();
    while more(sent, t0) || !inflight.is_empty() {
        while more(sent, t0) && inflight.len() < depth {
            inflight.push_back(InFlight {
                at: Instant::now(),
                fut: session.write_batch(batch_ops(k)),
                done: None,
            });
            k += batch;
            sent += size * batch;
        }
        std::future::poll_fn(|cx| {
            for f in inflight.iter_mut().filter(|f| f.done.is_none()) {
                if let std::task::Poll::Ready(r) = f.fut.as_mut().poll(cx) {
                    f.done = Some((r, f.at.elapsed()));
                }
            }
            match inflight.front() {
                Some(f) if f.done.is_none() => std::task::Poll::Pending,
                _ => std::task::Poll::Ready(()),
            }
        })
        .await;
        if let Some((r, took)) = inflight.pop_front().and_then(|f| f.done) {
            r?;
            let ns = took.as_nanos() as u64;
            lat_ns.push(ns);
            iv_lat.push(ns);
            done_bytes += size * batch;
            iv_bytes += size * batch;
            if let Some(b) = &bar {
                b.set_position(done_bytes.min(total));
            }
        }
        let now = t0.elapsed();
        if let Some(every) = interval
            && (now >= iv_start + every || (inflight.is_empty() && !more(sent, t0)))
            && iv_bytes > 0
        {
            iv_lat.sort_unstable();
            let secs = (now - iv_start).as_secs_f64().max(1e-9);
            let (a, b) = (iv_start.as_secs_f64(), now.as_secs_f64());
            let gbps = iv_bytes as f64 / secs / 1e9;
            let (p50, p99) = (percentile(&iv_lat, 0.50), percentile(&iv_lat, 0.99));
            if args.json {
                intervals.push(
                    json!({"start": a, "end": b, "bytes": iv_bytes, "gbps": gbps,
                    "latency_us": {"p50": p50, "p99": p99}}),
                );
            } else {
                let line = format!(
                    "[{a:7.2}-{b:7.2} s] {:10.1} MiB  {gbps:6.2} GB/s  p50 {p50:.0} us  p99 {p99:.0} us",
                    iv_bytes as f64 / (1 << 20) as f64
                );
                match &bar {
                    Some(bar) => bar.println(line),
                    None => println!("{line}"),
                }
            }
            (iv_start, iv_bytes) = (now, 0);
            iv_lat.clear();
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    lat_ns.sort_unstable();
    Ok(Run {
        size,
        bytes: done_bytes,
        secs,
        lat_ns,
        intervals,
    })
}

/// What [`loopback`] measured.
#[derive(Clone, Copy, Debug)]
pub struct LinkFigure {
    /// Bytes written (and acknowledged).
    pub bytes: u64,
    /// Seconds from the first write posted to the last completion.
    pub seconds: f64,
}

impl LinkFigure {
    /// Throughput in GB/s (10⁹ bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }
}

/// A link test inside this process over `backend` on loopback, as `kvx recv` + `kvx send`
/// would run it: a server with a `region_bytes` region, a client with as many, and `total`
/// bytes written as batches of four 16 MiB writes (two batches in flight) over `connections`
/// connections. The baseline `kvx demo` prints its rooms' throughput against.
pub async fn loopback(
    backend: Backend,
    rdma: &kvx_engine::plane::RdmaOptions,
    connections: usize,
    region_bytes: u64,
    total: u64,
) -> Result<LinkFigure> {
    const OP: u64 = 16 << 20;
    let region_bytes = region_bytes.max(OP);
    let len = usize::try_from(region_bytes)?;
    let name = format!("kvx-demo-link-{}", std::process::id());
    // The receiver's memory as a decode's would be (a /dev/shm file with the shm backend).
    let dst = Arc::new(kvx_engine::plane::alloc_region(
        backend, &name, "recv", len,
    )?);
    let src = Arc::new(Region::new(len));
    // Touched before the clock, as registered pools are.
    src.fill(src.base(), region_bytes, 0x5a)?;
    dst.fill(dst.base(), region_bytes, 0)?;
    let server = DataPlane::server_with(backend, rdma, "127.0.0.1", &name, vec![dst]).await?;
    let client = DataPlane::client_with(
        backend,
        rdma,
        &format!("{name}-send"),
        connections,
        vec![src.clone()],
    )?;
    let session = client
        .transport()
        .connect(&server.endpoint())
        .await
        .context("connecting the link test")?;
    let Some(remote) = session.remote().regions.first().cloned() else {
        bail!("link test: the server registered no memory");
    };
    let slots = (region_bytes / OP).min(remote.len / OP).max(1);
    let batch = |k: u64| -> Vec<TransferOp> {
        (0..4)
            .map(|i| {
                let slot = (k + i) % slots;
                TransferOp::new(src.base() + slot * OP, remote.base + slot * OP, OP)
            })
            .collect()
    };
    let batches = total.div_ceil(4 * OP).max(1);
    let t0 = Instant::now();
    let mut inflight = std::collections::VecDeque::new();
    for k in 0..batches {
        inflight.push_back(session.write_batch(batch(4 * k)));
        if inflight.len() >= 2
            && let Some(f) = inflight.pop_front()
        {
            f.await?;
        }
    }
    while let Some(f) = inflight.pop_front() {
        f.await?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    drop((session, client, server));
    Ok(LinkFigure {
        bytes: batches * 4 * OP,
        seconds,
    })
}
