//! # kvx-rdma
//!
//! The data plane of kvx: one [`Transport`] trait and its backends. A side registers its memory
//! once ([`Transport::register`] → a [`RegionKey`]), publishes a [`SegmentDescriptor`] (endpoint
//! and regions), and a sender opens a [`Session`] to a peer and posts batches of one-sided writes
//! ([`kvx_core::TransferOp`]: local src, remote dst, len), each completing once with one result.
//!
//! Backends: `tcp` (the default, kvx's own framed protocol, see `docs/tcp-transport.md`),
//! `mooncake` (Mooncake Transfer Engine's P2P handshake and TCP transport, wire compatible with
//! the real engine, see `docs/mooncake-transport.md`), `local` (same process or same host
//! through `/dev/shm`: memcpy into the peer's registered memory), and `verbs` (RDMA, cargo
//! feature `verbs`).
//!
//! ```
//! use kvx_rdma::{RegionDesc, RegionKey, SegmentDescriptor};
//!
//! let d = SegmentDescriptor {
//!     endpoint: "10.0.0.2:17000".into(),
//!     regions: vec![RegionDesc { base: 0x10000, len: 4096, key: RegionKey(9) }],
//! };
//! let wire = d.encode();
//! assert_eq!(SegmentDescriptor::decode(&wire).unwrap(), d);
//! // The sender finds the key of the region containing each destination.
//! assert_eq!(d.find(0x10800, 256).unwrap().key, RegionKey(9));
//! assert!(d.find(0x10f00, 512).is_none());
//! ```
//!
//! ## What memory each backend accepts
//!
//! [`Transport::register`] takes a virtual address range of host memory of this process;
//! [`Transport::register_device`] one of device (GPU) memory, which the backend must never touch
//! with the CPU. What a backend accepts depends on who moves the bytes
//! ([`Transport::accepts_device_memory`] says whether device memory is among them):
//!
//! | backend | accepts | why |
//! |---|---|---|
//! | `tcp` | host memory | the kernel's socket calls read it on the sender and write it on the receiver |
//! | `mooncake` | host memory | the same over Mooncake TE's TCP transport; kvx's implementation has no CUDA copy path |
//! | `auto` | host memory | `mooncake` or `tcp` per peer |
//! | `local`, same process | host memory | plain `memcpy` between the two transports' registered ranges |
//! | `local` across processes (`shm` in `kvx`) | receiver: a `/dev/shm` file ([`ShmRegion`], [`LocalTransport::register_shm`]); sender: host memory | the sender maps the receiver's files and copies into them |
//! | `verbs` | host memory ([`Transport::register`]); device memory ([`Transport::register_device`]) with a GPUDirect-RDMA capable NIC | `ibv_reg_mr` pins the range and the NIC moves the bytes; a GPU pointer registers only where the kernel's peer-memory module resolves it (`nvidia-peermem`; kvx does not use dma-buf registration), else `ibv_reg_mr` fails with a registration error. Untested by kvx on such hardware |
//!
//! Host memory means ordinary pageable or pinned memory of this process (heap, `mmap`, a serving
//! stack's host KV pool). On every backend but `verbs` the CPU moves the bytes:
//! `register_device` refuses there with [`TransportError::DeviceMemoryUnsupported`] (naming the
//! backend) without touching the range, and a device pointer given to `register` is undefined
//! behaviour, not an error. On `verbs` nothing forms a CPU pointer into a device registration:
//! the NIC reads it through the work requests' SGE lists, and a work request from it is never
//! sent inline (the one CPU copy the backend makes). Every remote address is bounds-checked
//! against a registered region, device or host, before a work request is built. Registration
//! never copies: the range is used in place until [`Transport::deregister`] returns.
//!
//! A decode-side receiver and a prefill-side sender over the tcp backend:
//!
//! ```
//! use kvx_core::TransferOp;
//! use kvx_rdma::{TcpConfig, TcpTransport, Transport};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let rt = tokio::runtime::Runtime::new()?;
//! let mut kv = vec![0u8; 4096]; // decode memory
//! let mut pages = vec![7u8; 4096]; // prefill memory
//! rt.block_on(async {
//!     let decode = TcpTransport::bind("127.0.0.1:0", TcpConfig::default()).await?;
//!     let prefill = TcpTransport::client(TcpConfig::default());
//!     // SAFETY: both buffers outlive the transports (dropped at the end of this block).
//!     unsafe {
//!         decode.register(kv.as_mut_ptr() as u64, 4096)?;
//!         prefill.register(pages.as_mut_ptr() as u64, 4096)?;
//!     }
//!     // The decode publishes `decode.endpoint()` as its session id; the prefill connects to it.
//!     let session = prefill.connect(&decode.endpoint()).await?;
//!     let op = TransferOp::new(pages.as_ptr() as u64, kv.as_ptr() as u64 + 1024, 512);
//!     let report = session.write_batch(vec![op]).await?;
//!     assert_eq!(report.bytes, 512);
//!     Ok::<_, kvx_rdma::TransportError>(())
//! })?;
//! assert_eq!(&kv[1024..1536], &[7u8; 512][..]);
//! assert_eq!(kv[1023], 0);
//! # Ok(())
//! # }
//! ```
//!
//! ## Stability
//!
//! [`TransportError`], [`RejectReason`] and the backends' error enums (`DescriptorError`,
//! `HostFileError`, the tcp and Mooncake wire and handshake errors, `VerbsError`) are
//! `#[non_exhaustive]`: match them with a wildcard arm that treats an unknown cause as a generic
//! failure, or use [`TransportError::label`]. The config structs ([`TcpConfig`],
//! [`MooncakeConfig`], `VerbsConfig`) keep public fields; build them as
//! `TcpConfig { max_connections: 64, ..TcpConfig::default() }` — a field added later comes with a
//! default that keeps the old behaviour, so such code keeps compiling.

#![warn(missing_docs)]

pub mod auto;
mod batch;
mod conn_limit;
pub mod error;
pub mod instance;
pub mod local;
pub mod mem;
pub mod mooncake;
pub mod place;
pub mod segment;
mod session_cache;
pub mod shm;
pub mod tcp;
pub mod transport;
#[cfg(feature = "verbs")]
pub mod verbs;

pub use auto::{AutoTransport, PeerKind};
pub use error::{RejectReason, TransportError};
pub use local::LocalTransport;
pub use mooncake::{MooncakeConfig, MooncakeTransport};
pub use place::Placement;
pub use segment::{DescriptorError, RegionDesc, RegionKey, SegmentDescriptor};
pub use shm::ShmRegion;
pub use tcp::{SharedSecret, TcpConfig, TcpTransport};
pub use transport::{BatchReport, BoxFuture, Session, Transport, write_to};
