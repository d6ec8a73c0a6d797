//! The one place every manager's driver calls are counted: a wrapper around
//! any [`Driver`] that counts each call by kind, tracks the physical memory
//! created and not yet released (its peak too), and models the device's
//! size — a `create` that would exceed the capacity fails with
//! out-of-memory, as `cuMemCreate` does on a full GPU.
//!
//! vmm-arena and every baseline run on their own instance of this wrapper
//! over the host backend (sparse mode), so their counts and their physical
//! footprint come from the same code.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use vmm_arena::driver::{CallKind, ChunkHandle, Driver, Granularity};
use vmm_arena::{Error, Result};

/// Driver calls are priced per 2 MiB chunk they cover (see `timing.rs`).
pub const PRICE_UNIT_BYTES: u64 = 2 << 20;

fn units(bytes: u64) -> u64 {
    bytes.div_ceil(PRICE_UNIT_BYTES).max(1)
}

fn index(k: CallKind) -> usize {
    match k {
        CallKind::Reserve => 0,
        CallKind::FreeReservation => 1,
        CallKind::Create => 2,
        CallKind::Release => 3,
        CallKind::Map => 4,
        CallKind::SetAccess => 5,
        CallKind::Unmap => 6,
        CallKind::Synchronize => 7,
        CallKind::Data => 8,
        // Stream events and sharing: counted, not modeled (the managers
        // here make none).
        CallKind::Event | CallKind::Share => 9,
        // Host buffers for sleep backups: counted, not modeled.
        CallKind::HostAlloc => 10,
    }
}

/// Driver calls by kind. `create` counts the chunks created; creates
/// refused because the device was full are counted apart, in
/// `create_failed` (and charged nothing by the cost model).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Calls {
    pub reserve: u64,
    pub free_reservation: u64,
    pub create: u64,
    pub create_failed: u64,
    pub release: u64,
    pub map: u64,
    pub set_access: u64,
    pub unmap: u64,
    pub synchronize: u64,
    pub data: u64,
    /// The 2 MiB chunks the calls of each kind covered (a call over 20 MiB
    /// counts 10), for pricing by size.
    pub create_chunks: u64,
    pub release_chunks: u64,
    pub map_chunks: u64,
    pub set_access_chunks: u64,
    pub unmap_chunks: u64,
}

impl Calls {
    /// The calls made between two snapshots.
    pub fn since(&self, before: &Calls) -> Calls {
        Calls {
            reserve: self.reserve - before.reserve,
            free_reservation: self.free_reservation - before.free_reservation,
            create: self.create - before.create,
            create_failed: self.create_failed - before.create_failed,
            release: self.release - before.release,
            map: self.map - before.map,
            set_access: self.set_access - before.set_access,
            unmap: self.unmap - before.unmap,
            synchronize: self.synchronize - before.synchronize,
            data: self.data - before.data,
            create_chunks: self.create_chunks - before.create_chunks,
            release_chunks: self.release_chunks - before.release_chunks,
            map_chunks: self.map_chunks - before.map_chunks,
            set_access_chunks: self.set_access_chunks - before.set_access_chunks,
            unmap_chunks: self.unmap_chunks - before.unmap_chunks,
        }
    }

    /// Driver calls that change mappings or memory (data access excluded).
    pub fn management(&self) -> u64 {
        self.reserve + self.free_reservation + self.create + self.release + self.map + self.set_access + self.unmap
    }
}

/// Counting, capacity-enforcing wrapper (see the module documentation).
#[derive(Debug)]
pub struct Counted<D> {
    inner: D,
    capacity: u64,
    counts: [AtomicU64; 11],
    /// Chunks covered, by call kind (see [`Calls::create_chunks`]).
    chunks: [AtomicU64; 11],
    create_failed: AtomicU64,
    live: AtomicU64,
    peak: AtomicU64,
    sizes: Mutex<HashMap<ChunkHandle, u64>>,
}

