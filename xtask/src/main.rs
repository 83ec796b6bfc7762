//! `cargo xtask`: every kvx chore that is not plain cargo.
//!
//! - `cargo xtask test`: installs what the tests need when it is missing (Debian packages, the
//!   Python venv for the interop peers), then runs `cargo fmt --check`, clippy with `-D warnings`,
//!   `cargo doc --no-deps` with `RUSTDOCFLAGS=-D warnings`, every test of the workspace (nextest
//!   when present, doc tests too), then the short profile of `cargo xtask integration`.
//! - `cargo xtask fuzz [--seconds N]`: runs every cargo-fuzz target for a bounded time.
//! - `cargo xtask bench [transport|e2e|interop]`: the benchmarks anyone can rerun, whole rooms end
//!   to end, and kvx's mooncake backend against the real Mooncake TE (`interop`); writes
//!   `target/kvx-report/report.md`.
//! - `cargo xtask integration`: multi-process fault runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod integration;
mod report;
mod setup;
mod sim;

#[derive(Parser)]
#[command(name = "xtask", about = "kvx chores")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Set up what is missing, then fmt, clippy and every test.
    Test {
        /// Skip installing packages and the venv (assume they are there).
        #[arg(long)]
        no_setup: bool,
    },
    /// Install the Debian packages and the Python venv the tests need.
    Setup,
    /// Run every fuzz target for a bounded time.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
    },
    /// Run the benchmarks (`transport` for the transport table only, `e2e` for whole rooms
    /// only), then write `target/kvx-report/report.md`.
    Bench {
        /// Which benchmark group (`e2e`: whole rooms end to end); all when absent.
        what: Option<String>,
    },
    /// Multi-process and multi-host fault scenarios with real `kvx` processes.
    Integration(integration::Opts),
    /// Deterministic simulation of the prefill and decode managers (`crates/kvx-sim`).
    Sim(sim::Opts),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = project_root();
    std::env::set_current_dir(&root)?;
    match cli.cmd {
        Cmd::Test { no_setup } => {
            // The venv (minutes of pip on a fresh machine) is made while fmt and clippy run;
            // the tests wait for it.
            let venv = if no_setup {
                None
            } else {
                setup::ensure_apt()?;
                let root = root.clone();
                Some(std::thread::spawn(move || setup::ensure_venv(&root)))
            };
            test(&root, venv)
        }
        Cmd::Setup => setup::ensure_all(&root),
        Cmd::Fuzz { seconds } => fuzz(&root, seconds),
        Cmd::Bench { what } if what.as_deref() == Some("interop") => report::interop::run(&root),
        Cmd::Bench { what } => {
            let r = if what.as_deref() == Some("e2e") {
                Ok(())
            } else {
                bench(what.as_deref())
            };
            bench_report(&root);
            if what.is_none() || what.as_deref() == Some("e2e") {
                match integration::e2e::run(&root) {
                    Ok(part) => {
                        if let Err(e) = report::write_part(&root, "bench-e2e", &part) {
                            eprintln!("xtask: writing the e2e report: {e:#}");
                        }
                    }
                    Err(e) => return Err(e.context("end-to-end rooms")),
                }
            }
            r
        }
        Cmd::Integration(opts) => integration::run(&root, &opts),
        Cmd::Sim(opts) => sim::run(&opts),
    }
}

