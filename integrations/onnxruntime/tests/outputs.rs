//! ONNX Runtime's kernels on the arena give the same bits as on ONNX
//! Runtime's default CPU allocator, for every sequence length 1..=512, and
//! the arena's own statistics show that it served every tensor of the run.

mod common;

use common::{arena_stats, first_difference, model_file, ort, serial, stat};
use vmm_arena_onnxruntime::model::{self, ModelSpec};
use vmm_arena_onnxruntime::{session_allocator_stats, ArenaAllocator, ArenaConfig, Session, SessionConfig};

const MAX_SEQ: usize = 512;

/// Every length 1..=MAX_SEQ once, in an order that jumps about (a stride
/// coprime with MAX_SEQ), so that each run's tensors differ in size from
/// the last one's in both directions.
fn sequence_lengths() -> Vec<usize> {
    let lengths: Vec<usize> = (0..MAX_SEQ).map(|i| (i * 211) % MAX_SEQ + 1).collect();
    let mut sorted = lengths.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (1..=MAX_SEQ).collect::<Vec<_>>(), "every length exactly once");
    lengths
}

#[test]
fn every_length_1_to_512_is_bit_identical_and_served_by_the_arena() {
    let _serial = serial();
    let ort = ort();
    let spec = ModelSpec::default();
    let path = model_file(spec);
    let allocator = ArenaAllocator::new(ort, ArenaConfig::default()).expect("arena allocator");
    let registration = allocator.register().expect("RegisterAllocator");
    let default_session = Session::new(ort, &path, SessionConfig::default()).expect("default session");
    assert_eq!(allocator.counters().allocs + allocator.counters().reserves, 0, "the default session used the arena");

    {
        let session = Session::new(ort, &path, SessionConfig { allocator: Some(&registration), ..Default::default() })
            .expect("arena session");
        // The weights ONNX Runtime copies at session creation (MatMul's
        // prepacked ones) are reserved from the arena.
        let after_create = allocator.counters();
        assert!(after_create.reserves > 0, "no weight came from the arena: {after_create:?}");
        assert_eq!(after_create.live_blocks, after_create.reserves + after_create.allocs);
        let weights = arena_stats(&allocator);
        assert_eq!(weights.live_allocations, after_create.live_blocks, "arena and allocator disagree: {weights:?}");
        assert!(weights.live_bytes >= after_create.live_bytes);
        assert!(weights.mapped_bytes >= after_create.live_bytes);

        // Runs seq on both sessions, checks, and returns the arena's Alloc calls.
        let check = |seq: usize| -> u64 {
            let x = model::input(seq, spec.d_model, seq as u64);
            let before = allocator.counters();
            let on_arena = session.run(&x, seq, spec.d_model).unwrap_or_else(|e| panic!("arena run, seq {seq}: {e}"));
            let after = allocator.counters();
            let on_default =
                default_session.run(&x, seq, spec.d_model).unwrap_or_else(|e| panic!("default run, seq {seq}: {e}"));
            assert_eq!(on_arena.len(), seq * spec.d_model);
            if let Some(i) = first_difference(&on_arena, &on_default) {
                panic!("seq {seq}: element {i} differs: arena {} vs default {}", on_arena[i], on_default[i]);
            }
            assert!(on_arena.iter().all(|v| v.is_finite()), "seq {seq}: a non-finite output");
            // This run's tensors came from the arena, and were all given back.
            assert!(after.allocs > before.allocs, "seq {seq}: the run allocated nothing from the arena");
            assert_eq!(after.live_blocks, after_create.live_blocks, "seq {seq}: the run left blocks live");
            assert_eq!(after.live_bytes, after_create.live_bytes, "seq {seq}: the run left bytes live");
            assert_eq!(after.refused + after.unknown_frees + after.arena_free_errors, 0, "seq {seq}: {after:?}");
            let arena = arena_stats(&allocator);
            assert_eq!(arena.live_allocations, after_create.live_blocks, "seq {seq}: {arena:?}");
            assert_eq!(arena.live_bytes, weights.live_bytes, "seq {seq}: {arena:?}");
            after.allocs - before.allocs
        };
        let lengths = sequence_lengths();
        assert_eq!(lengths.len(), MAX_SEQ);
        let first_allocs: u64 = lengths.iter().map(|&seq| check(seq)).sum();
        // Some lengths again: ONNX Runtime now serves a shape it has seen
        // from its memory pattern (one block for all intermediates), a
        // second way of allocating.
        let repeated: Vec<usize> = (1..=16).chain([100, 255, 256, 511, 512]).collect();
        let repeat_allocs: u64 = repeated.iter().map(|&seq| check(seq)).sum();
        println!(
            "Alloc calls per run: {:.1} on first sight of a length, {:.1} when repeated",
            first_allocs as f64 / lengths.len() as f64,
            repeat_allocs as f64 / repeated.len() as f64
        );

        // ONNX Runtime's view of the session's CPU allocator is this one.
        let counters = allocator.counters();
        let seen_by_ort = session_allocator_stats(&session).expect("session allocator stats");
        assert_eq!(stat(&seen_by_ort, "NumAllocs"), counters.allocs as i64, "{seen_by_ort:?}");
        assert_eq!(stat(&seen_by_ort, "NumReserves"), counters.reserves as i64, "{seen_by_ort:?}");
        assert_eq!(stat(&seen_by_ort, "InUse"), counters.live_bytes as i64, "{seen_by_ort:?}");
        let arena = arena_stats(&allocator);
        assert!(arena.peak_physical_bytes > weights.mapped_bytes, "the runs mapped nothing beyond the weights");
    }

    // The session is gone: every block it took was freed, none leaked.
    let end = allocator.counters();
    assert_eq!(end.live_blocks, 0, "{end:?}");
    assert_eq!(end.live_bytes, 0, "{end:?}");
    assert_eq!(end.frees, end.allocs + end.reserves, "{end:?}");
    assert_eq!(end.refused + end.unknown_frees + end.arena_free_errors, 0, "{end:?}");
    let arena = arena_stats(&allocator);
    assert_eq!((arena.live_allocations, arena.live_bytes, arena.mapped_bytes), (0, 0, 0), "{arena:?}");
    assert!(arena.pooled_bytes > 0, "nothing pooled before trim: {arena:?}");
    let released = allocator.trim().expect("trim");
    assert_eq!(released, arena.pooled_bytes);
    let trimmed = arena_stats(&allocator);
    assert_eq!((trimmed.mapped_bytes, trimmed.pooled_bytes), (0, 0), "{trimmed:?}");
    assert_eq!(trimmed.driver_creates, trimmed.driver_releases, "chunks not released: {trimmed:?}");
    drop(default_session);
    drop(registration);
}
