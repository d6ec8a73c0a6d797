//! The arena: public API, locking, and the operations built on the policy.
//!
//! Every public method takes the one state lock, plans, performs its driver
//! calls through a [`txn::Txn`], and only then changes the bookkeeping: a
//! failed driver call rolls the transaction back and leaves the state as it
//! was. Operations that move several allocations (compaction) work on a copy
//! of the state that replaces the original only when every call succeeded.
//!
//! The move callback runs under the lock, after the moves are mapped and the
//! state is committed, so callbacks see moves in the order they happened. A
//! callback that calls back into the same arena gets
//! `Error::InvalidArgument` instead of a deadlock.

use std::cell::RefCell;

use crate::compact;
use crate::driver::{ChunkHandle, Driver, Granularity};
use crate::error::{Error, Result};
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};
use crate::Id;

mod config;
pub(crate) mod small;
pub(crate) mod state;
pub(crate) mod txn;

use small::SmallEntry;
pub use state::MoveEvent;
use state::{Alloc, Owner, Plan, Sleep, State};
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
        }
    }
}

/// Counters and sizes of an arena (every field of `vmm_arena_stats`, and more).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub live_allocations: u64,
    /// Sum of the sizes callers asked for.
    pub live_bytes: u64,
    /// Physical bytes backing live allocations (each chunk once: a slab's
    /// chunk counts while one of its objects is live).
    pub mapped_bytes: u64,
    /// Physical bytes held but backing no live allocation: cached and
    /// unmapped pooled chunks, and slabs that hold only retired objects
    /// (until retired memory is released, when they join the pool).
    pub pooled_bytes: u64,
    /// High-water mark of `mapped_bytes + pooled_bytes`.
    pub peak_physical_bytes: u64,
    pub capacity_bytes: u64,
    pub reserved_va_bytes: u64,
    /// Address space covered by no live reservation and no retired range.
    pub free_va_bytes: u64,
    pub largest_free_va_bytes: u64,
    pub retired_va_bytes: u64,
    /// Moves by remapping, ever.
    pub moves: u64,
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    pub driver_unmaps: u64,
    pub driver_access_calls: u64,
    /// Device synchronizations (one before each batch of unmaps).
    pub driver_syncs: u64,
    /// The chunk size.
    pub chunk_bytes: u64,
    /// Pooled chunks mapped at a free address, ready to serve without a driver call.
    pub cached_mapped_bytes: u64,
    /// Chunk give-backs (watermark or drop) that failed and were kept pooled.
    pub release_failures: u64,
    /// Times the virtual reservation had to be retried smaller at creation.
    pub reserve_fallbacks: u64,
    /// Bytes copied by resizes of small allocations beyond their size class
    /// (the only copies the arena ever makes).
    pub bytes_copied: u64,
    /// Chunks serving as slabs for small allocations.
    pub small_slabs: u64,
    /// Reserved bytes of sleeping allocations (they count in
    /// `live_allocations` and `live_bytes`, not in `mapped_bytes`).
    pub asleep_bytes: u64,
    /// Host bytes held as sleeping allocations' backups.
    pub backup_bytes: u64,
}

/// What [`Arena::compact`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompactReport {
    /// Allocations that moved, as callers know them: every object of a
    /// moved slab counts (each gets a move event and counts in `moves`).
    pub moved_allocations: u64,
    /// Physical bytes remapped to a new address.
    pub moved_bytes: u64,
    pub largest_free_va_before: u64,
    pub largest_free_va_after: u64,
}

/// What [`Arena::query`] tells about one allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocInfo {
    pub ptr: u64,
    /// Size in bytes the caller asked for.
    pub size: u64,
    /// Address space reserved for it (its growth limit in place).
    pub reserved_bytes: u64,
    /// Physical bytes backing it.
    pub mapped_bytes: u64,
    pub pinned: bool,
    pub growable: bool,
    /// Its tag (see [`Arena::set_tag`]).
    pub tag: u32,
    /// Whether it sleeps (see [`Arena::sleep`]); `mapped_bytes` is 0 then.
    pub asleep: bool,
}

/// The move callback's type (see [`Arena::set_move_callback`]).
pub type MoveCallback = Box<dyn FnMut(&MoveEvent) + Send>;

struct Inner {
    st: State,
    callback: Option<MoveCallback>,
    release_failures: u64,
}

/// A GPU (or host) memory arena over one reserved virtual range.
///
/// `Arena` is `Send + Sync`; every method takes `&self` and may be called
/// from any thread.
pub struct Arena {
    driver: Box<dyn Driver>,
    counts: Counters,
    inner: Mutex<Inner>,
    key: u64,
    base: u64,
    reserved_bytes: u64,
    /// The driver's reservation (base, size): `base..base + reserved_bytes`
    /// plus the slack `reserve_chunk_aligned` needed to chunk-align `base`.
    driver_va: (u64, u64),
    chunk: u64,
    reserve_fallbacks: u64,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("backend", &self.driver.name())
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

fn pages_for(bytes: u64, chunk: u64, what: &str) -> Result<u64> {
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
}

impl Ctx<'_> {
    fn txn(&self, st: &State) -> Txn<'_> {
        Txn::new(self.drv, self.counts, st.base, st.chunk)
    }
}

impl Arena {
    /// Creates an arena on the backend named in `config`.
    pub fn new(config: ArenaConfig) -> Result<Arena> {
        // Before loading a backend: an invalid config is invalid everywhere.
        config::check(&config)?;
        match config.backend {
            Backend::Host => Arena::with_driver(crate::driver::host::HostDriver::new()?, config),
            Backend::HostSparse => Arena::with_driver(
                crate::driver::host::HostDriver::with_options(crate::driver::host::HostOptions { sparse: true })?,
                config,
            ),
            Backend::Cuda => Arena::with_driver(crate::driver::cuda::CudaDriver::new(config.device)?, config),
        }
    }

