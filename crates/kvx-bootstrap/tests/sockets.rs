//! The socket layer over real libzmq TCP sockets: inbox classification and survival of
//! malformed input, exact bytes through PUSH → PULL, IPv6, reconnection after a peer restart,
//! the LRU bound, send failures, and ordering through the async outbox.

#![allow(clippy::unwrap_used)]

use kvx_bootstrap::codec::{Abort, TransferStatus};
use kvx_bootstrap::sockets::{
    Inbox, InboxConfig, InboxKind, Outbox, PushCache, PushOptions, SocketError,
};
use kvx_core::{Endpoint, KVPoll, Room};
use std::time::Duration;

fn ctx() -> zmq::Context {
    zmq::Context::new()
}

fn room(n: u64) -> Room {
    Room::new(n).unwrap()
}

/// Receives with an upper bound so a broken build fails instead of hanging.
fn recv(inbox: &mut Inbox) -> Vec<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), inbox.recv())
            .await
            .expect("no message within 20 s")
            .expect("inbox closed")
            .to_vecs()
    })
}

#[test]
fn inbox_refuses_messages_over_its_size_bound() {
    let ctx = ctx();
    let cfg = InboxConfig {
        max_message_bytes: 64 << 10,
        ..InboxConfig::new("127.0.0.1", InboxKind::Raw)
    };
    let mut inbox = Inbox::bind(&ctx, cfg).unwrap();
    let ep = inbox.endpoint().clone();
    // A peer sending 1 MiB in one frame is cut off by libzmq before it is buffered.
    let big = ctx.socket(zmq::PUSH).unwrap();
    big.set_linger(1000).unwrap();
    big.connect(&ep.zmq_addr()).unwrap();
    big.send(vec![7u8; 1 << 20], 0).unwrap();
    // A well-behaved peer is served after it.
    let mut push = PushCache::new(&ctx, PushOptions::toward_prefill(), 8);
    std::thread::sleep(Duration::from_millis(200));
    push.send(&ep, &[b"small".to_vec()]).unwrap();
    assert_eq!(recv(&mut inbox), vec![b"small".to_vec()]);
    assert_eq!(inbox.stats().received(), 1);
}

#[test]
fn prefill_inbox_drops_malformed_and_lives_on() {
    let ctx = ctx();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Prefill)).unwrap();
    let ep = inbox.endpoint().clone();
    assert_eq!(ep.host, "127.0.0.1");
    assert_ne!(ep.port, 0);
    let mut push = PushCache::new(&ctx, PushOptions::toward_prefill(), 8);

    let garbage: Vec<Vec<Vec<u8>>> = vec![
        vec![b"garbage".to_vec()],
        vec![b"".to_vec()],
        vec![
            b"ABORT".to_vec(),
            b"0".to_vec(),
            b"h".to_vec(),
            b"1".to_vec(),
        ],
        vec![b"None".to_vec()],
        vec![b"12".to_vec(), b"10.0.0.2".to_vec()],
        vec![b"-5".to_vec(); 10],
        vec![vec![0xff; 3], vec![0; 100_000]],
        vec![b"x".to_vec(); 200],
    ];
    for g in &garbage {
        push.send(&ep, g).unwrap();
    }
    let abort = Abort {
        room: room(1234567890123456789),
        endpoint: Endpoint::new("10.0.0.2", 41235),
        generation: None,
    };
    push.send(&ep, &abort.encode()).unwrap();
    let got = recv(&mut inbox);
    assert_eq!(
        got,
        vec![
            b"ABORT".to_vec(),
            b"1234567890123456789".to_vec(),
            b"10.0.0.2".to_vec(),
            b"41235".to_vec()
        ]
    );
    assert_eq!(inbox.stats().dropped(), garbage.len() as u64);
    assert_eq!(inbox.stats().received(), 1);
}

