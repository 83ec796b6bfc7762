//! Reads a process's `/metrics` (Prometheus text format) over plain HTTP/1.0 and parses it into
//! samples, so that scenarios can check what a process says about itself (rooms by state, live
//! per-room entries, dropped frames, failures by cause).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// One sample: metric name, labels in order, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (for histograms including the `_bucket`/`_sum`/`_count` suffix).
    pub name: String,
    /// Label pairs as written.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

/// Every sample of one scrape.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// The samples in the order they came.
    pub samples: Vec<Sample>,
}

/// Why a line of the text format could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What was wrong.
    pub what: &'static str,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "metrics line {}: {}", self.line, self.what)
    }
}

impl std::error::Error for ParseError {}

fn parse_labels(s: &str) -> Option<(Vec<(String, String)>, &str)> {
    // `s` starts just after '{'; returns the labels and the rest after '}'.
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(r) = rest.strip_prefix('}') {
            return Some((labels, r));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_string();
        if key.is_empty() {
            return None;
        }
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => {
                    let (_, e) = chars.next()?;
                    value.push(match e {
                        'n' => '\n',
                        other => other,
                    });
                }
                c => value.push(c),
            }
        };
        labels.push((key, value));
        rest = &after[end + 1..];
    }
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

impl Metrics {
    /// Parses the Prometheus text exposition format (comments and blank lines skipped).
    pub fn parse(text: &str) -> Result<Metrics, ParseError> {
        let mut samples = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |what| ParseError { line: n + 1, what };
            let name_end = line
                .find(|c: char| c == '{' || c.is_whitespace())
                .ok_or(err("no value"))?;
            let name = &line[..name_end];
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            {
                return Err(err("bad metric name"));
            }
            let (labels, rest) = match line[name_end..].strip_prefix('{') {
                Some(r) => parse_labels(r).ok_or(err("bad labels"))?,
                None => (Vec::new(), &line[name_end..]),
            };
            let value = rest
                .split_whitespace()
                .next()
                .and_then(parse_value)
                .ok_or(err("bad value"))?;
            samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        Ok(Metrics { samples })
    }

    /// Sum of every sample named `name` whose labels include all of `want`; `None` if none does.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for s in &self.samples {
            if s.name == name
                && want
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
            {
                *found.get_or_insert(0.0) += s.value;
            }
        }
        found
    }

    /// The sum of every sample named `name`, whatever its labels. A metric missing from the scrape
    /// is an error naming it, never 0: a renamed metric or a process that never got as far as
    /// setting it must fail a verdict, not pass it.
    pub fn get(&self, name: &str) -> Result<f64, Absent> {
        self.get_where(name, &[])
    }

    /// Like [`Metrics::get`], over the samples whose labels include all of `want`.
    pub fn get_where(&self, name: &str, want: &[(&str, &str)]) -> Result<f64, Absent> {
        self.sum(name, want).ok_or_else(|| Absent {
            name: name.to_string(),
            labels: want
                .iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect::<Vec<_>>()
                .join(","),
        })
    }

    /// Events counted by a counter that the exporter lists only from its first increment
    /// (`kvx_worker_failures_total`, a `before` baseline of a failure counter): absent means
    /// none happened yet. Verdicts use this only where the figure must stay 0 or is subtracted
    /// as a baseline; a figure that must be positive is read with [`Metrics::get`].
    pub fn events(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.sum(name, want).unwrap_or(0.0)
    }
}

/// A metric a verdict needed is not in the scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Absent {
    /// The metric name.
    pub name: String,
    /// The label filter, as `k="v",…` (empty for none).
    pub labels: String,
}

impl std::fmt::Display for Absent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.labels.is_empty() {
            write!(f, "metric {} absent from /metrics", self.name)
        } else {
            write!(
                f,
                "metric {}{{{}}} absent from /metrics",
                self.name, self.labels
            )
        }
    }
}

impl std::error::Error for Absent {}

/// Fetches `http://addr/metrics` (from the calling thread's network namespace) and parses it.
pub fn scrape(addr: SocketAddr) -> Result<Metrics> {
    let body = http_get(addr, "/metrics")?;
    Ok(Metrics::parse(&body)?)
}

