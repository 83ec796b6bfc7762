//! Spawning the Python sglang stand-in (`tests/py/sglang_peer.py`) and reading its JSON events.
//!
//! The interpreter is `$KVX_PYTHON`, else `<workspace>/.venv/bin/python3`; it must import
//! `zmq` and `requests`. If none works the test fails (never skips) and says to run
//! `cargo xtask setup`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python interpreter for the interop peer, checked to import pyzmq and requests.
pub fn python() -> PathBuf {
    let candidates: Vec<PathBuf> = match std::env::var_os("KVX_PYTHON") {
        Some(p) => vec![PathBuf::from(p)],
        None => vec![workspace_root().join(".venv/bin/python3")],
    };
    for c in &candidates {
        let ok = Command::new(c)
            .args(["-c", "import zmq, requests"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return c.clone();
        }
    }
    panic!(
        "no Python with pyzmq and requests found (tried {candidates:?}); \
         run `cargo xtask setup` to create <workspace>/.venv, or set KVX_PYTHON"
    );
}

/// A running peer.
pub struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Peer {
    /// Starts `sglang_peer.py <mode> --bootstrap <addr> [extra...]`.
    pub fn spawn(mode: &str, bootstrap: &str, extra: &[&str]) -> Peer {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/sglang_peer.py");
        let mut child = Command::new(python())
            .arg(script)
            .args([mode, "--bootstrap", bootstrap])
            .args(extra)
            .env("NO_PROXY", "*")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn python");
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
            lines,
            stderr: Some(stderr),
        }
    }

    /// The next event; fails the test (with the peer's stderr) if none comes within 30 s.
    pub fn event(&mut self) -> Value {
        match self.lines.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("peer printed non-JSON {line:?}: {e}")),
            Err(_) => {
                let _ = self.child.kill();
                let status = self.child.wait().ok();
                let err = self.take_stderr();
                panic!("python peer gave no event (exit {status:?}); stderr:\n{err}");
            }
        }
    }

    fn take_stderr(&mut self) -> String {
        self.stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }

    /// The next event, which must be of type `name`.
    pub fn expect(&mut self, name: &str) -> Value {
        let ev = self.event();
        assert_eq!(ev["event"], name, "unexpected event {ev}");
        ev
    }

    /// Waits for the peer to exit and asserts success.
    pub fn finish(mut self) {
        let status = self.child.wait().expect("wait python");
        let err = self.take_stderr();
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

/// Frames as the peer prints them (lower-case hex).
pub fn hex_frames(frames: &[Vec<u8>]) -> Vec<String> {
    frames
        .iter()
        .map(|f| f.iter().map(|b| format!("{b:02x}")).collect())
        .collect()
}

/// The `frames` array of an event, as strings.
pub fn event_frames(ev: &Value) -> Vec<String> {
    ev["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .map(|v| v.as_str().expect("hex").to_string())
        .collect()
}
