//! The vmm-arena managers: `arena` (stream-ordered frees and shrinks,
//! prefetch, batch growth, prepared admissions, the prefix cache),
//! `arena-staged` (the same, admissions mapped over several steps: an
//! experiment), `arena-no-moves` and `arena-sync` (driven as engines drove
//! it before).

use super::*;

mod phase_calls;
mod prefetch_sizing;
mod staged;
use phase_calls::{Phase, PhaseCalls};
use prefetch_sizing::{AdmissionRate, GrowthRate};
use staged::{StageStats, Staged, MAX_STAGE_WAIT};

/// vmm-arena: one growable allocation per KV tensor, reserved for the
/// model's context, grown a chunk at a time (as vAttention maps pages).
///
/// Two ways to drive it ([`ArenaMode`]): `Stream` (the `arena` rows) frees
/// on the engine's stream, keeps prefetch targets with `maintain` between
/// steps, prepares the next step's admissions between steps
/// (`prepare_admissions`, see `prepared.rs`), and grows the whole decode
/// batch with one `resize_many`; `Sync`
/// (the `arena-sync` row) is the arena as engines used it before: plain
/// free, no prefetch, one `resize` per allocation.
pub struct ArenaMgr {
    name: &'static str,
    arena: Arena,
    mode: ArenaMode,
    dev: Dev,
    shape: KvShape,
    chunk: u64,
    capacity: u64,
    seqs: Vec<Option<ArenaSeq>>,
    release_errors: u64,
    last_release_error: Option<String>,
    maintain_errors: u64,
    last_maintain_error: Option<String>,
    discard: bool,
    /// The prefix cache (`prefix_cache.rs`), where it is on and the layout
    /// allows it; with it, admission, growth and free go through it.
    prefix: Option<ArenaPrefixCache>,
    prefix_state: &'static str,
    /// `Stream` mode: the next step's first admissions, prepared between
    /// steps (`prepare_admissions`).
    prepared: PreparedAdmissions,
    /// Whether `Stream` mode prepares admissions (off only to compare).
    prepare: bool,
    /// Device synchronizes made by `release_retired` between steps.
    release_syncs: u64,
    /// Whether `Stream` mode maps admissions over several steps, within
    /// what each step's GPU time hides (see `prepare_admissions`).
    stage: bool,
    /// The admission being mapped so, if any.
    staged: Option<Staged>,
    stage_stats: StageStats,
    /// The queue's front that admission waits for, and for how many steps.
    front_wait: (usize, u64, u64),
    /// Chunked prefill: growths made between steps (`prepare_growth`), and
    /// those of them that failed.
    prepared_growth: (u64, u64),
    /// Chunked prefill: some of the next step's growth is not made yet
    /// (`prepare_growth` could not), so no admission is prepared.
    growth_pending: bool,
    /// The replay schedules chunked prefill (learnt from its token budget).
    chunked: bool,
    /// `Stream` mode: the prefetch targets asked for (`ArenaOptions`), and
    /// what sizes the chunks created ahead to the need (see
    /// [`ArenaMgr::size_precreate`]).
    base_prefetch: (u64, u64),
    growth: GrowthRate,
    /// `Stream` mode: recent admissions, which size the admission
    /// map-ahead windows (see [`ArenaMgr::size_admission_windows`]).
    admissions: AdmissionRate,
    /// Whether `Stream` mode keeps admission map-ahead windows.
    admission_windows: bool,
    /// Requests waiting for admission as the next step is prepared.
    waiting: usize,
    /// Whole prompts: growths made between steps by
    /// `prepare_decode_growth` (with no chunk mapped ahead, `--map-ahead 0`).
    prepared_decode_growths: u64,
    /// The driver calls of each engine action (see `phase_calls.rs`).
    phase_calls: PhaseCalls,
}

/// How the engine drives the arena (see [`ArenaMgr`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaMode {
    Stream,
    Sync,
}

/// The stream the engine's kernels run on (the model in `counted.rs` does
/// not tell streams apart: one engine, one stream).
pub const ENGINE_STREAM: u64 = 0;

struct ArenaSeq {
    ids: Vec<Id>,
    /// Tokens every allocation has room for.
    cap: u64,
    /// Chunked prefill with the prefix cache: the request, while full hash
    /// blocks of its prompt are still to be computed (and cached).
    uncached: Option<Request>,
}

