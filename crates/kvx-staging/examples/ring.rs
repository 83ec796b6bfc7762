//! The decode's staging ring as a prefill sees it: chunks get placements in rounds, a placement
//! of a later round is writable only once the watermark (the oldest live allocation) has moved
//! past it, and an oversized chunk is refused.
//!
//! Run with `cargo run -p kvx-staging --example ring`.

use kvx_staging::StagingRing;

fn main() {
    let mut ring = StagingRing::new(1000);
    let (a, pa) = ring.assign(400).expect("fits");
    let (b, pb) = ring.assign(400).expect("fits");
    // Only 200 bytes are left before the end: the third chunk wraps into round 1 at offset 0,
    // over bytes chunk `a` still holds.
    let (_c, pc) = ring.assign(300).expect("fits the ring");
    println!("a: {pa:?}\nb: {pb:?}\nc: {pc:?}");
    assert!(pc.overlaps(&pa));

    // Before `a` is freed, the watermark says its bytes are still live: `c` must wait.
    let wm = ring.free(b).expect("b was live");
    println!("after freeing b: {wm:?}, c writable: {}", wm.admits(&pc));
    assert!(!wm.admits(&pc));
    let wm = ring.free(a).expect("a was live");
    println!("after freeing a: {wm:?}, c writable: {}", wm.admits(&pc));
    assert!(wm.admits(&pc));

    // A chunk larger than the whole ring can never be placed (sglang's wire value -2).
    assert!(ring.assign(1001).is_err());
    println!("a 1001-byte chunk is refused by a 1000-byte ring");
}
