//! The prefill rank's room table: a deterministic state machine (events and `now` in, actions
//! out) that the engine's threads drive under one lock.
//!
//! It keeps what sglang's `MooncakeKVManager` keeps per room and per session — transfer infos per
//! decode session, the status (`KVPoll`), outstanding chunks, the decode registrations and the
//! failed-session blacklist — and decides every status message: Success to every non-dummy
//! endpoint once the last chunk landed, Failed (status 0) to every non-dummy endpoint on the
//! first error. Per-room entries leave the table once a room is terminal, released and has
//! nothing outstanding.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use kvx_core::{Chunk, DecodeRegistration, Endpoint, KVPoll, Room, SessionId, TransferRequest};

/// What the drivers must do after an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send a status message for `room` to `endpoint`.
    Status {
        /// Decode inbox.
        endpoint: Endpoint,
        /// The room.
        room: Room,
        /// Success or Failed.
        status: KVPoll,
    },
    /// Send `ABORT_ACK` for `room` to `endpoint`.
    AbortAck {
        /// Decode inbox.
        endpoint: Endpoint,
        /// The room.
        room: Room,
    },
    /// Every decode session of `room` sent metadata; the forward pass may produce `pages` pages.
    Ready {
        /// The room.
        room: Room,
        /// Destination pages (the room's page count in suffix space).
        pages: usize,
    },
    /// `room` is terminal with nothing outstanding: its source pages may be reused.
    Released {
        /// The room.
        room: Room,
        /// Its final status.
        status: KVPoll,
    },
}

/// Why a chunk was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The room is not open.
    #[error("room {0} is not open")]
    UnknownRoom(Room),
    /// The room already failed or succeeded.
    #[error("room {0} is already {1}")]
    Terminal(Room, KVPoll),
    /// A chunk after the last one.
    #[error("room {0} already got its last chunk")]
    AfterLast(Room),
}

/// One room on a prefill rank.
#[derive(Debug)]
struct RoomState {
    status: KVPoll,
    opened_at: Instant,
    infos: BTreeMap<SessionId, TransferRequest>,
    src_aux_index: Option<i64>,
    shard: Option<usize>,
    outstanding: usize,
    last_queued: bool,
    ready_sent: bool,
    failure: Option<String>,
    pending_acks: Vec<Endpoint>,
}

/// Everything a worker needs to move one chunk to one decode session.
#[derive(Clone, Debug)]
pub struct Target {
    /// The decode session.
    pub session: SessionId,
    /// Its registration, `None` when it never registered.
    pub registration: Option<DecodeRegistration>,
    /// The room's transfer info for this session.
    pub request: TransferRequest,
    /// True when the session is blacklisted after a failure.
    pub blacklisted: bool,
}

/// A chunk as a worker sees it when it starts on it.
#[derive(Clone, Debug)]
pub struct ChunkWork {
    /// Every decode session of the room.
    pub targets: Vec<Target>,
    /// The prefill's aux row for the room.
    pub src_aux_index: Option<i64>,
}

/// The room table of one prefill rank.
#[derive(Debug)]
pub struct RoomTable {
    rooms: HashMap<Room, RoomState>,
    sessions: HashMap<SessionId, DecodeRegistration>,
    failed_sessions: HashSet<SessionId>,
    bootstrap_timeout: Duration,
    queues: usize,
    /// Drop entries on release (the synthetic forward pass) instead of waiting for `clear`.
    auto_clear: bool,
}

impl RoomTable {
    /// An empty table.
    pub fn new(bootstrap_timeout: Duration, queues: usize, auto_clear: bool) -> Self {
        RoomTable {
            rooms: HashMap::new(),
            sessions: HashMap::new(),
            failed_sessions: HashSet::new(),
            bootstrap_timeout,
            queues: queues.max(1),
            auto_clear,
        }
    }

    fn entry(&mut self, room: Room, now: Instant) -> &mut RoomState {
        self.rooms.entry(room).or_insert_with(|| RoomState {
            status: KVPoll::Bootstrapping,
            opened_at: now,
            infos: BTreeMap::new(),
            src_aux_index: None,
            shard: None,
            outstanding: 0,
            last_queued: false,
            ready_sent: false,
            failure: None,
            pending_acks: Vec::new(),
        })
    }

    /// A decode registered (or re-registered) its session: store it, lift its blacklist.
    pub fn register(&mut self, reg: DecodeRegistration) {
        self.failed_sessions.remove(&reg.session);
        self.sessions.insert(reg.session.clone(), reg);
    }

