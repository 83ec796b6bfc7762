//! Runs the bodies of the cargo-fuzz targets (`kvx_bootstrap::codec::check`) over
//! proptest-generated input, so the fuzz harness and the invariants it asserts are exercised in
//! ordinary CI: random frames, and valid messages damaged by one or two mutations.

#![allow(clippy::unwrap_used)]

mod codec_support;

use codec_support::*;
use kvx_bootstrap::codec::check;
use proptest::collection::vec;
use proptest::prelude::*;

fn random_frames() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let frame = prop_oneof![
        vec(any::<u8>(), 0..24),
        vec(proptest::sample::select(b"0123456789-".to_vec()), 0..22),
        proptest::sample::select(vec![
            b"None".to_vec(),
            b"ABORT".to_vec(),
            b"ABORT_ACK".to_vec(),
            b"AUX_DATA".to_vec(),
            b"WATERMARK".to_vec(),
            b"STAGING_REQ".to_vec(),
            b"STAGING_RSP".to_vec(),
            b"CHUNK_READY".to_vec(),
            b"BOOTSTRAP".to_vec(),
        ]),
    ];
    vec(frame, 0..21)
}

/// Runs every checking body the fuzz targets run on `frames` (each panics on a disagreement).
fn every_body(frames: &[Vec<u8>]) {
    let _ = check::prefill_inbox(frames);
    let _ = check::decode_inbox(frames);
    check::every_parser(frames);
    for fr in frames {
        check::packed_lists(fr);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn fuzz_bodies_on_random_frames(frames in random_frames()) {
        every_body(&frames);
    }

    #[test]
    fn fuzz_bodies_on_damaged_messages(
        mut frames in valid_frames(),
        muts in vec(mutation(), 1..3),
    ) {
        for m in &muts {
            apply(&mut frames, m);
        }
        every_body(&frames);
    }

    #[test]
    fn fuzz_bodies_accept_valid_messages(frames in valid_frames()) {
        // Every valid message parses on exactly one inbox, through the checking bodies too.
        let ok = check::prefill_inbox(&frames).is_ok() as u8 + check::decode_inbox(&frames).is_ok() as u8;
        prop_assert_eq!(ok, 1);
        check::every_parser(&frames);
    }

    #[test]
    fn packed_body_on_random_bytes(bytes in vec(any::<u8>(), 0..80)) {
        check::packed_lists(&bytes);
    }
}
