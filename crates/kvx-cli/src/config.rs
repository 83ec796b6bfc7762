//! Command-line flags of the `kvx` binary; environment variables mirror sglang's knobs.
//!
//! Every flag that has an sglang counterpart reads the same environment variable
//! (`SGLANG_DISAGGREGATION_*`), so a deployment's environment configures kvx the same way. Every
//! flag can also come from a TOML file (`--config kvx.toml`, see [`mod@file`]): command line >
//! environment variable > file > default.

pub mod file;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::telemetry::LogFormat;
use crate::validate::{self, ConfigError, HostPort};
use kvx_engine::model::ModelPreset;

/// kvx: KV-cache transfer engine for prefill/decode-disaggregated serving (sglang-compatible).
#[derive(Debug, Parser)]
#[command(name = "kvx", version, about)]
pub struct Cli {
    /// Read flags from this TOML file (keys are long flags without `--`; global flags at the
    /// top level, each subcommand's in its table: `[prefill]`, `[decode]`, …). The command line
    /// and environment variables win over it.
    #[arg(long, global = true, env = "KVX_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log line format on stderr: `text` (colour only on a terminal) or `json` (one object per
    /// line).
    #[arg(
        long,
        global = true,
        env = "KVX_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one prefill rank (optionally with the bootstrap server) on a synthetic model.
    Prefill(PrefillArgs),
    /// Run a decode peer that generates load against a prefill instance and verifies every byte.
    Decode(DecodeArgs),
    /// Run the standalone bootstrap server.
    Bootstrap(BootstrapArgs),
    /// Bootstrap server, one prefill rank and one decode peer in one process over loopback.
    Demo(DemoArgs),
    /// Link test, sending side: write blocks into a `kvx recv` peer and report GB/s.
    Send(SendArgs),
    /// Link test, receiving side: accept writes from `kvx send`.
    Recv(RecvArgs),
}

/// The synthetic model's shape.
#[derive(Clone, Debug, Args)]
pub struct ModelArgs {
    /// Model shape preset.
    #[arg(long, value_enum, default_value = "llama3-8b")]
    pub model: ModelPreset,
    /// Attention tensor-parallel size.
    #[arg(long, default_value_t = 1, value_parser = validate::count_u32)]
    pub tp_size: u32,
    /// Attention tensor-parallel rank of this process.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u32,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16, value_parser = validate::count_u64)]
    pub page_size: u64,
    /// KV pages in this process's pool (page 0 is reserved).
    #[arg(long, default_value_t = 640, value_parser = validate::count_u64)]
    pub pool_pages: u64,
    /// KV cache dtype string advertised to decodes (must match theirs).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
}

impl ModelArgs {
    /// Checks across the model flags: the rank below the size, a page besides page 0, a page
    /// size that fits the wire's 32 bits.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate::rank_in_range("--tp-rank", self.tp_rank, "--tp-size", self.tp_size)?;
        if self.pool_pages < 2 {
            return Err(ConfigError::Invalid {
                flag: "--pool-pages",
                value: self.pool_pages.to_string(),
                why: "is too small (expected >= 2: page 0 is reserved)".into(),
            });
        }
        if u32::try_from(self.page_size).is_err() {
            return Err(ConfigError::Invalid {
                flag: "--page-size",
                value: self.page_size.to_string(),
                why: "is too large (expected <= 4294967295)".into(),
            });
        }
        Ok(())
    }
}

/// How a long-running command stops on SIGINT or SIGTERM.
#[derive(Clone, Debug, Args)]
pub struct LifecycleArgs {
    /// Seconds a drain may take after SIGINT/SIGTERM: rooms in flight finish or are failed
    /// (with the reason sent to their peers) within it, then the process exits 0. A second
    /// signal exits at once.
    #[arg(
        long,
        env = "KVX_SHUTDOWN_TIMEOUT",
        default_value_t = 10.0,
        value_parser = validate::seconds
    )]
    pub shutdown_timeout: f64,
}

