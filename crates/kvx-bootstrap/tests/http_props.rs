//! Property tests for the bootstrap server's input handling: arbitrary bodies and query strings
//! sent over real HTTP never produce a 5xx nor stop the server, and the registry's counting and
//! first-writer-wins rules hold for any sequence of registrations.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;

use kvx_bootstrap::http::pyjson::PyJson;
use kvx_bootstrap::http::registry::RegistrationConflict;
use kvx_bootstrap::http::server::topology_json;
use kvx_bootstrap::http::{
    BootstrapServer, PrefillServerInfo, RankRegistration, Registry, RouteAnswer, RouteQuery,
    ServerConfig,
};
use proptest::prelude::*;

struct Fixture {
    rt: tokio::runtime::Runtime,
    base: String,
    http: reqwest::Client,
    _server: BootstrapServer,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = rt
            .block_on(BootstrapServer::bind(
                "127.0.0.1:0",
                ServerConfig::default(),
            ))
            .unwrap();
        Fixture {
            base: format!("http://{}", server.local_addr()),
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
            rt,
            _server: server,
        }
    })
}

fn status(method: reqwest::Method, path: &str, body: Vec<u8>) -> u16 {
    let f = fixture();
    f.rt.block_on(async {
        f.http
            .request(method, format!("{}{path}", f.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    })
}

fn json_ish() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        "[{}\\[\\]\":,0-9a-z_ .-]{0,80}".prop_map(String::into_bytes),
        (any::<i64>(), any::<i64>()).prop_map(|(a, b)| format!(
            r#"{{"bootstrap_room": {a}, "dp_rank": {b}, "bootstrap_rooms": [{a}, {b}]}}"#
        )
        .into_bytes()),
    ]
}

/// A `PUT /route` body of sglang 0.5.23's shape with an arbitrary JSON text as its DSpark layout.
fn put_0523_with(layout: &str, policy: &str) -> Vec<u8> {
    format!(
        r#"{{"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 1, "page_size": 16, "kv_cache_dtype": "auto", "kv_layout": null, "dsv41_spec_layout": {layout}, "enable_kv_cache_sharding": false, "decode_allocation_policy": "{policy}"}}"#
    )
    .into_bytes()
}

