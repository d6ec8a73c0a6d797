//! Several models served on one GPU, timed: each model has its own
//! continuous-batching scheduler and its own traffic, with intermittent
//! peaks, and the models share the device's KV memory through one of:
//!
//! - `static`: vLLM's paged pool per model, the memory split evenly (a
//!   model never holds more than its share, nor less);
//! - `kvcached`: one kvcached pool per model (the model of
//!   `managers/kvcached.rs`, prefix caching off as in kvcached's
//!   `bench_latency_benefit`), its pages mapped from the shared device when
//!   a block on them is needed and unmapped when the last one goes, each
//!   pool keeping its pre-mapped reserve of 5 to 10 pages;
//! - `arena`: one vmm-arena per model process, all on one device of the
//!   shared capacity, driven as `kv_serving`'s `arena` row drives it: one
//!   growable allocation per request (ordered on the engine's stream),
//!   reserved for the model's context and
//!   grown a 16-token block at a time (the decode batch's growth in one
//!   `resize_many_on_stream`), freed on the engine's stream when the
//!   request ends; between steps, retired ranges released and the prefetch
//!   target (chunks created ahead) brought back with `maintain`; freed
//!   chunks stay pooled up to the arena's retain watermark;
//! - `arena-shared`: the same with one arena for all models (one pool, the
//!   sum of the per-model watermarks; a model holds its allocations).
//!
//! Time: the models' steps time-share the GPU (one step at a time, the
//! models taken in turn), each step charged by the profile's step-time
//! model (`timing.rs`: prefill compute, the decode's weights and KV read;
//! each row's own attention layout, [`crate::step_charge::attn_layout`]:
//! `static` and `kvcached` are paged, the arena row as `--layout` says)
//! with its driver calls charged by the rule every replay shares
//! (`step_charge.rs`): each model's engine schedules asynchronously
//! ([`crate::step_charge::AsyncEngine`]), so a step's between-steps work is
//! its schedule's calls plus the frees and between-steps hooks that followed
//! the model's previous step, hidden up to the step's GPU time, none of it
//! hidden when a drain (a device synchronize: kvcached's before each unmap)
//! is among it. kvcached's pre-allocation thread runs between steps, off
//! the engine's thread: a step needing more pages than its reserve maps the
//! rest on the engine's thread. A decode that finds no memory preempts the
//! request admitted last (recomputed when admitted again, as vLLM V1 does).
//!
//! Traffic: model `m` replays its own slice of a trace (arrival gaps,
//! prompt and output lengths), its gaps scaled by `rate_scale`, and
//! divided by `peak` while it is in its peak phase: the phases rotate,
//! model `m` peaking during `[k·N·W + m·W, k·N·W + (m+1)·W)`.

use std::collections::{HashMap, VecDeque};

use vmm_arena::{Arena, ArenaConfig, Id};

use crate::attention::AttnLayout;
use crate::counted::Calls;
use crate::managers::kvcached::{BlockManager, SharedHbm, KVCACHED_GPU_UTILIZATION};
use crate::managers::kvcached_pool::{ElasticBlockPool, KvcachedPool, KVCACHED_BLOCK_TOKENS};
use crate::managers::{new_device, Dev, Layout, DEFAULT_PRECREATE, ENGINE_STREAM};
use crate::step_calls::{StepCallCounter, StepCallSummary};
use crate::step_charge::{attn_layout, AsyncEngine, DriverTally};
use crate::timing::{Profile, StepWork};
use crate::trace::Request;

pub mod plot;

/// One request of one model.
#[derive(Clone, Copy, Debug)]
pub struct MmRequest {
    pub arrival: f64,
    pub prompt: u64,
    pub output: u64,
}

