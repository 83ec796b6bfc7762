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
