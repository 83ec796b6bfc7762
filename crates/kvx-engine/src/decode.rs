//! The decode rank's protocol: what sglang's decode does on the wire, behind
//! [`engine::DecodeEngine`].
//!
//! Per prefill instance: the sentinel `GET /route` (15 tries at 1 s), the per-rank route queries
//! of spec §4.3, one registration per prefill rank (before any metadata, over the same PUSH
//! socket), then per room: metadata to every target rank, and Success once
//! `required_prefill_response_num` distinct ranks answered 4. A waiting timeout fails the room
//! and sends `ABORT`; `/health` heartbeats fail every open room after `max_failure` misses (the
//! next room resolves the instance again); a watcher per instance (`watch_ranks`) fails the
//! rooms of a rank whose inbox stops answering and registers again with it once it is back (at
//! its new inbox); rooms held over 5 s are logged with what they wait for. Room state lives in
//! `kvx-core`'s [`DecodeManager`]: this module feeds it statuses, ticks and heartbeat loss,
//! sends the `ABORT`s it asks for and hands each concluded room's outcome to the task waiting on
//! it. The destination memory is registered with a data-plane server whose endpoint is the
//! session id it sends. A failed room's pages are given back only once nothing can land in them
//! any more: an ABORTed room's once every prefill rank it was sent to acknowledged (each sends
//! `ABORT_ACK` only after its writes drained; sglang's deferred KV release), after checking that
//! they stay unchanged for a moment (a write after the last ACK is counted as a late write), or
//! after the release timeout; other failed rooms' after a grace. Towards a sglang 0.5.23 prefill
//! (its sentinel carries that release's keys) every `ABORT` carries a generation, which that
//! prefill's `ABORT_ACK` must echo; the registration goes out in 0.5.23's 20-frame form, which
//! tells a kvx prefill to send failure reasons as a 4th status frame. With staging
//! ([`engine::DecodeEngineConfig::staging`]) it also registers and advertises a staging ring and
//! serves `STAGING_REQ` / `CHUNK_READY` through [`crate::decode_staging`] for rooms from a
//! prefill of another attention-TP size.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvx_bootstrap::http::{BootstrapClient, RouteQuery};
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, Outbox, PushOptions, zmq};
use kvx_core::decode::{DecodeAction, DecodeEvent, DecodeManager};
use kvx_core::{
    DecodeRegistration, Destination, Endpoint, KVPoll, Room, SessionId, TransferRequest,
};
use tokio::sync::{Notify, oneshot};

use crate::decode_staging::{DecodeStager, Outgoing, StagingError};
use crate::engine::count_dropped;
use crate::plane::DataPlane;
use crate::region::Region;
use crate::wire::{self, DecodeInbound};

mod aux;
pub mod engine;
mod liveness;
mod release;

pub use aux::AuxError;
use engine::DecodeEngineConfig;
use kvx_staging::DecodeError;
use release::AbortWait;

/// The decode's staging ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeStagingConfig {
    /// Ring size in bytes.
    pub ring_bytes: u64,
    /// `chunked_prefill_size` in tokens (the chunk grid; must match the prefill's).
    pub chunked_prefill_size: i64,
    /// Receive staged blocks straight into the rooms' pages where the data plane's own threads
    /// receive them (`tcp`: no copy out of the ring; see [`crate::decode_staging`]). False
    /// scatters every block from the ring (the path RDMA and shared-memory writes always take).
    pub in_place: bool,
}

/// One room's outcome as reported by the prefill ranks.
type Outcome = Result<(), String>;

/// One prefill rank a room's metadata goes to.
#[derive(Clone, Debug)]
struct Target {
    endpoint: Endpoint,
    dummy: bool,
    /// Its attention-TP rank (the per-rank route query).
    tp_rank: u32,
    /// False while its inbox does not answer (rooms fail at once instead of waiting).
    up: bool,
}

/// An `ABORT` to send: the room, the prefill rank's inbox, the abort's generation.
type Abort = (Room, Endpoint, Option<u64>);