/// The setting.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MmConfig {
    pub models: usize,
    /// KV bytes per token (Llama-3.1-8B: 32 layers × 2 × 8 heads × 128 × 2 B).
    pub kv_bytes_per_token: u64,
    pub layers: u64,
    /// The device's memory and what the models' KV may use of it in all.
    pub device_bytes: u64,
    pub kv_bytes: u64,
    pub step_tokens: u64,
    pub max_batch: usize,
    pub requests_per_model: usize,
    pub rate_scale: f64,
    pub peak: f64,
    pub phase_s: f64,
    pub arena_retain: u64,
    /// Tokens an arena allocation's reservation is sized for (the
    /// engine's `max_model_len`): it grows in place up to it.
    pub max_context: u64,
    /// The arena row's KV layout (token-major or block-in-chunk: the same
    /// memory, one allocation per request; attention reads them as their
    /// layouts say).
    #[serde(serialize_with = "layout_name")]
    pub arena_layout: Layout,
    /// Sleep of idle models (kvcached's router sleeps a model idle past a
    /// threshold): a model idle this long gives back the memory it keeps
    /// for later requests (kvcached's reserved pages, the arena's pool:
    /// `SharedKv::sleep`), so the others can use it; its next request wakes
    /// it, paying the maps it needs then. KV only: weights stay. `None`: off.
    pub sleep_after_s: Option<f64>,
}

fn layout_name<S: serde::Serializer>(l: &Layout, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(l.name())
}

/// Each model's requests: slices of `trace` `requests_per_model` apart,
/// with the phases of the module documentation.
pub fn model_requests(c: &MmConfig, trace: &[Request]) -> Vec<Vec<MmRequest>> {
    (0..c.models)
        .map(|m| {
            let n = c.requests_per_model.min(trace.len() / c.models);
            let slice = &trace[m * n..(m + 1) * n];
            let mut t = 0.0;
            let mut out = Vec::with_capacity(n);
            for (k, q) in slice.iter().enumerate() {
                if k > 0 {
                    let gap = (q.arrival_s - slice[k - 1].arrival_s).max(0.0) / c.rate_scale;
                    let phase = (t / c.phase_s) as u64 % c.models as u64;
                    t += if phase == m as u64 { gap / c.peak } else { gap };
                }
                out.push(MmRequest { arrival: t, prompt: q.prompt.max(1), output: q.output.max(1) });
            }
            out
        })
        .collect()
}

/// The KV memory of all models under one sharing policy.
pub trait SharedKv {
    fn name(&self) -> &'static str;
    /// Room for `tokens` tokens of request `rid` of model `m` (a new
    /// request, or more for a running one); false if there is none.
    fn reserve(&mut self, m: usize, rid: usize, tokens: u64) -> bool;
    fn free(&mut self, m: usize, rid: usize);
    /// Room for every request of `grows` (request, tokens) of model `m` at
    /// once, all or nothing; false where there is no batch form or it
    /// failed (the scheduler then grows them one by one).
    fn reserve_batch(&mut self, _m: usize, _grows: &[(usize, u64)]) -> bool {
        false
    }
    /// Physical bytes model `m` holds.
    fn held(&self, m: usize) -> u64;
    /// Driver calls made on the engines' threads so far, all models.
    fn path_calls(&self) -> Calls;
    /// Driver calls made on other threads so far (kvcached's
    /// pre-allocation thread), all models.
    fn background_calls(&self) -> Calls {
        Calls::default()
    }
    /// Model `m`'s work between its steps, while the GPU computes.
    fn between_steps(&mut self, _m: usize) {}
    /// Model `m` is idle and goes to sleep: memory kept for later requests
    /// goes back to the device (nothing by default).
    fn sleep(&mut self, _m: usize) {}
    /// The GPU finished a step (the stream events recorded in it complete).
    fn gpu_finished_step(&mut self) {}
    /// The KV layout attention kernels read.
    fn attn_layout(&self) -> AttnLayout {
        attn_layout(self.name(), Layout::TokenMajor)
    }
}

/// `static`: a fixed block budget per model.
pub struct StaticKv {
    per_model_blocks: u64,
    block_bytes: u64,
    used: Vec<u64>,
    blocks: HashMap<(usize, usize), u64>,
}

