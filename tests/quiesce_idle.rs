//! `Arena::quiesce_on_stream` over the mock driver's streams, whose events
//! complete only when the test says so: once the promise's event has
//! completed, whatever the allocation gives up (a free, a shrink, the old
//! range of a move) is known idle; given up before that, it becomes idle
//! when the event completes, wherever the allocation lies by then.

mod common;

use common::fixtures::{stream_arena, STREAM_CHUNK};
use common::Snap;
use vmm_arena::Arena;

const C: u64 = STREAM_CHUNK;

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

#[test]
fn a_quiesced_allocation_freed_before_its_event_is_idle_once_it_completes() {
    let (d, a) = stream_arena(8, 16);
    let (x, _) = a.alloc(2 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    assert_eq!(a.stats().unwrap().quiesces, 1);
    a.free(x).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.cached_mapped_bytes, s.idle_cached_bytes), (2 * C, 0), "not idle before the event");
    d.complete_all_events();
    a.maintain().unwrap(); // polls
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 2 * C, "idle once the promise's event completed");
    check(&a);
}

/// The promise's event covers the allocation wherever it lies: moved by a
/// compaction before the event completes, the pages it gives up at its new
/// place become idle with the event too.
#[test]
fn a_quiesced_allocation_moved_before_its_event_is_idle_once_it_completes() {
    let (d, a) = stream_arena(8, 16);
    let (hole, _) = a.alloc(2 * C).unwrap(); // pages 0..2
    let (x, px) = a.alloc(2 * C).unwrap(); // pages 2..4
    a.write(x, 0, b"kv").unwrap();
    a.free(hole).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    let r = a.compact().unwrap();
    assert_eq!(r.moved_allocations, 1, "x slides down into the hole");
    assert_ne!(a.query(x).unwrap().ptr, px);
    let mut out = [0u8; 2];
    a.read(x, 0, &mut out).unwrap();
    assert_eq!(&out, b"kv");
    a.free(x).unwrap(); // its pages at the new place, before the event completes
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "not idle before the event");
    d.complete_all_events();
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.idle_cached_bytes, s.cached_mapped_bytes, "every page x gave up is idle: {s:?}");
    assert!(s.cached_mapped_bytes >= 2 * C, "x's chunks stay cached: {s:?}");
    check(&a);
}
