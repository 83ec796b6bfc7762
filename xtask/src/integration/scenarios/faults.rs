//! Process faults: a decode or a prefill killed with SIGKILL mid-transfer, a fatal worker fault
//! injected through a failpoint, and the soak with 1 % injected per-room failures. Transfers are
//! kept in flight long enough to be interrupted by a `sleep` failpoint on every batch, so the
//! scenarios do not depend on how fast this machine is.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::common::{self, DecodeOpts, Model, PrefillOpts, Summary};
use crate::integration::{Ctx, Verdict};

/// The batch failpoint.
const BATCH: &str = "kvx::transfer_worker::batch";
/// The per-chunk failpoint.
const CHUNK: &str = "kvx::transfer_worker::chunk";

fn failpoints(spec: &str) -> Vec<(String, String)> {
    vec![("FAILPOINTS".to_string(), spec.to_string())]
}

/// First room of the victim decode in `kill-decode` (`--room-base`), so that the prefill's log
/// tells its rooms from the other decode's.
const VICTIM_ROOMS: u64 = 1_000_000;
/// First room of the decode that must stay unaffected.
const OTHER_ROOMS: u64 = 2_000_000;

/// What `kill-decode` saw.
#[derive(Debug, Clone, Default)]
pub(crate) struct KillDecodeSeen {
    /// Seconds until the prefill held no more than the other decode's rooms (`None`: not in 10 s).
    pub cleared_s: Option<f64>,
    /// Growth of `kvx_rooms_finished_total{status="failed"}` from the kill to the end.
    pub failed_delta: f64,
    /// Rooms the prefill logged as failed after the kill, by id.
    pub failed_rooms: Vec<u64>,
    /// `kvx_rooms_finished_total{status="success"}` just after the kill and at the end.
    pub succeeded: (f64, f64),
    /// `kvx_live_workers` before the kill and at the end.
    pub workers: (f64, f64),
    /// `kvx_worker_failures_total` at the end.
    pub worker_failures: f64,
    /// The other decode's exit code and summary.
    pub other: (i32, Summary),
    /// Room entries left on the prefill at the end.
    pub left: f64,
}

/// `kill-decode`'s verdict: the victim's rooms ended Failed on the prefill within 2 s — some
/// failed, every failed room is the victim's, the Failed-rooms metric agrees with the log, and no
/// victim room succeeded after the kill (every Success the prefill counted beyond the other
/// decode's rooms was counted by the time of the kill); the other decode verified everything;
/// every worker alive; nothing left.
pub(crate) fn kill_decode_verdict(x: &KillDecodeSeen) -> Verdict {
    let (code, s) = &x.other;
    let victim = |r: &u64| (VICTIM_ROOMS..OTHER_ROOMS).contains(r);
    let victims = x.failed_rooms.iter().filter(|r| victim(r)).count();
    let strangers: Vec<u64> = x
        .failed_rooms
        .iter()
        .copied()
        .filter(|r| !victim(r))
        .collect();
    let victim_successes = x.succeeded.1 - s.succeeded as f64;
    let figures = format!(
        "victim's rooms cleared {} after the kill; {victims} victim rooms logged Failed, Failed rooms on the prefill +{}; victim rooms succeeded {victim_successes} ({} Successes counted at the kill); other decode exit {code}, {}; live workers {} before and {} after, worker failures {}; room entries left {}",
        x.cleared_s
            .map(|d| format!("{d:.2} s"))
            .unwrap_or("never".into()),
        x.failed_delta,
        x.succeeded.0,
        s.figures(),
        x.workers.0,
        x.workers.1,
        x.worker_failures,
        x.left
    );
    let checks = [
        (
            x.cleared_s.is_some_and(|d| d <= 2.0),
            "the victim's rooms were not cleared within 2 s".to_string(),
        ),
        (victims > 0, "no victim room ended Failed".into()),
        (
            strangers.is_empty(),
            format!("rooms not the victim's failed: {strangers:?}"),
        ),
        (
            x.failed_delta == x.failed_rooms.len() as f64,
            "the Failed-rooms metric and the prefill's log disagree".into(),
        ),
        (
            victim_successes <= x.succeeded.0,
            "victim rooms succeeded after the kill".into(),
        ),
        (
            *code == 0 && s.verified == s.requests && s.requests > 0,
            "the other decode was affected".into(),
        ),
        (
            x.workers.0 > 0.0 && x.workers.1 == x.workers.0 && x.worker_failures == 0.0,
            "a transfer worker died".into(),
        ),
        (x.left == 0.0, "room entries left on the prefill".into()),
    ];
    verdict(&checks, figures)
}

