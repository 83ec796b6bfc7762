//! The bootstrap client: what a prefill rank does at start-up (`PUT /route` with sglang's retry
//! and backoff) and what a decode does before talking ZMQ (sentinel and per-rank `GET /route`,
//! `POST /query_dp_ranks`, `GET /health` heartbeats with connect/read timeouts).
//!
//! The HTTP client never uses a proxy (`no_proxy`), as control-plane traffic stays inside the
//! cluster. The retry schedule is a [`RetryPolicy`] so tests can run it without sleeping.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde::Serialize;

use super::types::{PrefillServerInfo, RankInfo, RankRegistration};
use crate::http::registry::RouteQuery;

/// A failed bootstrap call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The request could not be built, sent, or its answer read (includes timeouts).
    #[error("bootstrap request failed: {0}")]
    Request(#[from] reqwest::Error),
    /// The server answered with a non-200 status.
    #[error("bootstrap server answered {status}: {body}")]
    Status {
        /// HTTP status code.
        status: u16,
        /// Response body (sglang's plain-text reason).
        body: String,
    },
    /// The 200 answer was not the JSON expected.
    #[error("bootstrap answer is not the expected JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A `query_dp_ranks` key was not a room number.
    #[error("bootstrap answer has a non-room key {0:?}")]
    BadRoomKey(String),
}

impl ClientError {
    /// True for the `503` "not fully registered yet" answer.
    pub fn is_not_ready(&self) -> bool {
        matches!(self, ClientError::Status { status: 503, .. })
    }
}

/// How `PUT /route` is retried.
#[derive(Clone)]
pub struct RetryPolicy {
    /// Attempts in total (sglang: 5).
    pub attempts: u32,
    /// Timeout of each attempt (sglang: 5 s).
    pub timeout: Duration,
    /// Sleep after failed attempt `k` (0-based) before the next one.
    pub backoff: Arc<dyn Fn(u32) -> Duration + Send + Sync>,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("attempts", &self.attempts)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// sglang's backoff: `min(2^k, 30) · jitter` seconds, `jitter` drawn from `0.75..1.0`.
pub fn sglang_backoff(k: u32, jitter: f64) -> Duration {
    let base = 2f64.powi(k.min(16) as i32).min(30.0);
    Duration::from_secs_f64(base * jitter.clamp(0.0, 1.0))
}

impl RetryPolicy {
    /// sglang's schedule: 5 attempts, 5 s each, jittered exponential backoff capped at 30 s.
    pub fn sglang() -> Self {
        RetryPolicy {
            attempts: 5,
            timeout: Duration::from_secs(5),
            backoff: Arc::new(|k| {
                use rand::Rng as _;
                sglang_backoff(k, rand::rng().random_range(0.75..1.0))
            }),
        }
    }

    /// A policy with the given attempts and per-attempt timeout that never sleeps (for tests).
    pub fn immediate(attempts: u32, timeout: Duration) -> Self {
        RetryPolicy {
            attempts,
            timeout,
            backoff: Arc::new(|_| Duration::ZERO),
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::sglang()
    }
}

/// What [`BootstrapClient::ensure_registered`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Registration {
    /// The server routes the rank to this inbox already.
    Present,
    /// The rank was missing (or the instance incomplete) and was registered now.
    Registered,
    /// The server routes the rank to another inbox.
    Taken(RankInfo),
}

/// A client for one bootstrap server (`http://host:port`).
#[derive(Clone, Debug)]
pub struct BootstrapClient {
    base: String,
    http: reqwest::Client,
    heartbeat: reqwest::Client,
}

/// Formats `host:port` as sglang does, bracketing IPv6 literals.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl BootstrapClient {
    /// A client for the server at `host:port` (IPv6 hosts with or without brackets).
    pub fn new(host: &str, port: u16) -> Result<Self, ClientError> {
        Self::with_base_url(format!("http://{}", host_port(host, port)))
    }

