//! How the arena unmaps runs of pages (`src/arena/unmap.rs`): one unmap call
//! per mapping unless a probe at creation shows the driver accepts a span of
//! separate mappings. Checked on the mock driver in both readings of
//! `cuMemUnmap` (its strict switch refuses spans, as a strict driver may):
//! every path that unmaps (free + trim, shrink, compaction, sleep, wake,
//! drop) works, leaves nothing mapped, and `driver_unmaps` counts the calls
//! made, one per page in the strict mode.

use std::sync::Arc;

use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, ALL_TAGS};

const C: u64 = 64 << 10;

fn arena(strict: bool) -> (Arc<MockDriver>, Arena) {
    let mut d = MockDriver::new(C, 1 << 30);
    if strict {
        d = d.with_strict_unmap();
    }
    let d = Arc::new(d);
    let cfg = ArenaConfig { capacity_bytes: 32 * C, reserve_bytes: 128 * C, chunk_bytes: C, ..Default::default() };
    (d.clone(), Arena::with_driver(d, cfg).unwrap())
}

/// Runs every unmapping path; returns the unmap calls counted.
fn exercise(a: &Arena) -> u64 {
    let (x, _) = a.alloc(6 * C).unwrap();
    let (y, _) = a.alloc(4 * C).unwrap();
    a.free(x).unwrap();
    a.trim(0).unwrap();
    a.resize(y, C).unwrap();
    a.trim(0).unwrap();
    let (z, _) = a.alloc(5 * C).unwrap();
    a.free(y).unwrap();
    a.compact().unwrap();
    a.sleep(ALL_TAGS, 0).unwrap();
    a.wake(ALL_TAGS).unwrap();
    a.resize(z, 2 * C).unwrap();
    a.stats().unwrap().driver_unmaps
}

#[test]
fn the_strict_reading_unmaps_one_mapping_per_call() {
    let (d, a) = arena(true);
    assert!(!a.unmaps_span_mappings(), "the probe saw the strict driver refuse a span");
    let unmaps = exercise(&a);
    let s = a.stats().unwrap();
    assert!(unmaps >= 6 + 3 + 5, "one call per page: {unmaps}");
    assert_eq!(s.mapped_bytes, 2 * C);
    drop(a);
    assert_eq!((d.live_chunks(), d.live_mappings(), d.live_reservations()), (0, 0, 0));
}

#[test]
fn a_driver_that_accepts_spans_gets_one_call_a_run() {
    let (d, a) = arena(false);
    assert!(a.unmaps_span_mappings(), "the probe saw the span accepted");
    let spans = exercise(&a);
    let (_, strict) = arena(true);
    let per_page = exercise(&strict);
    assert!(spans < per_page, "spans {spans} < per page {per_page}");
    drop(a);
    assert_eq!((d.live_chunks(), d.live_mappings(), d.live_reservations()), (0, 0, 0));
}

#[test]
fn the_probe_leaves_nothing_behind_and_counts_no_call() {
    for strict in [false, true] {
        let (d, a) = arena(strict);
        let s = a.stats().unwrap();
        assert_eq!((s.driver_creates, s.driver_maps, s.driver_unmaps, s.driver_releases), (0, 0, 0, 0));
        assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0), "strict {strict}");
    }
}
