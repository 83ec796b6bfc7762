//! Prefill manager tests: the sglang flows, failure rules, and random event sequences that must
//! never lower a status nor leak a per-room entry.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::layout::{AuxLayout, KvLayout};
use crate::peer::Destination;
use crate::planner::{BatchLimits, PlanError};
use crate::{Chunk, PageSlice, TransferOp};

const KP: u64 = 0x7f00_0000_0000;
const KD: u64 = 0x7e00_0000_0000;
const AUX_P: u64 = 0x6f00_0000_0000;
const AUX_D: u64 = 0x6e00_0000_0000;

fn local() -> LocalMemory {
    let aux_ptrs: Vec<u64> = (0..10).map(|i| AUX_P + (i << 20)).collect();
    LocalMemory {
        kv: KvLayout::mha_contiguous(KP, 2, 2048, 64, 1),
        aux: AuxLayout::sglang_default(&aux_ptrs, Some(16)).unwrap(),
        state: Vec::new(),
    }
}

fn session(n: u16) -> SessionId {
    SessionId::new(format!("10.0.0.{n}:{}", 15000 + n))
}

fn endpoint(n: u16) -> Endpoint {
    Endpoint::new(format!("10.0.0.{n}"), 41000 + n)
}

fn registration(n: u16, tp_size: u32) -> DecodeRegistration {
    let kv = KvLayout::mha_contiguous(KD + (u64::from(n) << 32), 2, 2048, 64, 1);
    DecodeRegistration {
        dst_attn_tp_size: tp_size,
        ..DecodeRegistration::plain(
            endpoint(n),
            session(n),
            kv.buffers.iter().map(|b| b.addr).collect(),
            (0..10)
                .map(|i| AUX_D + (u64::from(n) << 32) + (i << 20))
                .collect(),
            2048,
        )
    }
}

/// A registration as sglang 0.5.23 sends it: 20 frames, frame 19 the per-buffer item lengths.
fn registration_0523(n: u16, tp_size: u32) -> DecodeRegistration {
    DecodeRegistration {
        kv_item_lens: Some(vec![2048, 2048]),
        staging_slot_layer_ids: Some(Vec::new()),
        ..registration(n, tp_size)
    }
}

fn metadata(room: Room, n: u16, pages: Option<Vec<i32>>, required: u32) -> TransferRequest {
    TransferRequest {
        room,
        endpoint: endpoint(n),
        session: session(n),
        dst: pages.map(|kv_pages| Destination {
            kv_pages,
            aux_index: 7,
            state_indices: Vec::new(),
        }),
        required_dst_info_num: required,
        decode_prefix_len: Some(0),
        device_kv_pages: Vec::new(),
    }
}

struct Harness {
    mgr: PrefillManager,
    now: Instant,
    out: Vec<PrefillAction>,
}

impl Harness {
    fn new(cfg: PrefillConfig) -> Self {
        Harness {
            mgr: PrefillManager::new(cfg, local()),
            now: Instant::now(),
            out: Vec::new(),
        }
    }

    fn ev(&mut self, e: PrefillEvent) -> Vec<PrefillAction> {
        self.out.clear();
        self.mgr.handle(self.now, e, &mut self.out).unwrap();
        std::mem::take(&mut self.out)
    }

    /// Registers session 2, opens `room` with metadata for one destination page, and sends
    /// its only chunk (source page `src_page`, last); returns the chunk's actions.
    fn one_page_room(&mut self, room: Room, src_page: i32) -> Vec<PrefillAction> {
        self.ev(PrefillEvent::Register(registration(2, 1)));
        self.open(room);
        self.ev(PrefillEvent::Metadata(metadata(room, 2, Some(vec![1]), 1)));
        self.ev(PrefillEvent::Chunk {
            room,
            chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![src_page]).last(),
        })
    }

    fn open(&mut self, room: Room) {
        self.ev(PrefillEvent::SenderCreated { room });
        self.ev(PrefillEvent::SenderInit {
            room,
            num_pages: 4,
            aux_row: 3,
        });
    }
}

fn room(n: u64) -> Room {
    Room::new(n).unwrap()
}

fn batches(actions: &[PrefillAction]) -> Vec<(BatchId, Vec<TransferOp>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            PrefillAction::PostBatch { batch_id, ops, .. } => Some((*batch_id, ops.clone())),
            _ => None,
        })
        .collect()
}

fn statuses(actions: &[PrefillAction]) -> Vec<(Endpoint, KVPoll)> {
    actions
        .iter()
        .filter_map(|a| match a {
            PrefillAction::SendStatus {
                endpoint, status, ..
            } => Some((endpoint.clone(), *status)),
            _ => None,
        })
        .collect()
}

fn done(id: BatchId) -> PrefillEvent {
    PrefillEvent::BatchDone {
        batch_id: id,
        result: Ok(()),
    }
}

#[test]
fn happy_path_two_chunks() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(1_234_567_890_123_456_789);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.open(r);
    assert_eq!(h.mgr.poll(r), Some(KVPoll::Bootstrapping));
    h.ev(PrefillEvent::Metadata(metadata(
        r,
        2,
        Some(vec![5, 6, 7, 9]),
        1,
    )));
    assert_eq!(h.mgr.poll(r), Some(KVPoll::WaitingForInput));

    let chunk = Chunk::new(PageSlice::new(0, 4).unwrap(), vec![10, 11, 12, 40]);
    let a = h.ev(PrefillEvent::Chunk { room: r, chunk });
    let b = batches(&a);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].1.len(), 8);
    assert_eq!(
        b[0].1[0],
        TransferOp::new(KP + 20480, (KD + (2 << 32)) + 10240, 6144)
    );
    assert!(matches!(
        a[0],
        PrefillAction::PostBatch {
            path: TransferPath::EqualTp,
            ..
        }
    ));

    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::empty_last(4),
    });
    // Room row first, then the aux batch (10 rows, coalescing cannot merge distinct buffers).
    assert_eq!(
        a[0],
        PrefillAction::FillRoomRow {
            room: r,
            addr: AUX_P + (9 << 20) + 3 * 64,
            len: 64
        }
    );
    let aux = batches(&a);
    assert_eq!(aux.len(), 1);
    assert_eq!(aux[0].1.len(), 10);
    assert_eq!(aux[0].1[9].dst, AUX_D + (2 << 32) + (9 << 20) + 7 * 64);

    assert!(statuses(&h.ev(done(b[0].0))).is_empty());
    assert_eq!(h.mgr.poll(r), Some(KVPoll::WaitingForInput));
    let a = h.ev(done(aux[0].0));
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Success)]);
    assert!(matches!(
        a.last(),
        Some(PrefillAction::Concluded {
            status: KVPoll::Success,
            ..
        })
    ));
    assert!(h.mgr.live_entries().is_empty());
    assert_eq!(h.mgr.poll(r), None);
}

