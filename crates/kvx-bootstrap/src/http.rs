//! The HTTP bootstrap service of a prefill instance, wire-compatible with sglang's (spec §1.2):
//! the deterministic rank/dp-rank registry ([`registry`]), the axum server that exposes it
//! ([`server`]), the reqwest client that prefill and decode ranks use against it ([`client`]),
//! and the JSON shapes both sides exchange ([`types`]).

pub mod client;
pub mod pyjson;
pub mod registry;
pub mod server;
pub mod types;

pub use client::{BootstrapClient, ClientError, Registration, RetryPolicy, tcp_alive};
pub use registry::{RegisteredRank, RegistrationConflict, Registry, RouteAnswer, RouteQuery};
pub use server::{BootstrapServer, BootstrapState, ServerConfig};
pub use types::{PrefillServerInfo, RankInfo, RankRegistration};
