//! Faults injected through failpoints: a fatal worker fault (sglang's message, made true, every
//! open room reported Failed to the decode, and the documented exit code — or a restarted
//! worker), and an `AUX_DATA` row whose send fails (its room is reported Failed, never Success
//! over a stale row).
#![cfg(feature = "failpoints")]

mod common;

use std::time::Duration;

use common::*;

const GUARD: Duration = Duration::from_secs(60);

#[test]
fn fatal_fault_fails_every_open_room_and_exits_70() {
    let port = free_port();
    let prefill = start_prefill(
        port,
        &[],
        &[(
            "FAILPOINTS",
            // The first batch waits a second (every room's metadata arrives meanwhile) and
            // goes through; the second one is a fatal fault.
            "kvx::transfer_worker::batch=1*sleep(1000)->return(boom)",
        )],
    );
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let decode = start_decode(
        port,
        &s,
        &[
            "--requests",
            "4",
            "--concurrency",
            "4",
            "--prompt-tokens",
            "300",
            "--heartbeat-interval",
            "2",
            "--heartbeat-max-failure",
            "1",
            "--waiting-timeout",
            "20",
        ],
    );
    let out = prefill.wait_output(GUARD);
    assert_eq!(out.status.code(), Some(70));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = format!(
        "Transfer thread failed because of injected fault at kvx::transfer_worker::batch: boom. \
         Prefill instance with bootstrap_port={port} is dead."
    );
    assert!(stderr.lines().any(|l| l == want), "{stderr}");
    let dout = decode.wait_output(GUARD);
    assert_eq!(dout.status.code(), Some(1));
    let sum = summary(&s);
    assert_eq!(sum["failed"], 4, "{sum}");
    assert_eq!(sum["verified"], 0);
    // Every room was open when the worker died, and each got a status 0 from the prefill —
    // with the dead thread's message as its reason frame, which a kvx decode (20-frame
    // registration, like sglang 0.5.23's) is sent.
    let reasons = sum["failure_reasons"].as_object().unwrap();
    assert_eq!(
        reasons.get(&want).and_then(|v| v.as_u64()),
        Some(4),
        "{sum}"
    );
}

#[test]
fn restarted_worker_keeps_serving() {
    let port = free_port();
    let _prefill = start_prefill(
        port,
        &["--restart-workers", "--queues", "1"],
        &[("FAILPOINTS", "kvx::transfer_worker::batch=1*return(once)")],
    );
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let out = start_decode(
        port,
        &s,
        &[
            "--requests",
            "8",
            "--concurrency",
            "1",
            "--prompt-tokens",
            "200",
        ],
    )
    .wait_output(GUARD);
    assert_eq!(out.status.code(), Some(1));
    let sum = summary(&s);
    assert_eq!(sum["failed"], 1, "{sum}");
    assert_eq!(sum["verified"], 7);
    let (_, m) = http_get(port, "/metrics").unwrap();
    assert_eq!(metric_sum(&m, "kvx_worker_failures_total"), 1.0, "{m}");
    assert!(
        m.contains("kvx_worker_failures_total{cause=\"injected\"} 1"),
        "{m}"
    );
    assert_eq!(metric_sum(&m, "kvx_worker_restarts_total"), 1.0);
    assert_eq!(metric_sum(&m, "kvx_live_workers"), 1.0);
}

#[test]
fn a_lost_aux_row_fails_its_room_instead_of_succeeding() {
    let port = free_port();
    let _prefill = start_prefill(
        port,
        &["--aux-over-tcp"],
        &[("FAILPOINTS", "kvx::notifier::aux_data=1*return")],
    );
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let out = start_decode(
        port,
        &s,
        &[
            "--requests",
            "4",
            "--concurrency",
            "1",
            "--prompt-tokens",
            "200",
        ],
    )
    .wait_output(GUARD);
    assert_eq!(out.status.code(), Some(1));
    let sum = summary(&s);
    // The first room's row never left: Failed (not a Success over a stale row); the others
    // verify byte for byte, rows included.
    assert_eq!(sum["failed"], 1, "{sum}");
    assert_eq!(sum["verified"], 3, "{sum}");
    assert_eq!(sum["corrupt"], 0, "{sum}");
    let (_, m) = http_get(port, "/metrics").unwrap();
    assert_eq!(metric_sum(&m, "kvx_aux_rows_lost_total"), 1.0, "{m}");
    // sglang's 10 aux buffers, a row each, per room.
    assert_eq!(metric_sum(&m, "kvx_aux_messages_total"), 40.0, "{m}");
}
