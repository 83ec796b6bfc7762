//! Process faults: a decode or a prefill killed with SIGKILL mid-transfer, a fatal worker fault
//! injected through a failpoint, and the soak with 1 % injected per-room failures. Transfers are
//! kept in flight long enough to be interrupted by a `sleep` failpoint on every batch, so the
//! scenarios do not depend on how fast this machine is.

use std::time::{Duration, Instant};

use anyhow::Result;

use super::common::{self, DecodeOpts, Model, PrefillOpts};
use crate::integration::{Ctx, Verdict};

/// The batch failpoint.
const BATCH: &str = "kvx::transfer_worker::batch";
/// The per-chunk failpoint.
const CHUNK: &str = "kvx::transfer_worker::chunk";

fn failpoints(spec: &str) -> Vec<(String, String)> {
    vec![("FAILPOINTS".to_string(), spec.to_string())]
}

/// `kill-decode`: SIGKILL one decode mid-transfer; the prefill fails its rooms within 2 s, a
/// second decode keeps being served and every worker stays alive.
pub fn kill_decode(ctx: &mut Ctx) -> Result<Verdict> {
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
    let model = Model::new("llama3-8b", 160);
    let boot = common::bootstrap(ctx, 0)?;
    let popts = PrefillOpts {
        env: failpoints(&format!("{BATCH}=sleep(150)")),
        ..PrefillOpts::default()
    };
    let p = common::prefill(ctx, "prefill", 0, boot.addr, &model, 0, &popts)?;
    let mut victim_opts = DecodeOpts::new(40, 256);
    victim_opts.concurrency = 8;
    victim_opts.seed = 11;
    let mut victim = common::decode(ctx, "decode-victim", 1, boot.addr, &model, &victim_opts)?;
    let mut other_opts = DecodeOpts::new(common::sized(ctx, 8, 40), 256);
    other_opts.concurrency = 2;
    other_opts.seed = 12;
    let mut other = common::decode(ctx, "decode-other", 2, boot.addr, &model, &other_opts)?;

    // Kill once transfers are flowing.
    let (_, flowing) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(60), |m| {
        m.get("kvx_transfer_batches_total") >= 4.0 && m.get("kvx_room_entries") >= 4.0
    })?;
    if flowing.is_none() {
        return Ok(Verdict::Fail("transfers never started".into()));
    }
    let before = ctx.scrape(0, p.metrics)?;
    victim.proc.kill9();
    // Only the other decode's rooms (at most its concurrency) may stay open after the kill.
    let limit = other_opts.concurrency as f64;
    let (m, took) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(10), |m| {
        m.get("kvx_room_entries") <= limit
    })?;
    let failed_rooms = m
        .sum("kvx_rooms_finished_total", &[("status", "KVPoll.Failed")])
        .unwrap_or(0.0)
        - before
            .sum("kvx_rooms_finished_total", &[("status", "KVPoll.Failed")])
            .unwrap_or(0.0);
    let detect = took.map(|d| d.as_secs_f64());
    let (code, s) = other.finish(Duration::from_secs(180))?;
    let after = ctx.scrape(0, p.metrics)?;
    let left = common::drained(ctx, &p, Duration::from_secs(5))?;
    let workers = after.get("kvx_live_workers");
    let worker_failures = after.get("kvx_worker_failures_total");
    let figures = format!(
        "victim's rooms cleared {} after the kill ({} rooms Failed), other decode {}, live workers {workers}, room entries left {left}",
        detect
            .map(|d| format!("{d:.2} s"))
            .unwrap_or("never".into()),
        failed_rooms,
        s.figures()
    );
    if detect.is_none_or(|d| d > 2.0) {
        return Ok(Verdict::Fail(format!(
            "rooms not failed within 2 s: {figures}"
        )));
    }
    if code != 0 || s.verified != s.requests || worker_failures != 0.0 || left != 0.0 {
        return Ok(Verdict::Fail(figures));
    }
    Ok(Verdict::Pass(figures))
}

