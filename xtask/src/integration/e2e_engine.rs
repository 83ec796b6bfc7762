//! The engine-only half of `cargo xtask bench e2e` (issue 15, items 4 and 5): whole rooms
//! through `PrefillEngine` and `DecodeEngine` in one process (`kvx-cli`'s `engine_rooms`
//! example), with the synthetic model's fill before each room's clock starts and the byte
//! verification after it stops. This module reads that example's `--json` output, turns it into
//! throughput and latency figures (`EngineRun`), lays out the report table beside the link test
//! of the same run and computes the `e2e/link ratio` line: the smallest engine-throughput /
//! link-test quotient over the shapes that ran. Empty rooms (no KV page) give the control
//! overhead: last chunk handed over → decode sees Success.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::proc::Proc;
use crate::report::Part;
use crate::report::svg;

/// A shape the engine harness runs (decode TP 1).
pub struct EngineShape {
    /// Table label.
    pub label: &'static str,
    /// `KVX_E2E_SHAPES` key (the process-based shape of the same model shares it).
    pub key: &'static str,
    /// `--model` of the example.
    pub preset: &'static str,
    /// Prefill attention-TP size.
    pub tp: u32,
    /// KV bytes per token of the whole model (memory guard and room count only).
    pub bytes_per_token: u64,
    /// Prompt lengths measured.
    pub tokens: &'static [u64],
    /// Extra flags of the example.
    pub extra: &'static [&'static str],
    /// Memory the engines allocate beyond the pools (staging buffers and ring; memory guard).
    pub extra_bytes: u64,
}

/// Staging with 2048-token chunks (256 MiB at decode TP 1) and a 1 GiB ring, as the processes
/// table's staging shape.
const STAGING: &[&str] = &[
    "--staging-ring-mib",
    "1024",
    "--chunked-prefill-size",
    "2048",
];

/// Issue 15 item 4's shapes.
pub const ENGINE_SHAPES: &[EngineShape] = &[
    EngineShape {
        label: "Llama-3-8B TP1",
        key: "llama3-8b",
        preset: "llama3-8b",
        tp: 1,
        bytes_per_token: 32 * 2 * 8 * 128 * 2,
        tokens: &[4096, 32768],
        extra: &[],
        extra_bytes: 0,
    },
    EngineShape {
        label: "DeepSeek-V3 MLA",
        key: "deepseek-v3",
        preset: "deepseek-v3",
        tp: 1,
        bytes_per_token: 61 * 576 * 2,
        tokens: &[4096],
        extra: &[],
        extra_bytes: 0,
    },
    EngineShape {
        label: "Llama-3-8B TP2->TP1 head slices",
        key: "llama3-8b-tp2-tp1",
        preset: "llama3-8b",
        tp: 2,
        bytes_per_token: 32 * 2 * 8 * 128 * 2,
        tokens: &[4096],
        extra: &[],
        extra_bytes: 0,
    },
    EngineShape {
        label: "Llama-3-8B TP2->TP1 staging",
        key: "llama3-8b-tp2-tp1-staging",
        preset: "llama3-8b",
        tp: 2,
        bytes_per_token: 32 * 2 * 8 * 128 * 2,
        tokens: &[4096],
        extra: STAGING,
        // The ring (each rank sends all its heads: no staging buffer is allocated).
        extra_bytes: 1 << 30,
    },
];

/// Data-plane connections per decode session of every prefill rank, and of the link test beside
/// it (so that the quotient compares the same connection count).
pub const CONNECTIONS: usize = 2;

/// `KVX_E2E_SHAPES` key of the empty-room measurement.
pub const EMPTY_KEY: &str = "empty-room";

/// Empty rooms measured per run.
pub const EMPTY_ROOMS: u64 = 2000;

/// `KVX_E2E_SHAPES` key of the small rooms measured back to back and after idling.
pub const IDLE_KEY: &str = "idle-rooms";

/// The small rooms' arguments: 8 rooms of 256 Tiny tokens, each after a 5 ms forward pass.
pub const IDLE_ARGS: &[&str] = &[
    "--model",
    "tiny",
    "--tokens",
    "256",
    "--rooms",
    "8",
    "--forward-ms",
    "5",
];

/// Idle time before each small room in the second run: longer than the engines' data-session
/// idle limit (2 s), so every room finds its queue's session closed.
pub const IDLE_GAP_MS: u64 = 2500;

/// Rooms per shape and size: about 2 GiB in all, at least 4 (so that p99 is not p50), at most 16.
pub fn rooms_for(room_bytes: u64) -> u64 {
    (2u64 << 30).div_ceil(room_bytes.max(1)).clamp(4, 16)
}

