//! The continuous-batching scheduler, the same for every manager.
//!
//! Each step (its duration comes from the step-time model, `timing.rs`):
//! 1. requests whose arrival time has come join the waiting queue;
//! 2. waiting requests are admitted in order while the batch has room
//!    (`max_batch`) and the manager can allocate their KV (prompt, plus the
//!    tokens generated before a preemption, plus room for the next token);
//!    their prompt is computed in this step (prefill, or recompute after a
//!    preemption), less the tokens a prefix cache already holds;
//!    admission stops at the first request that does not fit (a request that
//!    does not fit even into an empty batch can never run and is rejected),
//!    and is not tried again until some KV has been freed (an engine does
//!    not probe a full device every step; this also keeps the models' retry
//!    paths from being charged for probes); while requests run, admission
//!    also stops, without a failure, at a request whose manager has not
//!    finished mapping its KV (`admission_ready`: the arena row maps an
//!    admission over several steps, within what their GPU time hides);
//! 3. every running request appends one token: the manager grows its KV
//!    (first all of them at once where it has a batch form, `grow_batch`;
//!    then, or where that fails, one by one) and
//!    the token's tag is written through the mapping. When growth fails,
//!    the most recently admitted running request is preempted — its tags are
//!    verified, its KV freed, and it goes back to the front of the waiting
//!    queue to recompute — and the growth is retried, as vLLM's scheduler
//!    does (`vllm/v1/core/sched/scheduler.py`: `preempted_req =
//!    self.running.pop()`, `self.waiting.prepend_request(...)`);
//! 4. a request that has generated all its tokens has every tag verified and
//!    its KV freed.
//!
//! 5. while the GPU computes: the manager may prepare the next step's
//!    admissions (`prepare_admissions`, with the waiting queue's front, at
//!    most the batch's room, with the token counts step 2 will ask for, and
//!    only when step 2 will try admission: not while it is blocked; with
//!    the step's GPU time, the between-steps time it can hide), then
//!    its `between_steps` hook runs. Nothing happens between this and the
//!    next step's admission but arrivals joining the queue's tail, so a
//!    prepared admission has the outcome it would have had there (the
//!    arena rows prepare; vLLM V1's asynchronous scheduling likewise
//!    schedules step k+1 while step k runs);
//! 6. the step's time is charged, and the manager learns that the GPU has
//!    finished it (`gpu_finished_step`: the stream events recorded during
//!    it complete, see `counted.rs`).
//!
//! The driver calls of steps 2 to 4 are the allocator's critical path; those
//! of step 5 (prepared admissions included) hide under the GPU's time,
//! unless a drain happens there (see `timing.rs` for the rule).
//!
//! That is the whole-prompt schedule (`max_num_batched_tokens` 0). With a
//! token budget the replay schedules chunked prefill as vLLM V1 does
//! (sim/DESIGN.md, "Chunked prefill"): the running requests take the budget
//! first, in order (one token to decode, or the next chunk of a prompt),
//! and grow first; admission follows only if that growth preempted
//! nothing, into the budget left, allocating a request's hit and first
//! chunk only ([`admission_tokens`], with the hit from
//! [`KvManager::prefix_hit`]); requests that end in the step are freed
//! once it has run; a request whose growth fails while it runs alone is
//! rejected; between steps the manager may make the next step's growth
//! too ([`KvManager::prepare_growth`]).
//!
//! A step is *warm* when its instantaneous peak of live KV does not exceed
//! that of an earlier step: the memory it needs has been needed before, so a
//! manager that keeps memory should not have to create any. Chunk creations
//! on the critical path of warm steps are reported apart
//! (`critical_path_creates_warm`).
//! Idle time (nothing running or waiting) is skipped to the next arrival.
//!
//! Each token's KV slot holds a tag. A prompt token inside a full, named
//! hash block (Mooncake) gets a tag of its content (the block's hash and
//! the position), so that a prefix cache sharing that block verifies for
//! every request that uses it; every other token's tag is its request's.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::counted::Calls;
use super::managers::{Fail, KvManager, StepBudget};
use super::step_calls::{StepCallCounter, StepCallSummary};
use super::step_charge::{charge_step, DriverTally, StepCalls};
use super::timing::{Profile, StepWork};
use super::trace::{Request, HASH_BLOCK_TOKENS};
use super::util::mix64;

