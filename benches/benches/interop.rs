//! Interop benchmark: kvx's `mooncake` backend against the real Mooncake Transfer Engine
//! (`mooncake-transfer-engine-non-cuda==0.3.13.post1`, Python peers in `benches/py/`), every
//! ratio measured side by side in one run over loopback.
//!
//! Processes: this bench (kvx initiator = `MooncakeTransport::client`, kvx target =
//! `MooncakeTransport::bind`, each on its own 2-thread runtime), one TE target process and one TE
//! initiator process (`benches/py/mooncake_bench_peer.py`). Cases:
//! - initiators into the same TE target: kvx (`write_batch`, one batch) vs Mooncake's own
//!   (`batch_transfer_sync_write` from the second Python process);
//! - targets under the same TE initiator: kvx target vs TE target;
//!
//! each on two shapes:
//! - `room`: Llama-3-8B TP1 KV, 64 buffers (32 layers × K,V), 4096 tokens, page size 16 (256
//!   pages), item_len 32 KiB (16 tokens × 8 heads × 128 × 2 B) per page per buffer, source pages
//!   in order, destination pages shuffled in pairs, contiguous runs merged: ≈ 8128 entries of
//!   ≈ 64 KiB, 512 MiB. Mooncake's initiator gets it in batches of at most 1024 entries
//!   (`KVX_INTEROP_TE_BATCH`): one `batch_transfer_sync_write` of more than ~2048 entries fails
//!   (lane queue-full), so sglang would have to cut it too; kvx posts one batch;
//! - `bulk`: 1 GiB in 4 MiB entries (`KVX_INTEROP_BULK_MIB`, `KVX_INTEROP_BULK_ENTRY_KIB`).
//!
//! and 4 KiB single-write latency (p50/p99 over `KVX_INTEROP_LAT_WRITES` = 2000 sequential
//! writes per path after 100 warm-up writes, in rounds of 250 with the paths rotated): kvx → TE,
//! TE → TE, TE → kvx, kvx → kvx for reference, and two more references: kvx's `tcp` backend
//! (kvx → kvx, default `TcpConfig`) and a plain blocking socket pair doing the same 4 KiB write
//! followed by an 8-byte acknowledgement. Printed after them: `interop/latency tcp/TE p50
//! ratio: X.XX` (tcp backend over TE → TE) and `interop/latency tcp/socket p50 ratio: X.XX`.
//!
//! Each throughput case runs once untimed (connections, page faults), then `KVX_INTEROP_REPS`
//! (default 5) interleaved repetitions (the order within each compared pair alternates); the
//! figures are medians, ratios the median over repetitions of the paired quotient. A final
//! untimed pass clears each destination, writes it once per case and checks sampled entries
//! (CRC-32 against the source, which both initiators fill with the same pattern). Beside each
//! figure: cores busy (CPU seconds over wall seconds, `/proc/<pid>/stat`) of this process, the
//! TE target and the TE initiator. The last line is `interop/mooncake ratio: X.XX`: kvx
//! initiator over TE initiator, room shape. Profiling: `KVX_INTEROP_ONLY=latency|throughput`,
//! `KVX_INTEROP_CASES=room:te_to_kvx,bulk:kvx_to_te,...` (shape:`kvx_to_te`|`te_to_te`|`te_to_kvx`).
//!
//! Python: `$KVX_PYTHON`, else `<workspace>/.venv/bin/python3`; it must import `mooncake.engine`.
//! With `KVX_INTEROP_JSON=<file>` the figures are also written there as JSON (what `cargo xtask
//! bench interop` turns into its report part). kvx tuning (both sides, defaults
//! `MooncakeConfig::default()`): `KVX_MC_CONNS`, `KVX_MC_SLICE_KIB`, `KVX_MC_GROUP_KIB`,
//! `KVX_MC_GROUP_REQS`, `KVX_MC_INFLIGHT_KIB`, `KVX_MC_INFLIGHT_REQS`, `KVX_MC_DEPTH`,
//! `KVX_MC_SOCKBUF_KIB`. `MC_*` variables reach the Mooncake engines unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::mooncake::MooncakeSession;
use kvx_rdma::tcp::TcpSession;
use kvx_rdma::{MooncakeConfig, MooncakeTransport, Session, TcpConfig, TcpTransport, Transport};
use serde_json::{Value, json};

const LAYERS: usize = 32;
/// Buffers of the room (K and V per layer).
const BUFFERS: usize = 2 * LAYERS;
/// 8 KV heads × 128 dims × bf16.
const TOKEN_BYTES: usize = 8 * 128 * 2;
const PAGE: usize = 16;
const LAT_BYTES: usize = 4096;
const LAT_WARMUP: usize = 100;
/// Latency writes per path and round.
const LAT_ROUND: usize = 250;
/// Period of the source pattern (odd, so no page-aligned shift maps it onto itself).
const PATTERN_LEN: usize = (1 << 20) + 13;

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| fail(&format!("{name}={v:?} is not a number"))),
        Err(_) => default,
    }
}

