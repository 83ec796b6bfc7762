//! Transport benchmark: the tcp backend against a plain socket loop and memcpy, in one run.
//!
//! Cases (all over loopback, same process; the tcp receiver and sender run on separate tokio
//! runtimes of `KVX_BENCH_WORKERS` threads each, default 2):
//! - `memcpy`: one-thread copy of the bulk size (the same-host ceiling);
//! - `socket-loop`: N plain blocking TCP connections, each `write_all`-ing its share of the bulk
//!   buffer straight into a `read_exact` on the other side (N = the tcp backend's connections),
//!   connected afresh for each repetition;
//! - `socket-loop warm`: the same over N connections kept from one repetition to the next, as the
//!   tcp backend keeps its own (the kernel's autotuning has grown their buffers alike);
//! - `tcp bulk`: the tcp backend writing the same bytes as one batch of one op;
//! - `tcp kv p1` / `tcp kv p16`: Llama-3-8B KV (32 layers × K,V; 8 KV heads × 128 dim bf16 =
//!   2 KiB per token per buffer), 4096 tokens, page size 1 or 16, destination pages fragmented
//!   (pairs of pages shuffled), planned into merged ops, one batch per room;
//! - `tcp kv heads`: the same room as one prefill rank of a TP 2 → TP 1 pair writes it (head
//!   slices): 4 of the 8 heads, 1 KiB per token per buffer, read end to end from the rank's pages
//!   and written at a 2 KiB stride into the decode's (pages of 16 shuffled as above), one op per
//!   token (262 144 ops of 1 KiB; half the room's bytes);
//! - `memcpy heads`: those ops done with `memcpy` in one thread, the ceiling of that access
//!   pattern on this host (a contiguous copy against 1 KiB pieces at a 2 KiB stride).
//!
//! Each case runs `KVX_BENCH_REPS` times (default 5), interleaved. The table shows the best and
//! median throughput and, per case, the median over repetitions of its throughput divided by the
//! socket loop's in the same repetition (robust to a noisy, shared machine), and the CPU the
//! whole process spent on it per GiB (all repetitions, both sides of the copy; `/proc/self/stat`).
//! Then that paired ratio for the bulk case: `tcp/socket-loop ratio: X.XX` (same connection
//! count, same bytes) and against the warm loop (`tcp/socket-loop-warm ratio: X.XX`), and the KV
//! rooms against the bulk write of the same transport
//! (`kv p16/bulk ratio: X.XX`, `kv p1/bulk ratio: X.XX`, `kv heads/bulk ratio: X.XX`), and
//! what the head-slice pattern costs a plain copy (`memcpy heads/memcpy ratio: X.XX`): the
//! receiver's kernel copy pays the same, so `kv heads/bulk` is read against it.
//! Then single-write latency: for 4 KiB, 64 KiB and 1 MiB, `KVX_BENCH_LAT_WRITES` (default
//! 1000) sequential writes of one op through the tcp backend (`block_on(write_batch)`, each
//! waiting for its completion) against a plain blocking socket doing the same write followed by
//! an 8-byte acknowledgement from a reader thread, in rounds of 100 with the two alternating;
//! p50 / p99 of each and the ratio of the p50s (`latency 4KiB tcp/socket p50 ratio: X.XX`).
//! Environment: `KVX_BENCH_MIB` (bulk size, default 512), `KVX_BENCH_TOKENS` (default 4096),
//! and tcp tuning (defaults: `TcpConfig::default()`): `KVX_BENCH_CONNS`, `KVX_BENCH_SLICE_KIB`,
//! `KVX_BENCH_WINDOW_KIB`, `KVX_BENCH_WRITES` (writes per window), `KVX_BENCH_DEPTH`,
//! `KVX_BENCH_SOCKBUF_KIB`;
//! `KVX_BENCH_ONLY=socket|warm|bulk|kv|heads` (or several, comma-separated)
//! runs those cases alone, without the latency section (to profile it); the rows left out are not
//! printed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::{TcpConfig, TcpTransport, Transport};

