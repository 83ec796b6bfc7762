//! The JSON bodies of the bootstrap API (spec §1.2): what a prefill rank registers, what the
//! all-minus-one sentinel returns, and what a per-rank lookup returns.
//!
//! Both generations of sglang are covered: sglang main ("K") registers and serves the 15-key
//! form; sglang 0.5.23 adds `kv_layout`, `dsv41_spec_layout`, `enable_kv_cache_sharding` and
//! `decode_allocation_policy` to both (the `*_0523` helpers tell the forms apart).

use serde::{Deserialize, Serialize};

use super::pyjson::PyJson;

/// The body of `PUT /route`: one prefill rank announcing its ZMQ inbox and the topology.
///
/// Required keys are those sglang's server reads unconditionally; the optional ones default the
/// way sglang does (a missing `load_balance_method` means "follow the bootstrap room", a missing
/// `enable_dsa_cache_layer_split` means `false`). Unknown keys are ignored, as sglang does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRegistration {
    /// Attention tensor-parallel size.
    pub attn_tp_size: u32,
    /// This rank's attention tensor-parallel rank.
    pub attn_tp_rank: u32,
    /// Attention context-parallel size.
    pub attn_cp_size: u32,
    /// This rank's attention context-parallel rank.
    pub attn_cp_rank: u32,
    /// Attention data-parallel size.
    pub attn_dp_size: u32,
    /// This rank's attention data-parallel rank.
    pub attn_dp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// This rank's pipeline-parallel rank.
    pub pp_rank: u32,
    /// System data-parallel size (1 unless several DP replicas share the instance).
    pub system_dp_size: u32,
    /// This rank's system data-parallel rank.
    pub system_dp_rank: u32,
    /// The IP (or host) of this rank's ZMQ PULL inbox.
    pub rank_ip: String,
    /// The port of this rank's ZMQ PULL inbox.
    pub rank_port: u16,
    /// Tokens per KV page (`null`/absent: unknown, the decode then skips its check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<u64>,
    /// The resolved `--kv-cache-dtype` (e.g. `"auto"`; `null`/absent: the decode skips its check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_dtype: Option<String>,
    /// The prefill's DP load-balance method; absent means `follow_bootstrap_room`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balance_method: Option<String>,
    /// DSA cache layer split; absent means `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_dsa_cache_layer_split: Option<bool>,
    /// The prefill instance's HTTP API port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_http_port: Option<u16>,
    /// sglang 0.5.23: the KV byte layout both roles must share (DeepSeek-V4 pools), or `null`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// sglang 0.5.23: the DeepSeek-V4.1 DSpark transfer layout (any JSON value), or `null`.
    /// Every rank of an instance must register the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<PyJson>,
    /// sglang 0.5.23: logical-page KV sharding across the prefill's ranks; absent means `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_kv_cache_sharding: Option<bool>,
    /// sglang 0.5.23: `--disaggregation-decode-allocation-policy` (`"early"` or
    /// `"prefill_complete"`); absent means `"early"`. Every rank must register the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_allocation_policy: Option<String>,
}

impl RankRegistration {
    /// The DP size this registration implies: `attn_dp_size` unless `system_dp_size > 1`.
    pub fn dp_size(&self) -> u32 {
        if self.system_dp_size == 1 {
            self.attn_dp_size
        } else {
            self.system_dp_size
        }
    }

    /// The DP group this rank belongs to: `attn_dp_rank` unless `system_dp_size > 1`.
    pub fn dp_group(&self) -> u32 {
        if self.system_dp_size == 1 {
            self.attn_dp_rank
        } else {
            self.system_dp_rank
        }
    }

    /// Whether the decode should pick the DP rank as `room % dp_size` (sglang's
    /// `follow_bootstrap_room`; true when the method is absent).
    pub fn follow_bootstrap_room(&self) -> bool {
        self.load_balance_method
            .as_deref()
            .is_none_or(|m| m == "follow_bootstrap_room")
    }

    /// The decode allocation policy, `"early"` when absent (sglang 0.5.23's default).
    pub fn allocation_policy(&self) -> &str {
        self.decode_allocation_policy.as_deref().unwrap_or("early")
    }

