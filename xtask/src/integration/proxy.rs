//! A small fault-injecting TCP proxy (std threads): forwards every accepted connection to one
//! target and can, at any time, delay every byte by a fixed time, stall all traffic (connections
//! stay open, nothing moves), or reset every open connection (the peers see `ECONNRESET`).
//! This kernel has no `netem`, so delay and stalls between test hosts come from here.
//!
//! In transparent mode (no fixed target) each connection goes to the address it was originally
//! sent to before an nftables `redirect` turned it to the proxy (`SO_ORIGINAL_DST`), so the proxy
//! can sit on a link between namespaces without any process knowing.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;

/// How often blocked loops look at the stop, stall and reset flags.
const TICK: Duration = Duration::from_millis(5);

struct Shared {
    target: Option<SocketAddr>,
    delay_us: AtomicU64,
    stalled: AtomicBool,
    stop: AtomicBool,
    conns: Mutex<Vec<Arc<Conn>>>,
    bytes: AtomicU64,
    accepted: AtomicU64,
}

/// One proxied connection: both sockets and its reset flag.
struct Conn {
    client: TcpStream,
    upstream: TcpStream,
    reset: AtomicBool,
}

/// A running proxy; stops (and resets its connections) when dropped.
pub struct FaultProxy {
    #[cfg_attr(not(test), allow(dead_code))]
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

/// Makes the next close of `s` send a RST instead of a FIN.
fn set_linger_zero(s: &TcpStream) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: the fd is open (owned by `s`), and the pointer and length describe `l`, a live,
    // properly aligned `linger` on this stack frame.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

impl FaultProxy {
    /// Serves `listener` (already bound, in whichever namespace it was made), forwarding to
    /// `target`. Outgoing connections are made from the namespace of the calling thread.
    #[cfg_attr(not(test), allow(dead_code))] // Scenarios use the transparent mode.
    pub fn start(listener: TcpListener, target: SocketAddr) -> Result<FaultProxy> {
        Self::serve(listener, Some(target))
    }

    /// Serves `listener` transparently: every connection goes on to its original destination
    /// (connections that were not redirected are refused).
    pub fn start_transparent(listener: TcpListener) -> Result<FaultProxy> {
        Self::serve(listener, None)
    }