const LAYERS: usize = 32;
const TOKEN_BYTES: usize = 8 * 128 * 2;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Plain blocking socket loop: `conns` connections share `src` → `dst`.
fn socket_loop(src: &[u8], dst: &mut [u8], conns: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let share = src.len().div_ceil(conns);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for chunk in src.chunks(share) {
            scope.spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_nodelay(true).unwrap();
                for piece in chunk.chunks(4 << 20) {
                    s.write_all(piece).unwrap();
                }
            });
        }
        let mut sinks = Vec::new();
        for _ in 0..src.len().div_ceil(share) {
            sinks.push(listener.accept().unwrap().0);
        }
        // Shares have equal lengths (bulk is a multiple of the connection count in every
        // configuration used), so each accepted stream simply fills the next share.
        for (sink, out) in sinks.into_iter().zip(dst.chunks_mut(share)) {
            scope.spawn(move || {
                let mut sink = sink;
                sink.read_exact(out).unwrap();
            });
        }
    });
    start.elapsed()
}

/// Plain blocking TCP connections kept across repetitions (`socket-loop warm`).
struct WarmLoop {
    /// (sending end, receiving end) of each connection.
    pairs: Vec<(TcpStream, TcpStream)>,
}

impl WarmLoop {
    fn new(conns: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let pairs = (0..conns.max(1))
            .map(|_| {
                let tx = TcpStream::connect(addr).unwrap();
                tx.set_nodelay(true).unwrap();
                (tx, listener.accept().unwrap().0)
            })
            .collect();
        WarmLoop { pairs }
    }

    /// Each connection moves its share of `src` into the same share of `dst`.
    fn run(&mut self, src: &[u8], dst: &mut [u8]) -> Duration {
        let share = src.len().div_ceil(self.pairs.len());
        let start = Instant::now();
        std::thread::scope(|scope| {
            let parts = src.chunks(share).zip(dst.chunks_mut(share));
            for ((tx, rx), (chunk, out)) in self.pairs.iter_mut().zip(parts) {
                scope.spawn(move || {
                    for piece in chunk.chunks(4 << 20) {
                        tx.write_all(piece).unwrap();
                    }
                });
                scope.spawn(move || rx.read_exact(out).unwrap());
            }
        });
        start.elapsed()
    }
}

