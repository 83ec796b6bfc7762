//! The data plane as the drivers use it: a `kvx-rdma` transport plus the regions registered
//! with it, kept together so the memory outlives its registration.
//!
//! A [`DataPlane`] owns `Arc`s of the regions it registered and deregisters them when dropped,
//! before the regions can be freed. The decode's plane listens (its endpoint is the session id it
//! sends); the prefill's is send-only. A prefill's default plane is `auto`: per decode session it
//! speaks Mooncake TE's protocol to an sglang decode and kvx's tcp protocol to a kvx decode.
//!
//! Every [`Backend`] is reachable from the binary. `verbs` (RDMA; cargo feature `verbs`, on by
//! default) opens the device named by [`RdmaOptions`]; [`check_backend`] runs before anything is
//! bound, so a host without a device fails at startup with a [`BackendError`] naming the flag.
//! `shm` is the same-host backend across processes: the decode's memory lives in `/dev/shm` files
//! ([`alloc_region`]) that it lists in a host file, and a prefill on the host maps them and
//! copies into them (`kvx-rdma`'s `local` backend, which `local` uses within one process).
//!
//! Device memory ([`Region::from_raw_device`]) is registered with
//! [`Transport::register_device`]; only `verbs` accepts it (a GPUDirect-RDMA capable NIC and the
//! kernel's `nvidia-peermem`; untested by kvx). Every other backend moves bytes with the CPU and
//! refuses before anything is registered, with
//! [`TransportError::DeviceMemoryUnsupported`] naming the backend and saying that device memory
//! needs `verbs`.

use std::sync::{Arc, Mutex};

use std::time::Duration;

use kvx_rdma::{
    AutoTransport, LocalTransport, MooncakeConfig, MooncakeTransport, RegionKey, Session,
    TcpConfig, TcpTransport, Transport, TransportError,
};

use crate::region::Region;

/// A transport with the regions registered on it.
pub struct DataPlane {
    transport: Arc<dyn Transport>,
    sessions: SessionSource,
    keys: Vec<RegionKey>,
    _regions: Vec<Arc<Region>>,
    /// Regions registered after start ([`DataPlane::register_late`]), with their keys.
    late: Mutex<Vec<(RegionKey, Arc<Region>)>>,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane")
            .field("kind", &self.transport.kind())
            .field("endpoint", &self.transport.endpoint())
            .finish()
    }
}

/// Where [`DataPlane::open_session`] gets sessions the caller owns alone.
enum SessionSource {
    /// The transport's shared, cached sessions.
    Cached,
    Tcp(Arc<TcpTransport>),
    Mooncake(Arc<MooncakeTransport>),
    Auto(Arc<AutoTransport>),
}

/// Which `kvx-rdma` backend a plane uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Backend {
    /// Sending: per peer, Mooncake TE's protocol when the peer's port answers it (an sglang
    /// decode), else kvx's tcp. Receiving: kvx's tcp.
    Auto,
    /// kvx's framed TCP protocol (any two hosts).
    #[default]
    Tcp,
    /// Mooncake Transfer Engine's P2P handshake and TCP transport (sglang's peers).
    Mooncake,
    /// memcpy into the peer's memory (both sides in one process).
    Local,
    /// RDMA WRITE over RC queue pairs (`--rdma-device`; both sides kvx).
    Verbs,
    /// memcpy across processes of one host: the receiver's memory lives in `/dev/shm` files.
    Shm,
}

impl Backend {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Tcp => "tcp",
            Backend::Mooncake => "mooncake",
            Backend::Local => "local",
            Backend::Verbs => "verbs",
            Backend::Shm => "shm",
        }
    }
}

/// The verbs backend's device selection (`--rdma-device`, `--rdma-port`, `--rdma-gid-index`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaOptions {
    /// Device name (`mlx5_0`, `rxe0`); `None` takes the first device.
    pub device: Option<String>,
    /// Physical port, from 1.
    pub port: u8,
    /// GID index; `None` picks the first RoCE v2 GID, else index 0.
    pub gid_index: Option<u32>,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            device: None,
            port: 1,
            gid_index: None,
        }
    }
}

