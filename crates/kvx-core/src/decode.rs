//! The decode room manager: a sans-IO state machine for the receiving side of a room.
//!
//! A room goes Bootstrapping (receiver created) → WaitingForInput (registration sent, prefill
//! ranks known) → Success once `required_prefill_response_num` *distinct* prefill ranks reported
//! status 4 (repeats are not double counted). It fails on a status 0, on heartbeat loss for its
//! bootstrap address, on a local abort, or when it waits longer than the waiting timeout after its
//! metadata went out. Every failure but the loss of one rank's inbox emits an `ABORT` to every
//! prefill rank of the room: with TP fan-in, the ranks that did not fail keep no batch of the
//! room queued behind slow writes after the decode gave up on it (they fail the room, skip what
//! they still hold and acknowledge once drained), so the pages can come back on every rank's word
//! rather than at the driver's release timeout; a rank that reported status 0 has nothing in
//! flight and acknowledges at once, and after a lost heartbeat the ranks still running (one
//! rank's process died, or only the bootstrap server) stop too. A lost rank's inbox sends none
//! (nothing there could acknowledge it). Status
//! messages for rooms it does not hold are dropped. Terminal rooms are released at once; the
//! [`DecodeAction::Concluded`] action carries the outcome to the driver.
//!
//! Towards a prefill of sglang 0.5.23 (the driver says so at [`DecodeEvent::Init`], from the
//! bootstrap sentinel's 0.5.23-only keys) every `ABORT` of a room carries a fresh generation —
//! one counter per manager, as sglang's decode arms one per abort — which that prefill echoes in
//! its `ABORT_ACK` and without which it sends no ACK at all; towards sglang main the `ABORT` keeps
//! its 4 frames.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::peer::Endpoint;
use crate::{KVPoll, Room};

/// sglang's default waiting timeout (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`).
pub const DEFAULT_WAITING_TIMEOUT: Duration = Duration::from_secs(300);

/// Configuration of the decode manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeConfig {
    /// A room WaitingForInput this long after its metadata went out fails and is aborted.
    pub waiting_timeout: Duration,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        DecodeConfig {
            waiting_timeout: DEFAULT_WAITING_TIMEOUT,
        }
    }
}

/// Something that happened on the decode side.
///
/// Deliberately not `#[non_exhaustive]`, like the actions: a new event changes what drivers must
/// feed, so adding one is a breaking change by design.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeEvent {
    /// A receiver was created for a room whose prefill bootstrap server is `bootstrap_addr`.
    Created {
        /// The room.
        room: Room,
        /// `host:port` of the prefill's bootstrap server (heartbeat key).
        bootstrap_addr: String,
    },
    /// The receiver resolved its prefill ranks and sent its registration (→ WaitingForInput).
    Init {
        /// The room.
        room: Room,
        /// Distinct prefill ranks that must report Success.
        required_prefill_response_num: u32,
        /// Inboxes of the room's prefill ranks (ABORT targets).
        prefill_endpoints: Vec<Endpoint>,
        /// The prefill instance acknowledges only `ABORT`s that carry a generation (sglang
        /// 0.5.23): the room's `ABORT`s get one.
        generational_aborts: bool,
    },
    /// The per-room metadata went out (the waiting timeout starts now).
    MetadataSent {
        /// The room.
        room: Room,
    },
    /// A status message from a prefill rank.
    Status {
        /// The room.
        room: Room,
        /// The reported status (only Success and Failed are acted upon).
        status: KVPoll,
        /// The sender's `prefill_unique_rank`.
        prefill_rank: u32,
        /// Failure reason, when the peer sent one.
        reason: Option<String>,
    },
    /// Heartbeats to a prefill bootstrap server failed too often.
    HeartbeatLost {
        /// `host:port` of the bootstrap server.
        bootstrap_addr: String,
    },
    /// A prefill rank's inbox stopped answering (its process died or moved): every held room
    /// sent to that inbox fails, without an `ABORT` (nothing there could acknowledge it).
    RankLost {
        /// The rank's inbox.
        endpoint: Endpoint,
    },
    /// The local scheduler aborted the request.
    LocalAbort {
        /// The room.
        room: Room,
    },
    /// Time passed (waiting timeouts).
    Tick,
}

