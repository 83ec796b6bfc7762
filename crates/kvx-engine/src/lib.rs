//! # kvx-engine
//!
//! kvx's embeddable engines: one [`engine::PrefillEngine`] is one prefill rank of sglang's
//! Mooncake connector (the sender), one [`decode::engine::DecodeEngine`] is one decode rank (the
//! receiver), each over memory its embedder owns and registers by address and length. They are
//! the drivers of `kvx-core`'s deterministic room managers: threads and tokio tasks that own the
//! sockets (`kvx-bootstrap`'s ZMQ inbox and outbox, its HTTP bootstrap client), the data plane
//! (`kvx-rdma`: kvx tcp, Mooncake TE's TCP, RDMA verbs, same-host shared memory) and the clock,
//! and feed what happens to the managers. The `kvx` binary (crate `kvx-cli`) is one user of this
//! crate among others.
//!
//! - [`engine`]: the prefill rank — one owner loop (which also sends the statuses) performing
//!   what the rank's sans-IO [`prefill_core`] decides, transfer [`worker`]s, heterogeneous-TP
//!   staging through the decode's ring ([`prefill_staging`]); the contract for caller-owned
//!   memory is in its module docs.
//! - [`decode`]: the decode rank — bootstrap resolution, registration per prefill rank, metadata
//!   per room, heartbeats, rank watching, waiting timeout with `ABORT`, deferred page release,
//!   staging scatter ([`decode_staging`]).
//! - [`region`]: registered memory (the engine's own or the caller's, host or device);
//!   [`memory`]: what the engines accept (device KV with `verbs`, host aux rows, staging over
//!   host KV only); [`plane`]: the backend choice and the data plane a rank registers its
//!   memory with; [`wire`]: the control messages
//!   as both ranks parse and build them; [`fault`]: the dead-worker error and exit code.
//! - [`model`], [`pages`], [`synthetic`]: model shapes, a page allocator and a synthetic forward
//!   pass with a byte pattern a decode can check — for tests, examples and benchmarks.
//!
//! A prefill rank over caller-owned memory (runs as a doc test; the rooms would be served to a
//! decode that resolves this rank through a bootstrap server — see `examples/embed.rs` for both
//! sides in one process):
//!
//! ```
//! use std::sync::Arc;
//! use kvx_core::{KVPoll, Room};
//! use kvx_engine::engine::{PrefillConfig, PrefillEngine, PrefillMemory};
//! use kvx_engine::region::Region;
//!
//! // The serving stack's own pools: one layer (K and V, 32 pages of 4 KiB each) and one aux
//! // buffer of 8-byte rows.
//! let mut kv_pool = vec![0u8; 2 * 32 * 4096];
//! let mut aux_pool = vec![0u8; 64 * 8];
//! // SAFETY: both vectors are host memory that outlives the engine (dropped at the end of the
//! // example, after the engine), and nothing else references them while it runs.
//! let (kv, aux) = unsafe {
//!     (
//!         Region::from_raw(kv_pool.as_mut_ptr() as u64, kv_pool.len()).unwrap(),
//!         Region::from_raw(aux_pool.as_mut_ptr() as u64, aux_pool.len()).unwrap(),
//!     )
//! };
//! let (kv, aux) = (Arc::new(kv), Arc::new(aux));
//! let kv_ptrs = vec![kv.base(), kv.base() + 32 * 4096];
//! let mem = PrefillMemory::new(kv, kv_ptrs, 4096, aux.clone(), vec![aux.base()], vec![8]);
//!
//! let rt = tokio::runtime::Runtime::new()?;
//! let engine = PrefillEngine::start(PrefillConfig::default(), mem, rt.handle().clone())?;
//! let room = Room::new(42).unwrap();
//! engine.open_room(room)?; // the request arrived
//! engine.init_room(room, 2, 0)?; // 2 pages, aux row 0
//! // No decode sent metadata yet: the room waits for it.
//! assert_eq!(engine.poll(room), Some(KVPoll::Bootstrapping));
//! // What this rank would PUT on the bootstrap server's /route.
//! assert_eq!(engine.rank_registration("auto").rank_port, engine.endpoint().port);
//! assert!(engine.shutdown(), "every engine thread let go of the memory");
//! drop(engine);
//! drop((kv_pool, aux_pool));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Features
//!
//! `verbs` (default): the RDMA verbs backend (libibverbs is dlopened at run time, so the build
//! runs on hosts without it). `failpoints`: named failpoints in the transfer workers
//! (`FAILPOINTS` env var). `clap`: `clap::ValueEnum` for [`plane::Backend`] and
//! [`model::ModelPreset`].
//!
//! ## Stability
//!
//! Error enums (`EngineError`, `StagingError`, `BackendError`, `WorkerFault`, `AuxError`,
//! `AccessError`, `MemoryError`) and
//! [`decode::engine::DecodeStats`] are `#[non_exhaustive]`. The engines' events
//! ([`engine::EngineEvent`], [`decode::engine::DecodeEngineEvent`]) are not: an embedder must act
//! on each (pages come back through them), so a new one is a breaking change by design. Config
//! structs keep public fields; build them from their constructor or `Default` and override fields
//! with `..` — a field added later comes with a default that keeps the old behaviour.

#![warn(missing_docs)]

mod busy;
pub mod decode;
pub mod decode_staging;
pub mod engine;
pub mod fault;
pub mod memory;
pub mod model;
pub mod pages;
pub mod plane;
pub mod prefill_core;
pub mod prefill_staging;
pub mod region;
pub mod synthetic;
pub mod timeline;
pub mod wire;
pub mod worker;
