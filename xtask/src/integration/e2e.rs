//! Whole rooms end to end for `cargo xtask bench e2e`, in two parts, each row beside the plain
//! link test (`kvx send` into `kvx recv`) moving the same bytes in the same run.
//!
//! **Engines** ([`super::e2e_engine`]): Llama-3-8B TP1 at 4k and 32k tokens, DeepSeek-V3 (MLA)
//! at 4k and Llama-3-8B from prefill TP 2 to decode TP 1 by head slices and through the decode's
//! staging ring, through `kvx-cli`'s
//! `engine_rooms` example (prefill and decode engines in one process, the synthetic model's fill
//! and the verification off the clock), then empty rooms for the control overhead. The bench's
//! last line is `e2e/link ratio: R`, the smallest engine / link quotient of those shapes.
//!
//! **Processes**: Llama-3-8B and DeepSeek-V3 through `kvx demo` (bootstrap, one prefill rank and
//! one decode over loopback TCP in one process), Llama-3-70B at TP 8 as 17 processes (bootstrap,
//! 8 prefill ranks, 8 decode ranks), and Llama-3-8B from prefill TP 2 to decode TP 1 by per-token
//! head slices and through the staging ring, at 4k, 8k and 32k tokens, every byte verified; their
//! GB/s is the decode's wall time, which includes the synthetic model and the verification.
//!
//! `KVX_E2E_PARTS=engine|processes` runs one part, `KVX_E2E_SHAPES=key,...` only those shapes
//! (`empty-room` names the empty rooms). Sizes that do not fit in half of the available memory
//! are left out with the reason, as are runs that fail.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::e2e_engine::{self, ENGINE_SHAPES, EngineRow, EngineRun};
use super::proc::Proc;
use super::scenarios::Summary;
use super::scenarios::common::{self, DecodeOpts, Model, PrefillOpts};
use super::{Ctx, kvx::Kvx};
use crate::report::Part;
use crate::report::svg::{self, LinePlot, Series};

/// A model shape of the run.
struct Shape {
    label: &'static str,
    /// Names its logs.
    key: &'static str,
    preset: &'static str,
    /// Prefill attention-TP size.
    tp: u32,
    /// Decode attention-TP size.
    decode_tp: u32,
    /// KV bytes per token on one rank (for the memory guard only; figures come from the run).
    bytes_per_token: u64,
    /// Extra flags of every prefill rank and every decode rank.
    prefill_extra: &'static [&'static str],
    decode_extra: &'static [&'static str],
}

/// Staging with 2048-token chunks (256 MiB at decode TP 1) and a 1 GiB ring.
const STAGING_PREFILL: &[&str] = &["--staging", "--chunked-prefill-size", "2048"];
const STAGING_DECODE: &[&str] = &[
    "--staging",
    "--chunked-prefill-size",
    "2048",
    "--staging-ring-mib",
    "1024",
];

const SHAPES: &[Shape] = &[
    Shape {
        label: "Llama-3-8B TP1",
        key: "llama3-8b",
        preset: "llama3-8b",
        tp: 1,
        decode_tp: 1,
        bytes_per_token: 32 * 2 * 8 * 128 * 2,
        prefill_extra: &[],
        decode_extra: &[],
    },
    Shape {
        label: "Llama-3-70B TP8 (8 ranks)",
        key: "llama3-70b",
        preset: "llama3-70b",
        tp: 8,
        decode_tp: 8,
        bytes_per_token: 80 * 2 * 128 * 2,
        prefill_extra: &[],
        decode_extra: &[],
    },
    Shape {
        label: "DeepSeek-V3 MLA",
        key: "deepseek-v3",
        preset: "deepseek-v3",
        tp: 1,
        decode_tp: 1,
        bytes_per_token: 61 * 576 * 2,
        prefill_extra: &[],
        decode_extra: &[],
    },
    Shape {
        label: "Llama-3-8B TP2->TP1 head slices",
        key: "llama3-8b-tp2-tp1",
        preset: "llama3-8b",
        tp: 2,
        decode_tp: 1,
        bytes_per_token: 32 * 2 * 8 * 128 * 2,
        prefill_extra: &[],
        decode_extra: &[],
    },
    Shape {
        label: "Llama-3-8B TP2->TP1 staging",
        key: "llama3-8b-tp2-tp1-staging",
        preset: "llama3-8b",
        tp: 2,
        decode_tp: 1,
        bytes_per_token: 32 * 2 * 8 * 128 * 2,
        prefill_extra: STAGING_PREFILL,
        decode_extra: STAGING_DECODE,
    },
];

