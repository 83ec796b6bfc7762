//! The bootstrap registry as a deterministic state machine: prefill ranks register, decodes
//! look them up, prefill senders record which DP rank serves a room, and old room entries are
//! swept. No I/O and no clock: every call that needs time takes `now`.
//!
//! Semantics follow sglang's bootstrap server (spec §1.2): topology scalars are
//! first-writer-wins, every `PUT /route` increments the registered count (a restarted rank
//! double counts, as in sglang) except one naming the inbox its slot already has (a live rank
//! re-registering with a restarted server, which kvx ranks do periodically, is idempotent),
//! and the instance is ready once all four sizes are known and `registered >= dp·cp·tp·pp`.
//!
//! sglang 0.5.23's additions are kept as that release keeps them — `kv_layout` first non-null
//! wins, `enable_kv_cache_sharding` first registration wins, `dsv41_spec_layout` and
//! `decode_allocation_policy` must agree across ranks (a disagreeing registration is refused
//! with 0.5.23's texts, [`RegistrationConflict`]) — and are served in the sentinel only once a
//! prefill registered in 0.5.23's form: an instance of sglang main prefills answers its decodes
//! with exactly the 15 keys they accept.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::pyjson::PyJson;
use super::types::{PrefillServerInfo, RankInfo, RankRegistration};

/// The four coordinates of a `GET /route` query (`-1` in all four is the sentinel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RouteQuery {
    /// `prefill_dp_rank`.
    pub dp_rank: i64,
    /// `prefill_cp_rank`.
    pub cp_rank: i64,
    /// `target_tp_rank`.
    pub tp_rank: i64,
    /// `target_pp_rank`.
    pub pp_rank: i64,
}

impl RouteQuery {
    /// The all-minus-one query that asks for the topology.
    pub const SENTINEL: RouteQuery = RouteQuery {
        dp_rank: -1,
        cp_rank: -1,
        tp_rank: -1,
        pp_rank: -1,
    };

    /// True for the all-minus-one sentinel.
    pub fn is_sentinel(&self) -> bool {
        *self == Self::SENTINEL
    }
}

/// A registered rank as [`Registry::ranks`] lists it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RegisteredRank {
    /// Its coordinates.
    pub at: RouteQuery,
    /// Its ZMQ inbox.
    pub info: RankInfo,
    /// The `prefill_http_port` it registered (its `/health`), if any.
    pub http_port: Option<u16>,
}

/// What a `GET /route` resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteAnswer {
    /// Not every rank registered yet; carries the registered count (HTTP 503).
    NotReady(u64),
    /// The topology, for the sentinel query (HTTP 200).
    Topology(Box<PrefillServerInfo>),
    /// The inbox of the requested rank (HTTP 200).
    Rank(RankInfo),
    /// No rank registered at those coordinates (HTTP 404).
    NotFound,
}

/// Topology scalars, each set by the first registration that carries it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Topology {
    attn_tp_size: Option<u32>,
    attn_cp_size: Option<u32>,
    dp_size: Option<u32>,
    pp_size: Option<u32>,
    page_size: Option<u64>,
    kv_cache_dtype: Option<String>,
    prefill_http_port: Option<u16>,
    follow_bootstrap_room: Option<bool>,
    enable_dsa_cache_layer_split: Option<bool>,
    /// A registration carried sglang 0.5.23's keys: the sentinel serves them.
    v0523: bool,
    kv_layout: Option<String>,
    enable_kv_cache_sharding: Option<bool>,
    /// Set by every accepted registration (all agree).
    dsv41_spec_layout: Option<PyJson>,
    /// Set by every accepted registration (all agree); `None` is `"early"`.
    decode_allocation_policy: Option<String>,
}

impl Topology {
    fn allocation_policy(&self) -> &str {
        self.decode_allocation_policy.as_deref().unwrap_or("early")
    }
}

