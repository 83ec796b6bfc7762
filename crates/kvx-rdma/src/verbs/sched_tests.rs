//! Tests of the per-peer scheduler against a simulated reliable-connected NIC.

use std::collections::{BTreeSet, HashMap, VecDeque};

use proptest::prelude::*;

use super::*;
use crate::verbs::error::{WC_SUCCESS, WC_WR_FLUSH_ERR};

const REM_ACCESS_ERR: u32 = 10;

#[test]
fn one_batch_spreads_over_queue_pairs_and_completes() {
    let cfg = SchedConfig {
        depth: 8,
        signal_every: 4,
        max_wr_per_post: 4,
    };
    let mut s = PeerScheduler::new(cfg, vec![0x10, 0x11]);
    assert!(s.submit(1, 8).is_none());
    let posts = s.schedule();
    assert_eq!(posts.len(), 2);
    assert_eq!(posts[0].items.len(), 4);
    assert_eq!(posts[1].items.len(), 4);
    for p in &posts {
        assert!(p.items.last().unwrap().signaled);
    }
    let last0 = posts[0].items.last().unwrap().wr_id;
    assert!(
        s.on_completion(posts[0].qp, last0, WC_SUCCESS, 0)
            .is_empty()
    );
    let last1 = posts[1].items.last().unwrap().wr_id;
    assert_eq!(
        s.on_completion(posts[1].qp, last1, WC_SUCCESS, 0),
        vec![(1, Ok(()))]
    );
    assert_eq!(s.open_batches(), 0);
}

#[test]
fn error_fails_only_its_batch_and_flushed_work_moves() {
    let cfg = SchedConfig {
        depth: 16,
        signal_every: 16,
        max_wr_per_post: 16,
    };
    let mut s = PeerScheduler::new(cfg, vec![0x20, 0x21]);
    assert!(s.submit(1, 1).is_none());
    assert!(s.submit(2, 3).is_none());
    let posts = s.schedule();
    assert_eq!(posts.len(), 2);
    // queue pair 0 carries batch 1 and the first work request of batch 2
    let qp0 = posts.iter().find(|p| p.qp == 0).unwrap().clone();
    assert_eq!(
        qp0.items
            .iter()
            .map(|i| (i.batch, i.wr))
            .collect::<Vec<_>>(),
        [(1, 0), (2, 0)]
    );
    let out = s.on_completion(0, qp0.items[0].wr_id, REM_ACCESS_ERR, 0x42);
    assert!(matches!(
        out.as_slice(),
        [(
            1,
            Err(VerbsError::Completion {
                qpn: 0x20,
                status: REM_ACCESS_ERR,
                vendor_err: 0x42,
                ..
            })
        )]
    ));
    assert_eq!(s.stats().requeued, 1);
    // the flushed work request of batch 2 moves to queue pair 1
    let again = s.schedule();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].qp, 1);
    assert_eq!((again[0].items[0].batch, again[0].items[0].wr), (2, 0));
    let first = posts.iter().find(|p| p.qp == 1).unwrap();
    assert!(
        s.on_completion(1, first.items.last().unwrap().wr_id, WC_SUCCESS, 0)
            .is_empty()
    );
    let out = s.on_completion(1, again[0].items[0].wr_id, WC_SUCCESS, 0);
    assert_eq!(out, vec![(2, Ok(()))]);
}

#[test]
fn losing_every_queue_pair_fails_with_peer_lost() {
    let mut s = PeerScheduler::new(SchedConfig::default(), vec![1]);
    assert!(s.submit(5, 3).is_none());
    let posts = s.schedule();
    let last = posts[0].items.last().unwrap().wr_id;
    let out = s.on_completion(0, last, WC_WR_FLUSH_ERR, 0);
    assert!(matches!(
        out.as_slice(),
        [(5, Err(VerbsError::PeerLost(_)))]
    ));
    assert!(matches!(
        s.submit(6, 1),
        Some((6, Err(VerbsError::PeerLost(_))))
    ));
    assert_eq!(s.submit(7, 0), Some((7, Ok(()))));
}

#[derive(Clone, Debug)]
enum Step {
    Submit(u32),
    Schedule,
    Complete(usize),
    Fail(usize),
    Break(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1u32..24).prop_map(Step::Submit),
        3 => Just(Step::Schedule),
        6 => (0usize..3).prop_map(Step::Complete),
        1 => (0usize..3).prop_map(Step::Fail),
        1 => (0usize..3).prop_map(Step::Break),
    ]
}

/// The simulated NIC and the checker's bookkeeping.
#[derive(Default)]
struct Sim {
    fifo: Vec<VecDeque<PostItem>>,
    broken: Vec<bool>,
    executed: HashMap<BatchId, BTreeSet<u32>>,
    sizes: HashMap<BatchId, u32>,
    guilty: BTreeSet<BatchId>,
    results: HashMap<BatchId, Result<(), VerbsError>>,
}

