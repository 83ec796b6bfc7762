//! Registered memory: a byte region addressed by virtual address, either allocated and zeroed
//! here or the embedder's own memory — host memory ([`Region::from_raw`]: a serving stack's KV
//! pool, never copied, never freed here) or device memory ([`Region::from_raw_device`]: a GPU KV
//! pool, which the CPU never touches).
//!
//! A region may also live in a `/dev/shm` file ([`Region::new_shm`]): that is the memory a
//! decode offers to prefills on the same host through the `shm` backend.
//!
//! A region is what a rank registers with the data plane: the KV pool, the aux rows. Remote peers
//! name bytes by virtual address (as sglang publishes pointers on the wire); every access here is
//! bounds-checked against the region before a pointer is formed. Remote peers write a region
//! concurrently (that is its purpose), so the safe API never hands out `&[u8]` or `&mut [u8]`:
//! [`Region::copy_in`], [`Region::copy_out`], [`Region::to_vec`] and [`Region::fill`] move bytes
//! through raw pointers. The zero-copy views, [`Region::view`] and [`Region::with_mut`], are
//! `unsafe`: their caller promises the page-ownership contract (a page belongs to one room at a
//! time, is written only by the room's producer — the forward pass on the prefill, the data plane
//! on the decode — and is read only after that write finished).
//!
//! A device region ([`Region::is_device`]) has the same addresses, bounds and registration, but
//! every CPU accessor above refuses it with [`AccessError::Device`] before forming a pointer:
//! only the data plane's NIC (the `verbs` backend) moves its bytes. [`Region::contains`],
//! [`Region::base`] and [`Region::len`] work for both kinds.

use std::cell::UnsafeCell;
use std::sync::Arc;

use kvx_rdma::{ShmRegion, TransportError};

/// Why an address range is not inside a region.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("range {addr:#x}+{len} is outside region {base:#x}+{size}")]
pub struct OutOfBounds {
    /// First byte asked for.
    pub addr: u64,
    /// Bytes asked for.
    pub len: u64,
    /// Region base address.
    pub base: u64,
    /// Region size in bytes.
    pub size: u64,
}

/// Why a CPU access to a region was refused (nothing was read or written).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccessError {
    /// The range is not inside the region.
    #[error(transparent)]
    OutOfBounds(#[from] OutOfBounds),
    /// The region is device memory ([`Region::from_raw_device`]): the CPU never reads or writes
    /// it.
    #[error(
        "range {addr:#x}+{len} of region {base:#x}+{size} is device memory: the CPU does not \
         read or write it"
    )]
    Device {
        /// First byte asked for.
        addr: u64,
        /// Bytes asked for.
        len: u64,
        /// Region base address.
        base: u64,
        /// Region size in bytes.
        size: u64,
    },
}

/// A fixed-size byte region shared between threads: host memory allocated and owned by the
/// region ([`Region::new`]), a `/dev/shm` mapping it owns ([`Region::new_shm`]), the caller's
/// host memory ([`Region::from_raw`]) or the caller's device memory
/// ([`Region::from_raw_device`]); caller memory is never freed here.
pub struct Region {
    /// First byte (the owned box's, the mapping's, or the caller's).
    ptr: *mut u8,
    len: usize,
    /// The allocation when the region owns it (freed on drop); `None` for caller memory.
    owned: Option<Box<[UnsafeCell<u8>]>>,
    /// The shared mapping when the region lives in `/dev/shm` (unmapped and its file removed
    /// once the last holder, this region or a transport it is registered with, lets go).
    shm: Option<Arc<ShmRegion>>,
    /// Device memory ([`Region::from_raw_device`]): no CPU access, ever.
    device: bool,
}

// SAFETY: every access is bounds-checked and goes through raw pointers (to `UnsafeCell` bytes, or
// to a shared mapping no reference is formed to); the safe methods form no references to the
// region's bytes, and the views that do are `unsafe` with the page-ownership contract (documented
// on the module) as their precondition. A device region is never accessed by the CPU at all.
unsafe impl Sync for Region {}
// SAFETY: the region owns its allocation (moving it moves only the box; the heap bytes stay) or its
// shared mapping (an `Arc`; the mapping never moves), or refers to caller memory that `from_raw`'s contract keeps valid wherever the region is used.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.device { ", device" } else { "" };
        write!(f, "Region({:#x}+{}{kind})", self.base(), self.len())
    }
}

