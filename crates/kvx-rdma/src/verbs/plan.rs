//! Work-request planning: a batch of `(src, dst, len)` ops → RDMA WRITE work requests.
//!
//! One RDMA WRITE carries one contiguous remote range and a gather list of local ranges (SGEs).
//! The planner walks the ops in order, checks every op against the local and the remote region
//! tables (before anything is built), and packs them:
//!
//! - ops whose destinations are contiguous inside one remote region share a work request;
//! - within a work request, ops whose sources are contiguous inside one local region share an
//!   SGE, otherwise a new SGE is added, up to `max_sge`;
//! - a work request never exceeds `max_wr_bytes`, so large ops are sliced (which also lets the
//!   scheduler spread one large op over several queue pairs);
//! - a work request no longer than `max_inline` is marked inline.
//!
//! The result is flat ([`WritePlan`]): one vector of work requests and one of SGEs, so
//! allocation is proportional to the number of work requests, not to the number of ops.

use kvx_core::TransferOp;

use super::error::VerbsError;
use super::regions::{Region, RegionTable};

/// Device and policy limits the planner respects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most SGEs in one work request (the queue pair's `max_send_sge`); at least 1.
    pub max_sge: u32,
    /// Largest payload sent inline (the queue pair's `max_inline_data`); 0 disables inlining.
    pub max_inline: u32,
    /// Largest payload of one work request (at most the port's `max_msg_sz`); at least 1.
    pub max_wr_bytes: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_sge: 4,
            max_inline: 0,
            max_wr_bytes: 4 << 20,
        }
    }
}

impl Limits {
    /// The limits with zero fields raised to 1 (a zero limit would make every op unplannable).
    pub fn sanitized(self) -> Self {
        Limits {
            max_sge: self.max_sge.max(1),
            max_inline: self.max_inline,
            max_wr_bytes: self.max_wr_bytes.max(1),
        }
    }
}

/// One scatter/gather entry: a local range and its lkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Local address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// lkey of the local region containing the range.
    pub lkey: u32,
}

/// One RDMA WRITE: a contiguous remote range filled from `sge_count` SGEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Remote destination address.
    pub remote_addr: u64,
    /// rkey of the remote region containing the destination.
    pub rkey: u32,
    /// Payload length (sum of the SGE lengths).
    pub len: u32,
    /// Index of the first SGE in [`WritePlan::sges`].
    pub sge_start: u32,
    /// Number of SGEs (1..=`max_sge`).
    pub sge_count: u32,
    /// Send the payload inline (copied into the work queue entry).
    pub inline: bool,
}

/// The work requests of one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WritePlan {
    /// Work requests in posting order.
    pub wrs: Vec<WorkRequest>,
    /// SGEs of all work requests, each work request's slice contiguous.
    pub sges: Vec<Sge>,
}

impl WritePlan {
    /// The SGEs of one work request.
    pub fn sges_of(&self, wr: &WorkRequest) -> &[Sge] {
        let start = wr.sge_start as usize;
        self.sges
            .get(start..start + wr.sge_count as usize)
            .unwrap_or(&[])
    }

    /// Total payload bytes.
    pub fn total_bytes(&self) -> u64 {
        self.wrs.iter().map(|w| u64::from(w.len)).sum()
    }

    /// Clears the inline flag of every work request with an SGE under one of `lkeys` (device
    /// memory registrations): an inline payload is copied from its source by the CPU when the
    /// work request is built, and the CPU must never touch device memory. The NIC then reads
    /// those sources itself (DMA through the SGE list).
    pub fn no_inline_from(&mut self, lkeys: &[u32]) {
        if lkeys.is_empty() {
            return;
        }
        let sges = &self.sges;
        for wr in self.wrs.iter_mut().filter(|w| w.inline) {
            let start = wr.sge_start as usize;
            let from_device = sges
                .get(start..start + wr.sge_count as usize)
                .unwrap_or(&[])
                .iter()
                .any(|s| lkeys.contains(&s.lkey));
            if from_device {
                wr.inline = false;
            }
        }
    }
}

