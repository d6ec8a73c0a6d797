//! The arena: public API, locking, and the operations built on the policy.
//!
//! Every public method takes the one state lock, plans, performs its driver
//! calls through a `Txn` (`txn.rs`), and only then changes the bookkeeping: a
//! failed driver call rolls the transaction back and leaves the state as it
//! was. Operations that move several allocations (compaction) work on a copy
//! of the state that replaces the original only when every call succeeded.
//!
//! The move callback runs under the lock, after the moves are mapped and the
//! state is committed, so callbacks see moves in the order they happened. A
//! callback that calls back into the same arena gets
//! `Error::InvalidArgument` instead of a deadlock.
//!
//! This file holds the `Arena` itself: construction, locking, the move
//! callback and data access. The operations live in files named for them:
//! `alloc.rs` (allocation, growth, pinning, `query`), `moves.rs` (moves and
//! compaction, releasing retired ranges), `pool.rs` (giving pooled memory
//! back), `sleep.rs` (tags, sleep and wake) and `stats.rs` (the report
//! types, the stats and the snapshot).

use std::cell::RefCell;

use std::sync::Arc;

use crate::driver::{ChunkHandle, Driver, Granularity};
use crate::error::{Error, Result};
use crate::sync::{Condvar, Mutex, MutexGuard};
use crate::Id;

mod admission_ahead;
mod alias;
mod alloc;
mod backup_cache;
mod batch;
mod config;
#[cfg(unix)]
mod dmabuf;
mod dry_run;
#[cfg(unix)]
mod export;
mod group_undo;
#[cfg(debug_assertions)]
mod holds;
mod moves;
mod page_table;
mod plan;
mod pool;
mod prefetch;
mod quiesce;
mod sleep;
pub(crate) mod small;
pub(crate) mod state;
mod stats;
mod stream;
mod stream_reuse;
mod two_phase;
pub(crate) mod txn;
mod unmap;
mod worker;

use self::alloc::{small_ptr, Target};
pub(crate) use alloc::Placing;
#[cfg(unix)]
pub use dmabuf::DmaBuf;
#[cfg(unix)]
pub use export::{
    Export, ExportLayout, EXPORT_FORMAT_VERSION, EXPORT_HANDLE_CUDA_POSIX_FD, EXPORT_HANDLE_HOST_MEMFD,
    EXPORT_HANDLE_UNSPECIFIED,
};
use pool::enforce_watermark;
pub use prefetch::MAX_ADMISSION_WINDOWS;
pub use state::MoveEvent;
use state::State;
pub use stats::{AllocInfo, CompactReport, Stats};
pub use two_phase::Prepared;
use txn::{Counters, Txn};

/// [`Arena::sleep`] and [`Arena::wake`]: every tag.
pub const ALL_TAGS: u32 = u32::MAX;
/// [`Arena::sleep`] flag: copy each allocation's bytes to host memory
/// first, and write them back on wake.
pub const SLEEP_BACKUP: u32 = 1;

/// Default chunk size: 2 MiB, CUDA's usual recommended granularity.
pub const DEFAULT_CHUNK_BYTES: u64 = 2 << 20;

/// Which backend an arena created by [`Arena::new`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Linux host memory (mmap + memfd), committed at chunk creation.
    Host,
    /// Linux host memory without committing chunks (for sparse simulations).
    HostSparse,
    /// CUDA driver virtual memory management on `ArenaConfig::device`.
    Cuda,
}

