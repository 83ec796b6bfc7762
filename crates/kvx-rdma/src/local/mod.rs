//! The `local` backend: same-process and same-host transfers by plain memcpy into the peer's
//! registered memory.
//!
//! Every [`LocalTransport`] is published under a name, reachable as `"local:<name>"`:
//! - in its own process through a process-wide directory (any registered memory);
//! - from other processes on the host through the host file `/dev/shm/kvx-local-<name>.desc`
//!   ([`hostfile`]), which lists the regions registered with [`LocalTransport::register_shm`]
//!   (memory in `/dev/shm` files, see [`crate::shm`]); the sender maps those files.
//!
//! A session copies straight from this side's registered regions into the peer's, after the same
//! checks the tcp receiver makes (source inside a local region, destination inside one of the
//! peer's regions). Large batches are copied on the blocking pool so tokio workers stay free.
//! A copy in this process leases the regions it reads and writes (`crate::mem`'s leases) from
//! its checks to its last byte, so `deregister` and dropping either transport return only once
//! no copy touches the memory concerned.

pub mod hostfile;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kvx_core::TransferOp;

use crate::error::TransportError;
use crate::mem::{self, NoInterrupt, Receiver, RegionTable, Span};
use crate::segment::{RegionDesc, RegionKey, SegmentDescriptor};
use crate::shm::{SHM_DIR, ShmRegion, valid_name};
use crate::transport::{BatchReport, BoxFuture, Session, Transport};
use hostfile::{HostFile, HostRegion};

/// Endpoint prefix of local transports.
pub const SCHEME: &str = "local:";

/// Batches larger than this are copied on the blocking pool.
const INLINE_COPY_MAX: u64 = 1 << 20;

/// What a local transport shares with same-process sessions writing into it.
struct Shared {
    table: RegionTable,
    /// Shared-memory regions registered (kept mapped until the transport is gone).
    shm: Mutex<Vec<(RegionKey, Arc<ShmRegion>)>>,
}

type Directory = Mutex<HashMap<String, Weak<Shared>>>;

fn directory() -> &'static Directory {
    static DIR: OnceLock<Directory> = OnceLock::new();
    DIR.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn host_file_path(name: &str) -> PathBuf {
    PathBuf::from(SHM_DIR).join(format!("kvx-local-{name}.desc"))
}

/// A same-process / same-host transport, reachable as `local:<name>`.
pub struct LocalTransport {
    name: String,
    shared: Arc<Shared>,
}

impl LocalTransport {
    /// Publishes a new local transport under `name` (`[A-Za-z0-9._-]`); fails if a live one in
    /// this process already has it.
    pub fn new(name: &str) -> Result<Arc<Self>, TransportError> {
        if !valid_name(name) {
            return Err(TransportError::Io {
                kind: std::io::ErrorKind::InvalidInput,
                detail: format!("bad local transport name {name:?}"),
            });
        }
        let shared = Arc::new(Shared {
            table: RegionTable::new(),
            shm: Mutex::new(Vec::new()),
        });
        let mut dir = lock(directory());
        dir.retain(|_, w| w.strong_count() > 0);
        if dir.contains_key(name) {
            return Err(TransportError::Io {
                kind: std::io::ErrorKind::AddrInUse,
                detail: format!("local transport {name:?} already exists"),
            });
        }
        dir.insert(name.to_owned(), Arc::downgrade(&shared));
        Ok(Arc::new(LocalTransport {
            name: name.to_owned(),
            shared,
        }))
    }

    /// Registers a shared-memory region and offers it to other processes of this host (through
    /// the host file). The mapping stays alive as long as this transport.
    pub fn register_shm(&self, shm: Arc<ShmRegion>) -> Result<RegionKey, TransportError> {
        let key = self.shared.table.insert(shm.addr(), shm.len() as u64)?;
        lock(&self.shared.shm).push((key, shm));
        self.publish()?;
        Ok(key)
    }

