//! Installs what the tests need on a fresh Debian machine, and only what is missing:
//! Debian packages (through apt-get) and the Python venv for the interop peers.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::run;

/// Debian packages the build and tests need (cmake and clang build the verbs bindings).
/// iproute2 and nftables build the network-namespace hosts of `cargo xtask integration`.
const APT_PACKAGES: &[&str] = &[
    "cmake",
    "clang",
    "libclang-dev",
    "iproute2",
    "nftables",
    "python3-venv",
];

/// Python packages for the interop peers.
const PY_PACKAGES: &[&str] = &["pyzmq", "requests"];

/// Installs everything missing.
pub fn ensure_all(root: &Path) -> Result<()> {
    ensure_apt()?;
    ensure_venv(root)?;
    Ok(())
}

fn ensure_apt() -> Result<()> {
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

fn ensure_venv(root: &Path) -> Result<()> {
    let venv = root.join(".venv");
    let py = venv.join("bin/python3");
    if !py.exists() {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(Command::new(python).arg("-m").arg("venv").arg(&venv))?;
    }
    let check = Command::new(&py)
        .args(["-c", "import zmq, requests"])
        .output()?;
    if !check.status.success() {
        run(Command::new(&py)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(PY_PACKAGES))?;
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
