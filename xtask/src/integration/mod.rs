//! `cargo xtask integration`: runs real `kvx` processes (bootstrap server, prefill ranks, decode
//! peers) through named fault scenarios, on separate hosts in network namespaces where they can be
//! made (loopback otherwise), and prints one verdict line per scenario and `N passed, M failed`.
//!
//! Every scenario runs on its own thread under a time budget; when the budget is spent, or on
//! Ctrl-C, every process group it started is killed. Scenarios whose support is missing from the
//! binary print `SKIP <name>: <reason>`; they are counted apart, never as passes. A scenario that
//! cannot inject its fault (a failpoint missing from the binary, no fault seen) FAILS, and under
//! `--require-hosts` (what `cargo xtask test` runs as root) so does a scenario that SKIPs for want
//! of separate hosts.

pub mod e2e;
pub mod e2e_engine;
pub mod kvx;
pub mod metrics;
pub mod netns;
pub mod proc;
pub mod proxy;
mod scenarios;
pub mod zmtp;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::report::{self, Part, svg};

/// How long and how large the runs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// A few minutes on 2 cores; what `cargo xtask test` runs.
    Short,
    /// Larger counts (the 10 000-room soak); on demand.
    Long,
}

/// Options of `cargo xtask integration`.
#[derive(Debug, Clone, clap::Args)]
pub struct Opts {
    /// Run size.
    #[arg(long, value_enum, default_value_t = Profile::Short)]
    pub profile: Profile,
    /// Run only these scenarios (repeatable).
    #[arg(long)]
    pub scenario: Vec<String>,
    /// Use this `kvx` binary instead of building one.
    #[arg(long, env = "KVX_BIN")]
    pub kvx: Option<PathBuf>,
    /// Run on loopback even where network namespaces work.
    #[arg(long)]
    pub loopback: bool,
    /// List the scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Fail (instead of SKIP) every scenario that needs separate hosts and could not get them;
    /// `cargo xtask test` sets it when run as root, where network namespaces must work.
    #[arg(long)]
    pub require_hosts: bool,
}

/// A scenario's result.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Passed; the figures measured.
    Pass(String),
    /// Failed; why, with figures.
    Fail(String),
    /// Not run; why.
    Skip(String),
}

/// A named scenario.
pub struct Scenario {
    /// Stable name (`--scenario`).
    pub name: &'static str,
    /// One line on what it proves.
    pub about: &'static str,
    /// Time budget in seconds: (short, long).
    pub budget_s: (u64, u64),
    /// The scenario.
    pub run: fn(&mut Ctx) -> Result<Verdict>,
    /// Needs separate hosts (network namespaces): SKIPs on a loopback run, which
    /// [`Opts::require_hosts`] turns into a FAIL.
    pub needs_hosts: bool,
}

/// Where the test hosts are.
pub enum Net {
    /// Every process on 127.0.0.1.
    Loopback,
    /// Separate hosts in network namespaces.
    Hosts(Arc<netns::Topology>),
}

/// What a scenario works with.
pub struct Ctx {
    /// Run size.
    pub profile: Profile,
    /// The binary, or why there is none.
    pub kvx: Result<kvx::Kvx, String>,
    /// Hosts.
    pub net: Arc<Net>,
    /// This scenario's log folder.
    pub logs: PathBuf,
    /// Room latencies (ms) measured by the scenario, for the report's CDF.
    pub latencies_ms: Vec<f64>,
    /// Process groups started by this scenario (killed when its budget runs out).
    pgids: Arc<Mutex<Vec<i32>>>,
}

/// Next port handed out inside namespaces (each namespace is fresh, so any free range works).
static NEXT_PORT: AtomicU16 = AtomicU16::new(21000);

/// Set by the Ctrl-C handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    proc::kill_all();
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `on_signal` only stores an atomic and calls kill(2), both async-signal-safe;
        // the handler is a plain `extern "C" fn` that lives for the whole program.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

