//! `AUX_DATA` on the decode: aux rows a prefill sends over ZMQ instead of writing them
//! (spec §3.4), written at this decode's own row length; anything else is a typed error, counted
//! and dropped by the caller.

use super::Peer;

/// Why an `AUX_DATA` row was not written (logged, counted, dropped).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuxError {
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
    pub(super) fn write_aux(&self, index: u32, row: i64, data: &[u8]) -> Result<(), AuxError> {
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