struct Peer {
    cfg: DecodeEngineConfig,
    /// Prefill inboxes whose connection from the outbox dropped (the rank died or restarted
    /// and may have forgotten this decode's registration); each rank watcher subscribes.
    rank_drops: tokio::sync::broadcast::Sender<Endpoint>,
    me: Endpoint,
    session: SessionId,
    kv: Arc<Region>,
    aux: Arc<Region>,
    /// Room state: `kvx-core`'s decode manager (statuses, waiting timeout, heartbeat loss).
    rooms: Mutex<DecodeManager>,
    /// Woken when the manager's earliest deadline moved earlier (the ticker sleeps until it).
    deadline_moved: Notify,
    /// The task of each held room, told its outcome when the manager concludes the room.
    waiters: Mutex<HashMap<Room, oneshot::Sender<Outcome>>>,
    /// The aux row of each room not yet concluded: an `AUX_DATA` row is written only into the
    /// row its room holds here (a row for a concluded room, or naming another row, could land
    /// in a row that belongs to another room by now).
    aux_rows: Mutex<HashMap<Room, u64>>,
    outbox: Outbox,
    /// The staging ring and staged rooms (with [`DecodeEngineConfig::staging`]).
    stager: Option<Arc<DecodeStager>>,
    stop: AtomicBool,
    /// Inbox messages dropped as malformed or unused (see [`engine::DecodeStats::dropped_messages`]).
    dropped: AtomicU64,
    /// Rooms whose `ABORT` went out, until their pages are released.
    aborts: Mutex<HashMap<Room, AbortWait>>,
    /// Woken by every ranked `ABORT_ACK`.
    acked: Notify,
    aborted_rooms: AtomicU64,
    abort_acked_rooms: AtomicU64,
    late_writes: AtomicU64,
    /// Rooms [`log_stuck_rooms`] reported, with when it last did.
    stuck_logged: Mutex<HashMap<Room, Instant>>,
}