    /// True when the session registered.
    pub fn is_registered(&self, s: &SessionId) -> bool {
        self.sessions.contains_key(s)
    }

    /// The sender side opened a room with its own aux row.
    pub fn open(&mut self, room: Room, src_aux_index: i64, now: Instant) {
        let e = self.entry(room, now);
        e.src_aux_index = Some(src_aux_index);
    }

    /// Sets the aux row of a room that exists and is still open; false otherwise.
    pub fn attach(&mut self, room: Room, src_aux_index: i64) -> bool {
        match self.rooms.get_mut(&room) {
            Some(e) if !e.status.is_terminal() => {
                e.src_aux_index = Some(src_aux_index);
                true
            }
            _ => false,
        }
    }

    /// Per-request metadata from one decode session.
    pub fn metadata(&mut self, req: TransferRequest, now: Instant) -> Vec<Action> {
        let room = req.room;
        let registered = self.sessions.contains_key(&req.session);
        let e = self.entry(room, now);
        if e.status.is_terminal() {
            return Vec::new();
        }
        let session = req.session.clone();
        let required = req.required_dst_info_num.max(1) as usize;
        e.infos.insert(session.clone(), req);
        if !registered {
            return self.fail(
                room,
                format!("metadata for room {room} from unregistered session {session}"),
            );
        }
        let mut out = Vec::new();
        if e.infos.len() >= required && !e.ready_sent {
            e.status = e.status.update(KVPoll::WaitingForInput);
            e.ready_sent = true;
            let pages = e
                .infos
                .values()
                .filter_map(|r| r.dst.as_ref())
                .map(|d| d.kv_pages.len())
                .max()
                .unwrap_or(0);
            out.push(Action::Ready { room, pages });
        }
        out
    }

    /// Queues a chunk: returns the shard it must go to.
    pub fn enqueue(&mut self, room: Room, chunk: &Chunk) -> Result<usize, SendError> {
        let queues = self.queues;
        let e = self
            .rooms
            .get_mut(&room)
            .ok_or(SendError::UnknownRoom(room))?;
        if e.status.is_terminal() {
            return Err(SendError::Terminal(room, e.status));
        }
        if e.last_queued {
            return Err(SendError::AfterLast(room));
        }
        let shard = *e.shard.get_or_insert_with(|| {
            // sglang's rule: sum of the decode sessions' ports, modulo the queue count.
            let sum: u64 = e.infos.keys().filter_map(SessionId::port).sum();
            let key = if e.infos.is_empty() { room.get() } else { sum };
            (key % queues as u64) as usize
        });
        e.outstanding += 1;
        e.last_queued |= chunk.is_last;
        Ok(shard)
    }

    /// A worker starts on a chunk of `room`: `None` means skip it (room gone or failed).
    pub fn begin(&self, room: Room) -> Option<ChunkWork> {
        let e = self.rooms.get(&room)?;
        if e.status == KVPoll::Failed {
            return None;
        }
        Some(ChunkWork {
            targets: e
                .infos
                .iter()
                .map(|(s, r)| Target {
                    session: s.clone(),
                    registration: self.sessions.get(s).cloned(),
                    request: r.clone(),
                    blacklisted: self.failed_sessions.contains(s),
                })
                .collect(),
            src_aux_index: e.src_aux_index,
        })
    }

