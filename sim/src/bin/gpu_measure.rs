//! Measures the CUDA virtual memory calls the arena is built on, on a real GPU.
//!
//! ```text
//! gpu_measure [--out DIR] [--device N] [--quick]
//! ```
//!
//! Measures, with [`CudaDriver`] directly (no arena policy in the way):
//! - the latency (median, p99) of each driver call for one chunk (2 MiB, or
//!   the device's recommended granularity if larger): `cuMemCreate`,
//!   `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`,
//!   `cuMemAddressReserve` / `cuMemAddressFree` (one chunk and 8 GiB), and
//!   `cuCtxSynchronize` on an idle device;
//! - `cuMemSetAccess` (and `cuMemUnmap`) over spans of 1, 8, 64 and 512 chunks;
//! - moving 2 MiB .. 4 GiB by remapping (map the same chunks at a second
//!   reserved range + one `cuMemSetAccess`: the arena's move) against copying
//!   the same bytes with `cuMemcpyDtoD` (timed until complete), as a ratio;
//! - and, through an [`Arena`] over the same device, alloc/free pairs on the
//!   pooled path, with the driver calls they made (expected: none).
//!
//! Prints a Markdown report; with `--out DIR` also writes `gpu-measure.json`
//! and `gpu-measure.md` there, and `kv-profile.json`: the measured driver
//! prices as a profile for `kv_serving --profile-file` (medians; the
//! access and unmap calls split into a part per call and a part per chunk,
//! fitted over the spans, see `sim/src/timing.rs`). Where CUDA cannot run it says so and exits 0
//! (writing a JSON with `"status": "unsupported"` when `--out` is given).
//! `--quick` cuts repetitions and sizes, for a smoke run.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use serde::Serialize;

use vmm_arena::driver::cuda::CudaDriver;
use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::{Arena, ArenaConfig};
use vmm_sim::timing::{fit_span_cost, DriverPrices, SpanCost};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Measures the CUDA virtual memory calls the arena is built on; prints a
/// Markdown report (exits 0, saying so, where CUDA cannot run).
#[derive(Debug, Parser)]
#[command(name = "gpu_measure")]
struct Args {
    /// Also write gpu-measure.json and gpu-measure.md into DIR.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// CUDA device ordinal.
    #[arg(long, value_name = "N", default_value_t = 0)]
    device: i32,
    /// Fewer repetitions and sizes, for a smoke run.
    #[arg(long)]
    quick: bool,
}

/// Latency samples in nanoseconds.
#[derive(Clone)]
struct Stats {
    ns: Vec<u64>,
}

impl Stats {
    fn new() -> Stats {
        Stats { ns: Vec::new() }
    }

    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.ns.push(t.elapsed().as_nanos() as u64);
        r
    }

    fn sorted(&self) -> Vec<u64> {
        let mut v = self.ns.clone();
        v.sort_unstable();
        v
    }

    /// Nearest-rank percentile, in microseconds.
    fn pct_us(&self, p: f64) -> f64 {
        let v = self.sorted();
        if v.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1] as f64 / 1e3
    }

    fn median_us(&self) -> f64 {
        self.pct_us(50.0)
    }

    fn p99_us(&self) -> f64 {
        self.pct_us(99.0)
    }

    fn mean_us(&self) -> f64 {
        if self.ns.is_empty() {
            return f64::NAN;
        }
        self.ns.iter().sum::<u64>() as f64 / self.ns.len() as f64 / 1e3
    }

    /// The summary written to JSON (no samples: NaN, written as null).
    fn json(&self) -> LatencyJson {
        LatencyJson {
            n: self.ns.len(),
            median_us: self.median_us(),
            p99_us: self.p99_us(),
            mean_us: self.mean_us(),
            min_us: self.pct_us(0.0),
            max_us: self.pct_us(100.0),
        }
    }
}

#[derive(Serialize)]
struct LatencyJson {
    n: usize,
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
    min_us: f64,
    max_us: f64,
}

fn size_label(bytes: u64) -> String {
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes / MIB)
    }
}

type Res<T> = Result<T, vmm_arena::error::Error>;

