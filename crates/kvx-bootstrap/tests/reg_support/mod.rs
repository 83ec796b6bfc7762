//! The rank registration the HTTP tests send: one attention-TP rank of a loopback prefill
//! (no CP, DP or PP), as sglang's prefill posts it to `/route`.

use kvx_bootstrap::http::RankRegistration;

/// Rank `tp_rank` of `tp_size` with its ZMQ inbox on `127.0.0.1:port`; page size 16,
/// round-robin load balancing, prefill HTTP port 30000.
pub fn loopback_rank(tp_size: u32, tp_rank: u32, port: u16) -> RankRegistration {
    RankRegistration {
        attn_tp_size: tp_size,
        attn_tp_rank: tp_rank,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        attn_dp_size: 1,
        attn_dp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        system_dp_size: 1,
        system_dp_rank: 0,
        rank_ip: "127.0.0.1".into(),
        rank_port: port,
        page_size: Some(16),
        kv_cache_dtype: Some("auto".into()),
        load_balance_method: Some("round_robin".into()),
        enable_dsa_cache_layer_split: Some(false),
        prefill_http_port: Some(30000),
        kv_layout: None,
        dsv41_spec_layout: None,
        enable_kv_cache_sharding: None,
        decode_allocation_policy: None,
    }
}