/// `kill-prefill`: SIGKILL the prefill (which serves the bootstrap and heartbeat, as sglang's
/// does); the decode fails its rooms within the heartbeat window; the prefill restarts on the same
/// endpoint, re-registers, and a new decode's rooms succeed.
pub fn kill_prefill(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(
        ctx,
        &[
            "prefill --serve-bootstrap",
            "prefill --inbox-port",
            "decode --heartbeat-interval",
            "decode --heartbeat-max-failure",
        ],
    ) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 160);
    let boot = ctx.addr(0);
    let inbox = ctx.port(0);
    let popts = PrefillOpts {
        env: failpoints(&format!("{BATCH}=sleep(150)")),
        serve_bootstrap: true,
        inbox_port: Some(inbox),
        ..PrefillOpts::default()
    };
    let mut p = common::prefill(ctx, "prefill", 0, boot, &model, 0, &popts)?;
    let (interval, max_fail) = (2u64, 2u64);
    let mut o = DecodeOpts::new(30, 256);
    o.extra = common::heartbeat_args(interval, max_fail);
    let mut d = common::decode(ctx, "decode-1", 1, boot, &model, &o)?;
    if !common::transfers_flowing(ctx, &p, 2.0)? {
        return Ok(Verdict::Fail("transfers never started".into()));
    }
    p.proc.kill9();
    let killed = Instant::now();
    let window = common::heartbeat_window(interval, max_fail);
    let (code, s) = d.finish(window + Duration::from_secs(30))?;
    let gone = killed.elapsed();
    if !s.all_terminal() || s.corrupt != 0 || s.failed == 0 {
        return Ok(Verdict::Fail(format!(
            "after the kill: exit {code}, {}",
            s.figures()
        )));
    }
    if gone > window {
        return Ok(Verdict::Fail(format!(
            "decode took {:.1} s to fail its rooms (window {} s): {}",
            gone.as_secs_f64(),
            window.as_secs(),
            s.top_reason()
        )));
    }
    // Restart on the same endpoint, no failpoint, and serve a new decode.
    let popts = PrefillOpts {
        env: Vec::new(),
        ..popts
    };
    let p2 = common::prefill(ctx, "prefill-restarted", 0, boot, &model, 0, &popts)?;
    let mut o2 = DecodeOpts::new(common::sized(ctx, 6, 40), 256);
    o2.seed = 99;
    let mut d2 = common::decode(ctx, "decode-2", 1, boot, &model, &o2)?;
    let (code2, s2) = d2.finish(Duration::from_secs(120))?;
    if code2 != 0 || s2.verified != s2.requests {
        return Ok(Verdict::Fail(format!(
            "after the restart: exit {code2}, {}; {}",
            s2.figures(),
            s2.top_reason()
        )));
    }
    let left = common::drained(ctx, &p2, Duration::from_secs(5))?;
    Ok(Verdict::Pass(format!(
        "decode failed {} of {} rooms {:.1} s after the kill (window {} s; {}); after restart {}; room entries left {left}",
        s.failed,
        s.requests,
        gone.as_secs_f64(),
        window.as_secs(),
        s.top_reason(),
        s2.figures()
    )))
}

