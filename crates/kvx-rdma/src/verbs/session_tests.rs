//! The session driver against an in-process simulated reliable-connected NIC.
//!
//! The simulation executes each posted RDMA WRITE as a real copy from the SGEs into the remote
//! range, emits completions for signalled work requests (errors always), breaks a queue pair on
//! its first error and flushes everything posted to it afterwards, like the hardware does. The
//! handshake connection is a real loopback TCP connection. Bytes are verified.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvx_core::TransferOp;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::*;
use crate::verbs::cq::Wc;
use crate::verbs::path::{LocalKeys, SendPath};
use crate::verbs::post::encode_wr_id;
use crate::verbs::regions::Region;
use crate::verbs::sched::Post;

const SRC_KEY: u32 = 1;
const DST_KEY: u32 = 7;
const BAD_KEY: u32 = 9;

struct SimNic {
    qps: usize,
    tx: mpsc::UnboundedSender<Wc>,
    rx: mpsc::UnboundedReceiver<Wc>,
    broken: Vec<bool>,
    fail_posts_on: Option<usize>,
    posts: Arc<AtomicUsize>,
    /// Work requests posted inline.
    inlined: Arc<AtomicUsize>,
}

impl SimNic {
    fn new(qps: usize) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        SimNic {
            qps,
            tx,
            rx,
            broken: vec![false; qps],
            fail_posts_on: None,
            posts: Arc::new(AtomicUsize::new(0)),
            inlined: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl SendPath for SimNic {
    fn qpns(&self) -> Vec<u32> {
        (0..self.qps as u32).map(|i| 0x100 + i).collect()
    }

    fn post<'p>(
        &mut self,
        post: &Post,
        plan_of: &dyn Fn(BatchId) -> Option<&'p WritePlan>,
    ) -> Result<(), VerbsError> {
        if self.fail_posts_on == Some(post.qp) {
            return Err(VerbsError::verbs("ibv_wr_complete", "simulated ENOMEM"));
        }
        self.posts.fetch_add(1, Ordering::Relaxed);
        for item in &post.items {
            let wr_id = encode_wr_id(post.qp as u32, item.wr_id);
            let wc = |status| Wc {
                wr_id,
                status,
                vendor_err: 0x88,
            };
            if self.broken[post.qp] {
                if item.signaled {
                    let _ = self.tx.send(wc(5));
                }
                continue;
            }
            let plan = plan_of(item.batch).ok_or(VerbsError::Closed)?;
            let wr = plan.wrs[item.wr as usize];
            if wr.inline {
                self.inlined.fetch_add(1, Ordering::Relaxed);
            }
            if wr.rkey == BAD_KEY {
                self.broken[post.qp] = true;
                let _ = self.tx.send(wc(10));
                continue;
            }
            let mut off = 0u64;
            for s in plan.sges_of(&wr) {
                // SAFETY: the test's source and destination buffers are alive for the whole
                // test, and the planner checked every range against their regions.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.addr as usize as *const u8,
                        (wr.remote_addr + off) as usize as *mut u8,
                        s.len as usize,
                    );
                }
                off += u64::from(s.len);
            }
            if item.signaled {
                let _ = self.tx.send(wc(0));
            }
        }
        Ok(())
    }

    async fn next_completions(&mut self, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        let first = self.rx.recv().await.ok_or(VerbsError::Closed)?;
        out.push(first);
        while let Ok(w) = self.rx.try_recv() {
            out.push(w);
        }
        Ok(out.len())
    }
}

/// The local regions, and whether the source region counts as device memory.
struct Keys(RegionTable, bool);

impl LocalKeys for Keys {
    fn local_regions(&self) -> RegionTable {
        self.0.clone()
    }

    fn device_lkeys(&self) -> Vec<u32> {
        if self.1 { vec![SRC_KEY] } else { Vec::new() }
    }
}

struct Fixture {
    src: Vec<u8>,
    dst: Vec<u8>,
    bad: Vec<u8>,
    peer_end: Option<TcpStream>,
    session: Arc<VerbsSession>,
    posts: Arc<AtomicUsize>,
}

const LEN: usize = 1 << 20;

async fn fixture<P: SendPath>(nic: P, posts: Arc<AtomicUsize>, sched: SchedConfig) -> Fixture {
    fixture_with(nic, posts, sched, 0, false).await
}

