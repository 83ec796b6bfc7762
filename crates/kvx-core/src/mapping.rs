//! Rank mapping (spec §4.3): which prefill ranks a decode rank talks to, which of them are
//! dummies, and the two counts that gate completion — `required_dst_info_num` (how many decode
//! sessions a prefill rank waits for) and `required_prefill_response_num` (how many distinct
//! prefill ranks must report Success to the decode).
//!
//! With `Pt`/`Dt` the prefill/decode attention-TP sizes and `r` the decode rank in its TP group:
//! equal sizes pair `r` with `r`; a larger decode fans in `Dt/Pt` decode ranks onto prefill rank
//! `r / (Dt/Pt)`; a smaller decode talks to `Pt/Dt` prefill ranks — all real for MHA (each sends
//! its heads), only the first real for MLA (the latent KV is replicated). Prefill CP > 1 adds CP
//! ranks only in all-CP-ranks mode; a decode with PP 1 facing a pipelined prefill talks to every
//! PP stage. Each extra dimension multiplies the responses the decode waits for.

/// The parallel layout of both sides, as the decode knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingInput {
    /// Prefill attention-TP size (`Pt`).
    pub prefill_tp: u32,
    /// Prefill attention-CP size.
    pub prefill_cp: u32,
    /// Prefill PP size.
    pub prefill_pp: u32,
    /// Decode attention-TP size (`Dt`).
    pub decode_tp: u32,
    /// Decode CP size (must be 1).
    pub decode_cp: u32,
    /// Decode PP size (1 or equal to the prefill's).
    pub decode_pp: u32,
    /// The decode rank's engine rank (taken modulo `Dt`).
    pub decode_rank: u32,
    /// The decode rank's PP rank (used when both sides have the same PP size).
    pub decode_pp_rank: u32,
    /// MLA model (dummies instead of head slices when `Dt < Pt`).
    pub mla: bool,
    /// All-CP-ranks transfer mode (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER` and friends).
    pub all_cp_ranks: bool,
}

/// One prefill rank a decode rank sends its registration and metadata to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefillTarget {
    /// Prefill attention-TP rank.
    pub tp_rank: u32,
    /// Prefill CP rank.
    pub cp_rank: u32,
    /// Prefill PP rank.
    pub pp_rank: u32,
    /// True when this rank receives empty metadata (no data, no status).
    pub dummy: bool,
}

/// The mapping for one decode rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Every prefill rank to contact, dummies included.
    pub targets: Vec<PrefillTarget>,
    /// Frame 7 of the metadata: decode sessions each prefill rank waits for.
    pub required_dst_info_num: u32,
    /// Distinct prefill ranks that must report Success.
    pub required_prefill_response_num: u32,
}

/// Most prefill ranks one decode rank may be mapped to. The sizes come from the prefill's
/// bootstrap answer; a layout beyond this is refused before anything is allocated.
pub const MAX_TARGETS: u64 = 1 << 16;

/// Why two parallel layouts cannot be mapped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MappingError {
    /// A size is zero.
    #[error("parallel sizes must be non-zero")]
    ZeroSize,
    /// The larger TP size is not a multiple of the smaller.
    #[error("attention TP sizes {prefill} (prefill) and {decode} (decode) do not divide")]
    NotDivisible {
        /// Prefill TP size.
        prefill: u32,
        /// Decode TP size.
        decode: u32,
    },
    /// The layout would map one decode rank to more than [`MAX_TARGETS`] prefill ranks.
    #[error("{targets} prefill targets for one decode rank (at most {MAX_TARGETS})")]
    TooManyTargets {
        /// Targets the layout implies (saturated at u64::MAX).
        targets: u64,
    },
    /// Decode CP must be 1.
    #[error("decode CP size must be 1, got {0}")]
    DecodeCp(u32),
    /// Decode PP must be 1 or equal to the prefill's.
    #[error("decode PP size {decode} must be 1 or the prefill's {prefill}")]
    Pp {
        /// Prefill PP size.
        prefill: u32,
        /// Decode PP size.
        decode: u32,
    },
}