/// The request, where its first `computed` tokens leave full hash blocks
/// of its prompt to be computed later (chunked prefill).
fn uncached_after(q: &Request, computed: u64) -> Option<Request> {
    (computed / HASH_BLOCK_TOKENS < q.full_hash_blocks()).then(|| q.clone())
}

/// The arena's virtual range for a KV workload: the arena's default (4 ×
/// capacity) or, if more, room for two full batches of reservations. An
/// engine sizes its range for its batch (address space costs no memory);
/// with less, the reservations of a full batch exhaust the range although
/// physical memory is free.
pub fn arena_reserve(shape: KvShape, capacity: u64, max_batch: usize) -> u64 {
    arena_reserve_for_chunk(shape, capacity, max_batch, 2 << 20)
}

/// [`arena_reserve`] for chunks of `chunk` bytes (super-pages: each
/// reservation rounds up to whole chunks).
pub fn arena_reserve_for_chunk(shape: KvShape, capacity: u64, max_batch: usize, chunk: u64) -> u64 {
    let chunk = chunk.max(1);
    let per_request = shape.n_allocs() * (shape.max_context * shape.bpt()).div_ceil(chunk) * chunk;
    (capacity / chunk * chunk).saturating_mul(4).max(2 * max_batch as u64 * per_request)
}

/// Options of the arena managers.
#[derive(Clone, Copy, Debug)]
pub struct ArenaOptions {
    pub capacity: u64,
    /// Virtual range (0: the arena's default, 4 × capacity).
    pub reserve: u64,
    /// Pooled bytes kept on free (`u64::MAX`: all).
    pub retain: u64,
    pub no_implicit_moves: bool,
    /// `Stream` mode's prefetch targets (`Arena::set_prefetch`): created,
    /// unmapped chunks kept pooled, and bytes kept mapped past each growable
    /// allocation's size.
    pub precreate_bytes: u64,
    pub map_ahead_bytes: u64,
    /// The arena's chunk size (0: the library's default, 2 MiB); larger
    /// ones are super-pages (`kv_serving --chunk-mib`).
    pub chunk_bytes: u64,
    /// `arena-paged`'s start-up pool: bytes mapped before the first
    /// request and kept pooled for blocks to adopt (`kv_serving
    /// --paged-warm`). Start-up work, not charged to a step, as vLLM's pool
    /// is built before serving; it is the arena's footprint while idle.
    pub paged_warm_bytes: u64,
}

impl ArenaOptions {
    /// `capacity` and `reserve`, with the defaults of `kv_serving` for the
    /// rest: retain everything, implicit moves on, prefetch of
    /// [`DEFAULT_PRECREATE`] and [`DEFAULT_MAP_AHEAD`].
    pub fn new(capacity: u64, reserve: u64) -> ArenaOptions {
        ArenaOptions {
            capacity,
            reserve,
            retain: u64::MAX,
            no_implicit_moves: false,
            precreate_bytes: DEFAULT_PRECREATE,
            map_ahead_bytes: DEFAULT_MAP_AHEAD,
            chunk_bytes: 0,
            paged_warm_bytes: 0,
        }
    }

    /// A counted device of `capacity` bytes and an arena over it, as these
    /// options say (the prefetch targets are the caller's to set).
    pub fn arena(&self) -> Result<(Arena, Dev), String> {
        let dev = new_device(self.capacity)?;
        let cfg = ArenaConfig {
            capacity_bytes: self.capacity,
            reserve_bytes: self.reserve,
            retain_bytes: self.retain,
            no_implicit_moves: self.no_implicit_moves,
            chunk_bytes: self.chunk_bytes,
            ..ArenaConfig::default()
        };
        let arena = Arena::with_driver(dev.clone(), cfg).map_err(|e| format!("arena: {e}"))?;
        Ok((arena, dev))
    }
}

/// Default prefetch targets of the `arena` rows: nothing mapped ahead of
/// the growing KV tensors (the next step's decode growth is made between
/// steps instead, sized to what that step needs: see
/// [`KvManager::prepare_decode_growth`]; a chunk mapped ahead of every
/// tensor costs a chunk of footprint per running request), and 4 chunks
/// created ahead for admissions.
pub const DEFAULT_MAP_AHEAD: u64 = 0;
pub const DEFAULT_PRECREATE: u64 = 8 << 20;

