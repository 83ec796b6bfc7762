//! Configuration, events, actions and errors of the prefill room manager.

use std::time::Duration;

use crate::layout::{AuxLayout, KvLayout, StateComponent};
use crate::peer::{DecodeRegistration, Endpoint, SessionId, TransferRequest};
use crate::planner::{BatchLimits, PlanError};
use crate::{Chunk, KVPoll, PageSlice, Room, TransferOp};

/// sglang's default bootstrap timeout (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`).
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(300);

/// Default of [`PrefillConfig::max_sessions`].
pub const DEFAULT_MAX_SESSIONS: usize = 4096;

/// Default of [`PrefillConfig::max_unopened_rooms`].
pub const DEFAULT_MAX_UNOPENED_ROOMS: usize = 65_536;

/// Default lifetime of a failed-session mark (sglang keeps them forever; kvx lets them expire).
pub const DEFAULT_FAILED_SESSION_TTL: Duration = Duration::from_secs(30);

/// Static configuration of one prefill rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillConfig {
    /// Attention-TP rank of this prefill rank.
    pub attn_tp_rank: u32,
    /// Attention-TP size.
    pub attn_tp_size: u32,
    /// Pipeline rank.
    pub pp_rank: u32,
    /// Pipeline size.
    pub pp_size: u32,
    /// Attention context-parallel rank.
    pub cp_rank: u32,
    /// Attention context-parallel size.
    pub cp_size: u32,
    /// Total KV heads of the model (head-slice path).
    pub total_kv_heads: u32,
    /// A room still Bootstrapping this long after its sender was created fails.
    pub bootstrap_timeout: Duration,
    /// How long a session stays marked failed after a write error (re-registration clears it).
    pub failed_session_ttl: Duration,
    /// Bounds for every posted batch.
    pub batch_limits: BatchLimits,
    /// Staging enabled on this prefill (used towards decodes that advertise a ring).
    pub staging: bool,
    /// Send aux rows as `AUX_DATA` messages instead of writes (`SGLANG_MOONCAKE_SEND_AUX_TCP`).
    pub aux_over_tcp: bool,
    /// Most decode sessions whose registration is held; a new one beyond it evicts the least
    /// recently used (network-fed state stays bounded).
    pub max_sessions: usize,
    /// Most rooms held whose metadata arrived but whose local sender does not exist yet;
    /// metadata for a new room beyond it is refused ([`PrefillError::TooManyRooms`]).
    pub max_unopened_rooms: usize,
    /// Metadata of a room whose local sender never appears is dropped after this.
    pub unopened_room_ttl: Duration,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            attn_tp_rank: 0,
            attn_tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            cp_rank: 0,
            cp_size: 1,
            total_kv_heads: 1,
            bootstrap_timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
            failed_session_ttl: DEFAULT_FAILED_SESSION_TTL,
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_unopened_rooms: DEFAULT_MAX_UNOPENED_ROOMS,
            unopened_room_ttl: DEFAULT_BOOTSTRAP_TIMEOUT,
            batch_limits: BatchLimits::default(),
            staging: false,
            aux_over_tcp: false,
        }
    }
}

impl PrefillConfig {
    /// sglang's `prefill_unique_rank`: `attn_tp_rank·pp·cp + pp_rank·cp + cp_rank` (status frame 2).
    pub fn prefill_unique_rank(&self) -> u32 {
        self.attn_tp_rank * self.pp_size * self.cp_size + self.pp_rank * self.cp_size + self.cp_rank
    }
}

/// This rank's registered memory as the planner sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalMemory {
    /// KV buffers.
    pub kv: KvLayout,
    /// Aux (metadata) buffers.
    pub aux: AuxLayout,
    /// State components (empty for plain models).
    pub state: Vec<StateComponent>,
}

/// Identifies one posted batch (or staging job) until its completion comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

/// How a room's KV reaches one decode session (chosen per chunk, reported on every batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferPath {
    /// Equal attention TP or MLA: merged page runs.
    EqualTp,
    /// Different attention TP, non-MLA: per-token head slices.
    HeadSlice,
    /// Different attention TP with a decode staging ring: handed to the staging engine.
    Staging,
    /// Only aux rows and state (empty chunk, or a decode without KV).
    NoKv,
}

