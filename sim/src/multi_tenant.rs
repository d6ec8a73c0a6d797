//! Several models' KV caches share one arena as load shifts between them.
//!
//! ```text
//! multi_tenant [--trace-a PATH] [--trace-b PATH] [--trace-c PATH] [--tenants 2|3] [--limit N]
//!              [--kv-a BYTES] [--kv-b BYTES] [--kv-c BYTES] [--shift SECONDS] [--capacity BYTES]
//!              [--retain BYTES] [--trim-every SECONDS] [--trim-keep BYTES] [--step-ms MS] [--max-batch N] [--phases N] [--seed N]
//!              [--backend host|host-sparse] [--mode stream|sync] [--precreate BYTES] [--map-ahead BYTES]
//!              [--json PATH] [--snapshot PATH] [--snapshot-at SECONDS]
//! ```
//!
//! Each tenant is one model served from the same arena: every request gets a
//! growable allocation holding its KV cache (`kv bytes per token` × tokens,
//! reserved up to prompt + output tokens), grown one token per decode step and
//! freed when the request ends. A one-u64 tag is written into every token's
//! slot and all of them are verified before the free.
//!
//! Load shifts: tenant *i*'s requests arrive from `i × shift` seconds on (by
//! default `shift` is half of tenant A's arrival span), at the trace's own
//! timestamps. So A is busy first and idle later, B the reverse (and C, with
//! `--tenants 3`, last). Traces are either format of `../shared/traces/`
//! (Azure CSV: `arrived_at` s, `num_prefill_tokens`, `num_decode_tokens`;
//! Mooncake JSONL: `timestamp` ms, `input_length`, `output_length`); without
//! `--trace-X` a tenant replays seeded synthetic load (A Azure-like at 5.5
//! req/s, B Mooncake-like at 3.4 req/s, C Azure-like at 2 req/s).
//!
//! Scheduling is per tenant, the same continuous batching as `kv_serving`:
//! each 30 ms step admits waiting requests in arrival order while their
//! prompt fits (leaving 1% of the capacity as headroom), then appends one
//! token to every running request; an append that cannot be served preempts
//! that tenant's most recently admitted request (freed and re-queued).
//!
//! Printed: a per-phase table of each tenant's mapped bytes (mean / peak), the
//! pooled and held bytes and the driver creates/releases, then the shared
//! arena against static partitioning (each tenant holding its own peak, as a
//! preallocated per-model pool does): peak, time-weighted mean, and the idle
//! footprint before and after `trim(0)`.
//!
//! `--snapshot PATH` writes the arena's snapshot (`Arena::snapshot_json`, for
//! the `snapshot_svg` example) at `--snapshot-at` simulated seconds, by default
//! in the middle of the time when tenants A and B both receive requests.
//!
//! The default backend is `host-sparse` (chunks are not committed, so a
//! replay whose KV exceeds this machine's RAM still runs; only the tagged
//! pages are touched). The backend runs under the counting driver of
//! `sim/src/counted.rs`, which also models stream events: an event recorded
//! during a step completes when the GPU has finished that step (the next
//! step begins), so memory freed on the stream is not reusable within the
//! step that freed it.
//!
//! `--mode stream` (the default) drives the arena as issue 11 has engines
//! do: frees on the engine's stream (`free_on_stream`), prefetch targets
//! (`--precreate`, `--map-ahead`) kept by `maintain` between steps, while
//! the GPU computes, and each tenant's decode step grown with one
//! `resize_many`. `--mode sync` is the arena as engines drove it before:
//! plain free, no prefetch, one `resize` per request. The report counts the
//! driver calls made inside the steps (the engine's critical path) apart
//! from those made between steps, and the device synchronizes and blocking
//! event waits among them.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{CommandFactory, Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id};

use crate::counted::{Calls, Counted};

const KIB: u64 = 1 << 10;
const GIB: u64 = 1 << 30;

/// One request of a tenant's stream (arrival relative to the stream's start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    pub arrive_s: f64,
    pub prompt: u64,
    pub output: u64,
}

/// Seeded synthetic load: Poisson arrivals, log-normal prompt and output lengths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Synthetic {
    pub rate_per_s: f64,
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub prompt_max: u64,
    pub output_median: f64,
    pub output_sigma: f64,
    pub output_max: u64,
}

impl Synthetic {
    /// Azure conversation 2023: prompt median 1020 (mean 1155), output median 129 (mean 211), 5.5 req/s.
    pub const AZURE: Synthetic = Synthetic {
        rate_per_s: 5.5,
        prompt_median: 1020.0,
        prompt_sigma: 0.5,
        prompt_max: 8192,
        output_median: 129.0,
        output_sigma: 0.99,
        output_max: 2048,
    };
    /// Mooncake conversation: prompt median 6909 (mean 12035), output median 350, 3.4 req/s.
    pub const MOONCAKE: Synthetic = Synthetic {
        rate_per_s: 3.4,
        prompt_median: 6909.0,
        prompt_sigma: 1.05,
        prompt_max: 126_000,
        output_median: 350.0,
        output_sigma: 0.35,
        output_max: 1200,
    };
}

/// Where a tenant's requests come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    Trace(PathBuf),
    Synthetic(Synthetic),
}

/// One tenant (one model).
#[derive(Clone, Debug, PartialEq)]
pub struct TenantSpec {
    pub name: String,
    pub kv_bytes_per_token: u64,
    pub source: Source,
}

/// How the engine drives the arena (see the module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Stream,
    Sync,
}

/// The stream the engines' kernels run on (the model does not tell streams apart).
const ENGINE_STREAM: u64 = 0;