/// How an arena is set up. `Default` gives the C ABI's defaults with the
/// host backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaConfig {
    /// Backend used by [`Arena::new`] (ignored by [`Arena::with_driver`]).
    pub backend: Backend,
    /// CUDA device ordinal.
    pub device: i32,
    /// Most physical memory the arena may hold, rounded down to the chunk
    /// size. 0: the backend's total memory (host: physical RAM; CUDA: the
    /// device's memory).
    pub capacity_bytes: u64,
    /// Size of the virtual range, rounded up to the chunk size. 0: four times
    /// the capacity, room for growable reservations and for moves.
    pub reserve_bytes: u64,
    /// Chunk size. 0: 2 MiB or the driver's recommended granularity if
    /// larger; otherwise a multiple of the backend's minimum granularity.
    pub chunk_bytes: u64,
    /// Pooled memory kept when allocations are freed; beyond it chunks go
    /// back to the driver. `u64::MAX`: keep everything until [`Arena::trim`].
    pub retain_bytes: u64,
    /// Never move other allocations implicitly (alloc/resize fail with
    /// out-of-address-space instead); only `compact` and a resized
    /// allocation itself move.
    pub no_implicit_moves: bool,
    /// Chunks can be exported to other processes ([`Arena::export`]): on the
    /// host each chunk gets a sealed memfd of its own (one descriptor per
    /// chunk), on CUDA chunks are created with the POSIX file-descriptor
    /// handle type (refused as `Unsupported` where the device lacks it).
    /// Used by [`Arena::new`]; with [`Arena::with_driver`] the driver
    /// decides.
    pub exportable: bool,
    /// Run a background thread of the arena's own that keeps the targets of
    /// [`Arena::set_prefetch`] and reaps completed stream-ordered frees, so
    /// that this driver work stays off the callers' threads (the C flag
    /// `VMM_ARENA_FLAG_BACKGROUND`). Dropping the arena stops and joins it.
    pub background: bool,
    /// Place allocations as a pure function of the operations and this
    /// config, whatever the pool holds: ranks of a tensor-parallel group,
    /// each in its own process, that apply the same operations get the
    /// same offsets from their bases, also after a two-phase operation was
    /// aborted on some of them (see `arena/two_phase.rs`). It gives up
    /// preferring free ranges whose pages still hold pooled chunks (a
    /// saving of driver calls, not of memory). The C flag
    /// `VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT`.
    pub deterministic_placement: bool,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        ArenaConfig {
            backend: Backend::Host,
            device: 0,
            capacity_bytes: 0,
            reserve_bytes: 0,
            chunk_bytes: 0,
            retain_bytes: u64::MAX,
            no_implicit_moves: false,
            exportable: false,
            background: false,
            deterministic_placement: false,
        }
    }
}

/// The move callback's type (see [`Arena::set_move_callback`]).
pub type MoveCallback = Box<dyn FnMut(&MoveEvent) + Send>;

struct Inner {
    st: State,
    callback: Option<MoveCallback>,
    release_failures: u64,
    /// Exports and imports (`export.rs`).
    #[cfg(unix)]
    shares: export::Shares,
    /// Whether the background worker waits for work (a caller's operation
    /// that made some wakes it, once).
    worker_waiting: bool,
    /// Whether a `maintain` (a caller's or the worker's) is running: one at a time.
    maintaining: bool,
    /// Operations waiting for chunks in flight: the prefetcher starts no
    /// new work while one waits.
    pressure_waiters: u32,
    /// Spent sleep backups kept for the next sleep (`backup_cache.rs`).
    backups: backup_cache::BackupCache,
    /// Driver failures in `maintain` or the worker.
    maintain_failures: u64,
    /// Set by `Drop` to stop the background worker.
    stop_worker: bool,
}

/// What an arena shares with its background worker.
struct Shared {
    driver: Box<dyn Driver>,
    /// Driver calls of the callers' operations.
    counts: Counters,
    /// Driver calls of `maintain` and the background worker.
    bg_counts: Counters,
    /// How runs of pages are unmapped: the answer of the probe at creation.
    unmaps: unmap::UnmapMode,
    inner: Mutex<Inner>,
    /// Signalled whenever the prefetcher commits (or abandons) work set
    /// aside, and whenever a waited-for stream event is reaped.
    round_done: Condvar,
    /// Wakes the background worker.
    work: Condvar,
    key: u64,
}

/// A GPU (or host) memory arena over one reserved virtual range.
///
/// `Arena` is `Send + Sync`; every method takes `&self` and may be called
/// from any thread.
pub struct Arena {
    sh: Arc<Shared>,
    /// The background worker (`ArenaConfig::background`), joined on drop.
    worker: Option<crate::sync::thread::JoinHandle<()>>,
    base: u64,
    reserved_bytes: u64,
    /// The driver's reservation (base, size): `base..base + reserved_bytes`
    /// plus the slack `reserve_chunk_aligned` needed to chunk-align `base`.
    driver_va: (u64, u64),
    chunk: u64,
    reserve_fallbacks: u64,
    /// The device its exports name (`ExportLayout::device`): the CUDA
    /// ordinal, -1 on other backends.
    device: i32,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("backend", &self.sh.driver.name())
            .field("base", &format_args!("{:#x}", self.base))
            .field("reserved_bytes", &self.reserved_bytes)
            .field("chunk_bytes", &self.chunk)
            .finish_non_exhaustive()
    }
}

