//! JSON text the way Python's `json.dumps` writes it (what sglang's aiohttp server sends):
//! `", "` and `": "` separators, keys in insertion order, `ensure_ascii` escaping. Only the
//! scalar values the bootstrap API needs are supported.

use std::fmt::Write as _;

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

    proptest::proptest! {
        #[test]
        fn any_string_round_trips_and_stays_ascii(s in ".{0,40}", n in proptest::prelude::any::<i64>()) {
            let out = object([("k", PyValue::Str(&s)), ("n", PyValue::Int(n.into()))]);
            proptest::prop_assert!(out.is_ascii());
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            proptest::prop_assert_eq!(v["k"].as_str(), Some(s.as_str()));
            proptest::prop_assert_eq!(v["n"].as_i64(), Some(n));
        }
    }
}
