//! Fuzzes the registration parser deep past its tag: frame 0 is always `None`, the fuzzer
//! supplies frames 1 onwards.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|rest: Vec<Vec<u8>>| {
    let mut frames = Vec::with_capacity(rest.len() + 1);
    frames.push(b"None".to_vec());
    frames.extend(rest);
    let _ = kvx_bootstrap::codec::check::prefill_inbox(&frames);
    kvx_bootstrap::codec::check::every_parser(&frames);
});
