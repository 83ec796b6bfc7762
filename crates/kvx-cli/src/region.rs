//! Registered host memory: one owned, zero-initialised byte region addressed by virtual address.
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

use std::cell::UnsafeCell;

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

/// A fixed-size byte region in host memory, shared between threads.
pub struct Region {
    bytes: Box<[UnsafeCell<u8>]>,
}

// SAFETY: every access is bounds-checked and goes through raw pointers to `UnsafeCell` bytes; the
// safe methods form no references to the region's bytes, and the views that do are `unsafe` with
// the page-ownership contract (documented on the module) as their precondition.
unsafe impl Sync for Region {}
// SAFETY: the region owns its allocation; moving it between threads moves only the box.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({:#x}+{})", self.base(), self.len())
    }
}

impl Region {
    /// A zeroed region of `len` bytes.
    pub fn new(len: usize) -> Self {
        let zeroed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw = Box::into_raw(zeroed) as *mut [UnsafeCell<u8>];
        // SAFETY: `UnsafeCell<u8>` is `repr(transparent)` over `u8`, so the slice layout and the
        // allocation are identical; ownership moves from the first box to the second.
        let bytes = unsafe { Box::from_raw(raw) };
        Region { bytes }
    }

    /// The virtual address of the first byte.
    pub fn base(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
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
    pub fn copy_out(&self, addr: u64, out: &mut [u8]) -> Result<(), OutOfBounds> {
        let src = self.ptr_of(addr, out.len() as u64)?;
        // SAFETY: `src..src+len` lies inside the owned allocation (checked by `ptr_of`); `out` is
        // a distinct, exclusively borrowed buffer, so the ranges do not overlap. The region's
        // bytes are `UnsafeCell`s: reading them through a raw pointer forms no `&[u8]`.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The bytes of `[addr, addr + len)` as a new vector (see [`Region::copy_out`]).
    pub fn to_vec(&self, addr: u64, len: u64) -> Result<Vec<u8>, OutOfBounds> {
        let n = usize::try_from(len).map_err(|_| self.oob(addr, len))?;
        self.ptr_of(addr, len)?;
        let mut v = vec![0u8; n];
        self.copy_out(addr, &mut v)?;
        Ok(v)
    }

    /// Copies `data` to `[addr, addr + data.len())`, through raw pointers (see
    /// [`Region::copy_out`]).
    pub fn copy_in(&self, addr: u64, data: &[u8]) -> Result<(), OutOfBounds> {
        let dst = self.ptr_of(addr, data.len() as u64)?;
        // SAFETY: inside the owned allocation (checked); `data` is a shared borrow of other
        // memory, so no overlap; writing `UnsafeCell` bytes through a raw pointer is allowed.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Sets `[addr, addr + len)` to `byte`.
    pub fn fill(&self, addr: u64, len: u64, byte: u8) -> Result<(), OutOfBounds> {
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
    pub unsafe fn view(&self, addr: u64, len: u64) -> Result<&[u8], OutOfBounds> {
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
    ) -> Result<R, OutOfBounds> {
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

    /// The raw pointer to `addr` once `[addr, addr + len)` is checked to lie in the region.
    fn ptr_of(&self, addr: u64, len: u64) -> Result<*mut u8, OutOfBounds> {
        let off = self.offset_of(addr, len)?;
        usize::try_from(len).map_err(|_| self.oob(addr, len))?;
        Ok(UnsafeCell::raw_get(self.bytes[off..].as_ptr()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked() {
        let r = Region::new(64);
        let b = r.base();
        assert!(r.to_vec(b, 64).is_ok());
        assert!(r.to_vec(b + 1, 64).is_err());
        assert!(r.to_vec(b.wrapping_sub(1), 1).is_err());
        assert!(r.to_vec(u64::MAX, 2).is_err());
        assert!(r.copy_in(b + 60, &[0; 5]).is_err());
        assert!(r.fill(b + 1, 64, 1).is_err());
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
}
