//! Completion polling driven by the completion channel's file descriptor in tokio.
//!
//! An [`EventCq`] is an extended completion queue bound to a non-blocking completion channel.
//! The channel's fd is registered with tokio ([`AsyncFd`]); [`EventCq::next_batch`] drains the
//! queue, re-arms the notification, drains again (closing the race between the last poll and
//! the re-arm) and only then sleeps on the fd. No thread spins.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_req_notify_cq};
use sideway::ibverbs::completion::{
    CompletionChannel, CompletionQueue, ExtendedCompletionQueue, PollCompletionQueueError,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::device::VerbsDevice;
use super::error::VerbsError;

/// One work completion, copied out of the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    /// The `wr_id` it was posted with.
    pub wr_id: u64,
    /// `ibv_wc_status`.
    pub status: u32,
    /// Vendor syndrome.
    pub vendor_err: u32,
}

struct ChannelFd(RawFd);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A completion queue whose events wake a tokio task.
pub struct EventCq {
    // drop order: deregister the fd from tokio, destroy the queue, then the channel
    fd: AsyncFd<ChannelFd>,
    cq: Arc<ExtendedCompletionQueue>,
    channel: Arc<CompletionChannel>,
}

impl std::fmt::Debug for EventCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventCq")
            .field("fd", &self.fd.get_ref().0)
            .finish()
    }
}

impl EventCq {
    /// Creates a completion queue of `cqe` entries with a completion channel (must be called
    /// inside a tokio runtime).
    pub fn new(dev: &VerbsDevice, cqe: u32) -> Result<Self, VerbsError> {
        let ctx = dev.context();
        let channel = ctx
            .create_comp_channel()
            .map_err(|e| VerbsError::verbs("ibv_create_comp_channel", e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| VerbsError::verbs("fcntl(O_NONBLOCK)", e))?;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(cqe.clamp(1, dev.caps().max_cqe))
            .setup_comp_channel(&channel, 0)
            .build_ex()
            .map_err(|e| VerbsError::verbs("ibv_create_cq_ex", e))?;
        // SAFETY: the fd belongs to `channel`, which this EventCq owns and destroys only after
        // the AsyncFd (field order), so it stays open and the same for the AsyncFd's lifetime.
        let fd = unsafe {
            AsyncFd::register_with_interest(ChannelFd(channel.as_raw_fd()), Interest::READABLE)
        }
        .map_err(|e| VerbsError::verbs("AsyncFd::register", e))?;
        let me = EventCq { fd, cq, channel };
        me.arm()?;
        Ok(me)
    }

    /// The queue, for creating queue pairs on it.
    pub fn queue(&self) -> &Arc<ExtendedCompletionQueue> {
        &self.cq
    }

    fn raw_cq(&self) -> *mut ibv_cq {
        // SAFETY: the pointer is only passed to verbs calls while `self.cq` keeps the queue alive.
        unsafe { self.cq.cq().as_ptr() }
    }

    fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the completion queue is alive (owned by self) and was created with a channel.
        let rc = unsafe { ibv_req_notify_cq(self.raw_cq(), 0) };
        if rc != 0 {
            return Err(VerbsError::verbs(
                "ibv_req_notify_cq",
                io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Appends every completion currently in the queue to `out`; returns how many.
    pub fn drain(&self, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        let before = out.len();
        match self.cq.start_poll() {
            Ok(poller) => {
                for wc in poller {
                    out.push(Wc {
                        wr_id: wc.wr_id(),
                        status: wc.status(),
                        vendor_err: wc.vendor_err(),
                    });
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
            Err(e) => return Err(VerbsError::verbs("ibv_start_poll", e)),
        }
        Ok(out.len() - before)
    }

    /// Consumes one pending channel event, if any; true when one was consumed.
    fn take_event(&self) -> Result<bool, VerbsError> {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive (owned by self) and non-blocking; the out-pointers are
        // valid locals.
        let rc =
            unsafe { ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(false);
            }
            return Err(VerbsError::verbs("ibv_get_cq_event", e));
        }
        // SAFETY: `cq` is the queue the event was for (ours, the only one on this channel);
        // acknowledging exactly the one event just taken.
        unsafe { ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }

    /// Waits until at least one completion is available and appends all available ones to
    /// `out`. Sleeps on the channel fd in between; never spins.
    pub async fn next_batch(&self, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        loop {
            if self.drain(out)? > 0 {
                return Ok(out.len());
            }
            self.arm()?;
            // a completion may have landed between the drain and the arm
            if self.drain(out)? > 0 {
                return Ok(out.len());
            }
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(|e| VerbsError::verbs("AsyncFd::readable", e))?;
            if !self.take_event()? {
                guard.clear_ready();
            }
        }
    }
}