#[test]
fn metadata_before_sender_and_fan_in() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(9);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.ev(PrefillEvent::Register(registration(3, 2)));
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 2)));
    assert_eq!(h.mgr.poll(r), Some(KVPoll::Bootstrapping));
    h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![1]), 2)));
    assert_eq!(h.mgr.poll(r), Some(KVPoll::WaitingForInput));
    h.open(r);
    // Sender creation (Bootstrapping) cannot lower the state.
    assert_eq!(h.mgr.poll(r), Some(KVPoll::WaitingForInput));
    assert_eq!(h.mgr.decode_prefix_len(r), Some(0));
}

#[test]
fn dummy_destinations_succeed_silently() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(5);
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 4, None, 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 2).unwrap(), vec![1, 2]).last(),
    });
    assert!(batches(&a).is_empty() && statuses(&a).is_empty());
    assert!(matches!(
        a.as_slice(),
        [PrefillAction::Concluded {
            status: KVPoll::Success,
            ..
        }]
    ));
    assert!(h.mgr.live_entries().is_empty());
}

#[test]
fn write_failure_fails_room_notifies_all_and_marks_session() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(77);
    for n in [2, 3] {
        h.ev(PrefillEvent::Register(registration(n, 1)));
    }
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1, 2]), 3)));
    h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![4, 5]), 3)));
    h.ev(PrefillEvent::Metadata(metadata(r, 9, None, 3)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 2).unwrap(), vec![8, 9]).last(),
    });
    let b = batches(&a);
    assert_eq!(b.len(), 2);
    let a = h.ev(PrefillEvent::BatchDone {
        batch_id: b[0].0,
        result: Err("remote key rejected".into()),
    });
    // Nobody is told while the second batch may still write.
    assert!(statuses(&a).is_empty());
    let reason = h.mgr.failure(r).unwrap().to_string();
    assert!(
        reason.contains("Failed to send kv chunk of 77") && reason.contains("remote key rejected")
    );
    assert_eq!(h.mgr.poll(r), Some(KVPoll::Failed));
    assert!(h.mgr.session_failed(&session(2), h.now));
    // The second batch drains: every real decode is told once, then the room is released.
    let a = h.ev(done(b[1].0));
    assert_eq!(
        statuses(&a),
        vec![(endpoint(2), KVPoll::Failed), (endpoint(3), KVPoll::Failed)]
    );
    assert!(h.mgr.live_entries().is_empty());

    // Another room towards the failed session fails at once, without a write.
    let r2 = room(78);
    h.open(r2);
    h.ev(PrefillEvent::Metadata(metadata(r2, 2, Some(vec![1]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r2,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]).last(),
    });
    assert!(batches(&a).is_empty());
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    // Re-registration clears the mark; the TTL would too.
    h.ev(PrefillEvent::Register(registration(2, 1)));
    assert!(!h.mgr.session_failed(&session(2), h.now));
}

#[test]
fn failed_session_mark_expires() {
    let cfg = PrefillConfig {
        failed_session_ttl: Duration::from_secs(10),
        ..PrefillConfig::default()
    };
    let mut h = Harness::new(cfg);
    let r = room(3);
    let a = h.one_page_room(r, 1);
    h.ev(PrefillEvent::BatchDone {
        batch_id: batches(&a)[0].0,
        result: Err("x".into()),
    });
    assert!(h.mgr.session_failed(&session(2), h.now));
    h.now += Duration::from_secs(10);
    assert!(!h.mgr.session_failed(&session(2), h.now));
    h.ev(PrefillEvent::Tick);
    assert!(h.mgr.failed.is_empty());
}

#[test]
fn bootstrap_timeout() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(11);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 2)));
    h.now += Duration::from_secs(299);
    assert!(h.ev(PrefillEvent::Tick).is_empty());
    h.now += Duration::from_secs(1);
    let a = h.ev(PrefillEvent::Tick);
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    let Some(PrefillAction::Concluded {
        reason: Some(reason),
        ..
    }) = a.last()
    else {
        panic!("expected a conclusion");
    };
    assert_eq!(
        reason.to_string(),
        "Request 11 timed out after 300.0s in KVPoll.Bootstrapping"
    );
    assert!(h.mgr.live_entries().is_empty());
}

#[test]
fn abort_ack_waits_for_drain() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(21);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1, 2]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]),
    });
    let b = batches(&a);
    let a = h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(2),
        generation: None,
    });
    assert!(
        !a.iter()
            .any(|x| matches!(x, PrefillAction::AbortAck { .. }))
    );
    assert!(statuses(&a).is_empty());
    assert_eq!(h.mgr.poll(r), Some(KVPoll::Failed));
    assert_eq!(h.mgr.live_entries().pending_acks, 1);
    let a = h.ev(done(b[0].0));
    assert_eq!(
        a,
        vec![PrefillAction::AbortAck {
            room: r,
            endpoint: endpoint(2),
            prefill_rank: 0,
            generation: None,
        }]
    );
    assert!(h.mgr.live_entries().is_empty());
    // Unknown rooms are acked at once.
    let a = h.ev(PrefillEvent::Abort {
        room: room(999),
        endpoint: endpoint(2),
        generation: None,
    });
    assert!(matches!(
        a.as_slice(),
        [PrefillAction::AbortAck {
            generation: None,
            ..
        }]
    ));
}

/// TP fan-out: one decode rank ABORTs the room; the other one is told Failed once the room drained
/// (not left to its waiting timeout), and the aborting one gets only its ACK.
#[test]
fn abort_from_one_decode_tells_the_others_failed_after_drain() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(23);
    h.ev(PrefillEvent::Register(registration(2, 2)));
    h.ev(PrefillEvent::Register(registration(3, 2)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 2)));
    h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![1]), 2)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]),
    });
    let b = batches(&a);
    assert!(b.len() >= 2, "{a:?}");
    let a = h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(2),
        generation: None,
    });
    assert!(statuses(&a).is_empty() && acks(&a).is_empty(), "{a:?}");
    let mut out = Vec::new();
    for (id, _) in b {
        out.extend(h.ev(done(id)));
    }
    assert_eq!(statuses(&out), vec![(endpoint(3), KVPoll::Failed)]);
    assert_eq!(acks(&out), vec![(endpoint(2), None)]);
    assert!(h.mgr.live_entries().is_empty());
}

/// Metadata that reaches the rank after the room concluded (a restarted or slow decode) gets
/// status 0 at once, whether the room is still held (draining) or already dropped; nothing was
/// planned towards that decode.
#[test]
fn late_metadata_is_answered_failed_at_once() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(24);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.ev(PrefillEvent::Register(registration(3, 1)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]),
    });
    let b = batches(&a);
    h.ev(PrefillEvent::SenderFailed {
        room: r,
        reason: "forward pass failed".into(),
    });
    // Held (its batch in flight): the late decode is told now, the first one after the drain.
    let a = h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![5]), 1)));
    assert_eq!(statuses(&a), vec![(endpoint(3), KVPoll::Failed)]);
    assert!(batches(&a).is_empty());
    let a = h.ev(done(b[0].0));
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    assert!(h.mgr.live_entries().is_empty());
    // Dropped: remembered, answered at once, not held as a new room waiting for its sender.
    let a = h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![5]), 1)));
    assert_eq!(statuses(&a), vec![(endpoint(3), KVPoll::Failed)]);
    assert_eq!(h.mgr.poll(r), None);
    let live = h.mgr.live_entries();
    assert!(live.is_empty() && live.recent_rooms == 1, "{live:?}");
}

