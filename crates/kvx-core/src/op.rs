//! Transfer ops: the `(src, dst, len)` triples the planner produces and transports execute.
//!
//! Addresses are plain integers (virtual addresses, as sglang publishes them on the wire); a
//! transport turns them into pointers only after checking them against a registered region.

/// One one-sided write: copy `len` bytes from local address `src` to remote address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferOp {
    /// Local (prefill) source address.
    pub src: u64,
    /// Remote (decode) destination address.
    pub dst: u64,
    /// Number of bytes.
    pub len: u64,
}

impl TransferOp {
    /// A new op.
    pub const fn new(src: u64, dst: u64, len: u64) -> Self {
        TransferOp { src, dst, len }
    }

    /// Total bytes of a slice of ops.
    pub fn total_bytes(ops: &[TransferOp]) -> u64 {
        ops.iter().map(|o| o.len).sum()
    }
}