/// Computes the mapping for one decode rank.
pub fn map_ranks(m: &MappingInput) -> Result<Mapping, MappingError> {
    let (pt, dt) = (m.prefill_tp, m.decode_tp);
    if [pt, dt, m.prefill_cp, m.prefill_pp, m.decode_cp, m.decode_pp].contains(&0) {
        return Err(MappingError::ZeroSize);
    }
    if m.decode_cp != 1 {
        return Err(MappingError::DecodeCp(m.decode_cp));
    }
    if m.decode_pp != 1 && m.decode_pp != m.prefill_pp {
        return Err(MappingError::Pp {
            prefill: m.prefill_pp,
            decode: m.decode_pp,
        });
    }
    if pt.max(dt) % pt.min(dt) != 0 {
        return Err(MappingError::NotDivisible {
            prefill: pt,
            decode: dt,
        });
    }
    // Count the targets before building them: TP fan-out × CP ranks × PP stages.
    let tp_n = u64::from(if pt > dt { pt / dt } else { 1 });
    let cp_n = u64::from(if m.prefill_cp > 1 && m.all_cp_ranks {
        m.prefill_cp
    } else {
        1
    });
    let pp_n = u64::from(if m.decode_pp == 1 { m.prefill_pp } else { 1 });
    let targets = tp_n.saturating_mul(cp_n).saturating_mul(pp_n);
    if targets > MAX_TARGETS {
        return Err(MappingError::TooManyTargets { targets });
    }
    // From here every count and product is at most MAX_TARGETS.
    let r = m.decode_rank % dt;
    // (tp_rank, dummy) per TP target, and the TP part of the counts.
    let (tp_targets, dst_info, mut responses): (Vec<(u32, bool)>, u32, u32) = if pt == dt {
        (vec![(r, false)], 1, 1)
    } else if dt > pt {
        let f = dt / pt;
        (vec![(r / f, false)], f, 1)
    } else {
        let f = pt / dt;
        let ranks = (r * f..(r + 1) * f).map(|t| (t, m.mla && t != r * f));
        (ranks.collect(), 1, if m.mla { 1 } else { f })
    };
    let cp_ranks: Vec<u32> = if m.prefill_cp > 1 && m.all_cp_ranks {
        responses *= m.prefill_cp;
        (0..m.prefill_cp).collect()
    } else {
        vec![0]
    };
    let pp_ranks: Vec<u32> = if m.decode_pp == 1 && m.prefill_pp > 1 {
        responses *= m.prefill_pp;
        (0..m.prefill_pp).collect()
    } else if m.decode_pp == 1 {
        vec![0]
    } else {
        vec![m.decode_pp_rank % m.prefill_pp]
    };
    let mut targets = Vec::with_capacity(tp_targets.len() * cp_ranks.len() * pp_ranks.len());
    for &pp_rank in &pp_ranks {
        for &cp_rank in &cp_ranks {
            for &(tp_rank, dummy) in &tp_targets {
                targets.push(PrefillTarget {
                    tp_rank,
                    cp_rank,
                    pp_rank,
                    dummy,
                });
            }
        }
    }
    Ok(Mapping {
        targets,
        required_dst_info_num: dst_info,
        required_prefill_response_num: responses,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(pt: u32, dt: u32, rank: u32, mla: bool) -> MappingInput {
        MappingInput {
            prefill_tp: pt,
            prefill_cp: 1,
            prefill_pp: 1,
            decode_tp: dt,
            decode_cp: 1,
            decode_pp: 1,
            decode_rank: rank,
            decode_pp_rank: 0,
            mla,
            all_cp_ranks: false,
        }
    }

    fn tp(m: &Mapping) -> Vec<(u32, bool)> {
        m.targets.iter().map(|t| (t.tp_rank, t.dummy)).collect()
    }

    #[test]
    fn spec_cases() {
        let m = map_ranks(&input(2, 2, 1, false)).unwrap();
        assert_eq!(
            (
                tp(&m),
                m.required_dst_info_num,
                m.required_prefill_response_num
            ),
            (vec![(1, false)], 1, 1)
        );
        // Dt > Pt: fan-in, the prefill rank waits for Dt/Pt sessions.
        let m = map_ranks(&input(2, 8, 7, false)).unwrap();
        assert_eq!(
            (
                tp(&m),
                m.required_dst_info_num,
                m.required_prefill_response_num
            ),
            (vec![(1, false)], 4, 1)
        );
        // Dt < Pt, MHA: every target real, responses Pt/Dt.
        let m = map_ranks(&input(4, 2, 1, false)).unwrap();
        assert_eq!(
            (
                tp(&m),
                m.required_dst_info_num,
                m.required_prefill_response_num
            ),
            (vec![(2, false), (3, false)], 1, 2)
        );
        // Dt < Pt, MLA: first target real, the rest dummies, one response.
        let m = map_ranks(&input(4, 2, 1, true)).unwrap();
        assert_eq!(
            (tp(&m), m.required_prefill_response_num),
            (vec![(2, false), (3, true)], 1)
        );
    }

    #[test]
    fn cp_pp_and_errors() {
        let mut i = input(2, 2, 0, false);
        i.prefill_cp = 2;
        assert_eq!(map_ranks(&i).unwrap().targets.len(), 1);
        i.all_cp_ranks = true;
        i.prefill_pp = 3;
        let m = map_ranks(&i).unwrap();
        assert_eq!(m.targets.len(), 6);
        assert_eq!(m.required_prefill_response_num, 6);
        i.decode_pp = 3;
        i.decode_pp_rank = 2;
        let m = map_ranks(&i).unwrap();
        assert!(m.targets.iter().all(|t| t.pp_rank == 2));
        assert_eq!(m.required_prefill_response_num, 2);
        i.decode_pp = 2;
        assert!(matches!(map_ranks(&i), Err(MappingError::Pp { .. })));
        assert!(matches!(
            map_ranks(&input(2, 3, 0, false)),
            Err(MappingError::NotDivisible { .. })
        ));
        assert_eq!(
            map_ranks(&input(0, 1, 0, false)),
            Err(MappingError::ZeroSize)
        );
        let mut i = input(1, 1, 0, false);
        i.decode_cp = 2;
        assert_eq!(map_ranks(&i), Err(MappingError::DecodeCp(2)));
    }

    proptest::proptest! {
        /// Any sizes a bootstrap answer can carry: no panic, bounded target lists, and the
        /// response count never exceeds the real targets.
        #[test]
        fn any_sizes_map_or_fail_typed(
            prefill_tp in proptest::prop_oneof![1u32..=16, proptest::num::u32::ANY],
            prefill_cp in proptest::prop_oneof![1u32..=4, proptest::num::u32::ANY],
            prefill_pp in proptest::prop_oneof![1u32..=4, proptest::num::u32::ANY],
            decode_tp in proptest::prop_oneof![1u32..=16, proptest::num::u32::ANY],
            decode_pp in 0u32..=4,
            decode_rank in proptest::num::u32::ANY,
            decode_pp_rank in proptest::num::u32::ANY,
            mla in proptest::bool::ANY,
            all_cp_ranks in proptest::bool::ANY,
        ) {
            let i = MappingInput {
                prefill_tp,
                prefill_cp,
                prefill_pp,
                decode_tp,
                decode_cp: 1,
                decode_pp,
                decode_rank,
                decode_pp_rank,
                mla,
                all_cp_ranks,
            };
            if let Ok(m) = map_ranks(&i) {
                proptest::prop_assert!(m.targets.len() as u64 <= MAX_TARGETS);
                let real = m.targets.iter().filter(|t| !t.dummy).count() as u64;
                proptest::prop_assert!(u64::from(m.required_prefill_response_num) <= real);
                proptest::prop_assert!(m.targets.iter().all(|t| t.tp_rank < prefill_tp
                    && t.cp_rank < prefill_cp && t.pp_rank < prefill_pp));
            }
        }
    }

    #[test]
    fn sizes_from_a_peer_cannot_overflow_or_exhaust_memory() {
        // Prefill sizes as a bootstrap answer could carry them: the response count used to
        // overflow u32 and the target list would not fit in memory.
        let mut i = input(u32::MAX, 1, 0, false);
        (i.prefill_cp, i.prefill_pp, i.all_cp_ranks) = (u32::MAX, u32::MAX, true);
        assert_eq!(
            map_ranks(&i),
            Err(MappingError::TooManyTargets { targets: u64::MAX })
        );
        let mut i = input(1, 1, 0, false);
        (i.prefill_cp, i.prefill_pp, i.all_cp_ranks) = (1 << 9, 1 << 8, true);
        assert_eq!(
            map_ranks(&i),
            Err(MappingError::TooManyTargets { targets: 1 << 17 })
        );
        // The limit itself still maps.
        i.prefill_pp = 1 << 7;
        let m = map_ranks(&i).unwrap();
        assert_eq!(m.targets.len() as u64, MAX_TARGETS);
        assert_eq!(u64::from(m.required_prefill_response_num), MAX_TARGETS);
    }
}
