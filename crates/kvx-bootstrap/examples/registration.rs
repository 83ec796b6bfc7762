//! Encodes a decode rank's KV-args registration as sglang's ZMQ frames, parses it back, and
//! shows what a malformed message gets: a typed error, never a panic.
//!
//! Run with `cargo run -p kvx-bootstrap --example registration`.

use kvx_bootstrap::codec::{CodecError, encode_registration, parse_registration};
use kvx_core::{DecodeRegistration, Endpoint, SessionId};

fn main() -> Result<(), CodecError> {
    let reg = DecodeRegistration {
        endpoint: Endpoint::new("10.0.0.2", 41000),
        session: SessionId::new("10.0.0.2:15000"),
        kv_ptrs: vec![0x7e00_0000_0000, 0x7e00_0010_0000],
        aux_ptrs: (0..10).map(|i| 0x6e00_0000_0000 + (i << 20)).collect(),
        state_ptrs: Vec::new(),
        dst_tp_rank: 0,
        dst_attn_tp_size: 1,
        dst_kv_item_len: 2048,
        state_item_lens: Vec::new(),
        state_dim_per_tensor: Vec::new(),
        kv_layer_ids: Vec::new(),
        state_layer_ids: Vec::new(),
        staging: Default::default(),
        dcp_size: 1,
        dcp_rank: 0,
        // sglang 0.5.23's 20-frame form: frame 18 (slot layer ids, empty here) and frame 19
        // (per-buffer item lengths), which tells the prefill it may send failure reasons.
        staging_slot_layer_ids: Some(Vec::new()),
        kv_item_lens: Some(vec![2048, 2048]),
    };
    let frames = encode_registration(&reg)?;
    println!(
        "{} frames; frame 0 {:?}",
        frames.len(),
        String::from_utf8_lossy(&frames[0])
    );
    for (i, f) in frames.iter().enumerate().take(4) {
        println!("  frame {i}: {:?}", String::from_utf8_lossy(f));
    }
    let back = parse_registration(&frames)?;
    assert_eq!(back, reg);
    assert!(back.accepts_status_reason());
    println!(
        "parsed back identical; takes a status reason frame: {}",
        back.accepts_status_reason()
    );

    // A truncated message is refused with a typed error (its kind labels metrics).
    let err = parse_registration(&frames[..5]).expect_err("5 frames are not a registration");
    println!("truncated: {err} (kind {})", err.kind());
    Ok(())
}
