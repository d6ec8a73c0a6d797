//! The prefix cache applied to the arena (issue 12): the books of
//! `prefix_cache.rs` (hash chains, LRU queue, holders) driven on an
//! arena. Every holder is an arena allocation; a hit is mapped with
//! `Arena::alloc_shared`, an entry is shrunk with `resize_on_stream` (or
//! `resize`) and freed with `free_on_stream` (or `free`) as the books say.

use vmm_arena::{Arena, Error, Id};

use super::managers::discard;
use super::prefix_cache::{PrefixCache, Release};
use super::trace::Request;

/// The prefix cache applied to an arena manager: one growable allocation
/// per request (the token-major layout), whose first chunks may be a cached
/// prefix shared with others. Every allocation the books name is an arena
/// allocation; entries are shrunk to their cached units (`resize`, or
/// `resize_on_stream` where frees are on the stream) and freed when
/// nothing of their own is cached any more.
pub struct ArenaPrefixCache {
    pub books: PrefixCache<Id>,
    /// Frees are ordered on this stream (`free_on_stream`), as the
    /// manager's own, where it frees on a stream.
    pub stream: Option<u64>,
    /// Entries quiesced on the stream (`Arena::quiesce_on_stream`) when
    /// their request ended.
    quiesces: u64,
    unit_bytes: u64,
    peak_footprint: u64,
    peak_shared_bytes: u64,
    /// Shrinks and frees made by evictions.
    evict_resizes: u64,
    evict_frees: u64,
    /// Entries freed (by evicting their units, oldest first) because the
    /// arena's address space had no range for a new reservation.
    va_evictions: u64,
    peak_entries: u64,
    /// Admissions that took over an entry's allocation, and the bytes of
    /// its mapped chunks they reused in place (past their hit).
    take_overs: u64,
    take_over_failures: u64,
    reused_bytes: u64,
    /// Resizes or frees of entries that failed (the arena is unchanged by
    /// a failed call; the books count the memory as evicted).
    errors: u64,
    last_error: Option<String>,
    /// Admissions begun (`begin`) over an entry they took over and not
    /// finished yet: given up, such an entry goes back to being one.
    taken_over: std::collections::HashSet<Id>,
}

impl ArenaPrefixCache {
    /// A cache for allocations of `bpt` bytes per token, or None where no
    /// unit fits: the unit is vLLM's 16-token block, or one chunk where a
    /// chunk holds more than 16 tokens (super-pages: 64 tokens in an 8 MiB
    /// chunk at 128 KiB a token); it must be whole chunks and tile a hash
    /// block (a 20 MiB chunk's 160 tokens do not tile 512: no cache).
    pub fn new(chunk: u64, bpt: u64) -> Option<ArenaPrefixCache> {
        let block = super::managers::VLLM_BLOCK_TOKENS;
        let unit_tokens = match chunk.checked_div(bpt)? {
            per_chunk if per_chunk > block && chunk % bpt == 0 => per_chunk,
            _ => block,
        };
        let unit_bytes = unit_tokens * bpt;
        let tiles = super::trace::HASH_BLOCK_TOKENS % unit_tokens == 0;
        (unit_bytes % chunk == 0 && tiles).then(|| ArenaPrefixCache {
            books: PrefixCache::new(unit_tokens, super::trace::HASH_BLOCK_TOKENS),
            stream: None,
            quiesces: 0,
            unit_bytes,
            peak_footprint: 0,
            peak_shared_bytes: 0,
            evict_resizes: 0,
            evict_frees: 0,
            va_evictions: 0,
            peak_entries: 0,
            take_overs: 0,
            take_over_failures: 0,
            reused_bytes: 0,
            errors: 0,
            last_error: None,
            taken_over: Default::default(),
        })
    }

    /// Bytes of running requests' KV that more than one of them maps,
    /// counted once per extra request.
    pub fn shared_live_bytes(&self) -> u64 {
        self.books.shared_live_units() * self.unit_bytes
    }

    /// Admits a request of `size` bytes reserving `max`: maps its longest
    /// cached prefix (`alloc_shared`) and grows past it, evicting what it
    /// needs. Its first `computed` tokens are computed in this step (its
    /// whole prompt, or its first chunk with chunked prefill): their full
    /// hash blocks are cached. Returns the allocation and the prompt
    /// tokens it found cached.
    pub fn admit(
        &mut self,
        arena: &Arena,
        size: u64,
        max: u64,
        q: &Request,
        computed: u64,
        discard: bool,
    ) -> Result<(Id, u64), Error> {
        let (id, hit) = self.begin(arena, size, max, q, discard, u64::MAX)?;
        self.finish(arena, id, q, computed);
        Ok((id, hit))
    }

