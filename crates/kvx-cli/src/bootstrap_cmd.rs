//! `kvx bootstrap`: the standalone bootstrap server, with `/metrics` on the same port.

use anyhow::{Context, Result};
use kvx_bootstrap::http::{BootstrapServer, ServerConfig};

use crate::config::BootstrapArgs;
use crate::telemetry;

/// Serves until interrupted; returns the exit code.
pub fn run(args: BootstrapArgs) -> Result<i32> {
    telemetry::install_metrics();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let server = BootstrapServer::bind_with(
            (args.host.as_str(), args.port),
            ServerConfig::default(),
            telemetry::metrics_router(),
        )
        .await
        .context("binding the bootstrap server")?;
        eprintln!("kvx bootstrap: listening on http://{}", server.local_addr());
        server
            .run_until(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        anyhow::Ok(0)
    })
}