impl Ctx {
    /// A context on loopback outside any scenario run (for the end-to-end benchmark); its
    /// processes die with their handles.
    pub fn loopback(kvx: kvx::Kvx, logs: PathBuf) -> Ctx {
        Ctx {
            profile: Profile::Short,
            kvx: Ok(kvx),
            net: Arc::new(Net::Loopback),
            logs,
            latencies_ms: Vec::new(),
            pgids: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// The binary, or a SKIP-worthy reason.
    pub fn kvx(&self) -> Result<&kvx::Kvx, String> {
        self.kvx.as_ref().map_err(Clone::clone)
    }

    /// Address of host `i` (127.0.0.1 on loopback).
    pub fn ip(&self, i: usize) -> Ipv4Addr {
        match &*self.net {
            Net::Loopback => Ipv4Addr::LOCALHOST,
            Net::Hosts(t) => t.host(i).ip,
        }
    }

    /// The topology when the run has separate hosts.
    pub fn topology(&self) -> Option<&netns::Topology> {
        match &*self.net {
            Net::Loopback => None,
            Net::Hosts(t) => Some(t),
        }
    }

    /// A free TCP port on host `i`.
    pub fn port(&self, i: usize) -> u16 {
        match &*self.net {
            Net::Loopback => TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .unwrap_or_else(|_| NEXT_PORT.fetch_add(1, Ordering::SeqCst)),
            Net::Hosts(_) => {
                let _ = i;
                NEXT_PORT.fetch_add(1, Ordering::SeqCst)
            }
        }
    }

    /// A socket address on host `i` with a fresh port.
    pub fn addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from((self.ip(i), self.port(i)))
    }

    /// A command running `program` on host `i`.
    pub fn command(&self, i: usize, program: &Path) -> Command {
        match &*self.net {
            Net::Loopback => Command::new(program),
            Net::Hosts(t) => t.command(i, program),
        }
    }

    /// Starts `kvx <args>` on host `i` as `name`; killed when the handle drops.
    pub fn spawn_kvx(&self, name: &str, host: usize, args: &[String]) -> Result<proc::Proc> {
        let bin = match &self.kvx {
            Ok(k) => k.path.clone(),
            Err(e) => bail!("{e}"),
        };
        let mut cmd = self.command(host, &bin);
        cmd.args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or("info".into()),
            )
            .env("NO_COLOR", "1");
        self.spawn(name, cmd)
    }

    /// Starts `cmd` as `name` with its log in this scenario's folder.
    pub fn spawn(&self, name: &str, cmd: Command) -> Result<proc::Proc> {
        let p = proc::Proc::spawn(name, cmd, &self.logs)?;
        if let Ok(mut g) = self.pgids.lock() {
            g.push(p.pid());
        }
        Ok(p)
    }

    /// Runs `f` inside host `i`'s namespace (on loopback, on a plain thread).
    pub fn on_host<T: Send + 'static>(
        &self,
        i: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T> {
        match &*self.net {
            Net::Loopback => std::thread::spawn(f)
                .join()
                .map_err(|_| anyhow::anyhow!("thread panicked")),
            Net::Hosts(t) => netns::in_ns(&t.host(i).ns.clone(), f),
        }
    }

    /// Scrapes `/metrics` at `addr`, which lives on host `i`.
    pub fn scrape(&self, i: usize, addr: SocketAddr) -> Result<metrics::Metrics> {
        self.on_host(i, move || metrics::scrape(addr))?
    }
}

/// One finished scenario.
struct Outcome {
    name: &'static str,
    verdict: Verdict,
    secs: f64,
    latencies_ms: Vec<f64>,
}

fn verdict_line(o: &Outcome) -> String {
    match &o.verdict {
        Verdict::Pass(f) => format!("PASS {} ({:.1} s): {f}", o.name, o.secs),
        Verdict::Fail(f) => format!("FAIL {} ({:.1} s): {f}", o.name, o.secs),
        Verdict::Skip(why) => format!("SKIP {}: {why}", o.name),
    }
}

/// Lists the scenarios.
pub fn list() {
    for s in scenarios::all() {
        println!("{:<16} {}", s.name, s.about);
    }
}