    /// Creates an arena over any driver (a backend, a mock, a fault injector).
    pub fn with_driver<D: Driver + 'static>(driver: D, config: ArenaConfig) -> Result<Arena> {
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
        Ok(Arena {
            driver: Box::new(driver),
            counts: Counters::default(),
            inner: Mutex::new(Inner { st, callback: None, release_failures: 0 }),
            key,
            base,
            reserved_bytes: reserve,
            driver_va,
            chunk,
            reserve_fallbacks: fallbacks,
        })
    }

    /// The chunk size.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk
    }

    /// Base address and size of the reserved virtual range.
    pub fn va_range(&self) -> (u64, u64) {
        (self.base, self.reserved_bytes)
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.driver.name()
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        let reentrant = IN_CALLBACK.with(|v| v.borrow().contains(&self.key));
        if reentrant {
            return Err(Error::invalid("the arena was called from inside its own move callback"));
        }
        self.inner.lock().map_err(|_| Error::Internal("the arena is poisoned by an earlier panic".into()))
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx { drv: &*self.driver, counts: &self.counts }
    }

    /// Runs `op` under the lock, applies the retain watermark, then reports
    /// its moves to the callback.
    ///
    /// The watermark applies after every successful operation: frees and
    /// shrinks add to the pool, and so does any release of retired ranges
    /// (an alloc, resize or compaction may release them) that empties a slab.
    fn run<T>(&self, op: impl FnOnce(&mut Inner, &Ctx<'_>, &mut Vec<MoveEvent>) -> Result<T>) -> Result<T> {
        let mut inner = self.lock()?;
        let mut events = Vec::new();
        let ctx = self.ctx();
        let out = op(&mut inner, &ctx, &mut events)?;
        enforce_watermark(&mut inner, &ctx);
        inner.st.note_peak();
        if !events.is_empty() {
            if let Some(cb) = inner.callback.as_mut() {
                let _scope = CallbackScope::enter(self.key);
                for e in &events {
                    cb(e);
                }
            }
        }
        Ok(out)
    }

    /// Allocates `size` bytes (rounded up to whole chunks). Returns the id and
    /// the address, chunk-aligned.
    pub fn alloc(&self, size: u64) -> Result<(Id, u64)> {
        self.alloc_inner(size, size, false)
    }

    /// Allocates `size` bytes inside a reservation of `max_size`, so the
    /// allocation can grow up to `max_size` without moving.
    pub fn alloc_growable(&self, size: u64, max_size: u64) -> Result<(Id, u64)> {
        if max_size < size {
            return Err(Error::invalid(format!("max_size {max_size} < size {size}")));
        }
        self.alloc_inner(size, max_size, true)
    }

    fn alloc_inner(&self, size: u64, max_size: u64, growable: bool) -> Result<(Id, u64)> {
        let chunk = self.chunk;
        let pages = pages_for(size, chunk, "size")?;
        let reserved = pages_for(max_size, chunk, "max_size")?;
        self.run(|inner, ctx, events| {
            let st = &mut inner.st;
            let mut tx = ctx.txn(st);
            let small = if growable { None } else { st.small.classes.class_of(size) };
            let placed = match small {
                Some(class) => alloc_small(st, &mut tx, class, size, events).map(Target::Small),
                None => {
                    alloc_pages(st, &mut tx, pages, reserved, size, growable, Owner::User, events).map(Target::Chunks)
                }
            };
            match placed {
                Ok(Target::Small(ss)) => {
                    tx.commit();
                    Ok((st.small_id(ss), small_ptr(st, ss)))
                }
                Ok(Target::Chunks(slot)) => {
                    tx.commit();
                    Ok((st.id_of(slot), st.addr(st.alloc(slot).start)))
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }

    /// Frees an allocation. Its chunks stay mapped in the pool (up to the
    /// retain watermark), ready for the next allocation without a driver call.
    pub fn free(&self, id: Id) -> Result<()> {
        self.run(|inner, _, _| {
            let st = &mut inner.st;
            match st.resolve(id)? {
                Target::Chunks(slot) => {
                    if let Owner::Promoted(ss) = st.alloc(slot).owner {
                        st.small.drop_slot(ss);
                    }
                    st.remove_alloc(slot);
                }
                Target::Small(ss) => {
                    let SmallEntry::InSlab { slab, .. } = *st.small.entry_of(ss) else {
                        unreachable!("resolve gives Small only for objects in slabs")
                    };
                    match st.small.release(ss) {
                        Some(empty_slab) => st.remove_alloc(empty_slab),
                        // Freeing a pinned object unpins it: the slab stays
                        // pinned only while another object in it is.
                        None => {
                            let s = st.small.slab(slab);
                            let (slab_slot, pinned) = (s.alloc_slot, s.pinned > 0);
                            st.alloc_mut(slab_slot).pinned = pinned;
                        }
                    }
                    st.small.drop_slot(ss);
                }
            }
            Ok(())
        })
    }

    /// Grows or shrinks an allocation, keeping its first `min(old, new)`
    /// bytes. Grows in place when its reservation (or the free space after
    /// it) allows, else moves it by remapping. Returns the (maybe new) address.
    pub fn resize(&self, id: Id, new_size: u64) -> Result<u64> {
        let chunk = self.chunk;
        let np = pages_for(new_size, chunk, "new_size")?;
        self.run(|inner, ctx, events| {
            let st = &mut inner.st;
            let slot = match st.resolve(id)? {
                Target::Chunks(slot) => slot,
                Target::Small(ss) => return resize_small(st, ctx, ss, id, new_size, events),
            };
            let a = st.alloc(slot).clone();
            if a.sleep.is_some() {
                return Err(Error::Asleep(id.get()));
            }
            if np <= a.backed {
                if np < a.backed {
                    st.shrink_backing(slot, np);
                    if !a.growable {
                        st.free.insert(a.start + np, a.reserved - np);
                        st.alloc_mut(slot).reserved = np;
                    }
                }
                st.live_bytes = st.live_bytes - a.size + new_size;
                st.alloc_mut(slot).size = new_size;
                return Ok(st.addr(a.start));
            }
            // A growable allocation that outgrew its reservation gets twice
            // the room when it moves, so repeated growth stays cheap.
            let wanted = if a.growable { np.max(a.reserved.saturating_mul(2)).min(st.pages) } else { np };
            let tail = (a.start + a.reserved, np.saturating_sub(a.reserved));
            let extend_in_place = np > a.reserved && st.free.contains(tail.0, tail.1);
            let via = if np > a.reserved && !extend_in_place { in_place_route(st, slot, tail, wanted) } else { None };
            if np > a.reserved && !extend_in_place && via.is_none() && a.pinned {
                return Err(Error::Pinned(id.get()));
            }
            // Chunks held only by retired small objects come back when the
            // retired memory is released: growth may count on them.
            let short = np - a.backed > st.obtainable_pages();
            if short && np - a.backed > st.obtainable_pages() + st.small.reclaimable_slabs() {
                return Err(Error::OutOfMemory(format!(
                    "growing to {new_size} bytes needs {} more chunks; {} are obtainable",
                    np - a.backed,
                    st.obtainable_pages()
                )));
            }
            if (np <= a.reserved || extend_in_place) && !short {
                let mut tx = ctx.txn(st);
                return match grow_in_place(st, &mut tx, slot, np, new_size) {
                    Ok(()) => {
                        tx.commit();
                        Ok(st.addr(a.start))
                    }
                    Err(e) => {
                        tx.rollback();
                        Err(e)
                    }
                };
            }
            let in_place = np <= a.reserved || extend_in_place || via.is_some();
            // Several steps (releases, moves of neighbours or of the
            // allocation itself): on a copy that replaces the state only
            // if every driver call succeeded.
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            let mut evs = Vec::new();
            let moved = (|| {
                if in_place {
                    match via {
                        Some(InPlace::Release) => release_retired_into(&mut sim, &mut tx)?,
                        Some(InPlace::Evacuate(moves)) => {
                            // Planned on the books after the release, which
                            // are `sim`'s once it is done.
                            release_retired_into(&mut sim, &mut tx)?;
                            for (other, dest) in moves {
                                let o = sim.alloc(other).clone();
                                move_alloc(&mut sim, &mut tx, other, dest, o.backed, o.reserved, o.size, &mut evs)?;
                            }
                            // The neighbours' old ranges are the pages to grow into.
                            release_retired_into(&mut sim, &mut tx)?;
                        }
                        None if short => release_retired_into(&mut sim, &mut tx)?,
                        None => {}
                    }
                    return grow_in_place(&mut sim, &mut tx, slot, np, new_size);
                }
                let (t, reserved) = match sim.free.best_fit(wanted) {
                    Some(t) => (t, wanted),
                    None => (make_room(&mut sim, &mut tx, np, Some(slot), &mut evs)?, np),
                };
                // The chunks of retired small objects' slabs only after the
                // place is found: `make_room` refuses before any driver call,
                // and a refusal after these unmaps would need a rollback whose
                // own calls may fail.
                if short {
                    release_retired_into(&mut sim, &mut tx)?;
                }
                move_alloc(&mut sim, &mut tx, slot, t, np, reserved, new_size, &mut evs)
            })();
            match moved {
                Ok(()) => {
                    tx.commit();
                    *st = sim;
                    events.extend(evs);
                    Ok(st.addr(st.alloc(slot).start))
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }

    /// Address and facts of a live allocation.
    pub fn query(&self, id: Id) -> Result<AllocInfo> {
        let inner = self.lock()?;
        let st = &inner.st;
        let slot = match st.resolve(id)? {
            Target::Chunks(slot) => slot,
            Target::Small(ss) => {
                let SmallEntry::InSlab { slab, size, pinned, .. } = *st.small.entry_of(ss) else {
                    unreachable!("resolve gives Small only for objects in slabs")
                };
                let class = st.small.classes.size(st.small.slab(slab).class);
                return Ok(AllocInfo {
                    ptr: small_ptr(st, ss),
                    size,
                    reserved_bytes: class,
                    mapped_bytes: class,
                    pinned,
                    growable: false,
                    tag: 0,
                    asleep: false,
                });
            }
        };
        let a = st.alloc(slot);
        Ok(AllocInfo {
            ptr: st.addr(a.start),
            size: a.size,
            reserved_bytes: a.reserved * st.chunk,
            mapped_bytes: a.backed * st.chunk,
            pinned: a.pinned,
            growable: a.growable,
            tag: a.tag,
            asleep: a.sleep.is_some(),
        })
    }

    /// Pins an allocation: it never moves until unpinned (for buffers
    /// registered with NCCL, RDMA or captured in CUDA graphs).
    pub fn pin(&self, id: Id) -> Result<()> {
        self.set_pinned(id, true)
    }

    /// Lets a pinned allocation move again.
    pub fn unpin(&self, id: Id) -> Result<()> {
        self.set_pinned(id, false)
    }

    fn set_pinned(&self, id: Id, pinned: bool) -> Result<()> {
        let mut inner = self.lock()?;
        let st = &mut inner.st;
        match st.resolve(id)? {
            Target::Chunks(slot) => {
                // Unpinning a sleeping allocation is fine; pinning needs it awake.
                if pinned && st.alloc(slot).sleep.is_some() {
                    return Err(Error::Asleep(id.get()));
                }
                st.alloc_mut(slot).pinned = pinned
            }
            Target::Small(ss) => {
                // A slab is pinned while any object in it is.
                let (slab_slot, count) = st.small.set_pinned(ss, pinned).expect("object in a slab");
                st.alloc_mut(slab_slot).pinned = count > 0;
            }
        }
        Ok(())
    }

    /// Moves unpinned allocations by remapping to close address-space
    /// holes, then releases the old ranges (after a synchronize). Moves
    /// happen whatever `no_implicit_moves` says: this is the explicit call.
    pub fn compact(&self) -> Result<CompactReport> {
        self.run(|inner, ctx, events| {
            let st = &mut inner.st;
            let mut report =
                CompactReport { largest_free_va_before: st.free.largest() * st.chunk, ..Default::default() };
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            let mut evs = Vec::new();
            let done = (|| {
                release_retired_into(&mut sim, &mut tx)?;
                let (passes, _) = plan_passes(&sim, |s, slot| s.alloc(slot).immovable());
                let (moved, bytes) = run_passes(&mut sim, &mut tx, passes, &mut evs)?;
                report.moved_allocations = moved;
                report.moved_bytes = bytes;
                Ok::<_, Error>(())
            })();
            match done {
                Ok(()) => {
                    tx.commit();
                    *st = sim;
                    events.extend(evs);
                    report.largest_free_va_after = st.free.largest() * st.chunk;
                    Ok(report)
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }

    /// Unmaps the old ranges of moved allocations, synchronizing the device
    /// first. Their address space becomes free.
    pub fn release_retired(&self) -> Result<()> {
        self.run(|inner, ctx, _| {
            let st = &mut inner.st;
            if st.retired.is_empty() && st.small.nothing_retired() {
                return Ok(());
            }
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            match release_retired_into(&mut sim, &mut tx) {
                Ok(()) => {
                    tx.commit();
                    *st = sim;
                    Ok(())
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }

    /// Gives pooled chunks back to the driver until at most `keep_bytes`
    /// (or the retain watermark, if lower) stay pooled; returns the bytes
    /// given back.
    ///
    /// Unlike every other operation, a driver failure here cannot undo what
    /// was already given back: chunks released before the failure stay
    /// released (and are counted), the rest stay pooled, and the error is
    /// returned. Nothing is leaked either way.
    ///
    /// A chunk to be given back may still be mapped at retired pages (the
    /// old range of an allocation that moved and was then freed or shrunk):
    /// those pages are unmapped first, so the memory really goes back. No
    /// other retired page is: a live allocation's old address stays valid
    /// (for its current size) until [`Arena::release_retired`], and the bytes
    /// returned never exceed what was pooled.
    pub fn trim(&self, keep_bytes: u64) -> Result<u64> {
        // Down to the retain watermark too, if it is lower: `run` would give
        // that back right after (pooled memory may exceed the watermark after
        // a failed give-back), and the bytes returned must count it.
        self.run(|inner, ctx, _| {
            let keep = keep_bytes.min(inner.st.retain_bytes);
            trim_pool(&mut inner.st, ctx, keep)
        })
    }

    /// Sets an allocation's tag (0 by default), which [`Arena::sleep`] and
    /// [`Arena::wake`] select by. Works on a sleeping allocation too.
    ///
    /// Small allocations (at most half a chunk, made by [`Arena::alloc`])
    /// share slabs with others and cannot sleep on their own:
    /// `Error::InvalidArgument` for them. Allocate more than half a chunk,
    /// or with [`Arena::alloc_growable`], to tag an allocation. Small
    /// allocations never sleep, whatever the tag asked for.
    pub fn set_tag(&self, id: Id, tag: u32) -> Result<()> {
        let mut inner = self.lock()?;
        let st = &mut inner.st;
        match st.resolve(id)? {
            Target::Chunks(slot) => {
                st.alloc_mut(slot).tag = tag;
                Ok(())
            }
            Target::Small(_) => Err(Error::invalid(
                "small allocations share slabs and cannot be tagged; allocate more than half a chunk, or use alloc_growable, to tag it",
            )),
        }
    }

    /// Puts every awake allocation with tag `tag` ([`ALL_TAGS`]: every tag)
    /// to sleep, giving its physical memory back to the driver; ids, sizes,
    /// addresses and reservations stay.
    ///
    /// In order: waits for the device; with [`SLEEP_BACKUP`] in `flags`,
    /// copies each one's `size` bytes to host memory through the driver
    /// (`cuMemcpy` on CUDA; the backup is a plain `Vec`, see below); unmaps
    /// every retired range (a retired range may still map one of their
    /// chunks, which must not outlive the sleep); unmaps them and every
    /// cached pooled chunk; then releases their chunks and every pooled
    /// chunk, whatever `retain_bytes` says. Pinned allocations sleep too,
    /// already sleeping ones are left as they are, small allocations never
    /// sleep (see [`Arena::set_tag`]).
    ///
    /// All or nothing: a failure of any call up to the unmaps undoes them
    /// (remaps) and nothing has slept. The releases come after that point
    /// and cannot be undone: a release that fails keeps its chunk pooled and
    /// counts in `release_failures` (like the retain watermark), and the
    /// sleep has succeeded; [`Arena::trim`] can give the chunk back later.
    ///
    /// The backups are ordinary host memory on every backend. Pinned host
    /// memory (`cuMemHostAlloc`), which CUDA copies faster and could copy
    /// asynchronously, is left for later: a plain `Vec` is what could be
    /// tested here.
    ///
    /// Unknown bits in `flags`: `Error::InvalidArgument`.
    pub fn sleep(&self, tag: u32, flags: u32) -> Result<()> {
        if flags & !SLEEP_BACKUP != 0 {
            return Err(Error::invalid(format!("unknown sleep flags {:#x}", flags & !SLEEP_BACKUP)));
        }
        self.run(|inner, ctx, _| sleep_tag(inner, ctx, tag, flags & SLEEP_BACKUP != 0))
    }

    /// Wakes every sleeping allocation with tag `tag` ([`ALL_TAGS`]: every
    /// tag), each at its own address: chunks are taken from the pool or
    /// created, mapped where its backing was, made accessible (one call per
    /// run of pages), and its backup, if it has one, written back through
    /// the driver. Without a backup its contents are whatever the driver
    /// gives.
    ///
    /// All or nothing: on failure (`OutOfMemory` when the capacity is taken,
    /// or a driver error) every one of them is still asleep with its backup
    /// intact.
    pub fn wake(&self, tag: u32) -> Result<()> {
        self.run(|inner, ctx, _| wake_tag(&mut inner.st, ctx, tag))
    }

    /// Installs (or, with `None`, removes) the callback told of every move.
    /// It runs during the call that moved, under the arena's lock: it must
    /// be quick and must not call into this arena (such calls fail).
    pub fn set_move_callback(&self, callback: Option<MoveCallback>) -> Result<()> {
        self.lock()?.callback = callback;
        Ok(())
    }

    /// Counters and sizes.
    pub fn stats(&self) -> Result<Stats> {
        let inner = self.lock()?;
        Ok(self.stats_of(&inner))
    }

    fn stats_of(&self, inner: &Inner) -> Stats {
        let st = &inner.st;
        let c = st.chunk;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // Slabs holding only retired objects back no live allocation: their
        // chunks are held memory, pooled (they return to the pool when
        // retired memory is released).
        let idle_slabs = st.small.reclaimable_slabs();
        Stats {
            live_allocations: st.live_count + st.small.live,
            live_bytes: st.live_bytes + st.small.live_bytes,
            mapped_bytes: (st.backed_pages - idle_slabs) * c,
            pooled_bytes: (st.pooled_pages() + idle_slabs) * c,
            peak_physical_bytes: st.peak_held_pages.max(st.held_pages()) * c,
            capacity_bytes: st.cap_pages * c,
            reserved_va_bytes: st.pages * c,
            free_va_bytes: st.free.total() * c,
            largest_free_va_bytes: st.free.largest() * c,
            retired_va_bytes: st.retired_pages * c + st.small.retired_bytes,
            moves: st.moves,
            driver_creates: load(&self.counts.creates),
            driver_releases: load(&self.counts.releases),
            driver_maps: load(&self.counts.maps),
            driver_unmaps: load(&self.counts.unmaps),
            driver_access_calls: load(&self.counts.access_calls),
            driver_syncs: load(&self.counts.syncs),
            chunk_bytes: c,
            cached_mapped_bytes: st.cached.len() as u64 * c,
            release_failures: inner.release_failures,
            reserve_fallbacks: self.reserve_fallbacks,
            bytes_copied: st.bytes_copied,
            small_slabs: st.small.slab_count(),
            asleep_bytes: st.asleep_pages * c,
            backup_bytes: st.backup_bytes,
        }
    }

    /// A JSON object describing every range (live, free, retired), the
    /// pooled chunks and the stats.
    pub fn snapshot_json(&self) -> Result<String> {
        let inner = self.lock()?;
        Ok(crate::snapshot::to_json(&inner.st, &self.stats_of(&inner), self.driver.name()))
    }

    /// The address of `len` bytes at `offset` in a live, awake allocation.
    fn span(&self, st: &State, id: Id, offset: u64, len: usize) -> Result<u64> {
        let (ptr, size, asleep) = match st.resolve(id)? {
            Target::Chunks(slot) => {
                let a = st.alloc(slot);
                (st.addr(a.start), a.size, a.sleep.is_some())
            }
            Target::Small(ss) => (small_ptr(st, ss), st.small.size_of(ss), false),
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
        let addr = self.span(&inner.st, id, offset, data.len())?;
        self.driver.write(addr, data)
    }

    /// Records an event on a device stream (a `CUstream`, 0 = the legacy
    /// default stream), for stream-ordered frees: memory freed by work on
    /// that stream may be handed out again once the event has completed.
    /// `None` on backends without asynchronous streams (the host).
    pub fn record_event(&self, stream: u64) -> Result<Option<u64>> {
        self.driver.record_event(stream)
    }

    /// Waits until all work on the device has finished (the fallback when a
    /// stream event cannot be recorded).
    pub fn synchronize(&self) -> Result<()> {
        self.driver.synchronize()
    }

    /// Whether an event from [`Arena::record_event`] has completed.
    pub fn event_complete(&self, event: u64) -> Result<bool> {
        self.driver.event_complete(event)
    }

    /// Destroys an event from [`Arena::record_event`].
    pub fn destroy_event(&self, event: u64) -> Result<()> {
        self.driver.destroy_event(event)
    }

    /// Copies bytes of the allocation at `offset` into `out`.
    pub fn read(&self, id: Id, offset: u64, out: &mut [u8]) -> Result<()> {
        let inner = self.lock()?;
        let addr = self.span(&inner.st, id, offset, out.len())?;
        self.driver.read(addr, out)
    }
}

/// Whether `a` is a caller's allocation of whole chunks that `tag` selects.
fn tagged(a: &Alloc, tag: u32) -> bool {
    !matches!(a.owner, Owner::Slab(_)) && (tag == ALL_TAGS || a.tag == tag)
}

/// [`Arena::sleep`]: the reversible part (synchronize, backups, unmaps) on a
/// copy of the state, then the releases, best effort.
fn sleep_tag(inner: &mut Inner, ctx: &Ctx<'_>, tag: u32, backup: bool) -> Result<()> {
    let st = &mut inner.st;
    let targets: Vec<u32> =
        st.by_start.values().copied().filter(|&s| st.alloc(s).sleep.is_none() && tagged(st.alloc(s), tag)).collect();
    let nothing_held = st.retired.is_empty() && st.small.nothing_retired() && st.pooled_pages() == 0;
    if targets.is_empty() && nothing_held {
        return Ok(());
    }
    let mut sim = st.clone();
    let mut tx = ctx.txn(st);
    let done = (|| {
        tx.sync()?;
        let mut backups = Vec::new();
        if backup {
            for &slot in &targets {
                let a = sim.alloc(slot);
                let len = usize::try_from(a.size).map_err(|_| Error::OutOfMemory("backup too large".into()))?;
                let mut buf = Vec::new();
                buf.try_reserve_exact(len)
                    .map_err(|_| Error::OutOfMemory(format!("no host memory for a backup of {len} bytes")))?;
                buf.resize(len, 0);
                ctx.drv.read(sim.addr(a.start), &mut buf)?;
                backups.push(Some(std::sync::Arc::new(buf)));
            }
        } else {
            backups.resize(targets.len(), None);
        }
        // Retired ranges may map the sleepers' chunks (a moved allocation's
        // old range): those mappings would keep the memory alive. All of
        // them go, as when the arena needs their address space.
        release_retired_into(&mut sim, &mut tx)?;
        let mut pages: Vec<u64> = targets
            .iter()
            .flat_map(|&s| {
                let a = sim.alloc(s);
                a.start..a.start + a.backed
            })
            .chain(sim.cached.iter().copied())
            .collect();
        pages.sort_unstable();
        for run in state::runs(&pages) {
            let hs: Vec<_> = run.clone().map(|p| sim.mapped[p as usize].expect("page is mapped")).collect();
            tx.unmap(run.start, hs)?;
        }
        Ok::<_, Error>(backups)
    })();
    let backups = match done {
        Ok(b) => {
            tx.commit();
            b
        }
        Err(e) => {
            tx.rollback();
            return Err(e);
        }
    };
    // Apply (infallible): the sleepers keep their reservations and map
    // nothing; every chunk they had and every pooled chunk is to release.
    let mut doomed: Vec<ChunkHandle> = Vec::new();
    for (&slot, backup) in targets.iter().zip(backups) {
        let a = sim.alloc(slot).clone();
        doomed.extend((a.start..a.start + a.backed).map(|p| sim.mapped[p as usize].take().expect("backing page")));
        sim.backed_pages -= a.backed;
        sim.asleep_pages += a.reserved;
        sim.backup_bytes += backup.as_ref().map_or(0, |b| b.len() as u64);
        let m = sim.alloc_mut(slot);
        m.sleep = Some(Sleep { backed: a.backed, backup });
        m.backed = 0;
    }
    for p in std::mem::take(&mut sim.cached) {
        doomed.push(sim.mapped[p as usize].take().expect("cached page is mapped"));
    }
    doomed.append(&mut sim.pool);
    *st = sim;
    for h in doomed {
        if txn::release(ctx.drv, ctx.counts, h).is_err() {
            inner.st.pool.push(h);
            inner.release_failures += 1;
        }
    }
    Ok(())
}

/// [`Arena::wake`]: every sleeper's chunks planned, mapped and made
/// accessible on a copy of the state, then the backups written; the copy
/// replaces the state only if every call succeeded.
fn wake_tag(st: &mut State, ctx: &Ctx<'_>, tag: u32) -> Result<()> {
    let targets: Vec<u32> =
        st.by_start.values().copied().filter(|&s| st.alloc(s).sleep.is_some() && tagged(st.alloc(s), tag)).collect();
    if targets.is_empty() {
        return Ok(());
    }
    // Out of memory is decided before any driver call: a refusal after some
    // sleepers were mapped would need a rollback, whose own driver calls
    // may fail and leave the arena unlike its books. Every pooled or cached
    // chunk can serve (none is cached inside a sleeper's reservation), and
    // new ones up to the capacity.
    let needed: u64 = targets.iter().map(|&s| st.alloc(s).sleep.as_ref().map_or(0, |z| z.backed)).sum();
    if needed > st.obtainable_pages() {
        return Err(Error::OutOfMemory(format!(
            "waking needs {needed} chunks of {} bytes; {} are obtainable under the capacity",
            st.chunk,
            st.obtainable_pages()
        )));
    }
    let mut sim = st.clone();
    let mut tx = ctx.txn(st);
    let done = (|| {
        for &slot in &targets {
            let a = sim.alloc(slot).clone();
            let sleep = a.sleep.as_ref().expect("asleep");
            // Nothing is cached inside a sleeper's reservation (sleep
            // unmapped it all, and nothing else maps there): every page
            // gets a pooled, stolen or new chunk.
            let mut plan = Plan::new(&sim, &[], a.start..a.start + sleep.backed, a.start..a.start + a.reserved)?;
            plan.execute(&sim, &mut tx)?;
            plan.apply(&mut sim);
            sim.backed_pages += sleep.backed;
            sim.asleep_pages -= a.reserved;
            sim.backup_bytes -= sleep.backup.as_ref().map_or(0, |b| b.len() as u64);
            let m = sim.alloc_mut(slot);
            m.backed = sleep.backed;
            m.sleep = None;
        }
        for &slot in &targets {
            let a = st.alloc(slot);
            if let Some(b) = a.sleep.as_ref().and_then(|s| s.backup.as_ref()) {
                ctx.drv.write(st.addr(a.start), b)?;
            }
        }
        Ok::<_, Error>(())
    })();
    match done {
        Ok(()) => {
            tx.commit();
            *st = sim;
            Ok(())
        }
        Err(e) => {
            tx.rollback();
            Err(e)
        }
    }
}

/// How an allocation can grow in place beyond its reservation when the
/// pages after it are not free.
enum InPlace {
    /// They are retired: release the retired ranges, then grow.
    Release,
    /// They hold unpinned allocations that fit elsewhere: move them
    /// (slot, destination page, planned on the books after the release of
    /// retired ranges), release, then grow.
    Evacuate(Vec<(u32, u64)>),
}

/// Whether `slot` can grow in place into `tail` (start page, pages) after
/// releasing retired ranges or moving its neighbours; `wanted` is the
/// reservation it would get by moving instead.
///
/// In place is preferred to moving the allocation itself: its address
/// stays, and the arena releases retired ranges when it needs their
/// address space anyway. Neighbours move for it only when it is pinned or
/// when no free range could take it (and never with `no_implicit_moves`).
fn in_place_route(st: &State, slot: u32, tail: (u64, u64), wanted: u64) -> Option<InPlace> {
    let (t0, n) = tail;
    if t0.checked_add(n).map_or(true, |end| end > st.pages) {
        return None;
    }
    let released_books;
    let released = if st.retired.is_empty() && st.small.nothing_retired() {
        st
    } else {
        let mut r = st.clone();
        forget_retired(&mut r);
        released_books = r;
        &released_books
    };
    if released.free.contains(t0, n) {
        // (Never with nothing retired: the caller found the pages not free.)
        return Some(InPlace::Release);
    }
    if st.no_implicit_moves || (!st.alloc(slot).pinned && st.free.best_fit(wanted).is_some()) {
        return None;
    }
    compact::plan_evacuation(released, t0, t0 + n, |other| other == slot || released.alloc(other).immovable())
        .map(InPlace::Evacuate)
}

/// Grows `slot` to `np` pages within its reservation, or into the free
/// range right after it. Changes `st` only on success.
fn grow_in_place(st: &mut State, tx: &mut Txn<'_>, slot: u32, np: u64, new_size: u64) -> Result<()> {
    let a = st.alloc(slot).clone();
    let reserved = a.reserved.max(np);
    let mut plan = Plan::new(st, &[], a.start + a.backed..a.start + np, a.start..a.start + reserved)?;
    plan.execute(st, tx)?;
    plan.apply(st);
    if reserved > a.reserved {
        st.free.remove(a.start + a.reserved, reserved - a.reserved);
    }
    st.backed_pages += np - a.backed;
    st.live_bytes = st.live_bytes - a.size + new_size;
    let m = st.alloc_mut(slot);
    m.reserved = reserved;
    m.backed = np;
    m.size = new_size;
    Ok(())
}

/// Places a new allocation of whole chunks: best fit, else after releasing
/// retired ranges and compacting. Returns its slot. On error the state is
/// unchanged and the caller rolls `tx` back.
#[allow(clippy::too_many_arguments)]
fn alloc_pages(
    st: &mut State,
    tx: &mut Txn<'_>,
    pages: u64,
    reserved: u64,
    size: u64,
    growable: bool,
    owner: Owner,
    events: &mut Vec<MoveEvent>,
) -> Result<u32> {
    let chunk = st.chunk;
    // Chunks held only by retired small objects come back when the retired
    // memory is released (below, on the slow path): count them.
    let short = pages > st.obtainable_pages();
    if short && pages > st.obtainable_pages() + st.small.reclaimable_slabs() {
        return Err(Error::OutOfMemory(format!(
            "{size} bytes need {pages} chunks; {} are obtainable under the capacity of {} bytes",
            st.obtainable_pages(),
            st.cap_pages * chunk
        )));
    }
    if reserved > st.pages {
        return Err(Error::OutOfAddressSpace(format!(
            "a reservation of {} bytes exceeds the whole virtual range",
            reserved * chunk
        )));
    }
    let a = Alloc { start: 0, reserved, backed: pages, size, growable, pinned: false, owner, tag: 0, sleep: None };
    if let (false, Some(t)) = (short, st.free.best_fit(reserved)) {
        let mut plan = Plan::new(st, &[], t..t + pages, t..t + reserved)?;
        plan.execute(st, tx)?;
        plan.apply(st);
        return Ok(st.insert_alloc(Alloc { start: t, ..a }));
    }
    // Several steps: work on a copy that replaces the state only on success.
    let mut sim = st.clone();
    let mut evs = Vec::new();
    let t = make_room(&mut sim, tx, reserved, None, &mut evs)?;
    // The chunks of retired small objects' slabs only after the place is
    // found: `make_room` refuses before any driver call, and a refusal after
    // these unmaps would need a rollback whose own calls may fail.
    if short {
        release_retired_into(&mut sim, tx)?;
    }
    let mut plan = Plan::new(&sim, &[], t..t + pages, t..t + reserved)?;
    plan.execute(&sim, tx)?;
    plan.apply(&mut sim);
    let slot = sim.insert_alloc(Alloc { start: t, ..a });
    *st = sim;
    events.extend(evs);
    Ok(slot)
}

/// Places a small allocation in a slab of its class, making a slab (one
/// chunk, like any allocation) when none has room. Returns its small slot.
fn alloc_small(st: &mut State, tx: &mut Txn<'_>, class: u16, size: u64, events: &mut Vec<MoveEvent>) -> Result<u32> {
    let slab = match st.small.partial_slab(class) {
        Some(s) => s,
        None => {
            let chunk = st.chunk;
            let slot = alloc_pages(st, tx, 1, 1, chunk, false, Owner::Slab(u32::MAX), events)?;
            let slab = st.small.add_slab(class, slot);
            st.alloc_mut(slot).owner = Owner::Slab(slab);
            slab
        }
    };
    Ok(st.small.take(slab, size).0)
}

/// Address of a small allocation in its slab.
fn small_ptr(st: &State, small_slot: u32) -> u64 {
    match st.small.slots[small_slot as usize].entry.as_ref().expect("live small slot") {
        SmallEntry::InSlab { slab, index, .. } => {
            let s = st.small.slab(*slab);
            st.addr(st.alloc(s.alloc_slot).start) + *index as u64 * st.small.classes.size(s.class)
        }
        SmallEntry::Promoted { alloc_slot } => st.addr(st.alloc(*alloc_slot).start),
    }
}

/// Resizes a small allocation. Within its class it stays where it is;
/// beyond, it gets a new place (another class, or whole chunks) and its
/// bytes are copied — the one place where the arena copies. The copy counts
/// in `bytes_copied`, and the address change is reported like a move.
fn resize_small(
    st: &mut State,
    ctx: &Ctx<'_>,
    ss: u32,
    id: Id,
    new_size: u64,
    events: &mut Vec<MoveEvent>,
) -> Result<u64> {
    let SmallEntry::InSlab { slab, size, pinned, .. } = *st.small.entry_of(ss) else {
        unreachable!("resolve gives Small only for objects in slabs")
    };
    let class = st.small.slab(slab).class;
    if new_size <= st.small.classes.size(class) {
        st.small.set_size(ss, new_size);
        return Ok(small_ptr(st, ss));
    }
    if pinned {
        return Err(Error::Pinned(id.get()));
    }
    let mut sim = st.clone();
    let mut tx = ctx.txn(st);
    let mut evs = Vec::new();
    let done = (|| {
        let chunk = sim.chunk;
        let new_place = match sim.small.classes.class_of(new_size) {
            Some(c) => {
                let tmp = alloc_small(&mut sim, &mut tx, c, new_size, &mut evs)?;
                NewPlace::Small(tmp)
            }
            None => {
                let pages = pages_for(new_size, chunk, "new_size")?;
                let owner = Owner::Promoted(ss);
                NewPlace::Chunks(alloc_pages(&mut sim, &mut tx, pages, pages, new_size, false, owner, &mut evs)?)
            }
        };
        // Placing the new object may have compacted: read the old address now.
        let old_ptr = small_ptr(&sim, ss);
        let new_ptr = match new_place {
            NewPlace::Small(tmp) => small_ptr(&sim, tmp),
            NewPlace::Chunks(slot) => sim.addr(sim.alloc(slot).start),
        };
        ctx.drv.copy(new_ptr, old_ptr, size.min(new_size))?;
        sim.bytes_copied += size.min(new_size);
        // The old place is retired, not freed: a kernel may still use it.
        sim.small.retire(ss);
        match new_place {
            NewPlace::Small(tmp) => sim.small.adopt(ss, tmp),
            NewPlace::Chunks(slot) => sim.small.set_entry(ss, SmallEntry::Promoted { alloc_slot: slot }),
        }
        sim.moves += 1;
        evs.push(MoveEvent { id, old_ptr, new_ptr, size: new_size });
        Ok::<_, Error>(new_ptr)
    })();
    match done {
        Ok(ptr) => {
            tx.commit();
            *st = sim;
            events.extend(evs);
            Ok(ptr)
        }
        Err(e) => {
            tx.rollback();
            Err(e)
        }
    }
}

enum NewPlace {
    Small(u32),
    Chunks(u32),
}

/// What an id names.
pub(crate) enum Target {
    /// An allocation of whole chunks (its arena slot).
    Chunks(u32),
    /// A small allocation in a slab (its small-table slot).
    Small(u32),
}

impl State {
    /// Resolves a caller's id; unknown, freed and internal ids are errors.
    pub(crate) fn resolve(&self, id: Id) -> Result<Target> {
        if !id.is_small() {
            return self.lookup(id).map(Target::Chunks);
        }
        let crate::id::IdParts { generation, tag, slot, .. } = id.parts();
        if tag != self.tag {
            return Err(Error::UnknownAllocation(id.get()));
        }
        match self.small.entry(slot, generation) {
            Some(SmallEntry::InSlab { .. }) => Ok(Target::Small(slot)),
            Some(SmallEntry::Promoted { alloc_slot }) => Ok(Target::Chunks(*alloc_slot)),
            None => Err(Error::UnknownAllocation(id.get())),
        }
    }

    /// The id a caller knows an allocation of whole chunks by.
    pub(crate) fn user_id(&self, slot: u32) -> Id {
        match self.alloc(slot).owner {
            Owner::Promoted(ss) => self.small_id(ss),
            _ => self.id_of(slot),
        }
    }
}

/// Finds `n` free pages, releasing retired ranges and then (unless implicit
/// moves are off) evacuating the cheapest window. Works on a state copy.
fn make_room(
    sim: &mut State,
    tx: &mut Txn<'_>,
    n: u64,
    resizing: Option<u32>,
    evs: &mut Vec<MoveEvent>,
) -> Result<u64> {
    if let Some(t) = sim.free.best_fit(n) {
        return Ok(t);
    }
    // Decide whether room can be made before any driver call: a refusal
    // after the retired ranges were unmapped would need a rollback, whose
    // own driver calls (mapping them back) may fail and leave the arena
    // unlike its books. The bookkeeping of the release is pure, so a copy
    // shows what the state will be after it.
    let mut released = sim.clone();
    forget_retired(&mut released);
    if let Some(t) = released.free.best_fit(n) {
        release_retired_into(sim, tx)?;
        return Ok(t);
    }
    let bytes = n * sim.chunk;
    if sim.no_implicit_moves {
        return Err(Error::OutOfAddressSpace(format!(
            "no free range of {bytes} bytes and implicit moves are disabled (largest free: {} bytes)",
            sim.free.largest() * sim.chunk
        )));
    }
    let immovable = |s: &State, slot: u32| Some(slot) == resizing || s.alloc(slot).immovable();
    let refused = || {
        Error::OutOfAddressSpace(format!(
            "no window of {bytes} bytes can be evacuated: pinned or sleeping allocations are in the way or there is nowhere to move them"
        ))
    };
    let plan = match compact::plan_window(&released, n, |slot| immovable(&released, slot)) {
        Some(plan) => {
            release_retired_into(sim, tx)?;
            plan
        }
        None => {
            // No single evacuation suffices: compact the whole range first
            // (planned on a copy, so a refusal makes no driver call), then
            // place the request directly or by evacuating a window.
            let (passes, after) = plan_passes(&released, immovable);
            let fits_after = after.free.best_fit(n).is_some()
                || compact::plan_window(&after, n, |slot| immovable(&after, slot)).is_some();
            if passes.is_empty() || !fits_after {
                return Err(refused());
            }
            release_retired_into(sim, tx)?;
            run_passes(sim, tx, passes, evs)?;
            if let Some(t) = sim.free.best_fit(n) {
                return Ok(t);
            }
            compact::plan_window(sim, n, |slot| immovable(sim, slot)).ok_or_else(refused)?
        }
    };
    drop(released);
    for (slot, dest) in plan.moves {
        let a = sim.alloc(slot).clone();
        move_alloc(sim, tx, slot, dest, a.backed, a.reserved, a.size, evs)?;
    }
    release_retired_into(sim, tx)?;
    sim.free.best_fit(n).ok_or_else(|| Error::Internal("compaction plan did not free its window".into()))
}

/// Maps `slot`'s chunks at `dest` (plus new ones up to `backed` pages),
/// retires its old range, and records the move.
#[allow(clippy::too_many_arguments)]
fn move_alloc(
    st: &mut State,
    tx: &mut Txn<'_>,
    slot: u32,
    dest: u64,
    backed: u64,
    reserved: u64,
    size: u64,
    evs: &mut Vec<MoveEvent>,
) -> Result<()> {
    let a = st.alloc(slot).clone();
    let known: Vec<_> =
        (a.start..a.start + a.backed).map(|p| st.mapped[p as usize].expect("backing page is mapped")).collect();
    let mut plan = Plan::new(st, &known, dest..dest + backed, dest..dest + reserved)?;
    plan.execute(st, tx)?;
    plan.apply(st);
    relocate_books(st, slot, dest, backed, reserved, size);
    let (old, new) = (st.addr(a.start), st.addr(dest));
    match a.owner {
        // Every object of a slab moves with it.
        Owner::Slab(slab) => {
            let s = st.small.slab(slab);
            let class = st.small.classes.size(s.class);
            for (i, member) in s.members.iter().enumerate() {
                if let Some(ss) = *member {
                    let off = i as u64 * class;
                    let id = st.small_id(ss);
                    evs.push(MoveEvent { id, old_ptr: old + off, new_ptr: new + off, size: st.small.size_of(ss) });
                    st.moves += 1;
                }
            }
        }
        _ => {
            evs.push(MoveEvent { id: st.user_id(slot), old_ptr: old, new_ptr: new, size });
            st.moves += 1;
        }
    }
    Ok(())
}

/// The address-space bookkeeping of a move (pure): the allocation takes
/// `dest..dest + reserved`, its old backed range is retired and its old
/// unbacked tail becomes free.
fn relocate_books(st: &mut State, slot: u32, dest: u64, backed: u64, reserved: u64, size: u64) {
    let a = st.alloc(slot).clone();
    st.by_start.remove(&a.start);
    st.retired.insert(a.start, a.backed);
    st.retired_pages += a.backed;
    st.free.insert(a.start + a.backed, a.reserved - a.backed);
    st.free.remove(dest, reserved);
    st.by_start.insert(dest, slot);
    st.backed_pages += backed - a.backed;
    if !matches!(a.owner, Owner::Slab(_)) {
        st.live_bytes = st.live_bytes - a.size + size;
    }
    let m = st.alloc_mut(slot);
    m.start = dest;
    m.reserved = reserved;
    m.backed = backed;
    m.size = size;
}

/// Plans top-down compaction passes on a copy of the books, without a
/// driver call: each movable allocation, highest first, moves into the
/// best-fitting hole below it, provided that does not shrink the largest
/// free range (counting retired ranges as free, as they are at the end of
/// the pass: filling a big hole to free a small pocket between pinned
/// neighbours would fragment, not compact). Returns the moves of each pass
/// and the books after them (retired ranges released).
fn plan_passes(st: &State, immovable: impl Fn(&State, u32) -> bool) -> (Vec<Vec<(u32, u64)>>, State) {
    let mut sim = st.clone();
    forget_retired(&mut sim);
    let mut passes = Vec::new();
    for _pass in 0..8 {
        let mut moves = Vec::new();
        let mut after = sim.free.clone();
        let order: Vec<u32> = sim.by_start.values().rev().copied().collect();
        for slot in order {
            if immovable(&sim, slot) {
                continue;
            }
            let a = sim.alloc(slot).clone();
            let Some(t) = sim.free.best_fit_where(a.reserved, 64, |s, _| s < a.start) else {
                continue;
            };
            let largest = after.largest();
            after.remove(t, a.reserved);
            after.insert(a.start, a.reserved);
            if after.largest() < largest {
                after.remove(a.start, a.reserved);
                after.insert(t, a.reserved);
                continue;
            }
            relocate_books(&mut sim, slot, t, a.backed, a.reserved, a.size);
            moves.push((slot, t));
        }
        forget_retired(&mut sim);
        if moves.is_empty() {
            break;
        }
        passes.push(moves);
    }
    (passes, sim)
}

/// Performs planned compaction passes: the moves of each pass, then the
/// release of the ranges they retired. Returns the allocations moved (as
/// callers count them: each object of a moved slab) and the bytes remapped.
fn run_passes(
    sim: &mut State,
    tx: &mut Txn<'_>,
    passes: Vec<Vec<(u32, u64)>>,
    evs: &mut Vec<MoveEvent>,
) -> Result<(u64, u64)> {
    let (mut moved, mut bytes) = (0, 0);
    for pass in passes {
        for (slot, dest) in pass {
            let a = sim.alloc(slot).clone();
            // Allocations, as callers know them: a slab's move moves each
            // of its objects (one event each), and none if it holds only
            // retired ones.
            let events_before = evs.len();
            move_alloc(sim, tx, slot, dest, a.backed, a.reserved, a.size, evs)?;
            moved += (evs.len() - events_before) as u64;
            bytes += a.backed * sim.chunk;
        }
        release_retired_into(sim, tx)?;
    }
    Ok((moved, bytes))
}

/// Unmaps every retired range (synchronizing first) and frees its pages.
fn release_retired_into(st: &mut State, tx: &mut Txn<'_>) -> Result<()> {
    let ranges: Vec<(u64, u64)> = st.retired.iter().map(|(&s, &l)| (s, l)).collect();
    for &(s, l) in &ranges {
        let chunks = (s..s + l).map(|p| st.mapped[p as usize].expect("retired page is mapped")).collect();
        tx.unmap(s, chunks)?;
    }
    forget_retired(st);
    Ok(())
}

/// The bookkeeping of releasing every retired range, once it is unmapped
/// (pure: no driver call).
fn forget_retired(st: &mut State) {
    let ranges: Vec<(u64, u64)> = st.retired.iter().map(|(&s, &l)| (s, l)).collect();
    for (s, l) in ranges {
        for p in s..s + l {
            st.mapped[p as usize] = None;
        }
        st.free.insert(s, l);
    }
    st.retired.clear();
    st.retired_pages = 0;
    // Copy-resized small objects: their old places become free, and a slab
    // left empty goes back like any freed allocation.
    for slab in st.small.release_retired() {
        st.remove_alloc(slab);
    }
}

/// Gives pooled chunks back until at most `keep_bytes` stay pooled.
///
/// A chunk about to be given back may still be mapped at retired pages
/// (the old range of an allocation that moved and was then freed or
/// shrunk). Its memory would outlive the release, so those pages are
/// unmapped first — only those: a pooled chunk backs no live allocation,
/// so no live allocation's old address loses a byte below its size, and
/// every other retired page (and retired small object) stays valid until
/// `release_retired`. Hence the bytes given back never exceed what was
/// pooled when the call began.
fn trim_pool(st: &mut State, ctx: &Ctx<'_>, keep_bytes: u64) -> Result<u64> {
    let keep = keep_bytes / st.chunk;
    let pooled = st.pooled_pages();
    if pooled <= keep {
        return Ok(0);
    }
    let k = (pooled - keep) as usize;
    // Unmapped pooled chunks first (giving them back needs no unmap of
    // theirs), then cached chunks, highest addresses first.
    let from_pool: Vec<ChunkHandle> = st.pool.iter().rev().take(k).copied().collect();
    let mut cached_pages: Vec<u64> = st.cached.iter().rev().take(k - from_pool.len()).copied().collect();
    cached_pages.sort_unstable();
    let cached_chunks: Vec<ChunkHandle> =
        cached_pages.iter().map(|&p| st.mapped[p as usize].expect("cached page is mapped")).collect();
    let doomed: std::collections::HashSet<ChunkHandle> = from_pool.iter().chain(&cached_chunks).copied().collect();
    let retired_pages: Vec<u64> = st
        .retired
        .iter()
        .flat_map(|(&s, &l)| s..s + l)
        .filter(|&p| st.mapped[p as usize].is_some_and(|h| doomed.contains(&h)))
        .collect();
    // Every unmap first, in one transaction (undoable until committed).
    let mut tx = ctx.txn(st);
    for run in state::runs(&retired_pages).into_iter().chain(state::runs(&cached_pages)) {
        let hs: Vec<_> = run.clone().map(|p| st.mapped[p as usize].expect("page is mapped")).collect();
        if let Err(e) = tx.unmap(run.start, hs) {
            tx.rollback();
            return Err(e);
        }
    }
    tx.commit();
    forget_retired_pages(st, &retired_pages);
    for &p in &cached_pages {
        st.cached.remove(&p);
        st.mapped[p as usize] = None;
    }
    st.pool.truncate(st.pool.len() - from_pool.len());
    // Then the releases, which cannot be undone: a failure keeps the rest pooled.
    let chunks: Vec<ChunkHandle> = from_pool.into_iter().chain(cached_chunks).collect();
    let mut released = 0u64;
    for (i, &h) in chunks.iter().enumerate() {
        if let Err(e) = txn::release(ctx.drv, ctx.counts, h) {
            st.pool.extend_from_slice(&chunks[i..]);
            return Err(e);
        }
        released += st.chunk;
    }
    Ok(released)
}

/// The bookkeeping of unmapping some pages of retired ranges (sorted):
/// they become free, and the ranges around them stay retired.
fn forget_retired_pages(st: &mut State, pages: &[u64]) {
    for &p in pages {
        let (&s, &l) = st.retired.range(..=p).next_back().expect("page lies in a retired range");
        debug_assert!(p < s + l, "page {p} outside the retired range {s}+{l}");
        st.retired.remove(&s);
        if p > s {
            st.retired.insert(s, p - s);
        }
        if p + 1 < s + l {
            st.retired.insert(p + 1, s + l - p - 1);
        }
        st.retired_pages -= 1;
        st.mapped[p as usize] = None;
        st.free.insert(p, 1);
    }
}

/// After an operation (a free, a shrink, a release of retired ranges that
/// emptied a slab): give back pooled memory beyond the retain watermark.
/// Best effort: the operation itself has succeeded, so a driver failure
/// only keeps the memory pooled (counted in `release_failures`).
fn enforce_watermark(inner: &mut Inner, ctx: &Ctx<'_>) {
    let st = &mut inner.st;
    if st.retain_bytes == u64::MAX || st.pooled_pages() * st.chunk <= st.retain_bytes {
        return;
    }
    if trim_pool(st, ctx, st.retain_bytes).is_err() {
        inner.release_failures += 1;
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Never panics: a poisoned lock still yields the state, and every
        // driver failure here is ignored (the process keeps the memory at worst).
        let inner = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let st = &inner.st;
        let _ = self.driver.synchronize();
        let mapped: Vec<u64> = (0..st.pages).filter(|&p| st.mapped[p as usize].is_some()).collect();
        for run in state::runs(&mapped) {
            let _ = self.driver.unmap(st.addr(run.start), (run.end - run.start) * st.chunk);
        }
        let mut owned: Vec<_> = st.pool.clone();
        owned.extend(st.cached.iter().filter_map(|&p| st.mapped[p as usize]));
        for a in st.slots.iter().filter_map(|s| s.alloc.as_ref()) {
            owned.extend((a.start..a.start + a.backed).filter_map(|p| st.mapped[p as usize]));
        }
        for h in owned {
            let _ = self.driver.release(h);
        }
        let _ = self.driver.free_reservation(self.driver_va.0, self.driver_va.1);
    }
}

// The arena is shared across threads by design; these fail to compile if a
// field ever makes it otherwise.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Arena>();
};