/// Something that happened, fed into [`super::PrefillManager::handle`].
///
/// Deliberately not `#[non_exhaustive]`, like the actions: a new event changes what drivers must
/// feed, so adding one is a breaking change by design.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillEvent {
    /// A decode session registered (or re-registered) its memory.
    Register(DecodeRegistration),
    /// Per-room transfer metadata from one decode session.
    Metadata(TransferRequest),
    /// The local sender for a room was created (room enters Bootstrapping; timeout starts).
    SenderCreated {
        /// The room.
        room: Room,
    },
    /// The local sender was initialised with its page count and prefill aux row.
    SenderInit {
        /// The room.
        room: Room,
        /// Pages after the decode prefix.
        num_pages: usize,
        /// The prefill's own aux (metadata) row for the room.
        aux_row: u64,
    },
    /// The forward pass finished a chunk.
    Chunk {
        /// The room.
        room: Room,
        /// The chunk.
        chunk: Chunk,
    },
    /// A posted batch (or staging job) completed.
    BatchDone {
        /// Which batch.
        batch_id: BatchId,
        /// `Err(reason)` when any op of it failed.
        result: Result<(), String>,
    },
    /// A decode's `ABORT` for a room.
    Abort {
        /// The room.
        room: Room,
        /// Where the ABORT_ACK goes.
        endpoint: Endpoint,
        /// The 5th frame of sglang 0.5.23's `ABORT` (deferred KV release): echoed in the
        /// 4-frame `ABORT_ACK`. `None` for sglang main's 4-frame `ABORT`.
        generation: Option<u64>,
    },
    /// The local scheduler aborted the request (`AbortReq`).
    LocalAbort {
        /// The room.
        room: Room,
    },
    /// The sender failed the room for a reason of its own (a staging failure, a room larger
    /// than its pool, a write the decode rejected): every non-dummy decode of the room is told
    /// (status 0, `reason` as the 4th frame where the decode takes one) once nothing of the room
    /// is in flight.
    SenderFailed {
        /// The room.
        room: Room,
        /// Why (recorded as the room's failure reason).
        reason: String,
    },
    /// The driver found the decode behind `session` gone without a batch failing (its inbox no
    /// longer accepts connections while rooms wait on it, e.g. for staging ring space): the
    /// session is blacklisted like after a failed transfer, and every open room writing to it
    /// fails now.
    SessionLost {
        /// The decode session.
        session: SessionId,
    },
    /// Time passed (bootstrap timeouts, unopened-room TTLs, failed-session expiry); send it at
    /// [`super::PrefillManager::poll_timeout`] (earlier or later is harmless).
    Tick,
    /// The engine hit a fatal error (a worker died, the transport is poisoned): every open room
    /// fails with `reason` and every non-dummy decode is told once the room's writes drained.
    /// Outstanding batches stay outstanding: the driver still reports each one (`BatchDone`)
    /// once nothing of it can reach the decode, and only then are the rooms released.
    Fatal {
        /// The inner cause, as the supervisor reports it.
        reason: String,
    },
}

/// Something the driver must do, in order.
///
/// Deliberately not `#[non_exhaustive]`: a driver must perform every action, so its `match` has
/// no wildcard arm and a new variant is a breaking change by design (the compiler then points at
/// every driver that must learn it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillAction {
    /// Write the room id (u64 LE, see [`crate::fill_room_row`]) into the local `bootstrap_room`
    /// row at `addr` (`len` bytes) before posting the room's aux batch.
    FillRoomRow {
        /// The room.
        room: Room,
        /// Local address of the row.
        addr: u64,
        /// Row length.
        len: u64,
    },
    /// Post one bounded batch of writes to a decode session; report it with `BatchDone`.
    PostBatch {
        /// The room.
        room: Room,
        /// Destination session.
        session: SessionId,
        /// Completion key.
        batch_id: BatchId,
        /// Path that produced it.
        path: TransferPath,
        /// The writes.
        ops: Vec<TransferOp>,
    },
    /// Hand a chunk's KV to the staging engine; report it with `BatchDone`.
    Stage {
        /// The room.
        room: Room,
        /// Destination session.
        session: SessionId,
        /// Completion key.
        batch_id: BatchId,
        /// The chunk's suffix-relative page slice.
        slice: PageSlice,
        /// Source pages (truncated to the destination length).
        src_pages: Vec<i32>,
        /// Destination pages.
        dst_pages: Vec<i32>,
    },
    /// Send one `AUX_DATA` message: the `len` bytes of the local row at `src_addr` for aux buffer
    /// `index`, to be written at decode row `dst_row`. Emitted before the room's status, on the
    /// same socket as the status, so it arrives first.
    SendAuxData {
        /// The room.
        room: Room,
        /// The decode's inbox.
        endpoint: Endpoint,
        /// Aux buffer index.
        index: usize,
        /// Decode aux row.
        dst_row: u64,
        /// Local address of the row.
        src_addr: u64,
        /// Row length (frame 4).
        len: u64,
    },
    /// Send a status message (`[room, status, prefill_rank]`).
    SendStatus {
        /// The room.
        room: Room,
        /// The decode's inbox.
        endpoint: Endpoint,
        /// Success or Failed.
        status: KVPoll,
        /// `prefill_unique_rank`.
        prefill_rank: u32,
        /// The first failure reason (for logs, and the 4th frame when `with_reason`).
        reason: Option<String>,
        /// Send `reason` as a 4th frame: set only for a Failed status towards a decode known
        /// to accept one (sglang 0.5.23: its registration had frame 19, or it sent a 5-frame
        /// `ABORT`). Never set towards a sglang main ("K") decode, whose receive thread dies on
        /// anything but 3 frames.
        with_reason: bool,
    },
    /// Send `ABORT_ACK` (the room's in-flight writes have drained).
    AbortAck {
        /// The room.
        room: Room,
        /// The decode's inbox.
        endpoint: Endpoint,
        /// `prefill_unique_rank` (frame 2).
        prefill_rank: u32,
        /// The generation of the `ABORT` being acknowledged: `Some` ⇒ sglang 0.5.23's 4-frame
        /// `[ABORT_ACK, room, rank, generation]`, `None` ⇒ sglang main's 3-frame form.
        generation: Option<u64>,
    },
    /// The room reached a terminal state (its entries go once nothing is outstanding).
    Concluded {
        /// The room.
        room: Room,
        /// Success or Failed.
        status: KVPoll,
        /// Why it failed.
        reason: Option<RoomError>,
    },
}

