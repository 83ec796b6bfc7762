//! A page allocator with controllable fragmentation, for the synthetic prefill pool and the decode.
//!
//! Page 0 is reserved (sglang's padding page). An allocation walks consecutive free pages and,
//! with probability `fragmentation` at each step, jumps to a random free page instead, so page
//! lists look like a busy server's: runs of varying length. Deterministic for a given seed.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Free-page bookkeeping for one pool.
#[derive(Debug)]
pub struct PageAllocator {
    free: BTreeSet<u32>,
    fragmentation: f64,
    rng: StdRng,
}

impl PageAllocator {
    /// An allocator over pages `1..pool_pages` (page 0 reserved).
    pub fn new(pool_pages: u64, fragmentation: f64, seed: u64) -> Self {
        let top = u32::try_from(pool_pages).unwrap_or(u32::MAX);
        PageAllocator {
            free: (1..top).collect(),
            fragmentation: fragmentation.clamp(0.0, 1.0),
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Free pages left.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    fn random_free(&mut self) -> Option<u32> {
        let n = self.free.len();
        if n == 0 {
            return None;
        }
        let lo = *self.free.first()?;
        let hi = *self.free.last()?;
        let probe = self.rng.random_range(lo..=hi);
        self.free
            .range(probe..)
            .next()
            .or_else(|| self.free.iter().next())
            .copied()
    }

    /// `n` pages, or `None` (nothing taken) when fewer than `n` are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<i32>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut next: Option<u32> = None;
        while out.len() < n {
            let jump = self.rng.random_bool(self.fragmentation);
            let page = match next {
                Some(p) if !jump && self.free.contains(&p) => p,
                _ => self.random_free()?,
            };
            self.free.remove(&page);
            out.push(page as i32);
            next = page.checked_add(1);
        }
        Some(out)
    }

    /// Returns pages to the pool (ids out of range or already free are ignored).
    pub fn free(&mut self, pages: &[i32]) {
        for &p in pages {
            if let Ok(p) = u32::try_from(p)
                && p > 0
            {
                self.free.insert(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_distinct_pages_and_frees() {
        let mut a = PageAllocator::new(101, 0.3, 1);
        let x = a.alloc(60).unwrap();
        let mut s = x.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 60);
        assert!(!s.contains(&0));
        assert!(a.alloc(41).is_none());
        assert_eq!(a.available(), 40);
        a.free(&x);
        assert_eq!(a.available(), 100);
        let contiguous = PageAllocator::new(11, 0.0, 1).alloc(10).unwrap();
        assert_eq!(contiguous.len(), 10);
    }
}
