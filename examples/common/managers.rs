//! KV-cache managers driven by the replay: vmm-arena (with and without
//! implicit moves, driven with stream-ordered frees, prefetch and batch
//! growth; and `arena-sync`, driven as before) and the baselines — PyTorch's caching allocator (native
//! and expandable segments) holding each request's KV as contiguous tensors
//! grown by doubling with a copy, and vLLM's static block pool.
//!
//! Every manager runs on its own [`Counted`] host driver in sparse mode, with
//! the same device capacity, so driver calls and physical memory are counted
//! by the same code for all of them. Each token's KV slot receives a real
//! 8-byte tag written through the mapping; the replay reads every tag back
//! when the request finishes (or is preempted).
//!
//! Layouts: `token-major` is one allocation per request holding all layers of
//! each token; `per-layer` is one allocation per layer and per K/V (`2 ×
//! layers` allocations per request, as vAttention and kvcached lay out KV).
//! With `per-layer`, token `t`'s tag goes to allocation `t mod (2 × layers)`
//! at `t × bytes_per_token_per_allocation`, so every allocation receives tags
//! along its whole length and each token has exactly one tagged slot (writing
//! all 64 slots of a token would multiply the replay's time by 64 without
//! testing anything more).
//!
//! The host backend runs in sparse mode: a page of host memory exists only
//! where a tag was written. Freed KV is punched out of the host memory
//! (`discard`) when a manager's resident pages pass a budget, so that a long
//! replay's host memory stays bounded; this makes no driver call and changes
//! no figure of the report.

use std::collections::VecDeque;
use std::sync::Arc;

use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::{Arena, ArenaConfig, Error, Id};

use super::caching::CachingAllocator;
use super::counted::{is_host_limit, Calls, Counted};
use super::prefix_cache::ArenaPrefixCache;
use super::prepared::{Prepared, PreparedAdmissions, Take};
use super::trace::{Request, HASH_BLOCK_TOKENS};

/// The host backend in sparse mode, counted, capped at `capacity`.
pub type Dev = Arc<Counted<HostDriver>>;

/// A fresh counted sparse host driver for a device of `capacity` bytes.
pub fn new_device(capacity: u64) -> Result<Dev, String> {
    let host = HostDriver::with_options(HostOptions { sparse: true }).map_err(|e| format!("host backend: {e}"))?;
    Ok(Arc::new(Counted::new(host, capacity)))
}

/// KV layout of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    TokenMajor,
    PerLayer,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::TokenMajor => "token-major",
            Layout::PerLayer => "per-layer",
        }
    }
}

/// The shape of one request's KV cache.
#[derive(Clone, Copy, Debug)]
pub struct KvShape {
    /// KV bytes per token, all layers, K and V.
    pub kv_bytes_per_token: u64,
    pub layers: u32,
    pub layout: Layout,
    /// Tokens a growable reservation is sized for (the model's context).
    pub max_context: u64,
}

impl KvShape {
    /// Allocations per request.
    pub fn n_allocs(&self) -> u64 {
        match self.layout {
            Layout::TokenMajor => 1,
            Layout::PerLayer => 2 * self.layers as u64,
        }
    }

    /// Bytes per token in each allocation.
    pub fn bpt(&self) -> u64 {
        (self.kv_bytes_per_token / self.n_allocs()).max(8)
    }

    /// Which allocation holds token `t`'s tag, and at which offset.
    pub fn slot(&self, t: u64) -> (usize, u64) {
        ((t % self.n_allocs()) as usize, t * self.bpt())
    }
}

/// A failed allocation or growth.
#[derive(Clone, Debug)]
pub struct Fail {
    /// Free physical capacity covered the request: it failed for layout
    /// (fragmentation), not for lack of memory.
    pub fragmentation: bool,
    /// The host backend hit a system limit (not a policy outcome): the
    /// replay's figures are not valid.
    pub host_limit: bool,
    pub message: String,
}

