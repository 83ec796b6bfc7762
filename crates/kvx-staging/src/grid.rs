//! The staging chunk grid: which pages of a room make up staged chunk `k`.
//!
//! Both sides must cut a room into the same chunks, or the decode sizes a region for a chunk the
//! prefill never sends (sglang issue #23797: the prefill cut from its own prefix-cache hit). Here
//! the grid is defined once, in the *suffix-relative* page space that starts at the decode's
//! prefix (`decode_prefix_len`): chunk `k` covers pages `[k·full, min((k+1)·full, total))`. The
//! prefill splits every send at grid boundaries with [`ChunkGrid::split`]; the decode checks each
//! `STAGING_REQ` against [`RoomGrid::chunk_pages`].

use kvx_core::PageSlice;

/// sglang's default `chunked_prefill_size` when none is configured.
pub const DEFAULT_CHUNKED_PREFILL_SIZE: i64 = 8192;

/// The grid spacing: `full_chunk_pages = max(1, cps // page_size)` pages per chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkGrid {
    full_chunk_pages: u64,
}

impl ChunkGrid {
    /// The grid for a `chunked_prefill_size` (tokens; `None` or `0` ⇒ 8192, negative ⇒ one page
    /// per chunk, as Python's `max(1, cps // page_size)` gives) and a page size; `None` when
    /// `page_size` is 0.
    pub fn new(chunked_prefill_size: Option<i64>, page_size: u64) -> Option<Self> {
        let page_size = i64::try_from(page_size).ok().filter(|p| *p > 0)?;
        let cps = match chunked_prefill_size {
            None | Some(0) => DEFAULT_CHUNKED_PREFILL_SIZE,
            Some(c) => c,
        };
        let pages = cps.div_euclid(page_size).max(1);
        Some(ChunkGrid {
            full_chunk_pages: u64::try_from(pages).ok()?,
        })
    }

    /// A grid of exactly `full_chunk_pages` pages per chunk (at least 1).
    pub fn with_pages(full_chunk_pages: u64) -> Self {
        ChunkGrid {
            full_chunk_pages: full_chunk_pages.max(1),
        }
    }

    /// Pages in a full chunk.
    pub fn full_chunk_pages(&self) -> u64 {
        self.full_chunk_pages
    }

    /// Number of chunks of a room with `total_pages` suffix pages.
    pub fn num_chunks(&self, total_pages: u64) -> u64 {
        total_pages.div_ceil(self.full_chunk_pages)
    }

    /// The chunk containing suffix page `page`.
    pub fn chunk_of(&self, page: u64) -> u64 {
        page / self.full_chunk_pages
    }

    /// The page range of chunk `idx` of a room with `total_pages` pages (`None` past the end).
    pub fn chunk_range(&self, idx: u64, total_pages: u64) -> Option<(u64, u64)> {
        let start = idx.checked_mul(self.full_chunk_pages)?;
        if start >= total_pages {
            return None;
        }
        Some((
            start,
            start.saturating_add(self.full_chunk_pages).min(total_pages),
        ))
    }

    /// Splits a send's page slice at grid boundaries: one `(chunk_idx, slice)` per grid
    /// segment, in order. An empty slice yields nothing.
    pub fn split(&self, slice: PageSlice) -> Vec<(u64, PageSlice)> {
        let mut out = Vec::new();
        let mut at = slice.start as u64;
        let end = slice.end as u64;
        while at < end {
            let idx = self.chunk_of(at);
            let seg_end = (idx + 1).saturating_mul(self.full_chunk_pages).min(end);
            if let (Ok(s), Ok(e)) = (usize::try_from(at), usize::try_from(seg_end)) {
                out.push((idx, PageSlice { start: s, end: e }));
            }
            at = seg_end;
        }
        out
    }
}

/// One room's grid: the spacing plus the room's suffix length, computed identically on both
/// sides from the **decode** prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RoomGrid {
    /// Grid spacing.
    pub grid: ChunkGrid,
    /// Pages after the decode prefix: `ceil((prompt_len - decode_prefix_len) / page_size)`.
    pub total_pages: u64,
}

