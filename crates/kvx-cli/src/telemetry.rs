//! Logs and metrics: the tracing subscriber (`RUST_LOG`; plain text without colour codes unless
//! stderr is a terminal, or one JSON object per line) and the Prometheus recorder whose text is
//! served at `/metrics`.
//!
//! The recorder is installed once per process with HELP text for every series kvx records
//! ([`SERIES`]), buckets for every `_seconds` histogram ([`LATENCY_BUCKETS`]), `kvx_build_info`,
//! and, per side ([`zero_counters`]), the failure counters an operator alerts on registered at
//! zero, so that a rate over them exists before the first failure.

use std::io::IsTerminal as _;
use std::sync::OnceLock;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (coloured only when stderr is a terminal).
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields).
    Json,
}

/// Installs the tracing subscriber: `RUST_LOG` if set, else `default` (e.g. `"info"`), on
/// stderr in `format`. Colour codes only go to a terminal.
pub fn init_tracing(default: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}

/// Bucket bounds (seconds) of every `*_seconds` histogram: 100 µs to 5 min.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Kind of a series (for its `describe_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A counter.
    Counter,
    /// A gauge.
    Gauge,
    /// A histogram.
    Histogram,
}

/// Every series kvx records, with its HELP text.
pub const SERIES: &[(&str, Kind, &str)] = &[
    // prefill engine
    (
        "kvx_build_info",
        Kind::Gauge,
        "Always 1; labels: version of the kvx binary",
    ),
    ("kvx_rooms", Kind::Gauge, "Prefill rooms held, by state"),
    (
        "kvx_rooms_finished_total",
        Kind::Counter,
        "Prefill rooms concluded, by final status",
    ),
    (
        "kvx_room_failures_total",
        Kind::Counter,
        "Prefill rooms that failed (any reason)",
    ),
    (
        "kvx_room_latency_seconds",
        Kind::Histogram,
        "Prefill room latency: last chunk handed over to the room's status sent",
    ),
    (
        "kvx_status_sent_total",
        Kind::Counter,
        "Status messages sent to decodes, by status",
    ),
    (
        "kvx_status_reason_frames_total",
        Kind::Counter,
        "Status 0 messages sent with the reason as a 4th frame",
    ),
    (
        "kvx_room_entries",
        Kind::Gauge,
        "Per-room entries held by the prefill's room manager",
    ),
    (
        "kvx_unopened_room_entries",
        Kind::Gauge,
        "Rooms whose metadata arrived before their sender",
    ),
    (
        "kvx_session_entries",
        Kind::Gauge,
        "Decode sessions registered with the prefill rank",
    ),
    (
        "kvx_outstanding_batches",
        Kind::Gauge,
        "Transfer batches posted and not yet completed",
    ),
    (
        "kvx_registrations_total",
        Kind::Counter,
        "Decode registrations accepted",
    ),
    (
        "kvx_metadata_refused_total",
        Kind::Counter,
        "Decode metadata refused, by reason",
    ),
    (
        "kvx_malformed_frames_total",
        Kind::Counter,
        "Malformed or refused messages at the prefill inbox, by kind",
    ),
    (
        "kvx_aborts_total",
        Kind::Counter,
        "ABORT messages received, by frame count",
    ),
    (
        "kvx_abort_acks_total",
        Kind::Counter,
        "ABORT_ACK messages sent, by frame count",
    ),
    (
        "kvx_aux_messages_total",
        Kind::Counter,
        "AUX_DATA messages sent (--aux-over-tcp)",
    ),
    (
        "kvx_ignored_messages_total",
        Kind::Counter,
        "Well-formed messages the prefill had no use for, by kind",
    ),
    (
        "kvx_notices_held_total",
        Kind::Counter,
        "Messages held because a decode's inbox was full",
    ),
    (
        "kvx_notice_failures_total",
        Kind::Counter,
        "Messages to decodes dropped (send error or inbox full for 30 s)",
    ),
    (
        "kvx_aux_rows_lost_total",
        Kind::Counter,
        "Rooms whose AUX_DATA row could not be sent: the decode was told Failed, not Success",
    ),
    (
        "kvx_live_workers",
        Kind::Gauge,
        "Transfer worker threads alive",
    ),
    (
        "kvx_worker_failures_total",
        Kind::Counter,
        "Transfer workers that died, by cause",
    ),
    (
        "kvx_worker_restarts_total",
        Kind::Counter,
        "Transfer workers restarted (--restart-workers)",
    ),
    (
        "kvx_transfer_batches_total",
        Kind::Counter,
        "Transfer batches written",
    ),
    (
        "kvx_transfer_bytes_total",
        Kind::Counter,
        "Bytes written by transfer batches",
    ),
    (
        "kvx_batch_latency_seconds",
        Kind::Histogram,
        "Transfer batch latency: posted to completed",
    ),
    (
        "kvx_prefill_transfer_busy_seconds",
        Kind::Gauge,
        "Seconds a prefill rank had at least one transfer batch in flight, summed over the process's ranks (its rate: data-plane utilisation)",
    ),
    (
        "kvx_batches_skipped_total",
        Kind::Counter,
        "Transfer batches not posted, by reason",
    ),
    (
        "kvx_session_failures_total",
        Kind::Counter,
        "Decode sessions that failed (peer failure; the session is blacklisted)",
    ),
    (
        "kvx_session_preconnects_total",
        Kind::Counter,
        "Data sessions a room's metadata asked a transfer worker to open ahead of its first write, by outcome (opened, open, dead, failed)",
    ),
    (
        "kvx_staging_rooms",
        Kind::Gauge,
        "Rooms on the staging path",
    ),
    (
        "kvx_staging_parked_chunks",
        Kind::Gauge,
        "Staged chunks waiting for ring space",
    ),
    (
        "kvx_staging_requests_total",
        Kind::Counter,
        "STAGING_REQ messages sent",
    ),
    (
        "kvx_staged_chunks_posted_total",
        Kind::Counter,
        "Staged chunks posted",
    ),
    (
        "kvx_staged_bytes_total",
        Kind::Counter,
        "Bytes written through staging rings",
    ),
    (
        "kvx_staged_cpu_gathers_total",
        Kind::Counter,
        "Staged chunks gathered on the CPU into a staging buffer (a slice of part of each token's heads through a data plane that does not gather sources itself)",
    ),
    (
        "kvx_staging_wait_timeouts_total",
        Kind::Counter,
        "Staged chunks that waited past --staging-wait-timeout",
    ),
    (
        "kvx_staging_sessions_lost_total",
        Kind::Counter,
        "Decode sessions with staged rooms whose inbox stopped answering (their rooms failed at once)",
    ),
    (
        "kvx_staging_room_failures_total",
        Kind::Counter,
        "Rooms failed by the staging driver",
    ),
    (
        "kvx_staging_dropped_total",
        Kind::Counter,
        "Staging messages dropped, by kind",
    ),
    // decode
    (
        "kvx_decode_rooms_total",
        Kind::Counter,
        "Decode rooms concluded, by result (verified, corrupt, failed)",
    ),
    (
        "kvx_decode_rooms_in_flight",
        Kind::Gauge,
        "Decode rooms started and not concluded",
    ),
    (
        "kvx_decode_room_latency_seconds",
        Kind::Histogram,
        "Decode room latency: metadata sent to Success (or failure)",
    ),
    (
        "kvx_decode_room_entries",
        Kind::Gauge,
        "Per-room entries held by the decode's room manager",
    ),
    (
        "kvx_decode_malformed_frames_total",
        Kind::Counter,
        "Malformed messages at the decode inbox, by kind",
    ),
    (
        "kvx_decode_ignored_messages_total",
        Kind::Counter,
        "Well-formed messages the decode had no use for, by kind",
    ),
    (
        "kvx_decode_abort_release_timeouts_total",
        Kind::Counter,
        "ABORTed rooms whose pages were released by timeout, not by ABORT_ACK",
    ),
    (
        "kvx_decode_abort_resends_total",
        Kind::Counter,
        "ABORT messages sent again because the first went unanswered, per prefill inbox",
    ),
    (
        "kvx_decode_late_writes_total",
        Kind::Counter,
        "Rooms whose pages changed after every ABORT_ACK came",
    ),
    (
        "kvx_decode_aux_rows_total",
        Kind::Counter,
        "AUX_DATA rows written",
    ),
    (
        "kvx_decode_aux_errors_total",
        Kind::Counter,
        "AUX_DATA messages refused",
    ),
    (
        "kvx_decode_staged_chunks_total",
        Kind::Counter,
        "Staged chunks landed in rooms' pages",
    ),
    (
        "kvx_decode_staged_blocks_total",
        Kind::Counter,
        "Writers' staged blocks by path: received in place, or scattered from the ring",
    ),
    (
        "kvx_decode_staging_requests_total",
        Kind::Counter,
        "STAGING_REQ messages answered",
    ),
    (
        "kvx_decode_staging_errors_total",
        Kind::Counter,
        "Staging messages refused, by kind",
    ),
    (
        "kvx_decode_staging_rooms",
        Kind::Gauge,
        "Rooms registered with the staging ring",
    ),
    (
        "kvx_decode_staging_allocations",
        Kind::Gauge,
        "Live staging ring allocations",
    ),
    (
        "kvx_decode_staging_fenced_rooms",
        Kind::Gauge,
        "Failed rooms whose ring regions stay fenced",
    ),
    // bootstrap (control plane)
    (
        "kvx_bootstrap_http_rejected_total",
        Kind::Counter,
        "Bootstrap HTTP requests rejected as malformed, by route",
    ),
    (
        "kvx_bootstrap_inbox_dropped_total",
        Kind::Counter,
        "ZMQ inbox messages dropped, by inbox and reason",
    ),
    (
        "kvx_bootstrap_push_disconnected_total",
        Kind::Counter,
        "PUSH sockets whose peer disconnected",
    ),
    (
        "kvx_bootstrap_push_evicted_total",
        Kind::Counter,
        "PUSH sockets closed as least recently used",
    ),
    (
        "kvx_bootstrap_push_send_errors_total",
        Kind::Counter,
        "ZMQ sends that failed, by kind",
    ),
    (
        "kvx_bootstrap_register_retries_total",
        Kind::Counter,
        "PUT /route retries",
    ),
    (
        "kvx_bootstrap_ranks_dropped_total",
        Kind::Counter,
        "Prefill ranks the bootstrap server dropped because neither their inbox nor their /health answered",
    ),
    (
        "kvx_bootstrap_registered_ranks",
        Kind::Gauge,
        "Prefill ranks the bootstrap server routes to",
    ),
    (
        "kvx_prefill_reregistrations_total",
        Kind::Counter,
        "Times this prefill rank registered again with a bootstrap server that did not route it",
    ),
    (
        "kvx_decode_prefill_instances_lost_total",
        Kind::Counter,
        "Prefill instances whose bootstrap heartbeats failed (resolved again by the next room)",
    ),
    (
        "kvx_decode_prefill_ranks_lost_total",
        Kind::Counter,
        "Prefill ranks whose inbox stopped answering (their rooms failed)",
    ),
    (
        "kvx_decode_prefill_reregistrations_total",
        Kind::Counter,
        "Registrations sent again to a prefill rank that restarted or moved",
    ),
    (
        "kvx_decode_rooms_stuck",
        Kind::Gauge,
        "Decode rooms held longer than 5 s",
    ),
    // data plane
    (
        "kvx_transport_batches_total",
        Kind::Counter,
        "Data-plane batches, by backend and result",
    ),
    (
        "kvx_auto_peers_total",
        Kind::Counter,
        "Decode sessions the auto backend resolved, by backend",
    ),
    (
        "kvx_conns_evicted_total",
        Kind::Counter,
        "Data-plane connections evicted, by server",
    ),
    (
        "kvx_local_bad_host_files_total",
        Kind::Counter,
        "Unusable local-backend host files",
    ),
    (
        "kvx_tcp_bytes_sent_total",
        Kind::Counter,
        "Bytes sent by the tcp backend",
    ),
    (
        "kvx_tcp_bytes_received_total",
        Kind::Counter,
        "Bytes received by the tcp backend",
    ),
    (
        "kvx_tcp_conn_failures_total",
        Kind::Counter,
        "tcp connections that failed, by cause",
    ),
    (
        "kvx_tcp_conns_refused_total",
        Kind::Counter,
        "tcp connections refused, by cause",
    ),
    (
        "kvx_tcp_accept_errors_total",
        Kind::Counter,
        "tcp accept errors",
    ),
    (
        "kvx_tcp_auth_failures_total",
        Kind::Counter,
        "tcp hellos refused for a wrong or missing KVX_TCP_SECRET",
    ),
    (
        "kvx_tcp_foreign_probes_total",
        Kind::Counter,
        "Connections that did not speak kvx tcp",
    ),
    (
        "kvx_tcp_handshake_errors_total",
        Kind::Counter,
        "tcp handshakes that failed, by cause",
    ),
    (
        "kvx_tcp_rejected_writes_total",
        Kind::Counter,
        "tcp writes rejected by the receiver, by reason",
    ),
    (
        "kvx_tcp_server_conn_errors_total",
        Kind::Counter,
        "tcp server connections that ended in an error",
    ),
    (
        "kvx_tcp_truncated_frames_total",
        Kind::Counter,
        "tcp frames cut short",
    ),
    (
        "kvx_mooncake_bytes_sent_total",
        Kind::Counter,
        "Bytes sent with Mooncake TE's protocol",
    ),
    (
        "kvx_mooncake_bytes_received_total",
        Kind::Counter,
        "Bytes received with Mooncake TE's protocol",
    ),
    (
        "kvx_mooncake_accept_errors_total",
        Kind::Counter,
        "Mooncake accept errors, by port",
    ),
    (
        "kvx_mooncake_conn_failures_total",
        Kind::Counter,
        "Mooncake connections that failed, by cause",
    ),
    (
        "kvx_mooncake_data_conn_errors_total",
        Kind::Counter,
        "Mooncake data connections that ended in an error",
    ),
    (
        "kvx_mooncake_handshake_errors_total",
        Kind::Counter,
        "Mooncake handshakes that failed, by side",
    ),
    (
        "kvx_mooncake_handshake_requests_total",
        Kind::Counter,
        "Mooncake handshake requests served",
    ),
    (
        "kvx_mooncake_rejects_total",
        Kind::Counter,
        "Mooncake writes rejected, by cause",
    ),
    (
        "kvx_verbs_posts_total",
        Kind::Counter,
        "RDMA work-request posts",
    ),
    (
        "kvx_verbs_batches_total",
        Kind::Counter,
        "RDMA batches, by result",
    ),
    (
        "kvx_verbs_batch_errors_total",
        Kind::Counter,
        "RDMA batch errors, by kind",
    ),
    (
        "kvx_verbs_post_errors_total",
        Kind::Counter,
        "RDMA post errors",
    ),
    (
        "kvx_verbs_connect_errors_total",
        Kind::Counter,
        "RDMA connects that failed, by kind",
    ),
    (
        "kvx_verbs_handshake_errors_total",
        Kind::Counter,
        "RDMA handshakes that failed, by kind",
    ),
    (
        "kvx_verbs_wrs_failed_total",
        Kind::Counter,
        "RDMA work requests completed in error",
    ),
    (
        "kvx_verbs_wrs_requeued_total",
        Kind::Counter,
        "RDMA work requests requeued",
    ),
    (
        "kvx_verbs_completions_ignored_total",
        Kind::Counter,
        "RDMA completions for no known request",
    ),
    (
        "kvx_verbs_peers_refused_total",
        Kind::Counter,
        "RDMA peers refused (max_peers)",
    ),
];

