//! Fuzzes the metadata parser deep past its room: frame 0 is always a decimal room built from
//! the fuzzer's integer (0 and out-of-range values included), the fuzzer supplies the rest.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, Vec<Vec<u8>>)| {
    let (room, rest) = input;
    let mut frames = Vec::with_capacity(rest.len() + 1);
    frames.push(room.to_string().into_bytes());
    frames.extend(rest);
    let _ = kvx_bootstrap::codec::check::prefill_inbox(&frames);
    let _ = kvx_bootstrap::codec::check::decode_inbox(&frames);
});
