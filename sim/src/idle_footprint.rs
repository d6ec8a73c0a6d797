//! The memory an idle serving instance still holds under prefix caching, in
//! kvcached's setting (`benchmarks/bench_idle_footprint`): its workload
//! shape (hot prefixes revisited, a long cold tail, staggered decode
//! lengths), Qwen3-4B's geometry, a prefix cache capped at 16,000 tokens
//! (1,000 blocks of 16). Two engines run the same requests through the same
//! scheduler:
//!
//! - `kvcached`: the model of `managers/kvcached.rs` and
//!   `managers/kvcached_pool.rs` (cross-checked against kvcached's code):
//!   blocks carved out of 2 MiB pages mapped in every KV buffer, the cache
//!   capped with page-aware eviction, memory back a page at a time;
//! - `arena`: one vmm-arena allocation per request (the token-major
//!   layout: all layers of a token together, 144 KiB a token for
//!   Qwen3-4B), holding the blocks the request computed; a hit uses the
//!   blocks of the request that computed them (mapped, not copied). When a
//!   request ends its allocation is shrunk to the blocks still cached, and
//!   an evicted block shrinks its allocation (eviction is vLLM's LRU, which
//!   takes a request's blocks tail first), so memory comes back to the
//!   chunk (2 MiB), not the page of 72 buffers. Driven as `kv_serving`'s
//!   arena row: each allocation growable, reserved for the workload's
//!   longest request and grown in place (no moves); shrinks and frees
//!   ordered on the engine's stream; between steps, retired ranges
//!   released and the prefetch target brought back (`maintain`); freed
//!   chunks kept pooled up to a watermark sized from the workload
//!   ([`IdleConfig::auto_arena_retain`]: the KV one step admits at most).
//!
//! Time: each step is priced by the step-time model (`timing.rs`, the
//! profile given Qwen3-4B's shape: [`IdleConfig::profile`]) and its driver
//! calls charged by the rule every replay shares (`step_charge.rs`, an
//! engine scheduling asynchronously); the report gives each engine's
//! driver time charged, on the engine's thread and in all (kvcached's
//! pre-allocation thread included).
//!
//! The scheduler is vLLM's continuous batching reduced to what places
//! blocks: a closed loop of `concurrency` clients (as `workload.py`'s
//! semaphore); each step decodes every running request one token (running
//! order), then admits waiting requests whole while the step's token
//! budget lasts (the first always), then frees the requests that finished.
//! A request of `output` tokens gets its first token from its prefill and
//! decodes `output - 1` steps. Every full block is cached (prompt and
//! decoded), as vLLM V1 does. Requests are drawn with this crate's RNG in
//! `workload.py`'s distributions, not Python's sequence for seed 1234.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use vmm_arena::{Arena, ArenaConfig, Id};

use crate::attention::AttnLayout;
use crate::counted::Calls;
use crate::managers::kvcached::{BlockManager, SharedHbm};
use crate::managers::kvcached_pool::{ElasticBlockPool, KvcachedPool, KVCACHED_BLOCK_TOKENS};
use crate::managers::{new_device, Dev, Layout, DEFAULT_PRECREATE, ENGINE_STREAM};
use crate::step_charge::{attn_layout, AsyncEngine, DriverTally};
use crate::timing::{Profile, StepWork};
use crate::util::{mix64, Rng};

/// The workload and the model (kvcached's defaults in [`IdleConfig::default`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct IdleConfig {
    pub requests: usize,
    pub concurrency: usize,
    pub hot_prefixes: usize,
    pub hot_tokens: u64,
    pub suffix_tokens: u64,
    pub cold_tokens_min: u64,
    pub cold_tokens_max: u64,
    pub hot_ratio: f64,
    pub max_tokens_min: u64,
    pub max_tokens_max: u64,
    pub seed: u64,
    /// Qwen3-4B: 36 layers, 8 KV heads of 128, BF16.
    pub layers: u64,
    pub kv_bytes_per_token_per_buffer: u64,
    /// Blocks of the pool (vLLM's `num_gpu_blocks`).
    pub num_blocks: u64,
    /// `KVCACHED_MAX_CACHED_TOKENS`.
    pub max_cached_tokens: u64,
    /// Tokens a step may compute (vLLM's `max_num_batched_tokens`).
    pub step_tokens: u64,
    /// The arena's retain watermark, bytes (`None`:
    /// [`IdleConfig::auto_arena_retain`]).
    pub arena_retain: Option<u64>,
}

