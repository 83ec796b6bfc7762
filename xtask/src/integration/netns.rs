//! Separate test hosts on one machine: network namespaces joined to a bridge by veth pairs, and the
//! link faults this kernel can make without `netem` — random packet drop and link cuts with
//! nftables, a bandwidth cap with `tc tbf`. Everything a [`Topology`] creates is removed when it
//! is dropped; namespaces left by an earlier run whose process is gone are removed at start.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

/// Prefix of every namespace this module creates; followed by the owning xtask's pid.
const PREFIX: &str = "kvxi";

/// The subnet of the test hosts: host `i` (from 0) is `10.77.0.(10 + i)`.
const SUBNET: [u8; 3] = [10, 77, 0];

/// One test host: a network namespace with one interface on the shared bridge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Namespace name (`ip netns exec <ns>`).
    pub ns: String,
    /// The host's address on the test subnet.
    pub ip: Ipv4Addr,
}

/// Link faults in force on one host, regenerated into one nftables table on each change.
#[derive(Debug, Default, Clone)]
struct Faults {
    /// Peer address → drop probability (permille) of what arrives from it.
    loss: BTreeMap<Ipv4Addr, u32>,
    /// Peers from which every packet is dropped.
    cut: Vec<Ipv4Addr>,
    /// New TCP connections from this peer are redirected to this local port (a proxy).
    redirect: BTreeMap<Ipv4Addr, u16>,
}

/// A set of hosts on one bridge; torn down on drop.
pub struct Topology {
    switch: String,
    hosts: Vec<Host>,
    faults: Mutex<Vec<Faults>>,
    torn_down: std::sync::atomic::AtomicBool,
}

fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {args:?}"))?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn in_ns_cmd(ns: &str, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, program]).args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running {program} in {ns}"))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{program} {} in {ns} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Why separate hosts cannot be made here, or `None` when they can (root, `ip netns`, veth and
/// nftables all work).
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: geteuid(2) has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root, so no network namespaces".into());
    }
    if Command::new("nft").arg("--version").output().is_err() {
        return Some("`nft` is missing (Debian package nftables)".into());
    }
    if Command::new("tc").arg("-V").output().is_err() {
        return Some("`tc` is missing (Debian package iproute2)".into());
    }
    let probe = format!("{PREFIX}{}-probe", std::process::id());
    let made = ip(&["netns", "add", &probe]);
    let _ = ip(&["netns", "del", &probe]);
    match made {
        Ok(_) => None,
        Err(e) => Some(format!("`ip netns add` does not work here: {e}")),
    }
}

/// Removes namespaces left by earlier runs whose xtask process no longer exists.
pub fn remove_stale() -> Result<usize> {
    let list = ip(&["netns", "list"])?;
    let mut removed = 0;
    for line in list.lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid: u32 = match rest.split('-').next().and_then(|p| p.parse().ok()) {
            Some(p) => p,
            None => continue,
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            ip(&["netns", "del", name])?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Runs `f` on a thread that has entered the namespace `ns`; sockets it makes live in `ns` and
/// keep working from any thread afterwards.
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    let handle = std::thread::spawn(move || -> Result<T> {
        // SAFETY: setns(2) gets a valid namespace fd that `file` keeps open for the call; it only
        // switches this (new, private) thread's network namespace.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        Ok(f())
    });
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("thread in {ns} panicked"))?
}

impl Topology {
    /// Creates `n` hosts on one bridge, named after this process.
    pub fn create(n: usize) -> Result<Topology> {
        Self::create_named(&format!("{PREFIX}{}", std::process::id()), n)
    }

