//! `AUX_DATA` on the decode: aux rows a prefill sends over ZMQ instead of writing them
//! (spec §3.4), written at this decode's own row length, and only into the row the named room
//! holds here while it is open; anything else is a typed error, counted and dropped by the
//! caller.

use super::Peer;

/// Why an `AUX_DATA` row was not written (logged, counted, dropped).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuxError {
    /// The room is not open here (unknown, or concluded: its row may belong to another room by
    /// now), or holds another row.
    #[error("AUX_DATA for {room} names aux row {row}, which that room does not hold here")]
    NotTheRoomsRow {
        /// The room the message names.
        room: kvx_core::Room,
        /// The row it names.
        row: i64,
    },
    /// No such aux buffer here.
    #[error("aux buffer {0} does not exist")]
    Index(u32),
    /// The row lies outside the aux pool.
    #[error("aux row {0} is outside the pool")]
    Row(i64),
    /// The payload is not one of this decode's rows (sglang drops it too).
    #[error("aux row of {got} bytes, this decode's rows of buffer {index} have {want}")]
    Length {
        /// The buffer.
        index: u32,
        /// Bytes received.
        got: usize,
        /// This decode's row length.
        want: u64,
    },
    /// The row's range is outside the aux region (or the aux region is device memory, which
    /// the engines refuse at start).
    #[error(transparent)]
    Bounds(#[from] crate::region::AccessError),
}

impl Peer {
    /// Writes an `AUX_DATA` row at `aux_ptr[index] + row · item_len[index]` with this decode's
    /// own row length (spec §3.4); it arrives before its room's status on the same socket.
    pub(super) fn write_aux(
        &self,
        room: kvx_core::Room,
        index: u32,
        row: i64,
        data: &[u8],
    ) -> Result<(), AuxError> {
        let held = super::lock(&self.aux_rows).get(&room).copied();
        if held.is_none_or(|r| i64::try_from(r).ok() != Some(row)) {
            return Err(AuxError::NotTheRoomsRow { room, row });
        }
        let l = &self.cfg.layout;
        let i = index as usize;
        let (Some(&ptr), Some(&want)) =
            (l.aux_ptrs(self.aux.base()).get(i), l.aux_item_lens().get(i))
        else {
            return Err(AuxError::Index(index));
        };
        let r = u64::try_from(row)
            .ok()
            .filter(|r| *r < l.aux_rows)
            .ok_or(AuxError::Row(row))?;
        if data.len() as u64 != want {
            return Err(AuxError::Length {
                index,
                got: data.len(),
                want,
            });
        }
        self.aux.copy_in(ptr + r * want, data)?;
        Ok(())
    }
}
