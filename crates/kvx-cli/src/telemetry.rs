//! Logs and metrics: the tracing subscriber (`RUST_LOG`) and the Prometheus recorder whose text
//! is served at `/metrics` on the HTTP port.

use std::sync::OnceLock;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the tracing subscriber: `RUST_LOG` if set, else `default` (e.g. `"info"`).
pub fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn install_metrics() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| match PrometheusBuilder::new().install_recorder() {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "metrics recorder not installed");
                None
            }
        })
        .clone()
}

/// The Prometheus text of every metric recorded so far.
pub fn render() -> String {
    install_metrics().map(|h| h.render()).unwrap_or_default()
}

/// A router serving `GET /metrics`.
pub fn metrics_router() -> Router {
    Router::new().route(
        "/metrics",
        get(|| async {
            (
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                render(),
            )
                .into_response()
        }),
    )
}

/// Serves `/metrics` alone on `addr` (when the bootstrap server runs elsewhere).
pub async fn serve_metrics(addr: std::net::SocketAddr) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, metrics_router()).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(local)
}
