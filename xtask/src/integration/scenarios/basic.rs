//! Scenarios without faults: equal TP, heterogeneous TP both ways, and MLA with dummy prefill
//! ranks. Every room's bytes are verified by the decode against the prefill's pattern, and every
//! prefill must end with no live per-room entry.

use std::time::Duration;

use anyhow::Result;

use super::common::{self, DecodeOpts, Model, PrefillOpts, Summary};
use crate::integration::metrics::{Absent, Metrics};
use crate::integration::{Ctx, Verdict};

/// How long a decode run of the short profile may take (debug build on 2 busy cores).
const RUN: Duration = Duration::from_secs(120);

/// Checks one decode's outcome: exit 0, every room verified, none corrupt.
fn check(name: &str, code: i32, s: &Summary) -> Option<String> {
    if code != 0 || s.verified != s.requests || s.corrupt != 0 {
        Some(format!(
            "{name}: exit {code}, {}; {}",
            s.figures(),
            s.top_reason()
        ))
    } else {
        None
    }
}

/// `happy-tp1`: several rooms prefill TP1 → decode TP1 on another host.
pub fn happy_tp1(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(ctx, &["bootstrap", "prefill", "decode --summary-json"]) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 160);
    let (boot, p) = common::bootstrap_and_prefill(ctx, &model)?;
    let mut o = DecodeOpts::new(common::sized(ctx, 16, 200), 128);
    o.tokens_max = Some(384);
    let mut d = common::decode(ctx, "decode", 1, boot.addr, &model, &o)?;
    let (code, s) = d.finish(RUN)?;
    ctx.latencies_ms.extend(&s.latencies_ms);
    if let Some(why) = check("decode", code, &s) {
        return Ok(Verdict::Fail(why));
    }
    let left = common::drained(ctx, &p, Duration::from_secs(5))?;
    if left != 0.0 {
        return Ok(Verdict::Fail(format!(
            "{}; prefill still holds {left} room entries",
            s.figures()
        )));
    }
    Ok(Verdict::Pass(format!(
        "{}; 0 room entries left",
        s.figures()
    )))
}

/// Prefill TP `pt` (ranks on hosts 0 and 2) → decode TP `dt` (ranks on hosts 1 and 2).
fn hetero_case(
    ctx: &mut Ctx,
    model: &Model,
    pt: u32,
    dt: u32,
    requests: usize,
    extra: &Extra,
) -> Result<Result<String, String>> {
    let popts = PrefillOpts {
        extra: extra.prefill.clone(),
        ..PrefillOpts::default()
    };
    let boot = common::bootstrap(ctx, 0)?;
    let mut prefills = Vec::new();
    for r in 0..pt {
        let host = if r == 0 { 0 } else { 2 };
        prefills.push(common::prefill(
            ctx,
            &format!("prefill-tp{pt}-r{r}"),
            host,
            boot.addr,
            &model.tp(pt),
            r,
            &popts,
        )?);
    }
    let mut decodes = Vec::new();
    for r in 0..dt {
        let mut o = DecodeOpts::new(requests, 256);
        o.tp_rank = r;
        o.extra = extra.decode.clone();
        let host = if r == 0 { 1 } else { 2 };
        decodes.push(common::decode(
            ctx,
            &format!("decode-tp{dt}-r{r}-from-tp{pt}"),
            host,
            boot.addr,
            &model.tp(dt),
            &o,
        )?);
    }
    let mut figures = Vec::new();
    for (r, d) in decodes.iter_mut().enumerate() {
        let (code, s) = d.finish(RUN)?;
        ctx.latencies_ms.extend(&s.latencies_ms);
        if let Some(why) = check(&format!("TP{pt}->TP{dt} decode rank {r}"), code, &s) {
            // The decode only sees status 0; the prefill's log has the reason.
            let cause = prefills
                .iter()
                .find_map(|p| common::first_failure_reason(&p.proc))
                .map(|r| format!(" (prefill: {r})"))
                .unwrap_or_default();
            return Ok(Err(format!("{why}{cause}")));
        }
        if extra.staged && s.staged_chunks == 0 {
            return Ok(Err(format!(
                "TP{pt}->TP{dt} decode rank {r}: no chunk came through the staging ring"
            )));
        }
        let staged = if extra.staged {
            format!(", {} chunks staged", s.staged_chunks)
        } else {
            String::new()
        };
        figures.push(format!(
            "rank {r}: {}/{} verified{staged}",
            s.verified, s.requests
        ));
    }
    for p in &prefills {
        let left = common::drained(ctx, p, Duration::from_secs(5))?;
        if left != 0.0 {
            return Ok(Err(format!(
                "TP{pt}->TP{dt}: {} still holds {left} room entries",
                p.proc.name()
            )));
        }
    }
    Ok(Ok(format!("TP{pt}->TP{dt} ({})", figures.join(", "))))
}

/// `hetero-tp`: prefill TP2 → decode TP1 and TP1 → TP2 (no staging), bytes verified.
pub fn hetero_tp(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(ctx, &["bootstrap", "prefill --tp-size", "decode --tp-rank"]) {
        return Ok(v);
    }
    hetero(ctx, &Extra::default())
}

/// Extra flags of the hetero-TP cases.
#[derive(Default)]
struct Extra {
    prefill: Vec<String>,
    decode: Vec<String>,
    /// Rooms must come through the staging ring.
    staged: bool,
}

