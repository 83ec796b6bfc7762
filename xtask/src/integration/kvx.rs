//! The `kvx` binary under test: where it is, how it is built (debug, with the `failpoints`
//! feature), and which subcommands and flags it offers (read from its `--help`), so that a
//! scenario whose support is missing says so instead of failing or passing falsely.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Subcommands whose help is read.
const SUBCOMMANDS: &[&str] = &["bootstrap", "prefill", "decode", "demo", "send", "recv"];

/// A probed `kvx` binary.
#[derive(Debug, Clone)]
pub struct Kvx {
    /// Path of the binary.
    pub path: PathBuf,
    help: BTreeMap<String, String>,
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
        Ok(Kvx {
            path: path.to_path_buf(),
            help,
        })
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
        }
    }

    /// Whether subcommand `sub` exists.
    pub fn has(&self, sub: &str) -> bool {
        self.help.contains_key(sub)
    }

    /// The help text of subcommand `sub` (`""` for the top level).
    pub fn help_text(&self, sub: &str) -> Option<&str> {
        self.help.get(sub).map(String::as_str)
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
    fn probing_a_real_program_reads_its_help() {
        // `ls --help` answers with a usage text on Debian.
        let k = Kvx::probe(Path::new("/bin/ls")).unwrap();
        assert!(k.has_flag("", "--all"));
        assert!(!k.has_flag("", "--summary-json"));
    }
}