/// Everything a run needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub tenants: Vec<TenantSpec>,
    /// Requests per tenant.
    pub limit: usize,
    /// Seconds between tenants' starts; `None`: half of tenant A's arrival span.
    pub shift_s: Option<f64>,
    pub capacity_bytes: u64,
    pub chunk_bytes: u64,
    pub retain_bytes: u64,
    /// Every this many simulated seconds the engine calls `trim(trim_keep_bytes)`; 0: never.
    pub trim_every_s: f64,
    pub trim_keep_bytes: u64,
    pub step_ms: f64,
    pub max_batch: usize,
    pub phases: usize,
    pub seed: u64,
    pub backend: Backend,
    pub mode: Mode,
    /// `Mode::Stream`'s prefetch targets (`Arena::set_prefetch`).
    pub precreate_bytes: u64,
    pub map_ahead_bytes: u64,
    pub snapshot: Option<PathBuf>,
    /// Simulated time of the snapshot; `None`: the middle of the time when A and B both receive requests.
    pub snapshot_at_s: Option<f64>,
    /// Show a progress bar of the simulated time on standard error.
    pub progress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tenants: vec![
                TenantSpec {
                    name: "A llama3-70b".into(),
                    kv_bytes_per_token: 320 * KIB,
                    source: Source::Synthetic(Synthetic::AZURE),
                },
                TenantSpec {
                    name: "B llama3-8b".into(),
                    kv_bytes_per_token: 128 * KIB,
                    source: Source::Synthetic(Synthetic::MOONCAKE),
                },
            ],
            limit: 1000,
            shift_s: None,
            capacity_bytes: 80 * GIB,
            chunk_bytes: 0,
            retain_bytes: u64::MAX,
            trim_every_s: 10.0,
            trim_keep_bytes: 4 * GIB,
            step_ms: 30.0,
            max_batch: 256,
            phases: 6,
            seed: 42,
            backend: Backend::HostSparse,
            mode: Mode::Stream,
            precreate_bytes: 8 << 20,
            map_ahead_bytes: 2 << 20,
            snapshot: None,
            snapshot_at_s: None,
            progress: false,
        }
    }
}

/// Figures of one tenant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantReport {
    pub name: String,
    pub source: String,
    pub kv_bytes_per_token: u64,
    pub start_s: f64,
    pub requests: u64,
    pub completed: u64,
    pub skipped_too_large: u64,
    pub preemptions: u64,
    pub tokens_written: u64,
    pub peak_mapped_bytes: u64,
    pub mean_mapped_bytes: f64,
    pub mean_queue_s: f64,
    pub max_queue_s: f64,
    pub integrity_errors: u64,
}

/// Figures of one phase (a window of simulated time).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PhaseReport {
    pub name: String,
    pub from_s: f64,
    pub to_s: f64,
    pub steps: u64,
    pub mean_mapped: Vec<f64>,
    pub peak_mapped: Vec<u64>,
    pub mean_running: Vec<f64>,
    pub peak_pooled: u64,
    pub mean_held: f64,
    pub peak_held: u64,
    pub creates: u64,
    pub releases: u64,
}

/// Everything a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub tenants: Vec<TenantReport>,
    pub phases: Vec<PhaseReport>,
    pub capacity_bytes: u64,
    pub chunk_bytes: u64,
    pub retain_bytes: u64,
    pub trim_every_s: f64,
    pub trim_keep_bytes: u64,
    pub periodic_trims: u64,
    pub periodic_trimmed_bytes: u64,
    pub backend: String,
    pub steps: u64,
    pub sim_seconds: f64,
    /// Arena: high-water mark of physical memory held (mapped + pooled).
    pub shared_peak_bytes: u64,
    /// Arena: time-weighted mean of held bytes.
    pub shared_mean_held: f64,
    /// Static partitioning: each tenant holds its own peak all the time.
    pub static_bytes: u64,
    pub idle_held_before_trim: u64,
    pub idle_held_after_trim: u64,
    pub trimmed_bytes: u64,
    pub moves: u64,
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    pub driver_unmaps: u64,
    pub driver_access_calls: u64,
    pub mode: Mode,
    /// Driver calls made inside the steps (admission, growth, free: the
    /// engines' critical path) and between them (`maintain`,
    /// `release_retired`), counted by the driver.
    pub critical_calls: Calls,
    pub between_calls: Calls,
    /// Chunk creations inside steps that needed no more KV than an earlier
    /// step (warm steps).
    pub critical_creates_warm: u64,
    /// Steps where the tenants' mapped bytes did not add up to the arena's `mapped_bytes`.
    pub accounting_errors: u64,
    pub integrity_errors: u64,
    pub wall_seconds: f64,
}

// ---------------------------------------------------------------- load

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unit(x: &mut u64) -> f64 {
    ((splitmix(x) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

fn normal(x: &mut u64) -> f64 {
    let (u, v) = (unit(x), unit(x));
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// Seeded synthetic requests.
pub fn synthetic(s: &Synthetic, n: usize, seed: u64) -> Vec<Request> {
    let mut x = seed;
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let r = Request {
                arrive_s: t,
                prompt: ((s.prompt_median * (s.prompt_sigma * normal(&mut x)).exp()).round() as u64)
                    .clamp(1, s.prompt_max),
                output: ((s.output_median * (s.output_sigma * normal(&mut x)).exp()).round() as u64)
                    .clamp(1, s.output_max),
            };
            t += -unit(&mut x).ln() / s.rate_per_s;
            r
        })
        .collect()
}

/// The fields of a Mooncake JSONL line that the replay uses (others, such as
/// `hash_ids`, are skipped).
#[derive(Deserialize)]
struct MooncakeLine {
    /// Milliseconds.
    timestamp: f64,
    input_length: f64,
    output_length: f64,
}

/// Reads the first `limit` requests of an Azure CSV or Mooncake JSONL trace,
/// arrivals relative to the first one.
pub fn load_trace(path: &Path, limit: usize) -> Result<Vec<Request>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = || format!("{}:{}: cannot parse {line:?}", path.display(), n + 1);
        let r = if line.starts_with('{') {
            let m: MooncakeLine = serde_json::from_str(line).map_err(|e| format!("{} ({e})", bad()))?;
            Request { arrive_s: m.timestamp / 1000.0, prompt: m.input_length as u64, output: m.output_length as u64 }
        } else {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            if f.len() < 3 || f[0].parse::<f64>().is_err() {
                if n == 0 {
                    continue; // header
                }
                return Err(bad());
            }
            Request {
                arrive_s: f[0].parse().map_err(|_| bad())?,
                prompt: f[1].parse::<f64>().map_err(|_| bad())? as u64,
                output: f[2].parse::<f64>().map_err(|_| bad())? as u64,
            }
        };
        out.push(Request { prompt: r.prompt.max(1), output: r.output.max(1), ..r });
    }
    if out.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    let t0 = out.iter().map(|r| r.arrive_s).fold(f64::INFINITY, f64::min);
    for r in &mut out {
        r.arrive_s -= t0;
    }
    out.sort_by(|a, b| a.arrive_s.total_cmp(&b.arrive_s));
    Ok(out)
}