impl Default for LifecycleArgs {
    fn default() -> Self {
        LifecycleArgs {
            shutdown_timeout: 10.0,
        }
    }
}

/// The RDMA device of `--backend verbs` (ignored by the other backends).
#[derive(Clone, Debug, Args)]
pub struct RdmaArgs {
    /// RDMA device for `--backend verbs` (`mlx5_0`, `rxe0`; `ibv_devices` lists them); default:
    /// the first device.
    #[arg(long, env = "KVX_RDMA_DEVICE")]
    pub rdma_device: Option<String>,
    /// Physical port of the RDMA device (from 1).
    #[arg(
        long,
        env = "KVX_RDMA_PORT",
        default_value_t = 1,
        value_parser = clap::value_parser!(u8).range(1..)
    )]
    pub rdma_port: u8,
    /// GID index of the RDMA port (default: the first RoCE v2 GID, else 0).
    #[arg(long, env = "KVX_RDMA_GID_INDEX")]
    pub rdma_gid_index: Option<u32>,
}

impl Default for RdmaArgs {
    fn default() -> Self {
        RdmaArgs {
            rdma_device: None,
            rdma_port: 1,
            rdma_gid_index: None,
        }
    }
}

impl RdmaArgs {
    /// The data plane's form of these flags.
    pub fn options(&self) -> kvx_engine::plane::RdmaOptions {
        kvx_engine::plane::RdmaOptions {
            device: self.rdma_device.clone().filter(|d| !d.is_empty()),
            port: self.rdma_port,
            gid_index: self.rdma_gid_index,
        }
    }
}

/// Staging for heterogeneous attention TP (spec §6): both sides must agree on the grid.
#[derive(Clone, Debug, Args)]
pub struct StagingArgs {
    /// Move KV between different attention-TP sizes through the decode's staging ring (one
    /// gathered write per chunk) instead of per-token head slices. Needed on both sides.
    #[arg(long, env = "SGLANG_DISAGG_STAGING_BUFFER", value_parser = validate::sglang_bool)]
    pub staging: bool,
    /// Tokens per prefill chunk; the staging chunk grid is cut from it (must match the other
    /// side's).
    #[arg(long, default_value_t = 8192)]
    pub chunked_prefill_size: i64,
}