impl Region {
    /// A zeroed region of `len` bytes.
    pub fn new(len: usize) -> Self {
        let zeroed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw = Box::into_raw(zeroed) as *mut [UnsafeCell<u8>];
        // SAFETY: `UnsafeCell<u8>` is `repr(transparent)` over `u8`, so the slice layout and the
        // allocation are identical; ownership moves from the first box to the second.
        let bytes: Box<[UnsafeCell<u8>]> = unsafe { Box::from_raw(raw) };
        Region {
            ptr: UnsafeCell::raw_get(bytes.as_ptr()),
            len,
            owned: Some(bytes),
            shm: None,
            device: false,
        }
    }

    /// A zeroed region of `len` bytes in the new file `/dev/shm/<name>` (`[A-Za-z0-9._-]`, which
    /// must not exist), mapped shared, so that another process of this host can map and write it
    /// (the `shm` backend). The file is removed once the region and every transport it was
    /// registered with are dropped.
    pub fn new_shm(name: &str, len: usize) -> Result<Self, TransportError> {
        let shm = Arc::new(ShmRegion::create(name, len)?);
        Ok(Region {
            ptr: shm.addr() as usize as *mut u8,
            len: shm.len(),
            owned: None,
            shm: Some(shm),
            device: false,
        })
    }

