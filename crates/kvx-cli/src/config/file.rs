//! `--config kvx.toml`: every flag of the binary from a TOML file.
//!
//! The file's keys are the long flags without their dashes (`tp-size = 8`, `staging = true`).
//! Top-level keys are the global flags (`log-format`); a table per subcommand (`[prefill]`,
//! `[decode]`, `[bootstrap]`, `[demo]`, `[send]`, `[recv]`) holds that command's flags, so one
//! file can describe every process of a deployment and each reads its own table. A key that is
//! no flag of its table, and a table that is no subcommand, is refused with the key and the file
//! named ([`FileError::UnknownKey`]), in every table, not only the one the command reads.
//!
//! Precedence: command line > environment variable > file > default. The command line is parsed
//! once to learn the subcommand and where each value came from ([`clap::parser::ValueSource`]);
//! a file value is used only for a flag that neither the command line nor its environment
//! variable set. It is then handed to clap as `--key=value` and parsed again, so a file value is
//! checked exactly as the same flag on the command line is, and a refused one is reported with a
//! note naming the file and the key ([`file_note`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches, Parser};

use super::Cli;

/// The id of the global `--config` flag.
const CONFIG_ID: &str = "config";

/// Why a configuration file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The file could not be read.
    #[error("--config {}: cannot read it: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("--config {}: not valid TOML: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A key that names no flag of its table (or a table that names no subcommand).
    #[error(
        "--config {}: unknown key `{key}`{} ({hint})",
        path.display(),
        table.as_ref().map(|t| format!(" in [{t}]")).unwrap_or_default()
    )]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The table (`None`: top level).
        table: Option<String>,
        /// The key.
        key: String,
        /// What is accepted there.
        hint: String,
    },
    /// A value of a type the flag cannot take (a table, an array for a single value).
    #[error(
        "--config {}: `{key}`{} must be {expected}",
        path.display(),
        table.as_ref().map(|t| format!(" in [{t}]")).unwrap_or_default()
    )]
    BadType {
        /// The file.
        path: PathBuf,
        /// The table (`None`: top level).
        table: Option<String>,
        /// The key.
        key: String,
        /// What the flag takes.
        expected: &'static str,
    },
}

/// A flag whose value came from the file (for error notes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FromFile {
    /// The long flag (`tp-size`).
    pub long: String,
    /// The table it was in (`None`: top level).
    pub table: Option<String>,
}

/// The configuration file's contribution to one run.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    /// The file (`None`: no `--config`).
    pub path: Option<PathBuf>,
    /// Flags set from it.
    pub flags: Vec<FromFile>,
}

/// Why the command line (with its file) was not usable.
#[derive(Debug)]
#[non_exhaustive]
pub enum CliError {
    /// clap's error (also `--help` and `--version`), with a note when a refused value came from
    /// the file.
    Clap(clap::Error, Option<String>),
    /// The file itself.
    File(FileError),
}

/// Parses `argv` (program name first) with the file named by `--config` (or `KVX_CONFIG`)
/// merged in at its precedence.
pub fn parse(argv: Vec<OsString>) -> Result<(Cli, Applied), CliError> {
    let cmd = Cli::command();
    let matches = cmd
        .clone()
        .try_get_matches_from(&argv)
        .map_err(|e| CliError::Clap(e, None))?;
    let Some(path) = matches.get_one::<PathBuf>(CONFIG_ID).cloned() else {
        let cli = Cli::from_arg_matches(&matches).map_err(|e| CliError::Clap(e, None))?;
        return Ok((cli, Applied::default()));
    };
    let text = std::fs::read_to_string(&path).map_err(|source| {
        CliError::File(FileError::Read {
            path: path.clone(),
            source,
        })
    })?;
    let (extra, flags) = file_args(&cmd, &matches, &path, &text).map_err(CliError::File)?;
    let mut full = argv;
    full.extend(extra);
    let applied = Applied {
        path: Some(path),
        flags,
    };
    match Cli::try_parse_from(&full) {
        Ok(cli) => Ok((cli, applied)),
        Err(e) => {
            let note = file_note(&e, &applied);
            Err(CliError::Clap(e, note))
        }
    }
}