impl RoomGrid {
    /// The grid of a room of `prompt_len` tokens whose first `decode_prefix_len` tokens the
    /// decode already holds; `None` if `page_size` is 0 or the prefix exceeds the prompt.
    pub fn new(
        prompt_len: u64,
        decode_prefix_len: u64,
        page_size: u64,
        chunked_prefill_size: Option<i64>,
    ) -> Option<Self> {
        let grid = ChunkGrid::new(chunked_prefill_size, page_size)?;
        let suffix = prompt_len.checked_sub(decode_prefix_len)?;
        Some(RoomGrid {
            grid,
            total_pages: suffix.div_ceil(page_size),
        })
    }

    /// A room grid from a spacing and a known suffix page count (the decode's destination list
    /// length).
    pub fn from_pages(grid: ChunkGrid, total_pages: u64) -> Self {
        RoomGrid { grid, total_pages }
    }

    /// Number of chunks.
    pub fn num_chunks(&self) -> u64 {
        self.grid.num_chunks(self.total_pages)
    }

    /// Pages of chunk `idx` (`None` past the end).
    pub fn chunk_pages(&self, idx: u64) -> Option<u64> {
        self.grid
            .chunk_range(idx, self.total_pages)
            .map(|(s, e)| e - s)
    }

    /// First page of chunk `idx` (`None` past the end).
    pub fn chunk_start(&self, idx: u64) -> Option<u64> {
        self.grid.chunk_range(idx, self.total_pages).map(|(s, _)| s)
    }

    /// Where a send may end when the first `done` suffix pages are finished: a non-last send
    /// stops at the last grid boundary (the rest rides with the next send, as sglang's prefill
    /// aligns staged sends); the last send goes to the end of the room.
    pub fn send_end(&self, done: u64, is_last: bool) -> u64 {
        if is_last {
            return self.total_pages;
        }
        let full = self.grid.full_chunk_pages();
        (done.min(self.total_pages) / full) * full
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grid_from_config() {
        assert_eq!(ChunkGrid::new(None, 1).unwrap().full_chunk_pages(), 8192);
        assert_eq!(
            ChunkGrid::new(Some(4096), 64).unwrap().full_chunk_pages(),
            64
        );
        assert_eq!(ChunkGrid::new(Some(100), 64).unwrap().full_chunk_pages(), 1);
        assert_eq!(ChunkGrid::new(Some(-1), 16).unwrap().full_chunk_pages(), 1);
        assert_eq!(ChunkGrid::new(Some(4096), 0), None);
        // 300 tokens, 44 cached on the decode, page 16, cps 64 => 16 pages, 4 per chunk.
        let rg = RoomGrid::new(300, 44, 16, Some(64)).unwrap();
        assert_eq!(rg.total_pages, 16);
        assert_eq!(rg.num_chunks(), 4);
        assert_eq!(rg.chunk_pages(3), Some(4));
        assert_eq!(rg.chunk_pages(4), None);
        assert_eq!(RoomGrid::new(10, 11, 1, None), None);
        assert_eq!(rg.send_end(7, false), 4);
        assert_eq!(rg.send_end(3, false), 0);
        assert_eq!(rg.send_end(99, false), 16);
        assert_eq!(rg.send_end(7, true), 16);
    }

    #[test]
    fn split_at_boundaries() {
        let g = ChunkGrid::with_pages(4);
        let s = g.split(PageSlice { start: 3, end: 10 });
        assert_eq!(
            s,
            vec![
                (0, PageSlice { start: 3, end: 4 }),
                (1, PageSlice { start: 4, end: 8 }),
                (2, PageSlice { start: 8, end: 10 }),
            ]
        );
        assert!(g.split(PageSlice { start: 5, end: 5 }).is_empty());
    }

    proptest! {
        #[test]
        fn split_tiles_the_slice(full in 1u64..50, start in 0usize..500, len in 0usize..500) {
            let g = ChunkGrid::with_pages(full);
            let parts = g.split(PageSlice { start, end: start + len });
            let mut at = start;
            for (idx, p) in &parts {
                prop_assert_eq!(p.start, at);
                prop_assert!(!p.is_empty());
                prop_assert_eq!(g.chunk_of(p.start as u64), *idx);
                prop_assert_eq!(g.chunk_of(p.end as u64 - 1), *idx);
                at = p.end;
            }
            prop_assert_eq!(at, start + len);
        }

        #[test]
        fn chunks_cover_room(full in 1u64..50, total in 0u64..2000) {
            let rg = RoomGrid::from_pages(ChunkGrid::with_pages(full), total);
            let sum: u64 = (0..rg.num_chunks()).map(|i| rg.chunk_pages(i).unwrap()).sum();
            prop_assert_eq!(sum, total);
        }
    }
}