/// A fixture whose queue pairs inline up to `max_inline` bytes; `device`: the source region is
/// registered as device memory.
async fn fixture_with<P: SendPath>(
    nic: P,
    posts: Arc<AtomicUsize>,
    sched: SchedConfig,
    max_inline: u32,
    device: bool,
) -> Fixture {
    let src: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    let dst = vec![0u8; LEN];
    let bad = vec![0u8; 4096];
    let local = RegionTable::from_regions(vec![Region {
        base: src.as_ptr() as u64,
        len: LEN as u64,
        key: SRC_KEY,
    }])
    .unwrap();
    let remote = RegionTable::from_regions(vec![
        Region {
            base: dst.as_ptr() as u64,
            len: LEN as u64,
            key: DST_KEY,
        },
        Region {
            base: bad.as_ptr() as u64,
            len: 4096,
            key: BAD_KEY,
        },
    ])
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ctrl = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (peer_end, _) = listener.accept().await.unwrap();
    let remote_desc = SegmentDescriptor {
        endpoint: "sim".into(),
        regions: remote.descs(),
    };
    let session = VerbsSession::start(
        nic,
        SessionParts {
            peer: "sim".into(),
            local: Arc::new(Keys(local, device)),
            ctrl,
            remote,
            remote_desc,
            limits: Limits {
                max_sge: 4,
                max_inline,
                max_wr_bytes: 64 << 10,
            },
            sched,
            max_queued_wrs: 64,
        },
    );
    Fixture {
        src,
        dst,
        bad,
        peer_end: Some(peer_end),
        session,
        posts,
    }
}

async fn sim_fixture(nic: SimNic) -> Fixture {
    let posts = nic.posts.clone();
    fixture(nic, posts, small_sched()).await
}

fn small_sched() -> SchedConfig {
    SchedConfig {
        depth: 8,
        signal_every: 4,
        max_wr_per_post: 4,
    }
}

/// Batch `k`: 32 pages of 2 KiB, scattered sources, its own shuffled block of destinations.
fn batch(f: &Fixture, k: usize) -> Vec<TransferOp> {
    (0..32)
        .map(|i| {
            let s = (i * 5 + k * 3) % (LEN / 2048);
            let d = k * 32 + (i * 11) % 32;
            TransferOp::new(
                f.src.as_ptr() as u64 + (s * 2048) as u64,
                f.dst.as_ptr() as u64 + (d * 2048) as u64,
                2048,
            )
        })
        .collect()
}

fn verify(f: &Fixture, ops: &[TransferOp]) {
    for op in ops {
        let s = (op.src - f.src.as_ptr() as u64) as usize;
        let d = (op.dst - f.dst.as_ptr() as u64) as usize;
        let n = op.len as usize;
        assert_eq!(&f.dst[d..d + n], &f.src[s..s + n], "dst offset {d:#x}");
    }
}

#[tokio::test]
async fn concurrent_batches_land_byte_exact() {
    let f = sim_fixture(SimNic::new(3)).await;
    let batches: Vec<_> = (0..16).map(|k| batch(&f, k)).collect();
    let futs: Vec<_> = batches
        .iter()
        .map(|ops| f.session.write_batch(ops.clone()))
        .collect();
    for (fut, ops) in futs.into_iter().zip(&batches) {
        let r = fut.await.unwrap();
        assert_eq!(r.ops, 32);
        assert_eq!(r.bytes, 32 * 2048);
        verify(&f, ops);
    }
    // one bulk op, sliced into 64 KiB work requests
    let bulk = vec![TransferOp::new(
        f.src.as_ptr() as u64,
        f.dst.as_ptr() as u64,
        LEN as u64,
    )];
    f.session.write_batch(bulk.clone()).await.unwrap();
    verify(&f, &bulk);
    assert!(f.session.is_alive());
}

#[tokio::test]
async fn device_memory_sources_are_never_inlined() {
    // Small writes from a host source go inline; from a device source, through the SGE list.
    for (device, want_inline) in [(false, true), (true, false)] {
        let nic = SimNic::new(1);
        let (posts, inlined) = (nic.posts.clone(), nic.inlined.clone());
        let f = fixture_with(nic, posts, small_sched(), 256, device).await;
        let ops: Vec<_> = (0..4)
            .map(|i| {
                TransferOp::new(
                    f.src.as_ptr() as u64 + i * 4096,
                    f.dst.as_ptr() as u64 + i * 4096,
                    64,
                )
            })
            .collect();
        f.session.write_batch(ops.clone()).await.unwrap();
        verify(&f, &ops);
        assert_eq!(
            inlined.load(Ordering::Relaxed) > 0,
            want_inline,
            "device {device}"
        );
    }
}

#[tokio::test]
async fn remote_error_fails_only_its_batch() {
    let f = sim_fixture(SimNic::new(2)).await;
    let good: Vec<_> = (0..6).map(|k| batch(&f, k)).collect();
    let bad = vec![TransferOp::new(
        f.src.as_ptr() as u64,
        f.bad.as_ptr() as u64,
        4096,
    )];
    let mut futs: Vec<_> = good
        .iter()
        .map(|ops| f.session.write_batch(ops.clone()))
        .collect();
    let bad_fut = f.session.write_batch(bad);
    futs.extend((6..10).map(|k| f.session.write_batch(batch(&f, k))));
    let e = bad_fut.await.unwrap_err();
    assert!(matches!(e, TransportError::RemoteRejected { .. }), "{e}");
    for fut in futs {
        fut.await.unwrap();
    }
    for ops in &good {
        verify(&f, ops);
    }
    // one queue pair is broken, the other still carries new batches
    let later = batch(&f, 12);
    f.session.write_batch(later.clone()).await.unwrap();
    verify(&f, &later);
}