// ---------------------------------------------------------------- simulation

struct Running {
    req: usize,
    id: Id,
    tokens: u64,
    target: u64,
}

#[derive(Default)]
struct TenantState {
    reqs: Vec<Request>,
    start_s: f64,
    bpt: u64,
    next: usize,
    waiting: VecDeque<usize>,
    running: Vec<Running>,
    mapped: u64,
    queue_sum: f64,
    admitted: u64,
    rep: TenantReport,
}

#[derive(Default)]
struct PhaseAcc {
    steps: u64,
    mapped_sum: Vec<f64>,
    mapped_peak: Vec<u64>,
    running_sum: Vec<f64>,
    pooled_peak: u64,
    held_sum: f64,
    held_peak: u64,
    creates0: u64,
    releases0: u64,
    creates1: u64,
    releases1: u64,
    from_s: f64,
    to_s: f64,
}

fn round_up(b: u64, chunk: u64) -> u64 {
    b.div_ceil(chunk) * chunk
}

fn tag(seed: u64, tenant: usize, req: usize, token: u64) -> u64 {
    let mut x = seed ^ ((tenant as u64) << 56) ^ ((req as u64) << 24) ^ token;
    splitmix(&mut x)
}

/// Writes the tag of `token` into the request's slot for it.
fn put_tag(arena: &Arena, seed: u64, t: usize, ts: &TenantState, r: &Running, token: u64) -> Result<(), Error> {
    arena.write(r.id, token * ts.bpt, &tag(seed, t, r.req, token).to_le_bytes())
}

/// Verifies every token's tag; returns the number of wrong ones.
fn check_tags(arena: &Arena, seed: u64, t: usize, ts: &TenantState, r: &Running) -> u64 {
    let mut bad = 0;
    let mut buf = [0u8; 8];
    for k in 0..r.tokens {
        match arena.read(r.id, k * ts.bpt, &mut buf) {
            Ok(()) if u64::from_le_bytes(buf) == tag(seed, t, r.req, k) => {}
            _ => bad += 1,
        }
    }
    bad
}

/// Verifies and frees a request's KV (on the engine's stream in
/// `Mode::Stream`).
fn retire(arena: &Arena, mode: Mode, seed: u64, t: usize, ts: &mut TenantState, r: &Running) -> Result<(), String> {
    ts.rep.integrity_errors += check_tags(arena, seed, t, ts, r);
    match mode {
        Mode::Stream => arena.free_on_stream(r.id, ENGINE_STREAM),
        Mode::Sync => arena.free(r.id),
    }
    .map_err(|e| format!("free failed: {e}"))?;
    ts.mapped -= round_up(r.tokens * ts.bpt, arena.chunk_bytes());
    Ok(())
}