    /// The first part of [`admit`](Self::admit), for an admission mapped
    /// over several steps: maps the longest cached prefix and grows past
    /// it by at most `now` bytes (at least one chunk where nothing is
    /// cached), up to `size`. The books hold the hit from now on; the
    /// request's own units are cached by [`finish`](Self::finish), in the
    /// step that computes them, or the admission is given up with
    /// [`give_up`](Self::give_up).
    pub fn begin(
        &mut self,
        arena: &Arena,
        size: u64,
        max: u64,
        q: &Request,
        discard: bool,
        now: u64,
    ) -> Result<(Id, u64), Error> {
        self.make_va_room(arena, max, discard);
        let full = q.full_hash_blocks() as usize;
        let hit = self.books.lookup(q.prompt, &q.hash_ids, full);
        let hit_bytes = hit.units.len() as u64 * self.unit_bytes;
        let hit_tokens = hit_bytes / self.unit_bytes * self.books.unit_tokens();
        let whole = size;
        let size = size.min(hit_bytes.saturating_add(now.max(if hit_bytes == 0 { self.unit_bytes } else { 0 })));
        // As vLLM: an admission whose fresh chunks (those mapped now, for
        // one mapped over several steps) exceed the free and the evictable
        // ones (its hit's queued units leave the queue) fails before
        // anything is evicted; evicting first would empty the cache for a
        // request that fails anyway.
        if let Ok(s) = arena.stats() {
            let fresh = size.saturating_sub(hit_bytes).div_ceil(self.unit_bytes);
            let free = s.capacity_bytes.saturating_sub(s.mapped_bytes) / self.unit_bytes;
            let evictable = self.books.queued_units() - self.books.queued_among(&hit.units);
            if fresh > free + evictable {
                return Err(Error::OutOfMemory(format!(
                    "{fresh} chunks of {} bytes needed, {free} free and {evictable} evictable",
                    self.unit_bytes
                )));
            }
        }
        if let Some(id) = self.take_over(arena, &hit.units, whole, size, discard) {
            self.taken_over.insert(id);
            return Ok((id, hit_tokens));
        }
        let id = match hit.source {
            Some(src) => {
                let (id, _) = arena.alloc_shared(src, 0, hit_bytes, max)?;
                self.books.acquire(id, &hit.units);
                if let Err(e) = self.grow_to(arena, id, hit_bytes, size, discard) {
                    self.books.abort(id);
                    // Never used by the GPU; on the stream, its pages are
                    // known idle once the step ends (a plain free would
                    // leave its shared pages retired and not known idle:
                    // releasing them would synchronize).
                    let _ = match self.stream {
                        Some(stream) => arena.free_on_stream(id, stream),
                        None => arena.free(id),
                    };
                    return Err(e);
                }
                id
            }
            None => {
                self.make_room(arena, size, discard);
                let id = loop {
                    // On the stream, memory freed or shrunk on it this
                    // step serves the admission at once.
                    let placed = match self.stream {
                        Some(stream) => arena.alloc_growable_on_stream(size, max, stream),
                        None => arena.alloc_growable(size, max),
                    };
                    match placed {
                        Ok((id, _)) => break id,
                        Err(Error::OutOfMemory(_)) if self.books.queued_units() > 0 => self.evict(arena, 1, discard),
                        Err(e) => return Err(e),
                    }
                };
                self.books.acquire(id, &[]);
                id
            }
        };
        Ok((id, hit_tokens))
    }

    /// The admission begun by [`begin`](Self::begin) runs (its first
    /// `computed` tokens are computed in this step): its own units of them
    /// are cached.
    pub fn finish(&mut self, arena: &Arena, id: Id, q: &Request, computed: u64) {
        self.taken_over.remove(&id);
        self.cache_computed(id, q, computed);
        self.note_peaks(arena);
        self.peak_entries = self.peak_entries.max(self.books.entries());
    }

    /// The running request `id` of `q` has computed its first `computed`
    /// tokens: the units of its full hash blocks among them are cached (as
    /// vLLM caches a block once computed). Whether its prompt's full hash
    /// blocks are all computed now.
    pub fn cache_computed(&mut self, id: Id, q: &Request, computed: u64) -> bool {
        let full = q.full_hash_blocks() as usize;
        let done = full.min((computed / super::trace::HASH_BLOCK_TOKENS) as usize);
        self.books.cache_own(id, &q.hash_ids, full, done);
        done == full
    }

