//! kv_serving's table of driver calls per decode step (`step_calls.rs`).

use vmm_sim::replay::RunResult;
use vmm_sim::step_calls::{CallDistribution, StepCallSummary, KINDS};

fn quantiles(d: &CallDistribution) -> String {
    format!("{}/{}/{}/{}", d.median, d.p90, d.p99, d.max)
}

fn zero(s: &StepCallSummary) -> String {
    format!("{:.1}%", s.total.zero_fraction * 100.0)
}

pub fn print(results: &[RunResult]) {
    const W: usize = 15;
    println!();
    let mut head = format!("{:<19} {:>7}", "manager", "decode");
    for k in KINDS {
        head.push_str(&format!(" {:>W$}", if k == "set_access" { "access" } else { k }));
    }
    head.push_str(&format!(" {:>7} {:>7} {:>W$} {:>7}", "zero", "warm", "warm total", "warm"));
    println!("{head}");
    let mut head = format!("{:<19} {:>7}", "", "steps");
    for _ in KINDS {
        head.push_str(&format!(" {:>W$}", "p50/90/99/max"));
    }
    head.push_str(&format!(" {:>7} {:>7} {:>W$} {:>7}", "steps", "steps", "p50/90/99/max", "zero"));
    println!("{head}");
    for r in results {
        let (all, warm) = (&r.decode_step_calls, &r.warm_decode_step_calls);
        let mut line = format!("{:<19} {:>7}", r.name, all.steps);
        for d in all.by_kind() {
            line.push_str(&format!(" {:>W$}", quantiles(d)));
        }
        line.push_str(&format!(" {:>7} {:>7} {:>W$} {:>7}", zero(all), warm.steps, quantiles(&warm.total), zero(warm)));
        println!("{line}");
    }
    println!("\n  Driver calls per decode step (a step that produced a token; its critical and between-steps calls");
    println!("  together), quantiles over the steps: median/p90/p99/max; access = set_access; total = the five kinds;");
    println!("  zero steps = steps with no call of the five; warm = steps whose live KV peak was reached before.");
}
