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
use kvx_cli::model::ModelPreset;
use kvx_cli::prefill_cmd::rank_registration;

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

    /// What the process wrote to stderr so far.
    pub fn stderr_now(&self) -> String {
        String::from_utf8_lossy(&self.err.lock().unwrap()).into_owned()
    }

    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().unwrap()
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