    /// A client for the server at `base` (e.g. `http://127.0.0.1:8998`, no trailing slash).
    pub fn with_base_url(base: impl Into<String>) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(30))
            .build()?;
        // sglang's heartbeat: connect 2 s, read 3 s.
        let heartbeat = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(2))
            .read_timeout(Duration::from_secs(3))
            .build()?;
        Ok(BootstrapClient {
            base: base.into().trim_end_matches('/').to_string(),
            http,
            heartbeat,
        })
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    async fn expect_ok(resp: reqwest::Response) -> Result<Bytes, ClientError> {
        let status = resp.status().as_u16();
        let body = resp.bytes().await?;
        if status == 200 {
            Ok(body)
        } else {
            Err(ClientError::Status {
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        }
    }

    /// One `PUT /route` attempt.
    pub async fn put_route(
        &self,
        reg: &RankRegistration,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let resp = self
            .http
            .put(format!("{}/route", self.base))
            .json(reg)
            .timeout(timeout)
            .send()
            .await?;
        Self::expect_ok(resp).await.map(|_| ())
    }

    /// Registers a prefill rank, retrying per `policy`; returns the attempts used, or the last
    /// error when every attempt failed (sglang only logs that; the caller decides).
    pub async fn register_rank(
        &self,
        reg: &RankRegistration,
        policy: &RetryPolicy,
    ) -> Result<u32, ClientError> {
        let attempts = policy.attempts.max(1);
        let mut k = 0;
        loop {
            match self.put_route(reg, policy.timeout).await {
                Ok(()) => return Ok(k + 1),
                Err(e) if k + 1 >= attempts => {
                    tracing::error!(error = %e, attempts, "prefill rank registration failed");
                    return Err(e);
                }
                Err(e) => {
                    let wait = (policy.backoff)(k);
                    tracing::warn!(error = %e, attempt = k + 1, ?wait, "registration attempt failed");
                    metrics::counter!("kvx_bootstrap_register_retries_total").increment(1);
                    tokio::time::sleep(wait).await;
                    k += 1;
                }
            }
        }
    }

    /// Makes sure the server has `reg`: asks for the rank's own route and, unless the server
    /// answers with this rank's inbox, registers it with one `PUT /route` (a restarted
    /// bootstrap server knows nothing; a `503` cannot tell whether this rank is missing, and
    /// an identical re-registration is idempotent on a kvx server). Returns
    /// [`Registration::Present`], [`Registration::Registered`], or
    /// [`Registration::Taken`] when another inbox holds the rank's slot (left alone: the
    /// newer process wins); an error when the server cannot be reached.
    pub async fn ensure_registered(
        &self,
        reg: &RankRegistration,
        timeout: Duration,
    ) -> Result<Registration, ClientError> {
        let q = RouteQuery {
            dp_rank: i64::from(reg.dp_group()),
            cp_rank: i64::from(reg.attn_cp_rank),
            tp_rank: i64::from(reg.attn_tp_rank),
            pp_rank: i64::from(reg.pp_rank),
        };
        match self.rank_info(q).await {
            Ok(ri) if ri.rank_ip == reg.rank_ip && ri.rank_port == reg.rank_port => {
                return Ok(Registration::Present);
            }
            Ok(ri) => return Ok(Registration::Taken(ri)),
            Err(ClientError::Status {
                status: 404 | 503, ..
            }) => {}
            Err(e) => return Err(e),
        }
        self.put_route(reg, timeout).await?;
        Ok(Registration::Registered)
    }

    async fn get_route(&self, q: RouteQuery) -> Result<Bytes, ClientError> {
        let resp = self
            .http
            .get(format!(
                "{}/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}",
                self.base, q.dp_rank, q.cp_rank, q.tp_rank, q.pp_rank
            ))
            .send()
            .await?;
        Self::expect_ok(resp).await
    }

    /// The sentinel query: the prefill instance's topology (strict keys, as sglang's decode:
    /// sglang main's 15 and sglang 0.5.23's four more are known, anything else is an error).
    pub async fn prefill_info(&self) -> Result<PrefillServerInfo, ClientError> {
        let body = self.get_route(RouteQuery::SENTINEL).await?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// Where the prefill rank at `q` has its ZMQ inbox.
    pub async fn rank_info(&self, q: RouteQuery) -> Result<RankInfo, ClientError> {
        let body = self.get_route(q).await?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// Records that `room` is served by `dp_rank` (prefill side).
    pub async fn register_dp_rank(&self, room: u64, dp_rank: i64) -> Result<(), ClientError> {
        #[derive(Serialize)]
        struct Body {
            bootstrap_room: u64,
            dp_rank: i64,
        }
        let resp = self
            .http
            .post(format!("{}/register_dp_rank", self.base))
            .json(&Body {
                bootstrap_room: room,
                dp_rank,
            })
            .send()
            .await?;
        Self::expect_ok(resp).await.map(|_| ())
    }

    /// The dp rank of each known room among `rooms` (decode side).
    pub async fn query_dp_ranks(&self, rooms: &[u64]) -> Result<HashMap<u64, i64>, ClientError> {
        #[derive(Serialize)]
        struct Body<'a> {
            bootstrap_rooms: &'a [u64],
        }
        let resp = self
            .http
            .post(format!("{}/query_dp_ranks", self.base))
            .json(&Body {
                bootstrap_rooms: rooms,
            })
            .send()
            .await?;
        let body = Self::expect_ok(resp).await?;
        let raw: HashMap<String, i64> = serde_json::from_slice(&body)?;
        raw.into_iter()
            .map(|(k, v)| match k.parse::<u64>() {
                Ok(room) => Ok((room, v)),
                Err(_) => Err(ClientError::BadRoomKey(k)),
            })
            .collect()
    }

    /// One heartbeat: `GET /health` with sglang's timeouts (connect 2 s, read 3 s).
    pub async fn health(&self) -> Result<(), ClientError> {
        let resp = self
            .heartbeat
            .get(format!("{}/health", self.base))
            .send()
            .await?;
        Self::expect_ok(resp).await.map(|_| ())
    }
}

/// True when a TCP connection to `host:port` opens within `timeout`; it is closed at once
/// without a byte sent. This is how a process is told alive behind a port that speaks no HTTP
/// (a prefill rank's ZMQ inbox: libzmq drops a peer that closes before its greeting).
pub async fn tcp_alive(host: &str, port: u16, timeout: Duration) -> bool {
    let addr = (host.trim_matches(['[', ']']), port);
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}
