//! The RDMA verbs backend (cargo feature `verbs`, built on `sideway`).
//!
//! The backend writes KV pages with RDMA WRITE over reliable-connected (RC) queue pairs, several
//! per peer. It is split in two halves:
//!
//! - **Decisions, device-free and unit-tested everywhere**: [`regions`] (every local and remote
//!   range resolved to a registered region and its key before a work request is built),
//!   [`plan`] (ops → work requests: SGE packing, slicing, inlining), [`sendq`] (one queue pair's
//!   send window, selective signalling, completion attribution) and [`sched`] (a peer's
//!   work requests spread over its queue pairs, batch accounting, error attribution to the
//!   affected batch only), [`handshake`] (the queue-pair handshake payload) and [`error`] (the
//!   typed errors, including the "no device" errno mapping).
//! - **Thin device drivers** that only move data between those decisions and libibverbs:
//!   [`device`] (discovery, protection domain, memory registration), [`qp`] (queue pair
//!   creation and the INIT → RTR → RTS transitions), [`post`] (chained work requests posted
//!   with one doorbell through the extended verbs), [`cq`] (completion polling driven by the
//!   completion channel's file descriptor in tokio).
//! - **Glue**: [`session`] (one peer's driver task: plan on the caller, post what the scheduler
//!   hands out, feed completions back, answer each batch once; it talks to the hardware only
//!   through the [`path`] seam, so it is tested against a simulated NIC here) and [`engine`]
//!   ([`VerbsTransport`], the crate's `Transport`: registration, descriptor, sessions), with
//!   [`hello`] (the queue-pair handshake over TCP, framed with the tcp backend's hello) and
//!   [`listener`] (the receiving side: accept handshakes, hold the peers' queue pairs).
//!
//! Invariants: no work request carries an address that was not resolved inside a registered
//! region (local: lkey table; remote: the regions the peer advertised); the send window of a
//! queue pair never exceeds its depth and never ends in an unsignalled work request; a failed
//! work request fails its own batch only, flushed ones are re-posted on the peer's other queue
//! pairs; a batch is answered once, after none of its work requests is still on the wire.
//!
//! sideway loads libibverbs with `dlopen`, so a binary built with the feature runs on hosts
//! without rdma-core: discovery then reports [`VerbsError::NoDevice`] (ENOSYS when the kernel
//! has no verbs support, EOPNOTSUPP when libibverbs is missing, ENODEV or an empty list).
//!
//! The decisions run anywhere; for instance, planning a fragmented batch and scheduling it over
//! two queue pairs:
//!
//! ```
//! use kvx_core::TransferOp;
//! use kvx_rdma::verbs::{Limits, PeerScheduler, Region, RegionTable, SchedConfig, plan_writes};
//!
//! let local = RegionTable::from_regions(vec![Region { base: 0x10000, len: 1 << 20, key: 1 }])?;
//! let remote = RegionTable::from_regions(vec![Region { base: 0x900000, len: 1 << 20, key: 2 }])?;
//! // eight 4 KiB pages: contiguous destination, every other source page
//! let ops: Vec<TransferOp> = (0..8)
//!     .map(|i| TransferOp::new(0x10000 + i * 8192, 0x900000 + i * 4096, 4096))
//!     .collect();
//! let limits = Limits { max_sge: 4, max_inline: 0, max_wr_bytes: 1 << 20 };
//! let plan = plan_writes(&ops, &local, &remote, limits)?;
//! assert_eq!(plan.wrs.len(), 2); // 4 SGEs per work request
//! assert_eq!(plan.total_bytes(), 8 * 4096);
//!
//! let mut sched = PeerScheduler::new(SchedConfig::default(), vec![0x11, 0x12]);
//! assert!(sched.submit(1, plan.wrs.len() as u32).is_none());
//! let posts = sched.schedule();
//! assert_eq!(posts.len(), 2); // one work request on each queue pair, each signalled
//! assert!(posts.iter().all(|p| p.items.iter().all(|i| i.signaled)));
//! let mut done = Vec::new();
//! for p in &posts {
//!     done.extend(sched.on_completion(p.qp, p.items[0].wr_id, 0, 0));
//! }
//! assert_eq!(done, vec![(1, Ok(()))]);
//! # Ok::<(), kvx_rdma::verbs::VerbsError>(())
//! ```
//!
//! # Running the hardware tests
//!
//! The tests in `crates/kvx-rdma/tests/verbs_*.rs` need a verbs device (a ConnectX NIC, or
//! Soft-RoCE on a kernel with `rdma_rxe`) and rdma-core (`apt install rdma-core libibverbs1
//! ibverbs-providers`). Name the device and run:
//!
//! ```text
//! ibv_devices                                   # find the name, e.g. mlx5_0 or rxe0
//! KVX_RDMA_DEVICE=mlx5_0 cargo test -p kvx-rdma --features verbs --test verbs_hw -- --nocapture
//! # optional: KVX_RDMA_PORT (default 1), KVX_RDMA_GID_INDEX (default: first RoCE v2 GID, else 0)
//! ```
//!
//! Without `KVX_RDMA_DEVICE` each hardware test prints why it skipped and passes.

pub mod cq;
pub mod device;
pub mod engine;
pub mod error;
pub mod handshake;
pub mod hello;
pub mod listener;
pub mod path;
pub mod plan;
pub mod post;
pub mod qp;
pub mod regions;
pub mod sched;
pub mod sendq;
pub mod session;

pub use device::{DeviceConfig, VerbsDevice, discover};
pub use engine::{VerbsConfig, VerbsTransport};
pub use error::VerbsError;
pub use handshake::{QpInfo, VerbsHandshake};
pub use path::{DevicePath, LocalKeys, SendPath};
pub use plan::{Limits, WritePlan, plan_writes};
pub use regions::{Region, RegionTable};
pub use sched::{PeerScheduler, SchedConfig};
pub use session::VerbsSession;
