//! `kv_serving --sweep DIR`: arena and vllm-paged over the grid of
//! `vmm_sim::sweep` (paged-attention overhead x token-major penalty x
//! driver pricing), each point a replay of its own.
//!
//! Step times feed back into the schedule (arrivals join the queue by the
//! simulated clock, and the arena prepares admissions within the step's
//! GPU time), so every point that changes a manager's step times is
//! replayed. What is reused: a manager's replay depends only on its own
//! layout's efficiency, so the arena runs once per (penalty, pricing) (with
//! `--layout block-in-chunk`, read by the paged kernel: once per (overhead,
//! pricing), and the penalty axis does not apply to it) and vLLM once per
//! (overhead, pricing); and vLLM's per-call runs are those
//! of per-chunk pricing when its steps made no driver call the two
//! pricings charge differently (checked on its per-chunk results).

use std::path::Path;

use serde_json::json;
use vmm_sim::replay::RunResult;
use vmm_sim::sweep::{self, Point, PAGED_OVERHEADS, PRICINGS, TOKEN_MAJOR_PENALTIES};
use vmm_sim::timing::Profile;

use vmm_sim::managers::Layout;

use super::{die, run_workers, Setup};

/// The profile overrides of a pricing: per-chunk is the profile as it is;
/// per-call moves `cuMemSetAccess` and `cuMemUnmap` to a cost per call.
fn pricing_overrides(pricing: &str, p: &Profile) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    if pricing == "per-call" {
        let src = "sweep: the per-chunk price charged once per call instead";
        m.insert("set_access_s".into(), json!({"value": 0.0, "source": src}));
        m.insert("unmap_s".into(), json!({"value": 0.0, "source": src}));
        let a = p.set_access_s + p.set_access_call_s;
        let u = p.unmap_s + p.unmap_call_s;
        m.insert("set_access_call_s".into(), json!({"value": a, "source": src}));
        m.insert("unmap_call_s".into(), json!({"value": u, "source": src}));
    }
    m
}

fn efficiency_overrides(m: &mut serde_json::Map<String, serde_json::Value>, layout: &str, overhead: f64) {
    let src = format!("sweep grid point: attention overhead {overhead}");
    for phase in ["decode", "prefill"] {
        m.insert(format!("attn_eff_{phase}_{layout}"), json!({"value": sweep::efficiency(overhead), "source": src}));
    }
}

fn args(m: serde_json::Map<String, serde_json::Value>) -> Vec<String> {
    vec!["--profile-json".into(), serde_json::Value::Object(m).to_string()]
}