impl Default for IdleConfig {
    fn default() -> IdleConfig {
        IdleConfig {
            requests: 2500,
            concurrency: 96,
            hot_prefixes: 16,
            hot_tokens: 128,
            suffix_tokens: 64,
            cold_tokens_min: 192,
            cold_tokens_max: 1024,
            hot_ratio: 0.3,
            max_tokens_min: 16,
            max_tokens_max: 256,
            seed: 1234,
            layers: 36,
            kv_bytes_per_token_per_buffer: 8 * 128 * 2,
            num_blocks: 14_000,
            max_cached_tokens: 16_000,
            step_tokens: 8192,
            arena_retain: None,
        }
    }
}

impl IdleConfig {
    /// Bytes of one block in one KV buffer (kvcached's `block_mem_size`).
    pub fn block_buffer_bytes(&self) -> u64 {
        KVCACHED_BLOCK_TOKENS * self.kv_bytes_per_token_per_buffer
    }

    /// Bytes of one block in all buffers (2 × layers).
    pub fn block_bytes(&self) -> u64 {
        2 * self.layers * self.block_buffer_bytes()
    }

    pub fn max_cached_blocks(&self) -> u64 {
        self.max_cached_tokens / KVCACHED_BLOCK_TOKENS
    }

    /// KV bytes of one token, every buffer.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers * self.kv_bytes_per_token_per_buffer
    }

    /// The longest request the workload draws, tokens (prompt and output).
    pub fn max_request_tokens(&self) -> u64 {
        self.cold_tokens_max.max(self.hot_tokens + self.suffix_tokens) + self.max_tokens_max
    }

    /// The arena's watermark sized from the workload: the KV one step
    /// admits at most (its token budget), whole 2 MiB chunks, so a step's
    /// admissions reuse what earlier steps freed instead of creating.
    pub fn auto_arena_retain(&self) -> u64 {
        (self.step_tokens * self.kv_bytes_per_token()).div_ceil(2 << 20) * (2 << 20)
    }

    pub fn arena_retain_bytes(&self) -> u64 {
        self.arena_retain.unwrap_or_else(|| self.auto_arena_retain())
    }

    /// `base` with Qwen3-4B's shape (Qwen/Qwen3-4B config.json: 36 layers,
    /// 32 query heads, 8 KV heads of 128; 4.0 B parameters, BF16).
    pub fn profile(&self, base: &Profile) -> Profile {
        let mut p = base.clone();
        p.params = 4.0e9;
        p.layers = self.layers as u32;
        p.heads = 32;
        p.kv_heads = 8;
        p.head_dim = 128;
        p.sources.insert("params".into(), "Qwen/Qwen3-4B: 4.0 B parameters (idle_footprint)".into());
        p
    }
}

/// A request: prompt and output tokens, and the hash of each of its blocks.
#[derive(Clone, Debug)]
pub struct IdleRequest {
    pub prompt: u64,
    pub output: u64,
    pub hot: bool,
    pub hashes: Arc<[u64]>,
}

/// `workload.py`'s `build_requests`: hot prefixes introduced gradually (so
/// they are first computed far apart), a hot request being a hot prefix
/// and a fresh suffix, a cold one fresh tokens of a uniform length.
pub fn build_requests(c: &IdleConfig) -> Vec<IdleRequest> {
    let mut rng = Rng::new(c.seed);
    let uniform = |lo: u64, hi: u64, r: &mut Rng| lo + r.next_u64() % (hi - lo + 1);
    let hot_blocks = c.hot_tokens / KVCACHED_BLOCK_TOKENS;
    (0..c.requests)
        .map(|i| {
            let introduced =
                c.hot_prefixes.min(1 + (c.hot_prefixes as f64 * (i as f64 / (c.requests.max(2) - 1) as f64)) as usize);
            let hot = rng.f64() < c.hot_ratio;
            let (prompt, prefix) = if hot {
                (c.hot_tokens + c.suffix_tokens, Some((rng.next_u64() % introduced as u64) + 1))
            } else {
                (uniform(c.cold_tokens_min, c.cold_tokens_max, &mut rng), None)
            };
            let output = uniform(c.max_tokens_min, c.max_tokens_max, &mut rng);
            let blocks = (prompt + output).div_ceil(KVCACHED_BLOCK_TOKENS);
            let hashes = (0..blocks)
                .map(|j| match prefix {
                    Some(p) if j < hot_blocks => mix64(p << 32 | j),
                    _ => mix64((c.seed << 40) ^ ((i as u64 + 1) << 20) ^ j ^ (1 << 62)),
                })
                .collect();
            IdleRequest { prompt, output, hot, hashes }
        })
        .collect()
}