/// What the replay needs from a KV-cache manager. `seq` is the request's
/// index in the trace.
pub trait KvManager {
    fn name(&self) -> &'static str;
    /// Allocates room for `tokens` tokens of a new sequence of request `q`;
    /// all or nothing. Returns the prompt tokens whose KV is already there
    /// (a prefix cache's hit), which the engine does not compute.
    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail>;
    /// Makes room for `tokens` tokens (more than now); `stored` hold data.
    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail>;
    /// Called once per decode step, before the per-sequence [`KvManager::grow`]
    /// calls, with every running sequence's growth (`seq`, `tokens`,
    /// `stored`, as `grow` takes them). A manager with a batch form grows
    /// them all here, all or nothing; `grow` then finds each one done. On
    /// failure (nothing grown) the replay falls back to growing each
    /// sequence in turn, preempting as usual. The default has no batch form
    /// and does nothing: each sequence grows in its own `grow` call, as the
    /// allocators the baselines model do (vLLM's scheduler allocates slots
    /// request by request; a PyTorch tensor is reallocated on its own).
    fn grow_batch(&mut self, grows: &[(usize, u64, u64)]) -> Result<(), Fail> {
        let _ = grows;
        Ok(())
    }
    /// Frees the sequence's KV.
    fn free(&mut self, seq: usize);
    /// Writes token `t`'s tag through the mapping.
    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool;
    /// Reads token `t`'s tag back.
    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64>;
    /// Physical memory held now.
    fn physical_bytes(&self) -> u64;
    fn peak_physical_bytes(&self) -> u64;
    fn calls(&self) -> Calls;
    fn bytes_copied(&self) -> u64;
    fn moves(&self) -> u64;
    /// Called after the scheduler has prepared a step, while the GPU
    /// computes it: driver work here is hidden up to the step's GPU time
    /// (see `timing.rs`). The point where an engine lets the arena unmap the
    /// old addresses of moved allocations.
    fn between_steps(&mut self) {}
    /// Called between steps, just before [`KvManager::between_steps`] (its
    /// driver time is counted and hidden as that hook's), with the front of
    /// the waiting queue that the next step's admission will try first, in
    /// order (`seq`, `tokens`, request, as [`KvManager::admit`] takes them),
    /// no more than the batch has room for, and only when admission will be
    /// tried. Nothing changes the manager between this call and that
    /// admission (new arrivals join the queue's tail), so a manager may do
    /// the admissions' memory work now, while the GPU computes, and hand the
    /// results out from `admit`, as an engine with asynchronous scheduling
    /// schedules step k+1 while step k runs (vLLM V1's async scheduling).
    /// It must give each request the outcome `admit` would have given it
    /// then. The default does nothing: `admit` does the work.
    fn prepare_admissions(&mut self, front: &[(usize, u64, &Request)]) {
        let _ = front;
    }
    /// Called when the GPU has finished the step just charged: events
    /// recorded on the manager's device until now complete (see
    /// `counted.rs`).
    fn gpu_finished_step(&mut self) {}
    /// Called every few steps: checks the host memory the simulation holds
    /// (not a figure of the report) and turns discarding on or off.
    fn housekeeping(&mut self) {}
    /// Manager-specific facts for the JSON report: (key, JSON value).
    fn extra(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Bytes of the running requests' KV that several of them map (a
    /// shared prefix), counted once per request beyond the first: the sum
    /// of the requests' KV less this is the distinct live KV.
    fn shared_live_bytes(&self) -> u64 {
        0
    }
}

/// This machine's physical memory (`MemTotal`), or 8 GiB if unknown.
pub fn host_ram() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(8 << 30, |kib| kib << 10)
}

/// Host memory the simulation may keep resident per manager before freed KV
/// is discarded (see [`discard`]): a sixteenth of the device, at least
/// 512 MiB, and never more than an eighth of this machine's memory.
pub fn host_budget(capacity: u64) -> u64 {
    host_budget_for(capacity, host_ram())
}

/// [`host_budget`] on a machine of `ram` bytes.
pub fn host_budget_for(capacity: u64, ram: u64) -> u64 {
    (capacity / 16).max(512 << 20).min(ram / 8)
}

/// Host bytes a stored tag keeps resident at worst: its own page.
pub const TAG_PAGE_BYTES: u64 = 4096;

/// Refuses, up front and with the limit named, a replay whose simulation
/// could not keep its host memory bounded: tags of live KV (and, with
/// prefix caching on a trace with hashes, of every cached block) stay
/// resident, one page each, whatever the discarding does. Their worst case
/// over `jobs` concurrent managers must fit in half of `ram` (this
/// machine's memory: [`host_ram`]).
#[allow(clippy::too_many_arguments)]
pub fn check_host_memory(
    ram: u64,
    shape: KvShape,
    capacity: u64,
    requests: &[Request],
    max_batch: usize,
    managers: &[String],
    prefix_caching: bool,
    jobs: usize,
) -> Result<(), String> {
    let limit = ram / 2;
    let device_tokens = capacity / shape.kv_bytes_per_token.max(1);
    let mut longest: Vec<u64> = requests.iter().map(|q| q.prompt + q.output).collect();
    longest.sort_unstable_by(|a, b| b.cmp(a));
    let batch_tokens: u64 = longest.iter().take(max_batch).sum();
    let live = device_tokens.min(batch_tokens) * TAG_PAGE_BYTES;
    let hashes = requests.iter().any(|q| !q.hash_ids.is_empty());
    // Both prefix caches (vLLM's, and the arena's in the token-major
    // layout) keep the tags of cached blocks resident.
    let caches = |m: &str| m == "vllm-paged" || (m.starts_with("arena") && shape.layout == Layout::TokenMajor);
    let worst = |m: &str| if caches(m) && prefix_caching && hashes { device_tokens * TAG_PAGE_BYTES } else { live };
    let mut per: Vec<u64> = managers.iter().map(|m| worst(m) + host_budget_for(capacity, ram)).collect();
    per.sort_unstable_by(|a, b| b.cmp(a));
    let need: u64 = per.iter().take(jobs.max(1)).sum();
    if need > limit {
        return Err(format!(
            "this replay could keep up to {} of host memory resident ({} manager(s) at once, each holding one {}              page per live token tag{}), over the limit of {} (half of this machine's memory); use a smaller              --capacity, --max-batch or --jobs",
            fmt_gib(need),
            jobs.max(1).min(managers.len()),
            TAG_PAGE_BYTES,
            if prefix_caching && hashes { ", and per cached prefix block with prefix caching" } else { "" },
            fmt_gib(limit)
        ));
    }
    Ok(())
}

