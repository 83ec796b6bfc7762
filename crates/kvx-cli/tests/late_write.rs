//! The decode's late-write check can fail: a misbehaving prefill (assembled here from kvx's
//! parts) acknowledges an ABORT at once and keeps writing into the room's pages afterwards. The
//! decode must hold the pages until the ACK, see them change after it, and count a late write.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use kvx_bootstrap::codec::AbortAck;
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions, zmq};
use kvx_cli::decode::{self, DecodeConfig};
use kvx_core::TransferOp;
use kvx_engine::model::ModelPreset;
use kvx_engine::plane::{Backend, DataPlane};
use kvx_engine::region::Region;
use kvx_engine::wire::{self, PrefillInbound};

fn recv(rt: &tokio::runtime::Runtime, inbox: &mut Inbox) -> PrefillInbound {
    let msg = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), inbox.recv()).await })
        .expect("hang guard: nothing from the decode")
        .unwrap();
    wire::parse_prefill_inbound(msg.frames()).unwrap()
}

#[test]
fn a_write_after_the_abort_ack_is_counted() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let (server, port) = common::bootstrap_server(&rt);
    let ctx = zmq::Context::new();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Prefill)).unwrap();
    common::register_tiny_rank(&rt, port, 64, inbox.endpoint().port);
    let src = Arc::new(Region::new(layout.item_len as usize));
    let plane = DataPlane::client(Backend::Tcp, "late-writer", 1, vec![src.clone()]).unwrap();

    let cfg = DecodeConfig {
        prompt_tokens: (100, 100),
        fragmentation: 0.0,
        waiting_timeout: Duration::from_secs(1),
        abort_release_timeout: Duration::from_secs(10),
        seed: 3,
        room_base: Some(500),
        ..DecodeConfig::new("127.0.0.1", port, layout.clone())
    };
    let decode = rt.spawn(decode::run(cfg));

    let PrefillInbound::Registration(reg) = recv(&rt, &mut inbox) else {
        panic!("no registration first");
    };
    let PrefillInbound::Metadata(req) = recv(&rt, &mut inbox) else {
        panic!("no metadata");
    };
    let page = req.dst.unwrap().kv_pages[0];
    // No KV and no status: the decode's waiting timeout fires and it sends ABORT.
    let PrefillInbound::Abort {
        room,
        endpoint,
        generation,
    } = recv(&rt, &mut inbox)
    else {
        panic!("no ABORT");
    };
    assert_eq!(room, req.room);
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 4);
    let ack = AbortAck {
        room,
        prefill_rank: Some(0),
        generation,
    }
    .encode();
    push.send(&endpoint, &ack).unwrap();
    // ... and then keeps writing into the room's first page, until the decode is gone (it
    // exits once the room's pages were released) or for at most a few seconds.
    let session = rt
        .block_on(plane.open_session(reg.session.as_str()))
        .unwrap();
    let dst = reg.kv_ptrs[0] + page as u64 * layout.item_len;
    let t0 = Instant::now();
    let mut n = 0u8;
    let mut landed = 0;
    while t0.elapsed() < Duration::from_secs(5) {
        n = n.wrapping_add(1);
        src.fill(src.base(), src.len(), n).unwrap();
        let op = TransferOp::new(src.base(), dst, src.len());
        if rt.block_on(session.write_batch(vec![op])).is_err() {
            break;
        }
        landed += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(landed > 0);
    let s = rt.block_on(decode).unwrap().unwrap();
    assert_eq!(
        (s.failed, s.aborted_rooms, s.abort_acked_rooms),
        (1, 1, 1),
        "{s:?}"
    );
    assert_eq!(s.late_writes, 1, "{s:?}");
    inbox.close();
    drop(server);
}
