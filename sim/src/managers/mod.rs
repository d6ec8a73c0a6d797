//! KV-cache managers driven by the replay: vmm-arena (with and without
//! implicit moves, driven with stream-ordered frees, prefetch and batch
//! growth; and `arena-sync`, driven as before), `arena-paged` (vLLM's block
//! pool over the arena's chunks, read through a block table:
//! `arena_paged.rs`, policy shared with `vllm-paged` in `paged.rs`) and the
//! baselines — PyTorch's caching allocator (native and expandable segments)
//! holding each request's KV as contiguous tensors grown by doubling with a
//! copy, and vLLM's static block pool.
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

use super::arena_prefix_cache::ArenaPrefixCache;
use super::caching::CachingAllocator;
use super::counted::{is_host_limit, Calls, Counted};
use super::prepared::{Prepared, PreparedAdmissions, Take};
use super::replay::{admission_tokens, Budget};
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
    /// One allocation per request, a token's KV of every layer together.
    TokenMajor,
    /// One allocation per layer and per K/V.
    PerLayer,
    /// One allocation per request of whole chunks, each chunk one block of
    /// a paged kernel's block table: its tokens laid out layer-major inside
    /// it (`vmm_arena::layout`). Memory as token-major's where a chunk holds
    /// a whole number of tokens (checked by the CLI); attention reads it as
    /// a paged kernel does.
    BlockInChunk,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::TokenMajor => "token-major",
            Layout::PerLayer => "per-layer",
            Layout::BlockInChunk => "block-in-chunk",
        }
    }

    /// Whether a request's KV is one allocation (every layout but per-layer).
    pub fn one_allocation(self) -> bool {
        self != Layout::PerLayer
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
            Layout::TokenMajor | Layout::BlockInChunk => 1,
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

/// What the step being computed leaves for between-steps work: its GPU
/// time, and the prices of driver calls (the profile's); and the next
/// step's token budget left for admissions once its running requests have
/// theirs (chunked prefill; `u64::MAX`: whole prompts).
#[derive(Clone, Copy, Debug)]
pub struct StepBudget<'a> {
    pub gpu_s: f64,
    pub profile: &'a super::timing::Profile,
    pub tokens_left: u64,
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
    /// The counting device a manager of one device runs on: the next three
    /// read it. A manager without one (or with several) implements them.
    fn counting_device(&self) -> Option<&Dev> {
        None
    }
    fn physical_bytes(&self) -> u64 {
        self.counting_device().expect("a manager without one counting device implements physical_bytes").live_bytes()
    }
    fn peak_physical_bytes(&self) -> u64 {
        self.counting_device()
            .expect("a manager without one counting device implements peak_physical_bytes")
            .peak_bytes()
    }
    fn calls(&self) -> Calls {
        self.counting_device().expect("a manager without one counting device implements calls").calls()
    }
    fn bytes_copied(&self) -> u64;
    fn moves(&self) -> u64;
    /// How many requests wait for admission as the next step is prepared
    /// (called just before [`KvManager::between_steps`]).
    fn waiting_requests(&mut self, _n: usize) {}
    /// Called after the scheduler has prepared a step, while the GPU
    /// computes it: driver work here is hidden up to the step's GPU time
    /// (see `timing.rs`). The point where an engine lets the arena unmap the
    /// old addresses of moved allocations.
    fn between_steps(&mut self) {}
    /// Called between steps, just before [`KvManager::between_steps`] (its
    /// driver time is counted and hidden as that hook's), with the front of
    /// the waiting queue that the next step's admission will try first, in
    /// order (`seq`, the tokens it stores before it decodes, request), no
    /// more than the batch has room for, and only when admission will be
    /// tried. The tokens each asks of [`KvManager::admit`] follow from its
    /// hit and the budget ([`super::replay::admission_tokens`] with
    /// `budget.tokens_left`, request after request: `total + 1` for whole
    /// prompts). Nothing changes the manager between this call and that
    /// admission (new arrivals join the queue's tail), so a manager may do
    /// the admissions' memory work now, while the GPU computes, and hand the
    /// results out from `admit`, as an engine with asynchronous scheduling
    /// schedules step k+1 while step k runs (vLLM V1's async scheduling).
    /// It must give each request the outcome `admit` would have given it
    /// then, unless it asks the replay to wait ([`KvManager::admission_ready`]).
    /// `budget` is the GPU time of the step being computed and the prices
    /// of driver calls: the between-steps time the step can hide. The
    /// default does nothing: `admit` does the work.
    fn prepare_admissions(&mut self, front: &[(usize, u64, &Request)], budget: &StepBudget<'_>) {
        let _ = (front, budget);
    }
    /// Chunked prefill: the prompt tokens [`KvManager::admit`] would find
    /// cached for request `seq` now (nothing is counted or changed; for an
    /// admission prepared between steps, the hit it was prepared with), so
    /// that the scheduler sizes the first chunk past them. The default:
    /// none.
    fn prefix_hit(&mut self, seq: usize, q: &Request) -> u64 {
        let _ = (seq, q);
        0
    }
    /// Whole prompts: called between steps, after
    /// [`KvManager::prepare_admissions`], with the decode growth the next
    /// step asks of every running request (as [`KvManager::prepare_growth`]
    /// takes it), which that step makes after its admissions. A manager may
    /// make it now where that cannot change what those admissions find (room
    /// is left for them); the next step's growth then finds it done. Nothing
    /// may fail here. The default does nothing.
    fn prepare_decode_growth(&mut self, _grows: &[(usize, u64, u64)]) {}
    /// Chunked prefill: called between steps, before
    /// [`KvManager::prepare_admissions`], with the growth the next step
    /// asks of every running request (`seq`, `tokens`, `stored`, as
    /// [`KvManager::grow`] takes them, in running order), which that step
    /// does before it admits. A manager may make that room now, while the
    /// GPU computes (its driver time is counted and hidden as
    /// `between_steps`'); the next step's `grow` then finds it done.
    /// Nothing may fail here: what it cannot do now, `grow` does then
    /// (and a manager that prepares admissions must not prepare any then:
    /// that growth comes before them). The default does nothing.
    fn prepare_growth(&mut self, grows: &[(usize, u64, u64)], budget: &StepBudget<'_>) {
        let _ = (grows, budget);
    }
    /// Asked before each admission while requests run: whether the
    /// request's KV is ready to be admitted now. A manager that maps an
    /// admission's memory over several steps, within what each step's GPU
    /// time hides (`prepare_admissions`), answers no until it is mapped;
    /// admission then stops for this step (the queue stays in order), as
    /// an engine waits for a request's KV before scheduling it. Nothing
    /// waits when no request runs (there is no GPU time to hide under).
    /// The default: always ready.
    fn admission_ready(&mut self, seq: usize, tokens: u64) -> bool {
        let _ = (seq, tokens);
        true
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
    // Both prefix caches (vLLM's, and the arena's in a one-allocation
    // layout) keep the tags of cached blocks resident.
    let caches =
        |m: &str| m == "vllm-paged" || m == "arena-paged" || (m.starts_with("arena") && shape.layout.one_allocation());
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

mod arena;
mod arena_paged;
mod ideal;
pub mod kvcached;
pub mod kvcached_pool;
pub mod paged;
mod torch;
mod vllm;

pub use arena::*;
pub use arena_paged::*;
pub use ideal::*;
pub use torch::*;
pub use vllm::*;

/// Every manager name the replay knows, in report order.
pub const ALL_MANAGERS: [&str; 10] = [
    "arena",
    "arena-paged",
    "arena-no-moves",
    "arena-staged",
    "arena-sync",
    "pytorch-caching",
    "pytorch-expandable",
    "vllm-paged",
    "ideal-contiguous",
    "contiguous-max",
];

/// Managers the replay knows but does not run unless named: comparisons.
/// `arena-no-admission-ahead` is `arena` without admission map-ahead.
pub const EXTRA_MANAGERS: [&str; 1] = ["arena-no-admission-ahead"];

/// Whether the replay knows the manager `name`.
pub fn is_known(name: &str) -> bool {
    ALL_MANAGERS.contains(&name) || EXTRA_MANAGERS.contains(&name)
}

/// Every known manager name, for messages.
pub fn known_names() -> String {
    ALL_MANAGERS.iter().chain(EXTRA_MANAGERS.iter()).copied().collect::<Vec<_>>().join(", ")
}

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
        "arena-no-admission-ahead" => Box::new(
            ArenaMgr::new(
                "arena-no-admission-ahead",
                shape,
                ArenaOptions { no_implicit_moves: false, ..arena },
                ArenaMode::Stream,
            )?
            .with_prefix_cache(o.prefix_caching)
            .without_admission_windows(),
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
        "arena-staged" => Box::new(
            ArenaMgr::new(
                "arena-staged",
                shape,
                ArenaOptions { no_implicit_moves: false, ..arena },
                ArenaMode::Stream,
            )?
            .with_prefix_cache(o.prefix_caching)
            .with_staged_admissions(),
        ),
        "arena-sync" => Box::new(
            ArenaMgr::new("arena-sync", shape, ArenaOptions { no_implicit_moves: false, ..arena }, ArenaMode::Sync)?
                .with_prefix_cache(o.prefix_caching),
        ),
        "arena-paged" => Box::new(ArenaPagedMgr::new(shape, arena, o.prefix_caching)?),
        "pytorch-caching" => Box::new(TorchMgr::new("pytorch-caching", shape, cap, false)?),
        "pytorch-expandable" => Box::new(TorchMgr::new("pytorch-expandable", shape, cap, true)?),
        "vllm-paged" => Box::new(VllmMgr::new(shape, cap, o.prefix_caching)?),
        "ideal-contiguous" => Box::new(IdealMgr::new("ideal-contiguous", shape, cap, None)),
        "contiguous-max" => Box::new(IdealMgr::new("contiguous-max", shape, cap, Some(o.max_tokens))),
        other => return Err(format!("unknown manager {other:?} (known: {})", known_names())),
    })
}
