//! # kvx-cli
//!
//! The `kvx` binary's commands, as a library: `kvx prefill` ([`prefill_cmd`]: a prefill rank on a
//! synthetic model, registered with a bootstrap server, drained on SIGINT/SIGTERM, exiting with
//! sglang's dead-thread message when a transfer worker dies), `kvx decode` ([`decode`]: load on
//! a decode engine, every byte verified, a [`decode::Summary`]), `kvx bootstrap`
//! ([`bootstrap_cmd`]), the link tests `kvx send` / `kvx recv` ([`link`]) and `kvx demo`
//! ([`demo`]); the command line and config file ([`config`]), signals, drains and readiness
//! ([`lifecycle`]), logging and the Prometheus exporter ([`telemetry`]).
//!
//! The engines themselves — the prefill and decode ranks, their threads and tasks, the data plane
//! and the wire — are crate `kvx-engine`'s: this crate holds no engine logic of its own, only
//! what a command line adds around it (arguments, memory of its own, load generation, exit codes).
//!
//! ```
//! use kvx_cli::config::ModelArgs;
//! use kvx_cli::prefill_cmd::rank_registration;
//! use kvx_engine::model::ModelPreset;
//!
//! let model = ModelArgs {
//!     model: ModelPreset::Tiny,
//!     tp_size: 2,
//!     tp_rank: 1,
//!     page_size: 16,
//!     pool_pages: 256,
//!     kv_cache_dtype: "auto".into(),
//! };
//! // What `kvx prefill --tp-size 2 --tp-rank 1` PUTs on the bootstrap server's /route.
//! let reg = rank_registration(&model, "10.0.0.7", 17000);
//! assert_eq!((reg.attn_tp_size, reg.attn_tp_rank, reg.rank_port), (2, 1, 17000));
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod bootstrap_cmd;
pub mod config;
pub mod decode;
pub mod demo;
pub mod lifecycle;
pub mod link;
pub mod prefill_cmd;
pub mod telemetry;
pub mod validate;
