//! `kv_serving --capacity-sweep FROM:TO:STEP`: every manager replays the
//! workload at each capacity of the range, each replay in a worker
//! process of its own; the figures are printed per capacity and summed
//! over the range (`vmm_sim::capacity_sweep`).

use serde_json::{json, Value};
use vmm_sim::capacity_sweep::totals;
use vmm_sim::replay::RunResult;
use vmm_sim::util::fmt_bytes;

use super::report::{manager_json, to_json};
use super::{die, run_workers, Opts, Setup};

fn vs_vllm(r: &RunResult, results: &[RunResult]) -> String {
    match results.iter().find(|v| v.name == "vllm-paged") {
        Some(v) if v.tokens_per_s > 0.0 => format!("{:.3}", r.tokens_per_s / v.tokens_per_s),
        _ => "-".into(),
    }
}

pub fn run(capacities: &[u64], o: &Opts, s: &Setup) {
    let runs: Vec<(String, Vec<String>)> = capacities
        .iter()
        .flat_map(|&c| o.managers.iter().map(move |m| (m.clone(), vec!["--capacity".to_string(), c.to_string()])))
        .collect();
    eprintln!(
        "capacity sweep: {} capacities x {} managers = {} replays, {} at a time",
        capacities.len(),
        o.managers.len(),
        runs.len(),
        s.jobs.min(runs.len())
    );
    let results = run_workers(&runs, s, s.jobs.min(runs.len()));
    let w = o.managers.iter().map(|m| m.len()).max().unwrap_or(0).max(19);
    let points: Vec<(u64, Vec<RunResult>)> =
        capacities.iter().zip(results.chunks(o.managers.len())).map(|(&c, rs)| (c, rs.to_vec())).collect();
    println!(
        "{:<10} {:<w$} {:>5} {:>4} {:>7} {:>8} {:>8} {:>6} {:>11} {:>8} {:>8}",
        "capacity", "manager", "done", "rej", "preempt", "tok/s", "tok/s", "frag", "bytes", "TPOT p99", "warm"
    );
    println!(
        "{:<10} {:<w$} {:>5} {:>4} {:>7} {:>8} {:>8} {:>6} {:>11} {:>8} {:>8}",
        "", "", "", "", "", "", "vs vLLM", "fails", "copied", "ms", "calls p50"
    );
    for (c, rs) in &points {
        for r in rs {
            println!(
                "{:<10} {:<w$} {:>5} {:>4} {:>7} {:>8.0} {:>8} {:>6} {:>11} {:>8.1} {:>8}",
                fmt_bytes(*c),
                r.name,
                r.completed_requests,
                r.rejected_requests,
                r.preemptions,
                r.tokens_per_s,
                vs_vllm(r, rs),
                r.fragmentation_failures,
                r.bytes_copied,
                r.tpot_p99_s * 1e3,
                r.warm_decode_step_calls.total.median
            );
        }
    }
    let sums = totals(&points);
    let vllm_sum = sums.iter().find(|t| t.manager == "vllm-paged").map(|t| t.tokens_per_s_sum);
    println!("\nSummed over the {} capacities:", capacities.len());
    println!(
        "{:<w$} {:>7} {:>11} {:>10} {:>6} {:>11} {:>5} {:>7}",
        "manager", "preempt", "tok/s sum", "vs vLLM", "frag", "bytes", "rej", "more"
    );
    println!("{:<w$} {:>7} {:>11} {:>10} {:>6} {:>11} {:>5} {:>7}", "", "", "", "", "fails", "copied", "", "preempt");
    for t in &sums {
        println!(
            "{:<w$} {:>7} {:>11.0} {:>10} {:>6} {:>11} {:>5} {:>7}",
            t.manager,
            t.preemptions,
            t.tokens_per_s_sum,
            vllm_sum.filter(|v| *v > 0.0).map_or("-".into(), |v| format!("{:.4}", t.tokens_per_s_sum / v)),
            t.fragmentation_failures,
            t.bytes_copied,
            t.rejected_requests,
            vllm_sum.map_or("-".into(), |_| t.capacities_preempting_more_than_vllm.to_string())
        );
    }
    println!("\n  tok/s sum = tokens per simulated second summed over the capacities; more preempt = capacities at");
    println!(
        "  which the manager preempted more than vllm-paged; warm calls p50 = median driver calls per warm decode"
    );
    println!("  step (map, unmap, create, release, set_access).");
    if let Some(path) = &o.json {
        let mut doc = to_json(&[], o, s);
        let workload = doc["workload"].as_object_mut().expect("an object");
        workload.insert("capacity_bytes".into(), Value::Null);
        workload.insert("capacities_bytes".into(), json!(capacities));
        let steps = results.iter().map(|r| r.steps).max().unwrap_or(0);
        workload.insert("steps".into(), json!(steps));
        doc.as_object_mut().expect("an object").remove("managers");
        doc["capacity_sweep"] = json!({
            "points": points.iter().map(|(c, rs)| json!({
                "capacity_bytes": c,
                "managers": rs.iter().map(manager_json).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "summed": sums,
        });
        let text = serde_json::to_string_pretty(&doc).expect("JSON of plain values");
        std::fs::write(path, text + "\n").unwrap_or_else(|e| die(&format!("cannot write {}: {e}", path.display())));
        println!("\nJSON written to {}", path.display());
    }
    let bad: Vec<&RunResult> =
        results.iter().filter(|r| r.integrity_errors > 0 || r.aborted.is_some() || r.host_limit_failures > 0).collect();
    if !bad.is_empty() {
        for r in bad {
            eprintln!(
                "FAILED: {}: {} integrity errors, {} host-limit failures, aborted {:?}",
                r.name, r.integrity_errors, r.host_limit_failures, r.aborted
            );
        }
        std::process::exit(1);
    }
}
