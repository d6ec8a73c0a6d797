//! The report types ([`Stats`], [`CompactReport`], [`AllocInfo`]), the
//! stats and the JSON snapshot.

use crate::error::Result;
use crate::sync::{AtomicU64, Ordering};

use super::{Arena, Inner};

/// Counters and sizes of an arena (every field of `vmm_arena_stats`, and more).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub live_allocations: u64,
    /// Sum of the sizes callers asked for.
    pub live_bytes: u64,
    /// Physical bytes backing live allocations (each chunk once: a slab's
    /// chunk counts while one of its objects is live), and the chunks of
    /// freed allocations that an open DMA-BUF still holds (`Arena::dmabuf`:
    /// not reusable, so not pooled).
    pub mapped_bytes: u64,
    /// Physical bytes held but backing no live allocation: cached and
    /// unmapped pooled chunks (prefetched ones included, and those the
    /// prefetcher is working on), slabs that hold only retired objects
    /// (until retired memory is released, when they join the pool), and
    /// the chunks of stream-ordered frees still waiting for their event
    /// (`pending_free_bytes`).
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
    /// Chunk creations (`cuMemCreate`), by every thread (callers' and the
    /// prefetcher's); likewise the next five counts.
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    /// Unmap calls: one per mapping, or one per run of pages where the
    /// driver accepts spans ([`Arena::unmaps_span_mappings`]).
    pub driver_unmaps: u64,
    pub driver_access_calls: u64,
    /// Device synchronizations (one before each batch of unmaps of pages
    /// not known idle).
    pub driver_syncs: u64,
    /// The chunk size.
    pub chunk_bytes: u64,
    /// Pooled chunks mapped at a free address, ready to serve without a driver call.
    pub cached_mapped_bytes: u64,
    /// Of those, the chunks known idle (see `Arena::free_on_stream` and
    /// `Arena::resize_on_stream`): another address takes them without a
    /// device synchronize. The others need one first.
    pub idle_cached_bytes: u64,
    /// Pooled chunks mapped nowhere (created ahead, or given up by an
    /// unmap), ready for any address with a map.
    pub unmapped_pooled_bytes: u64,
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
    /// Allocations imported from exports ([`Arena::import`]); they count
    /// here only, not in `live_allocations`, `live_bytes` or `mapped_bytes`.
    pub imported_allocations: u64,
    /// Chunk bytes mapped by imported allocations (memory another arena
    /// created: not held against this arena's capacity).
    pub imported_bytes: u64,
    /// Live allocations that were exported ([`Arena::export`]) at least once.
    pub exported_allocations: u64,
    /// Virtual-memory driver calls (creates, releases, maps, unmaps,
    /// access calls, synchronizes) made by the callers' operations, on
    /// their threads: the driver work on the critical path.
    pub caller_driver_calls: u64,
    /// Of `caller_driver_calls`, chunk creations.
    pub caller_creates: u64,
    /// Of `caller_driver_calls`, device synchronizations.
    pub caller_syncs: u64,
    /// The same calls made by [`Arena::maintain`](super::Arena::maintain)
    /// or the background worker: off the critical path when maintain runs
    /// while the device computes. `driver_*` count both kinds.
    pub maintain_driver_calls: u64,
    /// Frees ordered on a stream (an event recorded by
    /// [`Arena::free_on_stream`](super::Arena::free_on_stream)).
    pub stream_frees: u64,
    /// Shrinks ordered on a stream (an event recorded by
    /// [`Arena::resize_on_stream`](super::Arena::resize_on_stream)).
    pub stream_shrinks: u64,
    /// Promises of no more work (an event recorded by
    /// [`Arena::quiesce_on_stream`](super::Arena::quiesce_on_stream)).
    pub quiesces: u64,
    /// Polls of such events (`cuEventQuery`; they never block).
    pub event_polls: u64,
    /// Blocking waits on such events (`cuEventSynchronize`), made only when
    /// nothing else could serve a request, oldest event first.
    pub event_waits: u64,
    /// Physical bytes of stream-ordered frees whose event has not been
    /// seen complete: held, counted in `pooled_bytes`, not reusable yet.
    pub pending_free_bytes: u64,
    /// Of `pooled_bytes`, what serves the prefetch targets now: unmapped
    /// pooled chunks up to `precreate_bytes`, plus the chunks mapped ahead
    /// of awake growable allocations' backed sizes (up to
    /// `map_ahead_bytes` each) and the chunks the prefetcher is working on.
    pub prefetched_bytes: u64,
    /// Driver failures in `maintain` or the background worker; each left
    /// the arena consistent and lost nothing.
    pub maintain_failures: u64,
    /// Physical bytes mapped by more than one live allocation of this arena
    /// (aliasing, see [`Arena::alloc_shared`]), each chunk once; they count
    /// once in `mapped_bytes` too. Exports and imports count apart.
    pub shared_bytes: u64,
}

impl Stats {
    /// Capacity left neither mapped nor pooled once `size` more bytes are
    /// allocated, the pool serving what it can of them (the rule behind
    /// torch_memory_saver's `memory_margin_bytes`, checked against the
    /// arena's capacity rather than the device's free memory).
    pub fn capacity_free_after(&self, size: u64) -> u64 {
        let held = self.mapped_bytes.saturating_add(self.pooled_bytes);
        self.capacity_bytes.saturating_sub(held).saturating_sub(size.saturating_sub(self.pooled_bytes))
    }

