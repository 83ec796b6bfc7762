//! Scripted peers for the mooncake tests: a fake Mooncake target (handshake + data port, with
//! synthetic buffer addresses and a chosen misbehaviour), a one-reply server for the metadata
//! client, and a heap buffer that registers itself.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvx_rdma::mooncake::handshake::{self, RequestType};
use kvx_rdma::mooncake::wire::{HEADER_LEN, Header, STATUS_ADDR_REJECTED, Status};
use kvx_rdma::{RegionKey, Transport};

/// First address of the fake target's one buffer (synthetic: nothing is written there).
pub const FAKE_BASE: u64 = 0x7F3A_0000_0000;
/// Its length.
pub const FAKE_LEN: u64 = 1 << 30;

/// Heap memory with a stable address.
pub struct Buf(pub Vec<u8>);

impl Buf {
    pub fn zeroed(n: usize) -> Self {
        Buf(vec![0u8; n])
    }
    pub fn filled(n: usize, b: u8) -> Self {
        Buf(vec![b; n])
    }
    pub fn pattern(n: usize, seed: u64) -> Self {
        let mut x = seed | 1;
        Buf((0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect())
    }
    pub fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    pub fn register(&mut self, t: &dyn Transport) -> RegionKey {
        let n = self.0.len();
        self.register_range(t, 0, n)
    }
    pub fn register_range(&mut self, t: &dyn Transport, off: usize, len: usize) -> RegionKey {
        // SAFETY: every buffer outlives the transport it is registered with (declared first,
        // dropped last), and is only read after the batches touching it completed.
        unsafe { t.register(self.0.as_mut_ptr() as u64 + off as u64, len as u64) }.unwrap()
    }
}

/// How the fake target behaves.
#[derive(Clone, Copy, Debug)]
pub enum FakeMode {
    /// v2; acknowledges every write after `delay`, except the first one to `addr`, which it
    /// rejects (then closes that connection, as Mooncake does).
    RejectOnce { addr: u64, delay: Duration },
    /// v2; reads everything, never answers.
    Silent,
    /// v2; closes each data connection right after its first header.
    CloseAfterHeader,
    /// v1 (no `tcp_proto_version`): no status frames; READs answered with zero bytes.
    V1,
}

/// A running fake target.
pub struct Fake {
    /// Its session id.
    pub session: String,
    /// Payload bytes received on the data port so far (counted as they arrive).
    pub received: Arc<AtomicU64>,
    /// v1 READs (fences) served.
    pub fences: Arc<AtomicU64>,
}

impl Fake {
    pub fn start(mode: FakeMode) -> Fake {
        let hs = TcpListener::bind("127.0.0.1:0").unwrap();
        let data = TcpListener::bind("127.0.0.1:0").unwrap();
        let session = format!("127.0.0.1:{}", hs.local_addr().unwrap().port());
        let data_port = data.local_addr().unwrap().port();
        let mut desc = serde_json::json!({
            "name": session,
            "protocol": "tcp",
            "tcp_data_host": "127.0.0.1",
            "tcp_data_port": data_port,
            "buffers": [{"name": session, "addr": FAKE_BASE, "length": FAKE_LEN}],
        });
        if !matches!(mode, FakeMode::V1) {
            desc["tcp_proto_version"] = 2.into();
        }
        let reply =
            handshake::encode_frame(Some(RequestType::Metadata), desc.to_string().as_bytes());
        std::thread::spawn(move || {
            for s in hs.incoming() {
                let Ok(mut s) = s else { continue };
                let mut prefix = [0u8; 8];
                if s.read_exact(&mut prefix).is_err() {
                    continue;
                }
                let Ok(n) = handshake::body_len(&prefix) else {
                    continue;
                };
                let mut body = vec![0u8; n];
                if s.read_exact(&mut body).is_ok() {
                    let _ = s.write_all(&reply);
                }
            }
        });
        let received = Arc::new(AtomicU64::new(0));
        let fences = Arc::new(AtomicU64::new(0));
        let rejected = Arc::new(AtomicBool::new(false));
        let (r, f) = (received.clone(), fences.clone());
        std::thread::spawn(move || {
            for s in data.incoming() {
                let Ok(s) = s else { continue };
                let (r, f, rej) = (r.clone(), f.clone(), rejected.clone());
                std::thread::spawn(move || serve_data(s, mode, &r, &f, &rej));
            }
        });
        Fake {
            session,
            received,
            fences,
        }
    }
}

fn serve_data(
    mut s: TcpStream,
    mode: FakeMode,
    received: &AtomicU64,
    fences: &AtomicU64,
    rejected: &AtomicBool,
) {
    let _ = s.set_nodelay(true);
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        let mut hdr = [0u8; HEADER_LEN];
        if s.read_exact(&mut hdr).is_err() {
            return;
        }
        let h = Header::decode(&hdr);
        match mode {
            FakeMode::CloseAfterHeader => return,
            FakeMode::RejectOnce { addr, .. }
                if h.addr == addr && !rejected.swap(true, Ordering::SeqCst) =>
            {
                let _ = s.write_all(&Status::Rejected(STATUS_ADDR_REJECTED).encode());
                return;
            }
            _ => {}
        }
        if h.is_write() {
            let mut left = h.size;
            while left > 0 {
                let n = left.min(scratch.len() as u64) as usize;
                match s.read(&mut scratch[..n]) {
                    Ok(0) | Err(_) => return,
                    Ok(k) => {
                        received.fetch_add(k as u64, Ordering::SeqCst);
                        left -= k as u64;
                    }
                }
            }
            match mode {
                FakeMode::RejectOnce { delay, .. } => {
                    std::thread::sleep(delay);
                    if s.write_all(&Status::Ok.encode()).is_err() {
                        return;
                    }
                }
                FakeMode::Silent | FakeMode::V1 | FakeMode::CloseAfterHeader => {}
            }
        } else {
            if h.is_v2() && s.write_all(&Status::Ok.encode()).is_err() {
                return;
            }
            if !h.is_v2() {
                fences.fetch_add(1, Ordering::SeqCst);
            }
            if s.write_all(&vec![0u8; h.size.min(1 << 20) as usize])
                .is_err()
            {
                return;
            }
        }
    }
}

/// A server that, per connection, reads what the client sends (one read) and answers `reply`
/// then closes; with `silent` it holds the connection without answering. Returns its port.
pub fn reply_server(reply: Vec<u8>, silent: bool) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let reply = reply.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf);
                if silent {
                    std::thread::sleep(Duration::from_secs(10));
                } else {
                    let _ = s.write_all(&reply);
                }
            });
        }
    });
    port
}
