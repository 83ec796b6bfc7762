//! The driver against `kvx-staging`'s real decode state machine, every message through the
//! wire codec both ways.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::wire::{self, DecodeInbound, PrefillInbound};
use kvx_core::StagingRingInfo;
use kvx_staging::{DecodeAction, DecodeRoom, DecodeStaging};
use proptest::prelude::*;

const RING_BASE: u64 = 0x10_0000;
const PAGE: u64 = 2;
const BPH: u64 = 8;
const LAYERS: usize = 2;

fn prefill_ep() -> Endpoint {
    Endpoint::new("10.0.0.1", 7000)
}

fn decode_ep() -> Endpoint {
    Endpoint::new("10.0.0.2", 7001)
}

fn session() -> SessionId {
    SessionId::new("10.0.0.2:9000")
}

/// Prefill TP `pt` rank `rank` → decode TP `dt` rank `drank`, 8 KV heads, 2 layers.
fn shape(pt: u32, rank: u32) -> LocalShape {
    LocalShape {
        tp_rank: rank,
        tp_size: pt,
        total_kv_heads: 8,
        page_size: PAGE,
        item_len: PAGE * u64::from(8 / pt) * BPH,
        num_buffers: 2 * LAYERS,
    }
}

fn reg(dt: u32, drank: u32, ring: u64) -> DecodeRegistration {
    DecodeRegistration {
        endpoint: decode_ep(),
        session: session(),
        kv_ptrs: vec![0x1000; 2 * LAYERS],
        aux_ptrs: vec![],
        state_ptrs: vec![],
        dst_tp_rank: drank,
        dst_attn_tp_size: dt,
        dst_kv_item_len: PAGE * u64::from(8 / dt) * BPH,
        state_item_lens: vec![],
        state_dim_per_tensor: vec![],
        kv_layer_ids: vec![],
        state_layer_ids: vec![],
        staging: StagingRingInfo {
            base: Some(RING_BASE),
            size: Some(ring),
        },
        dcp_size: 1,
        dcp_rank: 0,
        staging_slot_layer_ids: None,
        kv_item_lens: None,
    }
}

/// One prefill rank's driver and one decode rank's state machine, wired through the codec.
struct Pair {
    driver: StagingDriver,
    decode: DecodeStaging<Endpoint>,
    layout: StagedLayout,
    posted: Vec<StageWork>,
    done: Vec<(BatchId, Result<(), String>)>,
    failed: Vec<(Room, String)>,
    now: Instant,
}

impl Pair {
    fn new(pt: u32, rank: u32, dt: u32, drank: u32, full: u64, ring: u64) -> Self {
        let geom = TpGeometry::new(8, pt, dt).unwrap();
        let layout = StagedLayout::for_decode(&geom, drank, LAYERS as u32, BPH, PAGE);
        Pair {
            driver: StagingDriver::new(
                shape(pt, rank),
                ChunkGrid::with_pages(full),
                Duration::from_secs(5),
            ),
            decode: DecodeStaging::new(session(), ring),
            layout,
            posted: Vec::new(),
            done: Vec::new(),
            failed: Vec::new(),
            now: Instant::now(),
        }
    }

    fn open(&mut self, room: Room, pages: u64, dt: u32, drank: u32, ring: u64) {
        let grid = RoomGrid::from_pages(self.driver.grid, pages);
        self.decode
            .register_room(
                room,
                DecodeRoom {
                    peers: vec![prefill_ep()],
                    grid,
                    layout: self.layout.clone(),
                },
            )
            .unwrap();
        let mut fx = Vec::new();
        self.driver
            .open(room, &reg(dt, drank, ring), pages as usize, &mut fx);
        self.run(fx);
    }

    /// Performs effects: requests go through the codec to the decode, whose answers come
    /// back through the codec to the driver, until nothing is left.
    fn run(&mut self, mut fx: Vec<Effect>) {
        while !fx.is_empty() {
            let mut next = Vec::new();
            for e in fx {
                match e {
                    Effect::Send(ep, frames) => {
                        assert_eq!(ep, decode_ep());
                        let Ok(DecodeInbound::StagingReq(req)) =
                            wire::parse_decode_inbound(&frames)
                        else {
                            panic!("not a STAGING_REQ");
                        };
                        assert_eq!(req.pp_rank, Some(0));
                        let actions = self.decode.on_staging_req(&req).unwrap();
                        self.answer(actions, &mut next);
                    }
                    Effect::Post(w) => self.posted.push(*w),
                    Effect::Done(b, r) => self.done.push((b, r)),
                    Effect::Fail(room, why) => self.failed.push((room, why)),
                }
            }
            fx = next;
        }
    }

