//! The decode rank's background tasks: the `/health` heartbeat per prefill instance, the
//! watcher that probes each target rank's inbox and registers again with a restarted rank, the
//! ticker that hands the room manager the time when its earliest deadline is due, and the log
//! of rooms waiting longer than a few seconds.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvx_bootstrap::http::{BootstrapClient, RouteQuery, tcp_alive};
use kvx_core::decode::DecodeEvent;
use kvx_core::{Endpoint, KVPoll};

use super::{Peer, Target, Topology, lock};
use crate::wire;

pub(super) async fn heartbeat(peer: Arc<Peer>, client: BootstrapClient, topo: Arc<Topology>) {
    let period = peer.cfg.heartbeat_interval.max(Duration::from_secs(2));
    let max = peer.cfg.heartbeat_max_failure.max(1);
    let mut failures = 0;
    loop {
        tokio::time::sleep(period).await;
        match client.health().await {
            Ok(()) => failures = 0,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, failures, "prefill heartbeat failed");
                if failures >= max {
                    topo.dead.store(true, Ordering::Relaxed);
                    topo.check.notify_one();
                    let lost = DecodeEvent::HeartbeatLost {
                        bootstrap_addr: topo.bootstrap_addr.clone(),
                    };
                    let aborts = peer.handle(lost, None);
                    peer.send_aborts(aborts).await;
                    // Rooms waiting for ABORT_ACKs look again: ranks that are gone now count
                    // as stopped (see `release`).
                    peer.acked.notify_waiters();
                    metrics::counter!("kvx_decode_prefill_instances_lost_total").increment(1);
                    tracing::warn!(
                        bootstrap_addr = %topo.bootstrap_addr,
                        "prefill instance lost: its rooms failed; the next room resolves its \
                         route again and registers with its ranks"
                    );
                    return;
                }
            }
        }
    }
}

/// How long a probe of a prefill rank's inbox may take to connect.
const RANK_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What one look at a target rank found.
#[derive(Debug, PartialEq, Eq)]
struct RankCheck {
    /// Its inbox answers where we send to it.
    alive: bool,
    /// The bootstrap server names another inbox for the rank, and that one answers.
    moved: Option<Endpoint>,
}

/// Looks at one target rank: a TCP probe of the inbox we send to, and its route as the
/// bootstrap server has it now (a restarted rank registers its new inbox there).
async fn check_rank(client: &BootstrapClient, t: &Target) -> RankCheck {
    let q = RouteQuery {
        dp_rank: 0,
        cp_rank: 0,
        tp_rank: i64::from(t.tp_rank),
        pp_rank: 0,
    };
    let route = match client.rank_info(q).await {
        Ok(ri) => Some(Endpoint::new(ri.rank_ip, ri.rank_port)),
        Err(e) => {
            tracing::debug!(tp_rank = t.tp_rank, error = %e, "prefill rank route not available");
            None
        }
    };
    let alive = tcp_alive(&t.endpoint.host, t.endpoint.port, RANK_PROBE_TIMEOUT).await;
    let moved = match route {
        Some(ep) if ep != t.endpoint && tcp_alive(&ep.host, ep.port, RANK_PROBE_TIMEOUT).await => {
            Some(ep)
        }
        _ => None,
    };
    RankCheck { alive, moved }
}

/// How often a rank that is down is looked at again.
const DOWN_RECHECK: Duration = Duration::from_secs(1);