    fn create_named(base: &str, n: usize) -> Result<Topology> {
        let switch = format!("{base}-sw");
        let mut topo = Topology {
            switch: switch.clone(),
            hosts: Vec::new(),
            faults: Mutex::new(vec![Faults::default(); n]),
            torn_down: std::sync::atomic::AtomicBool::new(false),
        };
        ip(&["netns", "add", &switch])?;
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = format!("{base}-h{}", i + 1);
            ip(&["netns", "add", &ns])?;
            let host = Host {
                ns: ns.clone(),
                ip: Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 10 + i as u8),
            };
            // Pushed before the links exist so that a failure below still removes it.
            topo.hosts.push(host.clone());
            let port = format!("p{}", i + 1);
            ip(&[
                "link", "add", "name", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &switch,
            ])?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", host.ip);
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            topo.apply(i, &Faults::default())?;
        }
        Ok(topo)
    }

    /// The hosts, in creation order.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i.min(self.hosts.len().saturating_sub(1))]
    }

    /// A command that runs `program` inside host `i`.
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.host(i).ns]).arg(program);
        cmd
    }

    /// Rules go on the input hook only: a drop on output would hand `EPERM` to the sender,
    /// which a real lossy or cut link never does.
    fn apply(&self, i: usize, f: &Faults) -> Result<()> {
        let mut rules = String::new();
        for peer in &f.cut {
            rules.push_str(&format!("    ip saddr {peer} counter drop\n"));
        }
        for (peer, permille) in &f.loss {
            rules.push_str(&format!(
                "    ip saddr {peer} numgen random mod 1000 < {permille} counter drop\n"
            ));
        }
        let mut nat = String::new();
        for (peer, port) in &f.redirect {
            nat.push_str(&format!(
                "    ip saddr {peer} tcp dport != {port} counter redirect to :{port}\n"
            ));
        }
        let script = format!(
            "table inet kvx {{}}\ndelete table inet kvx\ntable inet kvx {{\n  chain in {{\n    type filter hook input priority 0; policy accept;\n{rules}  }}\n  chain pre {{\n    type nat hook prerouting priority -100; policy accept;\n{nat}  }}\n}}\n"
        );
        in_ns_cmd(&self.host(i).ns, "nft", &["-f", "-"], Some(&script))?;
        Ok(())
    }

    fn update(&self, i: usize, change: impl FnOnce(&mut Faults)) -> Result<()> {
        let mut all = self
            .faults
            .lock()
            .map_err(|_| anyhow::anyhow!("fault table poisoned"))?;
        let Some(f) = all.get_mut(i) else {
            bail!("no host {i}");
        };
        change(f);
        let snapshot = f.clone();
        drop(all);
        self.apply(i, &snapshot)
    }

    /// Drops packets between hosts `a` and `b` at random with `percent` probability each way
    /// (0 removes the rule).
    pub fn set_loss(&self, a: usize, b: usize, percent: f64) -> Result<()> {
        let permille = (percent * 10.0).round().clamp(0.0, 1000.0) as u32;
        for (me, peer) in [(a, self.host(b).ip), (b, self.host(a).ip)] {
            self.update(me, |f| {
                if permille == 0 {
                    f.loss.remove(&peer);
                } else {
                    f.loss.insert(peer, permille);
                }
            })?;
        }
        Ok(())
    }

    /// Redirects new TCP connections from host `from` into host `to` to port `port` on `to`
    /// (where a transparent proxy listens); `None` removes the redirect.
    pub fn redirect(&self, to: usize, from: usize, port: Option<u16>) -> Result<()> {
        let peer = self.host(from).ip;
        self.update(to, |f| match port {
            Some(p) => {
                f.redirect.insert(peer, p);
            }
            None => {
                f.redirect.remove(&peer);
            }
        })
    }

    /// Packets dropped so far on host `i` by the loss and cut rules.
    pub fn dropped(&self, i: usize) -> Result<u64> {
        let out = in_ns_cmd(
            &self.host(i).ns,
            "nft",
            &["list", "chain", "inet", "kvx", "in"],
            None,
        )?;
        Ok(out
            .lines()
            .filter(|l| l.contains("drop"))
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                w.position(|x| x == "packets")?;
                w.next()?.parse::<u64>().ok()
            })
            .sum())
    }

    /// Cuts the link between hosts `a` and `b` (every packet dropped both ways, on both hosts).
    pub fn cut(&self, a: usize, b: usize) -> Result<()> {
        let (pa, pb) = (self.host(a).ip, self.host(b).ip);
        self.update(a, |f| {
            if !f.cut.contains(&pb) {
                f.cut.push(pb);
            }
        })?;
        self.update(b, |f| {
            if !f.cut.contains(&pa) {
                f.cut.push(pa);
            }
        })
    }

    /// Restores a link cut with [`Topology::cut`].
    pub fn restore(&self, a: usize, b: usize) -> Result<()> {
        let (pa, pb) = (self.host(a).ip, self.host(b).ip);
        self.update(a, |f| f.cut.retain(|p| *p != pb))?;
        self.update(b, |f| f.cut.retain(|p| *p != pa))
    }

    /// Caps what host `i` sends to `mbit` megabit/s with a token bucket (`None` removes it).
    pub fn cap_bandwidth(&self, i: usize, mbit: Option<u32>) -> Result<()> {
        let ns = self.host(i).ns.clone();
        let _ = in_ns_cmd(&ns, "tc", &["qdisc", "del", "dev", "eth0", "root"], None);
        if let Some(rate) = mbit {
            let rate = format!("{rate}mbit");
            in_ns_cmd(
                &ns,
                "tc",
                &[
                    "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &rate, "burst", "256kb",
                    "latency", "200ms",
                ],
                None,
            )?;
        }
        Ok(())
    }

    /// The queueing discipline on host `i`'s interface, as `tc qdisc show` prints it.
    #[cfg(test)]
    pub fn qdisc(&self, i: usize) -> Result<String> {
        in_ns_cmd(
            &self.host(i).ns,
            "tc",
            &["qdisc", "show", "dev", "eth0"],
            None,
        )
    }

    /// Deletes every namespace of the topology (and with them their links); idempotent.
    pub fn teardown(&self) {
        if self
            .torn_down
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.ns]);
        }
        let _ = ip(&["netns", "del", &self.switch]);
    }

    /// Removes every fault from every host.
    pub fn clear_faults(&self) -> Result<()> {
        for i in 0..self.hosts.len() {
            self.update(i, |f| *f = Faults::default())?;
            self.cap_bandwidth(i, None)?;
        }
        Ok(())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
    use std::time::Duration;

    fn topo(tag: &str, n: usize) -> Option<Topology> {
        if let Some(why) = unavailable_reason() {
            eprintln!("skipped: {why}");
            return None;
        }
        Some(Topology::create_named(&format!("{PREFIX}{}-{tag}", std::process::id()), n).unwrap())
    }

    fn connect(t: &Topology, from: usize, to: SocketAddr) -> std::io::Result<TcpStream> {
        in_ns(&t.host(from).ns.clone(), move || {
            TcpStream::connect_timeout(&to, Duration::from_millis(500))
        })
        .unwrap()
    }

    #[test]
    fn hosts_reach_each_other_and_cut_and_restore_work() {
        let Some(t) = topo("link", 2) else { return };
        let names: Vec<String> = t.hosts().iter().map(|h| h.ns.clone()).collect();
        let listen = SocketAddr::from((t.host(1).ip, 7000));
        let l = in_ns(&t.host(1).ns.clone(), move || TcpListener::bind(listen))
            .unwrap()
            .unwrap();
        let server = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 5];
                s.read_exact(&mut buf).unwrap();
                s.write_all(&buf).unwrap();
            }
        });
        let mut c = connect(&t, 0, listen).unwrap();
        c.write_all(b"hello").unwrap();
        let mut back = [0u8; 5];
        c.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"hello");

        t.cut(0, 1).unwrap();
        assert!(
            connect(&t, 0, listen).is_err(),
            "connected across a cut link"
        );
        t.restore(0, 1).unwrap();
        let mut c = connect(&t, 0, listen).unwrap();
        c.write_all(b"again").unwrap();
        c.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"again");
        server.join().unwrap();

        drop(t);
        let left = ip(&["netns", "list"]).unwrap();
        for n in names {
            assert!(!left.contains(&n), "{n} left behind");
        }
    }

    #[test]
    fn random_drop_loses_about_the_configured_share() {
        let Some(t) = topo("loss", 2) else { return };
        let to = SocketAddr::from((t.host(1).ip, 7001));
        let rx = in_ns(&t.host(1).ns.clone(), move || UdpSocket::bind(to))
            .unwrap()
            .unwrap();
        let from = SocketAddr::from((t.host(0).ip, 0));
        let tx = in_ns(&t.host(0).ns.clone(), move || UdpSocket::bind(from))
            .unwrap()
            .unwrap();
        t.set_loss(0, 1, 50.0).unwrap();
        rx.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let counter = std::thread::spawn(move || {
            let mut got = 0;
            let mut buf = [0u8; 8];
            while rx.recv(&mut buf).is_ok() {
                got += 1;
            }
            got
        });
        let sent = 2000;
        for i in 0..sent {
            tx.send_to(&(i as u32).to_le_bytes(), to).unwrap();
            if i % 16 == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let got = counter.join().unwrap();
        let dropped = t.dropped(1).unwrap();
        assert_eq!(
            got + dropped as usize,
            sent,
            "every datagram arrived or was counted"
        );
        // 50 % drop at the receiver's input: about half arrive.
        assert!(got > 600 && got < 1400, "received {got} of {sent}");
        t.set_loss(0, 1, 0.0).unwrap();
    }

    #[test]
    fn redirected_connections_pass_a_transparent_delaying_proxy() {
        use crate::integration::proxy::FaultProxy;
        let Some(t) = topo("redir", 2) else { return };
        let dst = SocketAddr::from((t.host(1).ip, 7002));
        let l = in_ns(&t.host(1).ns.clone(), move || TcpListener::bind(dst))
            .unwrap()
            .unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf).unwrap();
        });
        let proxy = in_ns(&t.host(1).ns.clone(), || {
            FaultProxy::start_transparent(TcpListener::bind("0.0.0.0:7099").unwrap()).unwrap()
        })
        .unwrap();
        proxy.set_delay(Duration::from_millis(20));
        t.redirect(1, 0, Some(7099)).unwrap();
        let mut c = connect(&t, 0, dst).unwrap();
        let t0 = std::time::Instant::now();
        c.write_all(b"ping").unwrap();
        let mut back = [0u8; 4];
        c.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"ping");
        assert!(t0.elapsed() >= Duration::from_millis(40));
        assert_eq!(proxy.accepted(), 1);
        // The counter moves just after the write the client already saw.
        for _ in 0..200 {
            if proxy.bytes() == 8 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(proxy.bytes(), 8);
        server.join().unwrap();
    }

    #[test]
    fn bandwidth_cap_installs_and_clears_a_token_bucket() {
        let Some(t) = topo("tbf", 1) else { return };
        t.cap_bandwidth(0, Some(200)).unwrap();
        assert!(t.qdisc(0).unwrap().contains("tbf"));
        t.clear_faults().unwrap();
        assert!(!t.qdisc(0).unwrap().contains("tbf"));
    }

    #[test]
    fn stale_namespaces_of_dead_runs_are_removed() {
        if unavailable_reason().is_some() {
            return;
        }
        // pid 0x7fff_fff0 cannot be alive (above the kernel's pid_max limit).
        let stale = format!("{PREFIX}2147483632-h1");
        ip(&["netns", "add", &stale]).unwrap();
        assert!(remove_stale().unwrap() >= 1);
        assert!(!ip(&["netns", "list"]).unwrap().contains(&stale));
    }
}