#[test]
fn decode_inbox_over_ipv6() {
    let ctx = ctx();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("::1", InboxKind::Decode)).unwrap();
    let ep = inbox.endpoint().clone();
    assert!(ep.zmq_addr().starts_with("tcp://[::1]:"));
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 8);
    // A 4-frame status with a reason is accepted by the decode inbox; a 2-frame one is not.
    push.send(&ep, &[&b"77"[..], b"4"]).unwrap();
    let st = TransferStatus {
        room: room(77),
        status: KVPoll::Success,
        prefill_rank: 3,
        reason: None,
    };
    push.send(&ep, &st.encode()).unwrap();
    assert_eq!(
        recv(&mut inbox),
        vec![b"77".to_vec(), b"4".to_vec(), b"3".to_vec()]
    );
    assert_eq!(inbox.stats().dropped(), 1);
}

fn free_port() -> u16 {
    let c = ctx();
    let inbox = Inbox::bind(&c, InboxConfig::new("127.0.0.1", InboxKind::Raw)).unwrap();
    let p = inbox.endpoint().port;
    inbox.close();
    p
}

#[test]
fn push_socket_is_recreated_after_the_peer_restarts() {
    let ctx = ctx();
    let port = free_port();
    let cfg = InboxConfig {
        port: Some(port),
        ..InboxConfig::new("127.0.0.1", InboxKind::Raw)
    };
    let mut inbox = Inbox::bind(&ctx, cfg.clone()).unwrap();
    let ep = inbox.endpoint().clone();
    assert_eq!(ep.port, port);
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 8);
    push.send(&ep, &[b"first"]).unwrap();
    assert_eq!(recv(&mut inbox), vec![b"first".to_vec()]);

    inbox.close();
    // The monitor reports the disconnect; RECONNECT_IVL=-1 means the old socket would never
    // come back by itself.
    let mut reaped = 0;
    for _ in 0..2000 {
        reaped = push.reap_disconnected();
        if reaped > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(reaped, 1, "disconnect never reported");
    assert!(!push.contains(&ep));

    let mut inbox = Inbox::bind(&ctx, cfg).unwrap();
    push.send(&ep, &[b"second"]).unwrap();
    assert_eq!(recv(&mut inbox), vec![b"second".to_vec()]);
}

#[test]
fn cache_is_bounded_least_recently_used_first() {
    let ctx = ctx();
    let mut inboxes: Vec<Inbox> = (0..3)
        .map(|_| Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Raw)).unwrap())
        .collect();
    let eps: Vec<Endpoint> = inboxes.iter().map(|i| i.endpoint().clone()).collect();
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 2);
    push.send(&eps[0], &[b"a"]).unwrap();
    push.send(&eps[1], &[b"b"]).unwrap();
    push.send(&eps[0], &[b"a2"]).unwrap();
    push.send(&eps[2], &[b"c"]).unwrap();
    assert_eq!(push.len(), 2);
    assert!(push.contains(&eps[0]) && push.contains(&eps[2]));
    assert!(!push.contains(&eps[1]));
    assert_eq!(recv(&mut inboxes[0]), vec![b"a".to_vec()]);
    assert_eq!(recv(&mut inboxes[0]), vec![b"a2".to_vec()]);
    assert_eq!(recv(&mut inboxes[1]), vec![b"b".to_vec()]);
    assert_eq!(recv(&mut inboxes[2]), vec![b"c".to_vec()]);
}

#[test]
fn send_that_cannot_complete_times_out_and_drops_the_socket() {
    let ctx = ctx();
    let ep = Endpoint::new("127.0.0.1", free_port());
    let opts = PushOptions::toward_decode().with_send_timeout(Duration::from_millis(50));
    let mut push = PushCache::new(&ctx, opts, 4);
    // Like sglang's sockets (no ZMQ_IMMEDIATE), messages to an absent peer are queued until
    // the send high-water mark (1000) is reached; then the send times out.
    let mut sent = 0;
    let err = loop {
        match push.send(&ep, &[b"lost"]) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent <= 5000, "the queue never filled");
    };
    assert!(matches!(err, SocketError::SendTimeout { .. }), "{err}");
    assert!(sent >= 1, "the first send must be queued");
    assert!(push.is_empty(), "a failed socket must not stay cached");
}