/// Runs the simulation.
pub fn run(cfg: &Config) -> Result<Report, String> {
    let wall = Instant::now();
    if cfg.tenants.is_empty() || cfg.tenants.len() > 8 {
        return Err("between 1 and 8 tenants".into());
    }
    let host = match cfg.backend {
        Backend::Host => HostDriver::new(),
        Backend::HostSparse => HostDriver::with_options(HostOptions { sparse: true }),
        Backend::Cuda => return Err("multi_tenant runs on the host backends".into()),
    }
    .map_err(|e| format!("host backend: {e}"))?;
    let device_bytes = match cfg.capacity_bytes {
        0 => vmm_arena::driver::Driver::total_memory(&host).map_err(|e| e.to_string())?,
        c => c,
    };
    let dev = std::sync::Arc::new(Counted::new(host, device_bytes));
    let arena = Arena::with_driver(
        dev.clone(),
        ArenaConfig {
            backend: cfg.backend,
            capacity_bytes: cfg.capacity_bytes,
            chunk_bytes: cfg.chunk_bytes,
            retain_bytes: cfg.retain_bytes,
            ..Default::default()
        },
    )
    .map_err(|e| format!("cannot create the arena: {e}"))?;
    let stream = cfg.mode == Mode::Stream;
    if stream {
        arena.set_prefetch(cfg.precreate_bytes, cfg.map_ahead_bytes).map_err(|e| format!("set_prefetch: {e}"))?;
    }
    let chunk = arena.chunk_bytes();
    let capacity = arena.stats().map_err(|e| e.to_string())?.capacity_bytes;
    let headroom = capacity / 100;

    let mut ts: Vec<TenantState> = Vec::new();
    for (i, spec) in cfg.tenants.iter().enumerate() {
        let (reqs, source) = match &spec.source {
            Source::Trace(p) => (load_trace(p, cfg.limit)?, p.display().to_string()),
            Source::Synthetic(s) => (
                synthetic(s, cfg.limit, cfg.seed.wrapping_add(i as u64 * 7919)),
                format!("synthetic {:.1} req/s, prompt median {}", s.rate_per_s, s.prompt_median),
            ),
        };
        ts.push(TenantState {
            bpt: spec.kv_bytes_per_token,
            rep: TenantReport {
                name: spec.name.clone(),
                source,
                kv_bytes_per_token: spec.kv_bytes_per_token,
                requests: reqs.len() as u64,
                ..Default::default()
            },
            reqs,
            ..Default::default()
        });
    }
    let span_a = ts[0].reqs.last().map_or(0.0, |r| r.arrive_s);
    let shift = cfg.shift_s.unwrap_or(span_a / 2.0);
    for (i, t) in ts.iter_mut().enumerate() {
        t.start_s = i as f64 * shift;
        t.rep.start_s = t.start_s;
    }
    let snapshot_at = cfg.snapshot_at_s.unwrap_or_else(|| {
        let end_b = ts.get(1).map_or(span_a, |t| t.start_s + t.reqs.last().map_or(0.0, |r| r.arrive_s));
        (shift.min(span_a) + span_a.min(end_b)) / 2.0
    });
    let mut snapshot_taken = false;
    let end_arrivals = ts.iter().map(|t| t.start_s + t.reqs.last().map_or(0.0, |r| r.arrive_s)).fold(0.0, f64::max);
    let nphase = cfg.phases.max(1);
    let phase_len = (end_arrivals / nphase as f64).max(cfg.step_ms / 1000.0);
    let nt = ts.len();
    let mut acc: Vec<PhaseAcc> = (0..=nphase)
        .map(|p| PhaseAcc {
            mapped_sum: vec![0.0; nt],
            mapped_peak: vec![0; nt],
            running_sum: vec![0.0; nt],
            from_s: p as f64 * phase_len,
            to_s: (p + 1) as f64 * phase_len,
            ..Default::default()
        })
        .collect();

    let seed = cfg.seed;
    let step_s = cfg.step_ms / 1000.0;
    let mut step: u64 = 0;
    let mut held_sum = 0.0;
    let mut accounting_errors = 0;
    let mut cur_phase = usize::MAX;
    let trim_steps = if cfg.trim_every_s > 0.0 { (cfg.trim_every_s / step_s).round().max(1.0) as u64 } else { 0 };
    let (mut trims, mut periodic_trimmed) = (0u64, 0u64);
    // Simulated milliseconds until the last arrival; the drain after it shows as the bar's end.
    let bar = if cfg.progress {
        indicatif::ProgressBar::new((end_arrivals * 1000.0) as u64)
            .with_style(
                indicatif::ProgressStyle::with_template("multi_tenant {bar:40} simulated {msg} s, {elapsed} elapsed")
                    .expect("a valid template"),
            )
            .with_message("0")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let (mut critical_calls, mut between_calls) = (Calls::default(), Calls::default());
    let (mut critical_creates_warm, mut peak_need) = (0u64, 0u64);
    loop {
        let now = step as f64 * step_s;
        let calls_before = dev.calls();
        // Arrivals.
        for t in ts.iter_mut() {
            while t.next < t.reqs.len() && t.start_s + t.reqs[t.next].arrive_s <= now {
                t.waiting.push_back(t.next);
                t.next += 1;
            }
        }
        // Admission, tenants in rotating order so none is always first.
        for k in 0..nt {
            let ti = (k + step as usize) % nt;
            let total_mapped: u64 = ts.iter().map(|t| t.mapped).sum();
            let t = &mut ts[ti];
            let mut used = total_mapped;
            while t.running.len() < cfg.max_batch {
                let Some(&ri) = t.waiting.front() else { break };
                let r = t.reqs[ri];
                let bytes = r.prompt * t.bpt;
                let max = (r.prompt + r.output) * t.bpt;
                if round_up(max, chunk) > capacity / 2 {
                    t.waiting.pop_front();
                    t.rep.skipped_too_large += 1;
                    continue;
                }
                if used + round_up(bytes, chunk) + headroom > capacity {
                    break;
                }
                let id = match arena.alloc_growable(bytes, max) {
                    Ok((id, _)) => id,
                    Err(Error::OutOfMemory(_)) => break,
                    Err(e) => return Err(format!("alloc_growable({bytes}, {max}) failed: {e}")),
                };
                t.waiting.pop_front();
                let run = Running { req: ri, id, tokens: r.prompt, target: r.prompt + r.output };
                for k in 0..r.prompt {
                    put_tag(&arena, seed, ti, t, &run, k).map_err(|e| format!("write failed: {e}"))?;
                }
                t.rep.tokens_written += r.prompt;
                let wait = now - (t.start_s + r.arrive_s);
                t.queue_sum += wait;
                t.admitted += 1;
                t.rep.max_queue_s = t.rep.max_queue_s.max(wait);
                t.mapped += round_up(bytes, chunk);
                used += round_up(bytes, chunk);
                t.running.push(run);
            }
        }
        // Decode: one token per running request; in stream mode each
        // tenant's batch grows at once first (on failure, one by one).
        for (ti, t) in ts.iter_mut().enumerate() {
            if stream && !t.running.is_empty() {
                let batch: Vec<(Id, u64)> = t.running.iter().map(|r| (r.id, (r.tokens + 1) * t.bpt)).collect();
                match arena.resize_many(&batch) {
                    Ok(_) | Err(Error::OutOfMemory(_)) => {}
                    Err(e) => return Err(format!("resize_many of {} requests failed: {e}", batch.len())),
                }
            }
            let mut i = 0;
            while i < t.running.len() {
                let (id, tokens) = (t.running[i].id, t.running[i].tokens);
                let new = (tokens + 1) * t.bpt;
                let mut preempted_self = false;
                loop {
                    match arena.resize(id, new) {
                        Ok(_) => break,
                        Err(Error::OutOfMemory(_)) => {
                            // Preempt the most recently admitted request of this tenant.
                            let victim = t.running.pop().expect("running is not empty");
                            retire(&arena, cfg.mode, seed, ti, t, &victim)?;
                            t.rep.preemptions += 1;
                            t.waiting.push_front(victim.req);
                            if t.running.len() == i {
                                preempted_self = true;
                                break;
                            }
                        }
                        Err(e) => return Err(format!("resize to {new} failed: {e}")),
                    }
                }
                if preempted_self {
                    break;
                }
                t.mapped += round_up(new, chunk) - round_up(tokens * t.bpt, chunk);
                let r = &mut t.running[i];
                r.tokens += 1;
                let tok = r.tokens - 1;
                let r = &t.running[i];
                put_tag(&arena, seed, ti, t, r, tok).map_err(|e| format!("write failed: {e}"))?;
                t.rep.tokens_written += 1;
                if r.tokens >= r.target {
                    let done = t.running.remove(i);
                    retire(&arena, cfg.mode, seed, ti, t, &done)?;
                    t.rep.completed += 1;
                } else {
                    i += 1;
                }
            }
        }
        // The KV the steps need (mapped by the tenants' requests) at its
        // highest so far: a step that needs no more is warm.
        let need: u64 = ts.iter().map(|t| t.mapped).sum();
        let critical = dev.calls().since(&calls_before);
        if step > 0 && need <= peak_need {
            critical_creates_warm += critical.create;
        }
        peak_need = peak_need.max(need);
        critical_calls = critical_calls.plus(&critical);
        let between_before = dev.calls();
        if trim_steps > 0 && step % trim_steps == trim_steps - 1 {
            periodic_trimmed += arena.trim(cfg.trim_keep_bytes).map_err(|e| format!("trim failed: {e}"))?;
            trims += 1;
        }
        if !snapshot_taken && now >= snapshot_at {
            if let Some(path) = &cfg.snapshot {
                let json = arena.snapshot_json().map_err(|e| e.to_string())?;
                std::fs::write(path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            }
            snapshot_taken = true;
        }
        let mut s = arena.stats().map_err(|e| e.to_string())?;
        if s.retired_va_bytes > 0 {
            arena.release_retired().map_err(|e| format!("release_retired failed: {e}"))?;
            s = arena.stats().map_err(|e| e.to_string())?;
        }
        // While the GPU computes the step: the prefetch targets.
        if stream {
            arena.maintain().map_err(|e| format!("maintain failed: {e}"))?;
            s = arena.stats().map_err(|e| e.to_string())?;
        }
        between_calls = between_calls.plus(&dev.calls().since(&between_before));
        // Accounting.
        let total_mapped: u64 = ts.iter().map(|t| t.mapped).sum();
        if total_mapped != s.mapped_bytes {
            accounting_errors += 1;
        }
        let p = if now < end_arrivals { ((now / phase_len) as usize).min(nphase - 1) } else { nphase };
        if p != cur_phase {
            if cur_phase != usize::MAX {
                acc[cur_phase].creates1 = s.driver_creates;
                acc[cur_phase].releases1 = s.driver_releases;
            }
            acc[p].creates0 = s.driver_creates;
            acc[p].releases0 = s.driver_releases;
            cur_phase = p;
        }
        let a = &mut acc[p];
        a.steps += 1;
        a.creates1 = s.driver_creates;
        a.releases1 = s.driver_releases;
        for (k, t) in ts.iter_mut().enumerate() {
            a.mapped_sum[k] += t.mapped as f64;
            a.mapped_peak[k] = a.mapped_peak[k].max(t.mapped);
            a.running_sum[k] += t.running.len() as f64;
            t.rep.peak_mapped_bytes = t.rep.peak_mapped_bytes.max(t.mapped);
            t.rep.mean_mapped_bytes += t.mapped as f64;
        }
        let held = s.mapped_bytes + s.pooled_bytes;
        a.pooled_peak = a.pooled_peak.max(s.pooled_bytes);
        a.held_sum += held as f64;
        a.held_peak = a.held_peak.max(held);
        held_sum += held as f64;
        step += 1;
        dev.finish_gpu_step();
        if step % 256 == 0 {
            bar.set_position((now * 1000.0) as u64);
            bar.set_message(format!("{now:.0}"));
        }
        if ts.iter().all(|t| t.next == t.reqs.len() && t.waiting.is_empty() && t.running.is_empty()) {
            break;
        }
        if step > 100_000_000 {
            return Err("the simulation does not finish".into());
        }
    }
    bar.finish_and_clear();
    let sim_seconds = step as f64 * step_s;
    acc[nphase].to_s = sim_seconds.max(acc[nphase].from_s);

    // Idle: everything has finished; the pool holds up to the watermark.
    let before = arena.stats().map_err(|e| e.to_string())?;
    if let (false, Some(path)) = (snapshot_taken, &cfg.snapshot) {
        let json = arena.snapshot_json().map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    let trimmed = arena.trim(0).map_err(|e| format!("trim failed: {e}"))?;
    let after = arena.stats().map_err(|e| e.to_string())?;

    let mut phases: Vec<PhaseReport> = acc
        .iter()
        .enumerate()
        .map(|(p, a)| {
            let n = a.steps.max(1) as f64;
            PhaseReport {
                name: if p < nphase { format!("{}", p + 1) } else { "drain".into() },
                from_s: a.from_s,
                to_s: a.to_s,
                steps: a.steps,
                mean_mapped: a.mapped_sum.iter().map(|v| v / n).collect(),
                peak_mapped: a.mapped_peak.clone(),
                mean_running: a.running_sum.iter().map(|v| v / n).collect(),
                peak_pooled: a.pooled_peak,
                mean_held: a.held_sum / n,
                peak_held: a.held_peak,
                creates: a.creates1.saturating_sub(a.creates0),
                releases: a.releases1.saturating_sub(a.releases0),
            }
        })
        .collect();
    let idle_held = after.mapped_bytes + after.pooled_bytes;
    phases.push(PhaseReport {
        name: "idle".into(),
        from_s: sim_seconds,
        to_s: sim_seconds,
        steps: 0,
        mean_mapped: vec![0.0; nt],
        peak_mapped: vec![0; nt],
        mean_running: vec![0.0; nt],
        peak_pooled: after.pooled_bytes,
        mean_held: idle_held as f64,
        peak_held: idle_held,
        creates: after.driver_creates - before.driver_creates,
        releases: after.driver_releases - before.driver_releases,
    });
    let mut tenants = Vec::new();
    for t in ts {
        let mut r = t.rep;
        r.mean_mapped_bytes /= step.max(1) as f64;
        r.mean_queue_s = t.queue_sum / t.admitted.max(1) as f64;
        tenants.push(r);
    }
    Ok(Report {
        static_bytes: tenants.iter().map(|t| t.peak_mapped_bytes).sum(),
        integrity_errors: tenants.iter().map(|t| t.integrity_errors).sum(),
        tenants,
        phases,
        capacity_bytes: capacity,
        chunk_bytes: chunk,
        retain_bytes: cfg.retain_bytes,
        trim_every_s: cfg.trim_every_s,
        trim_keep_bytes: cfg.trim_keep_bytes,
        periodic_trims: trims,
        periodic_trimmed_bytes: periodic_trimmed,
        backend: match cfg.backend {
            Backend::HostSparse => "host-sparse".into(),
            _ => arena.backend_name().to_string(),
        },
        steps: step,
        sim_seconds,
        shared_peak_bytes: after.peak_physical_bytes,
        shared_mean_held: held_sum / step.max(1) as f64,
        idle_held_before_trim: before.mapped_bytes + before.pooled_bytes,
        idle_held_after_trim: idle_held,
        trimmed_bytes: trimmed,
        moves: after.moves,
        driver_creates: after.driver_creates,
        driver_releases: after.driver_releases,
        driver_maps: after.driver_maps,
        driver_unmaps: after.driver_unmaps,
        driver_access_calls: after.driver_access_calls,
        mode: cfg.mode,
        critical_calls,
        between_calls,
        critical_creates_warm,
        accounting_errors,
        wall_seconds: wall.elapsed().as_secs_f64(),
    })
}

// ---------------------------------------------------------------- output

fn gib(b: f64) -> f64 {
    b / GIB as f64
}

/// `1.5 GiB`, `32 MiB`, `2 MiB`.
fn human(b: u64) -> String {
    if b >= GIB {
        format!("{:.1} GiB", gib(b as f64))
    } else if b >= 1 << 20 {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    } else {
        format!("{:.0} KiB", b as f64 / KIB as f64)
    }
}

impl Report {
    /// The printed table.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "multi_tenant: {} tenants share one arena ({}; capacity {}, chunk {}, retain {}; {})",
            self.tenants.len(),
            self.backend,
            human(self.capacity_bytes),
            human(self.chunk_bytes),
            if self.retain_bytes == u64::MAX { "all".into() } else { human(self.retain_bytes) },
            if self.trim_every_s > 0.0 {
                format!("the engine calls trim({}) every {} s", human(self.trim_keep_bytes), self.trim_every_s)
            } else {
                "no periodic trim".into()
            }
        );
        for t in &self.tenants {
            let _ = writeln!(
                o,
                "  {}: {} KiB/token, {} requests from {:.0} s ({})",
                t.name,
                t.kv_bytes_per_token / KIB,
                t.requests,
                t.start_s,
                t.source
            );
        }
        let _ = writeln!(o);
        let _ = write!(o, "{:<6} {:>15}", "phase", "window s");
        for t in &self.tenants {
            let n: String = t.name.chars().take(19).collect();
            let _ = write!(o, " {n:>19}");
        }
        let _ = writeln!(o, " {:>12} {:>15} {:>8} {:>8}", "pooled peak", "held mean/peak", "creates", "releases");
        let _ = write!(o, "{:<6} {:>15}", "", "");
        for _ in &self.tenants {
            let _ = write!(o, " {:>19}", "GiB mean/peak");
        }
        let _ = writeln!(o, " {:>12} {:>15} {:>8} {:>8}", "GiB", "GiB", "", "");
        for p in &self.phases {
            let window =
                if p.name == "idle" { "after trim(0)".to_string() } else { format!("{:.0}-{:.0}", p.from_s, p.to_s) };
            let _ = write!(o, "{:<6} {:>15}", p.name, window);
            for k in 0..self.tenants.len() {
                let cell = format!("{:.2} / {:.2}", gib(p.mean_mapped[k]), gib(p.peak_mapped[k] as f64));
                let _ = write!(o, " {cell:>19}");
            }
            let held = format!("{:.2} / {:.2}", gib(p.mean_held), gib(p.peak_held as f64));
            let _ = writeln!(o, " {:>12.2} {held:>15} {:>8} {:>8}", gib(p.peak_pooled as f64), p.creates, p.releases);
        }
        let _ = writeln!(o);
        let _ = writeln!(o, "{:<34} {:>14} {:>26}", "", "shared arena", "static partitions (peaks)");
        let _ = writeln!(
            o,
            "{:<34} {:>10.2} GiB {:>22.2} GiB",
            "peak physical",
            gib(self.shared_peak_bytes as f64),
            gib(self.static_bytes as f64)
        );
        let _ = writeln!(
            o,
            "{:<34} {:>10.2} GiB {:>22.2} GiB",
            "time-weighted mean held",
            gib(self.shared_mean_held),
            gib(self.static_bytes as f64)
        );
        let _ = writeln!(
            o,
            "{:<34} {:>10.2} GiB {:>22.2} GiB",
            "idle footprint before trim",
            gib(self.idle_held_before_trim as f64),
            gib(self.static_bytes as f64)
        );
        let _ = writeln!(
            o,
            "{:<34} {:>10.2} GiB {:>22.2} GiB",
            "idle footprint after trim(0)",
            gib(self.idle_held_after_trim as f64),
            gib(self.static_bytes as f64)
        );
        if self.static_bytes > self.capacity_bytes {
            let _ = writeln!(
                o,
                "(static partitions would need {:.2} GiB, more than the {:.2} GiB capacity: sized to fit it, \
                 some tenant's peak would queue or fail)",
                gib(self.static_bytes as f64),
                gib(self.capacity_bytes as f64)
            );
        }
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "{:<14} {:>9} {:>9} {:>8} {:>11} {:>12} {:>13} {:>10}",
            "tenant", "requests", "completed", "skipped", "preemptions", "peak GiB", "mean queue s", "integrity"
        );
        for t in &self.tenants {
            let n: String = t.name.chars().take(14).collect();
            let _ = writeln!(
                o,
                "{n:<14} {:>9} {:>9} {:>8} {:>11} {:>12.2} {:>13.2} {:>10}",
                t.requests,
                t.completed,
                t.skipped_too_large,
                t.preemptions,
                gib(t.peak_mapped_bytes as f64),
                t.mean_queue_s,
                t.integrity_errors
            );
        }
        let (c, b) = (&self.critical_calls, &self.between_calls);
        let _ = writeln!(
            o,
            "\n{} mode: inside steps (critical path) creates {} ({} in warm steps), maps {}, access calls {}, \
             unmaps {}, synchronizes {}, blocking event waits {}, events recorded {}; between steps creates {}, \
             maps {}, access calls {}, unmaps {}, synchronizes {}, blocking event waits {}",
            match self.mode {
                Mode::Stream => "stream",
                Mode::Sync => "sync",
            },
            c.create,
            self.critical_creates_warm,
            c.map,
            c.set_access,
            c.unmap,
            c.synchronize,
            c.event_wait_blocked,
            c.event_record,
            b.create,
            b.map,
            b.set_access,
            b.unmap,
            b.synchronize,
            b.event_wait_blocked
        );
        let _ = writeln!(
            o,
            "{} steps ({:.0} s simulated) in {:.1} s; moves {}; driver creates {} releases {} maps {} unmaps {}; \
             accounting errors {}; integrity errors {}",
            self.steps,
            self.sim_seconds,
            self.wall_seconds,
            self.moves,
            self.driver_creates,
            self.driver_releases,
            self.driver_maps,
            self.driver_unmaps,
            self.accounting_errors,
            self.integrity_errors
        );
        o
    }

    /// The figures as a JSON document.
    pub fn to_json(&self) -> String {
        let doc = ReportJson {
            workload: WorkloadJson {
                example: "multi_tenant",
                backend: &self.backend,
                capacity_bytes: self.capacity_bytes,
                chunk_bytes: self.chunk_bytes,
                // u64::MAX means "keep everything": null, not a number no reader expects.
                retain_bytes: Some(self.retain_bytes).filter(|&b| b != u64::MAX),
                trim_every_seconds: self.trim_every_s,
                trim_keep_bytes: self.trim_keep_bytes,
                steps: self.steps,
                sim_seconds: self.sim_seconds,
            },
            tenants: self
                .tenants
                .iter()
                .map(|t| TenantJson {
                    name: &t.name,
                    source: &t.source,
                    kv_bytes_per_token: t.kv_bytes_per_token,
                    start_s: t.start_s,
                    requests: t.requests,
                    completed_requests: t.completed,
                    skipped_too_large: t.skipped_too_large,
                    preemptions: t.preemptions,
                    tokens_written: t.tokens_written,
                    peak_mapped_bytes: t.peak_mapped_bytes,
                    mean_mapped_bytes: t.mean_mapped_bytes,
                    mean_queue_seconds: t.mean_queue_s,
                    max_queue_seconds: t.max_queue_s,
                    integrity_errors: t.integrity_errors,
                })
                .collect(),
            phases: self
                .phases
                .iter()
                .map(|p| PhaseJson {
                    name: &p.name,
                    from_s: p.from_s,
                    to_s: p.to_s,
                    steps: p.steps,
                    mean_mapped_bytes: &p.mean_mapped,
                    peak_mapped_bytes: &p.peak_mapped,
                    mean_running: &p.mean_running,
                    peak_pooled_bytes: p.peak_pooled,
                    mean_held_bytes: p.mean_held,
                    peak_held_bytes: p.peak_held,
                    driver_creates: p.creates,
                    driver_releases: p.releases,
                })
                .collect(),
            shared: SharedJson {
                peak_physical_bytes: self.shared_peak_bytes,
                mean_held_bytes: self.shared_mean_held,
                idle_held_before_trim_bytes: self.idle_held_before_trim,
                idle_held_after_trim_bytes: self.idle_held_after_trim,
                trimmed_bytes: self.trimmed_bytes,
                moves: self.moves,
                driver_calls: DriverCallsJson {
                    create: self.driver_creates,
                    release: self.driver_releases,
                    map: self.driver_maps,
                    unmap: self.driver_unmaps,
                    set_access: self.driver_access_calls,
                },
                periodic_trims: self.periodic_trims,
                periodic_trimmed_bytes: self.periodic_trimmed_bytes,
                mode: self.mode,
                critical_path_calls: self.critical_calls,
                between_steps_calls: self.between_calls,
                critical_path_creates_warm: self.critical_creates_warm,
            },
            static_partitions: StaticJson {
                total_bytes: self.static_bytes,
                per_tenant_bytes: self.tenants.iter().map(|t| t.peak_mapped_bytes).collect(),
            },
            accounting_errors: self.accounting_errors,
            integrity_errors: self.integrity_errors,
            wall_seconds: self.wall_seconds,
        };
        serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
    }
}

