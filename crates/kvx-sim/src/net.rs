//! The simulated control plane: ZMQ messages between prefill and decode ranks.
//!
//! One PUSH→PULL connection per (sender, receiver) pair, as kvx's and sglang's sockets are
//! used: messages on one link arrive in the order sent (FIFO per connection), links are
//! independent, so messages of different links overtake each other freely. A send may fail
//! (the message is dropped: the room it concerns is marked as excused from the "told by its
//! status" liveness rule), and idempotent messages (status, `ABORT`, `ABORT_ACK`) may be
//! delivered twice, as a retry after a reconnect can do. Registrations, metadata, `AUX_DATA` and
//! the staging messages are never dropped nor duplicated (the decode re-sends registrations and
//! metadata only on a restart). Messages to a rank that restarted in between are lost on
//! delivery (the world checks the receiver's incarnation).

use std::collections::BTreeMap;

use kvx_core::{DecodeRegistration, KVPoll, Room, TransferRequest};
use kvx_staging::{ChunkReady, StagingReq, StagingRsp, WatermarkMsg};

use crate::clock::{Nanos, US};
use crate::rng::Rng;

/// A simulated process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    /// Prefill rank (its attention-TP rank).
    Prefill(u32),
    /// Decode rank (its attention-TP rank).
    Decode(u32),
}

/// A control-plane message (the typed form of the ZMQ frames).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Decode → prefill registration.
    Register(Box<DecodeRegistration>),
    /// Decode → prefill per-room metadata.
    Metadata(Box<TransferRequest>),
    /// Decode → prefill `ABORT`.
    Abort {
        /// The room.
        room: Room,
        /// The aborting decode rank.
        from: u32,
        /// sglang 0.5.23's generation.
        generation: Option<u64>,
    },
    /// Prefill → decode status.
    Status {
        /// The room.
        room: Room,
        /// Success or Failed.
        status: KVPoll,
        /// `prefill_unique_rank`.
        rank: u32,
        /// The reason frame.
        reason: Option<String>,
    },
    /// Prefill → decode `ABORT_ACK`.
    AbortAck {
        /// The room.
        room: Room,
        /// `prefill_unique_rank`.
        rank: u32,
        /// The echoed generation.
        generation: Option<u64>,
    },
    /// Prefill → decode `AUX_DATA`: one aux row (`aux_over_tcp`), ahead of the room's status.
    AuxData {
        /// The room.
        room: Room,
        /// Aux buffer index.
        index: usize,
        /// Decode row.
        row: u64,
        /// The row's bytes.
        data: Vec<u8>,
    },
    /// Prefill → decode `STAGING_REQ`.
    StagingReq(StagingReq),
    /// Decode → prefill `STAGING_RSP`.
    StagingRsp(StagingRsp),
    /// Decode → prefill `WATERMARK`.
    Watermark(WatermarkMsg),
    /// Prefill → decode `CHUNK_READY` (after the chunk's write landed).
    ChunkReady(ChunkReady),
}

impl Msg {
    /// The room the message is about, if any.
    pub fn room(&self) -> Option<Room> {
        match self {
            Msg::Register(_) => None,
            Msg::Metadata(m) => Some(m.room),
            Msg::Abort { room, .. }
            | Msg::Status { room, .. }
            | Msg::AbortAck { room, .. }
            | Msg::AuxData { room, .. } => Some(*room),
            Msg::StagingReq(m) => Some(m.room),
            Msg::StagingRsp(m) => Some(m.room),
            Msg::ChunkReady(m) => Some(m.room),
            Msg::Watermark(_) => None,
        }
    }

    /// Messages whose send can fail, each on its own (a ZMQ send error drops one message; the
    /// next one to that inbox goes out on a fresh socket): status, `ABORT`, `ABORT_ACK` and the
    /// staging messages that name a room. A `WATERMARK` is superseded by the next one; `AUX_DATA`
    /// goes out right before its room's status on the same socket and is not dropped alone.
    fn lossy(&self) -> bool {
        matches!(
            self,
            Msg::Abort { .. }
                | Msg::Status { .. }
                | Msg::AbortAck { .. }
                | Msg::StagingReq(_)
                | Msg::StagingRsp(_)
                | Msg::ChunkReady(_)
        )
    }
}

/// Delays and faults of the control plane (per message, parts per million).
#[derive(Clone, Copy, Debug)]
pub struct NetConfig {
    /// Shortest one-way delay.
    pub min_delay: Nanos,
    /// Longest ordinary one-way delay.
    pub max_delay: Nanos,
    /// Chance of a slow message.
    pub slow_ppm: u32,
    /// Longest slow delay.
    pub slow_max: Nanos,
    /// Chance that a send fails (status, ABORT, ABORT_ACK, STAGING_REQ/RSP, CHUNK_READY).
    pub drop_ppm: u32,
    /// Chance of a duplicate (the same messages).
    pub dup_ppm: u32,
}

/// The links and their FIFO horizons.
#[derive(Clone, Debug)]
pub struct Net {
    cfg: NetConfig,
    last: BTreeMap<(Node, Node), Nanos>,
}

impl Net {
    /// A network with `cfg`.
    pub fn new(cfg: NetConfig) -> Self {
        Net {
            cfg,
            last: BTreeMap::new(),
        }
    }

    /// Sends `msg` from `from` to `to` at `now`: the delivery times (empty when the send
    /// failed, two for a duplicate), in order and never before an earlier message of the link.
    pub fn send(
        &mut self,
        rng: &mut Rng,
        now: Nanos,
        from: Node,
        to: Node,
        msg: &Msg,
    ) -> Vec<Nanos> {
        let c = self.cfg;
        if msg.lossy() && rng.chance(c.drop_ppm) {
            return Vec::new();
        }
        let delay = if rng.chance(c.slow_ppm) {
            rng.range(c.max_delay, c.slow_max)
        } else {
            rng.range(c.min_delay, c.max_delay)
        };
        let last = self.last.entry((from, to)).or_insert(0);
        let at = (now + delay).max(*last);
        *last = at;
        if msg.lossy() && rng.chance(c.dup_ppm) {
            let again = at + rng.range(0, 50 * US);
            *last = again;
            vec![at, again]
        } else {
            vec![at]
        }
    }
}