    /// A worker finished a chunk (or skipped it): `Err(reason)` fails the room.
    pub fn done(&mut self, room: Room, is_last: bool, result: Result<(), String>) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(e) = self.rooms.get_mut(&room) else {
            return out;
        };
        e.outstanding = e.outstanding.saturating_sub(1);
        match result {
            Err(reason) => out.extend(self.fail(room, reason)),
            Ok(()) if is_last && !e.status.is_terminal() => {
                e.status = e.status.update(KVPoll::Success);
                for ep in endpoints(e) {
                    out.push(Action::Status {
                        endpoint: ep,
                        room,
                        status: KVPoll::Success,
                    });
                }
            }
            Ok(()) => {}
        }
        out.extend(self.maybe_release(room));
        out
    }

    /// Fails `room` (first reason kept) and tells every non-dummy endpoint.
    pub fn fail(&mut self, room: Room, reason: String) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(e) = self.rooms.get_mut(&room) else {
            return out;
        };
        if e.status.is_terminal() {
            return out;
        }
        tracing::warn!(%room, %reason, "room failed");
        metrics::counter!("kvx_room_failures_total").increment(1);
        e.status = KVPoll::Failed;
        e.failure.get_or_insert(reason);
        for ep in endpoints(e) {
            out.push(Action::Status {
                endpoint: ep,
                room,
                status: KVPoll::Failed,
            });
        }
        out.extend(self.maybe_release(room));
        out
    }

    /// A transfer to `session` failed: blacklist it and fail every open room that uses it.
    pub fn fail_session(&mut self, session: &SessionId, reason: &str) -> Vec<Action> {
        self.failed_sessions.insert(session.clone());
        let rooms: Vec<Room> = self
            .rooms
            .iter()
            .filter(|(_, e)| !e.status.is_terminal() && e.infos.contains_key(session))
            .map(|(r, _)| *r)
            .collect();
        rooms
            .into_iter()
            .flat_map(|r| {
                self.fail(
                    r,
                    format!(
                        "Decode instance could be dead, session {session} is not alive: {reason}"
                    ),
                )
            })
            .collect()
    }

    /// Fails every open room (of one shard, or all when `shard` is `None`).
    pub fn fail_all(&mut self, shard: Option<usize>, reason: &str) -> Vec<Action> {
        let rooms: Vec<Room> = self
            .rooms
            .iter()
            .filter(|(_, e)| !e.status.is_terminal())
            .filter(|(_, e)| shard.is_none() || e.shard == shard)
            .map(|(r, _)| *r)
            .collect();
        rooms
            .into_iter()
            .flat_map(|r| self.fail(r, reason.to_owned()))
            .collect()
    }

    /// `ABORT` from a decode: fail the room unless it succeeded, ack once nothing is in flight.
    pub fn abort(&mut self, room: Room, endpoint: Endpoint) -> Vec<Action> {
        let mut out = Vec::new();
        let outstanding = match self.rooms.get(&room) {
            Some(e) => e.outstanding,
            None => 0,
        };
        if self.rooms.contains_key(&room) {
            out.extend(self.fail(room, format!("Aborted by the decode {endpoint}")));
        }
        match self.rooms.get_mut(&room) {
            Some(e) if outstanding > 0 => e.pending_acks.push(endpoint),
            _ => out.push(Action::AbortAck { endpoint, room }),
        }
        out
    }

    /// Time passes: fail rooms stuck in Bootstrapping past the bootstrap timeout.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let timeout = self.bootstrap_timeout;
        let late: Vec<(Room, Duration)> = self
            .rooms
            .iter()
            .filter(|(_, e)| e.status == KVPoll::Bootstrapping)
            .map(|(r, e)| (*r, now.saturating_duration_since(e.opened_at)))
            .filter(|(_, d)| *d >= timeout)
            .collect();
        late.into_iter()
            .flat_map(|(r, d)| {
                self.fail(
                    r,
                    format!(
                        "Request {r} timed out after {:.1}s in KVPoll.Bootstrapping",
                        d.as_secs_f64()
                    ),
                )
            })
            .collect()
    }

    fn maybe_release(&mut self, room: Room) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(e) = self.rooms.get_mut(&room) else {
            return out;
        };
        if !e.status.is_terminal() || e.outstanding > 0 {
            return out;
        }
        for endpoint in e.pending_acks.drain(..) {
            out.push(Action::AbortAck { endpoint, room });
        }
        out.push(Action::Released {
            room,
            status: e.status,
        });
        if self.auto_clear {
            self.rooms.remove(&room);
        }
        out
    }

    /// The sender is done with `room`: drop its entry (now, or once nothing is outstanding).
    pub fn clear(&mut self, room: Room) {
        if self.rooms.get(&room).is_some_and(|e| e.outstanding == 0) {
            self.rooms.remove(&room);
        }
    }

    /// The status of a room.
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        self.rooms.get(&room).map(|e| e.status)
    }

    /// The recorded failure reason of a room.
    pub fn failure(&self, room: Room) -> Option<&str> {
        self.rooms.get(&room).and_then(|e| e.failure.as_deref())
    }

    /// Live per-room entries.
    pub fn len(&self) -> usize {
        self.rooms.len()
    }

    /// True when no room is tracked.
    pub fn is_empty(&self) -> bool {
        self.rooms.is_empty()
    }

    /// Rooms per state, indexed by the `KVPoll` value.
    pub fn counts(&self) -> [usize; 5] {
        let mut c = [0; 5];
        for e in self.rooms.values() {
            c[e.status.as_u8() as usize] += 1;
        }
        c
    }
}