/// One room as the example measured it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoomFig {
    /// Verified bytes (0 when the room did not verify).
    pub bytes: u64,
    /// Every byte matched the pattern.
    pub verified: bool,
    /// Decode opens the room → decode sees Success, seconds.
    pub wall_s: f64,
    /// Decode opens the room → the first prefill rank's `Ready`.
    pub ready_s: f64,
    /// First chunk handed to a prefill engine → decode sees Success.
    pub window_s: f64,
    /// Last chunk handed over → decode sees Success.
    pub control_s: f64,
}

/// One run of the example.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineRun {
    /// The measured rooms, in order.
    pub rooms: Vec<RoomFig>,
    /// Seconds the synthetic model spent filling pages (off the clock).
    pub fill_s: f64,
    /// Seconds spent verifying (off the clock).
    pub verify_s: f64,
    /// `memcpy` into the shape's destination pattern over a contiguous copy of the same bytes
    /// (`None`: the pattern is contiguous).
    pub copy_pattern_ratio: Option<f64>,
    /// Empty rooms: the control path's floor on this host (a plain TCP write + ack, then one
    /// ZMQ message), p50 and p99 in µs.
    pub floor_us: Option<(f64, f64)>,
    /// The floor's parts at p50, µs: the write and its acknowledgement, then the message.
    pub floor_parts_p50_us: Option<(f64, f64)>,
}

fn num(v: &Value, key: &str) -> Result<f64> {
    v.get(key)
        .and_then(Value::as_f64)
        .filter(|x| x.is_finite() && *x >= 0.0)
        .with_context(|| format!("`{key}` missing or not a non-negative number"))
}

impl EngineRun {
    /// Parses the example's `--json` output.
    pub fn parse(text: &str) -> Result<EngineRun> {
        let v: Value = serde_json::from_str(text).context("engine_rooms JSON")?;
        let rooms = v
            .get("rooms")
            .and_then(Value::as_array)
            .context("`rooms` missing or not an array")?;
        let optional = |key: &str| match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => num(&v, key).map(Some),
        };
        let (floor_us, floor_parts_p50_us) = match v.get("floor") {
            None | Some(Value::Null) => (None, None),
            Some(f) => {
                let parts = match (f.get("write_ack_p50_us"), f.get("message_p50_us")) {
                    (Some(_), Some(_)) => Some((
                        num(f, "write_ack_p50_us").context("floor")?,
                        num(f, "message_p50_us").context("floor")?,
                    )),
                    _ => None,
                };
                let total = (
                    num(f, "p50_us").context("floor")?,
                    num(f, "p99_us").context("floor")?,
                );
                (Some(total), parts)
            }
        };
        let mut out = EngineRun {
            fill_s: num(&v, "fill_s")?,
            verify_s: num(&v, "verify_s")?,
            rooms: Vec::with_capacity(rooms.len()),
            copy_pattern_ratio: optional("copy_pattern_ratio")?,
            floor_us,
            floor_parts_p50_us,
        };
        for (i, r) in rooms.iter().enumerate() {
            let fig = || -> Result<RoomFig> {
                Ok(RoomFig {
                    bytes: r
                        .get("bytes")
                        .and_then(Value::as_u64)
                        .context("`bytes` missing")?,
                    verified: r
                        .get("verified")
                        .and_then(Value::as_bool)
                        .context("`verified` missing")?,
                    wall_s: num(r, "wall_s")?,
                    ready_s: num(r, "ready_s")?,
                    window_s: num(r, "window_s")?,
                    control_s: num(r, "control_s")?,
                })
            };
            out.rooms.push(fig().with_context(|| format!("room {i}"))?);
        }
        Ok(out)
    }

    /// Rooms that verified.
    pub fn verified(&self) -> usize {
        self.rooms.iter().filter(|r| r.verified).count()
    }

    /// Verified bytes.
    pub fn bytes(&self) -> u64 {
        self.rooms.iter().map(|r| r.bytes).sum()
    }

    fn rate(&self, f: impl Fn(&RoomFig) -> f64) -> f64 {
        let s: f64 = self.rooms.iter().map(f).sum();
        if s > 0.0 {
            self.bytes() as f64 / s / 1e9
        } else {
            0.0
        }
    }

    /// Engine throughput, GB/s: verified bytes over the rooms' open → Success times.
    pub fn gbps(&self) -> f64 {
        self.rate(|r| r.wall_s)
    }

    /// GB/s over the transfer windows (first chunk handed over → Success).
    pub fn window_gbps(&self) -> f64 {
        self.rate(|r| r.window_s)
    }

    /// The `q` quantile (nearest rank, as kvx's summaries) of a per-room figure.
    pub fn quantile(&self, f: impl Fn(&RoomFig) -> f64, q: f64) -> f64 {
        let mut v: Vec<f64> = self.rooms.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return 0.0;
        }
        let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    }
}

