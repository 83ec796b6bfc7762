//! Registers memory on both sides of the `tcp` backend, connects, writes one batch of scattered
//! writes with a shared secret on the hello, and shows that a write outside the peer's
//! registered memory is refused before any byte moves.
//!
//! Run with `cargo run -p kvx-rdma --example tcp_batch`.

use kvx_core::TransferOp;
use kvx_rdma::{SharedSecret, TcpConfig, TcpTransport, Transport, TransportError};

const PAGE: u64 = 4096;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = tokio::runtime::Runtime::new()?;
    // The decode's KV pool (written by the peer) and the prefill's pages (read by the sender).
    let mut pool = vec![0u8; 16 * PAGE as usize];
    let mut pages: Vec<u8> = (0..4 * PAGE).map(|i| (i / PAGE) as u8 + 1).collect();
    let secret = SharedSecret::new(b"same on both sides").ok_or("bad secret")?;
    let cfg = TcpConfig {
        secret: Some(secret),
        ..TcpConfig::default()
    };
    rt.block_on(async {
        let decode = TcpTransport::bind("127.0.0.1:0", cfg.clone()).await?;
        let prefill = TcpTransport::client(cfg);
        // SAFETY: both buffers outlive the transports (dropped, and so deregistered, at the end
        // of this block), and neither is touched by this thread until then.
        unsafe {
            decode.register(pool.as_mut_ptr() as u64, pool.len() as u64)?;
            prefill.register(pages.as_mut_ptr() as u64, pages.len() as u64)?;
        }
        let session = prefill.connect(&decode.endpoint()).await?;
        // Source page i goes to destination page 3 * i + 1: one batch, four writes.
        let (src, dst) = (pages.as_ptr() as u64, pool.as_ptr() as u64);
        let ops: Vec<TransferOp> = (0..4)
            .map(|i| TransferOp::new(src + i * PAGE, dst + (3 * i + 1) * PAGE, PAGE))
            .collect();
        let report = session.write_batch(ops).await?;
        println!("batch: {} writes, {} bytes", report.ops, report.bytes);

        // A destination past the end of the decode's pool: refused, nothing written.
        let bad = TransferOp::new(src, dst + 16 * PAGE - 100, PAGE);
        match session.write_batch(vec![bad]).await {
            Err(e @ TransportError::RemoteNotRegistered { .. }) => println!("refused: {e}"),
            other => return Err(format!("expected a refusal, got {other:?}").into()),
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    for i in 0..4u64 {
        let at = ((3 * i + 1) * PAGE) as usize;
        assert!(
            pool[at..at + PAGE as usize]
                .iter()
                .all(|&b| b == i as u8 + 1)
        );
    }
    assert!(pool[15 * PAGE as usize..].iter().all(|&b| b == 0));
    println!("verified: destination pages 1, 4, 7, 10 hold source pages 0-3");
    Ok(())
}