impl StaticKv {
    pub fn new(c: &MmConfig) -> StaticKv {
        let block_bytes = KVCACHED_BLOCK_TOKENS * c.kv_bytes_per_token;
        StaticKv {
            per_model_blocks: c.kv_bytes / c.models as u64 / block_bytes,
            block_bytes,
            used: vec![0; c.models],
            blocks: HashMap::new(),
        }
    }
}

impl SharedKv for StaticKv {
    fn name(&self) -> &'static str {
        "static"
    }
    fn reserve(&mut self, m: usize, rid: usize, tokens: u64) -> bool {
        let have = self.blocks.get(&(m, rid)).copied().unwrap_or(0);
        let need = tokens.div_ceil(KVCACHED_BLOCK_TOKENS).saturating_sub(have);
        if self.used[m] + need > self.per_model_blocks {
            return false;
        }
        self.used[m] += need;
        self.blocks.insert((m, rid), have + need);
        true
    }
    fn free(&mut self, m: usize, rid: usize) {
        if let Some(b) = self.blocks.remove(&(m, rid)) {
            self.used[m] -= b;
        }
    }
    fn held(&self, _m: usize) -> u64 {
        self.per_model_blocks * self.block_bytes
    }
    fn path_calls(&self) -> Calls {
        Calls::default()
    }
}

/// `kvcached`: a kvcached pool per model on one device.
pub struct KvcachedKv {
    pools: Vec<KvcachedPool>,
    admitted: HashMap<(usize, usize), u64>,
}

impl KvcachedKv {
    pub fn new(c: &MmConfig) -> Result<KvcachedKv, String> {
        // kvcached maps while the device's free memory exceeds the 5 %
        // headroom; the device is given what the KV may use plus that.
        let headroom = (c.device_bytes as f64 * (1.0 - KVCACHED_GPU_UTILIZATION)) as u64;
        let hbm = SharedHbm::new(c.device_bytes, c.kv_bytes + headroom);
        let per_buffer = KVCACHED_BLOCK_TOKENS * c.kv_bytes_per_token / (2 * c.layers);
        let num_blocks = c.kv_bytes / (KVCACHED_BLOCK_TOKENS * c.kv_bytes_per_token);
        let pools = (0..c.models)
            .map(|_| {
                let mut mgr = BlockManager::new(num_blocks, per_buffer, c.layers, hbm.clone())?;
                mgr.page_allocator.set_engine_threads(true);
                Ok(KvcachedPool::new(ElasticBlockPool::new(mgr, num_blocks, false, 0)))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(KvcachedKv { pools, admitted: HashMap::new() })
    }
}

impl SharedKv for KvcachedKv {
    fn name(&self) -> &'static str {
        "kvcached"
    }
    fn reserve(&mut self, m: usize, rid: usize, tokens: u64) -> bool {
        let p = &mut self.pools[m];
        if let std::collections::hash_map::Entry::Vacant(e) = self.admitted.entry((m, rid)) {
            if p.admit(rid as u64, std::sync::Arc::from(Vec::new()), tokens).is_none() {
                return false;
            }
            e.insert(tokens);
            return true;
        }
        p.decode(rid as u64, tokens)
    }
    fn free(&mut self, m: usize, rid: usize) {
        if self.admitted.remove(&(m, rid)).is_some() {
            self.pools[m].finish(rid as u64);
        }
    }
    fn held(&self, m: usize) -> u64 {
        self.pools[m].pool.mgr.mapped_bytes()
    }
    fn path_calls(&self) -> Calls {
        self.pools.iter().fold(Calls::default(), |a, p| a.plus(&p.pool.mgr.page_allocator.foreground_calls()))
    }
    fn background_calls(&self) -> Calls {
        self.pools.iter().fold(Calls::default(), |a, p| a.plus(&p.pool.mgr.page_allocator.background_calls()))
    }
    fn between_steps(&mut self, m: usize) {
        self.pools[m].pool.mgr.page_allocator.run_prealloc_thread();
    }
    fn sleep(&mut self, m: usize) {
        self.pools[m].pool.mgr.trim();
    }
}

/// `arena`: an arena per model on one counted device; `arena-shared`: one
/// arena all models allocate from (its pool shared: the sum of the
/// per-model watermarks).
pub struct ArenaKv {
    dev: Dev,
    arenas: Vec<Arena>,
    shared: bool,
    block_bytes: u64,
    max_bytes: u64,
    layout: Layout,
    allocs: HashMap<(usize, usize), (Id, u64)>,
    /// Errors of between-steps upkeep (`release_retired`, `maintain`):
    /// counted, not fatal (the next step retries).
    pub upkeep_errors: u64,
}

impl ArenaKv {
    /// An arena per model.
    pub fn new(c: &MmConfig) -> Result<ArenaKv, String> {
        Self::build(c, false)
    }