struct CallRow {
    call: String,
    stats: Stats,
}

struct SpanRow {
    chunks: u64,
    set_access: Stats,
    unmap: Stats,
}

struct PoolRow {
    bytes: u64,
    pair: Stats,
    driver_calls: u64,
}

struct MoveRow {
    bytes: u64,
    remap: Stats,
    unmap_old: Stats,
    copy: Stats,
}

/// Per-call latencies for single chunks.
fn measure_calls(d: &CudaDriver, chunk: u64, n: usize) -> Res<Vec<CallRow>> {
    let mut create = Stats::new();
    let mut map = Stats::new();
    let mut access = Stats::new();
    let mut unmap = Stats::new();
    let mut release = Stats::new();
    let warmup = 8usize.min(n);
    let base = d.reserve(chunk * n as u64, chunk)?;
    for round in 0..2 {
        // Round 0 warms up (lazy symbol loading, driver caches); round 1 counts.
        let count = if round == 0 { warmup } else { n };
        let mut handles: Vec<ChunkHandle> = Vec::with_capacity(count);
        let mut s = [Stats::new(), Stats::new(), Stats::new(), Stats::new(), Stats::new()];
        for _ in 0..count {
            handles.push(s[0].time(|| d.create(chunk))?);
        }
        for (i, &h) in handles.iter().enumerate() {
            let addr = base + i as u64 * chunk;
            s[1].time(|| d.map(addr, chunk, h, 0))?;
            s[2].time(|| d.set_access(addr, chunk))?;
        }
        for i in 0..count {
            let addr = base + i as u64 * chunk;
            s[3].time(|| d.unmap(addr, chunk))?;
        }
        for &h in &handles {
            s[4].time(|| d.release(h))?;
        }
        if round == 1 {
            let [a, b, c, e, f] = s;
            (create, map, access, unmap, release) = (a, b, c, e, f);
        }
    }
    d.free_reservation(base, chunk * n as u64)?;

    let mut rows = vec![
        CallRow { call: "cuMemCreate".into(), stats: create },
        CallRow { call: "cuMemMap".into(), stats: map },
        CallRow { call: "cuMemSetAccess (1 chunk)".into(), stats: access },
        CallRow { call: "cuMemUnmap (1 chunk)".into(), stats: unmap },
        CallRow { call: "cuMemRelease".into(), stats: release },
    ];
    for (size, reps) in [(chunk, n), (8 * GIB, n.min(100))] {
        let mut reserve = Stats::new();
        let mut free = Stats::new();
        for i in 0..reps + warmup {
            let mut r = Stats::new();
            let mut f = Stats::new();
            let base = r.time(|| d.reserve(size, chunk))?;
            f.time(|| d.free_reservation(base, size))?;
            if i >= warmup {
                reserve.ns.extend(r.ns);
                free.ns.extend(f.ns);
            }
        }
        let label = size_label(size);
        rows.push(CallRow { call: format!("cuMemAddressReserve ({label})"), stats: reserve });
        rows.push(CallRow { call: format!("cuMemAddressFree ({label})"), stats: free });
    }
    let mut sync = Stats::new();
    for i in 0..n + warmup {
        let mut s = Stats::new();
        s.time(|| d.synchronize())?;
        if i >= warmup {
            sync.ns.extend(s.ns);
        }
    }
    rows.push(CallRow { call: "cuCtxSynchronize (idle device)".into(), stats: sync });
    Ok(rows)
}

/// Unmaps `n` separately mapped chunks from `base` as the arena does: one
/// `cuMemUnmap` when the driver accepts a span of mappings (the arena's
/// probe said so), else one per chunk.
fn unmap_chunks(d: &CudaDriver, base: u64, n: u64, chunk: u64, spans: bool) -> Res<()> {
    if spans {
        return d.unmap(base, n * chunk);
    }
    for i in 0..n {
        d.unmap(base + i * chunk, chunk)?;
    }
    Ok(())
}

