//! Hardware tests of the verbs backend: real RDMA WRITEs between two transports in this process
//! over the device named by `KVX_RDMA_DEVICE` (loopback through the NIC), bytes verified.
//!
//! Without `KVX_RDMA_DEVICE` every test prints why it skipped and passes. See the `verbs`
//! module docs for how to run them on a host with a device.
#![cfg(feature = "verbs")]

use std::sync::Arc;
use std::time::Duration;

use kvx_core::TransferOp;
use kvx_rdma::verbs::{DeviceConfig, VerbsConfig, VerbsError, VerbsTransport, discover};
use kvx_rdma::{Session, Transport, TransportError};

/// The configured device, or `None` after printing why the test skips.
fn device_or_skip(test: &str) -> Option<DeviceConfig> {
    if let Some(cfg) = DeviceConfig::from_env() {
        return Some(cfg);
    }
    let why = match discover() {
        Err(VerbsError::NoDevice { reason }) => reason,
        Err(e) => e.to_string(),
        Ok(names) => format!("devices present: {}", names.join(",")),
    };
    eprintln!("skipping {test}: no RDMA device (KVX_RDMA_DEVICE unset; {why})");
    None
}

/// A page-aligned heap buffer that stays put while registered.
struct Buf {
    mem: Vec<u8>,
}

impl Buf {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Self {
        Buf {
            mem: (0..len).map(fill).collect(),
        }
    }
    fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
}

struct Pair {
    rx: VerbsTransport,
    tx: VerbsTransport,
    src: Buf,
    dst: Buf,
    session: Arc<dyn Session>,
}

const LEN: usize = 8 << 20;

async fn pair(dev: DeviceConfig, qps_per_peer: usize) -> Pair {
    let rx = VerbsTransport::open(VerbsConfig {
        device: dev.clone(),
        listen: Some("127.0.0.1:0".into()),
        ..VerbsConfig::default()
    })
    .await
    .expect("open receiver");
    let tx = VerbsTransport::open(VerbsConfig {
        device: dev,
        qps_per_peer,
        ..VerbsConfig::default()
    })
    .await
    .expect("open sender");
    let src = Buf::new(LEN, |i| (i * 31 % 251) as u8);
    let dst = Buf::new(LEN, |_| 0);
    // SAFETY: both buffers live in the returned Pair, which outlives the transports' use.
    unsafe {
        rx.register(dst.addr(), LEN as u64).expect("register dst");
        tx.register(src.addr(), LEN as u64).expect("register src");
    }
    let session = tx.connect(&rx.endpoint()).await.expect("connect");
    Pair {
        rx,
        tx,
        src,
        dst,
        session,
    }
}

/// Fragmented KV-like ops of batch `k`: 64 pages of 4 KiB, sources scattered, destinations a
/// shuffled block of its own (batches in flight together never write the same page).
fn fragmented_ops(p: &Pair, k: usize) -> Vec<TransferOp> {
    (0..64)
        .map(|i| {
            let s = (i * 7 + k * 5) % (LEN / 4096);
            let d = k * 64 + (i * 13) % 64;
            TransferOp::new(
                p.src.addr() + (s * 4096) as u64,
                p.dst.addr() + (d * 4096) as u64,
                4096,
            )
        })
        .collect()
}

fn verify(p: &Pair, ops: &[TransferOp]) {
    for op in ops {
        let s = (op.src - p.src.addr()) as usize;
        let d = (op.dst - p.dst.addr()) as usize;
        let n = op.len as usize;
        assert_eq!(
            &p.dst.mem[d..d + n],
            &p.src.mem[s..s + n],
            "bytes at dst offset {d:#x}"
        );
    }
}