/// Which side's failure counters [`zero_counters`] registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A prefill rank.
    Prefill,
    /// A decode peer.
    Decode,
}

/// A prefill rank's failure counters, registered at zero at startup (the label sets an
/// operator alerts on).
pub const PREFILL_ZERO_COUNTERS: &[(&str, &[(&str, &str)])] = &[
    ("kvx_room_failures_total", &[]),
    ("kvx_session_failures_total", &[]),
    ("kvx_notice_failures_total", &[]),
    ("kvx_aux_rows_lost_total", &[]),
    ("kvx_worker_restarts_total", &[]),
    ("kvx_worker_failures_total", &[("cause", "panic")]),
    (
        "kvx_worker_failures_total",
        &[("cause", "transport_poisoned")],
    ),
    ("kvx_worker_failures_total", &[("cause", "table_poisoned")]),
    ("kvx_rooms_finished_total", &[("status", "success")]),
    ("kvx_rooms_finished_total", &[("status", "failed")]),
    ("kvx_staging_wait_timeouts_total", &[]),
    ("kvx_staging_sessions_lost_total", &[]),
    ("kvx_staging_room_failures_total", &[]),
    ("kvx_batches_skipped_total", &[("reason", "session_dead")]),
    ("kvx_prefill_reregistrations_total", &[]),
];