/// Why a decode room failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeFailure {
    /// A prefill rank reported status 0.
    #[error("{}", .reason.as_deref().unwrap_or("Failed to get kvcache from prefill instance, it might be dead"))]
    PrefillFailed {
        /// The reporting rank.
        prefill_rank: u32,
        /// Its reason, if sent.
        reason: Option<String>,
    },
    /// Heartbeat loss for the room's bootstrap server.
    #[error("Lost connection with prefill instance (bootstrap_addr: {bootstrap_addr})")]
    LostConnection {
        /// The bootstrap server.
        bootstrap_addr: String,
    },
    /// A prefill rank of the room stopped answering (see [`DecodeEvent::RankLost`]).
    #[error("Lost connection with prefill rank at {endpoint}")]
    RankLost {
        /// The rank's inbox.
        endpoint: Endpoint,
    },
    /// Waited too long for the prefill.
    #[error("Request timed out after {:.1}s in KVPoll.WaitingForInput", .elapsed.as_secs_f64())]
    WaitingTimeout {
        /// Time since the metadata went out.
        elapsed: Duration,
    },
    /// Aborted by the local scheduler.
    #[error("Aborted by the decode scheduler")]
    Aborted,
}

/// Something the decode driver must do.
///
/// Deliberately not `#[non_exhaustive]`: a driver must perform every action, so its `match` has
/// no wildcard arm and a new variant is a breaking change by design (the compiler then points at
/// every driver that must learn it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeAction {
    /// Send `[ABORT, room, decode_ip, decode_port]` (plus `generation` as a 5th frame when set)
    /// to a prefill rank.
    SendAbort {
        /// The room.
        room: Room,
        /// The prefill rank's inbox.
        endpoint: Endpoint,
        /// The abort's generation (the same for every rank of one abort), which the prefill's
        /// `ABORT_ACK` must echo; `None` towards a prefill of sglang main.
        generation: Option<u64>,
    },
    /// The room is terminal and released.
    Concluded {
        /// The room.
        room: Room,
        /// Success or Failed.
        status: KVPoll,
        /// Why it failed.
        reason: Option<DecodeFailure>,
    },
}

/// An event dropped without any state change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The room is not held (never created, or already concluded).
    #[error("unknown room {0}")]
    UnknownRoom(Room),
    /// A second receiver for a held room.
    #[error("room {0} already exists")]
    DuplicateRoom(Room),
}

#[derive(Debug)]
struct DecodeRoom {
    status: KVPoll,
    bootstrap_addr: String,
    required: u32,
    responded: Vec<u32>,
    endpoints: Vec<Endpoint>,
    generational_aborts: bool,
    waiting_since: Option<Instant>,
    /// When the room times out in `WaitingForInput` (its entry in `deadlines`).
    deadline: Option<Instant>,
    created: Instant,
}

/// A room that has been held for a while, as [`DecodeManager::waiting`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitingRoom {
    /// The room.
    pub room: Room,
    /// Its status (`Bootstrapping` or `WaitingForInput`).
    pub status: KVPoll,
    /// `host:port` of its prefill's bootstrap server.
    pub bootstrap_addr: String,
    /// Inboxes of its prefill ranks (empty before `Init`).
    pub endpoints: Vec<Endpoint>,
    /// Prefill ranks that reported Success so far.
    pub responded: Vec<u32>,
    /// Distinct prefill ranks that must report Success.
    pub required: u32,
    /// The metadata went out (the waiting timeout runs).
    pub metadata_sent: bool,
    /// Time since the room was created.
    pub elapsed: Duration,
}

/// The decode side's room manager.
#[derive(Debug, Default)]
pub struct DecodeManager {
    cfg: DecodeConfig,
    rooms: HashMap<Room, DecodeRoom>,
    by_addr: HashMap<String, HashSet<Room>>,
    /// Waiting deadlines, earliest first: a tick looks only at the rooms that are due.
    deadlines: BTreeSet<(Instant, Room)>,
    /// The last abort generation handed out (sglang starts at 1).
    last_generation: u64,
}

impl DecodeManager {
    /// A manager with `cfg`.
    pub fn new(cfg: DecodeConfig) -> Self {
        DecodeManager {
            cfg,
            rooms: HashMap::new(),
            by_addr: HashMap::new(),
            deadlines: BTreeSet::new(),
            last_generation: 0,
        }
    }

    /// The room's status while held.
    pub fn poll(&self, room: Room) -> Option<KVPoll> {
        self.rooms.get(&room).map(|r| r.status)
    }

