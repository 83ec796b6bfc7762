//! Interop proof against the real sglang 0.5.23 classes, run live (`tests/py/sglang_live.py`:
//! sglang's own `MooncakeKVManager`, `MooncakeKVSender`, `MooncakeKVReceiver` and
//! `MooncakeKVBootstrapServer`, Mooncake TE over TCP, numpy pools of sglang's shapes, the GPU
//! stack stubbed at import). The pages carry kvx's synthetic pattern, so each side verifies
//! what the other wrote.
//!
//! * the harness itself: sglang prefill → sglang decode (MHA and MLA), and a negative control;
//!   the Python pattern against bytes produced by kvx's `model.rs`;
//! * kvx prefill → sglang decode (tiny, Llama-3-8B shape through sglang's bootstrap server,
//!   DeepSeek-V3 MLA): every byte and `bootstrap_room` checked by the sglang decode;
//! * sglang prefill → `kvx decode --backend mooncake` (tiny, MLA through kvx's bootstrap);
//! * ABORT: a 0.5.23 decode's 5-frame ABORT acknowledged by a kvx prefill with its generation
//!   after drain (no write after the ACK), the main-branch 4-frame form, and a kvx decode's
//!   ABORT acknowledged by a 0.5.23 prefill.
//!
//! Needs the venv of `cargo xtask setup` (or `$KVX_PYTHON`); without it every test fails.
//! The tests run one at a time, also under nextest (each starts two or three processes on a
//! 2-core machine).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{
    KVX, Proc, free_port, harness_summary, sglang_live, summary, tail, wait_harness_ready,
    wait_sentinel,
};
use kvx_engine::model::{self, ModelPreset};
use serde_json::Value;

