//! The run report, `target/kvx-report/report.md`: each producer (`cargo xtask integration`,
//! `cargo xtask bench`) writes its own part (`parts/<key>.md` plus SVG plots beside it) and the
//! report is rebuilt from every part present, so one command never erases the other's results.

pub mod bench;
pub mod interop;
pub mod svg;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Order of the known parts in the report; others follow alphabetically.
const ORDER: &[&str] = &["integration", "bench-e2e", "bench-interop", "bench"];

/// The report folder: `$CARGO_TARGET_DIR/kvx-report`, else `<root>/target/kvx-report`.
pub fn report_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_relative() { root.join(t) } else { t })
        .unwrap_or_else(|| root.join("target"))
        .join("kvx-report")
}

/// One producer's section of the report, built up in Markdown.
#[derive(Debug, Default)]
pub struct Part {
    /// Markdown text.
    pub md: String,
    /// Plots to write beside the report: (file name, SVG text).
    pub plots: Vec<(String, String)>,
}

impl Part {
    /// Appends a heading.
    pub fn heading(&mut self, level: usize, text: &str) {
        let _ = writeln!(self.md, "\n{} {text}\n", "#".repeat(level.clamp(1, 6)));
    }

    /// Appends a paragraph.
    pub fn para(&mut self, text: &str) {
        let _ = writeln!(self.md, "{text}\n");
    }

    /// Appends a Markdown table.
    pub fn table(&mut self, headers: &[&str], rows: &[Vec<String>]) {
        self.md.push_str(&table(headers, rows));
        self.md.push('\n');
    }

    /// Adds a plot file and an image link to it.
    pub fn plot(&mut self, file: &str, alt: &str, plot: &svg::LinePlot) {
        self.plots.push((file.to_string(), plot.render()));
        let _ = writeln!(self.md, "![{}]({file})\n", alt.replace(['[', ']'], ""));
    }
}

/// A Markdown table; `|` in cells is escaped.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let cell = |s: &str| s.replace('|', "\\|").replace('\n', " ");
    let mut o = String::new();
    let _ = writeln!(
        o,
        "| {} |",
        headers
            .iter()
            .map(|h| cell(h))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(o, "|{}", "---|".repeat(headers.len()));
    for r in rows {
        let _ = writeln!(
            o,
            "| {} |",
            r.iter().map(|c| cell(c)).collect::<Vec<_>>().join(" | ")
        );
    }
    o
}

/// Writes `part` as `key` into the report folder under `root` and rebuilds `report.md`;
/// returns the report's path.
pub fn write_part(root: &Path, key: &str, part: &Part) -> Result<PathBuf> {
    write_part_in(&report_dir(root), key, part)
}

fn write_part_in(dir: &Path, key: &str, part: &Part) -> Result<PathBuf> {
    let parts = dir.join("parts");
    std::fs::create_dir_all(&parts).with_context(|| format!("creating {}", parts.display()))?;
    for (file, svg) in &part.plots {
        std::fs::write(dir.join(file), svg)?;
    }
    std::fs::write(parts.join(format!("{key}.md")), &part.md)?;
    rebuild(dir)
}

fn rebuild(dir: &Path) -> Result<PathBuf> {
    let mut keys: Vec<String> = std::fs::read_dir(dir.join("parts"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".md"))
                .map(str::to_string)
        })
        .collect();
    keys.sort_by_key(|k| {
        (
            ORDER.iter().position(|o| o == k).unwrap_or(ORDER.len()),
            k.clone(),
        )
    });
    let mut md = String::from(
        "# kvx report\n\nWritten by `cargo xtask integration` and `cargo xtask bench`; each section \
         shows the run that last wrote it. Plots are SVG files beside this one.\n",
    );
    for k in keys {
        md.push_str(&std::fs::read_to_string(
            dir.join("parts").join(format!("{k}.md")),
        )?);
    }
    let out = dir.join("report.md");
    std::fs::write(&out, md)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_kept_and_ordered() {
        let dir = tempfile::tempdir().unwrap();
        let mut bench = Part::default();
        bench.heading(2, "Benchmarks");
        bench.table(&["size", "GB/s"], &[vec!["4 KiB".into(), "1|2".into()]]);
        let mut p = svg::LinePlot::new("t", "x", "y");
        p.series.push(svg::Series::new("s", vec![(1.0, 1.0)]));
        bench.plot("bw.svg", "bandwidth [tcp]", &p);
        write_part_in(dir.path(), "bench", &bench).unwrap();
        let mut integ = Part::default();
        integ.heading(2, "Integration");
        integ.para("3 passed, 0 failed");
        let out = write_part_in(dir.path(), "integration", &integ).unwrap();
        let md = std::fs::read_to_string(out).unwrap();
        let (i, b) = (
            md.find("## Integration").unwrap(),
            md.find("## Benchmarks").unwrap(),
        );
        assert!(i < b, "integration comes first");
        assert!(md.contains("| 4 KiB | 1\\|2 |"));
        assert!(md.contains("![bandwidth tcp](bw.svg)"));
        assert!(dir.path().join("bw.svg").exists());
        // Rewriting one part replaces it and keeps the other.
        integ.para("again");
        let md = std::fs::read_to_string(write_part_in(dir.path(), "integration", &integ).unwrap())
            .unwrap();
        assert_eq!(md.matches("## Integration").count(), 1);
        assert!(md.contains("again") && md.contains("## Benchmarks"));
    }
}
