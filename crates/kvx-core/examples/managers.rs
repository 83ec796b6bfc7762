//! Drives a `PrefillManager` and a `DecodeManager` against each other by hand: what an embedder's
//! event loop does, without sockets. The "network" is a function call and the "data plane" a
//! copy between two byte vectors whose addresses the layouts name, so every byte the plan moves
//! is checked at the end.
//!
//! Run with `cargo run -p kvx-core --example managers`.

use std::time::Instant;

use kvx_core::prefill::{LocalMemory, PrefillAction, PrefillEvent, PrefillManager};
use kvx_core::{
    AuxLayout, Chunk, DecodeAction, DecodeConfig, DecodeEvent, DecodeManager, DecodeRegistration,
    Destination, Endpoint, KVPoll, KvLayout, PageSlice, Room, SessionId, TransferOp,
    TransferRequest,
};

const LAYERS: usize = 2;
const ITEM: u64 = 256;
const PAGES: u64 = 8;

/// One side's memory: KV buffers (K then V layers, `PAGES` pages each) and sglang's 10 aux rows.
struct Memory {
    bytes: Vec<u8>,
}

impl Memory {
    fn new() -> Self {
        let kv = 2 * LAYERS as u64 * PAGES * ITEM;
        Memory {
            bytes: vec![0; kv as usize + 10 * 4096],
        }
    }
    fn base(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }
    fn kv(&self) -> KvLayout {
        KvLayout::mha_contiguous(self.base(), LAYERS, ITEM, PAGES, 1)
    }
    fn aux_ptrs(&self) -> Vec<u64> {
        let kv = 2 * LAYERS as u64 * PAGES * ITEM;
        (0..10).map(|i| self.base() + kv + i * 4096).collect()
    }
    fn range(&self, addr: u64, len: u64) -> std::ops::Range<usize> {
        let off = (addr - self.base()) as usize;
        off..off + len as usize
    }
}

/// The "data plane": copies one op from the prefill's memory into the decode's.
fn write(op: &TransferOp, src: &Memory, dst: &mut Memory) {
    let from = src.range(op.src, op.len);
    let to = dst.range(op.dst, op.len);
    dst.bytes[to].copy_from_slice(&src.bytes[from]);
}

