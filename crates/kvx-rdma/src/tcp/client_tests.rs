//! Unit tests of the inline path ([`send_inline`]) on bare connections: no writer or
//! acknowledgement thread runs, so the test plays both the peer and the reader.

use std::io::Read;
use std::net::{TcpListener, TcpStream};

use super::*;
use crate::batch::TestBatch;

/// A connection (no threads) and the peer's end of its socket.
fn conn() -> (Arc<ConnShared>, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let stream = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (peer, _) = l.accept().unwrap();
    let c = Arc::new(ConnShared {
        peer: "test".into(),
        stream,
        pending: Mutex::new(VecDeque::new()),
        dead: Mutex::new(None),
        is_dead: AtomicBool::new(false),
        wire: Mutex::new(1),
    });
    (c, peer)
}

/// A registered source buffer and a window of one write of its first `len` bytes.
struct Src {
    buf: Vec<u8>,
    table: RegionTable,
}

impl Src {
    fn new(len: usize) -> Src {
        let buf: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let table = RegionTable::new();
        table.insert(buf.as_ptr() as u64, len as u64).unwrap();
        Src { buf, table }
    }

    fn window(&self, len: usize, ticket: Ticket) -> Window {
        let src = self
            .table
            .resolve(self.buf.as_ptr() as u64, len as u64)
            .unwrap();
        Window {
            ticket,
            writes: vec![WireWrite {
                key: RegionKey(7),
                src,
                dst: 0x1000,
            }],
        }
    }
}

fn read_header(peer: &mut TcpStream) -> ClientFrame {
    let mut h = [0u8; HEADER_LEN];
    peer.read_exact(&mut h).unwrap();
    ClientFrame::decode(&h).unwrap()
}

fn ack(tag: u64) -> [u8; HEADER_LEN] {
    Ack {
        tag,
        status: None,
        rejected: 0,
        first_rejected_addr: 0,
        bytes: 0,
    }
    .encode()
}

#[test]
fn an_idle_connection_takes_a_small_window_inline() {
    let (c, mut peer) = conn();
    let src = Src::new(4096);
    let (batch, mut t) = TestBatch::new(1);
    let w = src.window(4096, t.remove(0));
    assert!(send_inline(std::slice::from_ref(&c), w).is_none());
    // Recorded in flight under the tag it went out with; the next window gets the next tag.
    assert_eq!(lock(&c.pending).front().map(|p| p.tag), Some(1));
    assert_eq!(*lock(&c.wire), 2);
    assert_eq!(
        read_header(&mut peer),
        ClientFrame::WriteV { count: 1, tag: 1 }
    );
    let mut e = [0u8; ENTRY_LEN];
    peer.read_exact(&mut e).unwrap();
    let e = Entry::decode(&e).unwrap();
    assert_eq!((e.key, e.addr, e.len), (RegionKey(7), 0x1000, 4096));
    let mut payload = vec![0u8; 4096];
    peer.read_exact(&mut payload).unwrap();
    assert_eq!(payload, src.buf);
    assert_eq!(read_header(&mut peer), ClientFrame::Fence { tag: 1 });
    // Unanswered until its acknowledgement.
    assert_eq!(batch.left(), 1);
    assert!(on_ack(&c, &ack(1)).is_ok());
    assert_eq!((batch.left(), batch.error()), (0, None));
}

#[test]
fn busy_connections_and_big_windows_are_left_to_the_writers() {
    let src = Src::new(INLINE_MAX + 1);
    // One batch per window: a window given back and dropped here fails its own batch only.
    let mut t: Vec<Ticket> = (0..3).map(|_| TestBatch::new(1).1.remove(0)).collect();
    // One connection with a window unacknowledged, one whose socket a writer holds.
    let (busy, _p1) = conn();
    busy.push(Pending {
        tag: 1,
        ticket: t.remove(0),
        since: Instant::now(),
    })
    .map_err(|_| "dead")
    .unwrap();
    let (held, _p2) = conn();
    let guard = lock(&held.wire);
    let conns = [busy.clone(), held.clone()];
    let w = send_inline(&conns, src.window(4096, t.remove(0))).expect("no idle connection");
    drop(guard);
    // Too big for the inline path, even on an idle connection.
    let (idle, _p3) = conn();
    let big = src.window(INLINE_MAX + 1, t.remove(0));
    assert!(send_inline(std::slice::from_ref(&idle), big).is_some());
    assert!(lock(&idle.pending).is_empty());
    // The small one goes on the first idle connection.
    let conns = [busy.clone(), idle.clone()];
    assert!(send_inline(&conns, w).is_none());
    assert_eq!(lock(&idle.pending).len(), 1);
    assert_eq!(lock(&busy.pending).len(), 1);
}

#[test]
fn a_full_send_buffer_gives_the_window_back_untouched() {
    let (c, _peer) = conn();
    // The peer reads nothing: fill the send path until it takes no more.
    let junk = vec![0u8; 1 << 16];
    let fd = c.stream.as_raw_fd();
    let mut filled = 0usize;
    loop {
        match mem::writev_nowait(fd, &[IoPart::Bytes(&junk)], 0) {
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling: {e}"),
        }
        assert!(filled < 1 << 30, "the send path never filled");
    }
    let src = Src::new(4096);
    let (batch, mut t) = TestBatch::new(1);
    let w = send_inline(std::slice::from_ref(&c), src.window(4096, t.remove(0)))
        .expect("nothing written: the window comes back");
    // Not in flight, tag not used, unit not finished: the writers may still send it.
    assert!(lock(&c.pending).is_empty());
    assert_eq!(*lock(&c.wire), 1);
    assert_eq!((batch.left(), batch.error()), (1, None));
    assert!(!c.is_dead.load(Ordering::Acquire));
    drop(w);
    assert_eq!(batch.left(), 0);
}

#[test]
fn a_dead_connection_or_a_cancelled_window_is_not_sent() {
    let src = Src::new(4096);
    let (c, mut peer) = conn();
    c.fail(TransportError::Closed);
    let (batch, mut t) = TestBatch::new(2);
    let w = send_inline(std::slice::from_ref(&c), src.window(4096, t.remove(0)))
        .expect("dead connections take nothing");
    drop(w);
    // The dropped window failed the batch: its other window is cancelled, even on a live one.
    assert!(batch.error().is_some());
    let (live, _p) = conn();
    assert!(send_inline(std::slice::from_ref(&live), src.window(4096, t.remove(0))).is_some());
    assert!(lock(&live.pending).is_empty());
    let mut b = [0u8; 1];
    assert_eq!(
        peer.read(&mut b).unwrap_or(0),
        0,
        "nothing reached the peer"
    );
}
