//! KV-args registration (spec §3.1): the `None`-tagged message a decode rank sends once per
//! session, before any metadata, ⇄ [`kvx_core::DecodeRegistration`].
//!
//! Parsing accepts 10 or more frames (frames 10–17 optional, 12/13/15/16/17 also empty; frames 6,
//! 10 and 11 accept empty bytes as the empty list; a frame 14 whose length is not 8 means "no
//! staging ring"; frame 18 is the later revision's staging slot layer ids; frame 19 is sglang
//! 0.5.23's per-buffer `kv_item_lens` (u64 LE, may be empty) — the frame that tells a 0.5.23
//! decode from a sglang main one, see [`DecodeRegistration::accepts_status_reason`]; further
//! trailing frames are ignored, as sglang's index-based parser ignores them). Encoding writes
//! frames 0–17 exactly as the target revision does, plus frame 18 when slot layer ids or item
//! lengths are present (empty when only the latter are) and frame 19 when item lengths are.

use kvx_core::{DecodeRegistration, Endpoint, SessionId, StagingRingInfo};

use super::le::{LeSlice, encode_le};
use super::packed::{PackedLists, encode_packed};
use super::scalar::{
    MAX_TEXT_LEN, ascii_u64, check_count, frame_opt, frame_or_empty, parse_host, parse_port,
    parse_text, parse_u32, parse_u64,
};
use super::{CodecError, Frames};

/// Frame 0 of a registration message.
pub const REGISTRATION_TAG: &[u8] = b"None";

const MSG: &str = "registration";

/// Parses a registration message (frame 0 must be `None`).
pub fn parse_registration<F: AsRef<[u8]>>(frames: &[F]) -> Result<DecodeRegistration, CodecError> {
    check_count(frames, MSG, 10, usize::MAX, "at least 10")?;
    let f = |i| frame_or_empty(frames, i);
    if f(0) != REGISTRATION_TAG {
        return Err(super::unknown_tag(f(0)));
    }
    let host = parse_host(f(1), "registration.host")?;
    let port = parse_port(f(2), "registration.port")?;
    let session = parse_text(f(3), "registration.session", MAX_TEXT_LEN)?;
    let kv_ptrs = LeSlice::<u64>::new(f(4), "registration.kv_ptrs")?.to_vec();
    let aux_ptrs = LeSlice::<u64>::new(f(5), "registration.aux_ptrs")?.to_vec();
    let state_ptrs = PackedLists::<u64>::parse(f(6), "registration.state_ptrs")?.to_vecs();
    let dst_tp_rank = parse_u32(f(7), "registration.dst_tp_rank")?;
    let dst_attn_tp_size = parse_u32(f(8), "registration.dst_attn_tp_size")?;
    let dst_kv_item_len = parse_u64(f(9), "registration.dst_kv_item_len")?;
    let state_item_lens =
        PackedLists::<u32>::parse(f(10), "registration.state_item_lens")?.to_vecs();
    let state_dim_per_tensor =
        PackedLists::<u32>::parse(f(11), "registration.state_dim_per_tensor")?.to_vecs();
    let kv_layer_ids = LeSlice::<u32>::new(f(12), "registration.kv_layer_ids")?.to_vec();
    let state_layer_ids =
        PackedLists::<u32>::parse(f(13), "registration.state_layer_ids")?.to_vecs();
    let base = f(14).first_chunk::<8>().filter(|_| f(14).len() == 8);
    let staging = StagingRingInfo {
        base: base.map(|b| u64::from_le_bytes(*b)),
        size: match f(15) {
            [] => None,
            b => Some(parse_u64(b, "registration.staging_size")?),
        },
    };
    let dcp_size = match f(16) {
        [] => 1,
        b => parse_u32(b, "registration.dcp_size")?,
    };
    let dcp_rank = match f(17) {
        [] => 0,
        b => parse_u32(b, "registration.dcp_rank")?,
    };
    let staging_slot_layer_ids = frame_opt(frames, 18)
        .map(|b| LeSlice::<u64>::new(b, "registration.staging_slot_layer_ids").map(|s| s.to_vec()))
        .transpose()?;
    let kv_item_lens = frame_opt(frames, 19)
        .map(|b| LeSlice::<u64>::new(b, "registration.kv_item_lens").map(|s| s.to_vec()))
        .transpose()?;
    Ok(DecodeRegistration {
        endpoint: Endpoint::new(host, port),
        session: SessionId::new(session),
        kv_ptrs,
        aux_ptrs,
        state_ptrs,
        dst_tp_rank,
        dst_attn_tp_size,
        dst_kv_item_len,
        state_item_lens,
        state_dim_per_tensor,
        kv_layer_ids,
        state_layer_ids,
        staging,
        dcp_size,
        dcp_rank,
        staging_slot_layer_ids,
        kv_item_lens,
    })
}

/// Encodes a registration message: 18 frames, 19 when only `staging_slot_layer_ids` is set, 20
/// (sglang 0.5.23's form) when `kv_item_lens` is set. Fails only when a list is too long for the
/// packed format's u32 lengths.
pub fn encode_registration(reg: &DecodeRegistration) -> Result<Frames, CodecError> {
    let mut out = Vec::with_capacity(20);
    out.push(REGISTRATION_TAG.to_vec());
    out.push(reg.endpoint.host.as_bytes().to_vec());
    out.push(ascii_u64(u64::from(reg.endpoint.port)));
    out.push(reg.session.as_str().as_bytes().to_vec());
    out.push(encode_le(&reg.kv_ptrs));
    out.push(encode_le(&reg.aux_ptrs));
    out.push(encode_packed(&reg.state_ptrs, "registration.state_ptrs")?);
    out.push(ascii_u64(u64::from(reg.dst_tp_rank)));
    out.push(ascii_u64(u64::from(reg.dst_attn_tp_size)));
    out.push(ascii_u64(reg.dst_kv_item_len));
    out.push(encode_packed(
        &reg.state_item_lens,
        "registration.state_item_lens",
    )?);
    out.push(encode_packed(
        &reg.state_dim_per_tensor,
        "registration.state_dim_per_tensor",
    )?);
    out.push(encode_le(&reg.kv_layer_ids));
    out.push(encode_packed(
        &reg.state_layer_ids,
        "registration.state_layer_ids",
    )?);
    out.push(
        reg.staging
            .base
            .map_or_else(Vec::new, |b| b.to_le_bytes().to_vec()),
    );
    out.push(reg.staging.size.map_or_else(Vec::new, ascii_u64));
    out.push(ascii_u64(u64::from(reg.dcp_size)));
    out.push(ascii_u64(u64::from(reg.dcp_rank)));
    match (&reg.staging_slot_layer_ids, &reg.kv_item_lens) {
        (None, None) => {}
        (ids, lens) => {
            out.push(ids.as_deref().map_or_else(Vec::new, encode_le));
            if let Some(lens) = lens {
                out.push(encode_le(lens));
            }
        }
    }
    Ok(out)
}
