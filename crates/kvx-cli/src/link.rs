//! `kvx send` / `kvx recv`: a link test in the style of ib_write_bw / iperf3 over the data plane.
//!
//! `recv` registers a region and serves writes into it; `send` asks for the region, then posts
//! batches of `--batch` writes of `--size` bytes on `--connections` connections (one completion
//! per batch) until `--total-mib` were written, and reports GB/s.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvx_core::TransferOp;

use crate::config::{RecvArgs, SendArgs};
use crate::dataplane::{DataConn, DataServer};
use crate::region::Region;

/// `kvx recv`: serves until interrupted, printing throughput once per second while busy.
pub fn recv(args: RecvArgs) -> Result<i32> {
    let region = Arc::new(Region::new(args.region as usize));
    let server = DataServer::bind(&args.listen, vec![region]).context("binding")?;
    eprintln!("kvx recv: listening on {}", server.local_addr());
    let mut last = server.bytes_received();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = server.bytes_received();
        if now != last {
            println!("received {:.2} GB/s", (now - last) as f64 / 1e9);
            last = now;
        }
    }
}

/// `kvx send`: returns the exit code.
pub fn send(args: SendArgs) -> Result<i32> {
    let size = args.size.max(1);
    let batch = args.batch.max(1);
    let conns = args.connections.max(1);
    let total = args.total_mib.max(1) << 20;
    let per_conn = total / conns as u64;
    let src = Arc::new(Region::new((size * batch as u64) as usize));
    let _ = src.write_with(src.base(), src.len(), |s| {
        for (i, b) in s.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
    });
    let sent = Arc::new(AtomicU64::new(0));
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
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..conns {
        let (src, sent, to) = (src.clone(), sent.clone(), args.to.clone());
        handles.push(std::thread::spawn(move || -> Result<()> {
            let mut c = DataConn::connect(&to, Duration::from_secs(10))?;
            let regions = c.regions()?;
            let Some(&(base, len)) = regions.first() else {
                bail!("peer registered no memory");
            };
            if len < size {
                bail!("peer region ({len} B) smaller than one write ({size} B)");
            }
            let slots = (len / size).max(1);
            let mut done = 0u64;
            let mut k = 0u64;
            while done < per_conn {
                let ops: Vec<TransferOp> = (0..batch as u64)
                    .map(|i| {
                        let slot = (k + i) % slots;
                        TransferOp::new(src.base() + i * size, base + slot * size, size)
                    })
                    .collect();
                k += batch as u64;
                c.write_batch(&[&src], &ops)?;
                let b = TransferOp::total_bytes(&ops);
                done += b;
                sent.fetch_add(b, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    if let Some(b) = &bar {
        while handles.iter().any(|h| !h.is_finished()) {
            b.set_position(sent.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(100));
        }
        b.finish_and_clear();
    }
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("sender thread panicked"))??;
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes = sent.load(Ordering::Relaxed);
    println!(
        "sent {:.1} MiB in {:.2} s on {conns} connection(s), {size} B writes × {batch}/batch: {:.2} GB/s",
        bytes as f64 / (1 << 20) as f64,
        secs,
        bytes as f64 / secs.max(1e-9) / 1e9
    );
    Ok(0)
}