fn endpoints(e: &RoomState) -> Vec<Endpoint> {
    let mut eps: Vec<Endpoint> = e
        .infos
        .values()
        .filter(|r| !r.is_dummy())
        .map(|r| r.endpoint.clone())
        .collect();
    eps.sort();
    eps.dedup();
    eps
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::{Destination, PageSlice};

    fn reg(s: &str) -> DecodeRegistration {
        DecodeRegistration {
            endpoint: Endpoint::new("127.0.0.1", 7000),
            session: SessionId::new(s),
            kv_ptrs: vec![],
            aux_ptrs: vec![],
            state_ptrs: vec![],
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            dst_kv_item_len: 0,
            state_item_lens: vec![],
            state_dim_per_tensor: vec![],
            kv_layer_ids: vec![],
            state_layer_ids: vec![],
            staging: Default::default(),
            dcp_size: 1,
            dcp_rank: 0,
            staging_slot_layer_ids: None,
        }
    }

    fn meta(room: u64, s: &str) -> TransferRequest {
        TransferRequest {
            room: Room::new(room).unwrap(),
            endpoint: Endpoint::new("127.0.0.1", 7000),
            session: SessionId::new(s),
            dst: Some(Destination {
                kv_pages: vec![1, 2, 3],
                aux_index: 0,
                state_indices: vec![],
            }),
            required_dst_info_num: 1,
            decode_prefix_len: Some(0),
            device_kv_pages: vec![],
        }
    }

    #[test]
    fn success_path_reports_and_releases() {
        let now = Instant::now();
        let mut t = RoomTable::new(Duration::from_secs(300), 4, true);
        t.register(reg("127.0.0.1:1"));
        let room = Room::new(5).unwrap();
        let a = t.metadata(meta(5, "127.0.0.1:1"), now);
        assert_eq!(a, vec![Action::Ready { room, pages: 3 }]);
        assert_eq!(t.poll(room), Some(KVPoll::WaitingForInput));
        let chunk = Chunk::new(PageSlice::new(0, 3).unwrap(), vec![4, 5, 6]).last();
        assert_eq!(t.enqueue(room, &chunk), Ok(1));
        assert_eq!(t.enqueue(room, &chunk), Err(SendError::AfterLast(room)));
        let a = t.done(room, true, Ok(()));
        assert!(matches!(
            a[0],
            Action::Status {
                status: KVPoll::Success,
                ..
            }
        ));
        assert!(matches!(
            a[1],
            Action::Released {
                status: KVPoll::Success,
                ..
            }
        ));
        assert!(t.is_empty());
    }

    #[test]
    fn unknown_session_fails_the_room_only() {
        let now = Instant::now();
        let mut t = RoomTable::new(Duration::from_secs(300), 4, false);
        let a = t.metadata(meta(9, "127.0.0.1:2"), now);
        assert!(matches!(
            a[0],
            Action::Status {
                status: KVPoll::Failed,
                ..
            }
        ));
        assert_eq!(t.poll(Room::new(9).unwrap()), Some(KVPoll::Failed));
        assert!(
            t.failure(Room::new(9).unwrap())
                .unwrap()
                .contains("unregistered session")
        );
    }

    #[test]
    fn bootstrap_timeout_and_abort_ack_after_drain() {
        let now = Instant::now();
        let mut t = RoomTable::new(Duration::from_secs(1), 4, false);
        let room = Room::new(3).unwrap();
        t.open(room, 0, now);
        assert!(t.tick(now).is_empty());
        t.tick(now + Duration::from_secs(2));
        assert_eq!(t.poll(room), Some(KVPoll::Failed));

        t.register(reg("127.0.0.1:1"));
        let r2 = Room::new(4).unwrap();
        t.metadata(meta(4, "127.0.0.1:1"), now);
        t.enqueue(r2, &Chunk::new(PageSlice::new(0, 1).unwrap(), vec![1]))
            .unwrap();
        let ep = Endpoint::new("127.0.0.1", 7000);
        let a = t.abort(r2, ep.clone());
        assert!(!a.iter().any(|x| matches!(x, Action::AbortAck { .. })));
        let a = t.done(r2, false, Ok(()));
        assert!(a.contains(&Action::AbortAck {
            endpoint: ep,
            room: r2
        }));
    }
}
