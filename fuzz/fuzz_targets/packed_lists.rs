//! Fuzzes the packed-int-lists decoder for each element width and checks byte-exact re-encoding
//! (`kvx_bootstrap::codec::check::packed_lists`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvx_bootstrap::codec::check::packed_lists(data);
});