#[tokio::test]
async fn failed_posts_move_work_to_the_other_queue_pairs() {
    let mut nic = SimNic::new(2);
    nic.fail_posts_on = Some(0);
    let f = sim_fixture(nic).await;
    let batches: Vec<_> = (0..4).map(|k| batch(&f, k)).collect();
    for ops in &batches {
        f.session.write_batch(ops.clone()).await.unwrap();
        verify(&f, ops);
    }
    // with its only queue pair failing, a session fails its batches as peer lost
    let mut nic = SimNic::new(1);
    nic.fail_posts_on = Some(0);
    let f = sim_fixture(nic).await;
    let e = f.session.write_batch(batch(&f, 0)).await.unwrap_err();
    assert!(matches!(e, TransportError::PeerLost { .. }), "{e}");
    assert!(e.is_peer_failure());
}

#[tokio::test]
async fn refused_batches_post_nothing() {
    let f = sim_fixture(SimNic::new(1)).await;
    let base = f.dst.as_ptr() as u64;
    let e = f
        .session
        .write_batch(vec![
            TransferOp::new(f.src.as_ptr() as u64, base, 64),
            TransferOp::new(f.src.as_ptr() as u64, base + LEN as u64 - 8, 64),
        ])
        .await
        .unwrap_err();
    assert!(
        matches!(e, TransportError::RemoteNotRegistered { .. }),
        "{e}"
    );
    let e = f
        .session
        .write_batch(vec![TransferOp::new(1, base, 64)])
        .await
        .unwrap_err();
    assert!(
        matches!(e, TransportError::LocalNotRegistered { .. }),
        "{e}"
    );
    assert_eq!(f.posts.load(Ordering::Relaxed), 0);
    assert!(f.dst.iter().all(|&b| b == 0));
    // an empty batch completes without posting
    let r = f.session.write_batch(Vec::new()).await.unwrap();
    assert_eq!(r.bytes, 0);
    assert_eq!(f.posts.load(Ordering::Relaxed), 0);
}

/// A NIC that accepts posts and never completes them (a peer that went silent).
struct SilentNic(SimNic);

impl SendPath for SilentNic {
    fn qpns(&self) -> Vec<u32> {
        self.0.qpns()
    }
    fn post<'p>(
        &mut self,
        _post: &Post,
        _plan_of: &dyn Fn(BatchId) -> Option<&'p WritePlan>,
    ) -> Result<(), VerbsError> {
        Ok(())
    }
    fn next_completions<'a>(
        &'a mut self,
        out: &'a mut Vec<Wc>,
    ) -> impl Future<Output = Result<usize, VerbsError>> + Send + 'a {
        self.0.next_completions(out)
    }
}

#[tokio::test]
async fn peer_closing_its_connection_fails_open_batches() {
    let mut f = fixture(
        SilentNic(SimNic::new(2)),
        Arc::new(AtomicUsize::new(0)),
        small_sched(),
    )
    .await;
    let other = sim_fixture(SimNic::new(2)).await;
    let fut = f.session.write_batch(batch(&f, 0));
    drop(f.peer_end.take()); // the peer process dies: its end of the connection closes
    // hang guard, not a timing assertion
    let e = tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("batch resolved")
        .unwrap_err();
    assert!(matches!(e, TransportError::PeerLost { .. }), "{e}");
    while f.session.is_alive() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(f.session.write_batch(batch(&f, 1)).await.is_err());
    // another peer's session is unaffected
    let ops = batch(&other, 2);
    other.session.write_batch(ops.clone()).await.unwrap();
    verify(&other, &ops);
}

#[tokio::test]
async fn backpressure_admits_batches_larger_than_the_queue() {
    // 64 work requests may be queued (fixture); this batch alone needs 128 (one per op: the
    // destinations are not contiguous), in the first half of the destination
    let f = sim_fixture(SimNic::new(2)).await;
    let ops: Vec<TransferOp> = (0..128)
        .map(|i| {
            TransferOp::new(
                f.src.as_ptr() as u64 + (i * 4096) as u64,
                f.dst.as_ptr() as u64 + ((127 - i) * 4096) as u64,
                2048,
            )
        })
        .collect();
    // other batches into the second half meanwhile
    let small: Vec<_> = (8..16).map(|k| batch(&f, k)).collect();
    let big = f.session.write_batch(ops.clone());
    let rest: Vec<_> = small
        .iter()
        .map(|o| f.session.write_batch(o.clone()))
        .collect();
    big.await.unwrap();
    for r in rest {
        r.await.unwrap();
    }
    verify(&f, &ops);
    for o in &small {
        verify(&f, o);
    }
}
