//! Link faults between separate hosts (network namespaces only): a slow, lossy, capped link
//! (`lossy-link`) and a link cut mid-transfer then restored (`partition`). On a loopback run
//! these cannot be made without touching the machine's own network, so they say SKIP — a FAIL
//! under `--require-hosts`, which `cargo xtask test` sets as root.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::common::{self, DecodeOpts, Model, PrefillOpts};
use crate::integration::proxy::FaultProxy;
use crate::integration::{Ctx, Verdict};

/// Port of the transparent delay proxy inside each host.
const PROXY_PORT: u16 = 20999;

/// SKIP on a loopback run: these faults need separate hosts.
fn no_hosts(ctx: &Ctx) -> Option<Verdict> {
    ctx.topology().is_none().then(|| {
        Verdict::Skip("needs separate hosts (network namespaces); this is a loopback run".into())
    })
}

/// Starts a transparent proxy in host `i` delaying every byte by `delay`, and redirects new
/// connections from host `from` to it.
fn delay_link(ctx: &Ctx, i: usize, from: usize, delay: Duration) -> Result<FaultProxy> {
    let proxy = ctx.on_host(i, || -> Result<FaultProxy> {
        FaultProxy::start_transparent(TcpListener::bind(("0.0.0.0", PROXY_PORT))?)
    })??;
    proxy.set_delay(delay);
    if let Some(t) = ctx.topology() {
        t.redirect(i, from, Some(PROXY_PORT))?;
    }
    Ok(proxy)
}

/// `lossy-link`: prefill and decode on two hosts joined by a link with 5 ms delay each way (a
/// proxy), 1 % random drop each way, a 400 Mbit/s cap and a one-second stall once bytes flow:
/// every room terminal, bytes verified.
pub fn lossy_link(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = no_hosts(ctx) {
        return Ok(v);
    }
    if let Some(v) = super::need(
        ctx,
        &[
            "bootstrap",
            "prefill --metrics-port",
            "decode --summary-json",
        ],
    ) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 96);
    let (boot, p) = common::bootstrap_and_prefill(ctx, &model)?;
    let (px0, px1) = {
        let t = ctx.topology().ok_or_else(|| anyhow::anyhow!("no hosts"))?;
        t.set_loss(0, 1, 1.0)?;
        t.cap_bandwidth(0, Some(400))?;
        t.cap_bandwidth(1, Some(400))?;
        let d = Duration::from_millis(5);
        (delay_link(ctx, 0, 1, d)?, delay_link(ctx, 1, 0, d)?)
    };
    let mut o = DecodeOpts::new(common::sized(ctx, 12, 100), 64);
    o.tokens_max = Some(160);
    let mut d = common::decode(ctx, "decode", 1, boot.addr, &model, &o)?;
    // Once bytes flow, stall both directions for a second: connections stay up, rooms go on.
    if common::transfers_flowing(ctx, &p, 1.0)? {
        px0.set_stalled(true);
        px1.set_stalled(true);
        std::thread::sleep(Duration::from_secs(1));
        px0.set_stalled(false);
        px1.set_stalled(false);
    }
    let (code, s) = d.finish(Duration::from_secs(240))?;
    ctx.latencies_ms.extend(&s.latencies_ms);
    let t = ctx.topology().ok_or_else(|| anyhow::anyhow!("no hosts"))?;
    let dropped = t.dropped(0)? + t.dropped(1)?;
    let proxied = px0.bytes() + px1.bytes();
    let left = common::drained(ctx, &p, Duration::from_secs(10))?;
    let figures = format!(
        "{}; {dropped} packets dropped, {:.1} MiB through the delay proxies ({} connections), 1 s stall; room entries left {left}; decode exit {code}",
        s.figures(),
        proxied as f64 / (1u64 << 20) as f64,
        px0.accepted() + px1.accepted()
    );
    if !s.all_terminal() || s.corrupt != 0 || s.verified != s.succeeded || left != 0.0 {
        return Ok(Verdict::Fail(figures));
    }
    if dropped == 0 || px1.bytes() == 0 {
        return Ok(Verdict::Fail(format!(
            "the faults were not in the path: {figures}"
        )));
    }
    if s.verified != s.requests {
        return Ok(Verdict::Fail(format!("{figures}; {}", s.top_reason())));
    }
    Ok(Verdict::Pass(figures))
}