    /// One arena shared by every model.
    pub fn new_shared(c: &MmConfig) -> Result<ArenaKv, String> {
        Self::build(c, true)
    }

    fn build(c: &MmConfig, shared: bool) -> Result<ArenaKv, String> {
        let dev = new_device(c.kv_bytes)?;
        let block_bytes = KVCACHED_BLOCK_TOKENS * c.kv_bytes_per_token;
        let max_bytes = c.max_context.div_ceil(KVCACHED_BLOCK_TOKENS) * block_bytes;
        // Room for two full batches of reservations (address space only),
        // every model's in a shared arena.
        let (n, users) = if shared { (1, c.models as u64) } else { (c.models, 1) };
        let reserve = (c.kv_bytes * 4).max(2 * users * c.max_batch as u64 * max_bytes);
        let arenas = (0..n)
            .map(|_| {
                let cfg = ArenaConfig {
                    capacity_bytes: c.kv_bytes,
                    reserve_bytes: reserve,
                    retain_bytes: c.arena_retain.saturating_mul(users),
                    ..ArenaConfig::default()
                };
                let arena = Arena::with_driver(dev.clone(), cfg).map_err(|e| format!("arena: {e}"))?;
                // kv_serving's arena row: chunks created ahead for
                // admissions, nothing mapped ahead of the growing tensors.
                arena.set_prefetch(DEFAULT_PRECREATE, 0).map_err(|e| format!("set_prefetch: {e}"))?;
                Ok(arena)
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(ArenaKv {
            dev,
            arenas,
            shared,
            block_bytes,
            max_bytes,
            layout: c.arena_layout,
            allocs: HashMap::new(),
            upkeep_errors: 0,
        })
    }

    /// The arena model `m` allocates from.
    fn arena(&self, m: usize) -> &Arena {
        &self.arenas[if self.shared { 0 } else { m }]
    }
}

impl SharedKv for ArenaKv {
    fn name(&self) -> &'static str {
        if self.shared {
            "arena-shared"
        } else {
            "arena"
        }
    }
    fn reserve(&mut self, m: usize, rid: usize, tokens: u64) -> bool {
        let size = tokens.div_ceil(KVCACHED_BLOCK_TOKENS) * self.block_bytes;
        match self.allocs.get(&(m, rid)).copied() {
            None => match self.arena(m).alloc_growable_on_stream(size, size.max(self.max_bytes), ENGINE_STREAM) {
                Ok((id, _)) => {
                    self.allocs.insert((m, rid), (id, size));
                    true
                }
                Err(_) => false,
            },
            Some((_, have)) if have >= size => true,
            Some((id, _)) => {
                if self.arena(m).resize_on_stream(id, size, ENGINE_STREAM).is_err() {
                    return false;
                }
                self.allocs.insert((m, rid), (id, size));
                true
            }
        }
    }
    fn reserve_batch(&mut self, m: usize, grows: &[(usize, u64)]) -> bool {
        let mut targets: Vec<(Id, u64)> = Vec::new();
        let mut grown: Vec<(usize, Id, u64)> = Vec::new();
        for &(rid, tokens) in grows {
            let size = tokens.div_ceil(KVCACHED_BLOCK_TOKENS) * self.block_bytes;
            match self.allocs.get(&(m, rid)) {
                Some(&(id, have)) if have < size => {
                    targets.push((id, size));
                    grown.push((rid, id, size));
                }
                Some(_) => {}
                None => return false,
            }
        }
        if targets.is_empty() {
            return true;
        }
        if self.arena(m).resize_many_on_stream(&targets, ENGINE_STREAM).is_err() {
            return false;
        }
        for (rid, id, size) in grown {
            self.allocs.insert((m, rid), (id, size));
        }
        true
    }
    fn free(&mut self, m: usize, rid: usize) {
        if let Some((id, _)) = self.allocs.remove(&(m, rid)) {
            if self.arena(m).free_on_stream(id, ENGINE_STREAM).is_err() {
                self.upkeep_errors += 1;
            }
        }
    }
    fn held(&self, m: usize) -> u64 {
        if self.shared {
            // The pool is everyone's: a model holds its allocations.
            return self.allocs.iter().filter(|((k, _), _)| *k == m).map(|(_, &(_, size))| size).sum();
        }
        self.arena(m).stats().map_or(0, |s| s.mapped_bytes + s.pooled_bytes)
    }
    fn path_calls(&self) -> Calls {
        self.dev.calls()
    }
    fn between_steps(&mut self, m: usize) {
        let a = self.arena(m);
        if a.release_retired().is_err() || a.maintain().is_err() {
            self.upkeep_errors += 1;
        }
    }
    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }
    fn sleep(&mut self, m: usize) {
        // A shared arena's pool serves the models still awake.
        if !self.shared && self.arena(m).trim(0).is_err() {
            self.upkeep_errors += 1;
        }
    }
    fn attn_layout(&self) -> AttnLayout {
        attn_layout(self.name(), self.layout)
    }
}

/// One model's figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ModelReport {
    pub model: usize,
    pub requests: usize,
    /// Requests that finished.
    pub served: usize,
    pub ttft_mean_s: f64,
    pub ttft_p99_s: f64,
    pub tpot_p99_s: f64,
    pub tokens_per_s: f64,
    pub preemptions: u64,
    pub peak_held_bytes: u64,
    /// Driver time charged to this model's steps.
    pub driver_charged_s: f64,
    /// Times the model went to sleep (`MmConfig::sleep_after_s`).
    pub sleeps: u64,
}

