//! `kvx prefill`: one prefill rank on a synthetic model, registered with a bootstrap server.
//!
//! Optionally serves the bootstrap server itself (with `/metrics` on its port), registers the
//! rank with `PUT /route` (sglang's retries), starts the engine and the synthetic forward pass,
//! and runs until SIGINT/SIGTERM — then it drains (no new room, rooms in flight finish or fail
//! with the reason within `--shutdown-timeout`) and exits 0 — or until a transfer worker dies,
//! in which case it prints the dead-thread error and exits with [`EXIT_WORKER_FAILED`]. `/ready`
//! answers 200 only once the rank is registered and its inbox and data plane are bound.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kvx_bootstrap::http::{
    BootstrapClient, BootstrapServer, RankRegistration, Registration, RetryPolicy, ServerConfig,
};

use crate::config::{ModelArgs, PrefillArgs};
use crate::lifecycle::{Deadline, Readiness, Signals};
use crate::telemetry;
use crate::validate;
use kvx_engine::engine::{PrefillConfig, PrefillEngine};
use kvx_engine::fault::EXIT_WORKER_FAILED;
use kvx_engine::pages::PageAllocator;
use kvx_engine::synthetic::{SyntheticModel, prefill_memory};

/// The `PUT /route` body of a TP-only prefill rank of the model `m` with its inbox at
/// `ip:port` ([`kvx_engine::engine::rank_registration`]); [`run`] sets `prefill_http_port` to
/// [`prefill_http_port`].
pub fn rank_registration(m: &ModelArgs, ip: &str, port: u16) -> RankRegistration {
    kvx_engine::engine::rank_registration(
        (m.tp_size, m.tp_rank),
        m.page_size,
        &m.kv_cache_dtype,
        ip,
        port,
    )
}

/// What `kvx prefill` registers as `prefill_http_port` (sglang: the prefill's HTTP API port on
/// the bootstrap host, where a 0.5.23 decode would POST `/generate` to rebootstrap a request).
/// kvx has no generation API; the HTTP ports it does serve are `/metrics` on `--metrics-port`
/// (this rank's own listener, preferred) and, with `--serve-bootstrap`, the bootstrap server
/// (`/route`, `/health`, `/metrics`). `None` when it serves neither. Pass the ports as bound.
pub fn prefill_http_port(metrics: Option<u16>, bootstrap: Option<u16>) -> Option<u16> {
    metrics.or(bootstrap)
}

/// Starts a prefill rank with its synthetic forward pass on its own thread.
pub fn start_rank(
    args: &PrefillArgs,
    backend: kvx_engine::plane::Backend,
    rt: tokio::runtime::Handle,
) -> Result<Arc<PrefillEngine>> {
    let m = &args.model;
    let layout = m
        .model
        .layout(m.tp_size, m.tp_rank, m.page_size, m.pool_pages);
    let mem = prefill_memory(&layout);
    let cfg = PrefillConfig {
        host: args.host.clone(),
        inbox_port: args.inbox_port,
        bootstrap_port: args.bootstrap_port,
        queues: args.queues.max(1),
        max_batch_ops: args.max_batch_ops.max(1),
        max_batch_bytes: args.max_batch_mib.max(1).saturating_mul(1 << 20),
        bootstrap_timeout: validate::duration(args.bootstrap_timeout),
        restart_workers: args.restart_workers,
        tp_rank: m.tp_rank,
        tp_size: m.tp_size.max(1),
        total_kv_heads: layout.total_kv_heads,
        auto_open: true,
        events: true,
        connect_timeout: Duration::from_secs(5),
        connections: args.connections.max(1),
        page_size: u32::try_from(m.page_size).unwrap_or(u32::MAX),
        backend,
        rdma: args.rdma.options(),
        staging: args.staging.staging,
        chunked_prefill_size: args.staging.chunked_prefill_size,
        staging_wait_timeout: validate::duration(args.staging_wait_timeout),
        aux_over_tcp: args.aux_over_tcp,
        loop_spin: Duration::from_micros(args.loop_spin_us),
    };
    let model = SyntheticModel {
        layout,
        kv: mem.kv.clone(),
        aux: mem.aux.clone(),
        chunk_pages: args.chunk_pages.max(1),
        pages: PageAllocator::new(m.pool_pages, args.fragmentation, 0x5eed),
    };
    let engine =
        Arc::new(PrefillEngine::start(cfg, mem, rt).context("starting the prefill engine")?);
    let events = engine
        .take_events()
        .context("engine event stream unavailable")?;
    let e = engine.clone();
    std::thread::Builder::new()
        .name("kvx-forward".into())
        .spawn(move || model.run(&e, events))?;
    Ok(engine)
}

/// The socket address to bind for `host:port`, resolving a name; the error names `flag`.
pub fn listen_addr(host: &str, port: u16, flag: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs as _;
    (host.trim_matches(['[', ']']), port)
        .to_socket_addrs()
        .with_context(|| format!("{flag} {host}: not an address this host can bind"))?
        .next()
        .with_context(|| format!("{flag} {host}: resolves to no address"))
}

