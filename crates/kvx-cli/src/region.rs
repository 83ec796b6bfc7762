//! Registered host memory: one owned, zero-initialised byte region addressed by virtual address.
//!
//! A region is what a rank registers with the data plane: the KV pool, the aux rows. Remote peers
//! name bytes by virtual address (as sglang publishes pointers on the wire); every access here is
//! bounds-checked against the region before a slice is formed. Disjointness of concurrent
//! accesses is the caller's page-ownership contract: a page belongs to one room at a time, and a
//! page is written only by the room's producer (the forward pass on the prefill, the data plane on
//! the decode) and read only after that write finished.

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

// SAFETY: the region hands out slices only through bounds-checked methods; concurrent access to
// the same bytes is excluded by the page-ownership contract documented on the module (one writer
// per page at a time, readers only after the writer finished).
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

    /// Shared view of `[addr, addr+len)`.
    ///
    /// The caller must not read a range some other thread is writing (page ownership).
    pub fn read(&self, addr: u64, len: u64) -> Result<&[u8], OutOfBounds> {
        let off = self.offset_of(addr, len)?;
        let start = self.bytes[off..].as_ptr();
        // SAFETY: `off..off+len` was bounds-checked above against the owned allocation, and
        // `UnsafeCell<u8>` has the layout of `u8`. No writer touches the range (contract).
        Ok(unsafe { std::slice::from_raw_parts(UnsafeCell::raw_get(start), len as usize) })
    }

    /// Runs `f` on a mutable view of `[addr, addr+len)`.
    ///
    /// The caller must be the only one touching the range while `f` runs (page ownership).
    pub fn write_with<R>(
        &self,
        addr: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, OutOfBounds> {
        let off = self.offset_of(addr, len)?;
        let start = self.bytes[off..].as_ptr();
        // SAFETY: bounds-checked above; interior mutability through `UnsafeCell`; exclusive
        // access to the range is the caller's page-ownership contract.
        let slice =
            unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(start), len as usize) };
        Ok(f(slice))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked() {
        let r = Region::new(64);
        let b = r.base();
        assert!(r.read(b, 64).is_ok());
        assert!(r.read(b + 1, 64).is_err());
        assert!(r.read(b.wrapping_sub(1), 1).is_err());
        assert!(r.read(u64::MAX, 2).is_err());
        r.write_with(b + 8, 8, |s| s.copy_from_slice(&7u64.to_le_bytes()))
            .unwrap();
        assert_eq!(r.read(b + 8, 8).unwrap(), &7u64.to_le_bytes());
    }
}
