//! Validation of the `kvx` flags before any traffic: value parsers that clap runs on every
//! flag and environment variable (so its error names the flag and shows the value), and the
//! checks across flags ([`ConfigError`]) each command makes before it binds a socket.
//!
//! Timeouts are finite positive seconds up to [`MAX_SECONDS`] (a `Duration` or an `Instant`
//! deadline of more would overflow), counts are non-zero, fractions lie in `[0, 1]`, booleans
//! read as sglang's `get_bool_env_var` (`true`/`false`/`1`/`0`, any case), addresses are
//! `host:port` with a port in 1–65535.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The longest timeout accepted, in seconds (one year).
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// Why one flag's value was refused (clap prefixes the flag and the value).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ValueError {
    /// Not a number.
    #[error("not a number (expected {expected})")]
    NotANumber {
        /// What was expected.
        expected: &'static str,
    },
    /// A number outside the valid range.
    #[error("out of range (expected {expected})")]
    OutOfRange {
        /// What was expected.
        expected: &'static str,
    },
    /// Not a boolean as sglang reads one.
    #[error("not a boolean (expected true, false, 1 or 0, any case)")]
    NotABool,
    /// Not `host:port`.
    #[error("expected host:port with a port in 1-65535 (e.g. 10.0.0.1:8998 or [::1]:8998): {0}")]
    HostPort(&'static str),
}

const SECONDS: &str = "seconds, a finite number > 0 and <= 31536000";

/// A timeout in seconds: finite, > 0, at most [`MAX_SECONDS`].
pub fn seconds(s: &str) -> Result<f64, ValueError> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| ValueError::NotANumber { expected: SECONDS })?;
    if v.is_finite() && v > 0.0 && v <= MAX_SECONDS {
        Ok(v)
    } else {
        Err(ValueError::OutOfRange { expected: SECONDS })
    }
}

/// Seconds as a `Duration` (for values [`seconds`] accepted; anything else is clamped into its
/// range rather than panicking).
pub fn duration(secs: f64) -> Duration {
    if secs.is_nan() {
        return Duration::ZERO;
    }
    Duration::from_secs_f64(secs.clamp(0.0, MAX_SECONDS))
}

const INTERVAL: &str = "seconds, a finite number >= 0 (0: none) and <= 31536000";

/// A reporting interval in seconds: like [`seconds`], or 0 for none.
pub fn interval(s: &str) -> Result<f64, ValueError> {
    match s.trim().parse::<f64>() {
        Ok(0.0) => Ok(0.0),
        Ok(_) => seconds(s).map_err(|_| ValueError::OutOfRange { expected: INTERVAL }),
        Err(_) => Err(ValueError::NotANumber { expected: INTERVAL }),
    }
}

const BYTES: &str = "a byte count >= 1, optionally with K, M or G (powers of 1024), e.g. 4K";

/// A non-zero byte count, `4096`, `4K`, `1M` or `1G` (powers of 1024).
pub fn byte_count(s: &str) -> Result<u64, ValueError> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        _ => (t, 0),
    };
    let v: u64 = digits
        .parse()
        .map_err(|_| ValueError::NotANumber { expected: BYTES })?;
    match v.checked_shl(shift).filter(|b| *b != 0 && b >> shift == v) {
        Some(b) => Ok(b),
        None => Err(ValueError::OutOfRange { expected: BYTES }),
    }
}

const COUNT: &str = "an integer >= 1";

/// A non-zero count.
pub fn count(s: &str) -> Result<usize, ValueError> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| ValueError::NotANumber { expected: COUNT })?;
    if v == 0 {
        return Err(ValueError::OutOfRange { expected: COUNT });
    }
    Ok(v)
}

/// A non-zero count as `u64`.
pub fn count_u64(s: &str) -> Result<u64, ValueError> {
    count(s).map(|v| v as u64)
}

/// A non-zero count as `u32`.
pub fn count_u32(s: &str) -> Result<u32, ValueError> {
    let v = count(s)?;
    u32::try_from(v).map_err(|_| ValueError::OutOfRange {
        expected: "an integer in 1-4294967295",
    })
}

const FRACTION: &str = "a number in [0, 1]";

/// A fraction in `[0, 1]`.
pub fn fraction(s: &str) -> Result<f64, ValueError> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| ValueError::NotANumber { expected: FRACTION })?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(ValueError::OutOfRange { expected: FRACTION })
    }
}

/// A boolean as sglang's `get_bool_env_var` reads it: `true`/`1` or `false`/`0`, any case
/// (sglang warns and reads `false` for anything else; kvx refuses it).
pub fn sglang_bool(s: &str) -> Result<bool, ValueError> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(ValueError::NotABool),
    }
}

/// `host:port` (IPv6 hosts in brackets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPort {
    /// Host (without brackets).
    pub host: String,
    /// Port, 1–65535.
    pub port: u16,
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Parses `host:port`.
pub fn host_port(s: &str) -> Result<HostPort, ValueError> {
    let (host, port) = s.rsplit_once(':').ok_or(ValueError::HostPort("no port"))?;
    let host = host.trim_matches(['[', ']']);
    if host.is_empty() {
        return Err(ValueError::HostPort("no host"));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| ValueError::HostPort("the port is not a number in 1-65535"))?;
    if port == 0 {
        return Err(ValueError::HostPort("port 0"));
    }
    Ok(HostPort {
        host: host.to_owned(),
        port,
    })
}