/// The sweep of `row` (`arena` or `arena-paged`) against vllm-paged.
pub fn run(dir: &Path, s: &Setup, jobs: usize, title: &str, row: &str) {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| die(&format!("cannot create {}: {e}", dir.display())));
    let base = &s.cfg.profile;
    let per_call =
        Profile::with_overrides(base, &serde_json::Value::Object(pricing_overrides("per-call", base)).to_string())
            .unwrap_or_else(|e| die(&e));
    // First pass: the arena at every (penalty, pricing), vLLM at every
    // overhead with per-chunk pricing.
    let mut runs: Vec<(String, Vec<String>)> = Vec::new();
    // The arena's axis: the token-major penalty, or (block-in-chunk, or
    // arena-paged's blocks, read by the paged kernel) the paged overhead,
    // which then applies to both.
    let paged_arena = s.shape.layout == Layout::BlockInChunk || row == "arena-paged";
    let arena_axis: &[f64] = if paged_arena { &PAGED_OVERHEADS } else { &TOKEN_MAJOR_PENALTIES };
    for pricing in PRICINGS {
        for &x in arena_axis {
            let mut m = pricing_overrides(pricing, base);
            efficiency_overrides(&mut m, if paged_arena { "paged" } else { "token_major" }, x);
            runs.push((row.into(), args(m)));
        }
    }
    for po in PAGED_OVERHEADS {
        let mut m = pricing_overrides("per-chunk", base);
        efficiency_overrides(&mut m, "paged", po);
        runs.push(("vllm-paged".into(), args(m)));
    }
    eprintln!(
        "sweep: {} replays ({row} x {} {} x {} pricings, vllm-paged x {} overheads)",
        runs.len(),
        arena_axis.len(),
        if paged_arena { "paged overheads" } else { "token-major penalties" },
        PRICINGS.len(),
        PAGED_OVERHEADS.len()
    );
    let first = run_workers(&runs, s, jobs);
    let arena =
        |pricing: usize, tm: usize, po: usize| &first[pricing * arena_axis.len() + if paged_arena { po } else { tm }];
    let n_arena = PRICINGS.len() * arena_axis.len();
    let vllm_chunk: Vec<RunResult> = first[n_arena..].to_vec();
    // vLLM under per-call pricing: the same replay unless its steps' calls
    // are priced differently.
    let differs = vllm_chunk.iter().any(|r| {
        let calls = r.critical_calls.plus(&r.between_calls);
        (base.driver_s(&calls) - per_call.driver_s(&calls)).abs() > 0.0
    });
    let vllm_call: Vec<RunResult> = if differs {
        eprintln!("sweep: vllm-paged's step driver calls price differently per call: replaying them");
        let runs: Vec<(String, Vec<String>)> = PAGED_OVERHEADS
            .iter()
            .map(|&po| {
                let mut m = pricing_overrides("per-call", base);
                efficiency_overrides(&mut m, "paged", po);
                ("vllm-paged".to_string(), args(m))
            })
            .collect();
        run_workers(&runs, s, jobs)
    } else {
        vllm_chunk.clone()
    };
    let mut points = Vec::new();
    for (pi, pricing) in PRICINGS.iter().enumerate() {
        let vllm = if pi == 0 { &vllm_chunk } else { &vllm_call };
        for (ti, &tm) in TOKEN_MAJOR_PENALTIES.iter().enumerate() {
            for (oi, &po) in PAGED_OVERHEADS.iter().enumerate() {
                let a = arena(pi, ti, oi);
                let v = &vllm[oi];
                points.push(Point {
                    pricing: pricing.to_string(),
                    paged_overhead: po,
                    token_major_penalty: tm,
                    arena_tokens_per_s: a.tokens_per_s,
                    vllm_tokens_per_s: v.tokens_per_s,
                    arena_tpot_p99_s: a.tpot_p99_s,
                    vllm_tpot_p99_s: v.tpot_p99_s,
                });
            }
        }
    }
    let bad: Vec<&RunResult> =
        first.iter().chain(&vllm_call).filter(|r| r.integrity_errors > 0 || r.aborted.is_some()).collect();
    let sentences = sweep::sentences(&points);
    let doc = json!({
        "title": title,
        "vllm_per_call_replayed": differs,
        "points": points,
        "break_even": sentences,
        "runs": first.iter().chain(if differs { vllm_call.iter() } else { [].iter() }).map(|r| json!({
            "manager": r.name, "tokens_per_s": r.tokens_per_s, "tpot_p99_s": r.tpot_p99_s,
            "ttft_p99_s": r.ttft_p99_s, "preemptions": r.preemptions, "peak_physical_bytes": r.peak_physical_bytes,
            "critical_path_alloc_s": r.critical_path_alloc_s, "integrity_errors": r.integrity_errors,
        })).collect::<Vec<_>>(),
    });
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap_or_else(|e| die(&format!("cannot write {}: {e}", p.display())));
        println!("  wrote {}", p.display());
    };
    write("sweep.json", serde_json::to_string_pretty(&doc).expect("plain values") + "\n");
    let mut md = format!("# {title}\n{}", sweep::markdown(&points));
    md.push_str("\nBreak-even:\n\n");
    for l in &sentences {
        md.push_str(&format!("- {l}\n"));
    }
    print!("{md}");
    write("sweep.md", md);
    write("sweep.svg", sweep::svg(&points, title));
    if !bad.is_empty() {
        for r in bad {
            eprintln!("FAILED: {}: {} integrity errors, aborted {:?}", r.name, r.integrity_errors, r.aborted);
        }
        std::process::exit(1);
    }
}