    fn serve(listener: TcpListener, target: Option<SocketAddr>) -> Result<FaultProxy> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            target,
            delay_us: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            bytes: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let accept = std::thread::spawn(move || accept_loop(listener, sh));
        Ok(FaultProxy {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// Where clients connect.
    #[cfg_attr(not(test), allow(dead_code))] // Transparent proxies are reached by redirects.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Delays every byte forwarded from now on by `d` (zero removes the delay).
    pub fn set_delay(&self, d: Duration) {
        self.shared
            .delay_us
            .store(d.as_micros() as u64, Ordering::SeqCst);
    }

    /// Stops (true) or resumes (false) all forwarding; data waits in the proxy meanwhile.
    pub fn set_stalled(&self, stalled: bool) {
        self.shared.stalled.store(stalled, Ordering::SeqCst);
    }

    /// Resets every open connection: both of its peers see a TCP RST. New connections still work.
    pub fn reset_all(&self) {
        let conns = match self.shared.conns.lock() {
            Ok(mut c) => std::mem::take(&mut *c),
            Err(_) => return,
        };
        for c in conns {
            c.reset.store(true, Ordering::SeqCst);
            set_linger_zero(&c.client);
            set_linger_zero(&c.upstream);
            // Wakes both readers; the last clone dropped closes each socket with a RST.
            let _ = c.client.shutdown(Shutdown::Read);
            let _ = c.upstream.shutdown(Shutdown::Read);
        }
    }

    /// Bytes forwarded so far, both directions.
    pub fn bytes(&self) -> u64 {
        self.shared.bytes.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.reset_all();
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    while !sh.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                sh.accepted.fetch_add(1, Ordering::SeqCst);
                if let Err(e) = open(client, &sh) {
                    eprintln!("proxy: forwarding a connection: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(TICK),
            Err(e) => {
                eprintln!("proxy: accept: {e}");
                std::thread::sleep(TICK);
            }
        }
    }
}

/// Where a redirected connection was going (`SO_ORIGINAL_DST`).
fn original_dst(s: &TcpStream) -> std::io::Result<SocketAddr> {
    // SAFETY: `sockaddr_in` is plain old data, so all-zero is a valid value.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: the fd is open (owned by `s`); `sa` and `len` are live locals whose size `len`
    // describes, and the kernel writes at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut sa as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let ip = std::net::Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
    let dst = SocketAddr::from((ip, u16::from_be(sa.sin_port)));
    if dst == s.local_addr()? {
        return Err(std::io::Error::other("connection was not redirected"));
    }
    Ok(dst)
}

fn open(client: TcpStream, sh: &Arc<Shared>) -> std::io::Result<()> {
    client.set_nonblocking(false)?;
    let target = match sh.target {
        Some(t) => t,
        None => original_dst(&client)?,
    };
    let upstream = match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
        Ok(u) => u,
        Err(e) => {
            set_linger_zero(&client);
            return Err(e);
        }
    };
    for s in [&client, &upstream] {
        s.set_nodelay(true)?;
        s.set_write_timeout(Some(Duration::from_millis(50)))?;
    }
    let conn = Arc::new(Conn {
        client: client.try_clone()?,
        upstream: upstream.try_clone()?,
        reset: AtomicBool::new(false),
    });
    if let Ok(mut c) = sh.conns.lock() {
        c.push(conn.clone());
    }
    pump(
        client.try_clone()?,
        upstream.try_clone()?,
        conn.clone(),
        sh.clone(),
    );
    pump(upstream, client, conn, sh.clone());
    Ok(())
}

/// Forwards `from` → `to`: a reader thread stamps each chunk with its delivery time, a writer
/// thread delivers it then (waiting while stalled).
fn pump(mut from: TcpStream, mut to: TcpStream, conn: Arc<Conn>, sh: Arc<Shared>) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let (c2, sh2) = (conn.clone(), sh.clone());
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let delay = Duration::from_micros(sh2.delay_us.load(Ordering::SeqCst));
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
            if c2.reset.load(Ordering::SeqCst) {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        'chunks: while let Ok((at, data)) = rx.recv() {
            loop {
                if conn.reset.load(Ordering::SeqCst) {
                    break 'chunks;
                }
                let now = Instant::now();
                if now >= at && !sh.stalled.load(Ordering::SeqCst) {
                    break;
                }
                std::thread::sleep(if now < at { (at - now).min(TICK) } else { TICK });
            }
            let mut off = 0;
            while off < data.len() {
                if conn.reset.load(Ordering::SeqCst) {
                    break 'chunks;
                }
                match to.write(&data[off..]) {
                    Ok(0) => break 'chunks,
                    Ok(n) => {
                        off += n;
                        sh.bytes.fetch_add(n as u64, Ordering::SeqCst);
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(_) => break 'chunks,
                }
            }
        }
        if !conn.reset.load(Ordering::SeqCst) {
            // Orderly end of this direction: pass the FIN on.
            let _ = to.shutdown(Shutdown::Write);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback; returns its address.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 8192];
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if s.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        addr
    }

    fn proxy() -> FaultProxy {
        FaultProxy::start(TcpListener::bind("127.0.0.1:0").unwrap(), echo()).unwrap()
    }

    #[test]
    fn forwards_bytes_exactly() {
        let p = proxy();
        let mut c = TcpStream::connect(p.addr()).unwrap();
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let d2 = data.clone();
        let mut w = c.try_clone().unwrap();
        let writer = std::thread::spawn(move || w.write_all(&d2).unwrap());
        let mut back = vec![0u8; data.len()];
        c.read_exact(&mut back).unwrap();
        writer.join().unwrap();
        assert!(back == data, "bytes differ after the proxy");
        // The counter moves just after the write the client already saw.
        for _ in 0..200 {
            if p.bytes() == 2 * data.len() as u64 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(p.bytes(), 2 * data.len() as u64);
        assert_eq!(p.accepted(), 1);
    }

    #[test]
    fn delay_holds_every_byte_at_least_that_long() {
        let p = proxy();
        p.set_delay(Duration::from_millis(30));
        let mut c = TcpStream::connect(p.addr()).unwrap();
        let t0 = Instant::now();
        c.write_all(b"ping").unwrap();
        let mut back = [0u8; 4];
        c.read_exact(&mut back).unwrap();
        // Two proxy legs (there and back), each held for at least the delay.
        assert!(t0.elapsed() >= Duration::from_millis(60));
        assert_eq!(&back, b"ping");
    }

    #[test]
    fn stall_holds_data_until_resumed() {
        let p = proxy();
        let mut c = TcpStream::connect(p.addr()).unwrap();
        c.write_all(b"a").unwrap();
        let mut one = [0u8; 1];
        c.read_exact(&mut one).unwrap();
        p.set_stalled(true);
        c.write_all(b"b").unwrap();
        c.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let e = c.read(&mut one).unwrap_err();
        assert!(matches!(
            e.kind(),
            ErrorKind::WouldBlock | ErrorKind::TimedOut
        ));
        p.set_stalled(false);
        c.set_read_timeout(None).unwrap();
        c.read_exact(&mut one).unwrap();
        assert_eq!(&one, b"b");
    }

    #[test]
    fn reset_sends_rst_and_new_connections_work() {
        let p = proxy();
        let mut c = TcpStream::connect(p.addr()).unwrap();
        c.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        c.read_exact(&mut one).unwrap();
        p.reset_all();
        let e = c.read(&mut one).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionReset);
        let mut c = TcpStream::connect(p.addr()).unwrap();
        c.write_all(b"y").unwrap();
        c.read_exact(&mut one).unwrap();
        assert_eq!(&one, b"y");
    }
}
