//! Device discovery, the protection domain and memory registration.
//!
//! [`discover`] lists the verbs devices, mapping "this host has none" (ENOSYS, EOPNOTSUPP,
//! ENODEV, an empty list) to [`VerbsError::NoDevice`]. [`VerbsDevice::open`] opens one device,
//! allocates its protection domain, reads the limits the planner needs and picks the port's
//! address (LID, GID). Memory is registered once per region ([`VerbsDevice::register`]); the
//! device keeps the lkey table (checked for every source range) and the rkey table (advertised
//! to peers).
//!
//! sideway panics on a few values it does not know (MTU, link layer); this module reads those
//! fields raw and validates them itself, so nothing a device reports can panic the process.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::error::{VerbsError, classify_device_list_error};
use super::regions::{Region, RegionTable};

/// Which device and port to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name (`mlx5_0`); `None` takes the first device.
    pub name: Option<String>,
    /// Physical port, from 1.
    pub port: u8,
    /// GID index; `None` picks the first RoCE v2 GID, else index 0.
    pub gid_index: Option<u32>,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            name: None,
            port: 1,
            gid_index: None,
        }
    }
}

impl DeviceConfig {
    /// The configuration named by `KVX_RDMA_DEVICE` (plus optional `KVX_RDMA_PORT` and
    /// `KVX_RDMA_GID_INDEX`); `None` when `KVX_RDMA_DEVICE` is unset or empty.
    pub fn from_env() -> Option<Self> {
        let name = std::env::var("KVX_RDMA_DEVICE")
            .ok()
            .filter(|s| !s.is_empty())?;
        let port = std::env::var("KVX_RDMA_PORT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        let gid_index = std::env::var("KVX_RDMA_GID_INDEX")
            .ok()
            .and_then(|s| s.parse().ok());
        Some(DeviceConfig {
            name: Some(name),
            port,
            gid_index,
        })
    }
}

/// Names of the verbs devices on this host; [`VerbsError::NoDevice`] when there are none.
pub fn discover() -> Result<Vec<String>, VerbsError> {
    let list = DeviceList::new().map_err(|e| classify_device_list_error(&e.0.into_io()))?;
    let names: Vec<String> = list.iter().map(|d| d.name()).collect();
    if names.is_empty() {
        return Err(VerbsError::NoDevice {
            reason: "ibv_get_device_list: empty list".into(),
        });
    }
    Ok(names)
}

/// Unwraps sideway's error kind into its `io::Error`.
trait IntoIo {
    fn into_io(self) -> std::io::Error;
}

impl IntoIo for sideway::ibverbs::device::GetDeviceListErrorKind {
    fn into_io(self) -> std::io::Error {
        match self {
            sideway::ibverbs::device::GetDeviceListErrorKind::Ibverbs(e) => e,
            #[allow(unreachable_patterns)]
            other => std::io::Error::other(other.to_string()),
        }
    }
}

/// Device limits the planner and the queue pairs respect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// `max_sge` of the device.
    pub max_sge: u32,
    /// `max_qp_wr` of the device.
    pub max_qp_wr: u32,
    /// `max_cqe` of the device.
    pub max_cqe: u32,
    /// `max_mr_size` of the device.
    pub max_mr_size: u64,
}

/// The port address this side announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAddress {
    /// Port number.
    pub port: u8,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// GID.
    pub gid: [u8; 16],
    /// GID index used as the source GID.
    pub gid_index: u8,
    /// Active MTU code (1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// One opened device with its protection domain and registrations.
pub struct VerbsDevice {
    name: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    caps: DeviceCaps,
    addr: PortAddress,
    mrs: Mutex<HashMap<u64, Arc<MemoryRegion>>>,
    lkeys: RwLock<RegionTable>,
    rkeys: RwLock<RegionTable>,
    /// The lkeys of device-memory registrations ([`VerbsDevice::register_device`]): their
    /// ranges are never sent inline (an inline payload is copied by the CPU).
    device_lkeys: RwLock<HashSet<u32>>,
}

