//! Memory given back: after an arena session's runs, `trim` leaves mapped
//! only what is live (the weights ONNX Runtime copied into it: MatMul's
//! prepacked ones), and once the session is gone mapped
//! bytes are 0 and the process's resident set is back near its start;
//! ONNX Runtime's default CPU allocator (its BFC arena) keeps the peak of
//! its runs for as long as the session lives.
//!
//! One test in its own binary, so that the resident set is this test's.

mod common;

use common::{arena_stats, model_file, ort, serial, stat, MIB};
use vmm_arena_onnxruntime::model::{self, ModelSpec};
use vmm_arena_onnxruntime::{
    release_free_heap, rss_bytes, session_allocator_stats, shmem_rss_bytes, ArenaAllocator, ArenaConfig, Session,
    SessionConfig,
};

/// Larger than the default model, so that its memory stands far above the
/// resident set's noise: 2 layers of d_model 1024 and ffn 4096 (96 MiB of
/// MatMul weights, prepacked into the allocator), 16 heads (16 MiB of attention scores at seq 512).
const SPEC: ModelSpec = ModelSpec { layers: 2, d_model: 1024, heads: 16, ffn: 4096 };
const LENGTHS: [usize; 5] = [512, 1, 256, 64, 512];

/// How far above its start the resident set may stay once the arena has
/// given everything back and the C library its free heap. Generous on
/// purpose: ONNX Runtime's own bookkeeping goes through malloc, and after
/// the session it still holds 0, 16 or 48 MiB of it (measured over many
/// runs; anonymous memory, not the arena's, whose share is checked exactly
/// below), while the arena phase raises the resident set by about 280 MiB.
const RSS_MARGIN: u64 = 64 * MIB;
/// The arena's chunks are shared memory (memfd): once unmapped and
/// released, the shared part of the resident set is back where it was,
/// to within this.
const SHMEM_MARGIN: u64 = 2 * MIB;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// Runs LENGTHS; the highest resident set and shared resident set seen
/// after a run.
fn run_lengths(session: &Session<'_>) -> (u64, u64) {
    let (mut peak_rss, mut peak_shmem) = (0, 0);
    for seq in LENGTHS {
        let x = model::input(seq, SPEC.d_model, seq as u64);
        let y = session.run(&x, seq, SPEC.d_model).unwrap_or_else(|e| panic!("seq {seq}: {e}"));
        assert_eq!(y.len(), x.len());
        peak_rss = peak_rss.max(rss_bytes());
        peak_shmem = peak_shmem.max(shmem_rss_bytes());
    }
    (peak_rss, peak_shmem)
}

