//! A small zero-copy TCP data plane: one-sided writes into a peer's registered regions.
//!
//! Framing (little-endian): `WRITE = 0x01, dst: u64, len: u64, payload[len]`;
//! `FLUSH = 0x02, id: u64`, answered by `ACK = 0x03, id: u64, failed_ops: u32` once every write
//! before it has landed. The sender writes headers and payloads straight from registered memory
//! with vectored writes (no payload copy); the receiver reads each payload straight into the
//! destination range after checking it against its registered regions. A write outside every
//! region is drained, counted and reported in the next ACK; a malformed frame closes the
//! connection. `INFO = 0x04` is answered by `0x05, n: u32, n × (base: u64, len: u64)`, the
//! registered regions (the segment descriptor a link test needs). The session id a decode
//! advertises is this server's `ip:port`.

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvx_core::TransferOp;

use crate::region::{OutOfBounds, Region};

const TAG_WRITE: u8 = 1;
const TAG_FLUSH: u8 = 2;
const TAG_ACK: u8 = 3;
const TAG_INFO: u8 = 4;
const TAG_INFO_REPLY: u8 = 5;
/// Largest single write accepted (1 GiB); larger is a protocol error.
pub const MAX_WRITE: u64 = 1 << 30;

/// Why a batch did not land.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The connection failed (peer gone, reset, timeout).
    #[error("data connection to {peer} failed: {source}")]
    Io {
        /// The peer.
        peer: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The peer rejected some writes (outside its registered memory).
    #[error("peer {peer} rejected {failed} writes of the batch")]
    Rejected {
        /// The peer.
        peer: String,
        /// Number of rejected writes.
        failed: u32,
    },
    /// A source range is not inside local registered memory.
    #[error("source outside registered memory: {0}")]
    LocalBounds(#[from] OutOfBounds),
    /// The ACK did not match the FLUSH.
    #[error("peer {peer} answered with a bad ack")]
    BadAck {
        /// The peer.
        peer: String,
    },
}

/// The receiving side: accepts writer connections and applies their writes.
pub struct DataServer {
    addr: SocketAddr,
    bytes: Arc<AtomicU64>,
}

impl DataServer {
    /// Binds `addr` (port 0 for any) and serves writes into `regions` on background threads.
    pub fn bind(addr: &str, regions: Vec<Arc<Region>>) -> io::Result<DataServer> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let bytes = Arc::new(AtomicU64::new(0));
        let counter = bytes.clone();
        let regions = Arc::new(regions);
        std::thread::Builder::new()
            .name("kvx-data-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    match conn {
                        Ok(s) => {
                            let regions = regions.clone();
                            let counter = counter.clone();
                            let _ = std::thread::Builder::new()
                                .name("kvx-data-conn".into())
                                .spawn(move || {
                                    let peer = s.peer_addr().map(|a| a.to_string()).ok();
                                    if let Err(e) = serve_conn(s, &regions, &counter) {
                                        tracing::debug!(?peer, error = %e, "data connection closed");
                                    }
                                });
                        }
                        Err(e) => tracing::warn!(error = %e, "data plane accept failed"),
                    }
                }
            })?;
        Ok(DataServer { addr: local, bytes })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Bytes written into the regions so far.
    pub fn bytes_received(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn serve_conn(mut s: TcpStream, regions: &[Arc<Region>], bytes: &AtomicU64) -> io::Result<()> {
    s.set_nodelay(true)?;
    let mut failed: u32 = 0;
    let mut scratch = vec![0u8; 64 * 1024];
    loop {
        let mut tag = [0u8; 1];
        match s.read_exact(&mut tag) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        match tag[0] {
            TAG_WRITE => {
                let dst = read_u64(&mut s)?;
                let len = read_u64(&mut s)?;
                if len > MAX_WRITE {
                    metrics::counter!("kvx_data_malformed_total").increment(1);
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "write too large",
                    ));
                }
                match regions.iter().find(|r| r.contains(dst, len)) {
                    Some(r) => {
                        r.write_with(dst, len, |buf| s.read_exact(buf))
                            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))??;
                        bytes.fetch_add(len, Ordering::Relaxed);
                    }
                    None => {
                        metrics::counter!("kvx_data_rejected_writes_total").increment(1);
                        tracing::warn!(dst, len, "write outside registered memory dropped");
                        failed = failed.saturating_add(1);
                        let mut left = len;
                        while left > 0 {
                            let n = left.min(scratch.len() as u64) as usize;
                            s.read_exact(&mut scratch[..n])?;
                            left -= n as u64;
                        }
                    }
                }
            }
            TAG_FLUSH => {
                let id = read_u64(&mut s)?;
                let mut ack = [0u8; 13];
                ack[0] = TAG_ACK;
                ack[1..9].copy_from_slice(&id.to_le_bytes());
                ack[9..13].copy_from_slice(&failed.to_le_bytes());
                s.write_all(&ack)?;
                failed = 0;
            }
            TAG_INFO => {
                let mut reply = vec![TAG_INFO_REPLY];
                reply.extend_from_slice(&(regions.len() as u32).to_le_bytes());
                for r in regions {
                    reply.extend_from_slice(&r.base().to_le_bytes());
                    reply.extend_from_slice(&r.len().to_le_bytes());
                }
                s.write_all(&reply)?;
            }
            _ => {
                metrics::counter!("kvx_data_malformed_total").increment(1);
                return Err(io::Error::new(io::ErrorKind::InvalidData, "unknown tag"));
            }
        }
    }
}

/// The writing side: one connection to one peer's data server.
pub struct DataConn {
    stream: TcpStream,
    peer: String,
    next_id: u64,
}

