//! What this host allows, measured in the same run as the engines so that their figures can be
//! read against it: the copy a shape's destination pattern costs, and the control path's floor.
//!
//! - [`copy_pattern`]: a TP 2 → TP 1 room lands in the decode's pages as pieces of one rank's
//!   heads (1 KiB per token for Llama-3-8B) at the stride of a whole token row (2 KiB). Whoever
//!   copies into that pattern — the receiver's kernel copy, or a scatter out of a ring — pays
//!   what a plain `memcpy` into it pays against a contiguous copy of the same bytes (stores that
//!   fill only part of each stretch of memory make the CPU read the lines before writing them).
//! - [`control_floor`]: an empty room's unavoidable hops with no engine in them: a 64-byte write
//!   on a plain TCP connection and the reader's 8-byte acknowledgement (the aux row's write),
//!   then one ZMQ PUSH → PULL message seen by a thread blocked on the PULL (the status), on
//!   loopback; the engines add their own hand-offs between threads to that.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvx_bootstrap::sockets::zmq;

/// Bytes each copy pattern moves (above any last-level cache).
const COPY_BYTES: usize = 128 << 20;

/// Best-of-three throughput (GB/s) of `memcpy` into pieces of `piece` bytes at a `stride`, and
/// of one contiguous copy of the same bytes, alternating.
pub fn copy_pattern(piece: usize, stride: usize) -> (f64, f64) {
    let (piece, stride) = (piece.max(1), stride.max(piece.max(1)));
    let pieces = COPY_BYTES / piece;
    let src: Vec<u8> = (0..pieces * piece).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![1u8; pieces * stride];
    let (mut strided, mut contiguous) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        let t = Instant::now();
        for (k, s) in src.chunks_exact(piece).enumerate() {
            dst[k * stride..k * stride + piece].copy_from_slice(s);
        }
        strided = strided.min(t.elapsed());
        let t = Instant::now();
        dst[..src.len()].copy_from_slice(&src);
        contiguous = contiguous.min(t.elapsed());
    }
    std::hint::black_box(&dst);
    let gbps = |d: Duration| src.len() as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    (gbps(strided), gbps(contiguous))
}

/// One round of [`control_floor`].
#[derive(Clone, Copy, Debug)]
pub struct FloorRound {
    /// The write and its acknowledgement.
    pub write_ack: Duration,
    /// From the acknowledgement until the receiving thread had the ZMQ message.
    pub message: Duration,
}

impl FloorRound {
    /// The whole round.
    pub fn total(&self) -> Duration {
        self.write_ack + self.message
    }
}

/// `rounds` times: a 64-byte write on a plain TCP connection and its 8-byte acknowledgement,
/// then a 3-frame ZMQ message until the receiving thread has it.
pub fn control_floor(rounds: usize) -> Result<Vec<FloorRound>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut tx = TcpStream::connect(listener.local_addr()?)?;
    tx.set_nodelay(true)?;
    let (mut rx, _) = listener.accept()?;
    rx.set_nodelay(true)?;
    let acker = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while rx.read_exact(&mut buf).is_ok() {
            if rx.write_all(&[1u8; 8]).is_err() {
                return;
            }
        }
    });
    let ctx = zmq::Context::new();
    let pull = ctx.socket(zmq::PULL)?;
    // A receiver left waiting (a round failed) stops after 2 s idle, closing its socket so that
    // the context can end; the PUSH socket drops what it still holds at close.
    pull.set_rcvtimeo(2000)?;
    pull.bind("tcp://127.0.0.1:*")?;
    let addr = pull
        .get_last_endpoint()?
        .ok()
        .context("PULL socket address")?;
    let push = ctx.socket(zmq::PUSH)?;
    push.set_linger(0)?;
    push.connect(&addr)?;
    let (seen_tx, seen) = mpsc::channel::<Instant>();
    let receiver = std::thread::spawn(move || {
        while let Ok(m) = pull.recv_multipart(0) {
            if m.first().is_some_and(|f| f.as_slice() == b"STOP")
                || seen_tx.send(Instant::now()).is_err()
            {
                return;
            }
        }
    });
    let status: [&[u8]; 3] = [b"1234567", b"2", b"0"];
    let mut once = || -> Result<FloorRound> {
        let t = Instant::now();
        tx.write_all(&[7u8; 64])?;
        let mut ack = [0u8; 8];
        tx.read_exact(&mut ack)?;
        let acked = Instant::now();
        push.send_multipart(status, 0)?;
        let at = seen
            .recv_timeout(Duration::from_secs(5))
            .context("the ZMQ message did not arrive")?;
        Ok(FloorRound {
            write_ack: acked - t,
            message: at.saturating_duration_since(acked),
        })
    };
    let mut run = || -> Result<Vec<FloorRound>> {
        for _ in 0..50 {
            once()?;
        }
        (0..rounds).map(|_| once()).collect()
    };
    let out = run();
    // Both helper threads end whatever happened: the STOP (or the receive timeout), then EOF.
    let _ = push.send(&b"STOP"[..], 0);
    let _ = tx.shutdown(std::net::Shutdown::Both);
    let _ = receiver.join();
    let _ = acker.join();
    out
}