#[tokio::test]
async fn verbs_bulk_and_fragmented_writes_land_byte_exact() {
    let Some(dev) = device_or_skip("verbs_bulk_and_fragmented_writes_land_byte_exact") else {
        return;
    };
    let p = pair(dev, 2).await;
    // one bulk write of the whole buffer, sliced into work requests and spread over both QPs
    let bulk = vec![TransferOp::new(p.src.addr(), p.dst.addr(), LEN as u64)];
    let r = p.session.write_batch(bulk.clone()).await.expect("bulk");
    assert_eq!(r.bytes, LEN as u64);
    verify(&p, &bulk);
    // many fragmented batches in flight at once
    let batches: Vec<Vec<TransferOp>> = (0..32).map(|k| fragmented_ops(&p, k)).collect();
    let futs: Vec<_> = batches
        .iter()
        .map(|ops| p.session.write_batch(ops.clone()))
        .collect();
    for (f, ops) in futs.into_iter().zip(&batches) {
        let r = f.await.expect("fragmented batch");
        assert_eq!(r.ops, ops.len() as u64);
    }
    for ops in &batches {
        verify(&p, ops);
    }
    drop(p.tx);
    drop(p.rx);
}

#[tokio::test]
async fn verbs_out_of_bounds_is_refused_before_posting() {
    let Some(dev) = device_or_skip("verbs_out_of_bounds_is_refused_before_posting") else {
        return;
    };
    let p = pair(dev, 1).await;
    let before = p.dst.mem.clone();
    let ops = vec![
        TransferOp::new(p.src.addr(), p.dst.addr(), 4096),
        TransferOp::new(p.src.addr(), p.dst.addr() + LEN as u64 - 8, 16),
    ];
    let e = p.session.write_batch(ops).await.expect_err("out of bounds");
    assert!(
        matches!(e, TransportError::RemoteNotRegistered { .. }),
        "{e}"
    );
    assert_eq!(p.dst.mem, before, "nothing written");
    let e = p
        .session
        .write_batch(vec![TransferOp::new(
            p.src.addr() - 4096,
            p.dst.addr(),
            4096,
        )])
        .await
        .expect_err("unregistered source");
    assert!(
        matches!(e, TransportError::LocalNotRegistered { .. }),
        "{e}"
    );
    // the session still works
    let ok = vec![TransferOp::new(p.src.addr(), p.dst.addr(), 4096)];
    p.session.write_batch(ok.clone()).await.expect("good batch");
    verify(&p, &ok);
}

#[tokio::test]
async fn verbs_remote_error_fails_only_its_batch() {
    let Some(dev) = device_or_skip("verbs_remote_error_fails_only_its_batch") else {
        return;
    };
    let p = pair(dev, 2).await;
    // register a second receiver region, let the sender learn it, then revoke it: writes into it
    // carry a stale rkey and the NIC answers with a remote access error
    let extra = Buf::new(1 << 20, |_| 0);
    // SAFETY: `extra` outlives its registration (deregistered below, before it is dropped).
    let key = unsafe { p.rx.register(extra.addr(), 1 << 20) }.expect("register extra");
    // a new sender learns the extra region in its handshake
    let tx2 = VerbsTransport::open(VerbsConfig {
        device: DeviceConfig::from_env().expect("device"),
        qps_per_peer: 2,
        ..VerbsConfig::default()
    })
    .await
    .expect("open");
    // SAFETY: p.src lives until the end of the test.
    unsafe { tx2.register(p.src.addr(), LEN as u64) }.expect("register");
    let fresh = tx2.connect(&p.rx.endpoint()).await.expect("connect");
    assert!(fresh.remote().find(extra.addr(), 4096).is_some());
    p.rx.deregister(key).expect("deregister");
    let bad = vec![TransferOp::new(p.src.addr(), extra.addr(), 4096)];
    let e = fresh.write_batch(bad).await.expect_err("stale rkey");
    eprintln!("stale rkey → {e}");
    assert!(matches!(e, TransportError::RemoteRejected { .. }), "{e}");
    // a later batch on the surviving queue pair succeeds
    let ok = vec![TransferOp::new(p.src.addr(), p.dst.addr(), 65536)];
    fresh
        .write_batch(ok.clone())
        .await
        .expect("batch after error");
    verify(&p, &ok);
}

