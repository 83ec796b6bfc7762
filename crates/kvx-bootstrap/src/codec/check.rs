//! Self-consistency checks over arbitrary input, shared by the cargo-fuzz targets in `fuzz/` and
//! by the test suite (which runs them over proptest-generated frames so they are exercised in
//! ordinary CI). Each check parses the input; when parsing succeeds it re-encodes the typed value,
//! parses that again and asserts the two agree (and that canonical input encodes back byte for
//! byte); when parsing fails it asserts the error carries a known [`CodecError::kind`].
//!
//! These functions panic on a codec inconsistency — that is their job; the parsers they call
//! never panic.

use super::le::LeInt;
use super::{Abort, encode_metadata, encode_registration};
use super::{
    AbortAck, AuxData, ChunkReady, CodecError, DecodeInbound, MetadataRef, PackedLists,
    PrefillInbound, StagingReq, StagingRsp, TransferStatus, Watermark, encode_packed,
    parse_metadata, parse_registration,
};

fn known(e: &CodecError) {
    assert!(
        CodecError::KINDS.contains(&e.kind()),
        "unlisted error kind {}",
        e.kind()
    );
    // Display must not panic either.
    let _ = e.to_string();
}

fn frames_eq<F: AsRef<[u8]>>(a: &[F], b: &[Vec<u8>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.as_ref() == y.as_slice())
}

/// Parses `frames` as a prefill-inbox message and checks encode/parse agreement.
pub fn prefill_inbox<F: AsRef<[u8]>>(frames: &[F]) -> Result<(), CodecError> {
    match PrefillInbound::parse(frames) {
        Ok(msg) => {
            let Ok(encoded) = msg.encode() else {
                panic!("a parsed message must encode");
            };
            let again = PrefillInbound::parse(&encoded);
            assert_eq!(
                again.as_ref().map(PrefillInbound::encode),
                Ok(Ok(encoded.clone()))
            );
            if let (PrefillInbound::Metadata(a), Ok(PrefillInbound::Metadata(b))) = (&msg, &again) {
                assert_eq!(a.to_request(), b.to_request());
            } else {
                assert_eq!(again.as_ref().map(PrefillInbound::kind), Ok(msg.kind()));
            }
            if let PrefillInbound::Metadata(m) = &msg {
                assert_eq!(parse_metadata(frames).as_ref(), Ok(&m.to_request()));
            }
            Ok(())
        }
        Err(e) => {
            known(&e);
            Err(e)
        }
    }
}

/// Parses `frames` as a decode-inbox message and checks encode/parse agreement.
pub fn decode_inbox<F: AsRef<[u8]>>(frames: &[F]) -> Result<(), CodecError> {
    match DecodeInbound::parse(frames) {
        Ok(msg) => {
            let Ok(encoded) = msg.encode() else {
                panic!("a parsed message must encode");
            };
            let again = DecodeInbound::parse(&encoded);
            match (&msg, &again) {
                (DecodeInbound::Status(a), Ok(DecodeInbound::Status(b))) => {
                    // The reason travels as a 4th frame, and only when there is one; the
                    // 3-frame form every decode takes carries the rest.
                    assert_eq!(a, b);
                    assert_eq!(encoded.len(), if a.reason.is_some() { 4 } else { 3 });
                    let plain = TransferStatus::parse(&a.encode());
                    assert_eq!(
                        plain.map(|p| (p.room, p.status, p.prefill_rank, p.reason)),
                        Ok((a.room, a.status, a.prefill_rank, None))
                    );
                }
                (DecodeInbound::AbortAck(a), Ok(b)) => {
                    // A generation without a rank is not encodable; nothing parses to one.
                    assert!(a.generation.is_none() || a.prefill_rank.is_some());
                    assert_eq!(&msg, b);
                }
                (a, Ok(b)) => assert_eq!(a, b),
                (_, Err(e)) => panic!("re-parse failed: {e}"),
            }
            Ok(())
        }
        Err(e) => {
            known(&e);
            Err(e)
        }
    }
}