impl ArenaMgr {
    pub fn new(name: &'static str, shape: KvShape, o: ArenaOptions, mode: ArenaMode) -> Result<ArenaMgr, String> {
        let (arena, dev) = o.arena()?;
        if mode == ArenaMode::Stream {
            arena.set_prefetch(o.precreate_bytes, o.map_ahead_bytes).map_err(|e| format!("set_prefetch: {e}"))?;
        }
        let chunk = arena.chunk_bytes();
        Ok(ArenaMgr {
            name,
            arena,
            mode,
            dev,
            shape,
            chunk,
            capacity: o.capacity / chunk * chunk,
            seqs: Vec::new(),
            release_errors: 0,
            last_release_error: None,
            maintain_errors: 0,
            last_maintain_error: None,
            discard: false,
            prefix: None,
            prefix_state: "off",
            prepared: PreparedAdmissions::default(),
            prepare: true,
            release_syncs: 0,
            stage: false,
            staged: None,
            stage_stats: StageStats::default(),
            front_wait: (usize::MAX, 0, 0),
            prepared_growth: (0, 0),
            growth_pending: false,
            chunked: false,
            base_prefetch: (o.precreate_bytes, o.map_ahead_bytes),
            growth: GrowthRate::default(),
            admissions: AdmissionRate::default(),
            admission_windows: true,
            waiting: 0,
            prepared_decode_growths: 0,
            phase_calls: PhaseCalls::default(),
        })
    }

    /// Turns the prefix cache on (`--prefix-caching on`) where its unit (16
    /// tokens, or one chunk where a chunk holds more) is whole chunks of the
    /// one allocation per request and tiles a hash block (see
    /// `prefix_cache.rs` and [`ArenaPrefixCache::new`]).
    pub fn with_prefix_cache(mut self, on: bool) -> ArenaMgr {
        if !on {
            return self;
        }
        if !self.shape.layout.one_allocation() {
            self.prefix_state = "off: one allocation per request only";
            return self;
        }
        self.prefix = ArenaPrefixCache::new(self.chunk, self.shape.bpt());
        if let Some(p) = self.prefix.as_mut() {
            p.stream = (self.mode == ArenaMode::Stream).then_some(ENGINE_STREAM);
        }
        self.prefix_state = if self.prefix.is_some() {
            "on"
        } else {
            "off: no unit of 16 tokens or one chunk is whole chunks and tiles a hash block"
        };
        self
    }

    /// Turns the preparation of admissions between steps off (`Stream`
    /// mode; for comparisons: the outcomes must be the same).
    pub fn without_prepared_admissions(mut self) -> ArenaMgr {
        self.prepare = false;
        self
    }

    /// Turns admission map-ahead off (`Stream` mode; to compare).
    pub fn without_admission_windows(mut self) -> ArenaMgr {
        self.admission_windows = false;
        self
    }

