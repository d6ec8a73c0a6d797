//! Several models on one GPU, timed, sharing its memory through `static`
//! partitions, kvcached or vmm-arena (see `vmm_sim::multi_model`).

use std::path::PathBuf;

use clap::Parser;
use vmm_sim::managers::Layout;
use vmm_sim::multi_model::{model_requests, plot, run, ArenaKv, KvcachedKv, MmConfig, MmReport, SharedKv, StaticKv};
use vmm_sim::timing::Profile;
use vmm_sim::trace;

#[derive(Parser, Debug)]
#[command(about = "N models on one GPU with intermittent peaks: static partitions, kvcached, vmm-arena")]
struct Args {
    /// GPU profile (a100: 80 GiB; h200: 141 GB).
    #[arg(long, default_value = "a100")]
    profile: String,
    #[arg(long, default_value_t = 3)]
    models: usize,
    /// Trace file (CSV or JSONL); `synthetic` for the built-in one.
    #[arg(long, default_value = "../shared/traces/azure_conv_2023.csv")]
    trace: String,
    #[arg(long, default_value_t = 600)]
    requests_per_model: usize,
    /// The trace's arrival rate is multiplied by this.
    #[arg(long, default_value_t = 0.05)]
    rate_scale: f64,
    /// A model in its peak phase gets this many times its rate.
    #[arg(long, default_value_t = 20.0)]
    peak: f64,
    /// Length of a peak phase, seconds.
    #[arg(long, default_value_t = 20.0)]
    phase_s: f64,
    /// The arena's retain watermark per model, bytes (default: sized from
    /// the workload, the KV one step admits at most: 8,192 tokens).
    #[arg(long)]
    arena_retain: Option<u64>,
    /// The arena row's KV layout: token-major or block-in-chunk (the same
    /// memory; attention reads block-in-chunk as a paged kernel does).
    #[arg(long, default_value = "token-major")]
    layout: String,
    /// Put a model to sleep once idle this many seconds (its kept memory
    /// back to the device until its next request); off by default.
    #[arg(long)]
    sleep_after_s: Option<f64>,
    /// Managers to run, comma-separated (`arena-shared`: one arena for
    /// every model, beside `arena`'s one per model).
    #[arg(long, default_value = "static,kvcached,arena")]
    managers: String,
    /// Write the memory-over-time plot here.
    #[arg(long)]
    svg: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// Tokens a step computes at most (vLLM's `max_num_batched_tokens`).
const STEP_TOKENS: u64 = 8192;

fn main() {
    let a = Args::parse();
    let profile = Profile::named(&a.profile).unwrap_or_else(|e| panic!("{e}"));
    // Llama-3.1-8B: 32 layers, 8 KV heads of 128, BF16; 16 GB of weights.
    let (kv_bytes_per_token, layers) = (128u64 << 10, 32u64);
    let device_bytes: u64 = if a.profile == "h200" { 141_000_000_000 } else { 80 << 30 };
    let weights = (profile.params * profile.bytes_per_param) as u64;
    // vLLM's 0.9 of the device, less each model's weights and 1 GiB of
    // activations and graphs.
    let kv_bytes = ((device_bytes as f64 * 0.9) as u64).saturating_sub(a.models as u64 * (weights + (1 << 30)));
    let c = MmConfig {
        models: a.models,
        kv_bytes_per_token,
        layers,
        device_bytes,
        kv_bytes,
        step_tokens: STEP_TOKENS,
        max_batch: 256,
        requests_per_model: a.requests_per_model,
        rate_scale: a.rate_scale,
        peak: a.peak,
        phase_s: a.phase_s,
        arena_retain: a.arena_retain.unwrap_or(STEP_TOKENS * kv_bytes_per_token),
        max_context: 32768,
        arena_layout: match a.layout.as_str() {
            "token-major" => Layout::TokenMajor,
            "block-in-chunk" => Layout::BlockInChunk,
            other => panic!("unknown --layout {other} (token-major, block-in-chunk)"),
        },
        sleep_after_s: a.sleep_after_s,
    };
    let tr = if a.trace == "synthetic" {
        trace::synthetic(a.models * a.requests_per_model, 7)
    } else {
        trace::load(std::path::Path::new(&a.trace), Some(a.models * a.requests_per_model))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let reqs = model_requests(&c, &tr.requests);
    let mut runs: Vec<MmReport> = Vec::new();
    for name in a.managers.split(',') {
        let mut kv: Box<dyn SharedKv> = match name {
            "static" => Box::new(StaticKv::new(&c)),
            "kvcached" => Box::new(KvcachedKv::new(&c).unwrap_or_else(|e| panic!("kvcached: {e}"))),
            "arena" => Box::new(ArenaKv::new(&c).unwrap_or_else(|e| panic!("arena: {e}"))),
            "arena-shared" => Box::new(ArenaKv::new_shared(&c).unwrap_or_else(|e| panic!("arena-shared: {e}"))),
            other => panic!("unknown manager {other} (static, kvcached, arena, arena-shared)"),
        };
        runs.push(run(&c, &reqs, kv.as_mut(), &profile));
    }
    if let Some(p) = &a.svg {
        let title = format!("{} × Llama-3.1-8B on {}: KV memory held per model", a.models, a.profile);
        std::fs::write(p, plot::svg(&runs, &title)).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    if a.json {
        let v = serde_json::json!({ "config": c, "trace": tr.name, "profile": a.profile, "runs": runs });
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
        return;
    }
    println!(
        "{} models on {} ({} trace, {} requests each), KV memory {:.1} GiB",
        a.models,
        a.profile,
        tr.name,
        reqs[0].len(),
        kv_bytes as f64 / (1u64 << 30) as f64
    );
    println!(
        "{:<9} {:>5} {:>11} {:>11} {:>11} {:>9} {:>8} {:>9}",
        "manager", "model", "TTFT mean", "TTFT p99", "TPOT p99", "tok/s", "preempt", "peak GiB"
    );
    for r in &runs {
        for m in &r.models {
            println!(
                "{:<9} {:>5} {:>10.3}s {:>10.3}s {:>10.4}s {:>9.1} {:>8} {:>9.2}",
                r.manager,
                m.model,
                m.ttft_mean_s,
                m.ttft_p99_s,
                m.tpot_p99_s,
                m.tokens_per_s,
                m.preemptions,
                m.peak_held_bytes as f64 / (1u64 << 30) as f64
            );
        }
        let d = &r.driver;
        println!(
            "{:<9} makespan {:.1} s; driver time charged {:.3} s, hidden {:.3} s, on the engines' threads {:.3} s, \
             serial {:.3} s; {} synchronizes, {} drained steps of {}",
            "",
            r.makespan_s,
            d.charged_s,
            d.hidden_s,
            d.caller_thread_s,
            d.serial_s,
            d.synchronizes,
            d.drained_steps,
            d.steps
        );
        let c = &r.decode_step_calls;
        println!(
            "{:<9} driver calls per step (map+unmap+create+release+set_access, {} steps): median {}, p90 {}, p99 {}, \
             max {}; {:.1}% of steps with none",
            "",
            c.steps,
            c.total.median,
            c.total.p90,
            c.total.p99,
            c.total.max,
            c.total.zero_fraction * 100.0
        );
    }
}
