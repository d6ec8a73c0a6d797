//! KV-serving replay: LLM serving traffic through vmm-arena and through
//! models of the allocators engines use today, side by side, with every
//! step's time charged by a GPU step-time model.
//!
//! ```sh
//! cargo run --release -p vmm-sim                       # built-in synthetic Azure-like trace
//! cargo run --release -p vmm-sim -- --trace ../shared/traces/azure_conv_2023.csv
//! cargo run --release -p vmm-sim -- --quick --json out.json
//! cargo run --release -p vmm-sim -- --tp 4 --model llama3-70b --capacity 12GiB   # tensor parallel
//! ```
//!
//! With `--tp N` every request's KV is sharded over N devices (1/N of each
//! token's KV per device, token-major), and the managers are the
//! tensor-parallel ones of `sim/src/tp.rs`: a vmm-arena group (all or
//! nothing across members) and N per-device PyTorch caching-allocator
//! models, each device with activation noise of its own seed
//! (`--activation-bytes`). `--capacity` is then the KV capacity of each
//! device.
//!
//! Every manager replays the same requests with the same scheduler (see
//! `sim/src/replay.rs`) on its own counted host device (sparse mode) of the
//! same capacity; each token's KV slot gets a real tag written through the
//! mapping and verified when the request ends. Step times, throughput and
//! latency come from `sim/src/timing.rs` (GPU profile `h200` by default).
//! `--help` lists the options.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use serde_json::{json, Value};
use vmm_sim::arena_prefix_cache::ArenaPrefixCache;
use vmm_sim::managers::{self, ArenaOptions, BuildOptions, KvShape, Layout, ALL_MANAGERS};
use vmm_sim::replay::{self, RunResult, SchedConfig};
use vmm_sim::timing::Profile;
use vmm_sim::tp;
use vmm_sim::trace::{self, Trace};
use vmm_sim::util::{fmt_bytes, parse_size};

mod capacity_sweep;
mod driver_table;
mod models;
mod report;
mod step_calls_table;
use report::{print_table, to_json};
mod sweep;
mod workload_args;
use workload_args::WorkloadArgs;

use models::MODELS;
use vmm_sim::step_charge::attn_layout;