    /// Turns the mapping of admissions over several steps on (`Stream`
    /// mode, the `arena-staged` row; see sim/DESIGN.md, "Staged admissions").
    /// Off, each admission is prepared whole in the step before it.
    pub fn with_staged_admissions(mut self) -> ArenaMgr {
        self.stage = true;
        self
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// The prefix cache, where it is on.
    pub fn prefix_cache(&self) -> Option<&ArenaPrefixCache> {
        self.prefix.as_ref()
    }

    pub fn device(&self) -> &Dev {
        &self.dev
    }

    /// Frees one allocation as the mode says.
    fn free_one(&self, id: Id) -> vmm_arena::Result<()> {
        match self.mode {
            ArenaMode::Stream => self.arena.free_on_stream(id, ENGINE_STREAM),
            ArenaMode::Sync => self.arena.free(id),
        }
    }

    fn bytes_for(&self, tokens: u64) -> u64 {
        (tokens * self.shape.bpt()).div_ceil(self.chunk).max(1) * self.chunk
    }

    /// Admission proper (see [`KvManager::admit`]).
    ///
    /// With chunked prefill `tokens` covers the hit and the first chunk
    /// only; later chunks come through [`KvManager::grow`].
    fn admit_now(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let size = self.bytes_for(tokens);
        let max = size.max(self.bytes_for(self.shape.max_context));
        if let Some(p) = self.prefix.as_mut() {
            let (id, hit) = p.admit(&self.arena, size, max, q, tokens, self.discard).map_err(|e| self.fail(e, size))?;
            self.admissions.record(size);
            let uncached = uncached_after(q, tokens);
            *slot_vec(&mut self.seqs, seq) = Some(ArenaSeq { ids: vec![id], cap: size / self.shape.bpt(), uncached });
            return Ok(hit);
        }
        let n = self.shape.n_allocs() as usize;
        let mut ids = Vec::with_capacity(n);
        for k in 0..n {
            let placed = match self.mode {
                // Ordered on the engine's stream: what this step freed there
                // serves it at once (no event wait, no synchronize).
                ArenaMode::Stream => self.arena.alloc_growable_on_stream(size, max, ENGINE_STREAM),
                ArenaMode::Sync => self.arena.alloc_growable(size, max),
            };
            match placed {
                Ok((id, _)) => ids.push(id),
                Err(e) => {
                    let f = self.fail(e, (n - k) as u64 * size);
                    // Never used by the GPU: freed as the mode frees (on
                    // the stream its pages become known idle).
                    for id in ids {
                        let _ = self.free_one(id);
                    }
                    return Err(f);
                }
            }
        }
        for _ in 0..n {
            self.admissions.record(size);
        }
        *slot_vec(&mut self.seqs, seq) = Some(ArenaSeq { ids, cap: size / self.shape.bpt(), uncached: None });
        Ok(0)
    }

    /// Gives back prepared admissions that were not admitted (never
    /// expected: the replay prepares exactly what it admits next), last
    /// first, as frees of requests that ran no step.
    fn give_back(&mut self, left: Vec<Prepared>) {
        for p in left.into_iter().rev() {
            if p.outcome.is_ok() {
                KvManager::free(self, p.seq);
            }
        }
    }

    /// Whether `bytes` more fit beside the live allocations, or nothing is
    /// pending. Memory freed on the stream serves an allocation on it at
    /// once, but one that does not fit even with it would wait for the
    /// frees' events (a drain) only to fail: it is left to the next step.
    fn fits_beside_live(&self, bytes: u64) -> bool {
        let Ok(s) = self.arena.stats() else { return false };
        s.pending_free_bytes == 0 || s.mapped_bytes + bytes <= s.capacity_bytes
    }

    /// The growths of `grows` that need more chunks than their requests
    /// have, and the bytes those chunks add.
    fn growth_needing_chunks(&self, grows: &[(usize, u64, u64)]) -> (Vec<(usize, u64, u64)>, u64) {
        let mut batch = Vec::new();
        let mut more = 0;
        for &(seq, tokens, stored) in grows {
            let s = self.seqs[seq].as_ref().expect("live sequence");
            let bytes = s.ids.len() as u64 * self.bytes_for(tokens).saturating_sub(self.bytes_for(s.cap));
            if bytes > 0 {
                batch.push((seq, tokens, stored));
                more += bytes;
            }
        }
        (batch, more)
    }

    /// One growth (see [`KvManager::grow`]).
    fn grow_once(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
        let s = self.seqs[seq].as_ref().expect("live sequence");
        if tokens <= s.cap {
            return Ok(());
        }
        let new_size = self.bytes_for(tokens);
        let old_size = self.bytes_for(s.cap);
        let ids = s.ids.clone();
        if let Some(p) = self.prefix.as_mut() {
            p.grow(&self.arena, ids[0], old_size, new_size, self.discard)
                .map_err(|e| self.fail(e, new_size - old_size))?;
            self.seqs[seq].as_mut().expect("live").cap = new_size / self.shape.bpt();
            return Ok(());
        }
        for (k, &id) in ids.iter().enumerate() {
            let resized = match self.mode {
                ArenaMode::Stream => self.arena.resize_on_stream(id, new_size, ENGINE_STREAM),
                ArenaMode::Sync => self.arena.resize(id, new_size),
            };
            if let Err(e) = resized {
                return Err(self.fail(e, (ids.len() - k) as u64 * (new_size - old_size)));
            }
        }
        self.seqs[seq].as_mut().expect("live").cap = new_size / self.shape.bpt();
        Ok(())
    }

    /// One batch growth (see [`KvManager::grow_batch`]).
    fn grow_batch_once(&mut self, grows: &[(usize, u64, u64)]) -> Result<(), Fail> {
        if self.mode == ArenaMode::Sync {
            return Ok(());
        }
        let mut targets: Vec<(Id, u64)> = Vec::new();
        let mut grown: Vec<(usize, u64)> = Vec::new();
        let (mut old_total, mut new_total) = (0u64, 0u64);
        for &(seq, tokens, _) in grows {
            let s = self.seqs[seq].as_ref().expect("live sequence");
            if tokens <= s.cap {
                continue;
            }
            let new_size = self.bytes_for(tokens);
            old_total += s.ids.len() as u64 * self.bytes_for(s.cap);
            new_total += s.ids.len() as u64 * new_size;
            targets.extend(s.ids.iter().map(|&id| (id, new_size)));
            grown.push((seq, new_size / self.shape.bpt()));
        }
        if targets.is_empty() {
            return Ok(());
        }
        match self.prefix.as_mut() {
            // The cache gives up what the batch needs first.
            Some(p) => p.resize_many(&self.arena, &targets, new_total - old_total, self.discard),
            None => self.arena.resize_many_on_stream(&targets, ENGINE_STREAM).map(|_| ()),
        }
        .map_err(|e| self.fail(e, new_total - old_total))?;
        for (seq, cap) in grown {
            self.seqs[seq].as_mut().expect("live").cap = cap;
        }
        Ok(())
    }

    /// Chunked prefill: request `seq` computes up to `tokens` tokens in
    /// the next (or this) step: the full hash blocks among them are cached.
    fn cache_chunk(&mut self, seq: usize, tokens: u64) {
        let s = self.seqs[seq].as_mut().expect("live");
        if let (Some(q), Some(p)) = (s.uncached.as_ref(), self.prefix.as_mut()) {
            if p.cache_computed(s.ids[0], q, tokens) {
                s.uncached = None;
            }
        }
    }

    /// Shared live bytes counting prepared admissions as running.
    fn shared_live_bytes_all(&self) -> u64 {
        self.prefix.as_ref().map_or(0, |p| p.shared_live_bytes())
    }

    fn fail(&self, e: Error, needed: u64) -> Fail {
        let mapped = self.arena.stats().map(|s| s.mapped_bytes).unwrap_or(0);
        let message = e.to_string();
        let host_limit = is_host_limit(&e);
        let fragmentation = !host_limit
            && match e {
                Error::OutOfAddressSpace(_) => true,
                _ => self.capacity.saturating_sub(mapped) >= needed,
            };
        Fail { fragmentation, host_limit, message }
    }
}

/// The bodies of the `KvManager` calls whose driver calls are counted by
/// engine action (see `phase_calls.rs`).
impl ArenaMgr {
    fn grow_counted(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        match self.grow_once(seq, tokens, stored) {
            // A running request comes before one not admitted yet: the
            // staged admission gives its memory up, and growth tries again.
            Err(_) if self.staged.is_some() => {
                self.stage_give_up(true);
                self.grow_once(seq, tokens, stored)
            }
            r => r,
        }?;
        self.cache_chunk(seq, tokens);
        Ok(())
    }