    /// Faults every page of a region this process allocated ([`Region::new`],
    /// [`Region::new_shm`]) in now, contents unchanged, as registering memory with an RDMA
    /// device pins it: the first rooms through memory an engine allocated for itself (the
    /// decode's staging ring) then do not pay a page fault per 4 KiB on the data path, and the
    /// process's resident set shows the memory it registered. Caller memory is left alone (its owner decides). An
    /// error (a kernel older than Linux 5.14, no memory) leaves the pages to fault lazily,
    /// which is slower but correct.
    pub fn populate(&self) -> std::io::Result<()> {
        if self.is_borrowed() || self.device || self.len == 0 {
            return Ok(());
        }
        // SAFETY: `sysconf` has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let start = (self.ptr as usize) & !(page - 1);
        let end = (self.ptr as usize + self.len).next_multiple_of(page);
        // SAFETY: `[start, end)` covers only pages holding bytes of this region's own mapping
        // (the first and last page contain its first and last byte), so all of it is mapped;
        // MADV_POPULATE_WRITE faults pages in as a write would but changes no byte.
        let rc = unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The `/dev/shm` mapping behind the region ([`Region::new_shm`]); `None` for heap or
    /// caller memory.
    pub fn shm_region(&self) -> Option<&Arc<ShmRegion>> {
        self.shm.as_ref()
    }

    /// Wraps `len` bytes of the caller's memory at `addr` — a serving stack's own KV pool, aux
    /// rows, state or staging buffers — without copying them; the region never frees them.
    /// `None` for a null address or a range that wraps the address space.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be host memory valid for reads and writes for as long as the
    /// region lives: an engine holds its regions (through `Arc`s) until it has shut down and its
    /// data plane deregistered them, so keep the memory until the engine is dropped. Peers write
    /// it concurrently; code outside kvx must not hold references into pages of a room in flight
    /// (the page-ownership contract of this module). Device memory is not host memory: the
    /// region's methods read and write through the CPU, so only host addresses may be given
    /// here; wrap device memory with [`Region::from_raw_device`].
    /// An engine adds per-room ownership and disjoint ranges: see the contract in
    /// [`crate::engine`] (*Caller-owned memory*).
    pub unsafe fn from_raw(addr: u64, len: usize) -> Option<Region> {
        Self::wrap(addr, len, false)
    }

    /// Wraps `len` bytes of the caller's device memory at `addr` — a serving stack's GPU KV
    /// pool — without copying or touching it; the region never frees it. Every CPU accessor
    /// ([`Region::copy_in`], [`Region::copy_out`], [`Region::to_vec`], [`Region::fill`],
    /// [`Region::view`], [`Region::with_mut`]) refuses it with [`AccessError::Device`];
    /// [`Region::contains`] bounds-checks as for host memory. Only the `verbs` backend
    /// registers it (see [`crate::plane`]); the engines accept it for KV and state, not for aux
    /// rows or with staging. `None` for a null address or a range that wraps the address space.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be device memory of this process (a CUDA allocation, say),
    /// allocated for as long as the region lives: an engine holds its regions until it has shut
    /// down and its data plane deregistered them, so keep the allocation until the engine is
    /// dropped. The engine never touches it from the CPU; the NIC reads and writes it while it
    /// is registered, so the page-ownership contract of this module applies to GPU kernels as
    /// to CPU code (see [`crate::engine`], *Caller-owned memory*).
    pub unsafe fn from_raw_device(addr: u64, len: usize) -> Option<Region> {
        Self::wrap(addr, len, true)
    }

    fn wrap(addr: u64, len: usize, device: bool) -> Option<Region> {
        if addr == 0 || addr.checked_add(len as u64).is_none() {
            return None;
        }
        Some(Region {
            ptr: addr as *mut u8,
            len,
            owned: None,
            shm: None,
            device,
        })
    }

    /// True when the region wraps caller memory ([`Region::from_raw`],
    /// [`Region::from_raw_device`]).
    pub fn is_borrowed(&self) -> bool {
        self.owned.is_none() && self.shm.is_none()
    }

    /// True when the region is device memory ([`Region::from_raw_device`]): the CPU never
    /// reads or writes it.
    pub fn is_device(&self) -> bool {
        self.device
    }

    /// The virtual address of the first byte.
    pub fn base(&self) -> u64 {
        self.ptr as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when `[addr, addr+len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        self.offset_of(addr, len).is_ok()
    }

    fn offset_of(&self, addr: u64, len: u64) -> Result<usize, OutOfBounds> {
        let err = OutOfBounds {
            addr,
            len,
            base: self.base(),
            size: self.len(),
        };
        let off = addr.checked_sub(self.base()).ok_or(err.clone())?;
        let end = off.checked_add(len).ok_or(err.clone())?;
        if end > self.len() {
            return Err(err);
        }
        usize::try_from(off).map_err(|_| err)
    }

    /// Copies `[addr, addr + out.len())` into `out`, through raw pointers (no reference to the
    /// region's bytes is formed; bytes a peer writes meanwhile may arrive torn, old and new
    /// mixed).
    pub fn copy_out(&self, addr: u64, out: &mut [u8]) -> Result<(), AccessError> {
        let src = self.ptr_of(addr, out.len() as u64)?;
        // SAFETY: `src..src+len` lies inside the owned allocation (checked by `ptr_of`); `out` is
        // a distinct, exclusively borrowed buffer, so the ranges do not overlap. The region's
        // bytes are `UnsafeCell`s: reading them through a raw pointer forms no `&[u8]`.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The bytes of `[addr, addr + len)` as a new vector (see [`Region::copy_out`]).
    pub fn to_vec(&self, addr: u64, len: u64) -> Result<Vec<u8>, AccessError> {
        self.ptr_of(addr, len)?;
        let n = usize::try_from(len).map_err(|_| self.oob(addr, len))?;
        let mut v = vec![0u8; n];
        self.copy_out(addr, &mut v)?;
        Ok(v)
    }

    /// Copies `data` to `[addr, addr + data.len())`, through raw pointers (see
    /// [`Region::copy_out`]).
    pub fn copy_in(&self, addr: u64, data: &[u8]) -> Result<(), AccessError> {
        let dst = self.ptr_of(addr, data.len() as u64)?;
        // SAFETY: inside the owned allocation (checked); `data` is a shared borrow of other
        // memory, so no overlap; writing `UnsafeCell` bytes through a raw pointer is allowed.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Sets `[addr, addr + len)` to `byte`.
    pub fn fill(&self, addr: u64, len: u64, byte: u8) -> Result<(), AccessError> {
        let dst = self.ptr_of(addr, len)?;
        // SAFETY: inside the owned allocation (checked by `ptr_of`, which also checked that
        // `len` fits a `usize`); raw-pointer writes to `UnsafeCell` bytes.
        unsafe { std::ptr::write_bytes(dst, byte, len as usize) };
        Ok(())
    }

    /// A shared view of `[addr, addr + len)`, without a copy.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nothing may write the range: no thread of this process
    /// and no peer through the data plane (the page-ownership contract: the range belongs to a
    /// room whose producer finished writing it, and it is not handed to a writer again until
    /// the slice is dropped).
    pub unsafe fn view(&self, addr: u64, len: u64) -> Result<&[u8], AccessError> {
        let start = self.ptr_of(addr, len)?;
        // SAFETY: bounds-checked by `ptr_of`; `UnsafeCell<u8>` has the layout of `u8`; no writer
        // touches the range while the slice lives (the caller's contract above).
        Ok(unsafe { std::slice::from_raw_parts(start, len as usize) })
    }

    /// Runs `f` on an exclusive view of `[addr, addr + len)`, without a copy.
    ///
    /// # Safety
    ///
    /// While `f` runs, nothing else may read or write the range: no other thread of this process
    /// and no peer through the data plane (page ownership: the caller is the range's only
    /// producer, and the data plane reads it only after `f` returned).
    pub unsafe fn with_mut<R>(
        &self,
        addr: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, AccessError> {
        let start = self.ptr_of(addr, len)?;
        // SAFETY: bounds-checked by `ptr_of`; interior mutability through `UnsafeCell`; exclusive
        // access to the range while `f` runs is the caller's contract above.
        let slice = unsafe { std::slice::from_raw_parts_mut(start, len as usize) };
        Ok(f(slice))
    }

    fn oob(&self, addr: u64, len: u64) -> OutOfBounds {
        OutOfBounds {
            addr,
            len,
            base: self.base(),
            size: self.len(),
        }
    }

    /// The raw pointer to `addr` once `[addr, addr + len)` is checked to lie in the region and
    /// the region is host memory (every CPU accessor goes through here: a device region is
    /// refused before any pointer into it is formed).
    fn ptr_of(&self, addr: u64, len: u64) -> Result<*mut u8, AccessError> {
        if self.device {
            return Err(AccessError::Device {
                addr,
                len,
                base: self.base(),
                size: self.len(),
            });
        }
        let off = self.offset_of(addr, len)?;
        usize::try_from(len).map_err(|_| self.oob(addr, len))?;
        // SAFETY: `off + len <= self.len` (checked by `offset_of`), so the pointer stays inside
        // (or one past the end of) the region's memory, owned or the caller's.
        Ok(unsafe { self.ptr.add(off) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_memory_is_used_in_place_and_not_freed() {
        let mut pool = vec![0u8; 4096];
        let addr = pool.as_mut_ptr() as u64;
        // SAFETY: `pool` outlives the region and is not touched while the region is used.
        let r = unsafe { Region::from_raw(addr, pool.len()) }.unwrap();
        assert!(r.is_borrowed() && r.base() == addr && r.len() == 4096);
        r.copy_in(addr + 100, b"kvx").unwrap();
        assert!(r.copy_in(addr + 4095, b"kvx").is_err());
        drop(r);
        // The bytes landed in the caller's memory, which is still the caller's to use.
        assert_eq!(&pool[100..103], b"kvx");
        pool[0] = 1;
        // SAFETY: a null address is refused before any use.
        assert!(unsafe { Region::from_raw(0, 16) }.is_none());
        // SAFETY: a wrapping range is refused before any use.
        assert!(unsafe { Region::from_raw(u64::MAX - 4, 16) }.is_none());
    }

    /// A `PROT_NONE` mapping standing in for device memory: any CPU read or write of it kills
    /// the test process, so a passing test proves nothing touched it.
    struct NoAccess {
        addr: *mut libc::c_void,
        len: usize,
    }

    impl NoAccess {
        fn new(len: usize) -> NoAccess {
            // SAFETY: an anonymous private mapping with no access rights; never dereferenced.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED, "mmap PROT_NONE");
            NoAccess { addr, len }
        }
    }

    impl Drop for NoAccess {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`, unmapped once.
            unsafe { libc::munmap(self.addr, self.len) };
        }
    }