/// A `PUT /route` that disagrees with the ranks registered before it (sglang 0.5.23 answers it
/// with 400 and these texts, and keeps nothing of it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationConflict {
    /// `dsv41_spec_layout` differs from the earlier ranks'.
    #[error("DeepSeek-V4.1 DSpark PD layout differs across prefill ranks")]
    DsparkLayout,
    /// `decode_allocation_policy` differs from the earlier ranks'.
    #[error("Inconsistent prefill allocation policies")]
    AllocationPolicy,
}

impl RegistrationConflict {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RegistrationConflict::DsparkLayout => "dspark_layout",
            RegistrationConflict::AllocationPolicy => "allocation_policy",
        }
    }
}

fn set_once<T>(slot: &mut Option<T>, value: Option<T>) {
    if slot.is_none() {
        *slot = value;
    }
}

/// The bootstrap server's whole state.
#[derive(Debug, Default)]
pub struct Registry {
    topology: Topology,
    ranks: HashMap<(i64, i64, i64, i64), RankInfo>,
    /// Each rank's own `prefill_http_port` (where its `/health` is), when it sent one.
    rank_http: HashMap<(i64, i64, i64, i64), u16>,
    registered: u64,
    room_to_dp_rank: HashMap<u64, (i64, Instant)>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a `PUT /route` registration, or refuses it (nothing kept, not counted) when its
    /// `dsv41_spec_layout` or `decode_allocation_policy` differs from the earlier ranks' — in
    /// that order, as sglang 0.5.23 checks them. A body without those keys (sglang main) has no
    /// layout and the `"early"` policy.
    pub fn register_rank(&mut self, r: &RankRegistration) -> Result<(), RegistrationConflict> {
        if self.registered > 0 {
            if self.topology.dsv41_spec_layout != r.dsv41_spec_layout {
                return Err(RegistrationConflict::DsparkLayout);
            }
            if self.topology.allocation_policy() != r.allocation_policy() {
                return Err(RegistrationConflict::AllocationPolicy);
            }
        }
        let t = &mut self.topology;
        t.dsv41_spec_layout = r.dsv41_spec_layout.clone();
        t.decode_allocation_policy = r.decode_allocation_policy.clone();
        t.v0523 |= r.has_0523_keys();
        set_once(&mut t.kv_layout, r.kv_layout.clone());
        set_once(
            &mut t.enable_kv_cache_sharding,
            Some(r.enable_kv_cache_sharding.unwrap_or(false)),
        );
        set_once(&mut t.attn_tp_size, Some(r.attn_tp_size));
        set_once(&mut t.attn_cp_size, Some(r.attn_cp_size));
        set_once(&mut t.dp_size, Some(r.dp_size()));
        set_once(&mut t.pp_size, Some(r.pp_size));
        set_once(&mut t.page_size, r.page_size);
        set_once(&mut t.kv_cache_dtype, r.kv_cache_dtype.clone());
        set_once(&mut t.prefill_http_port, r.prefill_http_port);
        set_once(
            &mut t.follow_bootstrap_room,
            Some(r.follow_bootstrap_room()),
        );
        set_once(
            &mut t.enable_dsa_cache_layer_split,
            Some(r.enable_dsa_cache_layer_split.unwrap_or(false)),
        );
        let key = (
            i64::from(r.dp_group()),
            i64::from(r.attn_cp_rank),
            i64::from(r.attn_tp_rank),
            i64::from(r.pp_rank),
        );
        let info = RankInfo {
            rank_ip: r.rank_ip.clone(),
            rank_port: r.rank_port,
        };
        // The same rank process registering again (a prefill making sure a restarted server
        // knows it) is idempotent; another process in the slot counts again, as in sglang.
        if self.ranks.get(&key) != Some(&info) {
            self.registered += 1;
        }
        self.ranks.insert(key, info);
        match r.prefill_http_port {
            Some(p) => self.rank_http.insert(key, p),
            None => self.rank_http.remove(&key),
        };
        Ok(())
    }

