//! ONNX Runtime's CPU allocators side by side in one run, on the decoder
//! model over one sequence of varying lengths: vmm-arena (this crate's
//! OrtAllocator), ONNX Runtime's default BFC arena, and plain malloc (its
//! arena disabled).
//!
//! Memory: each allocator alone in the process, one after the other (peak
//! and retained resident set, the retained part read after malloc_trim so
//! that glibc's keeping of ONNX Runtime's freed heap is not counted, and
//! what the allocator itself holds).
//! Throughput: the three sessions alive together, one untimed pass over
//! the sequence each (outputs compared bit for bit), then the timed passes
//! interleaved in rotating order; inferences per second each.
//!
//!     cargo run --release --example bench -- [--runs 64] [--passes 3] [--max-seq 512]
//!         [--threads 1] [--layers 2 --d-model 512 --heads 8 --ffn 2048] [--quick] [--json [PATH]]

use std::time::{Duration, Instant};

use vmm_arena_onnxruntime::model::{self, ModelSpec};
use vmm_arena_onnxruntime::{
    peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes, session_allocator_stats, AllocatorCounters,
    ArenaAllocator, ArenaConfig, Ort, Registration, Session, SessionConfig,
};

const MIB: f64 = (1u64 << 20) as f64;

struct Options {
    runs: usize,
    passes: usize,
    max_seq: usize,
    threads: i32,
    spec: ModelSpec,
    json: Option<Option<String>>,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { runs: 64, passes: 3, max_seq: 512, threads: 1, spec: ModelSpec::default(), json: None };
    let mut args = std::env::args().skip(1).peekable();
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            let value = args.next().ok_or_else(|| format!("{name} needs a value"))?;
            value.parse().map_err(|_| format!("{name}: {value} is not a number"))
        };
        match arg.as_str() {
            "--runs" => options.runs = number("--runs")?,
            "--passes" => options.passes = number("--passes")?,
            "--max-seq" => options.max_seq = number("--max-seq")?,
            "--threads" => options.threads = number("--threads")? as i32,
            "--layers" => options.spec.layers = number("--layers")?,
            "--d-model" => options.spec.d_model = number("--d-model")?,
            "--heads" => options.spec.heads = number("--heads")?,
            "--ffn" => options.spec.ffn = number("--ffn")?,
            "--quick" => {
                options.runs = 16;
                options.passes = 1;
            }
            "--json" => {
                let path = match args.peek() {
                    Some(next) if !next.starts_with("--") => args.next(),
                    _ => None,
                };
                options.json = Some(path);
            }
            "-h" | "--help" => {
                println!("{}", include_str!("bench.rs").lines().take(12).collect::<Vec<_>>().join("\n"));
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (see --help)")),
        }
    }
    if options.runs == 0 || options.passes == 0 || options.max_seq == 0 {
        return Err("--runs, --passes and --max-seq must be at least 1".into());
    }
    Ok(options)
}