fn acks(actions: &[PrefillAction]) -> Vec<(Endpoint, Option<u64>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            PrefillAction::AbortAck {
                endpoint,
                generation,
                ..
            } => Some((endpoint.clone(), *generation)),
            _ => None,
        })
        .collect()
}

/// sglang 0.5.23's 5-frame ABORT: the ACK echoes the generation of the endpoint's latest ABORT
/// and goes out only once the room's writes drained, once.
#[test]
fn generational_abort_is_acked_with_its_generation_after_drain() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(22);
    h.ev(PrefillEvent::Register(registration_0523(2, 1)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1, 2]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]),
    });
    let b = batches(&a);
    assert_eq!(b.len(), 1);
    for generation in [7, 9] {
        let a = h.ev(PrefillEvent::Abort {
            room: r,
            endpoint: endpoint(2),
            generation: Some(generation),
        });
        assert!(acks(&a).is_empty(), "no ACK while a batch is in flight");
        assert!(statuses(&a).is_empty());
    }
    assert_eq!(h.mgr.live_entries().pending_acks, 1);
    let a = h.ev(done(b[0].0));
    assert_eq!(acks(&a), vec![(endpoint(2), Some(9))]);
    assert!(h.mgr.live_entries().is_empty());
    // A drained or unknown room is acked at once, with the generation.
    let a = h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(2),
        generation: Some(10),
    });
    assert_eq!(acks(&a), vec![(endpoint(2), Some(10))]);
}

/// Two decodes of one room abort it, one of each generation: each gets its own form.
#[test]
fn mixed_aborts_of_one_room_get_their_own_ack_forms() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(23);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.ev(PrefillEvent::Register(registration_0523(3, 1)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 2)));
    h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![1]), 2)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]),
    });
    let b = batches(&a);
    assert!(!b.is_empty());
    h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(2),
        generation: None,
    });
    h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(3),
        generation: Some(4),
    });
    let mut got = Vec::new();
    for (id, _) in b {
        got.extend(acks(&h.ev(done(id))));
    }
    assert_eq!(got, vec![(endpoint(2), None), (endpoint(3), Some(4))]);
}

fn reason_frames(actions: &[PrefillAction]) -> Vec<(Endpoint, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            PrefillAction::SendStatus {
                endpoint,
                with_reason,
                ..
            } => Some((endpoint.clone(), *with_reason)),
            _ => None,
        })
        .collect()
}

/// The failure reason goes as a 4th status frame only to a decode whose registration had
/// frame 19 (sglang 0.5.23); a sglang main decode gets 3 frames. Success is 3 frames for both.
#[test]
fn reason_frame_only_to_decodes_that_accept_it() {
    let mut h = Harness::new(PrefillConfig::default());
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.ev(PrefillEvent::Register(registration_0523(3, 1)));
    assert!(!h.mgr.accepts_status_reason(&session(2)));
    assert!(h.mgr.accepts_status_reason(&session(3)));
    let r = room(24);
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 2)));
    h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![1]), 2)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]).last(),
    });
    let b = batches(&a);
    let mut a = h.ev(PrefillEvent::BatchDone {
        batch_id: b[0].0,
        result: Err("injected".into()),
    });
    // The statuses leave once the room's other batch drained.
    assert!(statuses(&a).is_empty());
    a.extend(h.ev(done(b[1].0)));
    assert_eq!(
        reason_frames(&a),
        vec![(endpoint(2), false), (endpoint(3), true)]
    );
    for x in &a {
        if let PrefillAction::SendStatus { reason, .. } = x {
            assert!(reason.as_deref().is_some_and(|r| r.contains("injected")));
        }
    }
    let r = room(25);
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 3, Some(vec![1]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]).last(),
    });
    let mut a2 = Vec::new();
    for (id, _) in batches(&a) {
        a2.extend(h.ev(done(id)));
    }
    assert_eq!(statuses(&a2), vec![(endpoint(3), KVPoll::Success)]);
    assert_eq!(reason_frames(&a2), vec![(endpoint(3), false)]);
}

/// A 5-frame ABORT shows a 0.5.23 decode even when its registration did not: its later
/// failures carry the reason frame, until it registers again.
#[test]
fn generational_abort_teaches_the_reason_frame() {
    let mut h = Harness::new(PrefillConfig::default());
    h.ev(PrefillEvent::Register(registration(2, 1)));
    let r = room(26);
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 1)));
    // A K-form ABORT teaches nothing.
    h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(2),
        generation: None,
    });
    assert!(!h.mgr.accepts_status_reason(&session(2)));
    let r = room(27);
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 1)));
    h.ev(PrefillEvent::Abort {
        room: r,
        endpoint: endpoint(2),
        generation: Some(1),
    });
    assert!(h.mgr.accepts_status_reason(&session(2)));
    let r = room(28);
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 1)));
    h.now += Duration::from_secs(1);
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(3, 5).unwrap(), vec![1, 2]).last(),
    });
    assert_eq!(reason_frames(&a), vec![(endpoint(2), true)]);
    // Re-registration starts over from what the registration shows.
    h.ev(PrefillEvent::Register(registration(2, 1)));
    assert!(!h.mgr.accepts_status_reason(&session(2)));
}

/// sglang 0.5.23 refuses a decode registration with DCP size 1 and a non-zero rank; kvx drops
/// it (and any other DCP size) without a state change, with a typed error.
#[test]
fn dcp_mismatch_registration_is_refused() {
    let mut h = Harness::new(PrefillConfig::default());
    let mut out = Vec::new();
    for (size, rank, kind) in [(1, 1, "dcp_rank_mismatch"), (2, 0, "unsupported_dcp")] {
        let reg = DecodeRegistration {
            dcp_size: size,
            dcp_rank: rank,
            ..registration(2, 1)
        };
        let err = h
            .mgr
            .handle(h.now, PrefillEvent::Register(reg), &mut out)
            .unwrap_err();
        assert_eq!(
            err,
            PrefillError::DcpMismatch {
                session: session(2),
                dcp_size: size,
                dcp_rank: rank
            }
        );
        assert_eq!(err.kind(), kind);
        assert!(out.is_empty());
        assert!(h.mgr.registration(&session(2)).is_none());
    }
    // The refused session stays unknown: its metadata is refused, nothing is sent.
    let r = room(29);
    let err = h
        .mgr
        .handle(
            h.now,
            PrefillEvent::Metadata(metadata(r, 2, Some(vec![1]), 1)),
            &mut out,
        )
        .unwrap_err();
    assert_eq!(err.kind(), "unregistered_session");
    assert!(out.is_empty());
    assert_eq!(h.mgr.poll(r), None);
    // DCP 1 rank 0 is accepted.
    h.ev(PrefillEvent::Register(registration(2, 1)));
    assert!(h.mgr.registration(&session(2)).is_some());
}

