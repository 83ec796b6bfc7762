//! Staging over real processes (Llama-3-8B shapes, 64-token grid, rings small enough to wrap):
//! prefill TP 2 → decode TP 1 and TP 1 → TP 2 with every byte verified and every chunk counted
//! through the ring; oversized chunks fail their rooms and nothing else; a decode killed while
//! its chunks are staged leaves nothing behind on the prefill.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const GUARD: Duration = Duration::from_secs(90);
const LLAMA: &[&str] = &["--model", "llama3-8b", "--pool-pages", "96"];
const GRID: &[&str] = &["--staging", "--chunked-prefill-size", "64"];

/// The `tp` ranks of a prefill instance; rank 0 serves the bootstrap server (and /metrics) on
/// `port`. Returns once every rank registered (the server answers route queries only then).
fn prefill(port: u16, tp: u32, extra: &[&str]) -> Vec<Proc> {
    prefill_env(port, tp, extra, &[])
}

/// [`prefill`] with `env` set on every rank (failpoints).
fn prefill_env(port: u16, tp: u32, extra: &[&str], env: &[(&str, &str)]) -> Vec<Proc> {
    let procs = (0..tp)
        .map(|rank| {
            let (tp, r) = (tp.to_string(), rank.to_string());
            let mut cmd = Command::new(KVX);
            cmd.arg("prefill");
            if rank == 0 {
                cmd.arg("--serve-bootstrap");
            }
            Proc::spawn(
                cmd.arg("--bootstrap-port")
                    .arg(port.to_string())
                    .args(MODEL)
                    .args(LLAMA)
                    .args(GRID)
                    .args(["--tp-size", &tp, "--tp-rank", &r, "--chunk-pages", "3"])
                    .args(extra)
                    .envs(env.iter().copied())
                    .env("RUST_LOG", "warn"),
            )
        })
        .collect();
    wait_until(Duration::from_secs(30), "prefill ranks registered", || {
        http_get(
            port,
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        )
        .is_some_and(|(s, _)| s == 200)
    });
    procs
}

/// Decode rank `rank` of TP `tp` with a ring of `ring` MiB; every rank draws the same rooms.
fn decode(port: u16, summary: &Path, tp: u32, rank: u32, ring: u32, extra: &[&str]) -> Proc {
    let (tp, r, ring) = (tp.to_string(), rank.to_string(), ring.to_string());
    let mut args = LLAMA.to_vec();
    args.extend(GRID);
    args.extend([
        "--tp-size",
        &tp,
        "--tp-rank",
        &r,
        "--staging-ring-mib",
        &ring,
    ]);
    args.extend(["--seed", "11", "--room-base", "5000"]);
    args.extend(extra);
    start_decode(port, summary, &args)
}

const LOAD: &[&str] = &[
    "--requests",
    "10",
    "--prompt-tokens",
    "200",
    "--prompt-tokens-max",
    "500",
    "--concurrency",
    "4",
];

fn metrics(port: u16) -> String {
    http_get(port, "/metrics").map(|x| x.1).unwrap_or_default()
}

/// Waits until the prefill on `port` holds no room entry and no staging state.
fn wait_drained(port: u16) {
    wait_until(GUARD, "prefill drained", || {
        let m = metrics(port);
        metric_sum(&m, "kvx_room_entries") == 0.0 && metric_sum(&m, "kvx_staging_rooms") == 0.0
    });
}

fn assert_verified(out: &std::process::Output, summary: &Path, n: u64) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = common::summary(summary);
    assert_eq!(s["verified"], n, "{s}");
    assert_eq!(s["failed"], 0, "{s}");
    // Rooms of 200..500 tokens are 13..32 pages: at least 4 chunks of 4 pages each.
    assert!(s["staged_chunks"].as_u64().unwrap() >= 4 * n, "{s}");
    s
}

#[test]
fn tp2_to_tp1_through_the_ring() {
    let port = free_port();
    let _p = prefill(port, 2, &[]);
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("d.json");
    // 8 MiB chunks at decode TP 1, a 12 MiB ring: writers wait for watermarks.
    let out = decode(port, &s, 1, 0, 12, LOAD).wait_output(GUARD);
    let sum = assert_verified(&out, &s, 10);
    // Over tcp every block is received straight into the pages, also those whose region
    // overlapped an older live one (placed once that one was freed).
    let aux: u64 = kvx_engine::model::SGLANG_AUX_ROW_LENS.iter().sum();
    let kv = sum["bytes"].as_u64().unwrap() - 10 * aux;
    assert_eq!(sum["staged_bytes_in_place"], kv, "{sum}");
    wait_drained(port);
    let m = metrics(port);
    assert!(
        metric_sum(&m, "kvx_staged_chunks_posted_total") >= 40.0,
        "{m}"
    );
    assert!(metric_sum(&m, "kvx_staging_requests_total") >= 40.0, "{m}");
    assert_eq!(
        metric_sum(&m, "kvx_staging_room_failures_total"),
        0.0,
        "{m}"
    );
}