/// The sequence of lengths every allocator runs: `runs` lengths in
/// 1..=max_seq from a fixed seed, the first and last being 1 and max_seq.
fn lengths(runs: usize, max_seq: usize) -> Vec<usize> {
    let mut state = 0x5EED_0F0Au64;
    let mut out: Vec<usize> = (0..runs)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % max_seq + 1
        })
        .collect();
    out[0] = 1;
    if runs > 1 {
        out[runs - 1] = max_seq;
    }
    out
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Arena,
    Bfc,
    Malloc,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Arena, Kind::Bfc, Kind::Malloc];

    fn name(self) -> &'static str {
        match self {
            Kind::Arena => "vmm-arena",
            Kind::Bfc => "ORT default (BFC arena)",
            Kind::Malloc => "ORT malloc (arena off)",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Kind::Arena => "vmm_arena",
            Kind::Bfc => "ort_bfc",
            Kind::Malloc => "ort_malloc",
        }
    }

    fn config<'r>(self, registration: &'r Registration<'r>, threads: i32) -> SessionConfig<'r> {
        match self {
            Kind::Arena => SessionConfig { threads, allocator: Some(registration), ..SessionConfig::default() },
            Kind::Bfc => SessionConfig { threads, ..SessionConfig::default() },
            Kind::Malloc => SessionConfig { threads, cpu_mem_arena: false, ..SessionConfig::default() },
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Memory {
    rss_before: u64,
    rss_peak: u64,
    rss_alive: u64,
    rss_after: u64,
    /// what the allocator held at its peak (arena: mapped + pooled;
    /// BFC: TotalAllocated after the runs, which it never lowers)
    held_peak: Option<u64>,
    /// what it holds with the session alive after the runs (arena: after
    /// trim; BFC: TotalAllocated)
    held_alive: Option<u64>,
    /// what it holds once the session is gone (arena: after trim)
    held_after: Option<u64>,
}

#[derive(Default, Clone, Copy)]
struct Throughput {
    runs: usize,
    elapsed: Duration,
}

impl Throughput {
    fn per_second(&self) -> f64 {
        self.runs as f64 / self.elapsed.as_secs_f64()
    }
}

fn run_all(session: &Session<'_>, lengths: &[usize], d_model: usize) -> Result<Vec<Vec<f32>>, String> {
    lengths
        .iter()
        .map(|&seq| {
            session.run(&model::input(seq, d_model, seq as u64), seq, d_model).map_err(|e| format!("seq {seq}: {e}"))
        })
        .collect()
}

fn stat(pairs: &[(String, String)], key: &str) -> Option<u64> {
    pairs.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.parse().ok())
}

/// One allocator alone: session, the sequence once, measurements, end.
fn measure_memory(
    kind: Kind,
    ort: &'static Ort,
    path: &std::path::Path,
    registration: &Registration<'_>,
    options: &Options,
    lengths: &[usize],
) -> Result<Memory, String> {
    let allocator = registration.allocator();
    release_free_heap();
    let mut memory = Memory { rss_before: rss_bytes(), ..Memory::default() };
    reset_peak_rss();
    let session = Session::new(ort, path, kind.config(registration, options.threads)).map_err(|e| e.to_string())?;
    run_all(&session, lengths, options.spec.d_model)?;
    memory.rss_peak = peak_rss_bytes();
    match kind {
        Kind::Arena => {
            let stats = allocator.arena_stats().map_err(|e| e.to_string())?;
            memory.held_peak = Some(stats.peak_physical_bytes);
            allocator.trim().map_err(|e| e.to_string())?;
            let trimmed = allocator.arena_stats().map_err(|e| e.to_string())?;
            memory.held_alive = Some(trimmed.mapped_bytes + trimmed.pooled_bytes);
        }
        Kind::Bfc => {
            let pairs = session_allocator_stats(&session).map_err(|e| e.to_string())?;
            memory.held_peak = stat(&pairs, "TotalAllocated");
            memory.held_alive = memory.held_peak;
        }
        Kind::Malloc => {}
    }
    release_free_heap();
    memory.rss_alive = rss_bytes();
    drop(session);
    if kind == Kind::Arena {
        allocator.trim().map_err(|e| e.to_string())?;
        let end = allocator.arena_stats().map_err(|e| e.to_string())?;
        memory.held_after = Some(end.mapped_bytes + end.pooled_bytes);
    }
    release_free_heap();
    memory.rss_after = rss_bytes();
    Ok(memory)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB)
}

fn opt_mib(bytes: Option<u64>) -> String {
    bytes.map(mib).unwrap_or_else(|| "-".into())
}

fn json_opt(bytes: Option<u64>) -> String {
    bytes.map(|b| b.to_string()).unwrap_or_else(|| "null".into())
}

fn main() {
    if let Err(error) = bench() {
        eprintln!("bench: {error}");
        std::process::exit(1);
    }
}