/// Process ids of the running Python peers (killed when the bench fails).
static PEERS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn fail(msg: &str) -> ! {
    eprintln!("interop bench: {msg}");
    let pids: Vec<String> = PEERS
        .lock()
        .map(|p| p.iter().map(u32::to_string).collect())
        .unwrap_or_default();
    if !pids.is_empty() {
        let _ = Command::new("kill").arg("-9").args(&pids).status();
    }
    std::process::exit(1)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$KVX_PYTHON`, else the workspace venv; exits with what to do when it cannot import the
/// engine.
fn python() -> PathBuf {
    let candidate = std::env::var_os("KVX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python3"));
    let out = Command::new(&candidate)
        .args(["-c", "from mooncake.engine import TransferEngine"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    match out {
        Ok(o) if o.status.success() => candidate,
        r => {
            let why = match r {
                Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                Err(e) => e.to_string(),
            };
            fail(&format!(
                "no Python with the Mooncake engine (tried {}: {why}); run `cargo xtask setup` or \
                 `<workspace>/.venv/bin/pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` \
                 (needs libibverbs1), or set KVX_PYTHON",
                candidate.display()
            ))
        }
    }
}

/// A running `mooncake_bench_peer.py`.
struct Peer {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Peer {
    fn spawn(python: &Path, name: &'static str, args: &[String]) -> Peer {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("py/mooncake_bench_peer.py");
        let mut child = Command::new(python)
            .arg(&script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| fail(&format!("starting {}: {e}", script.display())));
        if let Ok(mut p) = PEERS.lock() {
            p.push(child.id());
        }
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // The engine logs to stderr; keep the last lines for error messages.
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let tail = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                let mut t = tail.lock().unwrap();
                if t.len() == 40 {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        Peer {
            name,
            child,
            stdin,
            lines,
            stderr,
        }
    }

    fn die(&mut self, what: &str) -> ! {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let id = self.child.id();
        if let Ok(mut p) = PEERS.lock() {
            p.retain(|&q| q != id);
        }
        std::thread::sleep(Duration::from_millis(100));
        let tail: Vec<String> = self.stderr.lock().unwrap().iter().cloned().collect();
        fail(&format!(
            "{} peer: {what}; its stderr ends with:\n{}",
            self.name,
            tail.join("\n")
        ))
    }

    /// The next event, which must be `name`.
    fn expect(&mut self, name: &str) -> Value {
        match self.lines.recv_timeout(Duration::from_secs(300)) {
            Ok(line) => match serde_json::from_str::<Value>(&line) {
                Ok(ev) if ev["event"] == name => ev,
                Ok(ev) => self.die(&format!("expected event {name}, got {ev}")),
                Err(e) => self.die(&format!("printed non-JSON {line:?}: {e}")),
            },
            Err(_) => self.die(&format!("no {name} event")),
        }
    }

    fn call(&mut self, cmd: &Value, name: &str) -> Value {
        let line = format!("{cmd}\n");
        if self
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
            .is_err()
        {
            self.die("its stdin closed");
        }
        self.expect(name)
    }

    fn quit(mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// Deterministic source pattern (xorshift bytes), the period of both initiators' sources.
fn pattern() -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..PATTERN_LEN)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// One write: source offset (into the initiator's source), absolute destination, length.
#[derive(Clone, Copy, Debug)]
struct Entry {
    src_off: u64,
    dst: u64,
    len: u64,
}

fn entries_json(es: &[Entry]) -> Value {
    Value::Array(
        es.iter()
            .map(|e| json!([e.src_off, e.dst, e.len]))
            .collect(),
    )
}

fn ops(es: &[Entry], src_base: u64) -> Vec<TransferOp> {
    es.iter()
        .map(|e| TransferOp::new(src_base + e.src_off, e.dst, e.len))
        .collect()
}

/// The room: source buffer `b` at offset `b × buf_bytes` of the source, pages in order; the
/// destination pages shuffled in pairs (half the page boundaries discontiguous); runs of
/// contiguous destination pages merged into one entry, as sglang's prefill does.
fn plan_room(dst_bufs: &[u64], buf_bytes: usize) -> Vec<Entry> {
    let pages = buf_bytes / (PAGE * TOKEN_BYTES);
    let item = (PAGE * TOKEN_BYTES) as u64;
    let mut pairs: Vec<usize> = (0..pages.div_ceil(2)).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..pairs.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        pairs.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let dst_pages: Vec<usize> = pairs
        .iter()
        .flat_map(|&p| [2 * p, 2 * p + 1])
        .filter(|&p| p < pages)
        .collect();
    let mut out = Vec::new();
    for (b, &db) in dst_bufs.iter().enumerate().take(BUFFERS) {
        let sb = (b * buf_bytes) as u64;
        let mut i = 0;
        while i < pages {
            let mut j = i + 1;
            while j < pages && dst_pages[j] == dst_pages[j - 1] + 1 {
                j += 1;
            }
            out.push(Entry {
                src_off: sb + i as u64 * item,
                dst: db + dst_pages[i] as u64 * item,
                len: (j - i) as u64 * item,
            });
            i = j;
        }
    }
    out
}

/// The bulk write: `bytes` from the start of the source in `entry`-sized entries, laid over
/// the destination buffers in order (an entry never crosses a buffer).
fn plan_bulk(dst_bufs: &[u64], buf_bytes: usize, bytes: usize, entry: usize) -> Vec<Entry> {
    (0..bytes / entry)
        .map(|k| {
            let at = k * entry;
            Entry {
                src_off: at as u64,
                dst: dst_bufs[at / buf_bytes] + (at % buf_bytes) as u64,
                len: entry as u64,
            }
        })
        .collect()
}

/// CRC-32 (IEEE, zlib's).
fn crc32(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut c = !0u32;
    for &b in data {
        c = t[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// About `n` entries spread over `es`, the first and last included.
fn sample(es: &[Entry], n: usize) -> Vec<Entry> {
    let step = es.len().div_ceil(n.max(1)).max(1);
    let mut s: Vec<Entry> = es.iter().step_by(step).copied().collect();
    if let Some(&last) = es.last() {
        s.push(last);
    }
    s
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Who writes into whom.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path2 {
    KvxToTe,
    TeToTe,
    TeToKvx,
}

impl Path2 {
    fn label(self) -> &'static str {
        match self {
            Path2::KvxToTe => "kvx -> TE",
            Path2::TeToTe => "TE -> TE",
            Path2::TeToKvx => "TE -> kvx",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Path2::KvxToTe => "kvx_to_te",
            Path2::TeToTe => "te_to_te",
            Path2::TeToKvx => "te_to_kvx",
        }
    }
}

struct Case {
    shape: &'static str,
    path: Path2,
    entries: Vec<Entry>,
    bytes: u64,
    /// The TE initiator's plan name (TE-initiated cases).
    plan: String,
    /// TE initiator batches (TE-initiated cases).
    te_batches: usize,
    runs: Vec<f64>,
    /// Per run: CPU seconds of this process (kvx initiator and target), the TE target and the
    /// TE initiator, and the wall seconds they were measured over.
    cpu: Vec<([f64; 3], f64)>,
}

impl Case {
    fn gbps(&self, secs: f64) -> f64 {
        self.bytes as f64 / secs / 1e9
    }
    fn median_gbps(&self) -> f64 {
        median(self.runs.iter().map(|&s| self.gbps(s)).collect())
    }
    fn best_gbps(&self) -> f64 {
        self.runs
            .iter()
            .map(|&s| self.gbps(s))
            .fold(f64::NAN, f64::max)
    }
    /// Median CPU seconds per run, per process.
    fn cpu_median(&self) -> [f64; 3] {
        let m = |i: usize| median(self.cpu.iter().map(|c| c.0[i]).collect());
        [m(0), m(1), m(2)]
    }
    /// Median cores busy (CPU seconds over wall seconds) per process.
    fn cores_median(&self) -> [f64; 3] {
        let m = |i: usize| median(self.cpu.iter().map(|c| c.0[i] / c.1).collect());
        [m(0), m(1), m(2)]
    }
    /// Median over repetitions of this case's GB/s over `base`'s in the same repetition.
    fn paired(&self, base: &Case) -> f64 {
        median(
            self.runs
                .iter()
                .zip(&base.runs)
                .map(|(&t, &b)| self.gbps(t) / base.gbps(b))
                .collect(),
        )
    }
}

struct Bench {
    rt: tokio::runtime::Runtime,
    kvx_session: MooncakeSession,
    kvx_src: Vec<u8>,
    te_target: Peer,
    te_init: Peer,
    /// The kvx target's memory (registered; read only while no write is in flight).
    kvx_dst: Vec<u8>,
    te_session: String,
    te_bufs: Vec<u64>,
    kvx_endpoint: String,
    /// A second kvx initiator, for the kvx -> kvx latency reference.
    kvx_loop: Arc<MooncakeTransport>,
    /// kvx's tcp backend into `kvx_dst`, for the tcp latency reference.
    tcp_session: TcpSession,
    /// A plain socket pair (write + 8-byte acknowledgement), the socket latency reference.
    socket: std::net::TcpStream,
}

/// Serves the plain-socket latency reference: reads a 4 KiB write, answers 8 bytes.
fn socket_echo(mut rx: std::net::TcpStream) {
    let mut buf = [0u8; LAT_BYTES];
    while rx.read_exact(&mut buf).is_ok() {
        if rx.write_all(&[1u8; 8]).is_err() {
            return;
        }
    }
}

/// CPU seconds (user + system, all threads) used so far by process `pid` (`/proc/<pid>/stat`,
/// in clock ticks of 10 ms).
fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
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

impl Bench {
    /// CPU seconds so far of this process, the TE target and the TE initiator.
    fn cpu(&self) -> [f64; 3] {
        [
            cpu_secs(std::process::id()),
            cpu_secs(self.te_target.child.id()),
            cpu_secs(self.te_init.child.id()),
        ]
    }

    fn src_base(&self) -> u64 {
        self.kvx_src.as_ptr() as u64
    }

    /// Runs one case once; returns the initiator's wall time in seconds.
    fn run(&mut self, c: &Case) -> f64 {
        match c.path {
            Path2::KvxToTe => {
                let ops = ops(&c.entries, self.src_base());
                let t = Instant::now();
                let r = self.rt.block_on(self.kvx_session.write_batch(ops));
                let secs = t.elapsed().as_secs_f64();
                if let Err(e) = r {
                    fail(&format!("kvx -> TE {}: {e}", c.shape));
                }
                secs
            }
            Path2::TeToTe | Path2::TeToKvx => {
                let ev = self
                    .te_init
                    .call(&json!({"cmd": "run", "name": c.plan}), "ran");
                if ev["rc"] != 0 {
                    self.te_init.die(&format!(
                        "{} {}: batch_transfer_sync_write returned {} at batch {}",
                        c.path.label(),
                        c.shape,
                        ev["rc"],
                        ev["failed_batch"]
                    ));
                }
                ev["secs"].as_f64().unwrap()
            }
        }
    }

    /// Clears the destination, writes once and checks sampled entries against the source.
    fn verify(&mut self, c: &Case) {
        let picked = sample(&c.entries, if c.shape == "room" { 256 } else { 16 });
        let into_te = c.path != Path2::TeToKvx;
        if into_te {
            self.te_target.call(&json!({"cmd": "clear"}), "cleared");
        } else {
            self.kvx_dst.iter_mut().for_each(|b| *b = 0);
        }
        self.run(c);
        let want: Vec<u32> = picked
            .iter()
            .map(|e| {
                let o = e.src_off as usize;
                crc32(&self.kvx_src[o..o + e.len as usize])
            })
            .collect();
        let got: Vec<u32> = if into_te {
            let ranges: Vec<Value> = picked.iter().map(|e| json!([e.dst, e.len])).collect();
            let ev = self
                .te_target
                .call(&json!({"cmd": "crc", "ranges": ranges}), "crc");
            ev["crcs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        } else {
            let base = self.kvx_dst.as_ptr() as u64;
            picked
                .iter()
                .map(|e| {
                    let o = (e.dst - base) as usize;
                    crc32(&self.kvx_dst[o..o + e.len as usize])
                })
                .collect()
        };
        let bad = want.iter().zip(&got).filter(|(a, b)| a != b).count();
        if bad > 0 {
            fail(&format!(
                "{} {}: {bad} of {} sampled entries differ from the source",
                c.path.label(),
                c.shape,
                picked.len()
            ));
        }
    }

    /// `count` 4 KiB single writes after `warmup` untimed ones; their latencies in seconds.
    fn latency(&mut self, path: &str, count: usize, warmup: usize) -> Vec<f64> {
        let te_dst = self.te_bufs[0];
        let kvx_dst = self.kvx_dst.as_ptr() as u64;
        match path {
            "kvx_to_te" | "kvx_to_kvx" => {
                let dst = if path == "kvx_to_te" { te_dst } else { kvx_dst };
                let session = if path == "kvx_to_te" {
                    None
                } else {
                    Some(
                        self.rt
                            .block_on(self.kvx_loop.connect(&self.kvx_endpoint))
                            .unwrap_or_else(|e| fail(&format!("kvx -> kvx connect: {e}"))),
                    )
                };
                let op = TransferOp::new(self.src_base(), dst, LAT_BYTES as u64);
                let mut out = Vec::with_capacity(count);
                for i in 0..warmup + count {
                    let t = Instant::now();
                    let r = match &session {
                        None => self.rt.block_on(self.kvx_session.write_batch(vec![op])),
                        Some(s) => self.rt.block_on(s.write_batch(vec![op])),
                    };
                    let secs = t.elapsed().as_secs_f64();
                    if let Err(e) = r {
                        fail(&format!("{path} latency write: {e}"));
                    }
                    if i >= warmup {
                        out.push(secs);
                    }
                }
                out
            }
            "tcp_to_kvx" => {
                let op = TransferOp::new(self.src_base(), kvx_dst, LAT_BYTES as u64);
                let mut out = Vec::with_capacity(count);
                for i in 0..warmup + count {
                    let t = Instant::now();
                    let r = self.rt.block_on(self.tcp_session.write_batch(vec![op]));
                    let secs = t.elapsed().as_secs_f64();
                    if let Err(e) = r {
                        fail(&format!("{path} latency write: {e}"));
                    }
                    if i >= warmup {
                        out.push(secs);
                    }
                }
                out
            }
            "socket" => {
                let mut out = Vec::with_capacity(count);
                let mut ack = [0u8; 8];
                for i in 0..warmup + count {
                    let t = Instant::now();
                    self.socket.write_all(&self.kvx_src[..LAT_BYTES]).unwrap();
                    self.socket.read_exact(&mut ack).unwrap();
                    if i >= warmup {
                        out.push(t.elapsed().as_secs_f64());
                    }
                }
                out
            }
            _ => {
                let (session, dst) = if path == "te_to_te" {
                    (self.te_session.clone(), te_dst)
                } else {
                    (self.kvx_endpoint.clone(), kvx_dst)
                };
                let ev = self.te_init.call(
                    &json!({"cmd": "lat", "session": session, "src_off": 0, "dst": dst,
                        "len": LAT_BYTES, "count": count, "warmup": warmup}),
                    "lat",
                );
                if ev["rc"] != 0 {
                    self.te_init
                        .die(&format!("{path} latency: rc {}", ev["rc"]));
                }
                ev["secs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect()
            }
        }
    }
}

fn mc_config() -> MooncakeConfig {
    let d = MooncakeConfig::default();
    MooncakeConfig {
        connections: env_usize("KVX_MC_CONNS", d.connections),
        slice_bytes: (env_usize("KVX_MC_SLICE_KIB", (d.slice_bytes >> 10) as usize) << 10) as u64,
        group_bytes: (env_usize("KVX_MC_GROUP_KIB", (d.group_bytes >> 10) as usize) << 10) as u64,
        group_requests: env_usize("KVX_MC_GROUP_REQS", d.group_requests),
        max_inflight_bytes: (env_usize(
            "KVX_MC_INFLIGHT_KIB",
            (d.max_inflight_bytes >> 10) as usize,
        ) << 10) as u64,
        max_inflight_requests: env_usize("KVX_MC_INFLIGHT_REQS", d.max_inflight_requests),
        queue_depth: env_usize("KVX_MC_DEPTH", d.queue_depth),
        socket_buffer: std::env::var("KVX_MC_SOCKBUF_KIB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|k| k << 10),
        ..d
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() {
    // `cargo test --benches` runs bench targets without `--bench`: nothing to check there.
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "interop bench: run it with `cargo xtask bench interop` or \
             `cargo bench -p kvx-benches --bench interop`"
        );
        return;
    }
    let started = Instant::now();
    let python = python();
    let reps = env_usize("KVX_INTEROP_REPS", 5).max(1);
    let tokens = env_usize("KVX_INTEROP_TOKENS", 4096);
    let bulk = env_usize("KVX_INTEROP_BULK_MIB", 1024) << 20;
    let bulk_entry = env_usize("KVX_INTEROP_BULK_ENTRY_KIB", 4096) << 10;
    let te_batch = env_usize("KVX_INTEROP_TE_BATCH", 1024).max(1);
    let lat_writes = env_usize("KVX_INTEROP_LAT_WRITES", 2000).max(1);
    let buf_bytes = tokens * TOKEN_BYTES;
    if tokens == 0 || !tokens.is_multiple_of(PAGE) {
        fail("KVX_INTEROP_TOKENS must be a positive multiple of 16");
    }
    if bulk_entry == 0 || bulk_entry > buf_bytes || !buf_bytes.is_multiple_of(bulk_entry) {
        fail(&format!(
            "KVX_INTEROP_BULK_ENTRY_KIB must divide the {} KiB destination buffers",
            buf_bytes >> 10
        ));
    }
    let nbufs = BUFFERS.max(bulk.div_ceil(buf_bytes));
    let total = nbufs * buf_bytes;
    let src_len = (BUFFERS * buf_bytes).max(bulk);
    let cfg = mc_config();

    // The pattern both initiators' sources repeat.
    let pat = pattern();
    let pat_file =
        std::env::temp_dir().join(format!("kvx-interop-pattern-{}.bin", std::process::id()));
    std::fs::write(&pat_file, &pat)
        .unwrap_or_else(|e| fail(&format!("writing {}: {e}", pat_file.display())));
    let mut kvx_src = vec![0u8; src_len];
    for chunk in kvx_src.chunks_mut(PATTERN_LEN) {
        chunk.copy_from_slice(&pat[..chunk.len()]);
    }

    // Peers: one TE target, one TE initiator.
    let mut te_target = Peer::spawn(
        &python,
        "TE target",
        &[
            "target".into(),
            "--count".into(),
            nbufs.to_string(),
            "--bytes".into(),
            buf_bytes.to_string(),
        ],
    );
    let mut te_init = Peer::spawn(
        &python,
        "TE initiator",
        &[
            "initiator".into(),
            "--src-bytes".into(),
            src_len.to_string(),
            "--pattern".into(),
            pat_file.display().to_string(),
        ],
    );
    let ready = te_target.expect("ready");
    let te_session = ready["session"].as_str().unwrap().to_owned();
    let te_bufs: Vec<u64> = ready["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    te_init.expect("ready");
    let _ = std::fs::remove_file(&pat_file);

    // kvx: a target on its own runtime, an initiator on another (two processes' worth).
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    let (rt_target, rt) = (runtime(), runtime());
    let kvx_target = rt_target
        .block_on(MooncakeTransport::bind("127.0.0.1", cfg.clone()))
        .unwrap_or_else(|e| fail(&format!("binding the kvx target: {e}")));
    let mut kvx_dst = vec![0u8; total];
    let kvx_bufs: Vec<u64> = (0..nbufs)
        .map(|i| kvx_dst.as_mut_ptr() as u64 + (i * buf_bytes) as u64)
        .collect();
    for &b in &kvx_bufs {
        // SAFETY: kvx_dst outlives the target (dropped after it at the end of main) and is
        // only read while no write is in flight.
        unsafe { kvx_target.register(b, buf_bytes as u64) }.unwrap();
    }
    let kvx = MooncakeTransport::client(cfg.clone());
    // SAFETY: kvx_src outlives the client and is never written while registered.
    unsafe { kvx.register(kvx_src.as_ptr() as u64, src_len as u64) }.unwrap();
    let kvx_session = rt
        .block_on(kvx.open_session(&te_session))
        .unwrap_or_else(|e| fail(&format!("kvx -> TE target {te_session}: {e}")));
    // A second kvx initiator for the kvx -> kvx latency reference.
    let kvx_loop = MooncakeTransport::client(cfg.clone());
    // SAFETY: as above.
    unsafe { kvx_loop.register(kvx_src.as_ptr() as u64, src_len as u64) }.unwrap();
    let kvx_endpoint = kvx_target.endpoint();
    // The tcp backend's and a plain socket's latency references, into kvx_dst / from kvx_src.
    let tcp_target = rt_target
        .block_on(TcpTransport::bind("127.0.0.1:0", TcpConfig::default()))
        .unwrap_or_else(|e| fail(&format!("binding the kvx tcp target: {e}")));
    // SAFETY: as for the kvx target above.
    unsafe { tcp_target.register(kvx_dst.as_mut_ptr() as u64, total as u64) }.unwrap();
    let tcp_client = TcpTransport::client(TcpConfig::default());
    // SAFETY: as above.
    unsafe { tcp_client.register(kvx_src.as_ptr() as u64, src_len as u64) }.unwrap();
    let tcp_session = rt
        .block_on(tcp_client.open_session(&tcp_target.endpoint()))
        .unwrap_or_else(|e| fail(&format!("kvx tcp -> kvx tcp: {e}")));
    let socket = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (rx, _) = l.accept().unwrap();
        tx.set_nodelay(true).unwrap();
        rx.set_nodelay(true).unwrap();
        std::thread::spawn(move || socket_echo(rx));
        tx
    };

    let room_te = plan_room(&te_bufs, buf_bytes);
    let room_kvx = plan_room(&kvx_bufs, buf_bytes);
    let bulk_te = plan_bulk(&te_bufs, buf_bytes, bulk, bulk_entry);
    let bulk_kvx = plan_bulk(&kvx_bufs, buf_bytes, bulk, bulk_entry);
    let mut cases = Vec::new();
    for (shape, te, kx) in [("room", &room_te, &room_kvx), ("bulk", &bulk_te, &bulk_kvx)] {
        for (path, es) in [
            (Path2::KvxToTe, te),
            (Path2::TeToTe, te),
            (Path2::TeToKvx, kx),
        ] {
            cases.push(Case {
                shape,
                path,
                entries: es.clone(),
                bytes: es.iter().map(|e| e.len).sum(),
                plan: format!("{shape}-{}", path.key()),
                te_batches: 0,
                runs: Vec::new(),
                cpu: Vec::new(),
            });
        }
    }
    for c in cases.iter_mut().filter(|c| c.path != Path2::KvxToTe) {
        let session = if c.path == Path2::TeToTe {
            &te_session
        } else {
            &kvx_endpoint
        };
        let ev = te_init.call(
            &json!({"cmd": "plan", "name": c.plan, "session": session,
                "entries": entries_json(&c.entries), "batch": te_batch}),
            "planned",
        );
        c.te_batches = ev["batches"].as_u64().unwrap() as usize;
    }
    let room = &cases[1];
    println!(
        "interop bench: Mooncake TE 0.3.13.post1 over loopback; room = Llama-3-8B TP1, {BUFFERS} \
         buffers x {} pages x {} KiB, {} entries ({:.0} MiB); bulk = {:.0} MiB in {} entries of \
         {} KiB; {reps} repetitions; TE initiator batches <= {te_batch} entries (room: {} calls; \
         one batch_transfer_sync_write of more than ~2048 entries fails with lane queue-full), \
         kvx posts one batch; kvx {:?}",
        buf_bytes / (PAGE * TOKEN_BYTES),
        (PAGE * TOKEN_BYTES) >> 10,
        room.entries.len(),
        mib(room.bytes),
        mib(bulk as u64),
        bulk / bulk_entry,
        bulk_entry >> 10,
        room.te_batches,
        cfg
    );

    let mut b = Bench {
        rt,
        kvx_session,
        kvx_src,
        te_target,
        te_init,
        kvx_dst,
        te_session,
        te_bufs,
        kvx_endpoint,
        kvx_loop,
        tcp_session,
        socket,
    };
    // `KVX_INTEROP_ONLY=latency|throughput` runs one half (for profiling).
    let only = std::env::var("KVX_INTEROP_ONLY").unwrap_or_default();
    let (do_tp, do_lat) = (only != "latency", only != "throughput");
    // `KVX_INTEROP_CASES=room:te_to_kvx,bulk:kvx_to_te` runs only those throughput cases.
    let picked = std::env::var("KVX_INTEROP_CASES").unwrap_or_default();
    let on = |c: &Case| {
        do_tp
            && (picked.is_empty()
                || picked
                    .split(',')
                    .any(|p| p.trim() == format!("{}:{}", c.shape, c.path.key())))
    };
    // Warm-up: every case once.
    for c in cases.iter().filter(|c| on(c)) {
        b.run(c);
    }
    let te_lanes = kvx_target.inbound_connections();
    // Interleaved repetitions; within each compared pair the order alternates.
    for r in 0..reps {
        for shape in 0..2 {
            let base = shape * 3;
            // kvx -> TE, TE -> TE, TE -> kvx; reversed every other repetition.
            let order: [usize; 3] = if r % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
            for i in order {
                if !on(&cases[base + i]) {
                    continue;
                }
                let (c0, t0) = (b.cpu(), Instant::now());
                let secs = b.run(&cases[base + i]);
                let (c1, wall) = (b.cpu(), t0.elapsed().as_secs_f64());
                let c = &mut cases[base + i];
                c.runs.push(secs);
                c.cpu.push(([0, 1, 2].map(|k| c1[k] - c0[k]), wall));
            }
        }
    }
    for c in cases.iter().filter(|c| on(c)) {
        b.verify(c);
    }
    for c in &cases {
        let cpu = c.cores_median();
        println!(
            "interop/{} {}: {} entries, {:.0} MiB, median {:.2} GB/s, best {:.2} GB/s (runs: {}); \
             cores busy: kvx process {:.2}, TE target {:.2}, TE initiator {:.2}",
            c.shape,
            c.path.label(),
            c.entries.len(),
            mib(c.bytes),
            c.median_gbps(),
            c.best_gbps(),
            c.runs
                .iter()
                .map(|&s| format!("{:.0} ms", s * 1e3))
                .collect::<Vec<_>>()
                .join(", "),
            cpu[0],
            cpu[1],
            cpu[2]
        );
    }

    // Latency: rounds of LAT_ROUND writes per path, paths rotated every round (so that a burst
    // of load on the shared machine hits every path alike); LAT_WARMUP untimed writes first.
    let lat_paths = [
        ("kvx_to_te", "kvx -> TE"),
        ("te_to_te", "TE -> TE"),
        ("te_to_kvx", "TE -> kvx"),
        ("kvx_to_kvx", "kvx -> kvx (reference)"),
        ("tcp_to_kvx", "kvx tcp -> kvx tcp (reference)"),
        ("socket", "plain socket write + ack (reference)"),
    ];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); lat_paths.len()];
    if do_lat {
        for (key, _) in lat_paths {
            b.latency(key, 0, LAT_WARMUP);
        }
        let rounds = lat_writes.div_ceil(LAT_ROUND);
        for r in 0..rounds {
            let n = LAT_ROUND.min(lat_writes - r * LAT_ROUND);
            for k in 0..lat_paths.len() {
                let i = (k + r) % lat_paths.len();
                let v = b.latency(lat_paths[i].0, n, 0);
                samples[i].extend(v);
            }
        }
    }
    let mut lat = Vec::new();
    for ((key, label), mut v) in lat_paths.into_iter().zip(samples).filter(|_| do_lat) {
        v.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&v, 50.0) * 1e6, percentile(&v, 99.0) * 1e6);
        println!(
            "interop/latency 4KiB {label}: p50 {p50:.0} us, p99 {p99:.0} us ({} writes)",
            v.len()
        );
        lat.push((key, label, p50, p99, v.len()));
    }
    let p50_of = |k: &str| lat.iter().find(|l| l.0 == k).map_or(f64::NAN, |l| l.2);
    if do_lat {
        println!(
            "interop/latency tcp/TE p50 ratio: {:.2}",
            p50_of("tcp_to_kvx") / p50_of("te_to_te")
        );
        println!(
            "interop/latency tcp/socket p50 ratio: {:.2}",
            p50_of("tcp_to_kvx") / p50_of("socket")
        );
    }

    // Ratios (paired medians).
    let ratios: Vec<(&str, &str, f64, f64)> = vec![
        (
            "room",
            "kvx initiator / TE initiator (into TE)",
            cases[0].paired(&cases[1]),
            1.5,
        ),
        (
            "bulk",
            "kvx initiator / TE initiator (into TE)",
            cases[3].paired(&cases[4]),
            1.5,
        ),
        (
            "room",
            "kvx target / TE target (from TE)",
            cases[2].paired(&cases[1]),
            1.0,
        ),
        (
            "bulk",
            "kvx target / TE target (from TE)",
            cases[5].paired(&cases[4]),
            1.0,
        ),
    ];
    println!();
    println!(
        "| shape | path | entries | MiB | median GB/s | best GB/s | CPU ms per run: kvx / TE target / TE initiator |"
    );
    println!("|---|---|---:|---:|---:|---:|---|");
    for c in &cases {
        let cpu = c.cpu_median();
        println!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.0} / {:.0} / {:.0} |",
            c.shape,
            c.path.label(),
            c.entries.len(),
            mib(c.bytes),
            c.median_gbps(),
            c.best_gbps(),
            cpu[0] * 1e3,
            cpu[1] * 1e3,
            cpu[2] * 1e3
        );
    }
    println!();
    println!("| shape | ratio | median of paired runs | goal |");
    println!("|---|---|---:|---:|");
    for (shape, what, v, goal) in &ratios {
        println!("| {shape} | {what} | {v:.2} | >= {goal:.1} |");
    }
    println!();
    println!("| 4 KiB write | p50 us | p99 us | writes |");
    println!("|---|---:|---:|---:|");
    for (_, label, p50, p99, n) in &lat {
        println!("| {label} | {p50:.0} | {p99:.0} | {n} |");
    }
    println!();
    println!(
        "TE initiator lanes seen by the kvx target: {te_lanes}; kvx connections per session: {}; \
         wall time {:.0} s",
        b.kvx_session.connections(),
        started.elapsed().as_secs_f64()
    );

    if let Some(path) = std::env::var_os("KVX_INTEROP_JSON") {
        let out = json!({
            "config": {
                "reps": reps, "tokens": tokens, "buffers": BUFFERS,
                "item_len": PAGE * TOKEN_BYTES, "bulk_bytes": bulk, "bulk_entry": bulk_entry,
                "te_batch": te_batch, "lat_writes": lat_writes,
                "kvx": format!("{cfg:?}"), "te_lanes_seen": te_lanes,
                "kvx_connections": b.kvx_session.connections(),
            },
            "throughput": cases.iter().map(|c| json!({
                "shape": c.shape, "path": c.path.label(), "entries": c.entries.len(),
                "bytes": c.bytes, "te_batches": c.te_batches, "runs_s": c.runs,
                "median_gbps": c.median_gbps(), "best_gbps": c.best_gbps(),
                "cpu_s": c.cpu_median(), "cores": c.cores_median(),
            })).collect::<Vec<_>>(),
            "ratios": ratios.iter().map(|(shape, what, v, goal)| json!({
                "shape": shape, "what": what, "value": v, "goal": goal,
            })).collect::<Vec<_>>(),
            "latency": lat.iter().map(|(key, label, p50, p99, n)| json!({
                "key": key, "path": label, "p50_us": p50, "p99_us": p99, "writes": n,
            })).collect::<Vec<_>>(),
            "wall_s": started.elapsed().as_secs_f64(),
        });
        if let Err(e) = std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap()) {
            fail(&format!("writing {}: {e}", Path::new(&path).display()));
        }
    }

    let Bench {
        rt,
        kvx_session,
        te_target,
        te_init,
        kvx_dst,
        kvx_src,
        kvx_loop,
        tcp_session,
        socket,
        ..
    } = b;
    drop((tcp_session, socket, tcp_client));
    rt_target.block_on(tcp_target.shutdown());
    drop(tcp_target);
    te_init.quit();
    te_target.quit();
    drop(kvx_session);
    drop((kvx, kvx_loop));
    rt_target.block_on(kvx_target.shutdown());
    drop(kvx_target);
    drop((rt, rt_target, kvx_dst, kvx_src));
    println!();
    println!("interop/mooncake ratio: {:.2}", ratios[0].2);
}
