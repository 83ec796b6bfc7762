//! The mooncake backend against itself and against scripted peers (in process, loopback):
//! kvx ↔ kvx over v2 and v1, the batch-completion contract (a failed batch sends nothing after
//! it returns), silent and dying targets, and the server side under malformed input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod mc_fake;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::mooncake::fetch_descriptor;
use kvx_rdma::{
    MooncakeConfig, MooncakeTransport, RejectReason, Session, TcpConfig, TcpTransport, Transport,
    TransportError,
};
use mc_fake::{Buf, FAKE_BASE, Fake, FakeMode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvx_to_kvx_v2_and_v1() {
    let mut dst = Buf::zeroed(8 << 20);
    let mut src = Buf::pattern(8 << 20, 3);
    let target = MooncakeTransport::bind("127.0.0.1", MooncakeConfig::default())
        .await
        .unwrap();
    assert_eq!(target.kind(), "mooncake");
    dst.register(&*target);
    let ep = target.endpoint();
    assert!(ep.starts_with("127.0.0.1:"), "{ep}");
    let d = target.mooncake_descriptor().unwrap();
    assert_eq!(d.name, ep);
    assert_eq!(d.tcp_data_port, target.data_port());
    assert_eq!(d.buffers.len(), 1);

    for force_v1 in [false, true] {
        dst.0.fill(0);
        let client = MooncakeTransport::client(MooncakeConfig {
            force_v1,
            slice_bytes: 100_000,
            group_bytes: 300_000,
            group_requests: 64,
            max_inflight_bytes: 1 << 20,
            ..MooncakeConfig::default()
        });
        src.register(&*client);
        let session = client.connect(&ep).await.unwrap();
        let again = client.connect(&ep).await.unwrap();
        assert!(Arc::ptr_eq(&session, &again));
        // Mixed sizes, sliced ops, gaps, and 20 000 tiny ops in one batch.
        let mut ops = Vec::new();
        let mut expect = vec![0u8; dst.0.len()];
        let (mut s, mut at) = (0u64, 0u64);
        for i in 0..20_000u64 {
            // Big (sliced) ops among the first 60, tiny ones after.
            let len = if i < 60 {
                [1u64, 7, 100, 4096, 333, 250_001][(i % 6) as usize]
            } else {
                [1u64, 7, 100, 200, 333, 17][(i % 6) as usize]
            };
            if at + len + 3 > dst.0.len() as u64 {
                break;
            }
            if s + len > src.0.len() as u64 {
                s = 0;
            }
            ops.push(TransferOp::new(src.addr() + s, dst.addr() + at, len));
            expect[at as usize..(at + len) as usize]
                .copy_from_slice(&src.0[s as usize..(s + len) as usize]);
            s += len + i % 5;
            at += len + 1 + i % 3;
        }
        assert!(ops.len() > 10_000);
        let bytes = TransferOp::total_bytes(&ops);
        let report = session.write_batch(ops).await.unwrap();
        assert_eq!(report.bytes, bytes);
        assert!(dst.0 == expect, "v1={force_v1}: destination differs");
        // Concurrent batches complete independently.
        let mut futs = Vec::new();
        for k in 0..16u64 {
            let op = TransferOp::new(
                src.addr() + k * 999,
                dst.addr() + (7 << 20) + k * 8192,
                5000,
            );
            futs.push(tokio::spawn(session.write_batch(vec![op])));
        }
        for f in futs {
            assert_eq!(f.await.unwrap().unwrap().bytes, 5000);
        }
        for k in 0..16usize {
            let at = (7 << 20) + k * 8192;
            assert_eq!(&dst.0[at..at + 5000], &src.0[k * 999..k * 999 + 5000]);
        }
        assert_eq!(session.write_batch(Vec::new()).await.unwrap().ops, 0);
        // Sender-side checks: nothing leaves kvx.
        let outside = TransferOp::new(src.addr(), dst.addr() + dst.0.len() as u64 - 1, 2);
        assert!(matches!(
            session.write_batch(vec![outside]).await,
            Err(TransportError::RemoteNotRegistered { .. })
        ));
        let unregistered_src = TransferOp::new(dst.addr(), dst.addr(), 2);
        assert!(matches!(
            session.write_batch(vec![unregistered_src]).await,
            Err(TransportError::LocalNotRegistered { .. })
        ));
        assert!(session.is_alive());
        let one = client.open_session(&ep).await.unwrap();
        assert_eq!(one.is_v2(), !force_v1);
        assert_eq!(one.connections(), 4);
    }
    target.shutdown().await;
}

/// The integrity contract: a target rejects one write of a big multi-connection batch; once
/// `write_batch` has returned the error, no further byte of the batch reaches the target, and
/// the batch's unsent groups were cancelled (not sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_batch_sends_nothing_after_it_returns() {
    const OP: u64 = 32 << 10;
    const N: u64 = 1024;
    let reject_at = FAKE_BASE + 40 * OP;
    let fake = Fake::start(FakeMode::RejectOnce {
        addr: reject_at,
        delay: Duration::from_millis(2),
    });
    let mut src = Buf::pattern(1 << 20, 9);
    let client = MooncakeTransport::client(MooncakeConfig {
        connections: 4,
        slice_bytes: 64 << 10,
        group_bytes: 64 << 10,
        group_requests: 16,
        max_inflight_bytes: 256 << 10,
        // Deep enough that half the batch is queued when the rejection comes.
        queue_depth: 64,
        ..MooncakeConfig::default()
    });
    src.register(&*client);
    let session = client.connect(&fake.session).await.unwrap();
    let ops: Vec<TransferOp> = (0..N)
        .map(|i| TransferOp::new(src.addr() + (i % 16) * OP, FAKE_BASE + i * OP, OP))
        .collect();
    let err = session.write_batch(ops).await.unwrap_err();
    match err {
        TransportError::RemoteRejected {
            reason: RejectReason::OutOfBounds,
            addr,
            len,
        } => {
            assert_eq!(addr, reject_at);
            assert_eq!(len, OP);
        }
        // The target closes without draining right after its reject frame (as Mooncake does):
        // a writer still sending on that connection may see the reset before the reader has
        // read the frame, and the kernel then discards the frame. Either way the batch failed.
        TransportError::PeerLost { ref detail, .. }
            if detail.contains("reset") || detail.contains("pipe") => {}
        e => panic!("unexpected {e}"),
    }
    let at_return = fake.received.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let later = fake.received.load(Ordering::SeqCst);
    assert_eq!(
        at_return, later,
        "bytes of the failed batch arrived after it returned"
    );
    assert!(
        later < N * OP / 4,
        "{later} bytes arrived: the failed batch's queued groups were not cancelled"
    );
    assert!(!session.is_alive());
    // A fresh session (the cached one is dead) writes normally.
    let s2 = client.connect(&fake.session).await.unwrap();
    assert!(!Arc::ptr_eq(&session, &s2));
    let before = fake.received.load(Ordering::SeqCst);
    let op = TransferOp::new(src.addr(), reject_at, OP);
    s2.write_batch(vec![op]).await.unwrap();
    assert_eq!(fake.received.load(Ordering::SeqCst), before + OP);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_target_times_out() {
    let fake = Fake::start(FakeMode::Silent);
    let mut src = Buf::pattern(1 << 20, 1);
    let client = MooncakeTransport::client(MooncakeConfig {
        status_timeout: Duration::from_millis(400),
        ..MooncakeConfig::default()
    });
    src.register(&*client);
    let session = client.connect(&fake.session).await.unwrap();
    let t0 = Instant::now();
    let op = TransferOp::new(src.addr(), FAKE_BASE, 4096);
    let err = session.write_batch(vec![op]).await.unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(!session.is_alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_closing_mid_batch_fails_it() {
    let fake = Fake::start(FakeMode::CloseAfterHeader);
    let mut src = Buf::pattern(1 << 20, 1);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    let session = client.connect(&fake.session).await.unwrap();
    let ops = (0..64)
        .map(|i| TransferOp::new(src.addr(), FAKE_BASE + i * 65536, 65536))
        .collect();
    let err = session.write_batch(ops).await.unwrap_err();
    assert!(matches!(err, TransportError::PeerLost { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_target_gets_fence_reads() {
    let fake = Fake::start(FakeMode::V1);
    let mut src = Buf::pattern(1 << 20, 1);
    let client = MooncakeTransport::client(MooncakeConfig {
        group_bytes: 128 << 10,
        ..MooncakeConfig::default()
    });
    src.register(&*client);
    let session = client.open_session(&fake.session).await.unwrap();
    assert!(!session.is_v2());
    let ops = (0..64)
        .map(|i| TransferOp::new(src.addr(), FAKE_BASE + i * 65536, 65536))
        .collect();
    session.write_batch(ops).await.unwrap();
    assert_eq!(fake.received.load(Ordering::SeqCst), 64 * 65536);
    assert!(fake.fences.load(Ordering::SeqCst) >= 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_descriptor_tells_other_protocols_apart_quickly() {
    // kvx's own tcp server reads a 16-byte hello, sees the wrong magic, closes.
    let tcp = TcpTransport::bind("127.0.0.1:0", TcpConfig::default())
        .await
        .unwrap();
    let t0 = Instant::now();
    let err = fetch_descriptor(
        kvx_rdma::instance::address(&tcp.endpoint()),
        Duration::from_secs(10),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, TransportError::WrongProtocol { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());

    // Something that answers with its own bytes (an HTTP server, a kvx hello).
    for reply in [
        &b"HTTP/1.1 400 Bad Request\r\n\r\n"[..],
        b"KVXT\x01\x00\x00\x00\0\0\0\0\0\0\0\0",
    ] {
        let port = mc_fake::reply_server(reply.to_vec(), false);
        let err = fetch_descriptor(&format!("127.0.0.1:{port}"), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::WrongProtocol { .. }), "{err}");
    }
    // A Mooncake frame of the wrong type; a Mooncake reply with an RDMA descriptor.
    let frame = kvx_rdma::mooncake::handshake::encode_frame(
        Some(kvx_rdma::mooncake::handshake::RequestType::Probe),
        b"{\"status\":\"success\"}",
    );
    let port = mc_fake::reply_server(frame, false);
    let err = fetch_descriptor(&format!("127.0.0.1:{port}"), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::WrongProtocol { .. }), "{err}");
    let rdma = br#"{"name":"x:1","protocol":"rdma","tcp_data_port":5,"buffers":[]}"#;
    let frame = kvx_rdma::mooncake::handshake::encode_frame(
        Some(kvx_rdma::mooncake::handshake::RequestType::Metadata),
        rdma,
    );
    let port = mc_fake::reply_server(frame, false);
    let err = fetch_descriptor(&format!("127.0.0.1:{port}"), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Handshake { .. }), "{err}");

    // Silence is bounded by the timeout.
    let port = mc_fake::reply_server(Vec::new(), true);
    let t0 = Instant::now();
    let err = fetch_descriptor(&format!("127.0.0.1:{port}"), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2));

    // Nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = fetch_descriptor(&format!("127.0.0.1:{port}"), Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::PeerUnreachable { .. }),
        "{err}"
    );
    let err = fetch_descriptor("no-port-here:", Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::PeerUnreachable { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistered_region_is_refused_by_the_target() {
    let mut a = Buf::zeroed(1 << 20);
    let mut b = Buf::zeroed(1 << 20);
    let mut src = Buf::pattern(1 << 20, 5);
    let target = MooncakeTransport::bind("127.0.0.1", MooncakeConfig::default())
        .await
        .unwrap();
    a.register(&*target);
    let kb = b.register(&*target);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    let session = client.connect(&target.endpoint()).await.unwrap();
    target.deregister(kb).unwrap();
    assert_eq!(target.mooncake_descriptor().unwrap().buffers.len(), 1);
    // The session's descriptor still lists b: the write leaves kvx and the target refuses it.
    let op = TransferOp::new(src.addr(), b.addr() + 64, 4096);
    let err = session.write_batch(vec![op]).await.unwrap_err();
    assert!(
        matches!(err, TransportError::RemoteRejected { addr, .. } if addr == b.addr() + 64),
        "{err}"
    );
    assert!(b.0.iter().all(|&x| x == 0));
    // A new session learns the new descriptor and still writes into a.
    let s2 = client.connect(&target.endpoint()).await.unwrap();
    assert!(matches!(
        s2.write_batch(vec![op]).await,
        Err(TransportError::RemoteNotRegistered { .. })
    ));
    let ok = TransferOp::new(src.addr(), a.addr() + 64, 4096);
    s2.write_batch(vec![ok]).await.unwrap();
    assert_eq!(&a.0[64..64 + 4096], &src.0[..4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_and_advertised_names() {
    let mut dst = Buf::zeroed(1 << 16);
    let mut src = Buf::pattern(1 << 16, 8);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    for (host, advertise, expect) in [
        ("::1", None, "[::1]:"),
        ("[::1]", None, "[::1]:"),
        ("127.0.0.1", Some("localhost"), "localhost:"),
    ] {
        dst.0.fill(0);
        let cfg = MooncakeConfig {
            advertise_host: advertise.map(str::to_owned),
            ..MooncakeConfig::default()
        };
        let target = MooncakeTransport::bind(host, cfg).await.unwrap();
        let key = dst.register(&*target);
        let ep = target.endpoint();
        assert!(ep.starts_with(expect), "{ep}");
        let d = fetch_descriptor(&ep, Duration::from_secs(2)).await.unwrap();
        assert_eq!(d.name, ep);
        assert_eq!(d.tcp_data_host.as_deref(), Some(advertise.unwrap_or("::1")));
        let session = client.connect(&ep).await.unwrap();
        let op = TransferOp::new(src.addr() + 1, dst.addr() + 2, 60_000);
        session.write_batch(vec![op]).await.unwrap();
        assert_eq!(&dst.0[2..60_002], &src.0[1..60_001]);
        target.deregister(key).unwrap();
    }
}
