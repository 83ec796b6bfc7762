//! Just enough of ZMTP 3.0 (the wire protocol of libzmq) to act as a PUSH peer over a plain
//! TCP stream: the greeting with the NULL mechanism, the READY command and message frames. The
//! flood scenario uses it to put garbage multipart messages into real ZMQ inboxes, and raw
//! broken bytes (truncated greetings, bad frame headers) at the same ports, without a ZMQ
//! library in xtask.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};

/// The 64-byte greeting: signature, version 3.0, mechanism NULL, not a server.
pub fn greeting() -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    let mut mech = b"NULL".to_vec();
    mech.resize(20, 0);
    g.extend(mech);
    g.push(0); // as-server
    g.resize(64, 0); // filler
    g
}

/// The READY command announcing a PUSH socket.
pub fn ready() -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend(b"READY");
    let name = b"Socket-Type";
    body.push(name.len() as u8);
    body.extend(name);
    body.extend((4u32).to_be_bytes());
    body.extend(b"PUSH");
    let mut cmd = vec![0x04, body.len() as u8];
    cmd.extend(body);
    cmd
}

/// One multipart message as ZMTP frames (short or long size as needed).
pub fn message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { 0x01 } else { 0x00 };
        if f.len() <= 255 {
            out.push(more);
            out.push(f.len() as u8);
        } else {
            out.push(more | 0x02);
            out.extend((f.len() as u64).to_be_bytes());
        }
        out.extend_from_slice(f);
    }
    out
}

/// A PUSH connection to a ZMQ PULL socket.
pub struct Push {
    s: TcpStream,
}

impl Push {
    /// Connects and performs the handshake (the peer's greeting is read and ignored).
    pub fn connect(addr: SocketAddr) -> Result<Push> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
            .with_context(|| format!("connecting to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.write_all(&greeting())?;
        let mut peer = [0u8; 64];
        s.read_exact(&mut peer)
            .context("reading the ZMTP greeting")?;
        s.write_all(&ready())?;
        Ok(Push { s })
    }

    /// Sends one multipart message.
    pub fn send(&mut self, frames: &[&[u8]]) -> Result<()> {
        self.s.write_all(&message(frames))?;
        Ok(())
    }

    /// Sends raw bytes (a broken frame).
    pub fn raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.s.write_all(bytes)?;
        Ok(())
    }

    /// Closes after the peer has had time to read what was sent (reads until it closes or for
    /// at most `linger`, so that unread data does not turn the close into a reset).
    pub fn close(mut self, linger: Duration) {
        let _ = self.s.shutdown(std::net::Shutdown::Write);
        let _ = self.s.set_read_timeout(Some(linger));
        let mut buf = [0u8; 1024];
        while matches!(self.s.read(&mut buf), Ok(n) if n > 0) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_and_ready_follow_the_spec() {
        let g = greeting();
        assert_eq!(g.len(), 64);
        assert_eq!((g[0], g[9], g[10], g[11]), (0xFF, 0x7F, 3, 0));
        assert_eq!(&g[12..16], b"NULL");
        assert!(g[16..].iter().all(|b| *b == 0));
        let r = ready();
        assert_eq!(r[0], 0x04);
        assert_eq!(r[1] as usize, r.len() - 2);
        assert_eq!(&r[2..8], b"\x05READY");
        assert!(r.ends_with(b"Socket-Type\x00\x00\x00\x04PUSH"));
    }

    #[test]
    fn frames_carry_more_flags_and_long_sizes() {
        let big = vec![7u8; 300];
        let m = message(&[b"ab", &big, b""]);
        assert_eq!(&m[..4], &[0x01, 2, b'a', b'b']);
        assert_eq!(m[4], 0x03);
        assert_eq!(&m[5..13], &300u64.to_be_bytes());
        assert_eq!(&m[m.len() - 2..], &[0x00, 0]);
        assert_eq!(m.len(), 4 + 9 + 300 + 2);
    }
}