    /// Rewrites the host file from the registered shared regions.
    fn publish(&self) -> Result<(), TransportError> {
        let desc = self.shared.table.descriptor("");
        let shm = lock(&self.shared.shm);
        let mut regions: Vec<HostRegion> = shm
            .iter()
            .filter(|(k, _)| desc.regions.iter().any(|r| r.key == *k))
            .map(|(key, s)| HostRegion {
                desc: RegionDesc {
                    base: s.addr(),
                    len: s.len() as u64,
                    key: *key,
                },
                file: s.name().to_owned(),
            })
            .collect();
        regions.sort_by_key(|r| r.desc.base);
        let text = HostFile {
            pid: std::process::id(),
            regions,
        }
        .encode();
        let path = host_file_path(&self.name);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(TransportError::from)
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        let mut dir = lock(directory());
        if dir
            .get(&self.name)
            .is_some_and(|w| w.as_ptr() == Arc::as_ptr(&self.shared))
        {
            dir.remove(&self.name);
        }
        if !lock(&self.shared.shm).is_empty() {
            let _ = std::fs::remove_file(host_file_path(&self.name));
        }
        // Sessions of this process may still hold the shared table: wait for their copies.
        self.shared.table.close_receive();
    }
}

impl Transport for LocalTransport {
    fn kind(&self) -> &'static str {
        "local"
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        self.shared.table.insert(addr, len)
    }

    /// Forgets a region; returns once no copy of this process reads or writes it.
    fn deregister(&self, key: RegionKey) -> Result<(), TransportError> {
        self.shared.table.deregister(key)?;
        if lock(&self.shared.shm).iter().any(|(k, _)| *k == key) {
            self.publish()?;
        }
        Ok(())
    }

    fn descriptor(&self) -> SegmentDescriptor {
        self.shared.table.descriptor(&self.endpoint())
    }

    fn endpoint(&self) -> String {
        format!("{SCHEME}{}", self.name)
    }

    fn connect<'a>(
        &'a self,
        peer: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Session>, TransportError>> {
        Box::pin(async move {
            let unreachable = |detail: String| TransportError::PeerUnreachable {
                peer: peer.to_owned(),
                detail,
            };
            let name = peer
                .strip_prefix(SCHEME)
                .filter(|n| valid_name(n))
                .ok_or_else(|| unreachable("not a local: endpoint".into()))?;
            let in_process = lock(directory()).get(name).and_then(Weak::upgrade);
            let (desc, target) = match in_process {
                Some(s) => (
                    s.table.descriptor(peer),
                    Target::InProcess(Arc::downgrade(&s)),
                ),
                None => {
                    let host = open_host_peer(name).map_err(unreachable)?;
                    let desc = SegmentDescriptor {
                        endpoint: peer.to_owned(),
                        regions: host.regions.iter().map(|(r, _)| *r).collect(),
                    };
                    (desc, Target::Host(Arc::new(host)))
                }
            };
            Ok(Arc::new(LocalSession {
                inner: Arc::new(SessionInner {
                    peer: peer.to_owned(),
                    desc,
                    local: self.shared.clone(),
                    target,
                }),
            }) as Arc<dyn Session>)
        })
    }
}

/// A peer in another process: its regions and our mappings of their files.
struct HostPeer {
    pid: u32,
    name: String,
    regions: Vec<(RegionDesc, Arc<ShmRegion>)>,
    mapped: RegionTable,
}

fn open_host_peer(name: &str) -> Result<HostPeer, String> {
    let text = std::fs::read_to_string(host_file_path(name))
        .map_err(|e| format!("no such local transport in this process or host ({e})"))?;
    let file = HostFile::parse(&text).map_err(|e| {
        metrics::counter!("kvx_local_bad_host_files_total").increment(1);
        format!("bad host file: {e}")
    })?;
    let mapped = RegionTable::new();
    let mut regions = Vec::with_capacity(file.regions.len());
    for r in file.regions {
        let shm = ShmRegion::open(&r.file).map_err(|e| e.to_string())?;
        if (shm.len() as u64) < r.desc.len {
            return Err(format!("{} is shorter than its region", r.file));
        }
        mapped
            .insert(shm.addr(), r.desc.len)
            .map_err(|e| e.to_string())?;
        regions.push((r.desc, Arc::new(shm)));
    }
    Ok(HostPeer {
        pid: file.pid,
        name: name.to_owned(),
        regions,
        mapped,
    })
}

impl HostPeer {
    fn alive(&self) -> bool {
        PathBuf::from(format!("/proc/{}", self.pid)).exists() && host_file_path(&self.name).exists()
    }

