//! What `kv_serving` prints and writes: the side-by-side tables, and the
//! JSON report (`--json`).

use super::*;

pub(crate) fn gib(b: f64) -> String {
    format!("{:.2}", b / (1u64 << 30) as f64)
}

pub(crate) fn print_table(results: &[RunResult], trace: &Trace) {
    const W: [usize; 17] = [19, 5, 4, 7, 8, 8, 8, 8, 8, 7, 6, 7, 8, 7, 7, 7, 5];
    let row = |c: [&str; 17]| {
        let mut line = format!("{:<w$}", c[0], w = W[0]);
        for (v, w) in c.iter().zip(W).skip(1) {
            line.push_str(&format!(" {v:>w$}"));
        }
        println!("{line}");
    };
    row([
        "manager", "done", "rej", "preempt", "tok/s", "TTFT", "TPOT", "step", "alloc s", "hidden", "syncs", "prefix",
        "recomp", "peak", "peak", "mean", "integ",
    ]);
    row([
        "", "", "", "", "", "p99 s", "p99 ms", "p99 ms", "charged", "s", "", "hit", "tokens", "live", "phys", "phys",
        "errs",
    ]);
    for r in results {
        row([
            &r.name,
            &r.completed_requests.to_string(),
            &r.rejected_requests.to_string(),
            &r.preemptions.to_string(),
            &format!("{:.0}", r.tokens_per_s),
            &format!("{:.2}", r.ttft_p99_s),
            &format!("{:.1}", r.tpot_p99_s * 1e3),
            &format!("{:.1}", r.step_time_p99_s * 1e3),
            &format!("{:.3}", r.critical_path_alloc_s),
            &format!("{:.3}", r.overlapped_alloc_s),
            &r.critical_path_syncs.to_string(),
            &format!("{:.1}%", r.prefix_hit_rate * 100.0),
            &r.recomputed_tokens.to_string(),
            &gib(r.peak_live_bytes as f64),
            &gib(r.peak_physical_bytes as f64),
            &gib(r.mean_physical_bytes),
            &r.integrity_errors.to_string(),
        ]);
    }
    println!(
        "\n  {} requests. tok/s = output tokens per simulated second; TTFT = arrival to first token;",
        trace.requests.len()
    );
    println!("  TPOT = time per output token after the first, per request; step = a step's modeled time;");
    println!("  alloc s charged = driver time on the critical path (admission, growth, free), plus between-steps");
    println!("  driver time the GPU did not hide; hidden = between-steps driver time under the GPU; syncs = device");
    println!("  synchronizes on the critical path (each costs its step the CPU/GPU overlap); prefix hit = prompt");
    println!("  tokens found in a prefix cache; recomp = tokens computed again after preemptions; peak live = KV");
    println!("  of running requests at its instantaneous peak (a shared prefix once per request); GiB for memory.");
    println!("  See sim/src/timing.rs.");
    let shared: Vec<&RunResult> = results.iter().filter(|r| r.peak_shared_live_bytes > 0).collect();
    if !shared.is_empty() {
        println!("  Shared prefixes (a prefix mapped by several running requests counts once in distinct live KV):");
        for r in shared {
            let extra = |k: &str| r.extra.iter().find(|(n, _)| n == k).and_then(|(_, v)| v.parse::<f64>().ok());
            println!(
                "    {}: peak distinct live {} GiB, peak shared live {} GiB{}{}",
                r.name,
                gib(r.peak_distinct_live_bytes as f64),
                gib(r.peak_shared_live_bytes as f64),
                extra("peak_footprint_bytes").map_or(String::new(), |f| format!(
                    ", peak footprint {} GiB ({:.4}x distinct live; prefix-cache-only chunks left out)",
                    gib(f),
                    f / r.peak_distinct_live_bytes.max(1) as f64
                )),
                extra("prefix_hits").map_or(String::new(), |h| format!(
                    ", {h:.0} hits, {:.0} units evicted, {} bytes copied",
                    extra("evicted_prefix_units").unwrap_or(0.0),
                    r.bytes_copied
                )),
            );
        }
    }
    driver_table::print(results);
    step_calls_table::print(results);
    if let Some(a) = results.iter().find(|r| r.name == "arena") {
        let rel: Vec<String> = results
            .iter()
            .filter(|r| r.name != "arena")
            .map(|r| {
                format!(
                    "{} {:.2}x throughput, {:.2}x peak phys",
                    r.name,
                    r.tokens_per_s / a.tokens_per_s.max(1e-9),
                    r.peak_physical_bytes as f64 / a.peak_physical_bytes.max(1) as f64,
                )
            })
            .collect();
        if !rel.is_empty() {
            println!("  relative to arena: {}", rel.join("; "));
        }
    }
    for r in results {
        let x = |k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        if let (Some(n), Some(by), Some(bucket), Some(act), Some(actf)) = (
            x("tp_failures"),
            x("tp_failures_by_member"),
            x("tp_bucket_failures"),
            x("tp_activation_failures"),
            x("tp_activation_fragmentation"),
        ) {
            println!(
                "  {}: {n} failed admissions/growths, by failing device {by}: {bucket} on a device after the \
                 devices before it had room, {} with the failing device's free memory covering the request \
                 (fragmentation); activation allocations failed by device {act}, {actf} of them for fragmentation",
                r.name, r.fragmentation_failures
            );
        }
    }
    for r in results {
        if let Some(f) = &r.first_fragmentation {
            println!("  {}: first fragmentation failure: {f}", r.name);
        }
        if let Some(a) = &r.aborted {
            println!("  {}: ABORTED: {a}", r.name);
        }
        if let Some(h) = &r.first_host_limit {
            println!("  {}: HOST LIMIT ({} failures, figures invalid): {h}", r.name, r.host_limit_failures);
        }
    }
}