#[test]
fn the_arena_gives_memory_back_where_the_default_allocator_keeps_it() {
    let _serial = serial();
    let ort = ort();
    let path = model_file(SPEC);
    let allocator = ArenaAllocator::new(ort, ArenaConfig::default()).expect("arena allocator");
    let registration = allocator.register().expect("RegisterAllocator");
    let arena_config = SessionConfig { allocator: Some(&registration), ..Default::default() };

    // The same session and runs once first, so that what ONNX Runtime
    // sets up once and keeps (kernel registries, thread pools, per-thread
    // GEMM buffers) is not counted against the arena.
    {
        let warm = Session::new(ort, &path, arena_config).expect("warm-up session");
        run_lengths(&warm);
    }
    allocator.trim().expect("trim");
    release_free_heap();
    let rss_start = rss_bytes();
    let shmem_start = shmem_rss_bytes();
    assert!(rss_start > 0, "no VmRSS in /proc/self/status");

    let arena_session = Session::new(ort, &path, arena_config).expect("arena session");
    let weights = allocator.counters().live_bytes;
    assert!(weights > 90 * MIB, "weights {weights}");
    let (arena_peak_rss, arena_peak_shmem) = run_lengths(&arena_session);
    let before_trim = arena_stats(&allocator);
    assert!(before_trim.pooled_bytes > 0, "the runs left nothing pooled: {before_trim:?}");
    allocator.trim().expect("trim");
    // With the session alive, only its live tensors (the prepacked weights)
    // stay mapped.
    let trimmed_alive = arena_stats(&allocator);
    assert_eq!(trimmed_alive.pooled_bytes, 0, "{trimmed_alive:?}");
    assert_eq!(trimmed_alive.live_bytes, before_trim.live_bytes, "{trimmed_alive:?}");
    assert!(trimmed_alive.mapped_bytes < weights + 8 * MIB, "{trimmed_alive:?} for {weights} bytes of weights");
    let arena_alive_rss = rss_bytes();
    drop(arena_session);
    let after_session = arena_stats(&allocator);
    assert_eq!((after_session.live_allocations, after_session.mapped_bytes), (0, 0), "{after_session:?}");
    allocator.trim().expect("trim");
    let end = arena_stats(&allocator);
    assert_eq!((end.mapped_bytes, end.pooled_bytes), (0, 0), "{end:?}");
    let shmem_end = shmem_rss_bytes();
    let arena_end_rss_before_heap_release = rss_bytes();
    release_free_heap();
    let arena_end_rss = rss_bytes();

    // ONNX Runtime's default allocator, the same runs.
    let default_session = Session::new(ort, &path, SessionConfig::default()).expect("default session");
    let (default_peak_rss, _) = run_lengths(&default_session);
    let default_stats = session_allocator_stats(&default_session).expect("default allocator stats");
    let default_alive_rss = rss_bytes();
    drop(default_session);
    let default_end_rss = rss_bytes();

    println!("resident set (MiB): start {:.1} (shared {:.1})", mib(rss_start), mib(shmem_start));
    println!(
        "  arena:   peak {:.1} (shared {:.1}), after trim with the session alive {:.1}, \
         after the session and trim {:.1} (shared {:.1}), and malloc_trim {:.1}",
        mib(arena_peak_rss),
        mib(arena_peak_shmem),
        mib(arena_alive_rss),
        mib(arena_end_rss_before_heap_release),
        mib(shmem_end),
        mib(arena_end_rss)
    );
    println!(
        "  default: peak {:.1}, after the runs with the session alive {:.1}, after the session {:.1}",
        mib(default_peak_rss),
        mib(default_alive_rss),
        mib(default_end_rss)
    );
    println!(
        "arena mapped (MiB): peak {:.1}, alive after trim {:.1}, end {:.1}; default allocator: {default_stats:?}",
        mib(before_trim.peak_physical_bytes),
        mib(trimmed_alive.mapped_bytes),
        mib(end.mapped_bytes)
    );

    // The arena phase was visible in the resident set, and went away.
    assert!(arena_peak_rss >= rss_start + weights, "peak {arena_peak_rss}, start {rss_start}, weights {weights}");
    assert!(arena_peak_shmem >= shmem_start + weights, "shared peak {arena_peak_shmem}, start {shmem_start}");
    assert!(
        shmem_end <= shmem_start + SHMEM_MARGIN,
        "shared resident set {:.1} MiB after the arena gave everything back, {:.1} MiB at the start",
        mib(shmem_end),
        mib(shmem_start)
    );
    assert!(
        arena_end_rss <= rss_start + RSS_MARGIN,
        "resident set {:.1} MiB after the arena gave everything back (and malloc_trim), {:.1} MiB at the start",
        mib(arena_end_rss),
        mib(rss_start)
    );
    // The default allocator keeps more than is live while its session
    // lives: at least the largest intermediate tensor of the runs beyond
    // the weights (its BFC arena does not shrink unless configured to).
    let total = stat(&default_stats, "TotalAllocated");
    let in_use = stat(&default_stats, "InUse");
    let largest = stat(&default_stats, "MaxAllocSize");
    assert_eq!(in_use as u64, weights, "{default_stats:?}");
    assert!(total - in_use >= largest, "{default_stats:?}");
}
