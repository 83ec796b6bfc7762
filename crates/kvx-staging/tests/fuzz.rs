//! Arbitrary messages (as a peer or the network could send them) fed to both state machines:
//! nothing panics, every refusal is a typed error, and the ring's accounting stays consistent.
#![allow(clippy::unwrap_used)]

use kvx_core::{Room, SessionId};
use kvx_staging::{
    ChunkGrid, ChunkReady, DecodeRoom, DecodeStaging, Placement, PrefillStaging, RoomGrid,
    RspPlacement, StagedLayout, StagingReq, StagingRsp, TpGeometry, Watermark, WatermarkMsg,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Msg {
    Req(u64, u32, u64, bool, Option<u32>),
    Ready(u64, u32, u64, u64, Option<u32>),
    Done(u64, u32),
    Release(u64),
    Abort(u64),
    Quiesce(u64, u8),
    Rsp(u64, u32, i64, i64, i64),
    Wm(i64, u64),
    Poll(u64, u32),
    Conclude(u64),
}

fn msg() -> impl Strategy<Value = Msg> {
    let room = 1u64..6;
    prop_oneof![
        (
            room.clone(),
            0u32..6,
            prop_oneof![0u64..12, any::<u64>()],
            any::<bool>(),
            any::<Option<u32>>()
        )
            .prop_map(|(r, c, p, s, pp)| Msg::Req(r, c, p, s, pp)),
        (
            room.clone(),
            0u32..6,
            0u64..24,
            prop_oneof![0u64..12, any::<u64>()],
            any::<Option<u32>>()
        )
            .prop_map(|(r, c, s, n, k)| Msg::Ready(r, c, s, n, k)),
        (room.clone(), 0u32..6).prop_map(|(r, c)| Msg::Done(r, c)),
        room.clone().prop_map(Msg::Release),
        room.clone().prop_map(Msg::Abort),
        (room.clone(), 0u8..3).prop_map(|(r, p)| Msg::Quiesce(r, p)),
        (
            room.clone(),
            0u32..6,
            any::<i64>(),
            any::<i64>(),
            any::<i64>()
        )
            .prop_map(|(r, c, o, ro, e)| Msg::Rsp(r, c, o, ro, e)),
        (any::<i64>(), any::<u64>()).prop_map(|(r, t)| Msg::Wm(r, t)),
        (room.clone(), 0u32..6).prop_map(|(r, c)| Msg::Poll(r, c)),
        room.prop_map(Msg::Conclude),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn arbitrary_messages_never_panic(
        ring in 0u64..200,
        full in 1u64..5,
        msgs in prop::collection::vec(msg(), 0..120),
    ) {
        let s = SessionId::new("10.0.0.2:1");
        let other = SessionId::new("10.0.0.3:1");
        let geom = TpGeometry::new(4, 2, 1).unwrap();
        let mut d: DecodeStaging<u8> = DecodeStaging::new(s.clone(), ring);
        let mut p = PrefillStaging::new();
        for r in 1..6u64 {
            let grid = RoomGrid::from_pages(ChunkGrid::with_pages(full), r * 3);
            let layout = StagedLayout::for_decode(&geom, 0, 2, 2, 1);
            let room = Room::new(r).unwrap();
            d.register_room(room, DecodeRoom { peers: vec![0, 1], grid, layout }).unwrap();
            p.prefetch(room, &s, &grid, None).unwrap();
        }
        for m in msgs {
            let room = |r: u64| Room::new(r).unwrap();
            let sess = |ok: bool| if ok { s.clone() } else { other.clone() };
            match m {
                Msg::Req(r, c, pages, ok, pp) => {
                    let _ = d.on_staging_req(&StagingReq { room: room(r), chunk_idx: c, chunk_pages: pages, session: sess(ok), pp_rank: pp });
                }
                Msg::Ready(r, c, start, n, k) => {
                    let _ = d.on_chunk_ready(&ChunkReady { room: room(r), chunk_idx: c, page_start: start, num_pages: n, session: s.clone(), prefill_unique_rank: k });
                }
                Msg::Done(r, c) => {
                    let _ = d.on_scatter_done(room(r), c);
                }
                Msg::Release(r) => {
                    d.release_room(room(r));
                }
                Msg::Abort(r) => {
                    d.abort_room(room(r));
                }
                Msg::Quiesce(r, peer) => {
                    d.on_prefill_quiesced(room(r), &peer);
                }
                Msg::Rsp(r, c, o, ro, e) => {
                    if let Some(placement) = RspPlacement::from_wire(o, ro, e) {
                        let _ = p.on_staging_rsp(&StagingRsp { room: room(r), chunk_idx: c, placement, session: s.clone() });
                    }
                }
                Msg::Wm(r, t) => {
                    if let Some(watermark) = Watermark::from_wire(r, t) {
                        p.on_watermark(&WatermarkMsg { watermark, session: s.clone() });
                    }
                }
                Msg::Poll(r, c) => {
                    let _ = p.poll(&kvx_staging::ChunkKey { room: room(r), chunk_idx: c, session: s.clone() });
                }
                Msg::Conclude(r) => p.conclude_room(room(r)),
            }
            // Ring accounting: live allocations lie inside the ring; same-round ones are disjoint.
            let live: Vec<Placement> = d.ring().live().map(|(_, pl)| pl).collect();
            for (i, a) in live.iter().enumerate() {
                prop_assert!(a.end <= ring);
                for b in &live[i + 1..] {
                    prop_assert!(a.round != b.round || !a.overlaps(b) || a.is_empty() || b.is_empty());
                }
            }
        }
        for r in 1..6u64 {
            let room = Room::new(r).unwrap();
            d.abort_room(room);
            d.release_fenced(room);
            p.conclude_room(room);
        }
        prop_assert_eq!(d.live_allocations(), 0);
        prop_assert_eq!((d.room_count(), d.subscriber_count(), d.fenced_count()), (0, 0, 0));
        prop_assert!(p.is_idle());
    }
}