/// Why a backend cannot run on this host or build; each message names the flag to change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// `--backend verbs` on a host without a usable RDMA device.
    #[error(
        "--backend verbs: no RDMA device found on this host ({reason}); run on a host with an \
         RDMA NIC or Soft-RoCE (`ibv_devices` lists them), or choose another --backend (tcp)"
    )]
    NoRdmaDevice {
        /// What libibverbs said.
        reason: String,
    },
    /// `--rdma-device` names a device this host does not have.
    #[error(
        "--rdma-device {name} (KVX_RDMA_DEVICE): no such RDMA device on this host (it has: \
         {available})"
    )]
    RdmaDeviceNotFound {
        /// The requested name.
        name: String,
        /// The devices that exist, comma separated.
        available: String,
    },
    /// `--backend verbs` in a binary built without the `verbs` feature.
    #[error(
        "--backend verbs: this kvx was built without the `verbs` feature (build it with \
         `cargo build -p kvx-cli --features verbs`, the default)"
    )]
    VerbsNotBuilt,
    /// `--backend shm` where `/dev/shm` is unusable.
    #[error("--backend shm: {dir} is not a writable directory on this host ({source})")]
    NoShm {
        /// The directory.
        dir: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// The local name another live process of this host already publishes.
    #[error(
        "--backend shm: the name {name:?} is already published by process {pid} on this host \
         ({file})"
    )]
    ShmNameInUse {
        /// The name.
        name: String,
        /// The live owner.
        pid: u32,
        /// Its host file.
        file: String,
    },
    /// A `--to`/`--listen` value that names no shm peer.
    #[error(
        "{flag} {value:?}: with --backend shm, expected local:<name>, <name> \
         ([A-Za-z0-9._-]) or host:port (name kvx-link-<port>)"
    )]
    BadShmName {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
    },
}