fn hetero(ctx: &mut Ctx, extra: &Extra) -> Result<Verdict> {
    let model = Model::new("llama3-8b", 96);
    let n = common::sized(ctx, 8, 100);
    // Both directions run even when the first fails, so the verdict tells about each.
    let mut figures = Vec::new();
    let mut failed = false;
    for (pt, dt) in [(2, 1), (1, 2)] {
        match hetero_case(ctx, &model, pt, dt, n, extra)? {
            Ok(f) => figures.push(f),
            Err(why) => {
                failed = true;
                figures.push(why);
            }
        }
    }
    if failed {
        return Ok(Verdict::Fail(figures.join(" | ")));
    }
    Ok(Verdict::Pass(format!(
        "{}; 0 room entries left",
        figures.join("; ")
    )))
}

/// `hetero-tp-staging`: the same through the staging buffers (`--staging` on both sides), when
/// the binary offers them.
pub fn hetero_tp_staging(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(ctx, &["bootstrap", "prefill --staging", "decode --staging"]) {
        return Ok(v);
    }
    // A 64-token grid: 4 chunks per 256-token room. Llama-3-8B chunks are 8 MiB at decode TP 1
    // (4 MiB at TP 2); a 12 MiB ring holds one and a half, so rooms wrap the ring and writers
    // wait for watermarks.
    let grid = ["--staging", "--chunked-prefill-size", "64"];
    let mut decode = common::args(&grid);
    decode.extend(common::args(&["--staging-ring-mib", "12"]));
    hetero(
        ctx,
        &Extra {
            prefill: common::args(&grid),
            decode,
            staged: true,
        },
    )
}

/// Why the bytes of `mla-dummy` are wrong, if they are: the real rank must report
/// `kvx_transfer_bytes_total` and have written something; the dummy, a live prefill rank (it
/// exports `kvx_live_workers`), must have written nothing (its byte counter absent or 0: the
/// exporter lists a counter only from its first increment).
fn mla_bytes_check(real: &Result<f64, Absent>, dummy: &Metrics) -> Option<String> {
    let dummy_bytes = dummy.events("kvx_transfer_bytes_total", &[]);
    match real {
        Err(e) => Some(format!("real rank 0: {e}")),
        Ok(b) if *b <= 0.0 => Some("real rank 0 wrote 0 bytes".into()),
        Ok(_) if dummy.get("kvx_live_workers").is_err() => {
            Some("dummy rank 1: no kvx_live_workers (not a prefill's /metrics?)".into())
        }
        Ok(_) if dummy_bytes != 0.0 => Some(format!(
            "dummy rank 1 wrote {dummy_bytes} bytes (a dummy must write nothing)"
        )),
        Ok(_) => None,
    }
}

/// `mla-dummy`: DeepSeek-V3 (MLA) prefill TP2 → decode TP1: rank 1 is a dummy.
pub fn mla_dummy(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(ctx, &["bootstrap", "prefill --tp-size", "decode --tp-rank"]) {
        return Ok(v);
    }
    let model = Model::new("deepseek-v3", 96);
    let n = common::sized(ctx, 8, 100);
    let boot = common::bootstrap(ctx, 0)?;
    let p0 = common::prefill(
        ctx,
        "prefill-r0",
        0,
        boot.addr,
        &model.tp(2),
        0,
        &PrefillOpts::default(),
    )?;
    let p1 = common::prefill(
        ctx,
        "prefill-r1",
        2,
        boot.addr,
        &model.tp(2),
        1,
        &PrefillOpts::default(),
    )?;
    let mut d = common::decode(
        ctx,
        "decode",
        1,
        boot.addr,
        &model,
        &DecodeOpts::new(n, 256),
    )?;
    let (code, s) = d.finish(RUN)?;
    ctx.latencies_ms.extend(&s.latencies_ms);
    if let Some(why) = check("decode", code, &s) {
        return Ok(Verdict::Fail(why));
    }
    let real = ctx.scrape(0, p0.metrics)?.get("kvx_transfer_bytes_total");
    let dummy = ctx.scrape(2, p1.metrics)?;
    if let Some(why) = mla_bytes_check(&real, &dummy) {
        return Ok(Verdict::Fail(format!("{why}; {}", s.figures())));
    }
    let real = real.unwrap_or_default();
    for p in [&p0, &p1] {
        let left = common::drained(ctx, p, Duration::from_secs(5))?;
        if left != 0.0 {
            return Ok(Verdict::Fail(format!(
                "{}; {} still holds {left} room entries",
                s.figures(),
                p.proc.name()
            )));
        }
    }
    Ok(Verdict::Pass(format!(
        "{}; rank 0 wrote {:.1} MiB, dummy rank 1 wrote 0; 0 room entries left",
        s.figures(),
        real / (1u64 << 20) as f64
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(text: &str) -> Metrics {
        Metrics::parse(text).unwrap()
    }

    #[test]
    fn mla_dummy_fails_without_real_bytes_or_with_dummy_bytes() {
        let dummy = m("kvx_live_workers 4\n");
        let real = m("kvx_transfer_bytes_total 1048576\nkvx_live_workers 4\n");
        assert_eq!(
            mla_bytes_check(&real.get("kvx_transfer_bytes_total"), &dummy),
            None
        );
        // The real rank's counter absent (renamed, or nothing written): a failure, not 0.
        let why = mla_bytes_check(&dummy.get("kvx_transfer_bytes_total"), &dummy).unwrap();
        assert!(why.contains("absent"), "{why}");
        let zero = m("kvx_transfer_bytes_total 0\n");
        assert!(mla_bytes_check(&zero.get("kvx_transfer_bytes_total"), &dummy).is_some());
        // The dummy wrote, or what was scraped is not a prefill.
        let r = real.get("kvx_transfer_bytes_total");
        assert!(
            mla_bytes_check(&r, &real)
                .unwrap()
                .contains("dummy rank 1 wrote")
        );
        assert!(mla_bytes_check(&r, &m("other 1\n")).is_some());
    }
}
