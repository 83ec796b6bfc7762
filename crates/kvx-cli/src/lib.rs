//! # kvx-cli
//!
//! The runnable side of kvx: the tokio/thread drivers that wire `kvx-core`, `kvx-bootstrap` and
//! the data plane into a running prefill sender ([`engine`], embeddable as a library) and a
//! decode peer ([`decode`], embeddable as [`decode::engine::DecodeEngine`]), heterogeneous-TP
//! staging through the decode's ring on both sides ([`prefill_staging`], [`decode_staging`]),
//! worker supervision with sglang's dead-thread message made true ([`worker`], [`fault`]),
//! metrics export ([`telemetry`]) and the `kvx` binary's commands.
//!
//! ```
//! use kvx_cli::model::{self, ModelPreset};
//!
//! // Llama-3-8B at TP1 carries 128 KiB of KV per token.
//! let layout = ModelPreset::Llama3_8b.layout(1, 0, 16, 64);
//! assert_eq!(layout.bytes_per_page(), 16 * 128 * 1024);
//!
//! // The decode checks every byte against the pattern the prefill wrote.
//! let mut page = vec![0u8; 4096];
//! model::fill_page(&mut page, 42, 0, 3);
//! assert!(model::check_page(&page, 42, 0, 3));
//! assert!(!model::check_page(&page, 43, 0, 3));
//! ```
//!
//! ## Stability
//!
//! Error enums (`EngineError`, `StagingError`, `LifecycleError`, `BackendError`, `WorkerFault`,
//! the config errors) are `#[non_exhaustive]`. The engines' events
//! ([`engine::EngineEvent`], [`decode::engine::DecodeEngineEvent`]) are not: an embedder must act
//! on each (pages come back through them), so a new one is a breaking change by design. Config
//! structs keep public fields; build them from their constructor or `Default` and override fields
//! with `..` — a field added later comes with a default that keeps the old behaviour.

#![warn(missing_docs)]

pub mod bootstrap_cmd;
pub mod config;
pub mod decode;
pub mod decode_staging;
pub mod demo;
pub mod engine;
pub mod fault;
pub mod forward;
pub mod lifecycle;
pub mod link;
pub mod model;
pub mod pages;
pub mod plane;
pub mod prefill_cmd;
pub mod prefill_staging;
pub mod region;
pub mod telemetry;
pub mod validate;
pub mod wire;
pub mod worker;
