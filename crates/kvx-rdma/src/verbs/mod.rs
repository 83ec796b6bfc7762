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
//!
//! sideway loads libibverbs with `dlopen`, so a binary built with the feature runs on hosts
//! without rdma-core: discovery then reports [`VerbsError::NoDevice`] (ENOSYS when the kernel
//! has no verbs support, EOPNOTSUPP when libibverbs is missing, ENODEV or an empty list).
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
pub use plan::{Limits, WritePlan, plan_writes};
pub use regions::{Region, RegionTable};
pub use sched::{PeerScheduler, SchedConfig};