    /// `OutOfMemory` when `size` more bytes would leave less than `margin`
    /// of the capacity free ([`Stats::capacity_free_after`]).
    pub fn check_margin(&self, size: u64, margin: u64) -> Result<()> {
        let left = self.capacity_free_after(size);
        if left < margin {
            return Err(crate::Error::OutOfMemory(format!(
                "{size} bytes would leave {left} of the arena's {} bytes free, under the margin of {margin} (memory_margin_bytes)",
                self.capacity_bytes
            )));
        }
        Ok(())
    }
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

impl Arena {
    /// Counters and sizes.
    pub fn stats(&self) -> Result<Stats> {
        let inner = self.lock()?;
        Ok(self.stats_of(&inner))
    }

    /// [`Arena::stats`] if no call holds the arena's lock right now, `None`
    /// otherwise: for a monitoring thread that must never wait on the
    /// arena, or a driver hook that may run under the arena's own lock
    /// (e.g. the map calls of a rollback), where `stats` would deadlock.
    pub fn try_stats(&self) -> Result<Option<Stats>> {
        match self.sh.try_lock()? {
            Some(inner) => Ok(Some(self.stats_of(&inner))),
            None => Ok(None),
        }
    }

    fn stats_of(&self, inner: &Inner) -> Stats {
        let st = &inner.st;
        let c = st.chunk;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // Slabs holding only retired objects back no live allocation: their
        // chunks are held memory, pooled (they return to the pool when
        // retired memory is released).
        let idle_slabs = st.small.reclaimable_slabs();
        #[cfg(unix)]
        let (imported, exported) = (inner.shares.imported(c), inner.shares.exported_count());
        #[cfg(not(unix))]
        let (imported, exported) = ((0, 0), 0);
        let (fg, bg) = (&self.sh.counts, &self.sh.bg_counts);
        let both = |f: fn(&super::txn::Counters) -> &AtomicU64| load(f(fg)) + load(f(bg));
        let pending = super::stream::pending_chunks(st);
        Stats {
            live_allocations: st.live_count + st.small.live,
            live_bytes: st.live_bytes + st.small.live_bytes,
            mapped_bytes: (st.backing_chunks() - idle_slabs - pending) * c,
            pooled_bytes: (st.pooled_pages() + idle_slabs + pending + st.inflight_pages) * c,
            peak_physical_bytes: st.peak_held_pages.max(st.held_pages()) * c,
            capacity_bytes: st.cap_pages * c,
            reserved_va_bytes: st.pages * c,
            free_va_bytes: st.free.total() * c,
            largest_free_va_bytes: st.free.largest() * c,
            retired_va_bytes: st.retired_pages * c + st.small.retired_bytes,
            moves: st.moves,
            driver_creates: both(|c| &c.creates),
            driver_releases: both(|c| &c.releases),
            driver_maps: both(|c| &c.maps),
            driver_unmaps: both(|c| &c.unmaps),
            driver_access_calls: both(|c| &c.access_calls),
            driver_syncs: both(|c| &c.syncs),
            chunk_bytes: c,
            cached_mapped_bytes: st.cached.len() as u64 * c,
            idle_cached_bytes: idle_cached_pages(st) * c,
            unmapped_pooled_bytes: st.pool.len() as u64 * c,
            release_failures: inner.release_failures,
            reserve_fallbacks: self.reserve_fallbacks,
            bytes_copied: st.bytes_copied,
            small_slabs: st.small.slab_count(),
            asleep_bytes: st.asleep_pages * c,
            backup_bytes: st.backup_bytes,
            imported_allocations: imported.0,
            imported_bytes: imported.1,
            exported_allocations: exported,
            caller_driver_calls: fg.vmm_calls(),
            caller_creates: load(&fg.creates),
            caller_syncs: load(&fg.syncs),
            maintain_driver_calls: bg.vmm_calls(),
            stream_frees: both(|c| &c.event_records),
            stream_shrinks: both(|c| &c.shrink_events),
            quiesces: both(|c| &c.quiesce_events),
            event_polls: both(|c| &c.event_queries),
            event_waits: both(|c| &c.event_waits),
            pending_free_bytes: pending * c,
            prefetched_bytes: (super::prefetch::prefetched_pages(st) + st.inflight_pages) * c,
            maintain_failures: inner.maintain_failures,
            shared_bytes: st.shared.len() as u64 * c,
        }
    }

    /// A JSON object describing every range (live, free, retired), the
    /// pooled chunks and the stats.
    pub fn snapshot_json(&self) -> Result<String> {
        let inner = self.lock()?;
        Ok(crate::snapshot::to_json(&inner.st, &self.stats_of(&inner), self.sh.driver.name()))
    }
}

/// Cached pages known idle: `State::idle` holds cached pages and idle
/// pages of retired ranges (few: retired ranges are released between
/// steps), so this costs the retired ranges, not the idle set.
fn idle_cached_pages(st: &super::state::State) -> u64 {
    let retired_idle: usize = st.retired.iter().map(|(&s, &l)| st.idle.range(s..s + l).count()).sum();
    st.idle.len() as u64 - retired_idle as u64
}