/// One manager's JSON object: every field of its result, the driver calls
/// under `driver_calls`, and its own extra facts at the top level.
pub(crate) fn manager_json(r: &RunResult) -> Value {
    let mut v = serde_json::to_value(r).expect("JSON of plain values");
    let o = v.as_object_mut().expect("a struct serializes to an object");
    o.remove("extra");
    if let Some(calls) = o.remove("calls") {
        o.insert("driver_calls".into(), calls);
    }
    for (k, x) in &r.extra {
        o.insert(k.clone(), serde_json::from_str(x).unwrap_or_else(|_| Value::String(x.clone())));
    }
    v
}

pub(crate) fn to_json(results: &[RunResult], o: &Opts, s: &Setup) -> Value {
    json!({
        "workload": {
            "trace": s.trace.name,
            "requests": s.trace.requests.len(),
            "model": s.model,
            "kv_bytes_per_token": s.shape.kv_bytes_per_token,
            "layout": s.shape.layout.name(),
            "capacity_bytes": o.capacity,
            "steps": results.iter().map(|r| r.steps).max().unwrap_or(0),
            "layers": s.shape.layers,
            "allocations_per_request": s.shape.n_allocs(),
            "reservation_tokens": s.shape.max_context,
            "max_batch": s.cfg.max_batch,
            "max_num_batched_tokens": s.cfg.max_num_batched_tokens,
            "tp": s.tp,
            "activation_mean_bytes": if s.tp > 1 { json!(s.noise.mean_bytes) } else { Value::Null },
            "activation_spread": if s.tp > 1 { json!(s.noise.spread) } else { Value::Null },
            "activation_tensors": if s.tp > 1 { json!(s.noise.tensors) } else { Value::Null },
            "seed": o.seed,
            "arena_retain_bytes": if o.retain == u64::MAX { Value::Null } else { json!(o.retain) },
            "arena_reserve_bytes": s.build.arena.reserve,
            "arena_precreate_bytes": o.precreate,
            "arena_map_ahead_bytes": o.map_ahead,
            "arena_paged_warm_bytes": o.paged_warm,
            "prefix_caching": s.build.prefix_caching,
            "contiguous_max_tokens": s.build.max_tokens,
            "profile": s.cfg.profile,
            "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        },
        "managers": results.iter().map(manager_json).collect::<Vec<_>>(),
    })
}