// The JSON layout of a `Report` (field names are what scripts read; floats
// that are not finite become null).

#[derive(Serialize)]
struct ReportJson<'a> {
    workload: WorkloadJson<'a>,
    tenants: Vec<TenantJson<'a>>,
    phases: Vec<PhaseJson<'a>>,
    shared: SharedJson,
    static_partitions: StaticJson,
    accounting_errors: u64,
    integrity_errors: u64,
    wall_seconds: f64,
}

#[derive(Serialize)]
struct WorkloadJson<'a> {
    example: &'static str,
    backend: &'a str,
    capacity_bytes: u64,
    chunk_bytes: u64,
    retain_bytes: Option<u64>,
    trim_every_seconds: f64,
    trim_keep_bytes: u64,
    steps: u64,
    sim_seconds: f64,
}

#[derive(Serialize)]
struct TenantJson<'a> {
    name: &'a str,
    source: &'a str,
    kv_bytes_per_token: u64,
    start_s: f64,
    requests: u64,
    completed_requests: u64,
    skipped_too_large: u64,
    preemptions: u64,
    tokens_written: u64,
    peak_mapped_bytes: u64,
    mean_mapped_bytes: f64,
    mean_queue_seconds: f64,
    max_queue_seconds: f64,
    integrity_errors: u64,
}