/// Runs the example once; `args` are its flags besides `--json`.
pub fn run_example(example: &Path, logs: &Path, name: &str, args: &[String]) -> Result<EngineRun> {
    let json = logs.join(format!("{name}.json"));
    let _ = std::fs::remove_file(&json);
    let mut cmd = Command::new(example);
    cmd.args(args).arg("--json").arg(&json);
    let mut p = Proc::spawn(name, cmd, logs)?;
    let st = p
        .wait_timeout(Duration::from_secs(900))
        .with_context(|| format!("{name} did not finish in 900 s"))?;
    if !st.success() {
        bail!("{name} exited {st}: {}", p.log_tail(3));
    }
    let text = std::fs::read_to_string(&json)
        .with_context(|| format!("{name} wrote no JSON: {}", p.log_tail(3)))?;
    EngineRun::parse(&text)
}

/// One measured shape beside its link test.
pub struct EngineRow {
    /// Shape label.
    pub shape: &'static str,
    /// Prompt tokens per room.
    pub tokens: u64,
    /// The run.
    pub run: EngineRun,
    /// The link test moving the same bytes just before and just after the row (their mean),
    /// GB/s.
    pub link_gbps: Option<f64>,
}

/// The smallest engine / link-test quotient over `rows` (`None` when no row has a link test).
pub fn ratio(rows: &[EngineRow]) -> Option<f64> {
    rows.iter()
        .filter_map(|r| r.link_gbps.filter(|b| *b > 0.0).map(|b| r.run.gbps() / b))
        .min_by(f64::total_cmp)
}

/// The bench's last line.
pub fn ratio_line(r: Option<f64>) -> String {
    match r {
        Some(r) => format!("e2e/link ratio: {r:.2}"),
        None => "e2e/link ratio: none (no engine shape ran beside a link test)".into(),
    }
}