    /// Live per-room entries: rooms held plus entries of the bootstrap-address index and of
    /// the deadline queue.
    pub fn live_entries(&self) -> usize {
        self.rooms.len()
            + self.by_addr.values().map(HashSet::len).sum::<usize>()
            + self.deadlines.len()
    }

    /// When the next [`DecodeEvent::Tick`] has something to do (the earliest waiting
    /// deadline), or `None` while no room waits. A driver sleeps until then (or until its next
    /// event) instead of ticking on a fixed period.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.first().map(|(at, _)| *at)
    }

    /// Feeds one event; appends actions to `out`. `Err` means dropped without a state change.
    pub fn handle(
        &mut self,
        now: Instant,
        event: DecodeEvent,
        out: &mut Vec<DecodeAction>,
    ) -> Result<(), DecodeError> {
        match event {
            DecodeEvent::Created {
                room,
                bootstrap_addr,
            } => {
                if self.rooms.contains_key(&room) {
                    return Err(DecodeError::DuplicateRoom(room));
                }
                self.by_addr
                    .entry(bootstrap_addr.clone())
                    .or_default()
                    .insert(room);
                self.rooms.insert(
                    room,
                    DecodeRoom {
                        status: KVPoll::Bootstrapping,
                        bootstrap_addr,
                        required: 0,
                        responded: Vec::new(),
                        endpoints: Vec::new(),
                        generational_aborts: false,
                        waiting_since: None,
                        deadline: None,
                        created: now,
                    },
                );
            }
            DecodeEvent::Init {
                room,
                required_prefill_response_num,
                prefill_endpoints,
                generational_aborts,
            } => {
                let r = self.get(room)?;
                r.required = required_prefill_response_num.max(1);
                r.endpoints = prefill_endpoints;
                r.generational_aborts = generational_aborts;
                r.status = r.status.update(KVPoll::WaitingForInput);
                // A deadline that passed while the room was still bootstrapping.
                let overdue = match (r.deadline, r.waiting_since) {
                    (Some(at), Some(since))
                        if at <= now && !self.deadlines.contains(&(at, room)) =>
                    {
                        Some(now.saturating_duration_since(since))
                    }
                    _ => None,
                };
                self.maybe_succeed(room, out);
                if let Some(elapsed) = overdue
                    && self.rooms.contains_key(&room)
                {
                    self.fail(room, DecodeFailure::WaitingTimeout { elapsed }, true, out);
                }
            }
            DecodeEvent::MetadataSent { room } => {
                let at = now + self.cfg.waiting_timeout;
                let r = self.get(room)?;
                let old = r.deadline.replace(at);
                r.waiting_since = Some(now);
                if let Some(old) = old {
                    self.deadlines.remove(&(old, room));
                }
                self.deadlines.insert((at, room));
            }
            DecodeEvent::Status {
                room,
                status,
                prefill_rank,
                reason,
            } => {
                let r = self.get(room)?;
                match status {
                    KVPoll::Success => {
                        if !r.responded.contains(&prefill_rank) {
                            r.responded.push(prefill_rank);
                        }
                        self.maybe_succeed(room, out);
                    }
                    KVPoll::Failed => {
                        let why = DecodeFailure::PrefillFailed {
                            prefill_rank,
                            reason,
                        };
                        self.fail(room, why, true, out);
                    }
                    _ => {}
                }
            }
            DecodeEvent::HeartbeatLost { bootstrap_addr } => {
                let rooms: Vec<Room> = self
                    .by_addr
                    .get(&bootstrap_addr)
                    .map(|s| s.iter().copied().collect())
                    .unwrap_or_default();
                // Room order, not hash order: the same inputs give the same outputs (replay).
                let mut rooms = rooms;
                rooms.sort_unstable();
                for room in rooms {
                    let why = DecodeFailure::LostConnection {
                        bootstrap_addr: bootstrap_addr.clone(),
                    };
                    // The instance's ranks may outlive its heartbeat (one rank's process died,
                    // or only the bootstrap server): the ones still running stop and acknowledge.
                    self.fail(room, why, true, out);
                }
            }
            DecodeEvent::RankLost { endpoint } => {
                let mut rooms: Vec<Room> = self
                    .rooms
                    .iter()
                    .filter(|(_, r)| r.endpoints.contains(&endpoint))
                    .map(|(&room, _)| room)
                    .collect();
                // Room order, not hash order (replay).
                rooms.sort_unstable();
                for room in rooms {
                    let why = DecodeFailure::RankLost {
                        endpoint: endpoint.clone(),
                    };
                    self.fail(room, why, false, out);
                }
            }
            DecodeEvent::LocalAbort { room } => {
                self.get(room)?;
                self.fail(room, DecodeFailure::Aborted, true, out);
            }
            DecodeEvent::Tick => {
                // Due rooms in (deadline, room) order: abort generations are handed out in
                // this order, the same for the same inputs.
                while let Some(&(at, room)) = self.deadlines.first()
                    && at <= now
                {
                    self.deadlines.pop_first();
                    let Some(r) = self.rooms.get(&room) else {
                        continue;
                    };
                    // Still bootstrapping: it fails when `Init` makes it wait (see there).
                    if r.status == KVPoll::WaitingForInput {
                        let elapsed = r
                            .waiting_since
                            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s));
                        self.fail(room, DecodeFailure::WaitingTimeout { elapsed }, true, out);
                    }
                }
            }
        }
        Ok(())
    }

    /// Rooms held longer than `longer_than` since they were created, in room order: what each
    /// still waits for (operators' "why is this room stuck" view).
    pub fn waiting(&self, now: Instant, longer_than: Duration) -> Vec<WaitingRoom> {
        let mut v: Vec<WaitingRoom> = self
            .rooms
            .iter()
            .filter_map(|(&room, r)| {
                let elapsed = now.saturating_duration_since(r.created);
                (elapsed > longer_than).then(|| WaitingRoom {
                    room,
                    status: r.status,
                    bootstrap_addr: r.bootstrap_addr.clone(),
                    endpoints: r.endpoints.clone(),
                    responded: r.responded.clone(),
                    required: r.required,
                    metadata_sent: r.waiting_since.is_some(),
                    elapsed,
                })
            })
            .collect();
        v.sort_unstable_by_key(|w| w.room);
        v
    }

    fn get(&mut self, room: Room) -> Result<&mut DecodeRoom, DecodeError> {
        self.rooms
            .get_mut(&room)
            .ok_or(DecodeError::UnknownRoom(room))
    }

    fn maybe_succeed(&mut self, room: Room, out: &mut Vec<DecodeAction>) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.status == KVPoll::WaitingForInput
            && r.required > 0
            && r.responded.len() >= r.required as usize
        {
            r.status = KVPoll::Success;
            self.conclude(room, None, out);
        }
    }

    fn fail(&mut self, room: Room, why: DecodeFailure, abort: bool, out: &mut Vec<DecodeAction>) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.status.is_terminal() {
            return;
        }
        r.status = KVPoll::Failed;
        if abort {
            let generation = r.generational_aborts.then(|| {
                self.last_generation = self.last_generation.wrapping_add(1).max(1);
                self.last_generation
            });
            for endpoint in &r.endpoints {
                out.push(DecodeAction::SendAbort {
                    room,
                    endpoint: endpoint.clone(),
                    generation,
                });
            }
        }
        self.conclude(room, Some(why), out);
    }

    /// Emits the conclusion and drops every entry of the room.
    fn conclude(&mut self, room: Room, reason: Option<DecodeFailure>, out: &mut Vec<DecodeAction>) {
        let Some(r) = self.rooms.remove(&room) else {
            return;
        };
        if let Some(at) = r.deadline {
            self.deadlines.remove(&(at, room));
        }
        if let Some(set) = self.by_addr.get_mut(&r.bootstrap_addr) {
            set.remove(&room);
            if set.is_empty() {
                self.by_addr.remove(&r.bootstrap_addr);
            }
        }
        out.push(DecodeAction::Concluded {
            room,
            status: r.status,
            reason,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn room(n: u64) -> Room {
        Room::new(n).unwrap()
    }

    fn ep(n: u16) -> Endpoint {
        Endpoint::new("10.0.0.1", 40000 + n)
    }

    fn setup(m: &mut DecodeManager, now: Instant, r: Room, required: u32) {
        let mut out = Vec::new();
        m.handle(
            now,
            DecodeEvent::Created {
                room: r,
                bootstrap_addr: "10.0.0.1:8998".into(),
            },
            &mut out,
        )
        .unwrap();
        assert_eq!(m.poll(r), Some(KVPoll::Bootstrapping));
        m.handle(
            now,
            DecodeEvent::Init {
                room: r,
                required_prefill_response_num: required,
                prefill_endpoints: vec![ep(1), ep(2)],
                generational_aborts: false,
            },
            &mut out,
        )
        .unwrap();
        m.handle(now, DecodeEvent::MetadataSent { room: r }, &mut out)
            .unwrap();
        assert!(out.is_empty());
        assert_eq!(m.poll(r), Some(KVPoll::WaitingForInput));
    }

    fn status(r: Room, status: KVPoll, rank: u32) -> DecodeEvent {
        DecodeEvent::Status {
            room: r,
            status,
            prefill_rank: rank,
            reason: None,
        }
    }

    #[test]
    fn success_needs_distinct_ranks() {
        let now = Instant::now();
        let mut m = DecodeManager::default();
        let r = room(7);
        setup(&mut m, now, r, 2);
        let mut out = Vec::new();
        m.handle(now, status(r, KVPoll::Success, 0), &mut out)
            .unwrap();
        m.handle(now, status(r, KVPoll::Success, 0), &mut out)
            .unwrap();
        assert!(out.is_empty());
        assert_eq!(m.poll(r), Some(KVPoll::WaitingForInput));
        m.handle(now, status(r, KVPoll::Success, 1), &mut out)
            .unwrap();
        assert_eq!(
            out,
            vec![DecodeAction::Concluded {
                room: r,
                status: KVPoll::Success,
                reason: None
            }]
        );
        assert_eq!(m.live_entries(), 0);
        // Late messages for the released room are dropped.
        assert_eq!(
            m.handle(now, status(r, KVPoll::Failed, 1), &mut out),
            Err(DecodeError::UnknownRoom(r))
        );
    }

    #[test]
    fn ticks_look_only_at_due_deadlines() {
        let t0 = Instant::now();
        let cfg = DecodeConfig {
            waiting_timeout: Duration::from_secs(10),
        };
        let mut m = DecodeManager::new(cfg);
        assert_eq!(m.poll_timeout(), None);
        let (a, b) = (room(1), room(2));
        setup(&mut m, t0 + Duration::from_secs(3), b, 1);
        setup(&mut m, t0, a, 1);
        assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        let mut out = Vec::new();
        m.handle(t0 + Duration::from_secs(9), DecodeEvent::Tick, &mut out)
            .unwrap();
        assert!(out.is_empty());
        // Metadata sent again re-arms the room's one deadline.
        m.handle(
            t0 + Duration::from_secs(5),
            DecodeEvent::MetadataSent { room: a },
            &mut out,
        )
        .unwrap();
        assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(13)));
        m.handle(t0 + Duration::from_secs(13), DecodeEvent::Tick, &mut out)
            .unwrap();
        let failed: Vec<Room> = out
            .iter()
            .filter_map(|a| match a {
                DecodeAction::Concluded { room, .. } => Some(*room),
                _ => None,
            })
            .collect();
        assert_eq!(failed, vec![b]);
        assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(15)));
        // Success drops the deadline with the room.
        m.handle(t0, status(a, KVPoll::Success, 0), &mut out)
            .unwrap();
        assert_eq!(m.poll_timeout(), None);
        assert_eq!(m.live_entries(), 0);
    }

    #[test]
    fn a_deadline_passed_while_bootstrapping_fails_the_room_once_it_waits() {
        let t0 = Instant::now();
        let mut m = DecodeManager::new(DecodeConfig {
            waiting_timeout: Duration::from_secs(1),
        });
        let r = room(4);
        let mut out = Vec::new();
        m.handle(
            t0,
            DecodeEvent::Created {
                room: r,
                bootstrap_addr: "10.0.0.1:8998".into(),
            },
            &mut out,
        )
        .unwrap();
        m.handle(t0, DecodeEvent::MetadataSent { room: r }, &mut out)
            .unwrap();
        m.handle(t0 + Duration::from_secs(2), DecodeEvent::Tick, &mut out)
            .unwrap();
        assert!(out.is_empty(), "still bootstrapping");
        assert_eq!(m.poll_timeout(), None);
        m.handle(
            t0 + Duration::from_secs(3),
            DecodeEvent::Init {
                room: r,
                required_prefill_response_num: 1,
                prefill_endpoints: vec![ep(1)],
                generational_aborts: false,
            },
            &mut out,
        )
        .unwrap();
        assert!(matches!(
            out.last(),
            Some(DecodeAction::Concluded {
                status: KVPoll::Failed,
                reason: Some(DecodeFailure::WaitingTimeout { .. }),
                ..
            })
        ));
        assert_eq!(m.live_entries(), 0);
    }

    #[test]
    fn failures_and_timeouts() {
        let t0 = Instant::now();
        let mut m = DecodeManager::default();
        let (a, b, c) = (room(1), room(2), room(3));
        for r in [a, b, c] {
            setup(&mut m, t0, r, 1);
        }
        let mut out = Vec::new();
        m.handle(
            t0,
            DecodeEvent::Status {
                room: a,
                status: KVPoll::Failed,
                prefill_rank: 0,
                reason: Some("Failed to send kv chunk".into()),
            },
            &mut out,
        )
        .unwrap();
        // A status 0 aborts the room on both prefill ranks (the other one stops writing), then
        // concludes it.
        let [
            DecodeAction::SendAbort { endpoint: e0, .. },
            DecodeAction::SendAbort { endpoint: e1, .. },
            DecodeAction::Concluded {
                reason: Some(why), ..
            },
        ] = out.as_slice()
        else {
            panic!("expected two aborts and a conclusion: {out:?}");
        };
        assert_ne!(e0, e1);
        assert_eq!(why.to_string(), "Failed to send kv chunk");
        out.clear();

        m.handle(t0 + Duration::from_secs(299), DecodeEvent::Tick, &mut out)
            .unwrap();
        assert!(out.is_empty());
        m.handle(t0 + Duration::from_secs(300), DecodeEvent::Tick, &mut out)
            .unwrap();
        // Two rooms time out: each sends ABORT to both prefill ranks and concludes.
        let aborts = out
            .iter()
            .filter(|x| matches!(x, DecodeAction::SendAbort { .. }))
            .count();
        assert_eq!(aborts, 4);
        assert_eq!(m.live_entries(), 0);
    }

    #[test]
    fn heartbeat_loss_fails_rooms_of_that_address() {
        let now = Instant::now();
        let mut m = DecodeManager::default();
        setup(&mut m, now, room(1), 1);
        let mut out = Vec::new();
        m.handle(
            now,
            DecodeEvent::Created {
                room: room(2),
                bootstrap_addr: "10.0.0.9:8998".into(),
            },
            &mut out,
        )
        .unwrap();
        m.handle(
            now,
            DecodeEvent::HeartbeatLost {
                bootstrap_addr: "10.0.0.1:8998".into(),
            },
            &mut out,
        )
        .unwrap();
        // The ranks still running stop writing: one ABORT per rank of the room, then the
        // conclusion.
        assert_eq!(out.len(), 3, "{out:?}");
        assert!(
            out[..2]
                .iter()
                .all(|a| matches!(a, DecodeAction::SendAbort { room: r, .. } if *r == room(1)))
        );
        assert_eq!(
            out[2],
            DecodeAction::Concluded {
                room: room(1),
                status: KVPoll::Failed,
                reason: Some(DecodeFailure::LostConnection {
                    bootstrap_addr: "10.0.0.1:8998".into()
                })
            }
        );
        assert_eq!(m.poll(room(2)), Some(KVPoll::Bootstrapping));
    }

    #[test]
    fn a_lost_rank_fails_only_rooms_sent_to_it_without_abort() {
        let now = Instant::now();
        let mut m = DecodeManager::default();
        setup(&mut m, now, room(1), 2);
        let mut out = Vec::new();
        m.handle(
            now,
            DecodeEvent::Created {
                room: room(2),
                bootstrap_addr: "10.0.0.1:8998".into(),
            },
            &mut out,
        )
        .unwrap();
        m.handle(now, DecodeEvent::RankLost { endpoint: ep(2) }, &mut out)
            .unwrap();
        assert_eq!(
            out,
            vec![DecodeAction::Concluded {
                room: room(1),
                status: KVPoll::Failed,
                reason: Some(DecodeFailure::RankLost { endpoint: ep(2) })
            }]
        );
        assert_eq!(m.poll(room(2)), Some(KVPoll::Bootstrapping));
        let later = now + Duration::from_secs(6);
        let w = m.waiting(later, Duration::from_secs(5));
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].room, room(2));
        assert!(!w[0].metadata_sent);
        assert!(m.waiting(later, Duration::from_secs(7)).is_empty());
    }

    #[test]
    fn aborts_carry_a_generation_only_towards_generational_prefills() {
        let now = Instant::now();
        let mut m = DecodeManager::default();
        let mut out = Vec::new();
        for (n, generational) in [(1, true), (2, false), (3, true)] {
            let r = room(n);
            m.handle(
                now,
                DecodeEvent::Created {
                    room: r,
                    bootstrap_addr: "10.0.0.1:8998".into(),
                },
                &mut out,
            )
            .unwrap();
            m.handle(
                now,
                DecodeEvent::Init {
                    room: r,
                    required_prefill_response_num: 1,
                    prefill_endpoints: vec![ep(1), ep(2)],
                    generational_aborts: generational,
                },
                &mut out,
            )
            .unwrap();
        }
        let mut gens = Vec::new();
        for n in [1, 2, 3] {
            out.clear();
            m.handle(now, DecodeEvent::LocalAbort { room: room(n) }, &mut out)
                .unwrap();
            let g: Vec<Option<u64>> = out
                .iter()
                .filter_map(|a| match a {
                    DecodeAction::SendAbort { generation, .. } => Some(*generation),
                    _ => None,
                })
                .collect();
            gens.push(g);
        }
        // One generation per abort, shared by every rank of it, counting from 1; none towards
        // a prefill of sglang main.
        assert_eq!(
            gens,
            vec![
                vec![Some(1), Some(1)],
                vec![None, None],
                vec![Some(2), Some(2)]
            ]
        );
    }

    #[derive(Clone, Debug)]
    enum Step {
        Create(u64, u8),
        Init(u64, u32),
        Sent(u64),
        Status(u64, bool, u32),
        Lost(u8),
        Abort(u64),
        Advance(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u64..5, 0u8..2).prop_map(|(r, a)| Step::Create(r, a)),
            (1u64..5, 0u32..3).prop_map(|(r, n)| Step::Init(r, n)),
            (1u64..5).prop_map(Step::Sent),
            (1u64..5, prop::bool::weighted(0.8), 0u32..3)
                .prop_map(|(r, ok, k)| Step::Status(r, ok, k)),
            (0u8..2).prop_map(Step::Lost),
            (1u64..5).prop_map(Step::Abort),
            (0u64..400).prop_map(Step::Advance),
        ]
    }

    proptest! {
        #[test]
        fn random_sequences_are_monotone_and_release(steps in proptest::collection::vec(step(), 1..60)) {
            let mut now = Instant::now();
            let mut m = DecodeManager::default();
            let mut held: HashMap<Room, KVPoll> = HashMap::new();
            let mut out = Vec::new();
            for s in &steps {
                out.clear();
                let e = match *s {
                    Step::Create(r, a) => DecodeEvent::Created { room: room(r), bootstrap_addr: format!("h{a}:1") },
                    Step::Init(r, n) => DecodeEvent::Init { room: room(r), required_prefill_response_num: n, prefill_endpoints: vec![ep(1)], generational_aborts: r % 2 == 0 },
                    Step::Sent(r) => DecodeEvent::MetadataSent { room: room(r) },
                    Step::Status(r, ok, k) => status(room(r), if ok { KVPoll::Success } else { KVPoll::Failed }, k),
                    Step::Lost(a) => DecodeEvent::HeartbeatLost { bootstrap_addr: format!("h{a}:1") },
                    Step::Abort(r) => DecodeEvent::LocalAbort { room: room(r) },
                    Step::Advance(secs) => {
                        now += Duration::from_secs(secs);
                        DecodeEvent::Tick
                    }
                };
                let _ = m.handle(now, e, &mut out);
                for a in &out {
                    if let DecodeAction::Concluded { room, status, .. } = a {
                        prop_assert!(status.is_terminal());
                        prop_assert_eq!(m.poll(*room), None);
                    }
                }
                for r in (1..5).map(room) {
                    match (m.poll(r), held.get(&r).copied()) {
                        (None, _) => { held.remove(&r); }
                        (Some(p), old) => {
                            prop_assert!(!p.is_terminal(), "terminal rooms are released");
                            if let Some(old) = old {
                                prop_assert_eq!(old.update(p), p);
                            }
                            held.insert(r, p);
                        }
                    }
                }
                let indexed: usize = m.by_addr.values().map(HashSet::len).sum();
                prop_assert_eq!(indexed, m.rooms.len());
            }
            for r in 1..5 {
                let _ = m.handle(now, DecodeEvent::LocalAbort { room: room(r) }, &mut out);
            }
            prop_assert_eq!(m.live_entries(), 0);
        }
    }
}
