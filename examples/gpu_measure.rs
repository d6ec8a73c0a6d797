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
//! and `gpu-measure.md` there. Where CUDA cannot run it says so and exits 0
//! (writing a JSON with `"status": "unsupported"` when `--out` is given).
//! `--quick` cuts repetitions and sizes, for a smoke run.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use vmm_arena::driver::cuda::CudaDriver;
use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::{Arena, ArenaConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

struct Args {
    out: Option<PathBuf>,
    device: i32,
    quick: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { out: None, device: 0, quick: false };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => args.out = Some(it.next().ok_or("--out needs a directory")?.into()),
            "--device" => {
                let v = it.next().ok_or("--device needs a number")?;
                args.device = v.parse().map_err(|_| format!("bad device {v}"))?;
            }
            "--quick" => args.quick = true,
            "-h" | "--help" => {
                println!("usage: gpu_measure [--out DIR] [--device N] [--quick]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
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

    fn json(&self) -> String {
        format!(
            "{{\"n\": {}, \"median_us\": {:.3}, \"p99_us\": {:.3}, \"mean_us\": {:.3}, \"min_us\": {:.3}, \"max_us\": {:.3}}}",
            self.ns.len(),
            self.median_us(),
            self.p99_us(),
            self.mean_us(),
            self.pct_us(0.0),
            self.pct_us(100.0)
        )
    }
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
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

/// `cuMemSetAccess` and `cuMemUnmap` over spans of freshly mapped chunks.
fn measure_spans(d: &CudaDriver, chunk: u64, spans: &[(u64, usize)]) -> Res<Vec<SpanRow>> {
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
            u.time(|| d.unmap(base, n * chunk))?;
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
fn measure_moves(d: &CudaDriver, chunk: u64, sizes: &[u64], quick: bool) -> Res<Vec<MoveRow>> {
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
            u.time(|| d.unmap(b, bytes))?;
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
    d.unmap(a, max_bytes)?;
    d.unmap(c, max_bytes)?;
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

    let n = if quick { 50 } else { 500 };
    let t = Instant::now();
    out.calls = measure_calls(d, chunk, n)?;
    eprintln!("gpu_measure: per-call latencies done in {:.1?}", t.elapsed());

    let budget = total / 4; // the move test holds 2x the largest size.
    let spans: Vec<(u64, usize)> = [(1u64, 200usize), (8, 100), (64, 30), (512, 10)]
        .into_iter()
        .filter(|&(s, _)| s * chunk <= budget)
        .map(|(s, r)| (s, if quick { 3 } else { r }))
        .collect();
    let t = Instant::now();
    out.spans = measure_spans(d, chunk, &spans)?;
    eprintln!("gpu_measure: span latencies done in {:.1?}", t.elapsed());

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
    out.moves = measure_moves(d, chunk, &sizes, quick)?;
    eprintln!("gpu_measure: remap vs copy done in {:.1?}", t.elapsed());

    let t = Instant::now();
    out.pool = measure_pool(device, chunk, if quick { 1000 } else { 10_000 })?;
    eprintln!("gpu_measure: pooled alloc/free done in {:.1?}", t.elapsed());
    Ok(())
}

#[derive(Default)]
struct Report {
    device: String,
    driver_version: i32,
    chunk: u64,
    granularity: (u64, u64),
    total: u64,
    quick: bool,
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
        let mut j = String::from("{\n  \"status\": \"ok\",\n");
        let _ = writeln!(j, "  \"device\": {},", json_str(&self.device));
        let _ = writeln!(j, "  \"driver_version\": {},", self.driver_version);
        let _ = writeln!(j, "  \"total_memory_bytes\": {},", self.total);
        let _ = writeln!(
            j,
            "  \"granularity\": {{\"minimum\": {}, \"recommended\": {}}},",
            self.granularity.0, self.granularity.1
        );
        let _ = writeln!(j, "  \"chunk_bytes\": {},", self.chunk);
        let _ = writeln!(j, "  \"quick\": {},", self.quick);
        let _ = writeln!(j, "  \"seconds\": {:.3},", self.seconds);
        let calls: Vec<String> = self
            .calls
            .iter()
            .map(|r| format!("    {{\"call\": {}, \"latency\": {}}}", json_str(&r.call), r.stats.json()))
            .collect();
        let _ = writeln!(j, "  \"calls\": [\n{}\n  ],", calls.join(",\n"));
        let spans: Vec<String> = self
            .spans
            .iter()
            .map(|r| {
                format!(
                    "    {{\"chunks\": {}, \"bytes\": {}, \"set_access\": {}, \"unmap\": {}}}",
                    r.chunks,
                    r.chunks * self.chunk,
                    r.set_access.json(),
                    r.unmap.json()
                )
            })
            .collect();
        let _ = writeln!(j, "  \"set_access_spans\": [\n{}\n  ],", spans.join(",\n"));
        let moves: Vec<String> = self
            .moves
            .iter()
            .map(|r| {
                format!(
                    "    {{\"bytes\": {}, \"remap\": {}, \"deferred_unmap\": {}, \"copy\": {}, \"copy_over_remap\": {:.4}}}",
                    r.bytes,
                    r.remap.json(),
                    r.unmap_old.json(),
                    r.copy.json(),
                    r.copy.median_us() / r.remap.median_us()
                )
            })
            .collect();
        let _ = writeln!(j, "  \"moves\": [\n{}\n  ],", moves.join(",\n"));
        let pool: Vec<String> = self
            .pool
            .iter()
            .map(|r| {
                format!(
                    "    {{\"bytes\": {}, \"alloc_free_pair\": {}, \"driver_calls\": {}}}",
                    r.bytes,
                    r.pair.json(),
                    r.driver_calls
                )
            })
            .collect();
        let _ = writeln!(j, "  \"pooled_alloc_free\": [\n{}\n  ]", pool.join(",\n"));
        j.push_str("}\n");
        j
    }
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
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_measure: {e}");
            std::process::exit(2);
        }
    };
    let driver = match CudaDriver::new(args.device) {
        Ok(d) => d,
        Err(e) => {
            println!("gpu_measure: CUDA is unsupported here, nothing measured: {e}");
            let json = format!("{{\"status\": \"unsupported\", \"reason\": {}}}\n", json_str(&e.to_string()));
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
}