/// Scheduler settings.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    pub max_batch: usize,
    pub kv_bytes_per_token: u64,
    /// The step-time model's constants.
    pub profile: Profile,
    /// Chunked prefill: the most tokens one step computes (prefill chunks
    /// and one per decoding request), as vLLM V1's `max_num_batched_tokens`
    /// (8192 for its API server on an H100/H200-class GPU); 0 computes a
    /// whole prompt in its admission step. See the module documentation.
    pub max_num_batched_tokens: u64,
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrivals {
    /// At their trace times (an open loop).
    Trace,
    /// A closed-loop client of fixed concurrency, as a benchmark client
    /// with `--max-concurrency`: requests join in trace order whenever
    /// fewer than `concurrency` are in the system (waiting or running; a
    /// preempted request stays in it), so a new one arrives as soon as one
    /// finishes. Trace times are ignored; a request's arrival is when it
    /// joined.
    ClosedLoop { concurrency: usize },
}

/// What one manager did over the whole trace.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunResult {
    pub name: String,
    pub completed_requests: u64,
    pub rejected_requests: u64,
    pub preemptions: u64,
    pub admission_failures: u64,
    pub growth_failures: u64,
    pub fragmentation_failures: u64,
    /// Failures of the host simulation (a system limit), not of a policy.
    pub host_limit_failures: u64,
    /// Largest KV held by running requests at any instant (sampled at every
    /// admission and growth, before frees), in bytes; a shared prefix
    /// counts once per request using it.
    pub peak_live_bytes: u64,
    /// The same, sampled only at the end of each step (after its frees).
    pub peak_live_end_of_step_bytes: u64,
    /// Largest *distinct* live KV (sampled as `peak_live_bytes`): a prefix
    /// that several running requests map counts once
    /// ([`KvManager::shared_live_bytes`]).
    pub peak_distinct_live_bytes: u64,
    /// Largest KV that several running requests mapped at once, counted
    /// once per request beyond the first (what sharing saved at that time).
    pub peak_shared_live_bytes: u64,
    pub peak_physical_bytes: u64,
    pub mean_physical_bytes: f64,
    pub mean_live_bytes: f64,
    pub mean_waste_fraction: f64,
    pub final_physical_bytes: u64,
    /// Seconds from arrival to the last token, mean and 99th percentile.
    pub mean_latency_s: f64,
    pub p99_latency_s: f64,
    /// Seconds from arrival to first admission (queueing), mean.
    pub mean_queue_s: f64,
    /// Output tokens per simulated second.
    pub tokens_per_s: f64,
    pub output_tokens: u64,
    /// Time to first token (arrival to the end of the step that produced it).
    pub ttft_mean_s: f64,
    pub ttft_p99_s: f64,
    /// Time per output token after the first, per request.
    pub tpot_mean_s: f64,
    pub tpot_p99_s: f64,
    pub step_time_p50_s: f64,
    pub step_time_p99_s: f64,
    pub step_time_max_s: f64,
    /// Allocator time charged to steps (critical path, plus between-steps
    /// work the GPU did not hide), and between-steps time hidden.
    pub critical_path_alloc_s: f64,
    pub overlapped_alloc_s: f64,
    /// Synchronizes on the critical path (each costs its step the overlap).
    pub critical_path_syncs: u64,
    /// Waits on stream events not yet complete, on the critical path (each
    /// costs its step the overlap, like a synchronize).
    pub critical_path_event_waits: u64,
    /// Drains (synchronizes, blocking event waits) between steps (the step
    /// hides none of its between-steps driver time then).
    pub between_steps_drains: u64,
    /// Steps whose admission stopped because the front request's KV was
    /// not mapped yet (`KvManager::admission_ready`).
    #[serde(default)]
    pub admissions_waiting_for_kv: u64,
    /// Chunk creations on the critical path, in all steps and in warm steps
    /// (see the module docs).
    pub critical_path_creates: u64,
    pub critical_path_creates_warm: u64,
    pub warm_steps: u64,
    /// Driver calls per decode step (map, unmap, create, release,
    /// set_access; critical and between-steps together), over every decode
    /// step and over the warm ones (`step_calls.rs`).
    #[serde(default)]
    pub decode_step_calls: StepCallSummary,
    #[serde(default)]
    pub warm_decode_step_calls: StepCallSummary,
    /// Driver calls made on the critical path and between steps.
    pub critical_calls: Calls,
    pub between_calls: Calls,
    /// The sum of the steps' times (the simulated time less idle gaps), and
    /// the share of it that is allocator time charged.
    pub step_seconds: f64,
    pub critical_path_alloc_fraction: f64,
    /// Peak physical memory over the instantaneous peak of live KV.
    pub footprint_over_peak_live: f64,
    /// Decode steps whose batch growth failed (then grown one by one).
    pub batch_growth_failures: u64,
    /// Prompt tokens found in a prefix cache (not computed), and their share
    /// of all prompt tokens admitted (re-admissions included).
    pub prefix_hit_tokens: u64,
    pub prompt_tokens: u64,
    pub prefix_hit_rate: f64,
    /// The same for requests' first admissions only: a request re-admitted
    /// after a preemption finds much of its own prompt cached, so a manager
    /// that preempts more gains hits from it; this rate leaves that out.
    #[serde(default)]
    pub first_admission_hit_tokens: u64,
    #[serde(default)]
    pub first_admission_prompt_tokens: u64,
    #[serde(default)]
    pub first_admission_hit_rate: f64,
    /// Tokens computed again after preemptions.
    pub recomputed_tokens: u64,
    /// Prompt tokens computed (prefill and recompute, less prefix hits).
    pub prefill_tokens: u64,
    /// GPU time of all steps, and the simulated time they add up to.
    pub gpu_seconds: f64,
    pub bytes_copied: u64,
    pub moves: u64,
    pub calls: Calls,
    pub integrity_errors: u64,
    pub tags_written: u64,
    pub wall_seconds: f64,
    pub steps: u64,
    pub simulated_seconds: f64,
    pub first_fragmentation: Option<String>,
    pub first_host_limit: Option<String>,
    /// The most requests in the system (waiting or running) at a step's
    /// start: at most the concurrency of a closed loop.
    #[serde(default)]
    pub peak_in_system: u64,
    pub aborted: Option<String>,
    pub extra: Vec<(String, String)>,
}

