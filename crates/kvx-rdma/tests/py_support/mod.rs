//! Spawning the real Mooncake Transfer Engine peer (`tests/py/mooncake_peer.py`) and reading its
//! JSON events; and the CRC-32 the peer reports (zlib's).
//!
//! The interpreter is `$KVX_PYTHON`, else `<workspace>/.venv/bin/python3`; it must import
//! `mooncake.engine` (PyPI `mooncake-transfer-engine-non-cuda==0.3.13.post1`). If none works the
//! test fails (never skips) and says how to get one.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python interpreter for the peer, checked to import the Mooncake engine.
pub fn python() -> PathBuf {
    let candidate = match std::env::var_os("KVX_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join(".venv/bin/python3"),
    };
    let ok = Command::new(&candidate)
        .args(["-c", "from mooncake.engine import TransferEngine"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "no Python with the Mooncake engine found (tried {candidate:?}); run `cargo xtask setup` \
         or `<workspace>/.venv/bin/pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` \
         (needs libibverbs1), or set KVX_PYTHON"
    );
    candidate
}

/// A running peer.
pub struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Peer {
    /// Starts `mooncake_peer.py <mode> [args...]` with extra environment variables.
    pub fn spawn(mode: &str, args: &[&str], env: &[(&str, &str)]) -> Peer {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/mooncake_peer.py");
        let mut cmd = Command::new(python());
        cmd.arg(script)
            .arg(mode)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn python");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        Peer {
            child,
            stdin,
            lines,
            stderr: Some(stderr),
        }
    }

    /// The next event of type `name`; fails the test (with the peer's stderr) after 60 s.
    pub fn expect(&mut self, name: &str) -> Value {
        match self.lines.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => {
                let ev: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("peer printed non-JSON {line:?}: {e}"));
                if ev["event"] != name {
                    let err = self.kill_and_stderr();
                    panic!("expected event {name}, got {ev}; stderr:\n{err}");
                }
                ev
            }
            Err(_) => {
                let err = self.kill_and_stderr();
                panic!("python peer gave no {name} event; stderr:\n{err}");
            }
        }
    }

    fn kill_and_stderr(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }

    /// Sends one command (a JSON line).
    pub fn send(&mut self, cmd: &Value) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{cmd}").expect("write to python");
        stdin.flush().expect("flush");
    }

    /// Sends a command and returns the reply event of type `name`.
    pub fn call(&mut self, cmd: Value, name: &str) -> Value {
        self.send(&cmd);
        self.expect(name)
    }

    /// Asks the peer to quit and asserts it exits successfully.
    pub fn finish(mut self) {
        self.send(&serde_json::json!({"cmd": "quit"}));
        drop(self.stdin.take());
        let status = self.child.wait().expect("wait python");
        let err = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        assert!(status.success(), "python peer failed ({status}):\n{err}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// CRC-32 (IEEE, reflected, as zlib's `crc32`).
pub fn crc32(data: &[u8]) -> u32 {
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

#[test]
fn crc32_matches_zlib() {
    assert_eq!(crc32(b""), 0);
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
}
