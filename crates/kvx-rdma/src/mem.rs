//! Registered memory: the region table, bounds checks, and the only raw-pointer code of the crate.
//!
//! A [`RegionTable`] holds what a transport registered. The only way to obtain a [`Span`] (an
//! address range the transport may read or write) is a successful lookup in the table, so every
//! pointer this crate forms has been checked against a registered region first. The unsafe
//! blocks (vectored socket I/O straight from/into spans, and span-to-span copies) live here and
//! nowhere else in the crate; each carries a `// SAFETY:` comment.
//!
//! A registration is a lease. Code that writes into (or reads from) a region on a peer's behalf
//! — a receive thread, a same-host copy — does so through a [`Receiver`], which holds a
//! [`Lease`] on every region it is using while it uses it. [`RegionTable::deregister`] takes
//! the region out of the table (no new receive can start in it), interrupts every receiver
//! holding it and returns only once none does; [`RegionTable::close_receive`] does the same for
//! every region at once (transport shutdown and drop). After either returns, no byte of the
//! region(s) is written by this crate.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::Duration;

use crate::error::{RejectReason, TransportError};
use crate::place::Placement;
use crate::segment::{RegionDesc, RegionKey, SegmentDescriptor};

/// A checked address range inside a registered region. Constructed only by [`RegionTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    addr: u64,
    len: usize,
}

impl Span {
    /// First address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-span `[off, off + len)`; `None` when it does not fit.
    pub fn sub(&self, off: usize, len: usize) -> Option<Span> {
        let end = off.checked_add(len)?;
        (end <= self.len).then_some(Span {
            addr: self.addr + off as u64,
            len,
        })
    }
}

/// The lease of one registered region: how many receivers use it right now, and whether it
/// has left the table.
pub struct Lease {
    /// Receivers holding this lease.
    busy: AtomicUsize,
    /// Set once the region left the table (or the table stopped receiving).
    gone: AtomicBool,
    m: Mutex<()>,
    idle: Condvar,
}

impl Lease {
    fn new() -> Arc<Self> {
        Arc::new(Lease {
            busy: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
            m: Mutex::new(()),
            idle: Condvar::new(),
        })
    }

    fn release(&self) {
        if self.busy.fetch_sub(1, Ordering::SeqCst) == 1 && self.gone.load(Ordering::SeqCst) {
            let _g = lock(&self.m);
            self.idle.notify_all();
        }
    }