const TOKENS: &[u64] = &[4096, 8192, 32768];

/// One measured point.
struct Row {
    shape: &'static str,
    tokens: u64,
    room_bytes: f64,
    summary: Summary,
    baseline_gbps: Option<f64>,
}

fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// Builds the release binary and the `engine_rooms` example (no failpoints: these are the
/// figures a user would see); returns their paths.
fn build_release(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    crate::run(Command::new(cargo).current_dir(root).args([
        "build",
        "--release",
        "-q",
        "-p",
        "kvx-cli",
        "--bin",
        "kvx",
        "--example",
        "engine_rooms",
    ]))?;
    let release = crate::report::report_dir(root)
        .parent()
        .map(|t| t.join("release"))
        .context("no target dir")?;
    let (bin, example) = (
        release.join("kvx"),
        release.join("examples").join("engine_rooms"),
    );
    for p in [&bin, &example] {
        if !p.exists() {
            bail!("built, but {} is missing", p.display());
        }
    }
    Ok((bin, example))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(25201)
}

/// The plain link test moving `mib` MiB in 1 MiB writes over `connections` connections; GB/s.
fn baseline(bin: &Path, logs: &Path, mib: u64, connections: usize) -> Result<f64> {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut recv = Command::new(bin);
    recv.args(["recv", "--listen", &addr]);
    let mut r = Proc::spawn("link-recv", recv, logs)?;
    if !r.wait_for_log("listening", Duration::from_secs(30)) {
        bail!("kvx recv not listening: {}", r.log_tail(3));
    }
    let mut send = Command::new(bin);
    send.args([
        "send",
        "--to",
        &addr,
        "--no-progress",
        "--total-mib",
        &mib.to_string(),
        "--connections",
        &connections.to_string(),
    ]);
    let mut s = Proc::spawn("link-send", send, logs)?;
    let st = s
        .wait_timeout(Duration::from_secs(300))
        .context("kvx send did not finish in 300 s")?;
    if !st.success() {
        bail!("kvx send failed: {}", s.log_tail(3));
    }
    let text = s.log_text();
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_end().ends_with("GB/s"))
        .context("no GB/s line from kvx send")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .iter()
        .rev()
        .nth(1)
        .and_then(|w| w.parse().ok())
        .context("unreadable GB/s figure")
}

fn demo(bin: &Path, logs: &Path, shape: &Shape, tokens: u64, rooms: u64) -> Result<Summary> {
    let pool = tokens.div_ceil(16) + 64;
    let summary = logs.join(format!("demo-{}-{tokens}.json", shape.key));
    let _ = std::fs::remove_file(&summary);
    let mut cmd = Command::new(bin);
    cmd.args(["demo", "--model", shape.preset])
        .args(["--tp-size", &shape.tp.to_string()])
        .args(["--prompt-tokens", &tokens.to_string()])
        .args(["--rooms", &rooms.to_string(), "--concurrency", "1"])
        .args(["--pool-pages", &pool.to_string()])
        .arg("--summary-json")
        .arg(&summary);
    let mut p = Proc::spawn(&format!("demo-{}-{tokens}", shape.key), cmd, logs)?;
    let st = p
        .wait_timeout(Duration::from_secs(600))
        .context("kvx demo did not finish in 600 s")?;
    let text = std::fs::read_to_string(&summary)
        .with_context(|| format!("kvx demo exited {st} without a summary: {}", p.log_tail(3)))?;
    Summary::parse(&text)
}

