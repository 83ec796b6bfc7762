//! The `local` backend: same-process transfers by plain memcpy into the peer's registered memory.
//!
//! Every [`LocalTransport`] is published under a name in a process-wide directory; a session to
//! `"local:<name>"` copies straight from this side's registered regions into the peer's, after
//! the same checks the tcp receiver makes (source inside a local region, destination inside one
//! of the peer's live regions). Large batches are copied on the blocking pool so tokio worker
//! threads stay responsive.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kvx_core::TransferOp;

use crate::error::TransportError;
use crate::mem::{self, RegionTable, Span};
use crate::segment::{RegionKey, SegmentDescriptor};
use crate::transport::{BatchReport, BoxFuture, Session, Transport};

/// Endpoint prefix of local transports.
pub const SCHEME: &str = "local:";

/// Batches larger than this are copied on the blocking pool.
const INLINE_COPY_MAX: u64 = 1 << 20;

type Directory = Mutex<HashMap<String, Weak<RegionTable>>>;

fn directory() -> &'static Directory {
    static DIR: OnceLock<Directory> = OnceLock::new();
    DIR.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A same-process transport, reachable as `local:<name>`.
pub struct LocalTransport {
    name: String,
    table: Arc<RegionTable>,
}

impl LocalTransport {
    /// Publishes a new local transport under `name`; fails if a live one already has it.
    pub fn new(name: &str) -> Result<Arc<Self>, TransportError> {
        let table = Arc::new(RegionTable::new());
        let mut dir = directory().lock().unwrap_or_else(|p| p.into_inner());
        dir.retain(|_, w| w.strong_count() > 0);
        if dir.contains_key(name) {
            return Err(TransportError::Io {
                kind: std::io::ErrorKind::AddrInUse,
                detail: format!("local transport {name:?} already exists"),
            });
        }
        dir.insert(name.to_owned(), Arc::downgrade(&table));
        Ok(Arc::new(LocalTransport {
            name: name.to_owned(),
            table,
        }))
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        let mut dir = directory().lock().unwrap_or_else(|p| p.into_inner());
        if dir
            .get(&self.name)
            .is_some_and(|w| w.as_ptr() == Arc::as_ptr(&self.table))
        {
            dir.remove(&self.name);
        }
    }
}

impl Transport for LocalTransport {
    fn kind(&self) -> &'static str {
        "local"
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        self.table.insert(addr, len)
    }

    fn deregister(&self, key: RegionKey) -> Result<(), TransportError> {
        self.table.remove(key)
    }

    fn descriptor(&self) -> SegmentDescriptor {
        self.table.descriptor(&self.endpoint())
    }

    fn endpoint(&self) -> String {
        format!("{SCHEME}{}", self.name)
    }

    fn connect<'a>(
        &'a self,
        peer: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Session>, TransportError>> {
        Box::pin(async move {
            let unreachable = |detail: &str| TransportError::PeerUnreachable {
                peer: peer.to_owned(),
                detail: detail.into(),
            };
            let name = peer
                .strip_prefix(SCHEME)
                .ok_or_else(|| unreachable("not a local: endpoint"))?;
            let remote = directory()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(name)
                .cloned()
                .ok_or_else(|| unreachable("no such local transport"))?;
            let desc = remote
                .upgrade()
                .ok_or_else(|| unreachable("local transport is gone"))?
                .descriptor(peer);
            Ok(Arc::new(LocalSession {
                peer: peer.to_owned(),
                desc,
                local: self.table.clone(),
                remote,
            }) as Arc<dyn Session>)
        })
    }
}

/// A session to a local peer.
struct LocalSession {
    peer: String,
    desc: SegmentDescriptor,
    local: Arc<RegionTable>,
    remote: Weak<RegionTable>,
}

impl LocalSession {
    fn check(&self, ops: &[TransferOp]) -> Result<Vec<(Span, Span)>, TransportError> {
        let remote = self.remote.upgrade().ok_or(TransportError::PeerLost {
            peer: self.peer.clone(),
            detail: "local transport dropped".into(),
        })?;
        let mut pairs = Vec::with_capacity(ops.len());
        let mut srcs = Vec::with_capacity(ops.len());
        self.local
            .resolve_many(ops.iter().map(|o| (o.src, o.len)), |s| srcs.push(s))?;
        remote
            .resolve_many(ops.iter().map(|o| (o.dst, o.len)), |d| {
                pairs.push((srcs[pairs.len()], d))
            })
            .map_err(|e| match e {
                TransportError::LocalNotRegistered { addr, len } => {
                    TransportError::RemoteNotRegistered { addr, len }
                }
                e => e,
            })?;
        Ok(pairs)
    }
}

impl Session for LocalSession {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn remote(&self) -> &SegmentDescriptor {
        &self.desc
    }

    fn is_alive(&self) -> bool {
        self.remote.strong_count() > 0
    }

    fn write_batch(
        &self,
        ops: Vec<TransferOp>,
    ) -> BoxFuture<'static, Result<BatchReport, TransportError>> {
        let report = BatchReport {
            ops: ops.len() as u64,
            bytes: TransferOp::total_bytes(&ops),
        };
        let checked = self.check(&ops);
        Box::pin(async move {
            let pairs = checked?;
            let copy_all = move || {
                for (s, d) in pairs {
                    mem::copy(s, d);
                }
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
