//! The decode stager against a real tcp data plane: blocks received in place leave the pages
//! exactly as the scatter from the ring does, blocks written around the receiver (as RDMA or
//! shared memory would) are scattered from the ring, and a block that came half and half fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvx_core::TransferOp;
use kvx_rdma::{TcpConfig, TcpTransport};
use kvx_staging::StagingRsp;

use super::*;
use crate::model::ModelPreset;
use crate::wire::{PrefillInbound, parse_prefill_inbound};

/// Llama-3-8B at decode TP 1, page size 2, 16 pages; prefill TP 2 (two writers of 4 heads).
fn layout() -> KvLayout {
    ModelPreset::Llama3_8b.layout(1, 0, 2, 16)
}

const PAGES: [i32; 6] = [9, 3, 4, 5, 12, 0];
/// Chunks of 2 tokens' worth of pages: `chunked_prefill_size` 8 tokens = 4 pages.
const CHUNKED_PREFILL: i64 = 8;

fn room() -> Room {
    Room::new(41).unwrap()
}

fn writer_ep(w: u32) -> Endpoint {
    Endpoint::new("127.0.0.1", 7000 + w as u16)
}

/// How a writer's block reaches the ring.
#[derive(Clone, Copy, PartialEq)]
enum Via {
    /// A tcp write through the decode's data plane.
    Tcp,
    /// Straight into the ring memory (what an RDMA or shared-memory write does).
    Direct,
    /// The first half by tcp, the rest straight into the ring.
    Split,
}

/// Fields drop in order: the stager and both transports before the runtime and the memory.
struct Rig {
    stager: DecodeStager,
    sender: Arc<TcpTransport>,
    plane: Arc<TcpTransport>,
    rt: tokio::runtime::Runtime,
    kv: Arc<Region>,
    ring: Arc<Region>,
    src: Vec<u8>,
}

impl Rig {
    fn new(in_place: bool) -> Rig {
        Rig::with_ring(in_place, 8 << 20)
    }

    fn with_ring(in_place: bool, ring_bytes: usize) -> Rig {
        let l = layout();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let kv = Arc::new(Region::new(l.pool_bytes() as usize));
        let ring = Arc::new(Region::new(ring_bytes));
        let plane = rt
            .block_on(TcpTransport::bind("127.0.0.1:0", TcpConfig::default()))
            .unwrap();
        let sender = TcpTransport::client(TcpConfig::default());
        let src = vec![0u8; 4 << 20];
        // SAFETY: the rig holds the regions and `src` beside the transports, and its fields
        // drop the transports (and the stager, which holds the plane) first.
        unsafe {
            plane.register(kv.base(), kv.len()).unwrap();
            plane.register(ring.base(), ring.len()).unwrap();
            sender
                .register(src.as_ptr() as u64, src.len() as u64)
                .unwrap();
        }
        let session = SessionId::new(plane.endpoint());
        let placer: Arc<dyn Transport> = plane.clone();
        let stager = DecodeStager::new(session, ring.clone(), kv.clone(), l, CHUNKED_PREFILL)
            .unwrap()
            .with_placement(in_place.then_some(placer));
        let geom = TpGeometry::new(8, 2, 1).unwrap();
        stager
            .register_room(room(), vec![writer_ep(0), writer_ep(1)], &PAGES, &geom, 0)
            .unwrap();
        Rig {
            stager,
            sender,
            plane,
            rt,
            kv,
            ring,
            src,
        }
    }

    fn session(&self) -> SessionId {
        SessionId::new(self.plane.endpoint())
    }

    /// Requests chunk `c`'s region (both writers) and returns its ring offset.
    fn request(&self, c: u32, pages: u64) -> u64 {
        let mut offset = None;
        for _ in 0..2 {
            let req = StagingReq {
                room: room(),
                chunk_idx: c,
                chunk_pages: pages,
                session: self.session(),
                pp_rank: None,
            };
            for (_, frames) in self.stager.on_staging_req(&req).unwrap() {
                if let Ok(PrefillInbound::StagingRsp(StagingRsp {
                    placement: RspPlacement::At(p),
                    ..
                })) = parse_prefill_inbound(&frames)
                {
                    offset = Some(p.offset);
                }
            }
        }
        offset.expect("no placement")
    }

    /// Writes each writer's block of chunk `c` (pages `start..start + n` of the room), with
    /// byte `i` of writer `w`'s block = a pattern of (chunk, writer, i), then reports it ready.
    fn write_chunk(&mut self, c: u32, start: u64, n: u64, via: Via) -> Result<(), StagingError> {
        let off = self.request(c, n);
        let l = layout();
        let staged = StagedLayout::for_decode(
            &TpGeometry::new(8, 2, 1).unwrap(),
            0,
            (l.num_buffers / 2) as u32,
            l.head_bytes,
            l.page_size,
        );
        let mut out = Ok(Vec::new());
        for w in 0..2usize {
            let len = staged.writer_bytes(w, n) as usize;
            let at = self.ring.base() + off + staged.writer_offset(w, n);
            for (i, b) in self.src[..len].iter_mut().enumerate() {
                *b = (i as u64 * 31 + u64::from(c) * 7 + w as u64 * 101 + i as u64 / 4096) as u8;
            }
            let tcp_len = match via {
                Via::Tcp => len,
                Via::Direct => 0,
                Via::Split => len / 2,
            };
            if tcp_len > 0 {
                self.tcp_write(at, tcp_len);
            }
            if tcp_len < len {
                self.ring
                    .copy_in(at + tcp_len as u64, &self.src[tcp_len..len])
                    .unwrap();
            }
            let ready = ChunkReady {
                room: room(),
                chunk_idx: c,
                page_start: start,
                num_pages: n,
                session: self.session(),
                prefill_unique_rank: Some(w as u32),
            };
            out = self.stager.on_chunk_ready(&ready);
        }
        out.map(|_| ())
    }

