//! The segment descriptor a Mooncake TE target returns on its handshake port (JSON), parsed
//! strictly and encoded the way the real engine expects it.
//!
//! A TCP descriptor names the segment (`name`, the session id), its transport (`protocol`:
//! `"tcp"`, or an array of transport names in multi-protocol builds), the data endpoint
//! (`tcp_data_host`, `tcp_data_port`), the data protocol version (`tcp_proto_version`, absent
//! means 1) and the registered buffers (`addr`, `length`, `name`). The real initiator refuses a
//! whole descriptor with one malformed buffer (empty name, zero address or length); the parser
//! here does the same, refuses overlapping or wrapping buffers, and keeps the buffers sorted so
//! that a destination can be checked with a binary search ([`MooncakeDescriptor::find`]).

use serde_json::{Map, Value};

use crate::segment::{RegionDesc, RegionKey, SegmentDescriptor};

/// The protocol name of the TCP transport.
pub const PROTOCOL_TCP: &str = "tcp";

/// One registered buffer of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeBuffer {
    /// The buffer's name (Mooncake's TCP transport uses the segment name; never empty).
    pub name: String,
    /// Absolute address in the target process (non-zero).
    pub addr: u64,
    /// Length in bytes (non-zero, `addr + length` does not wrap).
    pub length: u64,
}

impl MooncakeBuffer {
    /// True when `[addr, addr + len)` lies inside this buffer.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match addr.checked_add(len) {
            Some(end) => addr >= self.addr && end <= self.addr + self.length,
            None => false,
        }
    }
}

/// A TCP segment descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeDescriptor {
    /// The segment name (`host:rpc_port`, the session id).
    pub name: String,
    /// The transport the target speaks; always `"tcp"` after a successful parse.
    pub protocol: String,
    /// The data host; `None` when the target did not publish one (use the session id's host).
    pub tcp_data_host: Option<String>,
    /// The data port (non-zero).
    pub tcp_data_port: u16,
    /// The data protocol version (1 when absent; 2 and above mean acknowledged writes).
    pub tcp_proto_version: u32,
    /// Registered buffers, sorted by address, non-overlapping.
    pub buffers: Vec<MooncakeBuffer>,
}

/// A descriptor that could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MooncakeDescriptorError {
    /// Not JSON.
    #[error("bad JSON: {0}")]
    BadJson(String),
    /// JSON, but not an object.
    #[error("descriptor is not a JSON object")]
    NotObject,
    /// A required field is absent.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// A field has the wrong JSON type or an unusable value.
    #[error("bad field `{field}`: {detail}")]
    BadField {
        /// The field.
        field: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The target does not speak the TCP transport (e.g. `"rdma"`).
    #[error("protocol {0:?} is not \"tcp\"")]
    Protocol(String),
    /// A buffer element is malformed (the whole descriptor is refused, as Mooncake does).
    #[error("bad buffer #{index}: {detail}")]
    BadBuffer {
        /// Index in the JSON array.
        index: usize,
        /// What is wrong.
        detail: &'static str,
    },
}

impl MooncakeDescriptorError {
    /// A short stable label (metrics).
    pub fn cause(&self) -> &'static str {
        match self {
            MooncakeDescriptorError::BadJson(_) => "bad_json",
            MooncakeDescriptorError::NotObject => "not_object",
            MooncakeDescriptorError::Missing(_) => "missing_field",
            MooncakeDescriptorError::BadField { .. } => "bad_field",
            MooncakeDescriptorError::Protocol(_) => "protocol",
            MooncakeDescriptorError::BadBuffer { .. } => "bad_buffer",
        }
    }
}

type DescResult<T> = Result<T, MooncakeDescriptorError>;

fn bad(field: &'static str, detail: impl Into<String>) -> MooncakeDescriptorError {
    MooncakeDescriptorError::BadField {
        field,
        detail: detail.into(),
    }
}

fn string_field(o: &Map<String, Value>, field: &'static str) -> DescResult<Option<String>> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(field, "not a string")),
    }
}

fn u64_field(o: &Map<String, Value>, field: &'static str) -> DescResult<Option<u64>> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(field, "not an unsigned integer")),
    }
}

