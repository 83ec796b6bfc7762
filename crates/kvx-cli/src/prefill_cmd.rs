//! `kvx prefill`: one prefill rank on a synthetic model, registered with a bootstrap server.
//!
//! Optionally serves the bootstrap server itself (with `/metrics` on its port), registers the
//! rank with `PUT /route` (sglang's retries), starts the engine and the synthetic forward pass,
//! and runs until interrupted — or until a transfer worker dies, in which case it prints the
//! dead-thread error and exits with [`EXIT_WORKER_FAILED`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kvx_bootstrap::http::{
    BootstrapClient, BootstrapServer, RankRegistration, RetryPolicy, ServerConfig,
};

use crate::config::{ModelArgs, PrefillArgs};
use crate::engine::{PrefillConfig, PrefillEngine, PrefillMemory};
use crate::fault::EXIT_WORKER_FAILED;
use crate::forward::SyntheticModel;
use crate::model::KvLayout;
use crate::pages::PageAllocator;
use crate::region::Region;
use crate::telemetry;

/// A prefill rank's registered memory for a model.
pub fn prefill_memory(layout: &KvLayout) -> PrefillMemory {
    let kv = Arc::new(Region::new(layout.pool_bytes() as usize));
    let aux = Arc::new(Region::new(layout.aux_bytes() as usize));
    let kv_ptrs = layout.kv_ptrs(kv.base());
    let aux_ptrs = layout.aux_ptrs(aux.base());
    PrefillMemory::new(
        kv,
        kv_ptrs,
        layout.item_len,
        aux,
        aux_ptrs,
        layout.aux_item_lens(),
    )
    .mla(layout.mla)
}

/// The `PUT /route` body of a TP-only prefill rank, in sglang main's form: none of sglang
/// 0.5.23's keys, so a bootstrap server (kvx's or sglang's) keeps serving its decodes the 15-key
/// sentinel both releases' decodes accept (0.5.23's decode defaults the four it adds). The
/// `prefill_http_port` is `None` here; [`run`] sets it to [`prefill_http_port`].
pub fn rank_registration(m: &ModelArgs, ip: &str, port: u16) -> RankRegistration {
    RankRegistration {
        attn_tp_size: m.tp_size.max(1),
        attn_tp_rank: m.tp_rank,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        attn_dp_size: 1,
        attn_dp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        system_dp_size: 1,
        system_dp_rank: 0,
        rank_ip: ip.to_owned(),
        rank_port: port,
        page_size: Some(m.page_size),
        kv_cache_dtype: Some(m.kv_cache_dtype.clone()),
        load_balance_method: Some("follow_bootstrap_room".into()),
        enable_dsa_cache_layer_split: Some(false),
        prefill_http_port: None,
        kv_layout: None,
        dsv41_spec_layout: None,
        enable_kv_cache_sharding: None,
        decode_allocation_policy: None,
    }
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
    backend: crate::plane::Backend,
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
        max_batch_bytes: args.max_batch_mib.max(1) << 20,
        bootstrap_timeout: Duration::from_secs_f64(args.bootstrap_timeout.max(0.0)),
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
        staging: args.staging.staging,
        chunked_prefill_size: args.staging.chunked_prefill_size,
        staging_wait_timeout: Duration::from_secs_f64(args.staging_wait_timeout.max(0.0)),
        aux_over_tcp: args.aux_over_tcp,
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

/// `kvx prefill`.
pub fn run(args: PrefillArgs) -> Result<i32> {
    telemetry::install_metrics();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let engine = start_rank(&args, args.backend, rt.handle().clone())?;
    let _server = rt.block_on(async {
        let mut http_ports = (None, None);
        let server = if args.serve_bootstrap {
            let s = BootstrapServer::bind_with(
                (args.bootstrap_host.as_str(), args.bootstrap_port),
                ServerConfig::default(),
                telemetry::metrics_router(),
            )
            .await
            .context("binding the bootstrap server")?;
            eprintln!("kvx prefill: bootstrap server on http://{}", s.local_addr());
            http_ports.1 = Some(s.local_addr().port());
            Some(s)
        } else {
            None
        };
        if let Some(p) = args.metrics_port {
            let addr: SocketAddr = format!("{}:{p}", args.host).parse()?;
            let bound = telemetry::serve_metrics(addr).await?;
            eprintln!("kvx prefill: metrics on http://{bound}/metrics");
            http_ports.0 = Some(bound.port());
        }
        let client = BootstrapClient::new(&args.bootstrap_host, args.bootstrap_port)?;
        let mut reg =
            rank_registration(&args.model, &engine.endpoint().host, engine.endpoint().port);
        reg.prefill_http_port = prefill_http_port(http_ports.0, http_ports.1);
        if let Err(e) = client.register_rank(&reg, &RetryPolicy::sglang()).await {
            tracing::error!(error = %e, "rank not registered with the bootstrap server");
        }
        anyhow::Ok(server)
    })?;
    eprintln!(
        "kvx prefill: rank {} inbox tcp://{} ready",
        args.model.tp_rank,
        engine.endpoint()
    );
    let waiter = engine.clone();
    let code = rt.block_on(async move {
        let fatal = tokio::task::spawn_blocking(move || {
            loop {
                if let Some(err) = waiter.wait_fatal(Duration::from_secs(3600)) {
                    return err;
                }
            }
        });
        tokio::select! {
            _ = tokio::signal::ctrl_c() => 0,
            err = fatal => {
                match err {
                    Ok(err) => {
                        eprintln!("{err}");
                        EXIT_WORKER_FAILED
                    }
                    Err(_) => EXIT_WORKER_FAILED,
                }
            }
        }
    });
    Ok(code)
}
