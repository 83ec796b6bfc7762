//! JSON text the way Python's `json.dumps` writes it (what sglang's aiohttp server sends):
//! `", "` and `": "` separators, keys in insertion order, `ensure_ascii` escaping, floats as
//! Python's `repr`. [`PyValue`] holds the scalars the bootstrap API renders; [`PyJson`] is an owned
//! JSON value read from a request body the way `json.loads` reads it into Python objects (object
//! keys keep their order, a repeated key its first place and last value), compared the way Python
//! compares them (`1 == 1.0 == True`, dicts regardless of key order), so a value a prefill
//! registered (sglang 0.5.23's `dsv41_spec_layout`) is checked and relayed as sglang would.

use std::fmt::{self, Write as _};

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A scalar JSON value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PyValue<'a> {
    /// `null` (Python `None`).
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer.
    Int(i128),
    /// A string, escaped as Python does with `ensure_ascii=True`.
    Str(&'a str),
    /// Any JSON value (rendered recursively).
    Json(&'a PyJson),
}

impl<'a> From<Option<&'a str>> for PyValue<'a> {
    fn from(v: Option<&'a str>) -> Self {
        v.map_or(PyValue::Null, PyValue::Str)
    }
}

/// `Some(n)` as an integer, `None` as `null`.
pub fn opt_int(v: Option<impl Into<i128>>) -> PyValue<'static> {
    v.map_or(PyValue::Null, |n| PyValue::Int(n.into()))
}

/// Renders an object with the keys in the given order: `{"a": 1, "b": null}`.
pub fn object<'a>(pairs: impl IntoIterator<Item = (&'a str, PyValue<'a>)>) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_str(&mut out, k);
        out.push_str(": ");
        push_value(&mut out, v);
    }
    out.push('}');
    out
}

fn push_value(out: &mut String, v: PyValue<'_>) {
    match v {
        PyValue::Null => out.push_str("null"),
        PyValue::Bool(true) => out.push_str("true"),
        PyValue::Bool(false) => out.push_str("false"),
        PyValue::Int(n) => {
            let _ = write!(out, "{n}");
        }
        PyValue::Str(s) => push_str(out, s),
        PyValue::Json(j) => push_json(out, j),
    }
}

fn push_json(out: &mut String, v: &PyJson) {
    match v {
        PyJson::Null => out.push_str("null"),
        PyJson::Bool(b) => push_value(out, PyValue::Bool(*b)),
        PyJson::Int(n) => push_value(out, PyValue::Int(*n)),
        PyJson::Float(f) => push_float(out, *f),
        PyJson::Str(s) => push_str(out, s),
        PyJson::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                push_json(out, item);
            }
            out.push(']');
        }
        PyJson::Object(pairs) => {
            out.push('{');
            for (i, (k, item)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                push_str(out, k);
                out.push_str(": ");
                push_json(out, item);
            }
            out.push('}');
        }
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional when the decimal
/// exponent is in `-4..16` (with `.0` for integral values), else `d.ddde+XX`. JSON has no NaN
/// or infinity; they render as Python's `json.dumps` would (`NaN`, `Infinity`).
fn push_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // `{:e}` gives the shortest round-tripping digits as `[-]d[.ddd]e[-]x`.
    let sci = format!("{f:e}");
    let (neg, sci) = match sci.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, sci.as_str()),
    };
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                let (int, frac) = digits.split_at(int_len);
                out.push_str(int);
                out.push('.');
                out.push_str(frac);
            }
        }
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
}

/// An owned JSON value as Python's `json.loads` holds it (see the module docs). Integers beyond
/// 64 bits arrive as floats (serde_json's reading), so they compare and render as floats.
#[derive(Clone, Debug)]
pub enum PyJson {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer.
    Int(i128),
    /// A floating-point number (never NaN or infinite when read from JSON).
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    List(Vec<PyJson>),
    /// An object, keys in first-seen order, each key once.
    Object(Vec<(String, PyJson)>),
}

impl PyJson {
    /// The value as a number, the way Python compares numbers (`True == 1`).
    fn number(&self) -> Option<Num> {
        match *self {
            PyJson::Bool(b) => Some(Num::Int(i128::from(b))),
            PyJson::Int(n) => Some(Num::Int(n)),
            PyJson::Float(f) => Some(Num::Float(f)),
            _ => None,
        }
    }

    /// Renders the value as Python's `json.dumps` does.
    pub fn to_python_json(&self) -> String {
        let mut out = String::new();
        push_json(&mut out, self);
        out
    }
}

#[derive(Clone, Copy)]
enum Num {
    Int(i128),
    Float(f64),
}

impl PartialEq for Num {
    fn eq(&self, other: &Num) -> bool {
        match (*self, *other) {
            (Num::Int(a), Num::Int(b)) => a == b,
            (Num::Float(a), Num::Float(b)) => a == b,
            // Python compares an int and a float exactly: the float must be integral and equal.
            (Num::Int(i), Num::Float(f)) | (Num::Float(f), Num::Int(i)) => {
                f.is_finite() && f.fract() == 0.0 && f.abs() < 1.8e38 && f as i128 == i
            }
        }
    }
}

/// Python's `==` on the values `json.loads` makes: numbers (and bools) by value, lists in order,
/// dicts as maps.
impl PartialEq for PyJson {
    fn eq(&self, other: &PyJson) -> bool {
        if let (Some(a), Some(b)) = (self.number(), other.number()) {
            return a == b;
        }
        match (self, other) {
            (PyJson::Null, PyJson::Null) => true,
            (PyJson::Str(a), PyJson::Str(b)) => a == b,
            (PyJson::List(a), PyJson::List(b)) => a == b,
            (PyJson::Object(a), PyJson::Object(b)) => {
                a.len() == b.len()
                    && a.iter()
                        .all(|(k, v)| b.iter().any(|(k2, v2)| k == k2 && v == v2))
            }
            _ => false,
        }
    }
}