fn protocol(v: Option<&Value>) -> DescResult<String> {
    match v {
        None | Some(Value::Null) => Err(MooncakeDescriptorError::Missing("protocol")),
        Some(Value::String(s)) if s == PROTOCOL_TCP => Ok(s.clone()),
        Some(Value::String(s)) => Err(MooncakeDescriptorError::Protocol(s.clone())),
        Some(Value::Array(items)) => {
            let mut names = Vec::with_capacity(items.len());
            for it in items {
                names.push(
                    it.as_str()
                        .ok_or_else(|| bad("protocol", "array of non-strings"))?,
                );
            }
            if names.contains(&PROTOCOL_TCP) {
                Ok(PROTOCOL_TCP.to_owned())
            } else {
                Err(MooncakeDescriptorError::Protocol(names.join(",")))
            }
        }
        Some(_) => Err(bad("protocol", "neither a string nor an array")),
    }
}

fn buffer(index: usize, v: &Value) -> DescResult<MooncakeBuffer> {
    let b = |detail| MooncakeDescriptorError::BadBuffer { index, detail };
    let o = v.as_object().ok_or(b("not an object"))?;
    let name = match o.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return Err(b("empty name")),
        Some(_) => return Err(b("name is not a string")),
        None => return Err(b("missing name")),
    };
    let num = |k: &str, missing, not_u64| match o.get(k) {
        None => Err(b(missing)),
        Some(v) => v.as_u64().ok_or(b(not_u64)),
    };
    let addr = num("addr", "missing addr", "addr is not a u64")?;
    let length = num("length", "missing length", "length is not a u64")?;
    if addr == 0 {
        return Err(b("zero addr"));
    }
    if length == 0 {
        return Err(b("zero length"));
    }
    if addr.checked_add(length).is_none() {
        return Err(b("wraps the address space"));
    }
    Ok(MooncakeBuffer { name, addr, length })
}

impl MooncakeDescriptor {
    /// Parses a Metadata reply's JSON. Unknown fields (`timestamp`, `rdma_server_name`, ...)
    /// are ignored; everything the TCP path uses is checked.
    pub fn parse(json: &[u8]) -> DescResult<Self> {
        let v: Value = serde_json::from_slice(json)
            .map_err(|e| MooncakeDescriptorError::BadJson(e.to_string()))?;
        Self::from_value(&v)
    }

