//! kv_serving's driver-work table.

use vmm_sim::replay::RunResult;

/// Driver work on the critical path, and the figures against vllm-paged
/// (when it ran) that issue 11's targets are stated in.
pub fn print(results: &[RunResult]) {
    let vllm = results.iter().find(|r| r.name == "vllm-paged");
    println!();
    println!(
        "{:<19} {:>7} {:>7} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9}",
        "manager", "syncs", "event", "creates", "creates", "alloc %", "between", "TPOT p99", "tok/s", "peak phys"
    );
    println!(
        "{:<19} {:>7} {:>7} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9}",
        "", "crit", "waits", "crit", "crit warm", "of steps", "drains", "vs vLLM", "vs vLLM", "/peak live"
    );
    for r in results {
        let vs = |f: &dyn Fn(&RunResult) -> f64| match vllm {
            Some(v) if f(v) > 0.0 => format!("{:.3}", f(r) / f(v)),
            _ => "-".into(),
        };
        println!(
            "{:<19} {:>7} {:>7} {:>9} {:>9} {:>8.2}% {:>8} {:>9} {:>9} {:>9.3}",
            r.name,
            r.critical_path_syncs,
            r.critical_path_event_waits,
            r.critical_path_creates,
            r.critical_path_creates_warm,
            r.critical_path_alloc_fraction * 100.0,
            r.between_steps_drains,
            vs(&|x| x.tpot_p99_s),
            vs(&|x| x.tokens_per_s),
            r.footprint_over_peak_live
        );
    }
    println!("\n  syncs crit / event waits = device synchronizes / waits on incomplete stream events on the critical");
    println!(
        "  path (each costs its step the overlap); creates crit (warm) = chunk creations on the critical path (in"
    );
    println!("  steps whose live KV peak was reached before); alloc % = allocator time charged over the summed step");
    println!("  time; between drains = drains in between_steps; vs vLLM = ratio to vllm-paged of this run.");
}