    fn prepare_growth_counted(&mut self, grows: &[(usize, u64, u64)], _budget: &StepBudget<'_>) {
        self.growth_pending = false;
        self.chunked = true;
        if self.mode == ArenaMode::Sync || !self.prepare {
            return;
        }
        let (batch, more) = self.growth_needing_chunks(grows);
        if !batch.is_empty() {
            // As for prepared admissions: memory freed on the stream in this
            // step serves the growth at once (same stream), but growth that
            // cannot fit even so is left to the next step.
            if !self.fits_beside_live(more) {
                self.growth_pending = true;
                return;
            }
            self.prepared_growth.0 += batch.len() as u64;
            if self.grow_batch_once(&batch).is_err() {
                // Unchanged (all or nothing): the next step's growth tries
                // again, and preempts where it must.
                self.prepared_growth.1 += batch.len() as u64;
                self.growth_pending = true;
                return;
            }
        }
        // The next step's growth is made, and it cannot fail now: the hash
        // blocks its chunks compute are cached now, as the next step's
        // admission will find them (its `grow` calls find this done).
        for &(seq, tokens, _) in grows {
            self.cache_chunk(seq, tokens);
        }
    }

    fn prepare_decode_growth_counted(&mut self, grows: &[(usize, u64, u64)]) {
        // With a chunk mapped ahead of each tensor, growth adopts it instead.
        let mapping_ahead = self.base_prefetch.1 > 0;
        if self.mode == ArenaMode::Sync || !self.prepare || mapping_ahead || self.staged.is_some() {
            return;
        }
        let (batch, more) = self.growth_needing_chunks(grows);
        if batch.is_empty() {
            return;
        }
        // The next step admits before it grows: made now, the growth must
        // leave what those admissions may take (the prepared ones hold
        // theirs already; a request arriving meanwhile may be as large as
        // the largest admitted lately) and evict nothing from the prefix
        // cache. Otherwise the step grows as before.
        let Ok(st) = self.arena.stats() else { return };
        let room_for_admission = self.admissions.recent.iter().copied().max().unwrap_or(0);
        let held = st.mapped_bytes + st.pending_free_bytes;
        if held + more + room_for_admission > st.capacity_bytes {
            return;
        }
        if self.grow_batch_once(&batch).is_ok() {
            self.prepared_decode_growths += batch.len() as u64;
        }
    }