/// The tag of token `t` of request `seq`: distinct for every (request, token).
pub fn tag(seq: usize, t: u64) -> u64 {
    mix64(((seq as u64) << 32) ^ t ^ 0x7a67_0000_0000_0000) | 1
}

/// The tag token `t` of request `q` (trace index `seq`) stores: its
/// content's where a named hash block defines it (see the module docs).
pub fn token_tag(q: &Request, seq: usize, t: u64) -> u64 {
    let b = t / HASH_BLOCK_TOKENS;
    if b < q.full_hash_blocks() {
        mix64(q.hash_ids[b as usize].wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (t % HASH_BLOCK_TOKENS) ^ 0x6b76) | 1
    } else {
        tag(seq, t)
    }
}

struct Live {
    seq: usize,
    /// Tokens whose KV is stored (and tagged).
    stored: u64,
    /// Tokens to store before it decodes (its prompt, plus the tokens
    /// generated before a preemption): it prefills while `stored < target`.
    target: u64,
}

/// The tokens a running request has room for after computing `n` more:
/// a prefill chunk, plus room for its first generated token where the
/// chunk ends its prompt; or one decoded token.
fn grown_to(l: &Live, n: u64) -> u64 {
    if l.stored < l.target {
        let s = l.stored + n;
        s + u64::from(s == l.target)
    } else {
        l.stored + 1
    }
}

/// A part of a step (see [`replay`]).
enum Pass {
    Admit,
    Grow,
}

/// The token budget of chunked prefill, over one step: a request gets
/// what it still needs, up to what is left (`u64::MAX` left: unbounded).
pub struct Budget(pub u64);

impl Budget {
    fn new(max_num_batched_tokens: u64) -> Budget {
        Budget(if max_num_batched_tokens == 0 { u64::MAX } else { max_num_batched_tokens })
    }

    pub fn take(&mut self, need: u64) -> u64 {
        let n = need.min(self.0);
        if self.0 != u64::MAX {
            self.0 -= n;
        }
        n
    }

    pub fn unbounded(&self) -> bool {
        self.0 == u64::MAX
    }
}

/// What one step computes for each running request, in running order (as
/// vLLM V1 schedules its running requests before its waiting ones): one
/// token for a decoding request, the next chunk of its prompt for a
/// prefilling one. Consumes the budget; what is left goes to admissions.
fn plan_running(running: &[Live], budget: &mut Budget) -> Vec<u64> {
    running
        .iter()
        .map(|l| if l.stored < l.target { budget.take(l.target - l.stored) } else { budget.take(1) })
        .collect()
}

