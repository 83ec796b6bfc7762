//! `cargo xtask sim`: the deterministic simulation (`crates/kvx-sim`), built in release with
//! kvx-core's and kvx-engine's test-only mutant hooks, and the CI profile `cargo xtask test` runs: at least
//! 1,000,000 simulated steps with no violation, then every planted mutant, each of which must
//! be caught within the default step budget.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// The mutants the self-test must catch (kvx-sim's `--mutant` names).
pub const MUTANTS: [&str; 11] = [
    "late-write",
    "early-ack",
    "lost-status",
    "leak",
    "any-instance",
    "early-slot-reuse",
    "ignore-watermark",
    "early-exit",
    "place-over-live",
    "stale-blacklist",
    "stale-mark",
];

/// Options of `cargo xtask sim`.
#[derive(clap::Args, Debug, Default)]
pub struct Opts {
    /// Replay one seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Step budget (default 1,000,000; the long profile is 100,000,000).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Run with a planted bug (a kvx-sim mutant name; `kvx-sim --help` lists them).
    #[arg(long)]
    pub mutant: Option<String>,
}

fn command(opts: &Opts) -> Command {
    let mut cmd = super::cargo();
    cmd.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "kvx-sim",
        "--features",
        "mutants",
        "--",
    ]);
    if let Some(s) = opts.seed {
        cmd.args(["--seed", &s.to_string()]);
    }
    if let Some(n) = opts.steps {
        cmd.args(["--steps", &n.to_string()]);
    }
    if let Some(m) = &opts.mutant {
        cmd.args(["--mutant", m]);
    }
    cmd
}

/// Runs the simulator with `opts`, output passed through; fails on a violation.
pub fn run(opts: &Opts) -> Result<()> {
    super::run(&mut command(opts))
}

/// Violations in the simulator's last line (`N steps, M seeds, V violations`).
fn violations(stdout: &str) -> Result<u64> {
    let last = stdout.lines().last().unwrap_or_default();
    let v = last
        .strip_suffix(" violations")
        .and_then(|s| s.rsplit(", ").next())
        .and_then(|v| v.parse().ok());
    v.with_context(|| format!("unexpected last line from kvx-sim: {last:?}"))
}

/// The step budget within which CI expects each mutant caught (a run stops at its first
/// violation; the slowest, `any-instance`, needs about 1.2 M steps since connects stopped
/// holding their worker).
const MUTANT_STEPS: u64 = 5_000_000;

/// The CI profile: the default budget clean, every mutant caught within [`MUTANT_STEPS`].
pub fn ci() -> Result<()> {
    run(&Opts::default())?;
    for m in MUTANTS {
        let opts = Opts {
            mutant: Some(m.into()),
            steps: Some(MUTANT_STEPS),
            ..Opts::default()
        };
        let out = command(&opts)
            .output()
            .with_context(|| format!("running kvx-sim --mutant {m}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v = violations(&stdout)?;
        if v == 0 {
            bail!("kvx-sim did not catch mutant {m}:\n{stdout}");
        }
        let first = stdout.lines().next().unwrap_or_default();
        eprintln!("xtask: mutant {m} caught ({v} violations): {first}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_last_line() {
        assert_eq!(
            violations("a\n1000 steps, 3 seeds, 2 violations\n").ok(),
            Some(2)
        );
        assert!(violations("garbage").is_err());
    }
}