fn main() {
    let now = Instant::now();
    let mut prefill_mem = Memory::new();
    let mut decode_mem = Memory::new();
    // The forward pass wrote KV into source pages 3 and 4 of every buffer.
    for (i, b) in prefill_mem.bytes.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }

    let local = LocalMemory {
        kv: prefill_mem.kv(),
        aux: AuxLayout::sglang_default(&prefill_mem.aux_ptrs(), Some(16)).expect("aux layout"),
        state: Vec::new(),
    };
    let mut prefill = PrefillManager::new(kvx_core::PrefillConfig::default(), local);
    let mut decode = DecodeManager::new(DecodeConfig::default());
    let room = Room::new(42).expect("non-zero room");
    let decode_inbox = Endpoint::new("10.0.0.2", 41000);
    let prefill_inbox = Endpoint::new("10.0.0.1", 40000);
    let session = SessionId::new("10.0.0.2:15000");
    let mut pa = Vec::new();
    let mut da = Vec::new();

    // Decode: a receiver for the room; it registers with the prefill rank and sends metadata.
    decode
        .handle(
            now,
            DecodeEvent::Created {
                room,
                bootstrap_addr: "10.0.0.1:8998".into(),
            },
            &mut da,
        )
        .expect("created");
    decode
        .handle(
            now,
            DecodeEvent::Init {
                room,
                required_prefill_response_num: 1,
                prefill_endpoints: vec![prefill_inbox],
                generational_aborts: false,
            },
            &mut da,
        )
        .expect("init");
    let kv = decode_mem.kv();
    let registration = DecodeRegistration {
        endpoint: decode_inbox.clone(),
        session: session.clone(),
        kv_ptrs: kv.buffers.iter().map(|b| b.addr).collect(),
        aux_ptrs: decode_mem.aux_ptrs(),
        state_ptrs: Vec::new(),
        dst_tp_rank: 0,
        dst_attn_tp_size: 1,
        dst_kv_item_len: ITEM,
        state_item_lens: Vec::new(),
        state_dim_per_tensor: Vec::new(),
        kv_layer_ids: Vec::new(),
        state_layer_ids: Vec::new(),
        staging: Default::default(),
        dcp_size: 1,
        dcp_rank: 0,
        staging_slot_layer_ids: None,
        kv_item_lens: None,
    };
    prefill
        .handle(now, PrefillEvent::Register(registration), &mut pa)
        .expect("registered");
    let metadata = TransferRequest {
        room,
        endpoint: decode_inbox,
        session,
        dst: Some(Destination {
            kv_pages: vec![6, 7],
            aux_index: 5,
            state_indices: Vec::new(),
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
        device_kv_pages: Vec::new(),
    };
    prefill
        .handle(now, PrefillEvent::Metadata(metadata), &mut pa)
        .expect("metadata");
    decode
        .handle(now, DecodeEvent::MetadataSent { room }, &mut da)
        .expect("metadata sent");

    // Prefill: the request arrives, the sender is created, the forward pass hands the chunk.
    for event in [
        PrefillEvent::SenderCreated { room },
        PrefillEvent::SenderInit {
            room,
            num_pages: 2,
            aux_row: 1,
        },
        PrefillEvent::Chunk {
            room,
            chunk: Chunk::new(PageSlice::new(0, 2).expect("slice"), vec![3, 4]).last(),
        },
    ] {
        prefill.handle(now, event, &mut pa).expect("prefill event");
    }
    assert_eq!(prefill.poll(room), Some(KVPoll::WaitingForInput));

    // The driver performs the actions in order: batches go to the data plane, completions come
    // back as BatchDone, statuses go to the decode.
    let mut queue: Vec<PrefillAction> = std::mem::take(&mut pa);
    let mut written = 0u64;
    while !queue.is_empty() {
        for action in std::mem::take(&mut queue) {
            match action {
                PrefillAction::PostBatch { batch_id, ops, .. } => {
                    for op in &ops {
                        write(op, &prefill_mem, &mut decode_mem);
                        written += op.len;
                    }
                    println!("batch {batch_id:?}: {} writes", ops.len());
                    let done = PrefillEvent::BatchDone {
                        batch_id,
                        result: Ok(()),
                    };
                    prefill.handle(now, done, &mut queue).expect("batch done");
                }
                PrefillAction::FillRoomRow { addr, len, room } => {
                    let r = prefill_mem.range(addr, len);
                    kvx_core::fill_room_row(&mut prefill_mem.bytes[r], room);
                }
                PrefillAction::SendStatus {
                    room,
                    status,
                    prefill_rank,
                    reason,
                    ..
                } => {
                    println!("status {status} for {room} from prefill rank {prefill_rank}");
                    let event = DecodeEvent::Status {
                        room,
                        status,
                        prefill_rank,
                        reason,
                    };
                    decode.handle(now, event, &mut da).expect("status");
                }
                PrefillAction::Concluded { room, status, .. } => {
                    println!("prefill: {room} concluded {status}");
                }
                other => println!("(not needed here) {other:?}"),
            }
        }
    }
    for action in &da {
        if let DecodeAction::Concluded { room, status, .. } = action {
            println!("decode: {room} concluded {status}");
        }
    }

    // Destination pages 6 and 7 hold source pages 3 and 4 of every buffer.
    let (src_kv, dst_kv) = (prefill_mem.kv(), decode_mem.kv());
    for (s, d) in src_kv.buffers.iter().zip(&dst_kv.buffers) {
        for (sp, dp) in [(3, 6), (4, 7)] {
            let from = prefill_mem.range(s.addr + sp * ITEM, ITEM);
            let to = decode_mem.range(d.addr + dp * ITEM, ITEM);
            assert_eq!(prefill_mem.bytes[from], decode_mem.bytes[to]);
        }
    }
    assert!(prefill.live_entries().is_empty() && decode.live_entries() == 0);
    println!("{written} bytes moved and verified; nothing left on either side");
}
