//! Property test: whatever multipart junk reaches a prefill or decode inbox over real ZMQ, the
//! inbox keeps running, accounts for every message (accepted or dropped), and still delivers
//! the next valid message.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;
use std::time::Duration;

use kvx_bootstrap::codec::{Abort, TransferStatus};
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions};
use kvx_core::{Endpoint, KVPoll, Room};
use proptest::prelude::*;

fn ctx() -> &'static zmq::Context {
    static C: OnceLock<zmq::Context> = OnceLock::new();
    C.get_or_init(zmq::Context::new)
}

fn rt() -> &'static tokio::runtime::Runtime {
    static R: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    R.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    })
}

fn frame() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..24),
        Just(b"None".to_vec()),
        Just(b"ABORT".to_vec()),
        Just(b"ABORT_ACK".to_vec()),
        Just(b"AUX_DATA".to_vec()),
        Just(b"CHUNK_READY".to_vec()),
        Just(b"STAGING_RSP".to_vec()),
        Just(b"WATERMARK".to_vec()),
        "-?[0-9]{0,22}".prop_map(String::into_bytes),
    ]
}

fn junk() -> impl Strategy<Value = Vec<Vec<Vec<u8>>>> {
    proptest::collection::vec(proptest::collection::vec(frame(), 1..20), 1..12)
}

fn drive(kind: InboxKind, junk: &[Vec<Vec<u8>>], valid: Vec<Vec<u8>>) {
    let ctx = ctx();
    let mut inbox = Inbox::bind(ctx, InboxConfig::new("127.0.0.1", kind)).unwrap();
    let ep = inbox.endpoint().clone();
    let mut push = PushCache::new(ctx, PushOptions::toward_prefill(), 2);
    for m in junk {
        push.send(&ep, m).unwrap();
    }
    push.send(&ep, &valid).unwrap();
    // Read until the valid message shows up; junk that happens to be well-formed comes first.
    loop {
        let m = rt()
            .block_on(async { tokio::time::timeout(Duration::from_secs(20), inbox.recv()).await })
            .expect("the valid message never arrived")
            .expect("inbox closed");
        if m.to_vecs() == valid {
            break;
        }
    }
    let s = inbox.stats();
    assert_eq!(s.received() + s.dropped(), junk.len() as u64 + 1);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn prefill_inbox_survives_junk(junk in junk()) {
        let valid = Abort {
            room: Room::new(42).unwrap(),
            endpoint: Endpoint::new("10.0.0.9", 7),
            generation: None,
        }
        .encode();
        drive(InboxKind::Prefill, &junk, valid);
    }

    #[test]
    fn decode_inbox_survives_junk(junk in junk()) {
        let valid = TransferStatus {
            room: Room::new(42).unwrap(),
            status: KVPoll::Success,
            prefill_rank: 1,
            reason: None,
        }
        .encode();
        drive(InboxKind::Decode, &junk, valid);
    }
}