#[tokio::test]
async fn outbox_keeps_order_per_endpoint() {
    let ctx = ctx();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Raw)).unwrap();
    let ep = inbox.endpoint().clone();
    let outbox = Outbox::new(&ctx, PushOptions::toward_prefill(), 4).unwrap();
    for i in 0..500u32 {
        outbox
            .send_detached(ep.clone(), vec![i.to_string().into_bytes()])
            .unwrap();
    }
    outbox
        .send(ep.clone(), vec![b"end".to_vec()])
        .await
        .unwrap();
    for i in 0..500u32 {
        let m = tokio::time::timeout(Duration::from_secs(20), inbox.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.to_vecs(), vec![i.to_string().into_bytes()]);
    }
    let m = inbox.recv().await.unwrap();
    assert_eq!(m.to_vecs(), vec![b"end".to_vec()]);
}

/// A monitored cache watching an endpoint it never sends to reports the drop of that
/// connection (the process behind it died), once, and nothing while the peer lives.
#[test]
fn a_watched_endpoint_reports_its_peer_going_away() {
    let ctx = ctx();
    let pull = ctx.socket(zmq::PULL).unwrap();
    pull.set_linger(0).unwrap();
    pull.bind("tcp://127.0.0.1:0").unwrap();
    let addr = pull.get_last_endpoint().unwrap().unwrap();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let ep = Endpoint::new("127.0.0.1", port);
    let mut canary = PushCache::new(&ctx, PushOptions::toward_prefill().monitored(), 8);
    canary.watch(&ep).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(canary.take_disconnected().is_empty(), "the peer is alive");
    drop(pull);
    let t0 = std::time::Instant::now();
    let gone = loop {
        let d = canary.take_disconnected();
        if !d.is_empty() || t0.elapsed() > Duration::from_secs(10) {
            break d;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(gone, vec![ep.clone()]);
    assert!(!canary.contains(&ep), "the dropped socket is forgotten");
    assert!(canary.take_disconnected().is_empty(), "reported once");
}

/// An inbox read in its consumer's task (`bind_async`, no socket thread): malformed messages
/// dropped and counted, the rest in order and byte-exact, nothing lost when a `recv` times out
/// and is dropped mid-wait, none while the reader is busy elsewhere; refused off a runtime.
#[test]
fn inbox_read_in_task_keeps_order_and_survives_cancelled_receives() {
    let ctx = ctx();
    let cfg = InboxConfig::new("127.0.0.1", InboxKind::Decode);
    assert!(matches!(
        Inbox::bind_async(&ctx, cfg.clone()),
        Err(SocketError::Reactor(_))
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut inbox = rt.block_on(async { Inbox::bind_async(&ctx, cfg).unwrap() });
    assert!(inbox.blocking_recv().is_none(), "no blocking reads on it");
    let ep = inbox.endpoint().clone();
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 8);
    let status = |n: u64| {
        TransferStatus {
            room: room(n),
            status: KVPoll::Success,
            prefill_rank: 0,
            reason: None,
        }
        .encode()
    };
    rt.block_on(async {
        // Nothing there yet: the receive times out and is dropped while waiting.
        let idle = tokio::time::timeout(Duration::from_millis(50), inbox.recv()).await;
        assert!(idle.is_err());
        push.send(&ep, &[b"garbage".to_vec()]).unwrap();
        for n in 1..=300 {
            push.send(&ep, &status(n)).unwrap();
            if n % 100 == 0 {
                // The reader is busy elsewhere; messages queue in libzmq meanwhile.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        for n in 1..=300 {
            let m = tokio::time::timeout(Duration::from_secs(20), inbox.recv())
                .await
                .expect("no message within 20 s")
                .expect("inbox closed");
            assert_eq!(m.to_vecs(), status(n), "message {n}");
        }
        // A wake-up with nothing behind it, then one more message.
        let idle = tokio::time::timeout(Duration::from_millis(50), inbox.recv()).await;
        assert!(idle.is_err());
        push.send(&ep, &status(301)).unwrap();
        let m = tokio::time::timeout(Duration::from_secs(20), inbox.recv()).await;
        assert_eq!(m.unwrap().unwrap().to_vecs(), status(301));
    });
    assert_eq!(inbox.stats().dropped(), 1);
    assert_eq!(inbox.stats().received(), 301);
    rt.block_on(async move { inbox.close() });
}