    fn answer(&mut self, actions: Vec<DecodeAction<Endpoint>>, next: &mut Vec<Effect>) {
        for a in actions {
            let frames = match a {
                DecodeAction::Respond { rsp, .. } => wire::encode_staging_rsp(&rsp),
                DecodeAction::Watermark { msg, .. } => wire::encode_watermark(&msg),
                DecodeAction::Scatter(_) => panic!("scatter without CHUNK_READY"),
            };
            match wire::parse_prefill_inbound(&frames).unwrap() {
                PrefillInbound::StagingRsp(rsp) => {
                    self.driver.on_rsp(self.now, &rsp, next).unwrap();
                }
                PrefillInbound::Watermark(wm) => self.driver.on_watermark(self.now, &wm, next),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    fn stage(&mut self, room: Room, batch: u64, start: usize, end: usize, src: &[i32]) {
        let mut fx = Vec::new();
        self.driver.stage(
            self.now,
            room,
            &session(),
            BatchId(batch),
            PageSlice { start, end },
            &src[start..end],
            &mut fx,
        );
        self.run(fx);
    }

    /// The worker wrote a posted chunk: `CHUNK_READY` to the decode (scatter done at once),
    /// completion back to the driver.
    fn write(&mut self, i: usize, rank: u32) {
        let w = self.posted.remove(i);
        let frames = wire::encode_chunk_ready(&w.chunk_ready(rank));
        let Ok(DecodeInbound::ChunkReady(msg)) = wire::parse_decode_inbound(&frames) else {
            panic!("not a CHUNK_READY");
        };
        let mut next = Vec::new();
        for a in self.decode.on_chunk_ready(&msg).unwrap() {
            if let DecodeAction::Scatter(job) = a {
                let more = self
                    .decode
                    .on_scatter_done(job.room, job.chunk_idx)
                    .unwrap();
                self.answer(more, &mut next);
            }
        }
        self.driver.chunk_done(&w.batches, Ok(()), &mut next);
        self.run(next);
    }
}

fn room(r: u64) -> Room {
    Room::new(r).unwrap()
}

fn src(n: usize) -> Vec<i32> {
    (0..n as i32).map(|i| 100 + 3 * i).collect()
}

#[test]
fn unaligned_sends_write_whole_grid_chunks() {
    // TP2 rank 1 → TP1: writer 1 of 2; 10 pages on a 4-page grid: chunks of 4, 4, 2.
    let ring = 1 << 20;
    let mut p = Pair::new(2, 1, 1, 0, 4, ring);
    let r = room(7);
    p.open(r, 10, 1, 0, ring);
    let pages = src(10);
    p.stage(r, 1, 0, 3, &pages);
    assert!(p.posted.is_empty() && p.done.is_empty());
    p.stage(r, 2, 3, 7, &pages);
    // Chunk 0 (pages 0..4) is complete; chunk 1 (4..8) is not.
    assert_eq!(p.posted.len(), 1);
    let w = &p.posted[0];
    assert_eq!((w.key.chunk_idx, w.page_start), (0, 0));
    assert_eq!(w.src_pages, pages[0..4]);
    // Writer 1's block follows writer 0's in the chunk region (placed at ring offset 0).
    assert_eq!(w.dst, RING_BASE + p.layout.writer_offset(1, 4));
    assert_eq!(w.len, p.layout.writer_bytes(1, 4));
    assert_eq!(w.batches, vec![BatchId(1), BatchId(2)]);
    assert_eq!(w.endpoint, decode_ep());
    p.stage(r, 3, 7, 10, &pages);
    assert_eq!(p.posted.len(), 3);
    // Chunk 2 (pages 8..10) sits after two full chunk regions, writer 1's block after
    // writer 0's block of a 2-page chunk.
    let w = &p.posted[2];
    assert_eq!(
        (w.key.chunk_idx, w.page_start, w.src_pages.len()),
        (2, 8, 2)
    );
    assert_eq!(
        w.dst,
        RING_BASE + 2 * p.layout.chunk_bytes(4) + p.layout.writer_offset(1, 2)
    );
    assert_eq!(w.batches, vec![BatchId(3)]);
    assert_eq!(p.posted[1].batches, vec![BatchId(2), BatchId(3)]);
    assert!(p.done.is_empty() && p.failed.is_empty());
}

#[test]
fn every_batch_completes_once_after_its_chunks() {
    let ring = 1 << 20;
    let mut p = Pair::new(2, 0, 1, 0, 4, ring);
    let r = room(8);
    p.open(r, 10, 1, 0, ring);
    let pages = src(10);
    p.stage(r, 1, 0, 3, &pages);
    p.stage(r, 2, 3, 7, &pages);
    p.stage(r, 3, 7, 10, &pages);
    assert_eq!(p.posted.len(), 3);
    assert_eq!(p.posted[0].dst, RING_BASE); // writer 0 at the chunk's offset
    p.write(0, 0);
    assert_eq!(p.done, vec![(BatchId(1), Ok(()))]);
    p.write(0, 0);
    assert_eq!(p.done.len(), 2);
    p.write(0, 0);
    assert_eq!(
        p.done,
        vec![
            (BatchId(1), Ok(())),
            (BatchId(2), Ok(())),
            (BatchId(3), Ok(()))
        ]
    );
    let mut fx = Vec::new();
    p.driver.conclude(r, &mut fx);
    assert!(fx.is_empty());
    assert!(p.driver.is_idle());
    assert!(p.failed.is_empty());
}

/// TP 1 → TP 2 rank 1 (one writer), 4-page grid chunks, a ring of one and a half chunks; room 9
/// of `pages` pages opened, and its source pages.
fn one_and_a_half_chunk_ring(pages: u64) -> (Pair, Room, Vec<i32>) {
    let geom = TpGeometry::new(8, 1, 2).unwrap();
    let chunk = StagedLayout::for_decode(&geom, 1, LAYERS as u32, BPH, PAGE).chunk_bytes(4);
    let ring = chunk * 3 / 2;
    let mut p = Pair::new(1, 0, 2, 1, 4, ring);
    let r = room(9);
    p.open(r, pages, 2, 1, ring);
    (p, r, src(pages as usize))
}

#[test]
fn a_failed_chunk_drops_the_parked_chunks_of_its_batch_at_once() {
    // As `ring_wrap_parks_until_the_watermark`: chunk 1 waits for chunk 0's region.
    let (mut p, r, pages) = one_and_a_half_chunk_ring(12);
    p.stage(r, 1, 0, 8, &pages);
    assert_eq!((p.posted.len(), p.driver.parked_count()), (1, 1));
    // Chunk 0 is lost in transport: the decode will never free its region, so chunk 1 would
    // wait for the wait timeout. Batch 1 completes now, with the error, and chunk 1 is dropped.
    let w = p.posted.remove(0);
    let mut fx = Vec::new();
    p.driver
        .chunk_done(&w.batches, Err("connection reset".into()), &mut fx);
    p.run(fx);
    assert_eq!(p.done, vec![(BatchId(1), Err("connection reset".into()))]);
    assert_eq!(p.driver.parked_since(r), None, "nothing of the room waits");
    assert!(p.posted.is_empty());
    // A later send of the room towards that session is not written; its batch fails too.
    p.stage(r, 2, 8, 12, &pages);
    assert!(p.posted.is_empty());
    assert_eq!(p.done[1], (BatchId(2), Err("connection reset".into())));
    // The manager fails the room; the driver forgets it.
    let mut fx = Vec::new();
    p.driver.conclude(r, &mut fx);
    assert!(fx.is_empty());
    assert!(p.driver.is_idle());
}

#[test]
fn ring_wrap_parks_until_the_watermark() {
    // Chunk 1 wraps to round 1 and may only be written once chunk 0's region is scattered
    // and freed.
    let (mut p, r, pages) = one_and_a_half_chunk_ring(8);
    p.stage(r, 1, 0, 8, &pages);
    assert_eq!(p.posted.len(), 1, "chunk 1 must wait for the watermark");
    assert_eq!(p.driver.parked_count(), 1);
    assert_eq!(p.driver.parked_since(r), Some(p.now));
    assert_eq!(p.driver.parked_since(room(99)), None);
    // The writer sends heads 4..8 of its 8 (decode rank 1's half).
    assert_eq!((p.posted[0].spec.head, p.posted[0].spec.n_heads), (4, 4));
    p.write(0, 0);
    assert_eq!(p.posted.len(), 1);
    assert_eq!(p.posted[0].key.chunk_idx, 1);
    assert_eq!(p.posted[0].dst, RING_BASE);
    assert_eq!(p.driver.parked_count(), 0);
    assert_eq!(p.driver.parked_since(r), None, "posted: no longer parked");
    p.write(0, 0);
    assert_eq!(p.done, vec![(BatchId(1), Ok(()))]);
}

#[test]
fn oversized_fails_the_room_without_blaming_the_session() {
    let mut p = Pair::new(2, 0, 1, 0, 4, 64);
    let r = room(10);
    p.open(r, 6, 1, 0, 64);
    p.stage(r, 1, 0, 6, &src(6));
    assert!(p.posted.is_empty());
    assert_eq!(p.failed.len(), 2, "{:?}", p.failed);
    assert!(p.failed[0].1.contains("does not fit"));
    // The batch completes without error (an error would mark the decode session dead).
    assert_eq!(p.done, vec![(BatchId(1), Ok(()))]);
    p.driver.conclude(r, &mut Vec::new());
    assert!(p.driver.is_idle());
}

#[test]
fn conclude_completes_unposted_batches_and_expiry_fails_parked_rooms() {
    let geom = TpGeometry::new(8, 1, 2).unwrap();
    let chunk = StagedLayout::for_decode(&geom, 0, LAYERS as u32, BPH, PAGE).chunk_bytes(4);
    let ring = chunk * 3 / 2;
    let mut p = Pair::new(1, 0, 2, 0, 4, ring);
    let r = room(11);
    p.open(r, 12, 2, 0, ring);
    let pages = src(12);
    p.stage(r, 1, 0, 6, &pages); // chunk 0 posted, chunk 1 half assembled
    p.stage(r, 2, 6, 8, &pages); // chunk 1 complete, parked (round 1)
    assert_eq!((p.posted.len(), p.driver.parked_count()), (1, 1));
    let mut fx = Vec::new();
    p.driver.expire(p.now + Duration::from_secs(1), &mut fx);
    assert!(fx.is_empty());
    p.driver.expire(p.now + Duration::from_secs(6), &mut fx);
    assert!(matches!(&fx[..], [Effect::Fail(x, why)] if *x == r && why.contains("no ring space")));
    // The room concludes with chunk 0 still posted: batch 2 (only chunk 1) completes now,
    // batch 1 when the worker reports chunk 0.
    let mut fx = Vec::new();
    p.driver.conclude(r, &mut fx);
    assert!(
        matches!(&fx[..], [Effect::Done(BatchId(2), Ok(()))]),
        "{fx:?}"
    );
    let w = p.posted.remove(0);
    let mut fx = Vec::new();
    p.driver
        .chunk_done(&w.batches, Err("peer lost".into()), &mut fx);
    assert!(matches!(&fx[..], [Effect::Done(BatchId(1), Err(e))] if e == "peer lost"));
    assert!(p.driver.is_idle());
}

#[test]
fn unusable_registrations_fail_the_room() {
    let mut d = StagingDriver::new(
        shape(2, 0),
        ChunkGrid::with_pages(4),
        Duration::from_secs(1),
    );
    let mut fx = Vec::new();
    let mut no_ring = reg(1, 0, 1 << 20);
    no_ring.staging.size = None;
    d.open(room(1), &no_ring, 8, &mut fx);
    let mut bad_tp = reg(3, 0, 1 << 20);
    bad_tp.dst_attn_tp_size = 3;
    d.open(room(2), &bad_tp, 8, &mut fx);
    assert!(matches!(&fx[..], [Effect::Fail(_, a), Effect::Fail(_, b)]
        if a.contains("no complete staging ring") && b.contains("TP")));
    // A stage for a room never opened fails it and completes the batch.
    let mut fx = Vec::new();
    d.stage(
        Instant::now(),
        room(1),
        &session(),
        BatchId(4),
        PageSlice { start: 0, end: 2 },
        &[1, 2],
        &mut fx,
    );
    assert!(matches!(
        &fx[..],
        [Effect::Fail(..), Effect::Done(BatchId(4), Ok(()))]
    ));
    assert!(d.is_idle());
}

proptest! {
    /// However a room's pages are cut into sends, every grid chunk is posted exactly once with
    /// its pages in order, and every batch completes exactly once, after its last chunk.
    #[test]
    fn any_send_cuts(pages in 1usize..40, full in 1u64..9, cuts in proptest::collection::vec(1usize..12, 1..12)) {
        let ring = 1 << 24;
        let mut p = Pair::new(2, 1, 1, 0, full, ring);
        let r = room(12);
        p.open(r, pages as u64, 1, 0, ring);
        let src = src(pages);
        let mut start = 0;
        let mut batch = 0;
        let mut cuts = cuts.into_iter().cycle();
        while start < pages {
            let end = (start + cuts.next().unwrap_or(1)).min(pages);
            batch += 1;
            p.stage(r, batch, start, end, &src);
            start = end;
        }
        let chunks = pages.div_ceil(full as usize);
        prop_assert_eq!(p.posted.len(), chunks);
        let mut all: Vec<i32> = Vec::new();
        let mut posted = p.posted.clone();
        posted.sort_by_key(|w| w.key.chunk_idx);
        for w in &posted {
            all.extend(&w.src_pages);
        }
        prop_assert_eq!(all, src);
        while !p.posted.is_empty() {
            p.write(0, 1);
        }
        let mut ids: Vec<u64> = p.done.iter().map(|(b, _)| b.0).collect();
        ids.sort_unstable();
        prop_assert_eq!(ids, (1..=batch).collect::<Vec<_>>());
        prop_assert!(p.done.iter().all(|(_, r)| r.is_ok()));
        p.driver.conclude(r, &mut Vec::new());
        prop_assert!(p.driver.is_idle());
    }
}
