//! Fuzzes the mooncake data port's fixed-size codecs: the 24-byte request header (any bytes
//! decode; `check` decides whether the range is usable) and the 8-byte status frame, and the
//! descriptor's destination lookup with arbitrary ranges.
#![no_main]

use kvx_rdma::mooncake::wire::{Header, Status};
use kvx_rdma::mooncake::{MooncakeBuffer, MooncakeDescriptor};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<u8>, Vec<(u64, u64)>, u64, u64)| {
    let (bytes, buffers, addr, len) = input;
    if let Ok(h) = Header::parse(&bytes) {
        assert_eq!(Header::decode(&h.encode()), h);
        assert_eq!(&h.encode()[..17], &bytes[..17]);
        if let Ok(end) = h.check() {
            assert!(end > h.addr);
        }
    }
    if let Ok(s) = Status::parse(&bytes) {
        assert_eq!(Status::decode(&s.encode()), Ok(s));
    }
    // Buffers through the strict parser (refuses zero, wrapping, overlapping ones), then a lookup.
    let json = serde_json::json!({
        "name": "h:1", "protocol": "tcp", "tcp_data_port": 2,
        "buffers": buffers.iter().map(|(a, l)| serde_json::json!({"name": "h:1", "addr": a, "length": l})).collect::<Vec<_>>(),
    });
    if let Ok(d) = MooncakeDescriptor::parse(json.to_string().as_bytes()) {
        if let Some(MooncakeBuffer { addr: base, length, .. }) = d.find(addr, len) {
            assert!(addr >= *base && addr.checked_add(len).is_some_and(|e| e <= base + length));
        }
    }
});