#[tokio::test]
async fn verbs_peer_gone_mid_batch_fails_and_does_not_hang() {
    let Some(dev) = device_or_skip("verbs_peer_gone_mid_batch_fails_and_does_not_hang") else {
        return;
    };
    let p = pair(dev.clone(), 2).await;
    // a second receiver the same sender writes to: it must not be affected
    let other = VerbsTransport::open(VerbsConfig {
        device: dev,
        listen: Some("127.0.0.1:0".into()),
        ..VerbsConfig::default()
    })
    .await
    .expect("open second receiver");
    let other_dst = Buf::new(1 << 20, |_| 0);
    // SAFETY: other_dst outlives `other` (declared after it, dropped before it).
    unsafe { other.register(other_dst.addr(), 1 << 20) }.expect("register");
    let other_session =
        p.tx.connect(&other.endpoint())
            .await
            .expect("connect other");
    let ops = vec![TransferOp::new(p.src.addr(), p.dst.addr(), LEN as u64)];
    let fut = p.session.write_batch(ops);
    drop(p.rx); // the receiver closes its control connections and queue pairs
    // the guard below is a hang detector, not a timing assertion
    let r = tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("batch resolved");
    eprintln!("batch with the peer gone → {r:?}");
    if let Err(e) = r {
        assert!(
            e.is_peer_failure() || matches!(e, TransportError::Io { .. }),
            "{e}"
        );
    }
    // the session notices the closed control connection (hang guard, not a timing assertion)
    tokio::time::timeout(Duration::from_secs(30), async {
        while p.session.is_alive() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("session marked dead");
    let later = p
        .session
        .write_batch(vec![TransferOp::new(p.src.addr(), p.dst.addr(), 8)])
        .await;
    assert!(later.is_err());
    // the other peer is unaffected
    other_session
        .write_batch(vec![TransferOp::new(
            p.src.addr(),
            other_dst.addr(),
            1 << 20,
        )])
        .await
        .expect("other peer still served");
    assert_eq!(&other_dst.mem[..], &p.src.mem[..1 << 20]);
}

/// Device memory reaches `ibv_reg_mr` on verbs (it is not refused as unsupported). Real GPU
/// memory is not available to this test, so a `PROT_NONE` mapping stands in for it: what the
/// NIC does with it is printed, and a transfer into GPU memory stays untested here.
#[tokio::test]
async fn verbs_takes_device_memory_to_ibv_reg_mr() {
    let Some(dev) = device_or_skip("verbs_takes_device_memory_to_ibv_reg_mr") else {
        return;
    };
    let t = VerbsTransport::client(VerbsConfig {
        device: dev,
        ..VerbsConfig::default()
    })
    .expect("open the device");
    assert!(t.accepts_device_memory());
    let len = 1usize << 20;
    // SAFETY: an anonymous private mapping with no access rights; never dereferenced.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "mmap PROT_NONE");
    // SAFETY: the mapping outlives the registration (deregistered or refused below, unmapped
    // after); the verbs backend never touches device registrations from the CPU.
    match unsafe { t.register_device(addr as u64, len as u64) } {
        Ok(key) => {
            eprintln!(
                "verbs_takes_device_memory_to_ibv_reg_mr: the stand-in registered; no transfer \
                 into GPU memory was tested (needs a CUDA allocation and nvidia-peermem)"
            );
            t.deregister(key).expect("deregister");
        }
        Err(e) => {
            assert!(
                !matches!(e, TransportError::DeviceMemoryUnsupported { .. }),
                "{e}"
            );
            eprintln!(
                "verbs_takes_device_memory_to_ibv_reg_mr: ibv_reg_mr refused the CPU-inaccessible \
                 stand-in ({e}); a transfer into GPU memory needs a CUDA allocation and \
                 nvidia-peermem and is untested here"
            );
        }
    }
    // SAFETY: the mapping made above, unmapped once, no longer registered.
    unsafe { libc::munmap(addr, len) };
}