#[test]
fn metadata_from_an_unregistered_session_is_refused_and_reflects_nothing() {
    // Before: the room failed and status 0 went to whatever endpoint the metadata named (a
    // reflector for anyone who can reach the inbox).
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(31);
    let mut out = Vec::new();
    let err = h
        .mgr
        .handle(
            h.now,
            PrefillEvent::Metadata(metadata(r, 5, Some(vec![1]), 1)),
            &mut out,
        )
        .unwrap_err();
    assert_eq!(
        err,
        PrefillError::UnregisteredSession {
            room: r,
            session: session(5)
        }
    );
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(h.mgr.poll(r), None);
    assert!(h.mgr.live_entries().is_empty());
    // A dummy (no destination) needs no registration.
    h.ev(PrefillEvent::Metadata(metadata(r, 5, None, 1)));
    assert_eq!(h.mgr.poll(r), Some(KVPoll::WaitingForInput));
}

#[test]
fn failed_status_waits_until_the_rooms_writes_drained() {
    // Before: status 0 went out while a batch of the room was still on the wire, so the decode
    // could reuse pages a late write then landed in.
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(41);
    let a = h.one_page_room(r, 1);
    let b = batches(&a);
    assert_eq!(b.len(), 1);
    let a = h.ev(PrefillEvent::SenderFailed {
        room: r,
        reason: "the embedder gave up".into(),
    });
    assert!(statuses(&a).is_empty(), "{a:?}");
    assert_eq!(h.mgr.poll(r), Some(KVPoll::Failed));
    let a = h.ev(done(b[0].0));
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    assert!(a.iter().any(|x| matches!(
        x,
        PrefillAction::SendStatus { reason: Some(t), .. } if t == "the embedder gave up"
    )));
    assert!(h.mgr.live_entries().is_empty());
}

#[test]
fn a_failed_batch_fails_every_open_room_of_its_session() {
    let mut h = Harness::new(PrefillConfig::default());
    let (r1, r2) = (room(51), room(52));
    let a = h.one_page_room(r1, 1);
    h.open(r2);
    h.ev(PrefillEvent::Metadata(metadata(r2, 2, Some(vec![2]), 1)));
    let a = h.ev(PrefillEvent::BatchDone {
        batch_id: batches(&a)[0].0,
        result: Err("connection reset".into()),
    });
    assert_eq!(
        statuses(&a),
        vec![(endpoint(2), KVPoll::Failed), (endpoint(2), KVPoll::Failed)]
    );
    // Room 2 (nothing in flight) was told why and released.
    assert!(a.iter().any(|x| matches!(
        x,
        PrefillAction::SendStatus { room, reason: Some(t), .. } if *room == r2 && t.contains("not alive")
    )));
    assert_eq!(h.mgr.poll(r2), None);
    assert!(h.mgr.live_entries().is_empty());
}

/// A manager that holds two sessions at most, with sessions 2 and 3 registered.
fn two_sessions_at_most() -> Harness {
    let cfg = PrefillConfig {
        max_sessions: 2,
        ..PrefillConfig::default()
    };
    let mut h = Harness::new(cfg);
    for n in [2, 3] {
        h.ev(PrefillEvent::Register(registration(n, 1)));
    }
    h
}

#[test]
fn registrations_are_bounded_and_replaced_on_re_registration() {
    let mut h = two_sessions_at_most();
    // Session 2 is used (metadata) after 3 registered: 3 is the least recently used.
    h.ev(PrefillEvent::Metadata(metadata(room(1), 2, None, 1)));
    h.ev(PrefillEvent::Metadata(metadata(
        room(1),
        2,
        Some(vec![1]),
        1,
    )));
    h.ev(PrefillEvent::Register(registration(4, 1)));
    assert_eq!(h.mgr.live_entries().sessions, 2);
    assert!(h.mgr.registration(&session(3)).is_none());
    assert!(h.mgr.registration(&session(2)).is_some());
    // A decode inbox that registers a new session (a restarted decode) replaces its old one,
    // and the room writing to the old one fails at once (its decode process is gone).
    assert_eq!(h.mgr.poll(room(1)), Some(KVPoll::WaitingForInput));
    let restarted = DecodeRegistration {
        session: SessionId::new("10.0.0.2:16000"),
        ..registration(2, 1)
    };
    let out = h.ev(PrefillEvent::Register(restarted));
    assert_eq!(h.mgr.poll(room(1)), Some(KVPoll::Failed));
    assert!(
        out.iter().any(|a| matches!(
            a,
            PrefillAction::SendStatus { room: r, status: KVPoll::Failed, .. } if *r == room(1)
        )),
        "{out:?}"
    );
    assert!(h.mgr.registration(&session(2)).is_none());
    assert!(
        h.mgr
            .registration(&SessionId::new("10.0.0.2:16000"))
            .is_some()
    );
    assert_eq!(h.mgr.live_entries().sessions, 2);
}

#[test]
fn evicting_a_session_fails_the_rooms_writing_to_it() {
    let mut h = two_sessions_at_most();
    // Room 5 writes to session 3; session 2 is used after it, so 3 is the least recently used.
    h.open(room(5));
    h.ev(PrefillEvent::Metadata(metadata(
        room(5),
        3,
        Some(vec![1]),
        1,
    )));
    h.ev(PrefillEvent::Metadata(metadata(
        room(6),
        2,
        Some(vec![2]),
        1,
    )));
    assert_eq!(h.mgr.poll(room(5)), Some(KVPoll::WaitingForInput));
    // A third decode registers: session 3 goes, and room 5 with it (it could never be planned).
    let out = h.ev(PrefillEvent::Register(registration(4, 1)));
    assert!(h.mgr.registration(&session(3)).is_none());
    // Failed, told, and (nothing in flight) dropped at once.
    assert_eq!(h.mgr.poll(room(5)), None);
    assert!(
        out.iter().any(|a| matches!(
            a,
            PrefillAction::SendStatus { room: r, status: KVPoll::Failed, .. } if *r == room(5)
        )),
        "{out:?}"
    );
    assert!(h.mgr.poll(room(6)).is_some_and(|s| !s.is_terminal()));
}