/// Runs the selected scenarios; fails when any scenario failed.
pub fn run(root: &Path, opts: &Opts) -> Result<()> {
    if opts.list {
        list();
        return Ok(());
    }
    let all = scenarios::all();
    for want in &opts.scenario {
        if !all.iter().any(|s| s.name == want) {
            bail!("no scenario named {want:?} (see --list)");
        }
    }
    let selected: Vec<&Scenario> = all
        .iter()
        .filter(|s| opts.scenario.is_empty() || opts.scenario.iter().any(|w| w == s.name))
        .collect();
    install_signal_handlers();

    let kvx = match &opts.kvx {
        Some(p) => Ok(p.clone()),
        None => kvx::build(root),
    }
    .and_then(|p| kvx::Kvx::probe(&p))
    .map_err(|e| format!("{e:#}"));
    if let Err(e) = &kvx {
        eprintln!("integration: no usable kvx binary: {e}");
    }

    let net = if opts.loopback {
        eprintln!("integration: loopback run (--loopback)");
        Net::Loopback
    } else if let Some(why) = netns::unavailable_reason() {
        eprintln!("integration: separate hosts unavailable ({why}); running on loopback");
        Net::Loopback
    } else {
        let stale = netns::remove_stale()?;
        if stale > 0 {
            eprintln!("integration: removed {stale} namespaces left by earlier runs");
        }
        let topo = netns::Topology::create(3)?;
        eprintln!(
            "integration: hosts {}",
            topo.hosts()
                .iter()
                .map(|h| format!("{}={}", h.ns, h.ip))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Net::Hosts(Arc::new(topo))
    };
    let net = Arc::new(net);
    let where_ = match &*net {
        Net::Loopback => "loopback".to_string(),
        Net::Hosts(t) => format!("{} network namespaces", t.hosts().len()),
    };
    let logs = report::report_dir(root).join("logs");
    let _ = std::fs::remove_dir_all(&logs);

    let mut outcomes = Vec::new();
    for s in selected {
        if INTERRUPTED.load(Ordering::SeqCst) {
            break;
        }
        if let Net::Hosts(t) = &*net
            && let Err(e) = t.clear_faults()
        {
            eprintln!("integration: clearing faults: {e:#}");
        }
        let mut o = run_one(
            s,
            opts.profile,
            kvx.clone(),
            net.clone(),
            &logs.join(s.name),
        );
        o.verdict = strict_skip(s, opts.require_hosts, o.verdict);
        println!("{}", verdict_line(&o));
        outcomes.push(o);
    }
    if proc::live_count() > 0 {
        eprintln!(
            "integration: {} process groups outlived their scenario; killing them",
            proc::live_count()
        );
        proc::kill_all();
    }
    // Tear the hosts down now, even if a stuck scenario thread still holds a reference.
    if let Net::Hosts(t) = &*net {
        t.teardown();
    }
    drop(net);

    let passed = outcomes
        .iter()
        .filter(|o| matches!(o.verdict, Verdict::Pass(_)))
        .count();
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o.verdict, Verdict::Fail(_)))
        .count();
    let skipped: Vec<&str> = outcomes
        .iter()
        .filter(|o| matches!(o.verdict, Verdict::Skip(_)))
        .map(|o| o.name)
        .collect();
    match write_report(root, opts.profile, &where_, &outcomes) {
        Ok(p) => eprintln!("integration: report in {}", p.display()),
        Err(e) => eprintln!("integration: writing the report: {e:#}"),
    }
    if !skipped.is_empty() {
        println!("{} skipped: {}", skipped.len(), skipped.join(", "));
    }
    println!("{passed} passed, {failed} failed");
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    if failed > 0 {
        bail!("{failed} integration scenarios failed");
    }
    Ok(())
}

/// A SKIP of a scenario that needs separate hosts, under [`Opts::require_hosts`], as a FAIL.
fn strict_skip(s: &Scenario, require_hosts: bool, v: Verdict) -> Verdict {
    match v {
        Verdict::Skip(why) if require_hosts && s.needs_hosts => Verdict::Fail(format!(
            "skipped where separate hosts are required (--require-hosts, set by `cargo xtask test` as root): {why}"
        )),
        v => v,
    }
}

