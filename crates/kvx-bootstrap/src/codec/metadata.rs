//! Per-request transfer metadata (spec §3.2): frame 0 is the room; one message per request from
//! each decode rank ⇄ [`kvx_core::TransferRequest`].
//!
//! This is the hot path, so [`MetadataRef`] parses without copying: text fields borrow the frames
//! and page lists are [`LeSlice`] views read without alignment assumptions. Frames 4 and 5 both
//! empty mark a dummy destination (frame 6 is then ignored). Frames 8 and 9 are optional; an
//! empty frame 8 means "unknown prefix". Trailing frames past 9 are ignored.

use kvx_core::{Destination, Endpoint, Room, SessionId, TransferRequest};

use super::le::{LeSlice, encode_le};
use super::packed::{PackedLists, encode_packed};
use super::scalar::{
    MAX_TEXT_LEN, ascii_i64, ascii_room, ascii_u64, check_count, frame_or_empty, parse_host,
    parse_i64, parse_port, parse_room, parse_text, parse_u32, parse_u64,
};
use super::{CodecError, Frames};

const MSG: &str = "metadata";

/// A borrowed destination: where the room's data goes on the sending decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DestinationRef<'a> {
    /// Destination KV page ids (frame 4, i32 LE).
    pub kv_pages: LeSlice<'a, i32>,
    /// Destination aux row (frame 5).
    pub aux_index: i64,
    /// Destination state indices, one list per state component (frame 6).
    pub state_indices: PackedLists<'a, i32>,
}

impl DestinationRef<'_> {
    /// The owned form.
    pub fn to_destination(&self) -> Destination {
        Destination {
            kv_pages: self.kv_pages.to_vec(),
            aux_index: self.aux_index,
            state_indices: self.state_indices.to_vecs(),
        }
    }
}

/// A parsed metadata message borrowing its frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetadataRef<'a> {
    /// The room (frame 0).
    pub room: Room,
    /// Decode rank host (frame 1).
    pub host: &'a str,
    /// Decode rank PULL port (frame 2).
    pub port: u16,
    /// Decode session id (frame 3).
    pub session: &'a str,
    /// Where the data goes; `None` for a dummy destination.
    pub dst: Option<DestinationRef<'a>>,
    /// How many decode sessions this prefill rank must hear from (frame 7).
    pub required_dst_info_num: u32,
    /// Decode prefix length in tokens (frame 8); `None` when absent or empty.
    pub decode_prefix_len: Option<u64>,
    /// Device-side KV page ids (frame 9), empty when absent.
    pub device_kv_pages: LeSlice<'a, i32>,
}

impl<'a> MetadataRef<'a> {
    /// Parses a metadata message (8 to 10 frames; more are ignored).
    pub fn parse<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, CodecError> {
        check_count(frames, MSG, 8, usize::MAX, "at least 8")?;
        let f = |i| frame_or_empty(frames, i);
        let room = parse_room(f(0), "metadata.room")?;
        let host = parse_host(f(1), "metadata.host")?;
        let port = parse_port(f(2), "metadata.port")?;
        let session = parse_text(f(3), "metadata.session", MAX_TEXT_LEN)?;
        let dst = if f(4).is_empty() && f(5).is_empty() {
            None
        } else {
            Some(DestinationRef {
                kv_pages: LeSlice::new(f(4), "metadata.kv_pages")?,
                aux_index: parse_i64(f(5), "metadata.aux_index")?,
                state_indices: PackedLists::parse(f(6), "metadata.state_indices")?,
            })
        };
        let required_dst_info_num = parse_u32(f(7), "metadata.required_dst_info_num")?;
        let decode_prefix_len = match f(8) {
            [] => None,
            b => Some(parse_u64(b, "metadata.decode_prefix_len")?),
        };
        let device_kv_pages = LeSlice::new(f(9), "metadata.device_kv_pages")?;
        Ok(MetadataRef {
            room,
            host,
            port,
            session,
            dst,
            required_dst_info_num,
            decode_prefix_len,
            device_kv_pages,
        })
    }

    /// True for a dummy destination.
    pub fn is_dummy(&self) -> bool {
        self.dst.is_none()
    }

    /// The owned form.
    pub fn to_request(&self) -> TransferRequest {
        TransferRequest {
            room: self.room,
            endpoint: Endpoint::new(self.host, self.port),
            session: SessionId::new(self.session),
            dst: self.dst.as_ref().map(DestinationRef::to_destination),
            required_dst_info_num: self.required_dst_info_num,
            decode_prefix_len: self.decode_prefix_len,
            device_kv_pages: self.device_kv_pages.to_vec(),
        }
    }
}

/// Parses a metadata message into the owned form.
pub fn parse_metadata<F: AsRef<[u8]>>(frames: &[F]) -> Result<TransferRequest, CodecError> {
    MetadataRef::parse(frames).map(|m| m.to_request())
}

/// Encodes a metadata message: always 10 frames. A dummy writes empty frames 4–6; an unknown
/// prefix (`None`) writes an empty frame 8, which every parser revision reads back as `None`.
/// Fails only when the state lists are too long for the packed format's u32 lengths.
pub fn encode_metadata(req: &TransferRequest) -> Result<Frames, CodecError> {
    let mut out = Vec::with_capacity(10);
    out.push(ascii_room(req.room));
    out.push(req.endpoint.host.as_bytes().to_vec());
    out.push(ascii_u64(u64::from(req.endpoint.port)));
    out.push(req.session.as_str().as_bytes().to_vec());
    match &req.dst {
        Some(d) => {
            out.push(encode_le(&d.kv_pages));
            out.push(ascii_i64(d.aux_index));
            out.push(encode_packed(&d.state_indices, "metadata.state_indices")?);
        }
        None => out.extend([Vec::new(), Vec::new(), Vec::new()]),
    }
    out.push(ascii_u64(u64::from(req.required_dst_info_num)));
    out.push(req.decode_prefix_len.map_or_else(Vec::new, ascii_u64));
    out.push(encode_le(&req.device_kv_pages));
    Ok(out)
}