#[derive(Serialize)]
struct PhaseJson<'a> {
    name: &'a str,
    from_s: f64,
    to_s: f64,
    steps: u64,
    mean_mapped_bytes: &'a [f64],
    peak_mapped_bytes: &'a [u64],
    mean_running: &'a [f64],
    peak_pooled_bytes: u64,
    mean_held_bytes: f64,
    peak_held_bytes: u64,
    driver_creates: u64,
    driver_releases: u64,
}

#[derive(Serialize)]
struct SharedJson {
    peak_physical_bytes: u64,
    mean_held_bytes: f64,
    idle_held_before_trim_bytes: u64,
    idle_held_after_trim_bytes: u64,
    trimmed_bytes: u64,
    moves: u64,
    driver_calls: DriverCallsJson,
    periodic_trims: u64,
    periodic_trimmed_bytes: u64,
    mode: Mode,
    critical_path_calls: Calls,
    between_steps_calls: Calls,
    critical_path_creates_warm: u64,
}

#[derive(Serialize)]
struct DriverCallsJson {
    create: u64,
    release: u64,
    map: u64,
    unmap: u64,
    set_access: u64,
}

#[derive(Serialize)]
struct StaticJson {
    total_bytes: u64,
    per_tenant_bytes: Vec<u64>,
}