/// Runs every individual message parser over `frames` (whatever frame 0 says) and checks that
/// each success re-encodes to an equal message, byte for byte when the input was canonical.
pub fn every_parser<F: AsRef<[u8]>>(frames: &[F]) {
    fn round<T: PartialEq + std::fmt::Debug>(
        parsed: Result<T, CodecError>,
        encode: fn(&T) -> Vec<Vec<u8>>,
        parse: fn(&[Vec<u8>]) -> Result<T, CodecError>,
    ) {
        match parsed {
            Ok(v) => {
                let enc = encode(&v);
                let back = parse(&enc);
                assert_eq!(back.as_ref(), Ok(&v));
                // The encoded form is canonical: encoding it again changes nothing.
                assert_eq!(back.map(|b| encode(&b)), Ok(enc));
            }
            Err(e) => known(&e),
        }
    }
    round(Abort::parse(frames), Abort::encode, Abort::parse::<Vec<u8>>);
    round(
        AbortAck::parse(frames),
        AbortAck::encode,
        AbortAck::parse::<Vec<u8>>,
    );
    round(
        StagingReq::parse(frames),
        StagingReq::encode,
        StagingReq::parse::<Vec<u8>>,
    );
    round(
        StagingRsp::parse(frames),
        StagingRsp::encode,
        StagingRsp::parse::<Vec<u8>>,
    );
    round(
        Watermark::parse(frames),
        Watermark::encode,
        Watermark::parse::<Vec<u8>>,
    );
    round(
        ChunkReady::parse(frames),
        ChunkReady::encode,
        ChunkReady::parse::<Vec<u8>>,
    );
    match TransferStatus::parse(frames) {
        Ok(s) => {
            let enc = s.encode();
            assert_eq!(enc.len(), 3);
            let back = TransferStatus::parse(&enc);
            assert_eq!(
                back.map(|b| (b.room, b.status, b.prefill_rank)),
                Ok((s.room, s.status, s.prefill_rank))
            );
            // The 4-frame form (sglang 0.5.23) carries the reason back unchanged, and encoding
            // is canonical: the same bytes again from what it parses to.
            let with = s.encode_with_reason();
            assert_eq!(with.len(), if s.reason.is_some() { 4 } else { 3 });
            let back = TransferStatus::parse(&with);
            assert_eq!(back.as_ref(), Ok(&s));
            assert_eq!(back.map(|b| b.encode_with_reason()), Ok(with));
        }
        Err(e) => known(&e),
    }
    match AuxData::parse(frames) {
        Ok(a) => match a.encode() {
            Ok(enc) => {
                // The length and payload frames come back byte for byte; the ASCII ints are
                // canonical only once encoded (the parser takes leading zeros, `-0`).
                assert!(
                    frames_eq(&frames[4..], &enc[4..]),
                    "aux payload is canonical"
                );
                let back = AuxData::parse(&enc);
                assert_eq!(back.as_ref(), Ok(&a));
                assert_eq!(back.map(|b| b.encode()), Ok(Ok(enc.clone())));
            }
            Err(e) => panic!("parsed aux data must encode: {e}"),
        },
        Err(e) => known(&e),
    }
    match parse_registration(frames) {
        Ok(r) => match encode_registration(&r) {
            Ok(enc) => assert_eq!(parse_registration(&enc).as_ref(), Ok(&r)),
            Err(e) => panic!("parsed registration must encode: {e}"),
        },
        Err(e) => known(&e),
    }
    match MetadataRef::parse(frames) {
        Ok(m) => {
            let req = m.to_request();
            match encode_metadata(&req) {
                Ok(enc) => assert_eq!(parse_metadata(&enc).as_ref(), Ok(&req)),
                Err(e) => panic!("parsed metadata must encode: {e}"),
            }
        }
        Err(e) => known(&e),
    }
}

fn packed_as<T: LeInt>(bytes: &[u8]) {
    match PackedLists::<T>::parse(bytes, "fuzz") {
        Ok(p) => {
            let lists = p.to_vecs();
            assert_eq!(p.len(), lists.len());
            let Ok(enc) = encode_packed(&lists, "fuzz") else {
                panic!("parsed lists must encode");
            };
            if lists.is_empty() {
                // `[]` is zero bytes, though a zero count header is accepted too.
                assert!(enc.is_empty());
            } else {
                assert_eq!(enc.as_slice(), bytes, "non-empty lists are canonical");
            }
        }
        Err(e) => known(&e),
    }
}

/// Parses `bytes` as packed-int-lists of each element type and checks byte-exact re-encoding.
pub fn packed_lists(bytes: &[u8]) {
    packed_as::<i32>(bytes);
    packed_as::<u32>(bytes);
    packed_as::<u64>(bytes);
}
