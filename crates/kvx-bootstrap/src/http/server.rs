//! The axum bootstrap server: routes of spec §1.2 over a shared [`Registry`], bound to a given
//! address (port 0 allowed), a periodic sweep of the room → dp-rank table, optional health
//! checks that drop ranks whose inbox and `/health` stop answering (so decodes get no route to
//! a dead rank; the instance answers `503` until it registers again), graceful shutdown,
//! and an open [`Router`] so an embedding binary can mount more routes (e.g. `/metrics`).
//!
//! Status codes and texts are sglang's. Where sglang answers malformed input with an accidental
//! aiohttp `500` (missing key in `PUT /route`, non-integer query parameter), kvx answers `400`
//! with a text naming the problem; every rejection is logged and counted in
//! `kvx_bootstrap_http_rejected_total{route,reason}`. A registration that disagrees with the
//! earlier ranks (sglang 0.5.23's checks) gets 0.5.23's `400` and exact text.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::Deserialize;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::client::{BootstrapClient, tcp_alive};
use super::pyjson::{self, PyValue, opt_int};
use super::registry::{RegisteredRank, Registry, RouteAnswer, RouteQuery};
use super::types::{PrefillServerInfo, RankRegistration};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Room → dp-rank entries older than this are dropped (sglang: 120 s).
    pub dp_rank_entry_ttl: Duration,
    /// How often the room → dp-rank table is swept (sglang: 120 s).
    pub sweep_interval: Duration,
    /// How often every registered rank is checked (`None`: never, as sglang). A rank is
    /// alive when its inbox accepts a TCP connection or, failing that, its `/health` (at the
    /// `prefill_http_port` it registered) answers 200.
    pub rank_health_interval: Option<Duration>,
    /// Consecutive failed checks before a rank is dropped (logged at warn with the rank).
    pub rank_health_max_failures: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            dp_rank_entry_ttl: Duration::from_secs(120),
            sweep_interval: Duration::from_secs(120),
            rank_health_interval: None,
            rank_health_max_failures: 2,
        }
    }
}

/// How long one probe of a rank (connect, or `/health`) may take.
const RANK_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// True when the rank answers: its inbox accepts a connection, or its `/health` says 200.
async fn rank_alive(rank: &RegisteredRank) -> bool {
    let ip = rank.info.rank_ip.as_str();
    if tcp_alive(ip, rank.info.rank_port, RANK_PROBE_TIMEOUT).await {
        return true;
    }
    let Some(port) = rank.http_port else {
        return false;
    };
    match BootstrapClient::new(ip, port) {
        Ok(c) => c.health().await.is_ok(),
        Err(_) => false,
    }
}

/// Checks every registered rank each `interval` and drops one that failed `max_failures`
/// checks in a row (the registry keeps a slot that registered again meanwhile).
async fn check_ranks(state: BootstrapState, interval: Duration, max_failures: u32) {
    let mut failures: HashMap<RegisteredRank, u32> = HashMap::new();
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let ranks = state.lock().ranks();
        let mut probes = tokio::task::JoinSet::new();
        for r in ranks.iter().cloned() {
            probes.spawn(async move {
                let alive = rank_alive(&r).await;
                (r, alive)
            });
        }
        let mut seen = HashMap::new();
        while let Some(res) = probes.join_next().await {
            let Ok((r, alive)) = res else { continue };
            let n = if alive {
                0
            } else {
                failures.get(&r).copied().unwrap_or(0) + 1
            };
            if n >= max_failures.max(1) {
                let dropped = state.lock().drop_rank(r.at, &r.info);
                if dropped {
                    tracing::warn!(
                        dp = r.at.dp_rank,
                        cp = r.at.cp_rank,
                        tp = r.at.tp_rank,
                        pp = r.at.pp_rank,
                        ip = %r.info.rank_ip,
                        port = r.info.rank_port,
                        http_port = ?r.http_port,
                        failures = n,
                        "prefill rank dropped: neither its inbox nor its /health answers"
                    );
                    metrics::counter!("kvx_bootstrap_ranks_dropped_total").increment(1);
                }
                continue;
            }
            seen.insert(r, n);
        }
        failures = seen;
        metrics::gauge!("kvx_bootstrap_registered_ranks").set(state.lock().ranks().len() as f64);
    }
}

/// The registry shared by all handlers (cheap to clone).
#[derive(Clone, Debug, Default)]
pub struct BootstrapState {
    inner: Arc<Mutex<Registry>>,
}

impl BootstrapState {
    /// A state around an empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Locks the registry (a poisoned lock is recovered: the registry has no invariants a
    /// panicking reader could break).
    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The bootstrap routes over `state`, ready to be merged with other routes or served.
pub fn router(state: BootstrapState) -> Router {
    Router::new()
        .route(
            "/route",
            put(put_route)
                .get(get_route)
                // sglang answers every method but GET and PUT with 405, HEAD included.
                .head(method_not_allowed)
                .fallback(method_not_allowed),
        )
        .route("/register_dp_rank", post(register_dp_rank))
        .route("/query_dp_ranks", post(query_dp_ranks))
        .route("/health", get(health))
        .with_state(state)
}

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body.into(),
    )
        .into_response()
}

