//! Installs what the tests need on a fresh Debian machine, and only what is missing:
//! Debian packages (through apt-get) and the Python venv for the interop peers.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::run;

/// Debian packages the build and tests need (cmake and clang build the verbs bindings).
/// iproute2 and nftables build the network-namespace hosts of `cargo xtask integration`.
/// libibverbs1: the Mooncake Transfer Engine wheel's `engine.so` links it even for TCP.
const APT_PACKAGES: &[&str] = &[
    "cmake",
    "clang",
    "libclang-dev",
    "iproute2",
    "nftables",
    "python3-venv",
    "libibverbs1",
];

/// Python packages for the interop peers, installed with their dependencies: kvx's own peers
/// (pyzmq, requests), the real Mooncake Transfer Engine, and the pure-Python packages sglang
/// 0.5.23's disaggregation import chain (`sglang.srt.disaggregation.mooncake.conn`) needs once
/// torch, triton and the GPU stack are stubbed (`crates/kvx-cli/tests/py/stubs`). Versions are
/// the ones verified together (a cold install of this list reproduces the verified venv).
const PY_PACKAGES: &[&str] = &[
    "pyzmq==27.3.0",
    "requests==2.34.2",
    "numpy==2.4.6",
    "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    // sglang 0.5.23's import chain
    "aiohttp==3.14.5",
    "orjson==3.13.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "packaging==26.4",
    "pillow==13.0.0",
    "starlette==1.10.0",
    "msgspec==0.23.0",
    "pydantic==2.14.4",
    "tqdm==4.70.1",
    "ipython==9.18.1",
    "prometheus_client==0.26.0",
    "transformers==5.19.0",
    "dill==0.4.1",
    "sentencepiece==0.2.1",
    "gguf==0.19.0",
];

/// Installed with `--no-deps`: its declared dependencies are the whole GPU serving stack.
const PY_NO_DEPS: &[&str] = &["sglang==0.5.23"];

/// One import of everything the Python peers use (with sglang's GPU modules stubbed);
/// when it succeeds, pip is not run.
const PY_CHECK: &str = "import sys; sys.path.insert(0, sys.argv[1]); \
import kvx_stubs; kvx_stubs.install(); \
import zmq, requests, numpy, mooncake.engine; \
import sglang.srt.disaggregation.mooncake.conn";

/// Installs everything missing.
pub fn ensure_all(root: &Path) -> Result<()> {
    ensure_apt()?;
    ensure_venv(root)?;
    Ok(())
}

/// Installs the missing Debian packages (the build needs some of them).
pub fn ensure_apt() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|name| !dpkg_installed(name))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if Command::new("apt-get").arg("--version").output().is_err() {
        bail!("missing packages {missing:?} and no apt-get to install them");
    }
    let sudo: &[&str] = if is_root() { &[] } else { &["sudo"] };
    let mut update = Command::new(sudo.first().copied().unwrap_or("apt-get"));
    if !sudo.is_empty() {
        update.arg("apt-get");
    }
    run(update.args(["update", "-q"]))?;
    let mut install = Command::new(sudo.first().copied().unwrap_or("apt-get"));
    if !sudo.is_empty() {
        install.arg("apt-get");
    }
    run(install
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing))
}

fn dpkg_installed(name: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", name])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Creates the Python venv of the interop peers when it is missing or incomplete.
pub fn ensure_venv(root: &Path) -> Result<()> {
    let venv = root.join(".venv");
    let py = venv.join("bin/python3");
    if !py.exists() {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(Command::new(python).arg("-m").arg("venv").arg(&venv))?;
    }
    let stubs = root.join("crates/kvx-cli/tests/py/stubs");
    let check = || {
        Command::new(&py)
            .args(["-W", "ignore", "-c", PY_CHECK])
            .arg(&stubs)
            .output()
    };
    if check()?.status.success() {
        return Ok(());
    }
    let pip = |args: &[&str], packages: &[&str]| {
        run(Command::new(&py)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(args)
            .args(packages))
    };
    pip(&[], PY_PACKAGES)?;
    pip(&["--no-deps"], PY_NO_DEPS)?;
    let out = check()?;
    if !out.status.success() {
        bail!(
            "the venv at {} still cannot import the interop peers' packages:\n{}",
            venv.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Installs cargo-fuzz when missing.
pub fn ensure_cargo_fuzz() -> Result<()> {
    let ok = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
    }
    Ok(())
}