/// Replay LLM serving traffic through vmm-arena and today's KV-cache
/// managers, charging each step's time with a GPU step-time model.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kv_serving",
    version,
    about = "KV-serving replay: LLM serving traffic through vmm-arena and through models of the allocators engines use today, side by side"
)]
struct Opts {
    /// Azure CSV or Mooncake JSONL trace (default: built-in synthetic
    /// Azure-conversation-like trace, seeded).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Requests in the synthetic trace (default 1500; --quick: 300).
    #[arg(long)]
    requests: Option<usize>,
    /// Seed of the synthetic trace.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Replay only the first N requests of the trace.
    #[arg(long)]
    limit: Option<usize>,
    /// A small run (under a minute): --limit 300 for a trace file.
    #[arg(long)]
    quick: bool,
    /// Model preset: llama2-7b (512 KiB/token), llama3-8b (128 KiB/token),
    /// llama3-70b (320 KiB/token).
    #[arg(long, default_value = "llama3-8b")]
    model: String,
    /// Override the preset's KV bytes per token (suffixes allowed).
    #[arg(long, value_parser = parse_size)]
    kv_bytes_per_token: Option<u64>,
    /// Override the preset's layer count (per-layer layout).
    #[arg(long)]
    layers: Option<u32>,
    /// Tokens a growable reservation is sized for (default: the preset's
    /// context: 4096 / 131072 / 131072, Llama 2 and 3.1).
    #[arg(long)]
    max_context: Option<u64>,
    /// KV layout of a request (block-in-chunk: each chunk one block of a
    /// paged kernel's block table, read at the paged kernel's efficiency;
    /// token-major: a token's KV of every layer together). Default:
    /// block-in-chunk where a chunk holds a whole number of tokens (Llama-3-8B:
    /// 16 of 128 KiB in 2 MiB), token-major where it does not (said so).
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    /// Most running requests.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_batch: u64,
    /// Device memory for KV, e.g. 40GiB (default: an 80 GB GPU less
    /// Llama-3-8B's 16 GB of weights).
    #[arg(long, default_value = "64GiB", value_parser = parse_size)]
    capacity: u64,
    /// Comma-separated subset of: arena, arena-no-moves, arena-sync,
    /// pytorch-caching, pytorch-expandable, vllm-paged, ideal-contiguous,
    /// contiguous-max. `arena` frees on the stream, prefetches and grows the
    /// decode batch at once; `arena-sync` is the arena driven as before
    /// (plain free, no prefetch, one resize per allocation). Named only:
    /// `arena-no-admission-ahead`, `arena` without admission map-ahead.
    #[arg(long, value_delimiter = ',', default_values_t = ALL_MANAGERS.map(String::from))]
    managers: Vec<String>,
    /// vmm-arena's pooled-memory watermark: a size, or "all".
    #[arg(long, default_value = "all", value_parser = parse_retain)]
    retain: u64,
    /// vmm-arena's virtual range (default: 4 x capacity, or room for
    /// 2 x max-batch reservations if that is more).
    #[arg(long, value_parser = parse_size)]
    arena_reserve: Option<u64>,
    /// The `arena` rows' prefetch: created, unmapped chunks kept pooled.
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    precreate: u64,
    /// `arena-paged`'s start-up pool: bytes mapped before the first request
    /// and kept pooled for blocks to adopt (start-up work, not charged, as
    /// vLLM's pool is built before serving; the arena's idle footprint).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    paged_warm: u64,
    /// The `arena` rows' prefetch: bytes kept mapped past each KV tensor's
    /// size. At 0 (the default) the rows make the next step's decode growth
    /// between steps instead, where that leaves room for the step's
    /// admissions (whole prompts; chunked prefill makes all of the next
    /// step's growth between steps either way).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    map_ahead: u64,
    /// Chunked prefill: the most tokens a step computes (prefill chunks and
    /// one per decoding request), as vLLM V1's max_num_batched_tokens (8192
    /// for its API server on an H100/H200-class GPU); 0 computes each
    /// prompt whole in its admission step.
    #[arg(long, default_value_t = 0)]
    max_num_batched_tokens: u64,
    /// GPU profile of the step-time model.
    #[arg(long, default_value = "h200", value_parser = ["h200", "a100", "h100"])]
    profile: String,
    /// JSON object overriding fields of the profile (see sim/src/timing.rs).
    #[arg(long)]
    profile_file: Option<PathBuf>,
    /// Prefix caching: vLLM's automatic prefix caching in vllm-paged, and
    /// the arena's prefix cache (shared chunks, one allocation per request: token-major or block-in-chunk) in
    /// arena, arena-staged, arena-no-moves and arena-sync; on by default, as in vLLM.
    #[arg(long, value_enum, default_value = "on")]
    prefix_caching: OnOff,
    /// contiguous-max's room for output tokens (default: the trace's largest output).
    #[arg(long)]
    max_tokens: Option<u64>,
    /// Managers replayed at once, each in its own process (default:
    /// available cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Tensor-parallel degree: shard every request's KV over N devices
    /// (token-major layout; managers: arena and pytorch-caching, as their
    /// tensor-parallel versions). --capacity is per device.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    tp: u64,
    /// With --tp: mean activation bytes per device per step, allocated
    /// between steps from the same allocator as the KV (default: 1/32 of
    /// --capacity).
    #[arg(long, value_parser = parse_size)]
    activation_bytes: Option<u64>,
    /// With --tp: each step's activation total is mean x (1 +- spread).
    #[arg(long, default_value_t = 0.5)]
    activation_spread: f64,
    /// With --tp: activation tensors per step per device.
    #[arg(long, default_value_t = 4)]
    activation_tensors: u32,
    /// A JSON object overriding profile fields, applied after
    /// --profile-file (the sweep passes each grid point's this way).
    #[arg(long)]
    profile_json: Option<String>,
    /// Replay arena and vllm-paged over the grid of the unmeasured
    /// constants (paged-attention overhead x token-major penalty x driver
    /// pricing) and write sweep.json, sweep.md and sweep.svg into DIR. The
    /// arena row is `arena`, or `arena-paged` where --managers names it
    /// and not `arena`.
    #[arg(long, value_name = "DIR")]
    sweep: Option<PathBuf>,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Replay the workload at each capacity of FROM:TO:STEP (e.g.
    /// 2.5GiB:4GiB:0.25GiB, both ends included) instead of --capacity, and
    /// report each manager's preemptions, tokens/s, fragmentation failures
    /// and bytes copied per capacity and summed over the range.
    #[arg(long, value_name = "FROM:TO:STEP", conflicts_with = "sweep")]
    capacity_sweep: Option<String>,
    /// Internal: replay only this manager and report on stdout.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LayoutArg {
    TokenMajor,
    PerLayer,
    BlockInChunk,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

fn parse_retain(s: &str) -> Result<u64, String> {
    if s == "all" {
        Ok(u64::MAX)
    } else {
        parse_size(s)
    }
}

fn die(msg: &str) -> ! {
    eprintln!("kv_serving: {msg}");
    std::process::exit(2);
}

/// Everything a replay needs, derived from the options.
struct Setup {
    trace: Trace,
    shape: KvShape,
    model: &'static str,
    cfg: SchedConfig,
    build: BuildOptions,
    jobs: usize,
    /// Tensor-parallel degree (1: the single-device managers).
    tp: usize,
    noise: tp::Noise,
    /// The user's `--profile-json`, passed on to every worker process.
    profile_json: Option<String>,
    /// How requests arrive (`--closed-loop`).
    arrivals: replay::Arrivals,
}

/// Builds the manager `name` replays: a single-device one, or with `--tp`
/// its tensor-parallel version.
fn build_manager(name: &str, s: &Setup) -> Result<Box<dyn managers::KvManager + Send>, String> {
    if s.tp == 1 {
        return managers::build(name, s.shape, s.build);
    }
    let a = s.build.arena;
    tp::build(name, s.shape, s.tp, a.capacity, a.reserve, a.retain, s.noise)
}

fn setup(o: &Opts) -> Setup {
    let model = MODELS.iter().find(|m| m.name == o.model).unwrap_or_else(|| {
        die(&format!(
            "unknown model {:?} (known: {}; or give --kv-bytes-per-token)",
            o.model,
            MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ))
    });
    let tp_degree = o.tp as usize;
    let managers_given = std::env::args().any(|a| a == "--managers" || a.starts_with("--managers="));
    for m in &o.managers {
        if !managers::is_known(m) {
            die(&format!("unknown manager {m:?} (known: {})", managers::known_names()));
        }
        if tp_degree > 1 && managers_given && !tp::TP_MANAGERS.contains(&m.as_str()) {
            die(&format!("--tp replays {} only, not {m:?}", tp::TP_MANAGERS.join(" and ")));
        }
    }
    if o.managers.is_empty() {
        die("--managers: empty list");
    }
    let chunk = o.workload.chunk_bytes();
    let kv_bytes_per_token = o.kv_bytes_per_token.unwrap_or(model.kv_bytes_per_token);
    // Block-in-chunk needs a chunk of whole tokens on each device.
    let whole_tokens = |bpt: u64| bpt / tp_degree as u64 > 0 && chunk % (bpt / tp_degree as u64) == 0;
    let shape = KvShape {
        kv_bytes_per_token,
        layers: o.layers.unwrap_or(model.layers),
        layout: match o.layout {
            Some(LayoutArg::TokenMajor) => Layout::TokenMajor,
            Some(LayoutArg::PerLayer) => Layout::PerLayer,
            Some(LayoutArg::BlockInChunk) => Layout::BlockInChunk,
            None if whole_tokens(kv_bytes_per_token) => Layout::BlockInChunk,
            None => {
                eprintln!(
                    "note: --layout token-major: a {} chunk does not hold a whole number of {}-byte tokens, \
                     which block-in-chunk (the default) needs",
                    fmt_bytes(chunk),
                    kv_bytes_per_token / tp_degree as u64
                );
                Layout::TokenMajor
            }
        },
        max_context: o.max_context.unwrap_or(model.context),
    };
    if shape.kv_bytes_per_token < 8 * shape.n_allocs() {
        die("--kv-bytes-per-token is too small for the layout (8 bytes per allocation at least)");
    }
    if shape.layout == Layout::BlockInChunk {
        // A chunk is one block of whole tokens; a remainder would be padding
        // the replay does not model.
        let per_device = shape.kv_bytes_per_token / tp_degree as u64;
        if !whole_tokens(shape.kv_bytes_per_token) {
            die(&format!(
                "--layout block-in-chunk: a {} chunk does not hold a whole number of {per_device}-byte tokens \
                 (the replay models it where it does, as for Llama-3-8B: 16 tokens of 128 KiB in 2 MiB)",
                fmt_bytes(chunk)
            ));
        }
    }
    if tp_degree > 1 && (chunk != 2 << 20 || o.workload.closed_loop.is_some()) {
        die("--chunk-mib and --closed-loop are for single-device replays (not --tp)");
    }
    let fixed = o.workload.fixed_trace(o.requests, o.seed).map(|t| t.unwrap_or_else(|e| die(&e)));
    let trace: Trace = match &o.trace {
        _ if fixed.is_some() => {
            let mut t = fixed.expect("checked");
            if let Some(l) = o.limit {
                t.requests.truncate(l);
            }
            t
        }
        Some(p) => {
            let limit = o.limit.or(if o.quick { Some(300) } else { None });
            trace::load(p, limit).unwrap_or_else(|e| die(&e))
        }
        None => {
            let n = o.requests.unwrap_or(if o.quick { 300 } else { 1500 });
            let mut t = trace::synthetic(n, o.seed);
            if let Some(l) = o.limit {
                t.requests.truncate(l);
            }
            t
        }
    };
    let mut profile = Profile::named(&o.profile).unwrap_or_else(|e| die(&e));
    profile.params = model.params;
    profile.layers = shape.layers;
    profile.heads = model.heads;
    profile.kv_heads = model.kv_heads;
    profile.head_dim = model.head_dim;
    for k in ["layers", "heads", "kv_heads", "head_dim"] {
        profile.sources.insert(k.into(), format!("model preset {}: {}", model.name, model.source));
    }
    if let Some(p) = &o.profile_file {
        let text = std::fs::read_to_string(p).unwrap_or_else(|e| die(&format!("cannot read {}: {e}", p.display())));
        profile = Profile::with_overrides(&profile, &text).unwrap_or_else(|e| die(&format!("{}: {e}", p.display())));
    }
    if let Some(j) = &o.profile_json {
        profile = Profile::with_overrides(&profile, j).unwrap_or_else(|e| die(&format!("--profile-json: {e}")));
    }
    let max_batch = o.max_batch as usize;
    let reserve =
        o.arena_reserve.unwrap_or_else(|| managers::arena_reserve_for_chunk(shape, o.capacity, max_batch, chunk));
    let arena = ArenaOptions {
        chunk_bytes: chunk,
        retain: o.retain,
        precreate_bytes: o.precreate,
        map_ahead_bytes: o.map_ahead,
        paged_warm_bytes: o.paged_warm,
        ..ArenaOptions::new(o.capacity, reserve)
    };
    let max_tokens = o.max_tokens.unwrap_or_else(|| trace.requests.iter().map(|q| q.output).max().unwrap_or(1));
    let build = BuildOptions { arena, prefix_caching: o.prefix_caching == OnOff::On, max_tokens };
    let jobs = o.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let mut cfg = SchedConfig {
        max_batch,
        kv_bytes_per_token: shape.kv_bytes_per_token,
        profile,
        max_num_batched_tokens: o.max_num_batched_tokens,
    };
    if tp_degree > 1 {
        // The replay models one device's step (every device runs the same
        // step at once; the all-reduce between them is not modeled): its
        // share of the weights and of every token's KV.
        let shard = tp::shard_shape(shape, tp_degree).unwrap_or_else(|e| die(&e));
        cfg.kv_bytes_per_token = shard.kv_bytes_per_token;
        cfg.profile.params /= tp_degree as f64;
        // Each member's share of the heads.
        cfg.profile.heads /= tp_degree as u32;
        // The members make their driver calls at once, from their own
        // processes: the replay sums them, contention scales the sum.
        cfg.profile.driver_threads = tp_degree as u32;
    }
    let noise = tp::Noise {
        mean_bytes: o.activation_bytes.unwrap_or(o.capacity / 32),
        spread: o.activation_spread.clamp(0.0, 1.0),
        tensors: o.activation_tensors,
        seed: o.seed,
    };
    Setup {
        trace,
        shape,
        model: if o.kv_bytes_per_token.is_some() { "custom" } else { model.name },
        cfg,
        build,
        jobs,
        tp: tp_degree,
        noise,
        profile_json: o.profile_json.clone(),
        arrivals: o.workload.arrivals(),
    }
}

/// The managers to replay: as given, or with `--tp` and no `--managers`,
/// the tensor-parallel ones.
fn manager_names(o: &Opts) -> Vec<String> {
    let given = std::env::args().any(|a| a == "--managers" || a.starts_with("--managers="));
    match (o.tp > 1, given) {
        (true, false) => tp::TP_MANAGERS.iter().map(|m| m.to_string()).collect(),
        _ => o.managers.clone(),
    }
}

fn main() {
    let help = format!(
        "The step-time model's constants (profile h200, model llama3-8b; --profile, --model and \
         --profile-file change them), each with its source:\n{}",
        Profile::h200().describe()
    );
    let matches = Opts::command().after_long_help(help).get_matches();
    let mut o = Opts::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    o.managers = manager_names(&o);
    // A sweep replays one arena row and vllm-paged (see `--sweep`).
    let sweep_row = {
        let has = |m: &str| o.managers.iter().any(|x| x == m);
        if has("arena-paged") && !has("arena") {
            "arena-paged"
        } else {
            "arena"
        }
    };
    if o.sweep.is_some() {
        o.managers = vec![sweep_row.into(), "vllm-paged".into()];
    }
    let capacities = o.capacity_sweep.as_deref().map(|r| {
        let caps = vmm_sim::capacity_sweep::parse_range(r).unwrap_or_else(|e| die(&format!("--capacity-sweep: {e}")));
        // The checks below (host memory, building each manager) at the largest.
        o.capacity = caps.iter().copied().max().unwrap_or(o.capacity);
        caps
    });
    let s = setup(&o);
    if let Some(name) = &o.worker {
        run_worker(name, &s);
        return;
    }
    let jobs = s.jobs.min(o.managers.len());
    if let Err(e) = managers::check_host_memory(
        managers::host_ram(),
        s.shape,
        // Every device of a tensor-parallel manager lives in its process.
        o.capacity * s.tp as u64,
        &s.trace.requests,
        s.cfg.max_batch,
        &o.managers,
        s.build.prefix_caching,
        jobs,
    ) {
        die(&e);
    }
    let trace = &s.trace;
    let ((pm, pmed, pp99), (om, omed, op99)) = trace.stats();
    println!("KV-serving replay");
    println!(
        "  trace     {} — {} requests over {:.0} s; prompt mean/median/p99 {:.0}/{}/{}, output {:.0}/{}/{}{}",
        trace.name,
        trace.requests.len(),
        trace.duration_s(),
        pm,
        pmed,
        pp99,
        om,
        omed,
        op99,
        if trace.requests.iter().any(|q| !q.hash_ids.is_empty()) { "; prompt block hashes" } else { "" }
    );
    println!(
        "  model     {} — {} KV per token, {} layers, {} layout ({} allocation(s) per request, reservation {} tokens)",
        s.model,
        fmt_bytes(s.shape.kv_bytes_per_token),
        s.shape.layers,
        s.shape.layout.name(),
        s.shape.n_allocs(),
        s.shape.max_context
    );
    let p = &s.cfg.profile;
    println!(
        "  device    {} capacity for every manager; max batch {}; {}; GPU profile {} ({:.1} TB/s, {:.0} TFLOPS, \
         prefill MFU {:.2}, CPU {:.1} ms/step); host backend (sparse), driver calls counted and priced",
        fmt_bytes(o.capacity),
        s.cfg.max_batch,
        match s.cfg.max_num_batched_tokens {
            0 => "whole prompts".to_string(),
            n => format!("chunked prefill, {n} tokens a step"),
        },
        p.name,
        p.hbm_bytes_per_s / 1e12,
        p.peak_flops / 1e12,
        p.prefill_mfu,
        p.cpu_step_s * 1e3
    );
    if let Some(c) = o.workload.closed_loop {
        println!("  client    closed loop: {c} requests in the system at once (a new one as soon as one finishes)");
    }
    println!(
        "  managers  arena: {} chunks, virtual range {}, retain {}, prefix cache {}, prefetch {} created + {} mapped ahead per tensor (arena-sync: none); \
         arena-paged: vLLM's block pool over the arena's chunks, {}-token blocks (a chunk each, read through a block table), \
         {} mapped at start-up; \
         vllm-paged: prefix caching {}; contiguous-max: room for {} output tokens",
        fmt_bytes(o.workload.chunk_bytes()),
        fmt_bytes(s.build.arena.reserve),
        if o.retain == u64::MAX { "all pooled memory".to_string() } else { fmt_bytes(o.retain) },
        match (s.build.prefix_caching, s.shape.layout) {
            (false, _) => "off",
            (true, Layout::PerLayer) => "off (one allocation per request only)",
            (true, _) if ArenaPrefixCache::new(o.workload.chunk_bytes(), s.shape.bpt()).is_none() => {
                "off (no unit of whole chunks tiles a 512-token hash block)"
            }
            (true, _) => "on",
        },
        fmt_bytes(o.precreate),
        fmt_bytes(o.map_ahead),
        managers::paged_block_tokens(o.workload.chunk_bytes(), s.shape.kv_bytes_per_token)
            .map_or_else(|e| format!("no ({e})"), |t| t.to_string()),
        fmt_bytes(o.paged_warm),
        if s.build.prefix_caching { "on" } else { "off" },
        s.build.max_tokens
    );
    println!();

    // Build managers up front so a bad configuration fails before the replay.
    if s.tp > 1 {
        println!(
            "  tp        {} devices, 1/{} of every token's KV each ({} per token per device); {} KV capacity per \
             device; activations per device per step: {} mean, +-{:.0}%, {} tensors, seeded per device;\n            \
             step times are one device's (its share of weights and KV; all-reduce not modeled); memory \
             columns are per device (the device with the highest value)",
            s.tp,
            s.tp,
            fmt_bytes(s.shape.kv_bytes_per_token / s.tp as u64),
            fmt_bytes(o.capacity),
            fmt_bytes(s.noise.mean_bytes),
            s.noise.spread * 100.0,
            s.noise.tensors
        );
        println!();
    }
    for name in &o.managers {
        if let Err(e) = build_manager(name, &s) {
            die(&format!("{name}: {e}"));
        }
    }

    if let Some(dir) = &o.sweep {
        let title = format!(
            "{}, first {} requests, {} KV, {}",
            s.trace.name,
            s.trace.requests.len(),
            fmt_bytes(o.capacity),
            match s.cfg.max_num_batched_tokens {
                0 => "whole prompts".to_string(),
                n => format!("chunked prefill {n}"),
            }
        );
        sweep::run(dir, &s, s.jobs, &format!("{sweep_row}, {title}"), sweep_row);
        return;
    }
    if let Some(caps) = &capacities {
        capacity_sweep::run(caps, &o, &s);
        return;
    }
    let results = run_all(&o, &s, jobs);
    print_table(&results, trace);
    if let Some(path) = &o.json {
        let mut doc = to_json(&results, &o, &s);
        if let Some(w) = doc.get_mut("workload").and_then(Value::as_object_mut) {
            w.insert("arena_chunk_bytes".into(), json!(o.workload.chunk_bytes()));
            w.insert("closed_loop_concurrency".into(), json!(o.workload.closed_loop));
        }
        let text = serde_json::to_string_pretty(&doc).expect("JSON of plain values");
        std::fs::write(path, text + "\n").unwrap_or_else(|e| die(&format!("cannot write {}: {e}", path.display())));
        println!("\nJSON written to {}", path.display());
    }
    let mut failed = false;
    for r in &results {
        if r.integrity_errors > 0 || r.aborted.is_some() {
            failed = true;
            eprintln!(
                "FAILED: {}: {} integrity errors{}",
                r.name,
                r.integrity_errors,
                r.aborted.as_ref().map(|a| format!(", aborted: {a}")).unwrap_or_default()
            );
        }
        if r.host_limit_failures > 0 {
            failed = true;
            eprintln!(
                "INVALID: {}: the host backend hit a system limit {} times ({}); its figures do not describe \
                 the allocator. The usual cause is vm.max_map_count ({}): use a smaller --capacity.",
                r.name,
                r.host_limit_failures,
                r.first_host_limit.as_deref().unwrap_or(""),
                std::fs::read_to_string("/proc/sys/vm/max_map_count").map_or("?".into(), |s| s.trim().to_string())
            );
        }
    }
    if failed {
        std::process::exit(1);
    }
}

/// Worker mode: replays one manager, reporting progress (`P n`) and the
/// result (`R` and its JSON) on stdout.
fn run_worker(name: &str, s: &Setup) {
    let progress = AtomicU64::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    let out = Mutex::new(std::io::stdout());
    let r = std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut last = u64::MAX;
            while !done.load(Relaxed) {
                let p = progress.load(Relaxed);
                if p != last {
                    let _ = writeln!(out.lock().expect("stdout"), "P {p}");
                    last = p;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let mut mgr = build_manager(name, s).unwrap_or_else(|e| die(&e));
        let mut cfg = s.cfg.clone();
        cfg.profile.attn_layout = attn_layout(name, s.shape.layout);
        let r = replay::replay_arrivals(mgr.as_mut(), &s.trace.requests, &cfg, s.arrivals, &progress);
        drop(mgr);
        done.store(true, Relaxed);
        r
    });
    let mut o = out.lock().expect("stdout");
    let _ = writeln!(o, "R {}", serde_json::to_string(&r).expect("JSON of plain values"));
    let _ = o.flush();
}

/// Runs every manager in its own process (`jobs` at a time): each gets its
/// own mapping budget (the host backend maps every chunk separately, and
/// the kernel caps mappings per process) and its own wall clock.
fn run_all(o: &Opts, s: &Setup, jobs: usize) -> Vec<RunResult> {
    let runs: Vec<(String, Vec<String>)> = o.managers.iter().map(|m| (m.clone(), Vec::new())).collect();
    run_workers(&runs, s, jobs)
}

/// A run's extra arguments with the user's `--profile-json` object merged
/// under the run's own one (the run's fields win), or added where the run
/// has none.
fn with_user_profile_json(extra: &[String], user: Option<&str>) -> Vec<String> {
    let Some(user) = user else { return extra.to_vec() };
    let parse = |j: &str| match serde_json::from_str::<serde_json::Value>(j) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => die("--profile-json: not a JSON object"),
    };
    let mut out = extra.to_vec();
    match out.iter().position(|a| a == "--profile-json") {
        Some(i) if i + 1 < out.len() => {
            let mut merged = parse(user);
            merged.extend(parse(&out[i + 1]));
            out[i + 1] = serde_json::Value::Object(merged).to_string();
        }
        _ => out.extend(["--profile-json".to_string(), user.to_string()]),
    }
    out
}

/// Runs each (manager, extra arguments) in its own worker process, `jobs`
/// at a time.
fn run_workers(runs: &[(String, Vec<String>)], s: &Setup, jobs: usize) -> Vec<RunResult> {
    let per = s.trace.requests.len() as u64;
    let exe = std::env::current_exe().unwrap_or_else(|e| die(&format!("cannot find own executable: {e}")));
    // Runs that set their own capacity (a capacity sweep) replace the user's.
    let own_capacity = runs.iter().any(|(_, extra)| extra.iter().any(|a| a == "--capacity"));
    let mut base_args: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" | "--managers" | "--jobs" | "--sweep" | "--profile-json" | "--capacity-sweep" => {
                args.next();
            }
            "--capacity" if own_capacity => {
                args.next();
            }
            x if x.starts_with("--capacity=") && own_capacity => {}
            x if ["--json=", "--managers=", "--jobs=", "--sweep=", "--profile-json=", "--capacity-sweep="]
                .iter()
                .any(|p| x.starts_with(p)) => {}
            _ => base_args.push(a),
        }
    }
    // The user's --profile-json goes to every worker, under a run's own
    // overrides (the sweep's grid points), which win field by field.
    let runs: Vec<(String, Vec<String>)> = runs
        .iter()
        .map(|(name, extra)| (name.clone(), with_user_profile_json(extra, s.profile_json.as_deref())))
        .collect();
    let runs = &runs[..];
    let pending = Mutex::new((0..runs.len()).collect::<std::collections::VecDeque<usize>>());
    let progress: Vec<AtomicU64> = runs.iter().map(|_| AtomicU64::new(0)).collect();
    let results: Mutex<Vec<Option<RunResult>>> = Mutex::new(vec![None; runs.len()]);
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(per * runs.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("  [{bar:40}] {pos}/{len} request replays, {elapsed}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        b
    });
    let finished = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        if let Some(bar) = &bar {
            sc.spawn(|| {
                while !finished.load(Relaxed) {
                    bar.set_position(progress.iter().map(|p| p.load(Relaxed)).sum());
                    std::thread::sleep(Duration::from_millis(200));
                }
                bar.finish_and_clear();
            });
        }
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                sc.spawn(|| loop {
                    let Some(k) = pending.lock().expect("queue").pop_front() else { break };
                    let (name, extra) = &runs[k];
                    let mut child = Command::new(&exe)
                        .args(&base_args)
                        .args(extra)
                        .args(["--worker", name])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::inherit())
                        .spawn()
                        .unwrap_or_else(|e| die(&format!("cannot start a worker: {e}")));
                    let stdout = child.stdout.take().expect("piped stdout");
                    let mut result = None;
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        if let Some(p) = line.strip_prefix("P ") {
                            progress[k].store(p.parse().unwrap_or(0), Relaxed);
                        } else if let Some(j) = line.strip_prefix("R ") {
                            result = serde_json::from_str::<RunResult>(j).ok();
                        }
                    }
                    let status = child.wait();
                    match (result, status) {
                        (Some(r), Ok(st)) if st.success() => results.lock().expect("results")[k] = Some(r),
                        (_, st) => die(&format!("the worker replaying {name} failed ({st:?})")),
                    }
                })
            })
            .collect();
        for w in workers {
            if w.join().is_err() {
                die("a worker thread panicked");
            }
        }
        finished.store(true, Relaxed);
    });
    results.into_inner().expect("results").into_iter().map(|r| r.expect("every manager ran")).collect()
}

#[cfg(test)]
mod tests {
    use super::with_user_profile_json;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_users_profile_json_lies_under_a_runs_own() {
        let user = r#"{"create_s":1.0,"map_s":2.0}"#;
        assert_eq!(with_user_profile_json(&args(&["--x"]), None), args(&["--x"]));
        assert_eq!(with_user_profile_json(&[], Some(user)), args(&["--profile-json", user]));
        let merged = with_user_profile_json(&args(&["--profile-json", r#"{"map_s":3.0,"unmap_s":4.0}"#]), Some(user));
        assert_eq!(merged[0], "--profile-json");
        let m: serde_json::Value = serde_json::from_str(&merged[1]).unwrap();
        assert_eq!(m, serde_json::json!({"create_s": 1.0, "map_s": 3.0, "unmap_s": 4.0}));
    }
}