/// Flags of `kvx prefill` (a repeated flag: the last one wins).
#[derive(Clone, Debug, Args)]
#[command(args_override_self = true)]
pub struct PrefillArgs {
    /// Synthetic model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Bootstrap server host to register with (and to bind with --serve-bootstrap).
    #[arg(long, default_value = "127.0.0.1")]
    pub bootstrap_host: String,
    /// Bootstrap server port (sglang's --disaggregation-bootstrap-port).
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// Also serve the bootstrap HTTP server (with /metrics) in this process.
    #[arg(long)]
    pub serve_bootstrap: bool,
    /// Host this rank binds its ZMQ inbox on and advertises.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// ZMQ inbox port (0: random).
    #[arg(long, default_value_t = 0)]
    pub inbox_port: u16,
    /// Serve /metrics on this port (when not serving the bootstrap server).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Transfer queues (= worker threads); chunks of a room stay on one queue, in order, and one
    /// decode's rooms spread over all of them.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_QUEUE_SIZE",
        default_value_t = 4,
        value_parser = validate::count
    )]
    pub queues: usize,
    /// Seconds a room may stay in Bootstrapping before it fails.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
        default_value_t = 300.0,
        value_parser = validate::seconds
    )]
    pub bootstrap_timeout: f64,
    /// Most writes per transfer batch (a batch of small writes — head slices, page size 1 —
    /// spans several tcp windows, so it keeps every connection busy).
    #[arg(long, default_value_t = 32 * 1024, value_parser = validate::count)]
    pub max_batch_ops: usize,
    /// About the most bytes per transfer batch, in MiB.
    #[arg(long, default_value_t = 64, value_parser = validate::count_u64)]
    pub max_batch_mib: u64,
    /// Pages per chunk the synthetic forward pass hands over.
    #[arg(long, default_value_t = 32, value_parser = validate::count)]
    pub chunk_pages: usize,
    /// Fraction of page-list breaks in the prefill's source pages (0: contiguous, 1: scattered).
    #[arg(long, default_value_t = 0.5, value_parser = validate::fraction)]
    pub fragmentation: f64,
    /// Restart a transfer worker that died instead of stopping the process (exit code 70).
    #[arg(long)]
    pub restart_workers: bool,
    /// Data-plane backend: `auto` (per decode session: Mooncake TE's protocol for an sglang
    /// decode, kvx's tcp for a kvx decode, decided from what the session's port answers),
    /// `tcp` or `mooncake` to force one, `verbs` (RDMA, a kvx decode with `--backend verbs`),
    /// `shm` (a kvx decode with `--backend shm` on this host, through /dev/shm).
    #[arg(long, default_value = "auto", value_parser = sending_backend)]
    pub backend: kvx_engine::plane::Backend,
    /// RDMA device (with `--backend verbs`).
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Data-plane connections per decode session.
    #[arg(long, default_value_t = 2, value_parser = validate::count)]
    pub connections: usize,
    /// Staging.
    #[command(flatten)]
    pub staging: StagingArgs,
    /// Seconds a staged chunk may wait for ring space before its room fails.
    #[arg(long, default_value_t = 60.0, value_parser = validate::seconds)]
    pub staging_wait_timeout: f64,
    /// Send aux rows as AUX_DATA messages over ZMQ instead of writing them.
    #[arg(long, env = "SGLANG_MOONCAKE_SEND_AUX_TCP", value_parser = validate::sglang_bool)]
    pub aux_over_tcp: bool,
    /// Microseconds the rank's loop keeps polling for its next input after one, before it
    /// sleeps (0: sleep at once; saves CPU, costs latency).
    #[arg(
        long,
        default_value_t = kvx_engine::engine::DEFAULT_LOOP_SPIN_US,
        value_parser = clap::value_parser!(u64).range(0..=10_000)
    )]
    pub loop_spin_us: u64,
    /// Drain on SIGINT/SIGTERM.
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    /// Seconds between checks that the bootstrap server still routes this rank (it registers
    /// again when the server restarted or dropped it).
    #[arg(long, default_value_t = 5.0, value_parser = validate::seconds)]
    pub reregister_interval: f64,
    /// With --serve-bootstrap: seconds between health checks of the registered ranks (a rank
    /// whose inbox and /health fail two checks in a row is dropped).
    #[arg(long, default_value_t = 5.0, value_parser = validate::seconds)]
    pub rank_health_interval: f64,
}

impl PrefillArgs {
    /// Checks across the flags (before anything is bound).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()
    }
}