/// Whether the arena unmaps a span of separate mappings with one call on
/// this device: the answer of its probe at creation.
fn unmap_spans(device: i32, chunk: u64) -> Res<bool> {
    let cfg = ArenaConfig { capacity_bytes: 4 * chunk, reserve_bytes: 8 * chunk, ..Default::default() };
    Ok(Arena::with_driver(CudaDriver::new(device)?, cfg)?.unmaps_span_mappings())
}

/// `cuMemSetAccess` and `cuMemUnmap` over spans of freshly mapped chunks
/// (the unmap as the arena makes it: one call, or one per chunk).
fn measure_spans(d: &CudaDriver, chunk: u64, spans: &[(u64, usize)], unmap_spans: bool) -> Res<Vec<SpanRow>> {
    let max = spans.iter().map(|s| s.0).max().unwrap_or(1);
    let handles: Vec<ChunkHandle> = (0..max).map(|_| d.create(chunk)).collect::<Res<_>>()?;
    let base = d.reserve(chunk * max, chunk)?;
    let mut rows = Vec::new();
    for &(n, reps) in spans {
        let mut row = SpanRow { chunks: n, set_access: Stats::new(), unmap: Stats::new() };
        for rep in 0..reps + 1 {
            for (i, &h) in handles[..n as usize].iter().enumerate() {
                d.map(base + i as u64 * chunk, chunk, h, 0)?;
            }
            let mut a = Stats::new();
            let mut u = Stats::new();
            a.time(|| d.set_access(base, n * chunk))?;
            u.time(|| unmap_chunks(d, base, n, chunk, unmap_spans))?;
            if rep > 0 {
                row.set_access.ns.extend(a.ns);
                row.unmap.ns.extend(u.ns);
            }
        }
        rows.push(row);
    }
    d.free_reservation(base, chunk * max)?;
    for h in handles {
        d.release(h)?;
    }
    Ok(rows)
}

/// Move by remap vs copy by `cuMemcpyDtoD`, sizes doubling from one chunk.
fn measure_moves(d: &CudaDriver, chunk: u64, sizes: &[u64], quick: bool, spans: bool) -> Res<Vec<MoveRow>> {
    let max_bytes = sizes.iter().copied().max().unwrap_or(chunk);
    let max_n = max_bytes / chunk;
    let src: Vec<ChunkHandle> = (0..max_n).map(|_| d.create(chunk)).collect::<Res<_>>()?;
    let dst: Vec<ChunkHandle> = (0..max_n).map(|_| d.create(chunk)).collect::<Res<_>>()?;
    let a = d.reserve(max_bytes, chunk)?;
    let b = d.reserve(max_bytes, chunk)?;
    let c = d.reserve(max_bytes, chunk)?;
    for (i, (&s, &t)) in src.iter().zip(&dst).enumerate() {
        d.map(a + i as u64 * chunk, chunk, s, 0)?;
        d.map(c + i as u64 * chunk, chunk, t, 0)?;
    }
    d.set_access(a, max_bytes)?;
    d.set_access(c, max_bytes)?;
    // Chunk i of the source starts with the word i: checked after each remap.
    for i in 0..max_n {
        d.fill_u32(a + i * chunk, i as u32, 1024)?;
    }

    let mut rows = Vec::new();
    for &bytes in sizes {
        let n = bytes / chunk;
        let reps = if quick {
            3
        } else if n <= 64 {
            20
        } else if n <= 1024 {
            5
        } else {
            3
        };
        let mut row = MoveRow { bytes, remap: Stats::new(), unmap_old: Stats::new(), copy: Stats::new() };
        for rep in 0..reps + 1 {
            let mut r = Stats::new();
            let mut u = Stats::new();
            let mut k = Stats::new();
            r.time(|| -> Res<()> {
                for (i, &h) in src[..n as usize].iter().enumerate() {
                    d.map(b + i as u64 * chunk, chunk, h, 0)?;
                }
                d.set_access(b, bytes)
            })?;
            if rep == 0 {
                for i in [0, n / 2, n - 1] {
                    let mut w = [0u8; 4];
                    d.read(b + i * chunk, &mut w)?;
                    assert_eq!(u32::from_ne_bytes(w), i as u32, "remapped chunk {i} shows wrong bytes");
                }
            }
            // What a move defers: the old range's unmap (same span size).
            d.synchronize()?;
            u.time(|| unmap_chunks(d, b, n, chunk, spans))?;
            k.time(|| d.copy(c, a, bytes))?;
            if rep > 0 {
                row.remap.ns.extend(r.ns);
                row.unmap_old.ns.extend(u.ns);
                row.copy.ns.extend(k.ns);
            }
        }
        rows.push(row);
    }
    d.synchronize()?;
    unmap_chunks(d, a, max_n, chunk, spans)?;
    unmap_chunks(d, c, max_n, chunk, spans)?;
    for base in [a, b, c] {
        d.free_reservation(base, max_bytes)?;
    }
    for h in src.into_iter().chain(dst) {
        d.release(h)?;
    }
    Ok(rows)
}