/// Reflexive for every value read from JSON (which has no NaN).
impl Eq for PyJson {}

impl<'de> Deserialize<'de> for PyJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PyJson;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<PyJson, E> {
                Ok(PyJson::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<PyJson, E> {
                Ok(PyJson::Null)
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<PyJson, D2::Error> {
                PyJson::deserialize(d)
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<PyJson, E> {
                Ok(PyJson::Bool(b))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<PyJson, E> {
                Ok(PyJson::Int(n.into()))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<PyJson, E> {
                Ok(PyJson::Int(n.into()))
            }
            fn visit_i128<E: de::Error>(self, n: i128) -> Result<PyJson, E> {
                Ok(PyJson::Int(n))
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<PyJson, E> {
                Ok(PyJson::Float(f))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PyJson, E> {
                Ok(PyJson::Str(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<PyJson, E> {
                Ok(PyJson::Str(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PyJson, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(PyJson::List(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PyJson, A::Error> {
                let mut pairs: Vec<(String, PyJson)> = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, PyJson>()? {
                    // A dict keeps a repeated key's first place and its last value.
                    match pairs.iter_mut().find(|(k2, _)| *k2 == k) {
                        Some(slot) => slot.1 = v,
                        None => pairs.push((k, v)),
                    }
                }
                Ok(PyJson::Object(pairs))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for PyJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PyJson::Null => s.serialize_unit(),
            PyJson::Bool(b) => s.serialize_bool(*b),
            PyJson::Int(n) => match i64::try_from(*n) {
                Ok(n) => s.serialize_i64(n),
                Err(_) => s.serialize_i128(*n),
            },
            PyJson::Float(f) => s.serialize_f64(*f),
            PyJson::Str(x) => s.serialize_str(x),
            PyJson::List(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            PyJson::Object(pairs) => {
                let mut map = s.serialize_map(Some(pairs.len()))?;
                for (k, v) in pairs {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

fn push_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_separators_and_escapes() {
        let s = object([
            ("a", PyValue::Int(-1)),
            ("b", PyValue::Null),
            ("c", PyValue::Bool(true)),
            ("d", PyValue::Str("x\"\\\n\u{7f}é😀")),
        ]);
        // json.dumps({"a": -1, "b": None, "c": True, "d": "x\"\\\n\x7fé😀"})
        assert_eq!(
            s,
            r#"{"a": -1, "b": null, "c": true, "d": "x\"\\\n\u007f\u00e9\ud83d\ude00"}"#
        );
        assert_eq!(object([]), "{}");
    }

    #[test]
    fn floats_render_as_python_repr() {
        // repr() of each, as Python 3.11 prints it.
        for (f, want) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.5, "0.5"),
            (123.25, "123.25"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
            (0.1, "0.1"),
            (1.0 / 3.0, "0.3333333333333333"),
        ] {
            assert_eq!(PyJson::Float(f).to_python_json(), want, "{f:e}");
        }
    }

    #[test]
    fn json_values_keep_order_and_compare_as_python() {
        let a: PyJson =
            serde_json::from_str(r#"{"b": [1, 2.5, true, null], "a": {"x": "é"}, "b": [3]}"#)
                .unwrap();
        // json.dumps(json.loads(...)): first place, last value.
        assert_eq!(a.to_python_json(), r#"{"b": [3], "a": {"x": "\u00e9"}}"#);
        let b: PyJson = serde_json::from_str(r#"{"a": {"x": "é"}, "b": [3.0]}"#).unwrap();
        assert_eq!(a, b, "dicts regardless of order, 3 == 3.0");
        let c: PyJson = serde_json::from_str(r#"{"a": {"x": "é"}, "b": [true]}"#).unwrap();
        assert_ne!(a, c);
        assert_eq!(
            serde_json::from_str::<PyJson>("[true, 1.0]").unwrap(),
            serde_json::from_str::<PyJson>("[1, true]").unwrap()
        );
        assert_ne!(PyJson::Null, PyJson::Int(0));
        assert_ne!(PyJson::Str("1".into()), PyJson::Int(1));
        // Serializing keeps the order too.
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#"{"b":[3],"a":{"x":"é"}}"#
        );
        assert_eq!(
            object([("k", PyValue::Json(&a))]),
            r#"{"k": {"b": [3], "a": {"x": "\u00e9"}}}"#
        );
    }

    proptest::proptest! {
        #[test]
        fn any_string_round_trips_and_stays_ascii(s in ".{0,40}", n in proptest::prelude::any::<i64>()) {
            let out = object([("k", PyValue::Str(&s)), ("n", PyValue::Int(n.into()))]);
            proptest::prop_assert!(out.is_ascii());
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            proptest::prop_assert_eq!(v["k"].as_str(), Some(s.as_str()));
            proptest::prop_assert_eq!(v["n"].as_i64(), Some(n));
        }

        #[test]
        fn any_float_renders_to_itself(f in proptest::prelude::any::<f64>()) {
            proptest::prop_assume!(f.is_finite());
            let out = PyJson::Float(f).to_python_json();
            proptest::prop_assert_eq!(out.parse::<f64>().ok(), Some(f));
            // Python floats always show a '.', an 'e' or both.
            proptest::prop_assert!(out.contains('.') || out.contains('e'), "{}", out);
        }

        #[test]
        fn any_json_text_never_panics(s in ".{0,64}") {
            if let Ok(v) = serde_json::from_str::<PyJson>(&s) {
                let again: PyJson = serde_json::from_str(&v.to_python_json()).unwrap();
                proptest::prop_assert_eq!(again, v);
            }
        }
    }
}
