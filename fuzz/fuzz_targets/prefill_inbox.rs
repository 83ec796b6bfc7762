//! Fuzzes the prefill inbox classifier and every parser behind it, checking that whatever parses
//! re-encodes to an equal message (`kvx_bootstrap::codec::check::prefill_inbox`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|frames: Vec<Vec<u8>>| {
    let _ = kvx_bootstrap::codec::check::prefill_inbox(&frames);
});
