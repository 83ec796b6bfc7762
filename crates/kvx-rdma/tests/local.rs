//! The local backend: bytes verified, the same bounds checks as tcp, peers that go away.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvx_core::TransferOp;
use kvx_rdma::{LocalTransport, Transport, TransportError};

fn register(t: &dyn Transport, buf: &mut [u8]) {
    // SAFETY: every buffer outlives the transports it is registered with in these tests.
    unsafe { t.register(buf.as_mut_ptr() as u64, buf.len() as u64) }.unwrap();
}

#[tokio::test]
async fn copies_exactly_and_checks_bounds() {
    let mut src: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 3 << 20];
    let a: Arc<dyn Transport> = LocalTransport::new("copies-a").unwrap();
    let b: Arc<dyn Transport> = LocalTransport::new("copies-b").unwrap();
    assert!(LocalTransport::new("copies-b").is_err());
    register(&*a, &mut src);
    register(&*b, &mut dst);
    let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    let session = a.connect(&b.endpoint()).await.unwrap();
    assert_eq!(session.remote().regions.len(), 1);

    // Out of bounds (dst end), unregistered src: the whole batch fails, nothing is written.
    let good = TransferOp::new(s + 10, d + 100, 50);
    let r = session
        .write_batch(vec![good, TransferOp::new(s, d + (3 << 20) - 1, 2)])
        .await;
    assert!(
        matches!(r, Err(TransportError::RemoteNotRegistered { .. })),
        "{r:?}"
    );
    let r = session
        .write_batch(vec![good, TransferOp::new(s - 1, d, 2)])
        .await;
    assert!(
        matches!(r, Err(TransportError::LocalNotRegistered { .. })),
        "{r:?}"
    );
    assert!(dst.iter().all(|&x| x == 0));

    // Small (inline) and large (blocking pool) batches.
    session.write_batch(vec![good]).await.unwrap();
    let big = vec![
        TransferOp::new(s + (1 << 20), d + (1 << 20), 2 << 20),
        TransferOp::new(s + 7, d + 4096, 999),
    ];
    assert_eq!(
        session.write_batch(big).await.unwrap().bytes,
        (2 << 20) + 999
    );
    assert_eq!(&dst[100..150], &src[10..60]);
    assert_eq!(&dst[4096..4096 + 999], &src[7..7 + 999]);
    assert_eq!(&dst[1 << 20..], &src[1 << 20..]);
    assert!(dst[150..4096].iter().all(|&x| x == 0));
}

#[tokio::test]
async fn unknown_and_vanished_peers() {
    let a = LocalTransport::new("vanish-a").unwrap();
    let mut src = vec![1u8; 64];
    register(&*a, &mut src);
    assert!(matches!(
        a.connect("local:nobody").await.map(|_| ()),
        Err(TransportError::PeerUnreachable { .. })
    ));
    assert!(a.connect("10.0.0.1:5").await.is_err());
    let b = LocalTransport::new("vanish-b").unwrap();
    let mut dst = vec![0u8; 64];
    register(&*b, &mut dst);
    let session = a.connect("local:vanish-b").await.unwrap();
    drop(b);
    assert!(!session.is_alive());
    let r = session
        .write_batch(vec![TransferOp::new(
            src.as_ptr() as u64,
            dst.as_ptr() as u64,
            8,
        )])
        .await;
    assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
    assert!(dst.iter().all(|&x| x == 0));
    // The name is free again.
    LocalTransport::new("vanish-b").unwrap();
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The receiving process of `same_host_peer_in_another_process` (run by that test).
#[test]
#[ignore = "child process of same_host_peer_in_another_process"]
fn host_peer_child() {
    use std::io::BufRead;
    let name = std::env::var("KVX_LOCAL_CHILD").unwrap();
    let t = LocalTransport::new(&name).unwrap();
    let shm = Arc::new(kvx_rdma::ShmRegion::create(&format!("{name}-mem"), 1 << 20).unwrap());
    t.register_shm(shm.clone()).unwrap();
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY {}", shm.addr()).unwrap();
        out.flush().unwrap();
    }
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    // SAFETY: the mapping is alive (held by `shm`) and the peer finished writing.
    let mem = unsafe { std::slice::from_raw_parts(shm.addr() as usize as *const u8, shm.len()) };
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "SUM {:x}", fnv(mem)).unwrap();
        out.flush().unwrap();
    }
}

#[tokio::test]
async fn same_host_peer_in_another_process() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    let name = format!("kvx-hosttest-{}", std::process::id());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "host_peer_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVX_LOCAL_CHILD", &name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut field = |prefix: &str| -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
            // The harness may print "test ... " on the same line first.
            if let Some((_, v)) = line.trim().split_once(prefix) {
                return v.to_owned();
            }
        }
    };
    let base: u64 = field("READY ").parse().unwrap();

    let me = LocalTransport::new(&format!("{name}-sender")).unwrap();
    let mut src: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 % 255) as u8).collect();
    register(&*me, &mut src);
    let s = src.as_ptr() as u64;
    let session = me.connect(&format!("local:{name}")).await.unwrap();
    assert_eq!(session.remote().regions.len(), 1);
    assert_eq!(session.remote().regions[0].base, base);
    let r = session
        .write_batch(vec![TransferOp::new(s, base + (1 << 20) - 10, 11)])
        .await;
    assert!(
        matches!(r, Err(TransportError::RemoteNotRegistered { .. })),
        "{r:?}"
    );
    let ops = vec![
        TransferOp::new(s, base + 4096, 4096),
        TransferOp::new(s + 10_000, base + 100_000, 900_000),
    ];
    session.write_batch(ops).await.unwrap();
    let mut expect = vec![0u8; 1 << 20];
    expect[4096..8192].copy_from_slice(&src[..4096]);
    expect[100_000..1_000_000].copy_from_slice(&src[10_000..910_000]);

    child.stdin.as_mut().unwrap().write_all(b"CHECK\n").unwrap();
    let sum = field("SUM ");
    assert_eq!(sum, format!("{:x}", fnv(&expect)));
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    // The peer process is gone: the session says so and refuses to write.
    assert!(!session.is_alive());
    let r = session.write_batch(vec![TransferOp::new(s, base, 1)]).await;
    assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
    assert!(me.connect(&format!("local:{name}")).await.is_err());
}
