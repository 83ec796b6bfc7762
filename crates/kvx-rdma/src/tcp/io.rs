//! Small async I/O helpers over a shared `&TcpStream` (readiness + non-blocking syscalls), so a
//! connection's reader and writer tasks can share one socket without splitting it.

use std::io;
use std::os::fd::AsRawFd;

use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::mem::{self, IoPart};

/// Reads exactly `buf.len()` bytes. EOF before that is `UnexpectedEof`.
pub async fn read_full(stream: &TcpStream, buf: &mut [u8]) -> io::Result<()> {
    let mut have = 0;
    while have < buf.len() {
        match stream.try_read(&mut buf[have..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => stream.readable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes every byte of `parts` (vectored, straight from registered memory for spans).
pub async fn write_parts(stream: &TcpStream, parts: &[IoPart<'_>]) -> io::Result<u64> {
    let fd = stream.as_raw_fd();
    let mut idx = 0;
    let mut off = 0;
    let mut total = 0u64;
    while idx < parts.len() {
        if parts[idx].len() == off {
            idx += 1;
            off = 0;
            continue;
        }
        let r = stream.try_io(Interest::WRITABLE, || mem::writev(fd, &parts[idx..], off));
        let n = match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                stream.writable().await?;
                continue;
            }
            Err(e) => return Err(e),
        };
        total += n as u64;
        tokio::task::consume_budget().await;
        (idx, off) = advance(parts, idx, off, n);
    }
    Ok(total)
}

/// Moves the cursor `(idx, off)` over `parts` forward by `n` written bytes.
pub(crate) fn advance(
    parts: &[IoPart<'_>],
    mut idx: usize,
    mut off: usize,
    mut n: usize,
) -> (usize, usize) {
    while n > 0 && idx < parts.len() {
        let left = parts[idx].len() - off;
        if n >= left {
            n -= left;
            idx += 1;
            off = 0;
        } else {
            off += n;
            n = 0;
        }
    }
    (idx, off)
}

/// Writes all of `bytes`.
pub async fn write_all(stream: &TcpStream, bytes: &[u8]) -> io::Result<()> {
    write_parts(stream, &[IoPart::Bytes(bytes)])
        .await
        .map(|_| ())
}
