//! The simulation: every tenant's requests admitted, grown a token per step, preempted and freed on one arena.

use super::load::splitmix;
use super::*;

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