/// Alloc/free pairs through an arena whose pool already holds the chunks.
fn measure_pool(device: i32, chunk: u64, n: usize) -> Res<Vec<PoolRow>> {
    let cfg = ArenaConfig { capacity_bytes: 64 * chunk, reserve_bytes: 256 * chunk, ..Default::default() };
    let arena = Arena::with_driver(CudaDriver::new(device)?, cfg)?;
    let calls = |s: &vmm_arena::Stats| {
        s.driver_creates + s.driver_releases + s.driver_maps + s.driver_unmaps + s.driver_access_calls + s.driver_syncs
    };
    let mut rows = Vec::new();
    for chunks in [1u64, 8] {
        let bytes = chunks * chunk;
        for _ in 0..16 {
            let (id, _) = arena.alloc(bytes)?;
            arena.free(id)?;
        }
        let before = calls(&arena.stats()?);
        let mut pair = Stats::new();
        for _ in 0..n {
            pair.time(|| -> Res<()> {
                let (id, _) = arena.alloc(bytes)?;
                arena.free(id)
            })?;
        }
        let driver_calls = calls(&arena.stats()?) - before;
        rows.push(PoolRow { bytes, pair, driver_calls });
    }
    Ok(rows)
}

fn run(d: &CudaDriver, device: i32, quick: bool, out: &mut Report) -> Res<()> {
    let g = d.granularity()?;
    let total = d.total_memory()?;
    let mut chunk = g.recommended;
    while chunk < 2 * MIB {
        chunk += g.recommended;
    }
    out.chunk = chunk;
    out.granularity = (g.minimum, g.recommended);
    out.total = total;
    out.unmap_spans = unmap_spans(device, chunk)?;

    let progress = Stages::new(4);
    let n = if quick { 50 } else { 500 };
    let t = Instant::now();
    out.calls = measure_calls(d, chunk, n)?;
    progress.done(format!("per-call latencies done in {:.1?}", t.elapsed()));

    let budget = total / 4; // the move test holds 2x the largest size.
    let spans: Vec<(u64, usize)> = [(1u64, 200usize), (8, 100), (64, 30), (512, 10)]
        .into_iter()
        .filter(|&(s, _)| s * chunk <= budget)
        .map(|(s, r)| (s, if quick { 3 } else { r }))
        .collect();
    let t = Instant::now();
    out.spans = measure_spans(d, chunk, &spans, out.unmap_spans)?;
    progress.done(format!("span latencies done in {:.1?}", t.elapsed()));

    let max_move = if quick { 512 * MIB } else { 4 * GIB }.min(budget);
    let mut sizes = Vec::new();
    let mut s = chunk;
    while s <= max_move {
        sizes.push(s);
        s *= 4;
    }
    if sizes.last().is_some_and(|&l| l < max_move && max_move % chunk == 0) {
        sizes.push(max_move);
    }
    let t = Instant::now();
    out.moves = measure_moves(d, chunk, &sizes, quick, out.unmap_spans)?;
    progress.done(format!("remap vs copy done in {:.1?}", t.elapsed()));

    let t = Instant::now();
    out.pool = measure_pool(device, chunk, if quick { 1000 } else { 10_000 })?;
    progress.done(format!("pooled alloc/free done in {:.1?}", t.elapsed()));
    Ok(())
}

