//! End to end over real processes: a prefill rank serving two decodes, a decode killed
//! mid-transfer, metadata from an unknown session, and a flood of malformed frames.

mod common;

use kvx_bootstrap::sockets::zmq;
use std::time::Duration;

use common::*;

const GUARD: Duration = Duration::from_secs(60);

#[test]
fn two_decodes_every_byte_verified() {
    let port = free_port();
    let prefill = start_prefill(port, &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let (sa, sb) = (dir.path().join("a.json"), dir.path().join("b.json"));
    let args = [
        "--requests",
        "12",
        "--prompt-tokens",
        "100",
        "--prompt-tokens-max",
        "700",
        "--concurrency",
        "4",
    ];
    let a = start_decode(port, &sa, &args);
    let b = start_decode(port, &sb, &args);
    let (oa, ob) = (a.wait_output(GUARD), b.wait_output(GUARD));
    assert!(
        oa.status.success(),
        "{}",
        String::from_utf8_lossy(&oa.stderr)
    );
    assert!(
        ob.status.success(),
        "{}",
        String::from_utf8_lossy(&ob.stderr)
    );
    for s in [summary(&sa), summary(&sb)] {
        assert_eq!(s["verified"], 12, "{s}");
        assert_eq!(s["failed"], 0);
        assert!(s["bytes"].as_u64().unwrap() > 0);
        // One latency per room, and the percentiles are taken from them.
        let lat: Vec<f64> = s["latencies_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(lat.len(), 12, "{s}");
        assert!(lat.iter().all(|&l| l >= 0.0));
        let max = lat.iter().copied().fold(0.0, f64::max);
        assert_eq!(s["p99_ms"].as_f64().unwrap(), max);
    }
    let stdout = String::from_utf8_lossy(&oa.stdout);
    assert!(
        stdout
            .lines()
            .last()
            .unwrap()
            .starts_with("verified: 12/12 rooms"),
        "{stdout}"
    );
    let (_, m) = http_get(port, "/metrics").unwrap();
    assert_eq!(metric_sum(&m, "kvx_registrations_total"), 2.0, "{m}");
    assert_eq!(metric_sum(&m, "kvx_live_workers"), 4.0);
    assert!(metric_sum(&m, "kvx_transfer_bytes_total") > 0.0);
    drop(prefill);
}

#[test]
fn killed_decode_fails_its_rooms_only() {
    let port = free_port();
    // A small prefill pool: one room transfers at a time, the decode's others stay open.
    let prefill = start_prefill(port, &["--pool-pages", "40"], &[("RUST_LOG", "info")]);
    let dir = tempfile::tempdir().unwrap();
    let (sa, sb) = (dir.path().join("a.json"), dir.path().join("b.json"));
    // A decode that would run for a long time, killed once transfers to it are under way.
    let mut victim = start_decode(port, &sa, ENDLESS_LOAD);
    let t0 = std::time::Instant::now();
    while !http_get(port, "/metrics").is_some_and(|(_, m)| {
        metric_sum(&m, "kvx_transfer_batches_total") >= 20.0
            && metric_sum(&m, "kvx_room_entries") >= 2.0
    }) {
        if t0.elapsed() > Duration::from_secs(20) {
            let m = http_get(port, "/metrics").map(|x| x.1).unwrap_or_default();
            panic!(
                "hang guard: transfers never started\n{m}\n{}\n{}",
                prefill.stderr_now(),
                victim.stderr_now()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    victim.child().kill().unwrap();
    victim.child().wait().unwrap();
    let t0 = std::time::Instant::now();
    while !http_get(port, "/metrics")
        .is_some_and(|(_, m)| metric_sum(&m, "kvx_room_failures_total") >= 1.0)
    {
        if t0.elapsed() > Duration::from_secs(15) {
            let (_, m) = http_get(port, "/metrics").unwrap();
            panic!("no room failed\n{m}\n{}", prefill.stderr_now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its open rooms are failed and dropped: nothing of them stays on the prefill.
    wait_until(GUARD, "per-room entries gone", || {
        http_get(port, "/metrics").is_some_and(|(_, m)| metric_sum(&m, "kvx_room_entries") == 0.0)
    });
    let other = start_decode(port, &sb, &["--requests", "10", "--prompt-tokens", "500"]);
    let out = other.wait_output(GUARD);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(summary(&sb)["verified"], 10);
    let (_, m) = http_get(port, "/metrics").unwrap();
    assert_eq!(metric_sum(&m, "kvx_live_workers"), 4.0, "{m}");
    assert_eq!(metric_sum(&m, "kvx_worker_failures_total"), 0.0);
}

fn push_to(endpoint: &str) -> (zmq::Context, zmq::Socket) {
    let ctx = zmq::Context::new();
    let push = ctx.socket(zmq::PUSH).expect("push socket");
    push.set_linger(1000).expect("linger");
    push.connect(endpoint).expect("connect");
    (ctx, push)
}

#[test]
fn metadata_from_unknown_session_is_refused_and_reflects_nothing() {
    let port = free_port();
    let _prefill = start_prefill(port, &[], &[]);
    let ctx = zmq::Context::new();
    let pull = ctx.socket(zmq::PULL).unwrap();
    pull.bind("tcp://127.0.0.1:*").unwrap();
    pull.set_rcvtimeo(2_000).unwrap();
    let me = pull.get_last_endpoint().unwrap().unwrap();
    let my_port = me.rsplit(':').next().unwrap();
    let (_c, push) = push_to(&inbox(port));
    // Metadata for room 77 from a session that never registered.
    let frames: Vec<Vec<u8>> = vec![
        b"77".to_vec(),
        b"127.0.0.1".to_vec(),
        my_port.as_bytes().to_vec(),
        b"127.0.0.1:1".to_vec(),
        [5i32, 6, 7].iter().flat_map(|x| x.to_le_bytes()).collect(),
        b"3".to_vec(),
        vec![],
        b"1".to_vec(),
        b"0".to_vec(),
        vec![],
    ];
    push.send_multipart(frames, 0).unwrap();
    // Refused and counted; the endpoint the metadata named gets nothing (before: a status 0 went
    // to any endpoint an unregistered sender named).
    wait_until(GUARD, "metadata refused", || {
        http_get(port, "/metrics").is_some_and(|(_, m)| {
            metric_sum(
                &m,
                "kvx_metadata_refused_total{reason=\"unregistered_session\"}",
            ) == 1.0
        })
    });
    assert!(
        pull.recv_multipart(0).is_err(),
        "the prefill sent something to an unregistered endpoint"
    );
    // The worker and the rank are fine: a real decode is served.
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let out =
        start_decode(port, &s, &["--requests", "6", "--prompt-tokens", "300"]).wait_output(GUARD);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(summary(&s)["verified"], 6);
}

#[test]
fn malformed_flood_is_counted_and_dropped() {
    let port = free_port();
    let _prefill = start_prefill(port, &[], &[]);
    let (_c, push) = push_to(&inbox(port));
    let garbage: [&[&[u8]]; 6] = [
        &[b"not-a-room"],
        &[b"None", b"x"],
        &[b"123"],
        &[b"ABORT", b"1"],
        &[b"0", b"127.0.0.1", b"1", b"s", b"", b"", b"", b"1"],
        &[
            b"None",
            b"h",
            b"notaport",
            b"s",
            b"",
            b"",
            b"",
            b"0",
            b"1",
            b"0",
        ],
    ];
    let n = 1200;
    for i in 0..n {
        let msg: Vec<Vec<u8>> = garbage[i % garbage.len()]
            .iter()
            .map(|f| f.to_vec())
            .collect();
        push.send_multipart(msg, 0).unwrap();
    }
    wait_until(GUARD, "every malformed frame counted", || {
        http_get(port, "/metrics")
            .is_some_and(|(_, m)| metric_sum(&m, "kvx_malformed_frames_total") >= n as f64)
    });
    let m = six_rooms_verified(port);
    assert_eq!(
        metric_sum(&m, "kvx_malformed_frames_total"),
        n as f64,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "kvx_live_workers"), 4.0);
}

#[test]
fn aux_rows_over_zmq_are_verified() {
    let port = free_port();
    let _prefill = start_prefill(port, &["--aux-over-tcp"], &[]);
    // The decode checks each room's aux rows and room slot: they came as AUX_DATA, one
    // message per aux buffer (sglang's 10), ahead of the status.
    let m = six_rooms_verified(port);
    assert_eq!(metric_sum(&m, "kvx_aux_messages_total"), 60.0, "{m}");
}

/// Llama-3-8B TP 2 → TP 1 through a 16 MiB staging ring in `kvx demo`: over tcp every
/// writer's block is received straight into the pages; over the same-process `local` backend
/// (writes that bypass a receiver, as RDMA's do) every block is scattered from the ring.
#[test]
fn demo_runs_heterogeneous_tp_through_staging() {
    let dir = tempfile::tempdir().unwrap();
    for backend in ["tcp", "local"] {
        let s = dir.path().join(format!("demo-{backend}.json"));
        let out = Proc::spawn(
            std::process::Command::new(KVX)
                .args(["demo", "--model", "llama3-8b", "--pool-pages", "64"])
                .args(["--tp-size", "2", "--decode-tp", "1", "--staging"])
                // 64-token chunks: 8 MiB, which the decode scatters on several threads.
                .args(["--chunked-prefill-size", "64", "--staging-ring-mib", "16"])
                .args([
                    "--rooms",
                    "4",
                    "--prompt-tokens",
                    "256",
                    "--backend",
                    backend,
                ])
                .arg("--summary-json")
                .arg(&s),
        )
        .wait_output(GUARD);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout
                .lines()
                .last()
                .unwrap()
                .starts_with("verified: 4/4 rooms"),
            "{stdout}"
        );
        // 256 tokens on a 64-token grid: 4 chunks per room, all through the ring.
        let sum = summary(&s);
        assert_eq!(sum["staged_chunks"], 16, "{stdout}");
        let in_place = if backend == "tcp" {
            4 * 256 * 128 * 1024
        } else {
            0
        };
        assert_eq!(
            sum["staged_bytes_in_place"], in_place,
            "{backend}: {stdout}"
        );
    }
}

/// A decode started with `KVX_TCP_SECRET` accepts kvx tcp writes only from a prefill with the
/// same secret: a prefill without it fails its rooms (the hello is refused); one with it is
/// served, bytes verified.
#[test]
fn tcp_shared_secret_keeps_out_a_prefill_without_it() {
    let dir = tempfile::tempdir().unwrap();
    for (prefill_secret, want_ok) in [(None, false), (Some("s3cret"), true)] {
        let port = free_port();
        let env: Vec<(&str, &str)> = prefill_secret
            .map(|s| vec![(kvx_engine::plane::TCP_SECRET_ENV, s)])
            .unwrap_or_default();
        let _prefill = start_prefill(port, &["--backend", "tcp"], &env);
        let s = dir.path().join(format!("secret-{want_ok}.json"));
        let out = Proc::spawn(
            std::process::Command::new(KVX)
                .args(["decode", "--no-progress", "--bootstrap-addr"])
                .arg(format!("127.0.0.1:{port}"))
                .args(MODEL)
                .arg("--summary-json")
                .arg(&s)
                .args(["--requests", "3", "--prompt-tokens", "200"])
                .env(kvx_engine::plane::TCP_SECRET_ENV, "s3cret")
                .env("RUST_LOG", "warn"),
        )
        .wait_output(GUARD);
        assert_eq!(
            out.status.success(),
            want_ok,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let verified = summary(&s)["verified"].as_u64().unwrap();
        assert_eq!(verified, if want_ok { 3 } else { 0 });
    }
}