/// Issues each arena a key (for the re-entrancy check). Always std's atomic:
/// loom's cannot be a static, and this counter is no part of the protocol
/// under test (it only needs to hand out distinct values).
static NEXT_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[cfg(not(loom))]
thread_local! {
    /// Arenas whose move callback is running on this thread.
    static IN_CALLBACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}
#[cfg(loom)]
loom::thread_local! {
    static IN_CALLBACK: RefCell<Vec<u64>> = RefCell::new(Vec::new());
}

/// The 16-bit tag this arena puts in its ids: a mix of its creation number
/// and address, so two arenas' ids differ unless the tags collide (1 in 65,536).
fn id_tag(key: u64, base: u64) -> u16 {
    // splitmix64's finalizer.
    let mut z = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ base;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u16
}

/// Marks this thread as running `key`'s callback until dropped, even if the
/// callback panics.
struct CallbackScope(u64);

impl CallbackScope {
    fn enter(key: u64) -> CallbackScope {
        IN_CALLBACK.with(|v| v.borrow_mut().push(key));
        CallbackScope(key)
    }
}

impl Drop for CallbackScope {
    fn drop(&mut self) {
        let _ = IN_CALLBACK.try_with(|v| {
            if let Ok(mut v) = v.try_borrow_mut() {
                if let Some(i) = v.iter().rposition(|&k| k == self.0) {
                    v.remove(i);
                }
            }
        });
    }
}

/// Reserves `size` bytes starting at a multiple of `chunk`; returns that
/// start and the driver's reservation (base, size), to free later.
///
/// `cuMemAddressReserve` takes only power-of-two alignments, and a chunk may
/// be any multiple of the granularity (6 MiB, 37 pages). So the driver is
/// asked for the largest power of two dividing `chunk` (a multiple of the
/// power-of-two granularity, as `chunk` is) and, when `chunk` is not itself
/// a power of two, for `chunk - align` bytes more: room to round the base up
/// to a multiple of `chunk`, which keeps chunk-sized allocations
/// chunk-aligned as the C ABI promises.
fn reserve_chunk_aligned(driver: &dyn Driver, size: u64, chunk: u64) -> Result<(u64, (u64, u64))> {
    let align = 1u64 << chunk.trailing_zeros();
    let total = size.checked_add(chunk - align).ok_or_else(|| Error::invalid("reserve_bytes overflows"))?;
    let raw = driver.reserve(total, align)?;
    Ok((raw.div_ceil(chunk) * chunk, (raw, total)))
}

pub(super) fn pages_for(bytes: u64, chunk: u64, what: &str) -> Result<u64> {
    if bytes == 0 {
        return Err(Error::invalid(format!("{what} is 0")));
    }
    bytes
        .checked_add(chunk - 1)
        .map(|b| b / chunk)
        .ok_or_else(|| Error::invalid(format!("{what} {bytes} overflows when rounded up to the chunk size")))
}

struct Ctx<'a> {
    drv: &'a dyn Driver,
    counts: &'a Counters,
    /// How runs of pages are unmapped (`unmap.rs`).
    unmaps: unmap::UnmapMode,
}

/// Whether an operation waits for all of the prefetcher's work in flight
/// before it starts (see `prefetch.rs`). Every other operation runs at
/// once: if it needs a page set aside, planning says so
/// ([`state::SET_ASIDE`]) before any driver call, and it is retried once
/// the prefetcher has committed that page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Touch {
    /// Starts at once.
    Nothing,
    /// Waits until nothing is in flight (sleep and wake: every pooled chunk
    /// and every page of a sleeper must be in the books).
    Everything,
}

impl Ctx<'_> {
    fn txn(&self, st: &State) -> Txn<'_> {
        Txn::new(self.drv, self.counts, self.unmaps, st.base, st.chunk)
    }
}