    /// Blocks until no receiver holds the lease (`gone` must be set first).
    fn wait_idle(&self) {
        let mut g = lock(&self.m);
        while self.busy.load(Ordering::SeqCst) != 0 {
            // The timeout only guards against a missed wakeup; the loop re-checks the count.
            g = self
                .idle
                .wait_timeout(g, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// Stops a receiver that holds a lease on a region being deregistered (e.g. shuts its socket
/// down so that a blocked read returns).
pub trait Interrupt: Send + Sync {
    /// Asks the receiver to stop; it must release its leases soon after.
    fn interrupt(&self);
}

/// An [`Interrupt`] that does nothing: for receivers that never block (memory copies).
pub struct NoInterrupt;

impl Interrupt for NoInterrupt {
    fn interrupt(&self) {}
}

struct RxShared {
    held: Mutex<Vec<Arc<Lease>>>,
    interrupted: AtomicBool,
    interrupt: Arc<dyn Interrupt>,
}

/// One user of registered memory on a peer's behalf (a receive thread, a copy). Every span it
/// obtains through [`RegionTable::lease_keyed`] or [`RegionTable::lease_range`] stays leased
/// until [`Receiver::release`] (or drop).
pub struct Receiver {
    shared: Arc<RxShared>,
}

impl Receiver {
    /// True once a deregistration or [`RegionTable::close_receive`] asked this receiver to
    /// stop; it must not start another read into memory.
    pub fn is_interrupted(&self) -> bool {
        self.shared.interrupted.load(Ordering::SeqCst)
    }

    /// Releases every lease held (the spans obtained so far must not be used any more).
    pub fn release(&self) {
        let held = std::mem::take(&mut *lock(&self.shared.held));
        for l in held {
            l.release();
        }
    }

    /// True while a lease is held.
    pub fn holds_any(&self) -> bool {
        !lock(&self.shared.held).is_empty()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.release();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Clone)]
struct Entry {
    desc: RegionDesc,
    lease: Arc<Lease>,
}

/// A placed range ([`RegionTable::place`]).
struct Placed {
    /// One past the range's last byte.
    end: u64,
    map: Arc<dyn Placement>,
    /// `map.bounds()`, checked inside the region of `dst`.
    bounds: (u64, u64),
    /// The lease of the region the pieces land in.
    dst: Arc<Lease>,
    /// Payload bytes leased through the placement.
    routed: AtomicU64,
}

#[derive(Default)]
struct Inner {
    /// Sorted by base, non-overlapping.
    regions: Vec<RegionDesc>,
    by_key: HashMap<u32, Entry>,
    /// Placed ranges by start, non-overlapping.
    placed: BTreeMap<u64, Placed>,
    /// Set by [`RegionTable::close_receive`]: no new lease is granted.
    closed: bool,
}

impl Inner {
    /// The registered region containing `[addr, addr + len)`.
    fn region_at(&self, addr: u64, len: u64) -> Option<&Entry> {
        let i = self.regions.partition_point(|r| r.base <= addr);
        i.checked_sub(1)
            .and_then(|i| self.regions.get(i))
            .filter(|r| r.contains(addr, len))
            .and_then(|r| self.by_key.get(&r.key.0))
    }
}

/// The regions a transport registered, with key and address lookups.
pub struct RegionTable {
    inner: RwLock<Inner>,
    next_key: AtomicU32,
    receivers: Mutex<HashMap<u64, Weak<RxShared>>>,
    next_rx: AtomicU64,
    /// Payload bytes peers wrote into the table's regions (see [`RegionTable::received`]).
    received: AtomicU64,
}

impl Default for RegionTable {
    fn default() -> Self {
        Self::new()
    }
}

impl RegionTable {
    /// Counts `bytes` of payload a peer wrote into the table's regions (the receive paths call
    /// it once per acknowledged batch or request).
    pub fn note_received(&self, bytes: u64) {
        self.received.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Payload bytes peers wrote into the table's regions since it was made.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// An empty table. Keys start at a per-table pseudo-random value so that a stale key from
    /// another table (a restarted peer) is unlikely to name a live region.
    pub fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32).rotate_left(16))
            .unwrap_or(1);
        RegionTable {
            inner: RwLock::new(Inner::default()),
            next_key: AtomicU32::new(seed | 1),
            receivers: Mutex::new(HashMap::new()),
            next_rx: AtomicU64::new(0),
            received: AtomicU64::new(0),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `[addr, addr + len)`; fails on a null address, zero length, overflow or overlap.
    /// The caller (a `Transport::register` implementation) carries the memory-validity contract.
    pub fn insert(&self, addr: u64, len: u64) -> Result<RegionKey, TransportError> {
        let err = |detail: &str| TransportError::Registration {
            addr,
            len,
            detail: detail.into(),
        };
        if addr == 0 {
            return Err(err("null address"));
        }
        if len == 0 {
            return Err(err("empty region"));
        }
        let end = addr.checked_add(len).ok_or_else(|| err("overflows"))?;
        if usize::try_from(len).is_err() || end > isize::MAX as u64 {
            return Err(err("beyond the address space"));
        }
        let mut g = self.write();
        let i = g.regions.partition_point(|r| r.base < addr);
        if i > 0 && g.regions[i - 1].base + g.regions[i - 1].len > addr {
            return Err(err("overlaps a registered region"));
        }
        if let Some(next) = g.regions.get(i)
            && next.base < end
        {
            return Err(err("overlaps a registered region"));
        }
        let mut key = self.next_key.fetch_add(1, Ordering::Relaxed);
        while key == 0 || g.by_key.contains_key(&key) {
            key = self.next_key.fetch_add(1, Ordering::Relaxed);
        }
        let desc = RegionDesc {
            base: addr,
            len,
            key: RegionKey(key),
        };
        g.regions.insert(i, desc);
        g.by_key.insert(
            key,
            Entry {
                desc,
                lease: Lease::new(),
            },
        );
        Ok(desc.key)
    }

    /// Removes a region without waiting for its receivers (tables nobody receives into: a
    /// sender's, a mapping table). Transports use [`RegionTable::deregister`].
    pub fn remove(&self, key: RegionKey) -> Result<(), TransportError> {
        self.take(key).map(|_| ())
    }

    fn take(&self, key: RegionKey) -> Result<Entry, TransportError> {
        let mut g = self.write();
        let e = g
            .by_key
            .remove(&key.0)
            .ok_or_else(|| TransportError::Registration {
                addr: 0,
                len: 0,
                detail: format!("no region with key {key}"),
            })?;
        g.regions.retain(|r| r.base != e.desc.base);
        // Placements in the region, or landing in it, end with it.
        g.placed
            .retain(|&start, p| !e.desc.contains(start, 0) && !Arc::ptr_eq(&p.dst, &e.lease));
        // Under the write lock: no receiver can take the lease from now on.
        e.lease.gone.store(true, Ordering::SeqCst);
        Ok(e)
    }

    /// Removes a region and returns once no receiver uses it: receivers holding its lease are
    /// interrupted, and this waits until each has released it. Afterwards nothing this table
    /// leased writes into (or reads from) the region. Blocks; do not call it from a receiver.
    pub fn deregister(&self, key: RegionKey) -> Result<RegionDesc, TransportError> {
        let e = self.take(key)?;
        self.interrupt_holders(|l| Arc::ptr_eq(l, &e.lease));
        e.lease.wait_idle();
        Ok(e.desc)
    }

    /// Stops every receive: no new lease is granted, every receiver holding one is
    /// interrupted, and this returns once none holds one. Regions stay registered (the
    /// descriptor is unchanged). Used by transport shutdown and drop.
    pub fn close_receive(&self) {
        let leases: Vec<Arc<Lease>> = {
            let mut g = self.write();
            g.closed = true;
            g.by_key
                .values()
                .map(|e| {
                    e.lease.gone.store(true, Ordering::SeqCst);
                    e.lease.clone()
                })
                .collect()
        };
        self.interrupt_holders(|_| true);
        for l in leases {
            l.wait_idle();
        }
    }

    /// True once [`RegionTable::close_receive`] ran.
    pub fn is_closed(&self) -> bool {
        self.read().closed
    }

    fn interrupt_holders(&self, hit: impl Fn(&Arc<Lease>) -> bool) {
        let live: Vec<Arc<RxShared>> = lock(&self.receivers)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for rx in live {
            if lock(&rx.held).iter().any(&hit) {
                rx.interrupted.store(true, Ordering::SeqCst);
                rx.interrupt.interrupt();
            }
        }
    }

    /// A new receiver of this table; `interrupt` stops it when a region it holds is being
    /// deregistered (or the table closes).
    pub fn receiver(&self, interrupt: Arc<dyn Interrupt>) -> Receiver {
        let shared = Arc::new(RxShared {
            held: Mutex::new(Vec::new()),
            interrupted: AtomicBool::new(false),
            interrupt,
        });
        let id = self.next_rx.fetch_add(1, Ordering::Relaxed);
        let mut rx = lock(&self.receivers);
        if id.is_multiple_of(64) {
            rx.retain(|_, w| w.strong_count() > 0);
        }
        rx.insert(id, Arc::downgrade(&shared));
        Receiver { shared }
    }

    /// Records that `rx` holds `lease` (called under the table's read lock, so that a
    /// deregistration either sees the hold or the receiver fails its lookup).
    fn hold(rx: &Receiver, lease: &Arc<Lease>) {
        let mut held = lock(&rx.shared.held);
        if !held.iter().any(|l| Arc::ptr_eq(l, lease)) {
            lease.busy.fetch_add(1, Ordering::SeqCst);
            held.push(lease.clone());
        }
    }

    /// [`RegionTable::check_keyed`], and `rx` leases the region until it releases.
    pub fn lease_keyed(
        &self,
        rx: &Receiver,
        key: RegionKey,
        addr: u64,
        len: u64,
    ) -> Result<Span, RejectReason> {
        let g = self.read();
        let e = g.by_key.get(&key.0).ok_or(RejectReason::BadKey)?;
        if g.closed {
            return Err(RejectReason::BadKey);
        }
        if !e.desc.contains(addr, len) {
            return Err(RejectReason::OutOfBounds);
        }
        Self::hold(rx, &e.lease);
        Ok(Span {
            addr,
            len: len as usize,
        })
    }

    /// [`RegionTable::lease_keyed`] (or, for an empty write, [`RegionTable::check_keyed`]) for
    /// every write of one frame under a single look at the table: one read lock, one key lookup
    /// per run of writes to the same region, one hold per region. `f(i, len, r)` gets, in order,
    /// the receive targets of write `i` (its index in `writes`): one `(len, span)` for a plain
    /// write or a rejection, and for a write into a placed range ([`RegionTable::place`]) the
    /// placement's destination ranges for the bytes inside it, each checked against the
    /// placement's bounds (a range outside them is rejected: `OutOfBounds`), and plain spans for
    /// the bytes outside it. The lengths of write `i`'s targets add up to its length. The frame
    /// is checked against one state of the table, so a deregistration either comes before all
    /// of it or waits for the frame's leases.
    pub fn lease_keyed_frame(
        &self,
        rx: &Receiver,
        writes: impl Iterator<Item = (RegionKey, u64, u64)>,
        mut f: impl FnMut(usize, u64, Result<Span, RejectReason>),
    ) {
        let g = self.read();
        // The region of the previous write, once it is held.
        let mut last: Option<(u32, &Entry, bool)> = None;
        for (i, (key, addr, len)) in writes.enumerate() {
            let e = match last {
                Some((k, e, _)) if k == key.0 => Some(e),
                _ => g.by_key.get(&key.0),
            };
            let Some(e) = e else {
                f(i, len, Err(RejectReason::BadKey));
                continue;
            };
            let held = matches!(last, Some((k, _, true)) if k == key.0);
            last = Some((key.0, e, held));
            if len > 0 && g.closed {
                f(i, len, Err(RejectReason::BadKey));
                continue;
            }
            if !e.desc.contains(addr, len) {
                f(i, len, Err(RejectReason::OutOfBounds));
                continue;
            }
            if len > 0 && !held {
                Self::hold(rx, &e.lease);
                last = Some((key.0, e, true));
            }
            if len > 0 && !g.placed.is_empty() {
                Self::route(&g, rx, addr, len, &mut |n, r| f(i, n, r));
            } else {
                f(
                    i,
                    len,
                    Ok(Span {
                        addr,
                        len: len as usize,
                    }),
                );
            }
        }
    }

    /// The targets of a checked write `[addr, addr + len)` under the placements (see
    /// [`RegionTable::lease_keyed_frame`]).
    fn route(
        g: &Inner,
        rx: &Receiver,
        addr: u64,
        len: u64,
        f: &mut dyn FnMut(u64, Result<Span, RejectReason>),
    ) {
        // In a registered region: no overflow.
        let end = addr + len;
        let mut at = addr;
        let from = g
            .placed
            .range(..=addr)
            .next_back()
            .map_or(addr, |(&s, _)| s);
        for (&start, p) in g.placed.range(from..end) {
            if p.end <= at {
                continue;
            }
            if start > at {
                f(
                    start - at,
                    Ok(Span {
                        addr: at,
                        len: (start - at) as usize,
                    }),
                );
                at = start;
            }
            let stop = p.end.min(end);
            Self::hold(rx, &p.dst);
            let (lo, hi) = p.bounds;
            // The pieces never add up to more than the bytes asked for, whatever the map says:
            // the targets must match the frame's payload byte for byte.
            let mut left = stop - at;
            p.map.pieces(at - start, stop - at, &mut |a, n| {
                let n = n.min(left);
                if n == 0 {
                    return;
                }
                left -= n;
                if a >= lo && a.checked_add(n).is_some_and(|e| e <= hi) {
                    f(
                        n,
                        Ok(Span {
                            addr: a,
                            len: n as usize,
                        }),
                    );
                } else {
                    f(n, Err(RejectReason::OutOfBounds));
                }
            });
            if left > 0 {
                f(left, Err(RejectReason::OutOfBounds));
            }
            p.routed.fetch_add(stop - at - left, Ordering::Relaxed);
            at = stop;
        }
        if at < end {
            f(
                end - at,
                Ok(Span {
                    addr: at,
                    len: (end - at) as usize,
                }),
            );
        }
    }

    /// Places `[addr, addr + map.len())`: from now on, writes received into it through
    /// [`RegionTable::lease_keyed_frame`] land where `map` says (see [`crate::place`]). The range
    /// must lie inside a registered region and overlap no other placement; `map.bounds()` must
    /// lie inside a registered region (whose lease the receivers hold while they write into it).
    /// Ended by [`RegionTable::unplace`], or when either region is deregistered.
    pub fn place(&self, addr: u64, map: Arc<dyn Placement>) -> Result<(), TransportError> {
        let len = map.len();
        let err = |detail: &str| TransportError::Registration {
            addr,
            len,
            detail: detail.into(),
        };
        let mut g = self.write();
        if g.closed {
            return Err(err("the table stopped receiving"));
        }
        if len == 0 || g.region_at(addr, len).is_none() {
            return Err(err("placed range empty or outside every registered region"));
        }
        let (lo, hi) = map.bounds();
        let dst = hi
            .checked_sub(lo)
            .and_then(|n| g.region_at(lo, n))
            .map(|e| e.lease.clone())
            .ok_or_else(|| err("placement bounds outside every registered region"))?;
        let end = addr + len;
        let before = g.placed.range(..end).next_back();
        if before.is_some_and(|(_, p)| p.end > addr) {
            return Err(err("overlaps a placed range"));
        }
        g.placed.insert(
            addr,
            Placed {
                end,
                map,
                bounds: (lo, hi),
                dst,
                routed: AtomicU64::new(0),
            },
        );
        Ok(())
    }

    /// Ends the placement starting at `addr`; returns the payload bytes leased through it
    /// (`None`: no such placement, or it ended with its region). Frames leased before this
    /// call still land where the placement said.
    pub fn unplace(&self, addr: u64) -> Option<u64> {
        self.write()
            .placed
            .remove(&addr)
            .map(|p| p.routed.into_inner())
    }

    /// [`RegionTable::resolve`], and `rx` leases the region until it releases.
    pub fn lease_range(&self, rx: &Receiver, addr: u64, len: u64) -> Result<Span, TransportError> {
        let mut out = None;
        self.lease_many(rx, std::iter::once((addr, len)), |s| out = Some(s))?;
        out.ok_or(TransportError::LocalNotRegistered { addr, len })
    }

    /// [`RegionTable::resolve_many`], and `rx` leases every region used until it releases
    /// (on an error, the leases taken so far stay with `rx` until it releases).
    pub fn lease_many(
        &self,
        rx: &Receiver,
        ranges: impl Iterator<Item = (u64, u64)>,
        mut f: impl FnMut(Span),
    ) -> Result<(), TransportError> {
        let g = self.read();
        for (addr, len) in ranges {
            let i = g.regions.partition_point(|r| r.base <= addr);
            let r = i
                .checked_sub(1)
                .and_then(|i| g.regions.get(i))
                .filter(|r| !g.closed && r.contains(addr, len))
                .and_then(|r| g.by_key.get(&r.key.0))
                .ok_or(TransportError::LocalNotRegistered { addr, len })?;
            Self::hold(rx, &r.lease);
            f(Span {
                addr,
                len: len as usize,
            });
        }
        Ok(())
    }

    /// A snapshot of the regions as a descriptor with `endpoint`.
    pub fn descriptor(&self, endpoint: &str) -> SegmentDescriptor {
        SegmentDescriptor {
            endpoint: endpoint.to_owned(),
            regions: self.read().regions.clone(),
        }
    }

    /// Checks a write into `[addr, addr + len)` under `key` (the receiver-side check).
    pub fn check_keyed(&self, key: RegionKey, addr: u64, len: u64) -> Result<Span, RejectReason> {
        let g = self.read();
        let r = &g.by_key.get(&key.0).ok_or(RejectReason::BadKey)?.desc;
        if !r.contains(addr, len) {
            return Err(RejectReason::OutOfBounds);
        }
        Ok(Span {
            addr,
            len: len as usize,
        })
    }

    /// Resolves many source ranges under one lock (the sender-side check).
    pub fn resolve_many(
        &self,
        ranges: impl Iterator<Item = (u64, u64)>,
        mut f: impl FnMut(Span),
    ) -> Result<(), TransportError> {
        let g = self.read();
        for (addr, len) in ranges {
            let i = g.regions.partition_point(|r| r.base <= addr);
            let ok = i > 0 && g.regions[i - 1].contains(addr, len);
            if !ok {
                return Err(TransportError::LocalNotRegistered { addr, len });
            }
            f(Span {
                addr,
                len: len as usize,
            });
        }
        Ok(())
    }

    /// Checks one source range.
    pub fn resolve(&self, addr: u64, len: u64) -> Result<Span, TransportError> {
        let mut out = None;
        self.resolve_many(std::iter::once((addr, len)), |s| out = Some(s))?;
        out.ok_or(TransportError::LocalNotRegistered { addr, len })
    }
}

/// One part of a vectored write: bytes owned by the caller, or a registered span.
#[derive(Clone, Copy, Debug)]
pub enum IoPart<'a> {
    /// Plain bytes (frame headers).
    Bytes(&'a [u8]),
    /// Registered memory.
    Span(Span),
}

impl IoPart<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            IoPart::Bytes(b) => b.len(),
            IoPart::Span(s) => s.len,
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Waits up to `timeout` for `fd` to have bytes to read (or an error or hang-up to report);
/// false on timeout. Unlike a blocking `read`, which sleeps on the socket's one wait queue and
/// is woken each time its send buffer drains, `poll` for `POLLIN` is woken only for input: the
/// thread reading acknowledgements off a socket another thread writes bulk data into no longer
/// wakes for every acknowledged segment.
pub fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid `pollfd` on this stack frame, borrowed for the call only.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n > 0)
}

/// Most iovecs passed to one `writev`/`readv`: Linux's `IOV_MAX`. Head slices and staged
/// blocks received in place move 1 KiB per iovec (Llama-3-8B, TP 2 → 1), so each call's reach
/// matters: 1024 against 256 ran TP2→TP1 head slices at 4.13–4.49 against 3.70–4.14 GB/s in
/// six alternating pairs.
pub const MAX_IOV: usize = 1024;

/// Bytes per call of the `tcp` backend's sending threads ([`writev_at_most`]): the kernel pushes
/// what a call queued at its end (or at half the peer's window), so one call of many megabytes
/// reaches the receiver in bursts of megabytes, after the bytes left the caches. With
/// [`quick_acks`] on the receiver, 1 MiB calls ran kvx's `tcp` bulk path at 0.89–1.00 of a plain
/// socket loop against 0.81–0.85 in 16 MiB calls (`docs/benchmarks.md`, "Where bulk time
/// goes"); the syscalls it adds are a few per MiB.
pub const BULK_WRITE: usize = 1 << 20;

/// Re-arms quick TCP ACKs on `stream` (Linux's `TCP_QUICKACK`; a no-op elsewhere), best effort.
/// A receiver calls it after each small reply it writes (an acknowledgement, a status): a
/// socket that answers soon after receiving is taken for request/response traffic and its TCP
/// ACKs of the next bulk bytes are delayed, while the sender waits on them to free its send
/// buffer. The setting lasts until the kernel sees such a reply again, hence after each one.
pub fn quick_acks(stream: &std::net::TcpStream) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let _ = socket2::SockRef::from(stream).set_tcp_quickack(true);
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = stream;
}

/// Appends the `len` bytes at `base` to `iov`, extending the last iovec instead when they start
/// where it ends: a TP 2 → 1 head slice's source runs are 1 KiB each but lie end to end in the
/// prefill's pages, so a `writev` takes megabytes of them in one iovec instead of 1 KiB per
/// iovec (1024 per call). The same bytes, in the same order, either way. False, with nothing
/// appended, when `iov` already holds `max` iovecs and the last cannot be extended.
fn push_iov(iov: &mut Vec<libc::iovec>, base: usize, len: usize, max: usize) -> bool {
    if let Some(last) = iov.last_mut()
        && (last.iov_base as usize).checked_add(last.iov_len) == Some(base)
    {
        last.iov_len += len;
        return true;
    }
    if iov.len() >= max {
        return false;
    }
    iov.push(libc::iovec {
        iov_base: base as *mut libc::c_void,
        iov_len: len,
    });
    true
}

/// `writev(fd, parts)` skipping the first `skip` bytes of the sequence; non-blocking sockets
/// return `WouldBlock` as an error. Returns bytes written.
pub fn writev(fd: RawFd, parts: &[IoPart<'_>], skip: usize) -> io::Result<usize> {
    send_parts(fd, parts, skip, usize::MAX, false)
}

/// [`writev`] of at most `max` bytes (at least 1): the rest is left for the next call.
pub fn writev_at_most(
    fd: RawFd,
    parts: &[IoPart<'_>],
    skip: usize,
    max: usize,
) -> io::Result<usize> {
    send_parts(fd, parts, skip, max.max(1), false)
}

/// [`writev`] on a socket that never waits, whatever the socket's mode (`sendmsg` with
/// `MSG_DONTWAIT`): writes what the send buffer takes now, `WouldBlock` when it takes nothing.
pub fn writev_nowait(fd: RawFd, parts: &[IoPart<'_>], skip: usize) -> io::Result<usize> {
    send_parts(fd, parts, skip, usize::MAX, true)
}

/// One `writev` (or non-blocking `sendmsg`) of the parts after `skip`, at most `max` bytes and
/// [`MAX_IOV`] iovecs.
fn send_parts(
    fd: RawFd,
    parts: &[IoPart<'_>],
    mut skip: usize,
    max: usize,
    nowait: bool,
) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(parts.len().min(MAX_IOV));
    let mut left = max;
    for p in parts {
        let len = p.len();
        if skip >= len {
            skip -= len;
            continue;
        }
        if left == 0 {
            break;
        }
        let base = match p {
            IoPart::Bytes(b) => b.as_ptr() as usize,
            IoPart::Span(s) => s.addr as usize,
        };
        let take = (len - skip).min(left);
        if !push_iov(&mut iov, base + skip, take, MAX_IOV) {
            break;
        }
        left -= take;
        skip = 0;
    }
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: every iovec points either into a caller-owned byte slice that outlives this call
    // or into a `Span`, which exists only after a successful registered-region lookup; the
    // registration contract keeps that memory mapped while registered. writev only reads them.
    let n = if nowait {
        // SAFETY: as above; the message header only refers to `iov`, which outlives the call.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        }
    } else {
        // SAFETY: see the comment above.
        unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) }
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Writes every byte of `parts` to a blocking socket with [`writev`] (retrying on `EINTR`).
/// Returns the bytes written (the sum of the parts' lengths).
pub fn writev_all(fd: RawFd, parts: &[IoPart<'_>]) -> io::Result<u64> {
    let (mut idx, mut off, mut total) = (0usize, 0usize, 0u64);
    while idx < parts.len() {
        if parts[idx].len() == off {
            idx += 1;
            off = 0;
            continue;
        }
        let mut n = match writev(fd, &parts[idx..], off) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        total += n as u64;
        while n > 0 && idx < parts.len() {
            let left = parts[idx].len() - off;
            if n >= left {
                n -= left;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
    Ok(total)
}

/// Where received payload bytes go: registered memory, or (for a rejected write) nowhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvTarget {
    /// Straight into a checked span.
    Mem(Span),
    /// This many bytes are read into a scratch buffer and dropped.
    Discard(u64),
}

impl RecvTarget {
    /// Payload length of this target.
    pub fn len(&self) -> u64 {
        match self {
            RecvTarget::Mem(s) => s.len as u64,
            RecvTarget::Discard(n) => *n,
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One `readv`: the rest of `targets` (the first one from byte `off`), then `tail` (the next
/// frame header). Payload for [`RecvTarget::Mem`] lands straight in registered memory; discarded
/// bytes land in `scratch`. Returns bytes read; 0 means EOF.
pub fn readv_targets(
    fd: RawFd,
    targets: &[RecvTarget],
    mut off: usize,
    scratch: &mut [u8],
    tail: &mut [u8],
) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = Vec::with_capacity((targets.len() + 1).min(MAX_IOV));
    let mut complete = true;
    for t in targets {
        let left = (t.len() as usize).saturating_sub(off);
        match t {
            _ if left == 0 => {}
            RecvTarget::Mem(s) => {
                if !push_iov(&mut iov, s.addr as usize + off, left, MAX_IOV - 1) {
                    complete = false;
                    break;
                }
            }
            RecvTarget::Discard(_) => {
                let n = left.min(scratch.len());
                if !push_iov(&mut iov, scratch.as_mut_ptr() as usize, n, MAX_IOV - 1) {
                    complete = false;
                    break;
                }
                if n < left {
                    // Bytes after this one still belong to the discarded payload.
                    complete = false;
                    break;
                }
            }
        }
        off = 0;
    }
    if complete && !tail.is_empty() {
        iov.push(libc::iovec {
            iov_base: tail.as_mut_ptr() as *mut libc::c_void,
            iov_len: tail.len(),
        });
    }
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: `Mem` iovecs lie inside `Span`s, which exist only after a successful check
    // against a registered region (the registration contract keeps them mapped and writable);
    // the others point into `scratch` and `tail`, exclusively borrowed for this call. Several
    // iovecs may share `scratch`; its bytes are never read. The kernel writes at most iov_len
    // bytes into each.
    let n = unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Copies `src` into `dst` (equal lengths; overlapping ranges allowed). Returns bytes copied.
pub fn copy(src: Span, dst: Span) -> usize {
    let n = src.len.min(dst.len);
    // SAFETY: both spans were checked against registered regions (mapped, readable/writable
    // under the registration contract); `n` fits both; `ptr::copy` tolerates overlap.
    unsafe {
        std::ptr::copy(
            src.addr as usize as *const u8,
            dst.addr as usize as *mut u8,
            n,
        );
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_lookup_remove() {
        let t = RegionTable::new();
        let k = t.insert(0x1000, 0x1000).unwrap();
        assert!(t.insert(0x1800, 0x10).is_err());
        assert!(t.insert(0xf00, 0x101).is_err());
        assert!(t.insert(0, 1).is_err());
        assert!(t.insert(0x5000, 0).is_err());
        assert!(t.insert(u64::MAX - 1, 4).is_err());
        let k2 = t.insert(0x2000, 0x10).unwrap();
        assert_ne!(k, k2);
        assert_eq!(t.check_keyed(k, 0x1000, 0x1000).unwrap().len(), 0x1000);
        assert_eq!(
            t.check_keyed(k, 0x1001, 0x1000),
            Err(RejectReason::OutOfBounds)
        );
        assert_eq!(
            t.check_keyed(k, u64::MAX, 2),
            Err(RejectReason::OutOfBounds)
        );
        assert_eq!(
            t.check_keyed(RegionKey(k.0 ^ 0x8000_0000), 0x1000, 1),
            Err(RejectReason::BadKey)
        );
        assert!(t.resolve(0x2000, 0x10).is_ok());
        assert!(t.resolve(0x1fff, 2).is_err());
        assert_eq!(t.descriptor("x").regions.len(), 2);
        t.remove(k).unwrap();
        assert_eq!(t.check_keyed(k, 0x1000, 1), Err(RejectReason::BadKey));
        assert!(t.remove(k).is_err());
    }

    struct Flag(AtomicBool);

    impl Interrupt for Flag {
        fn interrupt(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn deregister_waits_for_the_lease_holder() {
        let t = Arc::new(RegionTable::new());
        let k = t.insert(0x1000, 0x1000).unwrap();
        let other = t.insert(0x4000, 0x10).unwrap();
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let rx = t.receiver(flag.clone());
        let idle = t.receiver(Arc::new(NoInterrupt));
        assert!(t.lease_keyed(&rx, k, 0x1100, 0x10).is_ok());
        assert!(t.lease_keyed(&idle, other, 0x4000, 0x10).is_ok());
        assert!(rx.holds_any());
        let (done_tx, done) = std::sync::mpsc::channel();
        let t2 = t.clone();
        let h = std::thread::spawn(move || {
            t2.deregister(k).unwrap();
            done_tx.send(()).unwrap();
        });
        // The holder is interrupted (its mark first, then its interrupt hook); the call cannot
        // return while the lease is held.
        while !(rx.is_interrupted() && flag.0.load(Ordering::SeqCst)) {
            std::thread::yield_now();
        }
        assert!(done.try_recv().is_err());
        // No new lease on the region once it is going.
        let late = t.receiver(Arc::new(NoInterrupt));
        assert_eq!(
            t.lease_keyed(&late, k, 0x1100, 1),
            Err(RejectReason::BadKey)
        );
        rx.release();
        done.recv().unwrap();
        h.join().unwrap();
        assert!(!idle.is_interrupted());
        // Closing interrupts the remaining holder and waits for it.
        let t3 = t.clone();
        let h = std::thread::spawn(move || t3.close_receive());
        while !idle.is_interrupted() {
            std::thread::yield_now();
        }
        drop(idle);
        h.join().unwrap();
        assert!(t.is_closed());
        assert!(t.lease_range(&late, 0x4000, 1).is_err());
    }

    /// One frame's writes, checked in one go, give what one `lease_keyed` (or `check_keyed`
    /// for an empty write) per write gives, and hold each region used once.
    #[test]
    fn a_frame_is_leased_as_its_writes_one_by_one() {
        let t = Arc::new(RegionTable::new());
        let a = t.insert(0x1000, 0x1000).unwrap();
        let b = t.insert(0x4000, 0x100).unwrap();
        let bad = RegionKey(999);
        let writes = [
            (a, 0x1000, 0x10),
            (a, 0x1ff0, 0x20),
            (b, 0x4000, 0x100),
            (b, 0x4000, 0),
            (bad, 0x1000, 1),
            (a, 0x1010, 0x10),
            (a, 0x2000, 0),
        ];
        let one = t.receiver(Arc::new(NoInterrupt));
        let want: Vec<_> = writes
            .iter()
            .map(|&(k, addr, len)| {
                if len == 0 {
                    t.check_keyed(k, addr, len)
                } else {
                    t.lease_keyed(&one, k, addr, len)
                }
            })
            .collect();
        let rx = t.receiver(Arc::new(NoInterrupt));
        let mut got = Vec::new();
        t.lease_keyed_frame(&rx, writes.iter().copied(), |i, len, r| {
            assert_eq!((i, len), (got.len(), writes[i].2));
            got.push(r)
        });
        assert_eq!(got, want);
        assert_eq!(got[1], Err(RejectReason::OutOfBounds));
        assert_eq!(got[4], Err(RejectReason::BadKey));
        // Both regions held by the frame's receiver, each once.
        assert_eq!(lock(&rx.shared.held).len(), 2);
        rx.release();
        one.release();
        assert!(!rx.holds_any());
        // A closed table grants no lease (an empty write is still only checked).
        t.close_receive();
        let mut got = Vec::new();
        t.lease_keyed_frame(
            &rx,
            [(a, 0x1000, 1), (a, 0x1000, 0)].into_iter(),
            |_, _, r| got.push(r),
        );
        assert_eq!(got[0], Err(RejectReason::BadKey));
        assert!(got[1].is_ok());
        assert!(!rx.holds_any());
    }

    /// Places `[0, len)` at stride: byte `o` of the range lands at `dst + 2 * o` in runs of
    /// `run` bytes (every other run skipped), optionally with one piece out of bounds.
    struct Strided {
        len: u64,
        dst: u64,
        run: u64,
        stray: bool,
    }

    impl Placement for Strided {
        fn len(&self) -> u64 {
            self.len
        }
        fn bounds(&self) -> (u64, u64) {
            (self.dst, self.dst + 2 * self.len)
        }
        fn pieces(&self, off: u64, len: u64, f: &mut dyn FnMut(u64, u64)) -> u64 {
            let end = (off + len).min(self.len);
            let mut at = off;
            while at < end {
                let n = (self.run - at % self.run).min(end - at);
                let base = if self.stray && at == 0 { 0 } else { self.dst };
                f(base + 2 * at - at % self.run, n);
                at += n;
            }
            end.saturating_sub(off)
        }
    }

    fn frame(
        t: &RegionTable,
        rx: &Receiver,
        writes: &[(RegionKey, u64, u64)],
    ) -> Vec<(usize, u64, Result<Span, RejectReason>)> {
        let mut got = Vec::new();
        t.lease_keyed_frame(rx, writes.iter().copied(), |i, n, r| got.push((i, n, r)));
        got
    }

    /// A placement that names more bytes than asked for (a broken map).
    struct Greedy;

    impl Placement for Greedy {
        fn len(&self) -> u64 {
            0x100
        }
        fn bounds(&self) -> (u64, u64) {
            (0x10000, 0x10100)
        }
        fn pieces(&self, _off: u64, len: u64, f: &mut dyn FnMut(u64, u64)) -> u64 {
            f(0x10000, len + 0x40);
            f(0x10000, 8);
            len + 0x48
        }
    }

    #[test]
    fn a_map_naming_too_many_bytes_is_cut_to_the_write() {
        let t = RegionTable::new();
        let ring = t.insert(0x1000, 0x1000).unwrap();
        t.insert(0x10000, 0x1000).unwrap();
        t.place(0x1000, Arc::new(Greedy)).unwrap();
        let rx = t.receiver(Arc::new(NoInterrupt));
        let got = frame(&t, &rx, &[(ring, 0x1000, 0x20)]);
        assert_eq!(
            got,
            vec![(
                0,
                0x20,
                Ok(Span {
                    addr: 0x10000,
                    len: 0x20
                })
            )]
        );
        rx.release();
        assert_eq!(t.unplace(0x1000), Some(0x20));
    }

    #[test]
    fn writes_into_a_placed_range_land_where_the_placement_says() {
        let t = RegionTable::new();
        let ring = t.insert(0x1000, 0x1000).unwrap();
        t.insert(0x10000, 0x1000).unwrap();
        let map = Arc::new(Strided {
            len: 0x100,
            dst: 0x10000,
            run: 0x40,
            stray: false,
        });
        t.place(0x1100, map.clone()).unwrap();
        // No overlap with a placed range; bounds and range inside registered regions.
        assert!(t.place(0x10c0, map.clone()).is_err());
        assert!(t.place(0x11ff, map.clone()).is_err());
        assert!(
            t.place(0x1f80, map.clone()).is_err(),
            "range past its region"
        );
        let wide = Arc::new(Strided {
            len: 0x1000,
            dst: 0x10000,
            run: 0x40,
            stray: false,
        });
        assert!(
            t.place(0x1000, wide).is_err(),
            "bounds past the destination region"
        );
        let rx = t.receiver(Arc::new(NoInterrupt));
        // A write straddling the placed range's start, one inside it, one after it.
        let got = frame(
            &t,
            &rx,
            &[
                (ring, 0x10f0, 0x60),
                (ring, 0x11c0, 0x20),
                (ring, 0x1300, 8),
            ],
        );
        let span = |a: u64, n: u64| {
            Ok(Span {
                addr: a,
                len: n as usize,
            })
        };
        assert_eq!(
            got,
            vec![
                (0, 0x10, span(0x10f0, 0x10)),
                (0, 0x40, span(0x10000, 0x40)),
                (0, 0x10, span(0x10080, 0x10)),
                (1, 0x20, span(0x10180, 0x20)),
                (2, 8, span(0x1300, 8)),
            ]
        );
        // Both regions held once.
        assert_eq!(lock(&rx.shared.held).len(), 2);
        rx.release();
        assert_eq!(t.unplace(0x1100), Some(0x70));
        assert_eq!(t.unplace(0x1100), None);
        // Unplaced: the ring again.
        assert_eq!(
            frame(&t, &rx, &[(ring, 0x1100, 4)]),
            vec![(0, 4, span(0x1100, 4))]
        );
        rx.release();
        // A piece outside the placement's bounds is rejected, the others land.
        let stray = Arc::new(Strided {
            len: 0x80,
            dst: 0x10000,
            run: 0x40,
            stray: true,
        });
        t.place(0x1100, stray).unwrap();
        let got = frame(&t, &rx, &[(ring, 0x1100, 0x80)]);
        assert_eq!(got[0], (0, 0x40, Err(RejectReason::OutOfBounds)));
        assert_eq!(got[1], (0, 0x40, span(0x10080, 0x40)));
        rx.release();
        // Deregistering the ring ends its placements.
        t.deregister(ring).unwrap();
        assert_eq!(t.unplace(0x1100), None);
    }

    proptest::proptest! {
        /// Any pieces, end to end or apart, in or out of address order, sent with `writev_all`
        /// and received with `readv_targets` (however each call splits them): the stream is
        /// the pieces' bytes in order, and every target holds its piece's bytes.
        #[test]
        fn vectored_io_with_merged_iovecs_keeps_order(
            pieces in proptest::collection::vec((0usize..3, 1usize..300), 1..1500),
            shuffle in proptest::collection::vec(proptest::num::usize::ANY, 0..64),
        ) {
            use std::io::{Read as _, Write as _};
            use std::os::fd::AsRawFd as _;
            // Disjoint ranges of one buffer: gap 0 puts a piece right after the previous one.
            let mut ranges = Vec::with_capacity(pieces.len());
            let mut at = 0usize;
            for &(gap, len) in &pieces {
                at += gap * 7;
                ranges.push((at, len));
                at += len;
            }
            // Some swapped: pieces adjacent in memory but not in sequence are not merged.
            for (i, &k) in shuffle.iter().enumerate() {
                let n = ranges.len();
                ranges.swap(i % n, k % n);
            }
            let t = RegionTable::new();
            let src: Vec<u8> = (0..at).map(|i| (i * 31 + 5) as u8).collect();
            let mut dst = vec![0u8; at];
            t.insert(src.as_ptr() as u64, at as u64).unwrap();
            t.insert(dst.as_mut_ptr() as u64, at as u64).unwrap();
            let (sb, db) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
            let parts: Vec<IoPart<'_>> = ranges
                .iter()
                .map(|&(o, n)| IoPart::Span(t.resolve(sb + o as u64, n as u64).unwrap()))
                .collect();
            let want: Vec<u8> = ranges.iter().flat_map(|&(o, n)| src[o..o + n].to_vec()).collect();
            let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            let reader = std::thread::spawn(move || {
                let mut got = Vec::new();
                a.read_to_end(&mut got).unwrap();
                got
            });
            proptest::prop_assert_eq!(writev_all(b.as_raw_fd(), &parts).unwrap(), want.len() as u64);
            drop(b);
            let got = reader.join().unwrap();
            proptest::prop_assert!(got == want, "sent stream differs");
            // The same bytes received into the same ranges of `dst`.
            let targets: Vec<RecvTarget> = ranges
                .iter()
                .map(|&(o, n)| RecvTarget::Mem(t.resolve(db + o as u64, n as u64).unwrap()))
                .collect();
            let starts: Vec<usize> = ranges
                .iter()
                .scan(0usize, |acc, &(_, n)| { let s = *acc; *acc += n; Some(s) })
                .collect();
            let (mut c, d) = std::os::unix::net::UnixStream::pair().unwrap();
            let writer = std::thread::spawn(move || c.write_all(&got).unwrap());
            let mut done = 0usize;
            while done < want.len() {
                let i = starts.partition_point(|&s| s <= done) - 1;
                let n = readv_targets(d.as_raw_fd(), &targets[i..], done - starts[i], &mut [], &mut [])
                    .unwrap();
                proptest::prop_assert!(n > 0, "EOF after {} bytes", done);
                done += n;
            }
            writer.join().unwrap();
            for &(o, n) in &ranges {
                proptest::prop_assert!(dst[o..o + n] == src[o..o + n], "piece at {} differs", o);
            }
        }

        /// Any placements and any writes (edge addresses and lengths included): no panic, the
        /// targets of each write add up to its length, every span lies in a registered region
        /// (a routed one inside its placement's bounds), and the bytes counted as routed are
        /// those of the routed spans.
        #[test]
        fn routed_frames_stay_in_bounds(
            places in proptest::collection::vec(
                (0u64..0x1200, 1u64..0x300, 1u64..0x80, proptest::bool::ANY),
                0..4,
            ),
            writes in proptest::collection::vec(
                (
                    0usize..3,
                    proptest::prop_oneof![0u64..0x3000, (u64::MAX - 8)..=u64::MAX],
                    proptest::prop_oneof![0u64..0x600, (u64::MAX - 8)..=u64::MAX],
                ),
                0..8,
            ),
        ) {
            let t = RegionTable::new();
            let ring = t.insert(0x1000, 0x1000).unwrap();
            let kv = t.insert(0x10000, 0x1000).unwrap();
            let keys = [ring, kv, RegionKey(7)];
            let mut placed = Vec::new();
            for (at, len, run, stray) in places {
                let map = Arc::new(Strided { len, dst: 0x10000, run, stray });
                if t.place(0x1000 + at, map).is_ok() {
                    placed.push(0x1000 + at);
                }
            }
            let rx = t.receiver(Arc::new(NoInterrupt));
            let writes: Vec<(RegionKey, u64, u64)> =
                writes.into_iter().map(|(k, a, l)| (keys[k], a, l)).collect();
            let mut sums = vec![0u64; writes.len()];
            let mut routed = 0u64;
            t.lease_keyed_frame(&rx, writes.iter().copied(), |i, n, r| {
                sums[i] += n;
                if let Ok(span) = r {
                    let (a, n) = (span.addr(), span.len() as u64);
                    let in_ring = a >= 0x1000 && a + n <= 0x2000;
                    let in_kv = a >= 0x10000 && a + n <= 0x11000;
                    assert!(in_ring || in_kv, "span {a:#x}+{n} outside every region");
                    assert_eq!(n, span.len() as u64);
                    if in_kv {
                        routed += n;
                    }
                }
            });
            for (i, w) in writes.iter().enumerate() {
                proptest::prop_assert_eq!(sums[i], w.2, "write {:?}", w);
            }
            rx.release();
            let counted: u64 = placed.iter().filter_map(|&a| t.unplace(a)).sum();
            // Rejected pieces (a stray map's) are counted as routed too: the receiver drains
            // them, and the decode compares the count with the block it expected.
            proptest::prop_assert!(counted >= routed, "{counted} < {routed}");
        }
    }

    /// Every part's bytes arrive in order, whatever the partial writes and skips: more parts
    /// apart than `MAX_IOV` (several `writev`s), parts touching end to end (one iovec), a socket
    /// buffer far smaller than the total.
    #[test]
    fn many_parts_arrive_whole_and_in_order() {
        use std::io::Read as _;
        use std::os::fd::AsRawFd as _;
        let t = RegionTable::new();
        let src: Vec<u8> = (0..128 * 1024).map(|i| (i * 7 + 3) as u8).collect();
        t.insert(src.as_ptr() as u64, src.len() as u64).unwrap();
        let base = src.as_ptr() as u64;
        let head = *b"HEAD";
        let mut parts = vec![IoPart::Bytes(&head)];
        let mut want = head.to_vec();
        // 3000 adjacent 16-byte spans (one run), a gap, then 1500 spans 8 bytes apart.
        for i in 0..3000u64 {
            parts.push(IoPart::Span(t.resolve(base + i * 16, 16).unwrap()));
        }
        want.extend_from_slice(&src[..3000 * 16]);
        for i in 0..1500u64 {
            let at = 50_000 + i * 24;
            parts.push(IoPart::Span(t.resolve(base + at, 16).unwrap()));
            want.extend_from_slice(&src[at as usize..at as usize + 16]);
        }
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            a.read_to_end(&mut got).unwrap();
            got
        });
        assert_eq!(
            writev_all(b.as_raw_fd(), &parts).unwrap(),
            want.len() as u64
        );
        drop(b);
        assert_eq!(reader.join().unwrap(), want);
    }

    /// A capped `writev` writes at most its cap, from where the previous call stopped, across
    /// part boundaries and inside one merged run.
    #[test]
    fn capped_writes_stop_at_the_cap_and_resume_in_order() {
        use std::io::Read as _;
        use std::os::fd::AsRawFd as _;
        let t = RegionTable::new();
        let src: Vec<u8> = (0..4096).map(|i| (i * 5 + 1) as u8).collect();
        t.insert(src.as_ptr() as u64, src.len() as u64).unwrap();
        let base = src.as_ptr() as u64;
        let head = *b"HEADER";
        // A header, two spans touching end to end (one iovec), a third apart.
        let parts = [
            IoPart::Bytes(&head),
            IoPart::Span(t.resolve(base, 1000).unwrap()),
            IoPart::Span(t.resolve(base + 1000, 1000).unwrap()),
            IoPart::Span(t.resolve(base + 3000, 500).unwrap()),
        ];
        let mut want = head.to_vec();
        want.extend_from_slice(&src[..2000]);
        want.extend_from_slice(&src[3000..3500]);
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (mut done, mut calls) = (0usize, 0);
        while done < want.len() {
            // `done` bytes skipped: the next call resumes inside a part or a merged run.
            let n = writev_at_most(b.as_raw_fd(), &parts, done, 700).unwrap();
            assert_eq!(n, (want.len() - done).min(700));
            done += n;
            calls += 1;
        }
        assert_eq!(calls, want.len().div_ceil(700));
        drop(b);
        let mut got = Vec::new();
        a.read_to_end(&mut got).unwrap();
        assert_eq!(got, want);
    }

    /// Received bytes land in order in targets touching end to end and in more targets apart
    /// than one `readv` takes, however the calls split them, the header after them last.
    #[test]
    fn many_targets_fill_in_order() {
        use std::io::Write as _;
        use std::os::fd::AsRawFd as _;
        let t = RegionTable::new();
        let mut dst = vec![0u8; 64 * 1024];
        t.insert(dst.as_mut_ptr() as u64, dst.len() as u64).unwrap();
        let base = dst.as_mut_ptr() as u64;
        // 2000 adjacent 8-byte targets (one run), then 1500 targets 8 bytes apart.
        let mut at: Vec<u64> = (0..2000u64).map(|i| i * 8).collect();
        at.extend((0..1500u64).map(|i| 20_000 + i * 16));
        let targets: Vec<RecvTarget> = at
            .iter()
            .map(|&a| RecvTarget::Mem(t.resolve(base + a, 8).unwrap()))
            .collect();
        let payload: Vec<u8> = (0..at.len() * 8).map(|i| (i * 13 + 1) as u8).collect();
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let writer = {
            let mut bytes = payload.clone();
            bytes.extend_from_slice(b"NEXT");
            std::thread::spawn(move || a.write_all(&bytes).unwrap())
        };
        let (mut done, mut tail) = (0usize, [0u8; 4]);
        while done < payload.len() + tail.len() {
            let (i, off) = (done / 8, done % 8);
            let n = if i < targets.len() {
                readv_targets(b.as_raw_fd(), &targets[i..], off, &mut [], &mut tail).unwrap()
            } else {
                let got = done - payload.len();
                readv_targets(b.as_raw_fd(), &[], 0, &mut [], &mut tail[got..]).unwrap()
            };
            assert!(n > 0, "EOF after {done} bytes");
            done += n;
        }
        writer.join().unwrap();
        for (k, &a) in at.iter().enumerate() {
            let a = a as usize;
            assert_eq!(&dst[a..a + 8], &payload[k * 8..k * 8 + 8], "target {k}");
        }
        assert_eq!(&tail, b"NEXT");
    }

    /// Pieces touching end to end share one iovec; a gap, or a full list, starts or refuses one.
    #[test]
    fn iovecs_merge_only_end_to_end_pieces() {
        let mut iov = Vec::new();
        assert!(push_iov(&mut iov, 1000, 24, 2));
        assert!(push_iov(&mut iov, 1024, 1024, 2));
        assert_eq!((iov.len(), iov[0].iov_len), (1, 1048));
        assert!(push_iov(&mut iov, 4096, 8, 2));
        assert_eq!(iov.len(), 2);
        // Full: a piece apart is refused, one extending the last still goes in.
        assert!(!push_iov(&mut iov, 8192, 8, 2));
        assert!(push_iov(&mut iov, 4104, 8, 2));
        assert_eq!(
            (iov.len(), iov[1].iov_base as usize, iov[1].iov_len),
            (2, 4096, 16)
        );
        // An address at the top of the space never wraps into a merge.
        let mut top = vec![libc::iovec {
            iov_base: (usize::MAX - 4) as *mut libc::c_void,
            iov_len: 8,
        }];
        assert!(push_iov(&mut top, 3, 1, 4));
        assert_eq!(top.len(), 2);
    }

    #[test]
    fn copy_between_spans() {
        let t = RegionTable::new();
        let src = [7u8; 64];
        let mut dst = vec![0u8; 64];
        t.insert(src.as_ptr() as u64, 64).unwrap();
        t.insert(dst.as_mut_ptr() as u64, 64).unwrap();
        let s = t.resolve(src.as_ptr() as u64 + 8, 16).unwrap();
        let d = t.resolve(dst.as_mut_ptr() as u64 + 4, 16).unwrap();
        assert_eq!(copy(s, d), 16);
        assert_eq!(&dst[4..20], &[7u8; 16]);
        assert_eq!(dst[3], 0);
        assert_eq!(dst[20], 0);
    }
}