/// PASS with `figures` when every check holds, else FAIL naming the broken ones.
pub(crate) fn verdict(checks: &[(bool, String)], figures: String) -> Verdict {
    let broken: Vec<&str> = checks
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, w)| w.as_str())
        .collect();
    if broken.is_empty() {
        Verdict::Pass(figures)
    } else {
        Verdict::Fail(format!("{}: {figures}", broken.join("; ")))
    }
}

/// Room ids of the `room failed` lines of a prefill's log after its first `skip` lines,
/// deduplicated, whose line contains `needle`.
pub(crate) fn failed_rooms(log: &str, skip: usize, needle: &str) -> Vec<u64> {
    let mut rooms: Vec<u64> = super::flood::strip_ansi(log)
        .lines()
        .skip(skip)
        .filter(|l| l.contains("room failed") && l.contains(needle))
        .filter_map(|l| super::flood::field(l, "room")?.parse().ok())
        .collect();
    rooms.sort_unstable();
    rooms.dedup();
    rooms
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
            "decode --room-base",
        ],
    ) {
        return Ok(v);
    }
    if let Some(v) = super::need_failpoints(ctx, &[BATCH]) {
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
    victim_opts.extra = common::args(&["--room-base", &VICTIM_ROOMS.to_string()]);
    let mut victim = common::decode(ctx, "decode-victim", 1, boot.addr, &model, &victim_opts)?;
    let mut other_opts = DecodeOpts::new(common::sized(ctx, 8, 40), 256);
    other_opts.concurrency = 2;
    other_opts.seed = 12;
    other_opts.extra = common::args(&["--room-base", &OTHER_ROOMS.to_string()]);
    let mut other = common::decode(ctx, "decode-other", 2, boot.addr, &model, &other_opts)?;

    // Kill once transfers are flowing.
    let (_, flowing) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(60), |m| {
        m.get("kvx_transfer_batches_total").is_ok_and(|n| n >= 4.0)
            && m.get("kvx_room_entries").is_ok_and(|n| n >= 4.0)
    })?;
    if flowing.is_none() {
        return Ok(Verdict::Fail("transfers never started".into()));
    }
    let before = ctx.scrape(0, p.metrics)?;
    let log_before = p.proc.log_text().lines().count();
    victim.proc.kill9();
    let at_kill = ctx.scrape(0, p.metrics)?;
    // Only the other decode's rooms (at most its concurrency) may stay open after the kill.
    let limit = other_opts.concurrency as f64;
    let (_, took) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(10), |m| {
        m.get("kvx_room_entries").is_ok_and(|n| n <= limit)
    })?;
    let (code, s) = other.finish(Duration::from_secs(180))?;
    let left = common::drained(ctx, &p, Duration::from_secs(5))?;
    let after = ctx.scrape(0, p.metrics)?;
    let finished = |m: &crate::integration::metrics::Metrics, status: &str| {
        m.events("kvx_rooms_finished_total", &[("status", status)])
    };
    let seen = KillDecodeSeen {
        cleared_s: took.map(|d| d.as_secs_f64()),
        failed_delta: finished(&after, "failed") - finished(&before, "failed"),
        failed_rooms: failed_rooms(&p.proc.log_text(), log_before, ""),
        succeeded: (finished(&at_kill, "success"), finished(&after, "success")),
        workers: (
            before.get("kvx_live_workers")?,
            after.get("kvx_live_workers")?,
        ),
        worker_failures: after.events("kvx_worker_failures_total", &[]),
        other: (code, s),
        left,
    };
    Ok(kill_decode_verdict(&seen))
}

