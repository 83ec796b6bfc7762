//! Region tables: where a key is valid, checked before any work request is built.
//!
//! A [`RegionTable`] holds registered ranges sorted by base, non-overlapping, each with the key
//! that names it (an lkey for local memory registrations, an rkey for the regions a peer
//! advertised). Every address the backend hands to the NIC is resolved here first: a range that
//! does not lie wholly inside one region is refused with a typed error, so no work request ever
//! carries an address that was not registered.

use super::error::VerbsError;
use crate::segment::{RegionDesc, RegionKey};

/// One registered range and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// First address.
    pub base: u64,
    /// Length in bytes (non-zero).
    pub len: u64,
    /// The key (lkey or rkey) that names the range.
    pub key: u32,
}

impl Region {
    /// True when `[addr, addr + len)` lies inside this region; overflowing ranges never do.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.base.checked_add(self.len)) {
            (Some(end), Some(region_end)) => addr >= self.base && end <= region_end,
            _ => false,
        }
    }
}

/// Sorted, non-overlapping regions with O(log n) lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionTable {
    regions: Vec<Region>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        RegionTable::default()
    }

    /// Builds a table from regions in any order; empty, overflowing or overlapping regions are
    /// refused.
    pub fn from_regions(mut regions: Vec<Region>) -> Result<Self, VerbsError> {
        regions.sort_by_key(|r| r.base);
        let mut prev_end: Option<u64> = None;
        for r in &regions {
            if r.len == 0 {
                return Err(VerbsError::BadRegions("empty region"));
            }
            let end = r
                .base
                .checked_add(r.len)
                .ok_or(VerbsError::BadRegions("region overflows the address space"))?;
            if prev_end.is_some_and(|p| r.base < p) {
                return Err(VerbsError::BadRegions("overlapping regions"));
            }
            prev_end = Some(end);
        }
        Ok(RegionTable { regions })
    }

    /// Adds one region, keeping the table sorted; refuses an empty, overflowing or overlapping one.
    pub fn insert(&mut self, region: Region) -> Result<(), VerbsError> {
        let mut all = self.regions.clone();
        all.push(region);
        *self = RegionTable::from_regions(all)?;
        Ok(())
    }

    /// Removes the region starting at `base`; returns it if it was present.
    pub fn remove(&mut self, base: u64) -> Option<Region> {
        let i = self.regions.binary_search_by_key(&base, |r| r.base).ok()?;
        Some(self.regions.remove(i))
    }

    /// The region that wholly contains `[addr, addr + len)`, if any.
    pub fn find(&self, addr: u64, len: u64) -> Option<&Region> {
        let i = self.regions.partition_point(|r| r.base <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        r.contains(addr, len).then_some(r)
    }

    /// All regions, sorted by base.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// The regions as a segment descriptor lists them (the key is the region key).
    pub fn descs(&self) -> Vec<RegionDesc> {
        self.regions
            .iter()
            .map(|r| RegionDesc {
                base: r.base,
                len: r.len,
                key: RegionKey(r.key),
            })
            .collect()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// True when no region is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Resolves a local source range to its region, or [`VerbsError::LocalNotRegistered`].
    pub fn local(&self, addr: u64, len: u64) -> Result<&Region, VerbsError> {
        self.find(addr, len)
            .ok_or(VerbsError::LocalNotRegistered { addr, len })
    }

    /// Resolves a remote destination range to its region, or
    /// [`VerbsError::RemoteNotRegistered`].
    pub fn remote(&self, addr: u64, len: u64) -> Result<&Region, VerbsError> {
        self.find(addr, len)
            .ok_or(VerbsError::RemoteNotRegistered { addr, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table() -> RegionTable {
        RegionTable::from_regions(vec![
            Region {
                base: 0x2000,
                len: 0x1000,
                key: 7,
            },
            Region {
                base: 0x1000,
                len: 0x100,
                key: 1,
            },
        ])
        .unwrap()
    }

    #[test]
    fn descs_follow_the_sorted_regions() {
        let d = table().descs();
        assert_eq!(
            d.iter().map(|r| (r.base, r.len, r.key)).collect::<Vec<_>>(),
            vec![
                (0x1000, 0x100, RegionKey(1)),
                (0x2000, 0x1000, RegionKey(7))
            ]
        );
    }

    #[test]
    fn lookup() {
        let t = table();
        assert_eq!(t.find(0x1000, 0x100).unwrap().key, 1);
        assert!(t.find(0x1000, 0x101).is_none());
        assert!(t.find(0xfff, 1).is_none());
        assert_eq!(t.find(0x2fff, 1).unwrap().key, 7);
        assert!(t.find(0x3000, 1).is_none());
        assert!(t.find(u64::MAX, 2).is_none());
        assert_eq!(
            t.remote(0x3000, 8),
            Err(VerbsError::RemoteNotRegistered {
                addr: 0x3000,
                len: 8
            })
        );
        assert_eq!(
            t.local(0x10f0, 0x20),
            Err(VerbsError::LocalNotRegistered {
                addr: 0x10f0,
                len: 0x20
            })
        );
    }

    #[test]
    fn refuses_bad_tables() {
        let overlap = vec![
            Region {
                base: 0,
                len: 10,
                key: 1,
            },
            Region {
                base: 9,
                len: 10,
                key: 2,
            },
        ];
        assert!(RegionTable::from_regions(overlap).is_err());
        assert!(
            RegionTable::from_regions(vec![Region {
                base: 1,
                len: 0,
                key: 1
            }])
            .is_err()
        );
        let wrap = Region {
            base: u64::MAX,
            len: 2,
            key: 1,
        };
        assert!(RegionTable::from_regions(vec![wrap]).is_err());
        let mut t = table();
        assert!(
            t.insert(Region {
                base: 0x10ff,
                len: 2,
                key: 3
            })
            .is_err()
        );
        t.insert(Region {
            base: 0x1100,
            len: 2,
            key: 3,
        })
        .unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.remove(0x1100).unwrap().key, 3);
        assert!(t.remove(0x1100).is_none());
    }

    proptest! {
        /// `find` agrees with a linear scan and never returns a region that does not contain
        /// the whole range.
        #[test]
        fn find_matches_linear_scan(
            lens in proptest::collection::vec((1u64..5000, 0u64..300), 0..12),
            probes in proptest::collection::vec((0u64..80_000, 0u64..6000), 1..40),
        ) {
            let mut base = 100u64;
            let mut regions = Vec::new();
            for (i, (len, gap)) in lens.iter().enumerate() {
                regions.push(Region { base, len: *len, key: i as u32 });
                base += len + gap;
            }
            let t = RegionTable::from_regions(regions.clone()).unwrap();
            for (addr, len) in probes {
                let want = regions.iter().find(|r| r.contains(addr, len));
                prop_assert_eq!(t.find(addr, len), want);
                if let Some(r) = t.find(addr, len) {
                    prop_assert!(addr >= r.base && addr + len <= r.base + r.len);
                }
            }
        }
    }
}
