//! Turns criterion's saved results (`<target>/criterion/**/new/{benchmark,estimates}.json`) into
//! the report's benchmark section: one table per benchmark group and, for groups measured over
//! request sizes with a byte throughput, a bandwidth-against-size plot with one line per backend;
//! functions named like a baseline (`baseline`, `plain`, `memcpy`, `socket`) are drawn dashed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde_json::Value;

use super::Part;
use super::svg::{LinePlot, Series, fmt_bytes, fmt_num};

/// One criterion measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// Benchmark group.
    pub group: String,
    /// Function within the group (the backend, for transport groups).
    pub function: String,
    /// Parameter as written (a request size for transport groups).
    pub value: String,
    /// Mean time per iteration, nanoseconds.
    pub mean_ns: f64,
    /// Bytes per iteration when the bench declared a byte throughput.
    pub bytes: Option<f64>,
}

impl Measurement {
    /// Throughput in GB/s (10^9 bytes per second) when bytes are known.
    pub fn gbps(&self) -> Option<f64> {
        self.bytes
            .filter(|_| self.mean_ns > 0.0)
            .map(|b| b / self.mean_ns)
    }

    fn is_baseline(&self) -> bool {
        let f = self.function.to_ascii_lowercase();
        ["baseline", "plain", "memcpy", "socket"]
            .iter()
            .any(|k| f.contains(k))
    }
}

fn files_named(dir: &Path, name: &str, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "base" || n == "change") {
                continue;
            }
            files_named(&p, name, out);
        } else if p.file_name().is_some_and(|n| n == name)
            && p.parent()
                .and_then(Path::file_name)
                .is_some_and(|n| n == "new")
        {
            out.push(p);
        }
    }
}

/// Parses one result folder's `benchmark.json` and `estimates.json`.
pub fn parse(benchmark: &str, estimates: &str) -> Option<Measurement> {
    let b: Value = serde_json::from_str(benchmark).ok()?;
    let e: Value = serde_json::from_str(estimates).ok()?;
    let s = |v: &Value| v.as_str().map(str::to_string);
    let bytes = b.get("throughput").and_then(|t| {
        t.get("Bytes")
            .or_else(|| t.get("BytesDecimal"))
            .and_then(Value::as_f64)
    });
    Some(Measurement {
        group: s(b.get("group_id")?)?,
        function: b.get("function_id").and_then(s).unwrap_or_default(),
        value: b.get("value_str").and_then(s).unwrap_or_default(),
        mean_ns: e.get("mean")?.get("point_estimate")?.as_f64()?,
        bytes,
    })
}

/// Every measurement under `criterion_dir`, sorted by group, function and size.
pub fn collect(criterion_dir: &Path) -> Vec<Measurement> {
    let mut files = Vec::new();
    files_named(criterion_dir, "benchmark.json", &mut files);
    let mut out: Vec<Measurement> = files
        .iter()
        .filter_map(|b| {
            let e = b.with_file_name("estimates.json");
            parse(
                &std::fs::read_to_string(b).ok()?,
                &std::fs::read_to_string(e).ok()?,
            )
        })
        .collect();
    out.sort_by(|a, b| {
        (&a.group, &a.function)
            .cmp(&(&b.group, &b.function))
            .then(size_of(a).total_cmp(&size_of(b)))
    });
    out
}

/// The x value of a measurement: its parameter when numeric, else its bytes per iteration.
fn size_of(m: &Measurement) -> f64 {
    m.value.parse::<f64>().ok().or(m.bytes).unwrap_or(f64::NAN)
}