fn write_all_vectored(s: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = s.write_vectored(bufs)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

impl DataConn {
    /// Connects to a peer's data server (`host:port`, as a session id).
    pub fn connect(peer: &str, timeout: Duration) -> Result<DataConn, DataError> {
        let io_err = |source| DataError::Io {
            peer: peer.to_owned(),
            source,
        };
        let addr: SocketAddr = peer
            .parse()
            .map_err(|e| io_err(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(io_err)?;
        stream.set_nodelay(true).map_err(io_err)?;
        stream.set_write_timeout(Some(timeout)).map_err(io_err)?;
        stream.set_read_timeout(Some(timeout)).map_err(io_err)?;
        Ok(DataConn {
            stream,
            peer: peer.to_owned(),
            next_id: 1,
        })
    }

    /// The peer this connection writes to.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Writes every op (each source read from the region of `srcs` holding it), then waits
    /// until the peer applied them all.
    pub fn write_batch(&mut self, srcs: &[&Region], ops: &[TransferOp]) -> Result<(), DataError> {
        const GROUP: usize = 32;
        for group in ops.chunks(GROUP) {
            let mut headers = [[0u8; 17]; GROUP];
            let mut payloads: [&[u8]; GROUP] = [&[]; GROUP];
            for (i, op) in group.iter().enumerate() {
                headers[i][0] = TAG_WRITE;
                headers[i][1..9].copy_from_slice(&op.dst.to_le_bytes());
                headers[i][9..17].copy_from_slice(&op.len.to_le_bytes());
                let region = srcs
                    .iter()
                    .find(|r| r.contains(op.src, op.len))
                    .or(srcs.first())
                    .ok_or(OutOfBounds {
                        addr: op.src,
                        len: op.len,
                        base: 0,
                        size: 0,
                    })?;
                payloads[i] = region.read(op.src, op.len)?;
            }
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * group.len());
            for i in 0..group.len() {
                slices.push(IoSlice::new(&headers[i]));
                slices.push(IoSlice::new(payloads[i]));
            }
            write_all_vectored(&mut self.stream, &mut slices).map_err(|source| DataError::Io {
                peer: self.peer.clone(),
                source,
            })?;
        }
        self.flush()
    }

    /// The peer's registered regions, `(base, len)`.
    pub fn regions(&mut self) -> Result<Vec<(u64, u64)>, DataError> {
        let peer = self.peer.clone();
        let io_err = |source| DataError::Io {
            peer: peer.clone(),
            source,
        };
        self.stream.write_all(&[TAG_INFO]).map_err(io_err)?;
        let mut head = [0u8; 5];
        self.stream.read_exact(&mut head).map_err(io_err)?;
        if head[0] != TAG_INFO_REPLY {
            return Err(DataError::BadAck { peer });
        }
        let n = u32::from_le_bytes([head[1], head[2], head[3], head[4]]).min(1024);
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let base = read_u64(&mut self.stream).map_err(io_err)?;
            let len = read_u64(&mut self.stream).map_err(io_err)?;
            out.push((base, len));
        }
        Ok(out)
    }

    fn flush(&mut self) -> Result<(), DataError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = [0u8; 9];
        msg[0] = TAG_FLUSH;
        msg[1..9].copy_from_slice(&id.to_le_bytes());
        let peer = self.peer.clone();
        let io_err = |source| DataError::Io {
            peer: peer.clone(),
            source,
        };
        self.stream.write_all(&msg).map_err(io_err)?;
        let mut ack = [0u8; 13];
        self.stream.read_exact(&mut ack).map_err(io_err)?;
        let got = u64::from_le_bytes([
            ack[1], ack[2], ack[3], ack[4], ack[5], ack[6], ack[7], ack[8],
        ]);
        if ack[0] != TAG_ACK || got != id {
            return Err(DataError::BadAck { peer });
        }
        let failed = u32::from_le_bytes([ack[9], ack[10], ack[11], ack[12]]);
        if failed > 0 {
            return Err(DataError::Rejected { peer, failed });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_land_and_bad_writes_are_rejected() {
        let dst = Arc::new(Region::new(1 << 16));
        let server = DataServer::bind("127.0.0.1:0", vec![dst.clone()]).unwrap();
        let src = Region::new(1 << 16);
        src.write_with(src.base(), 1 << 16, |b| {
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
        })
        .unwrap();
        let mut c =
            DataConn::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
        let ops = [
            TransferOp::new(src.base(), dst.base() + 4096, 1000),
            TransferOp::new(src.base() + 5000, dst.base() + 100, 10),
        ];
        c.write_batch(&[&src], &ops).unwrap();
        assert_eq!(
            dst.read(dst.base() + 4096, 1000).unwrap(),
            src.read(src.base(), 1000).unwrap()
        );
        assert_eq!(
            dst.read(dst.base() + 100, 10).unwrap(),
            src.read(src.base() + 5000, 10).unwrap()
        );
        let bad = [TransferOp::new(src.base(), dst.base() + (1 << 16) - 5, 10)];
        assert!(matches!(
            c.write_batch(&[&src], &bad),
            Err(DataError::Rejected { failed: 1, .. })
        ));
        // the connection survives a rejected batch
        c.write_batch(&[&src], &ops[..1]).unwrap();
        assert_eq!(server.bytes_received(), 2010);
        assert_eq!(c.regions().unwrap(), vec![(dst.base(), 1 << 16)]);
        let local_bad = [TransferOp::new(0, dst.base(), 1)];
        assert!(matches!(
            c.write_batch(&[&src], &local_bad),
            Err(DataError::LocalBounds(_))
        ));
    }
}
