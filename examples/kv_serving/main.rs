//! KV-serving replay: LLM serving traffic through vmm-arena and through
//! models of the allocators engines use today, side by side.
//!
//! ```sh
//! cargo run --release --example kv_serving                       # built-in synthetic Azure-like trace
//! cargo run --release --example kv_serving -- --trace ../shared/traces/azure_conv_2023.csv
//! cargo run --release --example kv_serving -- --quick --json out.json
//! ```
//!
//! Every manager replays the same requests with the same scheduler (see
//! `common/replay.rs`) on its own counted host device (sparse mode) of the
//! same capacity; each token's KV slot gets a real tag written through the
//! mapping and verified when the request ends. `--help` lists the options.

#[path = "../common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::counted::Calls;
use common::managers::{self, ArenaOptions, KvShape, Layout, ALL_MANAGERS};
use common::replay::{self, RunResult, SchedConfig};
use common::trace::Request;
use common::trace::{self, Trace};
use common::util::{fmt_bytes, json_f64, json_str, parse_size, stderr_is_terminal};

const HELP: &str = "\
kv_serving: replay LLM serving traffic through vmm-arena and today's allocators

usage: kv_serving [options]

  --trace PATH               Azure CSV or Mooncake JSONL trace (default: built-in synthetic
                             Azure-conversation-like trace, seeded)
  --requests N               requests in the synthetic trace (default 1500; --quick: 300)
  --seed N                   seed of the synthetic trace (default 1)
  --limit N                  replay only the first N requests of the trace
  --quick                    a small run (under a minute): --limit 300 for a trace file
  --model NAME               llama2-7b (512 KiB/token), llama3-8b (128 KiB/token, default),
                             llama3-70b (320 KiB/token)
  --kv-bytes-per-token N     override the preset's KV bytes per token (suffixes allowed)
  --layers N                 override the preset's layer count (per-layer layout)
  --max-context N            tokens a growable reservation is sized for (default: the
                             preset's context: 4096 / 131072 / 131072, Llama 2 and 3.1)
  --layout L                 token-major (default) or per-layer
  --max-batch N              most running requests (default 256)
  --step-ms MS               simulated time per step (default 30)
  --capacity SIZE            device memory for KV, e.g. 40GiB (default 64GiB: an 80 GB GPU
                             less Llama-3-8B's 16 GB of weights)
  --managers LIST            comma-separated subset of: arena, arena-no-moves,
                             pytorch-caching, pytorch-expandable, vllm-paged (default: all)
  --retain SIZE|all          vmm-arena's pooled-memory watermark (default: all)
  --arena-reserve SIZE       vmm-arena's virtual range (default: 4 x capacity, or room for
                             2 x max-batch reservations if that is more)
  --jobs N                   managers replayed at once, each in its own process
                             (default: available cores)
  --json PATH                write the results as JSON
  -h, --help                 this text
";

struct Model {
    name: &'static str,
    kv_bytes_per_token: u64,
    layers: u32,
    context: u64,
}

const MODELS: [Model; 3] = [
    Model { name: "llama2-7b", kv_bytes_per_token: 512 << 10, layers: 32, context: 4096 },
    Model { name: "llama3-8b", kv_bytes_per_token: 128 << 10, layers: 32, context: 131072 },
    Model { name: "llama3-70b", kv_bytes_per_token: 320 << 10, layers: 80, context: 131072 },
];

struct Opts {
    trace: Option<PathBuf>,
    requests: Option<usize>,
    seed: u64,
    limit: Option<usize>,
    quick: bool,
    model: String,
    kvpt: Option<u64>,
    layers: Option<u32>,
    max_context: Option<u64>,
    layout: Layout,
    max_batch: usize,
    step_ms: f64,
    capacity: u64,
    managers: Vec<String>,
    retain: u64,
    arena_reserve: u64,
    jobs: usize,
    json: Option<PathBuf>,
    /// Internal: replay only this manager and report on stdout.
    worker: Option<String>,
}

fn die(msg: &str) -> ! {
    eprintln!("kv_serving: {msg}");
    std::process::exit(2);
}

fn parse_args() -> Opts {
    let mut o = Opts {
        trace: None,
        requests: None,
        seed: 1,
        limit: None,
        quick: false,
        model: "llama3-8b".into(),
        kvpt: None,
        layers: None,
        max_context: None,
        layout: Layout::TokenMajor,
        max_batch: 256,
        step_ms: 30.0,
        capacity: 64 << 30,
        managers: ALL_MANAGERS.iter().map(|s| s.to_string()).collect(),
        retain: u64::MAX,
        arena_reserve: 0,
        jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
        json: None,
        worker: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut val = || inline.clone().or_else(|| args.next()).unwrap_or_else(|| die(&format!("{key} needs a value")));
        let num = |s: String| s.parse::<u64>().unwrap_or_else(|_| die(&format!("{key}: bad number {s:?}")));
        match key.as_str() {
            "--trace" => o.trace = Some(PathBuf::from(val())),
            "--requests" => o.requests = Some(num(val()) as usize),
            "--seed" => o.seed = num(val()),
            "--limit" => o.limit = Some(num(val()) as usize),
            "--quick" => o.quick = true,
            "--model" => o.model = val(),
            "--kv-bytes-per-token" => o.kvpt = Some(parse_size(&val()).unwrap_or_else(|e| die(&e))),
            "--layers" => o.layers = Some(num(val()) as u32),
            "--max-context" => o.max_context = Some(num(val())),
            "--layout" => {
                o.layout = match val().as_str() {
                    "token-major" => Layout::TokenMajor,
                    "per-layer" => Layout::PerLayer,
                    other => die(&format!("unknown layout {other:?} (token-major or per-layer)")),
                }
            }
            "--max-batch" => o.max_batch = num(val()).max(1) as usize,
            "--step-ms" => {
                let v = val();
                o.step_ms = v.parse().ok().filter(|&x: &f64| x > 0.0).unwrap_or_else(|| die("--step-ms: bad value"))
            }
            "--capacity" => o.capacity = parse_size(&val()).unwrap_or_else(|e| die(&e)),
            "--managers" => {
                o.managers = val().split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
                for m in &o.managers {
                    if !ALL_MANAGERS.contains(&m.as_str()) {
                        die(&format!("unknown manager {m:?} (known: {})", ALL_MANAGERS.join(", ")));
                    }
                }
            }
            "--retain" => {
                let v = val();
                o.retain = if v == "all" { u64::MAX } else { parse_size(&v).unwrap_or_else(|e| die(&e)) }
            }
            "--arena-reserve" => o.arena_reserve = parse_size(&val()).unwrap_or_else(|e| die(&e)),
            "--jobs" => o.jobs = num(val()).max(1) as usize,
            "--json" => o.json = Some(PathBuf::from(val())),
            "--worker" => o.worker = Some(val()),
            "-h" | "--help" => {
                print!("{HELP}");
                std::process::exit(0);
            }
            other => die(&format!("unknown option {other:?} (try --help)")),
        }
    }
    if o.managers.is_empty() {
        die("--managers: empty list");
    }
    o
}

fn main() {
    let o = parse_args();
    let model = MODELS.iter().find(|m| m.name == o.model).unwrap_or_else(|| {
        die(&format!(
            "unknown model {:?} (known: {}; or give --kv-bytes-per-token)",
            o.model,
            MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ))
    });
    let shape = KvShape {
        kv_bytes_per_token: o.kvpt.unwrap_or(model.kv_bytes_per_token),
        layers: o.layers.unwrap_or(model.layers),
        layout: o.layout,
        max_context: o.max_context.unwrap_or(model.context),
    };
    if shape.kv_bytes_per_token < 8 * shape.n_allocs() {
        die("--kv-bytes-per-token is too small for the layout (8 bytes per allocation at least)");
    }
    let trace: Trace = match &o.trace {
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
    let cfg = SchedConfig {
        max_batch: o.max_batch,
        step_s: o.step_ms / 1000.0,
        kv_bytes_per_token: shape.kv_bytes_per_token,
    };
    let reserve = match o.arena_reserve {
        0 => managers::arena_reserve(shape, o.capacity, o.max_batch),
        r => r,
    };
    let arena_opts = ArenaOptions { capacity: o.capacity, reserve, retain: o.retain, no_implicit_moves: false };
    let o = Opts { arena_reserve: reserve, ..o };

    if let Some(name) = &o.worker {
        run_worker(name, &trace, shape, arena_opts, cfg);
        return;
    }
    let ((pm, pmed, pp99), (om, omed, op99)) = trace.stats();
    println!("KV-serving replay");
    println!(
        "  trace     {} — {} requests over {:.0} s; prompt mean/median/p99 {:.0}/{}/{}, output {:.0}/{}/{}",
        trace.name,
        trace.requests.len(),
        trace.duration_s(),
        pm,
        pmed,
        pp99,
        om,
        omed,
        op99
    );
    println!(
        "  model     {} — {} KV per token, {} layers, {} layout ({} allocation(s) per request, reservation {} tokens)",
        if o.kvpt.is_some() { "custom" } else { model.name },
        fmt_bytes(shape.kv_bytes_per_token),
        shape.layers,
        shape.layout.name(),
        shape.n_allocs(),
        shape.max_context
    );
    println!(
        "  device    {} capacity for every manager; max batch {}, step {} ms; host backend (sparse), driver calls counted",
        fmt_bytes(o.capacity),
        o.max_batch,
        o.step_ms
    );
    println!(
        "  arena     virtual range {}, retain {}",
        fmt_bytes(reserve),
        if o.retain == u64::MAX { "all pooled memory".to_string() } else { fmt_bytes(o.retain) }
    );
    println!();

    // Build managers up front so a bad configuration fails before the replay.
    for name in &o.managers {
        if let Err(e) = managers::build(name, shape, arena_opts) {
            die(&format!("{name}: {e}"));
        }
    }

    let results = run_all(&o, trace.requests.len() as u64);

    print_table(&results, &trace);
    if let Some(path) = &o.json {
        let doc = to_json(&results, &trace, &o, &shape, model.name);
        std::fs::write(path, doc).unwrap_or_else(|e| die(&format!("cannot write {}: {e}", path.display())));
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

fn gib(b: f64) -> String {
    format!("{:.2}", b / (1u64 << 30) as f64)
}

fn print_table(results: &[RunResult], trace: &Trace) {
    let row = |c: [&str; 18]| {
        println!(
            "{:<19} {:>6} {:>5} {:>7} {:>6} {:>9} {:>9} {:>9} {:>6} {:>8} {:>6} {:>8} {:>8} {:>8} {:>7} {:>7} {:>5} {:>7}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13], c[14], c[15], c[16], c[17]
        )
    };
    row([
        "manager",
        "done",
        "rej",
        "preempt",
        "frag",
        "peak live",
        "peak phys",
        "mean phys",
        "waste",
        "copied",
        "moves",
        "creates",
        "maps",
        "model s",
        "latency",
        "latency",
        "integ",
        "wall s",
    ]);
    row([
        "", "", "", "", "fails", "GiB", "GiB", "GiB", "mean", "GiB", "", "", "", "driver", "mean s", "p99 s", "errs",
        "",
    ]);
    for r in results {
        row([
            &r.name,
            &r.completed_requests.to_string(),
            &r.rejected_requests.to_string(),
            &r.preemptions.to_string(),
            &r.fragmentation_failures.to_string(),
            &gib(r.peak_live_bytes as f64),
            &gib(r.peak_physical_bytes as f64),
            &gib(r.mean_physical_bytes),
            &format!("{:.1}%", r.mean_waste_fraction * 100.0),
            &gib(r.bytes_copied as f64),
            &r.moves.to_string(),
            &r.calls.create.to_string(),
            &r.calls.map.to_string(),
            &format!("{:.2}", r.calls.modeled_seconds()),
            &format!("{:.1}", r.mean_latency_s),
            &format!("{:.1}", r.p99_latency_s),
            &r.integrity_errors.to_string(),
            &format!("{:.1}", r.wall_seconds),
        ]);
    }
    let n = trace.requests.len();
    println!(
        "\n  {n} requests; done = completed, rej = rejected (cannot fit even alone), frag fails = allocations that"
    );
    println!(
        "  failed although free device memory covered them; waste = mean over steps of (physical - live) / physical;"
    );
    println!("  latency = simulated seconds from arrival to the last token (queueing and recomputation included);");
    println!(
        "  model s = driver calls x the A100 cost table (create 193 us, set_access 36 us, unmap 25.6 us, map 1.45 us)."
    );
    if let Some(a) = results.iter().find(|r| r.name == "arena") {
        let rel: Vec<String> = results
            .iter()
            .filter(|r| r.name != "arena")
            .map(|r| {
                format!(
                    "{} {:.2}x peak phys, {:.2}x mean phys",
                    r.name,
                    r.peak_physical_bytes as f64 / a.peak_physical_bytes.max(1) as f64,
                    r.mean_physical_bytes / a.mean_physical_bytes.max(1.0)
                )
            })
            .collect();
        if !rel.is_empty() {
            println!("  relative to arena: {}", rel.join("; "));
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

fn to_json(results: &[RunResult], trace: &Trace, o: &Opts, shape: &KvShape, model: &str) -> String {
    let steps = results.iter().map(|r| r.steps).max().unwrap_or(0);
    let mut s = String::new();
    s.push_str("{\"workload\": {");
    s.push_str(&format!(
        "\"trace\": {}, \"requests\": {}, \"model\": {}, \"kv_bytes_per_token\": {}, \"layout\": {}, \
         \"capacity_bytes\": {}, \"steps\": {}, \"layers\": {}, \"allocations_per_request\": {}, \
         \"reservation_tokens\": {}, \"max_batch\": {}, \"step_ms\": {}, \"seed\": {}, \
         \"arena_retain_bytes\": {}, \"arena_reserve_bytes\": {}, \"date_unix\": {}",
        json_str(&trace.name),
        trace.requests.len(),
        json_str(if o.kvpt.is_some() { "custom" } else { model }),
        shape.kv_bytes_per_token,
        json_str(shape.layout.name()),
        o.capacity,
        steps,
        shape.layers,
        shape.n_allocs(),
        shape.max_context,
        o.max_batch,
        json_f64(o.step_ms),
        o.seed,
        if o.retain == u64::MAX { "null".to_string() } else { o.retain.to_string() },
        o.arena_reserve,
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    ));
    s.push_str("},\n \"managers\": [");
    for (i, r) in results.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let c = r.calls;
        s.push_str(&format!(
            "\n  {{\"name\": {}, \"completed_requests\": {}, \"preemptions\": {}, \"fragmentation_failures\": {}, \
             \"peak_live_bytes\": {}, \"peak_physical_bytes\": {}, \"mean_waste_fraction\": {}, \
             \"bytes_copied\": {}, \"moves\": {}, \
             \"driver_calls\": {{\"create\": {}, \"map\": {}, \"unmap\": {}, \"release\": {}, \"set_access\": {}, \
             \"reserve\": {}, \"free_reservation\": {}, \"synchronize\": {}, \"data\": {}}}, \
             \"modeled_driver_seconds\": {}, \"integrity_errors\": {}, \"wall_seconds\": {}, \
             \"rejected_requests\": {}, \"admission_failures\": {}, \"growth_failures\": {}, \
             \"host_limit_failures\": {}, \"create_failed\": {}, \
             \"mean_latency_s\": {}, \"p99_latency_s\": {}, \"mean_queue_s\": {}, \
             \"mean_physical_bytes\": {}, \"mean_live_bytes\": {}, \"final_physical_bytes\": {}, \
             \"tags_written\": {}, \"steps\": {}, \"simulated_seconds\": {}, \"first_fragmentation_failure\": {}, \
             \"aborted\": {}",
            json_str(&r.name),
            r.completed_requests,
            r.preemptions,
            r.fragmentation_failures,
            r.peak_live_bytes,
            r.peak_physical_bytes,
            json_f64(r.mean_waste_fraction),
            r.bytes_copied,
            r.moves,
            c.create,
            c.map,
            c.unmap,
            c.release,
            c.set_access,
            c.reserve,
            c.free_reservation,
            c.synchronize,
            c.data,
            json_f64(c.modeled_seconds()),
            r.integrity_errors,
            json_f64(r.wall_seconds),
            r.rejected_requests,
            r.admission_failures,
            r.growth_failures,
            r.host_limit_failures,
            c.create_failed,
            json_f64(r.mean_latency_s),
            json_f64(r.p99_latency_s),
            json_f64(r.mean_queue_s),
            json_f64(r.mean_physical_bytes),
            json_f64(r.mean_live_bytes),
            r.final_physical_bytes,
            r.tags_written,
            r.steps,
            json_f64(r.simulated_seconds),
            r.first_fragmentation.as_deref().map_or("null".to_string(), json_str),
            r.aborted.as_deref().map_or("null".to_string(), json_str),
        ));
        for (k, v) in &r.extra {
            s.push_str(&format!(", {}: {}", json_str(k), v));
        }
        s.push('}');
    }
    s.push_str("\n]}\n");
    s
}

/// Worker mode: replays one manager, reporting progress (`P n`) and the
/// result (`R key=value` lines, then `E`) on stdout.
fn run_worker(name: &str, trace: &Trace, shape: KvShape, arena: ArenaOptions, cfg: SchedConfig) {
    let reqs: &[Request] = &trace.requests;
    let progress = AtomicU64::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    let out = Mutex::new(std::io::stdout());
    let r = std::thread::scope(|s| {
        s.spawn(|| {
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
        let mut mgr = managers::build(name, shape, arena).unwrap_or_else(|e| die(&e));
        let r = replay::replay(mgr.as_mut(), reqs, cfg, &progress);
        drop(mgr);
        done.store(true, Relaxed);
        r
    });
    let mut o = out.lock().expect("stdout");
    for (k, v) in encode(&r) {
        let _ = writeln!(o, "R {k}={}", v.replace('\\', "\\\\").replace('\n', "\\n"));
    }
    let _ = writeln!(o, "E");
    let _ = o.flush();
}

/// Runs every manager in its own process (`--jobs` at a time): each gets
/// its own mapping budget (the host backend maps every chunk separately, and
/// the kernel caps mappings per process) and its own wall clock.
fn run_all(o: &Opts, requests: u64) -> Vec<RunResult> {
    let total = requests * o.managers.len() as u64;
    let exe = std::env::current_exe().unwrap_or_else(|e| die(&format!("cannot find own executable: {e}")));
    let mut base_args: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" | "--managers" | "--jobs" => {
                args.next();
            }
            x if x.starts_with("--json=") || x.starts_with("--managers=") || x.starts_with("--jobs=") => {}
            _ => base_args.push(a),
        }
    }
    let pending = Mutex::new((0..o.managers.len()).collect::<Vec<usize>>());
    let progress: Vec<AtomicU64> = o.managers.iter().map(|_| AtomicU64::new(0)).collect();
    let results: Mutex<Vec<Option<RunResult>>> = Mutex::new(vec![None; o.managers.len()]);
    let started = Instant::now();
    let tty = stderr_is_terminal();
    let finished = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        if tty {
            s.spawn(|| {
                while !finished.load(Relaxed) {
                    let done = progress.iter().map(|p| p.load(Relaxed)).sum::<u64>().min(total);
                    let width = 40u64;
                    let fill = (done * width / total.max(1)) as usize;
                    eprint!(
                        "\r  [{}{}] {}/{} request replays, {:.0} s ",
                        "=".repeat(fill),
                        " ".repeat(width as usize - fill),
                        done,
                        total,
                        started.elapsed().as_secs_f64()
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
                eprint!("\r{}\r", " ".repeat(90));
            });
        }
        let workers: Vec<_> = (0..o.jobs.min(o.managers.len()))
            .map(|_| {
                s.spawn(|| loop {
                    let Some(k) = pending.lock().expect("queue").pop_front_index() else { break };
                    let name = &o.managers[k];
                    let mut child = Command::new(&exe)
                        .args(&base_args)
                        .args(["--worker", name])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::inherit())
                        .spawn()
                        .unwrap_or_else(|e| die(&format!("cannot start a worker: {e}")));
                    let stdout = child.stdout.take().expect("piped stdout");
                    let mut fields = Vec::new();
                    let mut complete = false;
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        if let Some(p) = line.strip_prefix("P ") {
                            progress[k].store(p.parse().unwrap_or(0), Relaxed);
                        } else if let Some(kv) = line.strip_prefix("R ") {
                            if let Some((key, v)) = kv.split_once('=') {
                                fields.push((key.to_string(), v.replace("\\n", "\n").replace("\\\\", "\\")));
                            }
                        } else if line == "E" {
                            complete = true;
                        }
                    }
                    let status = child.wait();
                    if !complete || !status.as_ref().is_ok_and(|s| s.success()) {
                        die(&format!("the worker replaying {name} failed ({status:?})"));
                    }
                    results.lock().expect("results")[k] = Some(decode(name, &fields));
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

trait PopFront {
    fn pop_front_index(&mut self) -> Option<usize>;
}

impl PopFront for Vec<usize> {
    fn pop_front_index(&mut self) -> Option<usize> {
        if self.is_empty() {
            None
        } else {
            Some(self.remove(0))
        }
    }
}

fn encode(r: &RunResult) -> Vec<(String, String)> {
    let c = r.calls;
    let mut v: Vec<(String, String)> = vec![
        ("completed_requests".into(), r.completed_requests.to_string()),
        ("rejected_requests".into(), r.rejected_requests.to_string()),
        ("preemptions".into(), r.preemptions.to_string()),
        ("admission_failures".into(), r.admission_failures.to_string()),
        ("growth_failures".into(), r.growth_failures.to_string()),
        ("fragmentation_failures".into(), r.fragmentation_failures.to_string()),
        ("host_limit_failures".into(), r.host_limit_failures.to_string()),
        ("peak_live_bytes".into(), r.peak_live_bytes.to_string()),
        ("peak_physical_bytes".into(), r.peak_physical_bytes.to_string()),
        ("mean_physical_bytes".into(), r.mean_physical_bytes.to_string()),
        ("mean_live_bytes".into(), r.mean_live_bytes.to_string()),
        ("mean_waste_fraction".into(), r.mean_waste_fraction.to_string()),
        ("final_physical_bytes".into(), r.final_physical_bytes.to_string()),
        ("mean_latency_s".into(), r.mean_latency_s.to_string()),
        ("p99_latency_s".into(), r.p99_latency_s.to_string()),
        ("mean_queue_s".into(), r.mean_queue_s.to_string()),
        ("bytes_copied".into(), r.bytes_copied.to_string()),
        ("moves".into(), r.moves.to_string()),
        ("integrity_errors".into(), r.integrity_errors.to_string()),
        ("tags_written".into(), r.tags_written.to_string()),
        ("wall_seconds".into(), r.wall_seconds.to_string()),
        ("steps".into(), r.steps.to_string()),
        ("simulated_seconds".into(), r.simulated_seconds.to_string()),
        ("c.reserve".into(), c.reserve.to_string()),
        ("c.free_reservation".into(), c.free_reservation.to_string()),
        ("c.create".into(), c.create.to_string()),
        ("c.create_failed".into(), c.create_failed.to_string()),
        ("c.release".into(), c.release.to_string()),
        ("c.map".into(), c.map.to_string()),
        ("c.set_access".into(), c.set_access.to_string()),
        ("c.unmap".into(), c.unmap.to_string()),
        ("c.synchronize".into(), c.synchronize.to_string()),
        ("c.data".into(), c.data.to_string()),
    ];
    if let Some(f) = &r.first_fragmentation {
        v.push(("first_fragmentation".into(), f.clone()));
    }
    if let Some(f) = &r.first_host_limit {
        v.push(("first_host_limit".into(), f.clone()));
    }
    if let Some(f) = &r.aborted {
        v.push(("aborted".into(), f.clone()));
    }
    for (k, x) in &r.extra {
        v.push((format!("x.{k}"), x.clone()));
    }
    v
}

fn decode(name: &str, fields: &[(String, String)]) -> RunResult {
    let mut r = RunResult { name: name.to_string(), ..Default::default() };
    let mut c = Calls::default();
    for (k, v) in fields {
        let u = || v.parse::<u64>().unwrap_or(0);
        let f = || v.parse::<f64>().unwrap_or(0.0);
        match k.as_str() {
            "completed_requests" => r.completed_requests = u(),
            "rejected_requests" => r.rejected_requests = u(),
            "preemptions" => r.preemptions = u(),
            "admission_failures" => r.admission_failures = u(),
            "growth_failures" => r.growth_failures = u(),
            "fragmentation_failures" => r.fragmentation_failures = u(),
            "host_limit_failures" => r.host_limit_failures = u(),
            "peak_live_bytes" => r.peak_live_bytes = u(),
            "peak_physical_bytes" => r.peak_physical_bytes = u(),
            "mean_physical_bytes" => r.mean_physical_bytes = f(),
            "mean_live_bytes" => r.mean_live_bytes = f(),
            "mean_waste_fraction" => r.mean_waste_fraction = f(),
            "final_physical_bytes" => r.final_physical_bytes = u(),
            "mean_latency_s" => r.mean_latency_s = f(),
            "p99_latency_s" => r.p99_latency_s = f(),
            "mean_queue_s" => r.mean_queue_s = f(),
            "bytes_copied" => r.bytes_copied = u(),
            "moves" => r.moves = u(),
            "integrity_errors" => r.integrity_errors = u(),
            "tags_written" => r.tags_written = u(),
            "wall_seconds" => r.wall_seconds = f(),
            "steps" => r.steps = u(),
            "simulated_seconds" => r.simulated_seconds = f(),
            "c.reserve" => c.reserve = u(),
            "c.free_reservation" => c.free_reservation = u(),
            "c.create" => c.create = u(),
            "c.create_failed" => c.create_failed = u(),
            "c.release" => c.release = u(),
            "c.map" => c.map = u(),
            "c.set_access" => c.set_access = u(),
            "c.unmap" => c.unmap = u(),
            "c.synchronize" => c.synchronize = u(),
            "c.data" => c.data = u(),
            "first_fragmentation" => r.first_fragmentation = Some(v.clone()),
            "first_host_limit" => r.first_host_limit = Some(v.clone()),
            "aborted" => r.aborted = Some(v.clone()),
            x => {
                if let Some(x) = x.strip_prefix("x.") {
                    r.extra.push((x.to_string(), v.clone()));
                }
            }
        }
    }
    r.calls = c;
    r
}