/// Checks, before anything is bound, that `backend` can run here: for `verbs`, that the binary
/// has it and that libibverbs lists a device (the one `rdma.device` names, when set); for
/// `shm`, that `/dev/shm` is a writable directory. Other backends always pass.
pub fn check_backend(backend: Backend, rdma: &RdmaOptions) -> Result<(), BackendError> {
    match backend {
        Backend::Verbs => check_verbs(rdma),
        Backend::Shm => {
            let dir = kvx_rdma::shm::SHM_DIR;
            let probe = std::path::Path::new(dir).join(format!(
                ".kvx-probe-{}-{}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::write(&probe, b"")
                .and_then(|()| std::fs::remove_file(&probe))
                .map_err(|source| BackendError::NoShm { dir, source })
        }
        Backend::Auto | Backend::Tcp | Backend::Mooncake | Backend::Local => Ok(()),
    }
}

#[cfg(feature = "verbs")]
fn check_verbs(rdma: &RdmaOptions) -> Result<(), BackendError> {
    let names = kvx_rdma::verbs::discover().map_err(|e| match e {
        kvx_rdma::verbs::VerbsError::NoDevice { reason } => BackendError::NoRdmaDevice { reason },
        other => BackendError::NoRdmaDevice {
            reason: other.to_string(),
        },
    })?;
    match &rdma.device {
        Some(want) if !names.iter().any(|n| n == want) => Err(BackendError::RdmaDeviceNotFound {
            name: want.clone(),
            available: names.join(", "),
        }),
        _ => Ok(()),
    }
}

#[cfg(not(feature = "verbs"))]
fn check_verbs(_rdma: &RdmaOptions) -> Result<(), BackendError> {
    Err(BackendError::VerbsNotBuilt)
}

#[cfg(feature = "verbs")]
fn verbs_config(rdma: &RdmaOptions, listen: Option<String>) -> kvx_rdma::verbs::VerbsConfig {
    kvx_rdma::verbs::VerbsConfig {
        device: kvx_rdma::verbs::DeviceConfig {
            name: rdma.device.clone(),
            port: rdma.port,
            gid_index: rdma.gid_index,
        },
        listen,
        ..kvx_rdma::verbs::VerbsConfig::default()
    }
}

#[cfg(feature = "verbs")]
fn verbs_error(e: kvx_rdma::verbs::VerbsError) -> TransportError {
    kvx_rdma::verbs::session::to_transport_error(e, "")
}

#[cfg(not(feature = "verbs"))]
fn verbs_not_built() -> TransportError {
    TransportError::NoDevice(BackendError::VerbsNotBuilt.to_string())
}

/// A region of `len` zeroed bytes for a receiving plane on `backend`: for `shm`, in the new file
/// `/dev/shm/<name>-<part>-<pid>` (removed when the region and its plane are gone; a killed
/// process leaves it behind, `rm /dev/shm/kvx-*-<pid>` removes it); otherwise on the heap.
pub fn alloc_region(
    backend: Backend,
    name: &str,
    part: &str,
    len: usize,
) -> Result<Region, TransportError> {
    match backend {
        Backend::Shm => Region::new_shm(&format!("{name}-{part}-{}", std::process::id()), len),
        _ => Ok(Region::new(len)),
    }
}

/// The local name a link test (`kvx send --to`, `kvx recv --listen`) uses with `--backend shm`:
/// `local:<name>` or `<name>` as given, or `kvx-link-<port>` for `host:port` (so that the two
/// commands' defaults meet).
pub fn shm_link_name(flag: &'static str, value: &str) -> Result<String, BackendError> {
    let bad = || BackendError::BadShmName {
        flag,
        value: value.to_owned(),
    };
    let name = value.strip_prefix(kvx_rdma::local::SCHEME).unwrap_or(value);
    if kvx_rdma::shm::valid_name(name) {
        return Ok(name.to_owned());
    }
    match value.rsplit_once(':') {
        Some((_, port)) if port.parse::<u16>().is_ok() => Ok(format!("kvx-link-{port}")),
        _ => Err(bad()),
    }
}

/// Fails when a live process of this host already publishes `name` (its host file names a pid
/// that still runs); a file left by a dead process is replaced.
fn check_shm_name_free(name: &str) -> Result<(), BackendError> {
    let file = format!("{}/kvx-local-{name}.desc", kvx_rdma::shm::SHM_DIR);
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(());
    };
    match kvx_rdma::local::hostfile::HostFile::parse(&text) {
        Ok(h)
            if h.pid != std::process::id()
                && std::path::Path::new(&format!("/proc/{}", h.pid)).exists() =>
        {
            Err(BackendError::ShmNameInUse {
                name: name.to_owned(),
                pid: h.pid,
                file,
            })
        }
        _ => Ok(()),
    }
}

/// How long the `auto` backend waits for a peer's answer to its first metadata request.
pub const AUTO_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The mooncake backend's settings for `connections` connections per peer.
pub fn mooncake_config(connections: usize) -> MooncakeConfig {
    MooncakeConfig {
        connections: connections.max(1),
        ..MooncakeConfig::default()
    }
}

/// The environment variable holding the kvx tcp shared secret (off when unset): a receiver with
/// one answers a hello without it with no descriptor; a sender sends it in its hello. Set it on
/// both sides. It keeps stray peers out; it travels in clear, so it is no defence against an
/// eavesdropper.
pub const TCP_SECRET_ENV: &str = "KVX_TCP_SECRET";

/// The tcp backend's settings for `connections` connections per peer, with the shared secret of
/// [`TCP_SECRET_ENV`] when set (an empty or over-long one, more than 256 bytes, is refused).
pub fn tcp_config(connections: usize) -> Result<TcpConfig, TransportError> {
    let secret = match std::env::var_os(TCP_SECRET_ENV) {
        None => None,
        Some(v) => {
            let bytes = v.into_encoded_bytes();
            let secret = kvx_rdma::SharedSecret::new(&bytes).ok_or_else(|| TransportError::Io {
                kind: std::io::ErrorKind::InvalidInput,
                detail: format!(
                    "{TCP_SECRET_ENV} must hold 1 to 256 bytes (it holds {})",
                    bytes.len()
                ),
            })?;
            Some(secret)
        }
    };
    Ok(TcpConfig {
        connections: connections.max(1),
        secret,
        ..TcpConfig::default()
    })
}

impl DataPlane {
    /// Registers `regions` with `transport`.
    pub fn new(
        transport: Arc<dyn Transport>,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        if regions.iter().any(|r| r.is_device()) && !transport.accepts_device_memory() {
            // Before registering anything: the backend's CPU would read and write the bytes.
            return Err(TransportError::DeviceMemoryUnsupported {
                backend: transport.kind(),
            });
        }
        let mut keys = Vec::with_capacity(regions.len());
        for r in &regions {
            let key = if r.is_device() {
                // SAFETY: `from_raw_device`'s contract keeps the device range allocated while
                // the region lives, and this plane keeps its `Arc` until after `Drop`
                // deregistered it; the transport accepts device memory (checked above: `verbs`),
                // so it never touches the range from the CPU.
                unsafe { transport.register_device(r.base(), r.len()) }
            } else {
                // SAFETY: the region is live host memory (its own allocation, a mapping, or
                // caller memory under `from_raw`'s contract) held through the `Arc` this plane
                // keeps until after `Drop` deregisters it; its bytes are interior-mutable
                // (`UnsafeCell`), so peers and the transport may write them from other threads.
                unsafe { transport.register(r.base(), r.len()) }
            };
            match key {
                Ok(k) => keys.push(k),
                Err(e) => {
                    for k in keys {
                        let _ = transport.deregister(k);
                    }
                    return Err(e);
                }
            }
        }
        Ok(DataPlane {
            transport,
            sessions: SessionSource::Cached,
            keys,
            _regions: regions,
            late: Mutex::new(Vec::new()),
        })
    }

    /// A send-only tcp plane (a prefill rank).
    pub fn tcp_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = TcpTransport::client(tcp_config(connections)?);
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Tcp(t);
        Ok(plane)
    }

    /// A send-only plane that picks the protocol per peer (a prefill rank's default).
    pub fn auto_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = AutoTransport::client(
            tcp_config(connections)?,
            mooncake_config(connections),
            AUTO_PROBE_TIMEOUT,
        );
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Auto(t);
        Ok(plane)
    }

    /// A send-only Mooncake TE initiator plane.
    pub fn mooncake_client(
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = MooncakeTransport::client(mooncake_config(connections));
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Mooncake(t);
        Ok(plane)
    }

    /// A Mooncake-TE-compatible target on `host` (its endpoint is `host:rpc_port`, the session
    /// id an sglang prefill dials).
    pub async fn mooncake_server(
        host: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = MooncakeTransport::bind(host, mooncake_config(connections)).await?;
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Mooncake(t);
        Ok(plane)
    }

    /// A listening tcp plane on `addr` (a decode rank, a link-test receiver).
    pub async fn tcp_server(
        addr: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = TcpTransport::bind(addr, tcp_config(connections)?).await?;
        let mut plane = DataPlane::new(t.clone(), regions)?;
        plane.sessions = SessionSource::Tcp(t);
        Ok(plane)
    }

    /// A session to `peer` owned by the caller alone (tcp, mooncake, auto: not cached by the
    /// transport), so that dropping it closes its connections; the local, shm and verbs
    /// backends share their cached session.
    pub async fn open_session(&self, peer: &str) -> Result<Arc<dyn Session>, TransportError> {
        match &self.sessions {
            SessionSource::Tcp(t) => Ok(Arc::new(t.open_session(peer).await?)),
            SessionSource::Mooncake(t) => Ok(Arc::new(t.open_session(peer).await?)),
            SessionSource::Auto(t) => t.open_session(peer).await,
            SessionSource::Cached => self.transport.connect(peer).await,
        }
    }

    /// A sending plane on `backend` (`name` names a local or shm transport), verbs on the first
    /// RDMA device ([`DataPlane::client_with`] picks one).
    pub fn client(
        backend: Backend,
        name: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        DataPlane::client_with(backend, &RdmaOptions::default(), name, connections, regions)
    }

    /// A sending plane on `backend` (`name` names a local or shm transport; `rdma` selects the
    /// verbs device).
    pub fn client_with(
        backend: Backend,
        rdma: &RdmaOptions,
        name: &str,
        connections: usize,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        match backend {
            Backend::Auto => DataPlane::auto_client(connections, regions),
            Backend::Tcp => DataPlane::tcp_client(connections, regions),
            Backend::Mooncake => DataPlane::mooncake_client(connections, regions),
            Backend::Local | Backend::Shm => DataPlane::new(LocalTransport::new(name)?, regions),
            Backend::Verbs => DataPlane::verbs_client(rdma, regions),
        }
    }

    /// A send-only verbs plane on the device `rdma` names.
    #[cfg(feature = "verbs")]
    pub fn verbs_client(
        rdma: &RdmaOptions,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = kvx_rdma::verbs::VerbsTransport::client(verbs_config(rdma, None))
            .map_err(verbs_error)?;
        DataPlane::new(Arc::new(t), regions)
    }

    /// Without the `verbs` feature: always an error saying so.
    #[cfg(not(feature = "verbs"))]
    pub fn verbs_client(
        _rdma: &RdmaOptions,
        _regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        Err(verbs_not_built())
    }

    /// A listening verbs plane: queue-pair handshakes on `addr` (`host:port`, port 0 for any),
    /// on the device `rdma` names.
    #[cfg(feature = "verbs")]
    pub async fn verbs_server(
        addr: &str,
        rdma: &RdmaOptions,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        let t = kvx_rdma::verbs::VerbsTransport::open(verbs_config(rdma, Some(addr.to_owned())))
            .await
            .map_err(verbs_error)?;
        DataPlane::new(Arc::new(t), regions)
    }

    /// Without the `verbs` feature: always an error saying so.
    #[cfg(not(feature = "verbs"))]
    pub async fn verbs_server(
        _addr: &str,
        _rdma: &RdmaOptions,
        _regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        Err(verbs_not_built())
    }

    /// A receiving shm plane published as `local:<name>` to this host: every region must live
    /// in `/dev/shm` ([`alloc_region`] with [`Backend::Shm`]); they are listed in the host file
    /// `/dev/shm/kvx-local-<name>.desc`, which senders of other processes map.
    pub fn shm_server(name: &str, regions: Vec<Arc<Region>>) -> Result<DataPlane, TransportError> {
        check_shm_name_free(name).map_err(|e| TransportError::Io {
            kind: std::io::ErrorKind::AddrInUse,
            detail: e.to_string(),
        })?;
        let t = LocalTransport::new(name)?;
        let mut keys = Vec::with_capacity(regions.len());
        if regions.iter().any(|r| r.is_device()) {
            return Err(TransportError::DeviceMemoryUnsupported { backend: "shm" });
        }
        for r in &regions {
            let shm = r.shm_region().ok_or_else(|| TransportError::Registration {
                addr: r.base(),
                len: r.len(),
                detail: "the shm backend serves only /dev/shm memory (Region::new_shm)".into(),
            })?;
            keys.push(t.register_shm(shm.clone())?);
        }
        Ok(DataPlane {
            transport: t,
            sessions: SessionSource::Cached,
            keys,
            _regions: regions,
            late: Mutex::new(Vec::new()),
        })
    }

    /// A receiving plane on `backend` ([`DataPlane::server_with`]), verbs on the first RDMA
    /// device.
    pub async fn server(
        backend: Backend,
        host: &str,
        name: &str,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        DataPlane::server_with(backend, &RdmaOptions::default(), host, name, regions).await
    }

    /// A receiving plane on `backend`: tcp (also for `auto`) listens on `host:0`; mooncake
    /// binds a handshake and a data port on `host`; verbs listens for queue-pair handshakes on
    /// `host:0`; local publishes `name` in this process, shm to the host (its regions must come
    /// from [`alloc_region`]).
    pub async fn server_with(
        backend: Backend,
        rdma: &RdmaOptions,
        host: &str,
        name: &str,
        regions: Vec<Arc<Region>>,
    ) -> Result<DataPlane, TransportError> {
        match backend {
            Backend::Auto | Backend::Tcp => {
                DataPlane::tcp_server(&format!("{host}:0"), 1, regions).await
            }
            Backend::Mooncake => DataPlane::mooncake_server(host, 1, regions).await,
            Backend::Local => DataPlane::new(LocalTransport::new(name)?, regions),
            Backend::Shm => DataPlane::shm_server(name, regions),
            Backend::Verbs => DataPlane::verbs_server(&format!("{host}:0"), rdma, regions).await,
        }
    }

    /// Registers one more host region with the running plane (memory allocated on first use,
    /// such as a transfer queue's staging buffer); it is deregistered with the others when the
    /// plane is dropped, and the plane keeps it alive until then.
    pub fn register_late(&self, region: Arc<Region>) -> Result<(), TransportError> {
        if region.is_device() {
            return Err(TransportError::DeviceMemoryUnsupported {
                backend: self.transport.kind(),
            });
        }
        // SAFETY: the region is live host memory held through the `Arc` this plane keeps until
        // after `Drop` deregisters it; its bytes are interior-mutable (`UnsafeCell`).
        let key = unsafe { self.transport.register(region.base(), region.len()) }?;
        self.late
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((key, region));
        Ok(())
    }

    /// Deregisters `region`, which [`DataPlane::register_late`] registered, and lets go of it
    /// (nothing is done for a region it does not hold). No batch reading or writing it may be in
    /// flight.
    pub fn deregister_late(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        let mut late = self
            .late
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(i) = late.iter().position(|(_, r)| Arc::ptr_eq(r, region)) else {
            return Ok(());
        };
        self.transport.deregister(late[i].0)?;
        late.swap_remove(i);
        Ok(())
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// What peers use to reach this side (the decode's session id).
    pub fn endpoint(&self) -> String {
        self.transport.endpoint()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        let late = self.late.get_mut().unwrap_or_else(|p| p.into_inner());
        for (k, _) in late.iter() {
            let _ = self.transport.deregister(*k);
        }
        for k in self.keys.drain(..) {
            let _ = self.transport.deregister(k);
        }
    }
}