fn fmt_gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Gives the host pages wholly inside `addr..addr+len` back to the kernel
/// (`madvise(MADV_REMOVE)` punches them out of the backing memfd). Called on
/// KV that is freed, after its tags were verified (its contents are dead),
/// while the manager's host memory is above [`host_budget`]. It makes no
/// driver call and changes no count; it only keeps the simulation's host
/// memory bounded: tags of reused memory land on new host pages whenever
/// the reuse is at another offset (a block split elsewhere, another layer's
/// allocation), until every page of the device would be resident.
pub fn discard(addr: u64, len: u64) {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    let page = *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => 4096,
    });
    let start = addr.div_ceil(page) * page;
    let end = (addr + len) / page * page;
    if end > start {
        // SAFETY: the span lies inside a live, writable shared mapping that
        // this manager owns (freed KV of its own allocation); MADV_REMOVE
        // only replaces its contents with zeros. Errors are ignored: the
        // pages then simply stay resident.
        unsafe {
            libc::madvise(start as *mut libc::c_void, (end - start) as usize, libc::MADV_REMOVE);
        }
    }
}

fn slot_vec<T>(v: &mut Vec<Option<T>>, seq: usize) -> &mut Option<T> {
    if v.len() <= seq {
        v.resize_with(seq + 1, || None);
    }
    &mut v[seq]
}

// ---------------------------------------------------------------- vmm-arena

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
}

/// The arena's virtual range for a KV workload: the arena's default (4 ×
/// capacity) or, if more, room for two full batches of reservations. An
/// engine sizes its range for its batch (address space costs no memory);
/// with less, the reservations of a full batch exhaust the range although
/// physical memory is free.
pub fn arena_reserve(shape: KvShape, capacity: u64, max_batch: usize) -> u64 {
    const CHUNK: u64 = 2 << 20;
    let per_request = shape.n_allocs() * (shape.max_context * shape.bpt()).div_ceil(CHUNK) * CHUNK;
    (capacity / CHUNK * CHUNK).saturating_mul(4).max(2 * max_batch as u64 * per_request)
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
        }
    }
}

/// Default prefetch targets of the `arena` rows: one 2 MiB chunk mapped
/// ahead of each growing KV tensor (a decode step grows a tensor by at most
/// one token, so one chunk ahead always covers it), and 4 chunks created
/// ahead for admissions.
pub const DEFAULT_MAP_AHEAD: u64 = 2 << 20;
pub const DEFAULT_PRECREATE: u64 = 8 << 20;