fn json(body: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
        body,
    )
        .into_response()
}

fn reject(route: &'static str, reason: &'static str, detail: &str) -> Response {
    tracing::warn!(route, reason, detail, "bootstrap request rejected");
    metrics::counter!("kvx_bootstrap_http_rejected_total", "route" => route, "reason" => reason)
        .increment(1);
    text(StatusCode::BAD_REQUEST, format!("{reason}: {detail}"))
}

async fn put_route(State(state): State<BootstrapState>, body: Bytes) -> Response {
    let reg: RankRegistration = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return reject("/route", "Invalid registration", &e.to_string()),
    };
    if reg.attn_tp_size == 0
        || reg.attn_cp_size == 0
        || reg.pp_size == 0
        || reg.dp_size() == 0
        || reg.system_dp_size == 0
    {
        return reject("/route", "Invalid registration", "a size is zero");
    }
    if let Err(conflict) = state.lock().register_rank(&reg) {
        tracing::warn!(
            tp = reg.attn_tp_rank,
            ip = %reg.rank_ip,
            port = reg.rank_port,
            error = %conflict,
            "prefill rank registration refused"
        );
        metrics::counter!("kvx_bootstrap_http_rejected_total", "route" => "/route", "reason" => conflict.kind())
            .increment(1);
        return text(StatusCode::BAD_REQUEST, conflict.to_string());
    }
    tracing::info!(
        dp = reg.dp_group(),
        cp = reg.attn_cp_rank,
        tp = reg.attn_tp_rank,
        pp = reg.pp_rank,
        ip = %reg.rank_ip,
        port = reg.rank_port,
        sglang_0_5_23 = reg.has_0523_keys(),
        "prefill rank registered"
    );
    text(StatusCode::OK, "OK")
}

/// Renders the sentinel answer exactly as sglang's `json_response(asdict(info))`: sglang main's
/// 15 keys, with sglang 0.5.23's four in that release's places when set (`dsv41_spec_layout` and
/// `kv_layout` only when not `null`, as 0.5.23 drops them then).
pub fn topology_json(t: &PrefillServerInfo) -> String {
    let v0523 = [
        t.dsv41_spec_layout
            .as_ref()
            .map(|j| ("dsv41_spec_layout", PyValue::Json(j))),
        t.kv_layout
            .as_deref()
            .map(|s| ("kv_layout", PyValue::Str(s))),
        t.decode_allocation_policy
            .as_deref()
            .map(|s| ("decode_allocation_policy", PyValue::Str(s))),
        t.enable_kv_cache_sharding
            .map(|b| ("enable_kv_cache_sharding", PyValue::Bool(b))),
    ];
    let head = [
        ("attn_tp_size", PyValue::Int(t.attn_tp_size.into())),
        ("attn_cp_size", PyValue::Int(t.attn_cp_size.into())),
        ("dp_size", PyValue::Int(t.dp_size.into())),
        ("pp_size", PyValue::Int(t.pp_size.into())),
        ("page_size", opt_int(t.page_size)),
        ("kv_cache_dtype", t.kv_cache_dtype.as_deref().into()),
        (
            "follow_bootstrap_room",
            PyValue::Bool(t.follow_bootstrap_room),
        ),
        (
            "enable_dsa_cache_layer_split",
            PyValue::Bool(t.enable_dsa_cache_layer_split),
        ),
    ];
    let tail = [
        ("prefill_http_port", opt_int(t.prefill_http_port)),
        ("target_tp_rank", PyValue::Null),
        ("target_tp_ranks", PyValue::Null),
        ("target_cp_ranks", PyValue::Null),
        ("target_pp_ranks", PyValue::Null),
        ("required_dst_info_num", PyValue::Null),
        ("required_prefill_response_num", PyValue::Null),
    ];
    pyjson::object(
        head.into_iter()
            .chain(v0523.into_iter().flatten())
            .chain(tail),
    )
}

async fn get_route(
    State(state): State<BootstrapState>,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let params = query.map(|Query(q)| q).unwrap_or_default();
    let names = [
        "prefill_dp_rank",
        "prefill_cp_rank",
        "target_tp_rank",
        "target_pp_rank",
    ];
    let mut vals = [0i64; 4];
    for (slot, name) in vals.iter_mut().zip(names) {
        let Some(raw) = params.get(name).filter(|v| !v.is_empty()) else {
            tracing::debug!(param = name, "GET /route without a required parameter");
            metrics::counter!("kvx_bootstrap_http_rejected_total", "route" => "/route", "reason" => "missing inputs")
                .increment(1);
            return text(
                StatusCode::BAD_REQUEST,
                "Missing inputs for bootstrap server.",
            );
        };
        match raw.trim().parse::<i64>() {
            Ok(v) => *slot = v,
            Err(_) => return reject("/route", "Invalid inputs for bootstrap server", name),
        }
    }
    let q = RouteQuery {
        dp_rank: vals[0],
        cp_rank: vals[1],
        tp_rank: vals[2],
        pp_rank: vals[3],
    };
    let answer = state.lock().route(q);
    match answer {
        RouteAnswer::NotReady(n) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Prefill server not fully registered yet ({n} workers registered)."),
        ),
        RouteAnswer::Topology(t) => json(topology_json(&t)),
        RouteAnswer::Rank(info) => json(pyjson::object([
            ("rank_ip", PyValue::Str(&info.rank_ip)),
            ("rank_port", PyValue::Int(info.rank_port.into())),
        ])),
        RouteAnswer::NotFound => text(
            StatusCode::NOT_FOUND,
            format!(
                "Bootstrap info not found for dp_rank={} cp_rank={} tp_rank={} pp_rank={}",
                q.dp_rank, q.cp_rank, q.tp_rank, q.pp_rank
            ),
        ),
    }
}