#[test]
fn unopened_rooms_are_bounded_and_expire_at_their_deadline() {
    let cfg = PrefillConfig {
        max_unopened_rooms: 2,
        unopened_room_ttl: Duration::from_secs(20),
        ..PrefillConfig::default()
    };
    let mut h = Harness::new(cfg);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    assert_eq!(h.mgr.poll_timeout(), None);
    for n in [1, 2] {
        h.ev(PrefillEvent::Metadata(metadata(
            room(n),
            2,
            Some(vec![1]),
            1,
        )));
    }
    let mut out = Vec::new();
    let meta = PrefillEvent::Metadata(metadata(room(3), 2, Some(vec![1]), 1));
    assert_eq!(
        h.mgr.handle(h.now, meta, &mut out),
        Err(PrefillError::TooManyRooms(room(3)))
    );
    assert_eq!(h.mgr.live_entries().unopened_rooms, 2);
    // Opening one frees its slot; its deadline becomes the bootstrap timeout.
    h.open(room(1));
    assert_eq!(h.mgr.live_entries().unopened_rooms, 1);
    assert_eq!(h.mgr.poll_timeout(), Some(h.now + Duration::from_secs(20)));
    // A tick before the deadline changes nothing.
    h.now += Duration::from_secs(19);
    h.ev(PrefillEvent::Tick);
    assert_eq!(h.mgr.poll(room(2)), Some(KVPoll::WaitingForInput));
    h.now += Duration::from_secs(1);
    h.ev(PrefillEvent::Tick);
    assert_eq!(h.mgr.poll(room(2)), None);
    let e = h.mgr.live_entries();
    assert_eq!((e.rooms, e.unopened_rooms, e.deadlines), (1, 0, 0));
    // Room 1 is WaitingForInput with a sender: nothing timed is left.
    assert_eq!(h.mgr.poll_timeout(), None);
}

#[test]
fn path_selection_and_bounded_batches() {
    let cfg = PrefillConfig {
        attn_tp_size: 1,
        total_kv_heads: 8,
        batch_limits: BatchLimits::new(3, 1 << 20).unwrap(),
        staging: true,
        ..PrefillConfig::default()
    };
    let mut h = Harness::new(cfg);
    let mut staged = registration(3, 2);
    staged.staging.base = Some(0x1000);
    let mut sliced = registration(2, 2);
    sliced.dst_kv_item_len = 1024;
    h.ev(PrefillEvent::Register(sliced));
    h.ev(PrefillEvent::Register(staged));
    h.ev(PrefillEvent::Register(registration(4, 1)));
    assert_eq!(h.mgr.path_for(&session(2)), Some(TransferPath::HeadSlice));
    assert_eq!(h.mgr.path_for(&session(3)), Some(TransferPath::Staging));
    assert_eq!(h.mgr.path_for(&session(4)), Some(TransferPath::EqualTp));

    let r = room(41);
    h.open(r);
    for n in [2, 3] {
        h.ev(PrefillEvent::Metadata(metadata(
            r,
            n,
            Some(vec![1, 3, 5, 7]),
            2,
        )));
    }
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 4).unwrap(), vec![2, 4, 6, 8, 10]),
    });
    // Head slice: 4 pages × 4 buffers = 16 ops of 1024 bytes in batches of at most 3.
    let b = batches(&a);
    assert_eq!(b.len(), 6);
    assert!(b.iter().all(|(_, ops)| ops.len() <= 3));
    assert_eq!(b.iter().map(|(_, o)| o.len()).sum::<usize>(), 16);
    let stage: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            PrefillAction::Stage {
                src_pages,
                dst_pages,
                ..
            } => Some((src_pages.clone(), dst_pages.clone())),
            _ => None,
        })
        .collect();
    // The source list was truncated to the destination length.
    assert_eq!(stage, vec![(vec![2, 4, 6, 8], vec![1, 3, 5, 7])]);
    assert_eq!(h.mgr.live_entries().batches, 7);
}

#[test]
fn bad_chunks_fail_the_room() {
    let mut h = Harness::new(PrefillConfig::default());
    h.ev(PrefillEvent::Register(registration(2, 1)));
    // Before metadata completed.
    let r = room(51);
    h.open(r);
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::empty_last(0),
    });
    assert!(matches!(
        a.last(),
        Some(PrefillAction::Concluded {
            reason: Some(RoomError::NotReady { .. }),
            ..
        })
    ));
    // Slice beyond the destination pages, and a page beyond the local buffers.
    for (r, slice, pages) in [
        (room(52), (0, 3), vec![1, 2, 3]),
        (room(53), (0, 1), vec![64]),
    ] {
        h.open(r);
        h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1, 2]), 1)));
        let chunk = Chunk::new(PageSlice::new(slice.0, slice.1).unwrap(), pages);
        let a = h.ev(PrefillEvent::Chunk { room: r, chunk });
        assert!(batches(&a).is_empty());
        assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    }
    assert!(h.mgr.live_entries().is_empty());
    // Events for unknown rooms and batches are typed errors, not panics.
    let mut out = Vec::new();
    assert_eq!(
        h.mgr.handle(h.now, done(BatchId(12345)), &mut out),
        Err(PrefillError::UnknownBatch(BatchId(12345)))
    );
    assert_eq!(
        h.mgr
            .handle(h.now, PrefillEvent::LocalAbort { room: room(1) }, &mut out),
        Err(PrefillError::UnknownRoom(room(1)))
    );
}

#[test]
fn chunk_past_sender_pages_fails() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(61);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.open(r); // 4 pages
    h.ev(PrefillEvent::Metadata(metadata(
        r,
        2,
        Some(vec![1, 2, 3, 4, 5, 6]),
        1,
    )));
    let chunk = Chunk::new(PageSlice::new(2, 6).unwrap(), vec![1, 2, 3, 4]);
    let a = h.ev(PrefillEvent::Chunk { room: r, chunk });
    assert!(batches(&a).is_empty());
    assert!(matches!(
        a.last(),
        Some(PrefillAction::Concluded {
            reason: Some(RoomError::ChunkPastEnd { num_pages: 4, .. }),
            ..
        })
    ));
}

#[test]
fn fatal_fails_every_open_room_and_releases_after_the_writes_drained() {
    let mut h = Harness::new(PrefillConfig::default());
    h.ev(PrefillEvent::Register(registration(2, 1)));
    let (a_room, b_room) = (room(71), room(72));
    for r in [a_room, b_room] {
        h.open(r);
        h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1, 2]), 1)));
    }
    let a = h.ev(PrefillEvent::Chunk {
        room: a_room,
        chunk: Chunk::new(PageSlice::new(0, 2).unwrap(), vec![3, 4]),
    });
    let posted = batches(&a);
    assert_eq!(h.mgr.live_entries().batches, 1);
    let a = h.ev(PrefillEvent::Fatal {
        reason: "Transfer thread failed because of poisoned transport".into(),
    });
    // Before: both rooms were told and released at once while room a's batch was still being
    // written by another worker. Now room b (nothing in flight) is told at once; room a is held
    // and told once its batch came back.
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    assert_eq!(h.mgr.poll(a_room), Some(KVPoll::Failed));
    assert_eq!(h.mgr.poll(b_room), None);
    assert_eq!(h.mgr.live_entries().batches, 1);
    let a = h.ev(done(posted[0].0));
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    assert!(h.mgr.live_entries().is_empty());
}