    /// Every registered rank: its coordinates, inbox and `/health` port (for health checks).
    pub fn ranks(&self) -> Vec<RegisteredRank> {
        let mut v: Vec<RegisteredRank> = self
            .ranks
            .iter()
            .map(
                |(&(dp_rank, cp_rank, tp_rank, pp_rank), info)| RegisteredRank {
                    at: RouteQuery {
                        dp_rank,
                        cp_rank,
                        tp_rank,
                        pp_rank,
                    },
                    info: info.clone(),
                    http_port: self
                        .rank_http
                        .get(&(dp_rank, cp_rank, tp_rank, pp_rank))
                        .copied(),
                },
            )
            .collect();
        v.sort_unstable_by_key(|r| (r.at.dp_rank, r.at.cp_rank, r.at.tp_rank, r.at.pp_rank));
        v
    }

    /// The inbox registered at `at`, ready or not.
    pub fn rank(&self, at: RouteQuery) -> Option<&RankInfo> {
        self.ranks
            .get(&(at.dp_rank, at.cp_rank, at.tp_rank, at.pp_rank))
    }

    /// Drops the rank at `at` if its slot still holds `info` (a rank that registered again
    /// meanwhile is kept); true when dropped. The registered count loses it and never stays
    /// above the ranks left (sglang's double counts of restarted ranks must not keep an
    /// instance with a dead rank ready): decodes get `503` until it registers again.
    pub fn drop_rank(&mut self, at: RouteQuery, info: &RankInfo) -> bool {
        let key = (at.dp_rank, at.cp_rank, at.tp_rank, at.pp_rank);
        if self.ranks.get(&key) != Some(info) {
            return false;
        }
        self.ranks.remove(&key);
        self.rank_http.remove(&key);
        self.registered = self
            .registered
            .saturating_sub(1)
            .min(self.ranks.len() as u64);
        true
    }

    /// How many `PUT /route` calls were recorded (re-registrations by another inbox included,
    /// repeats of a slot's current inbox not).
    pub fn registered(&self) -> u64 {
        self.registered
    }

    /// The number of ranks the instance has, once all four sizes are known. The sizes come from
    /// request bodies: a product beyond u64 saturates (such an instance is never ready).
    pub fn expected(&self) -> Option<u64> {
        let t = &self.topology;
        Some(
            u64::from(t.dp_size?)
                .saturating_mul(u64::from(t.attn_cp_size?))
                .saturating_mul(u64::from(t.attn_tp_size?))
                .saturating_mul(u64::from(t.pp_size?)),
        )
    }

    /// True once all four sizes are known and at least that many registrations arrived.
    pub fn is_ready(&self) -> bool {
        self.expected().is_some_and(|n| self.registered >= n)
    }

    /// The topology as the sentinel query returns it, if all sizes are known: sglang main's 15
    /// keys, plus sglang 0.5.23's once a prefill registered in that form.
    pub fn topology(&self) -> Option<PrefillServerInfo> {
        let t = &self.topology;
        let v0523 = t.v0523;
        Some(PrefillServerInfo {
            attn_tp_size: t.attn_tp_size?,
            attn_cp_size: t.attn_cp_size?,
            dp_size: t.dp_size?,
            pp_size: t.pp_size?,
            page_size: t.page_size,
            kv_cache_dtype: t.kv_cache_dtype.clone(),
            follow_bootstrap_room: t.follow_bootstrap_room.unwrap_or(true),
            enable_dsa_cache_layer_split: t.enable_dsa_cache_layer_split.unwrap_or(false),
            dsv41_spec_layout: t.dsv41_spec_layout.clone().filter(|_| v0523),
            kv_layout: t.kv_layout.clone().filter(|_| v0523),
            decode_allocation_policy: v0523.then(|| t.allocation_policy().to_owned()),
            enable_kv_cache_sharding: v0523.then(|| t.enable_kv_cache_sharding.unwrap_or(false)),
            prefill_http_port: t.prefill_http_port,
            target_tp_rank: None,
            target_tp_ranks: None,
            target_cp_ranks: None,
            target_pp_ranks: None,
            required_dst_info_num: None,
            required_prefill_response_num: None,
        })
    }