    /// True when the body has a key only sglang 0.5.23 sends (it always sends
    /// `decode_allocation_policy` and `enable_kv_cache_sharding`): the instance's sentinel then
    /// carries 0.5.23's keys too.
    pub fn has_0523_keys(&self) -> bool {
        self.decode_allocation_policy.is_some()
            || self.enable_kv_cache_sharding.is_some()
            || self.kv_layout.is_some()
            || self.dsv41_spec_layout.is_some()
    }
}

/// The answer to the all-minus-one sentinel query: sglang's `PrefillServerInfo` as
/// `dataclasses.asdict` renders it, same keys in the same order.
///
/// sglang's decode builds `PrefillServerInfo(**json)`, so an unknown key breaks it; this type
/// therefore rejects unknown keys when parsing, as the decode would — knowing sglang 0.5.23's 19
/// fields (K's 15 plus `dsv41_spec_layout`, `kv_layout`, `decode_allocation_policy`,
/// `enable_kv_cache_sharding`), each of the four optional. A server of sglang main sends none of
/// the four (its decodes would die on them); one of 0.5.23 always sends the last two and the
/// first two when not `null`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillServerInfo {
    /// Attention tensor-parallel size.
    pub attn_tp_size: u32,
    /// Attention context-parallel size.
    pub attn_cp_size: u32,
    /// Data-parallel size.
    pub dp_size: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Tokens per page, or `null`.
    pub page_size: Option<u64>,
    /// KV cache dtype string, or `null`.
    pub kv_cache_dtype: Option<String>,
    /// Whether the decode derives the DP rank from the room.
    pub follow_bootstrap_room: bool,
    /// DSA cache layer split.
    pub enable_dsa_cache_layer_split: bool,
    /// sglang 0.5.23: the DeepSeek-V4.1 DSpark layout; sent only when not `null`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<PyJson>,
    /// sglang 0.5.23: the KV byte layout; sent only when not `null`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// sglang 0.5.23: the decode allocation policy (`None`: a sglang main server, i.e. `"early"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_allocation_policy: Option<String>,
    /// sglang 0.5.23: KV cache sharding across the prefill's ranks (`None`: sglang main, off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_kv_cache_sharding: Option<bool>,
    /// The prefill instance's HTTP API port, or `null`.
    pub prefill_http_port: Option<u16>,
    /// Filled in by the decode; always `null` from the server.
    #[serde(default)]
    pub target_tp_rank: Option<i64>,
    /// Filled in by the decode; always `null` from the server.
    #[serde(default)]
    pub target_tp_ranks: Option<Vec<i64>>,
    /// Filled in by the decode; always `null` from the server.
    #[serde(default)]
    pub target_cp_ranks: Option<Vec<i64>>,
    /// Filled in by the decode; always `null` from the server.
    #[serde(default)]
    pub target_pp_ranks: Option<Vec<i64>>,
    /// Filled in by the decode; always `null` from the server.
    #[serde(default)]
    pub required_dst_info_num: Option<i64>,
    /// Filled in by the decode; always `null` from the server.
    #[serde(default)]
    pub required_prefill_response_num: Option<i64>,
}

impl PrefillServerInfo {
    /// True when the answer has a key only a sglang 0.5.23 bootstrap server sends (or a kvx one
    /// relaying 0.5.23 prefills): the prefill ranks behind it are 0.5.23's, which acknowledge only
    /// an `ABORT` that carries a generation.
    pub fn has_0523_keys(&self) -> bool {
        self.decode_allocation_policy.is_some()
            || self.enable_kv_cache_sharding.is_some()
            || self.kv_layout.is_some()
            || self.dsv41_spec_layout.is_some()
    }

    /// The decode allocation policy, `"early"` when not sent.
    pub fn allocation_policy(&self) -> &str {
        self.decode_allocation_policy.as_deref().unwrap_or("early")
    }

    /// Whether the prefill shards its KV cache across ranks (`false` when not sent).
    pub fn kv_cache_sharding(&self) -> bool {
        self.enable_kv_cache_sharding.unwrap_or(false)
    }
}

/// The answer to a per-rank `GET /route`: where that prefill rank's ZMQ inbox is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankInfo {
    /// Inbox host.
    pub rank_ip: String,
    /// Inbox port.
    pub rank_port: u16,
}
