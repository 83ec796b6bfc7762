//! Recovery without restarts, with real processes: a prefill rank killed with `kill -9` and
//! started again (the decode re-resolves its route and registers with the new process), a
//! bootstrap server that restarts (the prefill ranks register again), a rank that dies under a
//! standalone bootstrap server (the server drops it), and a decode saying what a stuck room
//! waits for. Every wait has a hang guard; no assertion is about speed.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Hang guard of each wait (generous: builds share the machine).
const GUARD: Duration = Duration::from_secs(120);

const SENTINEL: &str =
    "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";

/// `kvx bootstrap` on `port`, ready.
fn start_bootstrap(port: u16, extra: &[&str]) -> Proc {
    let p = Proc::spawn(
        Command::new(KVX)
            .args(["bootstrap", "--port"])
            .arg(port.to_string())
            .args(extra)
            .env("RUST_LOG", "info"),
    );
    wait_until(GUARD, "bootstrap ready", || {
        http_get(port, "/ready").is_some_and(|(s, _)| s == 200)
    });
    p
}

/// `kvx prefill` registered with the bootstrap server on `bootstrap` (not serving it), its
/// `/metrics` on `metrics`.
fn spawn_prefill(bootstrap: u16, metrics: u16, extra: &[&str]) -> Proc {
    Proc::spawn(
        Command::new(KVX)
            .args(["prefill", "--bootstrap-port"])
            .arg(bootstrap.to_string())
            .arg("--metrics-port")
            .arg(metrics.to_string())
            .args(MODEL)
            .args(["--chunk-pages", "4"])
            .args(extra)
            .env("RUST_LOG", "info"),
    )
}

/// `kvx decode` under endless load against the bootstrap server on `bootstrap`, its summary
/// to `summary`.
fn spawn_endless_decode(bootstrap: u16, summary: &std::path::Path, extra: &[&str]) -> Proc {
    Proc::spawn(
        Command::new(KVX)
            .args(["decode", "--no-progress", "--bootstrap-addr"])
            .arg(format!("127.0.0.1:{bootstrap}"))
            .args(MODEL)
            .arg("--summary-json")
            .arg(summary)
            .args(ENDLESS_LOAD)
            .args(extra)
            .env("RUST_LOG", "info"),
    )
}