/// A minimal HTTP/1.0 GET; returns the body of a 200 answer.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("no HTTP header end from {addr}{path}");
    };
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1).is_none_or(|c| c != "200") {
        bail!("GET {addr}{path}: {status}");
    }
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TEXT: &str = r#"# HELP kvx_rooms rooms by state
# TYPE kvx_rooms gauge
kvx_rooms{state="success"} 12
kvx_rooms{state="failed",role="prefill"} 3
kvx_live_room_entries 0
kvx_bytes_total 1.5e9
kvx_batch_seconds_bucket{le="+Inf"} 7
kvx_failures_total{cause="peer \"x\" gone"} 2 1700000000000
"#;

    #[test]
    fn parses_samples_labels_and_values() {
        let m = Metrics::parse(TEXT).unwrap();
        assert_eq!(m.samples.len(), 6);
        assert_eq!(m.sum("kvx_rooms", &[("state", "success")]), Some(12.0));
        assert_eq!(m.get("kvx_rooms"), Ok(15.0));
        assert_eq!(m.get("kvx_bytes_total"), Ok(1.5e9));
        assert_eq!(m.sum("kvx_live_room_entries", &[]), Some(0.0));
        assert_eq!(m.sum("kvx_missing", &[]), None);
        assert_eq!(
            m.sum("kvx_failures_total", &[("cause", "peer \"x\" gone")]),
            Some(2.0)
        );
        assert_eq!(
            m.sum("kvx_batch_seconds_bucket", &[("le", "+Inf")]),
            Some(7.0)
        );
    }

    #[test]
    fn an_absent_metric_is_an_error_never_zero() {
        let m = Metrics::parse(TEXT).unwrap();
        let e = m.get("kvx_live_workers").unwrap_err();
        assert_eq!(
            e.to_string(),
            "metric kvx_live_workers absent from /metrics"
        );
        let e = m
            .get_where("kvx_rooms", &[("state", "bootstrapping")])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "metric kvx_rooms{state=\"bootstrapping\"} absent from /metrics"
        );
        // A gauge at 0 is present and reads as 0.
        assert_eq!(m.get("kvx_live_room_entries"), Ok(0.0));
        assert_eq!(m.get_where("kvx_rooms", &[("role", "prefill")]), Ok(3.0));
        // Only a counter of events reads its absence as none.
        assert_eq!(m.events("kvx_worker_failures_total", &[]), 0.0);
        assert_eq!(m.events("kvx_rooms", &[("state", "success")]), 12.0);
        assert!(Metrics::default().get("kvx_rooms").is_err());
    }

    #[test]
    fn rejects_broken_lines_with_their_number() {
        let e = Metrics::parse("ok 1\nbad{x=1} 2\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(Metrics::parse("name\n").is_err());
        assert!(Metrics::parse("name{a=\"b\"\n").is_err());
        assert!(Metrics::parse("na-me 1\n").is_err());
        assert!(Metrics::parse("name one\n").is_err());
    }

    #[test]
    fn http_get_reads_a_real_server() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.ends_with(b"\r\n\r\n") {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "request cut short");
                req.extend_from_slice(&buf[..n]);
            }
            assert!(String::from_utf8_lossy(&req).starts_with("GET /metrics "));
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nkvx_up 1\n")
                .unwrap();
        });
        let m = scrape(addr).unwrap();
        assert_eq!(m.get("kvx_up"), Ok(1.0));
        server.join().unwrap();
    }

    proptest! {
        #[test]
        fn never_panics_on_any_text(s in "\\PC{0,200}") {
            let _ = Metrics::parse(&s);
        }

        #[test]
        fn round_trips_generated_samples(
            name in "[a-z_][a-z0-9_]{0,20}",
            key in "[a-z_][a-z0-9_]{0,8}",
            val in "[ -~]{0,12}",
            v in -1e12f64..1e12,
        ) {
            let esc = val.replace('\\', "\\\\").replace('"', "\\\"");
            let text = format!("{name}{{{key}=\"{esc}\"}} {v}\n");
            let m = Metrics::parse(&text).unwrap();
            prop_assert_eq!(m.samples.len(), 1);
            prop_assert_eq!(&m.samples[0].labels[0].1, &val);
            prop_assert_eq!(m.samples[0].value, v);
        }
    }
}