    /// Resolves a `GET /route` query.
    pub fn route(&self, q: RouteQuery) -> RouteAnswer {
        if !self.is_ready() {
            return RouteAnswer::NotReady(self.registered);
        }
        if q.is_sentinel() {
            return match self.topology() {
                Some(t) => RouteAnswer::Topology(Box::new(t)),
                None => RouteAnswer::NotReady(self.registered),
            };
        }
        match self
            .ranks
            .get(&(q.dp_rank, q.cp_rank, q.tp_rank, q.pp_rank))
        {
            Some(info) => RouteAnswer::Rank(info.clone()),
            None => RouteAnswer::NotFound,
        }
    }

    /// Records `POST /register_dp_rank`: `room` is served by `dp_rank`, as of `now`.
    pub fn register_dp_rank(&mut self, room: u64, dp_rank: i64, now: Instant) {
        self.room_to_dp_rank.insert(room, (dp_rank, now));
    }

    /// Answers `POST /query_dp_ranks`: the known rooms, in request order, without duplicates;
    /// unknown rooms are left out. Linear in the request (the list comes from a request body
    /// and is answered under the registry lock).
    pub fn query_dp_ranks(&self, rooms: &[u64]) -> Vec<(u64, i64)> {
        let mut out: Vec<(u64, i64)> = Vec::new();
        let mut seen = HashSet::new();
        for room in rooms {
            if let Some((dp, _)) = self.room_to_dp_rank.get(room)
                && seen.insert(*room)
            {
                out.push((*room, *dp));
            }
        }
        out
    }

    /// Drops room entries recorded more than `max_age` before `now`; returns how many.
    pub fn sweep_dp_ranks(&mut self, now: Instant, max_age: Duration) -> usize {
        let before = self.room_to_dp_rank.len();
        self.room_to_dp_rank
            .retain(|_, (_, at)| now.saturating_duration_since(*at) <= max_age);
        before - self.room_to_dp_rank.len()
    }