/// The exit code `kvx prefill --help` documents for a dead worker (70 when it does not say).
fn documented_exit_code(ctx: &Ctx) -> i32 {
    ctx.kvx()
        .ok()
        .and_then(|k| k.help_text("prefill"))
        .and_then(|h| {
            let i = h.find("exit code ")?;
            h[i + 10..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(70)
}

/// `fatal-worker`: a fatal fault injected in a transfer worker: the exact dead-thread message,
/// every open room reported Failed to the decode, the documented exit code.
pub fn fatal_worker(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(
        ctx,
        &["prefill --serve-bootstrap", "decode --heartbeat-interval"],
    ) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 160);
    let boot = ctx.addr(0);
    let popts = PrefillOpts {
        // Four good batches, then the fault.
        env: failpoints(&format!("{BATCH}=4*sleep(50)->return(boom)")),
        serve_bootstrap: true,
        ..PrefillOpts::default()
    };
    let mut p = common::prefill(ctx, "prefill", 0, boot, &model, 0, &popts)?;
    let mut o = DecodeOpts::new(12, 256);
    o.extra = common::heartbeat_args(2, 2);
    let mut d = common::decode(ctx, "decode", 1, boot, &model, &o)?;
    let expected = format!(
        "Transfer thread failed because of injected fault at {BATCH}: boom. Prefill instance with bootstrap_port={} is dead.",
        boot.port()
    );
    let Some(status) = p.proc.wait_timeout(Duration::from_secs(60)) else {
        return Ok(Verdict::Fail(format!(
            "prefill still running 60 s after the fault was armed: {}",
            p.proc.log_tail(3)
        )));
    };
    let code = status.code().unwrap_or(-1);
    let log = p.proc.log_text();
    let (dc, s) = d.finish(Duration::from_secs(60))?;
    let want_code = documented_exit_code(ctx);
    let reported = s
        .failure_reasons
        .iter()
        .filter(|(r, _)| !r.starts_with("Lost connection"))
        .map(|(_, n)| n)
        .sum::<u64>();
    let figures = format!(
        "prefill exit {code} (documented {want_code}); decode exit {dc}: {}; {reported} rooms reported Failed by the prefill",
        s.figures()
    );
    if !log.lines().any(|l| l.trim_end() == expected) {
        return Ok(Verdict::Fail(format!(
            "no line exactly {expected:?} in the prefill's output; {figures}"
        )));
    }
    if code != want_code || !s.all_terminal() || s.corrupt != 0 || s.failed == 0 || reported == 0 {
        return Ok(Verdict::Fail(figures));
    }
    Ok(Verdict::Pass(format!("exact message; {figures}")))
}

/// `soak`: many rooms with 1 % injected per-room failures: every room terminal, every success
/// verified, workers alive, no per-room entry left on the prefill, and no socket the prefill
/// opened for the decode still open 10 s after the decode exited (counted in `/proc/<pid>/fd`,
/// as the metrics do not list sockets).
pub fn soak(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(
        ctx,
        &[
            "bootstrap",
            "prefill --metrics-port",
            "decode --prompt-tokens-max",
        ],
    ) {
        return Ok(v);
    }
    let model = Model::new("tiny", 2048);
    let boot = common::bootstrap(ctx, 0)?;
    let popts = PrefillOpts {
        env: failpoints(&format!("{CHUNK}=1%return(soak)")),
        ..PrefillOpts::default()
    };
    let p = common::prefill(ctx, "prefill", 0, boot.addr, &model, 0, &popts)?;
    let sockets_before = p.proc.sockets();
    let n = common::sized(ctx, 2000, 10_000);
    let mut o = DecodeOpts::new(n, 16);
    o.tokens_max = Some(512);
    o.concurrency = 16;
    let mut d = common::decode(ctx, "decode", 1, boot.addr, &model, &o)?;
    let (code, s) = d.finish(Duration::from_secs(common::sized(ctx, 150, 3300) as u64))?;
    ctx.latencies_ms.extend(&s.latencies_ms);
    let left = common::drained(ctx, &p, Duration::from_secs(10))?;
    // The decode is gone: whatever the prefill opened for it must be closed again.
    let mut sockets_after = p.proc.sockets();
    for _ in 0..100 {
        if sockets_after <= sockets_before {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        sockets_after = p.proc.sockets();
    }
    let m = ctx.scrape(0, p.metrics)?;
    let workers = m.get("kvx_live_workers");
    let wf = m.get("kvx_worker_failures_total");
    let figures = format!(
        "{}; decode exit {code}; live workers {workers}, worker failures {wf}, room entries left {left}, prefill sockets {sockets_before} before and {sockets_after} after",
        s.figures()
    );
    // Every room the decode saw fail is one the prefill failed (the injected faults), and the
    // injection rate is about 1 % (well under 5 % even for a few hundred rooms).
    let prefill_failed = m
        .sum("kvx_rooms_finished_total", &[("status", "KVPoll.Failed")])
        .unwrap_or(0.0) as u64;
    let figures = format!("{figures}; prefill failed {prefill_failed} rooms");
    let checks = [
        (s.all_terminal(), "not every room terminal"),
        (s.corrupt == 0, "corrupt rooms"),
        (s.verified == s.succeeded, "unverified successes"),
        (left == 0.0, "room entries left on the prefill"),
        (wf == 0.0, "a worker died"),
        (
            s.failed == prefill_failed,
            "the decode saw failures the prefill did not inject",
        ),
        (
            s.failed * 20 <= s.requests,
            "far more than 1 % of rooms failed",
        ),
        (
            sockets_after <= sockets_before,
            "the prefill kept sockets it opened for the decode after the decode left",
        ),
    ];
    let broken: Vec<&str> = checks
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, w)| *w)
        .collect();
    if !broken.is_empty() {
        return Ok(Verdict::Fail(format!("{}: {figures}", broken.join("; "))));
    }
    Ok(Verdict::Pass(figures))
}
