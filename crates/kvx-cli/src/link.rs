//! `kvx send` / `kvx recv`: a link test in the style of ib_write_bw / iperf3 over the data plane.
//!
//! `recv` registers a region with a listening transport and serves writes into it; `send`
//! learns the region from the session handshake, then posts batches of `--batch` writes of
//! `--size` bytes over `--connections` connections (one completion per batch, `--depth` batches
//! in flight, default 2) until `--total-mib` were written, and reports GB/s and the percentiles
//! of each batch's latency, from `write_batch` to its completion (`--depth 1 --batch 1` gives
//! the round trip of a single write). With `--backend mooncake` either
//! side speaks Mooncake TE's protocol, so each can be tested against a real Mooncake engine.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kvx_core::TransferOp;
use kvx_rdma::{BatchReport, BoxFuture, TransportError};

use crate::config::{RecvArgs, SendArgs};
use crate::plane::{Backend, DataPlane};
use crate::region::Region;

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// `kvx recv`: serves until interrupted.
pub fn recv(args: RecvArgs) -> Result<i32> {
    let shm_name = match args.backend {
        Backend::Shm => crate::plane::shm_link_name("--listen", &args.listen)?,
        _ => String::new(),
    };
    let region = Arc::new(
        crate::plane::alloc_region(args.backend, &shm_name, "recv", args.region as usize)
            .context("allocating the receive region")?,
    );
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
        let _ = tokio::signal::ctrl_c().await;
        drop(plane);
        anyhow::Ok(0)
    })
}

/// A batch posted by `kvx send`: when, its future, and once it resolved, its result and latency.
struct InFlight {
    at: Instant,
    fut: BoxFuture<'static, Result<BatchReport, TransportError>>,
    done: Option<(Result<BatchReport, TransportError>, std::time::Duration)>,
}

/// `kvx send`: returns the exit code.
pub fn send(args: SendArgs) -> Result<i32> {
    let size = args.size.max(1);
    let batch = args.batch.max(1) as u64;
    let total = args.total_mib.max(1) << 20;
    let src = Arc::new(Region::new((size * batch) as usize));
    let pattern: Vec<u8> = (0..src.len()).map(|i| (i % 251) as u8).collect();
    let _ = src.copy_in(src.base(), &pattern);
    let bar = {
        use std::io::IsTerminal as _;
        (!args.no_progress && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(total);
            if let Ok(s) = indicatif::ProgressStyle::with_template(
                "{bytes}/{total_bytes} [{bar:30}] {binary_bytes_per_sec}",
            ) {
                b.set_style(s.progress_chars("=> "));
            }
            b
        })
    };
    let mut lat_ns: Vec<u64> = Vec::new();
    let (bytes, secs) = runtime()?.block_on(async {
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
                crate::plane::shm_link_name("--to", &args.to)?
            ),
            _ => args.to.clone(),
        };
        let session = plane
            .transport()
            .connect(&to)
            .await
            .with_context(|| format!("connecting to {to}"))?;
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
        let depth = args.depth.max(1);
        let t0 = Instant::now();
        let mut sent = 0u64;
        let mut k = 0u64;
        // Every batch in flight is polled, not only the oldest: a future that is not polled
        // posts nothing, so awaiting them one by one would keep a single batch in flight.
        let mut inflight = std::collections::VecDeque::new();
        while sent < total || !inflight.is_empty() {
            while sent < total && inflight.len() < depth {
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
                lat_ns.push(took.as_nanos() as u64);
                if let Some(b) = &bar {
                    b.set_position(sent.min(total));
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        drop(plane);
        anyhow::Ok((sent, secs))
    })?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    println!(
        "sent {:.1} MiB in {secs:.2} s over {} connection(s), {size} B writes x {batch}/batch: {:.2} GB/s",
        bytes as f64 / (1 << 20) as f64,
        args.connections.max(1),
        bytes as f64 / secs.max(1e-9) / 1e9
    );
    lat_ns.sort_unstable();
    let pct = |q: f64| -> f64 {
        let i = ((lat_ns.len() as f64 * q).ceil() as usize).clamp(1, lat_ns.len().max(1)) - 1;
        lat_ns.get(i).copied().unwrap_or(0) as f64 / 1e3
    };
    println!(
        "batch latency over {} batches (depth {}): p50 {:.0} us, p99 {:.0} us, max {:.0} us",
        lat_ns.len(),
        args.depth.max(1),
        pct(0.50),
        pct(0.99),
        pct(1.0)
    );
    Ok(0)
}