/// The `--key=value` arguments the file adds to a command line already parsed into `matches`,
/// and which flags they are. Every table is checked for unknown keys; only the global keys and
/// the running subcommand's table are used.
pub fn file_args(
    cmd: &clap::Command,
    matches: &ArgMatches,
    path: &Path,
    text: &str,
) -> Result<(Vec<OsString>, Vec<FromFile>), FileError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| FileError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
    let running = matches.subcommand();
    let mut out = Vec::new();
    let mut flags = Vec::new();
    for (key, value) in &table {
        if let Some(sub) = cmd.get_subcommands().find(|s| s.get_name() == key) {
            let toml::Value::Table(section) = value else {
                return Err(FileError::BadType {
                    path: path.to_owned(),
                    table: None,
                    key: key.clone(),
                    expected: "a table of `kvx {key}` flags",
                });
            };
            let sub_matches = running
                .filter(|(name, _)| *name == key.as_str())
                .map(|(_, m)| m);
            for (k, v) in section {
                let arg = settable(sub, k).ok_or_else(|| FileError::UnknownKey {
                    path: path.to_owned(),
                    table: Some(key.clone()),
                    key: k.clone(),
                    hint: format!("`kvx {key}` has no --{k}; see `kvx {key} --help`"),
                })?;
                let Some(m) = sub_matches else { continue };
                push(&mut out, &mut flags, arg, m, v, path, Some(key))?;
            }
        } else {
            let arg = settable(cmd, key).ok_or_else(|| FileError::UnknownKey {
                path: path.to_owned(),
                table: None,
                key: key.clone(),
                hint: format!(
                    "top-level keys are the global flags ({}); a table per subcommand ({}) \
                     holds that command's flags",
                    globals(cmd).join(", "),
                    cmd.get_subcommands()
                        .map(|s| format!("[{}]", s.get_name()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
            push(&mut out, &mut flags, arg, matches, value, path, None)?;
        }
    }
    Ok((out, flags))
}

/// The global flags a file may set at its top level.
fn globals(cmd: &clap::Command) -> Vec<String> {
    cmd.get_arguments()
        .filter(|a| a.get_id() != CONFIG_ID)
        .filter_map(|a| a.get_long())
        .filter(|l| !matches!(*l, "help" | "version"))
        .map(str::to_owned)
        .collect()
}

/// The argument of `cmd` whose long flag is `key`, unless it is not settable from a file
/// (`--help`, `--version`, `--config`).
fn settable<'a>(cmd: &'a clap::Command, key: &str) -> Option<&'a clap::Arg> {
    cmd.get_arguments().find(|a| {
        a.get_long() == Some(key)
            && a.get_id() != CONFIG_ID
            && !matches!(
                a.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
    })
}

/// Adds `arg = value` unless the command line or the environment already set the flag.
fn push(
    out: &mut Vec<OsString>,
    flags: &mut Vec<FromFile>,
    arg: &clap::Arg,
    matches: &ArgMatches,
    value: &toml::Value,
    path: &Path,
    table: Option<&String>,
) -> Result<(), FileError> {
    let long = arg.get_long().unwrap_or_default();
    let bad = |expected| FileError::BadType {
        path: path.to_owned(),
        table: table.cloned(),
        key: long.to_owned(),
        expected,
    };
    let is_flag = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
    let scalars: Vec<String> = match value {
        toml::Value::Boolean(b) if is_flag => {
            // SetTrue: `true` sets it, `false` leaves the default (off); SetFalse the reverse.
            let on = matches!(arg.get_action(), ArgAction::SetTrue) == *b;
            if on { vec![String::new()] } else { Vec::new() }
        }
        _ if is_flag => return Err(bad("true or false")),
        toml::Value::Array(items) => {
            if !matches!(arg.get_action(), ArgAction::Append) {
                return Err(bad("a single value (not an array)"));
            }
            items
                .iter()
                .map(|v| scalar(v).ok_or_else(|| bad("an array of strings or numbers")))
                .collect::<Result<_, _>>()?
        }
        v => vec![scalar(v).ok_or_else(|| bad("a string, a number or a boolean"))?],
    };
    let id = arg.get_id().as_str();
    if matches!(
        matches.value_source(id),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    ) {
        return Ok(());
    }
    for s in scalars {
        out.push(if is_flag {
            format!("--{long}").into()
        } else {
            format!("--{long}={s}").into()
        });
    }
    flags.push(FromFile {
        long: long.to_owned(),
        table: table.cloned(),
    });
    Ok(())
}

/// A TOML scalar as the text clap parses.
fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(_) | toml::Value::Array(_) | toml::Value::Table(_) => None,
    }
}

/// For a clap error about a value the file gave, a note naming the file and the key.
pub fn file_note(err: &clap::Error, applied: &Applied) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    let path = applied.path.as_ref()?;
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    let long = arg.split_whitespace().next()?.strip_prefix("--")?;
    let f = applied.flags.iter().find(|f| f.long == long)?;
    Some(format!(
        "note: the value of --{long} came from {}, key `{long}`{}",
        path.display(),
        f.table
            .as_ref()
            .map(|t| format!(" in [{t}]"))
            .unwrap_or_default()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(argv: &[&str], text: &str) -> Result<(Vec<OsString>, Vec<FromFile>), FileError> {
        let cmd = Cli::command();
        let m = cmd
            .clone()
            .try_get_matches_from(argv)
            .expect("test argv parses");
        file_args(&cmd, &m, Path::new("kvx.toml"), text)
    }

    #[test]
    fn file_values_fill_only_what_the_command_line_left_unset() {
        let (out, flags) = args(
            &["kvx", "prefill", "--tp-size", "4"],
            "log-format = \"json\"\n[prefill]\ntp-size = 8\ntp-rank = 2\nstaging = true\n\
             fragmentation = 0.25\n[decode]\nrequests = 3\n",
        )
        .expect("valid file");
        let mut out: Vec<String> = out
            .into_iter()
            .map(|s| s.into_string().expect("utf-8"))
            .collect();
        out.sort();
        assert_eq!(
            out,
            [
                "--fragmentation=0.25",
                "--log-format=json",
                "--staging",
                "--tp-rank=2"
            ]
        );
        assert_eq!(flags.len(), 4);
    }

    #[test]
    fn a_global_flag_given_after_the_subcommand_still_wins_over_the_file() {
        let (out, flags) = args(
            &["kvx", "prefill", "--log-format", "text"],
            "log-format = \"json\"\n",
        )
        .expect("valid file");
        assert!(out.is_empty() && flags.is_empty(), "{out:?}");
    }

    #[test]
    fn unknown_keys_and_tables_are_refused_with_the_file_named() {
        let e = args(&["kvx", "prefill"], "[prefill]\ntp-sise = 8\n").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("kvx.toml") && msg.contains("`tp-sise`") && msg.contains("[prefill]"));
        // in a table the command does not read as well
        let e = args(&["kvx", "prefill"], "[decode]\nbogus = 1\n").unwrap_err();
        assert!(e.to_string().contains("`bogus` in [decode]"), "{e}");
        let e = args(&["kvx", "prefill"], "[prefil]\ntp-size = 1\n").unwrap_err();
        assert!(e.to_string().contains("unknown key `prefil`"), "{e}");
        let e = args(&["kvx", "prefill"], "config = \"x.toml\"\n").unwrap_err();
        assert!(e.to_string().contains("unknown key `config`"), "{e}");
        let e = args(&["kvx", "prefill"], "[prefill]\nhelp = true\n").unwrap_err();
        assert!(e.to_string().contains("unknown key `help`"), "{e}");
    }

    #[test]
    fn bad_types_and_bad_toml_are_refused() {
        let e = args(&["kvx", "prefill"], "[prefill]\nstaging = \"yes\"\n").unwrap_err();
        assert!(e.to_string().contains("true or false"), "{e}");
        let e = args(&["kvx", "prefill"], "[prefill]\ntp-size = [1, 2]\n").unwrap_err();
        assert!(e.to_string().contains("single value"), "{e}");
        let e = args(&["kvx", "prefill"], "prefill = 3\n").unwrap_err();
        assert!(e.to_string().contains("must be a table"), "{e}");
        let e = args(&["kvx", "prefill"], "[prefill\n").unwrap_err();
        assert!(matches!(e, FileError::Parse { .. }), "{e}");
    }

    #[test]
    fn a_refused_file_value_is_noted_with_its_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("kvx.toml");
        std::fs::write(&p, "[prefill]\nqueues = 0\n").expect("write");
        let argv: Vec<OsString> = ["kvx", "prefill", "--config"]
            .iter()
            .map(OsString::from)
            .chain([p.clone().into_os_string()])
            .collect();
        match parse(argv) {
            Err(CliError::Clap(e, Some(note))) => {
                assert!(e.to_string().contains("--queues"), "{e}");
                assert!(
                    note.contains("kvx.toml") && note.contains("[prefill]"),
                    "{note}"
                );
            }
            other => panic!("expected a noted clap error, got {other:?}"),
        }
    }
}