    /// Parses an already decoded JSON value.
    pub fn from_value(v: &Value) -> DescResult<Self> {
        let o = v.as_object().ok_or(MooncakeDescriptorError::NotObject)?;
        let name = string_field(o, "name")?.ok_or(MooncakeDescriptorError::Missing("name"))?;
        let protocol = protocol(o.get("protocol"))?;
        let port = u64_field(o, "tcp_data_port")?
            .ok_or(MooncakeDescriptorError::Missing("tcp_data_port"))?;
        let tcp_data_port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("tcp_data_port", format!("{port} is not a port")))?;
        let tcp_data_host = string_field(o, "tcp_data_host")?.filter(|h| !h.is_empty());
        let version = u64_field(o, "tcp_proto_version")?.unwrap_or(1);
        let tcp_proto_version = u32::try_from(version)
            .map_err(|_| bad("tcp_proto_version", format!("{version} out of range")))?;
        let items = match o.get("buffers") {
            None => return Err(MooncakeDescriptorError::Missing("buffers")),
            Some(Value::Array(a)) => a,
            Some(_) => return Err(bad("buffers", "not an array")),
        };
        let mut buffers = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            buffers.push((i, buffer(i, it)?));
        }
        buffers.sort_by_key(|(_, b)| b.addr);
        for w in buffers.windows(2) {
            if w[0].1.addr + w[0].1.length > w[1].1.addr {
                return Err(MooncakeDescriptorError::BadBuffer {
                    index: w[1].0,
                    detail: "overlaps another buffer",
                });
            }
        }
        Ok(MooncakeDescriptor {
            name,
            protocol,
            tcp_data_host,
            tcp_data_port,
            tcp_proto_version,
            buffers: buffers.into_iter().map(|(_, b)| b).collect(),
        })
    }

    /// True when the target acknowledges writes (protocol v2).
    pub fn is_v2(&self) -> bool {
        self.tcp_proto_version >= 2
    }

    /// The buffer containing `[addr, addr + len)`, if any (one buffer: adjacent ones do not
    /// merge, as on the target).
    pub fn find(&self, addr: u64, len: u64) -> Option<&MooncakeBuffer> {
        let i = self.buffers.partition_point(|b| b.addr <= addr);
        let b = self.buffers.get(i.checked_sub(1)?)?;
        b.contains(addr, len).then_some(b)
    }

    /// The JSON text (compact, with a trailing newline, as Mooncake writes it).
    pub fn to_json(&self) -> String {
        let buffers: Vec<Value> = self
            .buffers
            .iter()
            .map(|b| serde_json::json!({"addr": b.addr, "length": b.length, "name": b.name}))
            .collect();
        let mut o = Map::new();
        o.insert("buffers".into(), Value::Array(buffers));
        o.insert("name".into(), Value::String(self.name.clone()));
        o.insert("protocol".into(), Value::String(self.protocol.clone()));
        o.insert("rdma_server_name".into(), Value::String(String::new()));
        if let Some(h) = &self.tcp_data_host {
            o.insert("tcp_data_host".into(), Value::String(h.clone()));
        }
        o.insert("tcp_data_port".into(), Value::from(self.tcp_data_port));
        o.insert(
            "tcp_proto_version".into(),
            Value::from(self.tcp_proto_version),
        );
        let mut s = Value::Object(o).to_string();
        s.push('\n');
        s
    }

    /// The descriptor as kvx's backend-neutral form (`Session::remote`): endpoint = `name`,
    /// one region per buffer (Mooncake has no keys: every key is 0).
    pub fn to_segment(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            endpoint: self.name.clone(),
            regions: self
                .buffers
                .iter()
                .map(|b| RegionDesc {
                    base: b.addr,
                    len: b.length,
                    key: RegionKey(0),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OBSERVED: &str = r#"{"buffers":[{"addr":139649000000000,"length":134217728,"name":"127.0.0.1:15066"},
        {"addr":139650000000000,"length":83886080,"name":"127.0.0.1:15066"}],
        "name":"127.0.0.1:15066","protocol":"tcp","rdma_server_name":"",
        "tcp_data_host":"127.0.0.1","tcp_data_port":16547,"tcp_proto_version":2,
        "timestamp":"2026-12-01 20:37:50.619026"}"#;

    fn with(f: impl FnOnce(&mut Map<String, Value>)) -> Vec<u8> {
        let mut v: Value = serde_json::from_str(OBSERVED).unwrap();
        f(v.as_object_mut().unwrap());
        v.to_string().into_bytes()
    }

    #[test]
    fn observed_descriptor() {
        let d = MooncakeDescriptor::parse(OBSERVED.as_bytes()).unwrap();
        assert_eq!(d.name, "127.0.0.1:15066");
        assert_eq!(d.tcp_data_host.as_deref(), Some("127.0.0.1"));
        assert_eq!(d.tcp_data_port, 16547);
        assert!(d.is_v2());
        assert_eq!(d.buffers.len(), 2);
        assert!(d.find(139649000000000, 134217728).is_some());
        assert!(d.find(139649000000000 + 1, 134217728).is_none());
        assert!(d.find(139650000000000 + 83886079, 1).is_some());
        assert!(d.find(1, 1).is_none());
        let again = MooncakeDescriptor::parse(d.to_json().as_bytes()).unwrap();
        assert_eq!(again, d);
        assert_eq!(d.to_segment().regions.len(), 2);
    }

    #[test]
    fn legacy_and_variants() {
        let d = MooncakeDescriptor::parse(&with(|o| {
            o.remove("tcp_data_host");
            o.remove("tcp_proto_version");
            o.insert("buffers".into(), Value::Array(vec![]));
            o.insert("protocol".into(), serde_json::json!(["rdma", "tcp"]));
        }))
        .unwrap();
        assert_eq!(d.tcp_data_host, None);
        assert_eq!(d.tcp_proto_version, 1);
        assert!(!d.is_v2());
        assert!(d.buffers.is_empty());
        // Buffers come back sorted whatever their order.
        let d = MooncakeDescriptor::parse(&with(|o| {
            o.insert(
                "buffers".into(),
                serde_json::json!([{"addr": 9000, "length": 10, "name": "x"},
                                   {"addr": 100, "length": 10, "name": "x"}]),
            );
        }))
        .unwrap();
        assert_eq!(d.buffers[0].addr, 100);
    }

    #[test]
    fn strict_refusals() {
        use MooncakeDescriptorError as E;
        let p = |b: Vec<u8>| MooncakeDescriptor::parse(&b).unwrap_err();
        assert!(matches!(p(b"{nope".to_vec()), E::BadJson(_)));
        assert_eq!(p(b"[1]".to_vec()), E::NotObject);
        assert_eq!(p(with(|o| drop(o.remove("name")))), E::Missing("name"));
        assert_eq!(
            p(with(|o| drop(o.remove("protocol")))),
            E::Missing("protocol")
        );
        assert_eq!(
            p(with(|o| drop(o.remove("tcp_data_port")))),
            E::Missing("tcp_data_port")
        );
        assert_eq!(
            p(with(|o| drop(o.remove("buffers")))),
            E::Missing("buffers")
        );
        assert_eq!(
            p(with(|o| drop(o.insert("protocol".into(), "rdma".into())))),
            E::Protocol("rdma".into())
        );
        assert_eq!(
            p(with(|o| drop(
                o.insert("protocol".into(), serde_json::json!(["rdma"]))
            ))),
            E::Protocol("rdma".into())
        );
        for port in [
            serde_json::json!(0),
            serde_json::json!(70000),
            serde_json::json!("1"),
        ] {
            assert!(matches!(
                p(with(|o| drop(o.insert("tcp_data_port".into(), port)))),
                E::BadField {
                    field: "tcp_data_port",
                    ..
                }
            ));
        }
        assert!(matches!(
            p(with(|o| drop(o.insert("name".into(), 5.into())))),
            E::BadField { field: "name", .. }
        ));
        for (buf, detail) in [
            (
                serde_json::json!({"addr": 1, "length": 1, "name": ""}),
                "empty name",
            ),
            (
                serde_json::json!({"addr": 0, "length": 1, "name": "x"}),
                "zero addr",
            ),
            (
                serde_json::json!({"addr": 1, "length": 0, "name": "x"}),
                "zero length",
            ),
            (serde_json::json!({"addr": 1, "length": 1}), "missing name"),
            (
                serde_json::json!({"addr": -1, "length": 1, "name": "x"}),
                "addr is not a u64",
            ),
            (
                serde_json::json!({"addr": u64::MAX, "length": 2, "name": "x"}),
                "wraps the address space",
            ),
            (serde_json::json!(7), "not an object"),
        ] {
            let e = p(with(|o| {
                o.insert("buffers".into(), Value::Array(vec![buf]));
            }));
            assert_eq!(e, E::BadBuffer { index: 0, detail }, "{detail}");
        }
        let e = p(with(|o| {
            o.insert(
                "buffers".into(),
                serde_json::json!([{"addr": 100, "length": 10, "name": "x"},
                                   {"addr": 105, "length": 10, "name": "x"}]),
            );
        }));
        assert!(matches!(
            e,
            E::BadBuffer {
                detail: "overlaps another buffer",
                ..
            }
        ));
    }

    #[test]
    fn large_addresses_are_exact() {
        let d = MooncakeDescriptor::parse(&with(|o| {
            o.insert(
                "buffers".into(),
                serde_json::json!([{"addr": (1u64 << 60) + 1, "length": 3, "name": "x"}]),
            );
        }))
        .unwrap();
        assert_eq!(d.buffers[0].addr, (1u64 << 60) + 1);
    }

    proptest! {
        #[test]
        fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(d) = MooncakeDescriptor::parse(&b) {
                prop_assert_eq!(MooncakeDescriptor::parse(d.to_json().as_bytes()), Ok(d));
            }
        }

        #[test]
        fn never_panics_on_json_shapes(
            name in proptest::option::of(".{0,8}"),
            port in proptest::option::of(any::<i64>()),
            version in proptest::option::of(any::<i64>()),
            bufs in proptest::collection::vec((any::<u64>(), any::<u64>(), ".{0,3}"), 0..6),
        ) {
            let mut o = Map::new();
            if let Some(n) = name { o.insert("name".into(), n.into()); }
            o.insert("protocol".into(), "tcp".into());
            if let Some(p) = port { o.insert("tcp_data_port".into(), p.into()); }
            if let Some(v) = version { o.insert("tcp_proto_version".into(), v.into()); }
            o.insert("buffers".into(), Value::Array(bufs.iter().map(|(a, l, n)|
                serde_json::json!({"addr": a, "length": l, "name": n})).collect()));
            let text = Value::Object(o).to_string();
            if let Ok(d) = MooncakeDescriptor::parse(text.as_bytes()) {
                for w in d.buffers.windows(2) {
                    prop_assert!(w[0].addr + w[0].length <= w[1].addr);
                }
                prop_assert_eq!(MooncakeDescriptor::parse(d.to_json().as_bytes()), Ok(d));
            }
        }
    }
}
