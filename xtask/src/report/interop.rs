//! `cargo xtask bench interop`: runs `cargo bench -p kvx-benches --bench interop` (release) with
//! `KVX_INTEROP_JSON` pointing into the report folder, then turns that JSON into the report's
//! "Interop with Mooncake TE" part (`bench-interop`).

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

use super::Part;

/// Runs the interop bench and writes its report part.
pub fn run(root: &Path) -> Result<()> {
    let dir = super::report_dir(root);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = dir.join("interop.json");
    let _ = std::fs::remove_file(&json);
    crate::run(crate::cargo().env("KVX_INTEROP_JSON", &json).args([
        "bench",
        "-p",
        "kvx-benches",
        "--bench",
        "interop",
    ]))?;
    let text = std::fs::read_to_string(&json)
        .with_context(|| format!("the interop bench wrote no {}", json.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
    let path = super::write_part(root, "bench-interop", &part(&v))?;
    eprintln!("xtask: report in {}", path.display());
    Ok(())
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn items(v: &Value, key: &str) -> Vec<Value> {
    v.get(key)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn s(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// The report part from the bench's JSON.
pub fn part(v: &Value) -> Part {
    let mut p = Part::default();
    p.heading(2, "Interop with Mooncake TE");
    let cfg = v.get("config").cloned().unwrap_or(Value::Null);
    p.para(&format!(
        "`cargo xtask bench interop` (`benches/benches/interop.rs`): kvx's `mooncake` backend \
         against the real Mooncake Transfer Engine 0.3.13.post1 (Python peers), loopback, {} \
         repetitions (medians; ratios are medians of paired runs). Room: Llama-3-8B TP1, 64 \
         buffers, {} tokens, page size 16, {} B per page per buffer, fragmented destination \
         pages. Bulk: {} MiB in {} KiB entries. Mooncake's initiator is given the room in \
         batches of at most {} entries (one call of more than ~2048 entries fails with lane \
         queue-full); kvx posts one batch. Wall time {:.0} s.",
        s(&cfg, "reps"),
        s(&cfg, "tokens"),
        s(&cfg, "item_len"),
        f(&cfg["bulk_bytes"]) / f64::from(1u32 << 20),
        f(&cfg["bulk_entry"]) / 1024.0,
        s(&cfg, "te_batch"),
        f(&v["wall_s"]),
    ));
    let rows: Vec<Vec<String>> = items(v, "throughput")
        .iter()
        .map(|t| {
            let runs = items(t, "runs_s")
                .iter()
                .map(|r| format!("{:.0}", f(r) * 1e3))
                .collect::<Vec<_>>()
                .join(", ");
            let cpu = items(t, "cpu_s")
                .iter()
                .map(|c| format!("{:.0}", f(c) * 1e3))
                .collect::<Vec<_>>()
                .join(" / ");
            vec![
                s(t, "shape"),
                s(t, "path"),
                s(t, "entries"),
                format!("{:.0}", f(&t["bytes"]) / f64::from(1u32 << 20)),
                format!("{:.2}", f(&t["median_gbps"])),
                format!("{:.2}", f(&t["best_gbps"])),
                runs,
                cpu,
            ]
        })
        .collect();
    p.table(
        &[
            "shape",
            "path",
            "entries",
            "MiB",
            "median GB/s",
            "best GB/s",
            "runs (ms)",
            "CPU ms per run: kvx / TE target / TE initiator",
        ],
        &rows,
    );
    let rows: Vec<Vec<String>> = items(v, "ratios")
        .iter()
        .map(|r| {
            let (val, goal) = (f(&r["value"]), f(&r["goal"]));
            vec![
                s(r, "shape"),
                s(r, "what"),
                format!("{val:.2}"),
                format!(">= {goal:.1}"),
                if val >= goal { "met" } else { "not met" }.into(),
            ]
        })
        .collect();
    p.table(&["shape", "ratio", "value", "goal", ""], &rows);
    let rows: Vec<Vec<String>> = items(v, "latency")
        .iter()
        .map(|l| {
            vec![
                s(l, "path"),
                format!("{:.0}", f(&l["p50_us"])),
                format!("{:.0}", f(&l["p99_us"])),
                s(l, "writes"),
            ]
        })
        .collect();
    p.table(&["4 KiB write", "p50 µs", "p99 µs", "writes"], &rows);
    p.para(&format!(
        "kvx configuration: `{}`; TE initiator lanes seen by the kvx target: {}.",
        s(&cfg, "kvx"),
        s(&cfg, "te_lanes_seen")
    ));
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_has_the_tables() {
        let v: Value = serde_json::from_str(
            r#"{"config":{"reps":3,"tokens":4096,"item_len":32768,"bulk_bytes":1073741824,
                "bulk_entry":4194304,"te_batch":1024,"kvx":"MooncakeConfig { .. }",
                "te_lanes_seen":4},
               "throughput":[{"shape":"room","path":"kvx -> TE","entries":8128,
                "bytes":536870912,"runs_s":[0.5,0.4],"median_gbps":1.2,"best_gbps":1.3,
                "cpu_s":[0.31,0.4,0.0]}],
               "ratios":[{"shape":"room","what":"kvx initiator / TE initiator","value":1.62,
                "goal":1.5},{"shape":"bulk","what":"x","value":0.9,"goal":1.0}],
               "latency":[{"path":"TE -> kvx","p50_us":80.4,"p99_us":200.0,"writes":2000}],
               "wall_s":95.0}"#,
        )
        .unwrap();
        let md = part(&v).md;
        assert!(md.contains("## Interop with Mooncake TE"));
        assert!(md.contains(
            "| room | kvx -> TE | 8128 | 512 | 1.20 | 1.30 | 500, 400 | 310 / 400 / 0 |"
        ));
        assert!(md.contains("| 1.62 | >= 1.5 | met |"));
        assert!(md.contains("| 0.90 | >= 1.0 | not met |"));
        assert!(md.contains("| TE -> kvx | 80 | 200 | 2000 |"));
        assert!(md.contains("1024 MiB in 4096 KiB entries"));
    }
}