/// Extra margin after `--shutdown-timeout` for the rooms failed at the deadline to drain their
/// batches (each is cancelled; what is in flight completes or errors).
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// `kvx prefill`.
pub fn run(args: PrefillArgs) -> Result<i32> {
    telemetry::install_metrics();
    telemetry::zero_counters(telemetry::Role::Prefill);
    let stop = Signals::install("prefill")?;
    let ready = Readiness::new("starting");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let engine = start_rank(&args, args.backend, rt.handle().clone()).with_context(|| {
        format!(
            "--host {} --inbox-port {}: binding the rank's ZMQ inbox and data plane",
            args.host, args.inbox_port
        )
    })?;
    let registered = rt.block_on(async {
        let mut http_ports = (None, None);
        let server = if args.serve_bootstrap {
            let (host, port) = (args.bootstrap_host.as_str(), args.bootstrap_port);
            let s = BootstrapServer::bind_with(
                (host, port),
                ServerConfig {
                    rank_health_interval: Some(validate::duration(args.rank_health_interval)),
                    ..ServerConfig::default()
                },
                telemetry::metrics_router().merge(ready.router()),
            )
            .await
            .with_context(|| {
                format!(
                    "--bootstrap-port {port}: binding the bootstrap server on {host}:{port} \
                     (--bootstrap-host)"
                )
            })?;
            eprintln!(
                "kvx prefill: bootstrap server on http://{} (/route, /health, /ready, /metrics)",
                s.local_addr()
            );
            http_ports.1 = Some(s.local_addr().port());
            Some(s)
        } else {
            None
        };
        if let Some(p) = args.metrics_port {
            let addr = listen_addr(&args.host, p, "--host")?;
            let bound = telemetry::serve(addr, telemetry::ops_router(&ready))
                .await
                .with_context(|| format!("--metrics-port {p}: binding {addr}"))?;
            eprintln!("kvx prefill: metrics on http://{bound}/metrics (and /ready, /health)");
            http_ports.0 = Some(bound.port());
        }
        let client = BootstrapClient::new(&args.bootstrap_host, args.bootstrap_port)?;
        let mut reg =
            rank_registration(&args.model, &engine.endpoint().host, engine.endpoint().port);
        reg.prefill_http_port = prefill_http_port(http_ports.0, http_ports.1);
        ready.not_ready("registering with the bootstrap server");
        let policy = RetryPolicy::sglang();
        let registered = tokio::select! {
            r = client.register_rank(&reg, &policy) => Some(r),
            _ = stop.wait() => None,
        };
        anyhow::Ok((server, registered, reg.prefill_http_port))
    })?;
    let (server, registered, http_port) = registered;
    let bootstrap = format!("{}:{}", args.bootstrap_host, args.bootstrap_port);
    let attempted = registered.is_some();
    match registered {
        Some(Ok(_)) => {
            ready.set_ready();
            eprintln!(
                "kvx prefill: rank {} inbox tcp://{} registered with the bootstrap server at \
                 {bootstrap}: ready",
                args.model.tp_rank,
                engine.endpoint()
            );
        }
        Some(Err(e)) => {
            ready.not_ready(&format!("not registered with the bootstrap server: {e}"));
            tracing::error!(error = %e, %bootstrap, "rank not registered with the bootstrap server");
            eprintln!(
                "kvx prefill: rank {} inbox tcp://{} NOT registered with the bootstrap server at \
                 {bootstrap} ({e}): decodes cannot find it; /ready answers 503",
                args.model.tp_rank,
                engine.endpoint()
            );
        }
        None => {}
    }
    // The bootstrap server may restart (a standalone one, or the rank serving it) or drop this
    // rank: the rank checks it is still routed and registers again, so the instance does not
    // answer 503 until every rank restarts.
    let keeper = attempted.then(|| {
        let mut reg =
            rank_registration(&args.model, &engine.endpoint().host, engine.endpoint().port);
        reg.prefill_http_port = http_port;
        rt.spawn(keep_registered(
            args.bootstrap_host.clone(),
            args.bootstrap_port,
            reg,
            validate::duration(args.reregister_interval),
            ready.clone(),
        ))
    });
    let timeout = validate::duration(args.lifecycle.shutdown_timeout);
    let code = rt.block_on(async {
        let fatal = wait_fatal(engine.clone());
        let sig = tokio::select! {
            sig = stop.wait() => sig,
            err = fatal => {
                if let Ok(err) = err {
                    eprintln!("{err}");
                }
                return EXIT_WORKER_FAILED;
            }
        };
        if let Some(k) = &keeper {
            k.abort();
        }
        let code = drain(&engine, &ready, sig, timeout).await;
        if let Some(s) = server {
            // /health answered until now, so decodes' heartbeats saw a live prefill while it drained.
            if tokio::time::timeout(DRAIN_GRACE, s.shutdown())
                .await
                .is_err()
            {
                tracing::warn!("bootstrap server: connections still open at exit");
            }
        }
        code
    });
    engine.shutdown();
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(code)
}