/// Why a room failed. The `Display` text is the reason sent to decodes and recorded for the
/// scheduler.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RoomError {
    /// Planning failed (bad indices, layouts that do not fit).
    #[error("Failed to plan kv transfer of {room} to {session}: {source}")]
    Plan {
        /// The room.
        room: Room,
        /// The session.
        session: SessionId,
        /// The planner's error.
        source: PlanError,
    },
    /// Metadata came from a session that never registered.
    #[error("Metadata for {room} from unregistered decode session {session}")]
    UnregisteredSession {
        /// The room.
        room: Room,
        /// The session.
        session: SessionId,
    },
    /// Metadata was malformed (e.g. `required_dst_info_num` of 0, a negative aux row).
    #[error("Malformed metadata for {room} from {session}: {what}")]
    BadMetadata {
        /// The room.
        room: Room,
        /// The session.
        session: SessionId,
        /// What was wrong.
        what: &'static str,
    },
    /// The session is marked failed.
    #[error(
        "Decode instance could be dead, remote mooncake session {session} is not alive (room {room})"
    )]
    SessionDead {
        /// The room.
        room: Room,
        /// The session.
        session: SessionId,
    },
    /// A write batch failed.
    #[error("Failed to send kv chunk of {room} to {endpoint}: {cause}")]
    Transfer {
        /// The room.
        room: Room,
        /// The decode endpoint.
        endpoint: Endpoint,
        /// The transport's reason.
        cause: String,
    },
    /// Still Bootstrapping after the timeout.
    #[error("Request {room} timed out after {:.1}s in KVPoll.Bootstrapping", .elapsed.as_secs_f64())]
    BootstrapTimeout {
        /// The room.
        room: Room,
        /// Time since the sender was created.
        elapsed: Duration,
    },
    /// A chunk arrived before metadata from every required session, or before `SenderInit`.
    #[error("Chunk for {room} arrived before the room was ready ({what})")]
    NotReady {
        /// The room.
        room: Room,
        /// What was missing.
        what: &'static str,
    },
    /// The chunk's page slice does not fit the destination page list.
    #[error(
        "Chunk slice {start}..{end} of {room} exceeds the {have} destination pages of {session}"
    )]
    SliceOutOfRange {
        /// The room.
        room: Room,
        /// The session.
        session: SessionId,
        /// Slice start.
        start: usize,
        /// Slice end.
        end: usize,
        /// Destination pages available.
        have: usize,
    },
    /// The decode aborted the room.
    #[error("Aborted by decode {endpoint}")]
    AbortedByDecode {
        /// Who aborted.
        endpoint: Endpoint,
    },
    /// The local scheduler aborted the room.
    #[error("Aborted by AbortReq.")]
    AbortedLocally,
    /// The sender failed the room (its reason).
    #[error("{reason}")]
    FailedBySender {
        /// Why.
        reason: String,
    },
    /// A chunk reaches past the page count the sender was initialised with.
    #[error("Chunk slice {start}..{end} of {room} exceeds the sender's {num_pages} pages")]
    ChunkPastEnd {
        /// The room.
        room: Room,
        /// Slice start.
        start: usize,
        /// Slice end.
        end: usize,
        /// Pages the sender was initialised with.
        num_pages: usize,
    },
    /// The engine failed as a whole (see [`PrefillEvent::Fatal`]).
    #[error("{0}")]
    Fatal(String),
}