impl Arena {
    /// Creates an arena on the backend named in `config`.
    pub fn new(config: ArenaConfig) -> Result<Arena> {
        use crate::driver::host::{HostDriver, HostOptions};
        // Before loading a backend: an invalid config is invalid everywhere.
        config::check(&config)?;
        let host = |options: HostOptions| match config.exportable {
            true => HostDriver::with_exportable_chunks(options),
            false => HostDriver::with_options(options),
        };
        match config.backend {
            Backend::Host => Arena::with_driver(host(HostOptions::default())?, config),
            Backend::HostSparse => Arena::with_driver(host(HostOptions { sparse: true })?, config),
            Backend::Cuda => Arena::with_driver(
                crate::driver::cuda::CudaDriver::with_options(config.device, &[], config.exportable)?,
                config,
            ),
        }
    }

    /// Creates an arena over any driver (a backend, a mock, a fault injector).
    pub fn with_driver<D: Driver + 'static>(driver: D, config: ArenaConfig) -> Result<Arena> {
        let driver_name = driver.name();
        let Granularity { minimum, recommended } = driver.granularity()?;
        let chunk = match config.chunk_bytes {
            0 => DEFAULT_CHUNK_BYTES.max(recommended).div_ceil(minimum) * minimum,
            c if c % minimum != 0 => {
                return Err(Error::invalid(format!("chunk_bytes {c} is not a multiple of the granularity {minimum}")))
            }
            c => c,
        };
        let capacity = match config.capacity_bytes {
            0 => driver.total_memory()?,
            c => c,
        } / chunk
            * chunk;
        if capacity == 0 {
            return Err(Error::invalid(format!("capacity is below one chunk of {chunk} bytes")));
        }
        let mut reserve = match config.reserve_bytes {
            0 => capacity.saturating_mul(4),
            r => r,
        };
        reserve = reserve
            .checked_add(chunk - 1)
            .map(|r| r / chunk * chunk)
            .ok_or_else(|| Error::invalid("reserve_bytes overflows when rounded up"))?;
        // Some platforms refuse large reservations: retry smaller, down to
        // what the capacity needs, and record how far we fell back.
        let mut fallbacks = 0;
        let (base, driver_va) = loop {
            match reserve_chunk_aligned(&driver, reserve, chunk) {
                Ok(b) => break b,
                Err(e @ (Error::Unsupported(_) | Error::InvalidArgument(_))) => return Err(e),
                Err(e) => {
                    let smaller = (reserve / 2 / chunk * chunk).max(capacity);
                    if smaller >= reserve {
                        return Err(e);
                    }
                    reserve = smaller;
                    fallbacks += 1;
                }
            }
        };
        let pages = reserve / chunk;
        let key = NEXT_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut st =
            match State::new(chunk, base, pages, capacity / chunk, config.retain_bytes, config.no_implicit_moves) {
                Ok(st) => st,
                Err(e) => {
                    // Nothing else was made yet: give the reservation back.
                    let _ = driver.free_reservation(driver_va.0, driver_va.1);
                    return Err(e);
                }
            };
        st.tag = id_tag(key, base);
        st.deterministic = config.deterministic_placement;
        let unmaps = unmap::probe(&driver, base, chunk, pages);
        let sh = Arc::new(Shared {
            driver: Box::new(driver),
            counts: Counters::default(),
            bg_counts: Counters::default(),
            unmaps,
            inner: Mutex::new(Inner {
                st,
                callback: None,
                release_failures: 0,
                #[cfg(unix)]
                shares: export::Shares::default(),
                worker_waiting: false,
                maintaining: false,
                pressure_waiters: 0,
                backups: Default::default(),
                maintain_failures: 0,
                stop_worker: false,
            }),
            round_done: Condvar::new(),
            work: Condvar::new(),
            key,
        });
        let mut arena = Arena {
            sh,
            worker: None,
            base,
            reserved_bytes: reserve,
            driver_va,
            chunk,
            reserve_fallbacks: fallbacks,
            device: if driver_name == "cuda" { config.device } else { -1 },
        };
        if config.background {
            // On failure `arena` drops and gives everything back.
            arena.worker = Some(worker::start(arena.sh.clone())?);
        }
        Ok(arena)
    }

    /// The chunk size.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk
    }

    /// Base address and size of the reserved virtual range.
    pub fn va_range(&self) -> (u64, u64) {
        (self.base, self.reserved_bytes)
    }

    /// Whether one unmap call may cover several adjacent pages, each mapped
    /// separately: the answer of the probe made when the arena was created
    /// (`false`, one call per page, where the driver refused the span or
    /// the probe could not run). `cuMemUnmap`'s text leaves it open.
    pub fn unmaps_span_mappings(&self) -> bool {
        self.sh.unmaps == unmap::UnmapMode::Spans
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.sh.driver.name()
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.sh.lock()
    }

    fn ctx(&self) -> Ctx<'_> {
        self.sh.ctx()
    }

    /// Runs `op` under the lock, applies the retain watermark, then reports
    /// its moves to the callback.
    ///
    /// The watermark applies after every successful operation (frees and
    /// shrinks add to the pool, and so does any release of retired ranges
    /// that empties a slab), and after a failed one that gave completed
    /// stream frees back to the pool on its way (its reap, or its reclaim
    /// before an out-of-memory): the failed operation itself changed
    /// nothing, the frees it completed did.
    ///
    /// Before `op`, waits while the prefetcher has set aside pages that
    /// `touch` says `op` may need (a map of a few chunks, never a create).
    /// First reaps the stream-ordered frees that completed, oldest first
    /// (polls up to the first incomplete event), so that an operation that
    /// would otherwise create chunks reuses theirs.
    /// When `op` runs out of memory or address space it is retried (every
    /// operation is all or nothing, so a failed attempt changed nothing)
    /// once chunks in flight have landed, or once stream-ordered frees have
    /// completed: polled first, then the oldest waited for.
    fn run<T>(
        &self,
        touch: Touch,
        mut op: impl FnMut(&mut Inner, &Ctx<'_>, &mut Vec<MoveEvent>) -> Result<T>,
    ) -> Result<T> {
        let mut inner = self.lock()?;
        let mut events = Vec::new();
        let ctx = self.ctx();
        // Whether this call gave completed stream frees back to the pool: a
        // failed call then applies the watermark too (it changed nothing
        // else, and must not leave the pool past the watermark).
        let mut reclaimed = false;
        // Frees that waited for their DMA-BUFs to close finish first.
        #[cfg(unix)]
        if !inner.shares.held.is_empty() {
            dmabuf::reap(&mut inner, &ctx);
        }
        if !inner.st.pending.is_empty() {
            // Frees whose events completed since the last look serve this
            // operation rather than new chunks: a poll (no wait) until the
            // first incomplete one, under a microsecond each.
            reclaimed = stream::reap(&mut inner.st, &ctx, stream::Poll::UntilIncomplete) > 0;
        }
        let out = loop {
            inner = self.sh.wait_out_conflicts(inner, touch)?;
            let done = op(&mut inner, &ctx, &mut events);
            // An operation's stream (`stream_reuse.rs`) is its own.
            inner.st.reuse.op_stream = None;
            match done {
                Ok(v) => break v,
                Err(Error::Internal(m)) if m == state::SET_ASIDE => {
                    // A page the prefetcher is mapping: retry once it landed.
                    events.clear();
                    inner = self.sh.wait_round(inner)?;
                }
                Err(e @ (Error::OutOfMemory(_) | Error::OutOfAddressSpace(_))) => {
                    events.clear();
                    if inner.st.inflight_pages > 0 {
                        inner = self.sh.wait_for_inflight(inner)?;
                        continue;
                    }
                    let memory = matches!(e, Error::OutOfMemory(_));
                    let (again, progressed) = stream::reclaim(&self.sh, inner, &ctx, memory)?;
                    inner = again;
                    reclaimed |= progressed;
                    if !progressed {
                        if reclaimed {
                            enforce_watermark(&mut inner, &ctx);
                        }
                        return Err(e);
                    }
                }
                Err(e) => {
                    if reclaimed {
                        enforce_watermark(&mut inner, &ctx);
                    }
                    return Err(e);
                }
            }
        };
        enforce_watermark(&mut inner, &ctx);
        inner.st.note_peak();
        // Debug builds (the tests) audit who holds each chunk after every
        // operation (`holds.rs`).
        #[cfg(debug_assertions)]
        {
            let audit = holds::audit(&inner);
            debug_assert!(audit.is_ok(), "chunk holds after an operation: {audit:?}");
        }
        // The flag stays set for a busy worker to see before it sleeps.
        if inner.st.prefetch_dirty && inner.worker_waiting {
            let wanted = inner.st.prefetch != (0, 0) || !inner.st.admit_ahead.is_off() || !inner.st.pending.is_empty();
            if wanted {
                // Once per wait of the worker: a futex wake, no driver call.
                inner.st.prefetch_dirty = false;
                inner.worker_waiting = false;
                self.sh.work.notify_one();
            }
        }
        if !events.is_empty() {
            if let Some(cb) = inner.callback.as_mut() {
                let _scope = CallbackScope::enter(self.sh.key);
                for e in &events {
                    cb(e);
                }
            }
        }
        Ok(out)
    }

    /// Installs (or, with `None`, removes) the callback told of every move.
    /// It runs during the call that moved, under the arena's lock: it must
    /// be quick and must not call into this arena (such calls fail).
    pub fn set_move_callback(&self, callback: Option<MoveCallback>) -> Result<()> {
        self.lock()?.callback = callback;
        Ok(())
    }

    /// The address of `len` bytes at `offset` in a live, awake allocation.
    fn span(&self, inner: &Inner, id: Id, offset: u64, len: usize) -> Result<u64> {
        let st = &inner.st;
        #[cfg(unix)]
        let import = inner.shares.span(st, id);
        #[cfg(not(unix))]
        let import: Option<Result<(u64, u64)>> = None;
        let (ptr, size, asleep) = match import {
            Some(r) => {
                let (ptr, size) = r?;
                (ptr, size, false)
            }
            None => match st.resolve(id)? {
                Target::Chunks(slot) => {
                    let a = st.alloc(slot);
                    (st.addr(a.start), a.size, a.sleep.is_some())
                }
                Target::Small(ss) => (small_ptr(st, ss), st.small.size_of(ss), alloc::small_asleep(st, ss)),
            },
        };
        match offset.checked_add(len as u64) {
            Some(end) if end <= size && asleep => Err(Error::Asleep(id.get())),
            Some(end) if end <= size => Ok(ptr + offset),
            _ => Err(Error::invalid(format!("span {offset}+{len} exceeds the allocation's {size} bytes"))),
        }
    }

    /// Copies `data` into the allocation at `offset` (through the driver:
    /// a memcpy on the host, a host-to-device copy on CUDA).
    pub fn write(&self, id: Id, offset: u64, data: &[u8]) -> Result<()> {
        let inner = self.lock()?;
        let addr = self.span(&inner, id, offset, data.len())?;
        self.sh.driver.write(addr, data)
    }

    /// Records an event on a device stream (a `CUstream`, 0 = the legacy
    /// default stream), for stream-ordered frees: memory freed by work on
    /// that stream may be handed out again once the event has completed.
    /// `None` on backends without asynchronous streams (the host).
    pub fn record_event(&self, stream: u64) -> Result<Option<u64>> {
        self.sh.driver.record_event(stream)
    }

    /// Waits until all work on the device has finished (the fallback when a
    /// stream event cannot be recorded).
    pub fn synchronize(&self) -> Result<()> {
        self.sh.driver.synchronize()
    }

    /// Whether an event from [`Arena::record_event`] has completed.
    pub fn event_complete(&self, event: u64) -> Result<bool> {
        self.sh.driver.event_complete(event)
    }

    /// Destroys an event from [`Arena::record_event`].
    pub fn destroy_event(&self, event: u64) -> Result<()> {
        self.sh.driver.destroy_event(event)
    }

    /// Copies bytes of the allocation at `offset` into `out`.
    pub fn read(&self, id: Id, offset: u64, out: &mut [u8]) -> Result<()> {
        let inner = self.lock()?;
        let addr = self.span(&inner, id, offset, out.len())?;
        self.sh.driver.read(addr, out)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Never panics: a poisoned lock still yields the state, and every
        // driver failure here is ignored (the process keeps the memory at worst).
        if let Some(handle) = self.worker.take() {
            worker::stop(&self.sh, handle);
        }
        let mut inner = match self.sh.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let _ = self.sh.driver.synchronize();
        // Imports live in reservations of their own; exported chunks that
        // could not be released earlier are released here, never pooled.
        #[cfg(unix)]
        inner.shares.drop_all(&*self.sh.driver, self.chunk, self.sh.unmaps);
        let st = &inner.st;
        // Pending frees' events are the arena's to destroy; their memory is
        // released below with every allocation's (the device is idle now).
        for p in &st.pending {
            let _ = self.sh.driver.destroy_event(p.event);
        }
        let mapped: Vec<u64> = st.mapped.mapped().map(|(p, _)| p).collect();
        for run in state::runs(&mapped) {
            let pages = run.end - run.start;
            unmap::unmap_pages(&*self.sh.driver, None, self.sh.unmaps, st.addr(run.start), st.chunk, pages);
        }
        // A set: a shared chunk backs several pages, and is released once.
        let mut owned: std::collections::BTreeSet<ChunkHandle> = st.pool.iter().copied().collect();
        owned.extend(st.cached.iter().filter_map(|&p| st.mapped[p as usize]));
        for a in st.slots.iter().filter_map(|s| s.alloc.as_ref()) {
            owned.extend((a.start..a.start + a.backed).filter_map(|p| st.mapped[p as usize]));
        }
        for h in owned {
            let _ = self.sh.driver.release(h);
        }
        let _ = self.sh.driver.free_reservation(self.driver_va.0, self.driver_va.1);
    }
}

