//! Where bytes reach a decode, and what each write is checked against: a window of a batch
//! landing in the decode's pages, aux rows or state slots, an `AUX_DATA` row arriving over the
//! control plane, and a staged chunk landing in the decode's ring. Every write is checked against
//! what the decode knows of the room (statuses, `ABORT_ACK`s, release, page, row and slot
//! ownership) before a byte is copied; ring writes also against the ring's live slots
//! ([`Inv::RingWriteInLiveSlot`]).

use kvx_core::{Room, TransferOp};

use super::World;
use crate::data::{Job, Landing};
use crate::invariants::Inv;
use crate::memory::{AUX_ROW_LENS, Loc, STATE_ITEM};

impl World {
    /// A window lands on its decode: a staged chunk into the ring, else every op is checked and
    /// copied from the prefill's memory.
    pub(crate) fn apply_landing(&mut self, l: &Landing) {
        let (p, d, room) = (l.p, l.d, l.room);
        if self.decodes[d as usize].inc != l.d_inc || self.decodes[d as usize].down {
            return;
        }
        if let (Job::Stage { chunk, .. }, Some(bytes)) = (l.id, &l.payload) {
            for op in &l.ops {
                self.apply_ring_write(p, d, room, chunk, op, bytes);
            }
            return;
        }
        for op in &l.ops {
            let Some(src_loc) = self.prefills[p as usize].mem.locate(op.src, op.len) else {
                self.check
                    .check(Inv::WriteInOwnedPage, false, Some(room), || {
                        format!("prefill rank {p} reads {op:?} outside its memory")
                    });
                return;
            };
            let Some(dst_loc) = self.decodes[d as usize].mem.locate(op.dst, op.len) else {
                self.check
                    .check(Inv::WriteInOwnedPage, false, Some(room), || {
                        format!("prefill rank {p} writes {op:?} outside decode rank {d}'s memory")
                    });
                return;
            };
            let what = format!("prefill rank {p} wrote {op:?} to decode rank {d}");
            if !self.check_decode_write(p, d, room, dst_loc, op.len, &what) {
                return;
            }
            let bytes = self.prefills[p as usize]
                .mem
                .bytes(src_loc, op.len)
                .to_vec();
            self.decodes[d as usize]
                .mem
                .bytes_mut(dst_loc, op.len)
                .copy_from_slice(&bytes);
        }
    }

    /// An `AUX_DATA` row from prefill rank `p` reaches decode rank `d`: written into its row
    /// (as kvx's decode does) once the same checks as a data-plane write passed.
    pub(crate) fn apply_aux_data(
        &mut self,
        p: u32,
        d: u32,
        room: Room,
        (index, row): (usize, u64),
        data: &[u8],
    ) {
        let fits = AUX_ROW_LENS.get(index) == Some(&(data.len() as u64));
        let loc = AUX_ROW_LENS.get(index).filter(|_| fits).map(|&l| Loc::Aux {
            buf: index,
            off: row * l,
        });
        let mem = &self.decodes[d as usize].mem;
        let Some(loc) = loc.filter(|&l| mem.bytes_checked(l, data.len() as u64)) else {
            self.check.check(Inv::WriteInOwnedPage, false, Some(room), || {
                format!("prefill rank {p} sent AUX_DATA for row {row} of buffer {index} ({} bytes): no such row", data.len())
            });
            return;
        };
        let what = format!(
            "prefill rank {p} sent AUX_DATA row {row} of buffer {index} to decode rank {d}"
        );
        if self.check_decode_write(p, d, room, loc, data.len() as u64, &what) {
            self.stats.aux_rows += 1;
            self.decodes[d as usize]
                .mem
                .bytes_mut(loc, data.len() as u64)
                .copy_from_slice(data);
        }
    }

    /// Checks one write of `len` bytes at `dst` of decode rank `d` for `room` against what the
    /// decode knows (no write after prefill rank `p`'s status or `ABORT_ACK`, none after the
    /// release, only into what the room owns); true when it may land.
    fn check_decode_write(
        &mut self,
        p: u32,
        d: u32,
        room: Room,
        dst: Loc,
        len: u64,
        what: &str,
    ) -> bool {
        if self.late_after_lost_abort(p, d, room, || what.to_string()) {
            return false;
        }
        let dn = &self.decodes[d as usize];
        let owners: Vec<Option<Room>> = match dst {
            Loc::Kv { off, .. } => {
                let il = dn.mem.item_len();
                (off / il..=(off + len.max(1) - 1) / il)
                    .map(|pg| dn.page_owner.get(pg as usize).copied().flatten())
                    .collect()
            }
            Loc::Aux { buf, off } => {
                let rl = AUX_ROW_LENS[buf];
                (off / rl..=(off + len.max(1) - 1) / rl)
                    .map(|r| dn.row_owner.get(r as usize).copied().flatten())
                    .collect()
            }
            // A room's state slot is its aux row.
            Loc::State { off, .. } => (off / STATE_ITEM..=(off + len.max(1) - 1) / STATE_ITEM)
                .map(|r| dn.row_owner.get(r as usize).copied().flatten())
                .collect(),
        };
        let dr = dn.rooms.get(&room);
        let acked = dr.is_some_and(|r| r.acked.contains(&p));
        let told = dr.is_some_and(|r| r.status_from.contains(&p));
        let released = dr.is_some_and(|r| r.released);
        let owned = owners.iter().all(|o| *o == Some(room));
        let inc = dn.inc;
        let what = || format!("{what} (incarnation {inc}); page owners {owners:?}");
        self.check
            .check(Inv::NoWriteAfterAck, !acked, Some(room), || {
                format!("{}, after its ABORT_ACK arrived", what())
            });
        self.check
            .check(Inv::NoWriteAfterStatus, !told, Some(room), || {
                format!("{}, after its status arrived", what())
            });
        self.check
            .check(Inv::NoWriteAfterRelease, !released, Some(room), || {
                format!("{}, after the decode released the room", what())
            });
        self.check
            .check(Inv::WriteInOwnedPage, owned, Some(room), || {
                format!("{}, into memory the room does not own", what())
            });
        !(acked || told || released || !owned)
    }