    /// Gives up an admission begun by [`begin`](Self::begin) and never
    /// run: the hit goes back to the queue where it was, and the
    /// allocation (never used by the GPU) is freed, on the stream unless
    /// `now` asks for its memory at once (a plain free: stealing it then
    /// synchronizes, but nothing waits for an event). An admission that
    /// took an entry over gives it back as an entry (released as a
    /// finished request's: its units queued, shrunk to them, quiesced).
    pub fn give_up(&mut self, arena: &Arena, id: Id, now: bool) {
        if self.taken_over.remove(&id) {
            // An entry before: it is one again (never used by the GPU
            // meanwhile, so its promise of no more work holds as made anew).
            self.release(arena, id, false);
            return;
        }
        self.books.abort(id);
        let done = match self.stream {
            Some(stream) if !now => arena.free_on_stream(id, stream),
            _ => arena.free(id),
        };
        self.note(done);
    }

    /// Bytes of the longest cached prefix `q` would map now (nothing is
    /// counted or changed).
    pub fn hit_bytes(&self, q: &Request) -> u64 {
        let (hit, _) = self.books.find(q.prompt, &q.hash_ids, q.full_hash_blocks() as usize);
        hit.units.len() as u64 * self.unit_bytes
    }

    /// Prompt tokens of the longest cached prefix `q` would map now
    /// (nothing is counted or changed): what [`admit`](Self::admit) returns.
    pub fn hit_tokens(&self, q: &Request) -> u64 {
        self.hit_bytes(q) / self.unit_bytes * self.books.unit_tokens()
    }

    /// Evicts cached units now so that `bytes` more fit later: on the
    /// stream, their chunks are known idle once this step's work has
    /// completed (an admission mapped over several steps takes them then,
    /// without a synchronize). Evicts nothing unless the queue holds
    /// enough (as [`admit`](Self::admit)'s own eviction).
    pub fn evict_ahead(&mut self, arena: &Arena, bytes: u64, discard: bool) {
        self.make_room(arena, bytes, discard);
    }

    /// Where this admission must evict, gives it an entry's allocation that
    /// already maps its hit ([`PrefixCache::take_over`]), resized to `size`.
    /// `size` is the admission's whole size (what the eviction is for);
    /// the allocation grows now to `now_size`, or to what the entry
    /// already maps up to `size` if that is more (no driver call).
    fn take_over(&mut self, arena: &Arena, hit: &[u32], size: u64, now_size: u64, discard: bool) -> Option<Id> {
        let s = arena.stats().ok()?;
        let fresh = size - hit.len() as u64 * self.unit_bytes;
        let need = fresh.saturating_sub(s.capacity_bytes - s.mapped_bytes).div_ceil(self.unit_bytes);
        // With no hit, where the memory no chunk holds cannot serve the
        // admission, a new allocation would take chunks held elsewhere
        // (cached, pooled or pending) and map them at its address, even
        // with nothing to evict. The least recently used entry, when its
        // units are the oldest queued (those LRU eviction gives up next),
        // is taken over instead, its chunks adopted where they lie: as if
        // one unit were to be evicted, which its own units cover (an entry
        // taken over for a hit may have none past it, and then would
        // evict another's unit early).
        let room = s.capacity_bytes.saturating_sub(s.mapped_bytes + s.pooled_bytes);
        let need = if need == 0 && hit.is_empty() && fresh > room { 1 } else { need };
        let (id, others) = self.books.take_over(hit, need)?;
        for (k, r) in others {
            match r {
                Release::Keep(_) => self.evict_resizes += 1,
                Release::Free(_) => self.evict_frees += 1,
            }
            self.apply(arena, k, r, discard);
        }
        self.take_overs += 1;
        let backed = arena.query(id).map_or(0, |i| i.mapped_bytes);
        self.reused_bytes += backed.min(size).saturating_sub(hit.len() as u64 * self.unit_bytes);
        match self.grow_to(arena, id, backed, now_size.max(backed.min(size)), discard) {
            Ok(()) => {
                // The admission writes into the pages it keeps: the entry's
                // promise of no more work ends (growth ended it already; a
                // take-over that only shrank needs this). After the resize,
                // so that what a shrink drops, which saw no work, is idle.
                let unquiesced = arena.unquiesce(id);
                self.note(unquiesced);
                Some(id)
            }
            Err(_) => {
                // It goes back to being an entry of its hit (or is freed):
                // the admission fails, as it would have without the take-over.
                self.take_over_failures += 1;
                let r = self.books.release(id);
                self.apply(arena, id, r, discard);
                None
            }
        }
    }