#[test]
fn aux_rows_over_tcp() {
    let cfg = PrefillConfig {
        aux_over_tcp: true,
        ..PrefillConfig::default()
    };
    let mut h = Harness::new(cfg);
    let r = room(81);
    let first = h.one_page_room(r, 4);
    assert!(matches!(first[0], PrefillAction::FillRoomRow { .. }));
    // The rows wait for every batch of the room to succeed.
    assert!(
        !first
            .iter()
            .any(|x| matches!(x, PrefillAction::SendAuxData { .. }))
    );
    // Only the KV batch is written; the rows, then Success, follow its completion.
    let b = batches(&first);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].1.len(), 4);
    let a = h.ev(done(b[0].0));
    let rows: Vec<(usize, u64, u64, u64)> = a
        .iter()
        .filter_map(|x| match x {
            PrefillAction::SendAuxData {
                index,
                dst_row,
                src_addr,
                len,
                ..
            } => Some((*index, *dst_row, *src_addr, *len)),
            _ => None,
        })
        .collect();
    assert_eq!(rows.len(), 10);
    assert_eq!(rows[9], (9, 7, AUX_P + (9 << 20) + 3 * 64, 64));
    assert!(matches!(a[10], PrefillAction::SendStatus { .. }));
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Success)]);
}

/// A room whose KV write fails sends no aux row (kvx-sim seed 121: the decode had restarted on
/// the same address, and the row landed in one of its new rooms).
#[test]
fn aux_rows_over_tcp_are_not_sent_when_a_batch_fails() {
    let cfg = PrefillConfig {
        aux_over_tcp: true,
        ..PrefillConfig::default()
    };
    let mut h = Harness::new(cfg);
    let r = room(83);
    let first = h.one_page_room(r, 4);
    let b = batches(&first);
    let a = h.ev(PrefillEvent::BatchDone {
        batch_id: b[0].0,
        result: Err("peer restarted".into()),
    });
    assert!(
        !a.iter()
            .any(|x| matches!(x, PrefillAction::SendAuxData { .. }))
    );
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
}

#[test]
fn aux_rows_over_tcp_past_the_address_space_fail_the_room() {
    let cfg = PrefillConfig {
        aux_over_tcp: true,
        ..PrefillConfig::default()
    };
    // Row count unknown and the last buffer at the top of the address space: row 3 wraps.
    let mut aux_ptrs: Vec<u64> = (0..10).map(|i| AUX_P + (i << 20)).collect();
    aux_ptrs[9] = u64::MAX - 100;
    let mem = LocalMemory {
        aux: AuxLayout::sglang_default(&aux_ptrs, None).unwrap(),
        ..local()
    };
    let mut h = Harness::new(cfg);
    h.mgr = PrefillManager::new(h.mgr.config().clone(), mem);
    let r = room(82);
    let a = h.one_page_room(r, 4);
    assert!(
        !a.iter()
            .any(|x| matches!(x, PrefillAction::SendAuxData { .. }))
    );
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    assert!(
        a.iter().any(|x| matches!(
            x,
            PrefillAction::Concluded {
                status: KVPoll::Failed,
                reason: Some(RoomError::Plan {
                    source: PlanError::OutOfBounds { buffer: 9, .. },
                    ..
                }),
                ..
            }
        )),
        "{a:?}"
    );
}

#[test]
fn unique_rank() {
    let cfg = PrefillConfig {
        attn_tp_rank: 3,
        pp_size: 2,
        pp_rank: 1,
        cp_size: 4,
        cp_rank: 2,
        ..PrefillConfig::default()
    };
    assert_eq!(cfg.prefill_unique_rank(), 3 * 8 + 4 + 2);
}

/// One step of a random event sequence.
#[derive(Clone, Debug)]
enum Step {
    Register(u16),
    Meta {
        room: u64,
        n: u16,
        dummy: bool,
        required: u32,
    },
    Open(u64),
    Chunk {
        room: u64,
        last: bool,
        pages: u8,
    },
    Done {
        pick: usize,
        ok: bool,
    },
    Abort(u64),
    LocalAbort(u64),
    Advance(u64),
    Fatal,
    /// Open, metadata from session 2 and a last chunk, in one step.
    Happy(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (2u16..5).prop_map(Step::Register),
        3 => (1u64..4, 2u16..4, prop::bool::weighted(0.2), prop::sample::select(vec![1u32, 1, 1, 2, 0]))
            .prop_map(|(room, n, dummy, required)| Step::Meta { room, n, dummy, required }),
        3 => (1u64..4).prop_map(Step::Open),
        3 => (1u64..4, prop::bool::weighted(0.6), 0u8..3).prop_map(|(room, last, pages)| Step::Chunk { room, last, pages }),
        4 => (any::<usize>(), prop::bool::weighted(0.85)).prop_map(|(pick, ok)| Step::Done { pick, ok }),
        1 => (1u64..4).prop_map(Step::Abort),
        1 => (1u64..4).prop_map(Step::LocalAbort),
        2 => prop::sample::select(vec![0u64, 1, 5, 60, 301]).prop_map(Step::Advance),
        1 => Just(Step::Fatal),
        3 => (1u64..4).prop_map(Step::Happy),
    ]
}

impl Harness {
    /// Applies a step, ignoring dropped events; returns posted batch ids.
    fn apply(&mut self, s: &Step, outstanding: &mut Vec<BatchId>) {
        let e = match *s {
            Step::Happy(r) => {
                let meta = Step::Meta {
                    room: r,
                    n: 2,
                    dummy: false,
                    required: 1,
                };
                let last = Step::Chunk {
                    room: r,
                    last: true,
                    pages: 2,
                };
                for step in [Step::Open(r), meta, last] {
                    self.apply(&step, outstanding);
                }
                return;
            }
            Step::Register(n) => PrefillEvent::Register(registration(n, 1)),
            Step::Meta {
                room: r,
                n,
                dummy,
                required,
            } => PrefillEvent::Metadata(metadata(
                room(r),
                n,
                (!dummy).then(|| vec![1, 2, 3, 4]),
                required,
            )),
            Step::Open(r) => {
                self.out.clear();
                let _ = self.mgr.handle(
                    self.now,
                    PrefillEvent::SenderCreated { room: room(r) },
                    &mut self.out,
                );
                PrefillEvent::SenderInit {
                    room: room(r),
                    num_pages: 4,
                    aux_row: r,
                }
            }
            Step::Chunk {
                room: r,
                last,
                pages,
            } => {
                let held = self.mgr.rooms.get(&room(r));
                let start = if held.is_some_and(|x| x.inflight > 0) {
                    2
                } else {
                    0
                };
                let end = start + usize::from(pages);
                let mut chunk = Chunk::new(
                    PageSlice::new(start, end).unwrap(),
                    (start..end).map(|p| 10 + p as i32).collect(),
                );
                chunk.is_last = last;
                PrefillEvent::Chunk {
                    room: room(r),
                    chunk,
                }
            }
            Step::Done { pick, ok } => {
                if outstanding.is_empty() {
                    return;
                }
                let id = outstanding.swap_remove(pick % outstanding.len());
                PrefillEvent::BatchDone {
                    batch_id: id,
                    result: if ok { Ok(()) } else { Err("injected".into()) },
                }
            }
            Step::Abort(r) => PrefillEvent::Abort {
                room: room(r),
                endpoint: endpoint(2),
                generation: (r % 2 == 0).then_some(r),
            },
            Step::LocalAbort(r) => PrefillEvent::LocalAbort { room: room(r) },
            Step::Fatal => PrefillEvent::Fatal {
                reason: "fatal".into(),
            },
            Step::Advance(secs) => {
                self.now += Duration::from_secs(secs);
                PrefillEvent::Tick
            }
        };
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        let _ = self.mgr.handle(self.now, e, &mut out);
        for a in &out {
            match a {
                PrefillAction::PostBatch { batch_id, .. }
                | PrefillAction::Stage { batch_id, .. } => outstanding.push(*batch_id),
                _ => {}
            }
        }
        self.out = out;
    }

