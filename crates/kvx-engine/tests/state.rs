//! The embedded sender with state components (a hybrid model's MAMBA slots beside its KV): the
//! engine registers the state memory once, and the last chunk's state slot lands in the slot
//! the decode named, byte for byte, over the real ZMQ control plane and tcp data plane. The
//! decode side is assembled from kvx's own parts (inbox, push socket, data-plane server), since
//! the `kvx decode` peer does not model state.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions, zmq};
use kvx_core::{
    Buffer, Chunk, DecodeRegistration, Destination, KVPoll, PageSlice, Room, SessionId,
    StateComponent, StateKind, TransferRequest,
};
use kvx_engine::engine::{PrefillConfig, PrefillEngine, PrefillMemory};
use kvx_engine::plane::{Backend, DataPlane};
use kvx_engine::region::Region;
use kvx_engine::wire::{self, DecodeInbound};

const PAGES: u64 = 8;
const ITEM: u64 = 256;
const KV_BUFFERS: u64 = 4;
const ROWS: u64 = 4;
const SLOTS: u64 = 4;
const STATE_ITEM: u64 = 512;
const STATE_LAYERS: u64 = 3;

/// KV, aux and state regions of one side, and their buffer addresses.
struct Side {
    kv: Arc<Region>,
    aux: Arc<Region>,
    state: Arc<Region>,
}

impl Side {
    fn new() -> Side {
        Side {
            kv: Arc::new(Region::new((KV_BUFFERS * PAGES * ITEM) as usize)),
            aux: Arc::new(Region::new((ROWS * (64 + 8)) as usize)),
            state: Arc::new(Region::new((STATE_LAYERS * SLOTS * STATE_ITEM) as usize)),
        }
    }
    fn kv_ptrs(&self) -> Vec<u64> {
        (0..KV_BUFFERS)
            .map(|b| self.kv.base() + b * PAGES * ITEM)
            .collect()
    }
    fn aux_ptrs(&self) -> Vec<u64> {
        vec![self.aux.base(), self.aux.base() + ROWS * 64]
    }
    fn state_ptrs(&self) -> Vec<u64> {
        (0..STATE_LAYERS)
            .map(|l| self.state.base() + l * SLOTS * STATE_ITEM)
            .collect()
    }
    fn kv_page(&self, b: u64, page: u64) -> Vec<u8> {
        let addr = self.kv.base() + (b * PAGES + page) * ITEM;
        self.kv.to_vec(addr, ITEM).unwrap()
    }
    fn slot(&self, layer: u64, slot: u64) -> Vec<u8> {
        let addr = self.state_ptrs()[layer as usize] + slot * STATE_ITEM;
        self.state.to_vec(addr, STATE_ITEM).unwrap()
    }
}

fn fill(r: &Region, seed: u8) {
    let bytes: Vec<u8> = (0..r.len())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    r.copy_in(r.base(), &bytes).unwrap();
}

#[test]
fn state_slots_travel_with_the_last_chunk() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = Side::new();
    fill(&p.kv, 1);
    fill(&p.state, 2);
    let component = StateComponent::new(
        StateKind::Slot,
        p.state_ptrs()
            .into_iter()
            .map(|a| Buffer::new(a, STATE_ITEM, SLOTS * STATE_ITEM))
            .collect(),
    );
    let mem = PrefillMemory::new(
        p.kv.clone(),
        p.kv_ptrs(),
        ITEM,
        p.aux.clone(),
        p.aux_ptrs(),
        vec![64, 8],
    )
    .with_state(vec![p.state.clone()], vec![component]);
    let engine = PrefillEngine::start(PrefillConfig::default(), mem, rt.handle().clone()).unwrap();

    // The decode: its memory behind a data-plane server, an inbox, a push socket.
    let d = Side::new();
    let plane = rt
        .block_on(DataPlane::server(
            Backend::Tcp,
            "127.0.0.1",
            "state-test",
            vec![d.kv.clone(), d.aux.clone(), d.state.clone()],
        ))
        .unwrap();
    let ctx = zmq::Context::new();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Decode)).unwrap();
    let mut push = PushCache::new(&ctx, PushOptions::toward_prefill(), 4);
    let session = SessionId::new(plane.endpoint());
    let reg = DecodeRegistration {
        endpoint: inbox.endpoint().clone(),
        session: session.clone(),
        kv_ptrs: d.kv_ptrs(),
        aux_ptrs: d.aux_ptrs(),
        state_ptrs: vec![d.state_ptrs()],
        dst_tp_rank: 0,
        dst_attn_tp_size: 1,
        dst_kv_item_len: ITEM,
        state_item_lens: vec![vec![STATE_ITEM as u32; STATE_LAYERS as usize]],
        state_dim_per_tensor: vec![vec![]],
        kv_layer_ids: vec![],
        state_layer_ids: vec![vec![]],
        staging: Default::default(),
        dcp_size: 1,
        dcp_rank: 0,
        staging_slot_layer_ids: None,
        kv_item_lens: None,
    };
    let prefill = engine.endpoint().clone();
    push.send(&prefill, &wire::encode_registration(&reg).unwrap())
        .unwrap();
    let room = Room::new(77).unwrap();
    engine.open_room(room).unwrap();
    let req = TransferRequest {
        room,
        endpoint: inbox.endpoint().clone(),
        session,
        dst: Some(Destination {
            kv_pages: vec![3, 5],
            aux_index: 1,
            state_indices: vec![vec![1]],
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: vec![],
    };
    push.send(&prefill, &wire::encode_metadata(&req).unwrap())
        .unwrap();
    let t0 = Instant::now();
    while engine.poll(room) != Some(KVPoll::WaitingForInput) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "hang guard: metadata"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.init_room(room, 2, 0).unwrap();
    let mut chunk = Chunk::new(PageSlice::new(0, 2).unwrap(), vec![1, 6]).last();
    chunk.src_state = vec![vec![2]];
    engine.send(room, chunk).unwrap();

    let msg = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), inbox.recv()).await })
        .expect("hang guard: status")
        .unwrap();
    let status = wire::parse_decode_inbound(msg.frames()).unwrap();
    assert!(
        matches!(status, DecodeInbound::Status { room: r, status: KVPoll::Success, .. } if r == room),
        "{status:?}: {:?}",
        engine.failure(room)
    );
    // KV pages 1, 6 → 3, 5 in every buffer; state slot 2 → 1 in every layer, nothing else.
    for b in 0..KV_BUFFERS {
        assert_eq!(d.kv_page(b, 3), p.kv_page(b, 1));
        assert_eq!(d.kv_page(b, 5), p.kv_page(b, 6));
    }
    for l in 0..STATE_LAYERS {
        assert_eq!(d.slot(l, 1), p.slot(l, 2), "layer {l}");
        for other in [0, 2, 3] {
            assert!(
                d.slot(l, other).iter().all(|&x| x == 0),
                "layer {l} slot {other}"
            );
        }
    }
    engine.shutdown();
    inbox.close();
    drop(plane);
}
