//! Fuzzes the mooncake backend's handshake-port parsing: frame decoding (typed and old-protocol
//! frames, length limits), reply checking and the strict segment-descriptor parser. Whatever
//! parses must re-encode to something that parses to the same value.
#![no_main]

use kvx_rdma::mooncake::MooncakeDescriptor;
use kvx_rdma::mooncake::handshake::{self, RequestType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((frame, used)) = handshake::decode_frame(data) {
        assert!(used <= data.len());
        assert_eq!(handshake::encode_frame(frame.kind, frame.json), &data[..used]);
        let _ = handshake::check_json(frame.json);
        if let Ok(d) = MooncakeDescriptor::parse(frame.json) {
            assert_eq!(MooncakeDescriptor::parse(d.to_json().as_bytes()), Ok(d.clone()));
            for w in d.buffers.windows(2) {
                assert!(w[0].addr + w[0].length <= w[1].addr);
            }
        }
    }
    let _ = handshake::parse_reply(data, RequestType::Metadata);
    if let Ok(d) = MooncakeDescriptor::parse(data) {
        let again = MooncakeDescriptor::parse(d.to_json().as_bytes());
        assert_eq!(again, Ok(d));
    }
});