/// Tensor parallel shapes: a bootstrap server, `tp` prefill ranks and `decode_tp` decode ranks
/// (same seed, so the same rooms) on loopback; the aggregate is the sum of the decode ranks'
/// rates.
fn tp_run(bin: &Path, logs: &Path, shape: &Shape, tokens: u64, rooms: u64) -> Result<Summary> {
    let ctx = Ctx::loopback(
        Kvx::probe(bin)?,
        logs.join(format!("tp-{}-{tokens}", shape.key)),
    );
    let model = Model {
        preset: shape.preset,
        tp_size: shape.tp,
        page_size: 16,
        pool_pages: (tokens.div_ceil(16) + 64) as u32,
    };
    let boot = common::bootstrap(&ctx, 0)?;
    let popts = PrefillOpts {
        extra: common::args(shape.prefill_extra),
        ..PrefillOpts::default()
    };
    let mut prefills = Vec::new();
    for r in 0..shape.tp {
        prefills.push(common::prefill(
            &ctx,
            &format!("prefill-r{r}"),
            0,
            boot.addr,
            &model,
            r,
            &popts,
        )?);
    }
    let mut decodes = Vec::new();
    for r in 0..shape.decode_tp {
        let mut o = DecodeOpts::new(rooms as usize, tokens as usize);
        o.concurrency = 1;
        o.tp_rank = r;
        o.extra = common::args(shape.decode_extra);
        decodes.push(common::decode(
            &ctx,
            &format!("decode-r{r}"),
            0,
            boot.addr,
            &model.tp(shape.decode_tp),
            &o,
        )?);
    }
    let mut total = Summary {
        requests: rooms,
        verified: rooms,
        ..Summary::default()
    };
    for d in &mut decodes {
        let (_, s) = d.finish(Duration::from_secs(900))?;
        total.verified = total.verified.min(s.verified);
        total.succeeded = total.verified;
        total.failed = total.failed.max(s.failed);
        total.corrupt += s.corrupt;
        total.bytes += s.bytes;
        total.gbps += s.gbps;
        total.p50_ms = total.p50_ms.max(s.p50_ms);
        total.p99_ms = total.p99_ms.max(s.p99_ms);
    }
    drop(prefills);
    Ok(total)
}

/// Whether `key` is selected by `KVX_E2E_SHAPES` (`only`; empty: every shape).
fn selected(only: &str, key: &str) -> bool {
    only.is_empty() || only.split(',').any(|p| p.trim() == key)
}

/// Runs every part, shape and size that fits and returns the report section; prints the
/// engine section and, last, the `e2e/link ratio` line.
pub fn run(root: &Path) -> Result<Part> {
    let (bin, example) = match std::env::var_os("KVX_BIN_RELEASE") {
        Some(p) => {
            let bin = PathBuf::from(p);
            let example = match std::env::var_os("KVX_ENGINE_ROOMS") {
                Some(e) => PathBuf::from(e),
                None => bin
                    .parent()
                    .map(|d| d.join("examples").join("engine_rooms"))
                    .context("KVX_BIN_RELEASE has no parent folder")?,
            };
            (bin, example)
        }
        None => build_release(root)?,
    };
    let logs = crate::report::report_dir(root)
        .join("logs")
        .join("bench-e2e");
    let _ = std::fs::remove_dir_all(&logs);
    // `KVX_E2E_SHAPES=llama3-70b,llama3-8b-tp2-tp1-staging` runs only those shapes.
    let only = std::env::var("KVX_E2E_SHAPES").unwrap_or_default();
    let parts = std::env::var("KVX_E2E_PARTS").unwrap_or_default();
    let mut part = Part::default();
    let mut last_line = None;
    if selected(&parts, "engine") {
        let (rows, empty, idle, left_out) = engine_part(&bin, &example, &logs, &only);
        let idle = idle.as_ref().map(|(w, i)| (w, i));
        part = e2e_engine::part(&rows, empty.as_ref(), idle, &left_out);
        print!("{}", part.md);
        last_line = Some(e2e_engine::ratio_line(e2e_engine::ratio(&rows)));
    }
    if selected(&parts, "processes") {
        let p = processes_part(&bin, &logs, &only);
        part.md.push_str(&p.md);
        part.plots.extend(p.plots);
    }
    if let Some(line) = last_line {
        println!("{line}");
    }
    Ok(part)
}