/// A decode's counters registered at zero at startup.
pub const DECODE_ZERO_COUNTERS: &[(&str, &[(&str, &str)])] = &[
    ("kvx_tcp_auth_failures_total", &[]),
    ("kvx_decode_rooms_total", &[("result", "verified")]),
    ("kvx_decode_rooms_total", &[("result", "failed")]),
    ("kvx_decode_rooms_total", &[("result", "corrupt")]),
    ("kvx_decode_abort_release_timeouts_total", &[]),
    ("kvx_decode_abort_resends_total", &[]),
    ("kvx_decode_late_writes_total", &[]),
    ("kvx_decode_prefill_instances_lost_total", &[]),
    ("kvx_decode_prefill_ranks_lost_total", &[]),
    ("kvx_decode_prefill_reregistrations_total", &[]),
];

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn install_metrics() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let built = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .and_then(|b| b.install_recorder());
            match built {
                Ok(h) => {
                    describe_and_register();
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics recorder not installed");
                    None
                }
            }
        })
        .clone()
}

/// Registers `role`'s failure counters at zero (after [`install_metrics`]).
pub fn zero_counters(role: Role) {
    let set = match role {
        Role::Prefill => PREFILL_ZERO_COUNTERS,
        Role::Decode => DECODE_ZERO_COUNTERS,
    };
    for &(name, labels) in set {
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|&(k, v)| metrics::Label::new(k, v))
            .collect();
        metrics::counter!(name, labels).absolute(0);
    }
}

/// HELP text for every series and `kvx_build_info`.
fn describe_and_register() {
    for &(name, kind, help) in SERIES {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, metrics::Unit::Seconds, help),
        }
    }
    metrics::gauge!("kvx_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
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

/// Serves `router` alone on `addr` (e.g. `/metrics`, `/ready` and `/health` when the bootstrap
/// server runs elsewhere).
pub async fn serve(
    addr: std::net::SocketAddr,
    router: Router,
) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(local)
}

/// `/metrics`, `/ready` (from `ready`) and `/health` (200 while the process lives).
pub fn ops_router(ready: &crate::lifecycle::Readiness) -> Router {
    metrics_router()
        .merge(ready.router())
        .route("/health", get(|| async { "OK" }))
}

/// Serves `/metrics` alone on `addr` (when the bootstrap server runs elsewhere).
pub async fn serve_metrics(addr: std::net::SocketAddr) -> std::io::Result<std::net::SocketAddr> {
    serve(addr, metrics_router()).await
}
