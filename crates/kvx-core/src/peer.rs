//! What a decode rank tells a prefill rank about itself: its endpoint, its transfer session, the
//! memory it registered (once per session) and, per request, where a room's KV must go.
//!
//! These are the owned, typed forms of sglang's registration (`None`) and per-request metadata
//! messages. `kvx-bootstrap` parses ZMQ frames into them and encodes them back; the room managers
//! in this crate consume them. Nothing here knows about frames or sockets.

use std::fmt;

use crate::Room;

/// A ZMQ endpoint of a rank's PULL inbox: host (IPv4, IPv6 without brackets, or a name) and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// Host as sent on the wire (frame 1), IPv6 without brackets.
    pub host: String,
    /// PULL port (frame 2).
    pub port: u16,
}

impl Endpoint {
    /// A new endpoint.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Endpoint {
            host: host.into(),
            port,
        }
    }

    /// True when the host is an IPv6 literal (contains a colon).
    pub fn is_ipv6(&self) -> bool {
        self.host.contains(':')
    }

    /// The ZMQ address as sglang writes it: `tcp://host:port`, IPv6 hosts bracketed.
    pub fn zmq_addr(&self) -> String {
        if self.is_ipv6() {
            format!("tcp://[{}]:{}", self.host, self.port)
        } else {
            format!("tcp://{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ipv6() {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Separates a session id's address from the process instance it names (see [`split_instance`]).
pub const INSTANCE_SEPARATOR: char = '#';

/// Splits a session id into its address and the process instance it names, if any:
/// `"10.0.0.2:17000#5f0c…"` → (`"10.0.0.2:17000"`, `Some("5f0c…")`). A kvx listener names a
/// fresh random instance in its endpoint, so that a sender that reaches the address after the
/// process behind it restarted sees another instance and fails instead of writing pages the new
/// process never offered. Mooncake TE session ids carry none (`"host:rpc_port"`).
pub fn split_instance(id: &str) -> (&str, Option<&str>) {
    match id.split_once(INSTANCE_SEPARATOR) {
        Some((addr, inst)) => (addr, Some(inst)),
        None => (id, None),
    }
}

/// A decode rank's transfer-engine session id, `"{ip}:{port}"` (`"[v6]:port"` for IPv6),
/// optionally followed by `#instance` (kvx's own listeners, see [`split_instance`]). Opaque to
/// kvx except for the port, which sglang uses for queue sharding.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub String);

impl SessionId {
    /// A new session id.
    pub fn new(s: impl Into<String>) -> Self {
        SessionId(s.into())
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The address part (without the `#instance` suffix).
    pub fn address(&self) -> &str {
        split_instance(&self.0).0
    }

    /// The process instance the id names, if any.
    pub fn instance(&self) -> Option<&str> {
        split_instance(&self.0).1
    }

    /// The integer after the address's last `:` (the transfer-engine RPC port), if any.
    pub fn port(&self) -> Option<u64> {
        self.address()
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
    }
}

/// sglang's transfer-queue shard for a room: the sum of its decode sessions' ports modulo the
/// queue count, so every chunk of a room (and every room with the same session set) lands on the
/// same queue and chunks stay ordered. Sessions without a numeric port count as 0; 0 queues ⇒ 0.
pub fn queue_shard<'a>(sessions: impl IntoIterator<Item = &'a SessionId>, queues: usize) -> usize {
    if queues == 0 {
        return 0;
    }
    let sum = sessions
        .into_iter()
        .fold(0u64, |acc, s| acc.wrapping_add(s.port().unwrap_or(0)));
    (sum % queues as u64) as usize
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A decode rank's staging ring as advertised in registration frames 14 and 15.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StagingRingInfo {
    /// Base address (frame 14, 8 bytes LE) if sent.
    pub base: Option<u64>,
    /// Total size in bytes (frame 15) if sent.
    pub size: Option<u64>,
}

impl StagingRingInfo {
    /// sglang treats staging as advertised iff the base is present or the size non-empty.
    pub fn advertised(&self) -> bool {
        self.base.is_some() || self.size.is_some()
    }
}

/// A decode rank's KV-args registration (sglang's `None` message, sent once per session).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeRegistration {
    /// Where status and other prefill→decode messages go.
    pub endpoint: Endpoint,
    /// The decode's transfer session id.
    pub session: SessionId,
    /// One address per KV buffer (MHA: K layers, then V layers, then draft buffers).
    pub kv_ptrs: Vec<u64>,
    /// One address per aux (metadata) buffer.
    pub aux_ptrs: Vec<u64>,
    /// Per state component, its buffer addresses.
    pub state_ptrs: Vec<Vec<u64>>,
    /// The decode's attention-TP rank (`engine_rank % attn_tp_size`).
    pub dst_tp_rank: u32,
    /// The decode's attention-TP size.
    pub dst_attn_tp_size: u32,
    /// Bytes per page of one KV buffer on the decode (0 when it has no KV).
    pub dst_kv_item_len: u64,
    /// Per state component, item lengths.
    pub state_item_lens: Vec<Vec<u32>>,
    /// Per state component, dimension per tensor.
    pub state_dim_per_tensor: Vec<Vec<u32>>,
    /// Global layer id per KV buffer (empty for plain pools).
    pub kv_layer_ids: Vec<u32>,
    /// Per state component, layer ids.
    pub state_layer_ids: Vec<Vec<u32>>,
    /// Staging ring, if advertised.
    pub staging: StagingRingInfo,
    /// Decode context-parallel size (default 1).
    pub dcp_size: u32,
    /// Decode context-parallel rank (default 0).
    pub dcp_rank: u32,
    /// Staging slot layer ids (u64 per slot; later sglang only). `None` when the frame is absent.
    pub staging_slot_layer_ids: Option<Vec<u64>>,
    /// Per-KV-buffer item lengths (frame 19, u64 LE each; sglang 0.5.23 only). `None` when the
    /// frame is absent. Its presence is what marks the decode as 0.5.23-shaped (see
    /// [`DecodeRegistration::accepts_status_reason`]).
    pub kv_item_lens: Option<Vec<u64>>,
}

impl DecodeRegistration {
    /// The registration of a plain decode rank in sglang main's 18-frame form: attention-TP
    /// rank 0 of 1, DCP 1, no state buffers, layer ids or staging ring. Other shapes set the
    /// fields over it.
    ///
    /// ```
    /// use kvx_core::{DecodeRegistration, Endpoint, SessionId};
    /// let reg = DecodeRegistration {
    ///     dst_tp_rank: 1,
    ///     dst_attn_tp_size: 2,
    ///     ..DecodeRegistration::plain(
    ///         Endpoint::new("10.0.0.2", 41235),
    ///         SessionId::new("10.0.0.2:15234"),
    ///         vec![0x7f12_a000_0000, 0x7f12_b000_0000],
    ///         vec![0x7f13_0000_0000],
    ///         2048,
    ///     )
    /// };
    /// assert!(!reg.accepts_status_reason());
    /// ```
    pub fn plain(
        endpoint: Endpoint,
        session: SessionId,
        kv_ptrs: Vec<u64>,
        aux_ptrs: Vec<u64>,
        dst_kv_item_len: u64,
    ) -> Self {
        DecodeRegistration {
            endpoint,
            session,
            kv_ptrs,
            aux_ptrs,
            state_ptrs: Vec::new(),
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            dst_kv_item_len,
            state_item_lens: Vec::new(),
            state_dim_per_tensor: Vec::new(),
            kv_layer_ids: Vec::new(),
            state_layer_ids: Vec::new(),
            staging: StagingRingInfo::default(),
            dcp_size: 1,
            dcp_rank: 0,
            staging_slot_layer_ids: None,
            kv_item_lens: None,
        }
    }

    /// True when the registration shows a decode whose status parser takes an optional 4th
    /// failure-reason frame: sglang 0.5.23 always sends frame 19 (`kv_item_lens`) and parses a
    /// reason frame; sglang main ("K") sends 18 frames and dies on a 4-frame status.
    pub fn accepts_status_reason(&self) -> bool {
        self.kv_item_lens.is_some()
    }
}

/// Where one room's data goes on one decode rank (absent for a dummy destination).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Destination {
    /// Destination KV page ids for the pages after the decode prefix (suffix-relative order).
    pub kv_pages: Vec<i32>,
    /// The decode's aux (metadata) row for this room.
    pub aux_index: i64,
    /// Destination state indices, one list per state component.
    pub state_indices: Vec<Vec<i32>>,
}

/// Per-request transfer metadata from one decode rank (frame 0 = room).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferRequest {
    /// The room.
    pub room: Room,
    /// The decode rank's endpoint.
    pub endpoint: Endpoint,
    /// The decode rank's session.
    pub session: SessionId,
    /// Where the data goes; `None` when this prefill rank is a dummy for the room.
    pub dst: Option<Destination>,
    /// How many decode sessions this prefill rank must hear from for the room.
    pub required_dst_info_num: u32,
    /// Decode radix-cache prefix in tokens (`None` when the frame is absent or empty).
    pub decode_prefix_len: Option<u64>,
    /// Device-side KV page ids (frame 9; HiSparse only), usually empty.
    pub device_kv_pages: Vec<i32>,
}