/// The engine part: each engine shape and size that fits, beside its link test, then the
/// empty rooms and the small rooms back to back and after idling; returns the rows, the
/// empty-room run, the two small-room runs and what was left out.
#[allow(clippy::type_complexity)]
fn engine_part(
    bin: &Path,
    example: &Path,
    logs: &Path,
    only: &str,
) -> (
    Vec<EngineRow>,
    Option<EngineRun>,
    Option<(EngineRun, EngineRun)>,
    Vec<String>,
) {
    let avail = mem_available();
    let (mut rows, mut left_out) = (Vec::new(), Vec::new());
    for shape in ENGINE_SHAPES {
        if !selected(only, shape.key) {
            continue;
        }
        for &tokens in shape.tokens {
            let room = shape.bytes_per_token * tokens;
            // The prefill ranks' pools and the decode's.
            let footprint =
                2 * shape.bytes_per_token * (tokens.div_ceil(16) + 64) * 16 + shape.extra_bytes;
            if footprint > avail / 2 {
                left_out.push(format!(
                    "{} at {tokens} tokens needs about {:.1} GiB, {:.1} GiB available",
                    shape.label,
                    footprint as f64 / (1u64 << 30) as f64,
                    avail as f64 / (1u64 << 30) as f64
                ));
                continue;
            }
            let rooms = e2e_engine::rooms_for(room);
            eprintln!(
                "xtask: e2e engines {} at {tokens} tokens, {rooms} rooms",
                shape.label
            );
            let args: Vec<String> = [
                "--connections",
                &e2e_engine::CONNECTIONS.to_string(),
                "--model",
                shape.preset,
                "--tp-size",
                &shape.tp.to_string(),
                "--tokens",
                &tokens.to_string(),
                "--rooms",
                &rooms.to_string(),
            ]
            .iter()
            .chain(shape.extra)
            .map(|s| s.to_string())
            .collect();
            let name = format!("engine-{}-{tokens}", shape.key);
            // The link test brackets the row: the host's speed drifts over seconds here.
            let moved_mib = ((room * rooms) >> 20).max(64);
            let before = baseline(bin, logs, moved_mib, e2e_engine::CONNECTIONS).ok();
            let run = match e2e_engine::run_example(example, logs, &name, &args) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("xtask: {name} failed: {e:#}");
                    left_out.push(format!("{} at {tokens} tokens failed: {e:#}", shape.label));
                    continue;
                }
            };
            let after = baseline(bin, logs, moved_mib, e2e_engine::CONNECTIONS).ok();
            let links: Vec<f64> = before.into_iter().chain(after).collect();
            let link_gbps =
                (!links.is_empty()).then(|| links.iter().sum::<f64>() / links.len() as f64);
            rows.push(EngineRow {
                shape: shape.label,
                tokens,
                run,
                link_gbps,
            });
        }
    }
    let mut empty = None;
    if selected(only, e2e_engine::EMPTY_KEY) {
        eprintln!(
            "xtask: e2e engines, {} empty rooms",
            e2e_engine::EMPTY_ROOMS
        );
        let args = vec![
            "--model".to_string(),
            "tiny".to_string(),
            "--empty-rooms".to_string(),
            e2e_engine::EMPTY_ROOMS.to_string(),
        ];
        match e2e_engine::run_example(example, logs, "engine-empty-rooms", &args) {
            Ok(r) => empty = Some(r),
            Err(e) => left_out.push(format!("the empty rooms failed: {e:#}")),
        }
    }
    let mut idle = None;
    if selected(only, e2e_engine::IDLE_KEY) {
        eprintln!("xtask: e2e engines, small rooms back to back and after idling");
        let args = |gap: u64| -> Vec<String> {
            e2e_engine::IDLE_ARGS
                .iter()
                .map(|s| s.to_string())
                .chain(["--gap-ms".to_string(), gap.to_string()])
                .collect()
        };
        let warm = e2e_engine::run_example(example, logs, "engine-small-rooms", &args(0));
        let cold = e2e_engine::run_example(
            example,
            logs,
            "engine-small-rooms-idle",
            &args(e2e_engine::IDLE_GAP_MS),
        );
        match (warm, cold) {
            (Ok(w), Ok(c)) => idle = Some((w, c)),
            (Err(e), _) | (_, Err(e)) => {
                left_out.push(format!("the small rooms failed: {e:#}"));
            }
        }
    }
    (rows, empty, idle, left_out)
}

