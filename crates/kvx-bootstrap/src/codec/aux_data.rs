//! `AUX_DATA` (spec §3.4), prefill → decode: one aux (metadata-buffer) row sent over TCP instead
//! of RDMA. Frame 4 is the protocol's only big-endian field, the payload length, and must agree
//! with frame 5. The parsed form borrows the payload.

use kvx_core::Room;

use super::scalar::{
    ascii_i64, ascii_room, ascii_u64, check_count, frame_or_empty, parse_i64, parse_room, parse_u32,
};
use super::{CodecError, Frames};

/// Frame 0 of an aux-data message.
pub const AUX_DATA_TAG: &[u8] = b"AUX_DATA";

/// One aux row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuxData<'a> {
    /// The room.
    pub room: Room,
    /// Which aux buffer (0..n_aux).
    pub aux_index: u32,
    /// The destination row (the decode's aux index for the room).
    pub dst_row: i64,
    /// The row's bytes.
    pub payload: &'a [u8],
}

impl<'a> AuxData<'a> {
    /// Parses the 6 frames.
    pub fn parse<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, CodecError> {
        check_count(frames, "aux_data", 6, 6, "6")?;
        let f = |i| frame_or_empty(frames, i);
        if f(0) != AUX_DATA_TAG {
            return Err(super::unknown_tag(f(0)));
        }
        let room = parse_room(f(1), "aux_data.room")?;
        let aux_index = parse_u32(f(2), "aux_data.aux_index")?;
        let dst_row = parse_i64(f(3), "aux_data.dst_row")?;
        let len_frame = f(4);
        let declared = match len_frame.first_chunk::<4>() {
            Some(b) if len_frame.len() == 4 => u32::from_be_bytes(*b),
            _ => {
                return Err(CodecError::LengthMismatch {
                    field: "aux_data.length_frame",
                    declared: 4,
                    actual: len_frame.len() as u64,
                });
            }
        };
        let payload = f(5);
        if u64::from(declared) != payload.len() as u64 {
            return Err(CodecError::LengthMismatch {
                field: "aux_data.payload",
                declared: u64::from(declared),
                actual: payload.len() as u64,
            });
        }
        Ok(AuxData {
            room,
            aux_index,
            dst_row,
            payload,
        })
    }

    /// Encodes the 6 frames (copies the payload). Fails when the payload exceeds `u32::MAX` bytes.
    pub fn encode(&self) -> Result<Frames, CodecError> {
        let len = u32::try_from(self.payload.len()).map_err(|_| CodecError::Oversized {
            field: "aux_data.payload",
            len: self.payload.len(),
            max: u32::MAX as usize,
        })?;
        Ok(vec![
            AUX_DATA_TAG.to_vec(),
            ascii_room(self.room),
            ascii_u64(u64::from(self.aux_index)),
            ascii_i64(self.dst_row),
            len.to_be_bytes().to_vec(),
            self.payload.to_vec(),
        ])
    }
}