/// Flags of `kvx decode` (a repeated flag: the last one wins).
#[derive(Clone, Debug, Args)]
#[command(args_override_self = true)]
pub struct DecodeArgs {
    /// Synthetic model (must match the prefill's).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Bootstrap server of the prefill instance, `host:port`.
    #[arg(long, default_value = "127.0.0.1:8998", value_parser = validate::host_port)]
    pub bootstrap_addr: HostPort,
    /// Host this decode binds its ZMQ inbox and data plane on and advertises.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Data-plane backend: `tcp` (kvx's protocol), `mooncake` (a Mooncake-TE-compatible
    /// target, so that an unmodified sglang prefill writes into this decode), `verbs` (RDMA
    /// WRITE from a kvx prefill with `--backend verbs`), `shm` (pages in /dev/shm files a kvx
    /// prefill on this host with `--backend shm` copies into).
    #[arg(long, default_value = "tcp", value_parser = receiving_backend)]
    pub backend: kvx_engine::plane::Backend,
    /// RDMA device (with `--backend verbs`).
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Requests (rooms) to run.
    #[arg(long, default_value_t = 32, value_parser = validate::count)]
    pub requests: usize,
    /// Prompt tokens per request (the low end when --prompt-tokens-max is set).
    #[arg(long, default_value_t = 1024, value_parser = validate::count_u64)]
    pub prompt_tokens: u64,
    /// Draw prompt lengths uniformly from [--prompt-tokens, this].
    #[arg(long)]
    pub prompt_tokens_max: Option<u64>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4, value_parser = validate::count)]
    pub concurrency: usize,
    /// Fraction of page-list breaks in the destination pages (0: contiguous, 1: scattered).
    #[arg(long, default_value_t = 0.5, value_parser = validate::fraction)]
    pub fragmentation: f64,
    /// Seconds a room may wait for its KV before it fails and an ABORT is sent.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
        default_value_t = 300.0,
        value_parser = validate::seconds
    )]
    pub waiting_timeout: f64,
    /// Seconds between /health heartbeats (at least 2, as sglang).
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
        default_value_t = 5.0,
        value_parser = validate::seconds
    )]
    pub heartbeat_interval: f64,
    /// Consecutive heartbeat failures before the prefill is declared dead.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
        default_value_t = 2,
        value_parser = validate::count_u32
    )]
    pub heartbeat_max_failure: u32,
    /// Seconds an ABORTed room's pages wait for every prefill rank's ABORT_ACK (sent once the
    /// rank's writes drained) before they are reused anyway.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT",
        default_value_t = 30.0,
        value_parser = validate::seconds
    )]
    pub abort_release_timeout: f64,
    /// Seconds a ZMQ send toward a prefill may block.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT",
        default_value_t = 1.0,
        value_parser = validate::seconds
    )]
    pub zmq_send_timeout: f64,
    /// Seed for room ids and page placement (random when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Use rooms N, N+1, … instead of random ones (as a router hands them to both sides).
    #[arg(long)]
    pub room_base: Option<u64>,
    /// Write a JSON summary (counts of succeeded/failed/verified rooms, bytes, latencies) here.
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Never draw a progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// Serve Prometheus /metrics on this port while the run lasts.
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Staging.
    #[command(flatten)]
    pub staging: StagingArgs,
    /// Size of the staging ring in MiB (with --staging).
    #[arg(
        long,
        env = "SGLANG_DISAGG_STAGING_POOL_SIZE_MB",
        default_value_t = 4096,
        value_parser = validate::count_u64
    )]
    pub staging_ring_mib: u64,
    /// Drain on SIGINT/SIGTERM.
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
}

impl DecodeArgs {
    /// Checks across the flags and the summary path (before anything is bound or sent).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        if let Some(max) = self.prompt_tokens_max
            && max < self.prompt_tokens
        {
            return Err(ConfigError::Invalid {
                flag: "--prompt-tokens-max",
                value: max.to_string(),
                why: format!("is below --prompt-tokens {}", self.prompt_tokens),
            });
        }
        if let Some(p) = &self.summary_json {
            validate::writable("--summary-json", p)?;
        }
        Ok(())
    }
}

/// Flags of `kvx bootstrap`.
#[derive(Clone, Debug, Args)]
pub struct BootstrapArgs {
    /// Host to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (sglang's default 8998).
    #[arg(long, default_value_t = 8998)]
    pub port: u16,
    /// Drain on SIGINT/SIGTERM.
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    /// Seconds between health checks of the registered ranks (a rank whose inbox and /health
    /// fail two checks in a row is dropped).
    #[arg(long, default_value_t = 5.0, value_parser = validate::seconds)]
    pub rank_health_interval: f64,
}