/// Rooms the prefill whose `/metrics` is on `port` finished with Success.
fn successes(port: u16) -> f64 {
    http_get(port, "/metrics").map_or(0.0, |(_, m)| {
        m.lines()
            .filter(|l| l.starts_with("kvx_rooms_finished_total{status=\"success\"}"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    })
}

fn kill9(p: &mut Proc) {
    p.child().kill().unwrap();
    p.child().wait().unwrap();
}

/// The decode keeps serving rooms when its prefill rank is killed and started again at another
/// inbox, with a standalone bootstrap server whose `/health` never stopped answering (so the
/// instance heartbeat sees nothing): it notices the rank's inbox is gone, fails the rooms sent
/// there, re-resolves the route and registers with the new process, whose rooms then succeed.
/// Before, the decode kept the cached inbox and the new process never saw a room.
#[test]
fn decode_reregisters_with_a_restarted_prefill_rank() {
    let b = free_port();
    let _bootstrap = start_bootstrap(b, &[]);
    let (m1, m2) = (free_port(), free_port());
    let mut p1 = spawn_prefill(b, m1, &[]);
    wait_until(GUARD, "first prefill ready", || {
        http_get(m1, "/ready").is_some_and(|(s, _)| s == 200)
    });
    let dir = tempfile::tempdir().unwrap();
    let decode = spawn_endless_decode(
        b,
        &dir.path().join("s.json"),
        &["--heartbeat-interval", "2"],
    );
    wait_until(GUARD, "rooms served by the first prefill", || {
        successes(m1) >= 4.0
    });
    kill9(&mut p1);
    let _p2 = spawn_prefill(b, m2, &[]);
    wait_until(GUARD, "rooms served by the restarted prefill", || {
        successes(m2) >= 4.0
    });
    wait_until(GUARD, "the decode logging its new registration", || {
        decode
            .stderr_now()
            .contains("prefill rank back: registered with it again")
    });
}

/// The same, but the rank comes back on the same inbox port at once (as a service manager
/// restarts it): no probe sees the inbox down and the route does not change, yet the new
/// process knows nothing of this decode. The decode's connection to the inbox drops with the
/// old process (its outbox reports it), so it fails the rooms sent there and registers with
/// the new one, whose rooms then succeed. Before, every later room waited for its waiting
/// timeout.
#[test]
fn decode_reregisters_with_a_rank_restarted_on_the_same_port() {
    let b = free_port();
    let _bootstrap = start_bootstrap(b, &[]);
    let (m1, m2, inbox) = (free_port(), free_port(), free_port());
    let port = inbox.to_string();
    let mut p1 = spawn_prefill(b, m1, &["--inbox-port", &port]);
    wait_until(GUARD, "first prefill ready", || {
        http_get(m1, "/ready").is_some_and(|(s, _)| s == 200)
    });
    let dir = tempfile::tempdir().unwrap();
    let decode = spawn_endless_decode(
        b,
        &dir.path().join("s.json"),
        &["--heartbeat-interval", "30", "--waiting-timeout", "600"],
    );
    wait_until(GUARD, "rooms served by the first prefill", || {
        successes(m1) >= 4.0
    });
    kill9(&mut p1);
    let p2 = spawn_prefill(b, m2, &["--inbox-port", &port]);
    let t0 = std::time::Instant::now();
    while successes(m2) < 4.0 {
        assert!(
            t0.elapsed() < GUARD,
            "hang guard: rooms served by the prefill restarted on the same port\n--- decode\n{}\n--- prefill\n{}",
            tail(&decode.stderr_now(), 30),
            tail(&p2.stderr_now(), 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_until(GUARD, "the decode logging the dropped connection", || {
        decode.stderr_now().contains("its connection dropped")
    });
}

/// A standalone bootstrap server killed with `kill -9` and started again knows no rank; the
/// prefill rank notices (its periodic check) and registers again, so the instance answers the
/// sentinel with 200 instead of 503 until the rank restarts.
#[test]
fn prefill_registers_again_with_a_restarted_bootstrap_server() {
    let b = free_port();
    let mut b1 = start_bootstrap(b, &[]);
    let m = free_port();
    let p = spawn_prefill(b, m, &["--reregister-interval", "1"]);
    wait_sentinel(b, GUARD);
    kill9(&mut b1);
    let _b2 = start_bootstrap(b, &[]);
    wait_sentinel(b, GUARD);
    // The server answers the sentinel as soon as it took the registration; the rank logs it
    // once the reply reached it, a moment later.
    wait_until(GUARD, "the rank logging its new registration", || {
        p.stderr_now()
            .contains("rank registered again with the bootstrap server")
    });
}

/// A prefill rank killed with `kill -9` under a standalone bootstrap server is dropped once its
/// inbox and `/health` stop answering (logged at warn with the rank): the sentinel turns 503,
/// so decodes get no route to the dead rank, and 200 again once a new rank registers.
#[test]
fn bootstrap_drops_a_rank_that_stops_answering() {
    let b = free_port();
    let bootstrap = start_bootstrap(b, &["--rank-health-interval", "1"]);
    let mut p1 = spawn_prefill(b, free_port(), &[]);
    wait_sentinel(b, GUARD);
    kill9(&mut p1);
    wait_until(GUARD, "dead rank dropped", || {
        http_get(b, SENTINEL).is_some_and(|(s, _)| s == 503)
    });
    let err = bootstrap.stderr_now();
    assert!(
        err.lines().any(|l| l.contains("WARN")
            && l.contains("prefill rank dropped")
            && l.contains("tp=0")),
        "{}",
        tail(&err, 30)
    );
    let _p2 = spawn_prefill(b, free_port(), &[]);
    wait_sentinel(b, GUARD);
}

/// A room whose prefill does not answer (the prefill process is stopped with SIGSTOP: its
/// sockets still accept, nothing is served) is reported by the decode at info once it waited a
/// few seconds: its state, its prefill instance and ranks, the ranks that answered so far.
#[test]
fn decode_says_what_a_stuck_room_waits_for() {
    let b = free_port();
    let _bootstrap = start_bootstrap(b, &[]);
    let m = free_port();
    let mut p = spawn_prefill(b, m, &[]);
    wait_sentinel(b, GUARD);
    let inbox = inbox(b);
    let pid = p.child().id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s.json");
    let decode = Proc::spawn(
        Command::new(KVX)
            .args(["decode", "--no-progress", "--bootstrap-addr"])
            .arg(format!("127.0.0.1:{b}"))
            .args(MODEL)
            .arg("--summary-json")
            .arg(&s)
            .args(["--requests", "1"])
            .env("RUST_LOG", "info"),
    );
    let ep = inbox.trim_start_matches("tcp://").to_owned();
    wait_until(GUARD, "stuck room reported", || {
        decode.stderr_now().lines().any(|l| {
            l.contains("INFO")
                && l.contains("room waiting: waiting for the prefill ranks' status")
                && l.contains(&ep)
                && l.contains("succeeded_ranks=[]")
        })
    });
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
}
