//! The bootstrap server over real HTTP: status codes, texts, JSON bytes and content types of
//! spec §1.2, checked with a plain reqwest client and with kvx's own [`BootstrapClient`].

#![allow(clippy::unwrap_used)]

mod reg_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use kvx_bootstrap::http::client::sglang_backoff;
use kvx_bootstrap::http::{
    BootstrapClient, BootstrapServer, RankInfo, RetryPolicy, RouteQuery, ServerConfig,
};
use reg_support::loopback_rank as reg;

fn raw() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn call(method: reqwest::Method, url: String, body: Option<&str>) -> (u16, String, String) {
    let mut rb = raw().request(method, url);
    if let Some(b) = body {
        rb = rb
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let resp = rb.send().await.unwrap();
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, ct, resp.text().await.unwrap())
}

#[tokio::test]
async fn routes_answer_like_sglang() {
    let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let base = format!("http://{}", server.local_addr());
    let sentinel = format!(
        "{base}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    );
    let get = reqwest::Method::GET;

    assert_eq!(
        call(get.clone(), sentinel.clone(), None).await,
        (
            503,
            "text/plain; charset=utf-8".into(),
            "Prefill server not fully registered yet (0 workers registered).".into()
        )
    );
    let missing = format!("{base}/route?prefill_dp_rank=0&prefill_cp_rank=&target_tp_rank=0");
    assert_eq!(call(get.clone(), missing, None).await.0, 400);
    assert_eq!(
        call(get.clone(), format!("{base}/route"), None).await.2,
        "Missing inputs for bootstrap server."
    );
    for m in [
        reqwest::Method::POST,
        reqwest::Method::DELETE,
        reqwest::Method::PATCH,
    ] {
        let (s, _, body) = call(m, format!("{base}/route"), None).await;
        assert_eq!((s, body.as_str()), (405, "Method not allowed"));
    }
    let (s, _, _) = call(reqwest::Method::HEAD, format!("{base}/route"), None).await;
    assert_eq!(s, 405);

    let client = BootstrapClient::with_base_url(&base).unwrap();
    let policy = RetryPolicy::immediate(1, Duration::from_secs(5));
    assert_eq!(
        client
            .register_rank(&reg(2, 0, 5000), &policy)
            .await
            .unwrap(),
        1
    );
    let err = client.prefill_info().await.unwrap_err();
    assert!(err.is_not_ready(), "{err}");
    assert!(err.to_string().contains("(1 workers registered)"));
    // A second registration with other scalars: first writer wins.
    let mut second = reg(8, 1, 5001);
    second.page_size = Some(1);
    second.kv_cache_dtype = None;
    let (s, ct, body) = call(
        reqwest::Method::PUT,
        format!("{base}/route"),
        Some(&serde_json::to_string(&second).unwrap()),
    )
    .await;
    assert_eq!(
        (s, ct.as_str(), body.as_str()),
        (200, "text/plain; charset=utf-8", "OK")
    );

    let (s, ct, body) = call(get.clone(), sentinel, None).await;
    assert_eq!((s, ct.as_str()), (200, "application/json; charset=utf-8"));
    assert_eq!(
        body,
        r#"{"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": false, "enable_dsa_cache_layer_split": false, "prefill_http_port": 30000, "target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, "target_pp_ranks": null, "required_dst_info_num": null, "required_prefill_response_num": null}"#
    );
    let info = client.prefill_info().await.unwrap();
    assert_eq!((info.attn_tp_size, info.page_size), (2, Some(16)));

    let (s, _, body) = call(
        get.clone(),
        format!(
            "{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0"
        ),
        None,
    )
    .await;
    assert_eq!(
        (s, body.as_str()),
        (200, r#"{"rank_ip": "127.0.0.1", "rank_port": 5001}"#)
    );
    let q = RouteQuery {
        dp_rank: 0,
        cp_rank: 0,
        tp_rank: 0,
        pp_rank: 0,
    };
    assert_eq!(
        client.rank_info(q).await.unwrap(),
        RankInfo {
            rank_ip: "127.0.0.1".into(),
            rank_port: 5000
        }
    );
    let (s, ct, body) = call(
        get.clone(),
        format!(
            "{base}/route?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0"
        ),
        None,
    )
    .await;
    assert_eq!(
        (s, ct.as_str(), body.as_str()),
        (
            404,
            "text/plain; charset=utf-8",
            "Bootstrap info not found for dp_rank=1 cp_rank=0 tp_rank=3 pp_rank=0"
        )
    );
    let (s, _, _) = call(
        get.clone(),
        format!(
            "{base}/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        ),
        None,
    )
    .await;
    assert_eq!(s, 400);
    // Malformed registrations are refused and change nothing.
    for bad in ["{", "{}", r#"{"attn_tp_size": "2"}"#, "[1,2]"] {
        let (s, _, _) = call(reqwest::Method::PUT, format!("{base}/route"), Some(bad)).await;
        assert_eq!(s, 400, "{bad}");
    }
    assert_eq!(server.state().lock().registered(), 2);

    // Room → dp rank.
    client
        .register_dp_rank(1234567890123456789, 1)
        .await
        .unwrap();
    let (s, _, body) = call(
        reqwest::Method::POST,
        format!("{base}/register_dp_rank"),
        Some(r#"{"bootstrap_room": 42, "dp_rank": 0}"#),
    )
    .await;
    assert_eq!((s, body.as_str()), (200, "OK"));
    let (s, ct, body) = call(
        reqwest::Method::POST,
        format!("{base}/query_dp_ranks"),
        Some(r#"{"bootstrap_rooms": [7, 1234567890123456789, 42]}"#),
    )
    .await;
    assert_eq!(
        (s, ct.as_str(), body.as_str()),
        (
            200,
            "application/json; charset=utf-8",
            r#"{"1234567890123456789": 1, "42": 0}"#
        )
    );
    let got = client.query_dp_ranks(&[42, 5]).await.unwrap();
    assert_eq!(got.into_iter().collect::<Vec<_>>(), vec![(42, 0)]);
    for bad in [
        "",
        "{\"bootstrap_rooms\": [-1]}",
        "{\"bootstrap_rooms\": 3}",
    ] {
        let (s, _, _) = call(
            reqwest::Method::POST,
            format!("{base}/query_dp_ranks"),
            Some(bad),
        )
        .await;
        assert_eq!(s, 400, "{bad}");
    }

    let (s, ct, body) = call(get, format!("{base}/health"), None).await;
    assert_eq!(
        (s, ct.as_str(), body.as_str()),
        (200, "text/plain; charset=utf-8", "OK")
    );
    client.health().await.unwrap();

    server.shutdown().await.unwrap();
    assert!(client.health().await.is_err());
}

/// A `PUT /route` body as sglang 0.5.23's `register_to_bootstrap` sends it (`requests`' JSON:
/// every key, the layouts `null` unless set).
fn put_0523(tp_rank: u32, port: u16, policy: &str, dsv41: &str, kv_layout: &str) -> String {
    format!(
        r#"{{"attn_tp_size": 2, "attn_tp_rank": {tp_rank}, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": {port}, "page_size": 16, "kv_cache_dtype": "auto", "kv_layout": {kv_layout}, "dsv41_spec_layout": {dsv41}, "load_balance_method": "follow_bootstrap_room", "enable_dsa_cache_layer_split": false, "enable_kv_cache_sharding": false, "prefill_http_port": 30000, "decode_allocation_policy": "{policy}"}}"#
    )
}

const SENTINEL_Q: &str =
    "route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";

/// sglang 0.5.23 prefills: their extra keys are kept, checked across ranks (400 with 0.5.23's
/// texts, nothing kept) and served in the sentinel in 0.5.23's order; kvx's client reads it.
#[tokio::test]
async fn sglang_0523_registrations_are_kept_checked_and_served() {
    let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let base = format!("http://{}", server.local_addr());
    let put = |body: String| {
        let url = format!("{base}/route");
        async move { call(reqwest::Method::PUT, url, Some(&body)).await }
    };
    assert_eq!(
        put(put_0523(0, 5000, "early", "null", "null")).await.2,
        "OK"
    );
    let layout = r#"{"num_draft_tokens": 4, "compression_ratios": [2, 4]}"#;
    let text = "text/plain; charset=utf-8".to_string();
    assert_eq!(
        put(put_0523(1, 5001, "early", layout, "null")).await,
        (
            400,
            text.clone(),
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks".into()
        )
    );
    assert_eq!(
        put(put_0523(1, 5001, "prefill_complete", "null", "null")).await,
        (
            400,
            text.clone(),
            "Inconsistent prefill allocation policies".into()
        )
    );
    assert_eq!(server.state().lock().registered(), 1);
    // Not ready yet: the refused ranks were not counted.
    let sentinel = format!("{base}/{SENTINEL_Q}");
    assert_eq!(
        call(reqwest::Method::GET, sentinel.clone(), None).await.0,
        503
    );
    assert_eq!(
        put(put_0523(1, 5001, "early", "null", "null")).await.2,
        "OK"
    );
    let (s, ct, body) = call(reqwest::Method::GET, sentinel, None).await;
    assert_eq!((s, ct.as_str()), (200, "application/json; charset=utf-8"));
    // json.dumps(asdict(PrefillServerInfo)) with the null layouts popped: 17 keys.
    assert_eq!(
        body,
        r#"{"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": true, "enable_dsa_cache_layer_split": false, "decode_allocation_policy": "early", "enable_kv_cache_sharding": false, "prefill_http_port": 30000, "target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, "target_pp_ranks": null, "required_dst_info_num": null, "required_prefill_response_num": null}"#
    );
    let client = BootstrapClient::with_base_url(&base).unwrap();
    let info = client.prefill_info().await.unwrap();
    assert!(info.has_0523_keys());
    assert_eq!(info.allocation_policy(), "early");
    assert!(!info.kv_cache_sharding());
    server.shutdown().await.unwrap();

    // An instance with a DSpark layout and a KV layout: all 19 keys, the dict as registered.
    let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let base = format!("http://{}", server.local_addr());
    for (rank, port) in [(0, 5000), (1, 5001)] {
        let body = put_0523(rank, port, "early", layout, r#""c4_c128""#);
        let (s, _, _) = call(reqwest::Method::PUT, format!("{base}/route"), Some(&body)).await;
        assert_eq!(s, 200);
    }
    let (_, _, body) = call(reqwest::Method::GET, format!("{base}/{SENTINEL_Q}"), None).await;
    assert_eq!(
        body,
        r#"{"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": true, "enable_dsa_cache_layer_split": false, "dsv41_spec_layout": {"num_draft_tokens": 4, "compression_ratios": [2, 4]}, "kv_layout": "c4_c128", "decode_allocation_policy": "early", "enable_kv_cache_sharding": false, "prefill_http_port": 30000, "target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, "target_pp_ranks": null, "required_dst_info_num": null, "required_prefill_response_num": null}"#
    );
    let info = BootstrapClient::with_base_url(&base)
        .unwrap()
        .prefill_info()
        .await
        .unwrap();
    assert_eq!(info.kv_layout.as_deref(), Some("c4_c128"));
    assert!(info.dsv41_spec_layout.is_some());
    // A sglang main body after them: no layout, so refused.
    let (s, _, body) = call(
        reqwest::Method::PUT,
        format!("{base}/route"),
        Some(&serde_json::to_string(&reg(2, 1, 5002)).unwrap()),
    )
    .await;
    assert_eq!(
        (s, body.as_str()),
        (
            400,
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks"
        )
    );
    server.shutdown().await.unwrap();
}

/// The decode side of row 1: kvx's client reads sglang 0.5.23's sentinel (as sglang's decode
/// dataclass does, 19 fields) and still refuses a key neither release sends.
#[test]
fn sentinel_parsing_knows_0523_keys_only() {
    use kvx_bootstrap::http::PrefillServerInfo;
    let k = r#"{"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": true, "enable_dsa_cache_layer_split": false, "prefill_http_port": null, "target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, "target_pp_ranks": null, "required_dst_info_num": null, "required_prefill_response_num": null}"#;
    let info: PrefillServerInfo = serde_json::from_str(k).unwrap();
    assert!(!info.has_0523_keys());
    let v0523 = k.replace(
        r#""prefill_http_port": null"#,
        r#""decode_allocation_policy": "early", "enable_kv_cache_sharding": true, "prefill_http_port": 30000"#,
    );
    let info: PrefillServerInfo = serde_json::from_str(&v0523).unwrap();
    assert!(info.has_0523_keys() && info.kv_cache_sharding());
    assert_eq!(info.prefill_http_port, Some(30000));
    let unknown = k.replace(r#""prefill_http_port": null"#, r#""surprise": 1"#);
    let err = serde_json::from_str::<PrefillServerInfo>(&unknown).unwrap_err();
    assert!(
        err.to_string().contains("unknown field `surprise`"),
        "{err}"
    );
    // Serialized back, a K-form answer keeps its 15 keys.
    let k_info: PrefillServerInfo = serde_json::from_str(k).unwrap();
    let v: serde_json::Value = serde_json::to_value(&k_info).unwrap();
    assert_eq!(v.as_object().unwrap().len(), 15);
}

#[tokio::test]
async fn sizes_whose_product_overflows_are_served_not_ready() {
    let server = BootstrapServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let base = format!("http://{}", server.local_addr());
    let max = u32::MAX;
    let body = format!(
        r#"{{"attn_tp_size":{max},"attn_tp_rank":0,"attn_cp_size":{max},"attn_cp_rank":0,
        "attn_dp_size":{max},"attn_dp_rank":0,"pp_size":{max},"pp_rank":0,"system_dp_size":1,
        "system_dp_rank":0,"rank_ip":"127.0.0.1","rank_port":5000}}"#
    );
    let put = call(reqwest::Method::PUT, format!("{base}/route"), Some(&body)).await;
    assert_eq!((put.0, put.2.as_str()), (200, "OK"));
    let sentinel = format!(
        "{base}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    );
    let (status, _, text) = call(reqwest::Method::GET, sentinel, None).await;
    assert_eq!(
        (status, text.as_str()),
        (
            503,
            "Prefill server not fully registered yet (1 workers registered)."
        )
    );
    let health = call(reqwest::Method::GET, format!("{base}/health"), None).await;
    assert_eq!(health.0, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn extra_routes_are_served_alongside() {
    let extra = Router::new().route("/metrics", get(|| async { "kvx_up 1\n" }));
    let server = BootstrapServer::bind_with("127.0.0.1:0", ServerConfig::default(), extra)
        .await
        .unwrap();
    let base = format!("http://{}", server.local_addr());
    let (s, _, body) = call(reqwest::Method::GET, format!("{base}/metrics"), None).await;
    assert_eq!((s, body.as_str()), (200, "kvx_up 1\n"));
    let (s, _, _) = call(reqwest::Method::GET, format!("{base}/health"), None).await;
    assert_eq!(s, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn ipv6_bind_and_client() {
    let Ok(server) = BootstrapServer::bind("[::1]:0", ServerConfig::default()).await else {
        panic!("IPv6 loopback is required for this test");
    };
    let client = BootstrapClient::new("::1", server.local_addr().port()).unwrap();
    assert!(client.base_url().starts_with("http://[::1]:"));
    client.health().await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn registration_retries_with_the_injected_schedule() {
    // A port nobody listens on: bind, learn the port, close.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let client = BootstrapClient::new("127.0.0.1", port).unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let policy = RetryPolicy {
        attempts: 5,
        timeout: Duration::from_secs(5),
        backoff: Arc::new(move |k| {
            assert_eq!(k, seen.fetch_add(1, Ordering::SeqCst));
            Duration::ZERO
        }),
    };
    let err = client
        .register_rank(&reg(1, 0, 1), &policy)
        .await
        .unwrap_err();
    assert!(
        matches!(err, kvx_bootstrap::http::ClientError::Request(_)),
        "{err}"
    );
    // Sleeps happen between attempts only: 4 for 5 attempts.
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[test]
fn sglang_backoff_schedule() {
    let secs: Vec<f64> = (0..7)
        .map(|k| sglang_backoff(k, 1.0).as_secs_f64())
        .collect();
    assert_eq!(secs, vec![1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]);
    assert_eq!(sglang_backoff(1, 0.75), Duration::from_millis(1500));
    assert_eq!(
        sglang_backoff(u32::MAX, 0.75),
        Duration::from_secs_f64(22.5)
    );
}

#[tokio::test]
async fn dp_rank_entries_expire_by_the_periodic_sweep() {
    let cfg = ServerConfig {
        dp_rank_entry_ttl: Duration::ZERO,
        sweep_interval: Duration::from_millis(20),
        ..ServerConfig::default()
    };
    let server = BootstrapServer::bind("127.0.0.1:0", cfg).await.unwrap();
    let client = BootstrapClient::new("127.0.0.1", server.local_addr().port()).unwrap();
    client.register_dp_rank(9, 3).await.unwrap();
    // Wait for the sweep to run (bounded by a count of polls, not by a timing assertion).
    let mut gone = false;
    for _ in 0..500 {
        if server.state().lock().dp_rank_entries() == 0 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(gone, "the sweep never removed the entry");
    assert!(client.query_dp_ranks(&[9]).await.unwrap().is_empty());
    server.shutdown().await.unwrap();
}