/// The workspace root (the parent of this crate's folder).
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs a command, failing with its name when it exits non-zero.
pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn has_nextest() -> bool {
    cargo()
        .args(["nextest", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn test(root: &Path, venv: Option<std::thread::JoinHandle<Result<()>>>) -> Result<()> {
    let venv_bin = root.join(".venv/bin");
    let path = format!(
        "{}:{}",
        venv_bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo()
        .args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
        ])
        .args(["-D", "warnings"]))?;
    // The API docs build without a warning (broken intra-doc links, undocumented public items
    // through each library crate's `missing_docs` lint). `--no-deps` documents only the
    // workspace's crates: a few seconds on top of clippy, whose dependency metadata it reuses.
    run(cargo().env("RUSTDOCFLAGS", "-D warnings").args([
        "doc",
        "--workspace",
        "--no-deps",
        "--all-features",
    ]))?;
    if let Some(v) = venv {
        v.join()
            .map_err(|_| anyhow::anyhow!("the venv setup thread panicked"))?
            .context("setting up the Python venv")?;
    }
    if has_nextest() {
        run(cargo()
            .env("PATH", &path)
            .env("KVX_PYTHON", venv_bin.join("python3"))
            .args(["nextest", "run", "--workspace", "--all-features"])
            .args(["--no-fail-fast", "--failure-output", "final"]))?;
    } else {
        run(cargo()
            .env("PATH", &path)
            .env("KVX_PYTHON", venv_bin.join("python3"))
            .args([
                "test",
                "--workspace",
                "--all-features",
                "--lib",
                "--bins",
                "--tests",
            ]))?;
    }
    run(cargo()
        .env("PATH", &path)
        .args(["test", "--workspace", "--all-features", "--doc"]))?;
    // Every crate's example runs as its README says; each checks its own result and exits
    // non-zero on a mismatch.
    for (package, example, args) in EXAMPLES {
        run(cargo()
            .env("PATH", &path)
            .args([
                "run",
                "-q",
                "--all-features",
                "-p",
                package,
                "--example",
                example,
                "--",
            ])
            .args(args))?;
    }
    // The deterministic simulation: 1,000,000 steps clean, every planted mutant caught.
    sim::ci()?;
    // The short profile of the multi-process fault scenarios (a few minutes on 2 cores).
    integration::run(
        root,
        &integration::Opts {
            profile: integration::Profile::Short,
            scenario: Vec::new(),
            kvx: None,
            loopback: false,
            list: false,
            // CI runs as root, where network namespaces work: the link-fault scenarios must
            // run there, so their SKIP fails the run.
            // SAFETY: geteuid(2) has no arguments and cannot fail.
            require_hosts: unsafe { libc::geteuid() } == 0,
        },
    )?;
    eprintln!("xtask: all tests passed");
    Ok(())
}

/// The examples `cargo xtask test` runs: (package, example, arguments). `engine_rooms` runs
/// its staged TP 2 → TP 1 shape small: two prefill engines and an embedded decode engine with a
/// staging ring (`DecodeEngineConfig::staging`), every byte verified; then a few empty rooms and
/// the control path's floor.
const EXAMPLES: [(&str, &str, &[&str]); 7] = [
    ("kvx-core", "managers", &[]),
    ("kvx-bootstrap", "registration", &[]),
    ("kvx-staging", "ring", &[]),
    ("kvx-rdma", "tcp_batch", &[]),
    ("kvx-engine", "embed", &[]),
    (
        "kvx-cli",
        "engine_rooms",
        &[
            "--model",
            "llama3-8b",
            "--tp-size",
            "2",
            "--tokens",
            "512",
            "--rooms",
            "2",
            "--staging-ring-mib",
            "64",
            "--chunked-prefill-size",
            "128",
        ],
    ),
    (
        "kvx-cli",
        "engine_rooms",
        &["--model", "tiny", "--empty-rooms", "50"],
    ),
];

fn fuzz(root: &Path, seconds: u64) -> Result<()> {
    let fuzz_dir = root.join("fuzz");
    if !fuzz_dir.join("Cargo.toml").exists() {
        bail!("no fuzz targets yet (fuzz/Cargo.toml missing)");
    }
    setup::ensure_cargo_fuzz()?;
    let list = cargo()
        .current_dir(&fuzz_dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["fuzz", "list"])
        .output()?;
    let targets = String::from_utf8_lossy(&list.stdout).to_string();
    for target in targets.lines().map(str::trim).filter(|t| !t.is_empty()) {
        run(cargo()
            .current_dir(&fuzz_dir)
            .env("RUSTC_BOOTSTRAP", "1")
            .args([
                "fuzz",
                "run",
                target,
                "--",
                &format!("-max_total_time={seconds}"),
            ]))?;
    }
    Ok(())
}

/// Writes the benchmark section of `target/kvx-report/report.md` from criterion's results.
fn bench_report(root: &Path) {
    let dir = report::report_dir(root);
    match report::bench::part_from_target(&dir).and_then(|p| report::write_part(root, "bench", &p))
    {
        Ok(path) => eprintln!("xtask: report in {}", path.display()),
        Err(e) => eprintln!("xtask: writing the bench report: {e:#}"),
    }
}

fn bench(what: Option<&str>) -> Result<()> {
    match what {
        None => run(cargo().args(["bench", "-p", "kvx-benches"])),
        Some(group) => run(cargo().args(["bench", "-p", "kvx-benches", "--bench", group])),
    }
}
