//! Every data-plane backend from the binary, with real processes: `--backend verbs` fails at
//! startup naming the flag on a host without an RDMA device (and runs a demo where one is named
//! by `KVX_RDMA_DEVICE`); `--backend shm` moves rooms between a prefill and a decode process of
//! this host through `/dev/shm`, every byte verified by the decode, and cleans its files up.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const GUARD: Duration = Duration::from_secs(90);

fn kvx(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(KVX);
    cmd.args(args).env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc::spawn(&mut cmd).wait_output(GUARD)
}

/// What selecting verbs says here: no device, or (built with `--no-default-features`) no backend.
const NO_VERBS: &str = if cfg!(feature = "verbs") {
    "no RDMA device found"
} else {
    "built without the `verbs` feature"
};

/// True when this host has an RDMA device (the kernel lists one); the no-device tests skip.
fn host_has_rdma() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

#[test]
fn verbs_without_a_device_fails_at_startup_naming_the_flag_on_every_command() {
    if host_has_rdma() {
        eprintln!("SKIP: this host has an RDMA device (/sys/class/infiniband is not empty)");
        return;
    }
    let port = free_port().to_string();
    let to = format!("127.0.0.1:{}", free_port());
    let cases: Vec<Vec<&str>> = vec![
        vec!["prefill", "--bootstrap-port", &port],
        vec!["decode", "--no-progress", "--requests", "1"],
        vec!["demo", "--rooms", "1"],
        vec!["send", "--to", &to],
        vec!["recv", "--listen", &to],
    ];
    for mut args in cases {
        let cmd = args[0];
        args.extend(["--backend", "verbs"]);
        if cmd != "send" && cmd != "recv" {
            args.extend(MODEL);
        }
        let out = kvx(&args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "kvx {cmd}: {err}");
        assert!(
            err.contains("--backend verbs") && err.contains(NO_VERBS),
            "kvx {cmd}: {err}"
        );
        // refused before anything was bound or sent: no log line of a started rank
        assert!(!err.contains("ready"), "kvx {cmd}: {err}");
    }
    // A named device is no better on this host (and the env var names it just as well).
    let out = kvx(
        &["recv", "--backend", "verbs", "--listen", &to],
        &[("KVX_RDMA_DEVICE", "mlx5_9")],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(NO_VERBS), "{err}");
}

#[test]
fn verbs_demo_on_a_named_device_verifies_every_room() {
    if !cfg!(feature = "verbs") {
        eprintln!("SKIP: built without the `verbs` feature");
        return;
    }
    let Ok(dev) = std::env::var("KVX_RDMA_DEVICE") else {
        eprintln!("SKIP: KVX_RDMA_DEVICE names no RDMA device (see kvx-rdma's verbs module docs)");
        return;
    };
    let mut args = vec![
        "demo",
        "--backend",
        "verbs",
        "--rdma-device",
        &dev,
        "--rooms",
        "4",
    ];
    args.extend(MODEL);
    let out = kvx(&args, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verified: 4/4 rooms"), "{stdout}");
}

#[test]
fn unknown_backends_are_refused_with_the_choices() {
    let out = kvx(&["decode", "--backend", "local"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("tcp, mooncake, verbs or shm"), "{err}");
}

/// `/dev/shm` entries whose name contains `needle`.
fn shm_files(needle: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.contains(needle))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn shm_moves_rooms_between_two_processes_verified_at_the_decode() {
    let port = free_port();
    let prefill = start_prefill(port, &["--backend", "shm"], &[]);
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("shm.json");
    let mut decode = start_decode(
        port,
        &s,
        &[
            "--backend",
            "shm",
            "--requests",
            "6",
            "--prompt-tokens",
            "300",
            "--room-base",
            "7000",
        ],
    );
    let pid = decode.child().id();
    let needle = format!("kvx-decode-{pid}-");
    let out = decode.wait_output(GUARD);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sum = summary(&s);
    assert_eq!(sum["verified"], 6, "{sum}");
    assert_eq!(sum["corrupt"], 0, "{sum}");
    assert!(stdout.contains("verified: 6/6 rooms"), "{stdout}");
    // The decode's pages were /dev/shm files; it removed them (and its host file) on exit.
    assert!(shm_files(&needle).is_empty(), "{:?}", shm_files(&needle));
    drop(prefill);
}

#[test]
fn shm_demo_and_link_test_run() {
    let mut args = vec![
        "demo",
        "--backend",
        "shm",
        "--rooms",
        "4",
        "--prompt-tokens",
        "300",
    ];
    args.extend(MODEL);
    let out = kvx(&args, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verified: 4/4 rooms"), "{stdout}");

    // kvx recv publishes local:<name>; kvx send copies into its /dev/shm region.
    let name = format!("kvx-test-link-{}", std::process::id());
    let to = format!("local:{name}");
    let mut recv = Proc::spawn(
        Command::new(KVX)
            .args([
                "recv",
                "--backend",
                "shm",
                "--region",
                "1048576",
                "--listen",
            ])
            .arg(&name)
            .env("RUST_LOG", "warn"),
    );
    wait_until(Duration::from_secs(30), "recv published", || {
        recv.stderr_now().contains(&to)
    });
    // a second receiver under the same name is refused while the first lives
    let out = kvx(&["recv", "--backend", "shm", "--listen", &to], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("already published by process"), "{err}");
    let out = kvx(
        &[
            "send",
            "--backend",
            "shm",
            "--to",
            &to,
            "--size",
            "65536",
            "--batch",
            "4",
            "--total-mib",
            "8",
            "--no-progress",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("sent 8.0 MiB"), "{stdout}");
    // SIGINT: recv deregisters and removes its region and host file.
    recv.interrupt();
    let out = recv.wait_output(GUARD);
    assert_eq!(out.status.code(), Some(0));
    assert!(shm_files(&name).is_empty(), "{:?}", shm_files(&name));
    // a peer that does not exist is named
    let out = kvx(
        &["send", "--backend", "shm", "--to", "local:kvx-nobody-here"],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("local:kvx-nobody-here"), "{err}");
}
