//! Byte verification of a received room against kvx's synthetic pattern (what `kvx prefill` and
//! [`crate::synthetic::SyntheticModel`] write): every KV page of every buffer and the aux row,
//! whose `bootstrap_room` slot must hold the room (sglang admits the request only then) and is
//! zeroed afterwards, as sglang zeroes a used row's slot.

use kvx_core::Room;

use crate::model::{self, KvLayout};
use crate::region::Region;

/// Checks every byte of `room`, received into `pages` of `kv` and row `row` of `aux` laid out as
/// `layout`, and zeroes the row's room slot; returns the bytes checked, or `None` on a mismatch
/// (logged). Reads copies, never views: a late write may still land in the pages.
pub fn verify_room(
    layout: &KvLayout,
    kv: &Region,
    aux: &Region,
    room: Room,
    pages: &[i32],
    row: u64,
) -> Option<u64> {
    let l = layout;
    let mut bytes = 0;
    // Copies, not views: a late write from the prefill may still land in these pages.
    let mut data = vec![0u8; usize::try_from(l.item_len).ok()?];
    for b in 0..l.num_buffers {
        let base = l.buffer_addr(kv.base(), b);
        for (i, &p) in pages.iter().enumerate() {
            kv.copy_out(base + p as u64 * l.item_len, &mut data).ok()?;
            if !l.check_kv(&data, room.get(), b as u32, i as u32) {
                tracing::error!(%room, buffer = b, page_in_room = i, "KV bytes differ from the pattern");
                return None;
            }
            bytes += l.item_len;
        }
    }
    let ptrs = l.aux_ptrs(aux.base());
    let lens = l.aux_item_lens();
    let mut ok = true;
    for (i, (&ptr, &len)) in ptrs.iter().zip(&lens).enumerate() {
        let at = ptr + row * len;
        ok &= if i == model::AUX_ROOM_INDEX {
            // sglang's decode admits the request only when the slot holds the room.
            aux.to_vec(at, len).is_ok_and(|d| {
                d.split_first_chunk::<8>()
                    .is_some_and(|(head, _)| *head == room.get().to_le_bytes())
            })
        } else {
            aux.to_vec(at, len)
                .is_ok_and(|d| model::check_aux(&d, room.get(), i))
        };
    }
    // sglang zeroes the room slot of a used aux row.
    let slot = ptrs[model::AUX_ROOM_INDEX] + row * model::AUX_ROOM_LEN;
    let _ = aux.fill(slot, model::AUX_ROOM_LEN, 0);
    if !ok {
        tracing::error!(%room, row, "aux row differs from the pattern");
        return None;
    }
    Some(bytes + l.aux_row_bytes())
}
