//! The measurements: each driver call on its own, over spans, moves by
//! remap against copies, and the arena's pooled path.

use std::io::IsTerminal;
use std::time::Instant;

use vmm_arena::driver::cuda::CudaDriver;
use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::{Arena, ArenaConfig};

use crate::report::Report;
use crate::stats::{size_label, Stats};
use crate::{GIB, MIB};

pub(crate) type Res<T> = Result<T, vmm_arena::error::Error>;

pub(crate) struct CallRow {
    pub(crate) call: String,
    pub(crate) stats: Stats,
}

pub(crate) struct SpanRow {
    pub(crate) chunks: u64,
    pub(crate) set_access: Stats,
    pub(crate) unmap: Stats,
}

pub(crate) struct PoolRow {
    pub(crate) bytes: u64,
    pub(crate) pair: Stats,
    pub(crate) driver_calls: u64,
}

pub(crate) struct MoveRow {
    pub(crate) bytes: u64,
    pub(crate) remap: Stats,
    pub(crate) unmap_old: Stats,
    pub(crate) copy: Stats,
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

pub(crate) fn run(d: &CudaDriver, device: i32, quick: bool, out: &mut Report) -> Res<()> {
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