/// The measurement stages: a progress bar on a terminal; otherwise one line
/// per stage on standard error, which `scripts/gpu-check.sh` keeps as its log.
struct Stages(Option<indicatif::ProgressBar>);

impl Stages {
    fn new(stages: u64) -> Stages {
        Stages(std::io::stderr().is_terminal().then(|| {
            indicatif::ProgressBar::new(stages).with_style(
                indicatif::ProgressStyle::with_template("gpu_measure {bar:20} {pos}/{len} stages, {elapsed}")
                    .expect("a valid template"),
            )
        }))
    }

    fn done(&self, what: String) {
        match &self.0 {
            Some(bar) => {
                bar.println(format!("gpu_measure: {what}"));
                bar.inc(1);
            }
            None => eprintln!("gpu_measure: {what}"),
        }
    }
}

impl Drop for Stages {
    // Also on an early error return, so the error is not printed after a stale bar.
    fn drop(&mut self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

#[derive(Default)]
struct Report {
    device: String,
    driver_version: i32,
    chunk: u64,
    granularity: (u64, u64),
    total: u64,
    quick: bool,
    /// The arena's probe: one `cuMemUnmap` may cover several separate mappings.
    unmap_spans: bool,
    calls: Vec<CallRow>,
    spans: Vec<SpanRow>,
    moves: Vec<MoveRow>,
    pool: Vec<PoolRow>,
    seconds: f64,
}

impl Report {
    fn markdown(&self) -> String {
        let mut m = String::new();
        let _ = writeln!(m, "# CUDA VMM measurements\n");
        let _ = writeln!(
            m,
            "Device: {} (driver {}.{}), total memory {} MiB, granularity minimum {} KiB / \
             recommended {} KiB, chunk {}{}. Run took {:.1} s.\n",
            self.device,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            self.total / MIB,
            self.granularity.0 / 1024,
            self.granularity.1 / 1024,
            size_label(self.chunk),
            if self.quick { " (quick run)" } else { "" },
            self.seconds
        );
        let _ = writeln!(
            m,
            "Unmap of several separately mapped chunks with one `cuMemUnmap` (the arena's probe): {}.\n",
            if self.unmap_spans {
                "accepted, the arena unmaps a run with one call"
            } else {
                "refused, the arena unmaps one mapping per call (and so do the unmaps measured here)"
            }
        );
        let _ = writeln!(m, "## Driver calls, one chunk each\n");
        let _ = writeln!(m, "| call | n | median µs | p99 µs | mean µs |");
        let _ = writeln!(m, "|---|---:|---:|---:|---:|");
        for r in &self.calls {
            let s = &r.stats;
            let _ = writeln!(
                m,
                "| `{}` | {} | {:.2} | {:.2} | {:.2} |",
                r.call,
                s.ns.len(),
                s.median_us(),
                s.p99_us(),
                s.mean_us()
            );
        }
        let _ = writeln!(m, "\n## cuMemSetAccess and cuMemUnmap over spans of freshly mapped chunks\n");
        let _ = writeln!(m, "| span | n | set_access median µs | p99 µs | per chunk µs | unmap median µs | p99 µs |");
        let _ = writeln!(m, "|---|---:|---:|---:|---:|---:|---:|");
        for r in &self.spans {
            let _ = writeln!(
                m,
                "| {} chunk{} ({}) | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                r.chunks,
                if r.chunks == 1 { "" } else { "s" },
                size_label(r.chunks * self.chunk),
                r.set_access.ns.len(),
                r.set_access.median_us(),
                r.set_access.p99_us(),
                r.set_access.median_us() / r.chunks as f64,
                r.unmap.median_us(),
                r.unmap.p99_us()
            );
        }
        let _ = writeln!(m, "\n## Move by remap vs copy (cuMemcpyDtoD)\n");
        let _ = writeln!(
            m,
            "Remap = map the chunks at a second range + one `cuMemSetAccess` (the move's \
             critical path). Deferred unmap = `cuMemUnmap` of a span that size (done later, \
             at `release_retired`). Copy = `cuMemcpyDtoD` until complete.\n"
        );
        let _ = writeln!(
            m,
            "| size | n | remap median µs | remap p99 µs | deferred unmap µs | copy median µs | copy GB/s | copy / remap |"
        );
        let _ = writeln!(m, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.moves {
            let copy = r.copy.median_us();
            let _ = writeln!(
                m,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} |",
                size_label(r.bytes),
                r.remap.ns.len(),
                r.remap.median_us(),
                r.remap.p99_us(),
                r.unmap_old.median_us(),
                copy,
                r.bytes as f64 / (copy * 1e3),
                copy / r.remap.median_us()
            );
        }
        let _ = writeln!(m, "\n## Arena alloc/free pairs on the pooled path\n");
        let _ = writeln!(m, "| size | n | pair median µs | p99 µs | driver calls |");
        let _ = writeln!(m, "|---|---:|---:|---:|---:|");
        for r in &self.pool {
            let _ = writeln!(
                m,
                "| {} | {} | {:.3} | {:.3} | {} |",
                size_label(r.bytes),
                r.pair.ns.len(),
                r.pair.median_us(),
                r.pair.p99_us(),
                r.driver_calls
            );
        }
        m
    }

    fn json(&self) -> String {
        let doc = ReportJson {
            status: "ok",
            device: &self.device,
            driver_version: self.driver_version,
            total_memory_bytes: self.total,
            granularity: GranularityJson { minimum: self.granularity.0, recommended: self.granularity.1 },
            chunk_bytes: self.chunk,
            quick: self.quick,
            unmap_spans_mappings: self.unmap_spans,
            seconds: self.seconds,
            calls: self.calls.iter().map(|r| CallJson { call: &r.call, latency: r.stats.json() }).collect(),
            set_access_spans: self
                .spans
                .iter()
                .map(|r| SpanJson {
                    chunks: r.chunks,
                    bytes: r.chunks * self.chunk,
                    set_access: r.set_access.json(),
                    unmap: r.unmap.json(),
                })
                .collect(),
            moves: self
                .moves
                .iter()
                .map(|r| MoveJson {
                    bytes: r.bytes,
                    remap: r.remap.json(),
                    deferred_unmap: r.unmap_old.json(),
                    copy: r.copy.json(),
                    copy_over_remap: r.copy.median_us() / r.remap.median_us(),
                })
                .collect(),
            pooled_alloc_free: self
                .pool
                .iter()
                .map(|r| PoolJson { bytes: r.bytes, alloc_free_pair: r.pair.json(), driver_calls: r.driver_calls })
                .collect(),
        };
        // Pretty: `scripts/gpu-check.sh` greps for `"status": "unsupported"` with its space.
        serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
    }

    /// The measured driver prices as overrides of the replay's profile
    /// (`kv_serving --profile-file`): per call (median) where the arena
    /// calls once a chunk (create, map, release), per range (reserve, an
    /// 8 GiB one), per call (synchronize), and for access and unmap the
    /// two parts fitted over the spans. The replay prices per 2 MiB: a
    /// larger chunk's per-chunk parts are scaled down to 2 MiB.
    fn kv_profile(&self) -> Result<String, String> {
        let median_s = |name: &str| -> Result<f64, String> {
            let r = self.calls.iter().find(|r| r.call == name).ok_or(format!("{name} was not measured"))?;
            let m = r.stats.median_us();
            if m.is_finite() {
                Ok(m * 1e-6)
            } else {
                Err(format!("{name} has no samples"))
            }
        };
        let fit = |what: &str, pick: fn(&SpanRow) -> &Stats| -> Result<SpanCost, String> {
            let pts: Vec<(u64, f64)> = self.spans.iter().map(|r| (r.chunks, pick(r).median_us() * 1e-6)).collect();
            fit_span_cost(&pts).ok_or(format!("{what} over spans: no usable samples"))
        };
        let per_2mib = (2 * MIB) as f64 / self.chunk as f64;
        let access = fit("cuMemSetAccess", |r| &r.set_access)?;
        let unmap = fit("cuMemUnmap", |r| &r.unmap)?;
        let p = DriverPrices {
            name: format!("measured: {} (driver {})", self.device, self.driver_version),
            create_s: median_s("cuMemCreate")? * per_2mib,
            map_s: median_s("cuMemMap")? * per_2mib,
            set_access_s: access.chunk_s * per_2mib,
            set_access_call_s: access.call_s,
            unmap_s: unmap.chunk_s * per_2mib,
            unmap_call_s: unmap.call_s,
            release_s: median_s("cuMemRelease")? * per_2mib,
            reserve_s: median_s("cuMemAddressReserve (8 GiB)")?,
            synchronize_s: median_s("cuCtxSynchronize (idle device)")?,
        };
        Ok(p.json())
    }
}

// The JSON layout of the report (field names are what scripts read).

#[derive(Serialize)]
struct ReportJson<'a> {
    status: &'static str,
    device: &'a str,
    driver_version: i32,
    total_memory_bytes: u64,
    granularity: GranularityJson,
    chunk_bytes: u64,
    quick: bool,
    /// The arena's probe at creation: whether one `cuMemUnmap` may cover
    /// several separately mapped chunks (else the arena unmaps one per call).
    unmap_spans_mappings: bool,
    seconds: f64,
    calls: Vec<CallJson<'a>>,
    set_access_spans: Vec<SpanJson>,
    moves: Vec<MoveJson>,
    pooled_alloc_free: Vec<PoolJson>,
}

#[derive(Serialize)]
struct GranularityJson {
    minimum: u64,
    recommended: u64,
}

#[derive(Serialize)]
struct CallJson<'a> {
    call: &'a str,
    latency: LatencyJson,
}

