//! Unit tests of the decode-side staging state machine.
use super::*;
use crate::grid::ChunkGrid;
use crate::heads::TpGeometry;

fn setup(ring: u64) -> (DecodeStaging<u8>, Room, SessionId) {
    let s = SessionId::new("d:1");
    let mut d = DecodeStaging::new(s.clone(), ring);
    let geom = TpGeometry::new(2, 2, 1).unwrap();
    let room = Room::new(9).unwrap();
    d.register_room(
        room,
        DecodeRoom {
            peers: vec![1, 0],
            grid: RoomGrid::from_pages(ChunkGrid::with_pages(4), 6),
            layout: StagedLayout::for_decode(&geom, 0, 1, 1, 1),
        },
    )
    .unwrap();
    (d, room, s)
}

fn req(room: Room, chunk_idx: u32, chunk_pages: u64, s: &SessionId) -> StagingReq {
    StagingReq {
        room,
        chunk_idx,
        chunk_pages,
        session: s.clone(),
        pp_rank: None,
    }
}

fn ready(
    room: Room,
    chunk_idx: u32,
    page_start: u64,
    num_pages: u64,
    s: &SessionId,
    rank: u32,
) -> ChunkReady {
    ChunkReady {
        room,
        chunk_idx,
        page_start,
        num_pages,
        session: s.clone(),
        prefill_unique_rank: Some(rank),
    }
}

#[test]
fn one_allocation_per_chunk_and_one_scatter() {
    let (mut d, room, s) = setup(64);
    let a = d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    // Response to every prefill rank of the room, then the current watermark (subscribe).
    assert_eq!(a.len(), 2);
    let DecodeAction::Respond { to, rsp, .. } = &a[0] else {
        panic!("{a:?}")
    };
    assert_eq!(to, &vec![1, 0]);
    // 2 writers x 1 head x 4 tokens x 2 (K, V) x 1 layer x 1 byte.
    assert_eq!(
        rsp.placement,
        RspPlacement::At(Placement {
            offset: 0,
            round: 0,
            end: 16
        })
    );
    assert!(
        matches!(&a[1], DecodeAction::Watermark { msg, .. } if msg.watermark == Watermark::default())
    );
    // The second writer's request reuses the allocation; no second subscription.
    let b = d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(d.live_allocations(), 1);
    assert_eq!(d.subscriber_count(), 1);

    assert!(
        d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 0))
            .unwrap()
            .is_empty()
    );
    assert!(
        d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 0))
            .unwrap()
            .is_empty()
    );
    let job = d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 1)).unwrap();
    assert!(
        matches!(&job[..], [DecodeAction::Scatter(j)] if j.num_pages == 4 && j.page_start == 0)
    );
    assert!(
        d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 1))
            .unwrap()
            .is_empty()
    );
    assert!(!d.room_drained(room));
    let wm = d.on_scatter_done(room, 0).unwrap();
    assert!(matches!(&wm[..], [DecodeAction::Watermark { to, msg }]
        if to == &vec![0, 1] && msg.watermark == Watermark { round: 1, tail: 0 }));
    assert!(d.room_drained(room));
    // A late duplicate request for the scattered chunk is ignored.
    assert!(d.on_staging_req(&req(room, 0, 4, &s)).unwrap().is_empty());
    assert_eq!(
        d.on_scatter_done(room, 0),
        Err(DecodeError::ChunkNotAllocated { room, chunk_idx: 0 })
    );
}

#[test]
fn pipeline_stages_multiply_the_reports() {
    let s = SessionId::new("d:1");
    let mut d: DecodeStaging<u8> = DecodeStaging::new(s.clone(), 64);
    let room = Room::new(3).unwrap();
    let mut cfg = d_cfg();
    cfg.layout = cfg.layout.with_pp_writers(2);
    d.register_room(room, cfg).unwrap();
    d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    for rank in 0..3 {
        assert!(
            d.on_chunk_ready(&ready(room, 0, 0, 4, &s, rank))
                .unwrap()
                .is_empty()
        );
    }
    assert_eq!(
        d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 3))
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn arrivals_without_rank_each_count() {
    let (mut d, room, s) = setup(64);
    d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    let anon = ChunkReady {
        prefill_unique_rank: None,
        ..ready(room, 0, 0, 4, &s, 0)
    };
    assert!(d.on_chunk_ready(&anon).unwrap().is_empty());
    assert_eq!(d.on_chunk_ready(&anon).unwrap().len(), 1);
}