/// What the scheduler needs of an engine.
pub trait IdleEngine {
    /// Admits request `id` whole; the hit tokens, or `None` (no room).
    fn admit(&mut self, id: u64, q: &IdleRequest) -> Option<u64>;
    /// Room for `tokens` tokens of request `id`; false if none.
    fn decode(&mut self, id: u64, tokens: u64) -> bool;
    fn finish(&mut self, id: u64);
    /// Physical bytes held: (by live data and cached blocks, in total
    /// with pre-mapped or pooled memory).
    fn held(&self) -> (u64, u64);
    /// Gives back pre-mapped or pooled memory (kvcached's `trim`).
    fn trim(&mut self);
    /// Cached blocks nobody uses.
    fn cached_idle_blocks(&self) -> u64;
    /// Driver calls so far on the engine's thread, and on other threads.
    fn caller_calls(&self) -> Calls;
    fn background_calls(&self) -> Calls {
        Calls::default()
    }
    /// Work between steps, while the GPU computes.
    fn between_steps(&mut self) {}
    /// The GPU finished a step.
    fn gpu_finished_step(&mut self) {}
    /// The KV layout attention kernels read.
    fn attn_layout(&self) -> AttnLayout;
}

/// The run's outcome for one engine.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct IdleReport {
    pub engine: String,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    pub peak_held_bytes: u64,
    /// Once idle: bytes holding cached blocks; all bytes held; after trim.
    pub idle_used_bytes: u64,
    pub idle_held_bytes: u64,
    pub idle_after_trim_bytes: u64,
    pub idle_cached_blocks: u64,
    /// The steps' simulated time, and the driver time by the shared rule.
    pub makespan_s: f64,
    pub driver: DriverTally,
    pub extra: Vec<(String, u64)>,
}