/// A run's figures and its memory timeline: (time, bytes held per model).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MmReport {
    pub manager: String,
    pub makespan_s: f64,
    /// Driver time charged to steps (`driver.charged_s`).
    pub driver_s: f64,
    /// The run's driver time by the shared rule (`step_charge.rs`).
    pub driver: DriverTally,
    /// The attention layout the row's steps were priced with.
    pub attn_layout: AttnLayout,
    /// Driver calls per step (every model's steps; each computes tokens),
    /// the calls the step was charged with (`step_calls.rs`); calls of a
    /// background thread (kvcached's) are no step's and are left out.
    pub decode_step_calls: StepCallSummary,
    pub models: Vec<ModelReport>,
    #[serde(skip)]
    pub timeline: Vec<(f64, Vec<u64>)>,
}

struct Running {
    rid: usize,
    /// Output tokens produced (the first by the prefill).
    done: u64,
}

struct ModelState {
    waiting: VecDeque<usize>,
    next: usize,
    running: Vec<Running>,
    first_token: Vec<Option<f64>>,
    finish: Vec<Option<f64>>,
    preemptions: u64,
    peak: u64,
    driver_charged_s: f64,
    /// Since when the model has had nothing to run, and whether it sleeps.
    idle_since: Option<f64>,
    asleep: bool,
    sleeps: u64,
    /// Output tokens of preempted requests, recomputed on readmission.
    resumed: HashMap<usize, u64>,
}

fn p99(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}