/// One of these tests at a time, across threads (`cargo test`) and processes (`cargo nextest`):
/// holding a listener on a fixed loopback port (below the ephemeral range, outside Mooncake's
/// 15000-17000), which the OS frees even when a test process dies.
struct Serial(#[allow(dead_code)] std::net::TcpListener);

const SERIAL_PORT: u16 = 29517;

fn serial() -> Serial {
    let t0 = std::time::Instant::now();
    loop {
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", SERIAL_PORT)) {
            return Serial(l);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1800),
            "hang guard: port {SERIAL_PORT} (the sglang_interop lock) stayed taken"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Hang guard of one process (a run takes seconds; Python start-up alone is ~7 s here).
const GUARD: Duration = Duration::from_secs(100);
/// `--deadline` of a harness run.
const DEADLINE: &str = "70";
const ROOMS: u64 = 8;

/// A model shape both sides use (flag names are the same on kvx and on the harness).
#[derive(Clone, Copy)]
struct Shape {
    model: &'static str,
    pool_pages: u64,
    tokens: u64,
}

const TINY: Shape = Shape {
    model: "tiny",
    pool_pages: 256,
    tokens: 200,
};
const LLAMA: Shape = Shape {
    model: "llama3-8b",
    pool_pages: 96,
    tokens: 256,
};
const DEEPSEEK: Shape = Shape {
    model: "deepseek-v3",
    pool_pages: 128,
    tokens: 300,
};

impl Shape {
    fn flags(self) -> Vec<String> {
        strs(&[
            "--model",
            self.model,
            "--page-size",
            "16",
            "--pool-pages",
            &self.pool_pages.to_string(),
        ])
    }
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

fn csv(rooms: &[u64]) -> String {
    rooms
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What to print when a check fails: the summary and each process's last log lines.
fn context(summary: &Value, logs: &[(&str, String)]) -> String {
    let mut s = format!("summary: {summary}\n");
    for (name, text) in logs {
        let _ = write!(s, "---- {name} (last lines) ----\n{}\n", tail(text, 30));
    }
    s
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The sglang decode (harness) against the bootstrap server on `port`.
fn sglang_decode(port: u16, shape: Shape, room_base: u64, extra: &[String]) -> Output {
    let mut args = strs(&["--bootstrap-addr", &format!("127.0.0.1:{port}")]);
    args.extend(shape.flags());
    args.extend(strs(&[
        "--rooms",
        &ROOMS.to_string(),
        "--room-base",
        &room_base.to_string(),
        "--tokens",
        &shape.tokens.to_string(),
        "--concurrency",
        "4",
        "--deadline",
        DEADLINE,
    ]));
    args.extend_from_slice(extra);
    sglang_live("decode", &args).wait_output(GUARD)
}

/// The sglang prefill rank (harness) on bootstrap port `port`, waited until registered.
fn sglang_prefill(port: u16, shape: Shape, room_base: u64, extra: &[String]) -> Proc {
    let mut args = strs(&["--bootstrap-port", &port.to_string()]);
    args.extend(shape.flags());
    args.extend(strs(&[
        "--rooms",
        &ROOMS.to_string(),
        "--room-base",
        &room_base.to_string(),
        "--tokens",
        &shape.tokens.to_string(),
        "--chunk-pages",
        "3",
        "--deadline",
        DEADLINE,
    ]));
    args.extend_from_slice(extra);
    let p = sglang_live("prefill", &args);
    wait_harness_ready(&p, GUARD, "sglang prefill");
    wait_sentinel(port, GUARD);
    p
}

/// sglang's own bootstrap server (harness `bootstrap` mode) on `port`.
fn sglang_bootstrap(port: u16) -> Proc {
    let p = sglang_live("bootstrap", &strs(&["--bootstrap-port", &port.to_string()]));
    wait_harness_ready(&p, GUARD, "sglang bootstrap server");
    p
}

/// `kvx prefill` (default `--backend auto`) registering with the bootstrap server on `port`
/// (its own with `serve_bootstrap`), waited until registered.
fn kvx_prefill(port: u16, shape: Shape, serve_bootstrap: bool, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(KVX);
    cmd.arg("prefill");
    if serve_bootstrap {
        cmd.arg("--serve-bootstrap");
    }
    cmd.args(["--bootstrap-port", &port.to_string()])
        .args(shape.flags())
        .args(["--chunk-pages", "4"])
        .args(extra)
        .env("RUST_LOG", "info");
    let p = Proc::spawn(&mut cmd);
    let t0 = std::time::Instant::now();
    while common::http_get(
        port,
        "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
    )
    .is_none_or(|(s, _)| s != 200)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "kvx prefill never registered with the bootstrap server on {port}; stderr:\n{}",
            tail(&p.stderr_now(), 30)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    p
}

/// `kvx decode --backend mooncake` (a Mooncake-TE-compatible target) against `port`.
fn kvx_decode(
    port: u16,
    shape: Shape,
    room_base: u64,
    summary_path: &Path,
    extra: &[&str],
) -> Output {
    Proc::spawn(
        Command::new(KVX)
            .args(["decode", "--no-progress", "--backend", "mooncake"])
            .args(["--bootstrap-addr", &format!("127.0.0.1:{port}")])
            .args(shape.flags())
            .args(["--requests", &ROOMS.to_string()])
            .args(["--room-base", &room_base.to_string()])
            .args(["--prompt-tokens", &shape.tokens.to_string()])
            .args(["--concurrency", "4"])
            .arg("--summary-json")
            .arg(summary_path)
            .args(extra)
            .env("RUST_LOG", "info"),
    )
    .wait_output(GUARD)
}

/// Asserts an sglang decode run verified every room (every byte, aux rows, the
/// `bootstrap_room` gate), over non-contiguous pages, with no write outside the rooms.
fn assert_decode_verified(out: &Output, logs: &[(&str, String)]) {
    let s = harness_summary(out);
    let ctx = context(&s, logs);
    assert_eq!(
        s["ok"], ROOMS,
        "sglang decode: not every room verified\n{ctx}"
    );
    assert_eq!(s["corrupt"], 0, "{ctx}");
    assert_eq!(s["failed"], 0, "{ctx}");
    assert_eq!(
        s["stray_pages"], 0,
        "a write landed outside the rooms' pages\n{ctx}"
    );
    assert!(
        s["non_contiguous_rooms"].as_u64().unwrap_or(0) >= ROOMS / 2,
        "the decode's page lists were not fragmented\n{ctx}"
    );
    assert_eq!(s["pass"], true, "{ctx}");
    assert!(out.status.success(), "{ctx}");
}

// ---- the harness itself ----------------------------------------------------------------------

/// The Python pattern (`kvx_pattern.py`) is byte-identical to `model.rs`: KV pages of every
/// preset (incl. a head slice at TP4 rank 3), every aux row and the room row.
#[test]
fn python_pattern_matches_kvx_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let rooms = [1u64, 7, 0x1234_5678_9ABC_DEF0, kvx_core::Room::MAX];
    let cases: &[(ModelPreset, &str, u32, u32, u64)] = &[
        (ModelPreset::Tiny, "tiny", 1, 0, 16),
        (ModelPreset::Llama3_8b, "llama3-8b", 1, 0, 4),
        (ModelPreset::Llama3_70b, "llama3-70b", 4, 3, 2),
        (ModelPreset::DeepseekV3, "deepseek-v3", 2, 1, 3),
    ];
    for &(preset, name, tp_size, tp_rank, page_size) in cases {
        let l = preset.layout(tp_size, tp_rank, page_size, 8);
        let mut lines = String::new();
        let mut n = 0;
        for &room in &rooms {
            for b in [0, 1, l.num_buffers as u32 - 1] {
                for page in [0u32, 1, 5] {
                    let mut buf = vec![0u8; l.item_len as usize];
                    l.fill_kv(&mut buf, room, b, page);
                    assert!(l.check_kv(&buf, room, b, page));
                    writeln!(lines, "kv {room} {b} {page} {}", hex(&buf)).unwrap();
                    n += 1;
                }
            }
            for (i, &len) in model::SGLANG_AUX_ROW_LENS.iter().enumerate() {
                let mut row = vec![0u8; len as usize];
                if i == model::AUX_ROOM_INDEX {
                    assert!(kvx_core::layout::fill_room_row(
                        &mut row,
                        kvx_core::Room::new(room).unwrap()
                    ));
                } else {
                    model::fill_aux(&mut row, room, i);
                }
                writeln!(lines, "aux {room} {i} {}", hex(&row)).unwrap();
                n += 1;
            }
        }
        let path = dir.path().join(format!("{name}.txt"));
        std::fs::write(&path, lines).unwrap();
        let out = sglang_live(
            "selftest",
            &strs(&[
                "--model",
                name,
                "--tp-size",
                &tp_size.to_string(),
                "--tp-rank",
                &tp_rank.to_string(),
                "--page-size",
                &page_size.to_string(),
                "--expect",
                path.to_str().unwrap(),
            ]),
        )
        .wait_output(GUARD);
        let s = harness_summary(&out);
        let ctx = context(&s, &[("selftest", stderr_of(&out))]);
        assert_eq!(s["checked"], n, "{name}: {ctx}");
        assert_eq!(s["mismatched"], 0, "{name}: {ctx}");
        assert!(out.status.success(), "{name}: {ctx}");
    }
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(2 * b.len()), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// Milestone 1: sglang prefill → sglang decode through sglang's own bootstrap server (its own
/// process), MHA: 8 rooms, chunks of 3 pages, non-contiguous pages, every byte verified.
#[test]
fn harness_sglang_to_sglang_mha() {
    let _g = serial();
    let port = free_port();
    let bs = sglang_bootstrap(port);
    let pf = sglang_prefill(port, TINY, 100, &[]);
    let out = sglang_decode(port, TINY, 100, &[]);
    let pf_out = pf.wait_output(GUARD);
    assert_decode_verified(
        &out,
        &[
            ("sglang decode", stderr_of(&out)),
            ("sglang prefill", stderr_of(&pf_out)),
            ("sglang bootstrap", bs.stderr_now()),
        ],
    );
    let ps = harness_summary(&pf_out);
    assert_eq!(ps["ok"], ROOMS, "prefill: {ps}");
    assert!(
        ps["chunks_sent"].as_u64().unwrap() >= 4 * ROOMS,
        "prefill: {ps}"
    );
}

/// Milestone 1, MLA (DeepSeek-V3: 61 latent buffers), the prefill serving the bootstrap.
#[test]
fn harness_sglang_to_sglang_mla() {
    let _g = serial();
    let port = free_port();
    let pf = sglang_prefill(port, DEEPSEEK, 200, &strs(&["--serve-bootstrap"]));
    let out = sglang_decode(port, DEEPSEEK, 200, &[]);
    let pf_out = pf.wait_output(GUARD);
    assert_decode_verified(
        &out,
        &[
            ("sglang decode", stderr_of(&out)),
            ("sglang prefill", stderr_of(&pf_out)),
        ],
    );
}

/// The decode's check can fail: a prefill that writes another room's KV (correct aux rows)
/// makes every room corrupt and the decode exit non-zero.
#[test]
fn harness_detects_wrong_bytes() {
    let _g = serial();
    let port = free_port();
    let pf = sglang_prefill(
        port,
        TINY,
        300,
        &strs(&["--serve-bootstrap", "--pattern", "shifted"]),
    );
    let out = sglang_decode(port, TINY, 300, &[]);
    drop(pf);
    let s = harness_summary(&out);
    assert_eq!(
        s["corrupt"],
        ROOMS,
        "{}",
        context(&s, &[("decode", stderr_of(&out))])
    );
    assert_eq!(s["ok"], 0, "{s}");
    assert_eq!(s["pass"], false, "{s}");
    assert!(!out.status.success());
}

// ---- kvx prefill → sglang decode -------------------------------------------------------------

/// `kvx prefill` (its own bootstrap server) → sglang 0.5.23 decode, tiny MHA.
#[test]
fn kvx_prefill_to_sglang_decode_tiny() {
    let _g = serial();
    let port = free_port();
    let pf = kvx_prefill(port, TINY, true, &[]);
    let out = sglang_decode(port, TINY, 1000, &[]);
    assert_decode_verified(
        &out,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
        ],
    );
}

/// `kvx prefill` registered with sglang's own bootstrap server → sglang decode, Llama-3-8B
/// shape (64 buffers of 8 heads × 128).
#[test]
fn kvx_prefill_to_sglang_decode_llama_via_sglang_bootstrap() {
    let _g = serial();
    let port = free_port();
    let bs = sglang_bootstrap(port);
    let pf = kvx_prefill(port, LLAMA, false, &[]);
    let out = sglang_decode(port, LLAMA, 2000, &[]);
    assert_decode_verified(
        &out,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
            ("sglang bootstrap", bs.stderr_now()),
        ],
    );
}

/// `kvx prefill` → sglang decode, DeepSeek-V3 MLA (61 latent buffers).
#[test]
fn kvx_prefill_to_sglang_decode_mla() {
    let _g = serial();
    let port = free_port();
    let pf = kvx_prefill(port, DEEPSEEK, true, &[]);
    let out = sglang_decode(port, DEEPSEEK, 3000, &[]);
    assert_decode_verified(
        &out,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
        ],
    );
}

/// One `kvx prefill` (default `--backend auto`) serves an sglang 0.5.23 decode (Mooncake TE) and
/// a kvx decode (kvx tcp) at the same time, choosing the data plane per decode session.
#[test]
fn one_kvx_prefill_serves_an_sglang_decode_and_a_kvx_decode_at_once() {
    let _g = serial();
    let port = free_port();
    let pf = kvx_prefill(port, TINY, true, &[]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let kvx = {
        let path = path.clone();
        std::thread::spawn(move || kvx_decode(port, TINY, 7000, &path, &["--backend", "tcp"]))
    };
    let out = sglang_decode(port, TINY, 6000, &[]);
    let kvx_out = kvx.join().unwrap();
    let logs = [
        ("sglang decode", stderr_of(&out)),
        ("kvx decode", stderr_of(&kvx_out)),
        ("kvx prefill", pf.stderr_now()),
    ];
    assert_decode_verified(&out, &logs);
    assert!(
        path.exists(),
        "kvx decode wrote no summary\n{}",
        context(&Value::Null, &logs)
    );
    assert_kvx_verified(&summary(&path), &logs);
    let log = pf.stderr_now();
    for backend in ["\"mooncake\"", "\"tcp\""] {
        assert!(
            log.lines()
                .any(|l| l.contains("data plane chosen for peer") && l.contains(backend)),
            "the prefill never chose {backend}\n{}",
            context(&Value::Null, &logs)
        );
    }
}

// ---- sglang prefill → kvx decode -------------------------------------------------------------

fn assert_kvx_verified(s: &Value, logs: &[(&str, String)]) {
    let ctx = context(s, logs);
    assert_eq!(
        s["verified"], ROOMS,
        "kvx decode: not every room verified\n{ctx}"
    );
    assert_eq!(s["corrupt"], 0, "{ctx}");
    assert_eq!(s["failed"], 0, "{ctx}");
}

/// sglang 0.5.23 prefill (serving sglang's bootstrap) → `kvx decode --backend mooncake`, tiny.
#[test]
fn sglang_prefill_to_kvx_decode_tiny() {
    let _g = serial();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let pf = sglang_prefill(
        port,
        TINY,
        4000,
        &strs(&["--serve-bootstrap", "--linger", "1"]),
    );
    let out = kvx_decode(port, TINY, 4000, &path, &[]);
    let pf_out = pf.wait_output(GUARD);
    let logs = [
        ("kvx decode", stderr_of(&out)),
        ("sglang prefill", stderr_of(&pf_out)),
    ];
    assert!(
        path.exists(),
        "kvx decode wrote no summary\n{}",
        context(&Value::Null, &logs)
    );
    let s = summary(&path);
    assert_kvx_verified(&s, &logs);
    assert!(out.status.success(), "{}", context(&s, &logs));
    let ps = harness_summary(&pf_out);
    assert_eq!(ps["ok"], ROOMS, "sglang prefill: {ps}");
}

/// sglang prefill registered with kvx's bootstrap server → kvx decode, DeepSeek-V3 MLA.
#[test]
fn sglang_prefill_to_kvx_decode_mla_via_kvx_bootstrap() {
    let _g = serial();
    let port = free_port();
    let bs = Proc::spawn(
        Command::new(KVX)
            .args(["bootstrap", "--port", &port.to_string()])
            .env("RUST_LOG", "info"),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let pf = sglang_prefill(port, DEEPSEEK, 5000, &strs(&["--linger", "1"]));
    let out = kvx_decode(port, DEEPSEEK, 5000, &path, &[]);
    let pf_out = pf.wait_output(GUARD);
    let logs = [
        ("kvx decode", stderr_of(&out)),
        ("sglang prefill", stderr_of(&pf_out)),
        ("kvx bootstrap", bs.stderr_now()),
    ];
    assert!(
        path.exists(),
        "kvx decode wrote no summary\n{}",
        context(&Value::Null, &logs)
    );
    let s = summary(&path);
    assert_kvx_verified(&s, &logs);
    assert!(out.status.success(), "{}", context(&s, &logs));
}

// ---- ABORT -----------------------------------------------------------------------------------

/// A 0.5.23 decode aborts two 64 MiB rooms (deferred KV release on, its default: 5-frame
/// ABORT with a generation) as soon as their first bytes landed, so the kvx prefill is still
/// writing them. The
/// kvx prefill must answer each with the 4-frame ABORT_ACK echoing the generation, only after
/// its writes drained (the decode's pages do not change after the ACK), and keep serving the
/// other rooms.
#[test]
fn sglang_decode_abort_is_acked_with_generation_by_kvx_prefill() {
    let _g = serial();
    let port = free_port();
    let shape = Shape {
        tokens: 512,
        ..LLAMA
    };
    let aborted = [6001u64, 6004];
    let pf = kvx_prefill(port, shape, true, &[]);
    let out = sglang_decode(
        port,
        shape,
        6000,
        &strs(&[
            "--abort-rooms",
            &csv(&aborted),
            "--abort-on",
            "first-write",
            "--deferred-release",
            "1",
            "--concurrency",
            "2",
        ]),
    );
    let s = harness_summary(&out);
    let ctx = context(
        &s,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
        ],
    );
    assert_eq!(s["aborted"], 2, "{ctx}");
    assert!(
        s["aborted_mid_transfer"].as_u64().unwrap_or(0) >= 1,
        "no room was aborted while the kvx prefill was writing it\n{ctx}"
    );
    assert_eq!(
        s["abort_ack_generation_matched"], 2,
        "the kvx prefill did not send a generation-matched 4-frame ABORT_ACK for each aborted room\n{ctx}"
    );
    assert_eq!(
        s["abort_acked"], 2,
        "sglang's is_abort_release_safe never became true\n{ctx}"
    );
    assert_eq!(
        s["late_writes"], 0,
        "pages changed after the ABORT_ACK\n{ctx}"
    );
    assert_eq!(
        s["ok"],
        ROOMS - 2,
        "the other rooms must still arrive byte-exact\n{ctx}"
    );
    assert_eq!(s["pass"], true, "{ctx}");
}

/// The main-branch frame form: a decode without deferred release sends the 4-frame ABORT
/// (no generation). The kvx prefill fails the room, answers with a generation-less ACK (2 or 3
/// frames, as main-branch peers expect) and keeps serving the other rooms.
#[test]
fn main_branch_abort_from_sglang_decode_to_kvx_prefill() {
    let _g = serial();
    let port = free_port();
    let aborted = [7002u64, 7005];
    let pf = kvx_prefill(port, TINY, true, &[]);
    let out = sglang_decode(
        port,
        TINY,
        7000,
        &strs(&["--abort-rooms", &csv(&aborted), "--deferred-release", "0"]),
    );
    let s = harness_summary(&out);
    let ctx = context(
        &s,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
        ],
    );
    assert_eq!(s["aborted"], 2, "{ctx}");
    assert_eq!(s["ok"], ROOMS - 2, "{ctx}");
    assert_eq!(s["late_writes"], 0, "{ctx}");
    let acks = s["abort_acks_seen"].as_array().cloned().unwrap_or_default();
    for room in aborted {
        let ack = acks
            .iter()
            .filter_map(Value::as_array)
            .find(|a| a.get(1).and_then(Value::as_str) == Some(room.to_string().as_str()));
        let ack = ack.unwrap_or_else(|| panic!("no ABORT_ACK for room {room}\n{ctx}"));
        assert!(
            (2..=3).contains(&ack.len()),
            "a 4-frame ABORT must get a generation-less ACK, got {ack:?}\n{ctx}"
        );
    }
    assert_eq!(s["pass"], true, "{ctx}");
}

/// A kvx decode gives up on two rooms the 0.5.23 prefill holds (waiting timeout) and ABORTs
/// them; the 0.5.23 prefill acknowledges only an ABORT that carries a generation, so the kvx
/// decode must send one, and then count both rooms acknowledged with no late write.
#[test]
fn kvx_decode_abort_is_acked_by_sglang_prefill() {
    let _g = serial();
    let port = free_port();
    let held = [8002u64, 8005];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let pf = sglang_prefill(
        port,
        TINY,
        8000,
        &strs(&[
            "--serve-bootstrap",
            "--hold-rooms",
            &csv(&held),
            "--deferred-release",
            "1",
            "--linger",
            "2",
        ]),
    );
    let out = kvx_decode(
        port,
        TINY,
        8000,
        &path,
        &["--waiting-timeout", "3", "--abort-release-timeout", "10"],
    );
    let pf_out = pf.wait_output(GUARD);
    let logs = [
        ("kvx decode", stderr_of(&out)),
        ("sglang prefill", stderr_of(&pf_out)),
    ];
    assert!(
        path.exists(),
        "kvx decode wrote no summary\n{}",
        context(&Value::Null, &logs)
    );
    let s = summary(&path);
    let ctx = context(&s, &logs);
    assert_eq!(s["verified"], ROOMS - 2, "{ctx}");
    assert_eq!(s["failed"], 2, "{ctx}");
    assert_eq!(s["aborted_rooms"], 2, "{ctx}");
    assert_eq!(
        s["abort_acked_rooms"], 2,
        "the 0.5.23 prefill did not acknowledge the kvx decode's ABORTs (a generation-less \
         ABORT gets no ACK from 0.5.23)\n{ctx}"
    );
    assert_eq!(s["late_writes"], 0, "{ctx}");
    let ps = harness_summary(&pf_out);
    assert_eq!(ps["ok"], ROOMS - 2, "sglang prefill: {ps}");
    assert_eq!(ps["expected_failed"], 2, "sglang prefill: {ps}");
}

/// A per-room error on the kvx prefill is reported with its real cause: a 0.5.23 decode whose
/// metadata names a page outside its registered pool gets status Failed with kvx's reason as
/// the 4th frame that 0.5.23's parser accepts (not sglang's generic "it might be dead"), and the
/// other rooms still arrive byte-exact.
#[test]
fn kvx_prefill_failure_reason_reaches_sglang_decode() {
    let _g = serial();
    let port = free_port();
    let bad = [9001u64, 9006];
    let pf = kvx_prefill(port, TINY, true, &[]);
    let out = sglang_decode(port, TINY, 9000, &strs(&["--bad-page-rooms", &csv(&bad)]));
    let s = harness_summary(&out);
    let ctx = context(
        &s,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
        ],
    );
    assert_eq!(s["ok"], ROOMS - 2, "{ctx}");
    assert_eq!(s["expected_failed"], 2, "{ctx}");
    assert!(
        s["status_frames"]
            .as_array()
            .is_some_and(|f| f.contains(&Value::from(4))),
        "no 4-frame status (with a reason) reached the 0.5.23 decode\n{ctx}"
    );
    let reasons: Vec<&String> = s["expected_failure_reasons"]
        .as_object()
        .map(|m| m.keys().collect())
        .unwrap_or_default();
    assert!(
        !reasons.is_empty()
            && reasons.iter().all(|r| !r.contains("it might be dead")
                && !r.contains("no reason")
                && !r.contains("deadline")),
        "the decode did not get kvx's failure reason: {reasons:?}\n{ctx}"
    );
    assert_eq!(s["pass"], true, "{ctx}");
}

/// Rooms a kvx prefill never serves (each larger than its whole pool): a 0.5.23 decode whose
/// waiting timeout fires sends its own generation ABORT (`_check_waiting_timeout`), and the kvx
/// prefill must acknowledge every one with the matching generation although the room is long
/// gone on its side. (A room the prefill reports Failed with a reason needs no ABORT.)
#[test]
fn sglang_decode_timeout_abort_of_rooms_kvx_never_serves_is_acked() {
    let _g = serial();
    let port = free_port();
    let small = Shape {
        pool_pages: 8,
        ..TINY
    };
    let all: Vec<u64> = (9100..9100 + ROOMS).collect();
    let pf = kvx_prefill(port, small, true, &[]);
    let out = sglang_decode(
        port,
        TINY,
        9100,
        &strs(&[
            "--waiting-timeout",
            "3",
            "--deferred-release",
            "1",
            "--expect-failed",
            &csv(&all),
        ]),
    );
    let s = harness_summary(&out);
    let ctx = context(
        &s,
        &[
            ("sglang decode", stderr_of(&out)),
            ("kvx prefill", pf.stderr_now()),
        ],
    );
    assert_eq!(s["expected_failed"], ROOMS, "{ctx}");
    let timeouts = s["timeout_aborts"].as_u64().unwrap_or(0);
    let told = s["results"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter(|x| x["abort_generation"].is_null())
                .filter(|x| {
                    x["reason"]
                        .as_str()
                        .is_some_and(|r| !r.contains("it might be dead") && !r.contains("deadline"))
                })
                .count() as u64
        })
        .unwrap_or(0);
    assert_eq!(
        timeouts + told,
        ROOMS,
        "every room must end by the decode's ABORT or by a prefill status with its reason\n{ctx}"
    );
    assert_eq!(
        s["abort_ack_generation_matched"], timeouts,
        "an ABORT of a room the kvx prefill no longer knows got no generation-matched ACK\n{ctx}"
    );
    assert_eq!(s["abort_acked"], timeouts, "{ctx}");
    assert_eq!(s["late_writes"], 0, "{ctx}");
    assert_eq!(s["pass"], true, "{ctx}");
}