/// Small deterministic generator for the page shuffle.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Plans a KV room: `tokens` tokens in pages of `page` tokens; source pages in order,
/// destination pages shuffled in pairs; consecutive (src, dst) page pairs merged into one op.
fn plan_kv(src_base: u64, dst_base: u64, tokens: usize, page: usize) -> Vec<TransferOp> {
    let pages = tokens / page;
    let page_bytes = (page * TOKEN_BYTES) as u64;
    let buf_bytes = (tokens * TOKEN_BYTES) as u64;
    let mut pairs: Vec<usize> = (0..pages.div_ceil(2)).collect();
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for i in (1..pairs.len()).rev() {
        pairs.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let dst_pages: Vec<usize> = pairs
        .iter()
        .flat_map(|&p| [2 * p, 2 * p + 1])
        .filter(|&p| p < pages)
        .collect();
    let mut ops = Vec::new();
    for buf in 0..2 * LAYERS {
        let (sb, db) = (
            src_base + buf as u64 * buf_bytes,
            dst_base + buf as u64 * buf_bytes,
        );
        let mut i = 0;
        while i < pages {
            let mut j = i + 1;
            while j < pages && dst_pages[j] == dst_pages[j - 1] + 1 {
                j += 1;
            }
            ops.push(TransferOp::new(
                sb + i as u64 * page_bytes,
                db + dst_pages[i] as u64 * page_bytes,
                (j - i) as u64 * page_bytes,
            ));
            i = j;
        }
    }
    ops
}

/// Plans one prefill rank's head slices of a TP 2 → TP 1 room (rank 0: the first half of each
/// destination token row): `tokens` tokens in pages of 16, destination pages shuffled in pairs
/// as in [`plan_kv`], one 1 KiB op per token and buffer (the source runs lie end to end, the
/// destinations 2 KiB apart).
fn plan_heads(src_base: u64, dst_base: u64, tokens: usize) -> Vec<TransferOp> {
    const PAGE: usize = 16;
    let half = (TOKEN_BYTES / 2) as u64;
    // The destination page of each source page, from the paged plan's merged runs (buffer 0).
    let page_bytes = (PAGE * TOKEN_BYTES) as u64;
    let buf_bytes = (tokens * TOKEN_BYTES) as u64;
    let mut dst_page = Vec::with_capacity(tokens / PAGE);
    for op in plan_kv(0, 0, tokens, PAGE)
        .iter()
        .take_while(|op| op.src < buf_bytes)
    {
        let first = op.dst / page_bytes;
        dst_page.extend(first..first + op.len / page_bytes);
    }
    let mut ops = Vec::with_capacity(2 * LAYERS * tokens);
    for buf in 0..2 * LAYERS as u64 {
        let (sb, db) = (
            src_base + buf * tokens as u64 * half,
            dst_base + buf * buf_bytes,
        );
        for (i, &dp) in dst_page.iter().enumerate() {
            for t in 0..PAGE as u64 {
                let token = i as u64 * PAGE as u64 + t;
                let dst_token = dp * PAGE as u64 + t;
                ops.push(TransferOp::new(
                    sb + token * half,
                    db + dst_token * TOKEN_BYTES as u64,
                    half,
                ));
            }
        }
    }
    ops
}

/// A plain blocking socket pair for the latency baseline: the write, then an 8-byte
/// acknowledgement sent once the reader thread has read every byte.
struct PingPong {
    tx: TcpStream,
    stop: Option<std::thread::JoinHandle<()>>,
}

impl PingPong {
    fn new(max: usize) -> PingPong {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        tx.set_nodelay(true).unwrap();
        let (mut rx, _) = listener.accept().unwrap();
        rx.set_nodelay(true).unwrap();
        let stop = std::thread::spawn(move || {
            let mut buf = vec![0u8; max];
            let mut len = [0u8; 8];
            loop {
                if rx.read_exact(&mut len).is_err() {
                    return;
                }
                let n = u64::from_le_bytes(len) as usize;
                if rx.read_exact(&mut buf[..n]).is_err() || rx.write_all(&[1u8; 8]).is_err() {
                    return;
                }
            }
        });
        PingPong {
            tx,
            stop: Some(stop),
        }
    }

    /// One write of `data` (length prefix and payload in one call) and its acknowledgement.
    fn once(&mut self, frame: &[u8]) -> Duration {
        let t = Instant::now();
        self.tx.write_all(frame).unwrap();
        let mut ack = [0u8; 8];
        self.tx.read_exact(&mut ack).unwrap();
        t.elapsed()
    }
}

impl Drop for PingPong {
    fn drop(&mut self) {
        let _ = self.tx.shutdown(std::net::Shutdown::Both);
        if let Some(h) = self.stop.take() {
            let _ = h.join();
        }
    }
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e6
}

struct Row {
    name: String,
    bytes: u64,
    ops: usize,
    runs: Vec<Duration>,
    /// CPU seconds (user + system, whole process) spent over all repetitions.
    cpu: f64,
}

/// CPU seconds (user + system, all threads, exited ones included) used so far by this process
/// (`/proc/self/stat`, 10 ms ticks; summed over repetitions that is precise to about 1 %).
fn cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (tick(11) + tick(12)) / 100.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl Row {
    fn gbps(&self, t: Duration) -> f64 {
        self.bytes as f64 / t.as_secs_f64() / 1e9
    }

    fn best(&self) -> Duration {
        self.runs.iter().copied().min().unwrap_or(Duration::MAX)
    }

    /// Median over repetitions of this row's throughput divided by `base`'s in the same
    /// repetition (the two were measured back to back).
    fn paired_ratio(&self, base: &Row) -> f64 {
        median(
            self.runs
                .iter()
                .zip(&base.runs)
                .map(|(&t, &b)| self.gbps(t) / base.gbps(b))
                .collect(),
        )
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let bulk = env_usize("KVX_BENCH_MIB", 512) << 20;
    let reps = env_usize("KVX_BENCH_REPS", 5).max(1);
    let tokens = env_usize("KVX_BENCH_TOKENS", 4096);
    let cfg = TcpConfig {
        connections: env_usize("KVX_BENCH_CONNS", TcpConfig::default().connections),
        slice_bytes: env_usize(
            "KVX_BENCH_SLICE_KIB",
            TcpConfig::default().slice_bytes >> 10,
        ) << 10,
        window_bytes: (env_usize(
            "KVX_BENCH_WINDOW_KIB",
            (TcpConfig::default().window_bytes >> 10) as usize,
        ) << 10) as u64,
        queue_depth: env_usize("KVX_BENCH_DEPTH", TcpConfig::default().queue_depth),
        max_writes_per_window: env_usize(
            "KVX_BENCH_WRITES",
            TcpConfig::default().max_writes_per_window,
        ),
        socket_buffer: std::env::var("KVX_BENCH_SOCKBUF_KIB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|k| k << 10),
        ..TcpConfig::default()
    };
    let conns = cfg.connections;
    let kv_bytes = 2 * LAYERS * tokens * TOKEN_BYTES;
    let size = bulk.max(kv_bytes);
    println!(
        "transport bench: bulk {} MiB, KV {} tokens ({} MiB), {} repetitions; {:?}",
        bulk >> 20,
        tokens,
        kv_bytes >> 20,
        reps,
        cfg
    );
    let mut src: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
    let mut dst = vec![1u8; size];

    // Receiver and sender each get their own runtime, as the decode and prefill processes would.
    let workers = env_usize("KVX_BENCH_WORKERS", 2).max(1);
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap()
    };
    let (rt_recv, rt) = (runtime(), runtime());
    let server = rt_recv.block_on(async {
        TcpTransport::bind("127.0.0.1:0", cfg.clone())
            .await
            .unwrap()
    });
    let client = TcpTransport::client(cfg.clone());
    // SAFETY: both buffers live until the end of main, after every batch completed and both
    // transports are dropped.
    unsafe {
        server
            .register(dst.as_mut_ptr() as u64, size as u64)
            .unwrap();
        client
            .register(src.as_mut_ptr() as u64, size as u64)
            .unwrap();
    }
    let session = rt.block_on(client.connect(&server.endpoint())).unwrap();
    let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    // (row name, its `KVX_BENCH_ONLY` key, the batch).
    let cases: Vec<(&str, &str, Vec<TransferOp>)> = vec![
        ("tcp bulk", "bulk", vec![TransferOp::new(s, d, bulk as u64)]),
        ("tcp kv p1", "kv", plan_kv(s, d, tokens, 1)),
        ("tcp kv p16", "kv", plan_kv(s, d, tokens, 16)),
        ("tcp kv heads", "heads", plan_heads(s, d, tokens)),
    ];

    let mut rows = vec![
        Row {
            name: "memcpy".into(),
            bytes: bulk as u64,
            ops: 1,
            runs: Vec::new(),
            cpu: 0.0,
        },
        Row {
            name: format!("socket-loop x{conns}"),
            bytes: bulk as u64,
            ops: 1,
            runs: Vec::new(),
            cpu: 0.0,
        },
    ];
    for (name, _, ops) in &cases {
        rows.push(Row {
            name: format!("{name} x{conns}"),
            bytes: TransferOp::total_bytes(ops),
            ops: ops.len(),
            runs: Vec::new(),
            cpu: 0.0,
        });
    }
    let warm_row = rows.len();
    rows.push(Row {
        name: format!("socket-loop warm x{conns}"),
        bytes: bulk as u64,
        ops: 1,
        runs: Vec::new(),
        cpu: 0.0,
    });
    let heads_ops = &cases[3].2;
    let memcpy_heads_row = rows.len();
    rows.push(Row {
        name: "memcpy heads".into(),
        bytes: TransferOp::total_bytes(heads_ops),
        ops: heads_ops.len(),
        runs: Vec::new(),
        cpu: 0.0,
    });
    // `KVX_BENCH_ONLY=socket|warm|bulk|kv|heads[,…]`: run those cases alone and skip the latency
    // section (for `strace -c -f` / `perf stat` of one case; the other rows stay empty).
    let only = std::env::var("KVX_BENCH_ONLY").unwrap_or_default();
    let runs = |case: &str| only.is_empty() || only.split(',').any(|c| c == case);
    // Warm-up (page faults, connection ramp-up), then interleaved repetitions.
    if runs("socket") {
        socket_loop(&src[..bulk], &mut dst[..bulk], conns);
    }
    let mut warm = runs("warm").then(|| WarmLoop::new(conns));
    if let Some(w) = &mut warm {
        w.run(&src[..bulk], &mut dst[..bulk]);
    }
    if only != "socket" {
        rt.block_on(session.write_batch(cases[0].2.clone()))
            .unwrap();
    }
    for _ in 0..reps {
        if only.is_empty() {
            let (t, c) = (Instant::now(), cpu_secs());
            dst[..bulk].copy_from_slice(&src[..bulk]);
            rows[0].runs.push(t.elapsed());
            rows[0].cpu += cpu_secs() - c;
            let (t, c) = (Instant::now(), cpu_secs());
            for op in heads_ops {
                let (so, doff, n) = (
                    (op.src - s) as usize,
                    (op.dst - d) as usize,
                    op.len as usize,
                );
                dst[doff..doff + n].copy_from_slice(&src[so..so + n]);
            }
            rows[memcpy_heads_row].runs.push(t.elapsed());
            rows[memcpy_heads_row].cpu += cpu_secs() - c;
        }
        if runs("socket") {
            let c = cpu_secs();
            let t = socket_loop(&src[..bulk], &mut dst[..bulk], conns);
            rows[1].runs.push(t);
            rows[1].cpu += cpu_secs() - c;
        }
        // Before the tcp cases: the KV bytes check below reads what the last of them left.
        if let Some(w) = &mut warm {
            let c = cpu_secs();
            let t = w.run(&src[..bulk], &mut dst[..bulk]);
            rows[warm_row].runs.push(t);
            rows[warm_row].cpu += cpu_secs() - c;
        }
        for (i, (_, key, ops)) in cases.iter().enumerate() {
            if !runs(key) {
                continue;
            }
            let ops = ops.clone();
            let (t, c) = (Instant::now(), cpu_secs());
            rt.block_on(session.write_batch(ops)).unwrap();
            rows[2 + i].runs.push(t.elapsed());
            rows[2 + i].cpu += cpu_secs() - c;
        }
    }
    drop(warm);
    // Bytes check on the last KV case run: the planned destination must equal the source.
    let last = cases
        .iter()
        .rev()
        .find(|(_, key, _)| *key != "bulk" && runs(key));
    for op in last.iter().flat_map(|(_, _, ops)| ops) {
        let (so, doff) = ((op.src - s) as usize, (op.dst - d) as usize);
        assert_eq!(
            &src[so..so + op.len as usize],
            &dst[doff..doff + op.len as usize]
        );
    }
    // Single-write latency, tcp backend against a plain socket write + ack.
    let lat_writes = env_usize("KVX_BENCH_LAT_WRITES", 1000).max(1);
    let mut lat_lines = Vec::new();
    let lat_sizes: &[usize] = if only.is_empty() {
        &[4 << 10, 64 << 10, 1 << 20]
    } else {
        &[]
    };
    for &size in lat_sizes {
        let mut pp = PingPong::new(size);
        let mut frame = (size as u64).to_le_bytes().to_vec();
        frame.extend_from_slice(&src[..size]);
        let op = TransferOp::new(s, d, size as u64);
        let (mut t_tcp, mut t_sock) = (Vec::new(), Vec::new());
        for _ in 0..20 {
            pp.once(&frame);
            rt.block_on(session.write_batch(vec![op])).unwrap();
        }
        let mut left = lat_writes;
        while left > 0 {
            let n = left.min(100);
            left -= n;
            for _ in 0..n {
                t_sock.push(pp.once(&frame));
            }
            for _ in 0..n {
                let t = Instant::now();
                rt.block_on(session.write_batch(vec![op])).unwrap();
                t_tcp.push(t.elapsed());
            }
        }
        t_tcp.sort_unstable();
        t_sock.sort_unstable();
        let label = if size >= 1 << 20 {
            format!("{}MiB", size >> 20)
        } else {
            format!("{}KiB", size >> 10)
        };
        lat_lines.push(format!(
            "| {label} | {:.0} / {:.0} | {:.0} / {:.0} | {:.2} |",
            percentile(&t_tcp, 0.5),
            percentile(&t_tcp, 0.99),
            percentile(&t_sock, 0.5),
            percentile(&t_sock, 0.99),
            percentile(&t_tcp, 0.5) / percentile(&t_sock, 0.5)
        ));
        lat_lines.push(format!(
            "latency {label} tcp/socket p50 ratio: {:.2}",
            percentile(&t_tcp, 0.5) / percentile(&t_sock, 0.5)
        ));
    }
    drop((session, client, server));
    drop(rt);
    drop(rt_recv);

    println!();
    println!(
        "| case | bytes | ops | best ms | best GB/s | median GB/s | vs socket loop (median of paired runs) | CPU ms per GiB |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    // Rows `KVX_BENCH_ONLY` left out have no runs: not printed.
    for r in rows.iter().filter(|r| !r.runs.is_empty()) {
        println!(
            "| {} | {} MiB | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.0} |",
            r.name,
            r.bytes >> 20,
            r.ops,
            r.best().as_secs_f64() * 1e3,
            r.gbps(r.best()),
            median(r.runs.iter().map(|&t| r.gbps(t)).collect()),
            r.paired_ratio(&rows[1]),
            r.cpu * 1e3 / (r.bytes as f64 * r.runs.len() as f64 / (1u64 << 30) as f64)
        );
    }
    println!();
    println!(
        "tcp/socket-loop ratio: {:.2}",
        rows[2].paired_ratio(&rows[1])
    );
    println!(
        "tcp/socket-loop-warm ratio: {:.2}",
        rows[2].paired_ratio(&rows[warm_row])
    );
    // Issue 15 item 2: KV rooms (merged runs of fragmented pages) against the bulk write of the
    // same transport, paired per repetition.
    let row = |case: &str| {
        rows.iter()
            .find(|r| r.name.split(" x").next() == Some(case))
    };
    for case in ["tcp kv p16", "tcp kv p1", "tcp kv heads"] {
        if let (Some(kv), Some(b)) = (row(case), row("tcp bulk")) {
            println!(
                "{}/bulk ratio: {:.2}",
                case.trim_start_matches("tcp "),
                kv.paired_ratio(b)
            );
        }
    }
    if let (Some(h), Some(m)) = (row("memcpy heads"), row("memcpy")) {
        println!("memcpy heads/memcpy ratio: {:.2}", h.paired_ratio(m));
    }
    println!();
    println!(
        "| single write ({lat_writes} each) | tcp p50 / p99 us | socket write + ack p50 / p99 us | tcp/socket p50 |"
    );
    println!("|---|---:|---:|---:|");
    for l in lat_lines.iter().filter(|l| l.starts_with('|')) {
        println!("{l}");
    }
    println!();
    for l in lat_lines.iter().filter(|l| !l.starts_with('|')) {
        println!("{l}");
    }
}