#[test]
fn grid_and_session_are_checked() {
    let (mut d, room, s) = setup(64);
    assert!(matches!(
        d.on_staging_req(&req(room, 1, 4, &s)),
        Err(DecodeError::ChunkMismatch {
            expected: 2,
            got: 4,
            ..
        })
    ));
    assert!(matches!(
        d.on_staging_req(&req(room, 2, 1, &s)),
        Err(DecodeError::ChunkOutOfGrid { chunks: 2, .. })
    ));
    let other = SessionId::new("d:2");
    assert!(matches!(
        d.on_staging_req(&req(room, 0, 4, &other)),
        Err(DecodeError::WrongSession { .. })
    ));
    let unknown = Room::new(10).unwrap();
    assert_eq!(
        d.on_staging_req(&req(unknown, 0, 4, &s)),
        Err(DecodeError::UnknownRoom(unknown))
    );
    d.on_staging_req(&req(room, 1, 2, &s)).unwrap();
    assert!(matches!(
        d.on_chunk_ready(&ready(room, 1, 3, 2, &s, 0)),
        Err(DecodeError::ChunkMismatch { .. })
    ));
    assert!(matches!(
        d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 0)),
        Err(DecodeError::ChunkNotAllocated { .. })
    ));
    assert!(matches!(
        d.on_scatter_done(room, 1),
        Err(DecodeError::NotScattering { .. })
    ));
    assert_eq!(
        d.register_room(room, d.rooms[&room].cfg.clone()),
        Err(DecodeError::RoomExists(room))
    );
}

#[test]
fn release_frees_everything_and_unsubscribes() {
    let (mut d, room, s) = setup(20);
    d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    d.on_staging_req(&req(room, 1, 2, &s)).unwrap();
    assert_eq!(d.live_allocations(), 2);
    // Chunk 1 wrapped to round 1; releasing empties the ring, which restarts in round 2.
    // No subscribed room is left, so no watermark is sent (a new subscriber gets it).
    assert!(d.release_room(room).is_empty());
    assert_eq!(d.ring().watermark(), Watermark { round: 2, tail: 0 });
    assert_eq!(
        (d.room_count(), d.subscriber_count(), d.live_allocations()),
        (0, 0, 0)
    );
    assert!(d.release_room(room).is_empty());
}

#[test]
fn abort_fences_regions_until_every_prefill_rank_confirms() {
    let (mut d, room, s) = setup(64);
    d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    d.on_staging_req(&req(room, 1, 2, &s)).unwrap();
    // Both writers reported chunk 0; only one reported chunk 1.
    d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 0)).unwrap();
    d.on_chunk_ready(&ready(room, 0, 0, 4, &s, 1)).unwrap();
    d.on_chunk_ready(&ready(room, 1, 4, 2, &s, 1)).unwrap();
    assert!(d.abort_room(room).is_empty());
    assert_eq!(d.fenced_chunks(room), vec![1]);
    assert_eq!(d.live_allocations(), 1);
    assert_eq!((d.room_count(), d.subscriber_count()), (0, 0));
    assert_eq!(
        d.register_room(room, d_cfg()),
        Err(DecodeError::RoomExists(room))
    );
    assert!(d.on_prefill_quiesced(room, &1).is_empty());
    assert_eq!(d.live_allocations(), 1);
    d.on_prefill_quiesced(room, &0);
    assert_eq!((d.live_allocations(), d.fenced_count()), (0, 0));
    assert_eq!(d.ring().watermark(), Watermark { round: 1, tail: 0 });
    assert!(d.on_prefill_quiesced(room, &0).is_empty());
    // The driver's deadline path.
    let (mut d, room, s) = setup(64);
    d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    d.abort_room(room);
    assert_eq!(d.fenced_count(), 1);
    d.release_fenced(room);
    assert_eq!((d.live_allocations(), d.fenced_count()), (0, 0));
}

fn d_cfg() -> DecodeRoom<u8> {
    DecodeRoom {
        peers: vec![0],
        grid: RoomGrid::from_pages(ChunkGrid::with_pages(4), 6),
        layout: StagedLayout::for_decode(&TpGeometry::new(2, 2, 1).unwrap(), 0, 1, 1, 1),
    }
}

#[test]
fn oversized_is_remembered() {
    let (mut d, room, s) = setup(8);
    let a = d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    assert!(
        matches!(&a[0], DecodeAction::Respond { rsp, .. } if rsp.placement == RspPlacement::Oversized)
    );
    let a = d.on_staging_req(&req(room, 0, 4, &s)).unwrap();
    assert!(
        matches!(&a[0], DecodeAction::Respond { rsp, .. } if rsp.placement == RspPlacement::Oversized)
    );
    assert!(d.room_oversized(room));
    assert!(d.room_drained(room));
}
