//! The receiving side of the verbs backend: the handshake listener and its peers' queue pairs.
//!
//! For every connecting sender (at most [`VerbsConfig::max_peers`] at once; more are refused and
//! counted), the accept loop spawns a task that reads its handshake, creates and connects as
//! many RC queue pairs as it announced (at most [`VerbsConfig::max_inbound_qps`], never more than
//! [`MAX_INBOUND_QPS`]), answers
//! with this side's handshake (its regions and rkeys), and then holds the queue pairs until the
//! connection closes or the transport shuts down. Incoming RDMA WRITEs need no software on this
//! side: the NIC checks each rkey and range against the registrations.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::device::VerbsDevice;
use super::engine::VerbsConfig;
use super::error::VerbsError;
use super::handshake::VerbsHandshake;
use super::hello::{recv_handshake, send_handshake};
use super::qp::{RcQueuePair, RemotePort};

/// Hard ceiling on the queue pairs a receiver creates for one peer, whatever the configuration.
pub const MAX_INBOUND_QPS: usize = 64;

/// This side's handshake: port address, `qps`, and the regions peers may write.
pub(crate) fn handshake_for(dev: &VerbsDevice, qps: &[RcQueuePair]) -> VerbsHandshake {
    let addr = dev.address();
    VerbsHandshake {
        lid: addr.lid,
        gid: addr.gid,
        mtu: addr.mtu,
        qps: qps.iter().map(|q| q.info()).collect(),
        regions: dev.remote_keys(),
    }
}

/// Accepts handshake connections until `stop` changes.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    dev: Arc<VerbsDevice>,
    cfg: VerbsConfig,
    mut stop: watch::Receiver<bool>,
) {
    let peers = Arc::new(tokio::sync::Semaphore::new(cfg.max_peers.max(1)));
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            r = listener.accept() => match r {
                Ok((stream, from)) => {
                    let Ok(permit) = peers.clone().try_acquire_owned() else {
                        metrics::counter!("kvx_verbs_peers_refused_total").increment(1);
                        tracing::warn!(peer = %from, max = cfg.max_peers, "verbs peer refused: too many peers");
                        drop(stream);
                        continue;
                    };
                    let (dev, cfg, stop) = (dev.clone(), cfg.clone(), stop.clone());
                    tokio::spawn(async move {
                        serve_peer(stream, from.to_string(), dev, cfg, stop).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "verbs handshake accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// The receiving side of one peer: answer its handshake with as many connected queue pairs,
/// then keep them until the control connection closes or the transport shuts down.
async fn serve_peer(
    mut stream: TcpStream,
    from: String,
    dev: Arc<VerbsDevice>,
    cfg: VerbsConfig,
    mut stop: watch::Receiver<bool>,
) {
    let setup = async {
        let theirs =
            tokio::time::timeout(cfg.handshake_timeout, recv_handshake(&mut stream, false))
                .await
                .map_err(|_| VerbsError::Handshake("timed out".into()))??;
        // responder queue pairs see no completions for incoming RDMA WRITEs; the queue only
        // exists because a queue pair needs one
        let cq = dev
            .context()
            .create_cq_builder()
            .setup_cqe(1)
            .build_ex()
            .map_err(|e| VerbsError::verbs("ibv_create_cq_ex", e))?;
        let port = RemotePort {
            lid: theirs.lid,
            gid: theirs.gid,
            mtu: theirs.mtu,
        };
        let max_qps = cfg.max_inbound_qps.clamp(1, MAX_INBOUND_QPS);
        if theirs.qps.len() > max_qps {
            return Err(VerbsError::Handshake(format!(
                "{} queue pairs asked, at most {max_qps} served",
                theirs.qps.len()
            )));
        }
        let mut qps = Vec::with_capacity(theirs.qps.len());
        for info in &theirs.qps {
            let mut qp = RcQueuePair::create(&dev, &cq, cfg.qp)?;
            qp.connect(&dev, *info, port)?;
            qps.push(qp);
        }
        send_handshake(&mut stream, &handshake_for(&dev, &qps), true).await?;
        Ok::<_, VerbsError>((qps, cq))
    };
    let held = match setup.await {
        Ok(held) => held,
        Err(e) => {
            metrics::counter!("kvx_verbs_handshake_errors_total", "kind" => e.label()).increment(1);
            tracing::warn!(peer = %from, error = %e, "verbs handshake refused");
            return;
        }
    };
    tracing::info!(peer = %from, qps = held.0.len(), "verbs peer connected");
    let mut buf = [0u8; 64];
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            n = stream.read(&mut buf) => if matches!(n, Ok(0) | Err(_)) { break },
        }
    }
    tracing::info!(peer = %from, "verbs peer disconnected");
    drop(held);
}
