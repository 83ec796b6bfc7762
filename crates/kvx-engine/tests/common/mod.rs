//! Helpers the engine tests share: free ports, a hang guard, a bootstrap server with a tiny
//! prefill rank registered.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvx_bootstrap::http::{BootstrapClient, BootstrapServer, RetryPolicy, ServerConfig};

/// A port free on loopback right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `f` every 50 ms until it holds; panics naming `what` after `guard`.
pub fn wait_until(guard: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < guard, "hang guard: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A bootstrap server on a free loopback port, and the port.
pub fn bootstrap_server(rt: &tokio::runtime::Runtime) -> (BootstrapServer, u16) {
    let server = rt
        .block_on(BootstrapServer::bind(
            ("127.0.0.1", 0),
            ServerConfig::default(),
        ))
        .unwrap();
    let port = server.local_addr().port();
    (server, port)
}

/// Registers rank 0 of a TP1 instance (page size 16) whose inbox is on `inbox_port` with the
/// bootstrap server on `port`.
pub fn register_tiny_rank(rt: &tokio::runtime::Runtime, port: u16, inbox_port: u16) {
    let reg = kvx_engine::engine::rank_registration((1, 0), 16, "auto", "127.0.0.1", inbox_port);
    let client = BootstrapClient::new("127.0.0.1", port).unwrap();
    rt.block_on(client.register_rank(&reg, &RetryPolicy::immediate(3, Duration::from_secs(5))))
        .unwrap();
}