/// What `kill-prefill` saw.
#[derive(Debug, Clone, Default)]
pub(crate) struct KillPrefillSeen {
    /// The prefill's bootstrap address (`host:port`), as the decode names it.
    pub boot: String,
    /// The first decode's exit code and summary (the prefill killed under it).
    pub during: (i32, Summary),
    /// Seconds from the kill until that decode had ended every room.
    pub gone_s: f64,
    /// The heartbeat window, in seconds.
    pub window_s: f64,
    /// The second decode's exit code and summary (served by the restarted prefill).
    pub after: (i32, Summary),
    /// Room entries left on the restarted prefill.
    pub left: f64,
}

/// `kill-prefill`'s verdict: every room of the first decode terminal, some failed, each with the
/// lost-connection reason (those in flight naming the killed prefill's bootstrap address, at
/// least one of them), within the heartbeat window; after the restart every room verified and 0 room entries left on the new prefill.
pub(crate) fn kill_prefill_verdict(x: &KillPrefillSeen) -> Verdict {
    let (code, s) = &x.during;
    let (code2, s2) = &x.after;
    // Rooms in flight fail on heartbeat loss with sglang's text naming the prefill's address;
    // rooms the decode starts once it knows the prefill dead fail with the bare text.
    // The decode's rank watcher may see the rank's inbox gone before the heartbeats do: those
    // rooms fail naming the rank's inbox.
    let bare = "Lost connection with prefill instance";
    let lost = format!("{bare} (bootstrap_addr: {})", x.boot);
    let rank_lost = |r: &str| r.starts_with("Lost connection with prefill rank at ");
    let in_flight: u64 = s
        .failure_reasons
        .iter()
        .filter(|(r, _)| *r == lost || rank_lost(r))
        .map(|(_, n)| n)
        .sum();
    let other_reasons: Vec<String> = s
        .failure_reasons
        .iter()
        .filter(|(r, _)| *r != lost && r != bare && !rank_lost(r))
        .map(|(r, n)| format!("{n}x {r}"))
        .collect();
    let figures = format!(
        "decode failed {} of {} rooms {:.1} s after the kill (window {} s; {}), exit {code}; after restart exit {code2}, {}; room entries left {} on the restarted prefill",
        s.failed,
        s.requests,
        x.gone_s,
        x.window_s,
        s.top_reason(),
        s2.figures(),
        x.left
    );
    let checks = [
        (
            s.all_terminal() && s.corrupt == 0 && s.failed > 0,
            format!("after the kill: {}", s.figures()),
        ),
        (
            in_flight > 0,
            format!("no room failed with {lost:?} or the rank's inbox lost"),
        ),
        (
            other_reasons.is_empty(),
            format!("the decode failed rooms for another reason than {lost:?}: {other_reasons:?}"),
        ),
        (
            x.gone_s <= x.window_s,
            "the decode took longer than its heartbeat window".into(),
        ),
        (
            *code2 == 0 && s2.verified == s2.requests && s2.requests > 0,
            format!("after the restart: {}", s2.top_reason()),
        ),
        (
            x.left == 0.0,
            "room entries left on the restarted prefill".into(),
        ),
    ];
    verdict(&checks, figures)
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
    if let Some(v) = super::need_failpoints(ctx, &[BATCH]) {
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
    let during = d.finish(window + Duration::from_secs(30))?;
    let gone = killed.elapsed();
    // Restart on the same endpoint, no failpoint, and serve a new decode.
    let popts = PrefillOpts {
        env: Vec::new(),
        ..popts
    };
    let p2 = common::prefill(ctx, "prefill-restarted", 0, boot, &model, 0, &popts)?;
    let mut o2 = DecodeOpts::new(common::sized(ctx, 6, 40), 256);
    o2.seed = 99;
    let mut d2 = common::decode(ctx, "decode-2", 1, boot, &model, &o2)?;
    let after = d2.finish(Duration::from_secs(120))?;
    let left = common::drained(ctx, &p2, Duration::from_secs(5))?;
    Ok(kill_prefill_verdict(&KillPrefillSeen {
        boot: boot.to_string(),
        during,
        gone_s: gone.as_secs_f64(),
        window_s: window.as_secs_f64(),
        after,
        left,
    }))
}

/// The exit code README.md's `Exit codes` paragraph gives for a dead transfer worker: the
/// backquoted number of the `;`-separated entry that says `worker died` (`**`70`** a prefill
/// transfer worker died …). `None` when the README does not say.
pub(crate) fn documented_exit_code(readme: &str) -> Option<i32> {
    let start = readme.find("Exit codes:")?;
    let para = readme[start..].split("\n\n").next()?;
    let entry = para.split(';').find(|e| {
        e.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .contains("worker died")
    })?;
    entry
        .split('`')
        .skip(1)
        .step_by(2)
        .find_map(|code| code.parse().ok())
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
    if let Some(v) = super::need_failpoints(ctx, &[BATCH]) {
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
    let readme = crate::project_root().join("README.md");
    let text = std::fs::read_to_string(&readme)
        .with_context(|| format!("reading {}", readme.display()))?;
    let Some(want_code) = documented_exit_code(&text) else {
        return Ok(Verdict::Fail(format!(
            "{} documents no exit code for a dead transfer worker (its `Exit codes:` paragraph)",
            readme.display()
        )));
    };
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

/// What `soak` saw.
#[derive(Debug, Clone)]
pub(crate) struct SoakSeen {
    /// The decode's exit code and summary.
    pub decode: (i32, Summary),
    /// Rooms the prefill logged as failed by the injected fault.
    pub injected: u64,
    /// `kvx_rooms_finished_total{status="failed"}` on the prefill (an error when absent:
    /// with faults injected it must exist).
    pub prefill_failed: Result<f64, String>,
    /// `kvx_live_workers` after start and at the end.
    pub workers: (f64, f64),
    /// `kvx_worker_failures_total` at the end.
    pub worker_failures: f64,
    /// Room entries left on the prefill.
    pub left: f64,
    /// The prefill's open sockets before the decode and after it left.
    pub sockets: (usize, usize),
}

/// `soak`'s verdict: faults were injected (a soak without them proves nothing), every room
/// terminal, every success verified, every failure one the prefill injected (about 1 %), workers
/// alive, no room entry and no socket left behind.
pub(crate) fn soak_verdict(x: &SoakSeen) -> Verdict {
    let (code, s) = &x.decode;
    let prefill_failed = x.prefill_failed.clone().unwrap_or(-1.0);
    let figures = format!(
        "{}; decode exit {code}; {} rooms failed by injected faults, prefill failed {}; live workers {} after start and {} at the end, worker failures {}, room entries left {}, prefill sockets {} before and {} after",
        s.figures(),
        x.injected,
        match &x.prefill_failed {
            Ok(n) => n.to_string(),
            Err(e) => e.clone(),
        },
        x.workers.0,
        x.workers.1,
        x.worker_failures,
        x.left,
        x.sockets.0,
        x.sockets.1
    );
    let checks = [
        (
            x.injected > 0,
            "no fault was injected (the prefill logged no injected per-room fault)".to_string(),
        ),
        (
            s.requests > 0 && s.all_terminal(),
            "not every room terminal".into(),
        ),
        (s.corrupt == 0, "corrupt rooms".into()),
        (s.verified == s.succeeded, "unverified successes".into()),
        (x.left == 0.0, "room entries left on the prefill".into()),
        (
            x.workers.0 > 0.0 && x.workers.1 == x.workers.0 && x.worker_failures == 0.0,
            "a worker died".into(),
        ),
        (
            s.failed == x.injected && prefill_failed == x.injected as f64,
            "the rooms the decode saw fail are not the ones the prefill injected".into(),
        ),
        (
            s.failed * 20 <= s.requests,
            "far more than 1 % of rooms failed".into(),
        ),
        (
            x.sockets.1 <= x.sockets.0,
            "the prefill kept sockets it opened for the decode after the decode left".into(),
        ),
    ];
    verdict(&checks, figures)
}

/// `soak`: many rooms with 1 % injected per-room failures: every room terminal, every success
/// verified, workers alive, no per-room entry left on the prefill, and no socket the prefill
/// opened for the decode still open 10 s after the decode exited (counted in `/proc/<pid>/fd`,
/// as the metrics do not list sockets; the prefill's keep-alive connection to the bootstrap
/// server — its periodic re-registration check — is not the decode's and is left out).
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
    if let Some(v) = super::need_failpoints(ctx, &[CHUNK]) {
        return Ok(v);
    }
    let model = Model::new("tiny", 2048);
    let boot = common::bootstrap(ctx, 0)?;
    let popts = PrefillOpts {
        env: failpoints(&format!("{CHUNK}=1%return(soak)")),
        ..PrefillOpts::default()
    };
    let p = common::prefill(ctx, "prefill", 0, boot.addr, &model, 0, &popts)?;
    let workers_before = common::live_workers(ctx, &p)?;
    let boot_port = boot.addr.port();
    let sockets = || {
        p.proc
            .sockets()
            .saturating_sub(p.proc.tcp_sockets_to_port(boot_port))
    };
    // The fewest over half a second: a metrics scrape's connection may still be closing.
    let sockets_before = (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            sockets()
        })
        .min()
        .unwrap_or(0);
    let n = common::sized(ctx, 2000, 10_000);
    let mut o = DecodeOpts::new(n, 16);
    o.tokens_max = Some(512);
    o.concurrency = 16;
    let mut d = common::decode(ctx, "decode", 1, boot.addr, &model, &o)?;
    let (code, s) = d.finish(Duration::from_secs(common::sized(ctx, 150, 3300) as u64))?;
    ctx.latencies_ms.extend(&s.latencies_ms);
    let left = common::drained(ctx, &p, Duration::from_secs(10))?;
    // The decode is gone: whatever the prefill opened for it must be closed again.
    let mut sockets_after = sockets();
    for _ in 0..100 {
        if sockets_after <= sockets_before {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        sockets_after = sockets();
    }
    let m = ctx.scrape(0, p.metrics)?;
    let injected = failed_rooms(&p.proc.log_text(), 0, "injected per-room fault: soak").len();
    Ok(soak_verdict(&SoakSeen {
        decode: (code, s),
        injected: injected as u64,
        prefill_failed: m
            .get_where("kvx_rooms_finished_total", &[("status", "failed")])
            .map_err(|e| e.to_string()),
        workers: (workers_before, m.get("kvx_live_workers")?),
        worker_failures: m.events("kvx_worker_failures_total", &[]),
        left,
        sockets: (sockets_before, sockets_after),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(requests: u64, failed: u64) -> Summary {
        Summary {
            requests,
            succeeded: requests - failed,
            failed,
            verified: requests - failed,
            ..Summary::default()
        }
    }

    fn fails(v: &Verdict, why: &str) {
        match v {
            Verdict::Fail(t) => assert!(t.contains(why), "{why:?} not in {t}"),
            v => panic!("expected a FAIL for {why:?}, got {v:?}"),
        }
    }

    #[test]
    fn the_readme_documents_70_for_a_dead_worker() {
        let readme = include_str!("../../../../README.md");
        assert_eq!(documented_exit_code(readme), Some(70));
        let other = "x\n\nExit codes: `0` success; `1` an error; **`75`** a prefill transfer\nworker died (a panic).\n\n## Next `70`";
        assert_eq!(documented_exit_code(other), Some(75));
        assert_eq!(
            documented_exit_code("Exit codes: `0` success; `1` an error."),
            None
        );
        assert_eq!(documented_exit_code("no section; worker died `70`"), None);
    }

    fn soak_seen() -> SoakSeen {
        SoakSeen {
            decode: (1, summary(2000, 20)),
            injected: 20,
            prefill_failed: Ok(20.0),
            workers: (4.0, 4.0),
            worker_failures: 0.0,
            left: 0.0,
            sockets: (13, 13),
        }
    }

    #[test]
    fn soak_fails_without_injected_faults_or_their_metric() {
        assert!(matches!(soak_verdict(&soak_seen()), Verdict::Pass(_)));
        // The fault disabled: every room verifies, yet the soak proves nothing.
        let mut x = soak_seen();
        x.decode = (0, summary(2000, 0));
        x.injected = 0;
        x.prefill_failed = Ok(0.0);
        fails(&soak_verdict(&x), "no fault was injected");
        let mut x = soak_seen();
        x.prefill_failed = Err("metric kvx_rooms_finished_total absent".into());
        fails(&soak_verdict(&x), "not the ones the prefill injected");
        let mut x = soak_seen();
        x.workers = (4.0, 3.0);
        fails(&soak_verdict(&x), "a worker died");
        let mut x = soak_seen();
        x.sockets = (13, 14);
        fails(&soak_verdict(&x), "kept sockets");
    }

    fn kill_decode_seen() -> KillDecodeSeen {
        KillDecodeSeen {
            cleared_s: Some(0.3),
            failed_delta: 3.0,
            failed_rooms: vec![VICTIM_ROOMS + 4, VICTIM_ROOMS + 5, VICTIM_ROOMS + 6],
            succeeded: (4.0, 10.0),
            workers: (4.0, 4.0),
            worker_failures: 0.0,
            other: (0, summary(8, 0)),
            left: 0.0,
        }
    }

    #[test]
    fn kill_decode_fails_unless_the_victims_rooms_failed_and_workers_lived() {
        assert!(matches!(
            kill_decode_verdict(&kill_decode_seen()),
            Verdict::Pass(_)
        ));
        let mut x = kill_decode_seen();
        x.failed_rooms.clear();
        x.failed_delta = 0.0;
        fails(&kill_decode_verdict(&x), "no victim room ended Failed");
        let mut x = kill_decode_seen();
        x.failed_rooms.push(OTHER_ROOMS + 1);
        x.failed_delta = 4.0;
        fails(&kill_decode_verdict(&x), "rooms not the victim's failed");
        let mut x = kill_decode_seen();
        x.failed_delta = 1.0;
        fails(
            &kill_decode_verdict(&x),
            "metric and the prefill's log disagree",
        );
        // 2 + 8 Successes at the kill would be fine; 7 victim successes are more than counted.
        let mut x = kill_decode_seen();
        x.succeeded = (4.0, 15.0);
        fails(&kill_decode_verdict(&x), "succeeded after the kill");
        let mut x = kill_decode_seen();
        x.workers = (4.0, 3.0);
        fails(&kill_decode_verdict(&x), "a transfer worker died");
        let mut x = kill_decode_seen();
        x.workers = (0.0, 0.0);
        fails(&kill_decode_verdict(&x), "a transfer worker died");
        let mut x = kill_decode_seen();
        x.cleared_s = Some(2.5);
        fails(&kill_decode_verdict(&x), "not cleared within 2 s");
    }

    fn kill_prefill_seen() -> KillPrefillSeen {
        let boot = "10.77.0.10:21005".to_string();
        let mut s = summary(30, 28);
        s.failure_reasons = vec![
            (
                format!("Lost connection with prefill instance (bootstrap_addr: {boot})"),
                4,
            ),
            ("Lost connection with prefill instance".into(), 24),
        ];
        KillPrefillSeen {
            boot,
            during: (1, s),
            gone_s: 4.4,
            window_s: 12.0,
            after: (0, summary(6, 0)),
            left: 0.0,
        }
    }

    #[test]
    fn kill_prefill_fails_on_another_reason_or_entries_left() {
        assert!(matches!(
            kill_prefill_verdict(&kill_prefill_seen()),
            Verdict::Pass(_)
        ));
        let mut x = kill_prefill_seen();
        x.during.1.failure_reasons[0].0 =
            "Lost connection with prefill instance (bootstrap_addr: 10.77.0.99:1)".into();
        fails(&kill_prefill_verdict(&x), "another reason");
        let mut x = kill_prefill_seen();
        x.during.1.failure_reasons.remove(0);
        fails(&kill_prefill_verdict(&x), "no room failed with");
        let mut x = kill_prefill_seen();
        x.during.1.failure_reasons[1].0 = "Failed to get kvcache from prefill instance".into();
        fails(&kill_prefill_verdict(&x), "another reason");
        // Rooms the rank watcher failed first (the rank's inbox gone) count as in flight.
        let mut x = kill_prefill_seen();
        x.during.1.failure_reasons[0].0 =
            "Lost connection with prefill rank at 10.77.0.10:21018".into();
        assert!(matches!(kill_prefill_verdict(&x), Verdict::Pass(_)));
        let mut x = kill_prefill_seen();
        x.left = 2.0;
        fails(&kill_prefill_verdict(&x), "room entries left");
        let mut x = kill_prefill_seen();
        x.gone_s = 13.0;
        fails(&kill_prefill_verdict(&x), "heartbeat window");
    }
}
