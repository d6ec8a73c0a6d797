//! The one place every manager's driver calls are counted: a wrapper around
//! any [`Driver`] that counts each call by kind, tracks the physical memory
//! created and not yet released (its peak too), and models the device's
//! size — a `create` that would exceed the capacity fails with
//! out-of-memory, as `cuMemCreate` does on a full GPU.
//!
//! vmm-arena and every baseline run on their own instance of this wrapper
//! over the host backend (sparse mode), so their counts and their physical
//! footprint come from the same code.
//!
//! # Streams and events
//!
//! The host backend has no asynchronous streams: its events would complete
//! at once, which would hide exactly what stream-ordered frees are about.
//! This wrapper models them instead, by the replay's steps (the replay calls
//! [`Counted::finish_gpu_step`] when the GPU has finished a step):
//!
//! - an event recorded while step *k* is prepared or computed completes
//!   only once the GPU has finished step *k*, that is when step *k + 1*
//!   begins: memory freed on a stream is not known idle within the step
//!   that freed it (the arena lets work on the same stream reuse it at
//!   once; any other reuse waits for the event);
//! - [`Driver::event_complete`] (a poll) never blocks and changes nothing;
//! - a wait on an event that has not completed (`wait_event`) blocks until
//!   the GPU has drained: it completes every event recorded so far, and
//!   counts as a *blocking wait* (the time model charges it like a device
//!   synchronize: the step loses its CPU/GPU overlap); a wait on a completed
//!   event does not block;
//! - a device [`Driver::synchronize`] likewise completes every event
//!   recorded so far;
//! - every event call is counted by kind (record, query, wait, blocking
//!   wait, destroy) and priced by the profile (`timing.rs`).

use std::collections::{BTreeMap, HashMap};
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
        // Stream events: every call counts here, and by kind in `Events`.
        CallKind::Event => 9,
        // Sharing (export and import): counted, not modeled (the managers
        // here make none; this driver forwards none).
        CallKind::Share => 11,
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
    /// Stream events (see the module documentation): recorded, polled,
    /// waited for, waited for while not complete (the GPU drained), and
    /// destroyed.
    pub event_record: u64,
    pub event_query: u64,
    pub event_wait: u64,
    pub event_wait_blocked: u64,
    pub event_destroy: u64,
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
            event_record: self.event_record - before.event_record,
            event_query: self.event_query - before.event_query,
            event_wait: self.event_wait - before.event_wait,
            event_wait_blocked: self.event_wait_blocked - before.event_wait_blocked,
            event_destroy: self.event_destroy - before.event_destroy,
        }
    }

    /// The calls of both.
    pub fn plus(&self, o: &Calls) -> Calls {
        Calls {
            reserve: self.reserve + o.reserve,
            free_reservation: self.free_reservation + o.free_reservation,
            create: self.create + o.create,
            create_failed: self.create_failed + o.create_failed,
            release: self.release + o.release,
            map: self.map + o.map,
            set_access: self.set_access + o.set_access,
            unmap: self.unmap + o.unmap,
            synchronize: self.synchronize + o.synchronize,
            data: self.data + o.data,
            create_chunks: self.create_chunks + o.create_chunks,
            release_chunks: self.release_chunks + o.release_chunks,
            map_chunks: self.map_chunks + o.map_chunks,
            set_access_chunks: self.set_access_chunks + o.set_access_chunks,
            unmap_chunks: self.unmap_chunks + o.unmap_chunks,
            event_record: self.event_record + o.event_record,
            event_query: self.event_query + o.event_query,
            event_wait: self.event_wait + o.event_wait,
            event_wait_blocked: self.event_wait_blocked + o.event_wait_blocked,
            event_destroy: self.event_destroy + o.event_destroy,
        }
    }

    /// Calls that make the CPU wait for the GPU: device synchronizes and
    /// waits on events not yet complete.
    pub fn drains(&self) -> u64 {
        self.synchronize + self.event_wait_blocked
    }

    /// Driver calls that change mappings or memory (data access excluded).
    pub fn management(&self) -> u64 {
        self.reserve + self.free_reservation + self.create + self.release + self.map + self.set_access + self.unmap
    }
}