/// `partition`: the link between prefill and decode is cut mid-transfer. The decode fails its
/// rooms within its heartbeat window, the prefill's in-flight rooms end within its bounds; after
/// the link is restored, new rooms succeed.
pub fn partition(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = no_hosts(ctx) {
        return Ok(v);
    }
    if let Some(v) = super::need(
        ctx,
        &[
            "prefill --serve-bootstrap",
            "prefill --bootstrap-timeout",
            "decode --heartbeat-interval",
        ],
    ) {
        return Ok(v);
    }
    if let Some(v) = super::need_failpoints(ctx, &[crate::integration::kvx::FAILPOINTS[0]]) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 160);
    let boot = ctx.addr(0);
    let popts = PrefillOpts {
        serve_bootstrap: true,
        extra: common::args(&["--bootstrap-timeout", "10"]),
        env: vec![(
            "FAILPOINTS".into(),
            "kvx::transfer_worker::batch=sleep(150)".into(),
        )],
        ..PrefillOpts::default()
    };
    let p = common::prefill(ctx, "prefill", 0, boot, &model, 0, &popts)?;
    let (interval, max_fail) = (2u64, 2u64);
    let mut o = DecodeOpts::new(20, 256);
    o.extra = common::heartbeat_args(interval, max_fail);
    let mut d = common::decode(ctx, "decode-1", 1, boot, &model, &o)?;
    if !common::transfers_flowing(ctx, &p, 2.0)? {
        return Ok(Verdict::Fail("transfers never started".into()));
    }
    let t = ctx.topology().ok_or_else(|| anyhow::anyhow!("no hosts"))?;
    t.cut(0, 1)?;
    let cut = Instant::now();
    let window = common::heartbeat_window(interval, max_fail);
    let finished = d.finish(window + Duration::from_secs(20));
    let decode_took = cut.elapsed();
    // The prefill's view, while the link is still cut.
    let (pm, prefill_took) =
        common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(30), |m| {
            m.get("kvx_room_entries") == Ok(0.0)
        })?;
    let t = ctx.topology().ok_or_else(|| anyhow::anyhow!("no hosts"))?;
    t.restore(0, 1)?;
    let (code, s) = finished?;
    // The rooms the prefill had in flight at the cut ended Failed: the counter must be there.
    let prefill_failed = pm
        .get_where("kvx_rooms_finished_total", &[("status", "failed")])
        .map_err(|e| e.to_string());
    let mut o2 = DecodeOpts::new(common::sized(ctx, 6, 40), 256);
    o2.seed = 1234;
    let mut d2 = common::decode(ctx, "decode-2", 1, boot, &model, &o2)?;
    let (code2, s2) = d2.finish(Duration::from_secs(120))?;
    let left = common::drained(ctx, &p, Duration::from_secs(10))?;
    let figures = format!(
        "during the cut the decode ended its {} rooms ({} failed, {} verified) {:.1} s after the cut (window {} s); prefill emptied its room table {} after the cut ({} rooms Failed); after restore {}; room entries left {left}",
        s.requests,
        s.failed,
        s.verified,
        decode_took.as_secs_f64(),
        window.as_secs(),
        prefill_took
            .map(|d| format!("{:.1} s", d.as_secs_f64()))
            .unwrap_or("not within 30 s".into()),
        match &prefill_failed {
            Ok(n) => n.to_string(),
            Err(e) => e.clone(),
        },
        s2.figures()
    );
    let _ = code;
    if !s.all_terminal() || s.corrupt != 0 || s.failed == 0 || decode_took > window {
        return Ok(Verdict::Fail(figures));
    }
    if prefill_took.is_none()
        || !prefill_failed.as_ref().is_ok_and(|n| *n >= 1.0)
        || code2 != 0
        || s2.verified != s2.requests
        || left != 0.0
    {
        return Ok(Verdict::Fail(figures));
    }
    Ok(Verdict::Pass(figures))
}

