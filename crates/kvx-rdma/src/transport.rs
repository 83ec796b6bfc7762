//! The `Transport` trait every data-plane backend implements (tcp, local, verbs).
//!
//! The model is RDMA's: a side registers its memory once and gets a key per region; it publishes
//! a [`SegmentDescriptor`] (endpoint + regions + keys); a sender opens a [`Session`] to a peer
//! (named by its endpoint string, `host:port` for tcp), which hands back the peer's descriptor,
//! and then posts batches of one-sided writes ([`TransferOp`]: local src, remote dst, len). Each
//! batch completes once, with one result. Registration never happens per transfer.
//!
//! Both traits are object safe (futures are boxed) so a driver can hold an `Arc<dyn Transport>`
//! chosen at run time and share sessions (`Arc<dyn Session>`) between tasks.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvx_core::TransferOp;

use crate::error::TransportError;
use crate::place::Placement;
use crate::segment::{RegionKey, SegmentDescriptor};

/// A boxed, sendable future (what the object-safe traits return).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a completed batch moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Number of ops in the batch.
    pub ops: u64,
    /// Bytes written to the peer.
    pub bytes: u64,
}

/// A data-plane backend: memory registration, the local descriptor, sessions to peers.
pub trait Transport: Send + Sync + 'static {
    /// The backend's name (`"tcp"`, `"local"`, `"verbs"`).
    fn kind(&self) -> &'static str;

    /// Registers `[addr, addr + len)` so that peers may write into it (and so that it may be
    /// used as a source). Returns the region's key. Regions may not overlap.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be memory of this process that stays allocated, readable and
    /// writable until [`Transport::deregister`] returns and no batch that touches it is still
    /// in flight. The transport reads from it and writes into it from other threads at any time
    /// while it is registered; the caller must not rely on its contents while a peer may write.
    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError>;

    /// True when [`Transport::register_device`] can succeed on this backend: only `verbs`,
    /// whose NIC moves the bytes (with GPUDirect RDMA). Every other backend reads and writes
    /// registered bytes with the CPU.
    fn accepts_device_memory(&self) -> bool {
        false
    }

    /// Registers `[addr, addr + len)` of device (GPU) memory, as [`Transport::register`] does
    /// host memory: the backend must never form a CPU pointer into it, read, write or zero it.
    /// The default refuses with [`TransportError::DeviceMemoryUnsupported`] without touching
    /// the range; `verbs` overrides it (`ibv_reg_mr` on the device pointer, which needs a
    /// GPUDirect-RDMA capable NIC and the kernel's peer-memory module, `nvidia-peermem`).
    /// Every remote address is still bounds-checked against the registered regions.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be device memory of this process (a CUDA allocation, say) that
    /// stays allocated until [`Transport::deregister`] returns and no batch that touches it is
    /// still in flight; the NIC reads and writes it at any time while it is registered.
    unsafe fn register_device(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        let _ = (addr, len);
        Err(TransportError::DeviceMemoryUnsupported {
            backend: self.kind(),
        })
    }

    /// Forgets a region: later writes naming its key are rejected.
    fn deregister(&self, key: RegionKey) -> Result<(), TransportError>;

    /// The local descriptor: endpoint and the currently registered regions.
    fn descriptor(&self) -> SegmentDescriptor;

    /// The string peers use to reach this side (what a decode publishes as its session id).
    fn endpoint(&self) -> String;

    /// Payload bytes peers have written into this side's regions, where the backend counts
    /// them (`tcp`, `mooncake`); `None` where it does not.
    fn bytes_received(&self) -> Option<u64> {
        None
    }

    /// Places `[addr, addr + map.len())` of a registered region: writes this transport's own
    /// receive threads take into it land where `map` says instead (see [`crate::place`]).
    /// `Ok(false)`: this backend's writes bypass a receiver (RDMA, shared memory) or it does not
    /// route them, so they land in the range as usual (the default).
    fn place(&self, addr: u64, map: Arc<dyn Placement>) -> Result<bool, TransportError> {
        let _ = (addr, map);
        Ok(false)
    }

    /// Ends a placement made by [`Transport::place`]; returns the payload bytes received
    /// through it (`None` where there was none).
    fn unplace(&self, addr: u64) -> Option<u64> {
        let _ = addr;
        None
    }

    /// Opens (or reuses) a session to the peer at `peer`, handshaking to learn its descriptor.
    fn connect<'a>(
        &'a self,
        peer: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Session>, TransportError>>;
}

/// A live association with one peer: post batches of writes into its registered memory.
pub trait Session: Send + Sync + 'static {
    /// The peer as it was named in [`Transport::connect`].
    fn peer(&self) -> &str;

    /// The peer's descriptor as learnt in the handshake.
    fn remote(&self) -> &SegmentDescriptor;

    /// Posts one batch of writes and resolves once all of them are in the peer's memory (or the
    /// batch failed). Every `src` range must be inside a locally registered region and every
    /// `dst` range inside one of the peer's regions; otherwise the batch fails before any byte
    /// moves. Batches of any size are accepted; the backend bounds what is in flight.
    fn write_batch(
        &self,
        ops: Vec<TransferOp>,
    ) -> BoxFuture<'static, Result<BatchReport, TransportError>>;

    /// False once the session is known to be broken (its peer lost); a later
    /// [`Transport::connect`] then opens a fresh one.
    fn is_alive(&self) -> bool;

    /// True when writes whose sources lie scattered in small pieces cost this session about
    /// what one write of the same bytes gathered together would: it gathers them itself on the
    /// way out (kvx's `tcp`: vectored socket writes straight from registered memory). A caller
    /// may then write such pieces as they lie instead of copying them together first. False
    /// (the default) where each write has a cost of its own (an RDMA work request, a Mooncake
    /// TE request).
    fn gathers_sources(&self) -> bool {
        false
    }
}

/// Convenience: connect (or reuse) and post one batch.
pub async fn write_to(
    transport: &dyn Transport,
    peer: &str,
    ops: Vec<TransferOp>,
) -> Result<BatchReport, TransportError> {
    let session = transport.connect(peer).await?;
    session.write_batch(ops).await
}
