//! Contiguous-run merge: split paired page lists wherever either side does not step by exactly
//! one, so each run becomes one write per buffer instead of one per page.

use super::{PlanError, Side, nonneg};

/// A run of pages that are consecutive on both sides: `len` pages from `src` to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    /// First source page.
    pub src: u64,
    /// First destination page.
    pub dst: u64,
    /// Number of pages (≥ 1).
    pub len: u64,
}

/// Merges paired page lists into runs. Empty lists give no runs; unequal lengths and negative
/// pages are errors. Memory is proportional to the number of runs.
///
/// ```
/// use kvx_core::planner::{merge_runs, Run};
/// let runs = merge_runs(&[10, 11, 12, 40], &[5, 6, 7, 9]).unwrap();
/// assert_eq!(runs, vec![Run { src: 10, dst: 5, len: 3 }, Run { src: 40, dst: 9, len: 1 }]);
/// ```
pub fn merge_runs(src: &[i32], dst: &[i32]) -> Result<Vec<Run>, PlanError> {
    if src.len() != dst.len() {
        return Err(PlanError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    let (Some(&s0), Some(&d0)) = (src.first(), dst.first()) else {
        return Ok(Vec::new());
    };
    let mut runs: Vec<Run> = Vec::new();
    let mut cur = Run {
        src: nonneg(Side::Src, 0, s0)?,
        dst: nonneg(Side::Dst, 0, d0)?,
        len: 1,
    };
    for (i, (&s, &d)) in src.iter().zip(dst).enumerate().skip(1) {
        if (s | d) < 0 {
            nonneg(Side::Src, i, s)?;
            nonneg(Side::Dst, i, d)?;
        }
        let (s, d) = (s as u64, d as u64);
        if s == cur.src + cur.len && d == cur.dst + cur.len {
            cur.len += 1;
        } else {
            runs.push(cur);
            cur = Run {
                src: s,
                dst: d,
                len: 1,
            };
        }
    }
    runs.push(cur);
    Ok(runs)
}

/// One run per page, unmerged (what a plan without merging would write; used to check that
/// merging never changes the bytes copied).
pub fn unmerged_runs(src: &[i32], dst: &[i32]) -> Result<Vec<Run>, PlanError> {
    if src.len() != dst.len() {
        return Err(PlanError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    src.iter()
        .zip(dst)
        .enumerate()
        .map(|(i, (&s, &d))| {
            Ok(Run {
                src: nonneg(Side::Src, i, s)?,
                dst: nonneg(Side::Dst, i, d)?,
                len: 1,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spec_example_and_errors() {
        assert_eq!(
            merge_runs(&[10, 11, 12, 40], &[5, 6, 7, 9]).unwrap(),
            vec![
                Run {
                    src: 10,
                    dst: 5,
                    len: 3
                },
                Run {
                    src: 40,
                    dst: 9,
                    len: 1
                }
            ]
        );
        assert_eq!(merge_runs(&[], &[]).unwrap(), vec![]);
        assert_eq!(
            merge_runs(&[1], &[]),
            Err(PlanError::LengthMismatch { src: 1, dst: 0 })
        );
        assert!(matches!(
            merge_runs(&[1, -2], &[3, 4]),
            Err(PlanError::NegativePage {
                side: Side::Src,
                index: 1,
                value: -2
            })
        ));
        // A step that is contiguous on one side only splits the run.
        assert_eq!(merge_runs(&[1, 2], &[1, 5]).unwrap().len(), 2);
        // Descending pages never merge.
        assert_eq!(merge_runs(&[2, 1], &[2, 1]).unwrap().len(), 2);
    }

    proptest! {
        #[test]
        fn runs_expand_back_to_the_pages(pairs in proptest::collection::vec((0i32..64, 0i32..64), 0..64)) {
            let (src, dst): (Vec<i32>, Vec<i32>) = pairs.into_iter().unzip();
            let runs = merge_runs(&src, &dst).unwrap();
            let expanded: Vec<(i32, i32)> = runs
                .iter()
                .flat_map(|r| (0..r.len).map(move |k| ((r.src + k) as i32, (r.dst + k) as i32)))
                .collect();
            let orig: Vec<(i32, i32)> = src.into_iter().zip(dst).collect();
            prop_assert_eq!(expanded, orig);
            for w in runs.windows(2) {
                prop_assert!(!(w[0].src + w[0].len == w[1].src && w[0].dst + w[0].len == w[1].dst));
            }
        }
    }
}
