//! Admission map-ahead (`Arena::set_admission_prefetch`): chunks mapped by
//! `maintain` where the next allocations will be placed.
//! - an allocation placed in a window makes no driver call on the caller's
//!   thread, and several windows serve as many allocations in a row;
//! - windows are filled from the pool and from spare idle cached chunks,
//!   never by a create of their own, and count toward the precreate target
//!   (the footprint is what the precreate target made it);
//! - plans take other idle chunks before window chunks; window chunks are
//!   used under pressure (never an out-of-memory) and given back first;
//! - the prediction follows placement: a wrong size or count costs no
//!   correctness, only the between-steps calls;
//! - bad arguments are refused and leave the target as it was.

mod common;

use std::sync::Arc;

use common::Snap;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Error, MAX_ADMISSION_WINDOWS};

const C: u64 = 4096;

fn config(cap: u64, reserve: u64) -> ArenaConfig {
    ArenaConfig { capacity_bytes: cap * C, reserve_bytes: reserve * C, chunk_bytes: C, ..Default::default() }
}

fn arena(cap: u64, reserve: u64) -> Arena {
    Arena::with_driver(MockDriver::new(C, 1 << 30), config(cap, reserve)).unwrap()
}

/// An arena whose stream-ordered frees leave known-idle chunks once
/// `complete_all_events` (the mock driver's modelled streams).
fn arena_with_streams(cap: u64, reserve: u64) -> (Arc<MockDriver>, Arena) {
    let d = Arc::new(MockDriver::with_streams(C, 1 << 30));
    (d.clone(), Arena::with_driver(d, config(cap, reserve)).unwrap())
}

/// Frees `id` on stream 0 and lets its event complete: its chunks stay
/// cached where they were, known idle.
fn free_idle(d: &MockDriver, a: &Arena, id: vmm_arena::Id) {
    a.free_on_stream(id, 0).unwrap();
    d.complete_all_events();
    a.maintain().unwrap();
}

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

#[test]
fn an_admission_into_its_window_makes_no_driver_call() {
    let a = arena(32, 256);
    let (_g, _) = a.alloc_growable(2 * C, 16 * C).unwrap();
    a.set_prefetch(4 * C, 0).unwrap();
    a.set_admission_prefetch(16 * C, 3 * C, 1).unwrap();
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_creates, 2 + 4, "the precreate target only: the window took three of its chunks");
    assert_eq!((s.pooled_bytes, s.cached_mapped_bytes), (4 * C, 3 * C), "one unmapped, three in the window");
    assert_eq!(s.prefetched_bytes, 4 * C);
    check(&a);

    let calls = s.caller_driver_calls;
    let (x, _) = a.alloc_growable(3 * C, 16 * C).unwrap();
    let t = a.stats().unwrap();
    assert_eq!(t.caller_driver_calls, calls, "placed in the window: every chunk adopted");
    assert_eq!(t.mapped_bytes, 5 * C);
    // Smaller than the window: still no call; the rest stays cached in its
    // reservation (adopted when it grows).
    a.free(x).unwrap();
    a.maintain().unwrap();
    let calls = a.stats().unwrap().caller_driver_calls;
    let (y, _) = a.alloc_growable(C, 16 * C).unwrap();
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls);
    a.resize(y, 3 * C).unwrap();
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls, "growth adopts the window's rest");
    check(&a);
}

#[test]
fn several_windows_serve_as_many_admissions_in_a_row() {
    let a = arena(64, 512);
    a.set_prefetch(8 * C, 0).unwrap();
    a.set_admission_prefetch(16 * C, 2 * C, 3).unwrap();
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().cached_mapped_bytes, 6 * C, "three windows of two");
    let calls = a.stats().unwrap().caller_driver_calls;
    let ids: Vec<_> = (0..3).map(|_| a.alloc_growable(2 * C, 16 * C).unwrap().0).collect();
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls, "three placements, each in its window");
    // A fourth was not foreseen: it maps (from the pool), no create.
    let creates = a.stats().unwrap().driver_creates;
    a.alloc_growable(2 * C, 16 * C).unwrap();
    let s = a.stats().unwrap();
    assert!(s.caller_driver_calls > calls);
    assert_eq!(s.driver_creates, creates);
    for id in ids {
        a.free(id).unwrap();
    }
    check(&a);
}

#[test]
fn windows_are_filled_from_spare_idle_chunks_without_a_create() {
    let (d, a) = arena_with_streams(64, 512);
    // Freed allocations leave known-idle cached chunks at their places.
    let ids: Vec<_> = (0..4).map(|_| a.alloc_growable(2 * C, 8 * C).unwrap().0).collect();
    let keep = a.alloc_growable(C, 8 * C).unwrap().0;
    for id in ids {
        free_idle(&d, &a, id);
    }
    let s0 = a.stats().unwrap();
    assert_eq!((s0.cached_mapped_bytes, s0.pending_free_bytes), (8 * C, 0));
    // A reservation as long as the four holes together (they coalesced):
    // the window is at its start, with two cached chunks, and gets four.
    a.set_admission_prefetch(32 * C, 4 * C, 1).unwrap();
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_creates, s0.driver_creates, "no create: spare chunks moved");
    assert_eq!(s.pooled_bytes, s0.pooled_bytes, "the footprint stays");
    assert_eq!(s.driver_syncs, s0.driver_syncs, "known idle: no synchronize");
    let calls = s.caller_driver_calls;
    a.alloc_growable(4 * C, 32 * C).unwrap();
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls);
    a.free(keep).unwrap();
    check(&a);
}