/// A check across flags that failed (before anything was bound or sent).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A rank not below its size.
    #[error("{rank_flag} {rank} is out of range for {size_flag} {size} (expected 0..={max})", max = .size.saturating_sub(1))]
    RankOutOfRange {
        /// The rank's flag.
        rank_flag: &'static str,
        /// The rank.
        rank: u32,
        /// The size's flag.
        size_flag: &'static str,
        /// The size.
        size: u32,
    },
    /// A value too small for another flag.
    #[error("{flag} {value} {why}")]
    Invalid {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// An output file that cannot be written.
    #[error("{flag} {path}: cannot be written (nothing was run)", path = .path.display())]
    Output {
        /// The flag.
        flag: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// For a clap error about a value that came from an environment variable (the flag itself is
/// absent from `argv`), the note naming that variable; `None` otherwise.
pub fn env_note(err: &clap::Error, cmd: &clap::Command, argv: &[String]) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    let long = arg.split_whitespace().next()?.strip_prefix("--")?;
    let given = argv.iter().any(|a| {
        a.strip_prefix("--")
            .is_some_and(|a| a == long || a.starts_with(&format!("{long}=")))
    });
    if given {
        return None;
    }
    let mut stack = vec![cmd];
    while let Some(c) = stack.pop() {
        for a in c.get_arguments() {
            if a.get_long() == Some(long)
                && let Some(env) = a.get_env()
                && std::env::var_os(env).is_some()
            {
                return Some(format!(
                    "note: the value of --{long} came from the environment variable {}",
                    env.to_string_lossy()
                ));
            }
        }
        stack.extend(c.get_subcommands());
    }
    None
}

/// `rank < size`.
pub fn rank_in_range(
    rank_flag: &'static str,
    rank: u32,
    size_flag: &'static str,
    size: u32,
) -> Result<(), ConfigError> {
    if rank < size {
        Ok(())
    } else {
        Err(ConfigError::RankOutOfRange {
            rank_flag,
            rank,
            size_flag,
            size,
        })
    }
}

/// Checks that `path` can be written (its directory exists and accepts a file) without
/// changing an existing file: an existing file is opened for writing, a new one is created
/// and removed again.
pub fn writable(flag: &'static str, path: &Path) -> Result<(), ConfigError> {
    let err = |source| ConfigError::Output {
        flag,
        path: path.to_owned(),
        source,
    };
    if path.is_dir() {
        return Err(err(std::io::Error::other("it is a directory")));
    }
    if path.exists() {
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map(drop)
            .map_err(err)
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(err)?;
        std::fs::remove_file(path).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn seconds_refuse_what_would_panic_or_mean_nothing() {
        for bad in ["1e30", "inf", "-inf", "NaN", "0", "-1", "", "x", "3.2e7"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(seconds("0.5"), Ok(0.5));
        assert_eq!(seconds("31536000"), Ok(MAX_SECONDS));
        assert_eq!(
            duration(f64::INFINITY),
            Duration::from_secs_f64(MAX_SECONDS)
        );
        assert_eq!(duration(f64::NAN), Duration::ZERO);
    }

    #[test]
    fn counts_fractions_and_booleans() {
        assert!(count("0").is_err());
        assert!(count("-1").is_err());
        assert_eq!(count("4"), Ok(4));
        assert!(count_u32("4294967296").is_err());
        assert!(fraction("2").is_err());
        assert!(fraction("-0.1").is_err());
        assert!(fraction("NaN").is_err());
        assert_eq!(fraction("1"), Ok(1.0));
        for (s, v) in [("TRUE", true), ("1", true), ("False", false), ("0", false)] {
            assert_eq!(sglang_bool(s), Ok(v), "{s}");
        }
        assert_eq!(sglang_bool("yes"), Err(ValueError::NotABool));
    }

    #[test]
    fn host_port_names_what_is_wrong() {
        assert_eq!(
            host_port("foo:bar"),
            Err(ValueError::HostPort("the port is not a number in 1-65535"))
        );
        assert_eq!(host_port("foo"), Err(ValueError::HostPort("no port")));
        assert_eq!(host_port(":1"), Err(ValueError::HostPort("no host")));
        let v6 = host_port("[::1]:8998").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 8998));
        assert_eq!(v6.to_string(), "[::1]:8998");
    }

    #[test]
    fn ranks_and_output_paths() {
        let e = rank_in_range("--tp-rank", 5, "--tp-size", 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--tp-rank 5 is out of range for --tp-size 2 (expected 0..=1)"
        );
        let dir = tempfile::tempdir().unwrap();
        assert!(writable("--summary-json", &dir.path().join("missing/x.json")).is_err());
        let ok = dir.path().join("x.json");
        writable("--summary-json", &ok).unwrap();
        assert!(!ok.exists(), "the probe leaves nothing behind");
        assert!(writable("--summary-json", dir.path()).is_err());
    }
}
