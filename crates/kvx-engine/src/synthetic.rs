//! A synthetic model for tests, examples and benchmarks: a forward pass that stands in for a model
//! computing KV (what `kvx prefill` runs), the memory it writes into, and the check of every byte
//! a decode received ([`verify_room`]).
//!
//! When a room is ready (every decode sent metadata) it takes source pages from the prefill's pool
//! (fragmented like a busy server's), writes the deterministic pattern of the room into every
//! page of every buffer and the aux row, opens the room and hands its chunks to the engine; when
//! the room is released it returns the pages. Rooms wait when the pool is full. Once the engine
//! drains ([`PrefillEngine::begin_drain`]) it starts no room: every room not started yet is
//! failed with the drain's reason.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use kvx_core::{Chunk, PageSlice, Room};

use crate::engine::{EngineEvent, PrefillEngine, PrefillMemory};
use crate::model::{self, KvLayout};
use crate::pages::PageAllocator;
use crate::region::Region;

mod verify;

pub use verify::verify_room;

/// A prefill rank's memory for `layout`, allocated here (page-aligned, zeroed): the KV pool with
/// its buffers back to back and sglang's default aux buffers.
pub fn prefill_memory(layout: &KvLayout) -> PrefillMemory {
    let kv = Arc::new(Region::new(layout.pool_bytes() as usize));
    let aux = Arc::new(Region::new(layout.aux_bytes() as usize));
    let kv_ptrs = layout.kv_ptrs(kv.base());
    let aux_ptrs = layout.aux_ptrs(aux.base());
    PrefillMemory::new(
        kv,
        kv_ptrs,
        layout.item_len,
        aux,
        aux_ptrs,
        layout.aux_item_lens(),
    )
    .mla(layout.mla)
}

/// The pool a synthetic forward pass writes into.
pub struct SyntheticModel {
    /// KV layout.
    pub layout: KvLayout,
    /// The KV region (all buffers).
    pub kv: Arc<Region>,
    /// The aux region.
    pub aux: Arc<Region>,
    /// Pages per chunk.
    pub chunk_pages: usize,
    /// Page placement.
    pub pages: PageAllocator,
}

impl SyntheticModel {
    /// Writes the pattern of `room` into `pages` (its suffix pages, in order) and aux row `row`.
    /// Host memory only: the CPU writes the pattern (a device KV region refuses the write and
    /// its pages stay as they were).
    pub fn fill(&self, room: Room, pages: &[i32], row: u64) {
        let l = &self.layout;
        for b in 0..l.num_buffers {
            let base = l.buffer_addr(self.kv.base(), b);
            for (i, &p) in pages.iter().enumerate() {
                let addr = base + p as u64 * l.item_len;
                // SAFETY: the pages were just taken from the pool for this room: nothing reads
                // them (the engine gets the room's chunks only after this fill) or writes them.
                let _ = unsafe {
                    self.kv.with_mut(addr, l.item_len, |s| {
                        l.fill_kv(s, room.get(), b as u32, i as u32)
                    })
                };
            }
        }
        // Every aux data buffer's row; the room buffer's row is the engine's (`FillRoomRow`).
        let lens = l.aux_item_lens();
        for (i, ptr) in l.aux_ptrs(self.aux.base()).into_iter().enumerate() {
            if i == model::AUX_ROOM_INDEX {
                continue;
            }
            let len = lens[i];
            // SAFETY: the row was just taken for this room, as its pages (above).
            let _ = unsafe {
                self.aux
                    .with_mut(ptr + row * len, len, |s| model::fill_aux(s, room.get(), i))
            };
        }
    }

    /// Runs until the engine's event stream ends.
    pub fn run(mut self, engine: &PrefillEngine, events: Receiver<EngineEvent>) {
        let mut owned: HashMap<Room, (Vec<i32>, u64)> = HashMap::new();
        let mut waiting: VecDeque<(Room, usize)> = VecDeque::new();
        let mut rows: Vec<u64> = (0..self.layout.aux_rows).rev().collect();
        loop {
            match events.recv_timeout(Duration::from_millis(100)) {
                Ok(EngineEvent::Ready { room, pages }) => waiting.push_back((room, pages)),
                Ok(EngineEvent::Released { room, .. }) => {
                    if let Some((pages, row)) = owned.remove(&room) {
                        self.pages.free(&pages);
                        rows.push(row);
                    }
                    waiting.retain(|(r, _)| *r != room);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if let Some(reason) = engine.draining() {
                for (room, _) in waiting.drain(..) {
                    engine.fail_room(room, &reason);
                }
                continue;
            }
            while let Some(&(room, n)) = waiting.front() {
                if n >= self.layout.pool_pages as usize {
                    waiting.pop_front();
                    tracing::warn!(%room, pages = n, "room larger than the whole pool");
                    engine.fail_room(
                        room,
                        &format!("room of {n} pages is larger than the prefill's pool"),
                    );
                    continue;
                }
                let Some(row) = rows.last().copied() else {
                    break;
                };
                let Some(pages) = self.pages.alloc(n) else {
                    break;
                };
                rows.pop();
                waiting.pop_front();
                self.fill(room, &pages, row);
                if let Err(e) = engine.init_room(room, n, row) {
                    // failed or gone meanwhile: nothing will be sent
                    tracing::debug!(%room, error = %e, "room not initialised");
                    self.pages.free(&pages);
                    rows.push(row);
                    continue;
                }
                owned.insert(room, (pages.clone(), row));
                let step = self.chunk_pages.max(1);
                let mut start = 0;
                loop {
                    let end = (start + step).min(n);
                    let mut chunk =
                        Chunk::new(PageSlice { start, end }, pages[start..end].to_vec());
                    if end == n {
                        chunk = chunk.last();
                    }
                    if let Err(e) = engine.send(room, chunk) {
                        tracing::debug!(%room, error = %e, "chunk not queued");
                        break;
                    }
                    if end == n {
                        break;
                    }
                    start = end;
                }
            }
        }
    }
}
