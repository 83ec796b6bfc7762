//! The `auto` backend: one sending transport that writes into a kvx tcp target, a kvx mooncake
//! target and a real Mooncake TE target (`tests/py/mooncake_peer.py`) from the same process,
//! choosing per peer from what its port answers. Fails (never skips) when the Python
//! environment with the Mooncake TE wheel is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod py_support;

use std::time::Duration;

use kvx_core::TransferOp;
use kvx_rdma::{
    AutoTransport, MooncakeConfig, MooncakeTransport, PeerKind, TcpConfig, TcpTransport, Transport,
    TransportError,
};
use py_support::{Peer, crc32};
use serde_json::json;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

#[test]
fn auto_writes_to_kvx_tcp_kvx_mooncake_and_real_te_targets() {
    let rt = rt();
    let src = pattern(1 << 20, 0x5a);
    let mut tcp_mem = vec![0u8; 1 << 20];
    let mut mc_mem = vec![0u8; 1 << 20];

    let auto = AutoTransport::client(
        TcpConfig::default(),
        MooncakeConfig::default(),
        Duration::from_secs(5),
    );
    let tcp = rt
        .block_on(TcpTransport::bind("127.0.0.1:0", TcpConfig::default()))
        .unwrap();
    let mc = rt
        .block_on(MooncakeTransport::bind(
            "127.0.0.1",
            MooncakeConfig::default(),
        ))
        .unwrap();
    // SAFETY: the buffers outlive the transports (declared first, dropped last) and are read
    // only after the batches into them completed.
    unsafe {
        auto.register(src.as_ptr() as u64, src.len() as u64)
            .unwrap();
        tcp.register(tcp_mem.as_mut_ptr() as u64, tcp_mem.len() as u64)
            .unwrap();
        mc.register(mc_mem.as_mut_ptr() as u64, mc_mem.len() as u64)
            .unwrap();
    }
    let mut te = Peer::spawn("target", &["--buffers", &(1usize << 20).to_string()], &[]);
    let ready = te.expect("ready");
    let te_session = ready["session"].as_str().unwrap().to_owned();
    let te_addr = ready["buffers"][0]["addr"].as_u64().unwrap();

    let targets = [
        (tcp.endpoint(), tcp_mem.as_ptr() as u64, PeerKind::Tcp),
        (mc.endpoint(), mc_mem.as_ptr() as u64, PeerKind::Mooncake),
        (te_session.clone(), te_addr, PeerKind::Mooncake),
    ];
    for (i, (peer, dst, kind)) in targets.iter().enumerate() {
        let off = 4096 * (i as u64 + 1);
        let ops = vec![
            TransferOp::new(src.as_ptr() as u64, dst + off, 100_000),
            TransferOp::new(src.as_ptr() as u64 + 200_000, dst + 500_000, 300_000),
        ];
        let session = rt.block_on(auto.connect(peer)).unwrap();
        let report = rt.block_on(session.write_batch(ops)).unwrap();
        assert_eq!(report.bytes, 400_000);
        assert_eq!(rt.block_on(auto.peer_kind(peer)).unwrap(), *kind, "{peer}");
    }
    let expect = |mem_off: u64| {
        let mut e = vec![0u8; 1 << 20];
        e[mem_off as usize..][..100_000].copy_from_slice(&src[..100_000]);
        e[500_000..800_000].copy_from_slice(&src[200_000..500_000]);
        e
    };
    assert!(tcp_mem == expect(4096), "kvx tcp target bytes differ");
    assert!(mc_mem == expect(8192), "kvx mooncake target bytes differ");
    let crc = te.call(json!({"cmd": "crc", "ranges": [[te_addr, 1 << 20]]}), "crc");
    assert_eq!(
        crc["crcs"][0].as_u64().unwrap() as u32,
        crc32(&expect(12288)),
        "TE target bytes differ"
    );

    // A port nobody listens on: an error, and nothing remembered about it.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let err = rt.block_on(auto.connect(&dead)).err().unwrap();
    assert!(
        matches!(err, TransportError::PeerUnreachable { .. }),
        "{err}"
    );
    te.finish();
    drop((tcp, mc));
}