/// Most prefill inboxes the decode keeps a socket open to (least recently used closed first).
const PREFILL_SOCKETS: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Peer {
    fn finish(&self, room: Room, outcome: Outcome) {
        lock(&self.aux_rows).remove(&room);
        crate::timeline::stage!(room, "concluded");
        if let Some(tx) = lock(&self.waiters).remove(&room) {
            let _ = tx.send(outcome);
        }
    }

    /// Feeds one event to the room manager, tells the tasks of concluded rooms their outcome
    /// (`reason`, when given, replaces the manager's failure reason) and returns the `ABORT`s
    /// to send (room, prefill inbox, generation).
    #[must_use]
    fn handle(&self, event: DecodeEvent, reason: Option<&str>) -> Vec<Abort> {
        let mut out = Vec::new();
        let (r, moved) = {
            let mut rooms = lock(&self.rooms);
            let before = rooms.poll_timeout();
            let r = rooms.handle(Instant::now(), event, &mut out);
            let after = rooms.poll_timeout();
            (r, after.is_some_and(|a| before.is_none_or(|b| a < b)))
        };
        if moved {
            self.deadline_moved.notify_one();
        }
        if let Err(e) = r {
            tracing::debug!(error = %e, "decode event dropped");
        }
        // ABORTs are recorded before any room's task learns its outcome: the task decides by
        // them how long the room's pages are held.
        {
            let mut waits = lock(&self.aborts);
            for a in &out {
                if let DecodeAction::SendAbort {
                    room,
                    endpoint,
                    generation,
                } = a
                {
                    waits
                        .entry(*room)
                        .or_default()
                        .sent(endpoint.clone(), *generation);
                }
            }
        }
        let mut aborts = Vec::new();
        for a in out {
            match a {
                DecodeAction::SendAbort {
                    room,
                    endpoint,
                    generation,
                } => aborts.push((room, endpoint, generation)),
                DecodeAction::Concluded {
                    room,
                    status: KVPoll::Success,
                    ..
                } => {
                    self.finish(room, Ok(()));
                }
                DecodeAction::Concluded {
                    room, reason: why, ..
                } => {
                    let why = match (reason, why) {
                        (Some(r), _) => r.to_owned(),
                        (None, Some(w)) => w.to_string(),
                        (None, None) => "failed".to_owned(),
                    };
                    self.finish(room, Err(why));
                }
            }
        }
        aborts
    }

    /// Sends `[ABORT, room, ip, port]` (with the generation as a 5th frame towards a sglang
    /// 0.5.23 prefill) to each prefill inbox (failures are logged and counted by the outbox).
    async fn send_aborts(&self, aborts: Vec<Abort>) {
        for (room, ep, generation) in aborts {
            let _ = self
                .send(&ep, wire::encode_abort(room, &self.me, generation))
                .await;
        }
    }

    async fn on_message<F: AsRef<[u8]>>(&self, frames: &[F]) {
        match wire::parse_decode_inbound(frames) {
            Ok(DecodeInbound::Status {
                room,
                status,
                rank,
                reason,
            }) => {
                crate::timeline::stage!(room, "status_received");
                let event = DecodeEvent::Status {
                    room,
                    status,
                    prefill_rank: rank,
                    reason,
                };
                let aborts = self.handle(event, None);
                self.send_aborts(aborts).await;
            }
            Ok(DecodeInbound::AbortAck {
                room,
                rank,
                generation,
            }) => {
                tracing::debug!(%room, ?rank, ?generation, "abort acknowledged");
                // Only the ranked (deferred-release) forms promise that the rank's writes
                // drained, and one naming a generation only for the room's current abort; other
                // ACKs leave the room to its release timeout.
                let counted = lock(&self.aborts)
                    .get_mut(&room)
                    .is_some_and(|w| w.on_ack(rank, generation));
                if !counted {
                    metrics::counter!("kvx_decode_ignored_messages_total", "kind" => "abort_ack")
                        .increment(1);
                }
                self.acked.notify_waiters();
            }
            Ok(DecodeInbound::StagingReq(req)) => {
                let Some(st) = &self.stager else {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("kvx_decode_ignored_messages_total", "kind" => "staging_req")
                        .increment(1);
                    return;
                };
                let r = st.on_staging_req(&req);
                if let Err(
                    e @ StagingError::State(
                        DecodeError::ChunkMismatch { .. } | DecodeError::ChunkOutOfGrid { .. },
                    ),
                ) = &r
                {
                    // The prefill cuts the room on another grid (its chunked prefill size
                    // differs): no chunk of it can ever land. Fail it now, with the reason,
                    // instead of at the waiting timeouts of both sides.
                    let why = format!("staging: {e}; the prefill's chunk grid differs from ours");
                    let aborts =
                        self.handle(DecodeEvent::LocalAbort { room: req.room }, Some(&why));
                    self.send_aborts(aborts).await;
                }
                self.after_staging(r, "STAGING_REQ").await;
            }
            Ok(DecodeInbound::ChunkReady(msg)) => {
                let Some(st) = self.stager.clone() else {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("kvx_decode_ignored_messages_total", "kind" => "chunk_ready")
                        .increment(1);
                    return;
                };
                // The scatter runs before the next message is read (the status that follows
                // this CHUNK_READY must find the chunk in place), off the runtime's workers.
                let r = tokio::task::spawn_blocking(move || st.on_chunk_ready(&msg))
                    .await
                    .unwrap_or_else(|e| {
                        Err(StagingError::Geometry(format!("scatter task failed: {e}")))
                    });
                self.after_staging(r, "CHUNK_READY").await;
            }
            Ok(DecodeInbound::AuxData {
                room,
                index,
                row,
                data,
            }) => match self.write_aux(room, index, row, &data) {
                Ok(()) => metrics::counter!("kvx_decode_aux_rows_total").increment(1),
                Err(e) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("kvx_decode_aux_errors_total").increment(1);
                    tracing::warn!(%room, error = %e, "AUX_DATA dropped");
                }
            },
            Err(e) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("kvx_decode_malformed_frames_total", "kind" => e.kind())
                    .increment(1);
                tracing::warn!(error = %e, "malformed message dropped");
            }
        }
    }

    /// Sends the staging messages a handled message produced, or counts and logs its error.
    async fn after_staging(&self, r: Result<Vec<Outgoing>, StagingError>, what: &str) {
        match r {
            Ok(out) => self.send_all(out).await,
            Err(e) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("kvx_decode_staging_errors_total", "kind" => e.kind())
                    .increment(1);
                tracing::warn!(error = %e, "{what} dropped");
            }
        }
    }

    /// Sends each message (failures are logged and counted by the outbox).
    async fn send_all(&self, out: Vec<Outgoing>) {
        for (ep, frames) in out {
            let _ = self.send(&ep, frames).await;
        }
    }

    /// Sends one message to a prefill rank's inbox, in order after every earlier one.
    async fn send(&self, ep: &Endpoint, frames: Vec<Vec<u8>>) -> Result<()> {
        self.outbox
            .send(ep.clone(), frames)
            .await
            .with_context(|| format!("sending to prefill {ep}"))
    }

    fn registration(&self, dst_tp_rank: u32) -> DecodeRegistration {
        let l = &self.cfg.layout;
        DecodeRegistration {
            endpoint: self.me.clone(),
            session: self.session.clone(),
            kv_ptrs: l.kv_ptrs(self.kv.base()),
            aux_ptrs: l.aux_ptrs(self.aux.base()),
            state_ptrs: vec![],
            dst_tp_rank,
            dst_attn_tp_size: self.cfg.tp_size.max(1),
            dst_kv_item_len: l.item_len,
            state_item_lens: vec![],
            state_dim_per_tensor: vec![],
            kv_layer_ids: vec![],
            state_layer_ids: vec![],
            staging: self
                .stager
                .as_ref()
                .map(|s| s.ring_info())
                .unwrap_or_default(),
            dcp_size: 1,
            dcp_rank: 0,
            // sglang 0.5.23's frames 18 and 19 (no staging slots; every KV buffer's item length):
            // they tell a kvx prefill that this decode takes a failure reason as a 4th status
            // frame. sglang main's prefill reads frames by index and ignores them.
            staging_slot_layer_ids: Some(Vec::new()),
            kv_item_lens: Some(vec![l.item_len; l.num_buffers]),
        }
    }
}