#[test]
fn tp1_to_tp2_through_the_ring() {
    let port = free_port();
    let _p = prefill(port, 1, &[]);
    let dir = tempfile::tempdir().unwrap();
    let (s0, s1) = (dir.path().join("d0.json"), dir.path().join("d1.json"));
    let d0 = decode(port, &s0, 2, 0, 6, LOAD);
    let d1 = decode(port, &s1, 2, 1, 6, LOAD);
    let (o0, o1) = (d0.wait_output(GUARD), d1.wait_output(GUARD));
    assert_verified(&o0, &s0, 10);
    assert_verified(&o1, &s1, 10);
    wait_drained(port);
    // Part of each token's heads to each decode rank: written token by token from the pages
    // through tcp, never copied together first.
    let m = metrics(port);
    assert!(
        metric_sum(&m, "kvx_staged_chunks_posted_total") > 0.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "kvx_staged_cpu_gathers_total"), 0.0, "{m}");
}

#[test]
fn oversized_chunks_fail_their_rooms_and_the_prefill_serves_on() {
    let port = free_port();
    let _p = prefill(port, 2, &[]);
    let dir = tempfile::tempdir().unwrap();
    let (sa, sb) = (dir.path().join("a.json"), dir.path().join("b.json"));
    // A 1 MiB ring cannot hold one 8 MiB chunk: every room fails, cleanly.
    let out = decode(port, &sa, 1, 0, 1, &["--requests", "3"]).wait_output(GUARD);
    assert!(!out.status.success());
    let s = summary(&sa);
    assert_eq!(s["failed"], 3, "{s}");
    wait_drained(port);
    let m = metrics(port);
    // Each room failed on this rank by its own staging check or, when the other rank's status 0
    // reached the decode first, by the decode's ABORT of every rank.
    assert!(metric_sum(&m, "kvx_room_failures_total") >= 3.0, "{m}");
    assert!(
        metric_sum(&m, "kvx_staging_room_failures_total") + metric_sum(&m, "kvx_aborts_total")
            >= 3.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "kvx_live_workers"), 4.0, "{m}");
    // New rooms (as a router hands out), whatever rank 1 still holds of the failed ones.
    let mut load = LOAD.to_vec();
    load.extend(["--room-base", "9000"]);
    let out = decode(port, &sb, 1, 0, 12, &load).wait_output(GUARD);
    assert_verified(&out, &sb, 10);
}

/// The fault must strike rooms in flight: every job holds its transfer worker 150 ms before it
/// writes (failpoint), so a room seen staging on rank 0 is still there when the decode dies a
/// few milliseconds later. Without it the decode (its pool takes three of these rooms at a
/// time) was now and then killed between rooms, with nothing in flight to fail.
#[cfg(feature = "failpoints")]
#[test]
fn killed_decode_mid_staging_leaves_nothing_behind() {
    let port = free_port();
    // A wait timeout far beyond the guard: the staged rooms must fail because their decode is
    // gone (a failed write, or the probe of its inbox when nothing was in flight), not by it.
    let _p = prefill_env(
        port,
        2,
        &["--staging-wait-timeout", "600"],
        &[("FAILPOINTS", "kvx::transfer_worker::batch=sleep(150)")],
    );
    let dir = tempfile::tempdir().unwrap();
    let (sa, sb) = (dir.path().join("a.json"), dir.path().join("b.json"));
    let mut victim = decode(port, &sa, 1, 0, 12, ENDLESS_LOAD);
    wait_until(Duration::from_secs(60), "staged chunks flowing", || {
        let m = metrics(port);
        metric_sum(&m, "kvx_staged_chunks_posted_total") >= 10.0
            && metric_sum(&m, "kvx_staging_rooms") >= 1.0
    });
    victim.child().kill().unwrap();
    victim.child().wait().unwrap();
    // Every room waiting on the victim fails with its session, in flight or parked.
    wait_drained(port);
    let m = metrics(port);
    assert!(metric_sum(&m, "kvx_room_failures_total") >= 1.0, "{m}");
    assert_eq!(
        metric_sum(&m, "kvx_staging_wait_timeouts_total"),
        0.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "kvx_live_workers"), 4.0, "{m}");
    assert_eq!(metric_sum(&m, "kvx_worker_failures_total"), 0.0, "{m}");
    // New rooms: rank 1 (no metrics here) may still be failing the victim's.
    let mut load = LOAD.to_vec();
    load.extend(["--room-base", "9000000"]);
    let out = decode(port, &sb, 1, 0, 12, &load).wait_output(GUARD);
    assert_verified(&out, &sb, 10);
}

#[test]
fn mismatched_grids_fail_rooms_with_the_reason() {
    let port = free_port();
    // Long timeouts on both sides: only the grid check can end these rooms.
    let _p = prefill(port, 2, &["--staging-wait-timeout", "600"]);
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("d.json");
    let extra = [
        "--requests",
        "3",
        "--chunked-prefill-size",
        "128",
        "--waiting-timeout",
        "600",
    ];
    let out = decode(port, &s, 1, 0, 12, &extra).wait_output(GUARD);
    assert!(!out.status.success());
    let s = summary(&s);
    assert_eq!(s["failed"], 3, "{s}");
    let reasons = s["failure_reasons"].as_object().unwrap();
    assert!(
        reasons.keys().all(|r| r.contains("chunk grid differs")),
        "{s}"
    );
    // The prefill failed them on the decode's ABORT and holds nothing.
    wait_drained(port);
    let m = metrics(port);
    assert!(metric_sum(&m, "kvx_aborts_total") >= 3.0, "{m}");
}