/// Checks every `interval` that the bootstrap server at `host:port` routes this rank to its
/// inbox, and registers it again (one `PUT /route`) when not — the server restarted empty, or
/// dropped the rank as unhealthy. Logs each re-registration at info and counts it
/// (`kvx_prefill_reregistrations_total`); `/ready` turns 200 once registered. Runs until
/// aborted.
async fn keep_registered(
    host: String,
    port: u16,
    reg: RankRegistration,
    interval: Duration,
    ready: Readiness,
) {
    let client = match BootstrapClient::new(&host, port) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "bootstrap client not built: no re-registration");
            return;
        }
    };
    let bootstrap = format!("{host}:{port}");
    let (mut reachable, mut taken) = (true, false);
    loop {
        tokio::time::sleep(interval).await;
        match client.ensure_registered(&reg, RE_REGISTER_TIMEOUT).await {
            Ok(Registration::Present) => {}
            Ok(Registration::Registered) => {
                metrics::counter!("kvx_prefill_reregistrations_total").increment(1);
                tracing::info!(
                    %bootstrap,
                    tp_rank = reg.attn_tp_rank,
                    inbox = %format!("{}:{}", reg.rank_ip, reg.rank_port),
                    "rank registered again with the bootstrap server"
                );
                ready.set_ready();
            }
            Ok(Registration::Taken(other)) if !std::mem::replace(&mut taken, true) => {
                tracing::warn!(
                    %bootstrap,
                    tp_rank = reg.attn_tp_rank,
                    other = %format!("{}:{}", other.rank_ip, other.rank_port),
                    "the bootstrap server routes this rank to another inbox (a newer process?)"
                );
                continue;
            }
            Ok(Registration::Taken(_)) => continue,
            Err(e) => {
                if reachable {
                    tracing::warn!(%bootstrap, error = %e, "bootstrap server unreachable; will register again when it is back");
                }
                reachable = false;
                continue;
            }
        }
        (reachable, taken) = (true, false);
    }
}

/// Timeout of one re-registration request.
const RE_REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

/// Resolves with the rank's fatal worker error (polled off the runtime, so it never keeps the
/// process alive: the thread exits once the receiver is gone).
fn wait_fatal(
    engine: Arc<PrefillEngine>,
) -> tokio::sync::oneshot::Receiver<Arc<kvx_engine::fault::TransferThreadFailed>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("kvx-fatal-wait".into())
        .spawn(move || {
            while !tx.is_closed() {
                if let Some(err) = engine.wait_fatal(Duration::from_millis(200)) {
                    let _ = tx.send(err);
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "fatal-error watcher not started");
    }
    rx
}

/// The prefill's drain: `/ready` says draining, no new room starts (the forward pass fails
/// every room it has not started, with the reason, so its decodes are told at once), rooms in
/// flight finish; those still open after `timeout` are failed with the reason (their decodes
/// get status 0 once their batches drained). Every queued status then goes out. Exit code 0,
/// or 70 when a worker died meanwhile.
async fn drain(
    engine: &Arc<PrefillEngine>,
    ready: &Readiness,
    sig: &str,
    timeout: Duration,
) -> i32 {
    ready.set_draining();
    let reason = format!("prefill shutting down ({sig})");
    engine.begin_drain(&reason);
    eprintln!(
        "kvx prefill: {sig}: draining {} rooms for at most {:.1} s (a second signal exits at once)",
        engine.live_rooms(),
        timeout.as_secs_f64()
    );
    let mut deadline = Deadline::after(timeout);
    let mut forced = false;
    loop {
        if let Some(err) = engine.wait_fatal(Duration::ZERO) {
            eprintln!("{err}");
            return EXIT_WORKER_FAILED;
        }
        if engine.live_rooms() == 0 {
            break;
        }
        if deadline.passed() {
            if forced {
                tracing::warn!(
                    rooms = engine.live_rooms(),
                    "drain: rooms still held at exit"
                );
                break;
            }
            let e = engine.clone();
            let why = format!("{reason}: room still in flight after --shutdown-timeout");
            let n = tokio::task::spawn_blocking(move || e.fail_open_rooms(&why))
                .await
                .unwrap_or(0);
            tracing::warn!(
                rooms = n,
                "drain: --shutdown-timeout passed, open rooms failed"
            );
            forced = true;
            deadline = Deadline::after(DRAIN_GRACE);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let e = engine.clone();
    let _ = tokio::task::spawn_blocking(move || e.flush(DRAIN_GRACE)).await;
    eprintln!("kvx prefill: drained; exiting");
    0
}
