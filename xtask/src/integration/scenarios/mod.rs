//! The named scenarios and their budgets. Each scenario first checks that the binary offers what
//! it needs (subcommands, flags) and says SKIP with the missing pieces otherwise; a scenario that
//! injects a fault through a failpoint the binary lacks FAILS instead (it could not test anything).

mod basic;
pub(crate) mod common;
mod faults;
mod flood;
mod net;

pub use common::Summary;

use super::{Ctx, Scenario, Verdict};

/// Every scenario, in run order (cheap and basic first, the soak last).
pub fn all() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "happy-tp1",
            about: "several rooms prefill TP1 -> decode TP1, bytes verified",
            budget_s: (60, 300),
            run: basic::happy_tp1,
            needs_hosts: false,
        },
        Scenario {
            name: "hetero-tp",
            about: "prefill TP2 -> decode TP1 and TP1 -> TP2, with and without staging",
            budget_s: (120, 600),
            run: basic::hetero_tp,
            needs_hosts: false,
        },
        Scenario {
            name: "hetero-tp-staging",
            about: "hetero-tp through the staging buffers (--staging on both sides)",
            budget_s: (120, 600),
            run: basic::hetero_tp_staging,
            needs_hosts: false,
        },
        Scenario {
            name: "mla-dummy",
            about: "MLA layout where some prefill ranks are dummies",
            budget_s: (60, 300),
            run: basic::mla_dummy,
            needs_hosts: false,
        },
        Scenario {
            name: "kill-decode",
            about: "kill -9 a decode mid-transfer: its rooms Failed on the prefill, a second decode unaffected",
            budget_s: (60, 300),
            run: faults::kill_decode,
            needs_hosts: false,
        },
        Scenario {
            name: "kill-prefill",
            about: "kill -9 a prefill: decode fails its rooms; the prefill restarts and new rooms succeed",
            budget_s: (90, 300),
            run: faults::kill_prefill,
            needs_hosts: false,
        },
        Scenario {
            name: "lossy-link",
            about: "5 ms delay, 1 % drop and a bandwidth cap: every room terminal, bytes verified",
            budget_s: (120, 600),
            run: net::lossy_link,
            needs_hosts: true,
        },
        Scenario {
            name: "partition",
            about: "link cut mid-transfer then restored: in-flight rooms fail in bounds, later rooms succeed",
            budget_s: (120, 600),
            run: net::partition,
            needs_hosts: true,
        },
        Scenario {
            name: "silent-decode",
            about: "one of two decodes goes silent mid-transfer: the other's rooms do not wait behind its batches",
            budget_s: (60, 300),
            run: net::silent_decode,
            needs_hosts: true,
        },
        Scenario {
            name: "malformed-flood",
            about: "garbage and truncated frames at every inbox and port while real rooms run",
            budget_s: (60, 300),
            run: flood::malformed_flood,
            needs_hosts: false,
        },
        Scenario {
            name: "abort-drain",
            about: "ABORT while batches are on the wire, batches failing mid-flight: ACK after drain, no write lands after the ACK",
            budget_s: (60, 300),
            run: flood::abort_drain,
            needs_hosts: true,
        },
        Scenario {
            name: "fatal-worker",
            about: "fatal worker fault via failpoint: exact message, rooms Failed, documented exit code",
            budget_s: (60, 300),
            run: faults::fatal_worker,
            needs_hosts: false,
        },
        Scenario {
            name: "soak",
            about: "many rooms with 1 % injected failures: all terminal, verified, nothing left behind",
            budget_s: (180, 3600),
            run: faults::soak,
            needs_hosts: false,
        },
    ]
}

/// FAIL when the binary lacks one of the failpoints `points` (or there is no binary), `None` when
/// it has them all: a fault that cannot be injected must not let a scenario pass.
pub fn need_failpoints(ctx: &Ctx, points: &[&str]) -> Option<Verdict> {
    match ctx.kvx() {
        Err(e) => Some(Verdict::Fail(format!("no kvx binary: {e}"))),
        Ok(k) => k.has_failpoints(points).err().map(Verdict::Fail),
    }
}

/// SKIP with what is missing from the binary, FAIL when there is no binary at all, `None` when
/// every need is met.
pub fn need(ctx: &Ctx, needs: &[&str]) -> Option<Verdict> {
    match ctx.kvx() {
        Err(e) => Some(Verdict::Fail(format!("no kvx binary: {e}"))),
        Ok(k) => k.supports(needs).err().map(Verdict::Skip),
    }
}
