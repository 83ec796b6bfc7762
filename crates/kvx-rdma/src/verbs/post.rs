//! Posting: a scheduler [`Post`] becomes a chain of RDMA WRITE work requests behind one doorbell.
//!
//! The extended verbs (`ibv_wr_start`, `ibv_wr_rdma_write`, `ibv_wr_set_sge_list` /
//! `ibv_wr_set_inline_data_list`, `ibv_wr_complete`) build every work request of the post in the
//! send queue and ring the doorbell once. Every address here comes from a [`WritePlan`], whose
//! ranges were resolved against the registered region tables before the plan existed.

use std::io::IoSlice;

use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};

use super::error::VerbsError;
use super::plan::WritePlan;
use super::qp::RcQueuePair;
use super::sched::Post;
use super::sendq::BatchId;

/// Bits of a posted `wr_id` that carry the queue pair's own sequence number; the bits above
/// carry the queue pair's slot in the engine, so one completion queue can serve many queue
/// pairs without reading the queue pair number from the completion.
pub const WR_SEQ_BITS: u32 = 40;

/// The `wr_id` posted for sequence number `seq` on engine queue-pair slot `slot`.
pub fn encode_wr_id(slot: u32, seq: u64) -> u64 {
    (u64::from(slot) << WR_SEQ_BITS) | (seq & ((1 << WR_SEQ_BITS) - 1))
}

/// Splits a completed `wr_id` into (engine queue-pair slot, sequence number).
pub fn decode_wr_id(wr_id: u64) -> (u32, u64) {
    (
        (wr_id >> WR_SEQ_BITS) as u32,
        wr_id & ((1 << WR_SEQ_BITS) - 1),
    )
}

/// Posts `post` on `qp` with one doorbell. `plan_of` returns the plan of a batch; `slot` is the
/// queue pair's engine slot (encoded into every `wr_id`).
pub fn post_chain<'p>(
    qp: &mut RcQueuePair,
    slot: u32,
    post: &Post,
    plan_of: impl Fn(BatchId) -> Option<&'p WritePlan>,
) -> Result<(), VerbsError> {
    let mut sges: Vec<ibv_sge> = Vec::new();
    let mut guard = qp.qp.start_post_send();
    for item in &post.items {
        // a missing plan aborts the whole chain (the guard's drop calls ibv_wr_abort)
        let plan = plan_of(item.batch).ok_or(VerbsError::Closed)?;
        let wr = plan.wrs.get(item.wr as usize).ok_or(VerbsError::Closed)?;
        let mut flags = WorkRequestFlags::none();
        if item.signaled {
            flags |= WorkRequestFlags::Signaled;
        }
        if wr.inline {
            flags |= WorkRequestFlags::Inline;
        }
        let handle = guard
            .construct_wr(encode_wr_id(slot, item.wr_id), flags)
            .setup_write(wr.rkey, wr.remote_addr);
        let list = plan.sges_of(wr);
        if wr.inline {
            let bufs: Vec<IoSlice<'_>> = list
                .iter()
                .map(|s| {
                    // SAFETY: every SGE range was resolved inside a registered local region
                    // (plan_writes checks each source against the lkey table); registration
                    // keeps it mapped, and the bytes are only copied into the work queue entry
                    // during this call. It is host memory: a work request reading from a
                    // device-memory registration is never inline (the session clears the flag
                    // with `WritePlan::no_inline_from` before posting), so this is the only CPU
                    // pointer the verbs backend forms into registered memory and it never
                    // points into device memory.
                    IoSlice::new(unsafe {
                        std::slice::from_raw_parts(s.addr as usize as *const u8, s.len as usize)
                    })
                })
                .collect();
            handle.setup_inline_data_list(&bufs);
        } else {
            sges.clear();
            sges.extend(list.iter().map(|s| ibv_sge {
                addr: s.addr,
                length: s.len,
                lkey: s.lkey,
            }));
            // SAFETY: the SGEs name ranges inside registered regions with their own lkeys (see
            // above); the registration contract keeps them mapped until the work request
            // completes. The list is copied into the work queue entry by this call.
            unsafe { handle.setup_sge_list(&sges) };
        }
    }
    guard
        .post()
        .map_err(|e| VerbsError::verbs("ibv_wr_complete", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn wr_id_round_trips(slot in 0u32..(1 << 24), seq in 0u64..(1 << WR_SEQ_BITS)) {
            prop_assert_eq!(decode_wr_id(encode_wr_id(slot, seq)), (slot, seq));
        }
    }
}