impl Sim {
    fn record(&mut self, out: Vec<BatchResult>) -> Result<(), TestCaseError> {
        for (id, r) in out {
            prop_assert!(
                !self.results.contains_key(&id),
                "batch {} finished twice",
                id
            );
            for f in &self.fifo {
                prop_assert!(
                    f.iter().all(|i| i.batch != id),
                    "batch {} reported while on the wire",
                    id
                );
            }
            match &r {
                Ok(()) => {
                    let done = self.executed.get(&id).map_or(0, |s| s.len() as u32);
                    prop_assert_eq!(
                        done,
                        self.sizes[&id],
                        "batch {} ok but not fully written",
                        id
                    );
                }
                Err(VerbsError::Completion { .. }) => prop_assert!(self.guilty.contains(&id)),
                Err(VerbsError::PeerLost(_)) => prop_assert!(self.broken.iter().all(|b| *b)),
                Err(e) => prop_assert!(false, "unexpected error {}", e),
            }
            self.results.insert(id, r);
        }
        Ok(())
    }
}

proptest! {
    #[test]
    fn scheduler_against_simulated_nic(
        steps in proptest::collection::vec(step(), 1..120),
        depth in 1u32..12,
        signal_every in 1u32..12,
        max_wr_per_post in 1u32..10,
    ) {
        let cfg = SchedConfig { depth, signal_every, max_wr_per_post };
        let nqp = 3;
        let mut s = PeerScheduler::new(cfg, vec![1, 2, 3]);
        let mut sim = Sim { fifo: vec![VecDeque::new(); nqp], broken: vec![false; nqp], ..Sim::default() };
        let mut next_batch = 1u64;
        let post = |s: &mut PeerScheduler, sim: &mut Sim| -> Result<(), TestCaseError> {
            for p in s.schedule() {
                prop_assert!(!sim.broken[p.qp]);
                prop_assert!(!p.items.is_empty() && p.items.len() as u32 <= max_wr_per_post);
                prop_assert!(p.items.last().unwrap().signaled);
                sim.fifo[p.qp].extend(p.items.iter().copied());
            }
            for q in 0..sim.fifo.len() {
                prop_assert!(sim.fifo[q].len() as u32 <= depth);
                // unsignalled work requests that ran still hold their slot until a later
                // signalled completion
                let outstanding = s.send_queue(q).unwrap().outstanding();
                prop_assert!(outstanding >= sim.fifo[q].len() && outstanding as u32 <= depth);
                let mut run = 0;
                for i in &sim.fifo[q] {
                    run = if i.signaled { 0 } else { run + 1 };
                    prop_assert!(run < signal_every.clamp(1, depth));
                }
            }
            Ok(())
        };
        for st in steps {
            match st {
                Step::Submit(n) => {
                    let id = next_batch;
                    next_batch += 1;
                    sim.sizes.insert(id, n);
                    if let Some(r) = s.submit(id, n) {
                        sim.record(vec![r])?;
                    }
                }
                Step::Schedule => post(&mut s, &mut sim)?,
                Step::Complete(q) => {
                    if let Some(i) = sim.fifo[q].pop_front() {
                        sim.executed.entry(i.batch).or_default().insert(i.wr);
                        if i.signaled {
                            let out = s.on_completion(q, i.wr_id, WC_SUCCESS, 0);
                            sim.record(out)?;
                        }
                    }
                }
                Step::Fail(q) => {
                    if let Some(i) = sim.fifo[q].pop_front() {
                        sim.broken[q] = true;
                        sim.guilty.insert(i.batch);
                        let mut out = s.on_completion(q, i.wr_id, REM_ACCESS_ERR, 0);
                        let rest: Vec<PostItem> = sim.fifo[q].drain(..).collect();
                        for r in rest.iter().filter(|r| r.signaled) {
                            out.extend(s.on_completion(q, r.wr_id, WC_WR_FLUSH_ERR, 0));
                        }
                        sim.record(out)?;
                    }
                }
                Step::Break(q) => {
                    // an asynchronous fatal event: nothing more runs on this queue pair
                    sim.broken[q] = true;
                    sim.fifo[q].clear();
                    let out = s.qp_broken(q);
                    sim.record(out)?;
                }
            }
        }
        // drain: the NIC completes everything, the scheduler posts until nothing is left
        for _ in 0..10_000 {
            post(&mut s, &mut sim)?;
            let mut any = false;
            for q in 0..nqp {
                while let Some(i) = sim.fifo[q].pop_front() {
                    any = true;
                    sim.executed.entry(i.batch).or_default().insert(i.wr);
                    if i.signaled {
                        let out = s.on_completion(q, i.wr_id, WC_SUCCESS, 0);
                        sim.record(out)?;
                    }
                }
            }
            if !any {
                break;
            }
        }
        prop_assert_eq!(s.open_batches(), 0);
        prop_assert_eq!(sim.results.len() as u64, next_batch - 1);
        // batches that were not guilty succeed while a queue pair survives
        if sim.broken.iter().any(|b| !b) {
            for (id, r) in &sim.results {
                if !sim.guilty.contains(id) {
                    prop_assert!(r.is_ok(), "innocent batch {} failed: {:?}", id, r);
                }
            }
        }
    }
}