impl Shared {
    /// [`Shared::lock`] if the lock is free now, `None` if a call holds it.
    fn try_lock(&self) -> Result<Option<MutexGuard<'_, Inner>>> {
        let reentrant = IN_CALLBACK.with(|v| v.borrow().contains(&self.key));
        if reentrant {
            return Err(Error::invalid("the arena was called from inside its own move callback"));
        }
        let mut inner = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
            Err(std::sync::TryLockError::Poisoned(_)) => return Err(poisoned()),
        };
        #[cfg(unix)]
        {
            let Inner { st, shares, .. } = &mut *inner;
            shares.sweep(st);
        }
        Ok(Some(inner))
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        let reentrant = IN_CALLBACK.with(|v| v.borrow().contains(&self.key));
        if reentrant {
            return Err(Error::invalid("the arena was called from inside its own move callback"));
        }
        let mut inner = self.inner.lock().map_err(|_| poisoned())?;
        #[cfg(unix)]
        {
            let Inner { st, shares, .. } = &mut *inner;
            shares.sweep(st);
        }
        Ok(inner)
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx { drv: &*self.driver, counts: &self.counts, unmaps: self.unmaps }
    }

    /// The context of `maintain` and the worker (their own counters).
    fn bg_ctx(&self) -> Ctx<'_> {
        Ctx { drv: &*self.driver, counts: &self.bg_counts, unmaps: self.unmaps }
    }

    /// Waits on `round_done`, giving the lock up meanwhile.
    fn wait_round<'a>(&self, inner: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>> {
        self.round_done.wait(inner).map_err(|_| poisoned())
    }

    /// Waits until no work of the prefetcher's is in flight, if `touch` asks.
    fn wait_out_conflicts<'a>(&self, mut inner: MutexGuard<'a, Inner>, touch: Touch) -> Result<MutexGuard<'a, Inner>> {
        while touch == Touch::Everything && (inner.st.inflight_pages > 0 || !inner.st.set_aside.is_empty()) {
            inner = self.wait_round(inner)?;
        }
        Ok(inner)
    }

    /// Waits until the chunks in flight have landed in the books; the
    /// prefetcher starts nothing new meanwhile (`pressure_waiters`).
    fn wait_for_inflight<'a>(&self, mut inner: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>> {
        inner.pressure_waiters += 1;
        while inner.st.inflight_pages > 0 {
            match self.round_done.wait(inner) {
                Ok(g) => inner = g,
                Err(_) => return Err(poisoned()),
            }
        }
        inner.pressure_waiters -= 1;
        if inner.pressure_waiters == 0 {
            // The prefetcher found nothing it might do while this waited,
            // and the worker may have gone to sleep on that: wake it now,
            // whatever this operation's outcome (a failed one reaches no
            // other wake-up).
            self.poke_worker(&mut inner);
        }
        Ok(inner)
    }

    /// There may be work for the prefetcher: the background worker, if it
    /// is waiting, is woken now (a futex wake, no driver call); otherwise
    /// the flag makes it look again before it next sleeps.
    pub(super) fn poke_worker(&self, inner: &mut Inner) {
        inner.st.prefetch_dirty = true;
        if inner.worker_waiting {
            inner.st.prefetch_dirty = false;
            inner.worker_waiting = false;
            self.work.notify_one();
        }
    }
}

fn poisoned() -> Error {
    Error::Internal("the arena is poisoned by an earlier panic".into())
}

// The arena is shared across threads by design; these fail to compile if a
// field ever makes it otherwise.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Arena>();
};