fn bench() -> Result<(), String> {
    let options = parse_options()?;
    let ort = Ort::global().map_err(|e| e.to_string())?;
    let spec = options.spec;
    let path = model::ensure(spec)?;
    let lengths = lengths(options.runs, options.max_seq);
    let allocator = ArenaAllocator::new(ort, ArenaConfig::default()).map_err(|e| e.to_string())?;
    let registration = allocator.register().map_err(|e| e.to_string())?;

    // One session of each first, so that ONNX Runtime's one-time setup is
    // behind every measurement.
    for kind in Kind::ALL {
        let warm = Session::new(ort, &path, kind.config(&registration, options.threads)).map_err(|e| e.to_string())?;
        warm.run(&model::input(1, spec.d_model, 0), 1, spec.d_model).map_err(|e| e.to_string())?;
    }
    allocator.trim().map_err(|e| e.to_string())?;

    let mut memory = [Memory::default(); 3];
    for (i, kind) in Kind::ALL.into_iter().enumerate() {
        memory[i] = measure_memory(kind, ort, &path, &registration, &options, &lengths)?;
    }

    // Throughput: all sessions alive, passes interleaved in rotating order.
    let sessions = Kind::ALL
        .iter()
        .map(|kind| Session::new(ort, &path, kind.config(&registration, options.threads)).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    // One untimed pass each first: every allocator reaches its steady state
    // (the BFC arena its regions, vmm-arena its pooled chunks), and the
    // outputs are compared bit for bit.
    let reference = run_all(&sessions[0], &lengths, spec.d_model)?;
    let mut identical = true;
    for session in &sessions[1..] {
        let outputs = run_all(session, &lengths, spec.d_model)?;
        identical &= reference.iter().flatten().zip(outputs.iter().flatten()).all(|(a, b)| a.to_bits() == b.to_bits());
    }
    let counters_start = allocator.counters();
    let arena_start = allocator.arena_stats().map_err(|e| e.to_string())?;
    let mut throughput = [Throughput::default(); 3];
    for pass in 0..options.passes {
        for step in 0..Kind::ALL.len() {
            let i = (pass + step) % Kind::ALL.len();
            let start = Instant::now();
            run_all(&sessions[i], &lengths, spec.d_model)?;
            throughput[i].elapsed += start.elapsed();
            throughput[i].runs += lengths.len();
        }
    }
    let counters_end = allocator.counters();
    let arena_end = allocator.arena_stats().map_err(|e| e.to_string())?;
    drop(sessions);
    allocator.trim().map_err(|e| e.to_string())?;
    let counters = allocator.counters();
    // What the arena did during the timed passes.
    let timed = AllocatorCounters {
        allocs: counters_end.allocs - counters_start.allocs,
        frees: counters_end.frees - counters_start.frees,
        alloc_nanos: counters_end.alloc_nanos - counters_start.alloc_nanos,
        free_nanos: counters_end.free_nanos - counters_start.free_nanos,
        ..AllocatorCounters::default()
    };
    let timed_runs = throughput[0].runs.max(1) as f64;

    let mean_seq = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
    println!(
        "ONNX Runtime {} | decoder l{} d{} h{} f{} | {} runs of seq 1..={} (mean {:.0}) x {} passes | {} intra-op thread(s)",
        ort.version(),
        spec.layers,
        spec.d_model,
        spec.heads,
        spec.ffn,
        lengths.len(),
        options.max_seq,
        mean_seq,
        options.passes,
        options.threads
    );
    println!("outputs bit-identical across allocators: {identical}");
    println!();
    println!(
        "{:<25} {:>9} {:>9} {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}",
        "allocator", "infer/s", "rel", "RSS peak", "RSS alive", "RSS after", "held peak", "held alive", "held after"
    );
    println!(
        "{:<25} {:>9} {:>9} {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}",
        "", "", "", "MiB", "MiB", "MiB", "MiB", "MiB", "MiB"
    );
    let baseline = throughput[1].per_second();
    for (i, kind) in Kind::ALL.into_iter().enumerate() {
        let m = memory[i];
        println!(
            "{:<25} {:>9.2} {:>8.3}x {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}",
            kind.name(),
            throughput[i].per_second(),
            throughput[i].per_second() / baseline,
            mib(m.rss_peak),
            mib(m.rss_alive),
            mib(m.rss_after),
            opt_mib(m.held_peak),
            opt_mib(m.held_alive),
            opt_mib(m.held_after)
        );
    }
    println!();
    println!(
        "RSS: VmRSS/VmHWM of the process, each allocator measured alone (start {} / {} / {} MiB); alive = after the \
         runs with the session open (vmm-arena trimmed); after = session closed; alive and after are read after \
         malloc_trim (ONNX Runtime's own freed heap given back). held: vmm-arena mapped+pooled, BFC TotalAllocated.",
        mib(memory[0].rss_before),
        mib(memory[1].rss_before),
        mib(memory[2].rss_before)
    );
    println!(
        "vmm-arena served {} allocs + {} reserves in all, freed {}, refused {}, live at the end {}",
        counters.allocs, counters.reserves, counters.frees, counters.refused, counters.live_blocks
    );
    let per_run = |n: u64| n as f64 / timed_runs;
    println!(
        "vmm-arena per inference in the timed passes: {:.1} Allocs at {:.0} ns, {:.1} Frees at {:.0} ns \
         ({:.1} us in the arena); driver calls: {:.2} maps, {:.2} unmaps, {:.2} chunk creates, {:.2} releases",
        per_run(timed.allocs),
        timed.alloc_nanos as f64 / timed.allocs.max(1) as f64,
        per_run(timed.frees),
        timed.free_nanos as f64 / timed.frees.max(1) as f64,
        per_run(timed.alloc_nanos + timed.free_nanos) / 1000.0,
        per_run(arena_end.driver_maps - arena_start.driver_maps),
        per_run(arena_end.driver_unmaps - arena_start.driver_unmaps),
        per_run(arena_end.driver_creates - arena_start.driver_creates),
        per_run(arena_end.driver_releases - arena_start.driver_releases)
    );

    if let Some(target) = &options.json {
        let rows: Vec<String> = Kind::ALL
            .into_iter()
            .enumerate()
            .map(|(i, kind)| {
                let m = memory[i];
                format!(
                    "{{\"allocator\":\"{}\",\"inferences_per_s\":{:.3},\"runs\":{},\"seconds\":{:.3},\
                     \"rss_before_bytes\":{},\"rss_peak_bytes\":{},\"rss_alive_bytes\":{},\"rss_after_bytes\":{},\
                     \"held_peak_bytes\":{},\"held_alive_bytes\":{},\"held_after_bytes\":{}}}",
                    kind.key(),
                    throughput[i].per_second(),
                    throughput[i].runs,
                    throughput[i].elapsed.as_secs_f64(),
                    m.rss_before,
                    m.rss_peak,
                    m.rss_alive,
                    m.rss_after,
                    json_opt(m.held_peak),
                    json_opt(m.held_alive),
                    json_opt(m.held_after)
                )
            })
            .collect();
        let json = format!(
            "{{\"onnxruntime\":\"{}\",\"model\":{{\"layers\":{},\"d_model\":{},\"heads\":{},\"ffn\":{}}},\
             \"lengths\":{:?},\"passes\":{},\"threads\":{},\"bit_identical\":{},\"arena_timed_allocs\":{},\
             \"arena_timed_alloc_nanos\":{},\"arena_timed_frees\":{},\"arena_timed_free_nanos\":{},\"allocators\":[{}]}}\n",
            ort.version(),
            spec.layers,
            spec.d_model,
            spec.heads,
            spec.ffn,
            lengths,
            options.passes,
            options.threads,
            identical,
            timed.allocs,
            timed.alloc_nanos,
            timed.frees,
            timed.free_nanos,
            rows.join(",")
        );
        match target {
            Some(path) => std::fs::write(path, json).map_err(|e| format!("writing {path}: {e}"))?,
            None => print!("{json}"),
        }
    }
    drop(registration);
    Ok(())
}