    #[test]
    fn device_regions_refuse_every_cpu_access_without_touching() {
        let map = NoAccess::new(1 << 16);
        let b = map.addr as u64;
        // SAFETY: the mapping outlives the region; the region never touches it (the point of
        // this test: a touch would fault).
        let r = unsafe { Region::from_raw_device(b, map.len) }.unwrap();
        assert!(r.is_device() && r.is_borrowed() && r.shm_region().is_none());
        assert_eq!((r.base(), r.len()), (b, 1 << 16));
        // Bounds still work without touching the memory.
        assert!(r.contains(b + 4096, 4096));
        assert!(!r.contains(b + (1 << 16) - 1, 2));
        let device = |addr: u64, len: u64| AccessError::Device {
            addr,
            len,
            base: b,
            size: 1 << 16,
        };
        let mut out = [0u8; 8];
        assert_eq!(r.copy_out(b, &mut out), Err(device(b, 8)));
        assert_eq!(out, [0u8; 8]);
        assert_eq!(r.to_vec(b + 8, 16), Err(device(b + 8, 16)));
        assert_eq!(r.copy_in(b, b"kvx"), Err(device(b, 3)));
        assert_eq!(r.fill(b, 4096, 0xff), Err(device(b, 4096)));
        // Refused for device memory even when out of bounds or absurdly long (no pointer, no
        // allocation is made first).
        assert_eq!(r.to_vec(b, u64::MAX), Err(device(b, u64::MAX)));
        // SAFETY: refused before any pointer is formed (what this test checks).
        assert_eq!(unsafe { r.view(b, 64) }, Err(device(b, 64)));
        let mut called = false;
        // SAFETY: as above; `f` must never run.
        let res = unsafe { r.with_mut(b, 64, |_| called = true) };
        assert_eq!(res, Err(device(b, 64)));
        assert!(!called);
        let msg = device(b, 64).to_string();
        assert!(msg.contains("device memory"), "{msg}");
        // SAFETY: a null address is refused before any use.
        assert!(unsafe { Region::from_raw_device(0, 16) }.is_none());
        // SAFETY: a wrapping range is refused before any use.
        assert!(unsafe { Region::from_raw_device(u64::MAX - 4, 16) }.is_none());
        // Host regions are not device memory.
        assert!(!Region::new(8).is_device());
    }

