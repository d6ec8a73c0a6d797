//! The continuous-batching scheduler, the same for every manager.
//!
//! Each step (of `step_s` simulated seconds):
//! 1. requests whose arrival time has come join the waiting queue;
//! 2. waiting requests are admitted in order while the batch has room
//!    (`max_batch`) and the manager can allocate their KV (prompt, plus the
//!    tokens generated before a preemption, plus room for the next token);
//!    admission stops at the first request that does not fit (a request that
//!    does not fit even into an empty batch can never run and is rejected),
//!    and is not tried again until some KV has been freed (an engine does
//!    not probe a full device every step; this also keeps the models' retry
//!    paths from being charged for probes);
//! 3. every running request appends one token: the manager grows its KV and
//!    the token's tag is written through the mapping. When growth fails,
//!    the most recently admitted running request is preempted — its tags are
//!    verified, its KV freed, and it goes back to the front of the waiting
//!    queue to recompute — and the growth is retried, as vLLM's scheduler
//!    does (`vllm/v1/core/sched/scheduler.py`: `preempted_req =
//!    self.running.pop()`, `self.waiting.prepend_request(...)`);
//! 4. a request that has generated all its tokens has every tag verified and
//!    its KV freed.
//!
//! Idle time (nothing running or waiting) is skipped to the next arrival.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use super::counted::Calls;
use super::managers::{Fail, KvManager};
use super::trace::Request;
use super::util::mix64;

/// Scheduler settings.
#[derive(Clone, Copy, Debug)]
pub struct SchedConfig {
    pub max_batch: usize,
    pub step_s: f64,
    pub kv_bytes_per_token: u64,
}

/// What one manager did over the whole trace.
#[derive(Clone, Debug, Default)]
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
    pub peak_live_bytes: u64,
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
    pub aborted: Option<String>,
    pub extra: Vec<(String, String)>,
}

/// The tag of token `t` of request `seq`: distinct for every (request, token).
pub fn tag(seq: usize, t: u64) -> u64 {
    mix64(((seq as u64) << 32) ^ t ^ 0x7a67_0000_0000_0000) | 1
}

struct Live {
    seq: usize,
    /// Tokens whose KV is stored (and tagged).
    stored: u64,
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

/// Replays `requests` through `mgr`. `progress` counts requests finished or
/// rejected, for a progress bar.
pub fn replay(mgr: &mut dyn KvManager, requests: &[Request], cfg: SchedConfig, progress: &AtomicU64) -> RunResult {
    let start = Instant::now();
    let mut r = RunResult { name: mgr.name().to_string(), ..Default::default() };
    let kvpt = cfg.kv_bytes_per_token;
    let mut generated = vec![0u64; requests.len()];
    let mut admitted_at: Vec<Option<f64>> = vec![None; requests.len()];
    let mut latencies: Vec<f64> = Vec::with_capacity(requests.len());
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<Live> = Vec::new();
    let mut next = 0usize;
    let mut now = requests.first().map_or(0.0, |q| q.arrival_s);
    let mut waste_sum = 0.0;
    let mut phys_sum = 0.0;
    let mut live_sum = 0.0;
    let mut measured_steps = 0u64;
    let total_out: u64 = requests.iter().map(|q| q.output).sum();
    let max_steps = 20 * total_out + 10 * requests.len() as u64 + 100_000;
    // Bumped whenever KV is freed; admission after a failure waits for it.
    let mut freed_gen = 0u64;
    let mut blocked_at: Option<u64> = None;

    // Verifies and frees a sequence's KV; returns mismatching tags.
    let retire = |mgr: &mut dyn KvManager, l: &Live| -> u64 {
        let mut bad = 0;
        for t in 0..l.stored {
            if mgr.read_tag(l.seq, t) != Some(tag(l.seq, t)) {
                bad += 1;
            }
        }
        mgr.free(l.seq);
        bad
    };

    loop {
        if running.is_empty() && waiting.is_empty() {
            match requests.get(next) {
                Some(q) => now = now.max(q.arrival_s),
                None => break,
            }
        }
        while next < requests.len() && requests[next].arrival_s <= now {
            waiting.push_back(next);
            next += 1;
        }

        // Admission.
        while running.len() < cfg.max_batch && blocked_at != Some(freed_gen) {
            let Some(&seq) = waiting.front() else { break };
            let stored = requests[seq].prompt + generated[seq];
            match mgr.admit(seq, stored + 1) {
                Ok(()) => {
                    waiting.pop_front();
                    for t in 0..stored {
                        if !mgr.write_tag(seq, t, tag(seq, t)) {
                            r.integrity_errors += 1;
                        }
                    }
                    r.tags_written += stored;
                    admitted_at[seq].get_or_insert(now);
                    running.push(Live { seq, stored });
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

        // Decode: one token for every running request.
        let mut i = 0;
        while i < running.len() {
            let (seq, stored) = (running[i].seq, running[i].stored);
            let mut ok = true;
            while let Err(f) = mgr.grow(seq, stored + 1, stored) {
                r.growth_failures += 1;
                note(&mut r, &f, || format!("growth of request {seq}"));
                let victim = running.pop().expect("the growing request is running");
                r.integrity_errors += retire(mgr, &victim);
                freed_gen += 1;
                r.preemptions += 1;
                waiting.push_front(victim.seq);
                if victim.seq == seq {
                    ok = false;
                    break;
                }
            }
            if !ok {
                break;
            }
            if !mgr.write_tag(seq, stored, tag(seq, stored)) {
                r.integrity_errors += 1;
            }
            r.tags_written += 1;
            running[i].stored += 1;
            generated[seq] += 1;
            if generated[seq] >= requests[seq].output {
                let done = running.remove(i);
                r.integrity_errors += retire(mgr, &done);
                freed_gen += 1;
                r.completed_requests += 1;
                latencies.push(now + cfg.step_s - requests[seq].arrival_s);
                progress.fetch_add(1, Relaxed);
            } else {
                i += 1;
            }
        }

        mgr.end_step();
        if r.steps % 64 == 0 {
            mgr.housekeeping();
        }
        // Accounting.
        let live: u64 = running.iter().map(|l| l.stored * kvpt).sum();
        let phys = mgr.physical_bytes();
        r.peak_live_bytes = r.peak_live_bytes.max(live);
        if phys > 0 {
            waste_sum += phys.saturating_sub(live) as f64 / phys as f64;
            phys_sum += phys as f64;
            live_sum += live as f64;
            measured_steps += 1;
        }
        r.steps += 1;
        now += cfg.step_s;
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
    if !latencies.is_empty() {
        latencies.sort_by(f64::total_cmp);
        r.mean_latency_s = latencies.iter().sum::<f64>() / latencies.len() as f64;
        r.p99_latency_s = latencies[((latencies.len() - 1) as f64 * 0.99).round() as usize];
    }
    let queued: Vec<f64> =
        admitted_at.iter().zip(requests).filter_map(|(a, q)| a.map(|a| (a - q.arrival_s).max(0.0))).collect();
    if !queued.is_empty() {
        r.mean_queue_s = queued.iter().sum::<f64>() / queued.len() as f64;
    }
    r.peak_physical_bytes = mgr.peak_physical_bytes();
    r.bytes_copied = mgr.bytes_copied();
    r.moves = mgr.moves();
    r.calls = mgr.calls();
    r.extra = mgr.extra();
    r.simulated_seconds = now - requests.first().map_or(0.0, |q| q.arrival_s);
    r.wall_seconds = start.elapsed().as_secs_f64();
    r
}