// ---------------------------------------------------------------- command line

/// Parses `123`, `64MiB`, `40GiB`, `1.5G`, `512k` (binary units).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => KIB,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => GIB,
        "t" | "tib" | "tb" => 1 << 40,
        _ => return Err(format!("bad size {s:?}")),
    };
    let v: f64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    Ok((v * mult as f64) as u64)
}

/// The arena's backends a run can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Host,
    HostSparse,
}

/// Several models' KV caches share one arena as load shifts between them;
/// compares the shared arena with static per-model partitions.
#[derive(Debug, Parser)]
#[command(name = "multi_tenant")]
pub struct Cli {
    /// Tenant A's trace (Azure CSV or Mooncake JSONL); without it, synthetic Azure-like load at 5.5 req/s.
    #[arg(long, value_name = "PATH")]
    pub trace_a: Option<PathBuf>,
    /// Tenant B's trace; without it, synthetic Mooncake-like load at 3.4 req/s.
    #[arg(long, value_name = "PATH")]
    pub trace_b: Option<PathBuf>,
    /// Tenant C's trace; without it, synthetic Azure-like load at 2 req/s.
    #[arg(long, value_name = "PATH")]
    pub trace_c: Option<PathBuf>,
    /// Number of tenants.
    #[arg(long, value_name = "1|2|3", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=3))]
    pub tenants: u64,
    /// Requests per tenant.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: u64,
    /// Tenant A's KV bytes per token (`320KiB`: llama3-70b).
    #[arg(long, value_name = "BYTES", default_value = "320KiB", value_parser = parse_bytes)]
    pub kv_a: u64,
    /// Tenant B's KV bytes per token (`128KiB`: llama3-8b).
    #[arg(long, value_name = "BYTES", default_value = "128KiB", value_parser = parse_bytes)]
    pub kv_b: u64,
    /// Tenant C's KV bytes per token (`512KiB`: llama2-7b).
    #[arg(long, value_name = "BYTES", default_value = "512KiB", value_parser = parse_bytes)]
    pub kv_c: u64,
    /// Seconds between tenants' starts [default: half of tenant A's arrival span].
    #[arg(long, value_name = "SECONDS")]
    pub shift: Option<f64>,
    /// Physical capacity of the device.
    #[arg(long, value_name = "BYTES", default_value = "80GiB", value_parser = parse_bytes)]
    pub capacity: u64,
    /// Chunk size; 0: 2 MiB, or the driver's recommended granularity if larger.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub chunk: u64,
    /// Pooled memory kept after frees (beyond it chunks go back to the driver) [default: all].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub retain: Option<u64>,
    /// Every this many simulated seconds the engine calls trim(--trim-keep); 0: never.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub trim_every: f64,
    /// What the periodic trim keeps pooled.
    #[arg(long, value_name = "BYTES", default_value = "4GiB", value_parser = parse_bytes)]
    pub trim_keep: u64,
    /// Simulated milliseconds per scheduler step.
    #[arg(long, value_name = "MS", default_value_t = 30.0)]
    pub step_ms: f64,
    /// Most running requests per tenant.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_batch: u64,
    /// Phases (windows of simulated time) the table reports.
    #[arg(long, value_name = "N", default_value_t = 6)]
    pub phases: u64,
    /// Seed of the synthetic load and the tags.
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub seed: u64,
    /// The arena's backend (host-sparse commits no chunk, so replays larger than RAM run).
    #[arg(long, value_enum, default_value_t = BackendArg::HostSparse)]
    pub backend: BackendArg,
    /// How engines drive the arena: stream (free on the stream, prefetch
    /// kept by maintain between steps, batch growth) or sync (as before).
    #[arg(long, value_enum, default_value_t = Mode::Stream)]
    pub mode: Mode,
    /// Stream mode: created, unmapped chunks kept pooled.
    #[arg(long, value_name = "BYTES", default_value = "8MiB", value_parser = parse_bytes)]
    pub precreate: u64,
    /// Stream mode: bytes kept mapped past each request's KV.
    #[arg(long, value_name = "BYTES", default_value = "2MiB", value_parser = parse_bytes)]
    pub map_ahead: u64,
    /// Also write the report as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the arena's snapshot (for `snapshot_svg`) to PATH.
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<PathBuf>,
    /// Simulated time of the snapshot [default: the middle of the time when A and B both receive requests].
    #[arg(long, value_name = "SECONDS")]
    pub snapshot_at: Option<f64>,
}