fn fmt_time(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// Builds the benchmark section from `measurements`.
pub fn part(measurements: &[Measurement]) -> Part {
    let mut p = Part::default();
    p.heading(2, "Benchmarks");
    if measurements.is_empty() {
        p.para("No criterion results found (run `cargo xtask bench`).");
        return p;
    }
    let mut groups: BTreeMap<&str, Vec<&Measurement>> = BTreeMap::new();
    for m in measurements {
        groups.entry(&m.group).or_default().push(m);
    }
    for (g, ms) in groups {
        p.heading(3, g);
        let rows: Vec<Vec<String>> = ms
            .iter()
            .map(|m| {
                vec![
                    m.function.clone(),
                    m.value.clone(),
                    fmt_time(m.mean_ns),
                    m.gbps().map(|v| format!("{v:.3}")).unwrap_or_default(),
                ]
            })
            .collect();
        p.table(&["function", "parameter", "mean time", "GB/s"], &rows);
        let mut series: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
        let mut baseline: BTreeMap<&str, bool> = BTreeMap::new();
        for m in &ms {
            if let (Some(bw), x) = (m.gbps(), size_of(m))
                && x.is_finite()
            {
                series.entry(&m.function).or_default().push((x, bw));
                baseline.insert(&m.function, m.is_baseline());
            }
        }
        if series.values().any(|pts| pts.len() >= 2) {
            let mut plot = LinePlot::new(
                &format!("{g}: bandwidth against request size"),
                "request size",
                "GB/s",
            );
            plot.log_x = true;
            plot.x_fmt = fmt_bytes;
            plot.y_fmt = fmt_num;
            for (f, pts) in series {
                let name = if f.is_empty() { g } else { f };
                plot.series
                    .push(if baseline.get(f).copied().unwrap_or(false) {
                        Series::baseline(name, pts)
                    } else {
                        Series::new(name, pts)
                    });
            }
            let file = format!(
                "bench-{}.svg",
                g.chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                    .collect::<String>()
            );
            p.plot(&file, &format!("{g} bandwidth"), &plot);
        }
    }
    p
}

/// Reads `<target>/criterion` next to the report folder and builds the section.
pub fn part_from_target(report_dir: &Path) -> Result<Part> {
    let target = report_dir.parent().unwrap_or(report_dir);
    Ok(part(&collect(&target.join("criterion"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, group: &str, func: &str, size: u64, ns: f64) {
        let d = dir
            .join(group)
            .join(func)
            .join(size.to_string())
            .join("new");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("benchmark.json"),
            format!(
                r#"{{"group_id":"{group}","function_id":"{func}","value_str":"{size}","throughput":{{"Bytes":{size}}},"full_id":"x","directory_name":"x","title":"x"}}"#
            ),
        )
        .unwrap();
        std::fs::write(
            d.join("estimates.json"),
            format!(r#"{{"mean":{{"confidence_interval":{{}},"point_estimate":{ns},"standard_error":1.0}}}}"#),
        )
        .unwrap();
    }

    #[test]
    fn reads_criterion_results_and_plots_backends_against_baselines() {
        let dir = tempfile::tempdir().unwrap();
        for (size, ns) in [(4096u64, 2000.0), (1048576, 350_000.0)] {
            write(dir.path(), "transport", "tcp", size, ns);
            write(dir.path(), "transport", "plain-socket", size, ns * 0.9);
        }
        // Stale comparison folders are ignored.
        let base = dir.path().join("transport/tcp/4096/base");
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("benchmark.json"), "{}").unwrap();
        let ms = collect(dir.path());
        assert_eq!(ms.len(), 4);
        let tcp: Vec<&Measurement> = ms.iter().filter(|m| m.function == "tcp").collect();
        assert_eq!(tcp[0].value, "4096");
        assert!((tcp[0].gbps().unwrap() - 2.048).abs() < 1e-9);
        let part = part(&ms);
        assert!(part.md.contains("### transport"));
        assert!(part.md.contains("| tcp | 4096 | 2.00 µs | 2.048 |"));
        assert_eq!(part.plots.len(), 1);
        let svg = &part.plots[0].1;
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(
            svg.matches("stroke-dasharray").count(),
            2,
            "baseline dashed in plot and legend"
        );
    }

    #[test]
    fn malformed_results_are_skipped() {
        assert!(parse("{", "{}").is_none());
        assert!(parse(r#"{"group_id":"g"}"#, r#"{"mean":{}}"#).is_none());
        let m = parse(
            r#"{"group_id":"g","function_id":null,"value_str":null,"throughput":null}"#,
            r#"{"mean":{"point_estimate":5.0}}"#,
        )
        .unwrap();
        assert_eq!(m.gbps(), None);
        assert_eq!(part(&[m]).plots.len(), 0);
    }
}
