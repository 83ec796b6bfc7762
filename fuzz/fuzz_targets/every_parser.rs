//! Runs every individual message parser over the same frames, whatever frame 0 says, checking
//! encode/parse agreement (`kvx_bootstrap::codec::check::every_parser`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|frames: Vec<Vec<u8>>| {
    kvx_bootstrap::codec::check::every_parser(&frames);
});