/// Runs the requests through `engine`; errors if a request can never run.
pub fn run(
    c: &IdleConfig,
    reqs: &[IdleRequest],
    engine: &mut dyn IdleEngine,
    name: &str,
    profile: &Profile,
) -> Result<IdleReport, String> {
    let mut r = IdleReport { engine: name.into(), ..IdleReport::default() };
    let mut profile = c.profile(profile);
    profile.attn_layout = engine.attn_layout();
    let kvpt = c.kv_bytes_per_token();
    let mut clock = AsyncEngine::default();
    let mut waiting: VecDeque<usize> = (0..reqs.len()).collect();
    // Running: (request, decode steps done).
    let mut running: Vec<(usize, u64)> = Vec::new();
    while !waiting.is_empty() || !running.is_empty() {
        r.steps += 1;
        let calls_before = engine.caller_calls();
        let mut work = StepWork::default();
        let mut budget = c.step_tokens;
        let mut admitted = 0;
        for (i, done) in running.iter_mut() {
            *done += 1;
            let q = &reqs[*i];
            let context = q.prompt + *done - 1;
            if !engine.decode(*i as u64, q.prompt + *done) {
                return Err(format!("request {i} found no block to decode into (pool too small)"));
            }
            work.add_decode(context, context * kvpt);
            budget = budget.saturating_sub(1);
        }
        while running.len() < c.concurrency {
            let Some(&i) = waiting.front() else { break };
            let q = &reqs[i];
            if q.prompt > budget && admitted > 0 {
                break;
            }
            match engine.admit(i as u64, q) {
                Some(hit) => {
                    waiting.pop_front();
                    r.hit_tokens += hit;
                    r.prompt_tokens += q.prompt;
                    budget = budget.saturating_sub(q.prompt - hit);
                    work.add_prefill(hit, q.prompt);
                    running.push((i, 0));
                    admitted += 1;
                }
                None if running.is_empty() => return Err(format!("request {i} does not fit an empty pool")),
                None => break,
            }
        }
        let schedule = engine.caller_calls().since(&calls_before);
        let st = clock.charge(&profile, &mut work, &schedule, &mut r.driver);
        r.makespan_s += st.total_s;
        engine.gpu_finished_step();
        // After the step: its finished requests freed, then the engine's
        // between-steps work (the next step's between-steps calls).
        let (after, background) = (engine.caller_calls(), engine.background_calls());
        running.retain(|&(i, done)| {
            let over = done + 1 >= reqs[i].output;
            if over {
                engine.finish(i as u64);
            }
            !over
        });
        engine.between_steps();
        clock.after_step(&engine.caller_calls().since(&after));
        r.driver.add_background(&profile, &engine.background_calls().since(&background));
        r.peak_held_bytes = r.peak_held_bytes.max(engine.held().1);
    }
    // Idle: the last step has run, so its stream-ordered frees complete;
    // what the engine does now waits for nothing.
    engine.gpu_finished_step();
    let after = engine.caller_calls();
    engine.between_steps();
    clock.after_step(&engine.caller_calls().since(&after));
    clock.went_idle(&profile, &mut r.driver);
    (r.idle_used_bytes, r.idle_held_bytes) = engine.held();
    r.idle_cached_blocks = engine.cached_idle_blocks();
    engine.trim();
    r.idle_after_trim_bytes = engine.held().1;
    Ok(r)
}

/// kvcached (vLLM integration) as an [`IdleEngine`].
pub struct KvcachedEngine {
    pub pool: KvcachedPool,
}

impl KvcachedEngine {
    pub fn new(c: &IdleConfig) -> Result<KvcachedEngine, String> {
        let mut mgr = BlockManager::new(c.num_blocks, c.block_buffer_bytes(), c.layers, SharedHbm::unlimited())?;
        mgr.page_allocator.set_engine_threads(true);
        let pool = ElasticBlockPool::new(mgr, c.num_blocks, true, c.max_cached_blocks() as i64);
        Ok(KvcachedEngine { pool: KvcachedPool::new(pool) })
    }
}

impl IdleEngine for KvcachedEngine {
    fn admit(&mut self, id: u64, q: &IdleRequest) -> Option<u64> {
        self.pool.admit(id, q.hashes.clone(), q.prompt)
    }
    fn decode(&mut self, id: u64, tokens: u64) -> bool {
        self.pool.decode(id, tokens)
    }
    fn finish(&mut self, id: u64) {
        self.pool.finish(id)
    }
    fn held(&self) -> (u64, u64) {
        (self.pool.pool.mgr.inuse_bytes(), self.pool.pool.mgr.mapped_bytes())
    }
    fn trim(&mut self) {
        self.pool.pool.mgr.trim()
    }
    fn cached_idle_blocks(&self) -> u64 {
        self.pool.pool.num_evictable()
    }
    fn caller_calls(&self) -> Calls {
        self.pool.pool.mgr.page_allocator.foreground_calls()
    }
    fn background_calls(&self) -> Calls {
        self.pool.pool.mgr.page_allocator.background_calls()
    }
    fn between_steps(&mut self) {
        self.pool.pool.mgr.page_allocator.run_prealloc_thread();
    }
    fn attn_layout(&self) -> AttnLayout {
        attn_layout("kvcached", Layout::TokenMajor)
    }
}

/// A request's allocation in the arena: its blocks from `first` on (the
/// ones before are its hit, held by the requests that computed them).
struct Entry {
    id: Id,
    first: u64,
    /// Blocks the allocation is sized for.
    blocks: u64,
    /// Its blocks cached (absolute indices) and whether it still runs.
    cached: std::collections::BTreeSet<u64>,
    live: bool,
    /// The hit blocks it references: (owner, index).
    hit: Vec<(u64, u64)>,
    hashes: Arc<[u64]>,
}