    /// Invariants that hold after every step.
    fn check(&self) -> Result<(), TestCaseError> {
        for (room, rs) in &self.mgr.rooms {
            let mine = self
                .mgr
                .batches
                .values()
                .filter(|(r, _, _)| r == room)
                .count();
            prop_assert_eq!(mine, rs.inflight);
            let releasable = rs.status.is_terminal()
                && rs.inflight == 0
                && rs.sender.is_some()
                && rs.pending_acks.is_empty();
            prop_assert!(!releasable, "room {} should have been released", room);
        }
        // An ABORT_ACK leaves only for a drained room, in the form its ABORT asked for.
        for a in &self.out {
            if let PrefillAction::AbortAck {
                room, generation, ..
            } = a
            {
                let drained = self.mgr.rooms.get(room).is_none_or(|rs| rs.inflight == 0);
                prop_assert!(drained, "ABORT_ACK for {} with writes in flight", room);
                prop_assert_eq!(*generation, (room.get() % 2 == 0).then_some(room.get()));
            }
            // A Failed status leaves only once nothing of the room can still be written into
            // that decode (a decode whose metadata came after the room failed gets it at once:
            // nothing was ever planned towards it).
            if let PrefillAction::SendStatus {
                room,
                endpoint,
                status: KVPoll::Failed,
                ..
            } = a
            {
                let towards = self.mgr.batches.values().any(|(r, session, _)| {
                    r == room
                        && self
                            .mgr
                            .sessions
                            .get(session)
                            .is_some_and(|(s, _)| s.reg.endpoint == *endpoint)
                });
                prop_assert!(
                    !towards,
                    "status 0 for {} with writes in flight to {:?}",
                    room,
                    endpoint
                );
            }
        }
        Ok(())
    }
}

proptest! {
    #[test]
    fn random_sequences_never_lower_status_nor_leak(steps in proptest::collection::vec(step(), 1..60)) {
        let mut h = Harness::new(PrefillConfig::default());
        h.ev(PrefillEvent::Register(registration(2, 1)));
        let mut outstanding = Vec::new();
        let mut held: std::collections::HashMap<Room, KVPoll> = Default::default();
        for s in &steps {
            h.apply(s, &mut outstanding);
            h.check()?;
            for a in &h.out {
                if let PrefillAction::Concluded { status, .. } = a {
                    prop_assert!(status.is_terminal());
                }
            }
            // While a room stays held its status never goes down and Failed sticks.
            for r in (1..5).map(room) {
                match (h.mgr.poll(r), held.get(&r).copied()) {
                    (None, _) => {
                        held.remove(&r);
                    }
                    (Some(now), old) => {
                        if let Some(old) = old {
                            prop_assert_eq!(old.update(now), now, "{} went {} -> {}", r, old, now);
                        }
                        held.insert(r, now);
                    }
                }
            }
        }
        // Drain: complete every batch, abort every room locally, let orphans time out.
        while let Some(id) = outstanding.pop() {
            h.apply(&Step::Done { pick: 0, ok: true }, &mut vec![id]);
            h.check()?;
        }
        for r in 1..5 {
            h.apply(&Step::Open(r), &mut outstanding);
            h.apply(&Step::LocalAbort(r), &mut outstanding);
        }
        h.apply(&Step::Advance(301), &mut outstanding);
        prop_assert!(outstanding.is_empty());
        prop_assert!(h.mgr.live_entries().is_empty(), "{:?}", h.mgr.live_entries());
    }
}

/// A registration with arbitrary network-derived contents.
fn wild_registration() -> impl Strategy<Value = DecodeRegistration> {
    (
        proptest::collection::vec(any::<u64>(), 0..6),
        proptest::collection::vec(prop_oneof![any::<u64>(), Just(AUX_D)], 0..12),
        prop::sample::select(vec![0u64, 1, 7, 1024, 2048, u64::MAX]),
        prop::sample::select(vec![0u32, 1, 2, 3, 8]),
        any::<u32>(),
        any::<bool>(),
        proptest::collection::vec(0u32..4, 0..6),
        proptest::collection::vec(proptest::collection::vec(any::<u64>(), 0..3), 0..2),
    )
        .prop_map(|(kv, aux, item, tp, rank, staged, ids, state)| {
            let mut reg = registration(2, 1);
            reg.kv_ptrs = kv;
            reg.aux_ptrs = aux;
            reg.dst_kv_item_len = item;
            reg.dst_attn_tp_size = tp;
            reg.dst_tp_rank = rank;
            reg.staging.size = staged.then_some(1 << 20);
            reg.kv_layer_ids = ids;
            reg.state_item_lens = state.iter().map(|s| vec![8; s.len()]).collect();
            reg.state_ptrs = state;
            reg
        })
}