    /// Our span for the peer's `[addr, addr + len)`.
    fn span(&self, addr: u64, len: u64) -> Result<Span, TransportError> {
        let missing = TransportError::RemoteNotRegistered { addr, len };
        let i = self.regions.partition_point(|(r, _)| r.base <= addr);
        let (r, shm) = self
            .regions
            .get(i.checked_sub(1).ok_or(missing.clone())?)
            .ok_or(missing.clone())?;
        if !r.contains(addr, len) {
            return Err(missing);
        }
        self.mapped
            .resolve(shm.addr() + (addr - r.base), len)
            .map_err(|_| TransportError::RemoteNotRegistered { addr, len })
    }
}

enum Target {
    InProcess(Weak<Shared>),
    Host(Arc<HostPeer>),
}

/// Keeps the memory of a copy alive and leased while it runs: the leases (released on drop)
/// and what keeps the peer's table or mappings alive.
struct Guard {
    _leases: Vec<Receiver>,
    _keep: Box<dyn std::any::Any + Send + Sync>,
}

/// A session to a local peer.
struct LocalSession {
    inner: Arc<SessionInner>,
}

struct SessionInner {
    peer: String,
    desc: SegmentDescriptor,
    local: Arc<Shared>,
    target: Target,
}

impl SessionInner {
    /// Checks every op and leases the regions they touch (held by the returned guard).
    fn check(&self, ops: &[TransferOp]) -> Result<(Vec<(Span, Span)>, Guard), TransportError> {
        let mut srcs = Vec::with_capacity(ops.len());
        let src_rx = self.local.table.receiver(Arc::new(NoInterrupt));
        self.local
            .table
            .lease_many(&src_rx, ops.iter().map(|o| (o.src, o.len)), |s| {
                srcs.push(s)
            })?;
        let mut pairs = Vec::with_capacity(ops.len());
        match &self.target {
            Target::InProcess(w) => {
                let remote = w.upgrade().ok_or(TransportError::PeerLost {
                    peer: self.peer.clone(),
                    detail: "local transport dropped".into(),
                })?;
                let dst_rx = remote.table.receiver(Arc::new(NoInterrupt));
                remote
                    .table
                    .lease_many(&dst_rx, ops.iter().map(|o| (o.dst, o.len)), |d| {
                        pairs.push((srcs[pairs.len()], d))
                    })
                    .map_err(|e| match e {
                        TransportError::LocalNotRegistered { addr, len } => {
                            TransportError::RemoteNotRegistered { addr, len }
                        }
                        e => e,
                    })?;
                let guard = Guard {
                    _leases: vec![dst_rx, src_rx],
                    _keep: Box::new(remote),
                };
                Ok((pairs, guard))
            }
            Target::Host(h) => {
                if !h.alive() {
                    return Err(TransportError::PeerLost {
                        peer: self.peer.clone(),
                        detail: format!("process {} or its host file is gone", h.pid),
                    });
                }
                for (op, s) in ops.iter().zip(srcs) {
                    pairs.push((s, h.span(op.dst, op.len)?));
                }
                let guard = Guard {
                    _leases: vec![src_rx],
                    _keep: Box::new(h.clone()),
                };
                Ok((pairs, guard))
            }
        }
    }
}

impl Session for LocalSession {
    fn peer(&self) -> &str {
        &self.inner.peer
    }

    fn remote(&self) -> &SegmentDescriptor {
        &self.inner.desc
    }

    fn is_alive(&self) -> bool {
        match &self.inner.target {
            Target::InProcess(w) => w.strong_count() > 0,
            Target::Host(h) => h.alive(),
        }
    }

    fn write_batch(
        &self,
        ops: Vec<TransferOp>,
    ) -> BoxFuture<'static, Result<BatchReport, TransportError>> {
        let report = BatchReport {
            ops: ops.len() as u64,
            bytes: TransferOp::total_bytes(&ops),
        };
        let inner = self.inner.clone();
        Box::pin(async move {
            // Checked (and leased) when first polled, so a future that is never polled holds
            // no lease that a deregistration would wait for.
            let (pairs, guard) = inner.check(&ops)?;
            let copy_all = move || {
                for (s, d) in pairs {
                    mem::copy(s, d);
                }
                drop(guard);
            };
            if report.bytes > INLINE_COPY_MAX {
                tokio::task::spawn_blocking(copy_all)
                    .await
                    .map_err(|_| TransportError::Closed)?;
            } else {
                copy_all();
            }
            metrics::counter!("kvx_transport_batches_total", "backend" => "local", "result" => "ok")
                .increment(1);
            Ok(report)
        })
    }
}