/// One prefill instance as this decode resolved it (sentinel, rank routes, registrations sent).
struct Topology {
    /// `host:port` of the prefill's bootstrap server (the manager's heartbeat key).
    bootstrap_addr: String,
    /// Set once its heartbeats failed `heartbeat_max_failure` times in a row: the engine
    /// resolves the address again for the next room.
    dead: AtomicBool,
    /// The target ranks as last resolved ([`watch_ranks`] re-resolves a rank whose inbox stops
    /// answering and registers with it again).
    targets: Mutex<Vec<Target>>,
    /// Wakes [`watch_ranks`] before its next period (a send to a rank failed).
    check: Notify,
    /// Dropped connections to prefill inboxes, subscribed before the first registration went
    /// out (so no drop after it is missed); taken by the instance's rank watcher.
    drops: Mutex<Option<tokio::sync::broadcast::Receiver<Endpoint>>>,
    required_dst_info_num: u32,
    responses: usize,
    dst_tp_rank: u32,
    /// The two TP sizes when rooms take the staging path (staging on, TP differs, not MLA).
    staged: Option<kvx_staging::TpGeometry>,
    /// The prefill is sglang 0.5.23's (its sentinel carries that release's keys): `ABORT`s
    /// carry a generation, without which it would never acknowledge them.
    generational_aborts: bool,
}

impl Topology {
    /// The target ranks as they are now.
    fn targets(&self) -> Vec<Target> {
        lock(&self.targets).clone()
    }

    /// The first target rank whose inbox is known not to answer.
    fn down_target(&self) -> Option<Target> {
        lock(&self.targets).iter().find(|t| !t.up).cloned()
    }
}