/// The processes part: every shape and size that fits through `kvx` processes.
fn processes_part(bin: &Path, logs: &Path, only: &str) -> Part {
    let avail = mem_available();
    let mut rows = Vec::new();
    let mut left_out = Vec::new();
    for shape in SHAPES {
        if !selected(only, shape.key) {
            continue;
        }
        for &tokens in TOKENS {
            let room = shape.bytes_per_token * tokens;
            let rooms = (1u64 << 30)
                .div_ceil(room * u64::from(shape.tp))
                .clamp(2, 8);
            // Prefill and decode pools of every rank.
            let footprint =
                2 * u64::from(shape.tp) * shape.bytes_per_token * (tokens.div_ceil(16) + 64) * 16;
            if footprint > avail / 2 {
                left_out.push(format!(
                    "{} at {tokens} tokens needs about {:.1} GiB, {:.1} GiB available",
                    shape.label,
                    footprint as f64 / (1u64 << 30) as f64,
                    avail as f64 / (1u64 << 30) as f64
                ));
                continue;
            }
            eprintln!(
                "xtask: e2e {} at {tokens} tokens, {rooms} rooms",
                shape.label
            );
            let run = if shape.tp == 1 && shape.decode_tp == 1 {
                demo(bin, logs, shape, tokens, rooms)
            } else {
                tp_run(bin, logs, shape, tokens, rooms)
            };
            let summary = match run {
                Ok(s) => s,
                Err(e) => {
                    eprintln!(
                        "xtask: e2e {} at {tokens} tokens failed: {e:#}",
                        shape.label
                    );
                    left_out.push(format!("{} at {tokens} tokens failed: {e:#}", shape.label));
                    continue;
                }
            };
            let moved_mib = (summary.bytes >> 20).max(64);
            let baseline_gbps = baseline(bin, logs, moved_mib, 1).ok();
            rows.push(Row {
                shape: shape.label,
                tokens,
                room_bytes: summary.bytes as f64 / summary.verified.max(1) as f64,
                summary,
                baseline_gbps,
            });
        }
    }
    part(&rows, &left_out)
}
fn part(rows: &[Row], left_out: &[String]) -> Part {
    let mut p = Part::default();
    p.heading(2, "Whole rooms end to end");
    p.para(
        "Release build, loopback TCP, one room at a time, every byte verified. TP1 shapes run \
         `kvx demo` (bootstrap server, one prefill rank and one decode in one process); the TP8 \
         shape runs a bootstrap server, 8 prefill and 8 decode processes, and its GB/s is the \
         sum of the ranks' rates and its room size the sum over ranks. The TP2->TP1 shapes run \
         2 prefill processes and one decode: by head slices (one write per token, layer, K or V \
         and rank) or through the decode's staging ring (one gathered write per 2048-token \
         chunk and rank, scattered on the decode). Beside each, the link \
         test (`kvx send` into `kvx recv`, 1 MiB writes, one connection) moves the same bytes \
         in the same run. Rerun with `cargo xtask bench e2e`.",
    );
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let s = &r.summary;
            vec![
                r.shape.to_string(),
                r.tokens.to_string(),
                svg::fmt_bytes(r.room_bytes),
                format!("{}/{}", s.verified, s.requests),
                format!("{:.2}", s.gbps),
                r.baseline_gbps
                    .map(|b| format!("{b:.2}"))
                    .unwrap_or_default(),
                r.baseline_gbps
                    .filter(|b| *b > 0.0)
                    .map(|b| format!("{:.2}", s.gbps / b))
                    .unwrap_or_default(),
                format!("{:.1}", s.p50_ms),
                format!("{:.1}", s.p99_ms),
            ]
        })
        .collect();
    p.table(
        &[
            "shape",
            "tokens",
            "room",
            "verified",
            "GB/s",
            "link GB/s",
            "ratio",
            "p50 ms",
            "p99 ms",
        ],
        &table,
    );
    if !left_out.is_empty() {
        p.para(&format!("Left out: {}.", left_out.join("; ")));
    }
    let mut plot = LinePlot::new(
        "Whole rooms: bandwidth against room size",
        "room size",
        "GB/s",
    );
    plot.log_x = true;
    plot.x_fmt = svg::fmt_bytes;
    for shape in SHAPES {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.shape == shape.label)
            .map(|r| (r.room_bytes, r.summary.gbps))
            .collect();
        if !pts.is_empty() {
            plot.series.push(Series::new(shape.label, pts));
        }
    }
    let base: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| r.baseline_gbps.map(|b| (r.room_bytes, b)))
        .collect();
    if !base.is_empty() {
        plot.series
            .push(Series::baseline("link test (same bytes)", base));
    }
    if !rows.is_empty() {
        p.plot("e2e-rooms.svg", "whole-room bandwidth", &plot);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_section_has_a_row_per_run_and_the_baseline_dashed() {
        let s = Summary {
            requests: 2,
            verified: 2,
            succeeded: 2,
            gbps: 1.5,
            bytes: 1 << 30,
            ..Summary::default()
        };
        let rows = vec![
            Row {
                shape: "Llama-3-8B TP1",
                tokens: 4096,
                room_bytes: (1u64 << 29) as f64,
                summary: s.clone(),
                baseline_gbps: Some(3.0),
            },
            Row {
                shape: "Llama-3-8B TP1",
                tokens: 8192,
                room_bytes: (1u64 << 30) as f64,
                summary: s,
                baseline_gbps: None,
            },
        ];
        let p = part(&rows, &["x needs 9 GiB".into()]);
        assert!(p.md.contains("| Llama-3-8B TP1 | 4096 | 512 MiB | 2/2 | 1.50 | 3.00 | 0.50 |"));
        assert!(p.md.contains("Left out: x needs 9 GiB."));
        assert_eq!(p.plots.len(), 1);
        assert_eq!(p.plots[0].1.matches("<polyline").count(), 2);
        assert!(p.plots[0].1.contains("stroke-dasharray"));
    }
}