proptest! {
    #[test]
    fn arbitrary_peer_input_never_panics(
        reg in wild_registration(),
        kv_pages in proptest::collection::vec(any::<i32>(), 0..6),
        aux_index in any::<i64>(),
        state in proptest::collection::vec(proptest::collection::vec(any::<i32>(), 0..3), 0..2),
        src_pages in proptest::collection::vec(prop_oneof![0i32..64, any::<i32>()], 0..6),
        src_state in proptest::collection::vec(proptest::collection::vec(any::<i32>(), 0..3), 0..2),
        slice in (0usize..8, 0usize..8),
        staging in any::<bool>(),
        required in 0u32..3,
    ) {
        let cfg = PrefillConfig {
            attn_tp_size: 2,
            total_kv_heads: 8,
            staging,
            ..PrefillConfig::default()
        };
        let mut mem = local();
        mem.state = vec![crate::layout::StateComponent::new(
            crate::layout::StateKind::Slot,
            vec![crate::layout::Buffer::new(0x100, 8, 64)],
        )];
        let mut mgr = PrefillManager::new(cfg, mem);
        let now = Instant::now();
        let mut out = Vec::new();
        let r = room(5);
        let _ = mgr.handle(now, PrefillEvent::Register(reg), &mut out);
        let _ = mgr.handle(now, PrefillEvent::SenderCreated { room: r }, &mut out);
        let _ = mgr.handle(now, PrefillEvent::SenderInit { room: r, num_pages: 8, aux_row: 3 }, &mut out);
        let mut meta = metadata(r, 2, Some(kv_pages), required);
        if let Some(d) = meta.dst.as_mut() {
            d.aux_index = aux_index;
            d.state_indices = state;
        }
        let _ = mgr.handle(now, PrefillEvent::Metadata(meta), &mut out);
        let mut chunk = Chunk::new(PageSlice { start: slice.0, end: slice.1 }, src_pages);
        chunk.src_state = src_state;
        chunk.is_last = true;
        let _ = mgr.handle(now, PrefillEvent::Chunk { room: r, chunk }, &mut out);
        let ids: Vec<BatchId> = out
            .iter()
            .filter_map(|a| match a {
                PrefillAction::PostBatch { batch_id, ops, .. } => {
                    // Everything posted lies inside the local registered memory.
                    let local = local();
                    for op in ops {
                        let inside = local.kv.buffers.iter().chain(&local.aux.buffers)
                            .chain(std::iter::once(&crate::layout::Buffer::new(0x100, 8, 64)))
                            .any(|b| op.src >= b.addr && op.src + op.len <= b.addr + b.len.unwrap_or(0));
                        assert!(inside, "op {op:?} reads outside local memory");
                    }
                    Some(*batch_id)
                }
                PrefillAction::Stage { batch_id, .. } => Some(*batch_id),
                _ => None,
            })
            .collect();
        for id in ids {
            let _ = mgr.handle(now, done(id), &mut out);
        }
        let _ = mgr.handle(now + Duration::from_secs(301), PrefillEvent::Tick, &mut out);
        prop_assert!(mgr.live_entries().is_empty(), "{:?}", mgr.live_entries());
    }
}

/// kvx-sim seed 65: a decode that restarts under the same session id registers again; rooms of
/// its first incarnation must not write their old page lists into the new process.
#[test]
fn re_registration_of_a_held_session_fails_its_open_rooms() {
    let mut h = Harness::new(PrefillConfig::default());
    let r = room(65);
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.open(r);
    h.ev(PrefillEvent::Metadata(metadata(r, 2, Some(vec![1, 2]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: r,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![3]),
    });
    for (id, _) in batches(&a) {
        h.ev(done(id));
    }
    assert!(h.mgr.poll(r).is_some_and(|s| !s.is_terminal()));
    // The decode restarted: same session, new process.
    let a = h.ev(PrefillEvent::Register(registration(2, 1)));
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    // The failed room is gone (nothing was in flight): its next chunk writes nothing.
    let mut a = Vec::new();
    let chunk = Chunk::new(PageSlice::new(1, 2).unwrap(), vec![4]).last();
    let res = h
        .mgr
        .handle(h.now, PrefillEvent::Chunk { room: r, chunk }, &mut a);
    assert_eq!(res, Err(PrefillError::UnknownRoom(r)));
    assert!(batches(&a).is_empty(), "{a:?}");
    assert!(h.mgr.live_entries().is_empty());
}

/// A decode that restarts under the same session id while a batch of its first incarnation is
/// still on the wire: that batch fails later (the old process is gone), which says nothing of
/// the new one. The session must not be blacklisted for it, nor the new incarnation's rooms
/// failed.
#[test]
fn a_batch_of_an_earlier_registration_failing_spares_the_new_one() {
    let mut h = Harness::new(PrefillConfig::default());
    let (old, new) = (room(66), room(67));
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.open(old);
    h.ev(PrefillEvent::Metadata(metadata(old, 2, Some(vec![1]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: old,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![3]).last(),
    });
    let in_flight = batches(&a);
    assert_eq!(in_flight.len(), 1);
    // The decode restarts and registers again; its old room fails (its batch still in flight).
    let a = h.ev(PrefillEvent::Register(registration(2, 1)));
    assert_eq!(
        statuses(&a),
        Vec::<(Endpoint, KVPoll)>::new(),
        "told once drained"
    );
    // The new incarnation's room gets its metadata...
    h.open(new);
    h.ev(PrefillEvent::Metadata(metadata(new, 2, Some(vec![1]), 1)));
    // ...then the old batch fails: the old room is told Failed; the new room lives on.
    let a = h.ev(PrefillEvent::BatchDone {
        batch_id: in_flight[0].0,
        result: Err("connection reset by peer".into()),
    });
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    assert_eq!(h.mgr.poll(old), None);
    assert_eq!(h.mgr.poll(new), Some(KVPoll::WaitingForInput));
    // Its chunk is written: the session is not blacklisted.
    let a = h.ev(PrefillEvent::Chunk {
        room: new,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![4]).last(),
    });
    assert_eq!(batches(&a).len(), 1, "{a:?}");
    assert!(statuses(&a).is_empty(), "{a:?}");
    // A batch of the current registration failing still blacklists the session.
    let id = batches(&a)[0].0;
    let a = h.ev(PrefillEvent::BatchDone {
        batch_id: id,
        result: Err("connection reset by peer".into()),
    });
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
    let third = room(68);
    h.open(third);
    h.ev(PrefillEvent::Metadata(metadata(third, 2, Some(vec![2]), 1)));
    let a = h.ev(PrefillEvent::Chunk {
        room: third,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![5]).last(),
    });
    assert!(batches(&a).is_empty());
    assert_eq!(statuses(&a), vec![(endpoint(2), KVPoll::Failed)]);
}

#[test]
fn session_lost_fails_only_that_sessions_open_rooms_and_blacklists_it() {
    let mut h = Harness::new(PrefillConfig::default());
    h.ev(PrefillEvent::Register(registration(2, 1)));
    h.ev(PrefillEvent::Register(registration(3, 1)));
    let (a, b) = (room(21), room(22));
    h.open(a);
    h.open(b);
    h.ev(PrefillEvent::Metadata(metadata(a, 2, Some(vec![1]), 1)));
    h.ev(PrefillEvent::Metadata(metadata(b, 3, Some(vec![1]), 1)));
    let out = h.ev(PrefillEvent::SessionLost {
        session: session(2),
    });
    assert_eq!(statuses(&out), vec![(endpoint(2), KVPoll::Failed)]);
    assert_eq!(h.mgr.poll(a), None, "nothing in flight: released at once");
    assert_eq!(h.mgr.poll(b), Some(KVPoll::WaitingForInput));
    // A room opened for the lost session later fails at its first chunk.
    let c = room(23);
    h.open(c);
    h.ev(PrefillEvent::Metadata(metadata(c, 2, Some(vec![2]), 1)));
    let out = h.ev(PrefillEvent::Chunk {
        room: c,
        chunk: Chunk::new(PageSlice::new(0, 1).unwrap(), vec![0]).last(),
    });
    assert!(batches(&out).is_empty());
    assert_eq!(statuses(&out), vec![(endpoint(2), KVPoll::Failed)]);
}