impl ArenaMgr {
    pub fn new(name: &'static str, shape: KvShape, o: ArenaOptions, mode: ArenaMode) -> Result<ArenaMgr, String> {
        let dev = new_device(o.capacity)?;
        let cfg = ArenaConfig {
            capacity_bytes: o.capacity,
            reserve_bytes: o.reserve,
            retain_bytes: o.retain,
            no_implicit_moves: o.no_implicit_moves,
            ..ArenaConfig::default()
        };
        let arena = Arena::with_driver(dev.clone(), cfg).map_err(|e| format!("arena: {e}"))?;
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
        })
    }

    /// Turns the prefix cache on (`--prefix-caching on`) where a 16-token
    /// unit is whole chunks of the token-major layout's one allocation per
    /// request (see `prefix_cache.rs` for why not otherwise).
    pub fn with_prefix_cache(mut self, on: bool) -> ArenaMgr {
        if !on {
            return self;
        }
        if self.shape.layout != Layout::TokenMajor {
            self.prefix_state = "off: token-major layout only";
            return self;
        }
        self.prefix = ArenaPrefixCache::new(self.chunk, self.shape.bpt());
        if let Some(p) = self.prefix.as_mut() {
            p.stream = (self.mode == ArenaMode::Stream).then_some(ENGINE_STREAM);
        }
        self.prefix_state = if self.prefix.is_some() { "on" } else { "off: 16 tokens are not whole chunks" };
        self
    }

    /// Turns the preparation of admissions between steps off (`Stream`
    /// mode; for comparisons: the outcomes must be the same).
    pub fn without_prepared_admissions(mut self) -> ArenaMgr {
        self.prepare = false;
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
    fn admit_now(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let size = self.bytes_for(tokens);
        let max = size.max(self.bytes_for(self.shape.max_context));
        if let Some(p) = self.prefix.as_mut() {
            let (id, hit) = p.admit(&self.arena, size, max, q, self.discard).map_err(|e| self.fail(e, size))?;
            *slot_vec(&mut self.seqs, seq) = Some(ArenaSeq { ids: vec![id], cap: size / self.shape.bpt() });
            return Ok(hit);
        }
        let n = self.shape.n_allocs() as usize;
        let mut ids = Vec::with_capacity(n);
        for k in 0..n {
            match self.arena.alloc_growable(size, max) {
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
        *slot_vec(&mut self.seqs, seq) = Some(ArenaSeq { ids, cap: size / self.shape.bpt() });
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

    /// Whether `bytes` more fit in the capacity with no stream free still
    /// pending (no free of this step): none is pending, or they fit beside
    /// what is pending (bounded by the request's whole size: its hit and
    /// evictions only lower the need).
    fn fits_without_pending(&self, bytes: u64) -> bool {
        let Ok(s) = self.arena.stats() else { return false };
        s.pending_free_bytes == 0 || s.mapped_bytes + s.pending_free_bytes + bytes <= s.capacity_bytes
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
        self.admit_now(seq, tokens, q)
    }

    fn prepare_admissions(&mut self, front: &[(usize, u64, &Request)]) {
        if self.mode == ArenaMode::Sync || !self.prepare {
            return; // `arena-sync`: admission as before, on the critical path
        }
        let left = self.prepared.drain();
        self.give_back(left);
        for &(seq, tokens, q) in front {
            // Memory freed on the stream in this step is not reusable before
            // the GPU has finished it: an admission that may need it would
            // wait on its event here (a drain, which unhides all of this
            // step's between-steps work). It and those after it are left
            // to the next step's admission, which finds the event complete.
            if !self.fits_without_pending(self.bytes_for(tokens)) {
                self.prepared.deferred += 1;
                break;
            }
            let shared_before = self.shared_live_bytes_all();
            let outcome = self.admit_now(seq, tokens, q);
            let shared_bytes = self.shared_live_bytes_all().saturating_sub(shared_before);
            let failed = outcome.is_err();
            self.prepared.push(Prepared { seq, tokens, outcome, shared_bytes });
            if failed {
                break; // admission stops at the first failure
            }
        }
    }

    fn grow(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
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
            if let Err(e) = self.arena.resize(id, new_size) {
                return Err(self.fail(e, (ids.len() - k) as u64 * (new_size - old_size)));
            }
        }
        self.seqs[seq].as_mut().expect("live").cap = new_size / self.shape.bpt();
        Ok(())
    }

    fn grow_batch(&mut self, grows: &[(usize, u64, u64)]) -> Result<(), Fail> {
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
            None => self.arena.resize_many(&targets).map(|_| ()),
        }
        .map_err(|e| self.fail(e, new_total - old_total))?;
        for (seq, cap) in grown {
            self.seqs[seq].as_mut().expect("live").cap = cap;
        }
        Ok(())
    }

    fn free(&mut self, seq: usize) {
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

    fn physical_bytes(&self) -> u64 {
        self.dev.live_bytes()
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.dev.peak_bytes()
    }

    fn calls(&self) -> Calls {
        self.dev.calls()
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

    fn between_steps(&mut self) {
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
            if let Err(e) = self.arena.maintain() {
                self.maintain_errors += 1;
                self.last_maintain_error = Some(e.to_string());
            }
        }
    }

    fn extra(&self) -> Vec<(String, String)> {
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

    fn shared_live_bytes(&self) -> u64 {
        // Prepared admissions are not running yet.
        self.shared_live_bytes_all() - self.prepared.shared_bytes()
    }
}

// ------------------------------------------------ PyTorch caching allocator

/// A request's KV as contiguous tensors from PyTorch's caching allocator
/// (native or expandable segments). A contiguous cache without virtual
/// memory must grow by reallocation: each tensor starts with room for the
/// next power of two of tokens (at least 16) and doubles when full,
/// copying its stored KV into the new tensor (`driver.copy` of every stored
/// tag; `bytes_copied` counts the stored KV bytes a GPU would copy).
pub struct TorchMgr {
    name: &'static str,
    alloc: CachingAllocator<Dev>,
    dev: Dev,
    shape: KvShape,
    seqs: Vec<Option<Vec<(u64, u64)>>>,
    copied: u64,
    copy_errors: u64,
    capacity: u64,
    discard: bool,
}

fn pow2_tokens(tokens: u64) -> u64 {
    tokens.max(16).next_power_of_two()
}

impl TorchMgr {
    pub fn new(name: &'static str, shape: KvShape, capacity: u64, expandable: bool) -> Result<TorchMgr, String> {
        let dev = new_device(capacity)?;
        Ok(TorchMgr {
            name,
            alloc: CachingAllocator::new(dev.clone(), capacity, expandable),
            dev,
            shape,
            seqs: Vec::new(),
            copied: 0,
            copy_errors: 0,
            capacity,
            discard: false,
        })
    }

    /// The device (for managers made of several, `tp.rs`).
    pub fn device(&self) -> &Dev {
        &self.dev
    }

    /// The caching allocator, for tensors sharing it with the KV
    /// (activations, in `tp.rs`).
    pub fn allocator_mut(&mut self) -> &mut CachingAllocator<Dev> {
        &mut self.alloc
    }

    /// `remaining`: bytes the operation still had to allocate when it failed.
    fn fail(oom: super::caching::Oom, remaining: u64) -> Fail {
        let free = oom.capacity.saturating_sub(oom.allocated_bytes);
        Fail {
            fragmentation: oom.driver_error.is_none() && free >= remaining.max(oom.size),
            host_limit: oom.driver_error.is_some(),
            message: format!(
                "out of memory: tried {} bytes; {} in use, {} reserved, largest free block {}{}",
                oom.size,
                oom.allocated_bytes,
                oom.reserved_bytes,
                oom.largest_free_block,
                oom.driver_error.map(|e| format!(" (driver: {e})")).unwrap_or_default()
            ),
        }
    }
}

impl KvManager for TorchMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64, _q: &Request) -> Result<u64, Fail> {
        let cap = pow2_tokens(tokens);
        let n = self.shape.n_allocs() as usize;
        let mut v = Vec::with_capacity(n);
        for k in 0..n {
            match self.alloc.malloc(cap * self.shape.bpt()) {
                Ok(p) => v.push((p, cap)),
                Err(oom) => {
                    let remaining = (n - k) as u64 * oom.size;
                    for (p, _) in v {
                        self.alloc.free(p);
                    }
                    return Err(Self::fail(oom, remaining));
                }
            }
        }
        *slot_vec(&mut self.seqs, seq) = Some(v);
        Ok(0)
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        let n = self.shape.n_allocs();
        let bpt = self.shape.bpt();
        for a in 0..n as usize {
            let (old, cap) = self.seqs[seq].as_ref().expect("live")[a];
            if tokens <= cap {
                continue;
            }
            let mut new_cap = cap * 2;
            while new_cap < tokens {
                new_cap *= 2;
            }
            let new = self.alloc.malloc(new_cap * bpt).map_err(|oom| {
                let remaining = (n - a as u64) * oom.size;
                Self::fail(oom, remaining)
            })?;
            // Copy the stored KV: the tags are what this simulation stores.
            let mut t = a as u64;
            while t < stored {
                if self.dev.copy(new + t * bpt, old + t * bpt, 8).is_err() {
                    self.copy_errors += 1;
                }
                t += n;
            }
            self.copied += stored * bpt;
            if self.discard {
                discard(old, cap * bpt);
            }
            self.alloc.free(old);
            self.seqs[seq].as_mut().expect("live")[a] = (new, new_cap);
        }
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some(v) = self.seqs[seq].take() {
            for (p, cap) in v {
                if self.discard {
                    discard(p, cap * self.shape.bpt());
                }
                self.alloc.free(p);
            }
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let (a, off) = self.shape.slot(t);
        let p = self.seqs[seq].as_ref().expect("live")[a].0;
        self.dev.write(p + off, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let (a, off) = self.shape.slot(t);
        let p = self.seqs[seq].as_ref().expect("live")[a].0;
        let mut b = [0u8; 8];
        self.dev.read(p + off, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn physical_bytes(&self) -> u64 {
        self.dev.live_bytes()
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.dev.peak_bytes()
    }

    fn calls(&self) -> Calls {
        self.dev.calls()
    }

    fn bytes_copied(&self) -> u64 {
        self.copied
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }

    fn moves(&self) -> u64 {
        0
    }

    fn extra(&self) -> Vec<(String, String)> {
        let s = self.alloc.stats();
        vec![
            ("num_alloc_retries".into(), s.num_alloc_retries.to_string()),
            ("num_ooms".into(), s.num_ooms.to_string()),
            ("segment_allocs".into(), s.num_device_alloc.to_string()),
            ("segment_frees".into(), s.num_device_free.to_string()),
            ("peak_reserved_bytes".into(), s.peak_reserved_bytes.to_string()),
            ("copy_errors".into(), self.copy_errors.to_string()),
        ]
    }
}

// ------------------------------------------------------- vLLM block pool

/// vLLM's paged KV cache: at start-up every KV tensor is allocated for the
/// whole capacity (`vllm/v1/worker/gpu_model_runner.py`, one tensor per
/// layer holding K and V, or one tensor for the token-major layout), cut
/// into blocks of 16 tokens (`vllm/v1/core/block_pool.py`: block 0 is the
/// null block; `get_new_blocks` pops free blocks from the front of the free
/// queue and fails when too few are free; `free_blocks` appends a finished
/// request's blocks, last block first, as `single_type_kv_cache_manager.py`
/// frees `reversed(req_blocks)`). Nothing grows, nothing is returned.
///
/// Automatic prefix caching, on by default as in vLLM: a request reuses the
/// longest chain of cached blocks of its prompt (Mooncake `hash_ids`, 512
/// tokens each, chained on their predecessors), always computing at least
/// its last prompt token (hits are whole 16-token blocks of the first
/// `prompt - 1` tokens). Blocks of finished requests stay cached, in the
/// free queue, until popped for reuse in LRU order (eviction); a hit on a
/// free cached block takes it out of the queue. Traces without hashes
/// share nothing.
pub struct VllmMgr {
    dev: Dev,
    shape: KvShape,
    tensors: Vec<(u64, u64, ChunkHandle)>,
    num_blocks: u64,
    prefix_caching: bool,
    /// Free blocks, least recently freed first. Entries are deleted lazily:
    /// one counts only while its stamp is the block's `free_stamp`.
    free_q: VecDeque<(u32, u64)>,
    free_stamp: Vec<u64>,
    next_stamp: u64,
    n_free: u64,
    refs: Vec<u32>,
    /// Cached prompt blocks: hash id -> its 16-token blocks, in order. vLLM
    /// hashes every 16-token block on its predecessors; evicting one cuts
    /// the chain there, so an entry is a prefix of the hash block's blocks.
    cache: std::collections::HashMap<u64, Vec<u32>>,
    /// The cached hash block (and index in it) a block holds.
    block_hash: Vec<Option<(u64, u32)>>,
    seqs: Vec<Option<Vec<u32>>>,
    hit_blocks: u64,
    evicted_blocks: u64,
    /// Blocks mapped by more than one running request, once per extra one.
    shared_live_blocks: u64,
    capacity: u64,
    discard: bool,
}

pub const VLLM_BLOCK_TOKENS: u64 = 16;

impl VllmMgr {
    pub fn new(shape: KvShape, capacity: u64, prefix_caching: bool) -> Result<VllmMgr, String> {
        let dev = new_device(capacity)?;
        let n_tensors = match shape.layout {
            Layout::TokenMajor => 1,
            Layout::PerLayer => shape.layers as u64,
        };
        let per_block = VLLM_BLOCK_TOKENS * shape.bpt() * (shape.n_allocs() / n_tensors);
        let per_tensor_room = capacity / n_tensors / (2 << 20) * (2 << 20);
        let num_blocks = per_tensor_room / per_block;
        if num_blocks < 2 {
            return Err(format!("capacity {capacity} holds no block of {per_block} bytes per tensor"));
        }
        let size = (num_blocks * per_block).div_ceil(2 << 20) * (2 << 20);
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let base = dev.reserve(size, 2 << 20).map_err(|e| e.to_string())?;
            let h = dev.create(size).map_err(|e| e.to_string())?;
            dev.map(base, size, h, 0).map_err(|e| e.to_string())?;
            dev.set_access(base, size).map_err(|e| e.to_string())?;
            tensors.push((base, size, h));
        }
        let nb = num_blocks as usize;
        let mut m = VllmMgr {
            dev,
            shape,
            tensors,
            num_blocks,
            prefix_caching,
            free_q: VecDeque::with_capacity(nb),
            free_stamp: vec![0; nb],
            next_stamp: 1,
            n_free: 0,
            refs: vec![0; nb],
            cache: Default::default(),
            block_hash: vec![None; nb],
            seqs: Vec::new(),
            hit_blocks: 0,
            evicted_blocks: 0,
            shared_live_blocks: 0,
            capacity,
            discard: false,
        };
        for b in 1..num_blocks as u32 {
            m.push_free(b);
        }
        Ok(m)
    }

    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    fn push_free(&mut self, b: u32) {
        self.free_stamp[b as usize] = self.next_stamp;
        self.free_q.push_back((b, self.next_stamp));
        self.next_stamp += 1;
        self.n_free += 1;
    }

    fn unfree(&mut self, b: u32) {
        debug_assert!(self.free_stamp[b as usize] != 0);
        self.free_stamp[b as usize] = 0;
        self.n_free -= 1;
    }

    fn addr(&self, blocks: &[u32], t: u64) -> u64 {
        let (a, _) = self.shape.slot(t);
        let bpt = self.shape.bpt();
        let block = blocks[(t / VLLM_BLOCK_TOKENS) as usize] as u64;
        let pos = t % VLLM_BLOCK_TOKENS;
        match self.shape.layout {
            Layout::TokenMajor => self.tensors[0].0 + (block * VLLM_BLOCK_TOKENS + pos) * bpt,
            Layout::PerLayer => {
                let (l, kv) = (a / 2, a as u64 % 2);
                self.tensors[l].0 + (kv * self.num_blocks + block) * VLLM_BLOCK_TOKENS * bpt + pos * bpt
            }
        }
    }

    /// Pops `n` free blocks, least recently freed first, evicting the
    /// cached prefixes they held.
    fn take(&mut self, n: u64) -> Result<Vec<u32>, Fail> {
        if n > self.n_free {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{n} blocks needed, {} free", self.n_free),
            });
        }
        let mut out = Vec::with_capacity(n as usize);
        while (out.len() as u64) < n {
            let (b, stamp) = self.free_q.pop_front().expect("n_free counts the queue's live entries");
            if self.free_stamp[b as usize] != stamp {
                continue; // taken by a hit since it was freed
            }
            self.unfree(b);
            if let Some((h, i)) = self.block_hash[b as usize] {
                // Evicted: the cached chain of this hash block ends before it.
                let entry = self.cache.get_mut(&h).expect("a hashed block's entry");
                for x in entry.drain(i as usize..) {
                    self.block_hash[x as usize] = None;
                    self.evicted_blocks += 1;
                }
                if entry.is_empty() {
                    self.cache.remove(&h);
                }
            }
            out.push(b);
        }
        Ok(out)
    }

    /// The cached blocks a new request of `q` can use: whole 16-token
    /// blocks of its first `prompt - 1` tokens, along the longest chain of
    /// cached hash blocks.
    fn lookup(&self, q: &Request) -> Vec<u32> {
        let mut hit = Vec::new();
        if !self.prefix_caching {
            return hit;
        }
        let max_blocks = (q.prompt.saturating_sub(1) / VLLM_BLOCK_TOKENS) as usize;
        let per_hash = (HASH_BLOCK_TOKENS / VLLM_BLOCK_TOKENS) as usize;
        for j in 0..q.full_hash_blocks() as usize {
            let Some(blocks) = self.cache.get(&q.hash_ids[j]) else { break };
            let take = blocks.len().min(max_blocks - hit.len());
            hit.extend_from_slice(&blocks[..take]);
            if hit.len() == max_blocks || blocks.len() < per_hash {
                break;
            }
        }
        hit
    }

    /// Drops a request's references; blocks nobody uses go to the free
    /// queue, last block first (so a request's tail is evicted first).
    fn release(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().rev() {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r > 0 {
                self.shared_live_blocks -= 1;
            }
            if *r == 0 {
                if self.discard && self.block_hash[b as usize].is_none() {
                    // Dead KV (no prefix cache keeps it): give its host pages back.
                    let len = VLLM_BLOCK_TOKENS * self.shape.bpt();
                    for (base, _, _) in &self.tensors {
                        match self.shape.layout {
                            Layout::TokenMajor => discard(base + b as u64 * len, len),
                            Layout::PerLayer => {
                                for kv in 0..2 {
                                    discard(base + (kv * self.num_blocks + b as u64) * len, len);
                                }
                            }
                        }
                    }
                }
                self.push_free(b);
            }
        }
        if self.free_q.len() > 2 * self.num_blocks as usize + 1024 {
            let stamps = &self.free_stamp;
            self.free_q.retain(|&(b, s)| stamps[b as usize] == s);
        }
    }
}

impl Drop for VllmMgr {
    fn drop(&mut self) {
        for &(base, size, h) in &self.tensors {
            let _ = self.dev.unmap(base, size);
            let _ = self.dev.release(h);
            let _ = self.dev.free_reservation(base, size);
        }
    }
}

impl KvManager for VllmMgr {
    fn name(&self) -> &'static str {
        "vllm-paged"
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let need = tokens.div_ceil(VLLM_BLOCK_TOKENS);
        let hit = self.lookup(q);
        let hit_free = hit.iter().filter(|&&b| self.refs[b as usize] == 0).count() as u64;
        let fresh = need - hit.len() as u64;
        if fresh > self.n_free - hit_free {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{fresh} blocks needed, {} free", self.n_free - hit_free),
            });
        }
        for &b in &hit {
            if self.refs[b as usize] == 0 {
                self.unfree(b);
            } else {
                self.shared_live_blocks += 1;
            }
            self.refs[b as usize] += 1;
        }
        let new = self.take(fresh)?;
        for &b in &new {
            self.refs[b as usize] = 1;
        }
        self.hit_blocks += hit.len() as u64;
        let hit_tokens = hit.len() as u64 * VLLM_BLOCK_TOKENS;
        let mut blocks = hit;
        blocks.extend(new);
        if self.prefix_caching {
            // The prompt's full hash blocks are computed in this step: cache them.
            let per_hash = (HASH_BLOCK_TOKENS / VLLM_BLOCK_TOKENS) as usize;
            // A cut chain is completed with this request's blocks.
            for j in 0..q.full_hash_blocks() as usize {
                let h = q.hash_ids[j];
                let own = &blocks[j * per_hash..(j + 1) * per_hash];
                let entry = self.cache.entry(h).or_default();
                if entry.len() == per_hash || own[..entry.len()] != entry[..] {
                    continue; // complete, or computed apart from this request
                }
                for (i, &b) in own.iter().enumerate().skip(entry.len()) {
                    if self.block_hash[b as usize].is_some() {
                        break; // another prefix's cached block (cannot happen: blocks are new)
                    }
                    self.block_hash[b as usize] = Some((h, i as u32));
                    entry.push(b);
                }
            }
        }
        *slot_vec(&mut self.seqs, seq) = Some(blocks);
        Ok(hit_tokens)
    }

    fn grow(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
        let have = self.seqs[seq].as_ref().expect("live").len() as u64;
        let need = tokens.div_ceil(VLLM_BLOCK_TOKENS);
        if need <= have {
            return Ok(());
        }
        let more = self.take(need - have)?;
        for &b in &more {
            self.refs[b as usize] = 1;
        }
        self.seqs[seq].as_mut().expect("live").extend(more);
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some(blocks) = self.seqs[seq].take() {
            self.release(blocks);
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let addr = self.addr(self.seqs[seq].as_ref().expect("live"), t);
        self.dev.write(addr, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let addr = self.addr(self.seqs[seq].as_ref().expect("live"), t);
        let mut b = [0u8; 8];
        self.dev.read(addr, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn physical_bytes(&self) -> u64 {
        self.dev.live_bytes()
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.dev.peak_bytes()
    }

    fn calls(&self) -> Calls {
        self.dev.calls()
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        0
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }

    fn extra(&self) -> Vec<(String, String)> {
        vec![
            ("num_blocks".into(), self.num_blocks.to_string()),
            ("block_tokens".into(), VLLM_BLOCK_TOKENS.to_string()),
            ("prefix_caching".into(), self.prefix_caching.to_string()),
            ("prefix_hit_blocks".into(), self.hit_blocks.to_string()),
            ("evicted_prefix_blocks".into(), self.evicted_blocks.to_string()),
            ("cached_prefixes".into(), self.cache.len().to_string()),
        ]
    }

    fn shared_live_bytes(&self) -> u64 {
        self.shared_live_blocks * VLLM_BLOCK_TOKENS * self.shape.kv_bytes_per_token
    }
}

// ------------------------------------------------ policies without an allocator

/// Contiguous KV with no allocator at all: physical memory is exactly the
/// sum of the tensors, and an admission or growth fails only when that sum
/// would pass the capacity. Two policies:
/// - `ideal-contiguous`: the PyTorch rows' growth policy (room for the next
///   power of two of tokens, at least 16, doubling with a copy of the
///   stored KV when full), so the gap between it and the PyTorch rows is
///   the allocator's;
/// - `contiguous-max`: room for prompt + `max_tokens` at admission (more if
///   a preempted request comes back longer), never grown, never copied.
///
/// Tags live in host vectors (there is no device memory to write through).
pub struct IdealMgr {
    name: &'static str,
    shape: KvShape,
    capacity: u64,
    /// `Some(n)`: contiguous-max with `n` output tokens of room.
    max_tokens: Option<u64>,
    /// Per sequence: token capacity of its tensors, and its tags.
    seqs: Vec<Option<(u64, Vec<u64>)>>,
    held: u64,
    peak: u64,
    copied: u64,
}

impl IdealMgr {
    pub fn new(name: &'static str, shape: KvShape, capacity: u64, max_tokens: Option<u64>) -> IdealMgr {
        IdealMgr { name, shape, capacity, max_tokens, seqs: Vec::new(), held: 0, peak: 0, copied: 0 }
    }

    /// Bytes of all of a request's tensors with room for `tokens`.
    fn bytes(&self, tokens: u64) -> u64 {
        tokens * self.shape.bpt() * self.shape.n_allocs()
    }

    fn hold(&mut self, more: u64) -> Result<(), Fail> {
        if self.held + more > self.capacity {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{more} more bytes needed, {} of {} held", self.held, self.capacity),
            });
        }
        self.held += more;
        self.peak = self.peak.max(self.held);
        Ok(())
    }
}

impl KvManager for IdealMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let cap = match self.max_tokens {
            Some(m) => tokens.max(q.prompt + m),
            None => pow2_tokens(tokens),
        };
        self.hold(self.bytes(cap))?;
        *slot_vec(&mut self.seqs, seq) = Some((cap, Vec::with_capacity(tokens as usize)));
        Ok(0)
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        let cap = self.seqs[seq].as_ref().expect("live").0;
        if tokens <= cap {
            return Ok(());
        }
        if self.max_tokens.is_some() {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("contiguous-max never grows: {tokens} tokens > room for {cap}"),
            });
        }
        let mut new_cap = cap * 2;
        while new_cap < tokens {
            new_cap *= 2;
        }
        // Old and new tensors coexist during the copy.
        self.hold(self.bytes(new_cap))?;
        self.held -= self.bytes(cap);
        self.copied += stored * self.shape.kv_bytes_per_token;
        self.seqs[seq].as_mut().expect("live").0 = new_cap;
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some((cap, _)) = self.seqs[seq].take() {
            self.held -= self.bytes(cap);
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let Some((cap, tags)) = self.seqs[seq].as_mut() else { return false };
        if t >= *cap {
            return false;
        }
        if tags.len() <= t as usize {
            tags.resize(t as usize + 1, 0);
        }
        tags[t as usize] = tag;
        true
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        self.seqs[seq].as_ref()?.1.get(t as usize).copied()
    }

    fn physical_bytes(&self) -> u64 {
        self.held
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.peak
    }

    fn calls(&self) -> Calls {
        Calls::default()
    }

    fn bytes_copied(&self) -> u64 {
        self.copied
    }

    fn moves(&self) -> u64 {
        0
    }
}