/// vmm-arena as an [`IdleEngine`]: vLLM's prefix-cache books at block
/// level (hash -> the block of the request that computed it, references,
/// an LRU of blocks nobody uses, capped) over one allocation per request.
pub struct ArenaEngine {
    pub arena: Arena,
    pub dev: Dev,
    block_bytes: u64,
    /// Each allocation's reservation: the workload's longest request.
    max_bytes: u64,
    cap: u64,
    /// Errors of stream-ordered frees and between-steps upkeep: counted
    /// (the next step retries upkeep).
    pub upkeep_errors: u64,
    entries: HashMap<u64, Entry>,
    cache: HashMap<u64, (u64, u64)>,
    block_hash: HashMap<(u64, u64), u64>,
    refs: HashMap<(u64, u64), u32>,
    lru: BTreeMap<u64, (u64, u64)>,
    lru_stamp: HashMap<(u64, u64), u64>,
    next_stamp: u64,
    pub evicted_blocks: u64,
}

impl ArenaEngine {
    pub fn new(c: &IdleConfig) -> Result<ArenaEngine, String> {
        let capacity = (c.num_blocks * c.block_bytes()).div_ceil(2 << 20) * (2 << 20);
        let dev = new_device(capacity)?;
        let max_bytes = c.max_request_tokens().div_ceil(KVCACHED_BLOCK_TOKENS) * c.block_bytes();
        // Room for every client's reservation twice over (address space only).
        let reserve = (capacity * 4).max(2 * c.concurrency as u64 * max_bytes.div_ceil(2 << 20) * (2 << 20));
        let cfg = ArenaConfig {
            capacity_bytes: capacity,
            reserve_bytes: reserve,
            retain_bytes: c.arena_retain_bytes(),
            ..ArenaConfig::default()
        };
        let arena = Arena::with_driver(dev.clone(), cfg).map_err(|e| format!("arena: {e}"))?;
        arena.set_prefetch(DEFAULT_PRECREATE, 0).map_err(|e| format!("set_prefetch: {e}"))?;
        Ok(ArenaEngine {
            arena,
            dev,
            block_bytes: c.block_bytes(),
            max_bytes,
            cap: c.max_cached_blocks(),
            upkeep_errors: 0,
            entries: HashMap::new(),
            cache: HashMap::new(),
            block_hash: HashMap::new(),
            refs: HashMap::new(),
            lru: BTreeMap::new(),
            lru_stamp: HashMap::new(),
            next_stamp: 0,
            evicted_blocks: 0,
        })
    }

    fn unlru(&mut self, b: (u64, u64)) {
        if let Some(s) = self.lru_stamp.remove(&b) {
            self.lru.remove(&s);
        }
    }

    fn push_lru(&mut self, b: (u64, u64)) {
        self.lru.insert(self.next_stamp, b);
        self.lru_stamp.insert(b, self.next_stamp);
        self.next_stamp += 1;
    }

    /// Sizes a request's allocation to `blocks` of its own (frees it at 0).
    fn size_to(&mut self, req: u64, blocks: u64) {
        let e = self.entries.get_mut(&req).expect("entry");
        if blocks == e.blocks {
            return;
        }
        e.blocks = blocks;
        let id = e.id;
        let done = if blocks == 0 {
            self.entries.remove(&req);
            self.arena.free_on_stream(id, ENGINE_STREAM)
        } else {
            self.arena.resize_on_stream(id, blocks * self.block_bytes, ENGINE_STREAM).map(|_| ())
        };
        if done.is_err() {
            self.upkeep_errors += 1;
        }
    }

    /// Sizes a finished request's allocation to its cached blocks.
    fn shrink_to_cached(&mut self, req: u64) {
        let e = &self.entries[&req];
        let keep = e.cached.iter().next_back().map_or(0, |&last| last + 1 - e.first);
        self.size_to(req, keep);
    }

    fn cache_upto(&mut self, req: u64, hashes: &[u64], full: u64) {
        let first = self.entries[&req].first;
        for j in first..full.min(hashes.len() as u64) {
            let h = hashes[j as usize];
            if self.entries[&req].cached.contains(&j) || self.cache.contains_key(&h) {
                continue;
            }
            self.cache.insert(h, (req, j));
            self.block_hash.insert((req, j), h);
            self.entries.get_mut(&req).expect("entry").cached.insert(j);
        }
    }