/// Watches the target ranks of one prefill instance until the instance is lost. The decode's
/// outbox reports every prefill inbox whose connection dropped — the process behind it died or
/// restarted, even one restarted on the same port within a second, which a periodic probe would
/// miss and which forgot this decode's registration — and this watcher subscribed to those
/// reports before the instance's first registration went out. Every heartbeat period, every
/// second while a rank is down, at once when a send to a rank failed or its connection dropped,
/// each rank is looked at: a rank whose inbox stops answering, or whose connection dropped,
/// fails every room sent to it (`RankLost`, no `ABORT`: nothing there would acknowledge it) and
/// rooms opened meanwhile fail at once; when the bootstrap server names a new inbox for it (the
/// rank restarted and registered again), or its inbox answers again, this decode registers with
/// it again and new rooms go there. sglang's decode only notices a dead instance by its
/// bootstrap server's `/health`, which a standalone bootstrap server keeps answering.
pub(super) async fn watch_ranks(peer: Arc<Peer>, client: BootstrapClient, topo: Arc<Topology>) {
    let period = peer.cfg.heartbeat_interval.max(Duration::from_secs(2));
    let mut drops = lock(&topo.drops).take();
    let mut last_full = Instant::now();
    loop {
        let any_down = topo.targets().iter().any(|t| !t.up);
        let every = if any_down { DOWN_RECHECK } else { period };
        let wait = every.saturating_sub(last_full.elapsed());
        let dropped = tokio::select! {
            () = tokio::time::sleep(wait) => None,
            () = topo.check.notified() => None,
            r = async {
                match drops.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            } => Some(r),
        };
        if topo.dead.load(Ordering::Relaxed) || peer.stop.load(Ordering::Relaxed) {
            return;
        }
        match dropped {
            Some(Ok(ep)) => {
                let lost: Vec<Target> = topo
                    .targets()
                    .into_iter()
                    .filter(|t| t.up && t.endpoint == ep)
                    .collect();
                if lost.is_empty() {
                    continue;
                }
                for t in lost {
                    rank_lost(
                        &peer,
                        &topo,
                        &t,
                        "its connection dropped (the rank died or restarted)",
                    )
                    .await;
                    if let Some(cur) = lock(&topo.targets)
                        .iter_mut()
                        .find(|c| c.tp_rank == t.tp_rank)
                    {
                        cur.up = false;
                    }
                }
            }
            Some(Err(tokio::sync::broadcast::error::RecvError::Lagged(n))) => {
                tracing::warn!(
                    missed = n,
                    "rank watcher missed connection-drop reports; checking every rank"
                );
            }
            Some(Err(tokio::sync::broadcast::error::RecvError::Closed)) => drops = None,
            None => {}
        }
        last_full = Instant::now();
        check_targets(&peer, &client, &topo).await;
    }
}

/// Fails every room sent to rank `t` (`RankLost`), saying `why`.
async fn rank_lost(peer: &Peer, topo: &Topology, t: &Target, why: &str) {
    tracing::warn!(
        bootstrap_addr = %topo.bootstrap_addr,
        tp_rank = t.tp_rank,
        endpoint = %t.endpoint,
        "prefill rank lost, {why}: its rooms failed; re-resolving its route"
    );
    metrics::counter!("kvx_decode_prefill_ranks_lost_total").increment(1);
    let aborts = peer.handle(
        DecodeEvent::RankLost {
            endpoint: t.endpoint.clone(),
        },
        None,
    );
    peer.send_aborts(aborts).await;
}

/// One look at every target rank (see [`watch_ranks`]).
async fn check_targets(peer: &Peer, client: &BootstrapClient, topo: &Topology) {
    for (i, t) in topo.targets().into_iter().enumerate() {
        let check = check_rank(client, &t).await;
        if t.up && !check.alive {
            rank_lost(peer, topo, &t, "its inbox does not answer").await;
        }
        let endpoint = match check.moved {
            Some(ep) => ep,
            None if !check.alive => {
                if let Some(cur) = lock(&topo.targets).get_mut(i) {
                    cur.up = false;
                }
                continue;
            }
            None if t.up => continue,
            None => t.endpoint.clone(),
        };
        let reg = match wire::encode_registration(&peer.registration(topo.dst_tp_rank)) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "registration not encoded");
                continue;
            }
        };
        match peer.send(&endpoint, reg).await {
            Ok(()) => {
                tracing::info!(
                    bootstrap_addr = %topo.bootstrap_addr,
                    tp_rank = t.tp_rank,
                    %endpoint,
                    previous = %t.endpoint,
                    "prefill rank back: registered with it again"
                );
                metrics::counter!("kvx_decode_prefill_reregistrations_total").increment(1);
                if let Some(cur) = lock(&topo.targets).get_mut(i) {
                    cur.endpoint = endpoint;
                    cur.up = true;
                }
            }
            Err(e) => {
                tracing::warn!(tp_rank = t.tp_rank, %endpoint, error = %e, "registration with the restarted prefill rank not sent");
                if let Some(cur) = lock(&topo.targets).get_mut(i) {
                    cur.up = false;
                }
            }
        }
    }
}

