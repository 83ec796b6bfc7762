//! The `kvx` binary.

fn main() {
    println!("kvx: the demo is not built yet (see issue 6)");
}