    fn grow_batch_counted(&mut self, grows: &[(usize, u64, u64)]) -> Result<(), Fail> {
        match self.grow_batch_once(grows) {
            Err(_) if self.staged.is_some() => {
                self.stage_give_up(true);
                self.grow_batch_once(grows)
            }
            r => r,
        }
    }

    fn free_counted(&mut self, seq: usize) {
        if let Some(s) = self.seqs[seq].take() {
            if let Some(p) = self.prefix.as_mut() {
                p.release(&self.arena, s.ids[0], self.discard);
                return;
            }
            for id in s.ids {
                if self.discard {
                    if let Ok(q) = self.arena.query(id) {
                        discard(q.ptr, q.mapped_bytes);
                    }
                }
                self.free_one(id).expect("free of a live allocation");
            }
        }
    }
}

impl KvManager for ArenaMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        match self.prepared.take(seq, tokens) {
            Take::Ready(outcome) => return outcome,
            Take::NotPrepared => {}
            Take::Stale(left) => self.give_back(left),
        }
        if self.staged.as_ref().is_some_and(|s| (s.seq, s.tokens) == (seq, tokens)) {
            // Nothing runs (the replay admits without asking then), or it
            // waited long enough (`admission_ready`): the
            // rest of its mapping is done now, on the critical path.
            let size = self.staged.as_ref().expect("staged").size;
            if let Err(f) = self.stage_grow(size) {
                self.stage_give_up(false);
                return Err(f);
            }
            self.stage_stats.finished_critical += 1;
            return self.stage_finish(q).1;
        }
        self.stage_give_up(false);
        self.in_phase(Phase::Admit, |m| m.admit_now(seq, tokens, q))
    }

    fn admission_ready(&mut self, seq: usize, tokens: u64) -> bool {
        if !self.staging() || self.prepared.front_is(seq, tokens) {
            return true;
        }
        // Waiting holds up the whole queue behind it: after a few steps
        // the rest is mapped on the critical path instead.
        let (s, t, n) = self.front_wait;
        let n = if (s, t) == (seq, tokens) { n + 1 } else { 1 };
        self.front_wait = (seq, tokens, n);
        n > MAX_STAGE_WAIT
    }

    fn prepare_admissions(&mut self, front: &[(usize, u64, &Request)], budget: &StepBudget<'_>) {
        if self.mode == ArenaMode::Sync || !self.prepare {
            return; // `arena-sync`: admission as before, on the critical path
        }
        let left = self.prepared.drain();
        self.give_back(left);
        if budget.tokens_left != u64::MAX && !self.chunked {
            // Chunked prefill: no staging from now on.
            self.chunked = true;
            self.stage_give_up(false);
        }
        if std::mem::take(&mut self.growth_pending) {
            // Chunked prefill: the next step grows a running request before
            // it admits, and that growth was not done now: an admission
            // prepared now could take its memory.
            self.prepared.deferred += 1;
            return;
        }
        // The tokens each admission asks for, worked out as the replay
        // will, request after request (a hit may follow from the one
        // prepared before).
        let mut tokens_left = Budget(budget.tokens_left);
        if self.staging() {
            let mut sized = Vec::new();
            for &(seq, total, q) in front {
                let Some((tokens, _)) = admission_tokens(total, || self.prefix_hit(seq, q), &mut tokens_left) else {
                    break;
                };
                sized.push((seq, tokens, q));
            }
            self.prepare_staged(&sized, budget);
            return;
        }
        for &(seq, total, q) in front {
            let Some((tokens, _)) = admission_tokens(total, || self.prefix_hit(seq, q), &mut tokens_left) else {
                break;
            };
            // Memory freed on the stream in this step serves it at once:
            // the admission's work is ordered on the same stream
            // (`Arena::alloc_on_stream`), so nothing waits for the step's
            // event. One that cannot fit even so is left to the next step.
            if !self.fits_beside_live(self.bytes_for(tokens)) {
                self.prepared.deferred += 1;
                break;
            }
            let shared_before = self.shared_live_bytes_all();
            let outcome = self.in_phase(Phase::PreparedAdmit, |m| m.admit_now(seq, tokens, q));
            let shared_bytes = self.shared_live_bytes_all().saturating_sub(shared_before);
            let failed = outcome.is_err();
            self.prepared.push(Prepared { seq, tokens, outcome, shared_bytes });
            if failed {
                break; // admission stops at the first failure
            }
        }
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        self.in_phase(Phase::Grow, |m| m.grow_counted(seq, tokens, stored))
    }

    fn prefix_hit(&mut self, seq: usize, q: &Request) -> u64 {
        if let Some(hit) = self.prepared.hit_of(seq) {
            return hit;
        }
        if let Some(s) = self.staged.as_ref().filter(|s| s.seq == seq) {
            return s.hit;
        }
        self.prefix.as_ref().map_or(0, |p| p.hit_tokens(q))
    }

    fn prepare_growth(&mut self, grows: &[(usize, u64, u64)], budget: &StepBudget<'_>) {
        self.in_phase(Phase::PreparedGrow, |m| m.prepare_growth_counted(grows, budget))
    }

    fn prepare_decode_growth(&mut self, grows: &[(usize, u64, u64)]) {
        self.in_phase(Phase::PreparedGrow, |m| m.prepare_decode_growth_counted(grows))
    }

    fn grow_batch(&mut self, grows: &[(usize, u64, u64)]) -> Result<(), Fail> {
        self.in_phase(Phase::Grow, |m| m.grow_batch_counted(grows))
    }

    fn free(&mut self, seq: usize) {
        self.in_phase(Phase::Free, |m| m.free_counted(seq))
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let (a, off) = self.shape.slot(t);
        let id = self.seqs[seq].as_ref().expect("live").ids[a];
        self.arena.write(id, off, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let (a, off) = self.shape.slot(t);
        let id = self.seqs[seq].as_ref().expect("live").ids[a];
        let mut b = [0u8; 8];
        self.arena.read(id, off, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn counting_device(&self) -> Option<&Dev> {
        Some(&self.dev)
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        self.arena.stats().map(|s| s.moves).unwrap_or(0)
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }

    fn waiting_requests(&mut self, n: usize) {
        self.waiting = n;
    }

    fn between_steps(&mut self) {
        self.in_phase(Phase::Upkeep, |m| m.upkeep())
    }

    fn extra(&self) -> Vec<(String, String)> {
        let mut v = self.extra_arena();
        v.push(("arena_calls_by_phase".into(), self.phase_calls.json()));
        v
    }

    fn shared_live_bytes(&self) -> u64 {
        // Prepared and staged admissions are not running yet.
        let staged = self.staged.as_ref().map_or(0, |s| s.shared_bytes);
        self.shared_live_bytes_all() - self.prepared.shared_bytes() - staged
    }
}

impl ArenaMgr {
    /// Between steps: retired ranges released, prefetch targets kept.
    fn upkeep(&mut self) {
        // `prepare_growth`'s word is for this step's `prepare_admissions`
        // only (the next step may have no running request to grow).
        self.growth_pending = false;
        // Old ranges of moved allocations stay mapped (and valid for kernels
        // still using them) until released; between steps nothing uses them.
        let syncs_before = self.dev.calls().synchronize;
        let released = self.arena.release_retired();
        self.release_syncs += self.dev.calls().synchronize - syncs_before;
        if let Err(e) = released {
            self.release_errors += 1;
            self.last_release_error = Some(e.to_string());
        }
        // While the GPU computes: bring the prefetch targets back.
        if self.mode == ArenaMode::Stream {
            self.size_precreate();
            if self.admission_windows {
                self.size_admission_windows();
            }
            if let Err(e) = self.arena.maintain() {
                self.maintain_errors += 1;
                self.last_maintain_error = Some(e.to_string());
            }
        }
    }

    fn extra_arena(&self) -> Vec<(String, String)> {
        let Ok(s) = self.arena.stats() else { return Vec::new() };
        let mut v: Vec<(String, String)> = vec![
            ("arena_peak_physical_bytes".into(), s.peak_physical_bytes.to_string()),
            ("arena_driver_creates".into(), s.driver_creates.to_string()),
            ("arena_driver_maps".into(), s.driver_maps.to_string()),
            ("arena_driver_unmaps".into(), s.driver_unmaps.to_string()),
            ("reserved_va_bytes".into(), s.reserved_va_bytes.to_string()),
            ("chunk_bytes".into(), s.chunk_bytes.to_string()),
            ("driver_syncs".into(), s.driver_syncs.to_string()),
            ("release_retired_errors".into(), self.release_errors.to_string()),
            ("maintain_errors".into(), self.maintain_errors.to_string()),
            ("prepared_admissions".into(), self.prepared.prepared.to_string()),
            ("prepared_admission_failures".into(), self.prepared.failed.to_string()),
            ("prepared_admissions_used".into(), self.prepared.used.to_string()),
            ("prepared_admissions_stale".into(), self.prepared.stale.to_string()),
            ("prepared_admissions_deferred".into(), self.prepared.deferred.to_string()),
            ("staged_admissions".into(), self.stage_stats.begun.to_string()),
            ("staged_admission_waits".into(), self.stage_stats.waits.to_string()),
            ("staged_admissions_given_up".into(), self.stage_stats.given_up.to_string()),
            ("staged_admissions_finished_critical".into(), self.stage_stats.finished_critical.to_string()),
            ("staging_short_of_idle_chunks".into(), self.stage_stats.short_of_idle.to_string()),
            ("staging".into(), self.staging().to_string()),
            ("prepared_growths".into(), self.prepared_growth.0.to_string()),
            ("prepared_decode_growths".into(), self.prepared_decode_growths.to_string()),
            ("prepared_growth_failures".into(), self.prepared_growth.1.to_string()),
            ("release_retired_syncs".into(), self.release_syncs.to_string()),
            ("arena_caller_driver_calls".into(), s.caller_driver_calls.to_string()),
            ("arena_caller_creates".into(), s.caller_creates.to_string()),
            ("arena_caller_syncs".into(), s.caller_syncs.to_string()),
            ("arena_maintain_driver_calls".into(), s.maintain_driver_calls.to_string()),
            ("arena_maintain_failures".into(), s.maintain_failures.to_string()),
            ("arena_stream_frees".into(), s.stream_frees.to_string()),
            ("arena_event_polls".into(), s.event_polls.to_string()),
            ("arena_event_waits".into(), s.event_waits.to_string()),
            ("arena_pending_free_bytes".into(), s.pending_free_bytes.to_string()),
            ("arena_prefetched_bytes".into(), s.prefetched_bytes.to_string()),
            ("admission_windows".into(), self.admission_windows.to_string()),
            ("admission_window_target".into(), format!("[{}, {}]", self.admissions.target.0, self.admissions.target.1)),
            ("arena_final_pooled_bytes".into(), s.pooled_bytes.to_string()),
            ("arena_final_cached_mapped_bytes".into(), s.cached_mapped_bytes.to_string()),
            ("arena_mode".into(), format!("{:?}", format!("{:?}", self.mode).to_lowercase())),
            ("arena_prefix_caching".into(), serde_json::to_string(self.prefix_state).unwrap_or_default()),
        ];
        if let Some(p) = &self.prefix {
            v.extend(p.extra(&self.arena));
        }
        v
    }
}
