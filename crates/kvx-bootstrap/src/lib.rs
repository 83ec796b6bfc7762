//! # kvx-bootstrap
//!
//! sglang's PD-disaggregation control plane, wire-compatible: a sans-IO codec for every ZMQ
//! multipart message ([`codec`]), the HTTP bootstrap server and client ([`http`]), and the ZMQ
//! socket layer ([`sockets`]).
//!
//! The `net` cargo feature (on by default) builds [`http`] and [`sockets`] and pulls in their
//! dependencies (libzmq, axum, reqwest, tokio); with `default-features = false` only the
//! dependency-light [`codec`] is built, which is all the fuzz targets need.
//!
//! A prefill instance runs one [`http::BootstrapServer`]; each prefill rank registers its ZMQ
//! inbox there with [`http::BootstrapClient::register_rank`]; a decode asks for the topology
//! (the all-minus-one sentinel) and for the inbox of the ranks it needs, then talks ZMQ (this
//! example needs the `net` feature):
//!
#![cfg_attr(feature = "net", doc = "```")]
#![cfg_attr(not(feature = "net"), doc = "```ignore")]
//! use kvx_bootstrap::http::{
//!     BootstrapClient, BootstrapServer, RankRegistration, RetryPolicy, RouteQuery, ServerConfig,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default()).await?;
//! let client = BootstrapClient::new("127.0.0.1", server.local_addr().port())?;
//!
//! // Until every rank registered, decodes get 503.
//! assert!(client.prefill_info().await.unwrap_err().is_not_ready());
//!
//! let rank = RankRegistration {
//!     attn_tp_size: 1, attn_tp_rank: 0, attn_cp_size: 1, attn_cp_rank: 0,
//!     attn_dp_size: 1, attn_dp_rank: 0, pp_size: 1, pp_rank: 0,
//!     system_dp_size: 1, system_dp_rank: 0,
//!     rank_ip: "127.0.0.1".into(), rank_port: 17000,
//!     page_size: Some(16), kv_cache_dtype: Some("auto".into()),
//!     load_balance_method: None, enable_dsa_cache_layer_split: None,
//!     prefill_http_port: Some(30000),
//!     // sglang 0.5.23's keys (a sglang main prefill sends none of them):
//!     kv_layout: None, dsv41_spec_layout: None,
//!     enable_kv_cache_sharding: None, decode_allocation_policy: None,
//! };
//! client.register_rank(&rank, &RetryPolicy::sglang()).await?;
//!
//! let topology = client.prefill_info().await?;
//! assert_eq!((topology.attn_tp_size, topology.page_size), (1, Some(16)));
//! let inbox = client
//!     .rank_info(RouteQuery { dp_rank: 0, cp_rank: 0, tp_rank: 0, pp_rank: 0 })
//!     .await?;
//! assert_eq!(inbox.rank_port, 17000);
//! server.shutdown().await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## Stability
//!
//! Error enums (`CodecError`, `PackedError`, `SocketError`, `ClientError`,
//! `RegistrationConflict`) are `#[non_exhaustive]`: match them with a wildcard arm (or use their
//! `kind()` labels). The option structs (`InboxConfig`, `PushOptions`, `ServerConfig`) keep
//! public fields; build them from their constructor or `Default` and override fields with
//! `..` — a field added later comes with a default that keeps the old behaviour.

#![warn(missing_docs)]
// One `unsafe` block: registering an inbox socket's `ZMQ_FD` with tokio's reactor
// (`sockets/inbox.rs`).
#![deny(unsafe_code)]

pub mod codec;
#[cfg(feature = "net")]
pub mod http;
#[cfg(feature = "net")]
pub mod sockets;