impl<D: Driver> Counted<D> {
    /// Wraps `inner`; creates beyond `capacity` bytes of live chunks fail.
    pub fn new(inner: D, capacity: u64) -> Counted<D> {
        Counted {
            inner,
            capacity,
            counts: Default::default(),
            chunks: Default::default(),
            create_failed: AtomicU64::new(0),
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            sizes: Mutex::new(HashMap::new()),
        }
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Calls so far.
    pub fn calls(&self) -> Calls {
        let c = |k: CallKind| self.counts[index(k)].load(Relaxed);
        let u = |k: CallKind| self.chunks[index(k)].load(Relaxed);
        Calls {
            reserve: c(CallKind::Reserve),
            free_reservation: c(CallKind::FreeReservation),
            create: c(CallKind::Create),
            create_failed: self.create_failed.load(Relaxed),
            release: c(CallKind::Release),
            map: c(CallKind::Map),
            set_access: c(CallKind::SetAccess),
            unmap: c(CallKind::Unmap),
            synchronize: c(CallKind::Synchronize),
            data: c(CallKind::Data),
            create_chunks: u(CallKind::Create),
            release_chunks: u(CallKind::Release),
            map_chunks: u(CallKind::Map),
            set_access_chunks: u(CallKind::SetAccess),
            unmap_chunks: u(CallKind::Unmap),
        }
    }

    /// Physical bytes created and not released.
    pub fn live_bytes(&self) -> u64 {
        self.live.load(Relaxed)
    }

    /// High-water mark of [`Counted::live_bytes`].
    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    fn count(&self, k: CallKind) {
        self.counts[index(k)].fetch_add(1, Relaxed);
    }

    fn count_sized(&self, k: CallKind, bytes: u64) {
        self.count(k);
        self.chunks[index(k)].fetch_add(units(bytes), Relaxed);
    }
}

impl<D: Driver> Driver for Counted<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn granularity(&self) -> Result<Granularity> {
        self.inner.granularity()
    }
    fn total_memory(&self) -> Result<u64> {
        Ok(self.capacity)
    }
    fn reserve(&self, size: u64, align: u64) -> Result<u64> {
        self.count(CallKind::Reserve);
        self.inner.reserve(size, align)
    }
    fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
        self.count(CallKind::FreeReservation);
        self.inner.free_reservation(base, size)
    }
    fn create(&self, size: u64) -> Result<ChunkHandle> {
        let mut sizes = self.sizes.lock().map_err(|_| Error::Internal("counter lock poisoned".into()))?;
        let live = self.live.load(Relaxed);
        if live + size > self.capacity {
            self.create_failed.fetch_add(1, Relaxed);
            return Err(Error::OutOfMemory(format!(
                "create of {size} bytes: {live} of {} bytes of device memory in use",
                self.capacity
            )));
        }
        let h = self.inner.create(size).inspect_err(|_| {
            self.create_failed.fetch_add(1, Relaxed);
        })?;
        self.count_sized(CallKind::Create, size);
        sizes.insert(h, size);
        self.live.store(live + size, Relaxed);
        self.peak.fetch_max(live + size, Relaxed);
        Ok(h)
    }
    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        self.inner.release(chunk)?;
        let mut sizes = self.sizes.lock().map_err(|_| Error::Internal("counter lock poisoned".into()))?;
        let size = sizes.remove(&chunk);
        if let Some(s) = size {
            self.live.fetch_sub(s, Relaxed);
        }
        self.count_sized(CallKind::Release, size.unwrap_or(0));
        Ok(())
    }
    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
        self.count_sized(CallKind::Map, size);
        self.inner.map(addr, size, chunk, offset)
    }
    fn set_access(&self, addr: u64, size: u64) -> Result<()> {
        self.count_sized(CallKind::SetAccess, size);
        self.inner.set_access(addr, size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.count_sized(CallKind::Unmap, size);
        self.inner.unmap(addr, size)
    }
    fn synchronize(&self) -> Result<()> {
        self.count(CallKind::Synchronize);
        self.inner.synchronize()
    }
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        self.count(CallKind::Data);
        self.inner.read(addr, dst)
    }
    fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.count(CallKind::Data);
        self.inner.write(addr, src)
    }
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        self.count(CallKind::Data);
        self.inner.copy(dst, src, len)
    }
    fn alloc_host(&self, len: usize) -> Result<vmm_arena::driver::HostBuffer> {
        self.count(CallKind::HostAlloc);
        self.inner.alloc_host(len)
    }
}

/// A failure of the host simulation itself (the kernel refused a mapping,
/// typically `vm.max_map_count`), not of the allocator's policy.
pub fn is_host_limit(e: &Error) -> bool {
    match e {
        Error::OutOfMemory(m) => m.contains("mmap") || m.contains("mprotect"),
        Error::Driver { .. } | Error::Internal(_) => true,
        _ => false,
    }
}