    #[test]
    fn bounds_are_checked() {
        let r = Region::new(64);
        let b = r.base();
        assert!(r.to_vec(b, 64).is_ok());
        assert!(r.to_vec(b + 1, 64).is_err());
        assert!(r.to_vec(b.wrapping_sub(1), 1).is_err());
        assert!(r.to_vec(u64::MAX, 2).is_err());
        assert!(r.copy_in(b + 60, &[0; 5]).is_err());
        assert_eq!(
            r.fill(b + 1, 64, 1),
            Err(AccessError::OutOfBounds(OutOfBounds {
                addr: b + 1,
                len: 64,
                base: b,
                size: 64
            }))
        );
        r.copy_in(b + 8, &7u64.to_le_bytes()).unwrap();
        assert_eq!(r.to_vec(b + 8, 8).unwrap(), 7u64.to_le_bytes());
        let mut out = [0u8; 8];
        r.copy_out(b + 8, &mut out).unwrap();
        assert_eq!(out, 7u64.to_le_bytes());
        r.fill(b, 8, 0xaa).unwrap();
        // SAFETY: no other thread or peer touches this test's region.
        let v = unsafe { r.view(b, 16) }.unwrap();
        assert_eq!(v[..8], [0xaa; 8]);
        assert_eq!(v[8..], 7u64.to_le_bytes());
    }

    /// Pages of `r` resident in memory (`mincore`).
    fn resident_pages(r: &Region) -> usize {
        let page = 4096usize;
        let start = (r.base() as usize) & !(page - 1);
        let end = (r.base() as usize + r.len() as usize).next_multiple_of(page);
        let mut vec = vec![0u8; (end - start) / page];
        // SAFETY: the range covers pages of `r`'s own mapping; `vec` has one byte per page.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&v| v & 1 == 1).count()
    }

    #[test]
    fn populate_faults_owned_pages_in_and_changes_no_byte() {
        // 64 MiB: above the allocator's mmap threshold, so the pages start out unbacked.
        let r = Region::new(64 << 20);
        let pages = (64 << 20) / 4096;
        let before = resident_pages(&r);
        assert!(
            before < pages / 2,
            "{before} of {pages} pages resident before"
        );
        r.copy_in(r.base() + 12345, b"kept").unwrap();
        r.populate().unwrap();
        assert!(
            resident_pages(&r) >= pages,
            "not every page resident after populate"
        );
        assert_eq!(r.to_vec(r.base() + 12345, 4).unwrap(), b"kept");
        assert_eq!(r.to_vec(r.base(), 8).unwrap(), [0; 8]);
        // Caller and device memory are left alone.
        let mut mine = vec![0u8; 64];
        // SAFETY: `mine` outlives the region and nothing else touches it.
        let borrowed = unsafe { Region::from_raw(mine.as_mut_ptr() as u64, mine.len()) }.unwrap();
        borrowed.populate().unwrap();
    }
}
