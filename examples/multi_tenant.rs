//! Several models' KV caches share one arena as load shifts between them.
//!
//! ```text
//! multi_tenant [--trace-a PATH] [--trace-b PATH] [--trace-c PATH] [--tenants 2|3] [--limit N]
//!              [--kv-a BYTES] [--kv-b BYTES] [--kv-c BYTES] [--shift SECONDS] [--capacity BYTES]
//!              [--retain BYTES] [--trim-every SECONDS] [--trim-keep BYTES] [--step-ms MS] [--max-batch N] [--phases N] [--seed N]
//!              [--backend host|host-sparse] [--json PATH] [--snapshot PATH] [--snapshot-at SECONDS]
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
//! pages are touched).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id};

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
    pub snapshot: Option<PathBuf>,
    /// Simulated time of the snapshot; `None`: the middle of the time when A and B both receive requests.
    pub snapshot_at_s: Option<f64>,
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
            snapshot: None,
            snapshot_at_s: None,
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

fn json_number(line: &str, key: &str) -> Option<f64> {
    let pat = format!("\"{key}\"");
    let rest = &line[line.find(&pat)? + pat.len()..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let end =
        rest.find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E'))).unwrap_or(rest.len());
    rest[..end].parse().ok()
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
            Request {
                arrive_s: json_number(line, "timestamp").ok_or_else(bad)? / 1000.0,
                prompt: json_number(line, "input_length").ok_or_else(bad)? as u64,
                output: json_number(line, "output_length").ok_or_else(bad)? as u64,
            }
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

/// Verifies and frees a request's KV; returns the mapped bytes it held.
fn retire(arena: &Arena, seed: u64, t: usize, ts: &mut TenantState, r: &Running) -> Result<(), String> {
    ts.rep.integrity_errors += check_tags(arena, seed, t, ts, r);
    arena.free(r.id).map_err(|e| format!("free failed: {e}"))?;
    ts.mapped -= round_up(r.tokens * ts.bpt, arena.chunk_bytes());
    Ok(())
}

/// Runs the simulation.
pub fn run(cfg: &Config) -> Result<Report, String> {
    let wall = Instant::now();
    if cfg.tenants.is_empty() || cfg.tenants.len() > 8 {
        return Err("between 1 and 8 tenants".into());
    }
    let arena = Arena::new(ArenaConfig {
        backend: cfg.backend,
        capacity_bytes: cfg.capacity_bytes,
        chunk_bytes: cfg.chunk_bytes,
        retain_bytes: cfg.retain_bytes,
        ..Default::default()
    })
    .map_err(|e| format!("cannot create the arena: {e}"))?;
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
    loop {
        let now = step as f64 * step_s;
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
        // Decode: one token per running request.
        for (ti, t) in ts.iter_mut().enumerate() {
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
                            retire(&arena, seed, ti, t, &victim)?;
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
                    retire(&arena, seed, ti, t, &done)?;
                    t.rep.completed += 1;
                } else {
                    i += 1;
                }
            }
        }
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
        if ts.iter().all(|t| t.next == t.reqs.len() && t.waiting.is_empty() && t.running.is_empty()) {
            break;
        }
        if step > 100_000_000 {
            return Err("the simulation does not finish".into());
        }
    }
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

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json_f(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.6}")
    } else {
        "null".into()
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
        let _ = writeln!(
            o,
            "\n{} steps ({:.0} s simulated) in {:.1} s; moves {}; driver creates {} releases {} maps {} unmaps {}; \
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
        let mut o = String::from("{\"workload\":{");
        let _ = write!(
            o,
            "\"example\":\"multi_tenant\",\"backend\":{},\"capacity_bytes\":{},\"chunk_bytes\":{},\"retain_bytes\":{},\
             \"trim_every_seconds\":{},\"trim_keep_bytes\":{},\"steps\":{},\"sim_seconds\":{}}},\"tenants\":[",
            json_str(&self.backend),
            self.capacity_bytes,
            self.chunk_bytes,
            if self.retain_bytes == u64::MAX { "null".into() } else { self.retain_bytes.to_string() },
            json_f(self.trim_every_s),
            self.trim_keep_bytes,
            self.steps,
            json_f(self.sim_seconds)
        );
        for (i, t) in self.tenants.iter().enumerate() {
            if i > 0 {
                o.push(',');
            }
            let _ = write!(
                o,
                "{{\"name\":{},\"source\":{},\"kv_bytes_per_token\":{},\"start_s\":{},\"requests\":{},\
                 \"completed_requests\":{},\"skipped_too_large\":{},\"preemptions\":{},\"tokens_written\":{},\
                 \"peak_mapped_bytes\":{},\"mean_mapped_bytes\":{},\"mean_queue_seconds\":{},\
                 \"max_queue_seconds\":{},\"integrity_errors\":{}}}",
                json_str(&t.name),
                json_str(&t.source),
                t.kv_bytes_per_token,
                json_f(t.start_s),
                t.requests,
                t.completed,
                t.skipped_too_large,
                t.preemptions,
                t.tokens_written,
                t.peak_mapped_bytes,
                json_f(t.mean_mapped_bytes),
                json_f(t.mean_queue_s),
                json_f(t.max_queue_s),
                t.integrity_errors
            );
        }
        o.push_str("],\"phases\":[");
        for (i, p) in self.phases.iter().enumerate() {
            if i > 0 {
                o.push(',');
            }
            let list_f = |v: &[f64]| v.iter().map(|x| json_f(*x)).collect::<Vec<_>>().join(",");
            let list_u = |v: &[u64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
            let _ = write!(
                o,
                "{{\"name\":{},\"from_s\":{},\"to_s\":{},\"steps\":{},\"mean_mapped_bytes\":[{}],\
                 \"peak_mapped_bytes\":[{}],\"mean_running\":[{}],\"peak_pooled_bytes\":{},\"mean_held_bytes\":{},\
                 \"peak_held_bytes\":{},\"driver_creates\":{},\"driver_releases\":{}}}",
                json_str(&p.name),
                json_f(p.from_s),
                json_f(p.to_s),
                p.steps,
                list_f(&p.mean_mapped),
                list_u(&p.peak_mapped),
                list_f(&p.mean_running),
                p.peak_pooled,
                json_f(p.mean_held),
                p.peak_held,
                p.creates,
                p.releases
            );
        }
        let _ = write!(
            o,
            "],\"shared\":{{\"peak_physical_bytes\":{},\"mean_held_bytes\":{},\"idle_held_before_trim_bytes\":{},\
             \"idle_held_after_trim_bytes\":{},\"trimmed_bytes\":{},\"moves\":{},\"driver_calls\":{{\"create\":{},\
             \"release\":{},\"map\":{},\"unmap\":{},\"set_access\":{}}},\"periodic_trims\":{},\
             \"periodic_trimmed_bytes\":{}}},\"static_partitions\":{{\"total_bytes\":{},\
             \"per_tenant_bytes\":[{}]}},\"accounting_errors\":{},\"integrity_errors\":{},\"wall_seconds\":{}}}",
            self.shared_peak_bytes,
            json_f(self.shared_mean_held),
            self.idle_held_before_trim,
            self.idle_held_after_trim,
            self.trimmed_bytes,
            self.moves,
            self.driver_creates,
            self.driver_releases,
            self.driver_maps,
            self.driver_unmaps,
            self.driver_access_calls,
            self.periodic_trims,
            self.periodic_trimmed_bytes,
            self.static_bytes,
            self.tenants.iter().map(|t| t.peak_mapped_bytes.to_string()).collect::<Vec<_>>().join(","),
            self.accounting_errors,
            self.integrity_errors,
            json_f(self.wall_seconds)
        );
        o
    }
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

struct Cli {
    cfg: Config,
    json: Option<PathBuf>,
}

fn parse_args(args: impl Iterator<Item = String>) -> Result<Cli, String> {
    let mut cfg = Config::default();
    let mut json = None;
    let mut traces: [Option<PathBuf>; 3] = [None, None, None];
    let mut kv = [320 * KIB, 128 * KIB, 512 * KIB];
    let mut ntenants = 2;
    let mut it = args;
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|_| format!("bad number {v:?}"));
        match a.as_str() {
            "--trace-a" => traces[0] = Some(val()?.into()),
            "--trace-b" => traces[1] = Some(val()?.into()),
            "--trace-c" => traces[2] = Some(val()?.into()),
            "--kv-a" => kv[0] = parse_bytes(&val()?)?,
            "--kv-b" => kv[1] = parse_bytes(&val()?)?,
            "--kv-c" => kv[2] = parse_bytes(&val()?)?,
            "--tenants" => ntenants = num(val()?)? as usize,
            "--limit" => cfg.limit = num(val()?)? as usize,
            "--shift" => cfg.shift_s = Some(val()?.parse().map_err(|_| "bad --shift".to_string())?),
            "--capacity" => cfg.capacity_bytes = parse_bytes(&val()?)?,
            "--chunk" => cfg.chunk_bytes = parse_bytes(&val()?)?,
            "--retain" => cfg.retain_bytes = parse_bytes(&val()?)?,
            "--trim-every" => cfg.trim_every_s = val()?.parse().map_err(|_| "bad --trim-every".to_string())?,
            "--trim-keep" => cfg.trim_keep_bytes = parse_bytes(&val()?)?,
            "--step-ms" => cfg.step_ms = val()?.parse().map_err(|_| "bad --step-ms".to_string())?,
            "--max-batch" => cfg.max_batch = num(val()?)? as usize,
            "--phases" => cfg.phases = num(val()?)? as usize,
            "--seed" => cfg.seed = num(val()?)?,
            "--backend" => {
                cfg.backend = match val()?.as_str() {
                    "host" => Backend::Host,
                    "host-sparse" => Backend::HostSparse,
                    b => return Err(format!("unknown backend {b:?} (host, host-sparse)")),
                }
            }
            "--json" => json = Some(val()?.into()),
            "--snapshot" => cfg.snapshot = Some(val()?.into()),
            "--snapshot-at" => cfg.snapshot_at_s = Some(val()?.parse().map_err(|_| "bad --snapshot-at".to_string())?),
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    if !(1..=3).contains(&ntenants) {
        return Err("--tenants takes 1, 2 or 3".into());
    }
    if cfg.step_ms <= 0.0 || cfg.limit == 0 || cfg.max_batch == 0 {
        return Err("--step-ms, --limit and --max-batch must be positive".into());
    }
    let names = ["A", "B", "C"];
    let models = |b: u64| match b {
        x if x == 128 * KIB => " llama3-8b",
        x if x == 320 * KIB => " llama3-70b",
        x if x == 512 * KIB => " llama2-7b",
        _ => "",
    };
    let synth = [Synthetic::AZURE, Synthetic::MOONCAKE, Synthetic { rate_per_s: 2.0, ..Synthetic::AZURE }];
    cfg.tenants = (0..ntenants)
        .map(|i| TenantSpec {
            name: format!("{}{}", names[i], models(kv[i])),
            kv_bytes_per_token: kv[i],
            source: match &traces[i] {
                Some(p) => Source::Trace(p.clone()),
                None => Source::Synthetic(synth[i]),
            },
        })
        .collect();
    Ok(Cli { cfg, json })
}

#[allow(dead_code)]
fn main() {
    let cli = match parse_args(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(e) => {
            let usage = "usage: multi_tenant [--trace-a PATH] [--trace-b PATH] [--trace-c PATH] [--tenants 2|3] \
                         [--limit N] [--kv-a B] [--kv-b B] [--kv-c B] [--shift S] [--capacity B] [--chunk B] \
                         [--retain B] [--trim-every S] [--trim-keep B] [--step-ms MS] [--max-batch N] [--phases N] [--seed N] \
                         [--backend host|host-sparse] [--json PATH] [--snapshot PATH] [--snapshot-at S]";
            if e.is_empty() {
                println!("{usage}");
                return;
            }
            eprintln!("{e}\n{usage}");
            std::process::exit(2);
        }
    };
    let report = match run(&cli.cfg) {
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
