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

/// Average cost per call on an A100 (kvcached's VMM benchmark, per 2 MiB
/// chunk; see the design brief). `cuMemRelease` was not measured there and
/// is charged nothing; `cudaMalloc`/`cudaFree` of the caching allocator's
/// segments are charged as the create/map/access/unmap they stand for.
pub const COST_CREATE_S: f64 = 193e-6;
pub const COST_SET_ACCESS_S: f64 = 36e-6;
pub const COST_UNMAP_S: f64 = 25.6e-6;
pub const COST_MAP_S: f64 = 1.45e-6;
pub const COST_RESERVE_S: f64 = 19e-6;

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
        // Stream events: counted, not modeled (the managers here make none).
        CallKind::Event => 9,
    }
}

/// Driver calls by kind. `create` counts the chunks created; creates
/// refused because the device was full are counted apart, in
/// `create_failed` (and charged nothing by the cost model).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
}

impl Calls {
    /// Modeled driver time with the A100 cost table (data movement excluded).
    pub fn modeled_seconds(&self) -> f64 {
        self.create as f64 * COST_CREATE_S
            + self.set_access as f64 * COST_SET_ACCESS_S
            + self.unmap as f64 * COST_UNMAP_S
            + self.map as f64 * COST_MAP_S
            + self.reserve as f64 * COST_RESERVE_S
    }
}

/// Counting, capacity-enforcing wrapper (see the module documentation).
#[derive(Debug)]
pub struct Counted<D> {
    inner: D,
    capacity: u64,
    counts: [AtomicU64; 10],
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
        self.count(CallKind::Create);
        sizes.insert(h, size);
        self.live.store(live + size, Relaxed);
        self.peak.fetch_max(live + size, Relaxed);
        Ok(h)
    }
    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        self.count(CallKind::Release);
        self.inner.release(chunk)?;
        let mut sizes = self.sizes.lock().map_err(|_| Error::Internal("counter lock poisoned".into()))?;
        if let Some(s) = sizes.remove(&chunk) {
            self.live.fetch_sub(s, Relaxed);
        }
        Ok(())
    }
    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
        self.count(CallKind::Map);
        self.inner.map(addr, size, chunk, offset)
    }
    fn set_access(&self, addr: u64, size: u64) -> Result<()> {
        self.count(CallKind::SetAccess);
        self.inner.set_access(addr, size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.count(CallKind::Unmap);
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
