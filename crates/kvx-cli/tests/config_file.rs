//! `--config kvx.toml` with the built binary: file values used where nothing else set the flag,
//! precedence command line > environment variable > file > default, unknown keys and bad values
//! refused naming the key and the file (exit 2); and the examples of README and
//! `docs/deploy.md` (the TOML and every unit's `ExecStart=`) parse into the commands they claim.

#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use kvx_cli::config::Command as Cmd;
use kvx_cli::config::file;

const GUARD: Duration = Duration::from_secs(90);

fn kvx(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(KVX);
    cmd.args(args)
        .env("RUST_LOG", "warn")
        .env_remove("KVX_CONFIG")
        .env_remove("SGLANG_DISAGGREGATION_QUEUE_SIZE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = Proc::spawn(&mut cmd).wait_output(GUARD);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const DEMO: &str = "[demo]\nmodel = \"tiny\"\npage-size = 16\npool-pages = 256\n\
                    prompt-tokens = 200\nrooms = 3\n";

#[test]
fn file_values_apply_below_the_command_line_and_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "kvx.toml", DEMO);
    let f = f.to_str().unwrap();
    // file over default (--rooms 32)
    let (code, out, err) = kvx(&["demo", "--config", f], &[]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("verified: 3/3 rooms"), "{out}");
    // command line over file
    let (code, out, err) = kvx(&["demo", "--config", f, "--rooms", "2"], &[]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("verified: 2/2 rooms"), "{out}");
    // KVX_CONFIG names the file as well
    let (code, out, err) = kvx(&["demo", "--rooms", "1"], &[("KVX_CONFIG", f)]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("verified: 1/1 rooms"), "{out}");

    // environment over file: the file's refused value is never used while the variable is set
    let f0 = write(dir.path(), "queues0.toml", &format!("{DEMO}queues = 0\n"));
    let f0 = f0.to_str().unwrap();
    let (code, out, err) = kvx(
        &["demo", "--config", f0, "--rooms", "1"],
        &[("SGLANG_DISAGGREGATION_QUEUE_SIZE", "2")],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    // command line over environment
    let (code, out, err) = kvx(
        &["demo", "--config", f, "--rooms", "1", "--queues", "2"],
        &[("SGLANG_DISAGGREGATION_QUEUE_SIZE", "0")],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    // the file's value alone is checked as the flag is, and the note names the file and key
    let (code, out, err) = kvx(&["demo", "--config", f0], &[]);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(err.contains("--queues"), "{err}");
    assert!(
        err.contains(&format!("came from {f0}, key `queues` in [demo]")),
        "{err}"
    );
}

#[test]
fn unknown_keys_bad_types_and_missing_files_exit_2_naming_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[demo]\nroms = 3\n", "unknown key `roms` in [demo]"),
        // a typo in a table this command does not read is still caught
        (
            "[demo]\nrooms = 1\n[decode]\nbootstrap-adr = \"x:1\"\n",
            "unknown key `bootstrap-adr` in [decode]",
        ),
        ("[demoo]\nrooms = 1\n", "unknown key `demoo`"),
        ("tp-size = 2\n", "unknown key `tp-size`"),
        (
            "[demo]\nstaging = 1\n",
            "`staging` in [demo] must be true or false",
        ),
        ("[demo]\nrooms = [1]\n", "must be a single value"),
        ("[demo]\nrooms = \n", "not valid TOML"),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let f = write(dir.path(), &format!("bad{i}.toml"), text);
        let f = f.to_str().unwrap();
        let (code, out, err) = kvx(&["demo", "--config", f], &[]);
        assert_eq!(code, Some(2), "{text}: {out}{err}");
        assert!(err.contains(want) && err.contains(f), "{text}: {err}");
        assert!(!out.contains("verified"), "nothing ran: {out}");
    }
    let (code, _, err) = kvx(&["demo", "--config", "/nonexistent/kvx.toml"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--config /nonexistent/kvx.toml: cannot read it"),
        "{err}"
    );
}

/// The body of every fenced block of `lang` in `text`.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let open = format!("```{lang}");
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        match &mut cur {
            None if line.trim_start() == open => cur = Some(String::new()),
            Some(b) if line.trim_start() == "```" => {
                out.push(std::mem::take(b));
                cur = None;
            }
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            None => {}
        }
    }
    out
}

fn parse(argv: &[&str]) -> kvx_cli::config::Cli {
    let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
    match file::parse(argv.clone()) {
        Ok((cli, _)) => cli,
        Err(file::CliError::Clap(e, note)) => panic!("{argv:?}: {e} {note:?}"),
        Err(file::CliError::File(e)) => panic!("{argv:?}: {e}"),
        Err(e) => panic!("{argv:?}: {e:?}"),
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_deploy_guide_parses_into_the_commands_its_units_run() {
    let doc = std::fs::read_to_string(root().join("docs/deploy.md")).unwrap();
    let toml = blocks(&doc, "toml");
    assert_eq!(toml.len(), 1, "one kvx.toml in docs/deploy.md");
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "kvx.toml", &toml[0]);
    let f = f.to_str().unwrap();
    let units = blocks(&doc, "ini");
    assert_eq!(units.len(), 3, "bootstrap, prefill@ and decode units");
    let mut seen = Vec::new();
    for unit in &units {
        let exec = unit
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap();
        let argv: Vec<String> = exec
            .replace("/usr/local/bin/kvx", "kvx")
            .replace("/etc/kvx/kvx.toml", f)
            .replace("%i", "1")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let cli = parse(&argv);
        assert_eq!(cli.log_format, kvx_cli::telemetry::LogFormat::Json);
        match cli.command {
            Cmd::Bootstrap(a) => {
                assert_eq!((a.host.as_str(), a.port), ("0.0.0.0", 8998));
                seen.push("bootstrap");
            }
            Cmd::Prefill(a) => {
                assert_eq!((a.model.tp_size, a.model.tp_rank), (2, 1));
                assert_eq!(a.host, "10.0.0.1");
                assert_eq!(a.metrics_port, Some(9100));
                assert_eq!(a.lifecycle.shutdown_timeout, 30.0);
                a.validate().unwrap();
                seen.push("prefill");
            }
            Cmd::Decode(a) => {
                assert_eq!(a.bootstrap_addr.port, 8998);
                assert_eq!((a.requests, a.concurrency), (1_000_000, 8));
                assert!(a.no_progress);
                seen.push("decode");
            }
            other => panic!("unexpected unit command {other:?}"),
        }
    }
    assert_eq!(seen, ["bootstrap", "prefill", "decode"]);
}

#[test]
fn the_readme_example_parses() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let toml = blocks(&readme, "toml");
    assert_eq!(toml.len(), 1, "one kvx.toml example in README");
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "kvx.toml", &toml[0]);
    let f = f.to_str().unwrap();
    match parse(&["kvx", "prefill", "--config", f]).command {
        Cmd::Prefill(a) => {
            assert!(a.staging.staging);
            assert_eq!(a.model.tp_size, 8);
            assert_eq!(a.bootstrap_host, "10.0.0.1");
        }
        other => panic!("{other:?}"),
    }
    match parse(&["kvx", "decode", "--config", f, "--tp-rank", "3"]).command {
        Cmd::Decode(a) => assert_eq!((a.model.tp_size, a.model.tp_rank), (8, 3)),
        other => panic!("{other:?}"),
    }
}