/// The engine section of the report: whole rooms, then the empty rooms.
pub fn part(
    rows: &[EngineRow],
    empty: Option<&EngineRun>,
    idle: Option<(&EngineRun, &EngineRun)>,
    left_out: &[String],
) -> Part {
    let mut p = Part::default();
    p.heading(2, "Whole rooms, engines only");
    p.para(
        "Release build, loopback TCP, one room at a time, `PrefillEngine`s and one \
         `DecodeEngine` (decode TP 1) in one process (`cargo run --release -p kvx-cli --example \
         engine_rooms`). Each room's source pages are filled before its clock starts and \
         verified after it stops; one clock: wall = decode opens the room → decode sees Success, \
         window = first chunk handed to a prefill engine (first write posted) → Success. GB/s = \
         verified bytes over the summed wall times (the engine throughput) or window times. \
         Each prefill rank has 2 data connections to the decode; beside each row, the link \
         test (`kvx send --connections 2` into `kvx recv`, 1 MiB writes) moves the same bytes \
         just before and just after the engine run (link GB/s: their mean, so that the host's \
         drift during the row counts on both sides); ratio = engine GB/s / link GB/s (TP 2: \
         2 ranks, so 4 connections in all against the link test's 2). Copy pattern: after the \
         rooms, a plain `memcpy` into the shape's destination pattern (TP 2 → TP 1: a rank's \
         heads of each token, at a token row's stride) over a contiguous copy of the same \
         bytes — what any copy into those pages pays on this host, the receiver's kernel copy \
         included; read the TP 2 rows' ratio against it. Rerun with \
         `KVX_E2E_PARTS=engine cargo xtask bench e2e`.",
    );
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let s = &r.run;
            let ms = |f: fn(&RoomFig) -> f64, q| format!("{:.1}", s.quantile(f, q) * 1e3);
            let room = s.bytes() as f64 / s.verified().max(1) as f64;
            vec![
                r.shape.to_string(),
                r.tokens.to_string(),
                svg::fmt_bytes(room),
                format!("{}/{}", s.verified(), s.rooms.len()),
                format!("{:.2}", s.gbps()),
                format!("{:.2}", s.window_gbps()),
                r.link_gbps.map(|b| format!("{b:.2}")).unwrap_or_default(),
                r.link_gbps
                    .filter(|b| *b > 0.0)
                    .map(|b| format!("{:.2}", s.gbps() / b))
                    .unwrap_or_default(),
                ms(|f| f.wall_s, 0.5),
                ms(|f| f.wall_s, 0.99),
                ms(|f| f.window_s, 0.5),
                ms(|f| f.ready_s, 0.5),
                s.copy_pattern_ratio
                    .map(|c| format!("{c:.2}"))
                    .unwrap_or_else(|| "contiguous".into()),
            ]
        })
        .collect();
    p.table(
        &[
            "shape",
            "tokens",
            "room",
            "verified",
            "engine GB/s",
            "window GB/s",
            "link GB/s",
            "ratio",
            "wall p50 ms",
            "wall p99 ms",
            "window p50 ms",
            "ready p50 ms",
            "copy pattern",
        ],
        &table,
    );
    if let Some(e) = empty {
        let us = |f: fn(&RoomFig) -> f64, q| format!("{:.0}", e.quantile(f, q) * 1e6);
        p.para(&format!(
            "Empty rooms (no KV page: the aux row and the status), {} measured after one \
             warm-up, same process: last chunk handed over → decode sees Success p50 {} µs, \
             p90 {} µs, p99 {} µs, max {} µs (goal p99 ≤ 200 µs); whole room (decode opens it → \
             Success) p50 {} µs, p99 {} µs.",
            e.rooms.len(),
            us(|f| f.control_s, 0.5),
            us(|f| f.control_s, 0.9),
            us(|f| f.control_s, 0.99),
            us(|f| f.control_s, 1.0),
            us(|f| f.wall_s, 0.5),
            us(|f| f.wall_s, 0.99),
        ));
        if let Some((p50, p99)) = e.floor_us {
            let parts = e
                .floor_parts_p50_us
                .map(|(w, m)| {
                    format!(" (p50 of the parts: write + ack {w:.0} µs, message {m:.0} µs)")
                })
                .unwrap_or_default();
            p.para(&format!(
                "Floor of that path on this host, same run, no engine: a 64-byte write on a \
                 plain TCP connection and its 8-byte acknowledgement (the aux row's write), then \
                 one 3-frame ZMQ PUSH → PULL message seen by a blocked thread (the status): p50 \
                 {p50:.0} µs, p99 {p99:.0} µs{parts}. The engines add their hand-offs between \
                 threads (embedder → loop → transfer worker → loop; decode task → embedder) to it."
            ));
        }
    }
    if let Some((warm, idle)) = idle {
        let us = |r: &EngineRun, q| format!("{:.0}", r.quantile(|f| f.window_s, q) * 1e6);
        p.para(&format!(
            "Small rooms (Tiny, 256 tokens; {} measured, each after a 5 ms forward pass): \
             transfer window p50 {} µs, max {} µs back to back; p50 {} µs, max {} µs when each \
             room follows {IDLE_GAP_MS} ms of idle (its transfer queue's data session closed \
             meanwhile and is opened again while its forward pass runs).",
            warm.rooms.len(),
            us(warm, 0.5),
            us(warm, 1.0),
            us(idle, 0.5),
            us(idle, 1.0),
        ));
    }
    if !left_out.is_empty() {
        p.para(&format!("Left out: {}.", left_out.join("; ")));
    }
    p.para(&format!("`{}`", ratio_line(ratio(rows))));
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"{
        "model": "Llama3_8b", "prefill_tp": 1, "decode_tp": 1, "tokens": 4096,
        "pages_per_room": 256, "fill_s": 1.5, "verify_s": 0.75,
        "rooms": [
            {"room": 2, "verified": true, "bytes": 1000000000, "wall_s": 1.0,
             "ready_s": 0.001, "window_s": 0.5, "control_s": 0.0001},
            {"room": 3, "verified": true, "bytes": 1000000000, "wall_s": 3.0,
             "ready_s": 0.002, "window_s": 1.5, "control_s": 0.0003}
        ],
        "copy_pattern_ratio": 0.5, "floor": {"p50_us": 90.0, "p99_us": 180.0,
            "write_ack_p50_us": 40.0, "message_p50_us": 50.0}
    }"#;

    #[test]
    fn the_example_output_parses_into_rates_and_quantiles() {
        let r = EngineRun::parse(JSON).expect("parses");
        assert_eq!(r.rooms.len(), 2);
        assert_eq!(r.verified(), 2);
        assert_eq!(r.bytes(), 2_000_000_000);
        assert!((r.fill_s - 1.5).abs() < 1e-12);
        assert!((r.gbps() - 0.5).abs() < 1e-12, "2 GB over 4 s");
        assert!((r.window_gbps() - 1.0).abs() < 1e-12, "2 GB over 2 s");
        assert!((r.quantile(|f| f.wall_s, 0.5) - 1.0).abs() < 1e-12);
        assert!((r.quantile(|f| f.wall_s, 0.99) - 3.0).abs() < 1e-12);
        assert!((r.quantile(|f| f.control_s, 1.0) - 0.0003).abs() < 1e-12);
        assert_eq!(r.copy_pattern_ratio, Some(0.5));
        assert_eq!(r.floor_us, Some((90.0, 180.0)));
        assert_eq!(r.floor_parts_p50_us, Some((40.0, 50.0)));
        // All optional: an older example's output still parses.
        let old = JSON.replacen(
            r#""copy_pattern_ratio": 0.5, "floor": {"p50_us": 90.0, "p99_us": 180.0,
            "write_ack_p50_us": 40.0, "message_p50_us": 50.0}"#,
            r#""copy_pattern_ratio": null"#,
            1,
        );
        let r = EngineRun::parse(&old).expect("parses");
        assert_eq!((r.copy_pattern_ratio, r.floor_us), (None, None));
        assert_eq!(r.floor_parts_p50_us, None);
        let bad = JSON.replacen("\"p99_us\": 180.0", "\"p99_us\": \"x\"", 1);
        assert!(EngineRun::parse(&bad).is_err());
    }

    #[test]
    fn malformed_output_is_an_error_naming_the_field() {
        assert!(EngineRun::parse("not json").is_err());
        assert!(EngineRun::parse(r#"{"fill_s": 1, "verify_s": 1}"#).is_err());
        let bad = JSON.replacen("\"wall_s\": 1.0", "\"wall_s\": -1.0", 1);
        let e = EngineRun::parse(&bad).expect_err("negative time");
        assert!(format!("{e:#}").contains("wall_s"), "{e:#}");
        let bad = JSON.replacen("\"bytes\": 1000000000,", "", 1);
        assert!(EngineRun::parse(&bad).is_err());
    }

    #[test]
    fn the_ratio_is_the_smallest_engine_to_link_quotient() {
        let run = EngineRun::parse(JSON).expect("parses");
        let row = |link| EngineRow {
            shape: "s",
            tokens: 4096,
            run: run.clone(),
            link_gbps: link,
        };
        assert_eq!(ratio(&[]), None);
        assert_eq!(ratio(&[row(None)]), None);
        let r = ratio(&[row(Some(1.0)), row(Some(2.0)), row(None)]).expect("a ratio");
        assert!((r - 0.25).abs() < 1e-12, "0.5 GB/s against 2 GB/s");
        assert_eq!(ratio_line(Some(0.25)), "e2e/link ratio: 0.25");
        assert!(ratio_line(None).starts_with("e2e/link ratio: none"));
    }

    #[test]
    fn the_section_shows_rates_beside_the_link_and_the_empty_room_quantiles() {
        let run = EngineRun::parse(JSON).expect("parses");
        let rows = vec![EngineRow {
            shape: "Llama-3-8B TP1",
            tokens: 4096,
            run: run.clone(),
            link_gbps: Some(2.0),
        }];
        let p = part(&rows, Some(&run), Some((&run, &run)), &["x failed".into()]);
        assert!(
            p.md.contains("| Llama-3-8B TP1 | 4096 | 953.7 MiB | 2/2 | 0.50 | 1.00 | 2.00 | 0.25 | 1000.0 | 3000.0 | 500.0 | 1.0 | 0.50 |"),
            "{}",
            p.md
        );
        assert!(p.md.contains("p50 100 µs"), "{}", p.md);
        assert!(p.md.contains("p99 300 µs"), "{}", p.md);
        assert!(
            p.md.contains(
                "p50 90 µs, p99 180 µs (p50 of the parts: write + ack 40 µs, message 50 µs)"
            ),
            "{}",
            p.md
        );
        assert!(
            p.md.contains("p50 500000 µs, max 1500000 µs back to back"),
            "{}",
            p.md
        );
        assert!(p.md.contains("Left out: x failed."));
        assert!(p.md.contains("`e2e/link ratio: 0.25`"));
    }

    #[test]
    fn room_counts_stay_between_4_and_16() {
        assert_eq!(rooms_for(4 << 30), 4);
        assert_eq!(rooms_for(512 << 20), 4);
        assert_eq!(rooms_for(256 << 20), 8);
        assert_eq!(rooms_for(1 << 20), 16);
        assert_eq!(rooms_for(0), 16);
    }
}
