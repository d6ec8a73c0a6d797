//! The memory an idle instance holds under prefix caching, kvcached beside
//! vmm-arena, in kvcached's `bench_idle_footprint` setting (see
//! `vmm_sim::idle_footprint`).

use clap::Parser;
use vmm_sim::idle_footprint::{build_requests, run, ArenaEngine, IdleConfig, IdleReport, KvcachedEngine};
use vmm_sim::managers::kvcached::KVCACHED_PAGE_BYTES;
use vmm_sim::timing::Profile;

#[derive(Parser, Debug)]
#[command(about = "Idle footprint under prefix caching: kvcached and vmm-arena, kvcached's workload")]
struct Args {
    #[arg(long, default_value_t = 2500)]
    requests: usize,
    #[arg(long, default_value_t = 96)]
    concurrency: usize,
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// KVCACHED_MAX_CACHED_TOKENS.
    #[arg(long, default_value_t = 16_000)]
    max_cached_tokens: u64,
    /// The arena's retain watermark, bytes (default: sized from the
    /// workload, the KV one step admits at most).
    #[arg(long)]
    arena_retain: Option<u64>,
    /// GPU profile the steps are priced on (Qwen3-4B's shape over it).
    #[arg(long, default_value = "h200")]
    profile: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    let a = Args::parse();
    let c = IdleConfig {
        requests: a.requests,
        concurrency: a.concurrency,
        seed: a.seed,
        max_cached_tokens: a.max_cached_tokens,
        arena_retain: a.arena_retain,
        ..IdleConfig::default()
    };
    let reqs = build_requests(&c);
    let profile = Profile::named(&a.profile).unwrap_or_else(|e| panic!("{e}"));
    let mut reports: Vec<IdleReport> = Vec::new();
    let mut k = KvcachedEngine::new(&c).unwrap_or_else(|e| panic!("kvcached: {e}"));
    let mut r = run(&c, &reqs, &mut k, "kvcached", &profile).unwrap_or_else(|e| panic!("kvcached: {e}"));
    let pa = &k.pool.pool.mgr.page_allocator;
    r.extra = vec![
        ("idle_pages_in_use".into(), pa.num_inuse_pages()),
        ("evicted_blocks".into(), k.pool.pool.evicted_blocks),
        ("peak_mapped_pages".into(), pa.peak_mapped_pages()),
    ];
    reports.push(r);
    let mut ar = ArenaEngine::new(&c).unwrap_or_else(|e| panic!("arena: {e}"));
    let mut r = run(&c, &reqs, &mut ar, "arena", &profile).unwrap_or_else(|e| panic!("arena: {e}"));
    let s = ar.arena.stats().unwrap_or_else(|e| panic!("arena stats: {e}"));
    r.extra = vec![
        ("evicted_blocks".into(), ar.evicted_blocks),
        ("moves".into(), s.moves),
        ("retain_bytes".into(), c.arena_retain_bytes()),
        ("upkeep_errors".into(), ar.upkeep_errors),
    ];
    reports.push(r);

    // The packed floors: the cap's blocks in whole kvcached pages (as
    // kvcached's README states its floor), and their raw KV bytes.
    let bundle = KVCACHED_PAGE_BYTES * 2 * c.layers;
    let blocks_per_page = KVCACHED_PAGE_BYTES / c.block_buffer_bytes();
    let floor_pages = c.max_cached_blocks().div_ceil(blocks_per_page) * bundle;
    let floor_raw = c.max_cached_blocks() * c.block_bytes();
    if a.json {
        let v = serde_json::json!({
            "config": c,
            "floor_pages_bytes": floor_pages,
            "floor_raw_bytes": floor_raw,
            "engines": reports.iter().map(|r| serde_json::json!({
                "engine": r.engine, "steps": r.steps, "prompt_tokens": r.prompt_tokens,
                "hit_tokens": r.hit_tokens, "hit_rate": r.hit_tokens as f64 / r.prompt_tokens as f64,
                "peak_held_bytes": r.peak_held_bytes, "idle_used_bytes": r.idle_used_bytes,
                "idle_held_bytes": r.idle_held_bytes, "idle_after_trim_bytes": r.idle_after_trim_bytes,
                "idle_cached_blocks": r.idle_cached_blocks,
                "makespan_s": r.makespan_s, "driver": r.driver,
                "idle_used_vs_floor_pages": r.idle_used_bytes as f64 / floor_pages as f64,
                "idle_used_vs_floor_raw": r.idle_used_bytes as f64 / floor_raw as f64,
                "extra": r.extra.iter().map(|(k, v)| (k.clone(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
        return;
    }
    println!(
        "{} requests, concurrency {}, cap {} tokens ({} blocks); floor: {:.2} GiB in whole pages, {:.2} GiB raw",
        c.requests,
        c.concurrency,
        c.max_cached_tokens,
        c.max_cached_blocks(),
        gib(floor_pages),
        gib(floor_raw)
    );
    println!(
        "{:<9} {:>9} {:>12} {:>11} {:>10} {:>10} {:>12} {:>10} {:>8}",
        "engine", "hit rate", "idle cached", "idle GiB", "vs pages", "vs raw", "+reserve GiB", "trim GiB", "peak GiB"
    );
    for r in &reports {
        println!(
            "{:<9} {:>9.4} {:>12} {:>11.2} {:>9.2}x {:>9.2}x {:>12.2} {:>10.2} {:>8.2}",
            r.engine,
            r.hit_tokens as f64 / r.prompt_tokens as f64,
            r.idle_cached_blocks,
            gib(r.idle_used_bytes),
            r.idle_used_bytes as f64 / floor_pages as f64,
            r.idle_used_bytes as f64 / floor_raw as f64,
            gib(r.idle_held_bytes),
            gib(r.idle_after_trim_bytes),
            gib(r.peak_held_bytes)
        );
        let d = &r.driver;
        println!(
            "    driver time: charged {:.3} s, hidden {:.3} s, on the engine's thread {:.3} s, serial {:.3} s; \
             {} synchronizes, {} creates, {} drained steps of {}; makespan {:.1} s",
            d.charged_s,
            d.hidden_s,
            d.caller_thread_s,
            d.serial_s,
            d.synchronizes,
            d.calls.create,
            d.drained_steps,
            d.steps,
            r.makespan_s
        );
        for (k, v) in &r.extra {
            println!("    {k}: {v}");
        }
    }
}
