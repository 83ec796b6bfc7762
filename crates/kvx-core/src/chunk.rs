//! Chunks: the unit in which a prefill hands finished KV pages to the transfer engine.
//!
//! Chunked prefill finishes a prompt in pieces. Each piece covers a slice of the room's pages in
//! the *suffix-relative* page space (page 0 is the first page after the decode's cached prefix).
//! The last chunk may be empty: it still carries the aux row and state and triggers the status.

/// A half-open page range `[start, end)` in the suffix-relative page space of a room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageSlice {
    /// First page (inclusive).
    pub start: usize,
    /// One past the last page.
    pub end: usize,
}

impl PageSlice {
    /// A slice `[start, end)`; `None` if `end < start`.
    pub fn new(start: usize, end: usize) -> Option<Self> {
        (end >= start).then_some(PageSlice { start, end })
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// True when the slice covers no page.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// One chunk of a room's KV, as the forward pass produces it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Which pages of the room's destination list this chunk fills.
    pub slice: PageSlice,
    /// True for the room's final chunk (aux rows, state and status follow it).
    pub is_last: bool,
    /// The prefill's source page ids, one per page of `slice` (may be longer than the
    /// destination list, in which case it is truncated as sglang does).
    pub src_pages: Vec<i32>,
    /// Source state indices per state component (last chunk only).
    pub src_state: Vec<Vec<i32>>,
}

impl Chunk {
    /// A non-last chunk covering `slice` from `src_pages`.
    pub fn new(slice: PageSlice, src_pages: Vec<i32>) -> Self {
        Chunk {
            slice,
            is_last: false,
            src_pages,
            src_state: Vec::new(),
        }
    }

    /// Marks the chunk as the room's last.
    #[must_use]
    pub fn last(mut self) -> Self {
        self.is_last = true;
        self
    }

    /// An empty last chunk (carries only aux and state).
    pub fn empty_last(at: usize) -> Self {
        Chunk {
            slice: PageSlice { start: at, end: at },
            is_last: true,
            src_pages: Vec::new(),
            src_state: Vec::new(),
        }
    }
}
