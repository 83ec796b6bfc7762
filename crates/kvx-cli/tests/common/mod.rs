//! Helpers for the end-to-end tests: spawn the built `kvx` binary, talk plain HTTP to it.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};
use kvx_cli::config::ModelArgs;
use kvx_cli::prefill_cmd::rank_registration;
use kvx_engine::model::ModelPreset;

pub const KVX: &str = env!("CARGO_BIN_EXE_kvx");

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` on 127.0.0.1:port; `(status, body)`.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map(|x| x.1.to_owned())?;
    Some((status, body))
}

/// Sum of every sample of `metric` (all label sets) in a Prometheus text.
pub fn metric_sum(text: &str, metric: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `f` every 50 ms until it is true; panics after `guard` (a hang guard, not a timing check).
pub fn wait_until(guard: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < guard, "hang guard: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process killed on drop, its stdout and stderr drained into memory.
pub struct Proc {
    child: Option<Child>,
    out: Arc<Mutex<Vec<u8>>>,
    err: Arc<Mutex<Vec<u8>>>,
}

fn drain(r: Option<impl Read + Send + 'static>) -> Arc<Mutex<Vec<u8>>> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    if let Some(mut r) = r {
        let b = buf.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = r.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                b.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
    }
    buf
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = drain(child.stdout.take());
        let err = drain(child.stderr.take());
        Proc {
            child: Some(child),
            out,
            err,
        }
    }

    /// What the process wrote to stdout so far.
    pub fn stdout_now(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    /// What the process wrote to stderr so far.
    pub fn stderr_now(&self) -> String {
        String::from_utf8_lossy(&self.err.lock().unwrap()).into_owned()
    }

    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().unwrap()
    }

    /// Sends SIGINT (what Ctrl-C sends) to the process.
    pub fn interrupt(&mut self) {
        let pid = self.child().id().to_string();
        let ok = Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -INT {pid} failed");
    }

    /// Waits for exit under a hang guard and returns its output.
    pub fn wait_output(mut self, guard: Duration) -> Output {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child().try_wait().unwrap() {
                self.child = None;
                // let the drain threads see EOF
                std::thread::sleep(Duration::from_millis(100));
                return Output {
                    status,
                    stdout: self.out.lock().unwrap().clone(),
                    stderr: self.err.lock().unwrap().clone(),
                };
            }
            assert!(t0.elapsed() < guard, "hang guard: process did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub const MODEL: &[&str] = &[
    "--model",
    "tiny",
    "--page-size",
    "16",
    "--pool-pages",
    "256",
];

/// A bootstrap server on a free loopback port (in `rt`), and its port.
pub fn bootstrap_server(rt: &tokio::runtime::Runtime) -> (BootstrapServer, u16) {
    let server = rt
        .block_on(BootstrapServer::bind(
            ("127.0.0.1", 0),
            ServerConfig::default(),
        ))
        .unwrap();
    let port = server.local_addr().port();
    (server, port)
}

/// Registers rank 0 of a TP1 `tiny` instance (page size 16, `pool_pages` pages) whose inbox is
/// on `inbox_port` with the bootstrap server on `port`.
pub fn register_tiny_rank(
    rt: &tokio::runtime::Runtime,
    port: u16,
    pool_pages: u64,
    inbox_port: u16,
) {
    let args = ModelArgs {
        model: ModelPreset::Tiny,
        tp_size: 1,
        tp_rank: 0,
        page_size: 16,
        pool_pages,
        kv_cache_dtype: "auto".into(),
    };
    let client = BootstrapClient::new("127.0.0.1", port).unwrap();
    rt.block_on(client.register_rank(
        &rank_registration(&args, "127.0.0.1", inbox_port),
        &RetryPolicy::immediate(3, Duration::from_secs(5)),
    ))
    .unwrap();
}

/// Decode load that runs until it is killed: 500-token rooms, 8 in flight.
pub const ENDLESS_LOAD: &[&str] = &[
    "--requests",
    "1000000",
    "--prompt-tokens",
    "500",
    "--concurrency",
    "8",
];

/// Starts `kvx prefill --serve-bootstrap` on `port` and waits until its rank is registered.
pub fn start_prefill(port: u16, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut cmd = Command::new(KVX);
    cmd.args(["prefill", "--serve-bootstrap", "--bootstrap-port"])
        .arg(port.to_string())
        .args(MODEL)
        .args(["--chunk-pages", "4"])
        .args(extra)
        .env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let p = Proc::spawn(&mut cmd);
    wait_until(Duration::from_secs(30), "prefill registered", || {
        http_get(
            port,
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        )
        .is_some_and(|(s, _)| s == 200)
    });
    p
}

/// Starts `kvx decode` against the bootstrap server on `port`.
pub fn start_decode(port: u16, summary: &Path, extra: &[&str]) -> Proc {
    Proc::spawn(
        Command::new(KVX)
            .args(["decode", "--no-progress", "--bootstrap-addr"])
            .arg(format!("127.0.0.1:{port}"))
            .args(MODEL)
            .arg("--summary-json")
            .arg(summary)
            .args(extra)
            .env("RUST_LOG", "warn"),
    )
}

/// The decode's `--summary-json`.
pub fn summary(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The prefill rank's inbox endpoint from `GET /route`.
pub fn inbox(port: u16) -> String {
    let (_, body) = http_get(
        port,
        "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    format!(
        "tcp://{}:{}",
        v["rank_ip"].as_str().unwrap(),
        v["rank_port"].as_u64().unwrap()
    )
}

/// Runs a decode of six 300-token rooms against the prefill on `port`, asserts every byte
/// verified, and returns the prefill's metrics afterwards.
pub fn six_rooms_verified(port: u16) -> String {
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("six.json");
    let out = start_decode(port, &s, &["--requests", "6", "--prompt-tokens", "300"])
        .wait_output(Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(summary(&s)["verified"], 6);
    http_get(port, "/metrics").unwrap().1
}

// ---- the live sglang 0.5.23 harness (tests/py/sglang_live.py) --------------------------------

/// The Python that runs sglang 0.5.23's own disaggregation classes: `$KVX_PYTHON`, else
/// `<workspace>/.venv/bin/python3`. It must import `sglang.srt.disaggregation.mooncake.conn`
/// (with `tests/py/stubs` for the GPU stack) and Mooncake TE; if it cannot, the test fails (it
/// never skips) and says how to get one.
pub fn sglang_python() -> std::path::PathBuf {
    static CHECKED: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    CHECKED.get_or_init(check_sglang_python).clone()
}

fn check_sglang_python() -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let py = std::env::var_os("KVX_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join(".venv/bin/python3"));
    let stubs = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/stubs");
    let check = Command::new(&py)
        .args([
            "-W",
            "ignore",
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import kvx_stubs; kvx_stubs.install(); \
             import zmq, requests, numpy, mooncake.engine, sglang; \
             import sglang.srt.disaggregation.mooncake.conn; \
             assert sglang.__version__ == '0.5.23', sglang.__version__",
        ])
        .arg(&stubs)
        .output();
    match check {
        Ok(o) if o.status.success() => py,
        Ok(o) => panic!(
            "{} cannot run sglang 0.5.23's Mooncake connector: {}\n\
             run `cargo xtask setup` (installs libibverbs1 and the venv: Mooncake TE \
             0.3.13.post1, sglang==0.5.23 --no-deps and its import chain), or set KVX_PYTHON",
            py.display(),
            tail(&String::from_utf8_lossy(&o.stderr), 3).replace('\n', " | ")
        ),
        Err(e) => panic!(
            "no Python at {} ({e}); run `cargo xtask setup` or set KVX_PYTHON",
            py.display()
        ),
    }
}

/// Starts `tests/py/sglang_live.py <mode> <args>` (sglang's own classes; one JSON line per
/// event on stdout, logs on stderr).
pub fn sglang_live(mode: &str, args: &[String]) -> Proc {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/sglang_live.py");
    Proc::spawn(
        Command::new(sglang_python())
            .arg(script)
            .arg(mode)
            .args(args)
            .env("PYTHONUNBUFFERED", "1")
            .env("SGLANG_LIVE_LOG", "INFO")
            .env_remove("SGLANG_HOST_IP")
            .env_remove("MC_FORCE_TCP"),
    )
}

/// The JSON objects among `text`'s lines.
pub fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(serde_json::Value::is_object)
        .collect()
}

/// The harness's final summary (the last JSON line with a `pass` key), or `Null`.
pub fn harness_summary(out: &Output) -> serde_json::Value {
    json_lines(&String::from_utf8_lossy(&out.stdout))
        .into_iter()
        .rev()
        .find(|v| v.get("pass").is_some())
        .unwrap_or(serde_json::Value::Null)
}

/// Waits until a harness process printed its `{"ready": true}` line.
pub fn wait_harness_ready(p: &Proc, guard: Duration, what: &str) {
    let t0 = Instant::now();
    loop {
        if json_lines(&p.stdout_now())
            .iter()
            .any(|v| v["ready"] == serde_json::Value::Bool(true))
        {
            return;
        }
        assert!(
            t0.elapsed() < guard,
            "hang guard: {what} never became ready; stderr:\n{}",
            tail(&p.stderr_now(), 40)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the bootstrap server on `port` answers the sentinel route with 200 (a prefill
/// rank registered).
pub fn wait_sentinel(port: u16, guard: Duration) {
    wait_until(
        guard,
        "a prefill rank registered with the bootstrap server",
        || {
            http_get(
                port,
                "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
            )
            .is_some_and(|(s, _)| s == 200)
        },
    );
}

/// The last `n` lines of `text`, without the Mooncake engine's glog noise.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            !(l.starts_with('I')
                && l.get(1..5)
                    .is_some_and(|d| d.bytes().all(|b| b.is_ascii_digit())))
        })
        .collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
