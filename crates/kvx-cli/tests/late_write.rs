//! The decode's deferred release against misbehaving prefills assembled here from kvx's parts:
//! one acknowledges an ABORT at once and keeps writing into the room's pages afterwards (the
//! decode must hold the pages until the ACK, see them change after it, and count a late write);
//! one never answers the first ABORT (as if it was lost on the way), so the decode must send it
//! again and release on the ACK of the repeat, not on its release timeout.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use kvx_bootstrap::codec::AbortAck;
use kvx_bootstrap::http::BootstrapServer;
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions, zmq};
use kvx_cli::decode::{self, DecodeConfig, Summary};
use kvx_core::{DecodeRegistration, Endpoint, Room, TransferOp, TransferRequest};
use kvx_engine::model::{KvLayout, ModelPreset};
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

/// The decode's registration, then its room's metadata.
fn registration_and_metadata(
    rt: &tokio::runtime::Runtime,
    inbox: &mut Inbox,
) -> (Box<DecodeRegistration>, Box<TransferRequest>) {
    let PrefillInbound::Registration(reg) = recv(rt, inbox) else {
        panic!("no registration first");
    };
    let PrefillInbound::Metadata(req) = recv(rt, inbox) else {
        panic!("no metadata");
    };
    (reg, req)
}

/// The next message, an `ABORT`: (room, the decode's inbox, generation).
fn recv_abort(rt: &tokio::runtime::Runtime, inbox: &mut Inbox) -> (Room, Endpoint, Option<u64>) {
    let PrefillInbound::Abort {
        room,
        endpoint,
        generation,
    } = recv(rt, inbox)
    else {
        panic!("no ABORT");
    };
    (room, endpoint, generation)
}

/// Sends rank 0's ranked `ABORT_ACK` for `room`'s abort `generation` to the decode's inbox
/// through `push` (the caller keeps it open until the decode has read it).
fn acknowledge(push: &mut PushCache, endpoint: &Endpoint, room: Room, generation: Option<u64>) {
    let ack = AbortAck {
        room,
        prefill_rank: Some(0),
        generation,
    }
    .encode();
    push.send(endpoint, &ack).unwrap();
}

/// One prefill rank's inbox registered with a bootstrap server, and a `kvx decode` of one room
/// towards it that never gets the room's KV: its waiting timeout fires and it sends ABORT.
struct Harness {
    rt: tokio::runtime::Runtime,
    ctx: zmq::Context,
    inbox: Inbox,
    layout: KvLayout,
    _server: BootstrapServer,
    decode: tokio::task::JoinHandle<anyhow::Result<Summary>>,
}

impl Harness {
    fn start(abort_release_timeout: Duration) -> Self {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
        let (server, port) = common::bootstrap_server(&rt);
        let ctx = zmq::Context::new();
        let inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Prefill)).unwrap();
        common::register_tiny_rank(&rt, port, 64, inbox.endpoint().port);
        let cfg = DecodeConfig {
            prompt_tokens: (100, 100),
            fragmentation: 0.0,
            waiting_timeout: Duration::from_secs(1),
            abort_release_timeout,
            seed: 3,
            room_base: Some(500),
            ..DecodeConfig::new("127.0.0.1", port, layout.clone())
        };
        let decode = rt.spawn(decode::run(cfg));
        Harness {
            rt,
            ctx,
            inbox,
            layout,
            _server: server,
            decode,
        }
    }
}

#[test]
fn a_write_after_the_abort_ack_is_counted() {
    let Harness {
        rt,
        ctx,
        mut inbox,
        layout,
        _server,
        decode,
    } = Harness::start(Duration::from_secs(10));
    let src = Arc::new(Region::new(layout.item_len as usize));
    let plane = DataPlane::client(Backend::Tcp, "late-writer", 1, vec![src.clone()]).unwrap();

    let (reg, req) = registration_and_metadata(&rt, &mut inbox);
    let page = req.dst.unwrap().kv_pages[0];
    // No KV and no status: the decode's waiting timeout fires and it sends ABORT.
    let (room, endpoint, generation) = recv_abort(&rt, &mut inbox);
    assert_eq!(room, req.room);
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 4);
    acknowledge(&mut push, &endpoint, room, generation);
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
}

#[test]
fn an_unanswered_abort_is_sent_again_and_its_ack_releases_the_pages() {
    let release_timeout = Duration::from_secs(15);
    let Harness {
        rt,
        ctx,
        mut inbox,
        layout: _,
        _server,
        decode,
    } = Harness::start(release_timeout);
    let (_, req) = registration_and_metadata(&rt, &mut inbox);
    // The first ABORT goes unanswered, as if it had been lost on the way.
    let (room, endpoint, generation) = recv_abort(&rt, &mut inbox);
    assert_eq!(room, req.room);
    let first = Instant::now();
    // The decode sends it again, to the same inbox with the same generation (an ACK of the
    // repeat must count for the room's one abort).
    let (again, again_ep, again_gen) = recv_abort(&rt, &mut inbox);
    let gap = first.elapsed();
    assert_eq!((again, &again_ep, again_gen), (room, &endpoint, generation));
    assert!(gap >= Duration::from_millis(500), "resent after {gap:?}");
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 4);
    acknowledge(&mut push, &endpoint, room, generation);
    let s = rt.block_on(decode).unwrap().unwrap();
    // Released on the ACK of the repeat, not by the release timeout.
    assert_eq!(
        (
            s.failed,
            s.aborted_rooms,
            s.abort_acked_rooms,
            s.late_writes
        ),
        (1, 1, 1, 0),
        "{s:?}"
    );
    assert!(first.elapsed() < release_timeout, "{:?}", first.elapsed());
    inbox.close();
}