impl PrefillAction {
    /// The room the action is about.
    pub fn room(&self) -> Room {
        match self {
            PrefillAction::FillRoomRow { room, .. }
            | PrefillAction::PostBatch { room, .. }
            | PrefillAction::Stage { room, .. }
            | PrefillAction::SendAuxData { room, .. }
            | PrefillAction::SendStatus { room, .. }
            | PrefillAction::AbortAck { room, .. }
            | PrefillAction::Concluded { room, .. } => *room,
        }
    }
}

impl RoomError {
    /// The `Transfer` and `SessionDead` kinds blame a session (used to mark it failed).
    pub fn is_transfer(&self) -> bool {
        matches!(self, RoomError::Transfer { .. })
    }
}

/// An event that was dropped without changing any state (the driver logs and counts it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrefillError {
    /// The event names a room this rank does not know.
    #[error("unknown room {0}")]
    UnknownRoom(Room),
    /// Metadata for a room from a decode session that never registered: dropped, and nothing
    /// is sent to the endpoint it names (the prefill is no reflector).
    #[error("metadata for {room} from unregistered decode session {session} dropped")]
    UnregisteredSession {
        /// The room.
        room: Room,
        /// The session the metadata named.
        session: SessionId,
    },
    /// Metadata for a new room while [`PrefillConfig::max_unopened_rooms`] rooms wait for
    /// their sender.
    #[error("metadata for {0} refused: too many rooms wait for their sender")]
    TooManyRooms(Room),
    /// A completion for a batch that is not outstanding.
    #[error("unknown batch {0:?}")]
    UnknownBatch(BatchId),
    /// A second sender for the same room.
    #[error("room {0} already has a sender")]
    DuplicateSender(Room),
    /// A chunk after the room's last chunk.
    #[error("chunk for room {0} after its last chunk")]
    ChunkAfterLast(Room),
    /// A registration whose decode context parallelism cannot pair with this prefill (DCP
    /// size 1, rank 0): the same size with another rank (sglang 0.5.23 refuses it as
    /// "PD peers must connect matching DCP ranks"), or another size (kvx has no DCP relayout).
    #[error(
        "registration of {session} refused: decode DCP size {dcp_size} rank {dcp_rank} does not match the prefill's DCP size 1 rank 0"
    )]
    DcpMismatch {
        /// The registering session.
        session: SessionId,
        /// Its DCP size (frame 16).
        dcp_size: u32,
        /// Its DCP rank (frame 17).
        dcp_rank: u32,
    },
}

impl PrefillError {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PrefillError::UnknownRoom(_) => "unknown_room",
            PrefillError::UnregisteredSession { .. } => "unregistered_session",
            PrefillError::TooManyRooms(_) => "too_many_rooms",
            PrefillError::UnknownBatch(_) => "unknown_batch",
            PrefillError::DuplicateSender(_) => "duplicate_sender",
            PrefillError::ChunkAfterLast(_) => "chunk_after_last",
            PrefillError::DcpMismatch { dcp_size: 1, .. } => "dcp_rank_mismatch",
            PrefillError::DcpMismatch { .. } => "unsupported_dcp",
        }
    }
}

/// Counts of live entries: per room (all zero once every room concluded and drained) and per
/// decode session (bounded by [`PrefillConfig::max_sessions`], replaced on re-registration).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveEntries {
    /// Rooms held.
    pub rooms: usize,
    /// Per-room transfer infos (one per room and decode session).
    pub transfer_infos: usize,
    /// Outstanding batches.
    pub batches: usize,
    /// ABORT_ACKs waiting for a drain.
    pub pending_acks: usize,
    /// Rooms held whose local sender does not exist yet (a subset of `rooms`).
    pub unopened_rooms: usize,
    /// Pending room deadlines (bootstrap timeouts, unopened-room TTLs).
    pub deadlines: usize,
    /// Decode sessions registered (per peer, not per room).
    pub sessions: usize,
    /// Decode sessions marked failed (expire after the TTL).
    pub failed_sessions: usize,
    /// Concluded rooms remembered to answer late metadata (bounded by
    /// [`RECENT_ROOMS`](super::RECENT_ROOMS); not per-room state of a live room).
    pub recent_rooms: usize,
}

impl LiveEntries {
    /// True when nothing per-room is held (sessions are per-peer state and may remain).
    pub fn is_empty(&self) -> bool {
        LiveEntries {
            sessions: 0,
            failed_sessions: 0,
            recent_rooms: 0,
            ..*self
        } == LiveEntries::default()
    }
}
