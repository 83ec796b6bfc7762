//! `kvx bootstrap`: the standalone bootstrap server, with `/metrics` and `/ready` on the same
//! port. SIGINT/SIGTERM stop it gracefully (open requests answered, within
//! `--shutdown-timeout`); a second signal exits at once.

use anyhow::{Context, Result};
use kvx_bootstrap::http::{BootstrapServer, ServerConfig};

use crate::config::BootstrapArgs;
use crate::lifecycle::{Readiness, Signals};
use crate::{telemetry, validate};

/// Serves until a signal; returns the exit code.
pub fn run(args: BootstrapArgs) -> Result<i32> {
    telemetry::install_metrics();
    let stop = Signals::install("bootstrap")?;
    let ready = Readiness::new("starting");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let timeout = validate::duration(args.lifecycle.shutdown_timeout);
    rt.block_on(async {
        let (host, port) = (args.host.as_str(), args.port);
        let server = BootstrapServer::bind_with(
            (host, port),
            ServerConfig {
                rank_health_interval: Some(validate::duration(args.rank_health_interval)),
                ..ServerConfig::default()
            },
            telemetry::metrics_router().merge(ready.router()),
        )
        .await
        .with_context(|| format!("--port {port}: binding the bootstrap server on {host}:{port}"))?;
        ready.set_ready();
        eprintln!(
            "kvx bootstrap: listening on http://{} (/route, /health, /ready, /metrics)",
            server.local_addr()
        );
        let sig = stop.wait().await;
        ready.set_draining();
        eprintln!("kvx bootstrap: {sig}: stopping");
        if tokio::time::timeout(timeout, server.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("bootstrap server: requests still open after --shutdown-timeout");
        }
        anyhow::Ok(0)
    })
}