impl TransferRequest {
    /// True for a dummy destination (no data, no status message).
    pub fn is_dummy(&self) -> bool {
        self.dst.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_sessions() {
        assert_eq!(
            Endpoint::new("10.0.0.2", 41235).zmq_addr(),
            "tcp://10.0.0.2:41235"
        );
        assert_eq!(
            Endpoint::new("fe80::1", 5555).zmq_addr(),
            "tcp://[fe80::1]:5555"
        );
        assert_eq!(SessionId::new("[fe80::1]:15234").port(), Some(15234));
        assert_eq!(SessionId::new("nocolon").port(), None);
        let named = SessionId::new("10.0.0.2:17000#00ff00ff00ff00ff");
        assert_eq!(named.port(), Some(17000));
        assert_eq!(named.address(), "10.0.0.2:17000");
        assert_eq!(named.instance(), Some("00ff00ff00ff00ff"));
        assert_eq!(SessionId::new("[fe80::1]:15234").instance(), None);
        let sessions = [
            SessionId::new("10.0.0.2:15234"),
            SessionId::new("[fe80::1]:15235"),
        ];
        assert_eq!(queue_shard(&sessions, 4), (15234 + 15235) % 4);
        assert_eq!(queue_shard(&sessions, 0), 0);
    }
}