/// The tokens admission allocates for a request storing `total` tokens
/// before it decodes, of which `hit` are cached, given `budget`: its hit
/// and the chunk it computes now, plus room for its first generated token
/// where the chunk ends its prompt. Whole prompts (an unbounded budget)
/// need no hit: `total + 1`. `None` when the budget has nothing left.
pub fn admission_tokens(total: u64, hit: impl FnOnce() -> u64, budget: &mut Budget) -> Option<(u64, u64)> {
    if budget.unbounded() {
        return Some((total + 1, total));
    }
    if budget.0 == 0 {
        return None;
    }
    let hit = hit().min(total.saturating_sub(1));
    let n = budget.take(total - hit);
    let stored = hit + n;
    Some((stored + u64::from(stored == total), stored))
}

fn note(r: &mut RunResult, f: &Fail, what: impl Fn() -> String) {
    if f.fragmentation {
        r.fragmentation_failures += 1;
        r.first_fragmentation.get_or_insert_with(|| format!("{}: {}", what(), f.message));
    }
    if f.host_limit {
        r.host_limit_failures += 1;
        r.first_host_limit.get_or_insert_with(|| format!("{}: {}", what(), f.message));
    }
}

/// Samples the instantaneous live KV: `live` summed over running requests,
/// `shared` of it mapped by more than one.
fn sample(r: &mut RunResult, live: u64, shared: u64) {
    r.peak_live_bytes = r.peak_live_bytes.max(live);
    r.peak_distinct_live_bytes = r.peak_distinct_live_bytes.max(live - shared);
    r.peak_shared_live_bytes = r.peak_shared_live_bytes.max(shared);
}

/// `q`-quantile of sorted values (nearest rank), 0 when empty.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => sorted[((n - 1) as f64 * q).round() as usize],
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Replays `requests` through `mgr`. `progress` counts requests finished or
/// rejected, for a progress bar.
pub fn replay(mgr: &mut dyn KvManager, requests: &[Request], cfg: &SchedConfig, progress: &AtomicU64) -> RunResult {
    replay_arrivals(mgr, requests, cfg, Arrivals::Trace, progress)
}