/// Plans `ops` into RDMA WRITE work requests.
///
/// Every op is checked against `local` (its source) and `remote` (its destination) first; the
/// first op that does not lie wholly inside one region of each fails the whole batch and nothing
/// is planned. Zero-length ops are skipped.
pub fn plan_writes(
    ops: &[TransferOp],
    local: &RegionTable,
    remote: &RegionTable,
    limits: Limits,
) -> Result<WritePlan, VerbsError> {
    let limits = limits.sanitized();
    let max_wr = u64::from(limits.max_wr_bytes);
    let mut plan = WritePlan::default();
    // consecutive ops mostly hit the same regions: try the last ones before searching
    let mut last_l: Option<Region> = None;
    let mut last_r: Option<Region> = None;
    for op in ops {
        if op.len == 0 {
            continue;
        }
        let l = match last_l {
            Some(l) if l.contains(op.src, op.len) => l,
            _ => *local.local(op.src, op.len)?,
        };
        let r = match last_r {
            Some(r) if r.contains(op.dst, op.len) => r,
            _ => *remote.remote(op.dst, op.len)?,
        };
        (last_l, last_r) = (Some(l), Some(r));
        let (mut src, mut dst, mut remaining) = (op.src, op.dst, op.len);
        while remaining > 0 {
            // Try to extend the last work request.
            if let Some(wr) = plan.wrs.last_mut() {
                let wr_len = u64::from(wr.len);
                let contiguous = wr.rkey == r.key
                    && wr.remote_addr.checked_add(wr_len) == Some(dst)
                    && wr_len < max_wr
                    && r.contains(wr.remote_addr, wr_len + 1);
                if contiguous {
                    let take = remaining.min(max_wr - wr_len);
                    let extended = match plan.sges.last_mut() {
                        Some(sge)
                            if sge.lkey == l.key
                                && sge.addr.checked_add(u64::from(sge.len)) == Some(src)
                                && l.contains(sge.addr, u64::from(sge.len) + take) =>
                        {
                            // take + sge.len <= max_wr <= u32::MAX
                            sge.len += take as u32;
                            true
                        }
                        _ if wr.sge_count < limits.max_sge => {
                            plan.sges.push(Sge {
                                addr: src,
                                len: take as u32,
                                lkey: l.key,
                            });
                            wr.sge_count += 1;
                            true
                        }
                        _ => false,
                    };
                    if extended {
                        wr.len += take as u32;
                        src += take;
                        dst += take;
                        remaining -= take;
                        continue;
                    }
                }
            }
            // Start a new work request.
            let take = remaining.min(max_wr);
            plan.wrs.push(WorkRequest {
                remote_addr: dst,
                rkey: r.key,
                len: take as u32,
                sge_start: plan.sges.len() as u32,
                sge_count: 1,
                inline: false,
            });
            plan.sges.push(Sge {
                addr: src,
                len: take as u32,
                lkey: l.key,
            });
            src += take;
            dst += take;
            remaining -= take;
        }
    }
    if limits.max_inline > 0 {
        for wr in &mut plan.wrs {
            wr.inline = wr.len <= limits.max_inline;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tables() -> (RegionTable, RegionTable) {
        let local = RegionTable::from_regions(vec![
            Region {
                base: 0x10_0000,
                len: 0x10_0000,
                key: 11,
            },
            Region {
                base: 0x20_0000,
                len: 0x10_0000,
                key: 12,
            },
        ])
        .unwrap();
        let remote = RegionTable::from_regions(vec![
            Region {
                base: 0x100_0000,
                len: 0x10_0000,
                key: 21,
            },
            Region {
                base: 0x110_0000,
                len: 0x10_0000,
                key: 22,
            },
        ])
        .unwrap();
        (local, remote)
    }

    #[test]
    fn device_sources_are_never_inlined() {
        let (l, r) = tables();
        // One small op from each local region (lkeys 11 and 12), both short enough to inline.
        let ops = vec![
            TransferOp::new(0x10_0000, 0x100_0000, 32),
            TransferOp::new(0x20_0000, 0x110_0000, 32),
        ];
        let limits = Limits {
            max_inline: 64,
            ..Limits::default()
        };
        let mut p = plan_writes(&ops, &l, &r, limits).unwrap();
        assert_eq!(
            p.wrs.iter().map(|w| w.inline).collect::<Vec<_>>(),
            [true, true]
        );
        p.no_inline_from(&[]);
        assert!(p.wrs.iter().all(|w| w.inline));
        // Region 12 is device memory: its work request goes through the SGE list (NIC DMA).
        p.no_inline_from(&[12]);
        assert_eq!(
            p.wrs.iter().map(|w| w.inline).collect::<Vec<_>>(),
            [true, false]
        );
    }

    #[test]
    fn contiguous_ops_merge_into_one_sge() {
        let (l, r) = tables();
        let ops: Vec<_> = (0..8)
            .map(|i| TransferOp::new(0x10_0000 + i * 64, 0x100_0000 + i * 64, 64))
            .collect();
        let p = plan_writes(&ops, &l, &r, Limits::default()).unwrap();
        assert_eq!(p.wrs.len(), 1);
        assert_eq!(p.sges.len(), 1);
        assert_eq!(p.wrs[0].len, 512);
        assert_eq!(
            p.sges[0],
            Sge {
                addr: 0x10_0000,
                len: 512,
                lkey: 11
            }
        );
    }

    #[test]
    fn scattered_sources_use_sges_up_to_the_limit() {
        let (l, r) = tables();
        // contiguous destination, every source 4 KiB apart
        let ops: Vec<_> = (0..5)
            .map(|i| TransferOp::new(0x10_0000 + i * 4096, 0x100_0000 + i * 64, 64))
            .collect();
        let limits = Limits {
            max_sge: 2,
            max_inline: 0,
            max_wr_bytes: 1 << 20,
        };
        let p = plan_writes(&ops, &l, &r, limits).unwrap();
        assert_eq!(
            p.wrs.iter().map(|w| w.sge_count).collect::<Vec<_>>(),
            [2, 2, 1]
        );
        assert_eq!(p.wrs[1].remote_addr, 0x100_0000 + 128);
    }

    #[test]
    fn large_ops_are_sliced_and_small_inlined() {
        let (l, r) = tables();
        let ops = [
            TransferOp::new(0x10_0000, 0x100_0000, 10_000),
            TransferOp::new(0x20_0000, 0x110_0000, 16),
        ];
        let limits = Limits {
            max_sge: 4,
            max_inline: 64,
            max_wr_bytes: 4096,
        };
        let p = plan_writes(&ops, &l, &r, limits).unwrap();
        assert_eq!(
            p.wrs.iter().map(|w| w.len).collect::<Vec<_>>(),
            [4096, 4096, 1808, 16]
        );
        assert_eq!(
            p.wrs.iter().map(|w| w.inline).collect::<Vec<_>>(),
            [false, false, false, true]
        );
        assert_eq!(p.wrs[3].rkey, 22);
        assert_eq!(p.sges_of(&p.wrs[3])[0].lkey, 12);
    }

    #[test]
    fn no_merge_across_regions() {
        let (l, r) = tables();
        // destination runs from the end of region 21 into region 22: two work requests
        let ops = [
            TransferOp::new(0x10_0000, 0x10f_ff00, 0x100),
            TransferOp::new(0x10_0100, 0x110_0000, 0x100),
        ];
        let p = plan_writes(&ops, &l, &r, Limits::default()).unwrap();
        assert_eq!(p.wrs.len(), 2);
        assert_eq!((p.wrs[0].rkey, p.wrs[1].rkey), (21, 22));
    }

    #[test]
    fn out_of_bounds_is_refused_before_anything_is_built() {
        let (l, r) = tables();
        let ops = [
            TransferOp::new(0x10_0000, 0x100_0000, 64),
            TransferOp::new(0x10_0000, 0x11f_fff0, 64),
        ];
        assert_eq!(
            plan_writes(&ops, &l, &r, Limits::default()),
            Err(VerbsError::RemoteNotRegistered {
                addr: 0x11f_fff0,
                len: 64
            })
        );
        let ops = [TransferOp::new(0x30_0000, 0x100_0000, 64)];
        assert!(matches!(
            plan_writes(&ops, &l, &r, Limits::default()),
            Err(VerbsError::LocalNotRegistered { .. })
        ));
        let ops = [TransferOp::new(u64::MAX - 1, 0x100_0000, 64)];
        assert!(plan_writes(&ops, &l, &r, Limits::default()).is_err());
    }

    /// Normalises `(dst, src, len)` runs: sorted by dst, adjacent runs contiguous on both sides
    /// merged.
    fn normalise(mut runs: Vec<(u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
        runs.retain(|r| r.2 > 0);
        runs.sort();
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        for (d, s, n) in runs {
            if let Some(last) = out.last_mut()
                && last.0 + last.2 == d
                && last.1 + last.2 == s
            {
                last.2 += n;
                continue;
            }
            out.push((d, s, n));
        }
        out
    }

    proptest! {
        /// Every byte of every op is written exactly once, from the right source, and every work
        /// request respects the limits and the region tables.
        #[test]
        fn plan_covers_ops_exactly_and_respects_limits(
            pieces in proptest::collection::vec((1u64..3000, 0u64..3, 0u64..3, any::<bool>()), 1..60),
            max_sge in 1u32..5,
            max_inline in 0u32..200,
            max_wr_bytes in 1u32..5000,
        ) {
            let (l, r) = tables();
            let mut ops = Vec::new();
            let (mut src, mut dst) = (0x10_0000u64, 0x100_0000u64);
            for (len, sgap, dgap, other) in pieces {
                src += sgap * 64;
                dst += dgap * 32;
                let s = if other { src + 0x10_0000 } else { src };
                ops.push(TransferOp::new(s, dst, len));
                src += len;
                dst += len;
            }
            let limits = Limits { max_sge, max_inline, max_wr_bytes };
            let p = plan_writes(&ops, &l, &r, limits).unwrap();
            let mut runs = Vec::new();
            for wr in &p.wrs {
                prop_assert!(wr.sge_count >= 1 && wr.sge_count <= max_sge);
                prop_assert!(wr.len >= 1 && wr.len <= max_wr_bytes);
                prop_assert_eq!(wr.inline, max_inline > 0 && wr.len <= max_inline);
                let region = r.find(wr.remote_addr, u64::from(wr.len)).unwrap();
                prop_assert_eq!(region.key, wr.rkey);
                let sges = p.sges_of(wr);
                prop_assert_eq!(sges.len(), wr.sge_count as usize);
                prop_assert_eq!(sges.iter().map(|s| u64::from(s.len)).sum::<u64>(), u64::from(wr.len));
                let mut d = wr.remote_addr;
                for s in sges {
                    prop_assert!(s.len >= 1);
                    prop_assert_eq!(l.find(s.addr, u64::from(s.len)).unwrap().key, s.lkey);
                    runs.push((d, s.addr, u64::from(s.len)));
                    d += u64::from(s.len);
                }
            }
            let want: Vec<_> = ops.iter().map(|o| (o.dst, o.src, o.len)).collect();
            prop_assert_eq!(normalise(runs), normalise(want));
            prop_assert_eq!(p.total_bytes(), TransferOp::total_bytes(&ops));
        }

        /// Fully contiguous batches need the minimum number of work requests.
        #[test]
        fn contiguous_batches_are_minimal(n in 1u64..200, len in 1u64..500, max_wr_bytes in 64u32..4096) {
            let (l, r) = tables();
            let ops: Vec<_> = (0..n)
                .map(|i| TransferOp::new(0x10_0000 + i * len, 0x100_0000 + i * len, len))
                .collect();
            let limits = Limits { max_sge: 1, max_inline: 0, max_wr_bytes };
            let p = plan_writes(&ops, &l, &r, limits).unwrap();
            prop_assert_eq!(p.wrs.len() as u64, (n * len).div_ceil(u64::from(max_wr_bytes)));
        }
    }
}