#[derive(Serialize)]
struct SpanJson {
    chunks: u64,
    bytes: u64,
    set_access: LatencyJson,
    unmap: LatencyJson,
}

#[derive(Serialize)]
struct MoveJson {
    bytes: u64,
    remap: LatencyJson,
    deferred_unmap: LatencyJson,
    copy: LatencyJson,
    copy_over_remap: f64,
}

#[derive(Serialize)]
struct PoolJson {
    bytes: u64,
    alloc_free_pair: LatencyJson,
    driver_calls: u64,
}

#[derive(Serialize)]
struct UnsupportedJson {
    status: &'static str,
    reason: String,
}

fn write_out(dir: &Option<PathBuf>, json: &str, md: &str) {
    let Some(dir) = dir else { return };
    let result = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(dir.join("gpu-measure.json"), json))
        .and_then(|_| std::fs::write(dir.join("gpu-measure.md"), md));
    if let Err(e) = result {
        eprintln!("gpu_measure: cannot write to {}: {e}", dir.display());
        std::process::exit(1);
    }
}

fn main() {
    let args = Args::parse();
    let driver = match CudaDriver::new(args.device) {
        Ok(d) => d,
        Err(e) => {
            println!("gpu_measure: CUDA is unsupported here, nothing measured: {e}");
            let doc = UnsupportedJson { status: "unsupported", reason: e.to_string() };
            let json = serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n";
            let md = format!("# CUDA VMM measurements\n\nNot run: CUDA is unsupported here: {e}\n");
            write_out(&args.out, &json, &md);
            return;
        }
    };
    let mut report = Report {
        device: driver.device_name().to_string(),
        driver_version: driver.driver_version(),
        quick: args.quick,
        ..Report::default()
    };
    let start = Instant::now();
    if let Err(e) = run(&driver, args.device, args.quick, &mut report) {
        eprintln!("gpu_measure: a driver call failed: {e}");
        std::process::exit(1);
    }
    report.seconds = start.elapsed().as_secs_f64();
    let md = report.markdown();
    print!("{md}");
    write_out(&args.out, &report.json(), &md);
    if let Some(dir) = &args.out {
        match report.kv_profile() {
            Ok(p) => {
                if let Err(e) = std::fs::write(dir.join("kv-profile.json"), p) {
                    eprintln!("gpu_measure: cannot write kv-profile.json: {e}");
                    std::process::exit(1);
                }
            }
            // Measured but not fittable: the report stands; say why.
            Err(e) => eprintln!("gpu_measure: no kv-profile.json: {e}"),
        }
    }
}