async fn method_not_allowed() -> Response {
    text(StatusCode::METHOD_NOT_ALLOWED, "Method not allowed")
}

#[derive(Deserialize)]
struct DpRankBody {
    bootstrap_room: u64,
    dp_rank: i64,
}

async fn register_dp_rank(State(state): State<BootstrapState>, body: Bytes) -> Response {
    match serde_json::from_slice::<DpRankBody>(&body) {
        Ok(b) => {
            state
                .lock()
                .register_dp_rank(b.bootstrap_room, b.dp_rank, Instant::now());
            text(StatusCode::OK, "OK")
        }
        Err(e) => reject("/register_dp_rank", "Invalid body", &e.to_string()),
    }
}

#[derive(Deserialize)]
struct QueryBody {
    bootstrap_rooms: Vec<u64>,
}

async fn query_dp_ranks(State(state): State<BootstrapState>, body: Bytes) -> Response {
    match serde_json::from_slice::<QueryBody>(&body) {
        Ok(b) => {
            let found = state.lock().query_dp_ranks(&b.bootstrap_rooms);
            let keys: Vec<(String, i64)> =
                found.into_iter().map(|(r, d)| (r.to_string(), d)).collect();
            json(pyjson::object(
                keys.iter()
                    .map(|(k, d)| (k.as_str(), PyValue::Int((*d).into()))),
            ))
        }
        Err(e) => reject("/query_dp_ranks", "Invalid body", &e.to_string()),
    }
}

async fn health() -> Response {
    text(StatusCode::OK, "OK")
}

/// A running bootstrap server.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    state: BootstrapState,
    stop: Option<oneshot::Sender<()>>,
    serve: Option<JoinHandle<io::Result<()>>>,
    sweeper: JoinHandle<()>,
    /// The rank health checks ([`ServerConfig::rank_health_interval`]).
    health: Option<JoinHandle<()>>,
}

impl BootstrapServer {
    /// Binds `addr` (port 0 picks a free port) and serves the bootstrap routes.
    pub async fn bind(addr: impl ToSocketAddrs, config: ServerConfig) -> io::Result<Self> {
        Self::bind_with(addr, config, Router::new()).await
    }

    /// Like [`bind`](Self::bind), with `extra` routes merged in (they must not overlap the
    /// bootstrap routes).
    pub async fn bind_with(
        addr: impl ToSocketAddrs,
        config: ServerConfig,
        extra: Router,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = BootstrapState::new();
        let app = router(state.clone()).merge(extra);
        let (stop, stopped) = oneshot::channel::<()>();
        let serve = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
        });
        let sweep_state = state.clone();
        let sweeper = tokio::spawn(async move {
            let mut tick =
                tokio::time::interval(config.sweep_interval.max(Duration::from_millis(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let n = sweep_state
                    .lock()
                    .sweep_dp_ranks(Instant::now(), config.dp_rank_entry_ttl);
                if n > 0 {
                    tracing::debug!(swept = n, "expired room → dp-rank entries");
                }
            }
        });
        let health = config.rank_health_interval.map(|every| {
            tokio::spawn(check_ranks(
                state.clone(),
                every,
                config.rank_health_max_failures,
            ))
        });
        tracing::info!(%addr, "bootstrap server listening");
        Ok(BootstrapServer {
            addr,
            state,
            stop: Some(stop),
            serve: Some(serve),
            sweeper,
            health,
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The registry behind the server.
    pub fn state(&self) -> &BootstrapState {
        &self.state
    }

    /// Stops accepting, lets in-flight requests finish, and waits for the server to end.
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.sweeper.abort();
        if let Some(h) = &self.health {
            h.abort();
        }
        match self.serve.take() {
            Some(task) => task.await.map_err(io::Error::other)?,
            None => Ok(()),
        }
    }

    /// Serves until `signal` completes, then shuts down gracefully.
    pub async fn run_until(self, signal: impl Future<Output = ()>) -> io::Result<()> {
        signal.await;
        self.shutdown().await
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.sweeper.abort();
        if let Some(h) = &self.health {
            h.abort();
        }
        if let Some(task) = &self.serve {
            task.abort();
        }
    }
}