    /// Writes `src[..len]` to `at` through the decode's data plane (a tcp batch of one op).
    fn tcp_write(&self, at: u64, len: usize) {
        let ep = self.plane.endpoint();
        let op = TransferOp::new(self.src.as_ptr() as u64, at, len as u64);
        self.rt
            .block_on(async {
                let s = self.sender.connect(&ep).await?;
                s.write_batch(vec![op]).await
            })
            .unwrap();
    }

    fn pages(&self) -> Vec<u8> {
        self.kv.to_vec(self.kv.base(), self.kv.len()).unwrap()
    }
}

#[test]
fn blocks_received_in_place_leave_the_pages_as_the_ring_scatter_does() {
    let mut placed = Rig::new(true);
    let mut ring = Rig::new(false);
    for rig in [&mut placed, &mut ring] {
        rig.write_chunk(0, 0, 4, Via::Tcp).unwrap();
        rig.write_chunk(1, 4, 2, Via::Tcp).unwrap();
        assert_eq!(rig.stager.scattered(), 2);
    }
    assert!(placed.pages().iter().any(|&b| b != 0));
    assert!(placed.pages() == ring.pages(), "pages differ");
    // Every byte of both chunks arrived in place; none through the ring.
    let per_page = layout().bytes_per_page();
    assert_eq!(placed.stager.placed_bytes(), 6 * per_page);
    assert_eq!(ring.stager.placed_bytes(), 0);
    let (rooms, live, _) = placed.stager.counts();
    assert_eq!((rooms, live), (1, 0));
    assert!(lock(&placed.stager.inner).placed.is_empty());
}

#[test]
fn blocks_written_around_the_receiver_are_scattered_and_half_and_half_fails() {
    let mut placed = Rig::new(true);
    let mut ring = Rig::new(false);
    for rig in [&mut placed, &mut ring] {
        rig.write_chunk(0, 0, 4, Via::Direct).unwrap();
    }
    assert_eq!(placed.stager.placed_bytes(), 0);
    assert!(placed.pages() == ring.pages(), "pages differ");
    // A block that came partly through the receiver and partly around it.
    let err = placed.write_chunk(1, 4, 2, Via::Split).unwrap_err();
    assert!(
        matches!(err, StagingError::PartlyPlaced { writer: 0, .. }),
        "{err}"
    );
    assert_eq!(err.kind(), "partly_placed");
    // The room ends: nothing stays placed.
    placed.stager.finish_room(room(), false);
    assert!(lock(&placed.stager.inner).placed.is_empty());
}

#[test]
fn a_failed_room_ends_its_placements_and_later_writes_land_in_the_ring() {
    let mut rig = Rig::new(true);
    let off = rig.request(0, 4);
    assert_eq!(lock(&rig.stager.inner).placed.len(), 1);
    rig.stager.finish_room(room(), false);
    assert!(lock(&rig.stager.inner).placed.is_empty());
    // A late write into the (fenced) region lands in the ring, not in the pages.
    rig.src[..4096].fill(0xab);
    let at = rig.ring.base() + off;
    rig.tcp_write(at, 4096);
    assert_eq!(rig.ring.to_vec(at, 4096).unwrap(), vec![0xab; 4096]);
    assert!(rig.pages().iter().all(|&b| b == 0));
}

#[test]
fn a_chunk_over_a_live_region_is_placed_only_once_that_region_is_freed() {
    // Chunk 0 (4 pages, 1 MiB) at [0, 1 MiB); chunk 1 (2 pages) does not fit before the end of
    // a 1.25 MiB ring and wraps onto chunk 0's bytes.
    let mut placed = Rig::with_ring(true, 5 << 18);
    let mut ring = Rig::with_ring(false, 5 << 18);
    for rig in [&mut placed, &mut ring] {
        assert_eq!(rig.request(0, 4), 0);
        assert_eq!(rig.request(1, 2), 0);
    }
    {
        let inner = lock(&placed.stager.inner);
        assert_eq!(inner.placed.len(), 1);
        assert!(
            inner.waiting.contains_key(&(room(), 1)),
            "placed over a live region"
        );
    }
    // Chunk 0's bytes (through the shared range) land in chunk 0's pages; freeing its region
    // places chunk 1, whose bytes then land in place too.
    for rig in [&mut placed, &mut ring] {
        rig.write_chunk(0, 0, 4, Via::Tcp).unwrap();
    }
    assert!(lock(&placed.stager.inner).placed.contains_key(&(room(), 1)));
    for rig in [&mut placed, &mut ring] {
        rig.write_chunk(1, 4, 2, Via::Tcp).unwrap();
    }
    assert!(placed.pages() == ring.pages(), "pages differ");
    assert_eq!(placed.stager.placed_bytes(), 6 * layout().bytes_per_page());
    let inner = lock(&placed.stager.inner);
    assert!(inner.placed.is_empty() && inner.waiting.is_empty());
}