    fn evict_over_cap(&mut self) {
        while self.lru.len() as u64 > self.cap {
            let (_, b) = self.lru.pop_first().expect("over the cap");
            self.lru_stamp.remove(&b);
            let h = self.block_hash.remove(&b).expect("a cached block");
            self.cache.remove(&h);
            self.evicted_blocks += 1;
            let e = self.entries.get_mut(&b.0).expect("owner");
            e.cached.remove(&b.1);
            if !e.live {
                self.shrink_to_cached(b.0);
            }
        }
    }
}

impl IdleEngine for ArenaEngine {
    fn admit(&mut self, id: u64, q: &IdleRequest) -> Option<u64> {
        let max = (q.prompt - 1) / KVCACHED_BLOCK_TOKENS;
        let hit: Vec<(u64, u64)> =
            q.hashes.iter().take(max as usize).map_while(|h| self.cache.get(h).copied()).collect();
        let first = hit.len() as u64;
        let blocks = q.prompt.div_ceil(KVCACHED_BLOCK_TOKENS) - first;
        let size = blocks * self.block_bytes;
        let (aid, _) = self.arena.alloc_growable_on_stream(size, size.max(self.max_bytes), ENGINE_STREAM).ok()?;
        for &b in &hit {
            *self.refs.entry(b).or_default() += 1;
            self.unlru(b);
        }
        self.entries.insert(
            id,
            Entry {
                id: aid,
                first,
                blocks,
                cached: Default::default(),
                live: true,
                hit: hit.clone(),
                hashes: q.hashes.clone(),
            },
        );
        self.cache_upto(id, &q.hashes, q.prompt / KVCACHED_BLOCK_TOKENS);
        Some(first * KVCACHED_BLOCK_TOKENS)
    }

    fn decode(&mut self, id: u64, tokens: u64) -> bool {
        let e = &self.entries[&id];
        let need = tokens.div_ceil(KVCACHED_BLOCK_TOKENS) - e.first;
        if need > e.blocks {
            let (aid, size) = (e.id, need * self.block_bytes);
            if self.arena.resize_on_stream(aid, size, ENGINE_STREAM).is_err() {
                return false;
            }
            self.entries.get_mut(&id).expect("entry").blocks = need;
        }
        let hashes = self.entries[&id].hashes.clone();
        self.cache_upto(id, &hashes, tokens / KVCACHED_BLOCK_TOKENS);
        true
    }

    fn finish(&mut self, id: u64) {
        let e = self.entries.get_mut(&id).expect("live");
        e.live = false;
        // Last block first, as vLLM frees: its own blocks, then its hit.
        let own: Vec<u64> = e.cached.iter().rev().copied().collect();
        let hit: Vec<(u64, u64)> = e.hit.iter().rev().copied().collect();
        for j in own {
            if !self.refs.contains_key(&(id, j)) {
                self.push_lru((id, j));
            }
        }
        for b in hit {
            let r = self.refs.get_mut(&b).expect("a hit block's references");
            *r -= 1;
            if *r == 0 {
                self.refs.remove(&b);
                if self.block_hash.contains_key(&b) {
                    self.push_lru(b);
                }
            }
        }
        self.shrink_to_cached(id);
        self.evict_over_cap();
    }

    fn held(&self) -> (u64, u64) {
        let s = self.arena.stats().expect("stats");
        (s.mapped_bytes, s.mapped_bytes + s.pooled_bytes)
    }

    fn trim(&mut self) {
        let _ = self.arena.trim(0);
    }

    fn cached_idle_blocks(&self) -> u64 {
        self.lru.len() as u64
    }

    fn caller_calls(&self) -> Calls {
        self.dev.calls()
    }

    fn between_steps(&mut self) {
        if self.arena.release_retired().is_err() || self.arena.maintain().is_err() {
            self.upkeep_errors += 1;
        }
    }

    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }

    fn attn_layout(&self) -> AttnLayout {
        attn_layout("arena", Layout::TokenMajor)
    }
}