/// Resolves the prefill instance behind `client` (its bootstrap server is `bootstrap_addr`):
/// sentinel (`tries` at 1 s), checks, §4.3 rank mapping, per-rank routes, one registration per
/// target rank.
async fn connect_prefill(
    peer: &Peer,
    client: &BootstrapClient,
    bootstrap_addr: String,
    tries: u32,
) -> Result<Topology> {
    let drops = peer.rank_drops.subscribe();
    let mut last = None;
    let mut info = None;
    for k in 0..tries.max(1) {
        match client.prefill_info().await {
            Ok(i) => {
                info = Some(i);
                break;
            }
            Err(e) => {
                tracing::debug!(error = %e, attempt = k + 1, "prefill info not available yet");
                last = Some(e);
                if k + 1 < tries {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
    let Some(info) = info else {
        bail!(
            "prefill instance at {} unreachable: {}",
            client.base_url(),
            last.map(|e| e.to_string()).unwrap_or_default()
        );
    };
    let cfg = &peer.cfg;
    if let Some(ps) = info.page_size
        && ps != cfg.layout.page_size
    {
        bail!(
            "page size mismatch: prefill {ps}, decode {}",
            cfg.layout.page_size
        );
    }
    if let Some(dt) = &info.kv_cache_dtype
        && *dt != cfg.kv_cache_dtype
    {
        bail!(
            "kv cache dtype mismatch: prefill {dt}, decode {}",
            cfg.kv_cache_dtype
        );
    }
    check_0523_keys(&info, cfg.layout.mla, cfg.tp_size.max(1))?;
    let pt = info.attn_tp_size.max(1);
    let dt = cfg.tp_size.max(1);
    let r = cfg.tp_rank % dt;
    let (ranks, required_dst_info_num, responses): (Vec<(u32, bool)>, u32, usize) =
        if cfg.layout.mla && info.kv_cache_sharding() {
            // sglang 0.5.23's MLA KV sharding: every prefill rank holds some of the pages, so each
            // decode rank hears from all of them (equal TP only, checked above).
            ((0..pt).map(|t| (t, false)).collect(), dt, pt as usize)
        } else {
            // spec §4.3, CP and PP 1 on both sides (the route queries below ask for those).
            let m = kvx_core::mapping::map_ranks(&kvx_core::mapping::MappingInput {
                prefill_tp: pt,
                prefill_cp: 1,
                prefill_pp: 1,
                decode_tp: dt,
                decode_cp: 1,
                decode_pp: 1,
                decode_rank: r,
                decode_pp_rank: 0,
                mla: cfg.layout.mla,
                all_cp_ranks: false,
            })
            .with_context(|| {
                format!(
                    "mapping this decode (TP {dt}, rank {r}) onto the prefill (attention TP {pt})"
                )
            })?;
            (
                m.targets.iter().map(|t| (t.tp_rank, t.dummy)).collect(),
                m.required_dst_info_num,
                m.required_prefill_response_num as usize,
            )
        };
    let mut targets = Vec::new();
    for (t, dummy) in ranks {
        let q = RouteQuery {
            dp_rank: 0,
            cp_rank: 0,
            tp_rank: i64::from(t),
            pp_rank: 0,
        };
        let ri = client.rank_info(q).await.context("per-rank route query")?;
        let endpoint = Endpoint::new(ri.rank_ip, ri.rank_port);
        let reg = wire::encode_registration(&peer.registration(r))?;
        peer.send(&endpoint, reg).await?;
        targets.push(Target {
            endpoint,
            dummy,
            tp_rank: t,
            up: true,
        });
    }
    let staged = match &peer.stager {
        Some(_) if pt != dt && !cfg.layout.mla => Some(
            kvx_staging::TpGeometry::new(cfg.layout.total_kv_heads, pt, dt)
                .context("staging geometry")?,
        ),
        _ => None,
    };
    Ok(Topology {
        bootstrap_addr,
        dead: AtomicBool::new(false),
        targets: Mutex::new(targets),
        check: Notify::new(),
        drops: Mutex::new(Some(drops)),
        required_dst_info_num,
        responses,
        dst_tp_rank: r,
        staged,
        generational_aborts: info.has_0523_keys(),
    })
}

/// The checks sglang 0.5.23's decode makes on that release's sentinel keys, for a kvx decode
/// (no DSpark layout, no `kv_layout` of its own, the `early` allocation policy): a DSpark layout
/// differs from none, another allocation policy fails every request, and KV sharding is served
/// only as 0.5.23 maps it for MLA (equal TP, prefill CP 1).
fn check_0523_keys(
    info: &kvx_bootstrap::http::PrefillServerInfo,
    mla: bool,
    decode_tp: u32,
) -> Result<()> {
    if info.dsv41_spec_layout.is_some() {
        bail!(
            "DeepSeek-V4.1 DSpark PD layout mismatch: the prefill registered one, this decode has none"
        );
    }
    let policy = info.allocation_policy();
    if policy != "early" {
        bail!("Disaggregation decode allocation policy mismatch: prefill={policy}, decode=early");
    }
    if info.kv_cache_sharding() {
        if info.attn_cp_size > 1 {
            bail!("a prefill with KV cache sharding and CP > 1 is not supported by kvx decode");
        }
        if mla && info.attn_tp_size.max(1) != decode_tp {
            bail!(
                "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill={} decode={decode_tp}",
                info.attn_tp_size
            );
        }
    }
    Ok(())
}

/// Binds the decode's data plane (`kv`, `aux` and, with staging, a ring of its own registered on
/// it, named `name`), inbox and outbox, and starts reading the inbox. The peer and the plane live
/// until the caller drops the plane and sets `stop`.
async fn start_peer(
    cfg: DecodeEngineConfig,
    kv: Arc<Region>,
    aux: Arc<Region>,
    name: &str,
) -> Result<(Arc<Peer>, DataPlane)> {
    let layout = cfg.layout.clone();
    let ring = match &cfg.staging {
        Some(s) => {
            let ring = crate::plane::alloc_region(
                cfg.backend,
                name,
                "ring",
                usize::try_from(s.ring_bytes).context("staging ring size")?,
            )?;
            // Registration pins memory: fault the ring in now, not on the first rooms' writes.
            if let Err(e) = ring.populate() {
                tracing::debug!(error = %e, "staging ring left to fault in lazily");
            }
            Some(Arc::new(ring))
        }
        None => None,
    };
    let mut regions = vec![kv.clone(), aux.clone()];
    regions.extend(ring.clone());
    let plane = DataPlane::server_with(cfg.backend, &cfg.rdma, &cfg.host, name, regions)
        .await
        .context("binding the data plane")?;
    let session = SessionId::new(plane.endpoint());
    let stager = match (ring, &cfg.staging) {
        (Some(ring), Some(s)) => Some(Arc::new(
            DecodeStager::new(
                session.clone(),
                ring,
                kv.clone(),
                layout.clone(),
                s.chunked_prefill_size,
            )?
            .with_placement(s.in_place.then(|| plane.transport().clone())),
        )),
        _ => None,
    };
    let ctx = zmq::Context::new();
    let mut inbox = Inbox::bind_async(&ctx, InboxConfig::new(cfg.host.clone(), InboxKind::Decode))
        .context("binding the decode inbox")?;
    let (outbox, mut drops) = Outbox::reporting_disconnects(
        &ctx,
        PushOptions::toward_prefill().with_send_timeout(cfg.zmq_send_timeout),
        PREFILL_SOCKETS,
    )
    .context("starting the decode outbox")?;
    let (rank_drops, _) = tokio::sync::broadcast::channel(256);
    let forward = rank_drops.clone();
    tokio::spawn(async move {
        while let Some(ep) = drops.recv().await {
            let _ = forward.send(ep);
        }
    });
    let me = inbox.endpoint().clone();
    let peer = Arc::new(Peer {
        rank_drops,
        me,
        session,
        deadline_moved: Notify::new(),
        rooms: Mutex::new(DecodeManager::new(kvx_core::decode::DecodeConfig {
            waiting_timeout: cfg.waiting_timeout,
        })),
        waiters: Mutex::new(HashMap::new()),
        aux_rows: Mutex::new(HashMap::new()),
        outbox,
        stager,
        stop: AtomicBool::new(false),
        dropped: AtomicU64::new(0),
        aborts: Mutex::new(HashMap::new()),
        acked: Notify::new(),
        aborted_rooms: AtomicU64::new(0),
        abort_acked_rooms: AtomicU64::new(0),
        late_writes: AtomicU64::new(0),
        stuck_logged: Mutex::new(HashMap::new()),
        kv,
        aux,
        cfg,
    });
    let p = peer.clone();
    tokio::spawn(async move {
        // Malformed messages are dropped by the inbox; their count is mirrored here.
        let mut dropped = 0;
        while !p.stop.load(Ordering::Relaxed) {
            let next = tokio::time::timeout(Duration::from_millis(100), inbox.recv()).await;
            let seen = dropped;
            count_dropped(&inbox, &mut dropped, "kvx_decode_malformed_frames_total");
            p.dropped.fetch_add(dropped - seen, Ordering::Relaxed);
            match next {
                Ok(Some(msg)) => p.on_message(msg.frames()).await,
                Ok(None) => break,
                Err(_) => {}
            }
        }
        // The inbox is read in this task (no thread to join); closing takes its fd out of the
        // reactor, then closes the socket.
        inbox.close();
    });

    Ok((peer, plane))
}

impl Peer {
    /// Drives one room whose pages and aux row are held, from its registration with the room
    /// manager to its outcome: the manager learns of it (`Created`, `Init`), a staged room is
    /// registered with the ring, metadata goes to every target rank of `topo` (the waiting
    /// timeout starts), then the outcome the manager concludes is awaited (with staging: Success
    /// only once every chunk was scattered). Returns the outcome and, for a staged room, the
    /// stager that still fences its regions until [`Peer::settle_room`].
    async fn drive_room(
        &self,
        topo: &Topology,
        room: Room,
        pages: &[i32],
        row: u64,
    ) -> (Outcome, Option<Arc<DecodeStager>>) {
        let (tx, rx) = oneshot::channel();
        lock(&self.waiters).insert(room, tx);
        lock(&self.aux_rows).insert(room, row);
        let targets = topo.targets();
        let created = DecodeEvent::Created {
            room,
            bootstrap_addr: topo.bootstrap_addr.clone(),
        };
        let init = DecodeEvent::Init {
            room,
            required_prefill_response_num: u32::try_from(topo.responses).unwrap_or(u32::MAX),
            prefill_endpoints: targets.iter().map(|t| t.endpoint.clone()).collect(),
            generational_aborts: topo.generational_aborts,
        };
        let aborts = [self.handle(created, None), self.handle(init, None)].concat();
        self.send_aborts(aborts).await;
        // A staged room is registered with the ring before its metadata goes out (sglang's
        // order): the prefill's STAGING_REQs follow the metadata.
        let staged = match (&self.stager, &topo.staged) {
            (Some(st), Some(geom)) => {
                let peers = targets
                    .iter()
                    .filter(|t| !t.dummy)
                    .map(|t| t.endpoint.clone())
                    .collect();
                if let Err(e) = st.register_room(room, peers, pages, geom, topo.dst_tp_rank) {
                    let why = format!("staging: {e}");
                    let aborts = self.handle(DecodeEvent::LocalAbort { room }, Some(&why));
                    self.send_aborts(aborts).await;
                }
                Some(st.clone())
            }
            _ => None,
        };
        for t in &targets {
            let req = TransferRequest {
                room,
                endpoint: self.me.clone(),
                session: self.session.clone(),
                dst: (!t.dummy).then(|| Destination {
                    kv_pages: pages.to_vec(),
                    aux_index: row as i64,
                    state_indices: vec![],
                }),
                required_dst_info_num: topo.required_dst_info_num,
                decode_prefix_len: Some(0),
                device_kv_pages: vec![],
            };
            let sent = match wire::encode_metadata(&req) {
                Ok(f) => self.send(&t.endpoint, f).await,
                Err(e) => Err(e.into()),
            };
            if let Err(e) = sent {
                // The rank may have died or moved: re-resolve it now, not at the next period.
                topo.check.notify_one();
                let why = format!("metadata not sent: {e:#}");
                let aborts = self.handle(DecodeEvent::LocalAbort { room }, Some(&why));
                self.send_aborts(aborts).await;
                break;
            }
        }
        // The waiting timeout starts once the metadata went out; the ticker enforces it.
        let aborts = self.handle(DecodeEvent::MetadataSent { room }, None);
        self.send_aborts(aborts).await;
        let mut outcome = rx.await.unwrap_or_else(|_| Err("room dropped".into()));
        if let Some(st) = &staged {
            let (out, drained) = st.finish_room(room, outcome.is_ok());
            self.send_all(out).await;
            if outcome.is_ok() && !drained {
                outcome = Err("staging: Success before every chunk was scattered".into());
            }
        }
        (outcome, staged)
    }

    /// Holds a failed room's pages until nothing can land in them any more (see
    /// [`release`](self::release)), then lets a staged room's fenced ring regions go. True when
    /// every prefill rank the room's `ABORT` went to acknowledged it. The caller releases the
    /// pages afterwards.
    async fn settle_room(
        self: &Arc<Self>,
        room: Room,
        pages: &[i32],
        topo: &Topology,
        staged: Option<Arc<DecodeStager>>,
    ) -> bool {
        let acked = self.settle_failed(room, pages, &topo.dead).await;
        if let Some(st) = staged {
            let out = st.release_fenced(room);
            self.send_all(out).await;
        }
        acked
    }
}
