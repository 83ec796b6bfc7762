//! # kvx-bootstrap
//!
//! sglang's PD-disaggregation control plane, wire-compatible: a sans-IO codec for every ZMQ
//! multipart message ([`codec`]), the HTTP bootstrap server and client ([`http`]), and the ZMQ
//! socket layer ([`sockets`]).

pub mod codec;
pub mod http;
pub mod sockets;