#[test]
fn growth_takes_other_idle_chunks_before_window_chunks() {
    let (d, a) = arena_with_streams(64, 512);
    let (g, _) = a.alloc_growable(C, 8 * C).unwrap(); // pages 0..8
    let (x, _) = a.alloc(2 * C).unwrap(); // 8..10
    let (_z, _) = a.alloc(C).unwrap(); // 10..11: keeps x's hole apart
    let (y, _) = a.alloc(2 * C).unwrap(); // 11..13
    free_idle(&d, &a, x);
    free_idle(&d, &a, y);
    // The window: the start of the free range after z (y's old pages,
    // already holding two idle chunks).
    a.set_admission_prefetch(16 * C, 2 * C, 1).unwrap();
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.cached_mapped_bytes, s.prefetched_bytes), (4 * C, 2 * C), "x's two, and the window's two");
    // g grows by two chunks with no pool: idle chunks serve it, x's, not
    // the window's.
    let creates = s.driver_creates;
    a.resize(g, 3 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_creates, creates, "idle chunks served the growth");
    assert_eq!((s.cached_mapped_bytes, s.prefetched_bytes), (2 * C, 2 * C), "the window kept its chunks");
    let calls = s.caller_driver_calls;
    a.alloc_growable(2 * C, 16 * C).unwrap();
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls, "and the admission adopts them");
    check(&a);
}

#[test]
fn window_chunks_serve_allocations_under_pressure_and_are_given_back_first() {
    let a = arena(8, 128);
    a.set_prefetch(4 * C, 0).unwrap();
    a.set_admission_prefetch(16 * C, 4 * C, 1).unwrap();
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().cached_mapped_bytes, 4 * C);
    // Needs the whole capacity, elsewhere than the window (not growable:
    // a reservation of 8 pages is another place).
    let (x, _) = a.alloc(8 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.driver_syncs), (8 * C, 0, 0), "window chunks taken, no sync");
    a.free(x).unwrap();
    check(&a);

    let a = arena(16, 128);
    a.set_prefetch(4 * C, 0).unwrap();
    a.set_admission_prefetch(16 * C, 4 * C, 1).unwrap();
    a.maintain().unwrap();
    assert_eq!(a.trim(0).unwrap(), 4 * C, "prefetched window chunks go back like any pooled chunk");
    let s = a.stats().unwrap();
    assert_eq!((s.pooled_bytes, s.prefetched_bytes), (0, 0));
    check(&a);
}

#[test]
fn a_wrong_prediction_costs_no_correctness() {
    let a = arena(32, 256);
    a.set_prefetch(4 * C, 0).unwrap();
    // Windows for growable allocations of 16 pages; a plain allocation of
    // 2 pages lands elsewhere (best fit for 2 pages), and the window stays.
    a.set_admission_prefetch(16 * C, 4 * C, 1).unwrap();
    a.maintain().unwrap();
    let (x, _) = a.alloc(2 * C).unwrap();
    a.write(x, 0, b"abcdefgh").unwrap();
    let mut b = [0u8; 8];
    a.read(x, 0, &mut b).unwrap();
    assert_eq!(&b, b"abcdefgh");
    check(&a);
    // Turned off: the window's chunks are spare now (x took one of them,
    // with the one unmapped pooled chunk): they serve the precreate target
    // first, unmapped, and only the rest is created.
    let before = a.stats().unwrap();
    assert_eq!((before.pooled_bytes, before.cached_mapped_bytes), (2 * C, 2 * C));
    a.set_admission_prefetch(0, 0, 0).unwrap();
    a.maintain().unwrap();
    let after = a.stats().unwrap();
    assert_eq!(after.driver_creates, before.driver_creates + 2);
    assert_eq!((after.pooled_bytes, after.cached_mapped_bytes), (4 * C, 0));
    check(&a);
}

#[test]
fn too_many_windows_are_refused_and_the_target_stays() {
    let a = arena(32, 256);
    a.set_admission_prefetch(16 * C, 2 * C, 1).unwrap();
    let e = a.set_admission_prefetch(16 * C, 2 * C, MAX_ADMISSION_WINDOWS + 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    a.set_prefetch(2 * C, 0).unwrap();
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().cached_mapped_bytes, 2 * C, "the one window asked for before");
}

/// Once an allocation takes a window's place, the chunks left past its
/// size are its own (mapped ahead of it, or pooled in its reservation):
/// `prefetched_bytes` counts each of them once, and never more than is
/// pooled.
#[test]
fn a_window_taken_by_an_allocation_is_not_counted_twice() {
    let a = arena(32, 256);
    a.set_prefetch(4 * C, 2 * C).unwrap();
    a.set_admission_prefetch(16 * C, 4 * C, 1).unwrap();
    a.maintain().unwrap();
    a.alloc_growable(C, 16 * C).unwrap(); // the window's first page; 3 left past it
    let s = a.stats().unwrap();
    assert_eq!(s.cached_mapped_bytes, 3 * C);
    let unmapped = s.pooled_bytes - s.cached_mapped_bytes;
    assert_eq!(s.prefetched_bytes, unmapped.min(4 * C) + 2 * C, "the pool, and two chunks mapped ahead of it");
    assert!(s.prefetched_bytes <= s.pooled_bytes);
}