/// [`replay`], with requests arriving as `arrivals` says.
pub fn replay_arrivals(
    mgr: &mut dyn KvManager,
    requests: &[Request],
    cfg: &SchedConfig,
    arrivals: Arrivals,
    progress: &AtomicU64,
) -> RunResult {
    let start = Instant::now();
    let mut r = RunResult { name: mgr.name().to_string(), ..Default::default() };
    let kvpt = cfg.kv_bytes_per_token;
    let prof = &cfg.profile;
    let n = requests.len();
    let mut generated = vec![0u64; n];
    // Tokens each request had stored when last preempted: computing them
    // again is recomputation.
    let mut computed_before = vec![0u64; n];
    let mut admitted_at: Vec<Option<f64>> = vec![None; n];
    let mut first_token_at: Vec<Option<f64>> = vec![None; n];
    let mut latencies: Vec<f64> = Vec::with_capacity(n);
    let mut ttfts: Vec<f64> = Vec::with_capacity(n);
    let mut tpots: Vec<f64> = Vec::with_capacity(n);
    let mut step_times: Vec<f64> = Vec::new();
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<Live> = Vec::new();
    let mut next = 0usize;
    let t0 = match arrivals {
        Arrivals::Trace => requests.first().map_or(0.0, |q| q.arrival_s),
        Arrivals::ClosedLoop { .. } => 0.0,
    };
    let mut now = t0;
    // When each request joined the system (its trace time in an open loop).
    let mut arrived_at: Vec<f64> = requests.iter().map(|q| q.arrival_s).collect();
    let mut waste_sum = 0.0;
    let mut phys_sum = 0.0;
    let mut live_sum = 0.0;
    let mut measured_steps = 0u64;
    // KV held by running requests now, kept up to date at every change.
    let mut live_now = 0u64;
    let total_out: u64 = requests.iter().map(|q| q.output).sum();
    let max_steps = 20 * total_out + 10 * n as u64 + 100_000;
    // Bumped whenever KV is freed; admission after a failure waits for it.
    let mut freed_gen = 0u64;
    let mut blocked_at: Option<u64> = None;
    let mut copied_before = mgr.bytes_copied();
    // The highest instantaneous live KV of the steps so far (warm steps).
    let mut peak_live_before = 0u64;
    // The steps' driver time, by the rule every replay shares.
    let mut driver_tally = DriverTally::default();
    let mut decode_step_calls = StepCallCounter::default();
    let mut warm_decode_step_calls = StepCallCounter::default();

    // Verifies and frees a sequence's KV; returns mismatching tags.
    let retire = |mgr: &mut dyn KvManager, l: &Live| -> u64 {
        let q = &requests[l.seq];
        let bad = (0..l.stored).filter(|&t| mgr.read_tag(l.seq, t) != Some(token_tag(q, l.seq, t))).count();
        mgr.free(l.seq);
        bad as u64
    };

    loop {
        if running.is_empty() && waiting.is_empty() {
            match (requests.get(next), arrivals) {
                (Some(q), Arrivals::Trace) => now = now.max(q.arrival_s),
                (Some(_), Arrivals::ClosedLoop { .. }) => {}
                (None, _) => break,
            }
        }
        while next < n
            && match arrivals {
                Arrivals::Trace => requests[next].arrival_s <= now,
                Arrivals::ClosedLoop { concurrency } => waiting.len() + running.len() < concurrency.max(1),
            }
        {
            arrived_at[next] = now;
            waiting.push_back(next);
            next += 1;
        }
        r.peak_in_system = r.peak_in_system.max((waiting.len() + running.len()) as u64);
        let calls_before = mgr.calls();
        let output_before = r.output_tokens;
        let mut work = StepWork::default();
        let mut step_peak_live = live_now;

        // The step's token budget: running requests first, then admissions.
        let chunked = cfg.max_num_batched_tokens > 0;
        let mut budget = Budget::new(cfg.max_num_batched_tokens);
        let mut plan = plan_running(&running, &mut budget);
        let preemptions_before = r.preemptions;
        let mut finished: Vec<usize> = Vec::new();
        let mut ending: Vec<Live> = Vec::new();
        // Whole prompts: admission, then every running request's growth.
        // Chunked prefill, as vLLM V1 schedules: the running requests'
        // growth first, then (unless it preempted) admission into the budget
        // left, then the new requests' first tokens.
        let passes: &[Pass] = if chunked { &[Pass::Grow, Pass::Admit, Pass::Grow] } else { &[Pass::Admit, Pass::Grow] };
        let mut grow_from = 0;
        for pass in passes {
            match pass {
                Pass::Admit => {
                    if chunked {
                        if r.preemptions > preemptions_before {
                            break;
                        }
                        grow_from = running.len();
                    }
                    // A request ending in this step keeps its place until
                    // the step has run.
                    while running.len() + ending.len() < cfg.max_batch && blocked_at != Some(freed_gen) {
                        let Some(&seq) = waiting.front() else { break };
                        let q = &requests[seq];
                        let total = q.prompt + generated[seq];
                        let mut after = Budget(budget.0);
                        let Some((tokens, stored)) = admission_tokens(total, || mgr.prefix_hit(seq, q), &mut after)
                        else {
                            break;
                        };
                        if !running.is_empty() && !mgr.admission_ready(seq, tokens) {
                            r.admissions_waiting_for_kv += 1;
                            break;
                        }
                        match mgr.admit(seq, tokens, q) {
                            Ok(hit) => {
                                waiting.pop_front();
                                budget = after;
                                let hit = hit.min(q.prompt.saturating_sub(1)).min(stored);
                                for t in hit..stored {
                                    if !mgr.write_tag(seq, t, token_tag(q, seq, t)) {
                                        r.integrity_errors += 1;
                                    }
                                }
                                r.tags_written += stored - hit;
                                r.prefix_hit_tokens += hit;
                                r.prompt_tokens += q.prompt;
                                if admitted_at[seq].is_none() {
                                    r.first_admission_hit_tokens += hit;
                                    r.first_admission_prompt_tokens += q.prompt;
                                }
                                work.add_prefill(hit, stored);
                                r.prefill_tokens += stored - hit;
                                // What it had computed before a preemption is computed again.
                                r.recomputed_tokens += stored.min(computed_before[seq]).saturating_sub(hit);
                                admitted_at[seq].get_or_insert(now);
                                running.push(Live { seq, stored, target: total });
                                // Its first chunk is computed: it decodes
                                // in this step if that ends its prompt.
                                plan.push(u64::from(stored == total));
                                live_now += stored * kvpt;
                                sample(&mut r, live_now, mgr.shared_live_bytes());
                                step_peak_live = step_peak_live.max(live_now);
                            }
                            Err(f) => {
                                r.admission_failures += 1;
                                note(&mut r, &f, || format!("admission of request {seq}"));
                                if running.is_empty() {
                                    // It cannot fit even alone: it can never run.
                                    waiting.pop_front();
                                    r.rejected_requests += 1;
                                    progress.fetch_add(1, Relaxed);
                                    continue;
                                }
                                blocked_at = Some(freed_gen);
                                break;
                            }
                        }
                    }
                }
                Pass::Grow => {
                    // Every running request (from `grow_from`) with a share
                    // of the step computes it: a prefilling one stores its
                    // next chunk (and decodes too where the chunk ends its
                    // prompt); a decoding one appends one token. The step
                    // reads the KV each decoding request holds; finished
                    // requests end with the step.
                    let grows: Vec<(usize, u64, u64)> = running[grow_from..]
                        .iter()
                        .zip(&plan[grow_from..])
                        .filter(|(_, &n)| n > 0)
                        .map(|(l, &n)| (l.seq, grown_to(l, n), l.stored))
                        .collect();
                    if !grows.is_empty() && mgr.grow_batch(&grows).is_err() {
                        r.batch_growth_failures += 1;
                    }
                    let mut i = grow_from;
                    while i < running.len() {
                        let (seq, stored, target) = (running[i].seq, running[i].stored, running[i].target);
                        let n = plan[i];
                        if n == 0 {
                            i += 1;
                            continue;
                        }
                        let to = grown_to(&running[i], n);
                        let mut ok = true;
                        while let Err(f) = mgr.grow(seq, to, stored) {
                            r.growth_failures += 1;
                            note(&mut r, &f, || format!("growth of request {seq}"));
                            let victim = running.pop().expect("the growing request is running");
                            plan.pop();
                            r.integrity_errors += retire(mgr, &victim);
                            live_now -= victim.stored * kvpt;
                            freed_gen += 1;
                            if chunked && victim.seq == seq && running.is_empty() && ending.is_empty() {
                                // Alone, it cannot grow: it can never run (its
                                // first chunk fitting let admission take it).
                                r.rejected_requests += 1;
                                progress.fetch_add(1, Relaxed);
                                ok = false;
                                break;
                            }
                            r.preemptions += 1;
                            computed_before[victim.seq] = computed_before[victim.seq].max(victim.stored);
                            waiting.push_front(victim.seq);
                            if victim.seq == seq {
                                ok = false;
                                break;
                            }
                        }
                        if !ok {
                            break;
                        }
                        let q = &requests[seq];
                        if stored < target {
                            // A prefill chunk after the first.
                            for t in stored..stored + n {
                                if !mgr.write_tag(seq, t, token_tag(q, seq, t)) {
                                    r.integrity_errors += 1;
                                }
                            }
                            r.tags_written += n;
                            work.add_prefill(stored, stored + n);
                            r.prefill_tokens += n;
                            r.recomputed_tokens += (stored + n).min(computed_before[seq]).saturating_sub(stored);
                            running[i].stored += n;
                            live_now += n * kvpt;
                            sample(&mut r, live_now, mgr.shared_live_bytes());
                            step_peak_live = step_peak_live.max(live_now);
                            if stored + n < target {
                                i += 1;
                                continue;
                            }
                        }
                        // Decode one token.
                        let stored = running[i].stored;
                        if !mgr.write_tag(seq, stored, token_tag(q, seq, stored)) {
                            r.integrity_errors += 1;
                        }
                        r.tags_written += 1;
                        work.add_decode(stored, stored * kvpt);
                        running[i].stored += 1;
                        live_now += kvpt;
                        sample(&mut r, live_now, mgr.shared_live_bytes());
                        step_peak_live = step_peak_live.max(live_now);
                        generated[seq] += 1;
                        r.output_tokens += 1;
                        if generated[seq] >= q.output {
                            let done = running.remove(i);
                            plan.remove(i);
                            finished.push(seq);
                            if chunked {
                                // Its KV is freed once the step has run (as
                                // vLLM V1 frees after the step's output):
                                // this step's admission cannot have it.
                                ending.push(done);
                            } else {
                                r.integrity_errors += retire(mgr, &done);
                                live_now -= done.stored * kvpt;
                                freed_gen += 1;
                                r.completed_requests += 1;
                                progress.fetch_add(1, Relaxed);
                            }
                        } else {
                            i += 1;
                        }
                    }
                }
            }
        }
        for done in ending {
            r.integrity_errors += retire(mgr, &done);
            live_now -= done.stored * kvpt;
            freed_gen += 1;
            r.completed_requests += 1;
            progress.fetch_add(1, Relaxed);
        }
        let after_critical = mgr.calls();
        let critical = after_critical.since(&calls_before);
        let copied = mgr.bytes_copied();
        work.copied_bytes = copied - copied_before;
        copied_before = copied;

        // Between steps: while the GPU computes. The next step's plan is
        // known now (nothing changes before it but arrivals joining the
        // queue's tail). Chunked prefill grows the running requests before
        // admitting: the manager may make that room now. Then admission
        // tries the queue's front: the manager may prepare those admissions
        // too, into the budget the running requests leave.
        let mut next_budget = Budget::new(cfg.max_num_batched_tokens);
        let next_plan = plan_running(&running, &mut next_budget);
        let step_budget = StepBudget { gpu_s: prof.gpu_s(&work), profile: prof, tokens_left: next_budget.0 };
        let next_grows: Vec<(usize, u64, u64)> = running
            .iter()
            .zip(&next_plan)
            .filter(|(_, &n)| n > 0)
            .map(|(l, &n)| (l.seq, grown_to(l, n), l.stored))
            .collect();
        if chunked && !running.is_empty() {
            mgr.prepare_growth(&next_grows, &step_budget);
        }
        if running.len() < cfg.max_batch && blocked_at != Some(freed_gen) && !waiting.is_empty() && next_budget.0 > 0 {
            let front: Vec<(usize, u64, &Request)> = waiting
                .iter()
                .take(cfg.max_batch - running.len())
                .map(|&seq| (seq, requests[seq].prompt + generated[seq], &requests[seq]))
                .collect();
            mgr.prepare_admissions(&front, &step_budget);
        }
        if !chunked && !next_grows.is_empty() {
            mgr.prepare_decode_growth(&next_grows);
        }
        mgr.waiting_requests(waiting.len());
        mgr.between_steps();
        let between = mgr.calls().since(&after_critical);
        r.critical_calls = r.critical_calls.plus(&critical);
        r.between_calls = r.between_calls.plus(&between);
        r.critical_path_event_waits += critical.event_wait_blocked;
        r.between_steps_drains += between.drains();
        r.critical_path_creates += critical.create;
        let warm = r.steps > 0 && step_peak_live <= peak_live_before;
        if warm {
            r.warm_steps += 1;
            r.critical_path_creates_warm += critical.create;
        }
        if r.output_tokens > output_before {
            let step_calls = critical.plus(&between);
            decode_step_calls.add(&step_calls);
            if warm {
                warm_decode_step_calls.add(&step_calls);
            }
        }
        peak_live_before = peak_live_before.max(step_peak_live);
        if r.steps % 64 == 0 {
            mgr.housekeeping();
        }

        let st = charge_step(prof, &mut work, &StepCalls { critical, between }, &mut driver_tally);
        step_times.push(st.total_s);
        r.gpu_seconds += st.gpu_s;
        r.critical_path_alloc_s += st.alloc_charged_s;
        r.overlapped_alloc_s += st.alloc_hidden_s;
        r.critical_path_syncs += work.critical_syncs;
        r.step_seconds += st.total_s;
        now += st.total_s;
        mgr.gpu_finished_step();
        // Tokens of this step exist at its end.
        for l in running.iter().filter(|l| generated[l.seq] > 0) {
            first_token_at[l.seq].get_or_insert(now);
        }
        for &seq in &finished {
            let q = &requests[seq];
            let first = *first_token_at[seq].get_or_insert(now);
            latencies.push(now - arrived_at[seq]);
            ttfts.push(first - arrived_at[seq]);
            if q.output > 1 {
                tpots.push((now - first) / (q.output - 1) as f64);
            }
        }

        // Accounting.
        let live: u64 = running.iter().map(|l| l.stored * kvpt).sum();
        debug_assert_eq!(live, live_now);
        let phys = mgr.physical_bytes();
        r.peak_live_end_of_step_bytes = r.peak_live_end_of_step_bytes.max(live);
        if phys > 0 {
            waste_sum += phys.saturating_sub(live) as f64 / phys as f64;
            phys_sum += phys as f64;
            live_sum += live as f64;
            measured_steps += 1;
        }
        r.steps += 1;
        if r.steps > max_steps {
            r.aborted = Some(format!("no progress after {} steps", r.steps));
            break;
        }
    }
    for l in std::mem::take(&mut running) {
        r.integrity_errors += retire(mgr, &l);
    }
    let m = measured_steps.max(1) as f64;
    r.mean_waste_fraction = waste_sum / m;
    r.mean_physical_bytes = phys_sum / m;
    r.mean_live_bytes = live_sum / m;
    r.final_physical_bytes = mgr.physical_bytes();
    for v in [&mut latencies, &mut ttfts, &mut tpots, &mut step_times] {
        v.sort_by(f64::total_cmp);
    }
    r.mean_latency_s = mean(&latencies);
    r.p99_latency_s = quantile(&latencies, 0.99);
    r.ttft_mean_s = mean(&ttfts);
    r.ttft_p99_s = quantile(&ttfts, 0.99);
    r.tpot_mean_s = mean(&tpots);
    r.tpot_p99_s = quantile(&tpots, 0.99);
    r.step_time_p50_s = quantile(&step_times, 0.5);
    r.step_time_p99_s = quantile(&step_times, 0.99);
    r.step_time_max_s = step_times.last().copied().unwrap_or(0.0);
    let queued: Vec<f64> =
        admitted_at.iter().zip(&arrived_at).filter_map(|(a, t)| a.map(|a| (a - t).max(0.0))).collect();
    r.mean_queue_s = mean(&queued);
    r.prefix_hit_rate = if r.prompt_tokens > 0 { r.prefix_hit_tokens as f64 / r.prompt_tokens as f64 } else { 0.0 };
    r.first_admission_hit_rate = match r.first_admission_prompt_tokens {
        0 => 0.0,
        n => r.first_admission_hit_tokens as f64 / n as f64,
    };
    r.peak_physical_bytes = mgr.peak_physical_bytes();
    r.bytes_copied = mgr.bytes_copied();
    r.moves = mgr.moves();
    r.calls = mgr.calls();
    r.decode_step_calls = decode_step_calls.summary();
    r.warm_decode_step_calls = warm_decode_step_calls.summary();
    r.extra = mgr.extra();
    r.simulated_seconds = now - t0;
    r.tokens_per_s = if r.simulated_seconds > 0.0 { r.output_tokens as f64 / r.simulated_seconds } else { 0.0 };
    r.critical_path_alloc_fraction = if r.step_seconds > 0.0 { r.critical_path_alloc_s / r.step_seconds } else { 0.0 };
    r.footprint_over_peak_live =
        if r.peak_live_bytes > 0 { r.peak_physical_bytes as f64 / r.peak_live_bytes as f64 } else { 0.0 };
    r.wall_seconds = start.elapsed().as_secs_f64();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(stored: u64, target: u64) -> Live {
        Live { seq: 0, stored, target }
    }

    #[test]
    fn running_requests_take_the_budget_in_order() {
        // A decoder, a prefill needing 5000 more, one needing 9000 more,
        // and a decoder the budget no longer reaches (it waits a step).
        let running = [live(10, 5), live(7000, 12000), live(0, 9000), live(3, 3)];
        let mut b = Budget::new(8192);
        assert_eq!(plan_running(&running, &mut b), vec![1, 5000, 3191, 0]);
        assert_eq!(b.0, 0);
        // Whole prompts: nothing is bounded.
        let mut b = Budget::new(0);
        assert_eq!(plan_running(&running, &mut b), vec![1, 5000, 9000, 1]);
        assert!(b.unbounded());
    }

    #[test]
    fn admission_allocates_the_hit_and_the_first_chunk() {
        // 20000 tokens, 4096 cached, 8192 left: a chunk of 8192, no room
        // for a generated token yet.
        let mut b = Budget(8192);
        assert_eq!(admission_tokens(20_000, || 4096, &mut b), Some((12_288, 12_288)));
        assert_eq!(b.0, 0);
        assert_eq!(admission_tokens(100, || 0, &mut b), None, "nothing left");
        // A chunk that ends the prompt has room for the first token.
        let mut b = Budget(8192);
        assert_eq!(admission_tokens(5000, || 512, &mut b), Some((5001, 5000)));
        assert_eq!(b.0, 8192 - 4488);
        // A hit of the whole prompt still computes its last token.
        let mut b = Budget(10);
        assert_eq!(admission_tokens(1024, || 1024, &mut b), Some((1025, 1024)));
        assert_eq!(b.0, 9);
        // Whole prompts: the hit is not even asked for.
        let mut b = Budget::new(0);
        assert_eq!(admission_tokens(777, || panic!("no lookup"), &mut b), Some((778, 777)));
    }

    #[test]
    fn growth_leaves_room_for_the_first_token_where_a_chunk_ends_the_prompt() {
        assert_eq!(grown_to(&live(100, 1000), 500), 600);
        assert_eq!(grown_to(&live(100, 1000), 900), 1001);
        assert_eq!(grown_to(&live(1001, 1000), 1), 1002);
    }
}
