//! Heterogeneous-TP rooms through staging with real transports: every gathered block travels as
//! one write through kvx-rdma's `tcp` backend (loopback sockets) or its `local` backend into the
//! decode's registered ring, and the decode's KV pages must equal kvx-core's per-token
//! head-slice plan byte for byte.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{Cluster, Link, Shape, run_staged_room};
use kvx_core::{Room, TransferOp};
use kvx_rdma::{LocalTransport, Session, TcpConfig, TcpTransport, Transport};
use kvx_staging::StagedLayout;
use tokio::runtime::Runtime;

/// Staging buffers and rings in registered heap memory; one write per block via a session.
struct TransportLink {
    // Field order is drop order: sessions and transports go before the runtime and the
    // registered buffers.
    sessions: Vec<Vec<Arc<dyn Session>>>,
    _transports: Vec<Arc<dyn Transport>>,
    rt: Runtime,
    staging: Vec<Vec<u8>>,
    rings: Vec<Vec<u8>>,
    ops: u64,
}

fn register(t: &dyn Transport, buf: &mut [u8]) {
    // SAFETY: the buffers live in `TransportLink` beside the transports, are never resized,
    // and outlive every batch: `write` blocks until its batch completed, and the transports
    // are dropped with the link.
    unsafe { t.register(buf.as_mut_ptr() as u64, buf.len() as u64) }.unwrap();
}

impl TransportLink {
    fn new(
        kind: &str,
        prefills: usize,
        staging_len: usize,
        decodes: usize,
        ring_len: usize,
    ) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut staging: Vec<Vec<u8>> = (0..prefills).map(|_| vec![0; staging_len]).collect();
        let mut rings: Vec<Vec<u8>> = (0..decodes).map(|_| vec![0; ring_len]).collect();
        let tag = format!("{kind}-{}-{prefills}-{decodes}", std::process::id());
        let mk_decode = |d: usize| -> Arc<dyn Transport> {
            match kind {
                "tcp" => rt
                    .block_on(TcpTransport::bind("127.0.0.1:0", TcpConfig::default()))
                    .unwrap(),
                _ => LocalTransport::new(&format!("{tag}-decode-{d}")).unwrap(),
            }
        };
        let mk_prefill = |p: usize| -> Arc<dyn Transport> {
            match kind {
                "tcp" => {
                    let _g = rt.enter();
                    TcpTransport::client(TcpConfig::default())
                }
                _ => LocalTransport::new(&format!("{tag}-prefill-{p}")).unwrap(),
            }
        };
        let decode_t: Vec<Arc<dyn Transport>> = (0..decodes).map(mk_decode).collect();
        let prefill_t: Vec<Arc<dyn Transport>> = (0..prefills).map(mk_prefill).collect();
        for (t, r) in decode_t.iter().zip(rings.iter_mut()) {
            register(&**t, r);
        }
        for (t, s) in prefill_t.iter().zip(staging.iter_mut()) {
            register(&**t, s);
        }
        let sessions = prefill_t
            .iter()
            .map(|pt| {
                decode_t
                    .iter()
                    .map(|dt| rt.block_on(pt.connect(&dt.endpoint())).unwrap())
                    .collect()
            })
            .collect();
        let mut transports = decode_t;
        transports.extend(prefill_t);
        TransportLink {
            sessions,
            _transports: transports,
            rt,
            staging,
            rings,
            ops: 0,
        }
    }
}

impl Link for TransportLink {
    fn staging(&mut self, p: usize) -> &mut [u8] {
        &mut self.staging[p]
    }

    fn write(&mut self, p: usize, d: usize, src_off: usize, len: usize, ring_off: u64) -> usize {
        let op = TransferOp::new(
            self.staging[p].as_ptr() as u64 + src_off as u64,
            self.rings[d].as_ptr() as u64 + ring_off,
            len as u64,
        );
        let report = self
            .rt
            .block_on(self.sessions[p][d].write_batch(vec![op]))
            .unwrap();
        assert_eq!(report.bytes, len as u64);
        self.ops += 1;
        1
    }

    fn ring(&self, d: usize) -> &[u8] {
        &self.rings[d]
    }
}

fn pages(n: usize, stride: i32, first: i32, total: u64) -> Vec<i32> {
    (0..n as i32)
        .map(|i| 1 + (first + i * stride).rem_euclid(total as i32 - 1))
        .collect()
}

fn run(kind: &str, pt: u32, dt: u32) {
    let shape = Shape {
        heads: 8,
        pt,
        dt,
        layers: 4,
        bph: 256, // 128 dims of bf16
        page_size: 4,
        pages: 96,
        pp: 1,
    };
    // Fragmented but distinct page lists (stride coprime with 95).
    let src = pages(80, 7, 3, shape.pages);
    let dst = pages(80, 11, 5, shape.pages);
    let full_chunk_pages = 16;
    let mut cluster = Cluster::new(shape, u64::from(pt * 10 + dt));
    let (expected, baseline_ops) = cluster.head_slice_baseline(&src, &dst);
    let chunk =
        StagedLayout::for_decode(&shape.geom(), 0, shape.layers, shape.bph, shape.page_size)
            .chunk_bytes(full_chunk_pages);
    // Two and a half chunks: the ring wraps and writers wait for watermarks.
    let ring_len = chunk * 5 / 2;
    let mut link = TransportLink::new(
        kind,
        pt as usize,
        chunk as usize,
        dt as usize,
        ring_len as usize,
    );
    let stats = run_staged_room(
        &mut cluster,
        &mut link,
        Room::new(99).unwrap(),
        &src,
        &dst,
        full_chunk_pages,
        ring_len,
    );
    cluster.assert_decode_equals(&expected, &format!("{kind} {pt}->{dt}"));
    // 5 chunks per (writer, decode) pair, one write each, all through the transport.
    let pairs = u64::from(pt.max(dt));
    assert_eq!(link.ops, 5 * pairs);
    assert_eq!(stats.write_ops, 5 * pairs);
    assert_eq!(baseline_ops, pairs * 2 * 4 * 80 * 4);
    assert!(stats.waits > 0);
}

#[test]
fn tcp_tp2_to_tp1() {
    run("tcp", 2, 1);
}

#[test]
fn tcp_tp1_to_tp2() {
    run("tcp", 1, 2);
}

#[test]
fn local_tp2_to_tp1_and_tp1_to_tp2() {
    run("local", 2, 1);
    run("local", 1, 2);
}