/// `silent-decode`: one of two decodes goes silent mid-transfer (its link cut: no reset, no
/// answer), while the other keeps asking for rooms. The prefill's batches to the silent decode
/// wait for their acknowledgement timeout; the other decode's rooms, queued on the same transfer
/// workers, must not wait behind them: the prefill keeps completing rooms between the cut and
/// its first failure of a silent decode's room. Afterwards every room of the other decode is
/// verified and the prefill holds no room entries.
pub fn silent_decode(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = no_hosts(ctx) {
        return Ok(v);
    }
    if let Some(v) = super::need(
        ctx,
        &[
            "bootstrap",
            "prefill --metrics-port",
            "decode --summary-json",
            "decode --heartbeat-interval",
        ],
    ) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 160);
    let (boot, p) = common::bootstrap_and_prefill(ctx, &model)?;
    // The silent one: 8 rooms of 256 tokens in flight at a time, so that every worker holds
    // its batches when the link goes.
    let mut vo = DecodeOpts::new(400, 256);
    vo.concurrency = 8;
    vo.seed = 21;
    vo.extra = common::heartbeat_args(2, 2);
    let mut victim = common::decode(ctx, "decode-silent", 1, boot.addr, &model, &vo)?;
    if !common::transfers_flowing(ctx, &p, 8.0)? {
        return Ok(Verdict::Fail("transfers never started".into()));
    }
    let mut oo = DecodeOpts::new(common::sized(ctx, 300, 1000), 32);
    oo.concurrency = 2;
    oo.seed = 22;
    let mut other = common::decode(ctx, "decode-other", 2, boot.addr, &model, &oo)?;
    let success = |m: &crate::integration::metrics::Metrics| {
        m.events("kvx_rooms_finished_total", &[("status", "success")])
    };
    let failed = |m: &crate::integration::metrics::Metrics| {
        m.events("kvx_rooms_finished_total", &[("status", "failed")])
    };
    // Both decodes served before the cut.
    let before = ctx.scrape(0, p.metrics)?;
    let (_, both) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(60), |m| {
        success(m) >= success(&before) + 8.0
    })?;
    if both.is_none() {
        return Ok(Verdict::Fail(
            "the second decode's rooms never started".into(),
        ));
    }
    let t = ctx.topology().ok_or_else(|| anyhow::anyhow!("no hosts"))?;
    t.cut(0, 1)?;
    let cut = Instant::now();
    // A silent decode's room cannot succeed once its link is gone; half a second covers the
    // completions the prefill had received but not yet counted.
    std::thread::sleep(Duration::from_millis(500));
    let base = ctx.scrape(0, p.metrics)?;
    let (at_fail, took) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(40), |m| {
        failed(m) > failed(&base)
    })?;
    let failed_after = took.map(|_| cut.elapsed());
    let served = success(&at_fail) - success(&base);
    let victim_end = victim.finish(Duration::from_secs(60));
    let t = ctx.topology().ok_or_else(|| anyhow::anyhow!("no hosts"))?;
    t.restore(0, 1)?;
    let (code, s) = other.finish(Duration::from_secs(300))?;
    let left = common::drained(ctx, &p, Duration::from_secs(30))?;
    let figures = format!(
        "first silent-decode room failed {} after the cut; rooms completed meanwhile {served}; silent decode {}; other decode exit {code}, {}; room entries left {left}",
        failed_after
            .map(|d| format!("{:.1} s", d.as_secs_f64()))
            .unwrap_or("never (40 s)".into()),
        match &victim_end {
            Ok((c, v)) => format!("exit {c}, {} failed of {}", v.failed, v.requests),
            Err(e) => format!("{e:#}"),
        },
        s.figures(),
    );
    let checks = [
        (
            took.is_some(),
            "the prefill never failed a silent decode's room".to_string(),
        ),
        (
            served >= 4.0,
            "the other decode's rooms waited behind the silent decode's batches".into(),
        ),
        (
            victim_end
                .as_ref()
                .is_ok_and(|(_, v)| v.all_terminal() && v.failed > 0),
            "the silent decode did not fail its rooms".into(),
        ),
        (
            code == 0 && s.verified == s.requests && s.corrupt == 0,
            "the other decode lost rooms".into(),
        ),
        (left == 0.0, "room entries left on the prefill".into()),
    ];
    Ok(super::faults::verdict(&checks, figures))
}