    /// Number of room → dp-rank entries held.
    pub fn dp_rank_entries(&self) -> usize {
        self.room_to_dp_rank.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(tp: u32, tp_rank: u32, port: u16) -> RankRegistration {
        RankRegistration {
            attn_tp_size: tp,
            attn_tp_rank: tp_rank,
            attn_cp_size: 1,
            attn_cp_rank: 0,
            attn_dp_size: 1,
            attn_dp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            system_dp_size: 1,
            system_dp_rank: 0,
            rank_ip: "10.0.0.1".into(),
            rank_port: port,
            page_size: Some(16),
            kv_cache_dtype: Some("auto".into()),
            load_balance_method: None,
            enable_dsa_cache_layer_split: None,
            prefill_http_port: Some(30000),
            kv_layout: None,
            dsv41_spec_layout: None,
            enable_kv_cache_sharding: None,
            decode_allocation_policy: None,
        }
    }

    /// `reg` as sglang 0.5.23 registers it (its four keys always present, layouts null).
    fn reg_0523(tp: u32, tp_rank: u32, port: u16) -> RankRegistration {
        RankRegistration {
            enable_kv_cache_sharding: Some(false),
            decode_allocation_policy: Some("early".into()),
            ..reg(tp, tp_rank, port)
        }
    }

    #[test]
    fn sentinel_serves_0523_keys_only_after_a_0523_registration() {
        let mut k = Registry::new();
        k.register_rank(&reg(1, 0, 5000)).unwrap();
        let t = k.topology().unwrap();
        assert!(
            !t.has_0523_keys(),
            "a sglang main instance keeps K's 15 keys"
        );
        let mut r = Registry::new();
        let mut first = reg_0523(2, 0, 5000);
        first.kv_layout = Some("nhd".into());
        r.register_rank(&first).unwrap();
        let mut second = reg_0523(2, 1, 5001);
        second.kv_layout = Some("other".into());
        second.enable_kv_cache_sharding = Some(true);
        second.prefill_http_port = Some(1);
        r.register_rank(&second).unwrap();
        let t = r.topology().unwrap();
        assert_eq!(t.decode_allocation_policy.as_deref(), Some("early"));
        assert_eq!(
            t.enable_kv_cache_sharding,
            Some(false),
            "first registration wins"
        );
        assert_eq!(t.kv_layout.as_deref(), Some("nhd"), "first non-null wins");
        assert_eq!(t.dsv41_spec_layout, None);
        assert_eq!(t.prefill_http_port, Some(30000));
    }

    #[test]
    fn disagreeing_ranks_are_refused_with_0523_texts() {
        let layout: PyJson = serde_json_layout(r#"{"num_draft_tokens": 4, "kv_item_lens": [64]}"#);
        let mut r = Registry::new();
        let mut a = reg_0523(2, 0, 5000);
        a.dsv41_spec_layout = Some(layout.clone());
        r.register_rank(&a).unwrap();
        // Same layout with keys reordered and 4 as 4.0: equal for Python, accepted.
        let mut b = reg_0523(2, 1, 5001);
        b.dsv41_spec_layout = Some(serde_json_layout(
            r#"{"kv_item_lens": [64], "num_draft_tokens": 4.0}"#,
        ));
        r.register_rank(&b).unwrap();
        let mut c = reg_0523(2, 1, 5002);
        let e = r.register_rank(&c).unwrap_err();
        assert_eq!(
            e.to_string(),
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks"
        );
        c.dsv41_spec_layout = Some(layout.clone());
        c.decode_allocation_policy = Some("prefill_complete".into());
        let e = r.register_rank(&c).unwrap_err();
        assert_eq!(e.to_string(), "Inconsistent prefill allocation policies");
        assert_eq!(e.kind(), "allocation_policy");
        // The layout is checked first; a refused registration changes nothing.
        c.dsv41_spec_layout = None;
        assert_eq!(r.register_rank(&c), Err(RegistrationConflict::DsparkLayout));
        assert_eq!(r.registered(), 2);
        let t = r.topology().unwrap();
        assert_eq!(t.dsv41_spec_layout, Some(layout));
        // A sglang main body has no layout and the "early" policy.
        let mut r = Registry::new();
        r.register_rank(&reg(1, 0, 5000)).unwrap();
        let mut p = reg_0523(1, 0, 5001);
        p.decode_allocation_policy = Some("prefill_complete".into());
        assert_eq!(
            r.register_rank(&p),
            Err(RegistrationConflict::AllocationPolicy)
        );
        assert_eq!(r.register_rank(&reg_0523(1, 0, 5001)), Ok(()));
    }

    fn serde_json_layout(s: &str) -> PyJson {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn ready_after_all_ranks_and_first_writer_wins() {
        let mut r = Registry::new();
        assert_eq!(r.route(RouteQuery::SENTINEL), RouteAnswer::NotReady(0));
        r.register_rank(&reg(2, 0, 5000)).unwrap();
        assert_eq!(r.route(RouteQuery::SENTINEL), RouteAnswer::NotReady(1));
        let mut second = reg(4, 1, 5001);
        second.page_size = Some(64);
        r.register_rank(&second).unwrap();
        let RouteAnswer::Topology(t) = r.route(RouteQuery::SENTINEL) else {
            panic!("not ready")
        };
        assert_eq!((t.attn_tp_size, t.page_size), (2, Some(16)));
        assert!(t.follow_bootstrap_room);
        let q = RouteQuery {
            dp_rank: 0,
            cp_rank: 0,
            tp_rank: 1,
            pp_rank: 0,
        };
        assert_eq!(
            r.route(q),
            RouteAnswer::Rank(RankInfo {
                rank_ip: "10.0.0.1".into(),
                rank_port: 5001
            })
        );
        assert_eq!(
            r.route(RouteQuery { tp_rank: 2, ..q }),
            RouteAnswer::NotFound
        );
    }

    #[test]
    fn sizes_whose_product_overflows_never_become_ready() {
        let mut r = Registry::new();
        let mut huge = reg(u32::MAX, 0, 5000);
        (huge.attn_cp_size, huge.pp_size, huge.attn_dp_size) = (u32::MAX, u32::MAX, u32::MAX);
        r.register_rank(&huge).unwrap();
        assert_eq!(r.expected(), Some(u64::MAX));
        assert!(!r.is_ready());
        assert_eq!(r.route(RouteQuery::SENTINEL), RouteAnswer::NotReady(1));
    }

    #[test]
    fn reregistration_double_counts() {
        let mut r = Registry::new();
        r.register_rank(&reg(2, 0, 5000)).unwrap();
        r.register_rank(&reg(2, 0, 5002)).unwrap();
        // sglang counts the restarted rank twice: "ready" although rank 1 never came.
        assert!(r.is_ready());
        assert_eq!(r.registered(), 2);
    }

    #[test]
    fn a_dropped_rank_is_not_routed_and_the_instance_waits_for_it_again() {
        let mut r = Registry::new();
        r.register_rank(&reg(2, 0, 5000)).unwrap();
        r.register_rank(&reg(2, 1, 5001)).unwrap();
        // A repeat of the same inbox is not counted; a restart elsewhere is (sglang).
        r.register_rank(&reg(2, 1, 5001)).unwrap();
        assert_eq!(r.registered(), 2);
        r.register_rank(&reg(2, 1, 5003)).unwrap();
        assert_eq!(r.registered(), 3);
        let at = RouteQuery {
            dp_rank: 0,
            cp_rank: 0,
            tp_rank: 1,
            pp_rank: 0,
        };
        let stale = RankInfo {
            rank_ip: "10.0.0.1".into(),
            rank_port: 5001,
        };
        assert!(!r.drop_rank(at, &stale), "the slot moved on");
        let cur = r.rank(at).unwrap().clone();
        assert!(r.drop_rank(at, &cur));
        assert!(!r.is_ready());
        assert_eq!(r.route(at), RouteAnswer::NotReady(1));
        assert_eq!(r.ranks().len(), 1);
        r.register_rank(&reg(2, 1, 5004)).unwrap();
        assert!(r.is_ready());
    }

    #[test]
    fn system_dp_overrides_attention_dp() {
        let mut a = reg(1, 0, 5000);
        a.system_dp_size = 2;
        a.system_dp_rank = 1;
        a.attn_dp_size = 4;
        a.attn_dp_rank = 3;
        a.load_balance_method = Some("round_robin".into());
        assert_eq!((a.dp_size(), a.dp_group()), (2, 1));
        assert!(!a.follow_bootstrap_room());
    }

    #[test]
    fn dp_rank_table_sweeps_old_entries_only() {
        let t0 = Instant::now();
        let mut r = Registry::new();
        r.register_dp_rank(7, 1, t0);
        r.register_dp_rank(8, 0, t0 + Duration::from_secs(100));
        assert_eq!(r.query_dp_ranks(&[8, 9, 7, 8]), vec![(8, 0), (7, 1)]);
        let many: Vec<u64> = (0..100_000u64)
            .map(|i| [7, 8, 9][(i % 3) as usize])
            .collect();
        assert_eq!(r.query_dp_ranks(&many), vec![(7, 1), (8, 0)]);
        let ttl = Duration::from_secs(120);
        assert_eq!(r.sweep_dp_ranks(t0 + Duration::from_secs(120), ttl), 0);
        assert_eq!(r.sweep_dp_ranks(t0 + Duration::from_secs(121), ttl), 1);
        assert_eq!(r.query_dp_ranks(&[7, 8]), vec![(8, 0)]);
        assert_eq!(r.dp_rank_entries(), 1);
    }
}
