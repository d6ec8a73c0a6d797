//! Allocations the arena refuses reach ONNX Runtime as an error it reports
//! (CreateSession or Run returns a status), never as a crash, and leave the
//! arena intact: nothing leaked, later runs correct, everything given back.

mod common;

use common::{arena_stats, first_difference, model_file, ort, serial, MIB};
use vmm_arena_onnxruntime::model::{self, ModelSpec};
use vmm_arena_onnxruntime::{ArenaAllocator, ArenaConfig, Session, SessionConfig};

const CHUNK: u64 = 2 * MIB;

fn arena_with_capacity(capacity_bytes: u64) -> ArenaAllocator {
    let config = ArenaConfig { capacity_bytes, chunk_bytes: CHUNK, ..ArenaConfig::default() };
    ArenaAllocator::new(ort(), config).expect("arena allocator")
}

/// Checks that nothing is live or mapped once sessions are gone, and that
/// trim gives every chunk back.
fn assert_all_given_back(allocator: &ArenaAllocator) {
    let c = allocator.counters();
    assert_eq!((c.live_blocks, c.live_bytes), (0, 0), "{c:?}");
    assert_eq!(c.frees, c.allocs + c.reserves, "{c:?}");
    assert_eq!(c.unknown_frees + c.arena_free_errors, 0, "{c:?}");
    let arena = arena_stats(allocator);
    assert_eq!((arena.live_allocations, arena.live_bytes, arena.mapped_bytes), (0, 0, 0), "{arena:?}");
    allocator.trim().expect("trim");
    let trimmed = arena_stats(allocator);
    assert_eq!((trimmed.mapped_bytes, trimmed.pooled_bytes), (0, 0), "{trimmed:?}");
    assert_eq!(trimmed.driver_creates, trimmed.driver_releases, "{trimmed:?}");
}

#[test]
fn a_capacity_below_the_weights_fails_session_creation_with_an_error() {
    let _serial = serial();
    let ort = ort();
    let path = model_file(ModelSpec::default());
    // Eight chunks: below the decoder's 24 MiB of weights, above what a
    // small model needs (small tensors share chunks by size class).
    let allocator = arena_with_capacity(8 * CHUNK);
    let registration = allocator.register().expect("RegisterAllocator");
    let config = SessionConfig { allocator: Some(&registration), ..Default::default() };
    let error = match Session::new(ort, &path, config) {
        Ok(_) => panic!("a session whose weights exceed the arena's capacity was created"),
        Err(error) => error,
    };
    assert!(error.message.contains("vmm-arena refused"), "ONNX Runtime's error does not carry the arena's: {error}");
    println!("CreateSession reported: {error}");
    let c = allocator.counters();
    assert!(c.refused >= 1, "{c:?}");
    assert_all_given_back(&allocator);

    // The arena is intact: with the registration still in place, a session
    // of a model that fits runs on it.
    let small = ModelSpec { layers: 1, d_model: 64, heads: 4, ffn: 128 };
    let small_path = model_file(small);
    let session = Session::new(ort, &small_path, config).expect("a model that fits");
    let default_session = Session::new(ort, &small_path, SessionConfig::default()).expect("default session");
    let x = model::input(16, small.d_model, 3);
    let on_arena = session.run(&x, 16, small.d_model).expect("run on the arena");
    let on_default = default_session.run(&x, 16, small.d_model).expect("run on the default allocator");
    assert_eq!(first_difference(&on_arena, &on_default), None);
    drop(session);
    assert_all_given_back(&allocator);
}

/// Peak physical bytes of a session of `spec` that runs `seq`, measured on
/// an arena without a capacity.
fn peak_bytes(spec: ModelSpec, seq: usize) -> u64 {
    let ort = ort();
    let path = model_file(spec);
    let allocator = arena_with_capacity(0);
    let registration = allocator.register().expect("RegisterAllocator");
    {
        let session = Session::new(ort, &path, SessionConfig { allocator: Some(&registration), ..Default::default() })
            .expect("arena session");
        session.run(&model::input(seq, spec.d_model, 1), seq, spec.d_model).expect("run");
    }
    arena_stats(&allocator).peak_physical_bytes
}

#[test]
fn capacity_exhausted_mid_run_fails_that_run_and_the_session_goes_on() {
    let _serial = serial();
    let ort = ort();
    let spec = ModelSpec::default();
    let (short, long) = (8usize, 512usize);
    // A capacity between what the short run and the long one need, so the
    // arena runs out part-way through the long run's kernels.
    let short_peak = peak_bytes(spec, short);
    let long_peak = peak_bytes(spec, long);
    assert!(long_peak > short_peak + 4 * CHUNK, "short {short_peak}, long {long_peak}");
    let capacity = (short_peak + long_peak) / 2 / CHUNK * CHUNK;
    println!("peak bytes: seq {short} {short_peak}, seq {long} {long_peak}; capacity {capacity}");

    let path = model_file(spec);
    let allocator = arena_with_capacity(capacity);
    let registration = allocator.register().expect("RegisterAllocator");
    let default_session = Session::new(ort, &path, SessionConfig::default()).expect("default session");
    {
        let session = Session::new(ort, &path, SessionConfig { allocator: Some(&registration), ..Default::default() })
            .expect("arena session");
        let weights = allocator.counters();
        for round in 0..3 {
            let x_long = model::input(long, spec.d_model, 7);
            let error = match session.run(&x_long, long, spec.d_model) {
                Ok(_) => panic!("round {round}: seq {long} ran within {capacity} bytes (needs {long_peak})"),
                Err(error) => error,
            };
            assert!(error.message.contains("vmm-arena refused"), "round {round}: {error}");
            println!("round {round}: Run reported: {error}");
            let after = allocator.counters();
            assert!(after.refused > weights.refused + round, "round {round}: {after:?}");
            assert!(after.allocs > weights.allocs, "round {round}: the run failed before allocating: {after:?}");
            // What the failed run took before the refusal was given back.
            assert_eq!((after.live_blocks, after.live_bytes), (weights.live_blocks, weights.live_bytes), "{after:?}");
            let arena = arena_stats(&allocator);
            assert_eq!(arena.live_allocations, weights.live_blocks, "{arena:?}");
            assert!(arena.mapped_bytes + arena.pooled_bytes <= capacity, "{arena:?}");

            // The same session still runs what fits, with the same bits.
            let x = model::input(short, spec.d_model, 9 + round);
            let on_arena = session.run(&x, short, spec.d_model).expect("a short run after the failed one");
            let on_default = default_session.run(&x, short, spec.d_model).expect("default run");
            assert_eq!(first_difference(&on_arena, &on_default), None, "round {round}");
        }
    }
    assert_all_given_back(&allocator);
}
