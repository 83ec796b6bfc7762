//! `kvx-sim [--seed S] [--steps N] [--mutant NAME] [--first-seed S]`: runs seeds until the step
//! budget is spent (or one seed with `--seed`), stops at the first violation and replays it
//! with a trace, and prints one line per invariant, then `N steps, M seeds, V violations`.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Instant;

use kvx_sim::invariants::Inv;
use kvx_sim::mutants::Mutant;
use kvx_sim::{replay, run_seed};

fn usage() -> ExitCode {
    eprintln!("usage: kvx-sim [--seed S] [--steps N] [--mutant NAME] [--first-seed S]");
    eprintln!("mutants: {}", Mutant::ALL.map(Mutant::name).join(", "));
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut seed = None;
    let mut first = 0u64;
    let mut steps = 1_000_000u64;
    let mut mutant = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let val = args.next();
        let num = val.as_deref().and_then(|v| v.parse::<u64>().ok());
        match (a.as_str(), num) {
            ("--seed", Some(n)) => seed = Some(n),
            ("--first-seed", Some(n)) => first = n,
            ("--steps", Some(n)) => steps = n,
            ("--mutant", _) => match val.as_deref().and_then(Mutant::parse) {
                Some(m) => mutant = Some(m),
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    if let Some(m) = mutant
        && m.in_core()
        && !cfg!(feature = "mutants")
    {
        eprintln!("kvx-sim: mutant {} needs the `mutants` feature", m.name());
        return ExitCode::from(2);
    }
    let start = Instant::now();
    let mut checks = [0u64; Inv::ALL.len()];
    let mut violations = Vec::new();
    let (mut total, mut seeds) = (0u64, 0u64);
    let mut stats = kvx_sim::Stats::default();
    let mut next = seed.unwrap_or(first);
    loop {
        let Ok(out) = std::panic::catch_unwind(|| run_seed(next, mutant)) else {
            println!("seed {next}: the simulator itself panicked (replay with --seed {next})");
            return ExitCode::FAILURE;
        };
        total += out.steps;
        seeds += 1;
        stats.scattered += out.stats.scattered;
        stats.in_place += out.stats.in_place;
        stats.mixed_chunks += out.stats.mixed_chunks;
        stats.sessions_lost += out.stats.sessions_lost;
        stats.aux_rows += out.stats.aux_rows;
        stats.state_slots += out.stats.state_slots;
        stats.skipped_jobs += out.stats.skipped_jobs;
        stats.preconnects += out.stats.preconnects;
        stats.worker_restarts += out.stats.worker_restarts;
        stats.undrained_success += out.stats.undrained_success;
        stats.stale_failures += out.stats.stale_failures;
        stats.lost_abort_writes += out.stats.lost_abort_writes;
        stats.abort_resends += out.stats.abort_resends;
        stats.marked_skips += out.stats.marked_skips;
        stats.passed_jobs += out.stats.passed_jobs;
        stats.unmarked_failures += out.stats.unmarked_failures;
        stats.failed_connects += out.stats.failed_connects;
        for (c, n) in checks.iter_mut().zip(out.checks) {
            *c += n;
        }
        if let Some(v) = out.violations.first() {
            println!("seed {next}: {v}");
            let (lines, same) = replay(next, mutant, v);
            println!("trace of seed {next} (room {:?} and rank faults):", v.room);
            for l in &lines {
                println!("  {l}");
            }
            if !same {
                println!("replay of seed {next} did NOT reproduce the violation (nondeterminism)");
            }
            violations.extend(out.violations.iter().map(|v| (next, v.clone())));
            break;
        }
        if seed.is_some() || total >= steps {
            break;
        }
        next += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let width = Inv::ALL
        .map(|i| i.name().len())
        .into_iter()
        .max()
        .unwrap_or(0);
    for inv in Inv::ALL {
        let v: Vec<_> = violations.iter().filter(|(_, v)| v.inv == inv).collect();
        match v.first() {
            None => println!(
                "{:<width$} ok ({} checks)",
                inv.name(),
                checks[inv as usize]
            ),
            Some((s, first)) => println!(
                "{:<width$} {} VIOLATED ({} checks; first: seed {s}, {first})",
                inv.name(),
                v.len(),
                checks[inv as usize]
            ),
        }
    }
    eprintln!(
        "kvx-sim: {:.0} steps/s ({total} steps in {secs:.2} s; {} staged chunks landed ({} blocks in place, {} chunks partly in place), {} SessionLost, {} AUX_DATA rows, {} state slots, {} cancelled jobs skipped, {} sessions opened ahead of rooms, {} workers restarted, {} Success before a lost CHUNK_READY, {} failures towards a restarted decode's earlier process, {} writes after a release timeout that followed a lost ABORT, {} ABORTs sent again, {} jobs failed by a dead-session mark, {} jobs started past a session at its depth, {} failed preconnects, {} failures from before a registration that marked nothing){}",
        total as f64 / secs.max(1e-9),
        stats.scattered,
        stats.in_place,
        stats.mixed_chunks,
        stats.sessions_lost,
        stats.aux_rows,
        stats.state_slots,
        stats.skipped_jobs,
        stats.preconnects,
        stats.worker_restarts,
        stats.undrained_success,
        stats.stale_failures,
        stats.lost_abort_writes,
        stats.abort_resends,
        stats.marked_skips,
        stats.passed_jobs,
        stats.failed_connects,
        stats.unmarked_failures,
        mutant
            .map(|m| format!(", mutant {}", m.name()))
            .unwrap_or_default()
    );
    println!(
        "{total} steps, {seeds} seeds, {} violations",
        violations.len()
    );
    if violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
