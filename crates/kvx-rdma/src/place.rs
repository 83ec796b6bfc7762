//! Placements: a range of a registered region whose incoming writes a receiver lands elsewhere.
//!
//! A decode that stages heterogeneous-TP chunks hands a prefill a range of its staging ring to
//! write a block into, and then copies the block out of the ring into its KV pages. When the
//! decode's own receive thread moves the bytes (the `tcp` backend), it can read the block
//! straight into the pages instead: the decode places the ring range
//! ([`Transport::place`](crate::Transport::place)) with a [`Placement`] that names, for any
//! byte range of the block, where those bytes belong. The wire is unchanged — the prefill still writes the ring addresses it was given — and writes that
//! bypass a receiver (RDMA, shared memory, another backend) land in the ring as before; how many
//! bytes went through the placement ([`Transport::unplace`](crate::Transport::unplace)) tells the
//! two apart.
//!
//! Every destination range a placement names is checked by the region table against the
//! placement's declared bounds, which must lie inside one registered region, before a byte is
//! received into it; the receiver holds that region's lease like any other.

/// Where the bytes of a placed range belong (see the module docs).
pub trait Placement: Send + Sync + 'static {
    /// Length of the placed range.
    fn len(&self) -> u64;

    /// True for an empty range (never placed).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The lowest and one-past-highest address of any destination range: must lie inside one
    /// registered region.
    fn bounds(&self) -> (u64, u64);

    /// Calls `f(addr, len)` for the destination ranges of bytes `[off, off + len)` of the placed
    /// range, in order; returns the bytes mapped (less than `len` only past the range's end).
    /// The region table trusts neither the count nor the ranges: it cuts them to the bytes it
    /// asked for, checks each against [`Placement::bounds`], and rejects the rest.
    fn pieces(&self, off: u64, len: u64, f: &mut dyn FnMut(u64, u64)) -> u64;
}