    /// Grows a running request's allocation from `backed` to `new_size`
    /// bytes, evicting what it needs.
    pub fn grow(&mut self, arena: &Arena, id: Id, backed: u64, new_size: u64, discard: bool) -> Result<(), Error> {
        self.grow_to(arena, id, backed, new_size, discard)?;
        self.note_peaks(arena);
        Ok(())
    }

    /// Grows several running requests' allocations at once
    /// (`Arena::resize_many`, all or nothing) by `more` bytes in all,
    /// evicting what they need.
    pub fn resize_many(&mut self, arena: &Arena, targets: &[(Id, u64)], more: u64, discard: bool) -> Result<(), Error> {
        self.make_room(arena, more, discard);
        loop {
            let resized = match self.stream {
                Some(stream) => arena.resize_many_on_stream(targets, stream),
                None => arena.resize_many(targets),
            };
            match resized {
                Ok(_) => break,
                Err(Error::OutOfMemory(_)) if self.books.queued_units() > 0 => self.evict(arena, 1, discard),
                Err(e) => return Err(e),
            }
        }
        self.note_peaks(arena);
        Ok(())
    }

    fn grow_to(&mut self, arena: &Arena, id: Id, backed: u64, new_size: u64, discard: bool) -> Result<(), Error> {
        self.make_room(arena, new_size.saturating_sub(backed), discard);
        loop {
            // A take-over may shrink the entry it takes (to the admission's
            // size): on the stream, as every shrink of the cache.
            let resized = match self.stream {
                Some(stream) => arena.resize_on_stream(id, new_size, stream),
                None => arena.resize(id, new_size),
            };
            match resized {
                Ok(_) => return Ok(()),
                Err(Error::OutOfMemory(_)) if self.books.queued_units() > 0 => self.evict(arena, 1, discard),
                Err(e) => return Err(e),
            }
        }
    }

    /// A running request ends: its allocation becomes an entry shrunk to
    /// its cached units, or is freed.
    pub fn release(&mut self, arena: &Arena, id: Id, discard: bool) {
        let r = self.books.release(id);
        // An entry sees no more work through its own addresses (a hit maps
        // its chunks elsewhere): promised now, on the stream, so that what
        // an eviction later takes from it is known idle at once, without
        // waiting for an event recorded at the eviction.
        if let (Release::Keep(_), Some(stream)) = (r, self.stream) {
            self.quiesces += 1;
            let quiesced = arena.quiesce_on_stream(id, stream);
            self.note(quiesced);
        }
        self.apply(arena, id, r, discard);
    }

    /// Evicts cached units (oldest first) until `need` more bytes are free,
    /// if the queue holds enough; else evicts nothing (as vLLM checks its
    /// free blocks before it takes any) and lets the arena's call fail.
    fn make_room(&mut self, arena: &Arena, need: u64, discard: bool) {
        let Ok(s) = arena.stats() else { return };
        let free = s.capacity_bytes.saturating_sub(s.mapped_bytes);
        if need <= free {
            return;
        }
        let units = (need - free).div_ceil(self.unit_bytes);
        if units <= self.books.queued_units() {
            self.evict(arena, units, discard);
        }
    }

    /// Every entry keeps its request's reservation (sized for the model's
    /// context: address space, not memory). Where no free range can take a
    /// new reservation of `max` bytes, entries are given up, oldest units
    /// first, until one can: the arena would otherwise move allocations
    /// (driver calls) or fail for address space.
    fn make_va_room(&mut self, arena: &Arena, max: u64, discard: bool) {
        while let Ok(s) = arena.stats() {
            if s.largest_free_va_bytes >= max || self.books.entries() == 0 || self.books.queued_units() == 0 {
                return;
            }
            let entries = self.books.entries();
            while self.books.entries() == entries && self.books.queued_units() > 0 {
                self.evict(arena, 1, discard);
            }
            self.va_evictions += 1;
        }
    }

    fn evict(&mut self, arena: &Arena, units: u64, discard: bool) {
        for (id, r) in self.books.evict(units) {
            match r {
                Release::Keep(_) => self.evict_resizes += 1,
                Release::Free(_) => self.evict_frees += 1,
            }
            self.apply(arena, id, r, discard);
        }
    }

