//! Shared-memory regions in `/dev/shm`, so the `local` backend can write across processes.
//!
//! A receiver allocates memory it wants peers on the same host to write into with
//! [`ShmRegion::create`] (a file in `/dev/shm`, mapped shared) and registers it with
//! `LocalTransport::register_shm`; a sender in another process maps the same file with
//! [`ShmRegion::open`]. This module and [`crate::mem`] are the only places with `unsafe` outside
//! the verbs backend: `mmap`/`munmap` here, each with a `// SAFETY:` comment.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use crate::error::TransportError;

/// Directory holding the shared files.
pub const SHM_DIR: &str = "/dev/shm";

/// True for names made of `[A-Za-z0-9._-]`, 1 to 200 bytes, not starting with a dot.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A file in `/dev/shm` mapped shared into this process.
#[derive(Debug)]
pub struct ShmRegion {
    name: String,
    addr: u64,
    len: usize,
    owner: bool,
}

fn io_err(what: &str, name: &str, e: std::io::Error) -> TransportError {
    TransportError::Io {
        kind: e.kind(),
        detail: format!("{what} {SHM_DIR}/{name}: {e}"),
    }
}

impl ShmRegion {
    fn path(name: &str) -> Result<PathBuf, TransportError> {
        if !valid_name(name) {
            return Err(TransportError::Io {
                kind: std::io::ErrorKind::InvalidInput,
                detail: format!("bad shared-memory name {name:?}"),
            });
        }
        Ok(PathBuf::from(SHM_DIR).join(name))
    }

    /// Creates `/dev/shm/<name>` (which must not exist) of `len` bytes, zero-filled, and maps it.
    /// The file is removed when this value is dropped.
    pub fn create(name: &str, len: usize) -> Result<Self, TransportError> {
        let path = Self::path(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err("create", name, e))?;
        let r = file
            .set_len(len as u64)
            .map_err(|e| io_err("size", name, e))
            .and_then(|()| Self::map(&file, name, len, true));
        if r.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        r
    }

    /// Maps an existing `/dev/shm/<name>` (its whole length).
    pub fn open(name: &str) -> Result<Self, TransportError> {
        let path = Self::path(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_err("open", name, e))?;
        let len = file.metadata().map_err(|e| io_err("stat", name, e))?.len();
        let len = usize::try_from(len).map_err(|_| TransportError::Io {
            kind: std::io::ErrorKind::InvalidData,
            detail: format!("{name}: too large"),
        })?;
        Self::map(&file, name, len, false)
    }

    fn map(file: &File, name: &str, len: usize, owner: bool) -> Result<Self, TransportError> {
        if len == 0 {
            return Err(TransportError::Io {
                kind: std::io::ErrorKind::InvalidInput,
                detail: format!("{name}: empty shared region"),
            });
        }
        // SAFETY: a fresh shared mapping of `len` bytes of an open file descriptor; the kernel
        // picks the address (no existing mapping is replaced). The result is checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io_err("map", name, std::io::Error::last_os_error()));
        }
        Ok(ShmRegion {
            name: name.to_owned(),
            addr: p as u64,
            len,
            owner,
        })
    }

    /// The file name under `/dev/shm`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Address of the mapping in this process.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (regions are never empty).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly the mapping created in `map`, unmapped only here.
        // Transports that registered it hold an `Arc<ShmRegion>`, so no registered span
        // outlives the mapping.
        unsafe {
            libc::munmap(self.addr as usize as *mut libc::c_void, self.len);
        }
        if self.owner
            && let Ok(p) = Self::path(&self.name)
        {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("kvx-1.kv_0"));
        assert!(!valid_name(""));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("../x"));
        assert!(!valid_name(&"x".repeat(201)));
    }

    #[test]
    fn create_open_share_and_remove() {
        let name = format!("kvx-test-shm-{}", std::process::id());
        let a = ShmRegion::create(&name, 8192).unwrap();
        assert!(ShmRegion::create(&name, 8192).is_err());
        let b = ShmRegion::open(&name).unwrap();
        assert_eq!(b.len(), 8192);
        assert_ne!(a.addr(), b.addr());
        let t = crate::mem::RegionTable::new();
        t.insert(a.addr(), a.len() as u64).unwrap();
        t.insert(b.addr(), b.len() as u64).unwrap();
        let src = t.resolve(a.addr() + 10, 4).unwrap();
        let dst = t.resolve(b.addr() + 100, 4).unwrap();
        let one = t.resolve(a.addr(), 1).unwrap();
        let _ = (src, one);
        // Write through one mapping, read through the other.
        let pattern = [1u8, 2, 3, 4];
        let tp = crate::mem::RegionTable::new();
        tp.insert(pattern.as_ptr() as u64, 4).unwrap();
        crate::mem::copy(tp.resolve(pattern.as_ptr() as u64, 4).unwrap(), src);
        let back = t.resolve(b.addr() + 10, 4).unwrap();
        crate::mem::copy(back, dst);
        let mut out = [0u8; 4];
        let to = crate::mem::RegionTable::new();
        to.insert(out.as_mut_ptr() as u64, 4).unwrap();
        crate::mem::copy(
            t.resolve(a.addr() + 100, 4).unwrap(),
            to.resolve(out.as_ptr() as u64, 4).unwrap(),
        );
        assert_eq!(out, pattern);
        drop(b);
        drop(a);
        assert!(ShmRegion::open(&name).is_err());
    }
}
