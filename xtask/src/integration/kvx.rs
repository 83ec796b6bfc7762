//! The `kvx` binary under test: where it is, how it is built (debug, with the `failpoints`
//! feature), and which subcommands and flags it offers (read from its `--help`), so that a
//! scenario whose support is missing says so instead of failing or passing falsely.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Subcommands whose help is read.
const SUBCOMMANDS: &[&str] = &["bootstrap", "prefill", "decode", "demo", "send", "recv"];

/// Failpoints the scenarios arm through `FAILPOINTS` (`fail_point!` in `crates/kvx-cli`).
pub const FAILPOINTS: &[&str] = &["kvx::transfer_worker::batch", "kvx::transfer_worker::chunk"];

/// A probed `kvx` binary.
#[derive(Debug, Clone)]
pub struct Kvx {
    /// Path of the binary.
    pub path: PathBuf,
    help: BTreeMap<String, String>,
    /// The names of [`FAILPOINTS`] compiled into the binary.
    failpoints: Vec<String>,
}

/// Builds the debug binary with failpoints into the current target dir and returns its path.
pub fn build(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root)
        .args(["build", "-q", "-p", "kvx-cli", "--features", "failpoints"])
        .output()
        .context("starting cargo build")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(15).collect();
        bail!(
            "cargo build -p kvx-cli --features failpoints failed:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_relative() { root.join(t) } else { t })
        .unwrap_or_else(|| root.join("target"));
    let bin = target.join("debug").join("kvx");
    if !bin.exists() {
        bail!("built, but {} is missing", bin.display());
    }
    Ok(bin)
}

impl Kvx {
    /// Reads the binary's help texts.
    pub fn probe(path: &Path) -> Result<Kvx> {
        let mut help = BTreeMap::new();
        let top = help_of(path, &[])?;
        for sub in SUBCOMMANDS {
            if let Ok(text) = help_of(path, &[sub])
                && (text.contains("Usage") || text.contains("USAGE"))
            {
                help.insert((*sub).to_string(), text);
            }
        }
        help.insert(String::new(), top);
        let failpoints = compiled_failpoints(path, FAILPOINTS)?;
        Ok(Kvx {
            path: path.to_path_buf(),
            help,
            failpoints,
        })
    }

    /// `Ok` when every failpoint in `points` is compiled into the binary, else why not (for a
    /// FAIL verdict: a scenario that cannot inject its fault proves nothing).
    pub fn has_failpoints(&self, points: &[&str]) -> Result<(), String> {
        let missing: Vec<&str> = points
            .iter()
            .copied()
            .filter(|p| !self.failpoints.iter().any(|f| f == p))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} has no failpoint {} (built without `--features failpoints`?), so the fault cannot be injected",
                self.path.display(),
                missing.join(", ")
            ))
        }
    }

    /// A binary with the given help texts (for tests of the support checks).
    #[cfg(test)]
    pub fn with_help(help: &[(&str, &str)]) -> Kvx {
        Kvx {
            path: PathBuf::from("kvx"),
            help: help
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            failpoints: FAILPOINTS.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Whether subcommand `sub` exists.
    pub fn has(&self, sub: &str) -> bool {
        self.help.contains_key(sub)
    }

    /// Whether subcommand `sub` takes `--flag` (given with its dashes).
    pub fn has_flag(&self, sub: &str, flag: &str) -> bool {
        self.help.get(sub).is_some_and(|h| {
            h.split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[')
                .any(|w| w == flag)
        })
    }

    /// `Ok` when every subcommand and flag in `needs` (`"decode --summary-json"`, `"bootstrap"`)
    /// exists, else the list of what is missing, for a SKIP verdict.
    pub fn supports(&self, needs: &[&str]) -> Result<(), String> {
        let missing: Vec<&str> = needs
            .iter()
            .copied()
            .filter(|n| {
                let mut it = n.split_whitespace();
                let sub = it.next().unwrap_or_default();
                match it.next() {
                    None => !self.has(sub),
                    Some(flag) => !self.has_flag(sub, flag),
                }
            })
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("kvx lacks {}", missing.join(", ")))
        }
    }
}

/// Which of `names` occur in the binary at `path`. `fail_point!(name, …)` compiles to a call
/// holding `name` only with the `fail/failpoints` feature; without it the macro expands to
/// nothing and the name (used nowhere else in `kvx`) is absent from the binary.
fn compiled_failpoints(path: &Path, names: &[&str]) -> Result<Vec<String>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(names
        .iter()
        .filter(|n| contains(&bytes, n.as_bytes()))
        .map(|n| n.to_string())
        .collect())
}

/// Whether `needle` (non-empty) occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    let Some((&first, rest)) = needle.split_first() else {
        return true;
    };
    let mut at = 0;
    while let Some(i) = hay[at..].iter().position(|&b| b == first) {
        let start = at + i + 1;
        if hay.get(start..start + rest.len()) == Some(rest) {
            return true;
        }
        at = start;
    }
    false
}

fn help_of(path: &Path, sub: &[&str]) -> Result<String> {
    let out = Command::new(path)
        .args(sub)
        .arg("--help")
        .output()
        .with_context(|| format!("running {} --help", path.display()))?;
    Ok(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn support_checks_read_flags_from_help() {
        let k = Kvx::with_help(&[
            ("", "Usage: kvx <COMMAND>"),
            (
                "decode",
                "Usage: kvx decode [OPTIONS]\n  --summary-json <PATH>  write\n  -r, --requests <N>\n  --fragment[=<F>]",
            ),
        ]);
        assert!(k.has("decode") && !k.has("prefill"));
        assert!(k.has_flag("decode", "--summary-json"));
        assert!(k.has_flag("decode", "--requests"));
        assert!(k.has_flag("decode", "--fragment"));
        assert!(!k.has_flag("decode", "--summary"));
        assert!(k.supports(&["decode", "decode --requests"]).is_ok());
        assert_eq!(
            k.supports(&["prefill", "decode --abort-after"])
                .unwrap_err(),
            "kvx lacks prefill, decode --abort-after"
        );
    }

    #[test]
    fn failpoints_are_found_only_when_compiled_in() {
        let dir = tempfile::tempdir().unwrap();
        let with = dir.path().join("with");
        let mut bytes = vec![0u8; 5000];
        bytes.extend_from_slice(b"kvx::transfer_worker::chunkkvx::transfer_worker::batc");
        std::fs::write(&with, &bytes).unwrap();
        let found = compiled_failpoints(&with, FAILPOINTS).unwrap();
        assert_eq!(found, vec!["kvx::transfer_worker::chunk".to_string()]);
        let k = Kvx {
            path: with,
            help: BTreeMap::new(),
            failpoints: found,
        };
        assert!(k.has_failpoints(&["kvx::transfer_worker::chunk"]).is_ok());
        let e = k.has_failpoints(FAILPOINTS).unwrap_err();
        assert!(
            e.contains("no failpoint kvx::transfer_worker::batch"),
            "{e}"
        );
        assert!(contains(b"aab", b"ab") && !contains(b"a", b"ab") && contains(b"x", b""));
    }

    #[test]
    fn probing_a_real_program_reads_its_help() {
        // `ls --help` answers with a usage text on Debian.
        let k = Kvx::probe(Path::new("/bin/ls")).unwrap();
        assert!(k.has_flag("", "--all"));
        assert!(!k.has_flag("", "--summary-json"));
    }
}
