//! Round-trip property tests: every message type encodes to frames that parse back to the same
//! value, through its own parser and through the inbox classifier, and the encoding is canonical
//! (encoding the parsed value again gives the same bytes).

#![allow(clippy::unwrap_used)]

mod codec_support;

use codec_support::*;
use kvx_bootstrap::codec::{
    Abort, AbortAck, AuxData, ChunkReady, DecodeInbound, MetadataRef, PrefillInbound, StagingReq,
    StagingRsp, TransferStatus, Watermark, encode_metadata, encode_registration, parse_metadata,
    parse_registration,
};
use proptest::prelude::*;

proptest! {
    #[test]
    fn registration_round_trip(reg in registration()) {
        let frames = encode_registration(&reg).unwrap();
        let want = match (&reg.staging_slot_layer_ids, &reg.kv_item_lens) {
            (_, Some(_)) => 20,
            (Some(_), None) => 19,
            (None, None) => 18,
        };
        prop_assert_eq!(frames.len(), want);
        prop_assert_eq!(&frames[0], b"None");
        prop_assert_eq!(parse_registration(&frames).unwrap(), reg.clone());
        match PrefillInbound::parse(&frames).unwrap() {
            PrefillInbound::Registration(r) => prop_assert_eq!(*r, reg),
            other => prop_assert!(false, "classified as {}", other.kind()),
        }
    }

    #[test]
    fn metadata_round_trip(req in request()) {
        let frames = encode_metadata(&req).unwrap();
        prop_assert_eq!(frames.len(), 10);
        let m = MetadataRef::parse(&frames).unwrap();
        prop_assert_eq!(m.is_dummy(), req.is_dummy());
        prop_assert_eq!(m.to_request(), req.clone());
        prop_assert_eq!(parse_metadata(&frames).unwrap(), req.clone());
        match PrefillInbound::parse(&frames).unwrap() {
            PrefillInbound::Metadata(x) => {
                prop_assert_eq!(x.room, req.room);
                prop_assert_eq!(encode_metadata(&x.to_request()).unwrap(), frames);
            }
            other => prop_assert!(false, "classified as {}", other.kind()),
        }
    }

    #[test]
    fn metadata_page_views_match_owned(req in request()) {
        let frames = encode_metadata(&req).unwrap();
        let m = MetadataRef::parse(&frames).unwrap();
        if let (Some(view), Some(owned)) = (m.dst, req.dst.as_ref()) {
            prop_assert_eq!(view.kv_pages.len(), owned.kv_pages.len());
            for (i, p) in owned.kv_pages.iter().enumerate() {
                prop_assert_eq!(view.kv_pages.get(i), Some(*p));
            }
            prop_assert_eq!(view.kv_pages.iter().collect::<Vec<_>>(), owned.kv_pages.clone());
            prop_assert_eq!(view.state_indices.to_vecs(), owned.state_indices.clone());
        }
    }

    #[test]
    fn status_round_trip(s in status()) {
        let frames = s.encode();
        prop_assert_eq!(frames.len(), 3);
        prop_assert_eq!(TransferStatus::parse(&frames).unwrap(), s.clone());
        prop_assert_eq!(DecodeInbound::parse(&frames).unwrap(), DecodeInbound::Status(s));
    }

    #[test]
    fn status_with_reason_round_trip(s in status_with_reason()) {
        let frames = s.encode_with_reason();
        prop_assert_eq!(frames.len(), if s.reason.is_some() { 4 } else { 3 });
        prop_assert_eq!(&frames[..3], &s.encode()[..]);
        prop_assert_eq!(TransferStatus::parse(&frames).unwrap(), s.clone());
        prop_assert_eq!(DecodeInbound::parse(&frames).unwrap(), DecodeInbound::Status(s));
    }

    #[test]
    fn abort_round_trip(a in abort(), ack in abort_ack()) {
        let frames = a.encode();
        prop_assert_eq!(frames.len(), if a.generation.is_some() { 5 } else { 4 });
        prop_assert_eq!(Abort::parse(&frames).unwrap(), a.clone());
        prop_assert_eq!(PrefillInbound::parse(&frames).unwrap(), PrefillInbound::Abort(a));
        let frames = ack.encode();
        let want = match (ack.prefill_rank, ack.generation) {
            (None, _) => 2,
            (Some(_), None) => 3,
            (Some(_), Some(_)) => 4,
        };
        prop_assert_eq!(frames.len(), want);
        prop_assert_eq!(AbortAck::parse(&frames).unwrap(), ack.clone());
        prop_assert_eq!(DecodeInbound::parse(&frames).unwrap(), DecodeInbound::AbortAck(ack));
    }

    #[test]
    fn aux_data_round_trip(
        r in room(),
        aux_index in any::<u32>(),
        dst_row in any::<i64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let a = AuxData { room: r, aux_index, dst_row, payload: &payload };
        let frames = a.encode().unwrap();
        prop_assert_eq!(&frames[4], &(payload.len() as u32).to_be_bytes().to_vec());
        prop_assert_eq!(AuxData::parse(&frames).unwrap(), a);
        prop_assert_eq!(DecodeInbound::parse(&frames).unwrap(), DecodeInbound::AuxData(a));
    }

    #[test]
    fn staging_round_trip(
        req in staging_req(),
        rsp in staging_rsp(),
        wm in watermark(),
        cr in chunk_ready(),
    ) {
        let (req_f, rsp_f, wm_f, cr_f) = (req.encode(), rsp.encode(), wm.encode(), cr.encode());
        prop_assert_eq!(StagingReq::parse(&req_f).unwrap(), req.clone());
        prop_assert_eq!(DecodeInbound::parse(&req_f).unwrap(), DecodeInbound::StagingReq(req));
        prop_assert_eq!(StagingRsp::parse(&rsp_f).unwrap(), rsp.clone());
        prop_assert_eq!(PrefillInbound::parse(&rsp_f).unwrap(), PrefillInbound::StagingRsp(rsp));
        prop_assert_eq!(Watermark::parse(&wm_f).unwrap(), wm.clone());
        prop_assert_eq!(PrefillInbound::parse(&wm_f).unwrap(), PrefillInbound::Watermark(wm));
        prop_assert_eq!(ChunkReady::parse(&cr_f).unwrap(), cr.clone());
        prop_assert_eq!(DecodeInbound::parse(&cr_f).unwrap(), DecodeInbound::ChunkReady(cr));
    }

    #[test]
    fn inbox_encode_is_canonical(frames in valid_frames()) {
        if let Ok(m) = PrefillInbound::parse(&frames) {
            prop_assert_eq!(m.encode().unwrap(), frames.clone());
        }
        if let Ok(m) = DecodeInbound::parse(&frames) {
            prop_assert_eq!(m.encode().unwrap(), frames.clone());
        }
    }

    #[test]
    fn each_valid_message_lands_in_exactly_one_inbox(frames in valid_frames()) {
        let p = PrefillInbound::parse(&frames).is_ok();
        let d = DecodeInbound::parse(&frames).is_ok();
        // Registration, metadata, ABORT, STAGING_RSP, WATERMARK go to the prefill; the rest to
        // the decode. (A metadata message can never pass as a 3/4-frame status: it has 10.)
        prop_assert!(p != d, "prefill={} decode={}", p, d);
    }
}

#[test]
fn borrowed_frames_of_any_container() {
    let owned = TransferStatus {
        room: kvx_core::Room::new(7).unwrap(),
        status: kvx_core::KVPoll::Failed,
        prefill_rank: 2,
        reason: None,
    }
    .encode();
    let slices: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
    let arrays: [&[u8]; 3] = [b"7", b"0", b"2"];
    assert_eq!(
        TransferStatus::parse(&slices),
        TransferStatus::parse(&owned)
    );
    assert_eq!(
        TransferStatus::parse(&arrays),
        TransferStatus::parse(&owned)
    );
}