fn rank_with(policy: Option<&str>, layout: Option<u8>, v0523: bool) -> RankRegistration {
    RankRegistration {
        attn_tp_size: 1,
        attn_tp_rank: 0,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        attn_dp_size: 1,
        attn_dp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        system_dp_size: 1,
        system_dp_rank: 0,
        rank_ip: "10.0.0.1".into(),
        rank_port: 1,
        page_size: Some(16),
        kv_cache_dtype: None,
        load_balance_method: None,
        enable_dsa_cache_layer_split: None,
        prefill_http_port: None,
        kv_layout: None,
        dsv41_spec_layout: layout
            .map(|n| PyJson::Object(vec![("n".into(), PyJson::Int(n.into()))])),
        enable_kv_cache_sharding: v0523.then_some(false),
        decode_allocation_policy: policy.map(str::to_owned),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// sglang 0.5.23's keys with any JSON-ish layout text: never a 5xx, and a registration
    /// refused for disagreeing is a 400 (never counted).
    #[test]
    fn arbitrary_0523_bodies_never_5xx(layout in "[{}\\[\\]\":,0-9a-z_ .-]{0,40}", policy in "[a-z_]{0,12}") {
        let s = status(reqwest::Method::PUT, "/route", put_0523_with(&layout, &policy));
        prop_assert!(s == 200 || s == 400, "status {s}");
        prop_assert_eq!(status(reqwest::Method::GET, "/health", vec![]), 200);
    }

    /// Any sequence of sglang main and 0.5.23 registrations: a rank is refused exactly when its
    /// layout or policy differs from the first accepted rank's, refused ranks are not counted,
    /// and the sentinel shows 0.5.23's keys exactly when an accepted rank had them — rendered
    /// as JSON that parses back to the same answer.
    #[test]
    fn registry_checks_0523_ranks_like_sglang(
        regs in proptest::collection::vec(
            (proptest::option::of(prop::sample::select(vec!["early", "prefill_complete"])),
             proptest::option::of(0u8..2), any::<bool>()),
            1..10,
        )
    ) {
        let mut r = Registry::new();
        let mut first: Option<(String, Option<u8>)> = None;
        let mut accepted = 0u64;
        let mut any_0523 = false;
        for (policy, layout, v0523) in &regs {
            let reg = rank_with(*policy, *layout, *v0523 || policy.is_some());
            let got = r.register_rank(&reg);
            let policy = policy.unwrap_or("early").to_string();
            let want = match &first {
                None => Ok(()),
                Some((_, l)) if l != layout => Err(RegistrationConflict::DsparkLayout),
                Some((p, _)) if *p != policy => Err(RegistrationConflict::AllocationPolicy),
                Some(_) => Ok(()),
            };
            prop_assert_eq!(&got, &want);
            if got.is_ok() {
                accepted += 1;
                any_0523 |= reg.has_0523_keys();
                first.get_or_insert((policy, *layout));
            }
        }
        // Every accepted body names the same rank and inbox: repeats are idempotent.
        prop_assert_eq!(r.registered(), accepted.min(1));
        let RouteAnswer::Topology(t) = r.route(RouteQuery::SENTINEL) else {
            return Err(TestCaseError::fail("one accepted rank makes a TP1 instance ready"));
        };
        prop_assert_eq!(t.has_0523_keys(), any_0523);
        let back: PrefillServerInfo = serde_json::from_str(&topology_json(&t)).unwrap();
        prop_assert_eq!(&back, t.as_ref());
    }

    #[test]
    fn arbitrary_bodies_never_5xx(body in json_ish(), which in 0..3usize) {
        let (method, path) = [
            (reqwest::Method::PUT, "/route"),
            (reqwest::Method::POST, "/register_dp_rank"),
            (reqwest::Method::POST, "/query_dp_ranks"),
        ][which].clone();
        let s = status(method, path, body);
        prop_assert!(s == 200 || s == 400 || s == 413 || s == 415, "status {s}");
        prop_assert_eq!(status(reqwest::Method::GET, "/health", vec![]), 200);
    }

    #[test]
    fn arbitrary_route_queries_never_5xx(q in "[a-z_=&%0-9+-]{0,60}") {
        let s = status(reqwest::Method::GET, &format!("/route?{q}"), vec![]);
        prop_assert!(s == 400 || s == 404 || s == 503 || s == 200, "status {s}");
    }

    #[test]
    fn registry_counts_and_first_writer_wins(
        regs in proptest::collection::vec((1u32..4, 0u32..4, 0u64..512, any::<u16>()), 1..12)
    ) {
        let mut r = Registry::new();
        for (i, (tp, rank, page, port)) in regs.iter().enumerate() {
            r.register_rank(&RankRegistration {
                attn_tp_size: *tp, attn_tp_rank: *rank, attn_cp_size: 1, attn_cp_rank: 0,
                attn_dp_size: 1, attn_dp_rank: 0, pp_size: 1, pp_rank: 0,
                system_dp_size: 1, system_dp_rank: 0,
                rank_ip: format!("10.0.0.{i}"), rank_port: *port,
                page_size: Some(*page), kv_cache_dtype: None, load_balance_method: None,
                enable_dsa_cache_layer_split: None, prefill_http_port: None,
                kv_layout: None, dsv41_spec_layout: None, enable_kv_cache_sharding: None,
                decode_allocation_policy: None,
            }).unwrap();
        }
        prop_assert_eq!(r.registered(), regs.len() as u64);
        let first_tp = regs[0].0;
        prop_assert_eq!(r.is_ready(), regs.len() as u64 >= u64::from(first_tp));
        match r.route(RouteQuery::SENTINEL) {
            RouteAnswer::Topology(t) => {
                prop_assert!(r.is_ready());
                prop_assert_eq!(t.attn_tp_size, first_tp);
                prop_assert_eq!(t.page_size, Some(regs[0].2));
            }
            RouteAnswer::NotReady(n) => {
                prop_assert!(!r.is_ready());
                prop_assert_eq!(n, regs.len() as u64);
            }
            other => prop_assert!(false, "unexpected {other:?}"),
        }
        if r.is_ready() {
            // The last registration of a slot owns the table entry.
            let (_, rank, _, port) = *regs.last().unwrap();
            let q = RouteQuery { dp_rank: 0, cp_rank: 0, tp_rank: i64::from(rank), pp_rank: 0 };
            match r.route(q) {
                RouteAnswer::Rank(info) => prop_assert_eq!(info.rank_port, port),
                other => prop_assert!(false, "unexpected {other:?}"),
            }
        }
    }
}
