//! The seam between a session's driver and the device: [`SendPath`] and [`LocalKeys`].
//!
//! The session task (see `session`) needs exactly two things from the hardware: post a chain of
//! work requests on one queue pair, and wait for completions. [`DevicePath`] does both with real
//! queue pairs and an [`EventCq`]; the session's tests drive the same task through an
//! in-process simulation of a reliable-connected NIC, so the driver is exercised on hosts
//! without a device too. [`LocalKeys`] is where the session resolves source ranges (the
//! device's lkey table).

use std::future::Future;

use super::cq::{EventCq, Wc};
use super::device::VerbsDevice;
use super::error::VerbsError;
use super::plan::WritePlan;
use super::post::post_chain;
use super::qp::RcQueuePair;
use super::regions::RegionTable;
use super::sched::Post;
use super::sendq::BatchId;

/// Posting and completion delivery for one peer's queue pairs.
pub trait SendPath: Send + 'static {
    /// Queue pair numbers, in slot order (slot `i` is `Post::qp == i`).
    fn qpns(&self) -> Vec<u32>;

    /// Posts `post` on its queue pair with one doorbell; `plan_of` gives each batch's plan.
    /// The posted `wr_id`s must come back in [`Wc::wr_id`] as
    /// [`encode_wr_id`](super::post::encode_wr_id)`(post.qp, item.wr_id)`.
    fn post<'p>(
        &mut self,
        post: &Post,
        plan_of: &dyn Fn(BatchId) -> Option<&'p WritePlan>,
    ) -> Result<(), VerbsError>;

    /// Waits until at least one completion is available and appends all available ones.
    fn next_completions<'a>(
        &'a mut self,
        out: &'a mut Vec<Wc>,
    ) -> impl Future<Output = Result<usize, VerbsError>> + Send + 'a;
}

/// Where a session resolves its source ranges.
pub trait LocalKeys: Send + Sync + 'static {
    /// The locally registered regions with their lkeys.
    fn local_regions(&self) -> RegionTable;

    /// The lkeys of regions in device memory, whose bytes the CPU must never touch: a work
    /// request reading from them is never sent inline ([`WritePlan::no_inline_from`]). None by
    /// default.
    fn device_lkeys(&self) -> Vec<u32> {
        Vec::new()
    }
}

impl LocalKeys for VerbsDevice {
    fn local_regions(&self) -> RegionTable {
        VerbsDevice::local_regions(self)
    }

    fn device_lkeys(&self) -> Vec<u32> {
        VerbsDevice::device_lkeys(self)
    }
}

/// The real [`SendPath`]: RC queue pairs sharing one event-driven completion queue.
pub struct DevicePath {
    /// The queue pairs, by slot.
    pub qps: Vec<RcQueuePair>,
    /// Their completion queue.
    pub cq: EventCq,
}

impl SendPath for DevicePath {
    fn qpns(&self) -> Vec<u32> {
        self.qps.iter().map(|q| q.info().qpn).collect()
    }

    fn post<'p>(
        &mut self,
        post: &Post,
        plan_of: &dyn Fn(BatchId) -> Option<&'p WritePlan>,
    ) -> Result<(), VerbsError> {
        let qp = self.qps.get_mut(post.qp).ok_or(VerbsError::Closed)?;
        post_chain(qp, post.qp as u32, post, plan_of)
    }

    fn next_completions<'a>(
        &'a mut self,
        out: &'a mut Vec<Wc>,
    ) -> impl Future<Output = Result<usize, VerbsError>> + Send + 'a {
        self.cq.next_batch(out)
    }
}