/// The modeled stream events (see the module documentation).
#[derive(Debug, Default)]
struct Events {
    /// The step the GPU is on: events recorded now complete when it ends.
    step: u64,
    next_id: u64,
    /// Live events: id -> the step it was recorded in.
    live: BTreeMap<u64, u64>,
    /// Every event up to this id has completed early (a synchronize or a
    /// blocking wait drained the GPU).
    drained_through: u64,
    record: u64,
    query: u64,
    wait: u64,
    wait_blocked: u64,
    destroy: u64,
}

impl Events {
    fn complete(&self, id: u64) -> Result<bool> {
        match self.live.get(&id) {
            Some(&recorded) => Ok(recorded < self.step || id <= self.drained_through),
            None => Err(Error::InvalidArgument(format!("event {id} is unknown or destroyed"))),
        }
    }

    /// The GPU has finished everything queued so far.
    fn drain(&mut self) {
        self.drained_through = self.next_id;
    }
}

/// Counting, capacity-enforcing wrapper (see the module documentation).
#[derive(Debug)]
pub struct Counted<D> {
    inner: D,
    capacity: u64,
    counts: [AtomicU64; 12],
    /// Chunks covered, by call kind (see [`Calls::create_chunks`]).
    chunks: [AtomicU64; 12],
    create_failed: AtomicU64,
    live: AtomicU64,
    peak: AtomicU64,
    sizes: Mutex<HashMap<ChunkHandle, u64>>,
    events: Mutex<Events>,
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
            events: Mutex::new(Events::default()),
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
        let (event_record, event_query, event_wait, event_wait_blocked, event_destroy) = match self.events.lock() {
            Ok(e) => (e.record, e.query, e.wait, e.wait_blocked, e.destroy),
            Err(_) => Default::default(),
        };
        Calls {
            event_record,
            event_query,
            event_wait,
            event_wait_blocked,
            event_destroy,
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

    /// The GPU has finished the step it was on: every event recorded until
    /// now completes, and later ones belong to the next step.
    pub fn finish_gpu_step(&self) {
        if let Ok(mut e) = self.events.lock() {
            e.step += 1;
        }
    }

    /// Live (recorded, not destroyed) events, and how many of them have
    /// not completed.
    pub fn events_outstanding(&self) -> (u64, u64) {
        match self.events.lock() {
            Ok(e) => {
                let pending = e.live.keys().filter(|&&id| !e.complete(id).unwrap_or(true)).count();
                (e.live.len() as u64, pending as u64)
            }
            Err(_) => (0, 0),
        }
    }

    fn events(&self) -> Result<std::sync::MutexGuard<'_, Events>> {
        self.count(CallKind::Event);
        self.events.lock().map_err(|_| Error::Internal("event lock poisoned".into()))
    }

    /// `wait_event` of the model: blocks (is counted as blocking) only if
    /// the event has not completed, and then drains the GPU.
    pub fn wait_for_event(&self, event: u64) -> Result<()> {
        let mut e = self.events()?;
        e.wait += 1;
        if !e.complete(event)? {
            e.wait_blocked += 1;
            e.drain();
        }
        Ok(())
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
        self.inner.synchronize()?;
        if let Ok(mut e) = self.events.lock() {
            e.drain();
        }
        Ok(())
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
    // Events are modeled here, not forwarded: the host's complete at once.
    fn record_event(&self, _stream: u64) -> Result<Option<u64>> {
        let mut e = self.events()?;
        e.record += 1;
        e.next_id += 1;
        let (id, step) = (e.next_id, e.step);
        e.live.insert(id, step);
        Ok(Some(id))
    }
    fn event_complete(&self, event: u64) -> Result<bool> {
        let mut e = self.events()?;
        e.query += 1;
        e.complete(event)
    }
    fn wait_event(&self, event: u64) -> Result<()> {
        self.wait_for_event(event)
    }
    fn destroy_event(&self, event: u64) -> Result<()> {
        let mut e = self.events()?;
        e.destroy += 1;
        match e.live.remove(&event) {
            Some(_) => Ok(()),
            None => Err(Error::InvalidArgument(format!("event {event} is unknown or destroyed"))),
        }
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
