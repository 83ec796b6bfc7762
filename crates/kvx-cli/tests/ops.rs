//! Operating `kvx` as an operator would: signals (drain, a second signal, the decode's summary),
//! readiness, flag validation before any traffic, the Prometheus exposition (parsed with a real
//! parser) and log output. Every test runs the built binary; every wait has a hang guard, no
//! assertion is about speed.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use common::*;
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, zmq};

const GUARD: Duration = Duration::from_secs(60);
/// How long a drained process may take to exit after its signal (a hang guard: a drain with
/// nothing in flight takes well under a second, `--shutdown-timeout` bounds the rest).
const EXIT_GUARD: Duration = Duration::from_secs(20);

fn signal(p: &mut Proc, sig: &str) {
    let pid = p.child().id().to_string();
    let st = Command::new("kill").args([sig, &pid]).status().unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

fn kvx(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(KVX);
    cmd.args(args).env("RUST_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc::spawn(&mut cmd).wait_output(GUARD)
}

fn prefill_success(port: u16) -> f64 {
    http_get(port, "/metrics").map_or(0.0, |(_, m)| {
        m.lines()
            .filter(|l| l.starts_with("kvx_rooms_finished_total{status=\"success\"}"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    })
}

#[test]
fn prefill_drains_on_sigint_and_exits_0_logging_without_colour_codes() {
    let port = free_port();
    let mut p = start_prefill(port, &[], &[("RUST_LOG", "info")]);
    assert_eq!(http_get(port, "/ready").map(|r| r.0), Some(200));
    signal(&mut p, "-INT");
    let out = p.wait_output(EXIT_GUARD);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("drained; exiting"), "{err}");
    // stderr is a pipe here: no ANSI escape codes.
    assert!(!err.contains('\u{1b}'), "{err}");
}

#[test]
fn bootstrap_stops_on_sigterm_with_exit_0_and_logs_json_on_request() {
    let port = free_port();
    let mut p = Proc::spawn(
        Command::new(KVX)
            .args(["bootstrap", "--log-format", "json", "--port"])
            .arg(port.to_string())
            .env("RUST_LOG", "info"),
    );
    wait_until(GUARD, "bootstrap ready", || {
        http_get(port, "/ready").is_some_and(|(s, _)| s == 200)
    });
    signal(&mut p, "-TERM");
    let out = p.wait_output(EXIT_GUARD);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let logs = json_lines(&err);
    assert!(
        logs.iter()
            .any(|l| l["level"] == "INFO" && l["fields"].is_object()),
        "{err}"
    );
}

#[test]
fn ready_says_503_while_unregistered_and_a_signal_ends_the_registration_retries() {
    // Nothing listens on the bootstrap port: registration retries (sglang's 5 × 5 s).
    let (bootstrap, metrics) = (free_port(), free_port());
    let mut p = Proc::spawn(
        Command::new(KVX)
            .args(["prefill", "--model", "tiny", "--bootstrap-port"])
            .arg(bootstrap.to_string())
            .arg("--metrics-port")
            .arg(metrics.to_string())
            .env("RUST_LOG", "warn"),
    );
    wait_until(GUARD, "metrics listener", || {
        http_get(metrics, "/health").is_some_and(|(s, _)| s == 200)
    });
    // 503 throughout: "starting" while the engine binds (longer on a loaded machine), then
    // "registering" for as long as the bootstrap server does not answer.
    wait_until(GUARD, "/ready says registering", || {
        let (status, body) = http_get(metrics, "/ready").unwrap();
        assert_eq!(status, 503, "{body}");
        body.contains("registering")
    });
    // Never claimed ready (the line ends in "ready" only once registered).
    let err = p.stderr_now();
    assert!(!err.lines().any(|l| l.ends_with("ready")), "{err}");
    signal(&mut p, "-INT");
    let out = p.wait_output(EXIT_GUARD);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn decode_sigint_drains_writes_its_summary_and_exits_0() {
    let port = free_port();
    let _prefill = start_prefill(port, &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let mut decode = start_decode(port, &s, ENDLESS_LOAD);
    wait_until(GUARD, "rooms served", || prefill_success(port) >= 4.0);
    signal(&mut decode, "-INT");
    let out = decode.wait_output(EXIT_GUARD);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("interrupted by SIGINT"), "{stdout}");
    let sum = summary(&s);
    assert_eq!(sum["interrupted"], "SIGINT", "{sum}");
    assert!(sum["verified"].as_u64().unwrap() >= 1, "{sum}");
    assert_eq!(sum["corrupt"], 0, "{sum}");
    assert_eq!(sum["failed"], sum["shutdown_aborted"], "{sum}");
    assert!(sum["not_started"].as_u64().unwrap() > 0, "{sum}");
}

#[test]
fn prefill_sigterm_under_load_tells_the_decode_why_and_exits_0() {
    let port = free_port();
    let mut prefill = start_prefill(port, &["--shutdown-timeout", "2"], &[]);
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let mut decode = start_decode(
        port,
        &s,
        &[
            ENDLESS_LOAD,
            &[
                "--heartbeat-interval",
                "2",
                "--heartbeat-max-failure",
                "1",
                "--shutdown-timeout",
                "2",
            ],
        ]
        .concat(),
    );
    wait_until(GUARD, "rooms served", || prefill_success(port) >= 4.0);
    signal(&mut prefill, "-TERM");
    let out = prefill.wait_output(EXIT_GUARD);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    // The decode keeps starting rooms; those the drain refused failed with its reason.
    wait_until(GUARD, "decode saw the drain", || {
        decode
            .stderr_now()
            .contains("prefill shutting down (SIGTERM)")
    });
    signal(&mut decode, "-INT");
    let dout = decode.wait_output(EXIT_GUARD);
    let sum = summary(&s);
    // Rooms failed by the prefill's shutdown are failures of the run: exit 1, summary written.
    assert_eq!(dout.status.code(), Some(1), "{sum}");
    let reasons = sum["failure_reasons"].as_object().unwrap();
    assert!(
        reasons
            .keys()
            .any(|k| k.starts_with("prefill shutting down (SIGTERM)")),
        "{sum}"
    );
    assert_eq!(sum["corrupt"], 0, "{sum}");
}

#[test]
fn a_second_signal_exits_at_once_while_rooms_are_stuck() {
    // A registered rank whose inbox nobody reads: the decode's rooms wait for their KV.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_server, port) = bootstrap_server(&rt);
    let ctx = zmq::Context::new();
    let inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Prefill)).unwrap();
    register_tiny_rank(&rt, port, 256, inbox.endpoint().port);
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let mut decode = start_decode(
        port,
        &s,
        &[
            "--requests",
            "4",
            "--prompt-tokens",
            "64",
            "--shutdown-timeout",
            "300",
            "--metrics-port",
            &free_port().to_string(),
        ],
    );
    let m = decode_metrics_port(&decode);
    wait_until(GUARD, "rooms in flight", || {
        http_get(m, "/metrics")
            .is_some_and(|(_, t)| metric_sum(&t, "kvx_decode_rooms_in_flight") >= 1.0)
    });
    signal(&mut decode, "-INT");
    wait_until(GUARD, "decode draining", || {
        http_get(m, "/ready").is_some_and(|(s, b)| s == 503 && b.contains("draining"))
    });
    signal(&mut decode, "-INT");
    let out = decode.wait_output(EXIT_GUARD);
    assert_eq!(out.status.code(), Some(130));
}

/// The port of `--metrics-port` in the decode's command line.
fn decode_metrics_port(p: &Proc) -> u16 {
    wait_until(GUARD, "decode metrics listener", || {
        p.stderr_now().contains("metrics on http://")
    });
    let err = p.stderr_now();
    let addr = err
        .split("metrics on http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap();
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// Arguments, environment, what the error must say.
type Case = (
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static str,
);

#[test]
fn invalid_flags_are_refused_before_any_traffic_naming_the_flag() {
    let cases: &[Case] = &[
        (
            &["prefill", "--tp-rank", "5", "--tp-size", "2"],
            &[],
            "--tp-rank 5 is out of range for --tp-size 2",
        ),
        (
            &["decode", "--waiting-timeout=1e30"],
            &[],
            "--waiting-timeout",
        ),
        (
            &["decode", "--zmq-send-timeout=inf"],
            &[],
            "--zmq-send-timeout",
        ),
        (
            &["decode", "--abort-release-timeout=NaN"],
            &[],
            "--abort-release-timeout",
        ),
        (
            &["decode"],
            &[("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "inf")],
            "environment variable SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
        ),
        (&["prefill", "--queues", "0"], &[], "--queues"),
        (&["decode", "--concurrency", "0"], &[], "--concurrency"),
        (
            &["decode", "--heartbeat-interval=-1"],
            &[],
            "--heartbeat-interval",
        ),
        (&["decode", "--fragmentation", "2"], &[], "--fragmentation"),
        (&["send", "--size", "0"], &[], "--size"),
        (
            &["decode", "--bootstrap-addr", "foo:bar"],
            &[],
            "--bootstrap-addr",
        ),
        (
            &["prefill"],
            &[("SGLANG_DISAGG_STAGING_BUFFER", "yes")],
            "environment variable SGLANG_DISAGG_STAGING_BUFFER",
        ),
        (
            &["decode", "--summary-json", "missing-dir/x.json"],
            &[],
            "--summary-json missing-dir/x.json",
        ),
    ];
    for (args, env, want) in cases {
        let out = kvx(args, env);
        let err = String::from_utf8_lossy(&out.stderr);
        let code = out.status.code();
        assert!(
            matches!(code, Some(1 | 2)),
            "{args:?}: exit {code:?}\n{err}"
        );
        assert!(err.contains(want), "{args:?}: no {want:?} in\n{err}");
        // Refused before anything was bound or sent.
        assert!(
            !err.contains("bound") && !err.contains("listening"),
            "{args:?}\n{err}"
        );
    }
    // SGLANG booleans read as sglang does, in any case.
    let out = kvx(
        &["prefill", "--help"],
        &[("SGLANG_DISAGG_STAGING_BUFFER", "TRUE")],
    );
    assert!(out.status.success());
}

#[test]
fn a_port_in_use_is_named() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = kvx(&["bootstrap", "--port", &port], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("--port {port}")), "{err}");
    let out = kvx(
        &[
            "prefill",
            "--model",
            "tiny",
            "--serve-bootstrap",
            "--bootstrap-port",
            &port,
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("--bootstrap-port {port}")), "{err}");
}

fn scrape(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap()
}

/// Every sample's family has HELP text, no label value carries sglang's `KVPoll.` prefix.
fn check_exposition(text: &str, side: &str) -> prometheus_parse::Scrape {
    let s = scrape(text);
    assert!(s.samples.len() > 10, "{side}: {text}");
    for sample in &s.samples {
        let m = sample.metric.as_str();
        let family = [m, m.trim_end_matches("_sum"), m.trim_end_matches("_count")];
        assert!(
            family.iter().any(|f| s.docs.contains_key(*f)),
            "{side}: no HELP for {m}"
        );
        for l in ["status", "state", "result"] {
            if let Some(v) = sample.labels.get(l) {
                assert!(!v.starts_with("KVPoll"), "{side}: {m}{{{l}={v}}}");
            }
        }
    }
    assert!(
        s.samples.iter().any(|x| x.metric == "kvx_build_info"),
        "{side}"
    );
    s
}

fn histogram_count(s: &prometheus_parse::Scrape, name: &str) -> f64 {
    let h = s
        .samples
        .iter()
        .find(|x| x.metric == name)
        .unwrap_or_else(|| panic!("{name} absent"));
    match &h.value {
        prometheus_parse::Value::Histogram(b) => {
            assert!(b.len() > 5, "{name}: {} buckets", b.len());
            b.iter().map(|c| c.count).fold(0.0, f64::max)
        }
        other => panic!("{name} is not a histogram: {other:?}"),
    }
}

#[test]
fn metrics_have_help_zeroed_failures_histograms_and_live_decode_counts() {
    let port = free_port();
    let prefill = start_prefill(port, &[], &[]);
    let fresh = http_get(port, "/metrics").unwrap().1;
    // Failure counters exist at zero before the first failure.
    let s = check_exposition(&fresh, "prefill at start");
    for name in ["kvx_room_failures_total", "kvx_session_failures_total"] {
        assert!(s.samples.iter().any(|x| x.metric == name), "{name} absent");
    }
    let dir = tempfile::tempdir().unwrap();
    let sum = dir.path().join("s.json");
    let mut decode = start_decode(
        port,
        &sum,
        &[ENDLESS_LOAD, &["--metrics-port", &free_port().to_string()]].concat(),
    );
    let m = decode_metrics_port(&decode);
    // The decode's room counters move while it runs (not only once it ends).
    wait_until(GUARD, "decode counts rooms while it runs", || {
        http_get(m, "/metrics").is_some_and(|(_, t)| {
            t.lines()
                .filter(|l| l.starts_with("kvx_decode_rooms_total{result=\"verified\"}"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
                >= 3.0
        })
    });
    let d = check_exposition(&http_get(m, "/metrics").unwrap().1, "decode");
    assert!(histogram_count(&d, "kvx_decode_room_latency_seconds") >= 3.0);
    assert!(
        d.samples
            .iter()
            .any(|x| x.metric == "kvx_decode_rooms_in_flight")
    );
    // The prefill's gauges refresh once a second.
    wait_until(GUARD, "prefill room gauges", || {
        http_get(port, "/metrics").is_some_and(|(_, t)| t.contains("kvx_rooms{state=\"success\"}"))
    });
    let p = check_exposition(&http_get(port, "/metrics").unwrap().1, "prefill");
    assert!(histogram_count(&p, "kvx_room_latency_seconds") >= 1.0);
    assert!(histogram_count(&p, "kvx_batch_latency_seconds") >= 1.0);
    assert!(p.samples.iter().any(
        |x| x.metric == "kvx_rooms_finished_total" && x.labels.get("status") == Some("success")
    ),);
    signal(&mut decode, "-INT");
    let _ = decode.wait_output(EXIT_GUARD);
    drop(prefill);
}
