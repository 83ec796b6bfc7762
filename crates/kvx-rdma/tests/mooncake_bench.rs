//! Throughput of one 512 MiB write (128 entries of 4 MiB) over loopback, the mooncake backend
//! against the real Mooncake TE both ways, TE → TE as the reference, and kvx → kvx. A
//! measurement, not a check: opt in with
//! `cargo test --release -p kvx-rdma --test mooncake_bench -- --ignored --nocapture`
//! (it needs the same Python environment as `mooncake_te` and fails without it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod mc_fake;
mod py_support;

use std::time::{Duration, Instant};

use kvx_core::TransferOp;
use kvx_rdma::{MooncakeConfig, MooncakeTransport, Transport};
use mc_fake::Buf;
use py_support::Peer;
use serde_json::{Value, json};

const TOTAL: usize = 512 << 20;
const ENTRY: usize = 4 << 20;
const RUNS: usize = 3;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 * 8.0 / secs / 1e9
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `batch_transfer_sync_write` of the whole source to `base..` through the Python initiator;
/// the best time of [`RUNS`].
fn te_write(init: &mut Peer, session: &str, base: u64) -> f64 {
    let entries: Vec<Value> = (0..TOTAL / ENTRY)
        .map(|i| json!([i * ENTRY, base + (i * ENTRY) as u64, ENTRY]))
        .collect();
    // Warm-up: descriptor fetch and lanes.
    let warm = json!({"cmd": "write", "session": session, "entries": [[0, base, 4096]]});
    assert_eq!(init.call(warm, "written")["rc"], 0);
    (0..RUNS)
        .map(|_| {
            let cmd = json!({"cmd": "write", "session": session, "entries": entries});
            let ev = init.call(cmd, "written");
            assert_eq!(ev["rc"], 0, "{ev}");
            ev["secs"].as_f64().unwrap()
        })
        .fold(f64::INFINITY, f64::min)
}

/// One kvx batch of the whole source to `base..`; the best time of [`RUNS`].
fn kvx_write(
    rt: &tokio::runtime::Runtime,
    client: &MooncakeTransport,
    src: &Buf,
    peer: &str,
    base: u64,
) -> f64 {
    let session = rt.block_on(client.connect(peer)).unwrap();
    let ops: Vec<TransferOp> = (0..TOTAL / ENTRY)
        .map(|i| {
            TransferOp::new(
                src.addr() + (i * ENTRY) as u64,
                base + (i * ENTRY) as u64,
                ENTRY as u64,
            )
        })
        .collect();
    rt.block_on(session.write_batch(vec![TransferOp::new(src.addr(), base, 4096)]))
        .unwrap();
    (0..RUNS)
        .map(|_| {
            let t0 = Instant::now();
            rt.block_on(session.write_batch(ops.clone())).unwrap();
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
#[ignore = "measurement; run with --ignored --nocapture (release build)"]
fn write_512mib() {
    let rt = rt();
    let mut target = Peer::spawn("target", &["--buffers", &TOTAL.to_string()], &[]);
    let ev = target.expect("ready");
    let te_session = ev["session"].as_str().unwrap().to_owned();
    let te_base = ev["buffers"][0]["addr"].as_u64().unwrap();
    let mut init = Peer::spawn("initiator", &["--src-bytes", &TOTAL.to_string()], &[]);
    init.expect("ready");

    let te_te = te_write(&mut init, &te_session, te_base);
    println!(
        "TE   -> TE   : {:.3} s  {:.2} Gbit/s",
        te_te,
        gbps(TOTAL, te_te)
    );

    let mut src = Buf::pattern(TOTAL, 1);
    let client = MooncakeTransport::client(MooncakeConfig::default());
    src.register(&*client);
    let kvx_te = kvx_write(&rt, &client, &src, &te_session, te_base);
    println!(
        "kvx  -> TE   : {:.3} s  {:.2} Gbit/s",
        kvx_te,
        gbps(TOTAL, kvx_te)
    );

    let mut dst = Buf::zeroed(TOTAL);
    let kvx_target = rt
        .block_on(MooncakeTransport::bind(
            "127.0.0.1",
            MooncakeConfig::default(),
        ))
        .unwrap();
    dst.register(&*kvx_target);
    let te_kvx = te_write(&mut init, &kvx_target.endpoint(), dst.addr());
    println!(
        "TE   -> kvx  : {:.3} s  {:.2} Gbit/s",
        te_kvx,
        gbps(TOTAL, te_kvx)
    );
    let kvx_kvx = kvx_write(&rt, &client, &src, &kvx_target.endpoint(), dst.addr());
    println!(
        "kvx  -> kvx  : {:.3} s  {:.2} Gbit/s",
        kvx_kvx,
        gbps(TOTAL, kvx_kvx)
    );
    println!("kvx->TE / TE->TE: {:.2}", te_te / kvx_te);
    assert!(dst.0[..TOTAL] == src.0[..TOTAL]);
    drop(client);
    rt.block_on(kvx_target.shutdown());
    std::thread::sleep(Duration::from_millis(10));
    init.finish();
    target.finish();
}