/// Flags of `kvx demo` (a repeated flag: the last one wins).
#[derive(Clone, Debug, Args)]
#[command(args_override_self = true)]
pub struct DemoArgs {
    /// Synthetic model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Rooms to transfer.
    #[arg(long, default_value_t = 32, value_parser = validate::count)]
    pub rooms: usize,
    /// Prompt tokens per room.
    #[arg(long, default_value_t = 1024, value_parser = validate::count_u64)]
    pub prompt_tokens: u64,
    /// Rooms in flight at once.
    #[arg(long, default_value_t = 4, value_parser = validate::count)]
    pub concurrency: usize,
    /// Transfer queues on the prefill.
    #[arg(
        long,
        env = "SGLANG_DISAGGREGATION_QUEUE_SIZE",
        default_value_t = 4,
        value_parser = validate::count
    )]
    pub queues: usize,
    /// Pages per chunk the synthetic forward pass hands over.
    #[arg(long, default_value_t = 32)]
    pub chunk_pages: usize,
    /// Fraction of page-list breaks on both sides.
    #[arg(long, default_value_t = 0.5, value_parser = validate::fraction)]
    pub fragmentation: f64,
    /// Write the decode's JSON summary here.
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Data-plane backend: `tcp`, `mooncake` (the decodes are Mooncake-TE-compatible targets,
    /// the prefills write with the Mooncake TE protocol), `auto` (the prefills decide per
    /// session; the decodes serve kvx's tcp), `local` (memcpy between the two sides of this
    /// process), `shm` (as `local`, the decodes' pages in /dev/shm files), `verbs` (RDMA).
    #[arg(long, value_enum, default_value = "tcp")]
    pub backend: kvx_engine::plane::Backend,
    /// RDMA device (with `--backend verbs`).
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Decode attention-TP size (default: `--tp-size`); all prefill and decode ranks run in
    /// this process.
    #[arg(long, value_parser = validate::count_u32)]
    pub decode_tp: Option<u32>,
    /// Staging (used when the two TP sizes differ).
    #[command(flatten)]
    pub staging: StagingArgs,
    /// Size of each decode rank's staging ring in MiB (with --staging).
    #[arg(long, default_value_t = 1024, value_parser = validate::count_u64)]
    pub staging_ring_mib: u64,
    /// Drain on SIGINT/SIGTERM.
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
}

impl DemoArgs {
    /// Checks across the flags and the summary path (before anything is bound).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        if let Some(p) = &self.summary_json {
            validate::writable("--summary-json", p)?;
        }
        Ok(())
    }
}