    /// Shrinks or frees an allocation as the books say. The dropped part
    /// is dead KV (no holder keeps it): its host pages may be discarded.
    fn apply(&mut self, arena: &Arena, id: Id, r: Release, discard_pages: bool) {
        let keep_units = match r {
            Release::Keep(n) | Release::Free(n) => n as u64,
        };
        if discard_pages {
            if let Ok(info) = arena.query(id) {
                let keep = keep_units * self.unit_bytes;
                if info.mapped_bytes > keep {
                    discard(info.ptr + keep, info.mapped_bytes - keep);
                }
            }
        }
        let done = match r {
            // On the stream, the dropped chunks become known idle once the
            // step's work has completed: taking them for another address
            // then needs no synchronize.
            Release::Keep(n) => match self.stream {
                Some(stream) => arena.resize_on_stream(id, n as u64 * self.unit_bytes, stream).map(|_| ()),
                None => arena.resize(id, n as u64 * self.unit_bytes).map(|_| ()),
            },
            Release::Free(_) => match self.stream {
                Some(stream) => arena.free_on_stream(id, stream),
                None => arena.free(id),
            },
        };
        self.note(done);
    }

    /// Counts a failed call on an entry (the arena is unchanged by it; the
    /// books go on as if it had succeeded).
    fn note(&mut self, r: Result<(), Error>) {
        if let Err(e) = r {
            self.errors += 1;
            self.last_error = Some(e.to_string());
        }
    }

    fn note_peaks(&mut self, arena: &Arena) {
        if let Ok(s) = arena.stats() {
            let cache_only = self.books.queued_units() * self.unit_bytes;
            self.peak_footprint = self.peak_footprint.max(s.mapped_bytes.saturating_sub(cache_only));
            self.peak_shared_bytes = self.peak_shared_bytes.max(s.shared_bytes);
        }
    }

    /// Facts for the JSON report.
    pub fn extra(&self, arena: &Arena) -> Vec<(String, String)> {
        let st = &self.books.stats;
        let mut v = vec![
            ("prefix_cache_unit_bytes".into(), self.unit_bytes.to_string()),
            ("prefix_hits".into(), st.hits.to_string()),
            ("prefix_hit_units".into(), st.hit_units.to_string()),
            ("evicted_prefix_units".into(), st.evicted_units.to_string()),
            ("cascade_evictions".into(), st.cascade_evictions.to_string()),
            ("source_mismatches".into(), st.source_mismatches.to_string()),
            ("uncached_after_gap".into(), st.uncached_after_gap.to_string()),
            ("prefix_entries_kept".into(), st.entries_kept.to_string()),
            ("prefix_duplicates_freed".into(), st.duplicates_freed.to_string()),
            ("prefix_entries_now".into(), self.books.entries().to_string()),
            ("peak_prefix_entries".into(), self.peak_entries.to_string()),
            ("va_evictions".into(), self.va_evictions.to_string()),
            ("take_overs".into(), self.take_overs.to_string()),
            ("early_evicted_units".into(), st.early_evicted_units.to_string()),
            ("take_over_failures".into(), self.take_over_failures.to_string()),
            ("take_over_reused_bytes".into(), self.reused_bytes.to_string()),
            ("cached_prefixes".into(), self.books.cached_prefixes().to_string()),
            ("cached_units_now".into(), self.books.cached_units().to_string()),
            ("evict_resizes".into(), self.evict_resizes.to_string()),
            ("evict_frees".into(), self.evict_frees.to_string()),
            ("quiesced_entries".into(), self.quiesces.to_string()),
            ("prefix_cache_errors".into(), self.errors.to_string()),
            // Physical bytes serving running requests (shared chunks once,
            // cached-only chunks left out), at its peak after an admission
            // or a growth.
            ("peak_footprint_bytes".into(), self.peak_footprint.to_string()),
            ("peak_shared_bytes".into(), self.peak_shared_bytes.to_string()),
            // Copies the cache made: none, as a hit is whole chunks.
            ("prefix_copied_bytes".into(), "0".into()),
        ];
        if let Some(e) = &self.last_error {
            v.push(("prefix_cache_last_error".into(), serde_json::to_string(e).unwrap_or_default()));
        }
        if let Ok(s) = arena.stats() {
            v.push(("shared_bytes_now".into(), s.shared_bytes.to_string()));
        }
        v
    }
}