    /// True when a write of prefill rank `p` for `room` reaches decode rank `d` after the decode
    /// gave the room's pages back at its release timeout because the room's `ABORT` towards `p`
    /// was lost: sglang's protocol has no way to stop such a write (the prefill never heard of
    /// the abort, and only an `ABORT_ACK` tells the decode that nothing of the room is in flight),
    /// so it breaks no invariant of kvx; it is counted ([`Stats::lost_abort_writes`]) and not
    /// applied, so that the pages' next room is checked against what kvx itself does (kvx-sim
    /// seeds 104670 and 124531: the room's batches waited in a worker queue behind slow writes
    /// past the release timeout).
    ///
    /// [`Stats::lost_abort_writes`]: super::Stats::lost_abort_writes
    fn late_after_lost_abort(
        &mut self,
        p: u32,
        d: u32,
        room: Room,
        what: impl FnOnce() -> String,
    ) -> bool {
        let late = self.decodes[d as usize]
            .rooms
            .get(&room)
            .is_some_and(|r| r.released && r.timed_out && r.abort_lost.contains(&p));
        if late {
            self.stats.lost_abort_writes += 1;
            self.trace_line(Some(room), || {
                format!(
                    "  {} after a release timeout that followed its lost ABORT: not applied",
                    what()
                )
            });
        }
        late
    }

    /// A staged chunk's block lands in decode rank `d`'s ring: it must fall inside a live slot
    /// granted to that chunk, over no older slot still live (the watermark admitted it), and
    /// not after the decode heard prefill rank `p`'s status or `ABORT_ACK` for the room.
    fn apply_ring_write(
        &mut self,
        p: u32,
        d: u32,
        room: Room,
        chunk: u32,
        op: &TransferOp,
        bytes: &[u8],
    ) {
        let lost =
            || format!("prefill rank {p} wrote chunk {chunk} ({op:?}) to decode rank {d}'s ring");
        if self.late_after_lost_abort(p, d, room, lost) {
            return;
        }
        let dn = &self.decodes[d as usize];
        let dr = dn.rooms.get(&room);
        let acked = dr.is_some_and(|r| r.acked.contains(&p));
        let told = dr.is_some_and(|r| r.status_from.contains(&p));
        let Some(st) = dn.stager.as_ref() else {
            self.check.check(Inv::WriteInOwnedPage, false, Some(room), || {
                format!("prefill rank {p} writes a staged chunk to decode rank {d}, which has no ring")
            });
            return;
        };
        let verdict = st.check_write(room, chunk, op, bytes.len());
        let what =
            || format!("prefill rank {p} wrote chunk {chunk} ({op:?}) to decode rank {d}'s ring");
        self.check
            .check(Inv::NoWriteAfterAck, !acked, Some(room), || {
                format!("{}, after its ABORT_ACK arrived", what())
            });
        self.check
            .check(Inv::NoWriteAfterStatus, !told, Some(room), || {
                format!("{}, after its status arrived", what())
            });
        self.check.check(
            Inv::RingWriteInLiveSlot,
            verdict.is_ok(),
            Some(room),
            || {
                format!(
                    "{}: {}",
                    what(),
                    verdict.as_ref().err().cloned().unwrap_or_default()
                )
            },
        );
        let slot = verdict.ok();
        if acked || told {
            return;
        }
        let item = crate::memory::item_len(self.sc.decode_tp);
        let dn = &mut self.decodes[d as usize];
        let Some(st) = dn.stager.as_mut() else {
            return;
        };
        // Where the decode's receiver puts it: by address, through a placement when one covers
        // it (into the pages of the chunk that placement's slot was granted to), else the ring.
        // A rank writing around the receiver always lands in the ring.
        let around = self.sc.staging.is_some_and(|c| c.around & (1 << p) != 0);
        let placed = if around { None } else { st.placed_slot(op) };
        let routed = match (placed, slot) {
            (Some(placed), Some(slot)) if placed == slot => {
                st.route(slot, op, bytes, dn.mem.kv_bufs_mut(), item)
            }
            (Some(placed), _) => Err(format!(
                "it lands through slot {placed}'s placement, not in its own slot {slot:?}"
            )),
            (None, Some(slot)) => {
                st.write(slot, op, bytes);
                Ok(())
            }
            (None, None) => Ok(()),
        };
        self.check
            .check(Inv::PlacedWriteOwnChunk, routed.is_ok(), Some(room), || {
                format!("{}: {}", what(), routed.err().unwrap_or_default())
            });
    }
}
