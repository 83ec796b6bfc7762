//! Reliable-connected queue pairs: creation and the INIT → RTR → RTS transitions.
//!
//! An [`RcQueuePair`] is created with the extended verbs (`ibv_create_qp_ex`, RDMA WRITE as its
//! only send operation) on the engine's completion queue, moved to INIT at once, and connected
//! with the peer's [`QpInfo`] and port address from the handshake ([`RcQueuePair::connect`]).
//! The capabilities the device actually granted (send depth, SGEs, inline size) are read back
//! and become the planner's and the scheduler's limits.

use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::ExtendedCompletionQueue;
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, QueuePair, QueuePairAttribute, QueuePairAttributeMask, QueuePairState,
    QueuePairType, SendOperationFlags,
};

use super::device::VerbsDevice;
use super::error::VerbsError;
use super::handshake::QpInfo;

/// What to ask of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// Send-queue depth.
    pub depth: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Inline payload size (0: none).
    pub max_inline: u32,
    /// Local ACK timeout exponent: a work request is retransmitted after 4.096 µs × 2^timeout
    /// without acknowledgement (14 ≈ 67 ms).
    pub timeout: u8,
    /// Retransmissions before the work request fails with `IBV_WC_RETRY_EXC_ERR` (at most 7).
    /// With `timeout`, this bounds how long a dead peer goes unnoticed (14 and 7: about 0.5 s).
    pub retry_cnt: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            depth: 256,
            max_sge: 8,
            max_inline: 0,
            timeout: 14,
            retry_cnt: 7,
        }
    }
}

/// The capabilities a created queue pair actually has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth.
    pub depth: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Inline payload size.
    pub max_inline: u32,
}

/// The peer's port address, as announced in its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemotePort {
    /// LID (0 on RoCE).
    pub lid: u16,
    /// GID.
    pub gid: [u8; 16],
    /// Active MTU code.
    pub mtu: u8,
}

/// One RC queue pair to one peer.
pub struct RcQueuePair {
    pub(crate) qp: ExtendedQueuePair,
    psn: u32,
    caps: QpCaps,
    timeout: u8,
    retry_cnt: u8,
}

impl std::fmt::Debug for RcQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcQueuePair")
            .field("qpn", &self.qp.qp_number())
            .field("psn", &self.psn)
            .field("caps", &self.caps)
            .finish()
    }
}

/// A 24-bit initial packet sequence number that differs between queue pairs and runs.
fn initial_psn(qpn: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ qpn.wrapping_mul(2_654_435_761)) & 0xff_ffff
}

/// The MTU enum for a validated code (1..=5); anything else becomes 1024.
pub fn mtu_from_code(code: u8) -> Mtu {
    match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        4 => Mtu::Mtu2048,
        5 => Mtu::Mtu4096,
        _ => Mtu::Mtu1024,
    }
}

impl RcQueuePair {
    /// Creates a queue pair on `cq` and moves it to INIT.
    pub fn create(
        dev: &VerbsDevice,
        cq: &Arc<ExtendedCompletionQueue>,
        cfg: QpConfig,
    ) -> Result<Self, VerbsError> {
        let caps = dev.caps();
        let depth = cfg.depth.clamp(1, caps.max_qp_wr);
        let max_sge = cfg.max_sge.clamp(1, caps.max_sge);
        let mut builder = dev.pd().create_qp_builder();
        builder
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(depth)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(max_sge)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(cfg.max_inline)
            .setup_send_ops_flags(SendOperationFlags::Write)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone());
        let mut qp = builder
            .build_ex()
            .map_err(|e| VerbsError::verbs("ibv_create_qp_ex", e))?;
        let granted = qp
            .query(QueuePairAttributeMask::Capabilities)
            .map(|(_, init)| QpCaps {
                depth: init.max_send_wr().max(1),
                max_sge: init.max_send_sge().max(1),
                max_inline: init.max_inline_data(),
            })
            .unwrap_or(QpCaps {
                depth,
                max_sge,
                max_inline: cfg.max_inline,
            });
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.address().port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr)
            .map_err(|e| VerbsError::verbs("ibv_modify_qp(INIT)", e))?;
        let psn = initial_psn(qp.qp_number());
        Ok(RcQueuePair {
            qp,
            psn,
            caps: QpCaps {
                // never plan past what was asked either
                depth: granted.depth.min(depth),
                max_sge: granted.max_sge.min(max_sge),
                max_inline: granted.max_inline.min(cfg.max_inline),
            },
            timeout: cfg.timeout.min(31),
            retry_cnt: cfg.retry_cnt.min(7),
        })
    }

    /// What this queue pair announces in the handshake.
    pub fn info(&self) -> QpInfo {
        QpInfo {
            qpn: self.qp.qp_number(),
            psn: self.psn,
        }
    }

    /// The granted capabilities.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Connects to the peer's queue pair: INIT → RTR → RTS.
    pub fn connect(
        &mut self,
        dev: &VerbsDevice,
        remote_qp: QpInfo,
        remote: RemotePort,
    ) -> Result<(), VerbsError> {
        let local = dev.address();
        let mtu = mtu_from_code(local.mtu.min(remote.mtu));
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(remote.lid)
            .setup_port(local.port)
            .setup_service_level(0);
        if remote.gid != [0u8; 16] {
            av.setup_grh(&Gid { raw: remote.gid }, 0, local.gid_index, 64, 0);
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote_qp.qpn)
            .setup_rq_psn(remote_qp.psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&av);
        self.qp
            .modify(&rtr)
            .map_err(|e| VerbsError::verbs("ibv_modify_qp(RTR)", e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(self.timeout)
            .setup_retry_cnt(self.retry_cnt)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(1);
        self.qp
            .modify(&rts)
            .map_err(|e| VerbsError::verbs("ibv_modify_qp(RTS)", e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_is_24_bits_and_mtu_codes_map() {
        for q in [0, 1, 0xff_ffff] {
            assert!(initial_psn(q) <= 0xff_ffff);
        }
        assert_eq!(mtu_from_code(5), Mtu::Mtu4096);
        assert_eq!(mtu_from_code(1), Mtu::Mtu256);
        assert_eq!(mtu_from_code(0), Mtu::Mtu1024);
    }
}