/// A room held this long is reported at info with what it waits for.
const STUCK_AFTER: Duration = Duration::from_secs(5);
/// A room still held is reported again this often.
const STUCK_REPEAT: Duration = Duration::from_secs(30);

/// Logs at info each room held longer than [`STUCK_AFTER`] (again every [`STUCK_REPEAT`]):
/// its state, its prefill instance, the ranks it sent to and those that reported Success so
/// far, so an operator sees why a room does not finish (a rank that never answers, a prefill
/// that has not started the room) before its waiting timeout.
fn log_stuck_rooms(peer: &Peer, now: Instant) {
    let waiting = lock(&peer.rooms).waiting(now, STUCK_AFTER);
    let mut logged = lock(&peer.stuck_logged);
    logged.retain(|room, _| waiting.iter().any(|w| w.room == *room));
    metrics::gauge!("kvx_decode_rooms_stuck").set(waiting.len() as f64);
    for w in waiting {
        if logged
            .get(&w.room)
            .is_some_and(|t| now.saturating_duration_since(*t) < STUCK_REPEAT)
        {
            continue;
        }
        logged.insert(w.room, now);
        let endpoints: Vec<String> = w.endpoints.iter().map(ToString::to_string).collect();
        let state = match (w.status, w.metadata_sent) {
            (KVPoll::Bootstrapping, _) => "resolving the prefill instance",
            (_, false) => "sending its metadata",
            _ => "waiting for the prefill ranks' status",
        };
        tracing::info!(
            room = %w.room,
            status = match w.status {
                KVPoll::Bootstrapping => "bootstrapping",
                _ => "waiting_for_input",
            },
            waited_s = w.elapsed.as_secs_f64().round(),
            bootstrap_addr = %w.bootstrap_addr,
            prefill_ranks = %endpoints.join(","),
            succeeded_ranks = ?w.responded,
            required = w.required,
            "room waiting: {state}"
        );
    }
}

/// How often the ticker logs stuck rooms and refreshes the gauges.
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// Gives the room manager the time when its earliest deadline is due (`poll_timeout()`, woken
/// early when a new deadline comes before it) and sends its `ABORT`s; once a second it logs
/// stuck rooms and refreshes the gauges.
pub(super) async fn ticker(peer: Arc<Peer>) {
    let mut last_stuck = Instant::now();
    loop {
        let next = lock(&peer.rooms).poll_timeout();
        let house = last_stuck + HOUSEKEEPING;
        let wake = next.map_or(house, |n| n.min(house));
        tokio::select! {
            () = tokio::time::sleep_until(wake.into()) => {}
            () = peer.deadline_moved.notified() => continue,
        }
        let now = Instant::now();
        if next.is_some_and(|n| n <= now) {
            let aborts = peer.handle(DecodeEvent::Tick, None);
            peer.send_aborts(aborts).await;
        }
        if now < house {
            continue;
        }
        last_stuck = now;
        log_stuck_rooms(&peer, now);
        metrics::gauge!("kvx_decode_room_entries").set(lock(&peer.rooms).live_entries() as f64);
        if let Some(st) = &peer.stager {
            let (rooms, allocations, fenced) = st.counts();
            metrics::gauge!("kvx_decode_staging_rooms").set(rooms as f64);
            metrics::gauge!("kvx_decode_staging_allocations").set(allocations as f64);
            metrics::gauge!("kvx_decode_staging_fenced_rooms").set(fenced as f64);
        }
    }
}
