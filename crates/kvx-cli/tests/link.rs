//! The link test as an operator runs it, real processes: `kvx recv` and `kvx send` over tcp
//! with a block-size sweep, a duration, interval lines and `--json` on both sides; the
//! receiver's own count of what landed equals what the sender had acknowledged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{KVX, Proc, free_port, json_lines, wait_until};

const GUARD: Duration = Duration::from_secs(90);

#[test]
fn sweep_with_duration_and_json_matches_the_receivers_own_count() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut recv = Proc::spawn(
        Command::new(KVX)
            .args(["recv", "--listen", &addr, "--interval", "0.2", "--json"])
            .env("RUST_LOG", "warn"),
    );
    wait_until(Duration::from_secs(30), "recv listening", || {
        recv.stderr_now().contains("listening on")
    });
    let out = Proc::spawn(Command::new(KVX).args([
        "send",
        "--to",
        &addr,
        "--sizes",
        "4K,64K",
        "--batch",
        "4",
        "--duration",
        "0.6",
        "--interval",
        "0.2",
        "--json",
    ]))
    .wait_output(GUARD);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON document");
    let runs = doc["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{doc}");
    let mut sent = 0;
    for (run, size) in runs.iter().zip([4096u64, 65536]) {
        assert_eq!(run["size"], size, "{run}");
        let bytes = run["bytes"].as_u64().unwrap();
        assert!(bytes >= size * 4, "{run}");
        assert_eq!(bytes % (size * 4), 0, "whole batches only: {run}");
        assert!(run["seconds"].as_f64().unwrap() >= 0.6, "{run}");
        assert!(run["latency_us"]["p50"].as_f64().unwrap() > 0.0, "{run}");
        assert!(
            run["latency_us"]["p99"].as_f64().unwrap()
                >= run["latency_us"]["p50"].as_f64().unwrap(),
            "{run}"
        );
        let intervals = run["intervals"].as_array().unwrap();
        assert!(intervals.len() >= 2, "{run}");
        let in_intervals: u64 = intervals.iter().map(|i| i["bytes"].as_u64().unwrap()).sum();
        assert_eq!(in_intervals, bytes, "intervals add up to the run: {run}");
        sent += bytes;
    }
    // The receiver counts what landed in its region; every byte the sender had acknowledged.
    wait_until(Duration::from_secs(10), "receiver interval lines", || {
        !json_lines(&recv.stdout_now()).is_empty()
    });
    recv.interrupt();
    let out = recv.wait_output(GUARD);
    assert_eq!(out.status.code(), Some(0));
    let lines = json_lines(&String::from_utf8_lossy(&out.stdout));
    let total = lines.last().expect("a total line");
    assert_eq!(total["total_bytes"].as_u64(), Some(sent), "{lines:?}");
    let in_intervals: u64 = lines
        .iter()
        .filter_map(|l| l.get("bytes").and_then(serde_json::Value::as_u64))
        .sum();
    assert_eq!(in_intervals, sent, "{lines:?}");
}