/// Runs every model's requests through `kv` on `profile`'s GPU.
pub fn run(c: &MmConfig, reqs: &[Vec<MmRequest>], kv: &mut dyn SharedKv, profile: &Profile) -> MmReport {
    let mut row_profile = profile.clone();
    row_profile.attn_layout = kv.attn_layout();
    let profile = &row_profile;
    let mut engines = vec![AsyncEngine::default(); c.models];
    let mut tally = DriverTally::default();
    let mut step_calls = StepCallCounter::default();
    let mut st: Vec<ModelState> = reqs
        .iter()
        .map(|r| ModelState {
            waiting: VecDeque::new(),
            next: 0,
            running: Vec::new(),
            first_token: vec![None; r.len()],
            finish: vec![None; r.len()],
            preemptions: 0,
            peak: 0,
            driver_charged_s: 0.0,
            idle_since: Some(0.0),
            asleep: false,
            sleeps: 0,
            resumed: HashMap::new(),
        })
        .collect();
    let mut t = 0.0f64;
    let mut timeline = Vec::new();
    let mut turn = 0usize;
    let busy = |s: &ModelState| !s.running.is_empty() || !s.waiting.is_empty();
    loop {
        // Sleep first: a model idle past the threshold slept before the
        // arrivals of now (which wake it).
        for (m, s) in st.iter_mut().enumerate() {
            if busy(s) {
                (s.idle_since, s.asleep) = (None, false);
                continue;
            }
            let due = match (c.sleep_after_s, s.idle_since) {
                (Some(after), Some(since)) => !s.asleep && t - since >= after,
                _ => false,
            };
            if due {
                // Idle: what sleep does waits for nothing.
                let before = kv.path_calls();
                kv.sleep(m);
                engines[m].after_step(&kv.path_calls().since(&before));
                engines[m].went_idle(profile, &mut tally);
                s.asleep = true;
                s.sleeps += 1;
            }
        }
        for (m, s) in st.iter_mut().enumerate() {
            while s.next < reqs[m].len() && reqs[m][s.next].arrival <= t {
                s.waiting.push_back(s.next);
                s.next += 1;
            }
        }
        if !st.iter().any(busy) {
            let next = st
                .iter()
                .enumerate()
                .filter(|(m, s)| s.next < reqs[*m].len())
                .map(|(m, s)| reqs[m][s.next].arrival)
                .fold(f64::INFINITY, f64::min);
            if next.is_infinite() {
                break;
            }
            // The GPU idles until then: what it was given has completed.
            kv.gpu_finished_step();
            t = next;
            continue;
        }
        // The next model with work, in turn.
        let m = (0..c.models).map(|k| (turn + k) % c.models).find(|&k| busy(&st[k])).expect("a busy model");
        turn = m + 1;
        let calls_before = kv.path_calls();
        let s = &mut st[m];
        // Decodes first, in running order: the batch's growth at once where
        // the manager has a batch form; then one by one, a request that
        // finds no memory preempting the one admitted last (itself if it
        // is the last).
        let grows: Vec<(usize, u64)> = s.running.iter().map(|r| (r.rid, reqs[m][r.rid].prompt + r.done)).collect();
        if !grows.is_empty() {
            kv.reserve_batch(m, &grows);
        }
        let mut i = 0;
        while i < s.running.len() {
            let r = &s.running[i];
            let q = reqs[m][r.rid];
            if kv.reserve(m, r.rid, q.prompt + r.done) {
                i += 1;
                continue;
            }
            let victim = s.running.pop().expect("running");
            kv.free(m, victim.rid);
            s.resumed.insert(victim.rid, victim.done);
            s.waiting.push_front(victim.rid);
            s.preemptions += 1;
        }
        // The step's work as `timing.rs` prices it: each decode over its
        // context (KV read, attention FLOPs), each admission's prompt
        // (linear and causal attention FLOPs).
        let mut work = StepWork::default();
        for r in &s.running {
            let context = reqs[m][r.rid].prompt + r.done;
            work.add_decode(context, context * c.kv_bytes_per_token);
        }
        let decoding = !s.running.is_empty();
        // Admissions while the step's tokens and the batch allow.
        let mut prefill = 0u64;
        let mut admitted = Vec::new();
        while s.running.len() + admitted.len() < c.max_batch {
            let Some(&rid) = s.waiting.front() else { break };
            let q = reqs[m][rid];
            let done = s.resumed.get(&rid).copied().unwrap_or(0);
            let tokens = q.prompt + done;
            if prefill + tokens > c.step_tokens && (prefill > 0 || decoding) {
                break;
            }
            if !kv.reserve(m, rid, tokens) {
                break;
            }
            s.waiting.pop_front();
            s.resumed.remove(&rid);
            prefill += tokens;
            work.add_prefill(0, tokens);
            work.decode_kv_bytes += tokens * c.kv_bytes_per_token;
            admitted.push((rid, done));
        }
        let schedule = kv.path_calls().since(&calls_before);
        if !s.running.is_empty() || !admitted.is_empty() {
            step_calls.add(&engines[m].pending().plus(&schedule));
        }
        let step = engines[m].charge(profile, &mut work, &schedule, &mut tally);
        s.driver_charged_s += step.alloc_charged_s;
        t += step.total_s;
        kv.gpu_finished_step();
        // After the step: its finished requests freed, then the model's
        // between-steps work (the next step's between-steps calls).
        let after_before = kv.path_calls();
        let background_before = kv.background_calls();
        for r in s.running.iter_mut() {
            r.done += 1;
        }
        for (rid, done) in admitted {
            if s.first_token[rid].is_none() {
                s.first_token[rid] = Some(t);
            }
            s.running.push(Running { rid, done: done + 1 });
        }
        let mut k = 0;
        while k < s.running.len() {
            let rid = s.running[k].rid;
            if s.running[k].done >= reqs[m][rid].output {
                kv.free(m, rid);
                s.finish[rid] = Some(t);
                s.running.remove(k);
            } else {
                k += 1;
            }
        }
        kv.between_steps(m);
        engines[m].after_step(&kv.path_calls().since(&after_before));
        if s.running.is_empty() && s.waiting.is_empty() {
            engines[m].went_idle(profile, &mut tally);
            s.idle_since = Some(t);
        }
        tally.add_background(profile, &kv.background_calls().since(&background_before));
        let held: Vec<u64> = (0..c.models).map(|k| kv.held(k)).collect();
        for (k, h) in held.iter().enumerate() {
            st[k].peak = st[k].peak.max(*h);
        }
        if timeline.last().map_or(true, |(lt, _): &(f64, Vec<u64>)| t - lt >= 0.25) {
            timeline.push((t, held));
        }
    }
    let models = st
        .iter()
        .enumerate()
        .map(|(m, s)| {
            let r = &reqs[m];
            let ttft: Vec<f64> = r.iter().zip(&s.first_token).filter_map(|(q, f)| f.map(|f| f - q.arrival)).collect();
            let tpot: Vec<f64> = r
                .iter()
                .zip(s.first_token.iter().zip(&s.finish))
                .filter(|(q, _)| q.output > 1)
                .filter_map(|(q, (f, e))| Some((e.as_ref()? - f.as_ref()?) / (q.output - 1) as f64))
                .collect();
            let out: u64 = r.iter().map(|q| q.output).sum();
            let end = s.finish.iter().flatten().fold(0.0f64, |a, &b| a.max(b));
            let start = r.first().map_or(0.0, |q| q.arrival);
            ModelReport {
                model: m,
                requests: r.len(),
                served: s.finish.iter().flatten().count(),
                ttft_mean_s: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
                ttft_p99_s: p99(ttft),
                tpot_p99_s: p99(tpot),
                tokens_per_s: out as f64 / (end - start).max(1e-9),
                preemptions: s.preemptions,
                peak_held_bytes: s.peak,
                driver_charged_s: s.driver_charged_s,
                sleeps: s.sleeps,
            }
        })
        .collect();
    // Idle: the last step has run (its stream-ordered frees complete), and
    // each model's between-steps work waits for nothing now.
    kv.gpu_finished_step();
    for (m, e) in engines.iter_mut().enumerate() {
        let before = kv.path_calls();
        kv.between_steps(m);
        e.after_step(&kv.path_calls().since(&before));
        e.went_idle(profile, &mut tally);
    }
    MmReport {
        manager: kv.name().into(),
        makespan_s: t,
        driver_s: tally.charged_s,
        driver: tally,
        attn_layout: profile.attn_layout,
        decode_step_calls: step_calls.summary(),
        models,
        timeline,
    }
}