/// Flags of `kvx send`.
#[derive(Clone, Debug, Args)]
pub struct SendArgs {
    /// The `kvx recv` peer, `host:port`.
    #[arg(long, default_value = "127.0.0.1:5201")]
    pub to: String,
    /// Bytes per write (block size).
    #[arg(long, default_value_t = 1 << 20, value_parser = validate::count_u64)]
    pub size: u64,
    /// Writes per batch (one completion per batch).
    #[arg(long, default_value_t = 64, value_parser = validate::count)]
    pub batch: usize,
    /// Parallel connections.
    #[arg(long, default_value_t = 1, value_parser = validate::count)]
    pub connections: usize,
    /// Batches in flight at once (1: each write waits for the previous one's completion, so
    /// the reported percentiles are the round-trip latency of one batch).
    #[arg(long, default_value_t = 2, value_parser = validate::count)]
    pub depth: usize,
    /// Total bytes to send, in MiB (per block size of a sweep; `--duration` instead bounds by
    /// time).
    #[arg(long, default_value_t = 4096, value_parser = validate::count_u64)]
    pub total_mib: u64,
    /// Send for this many seconds (per block size) instead of `--total-mib`, like iperf3's `-t`.
    #[arg(long, value_parser = validate::seconds)]
    pub duration: Option<f64>,
    /// Print a line every this many seconds (bytes, GB/s, batch latency p50/p99); 0: none.
    #[arg(long, default_value = "1", value_parser = validate::interval)]
    pub interval: f64,
    /// Block-size sweep: one run per size, comma separated (`4K,64K,1M`), in place of `--size`.
    #[arg(long, value_delimiter = ',', value_parser = validate::byte_count)]
    pub sizes: Vec<u64>,
    /// Print one JSON document (every run, its intervals and latency percentiles) on stdout
    /// instead of text.
    #[arg(long)]
    pub json: bool,
    /// Data-plane backend: `tcp` (a `kvx recv` peer), `mooncake` (a Mooncake TE target or
    /// `kvx recv --backend mooncake`; `--to` is its session id), `auto`, `verbs` (a `kvx recv
    /// --backend verbs`), or `shm` (a `kvx recv --backend shm` on this host; `--to` is
    /// `local:<name>`, or `host:port` for the name `kvx-link-<port>`).
    #[arg(long, default_value = "tcp", value_parser = sending_backend)]
    pub backend: kvx_engine::plane::Backend,
    /// RDMA device (with `--backend verbs`).
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Never draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// Flags of `kvx recv`.
#[derive(Clone, Debug, Args)]
pub struct RecvArgs {
    /// Address to listen on, `host:port`.
    #[arg(long, default_value = "127.0.0.1:5201")]
    pub listen: String,
    /// Bytes of the receive region (writes land at `offset % region`).
    #[arg(long, default_value_t = 64 << 20, value_parser = validate::count_u64)]
    pub region: u64,
    /// Print the bytes received (and the rate) every this many seconds while any arrive; 0:
    /// only the total at the end.
    #[arg(long, default_value = "1", value_parser = validate::interval)]
    pub interval: f64,
    /// Print JSON lines (one object per interval and one for the total) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Data-plane backend: `tcp`, `mooncake` (a Mooncake-TE-compatible target on the host
    /// of `--listen`, random ports; it prints its session id), `verbs` (queue-pair handshakes
    /// on `--listen`), or `shm` (the region in /dev/shm, published as `local:<name>`: `--listen`
    /// is the name, or `host:port` for `kvx-link-<port>`).
    #[arg(long, default_value = "tcp", value_parser = receiving_backend)]
    pub backend: kvx_engine::plane::Backend,
    /// RDMA device (with `--backend verbs`).
    #[command(flatten)]
    pub rdma: RdmaArgs,
}

/// Parses a sending side's `--backend` (`auto`, `tcp`, `mooncake`, `verbs`, `shm`).
fn sending_backend(s: &str) -> Result<kvx_engine::plane::Backend, String> {
    use kvx_engine::plane::Backend;
    match s {
        "auto" => Ok(Backend::Auto),
        "tcp" => Ok(Backend::Tcp),
        "mooncake" => Ok(Backend::Mooncake),
        "verbs" => Ok(Backend::Verbs),
        "shm" => Ok(Backend::Shm),
        _ => Err(format!(
            "unknown backend {s:?} (expected auto, tcp, mooncake, verbs or shm; local only with \
             `kvx demo`)"
        )),
    }
}

/// Parses a receiving side's `--backend` (`tcp`, `mooncake`, `verbs`, `shm`).
fn receiving_backend(s: &str) -> Result<kvx_engine::plane::Backend, String> {
    use kvx_engine::plane::Backend;
    match s {
        "tcp" => Ok(Backend::Tcp),
        "mooncake" => Ok(Backend::Mooncake),
        "verbs" => Ok(Backend::Verbs),
        "shm" => Ok(Backend::Shm),
        _ => Err(format!(
            "unknown backend {s:?} (expected tcp, mooncake, verbs or shm; local only with \
             `kvx demo`)"
        )),
    }
}

impl Command {
    /// The data-plane backend this command selected and its RDMA device (`None` for `kvx
    /// bootstrap`), for [`kvx_engine::plane::check_backend`] before anything is bound.
    pub fn backend(&self) -> Option<(kvx_engine::plane::Backend, kvx_engine::plane::RdmaOptions)> {
        match self {
            Command::Prefill(a) => Some((a.backend, a.rdma.options())),
            Command::Decode(a) => Some((a.backend, a.rdma.options())),
            Command::Demo(a) => Some((a.backend, a.rdma.options())),
            Command::Send(a) => Some((a.backend, a.rdma.options())),
            Command::Recv(a) => Some((a.backend, a.rdma.options())),
            Command::Bootstrap(_) => None,
        }
    }
}