/// Every manager name the replay knows, in report order.
pub const ALL_MANAGERS: [&str; 8] = [
    "arena",
    "arena-no-moves",
    "arena-sync",
    "pytorch-caching",
    "pytorch-expandable",
    "vllm-paged",
    "ideal-contiguous",
    "contiguous-max",
];

/// What [`build`] needs besides the shape.
#[derive(Clone, Copy, Debug)]
pub struct BuildOptions {
    pub arena: ArenaOptions,
    /// vLLM's automatic prefix caching (on by default, as in vLLM).
    pub prefix_caching: bool,
    /// contiguous-max's output room (the trace's largest output by default).
    pub max_tokens: u64,
}

/// Builds a manager by name.
pub fn build(name: &str, shape: KvShape, o: BuildOptions) -> Result<Box<dyn KvManager + Send>, String> {
    let arena = o.arena;
    let cap = arena.capacity;
    Ok(match name {
        "arena" => Box::new(
            ArenaMgr::new("arena", shape, ArenaOptions { no_implicit_moves: false, ..arena }, ArenaMode::Stream)?
                .with_prefix_cache(o.prefix_caching),
        ),
        "arena-no-moves" => Box::new(
            ArenaMgr::new(
                "arena-no-moves",
                shape,
                ArenaOptions { no_implicit_moves: true, ..arena },
                ArenaMode::Stream,
            )?
            .with_prefix_cache(o.prefix_caching),
        ),
        "arena-sync" => Box::new(
            ArenaMgr::new("arena-sync", shape, ArenaOptions { no_implicit_moves: false, ..arena }, ArenaMode::Sync)?
                .with_prefix_cache(o.prefix_caching),
        ),
        "pytorch-caching" => Box::new(TorchMgr::new("pytorch-caching", shape, cap, false)?),
        "pytorch-expandable" => Box::new(TorchMgr::new("pytorch-expandable", shape, cap, true)?),
        "vllm-paged" => Box::new(VllmMgr::new(shape, cap, o.prefix_caching)?),
        "ideal-contiguous" => Box::new(IdealMgr::new("ideal-contiguous", shape, cap, None)),
        "contiguous-max" => Box::new(IdealMgr::new("contiguous-max", shape, cap, Some(o.max_tokens))),
        other => return Err(format!("unknown manager {other:?} (known: {})", ALL_MANAGERS.join(", "))),
    })
}