fn run_one(
    s: &Scenario,
    profile: Profile,
    kvx: Result<kvx::Kvx, String>,
    net: Arc<Net>,
    logs: &Path,
) -> Outcome {
    let budget = Duration::from_secs(match profile {
        Profile::Short => s.budget_s.0,
        Profile::Long => s.budget_s.1,
    });
    let pgids = Arc::new(Mutex::new(Vec::new()));
    let mut ctx = Ctx {
        profile,
        kvx,
        net,
        logs: logs.to_path_buf(),
        latencies_ms: Vec::new(),
        pgids: pgids.clone(),
    };
    let (tx, rx) = mpsc::channel();
    let f = s.run;
    let t0 = Instant::now();
    let handle = std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut ctx)));
        let _ = tx.send((r, std::mem::take(&mut ctx.latencies_ms)));
    });
    let (verdict, latencies_ms) = loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((Ok(Ok(v)), lat)) => break (v, lat),
            Ok((Ok(Err(e)), lat)) => break (Verdict::Fail(format!("{e:#}")), lat),
            Ok((Err(_), _)) => break (Verdict::Fail("scenario panicked".into()), Vec::new()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break (Verdict::Fail("scenario vanished".into()), Vec::new());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let over = t0.elapsed() > budget;
                if over || INTERRUPTED.load(Ordering::SeqCst) {
                    if let Ok(g) = pgids.lock() {
                        proc::kill_groups(&g);
                    }
                    // Its processes are dead, so its waits end; give it a moment to unwind.
                    let _ = rx.recv_timeout(Duration::from_secs(5));
                    let why = if over {
                        format!("timed out after {} s", budget.as_secs())
                    } else {
                        "interrupted".into()
                    };
                    break (Verdict::Fail(why), Vec::new());
                }
            }
        }
    };
    // The thread ends right after sending (dropping its processes and its hold on the hosts);
    // a thread stuck past its budget is left behind with its processes already killed.
    for _ in 0..100 {
        if handle.is_finished() {
            let _ = handle.join();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Outcome {
        name: s.name,
        verdict,
        secs: t0.elapsed().as_secs_f64(),
        latencies_ms,
    }
}

fn write_report(
    root: &Path,
    profile: Profile,
    where_: &str,
    outcomes: &[Outcome],
) -> Result<PathBuf> {
    let mut part = Part::default();
    part.heading(2, "Integration scenarios");
    part.para(&format!(
        "Profile `{}`, on {where_}. Run with `cargo xtask integration --profile {}`; logs of every \
         process are under `logs/<scenario>/`.",
        if profile == Profile::Short {
            "short"
        } else {
            "long"
        },
        if profile == Profile::Short {
            "short"
        } else {
            "long"
        },
    ));
    let rows: Vec<Vec<String>> = outcomes
        .iter()
        .map(|o| {
            let (v, text) = match &o.verdict {
                Verdict::Pass(t) => ("PASS", t),
                Verdict::Fail(t) => ("FAIL", t),
                Verdict::Skip(t) => ("SKIP", t),
            };
            vec![
                o.name.to_string(),
                v.to_string(),
                format!("{:.1}", o.secs),
                text.lines().next().unwrap_or_default().to_string(),
            ]
        })
        .collect();
    part.table(
        &["scenario", "verdict", "seconds", "figures / reason"],
        &rows,
    );
    let with_lat: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !o.latencies_ms.is_empty())
        .collect();
    if with_lat.is_empty() {
        part.para(
            "No room-latency CDF: the decode summaries of this run list no per-room latencies \
             (`latencies_ms`); the p50/p99 in the figures above come from the summaries.",
        );
    } else {
        part.heading(3, "Room latency");
        let mut rows = Vec::new();
        let mut plot = svg::LinePlot::new(
            "Room latency CDF (request → Success at the decode)",
            "latency (ms)",
            "fraction of rooms",
        );
        for o in &with_lat {
            let q = |p| {
                svg::quantile(&o.latencies_ms, p)
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_default()
            };
            rows.push(vec![
                o.name.to_string(),
                o.latencies_ms.len().to_string(),
                q(0.5),
                q(0.9),
                q(0.99),
                q(1.0),
            ]);
            plot.series
                .push(svg::Series::new(o.name, svg::cdf(&o.latencies_ms)));
        }
        part.table(
            &["scenario", "rooms", "p50 ms", "p90 ms", "p99 ms", "max ms"],
            &rows,
        );
        part.plot("room-latency-cdf.svg", "room latency CDF", &plot);
    }
    report::write_part(root, "integration", &part)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx_loopback() -> Ctx {
        Ctx {
            profile: Profile::Short,
            kvx: Err("none".into()),
            net: Arc::new(Net::Loopback),
            logs: std::env::temp_dir().join(format!("kvx-integ-test-{}", std::process::id())),
            latencies_ms: Vec::new(),
            pgids: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn slow(ctx: &mut Ctx) -> Result<Verdict> {
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        let mut p = ctx.spawn("sleeper", cmd)?;
        p.wait_timeout(Duration::from_secs(600));
        Ok(Verdict::Pass("should not get here".into()))
    }

    fn quick(ctx: &mut Ctx) -> Result<Verdict> {
        ctx.latencies_ms = vec![1.0, 2.0];
        Ok(Verdict::Pass("fine".into()))
    }

    #[test]
    fn a_scenario_over_budget_fails_and_its_processes_die() {
        let s = Scenario {
            name: "slow",
            about: "sleeps",
            budget_s: (1, 1),
            run: slow,
            needs_hosts: false,
        };
        let c = ctx_loopback();
        let logs = c.logs.clone();
        let o = run_one(&s, Profile::Short, Err("none".into()), c.net.clone(), &logs);
        assert_eq!(o.verdict, Verdict::Fail("timed out after 1 s".into()));
        assert!(o.secs < 60.0);
        let line = verdict_line(&o);
        assert!(line.starts_with("FAIL slow ("), "{line}");
        let _ = std::fs::remove_dir_all(logs);
    }

    #[test]
    fn verdicts_and_latencies_come_back() {
        let s = Scenario {
            name: "quick",
            about: "passes",
            budget_s: (10, 10),
            run: quick,
            needs_hosts: false,
        };
        let c = ctx_loopback();
        let o = run_one(
            &s,
            Profile::Short,
            Err("none".into()),
            c.net.clone(),
            &c.logs,
        );
        assert_eq!(o.verdict, Verdict::Pass("fine".into()));
        assert_eq!(o.latencies_ms, vec![1.0, 2.0]);
        let skip = Outcome {
            name: "x",
            verdict: Verdict::Skip("kvx lacks decode".into()),
            secs: 0.0,
            latencies_ms: Vec::new(),
        };
        assert_eq!(verdict_line(&skip), "SKIP x: kvx lacks decode");
    }

    #[test]
    fn a_skip_of_a_host_scenario_fails_where_hosts_are_required() {
        let all = scenarios::all();
        let needing: Vec<&str> = all
            .iter()
            .filter(|s| s.needs_hosts)
            .map(|s| s.name)
            .collect();
        assert_eq!(
            needing,
            vec!["lossy-link", "partition", "silent-decode", "abort-drain"]
        );
        let lossy = all.iter().find(|s| s.name == "lossy-link").unwrap();
        let happy = all.iter().find(|s| s.name == "happy-tp1").unwrap();
        let skip = || Verdict::Skip("needs separate hosts".into());
        match strict_skip(lossy, true, skip()) {
            Verdict::Fail(why) => assert!(why.contains("needs separate hosts"), "{why}"),
            v => panic!("{v:?}"),
        }
        assert_eq!(strict_skip(lossy, false, skip()), skip());
        assert_eq!(strict_skip(happy, true, skip()), skip());
        let pass = Verdict::Pass("ok".into());
        assert_eq!(strict_skip(lossy, true, pass.clone()), pass);
    }

    #[test]
    fn every_scenario_has_a_unique_stable_name_and_a_budget() {
        let all = scenarios::all();
        let mut names: Vec<&str> = all.iter().map(|s| s.name).collect();
        for want in [
            "happy-tp1",
            "hetero-tp",
            "mla-dummy",
            "kill-decode",
            "kill-prefill",
            "lossy-link",
            "partition",
            "silent-decode",
            "malformed-flood",
            "abort-drain",
            "fatal-worker",
            "soak",
        ] {
            assert!(names.contains(&want), "{want} missing");
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert!(
            all.iter()
                .all(|s| s.budget_s.0 > 0 && s.budget_s.0 <= s.budget_s.1)
        );
        let short: u64 = all.iter().map(|s| s.budget_s.0).sum();
        assert!(short <= 20 * 60, "short profile budget {short} s");
    }
}