impl std::fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDevice")
            .field("name", &self.name)
            .field("caps", &self.caps)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl VerbsDevice {
    /// Opens the configured device, allocates a protection domain, reads limits and the port
    /// address.
    pub fn open(cfg: &DeviceConfig) -> Result<Arc<Self>, VerbsError> {
        let list = DeviceList::new().map_err(|e| classify_device_list_error(&e.0.into_io()))?;
        if list.is_empty() {
            return Err(VerbsError::NoDevice {
                reason: "ibv_get_device_list: empty list".into(),
            });
        }
        let dev = match &cfg.name {
            None => list.get(0),
            Some(want) => list.iter().find(|d| &d.name() == want),
        };
        let Some(dev) = dev else {
            return Err(VerbsError::DeviceNotFound {
                name: cfg.name.clone().unwrap_or_default(),
                available: list.iter().map(|d| d.name()).collect::<Vec<_>>().join(","),
            });
        };
        let name = dev.name();
        let ctx = dev
            .open()
            .map_err(|e| VerbsError::verbs("ibv_open_device", e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| VerbsError::verbs("ibv_alloc_pd", e))?;
        let attr = ctx
            .query_device()
            .map_err(|e| VerbsError::verbs("ibv_query_device_ex", e))?;
        let caps = DeviceCaps {
            max_sge: u32::try_from(attr.max_sge()).unwrap_or(1).max(1),
            max_qp_wr: u32::try_from(attr.max_qp_wr()).unwrap_or(1).max(1),
            max_cqe: u32::try_from(attr.max_cqe()).unwrap_or(1).max(1),
            max_mr_size: attr.max_mr_size(),
        };
        let port_attr = ctx
            .query_port(cfg.port)
            .map_err(|e| VerbsError::verbs("ibv_query_port", e))?;
        // raw fields: sideway's enum conversions panic on unknown values
        let mtu = u8::try_from(port_attr.attr.active_mtu)
            .ok()
            .filter(|m| (1..=5).contains(m))
            .ok_or_else(|| VerbsError::verbs("ibv_query_port", "unknown active MTU"))?;
        let gid_index = match cfg.gid_index {
            Some(i) => i,
            None => pick_gid_index(&ctx, cfg.port, port_attr.attr.gid_tbl_len),
        };
        let gid = ctx
            .query_gid(cfg.port, gid_index)
            .map_err(|e| VerbsError::verbs("ibv_query_gid", e))?;
        let addr = PortAddress {
            port: cfg.port,
            lid: port_attr.attr.lid,
            gid: gid.raw,
            gid_index: u8::try_from(gid_index)
                .map_err(|_| VerbsError::verbs("ibv_query_gid", "gid index above 255"))?,
            mtu,
        };
        tracing::info!(device = %name, ?caps, ?addr, "verbs device opened");
        Ok(Arc::new(VerbsDevice {
            name,
            ctx,
            pd,
            caps,
            addr,
            mrs: Mutex::new(HashMap::new()),
            lkeys: RwLock::new(RegionTable::new()),
            rkeys: RwLock::new(RegionTable::new()),
            device_lkeys: RwLock::new(HashSet::new()),
        }))
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Device limits.
    pub fn caps(&self) -> DeviceCaps {
        self.caps
    }

    /// The port address announced in handshakes.
    pub fn address(&self) -> PortAddress {
        self.addr
    }

    /// The device context.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.ctx
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// Registers `[addr, addr + len)` for local reads and remote writes; returns `(lkey, rkey)`.
    ///
    /// # Safety
    ///
    /// The range must be memory of this process that stays mapped until
    /// [`VerbsDevice::deregister`] returns and no work request touching it is in flight; the
    /// NIC reads and writes it at any time while it is registered.
    pub unsafe fn register(&self, addr: u64, len: u64) -> Result<(u32, u32), VerbsError> {
        // SAFETY: forwarded contract (host memory the caller keeps mapped).
        unsafe { self.register_range(addr, len, false) }
    }

    /// Registers `[addr, addr + len)` of device (GPU) memory for local reads and remote writes,
    /// as [`VerbsDevice::register`] does host memory; returns `(lkey, rkey)`. `ibv_reg_mr`
    /// resolves a GPU pointer only with a GPUDirect-RDMA capable NIC and the kernel's
    /// peer-memory module (`nvidia-peermem`); elsewhere it fails and the error names
    /// `ibv_reg_mr`. Untested by kvx (no such hardware in its CI).
    ///
    /// # Safety
    ///
    /// The range must be device memory of this process that stays allocated until
    /// [`VerbsDevice::deregister`] returns and no work request touching it is in flight.
    pub unsafe fn register_device(&self, addr: u64, len: u64) -> Result<(u32, u32), VerbsError> {
        // SAFETY: forwarded contract (device memory the caller keeps allocated).
        unsafe { self.register_range(addr, len, true) }
    }

    /// The lkeys of the device-memory registrations (never inlined, see [`crate::verbs::post`]).
    pub fn device_lkeys(&self) -> Vec<u32> {
        read(&self.device_lkeys).iter().copied().collect()
    }

    /// # Safety
    ///
    /// See [`VerbsDevice::register`] (`device` false) and [`VerbsDevice::register_device`].
    unsafe fn register_range(
        &self,
        addr: u64,
        len: u64,
        device: bool,
    ) -> Result<(u32, u32), VerbsError> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() || len > self.caps.max_mr_size {
            return Err(VerbsError::BadRegions(
                "null, empty, overflowing or oversized region",
            ));
        }
        let probe = Region {
            base: addr,
            len,
            key: 0,
        };
        // refuse overlaps before asking the device
        RegionTable::from_regions(
            read(&self.lkeys)
                .regions()
                .iter()
                .copied()
                .chain([probe])
                .collect(),
        )?;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
        let len_usize =
            usize::try_from(len).map_err(|_| VerbsError::BadRegions("region too long"))?;
        // SAFETY: the caller guarantees the range is memory of this process (host memory, or
        // device memory when `device`) that outlives the registration (see the contracts of
        // `register` and `register_device`); ibv_reg_mr only pins it and maps it for the NIC
        // (a device range through the kernel's peer-memory module): it forms no CPU pointer
        // into the range and never reads, writes or zeroes it.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len_usize, access) }
            .map_err(|e| VerbsError::verbs("ibv_reg_mr", e))?;
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        write(&self.lkeys).insert(Region {
            base: addr,
            len,
            key: lkey,
        })?;
        write(&self.rkeys).insert(Region {
            base: addr,
            len,
            key: rkey,
        })?;
        self.mrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr, mr);
        if device {
            write(&self.device_lkeys).insert(lkey);
        }
        Ok((lkey, rkey))
    }

    /// Deregisters the region starting at `addr`.
    pub fn deregister(&self, addr: u64) -> Result<(), VerbsError> {
        let mr = self
            .mrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addr);
        if mr.is_none() {
            return Err(VerbsError::BadRegions(
                "no region registered at this address",
            ));
        }
        if let Some(r) = write(&self.lkeys).remove(addr) {
            write(&self.device_lkeys).remove(&r.key);
        }
        write(&self.rkeys).remove(addr);
        Ok(())
    }

    /// Local regions with their lkeys (every source range is resolved here).
    pub fn local_regions(&self) -> RegionTable {
        read(&self.lkeys).clone()
    }

    /// Regions with their rkeys, as advertised to peers.
    pub fn remote_keys(&self) -> RegionTable {
        read(&self.rkeys).clone()
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// The first non-zero RoCE v2 GID of the port, else index 0.
fn pick_gid_index(ctx: &DeviceContext, port: u8, table_len: i32) -> u32 {
    let n = u32::try_from(table_len).unwrap_or(0).min(64);
    (0..n)
        .find(|&i| {
            let non_zero = ctx.query_gid(port, i).is_ok_and(|g| !g.is_zero());
            non_zero && ctx.query_gid_type(port, i).is_ok_and(|t| t == 1)
        })
        .unwrap_or(0)
}