impl Cli {
    /// The run this command line asks for.
    pub fn config(&self) -> Result<Config, String> {
        if self.step_ms.is_nan() || self.step_ms <= 0.0 {
            return Err("--step-ms must be positive".into());
        }
        let traces = [&self.trace_a, &self.trace_b, &self.trace_c];
        let kv = [self.kv_a, self.kv_b, self.kv_c];
        let names = ["A", "B", "C"];
        let models = |b: u64| match b {
            x if x == 128 * KIB => " llama3-8b",
            x if x == 320 * KIB => " llama3-70b",
            x if x == 512 * KIB => " llama2-7b",
            _ => "",
        };
        let synth = [Synthetic::AZURE, Synthetic::MOONCAKE, Synthetic { rate_per_s: 2.0, ..Synthetic::AZURE }];
        let defaults = Config::default();
        Ok(Config {
            tenants: (0..self.tenants as usize)
                .map(|i| TenantSpec {
                    name: format!("{}{}", names[i], models(kv[i])),
                    kv_bytes_per_token: kv[i],
                    source: match traces[i] {
                        Some(p) => Source::Trace(p.clone()),
                        None => Source::Synthetic(synth[i]),
                    },
                })
                .collect(),
            limit: self.limit as usize,
            shift_s: self.shift,
            capacity_bytes: self.capacity,
            chunk_bytes: self.chunk,
            retain_bytes: self.retain.unwrap_or(defaults.retain_bytes),
            trim_every_s: self.trim_every,
            trim_keep_bytes: self.trim_keep,
            step_ms: self.step_ms,
            max_batch: self.max_batch as usize,
            phases: self.phases as usize,
            seed: self.seed,
            backend: match self.backend {
                BackendArg::Host => Backend::Host,
                BackendArg::HostSparse => Backend::HostSparse,
            },
            mode: self.mode,
            precreate_bytes: self.precreate,
            map_ahead_bytes: self.map_ahead,
            snapshot: self.snapshot.clone(),
            snapshot_at_s: self.snapshot_at,
            progress: false,
        })
    }
}

/// The `multi_tenant` program (`src/bin/multi_tenant.rs`).
pub fn main() {
    let cli = Cli::parse();
    let cfg = match cli.config() {
        Ok(c) => Config { progress: std::io::stderr().is_terminal(), ..c },
        Err(e) => Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit(),
    };
    let report = match run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("multi_tenant: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", report.table());
    if let Some(path) = &cli.json {
        if let Err(e) = std::fs::write(path, report.to_json()) {
            eprintln!("cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    if report.integrity_errors > 0 || report.accounting_errors > 0 {
        eprintln!(
            "multi_tenant: {} integrity errors, {} accounting errors",
            report.integrity_errors, report.accounting_errors
        );
        std::process::exit(1);
    }
}
