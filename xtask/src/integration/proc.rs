//! Child processes of a scenario. Each child runs in its own process group, writes its output to a
//! log file, is killed with its whole group when its handle is dropped, and is killed by the kernel
//! (`PR_SET_PDEATHSIG`) if the thread that started it goes away first. Every live group is also
//! listed in a lock-free table so that a Ctrl-C handler can kill them all.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Slots of live process-group ids (0 = free); read by the signal handler, so no locks.
static LIVE: [AtomicI32; 256] = [const { AtomicI32::new(0) }; 256];

fn register(pgid: i32) {
    for slot in &LIVE {
        if slot
            .compare_exchange(0, pgid, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return;
        }
    }
}

fn unregister(pgid: i32) {
    for slot in &LIVE {
        let _ = slot.compare_exchange(pgid, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// Sends SIGKILL to one process group.
fn kill_group(pgid: i32) {
    if pgid > 0 {
        // SAFETY: kill(2) takes plain integers and touches no memory of ours; a negative pid names
        // the process group, which we created for this child only.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

/// Kills every live process group (async-signal-safe: atomics and kill(2) only).
pub fn kill_all() {
    for slot in &LIVE {
        let pgid = slot.load(Ordering::SeqCst);
        if pgid > 0 {
            kill_group(pgid);
        }
    }
}

/// Kills every process group whose id is in `pgids` (the children of one timed-out scenario).
pub fn kill_groups(pgids: &[i32]) {
    for &pgid in pgids {
        kill_group(pgid);
    }
}

/// Number of live process groups (for tests and the end-of-run check).
pub fn live_count() -> usize {
    LIVE.iter().filter(|s| s.load(Ordering::SeqCst) > 0).count()
}

/// A running child in its own process group.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    status: Option<ExitStatus>,
}

impl Proc {
    /// Starts `cmd` as `name`, stdout and stderr appended to `log_dir/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Proc> {
        std::fs::create_dir_all(log_dir)?;
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
        // is async-signal-safe; it allocates nothing and takes no locks.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        let pgid = i32::try_from(child.id()).unwrap_or(0);
        register(pgid);
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
            status: None,
        })
    }

    /// The child's name in verdicts and logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's pid (also its process-group id).
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(0)
    }

    /// Kills the whole group with SIGKILL and reaps the child.
    pub fn kill9(&mut self) {
        if self.status.is_none() {
            kill_group(self.pid());
            self.status = self.child.wait().ok();
        }
        unregister(self.pid());
    }

    /// Exit status if the child has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
            if self.status.is_some() {
                // The leader is gone; make sure nothing else of its group stays behind.
                kill_group(self.pid());
                unregister(self.pid());
            }
        }
        self.status
    }

    /// Waits for the child to exit, at most `timeout`; `None` when it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Open sockets of the child (its `/proc/<pid>/fd` entries that are sockets).
    pub fn sockets(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::read_link(e.path()).ok())
                    .filter(|t| t.to_string_lossy().starts_with("socket:"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// The child's TCP sockets (IPv4 or IPv6) whose remote port is `port`: its `/proc/<pid>/fd`
    /// socket inodes found in `/proc/<pid>/net/tcp{,6}` with that remote port.
    pub fn tcp_sockets_to_port(&self, port: u16) -> usize {
        let pid = self.pid();
        let inodes: std::collections::HashSet<String> =
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter_map(|e| std::fs::read_link(e.path()).ok())
                        .filter_map(|t| {
                            let t = t.to_string_lossy().into_owned();
                            t.strip_prefix("socket:[")
                                .and_then(|r| r.strip_suffix(']'))
                                .map(str::to_owned)
                        })
                        .collect()
                })
                .unwrap_or_default();
        let want = format!("{port:04X}");
        ["tcp", "tcp6"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).ok())
            .map(|text| {
                text.lines()
                    .skip(1)
                    .filter(|l| {
                        let cols: Vec<&str> = l.split_whitespace().collect();
                        let remote_port = cols.get(2).and_then(|r| r.rsplit(':').next());
                        remote_port == Some(want.as_str())
                            && cols.get(9).is_some_and(|i| inodes.contains(*i))
                    })
                    .count()
            })
            .sum()
    }

    /// The child's output so far.
    pub fn log_text(&self) -> String {
        std::fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Waits until the log contains `needle` (true) or `timeout` passes or the child exits (false).
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            if self.log_text().contains(needle) {
                return true;
            }
            if self.try_wait().is_some() {
                return self.log_text().contains(needle);
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last `n` lines of the log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_a_proc_kills_its_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("bash");
        // The grandchild would outlive a plain kill of the leader.
        cmd.args(["-c", "sleep 300 & echo grandchild $!; wait"]);
        let mut p = Proc::spawn("sleeper", cmd, dir.path()).unwrap();
        assert!(p.wait_for_log("grandchild", Duration::from_secs(10)));
        assert_eq!(p.sockets(), 0, "bash with a sleep has no sockets");
        let text = p.log_text();
        let gpid: i32 = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap();
        let pgid = p.pid();
        assert!(LIVE.iter().any(|s| s.load(Ordering::SeqCst) == pgid));
        drop(p);
        assert!(!LIVE.iter().any(|s| s.load(Ordering::SeqCst) == pgid));
        // The grandchild is killed too (it may linger as a zombie of init for a moment).
        let mut gone = false;
        for _ in 0..500 {
            let stat = std::fs::read_to_string(format!("/proc/{gpid}/stat")).unwrap_or_default();
            if stat.is_empty() || stat.contains(") Z") {
                gone = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(gone, "grandchild {gpid} survived");
    }

    #[test]
    fn exit_status_and_log_are_captured() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("bash");
        cmd.args(["-c", "echo hello; echo oops >&2; exit 3"]);
        let mut p = Proc::spawn("status", cmd, dir.path()).unwrap();
        let st = p.wait_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(st.code(), Some(3));
        assert_eq!(p.sockets(), 0, "an exited child has no sockets");
        assert!(p.log_text().contains("hello"));
        assert!(p.log_tail(1).contains("oops"));
        assert_eq!(p.name(), "status");
    }
}
