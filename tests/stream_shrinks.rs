//! Stream-ordered shrinks (`Arena::resize_on_stream`), checked through the
//! mock driver's streams, whose events complete only when the test says so:
//!
//! - before its event completes, a shrink's dropped pages are what a plain
//!   shrink leaves (growth takes them back at once, another address takes
//!   their chunks after a synchronize); after it, they are known idle and
//!   another address takes them without one;
//! - a page the allocation took back before the event is not made idle by
//!   it (new work may use it), even if a later plain shrink drops it again;
//! - nothing ever waits for a shrink's event (it frees nothing);
//! - growth, small allocations and the host backend record no event; a
//!   failed record changes nothing; sleep and drop handle pending shrinks.

mod common;

use std::sync::Arc;

use common::fixtures::{faulty_stream_arena, stream_arena, STREAM_CHUNK};
use common::Snap;
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Error, ALL_TAGS};

const C: u64 = STREAM_CHUNK;

fn arena(cap: u64, reserve: u64) -> (Arc<MockDriver>, Arena) {
    stream_arena(cap, reserve)
}

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

/// Capacity 3: a growable allocation of two chunks shrunk to one (on the
/// stream or not), a neighbour of one; then `before_steal` runs and an
/// allocation of one chunk must steal the dropped page's chunk. Returns
/// the synchronizes that steal made.
fn steal_after(on_stream: bool, before_steal: impl FnOnce(&MockDriver, &Arena, vmm_arena::Id)) -> u64 {
    let (d, a) = arena(3, 16);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    a.write(x, 0, b"kept").unwrap();
    let (_b, _) = a.alloc(C).unwrap();
    if on_stream {
        a.resize_on_stream(x, C, 5).unwrap();
    } else {
        a.resize(x, C).unwrap();
    }
    assert_eq!(a.stats().unwrap().cached_mapped_bytes, C, "the dropped page stays mapped, cached");
    before_steal(&d, &a, x);
    let before = a.stats().unwrap();
    let (_y, _) = a.alloc(C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.driver_unmaps - before.driver_unmaps, s.driver_creates - before.driver_creates), (1, 0), "stolen");
    assert_eq!(s.event_waits, 0, "nothing waits for a shrink's event");
    let mut kept = [0u8; 4];
    a.read(x, 0, &mut kept).unwrap();
    assert_eq!(&kept, b"kept");
    check(&a);
    s.driver_syncs - before.driver_syncs
}

#[test]
fn a_stream_shrinks_pages_are_stolen_without_a_synchronize_once_its_event_completes() {
    let complete = |d: &MockDriver, a: &Arena, _| {
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 0);
        d.complete_all_events();
        a.maintain().unwrap(); // polls: the page is idle now
    };
    assert_eq!(steal_after(true, complete), 0, "known idle: no synchronize");
    let idle_after = |d: &MockDriver, a: &Arena, _| {
        d.complete_all_events();
        a.maintain().unwrap();
        assert_eq!(a.stats().unwrap().idle_cached_bytes, C, "the dropped page is known idle");
    };
    assert_eq!(steal_after(true, idle_after), 0);
    assert_eq!(steal_after(false, complete), 1, "a plain shrink: a synchronize first, as before");
    assert_eq!(steal_after(true, |_, _, _| {}), 1, "before the event: as a plain shrink");
}

#[test]
fn the_event_is_polled_by_the_next_operation_and_destroyed() {
    let (d, a) = arena(8, 16);
    let (x, _) = a.alloc_growable(3 * C, 4 * C).unwrap();
    a.resize_on_stream(x, C, 2).unwrap();
    assert_eq!(d.events().len(), 1, "one event for the shrink");
    assert_eq!(a.stats().unwrap().stream_shrinks, 1);
    assert_eq!(a.stats().unwrap().pending_free_bytes, 0, "a shrink holds nothing back");
    d.complete_all_events();
    a.alloc(C).unwrap();
    assert!(d.events().is_empty(), "reaped by the next operation's poll, destroyed");
    check(&a);
}

#[test]
fn a_page_taken_back_before_the_event_is_not_made_idle_by_it() {
    let retake = |d: &MockDriver, a: &Arena, x| {
        // Growth adopts the dropped page at once (no driver call), new work
        // may use it, and a plain shrink drops it again: the old event
        // completing says nothing about that work.
        let calls = a.stats().unwrap().caller_driver_calls;
        a.resize(x, 2 * C).unwrap();
        assert_eq!(a.stats().unwrap().caller_driver_calls, calls, "taken back in place");
        a.resize(x, C).unwrap();
        d.complete_all_events();
        a.maintain().unwrap();
    };
    assert_eq!(steal_after(true, retake), 1, "not idle: a synchronize first");
}

#[test]
fn an_out_of_memory_never_waits_for_a_shrinks_event() {
    let (d, a) = arena(4, 16);
    let (x, _) = a.alloc_growable(4 * C, 4 * C).unwrap();
    a.resize_on_stream(x, 2 * C, 1).unwrap();
    // Two cached chunks could serve two pages; five cannot be had.
    let before = Snap::of(&a).without_driver_counters();
    assert!(matches!(a.alloc(5 * C), Err(Error::OutOfMemory(_))));
    assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing changed");
    assert_eq!((a.stats().unwrap().event_waits, d.events_waited()), (0, 0));
    // The dropped pages serve (after a synchronize: not idle yet).
    a.alloc(2 * C).unwrap();
    assert_eq!(a.stats().unwrap().event_waits, 0);
    check(&a);
}

#[test]
fn growth_unchanged_sizes_and_small_allocations_record_no_event() {
    let (d, a) = arena(8, 16);
    let (x, _) = a.alloc_growable(C, 4 * C).unwrap();
    a.resize_on_stream(x, 3 * C, 1).unwrap();
    a.resize_on_stream(x, 3 * C, 1).unwrap();
    a.resize_on_stream(x, 3 * C - 100, 1).unwrap(); // the same pages
    let (s, _) = a.alloc(300).unwrap();
    a.resize_on_stream(s, 100, 1).unwrap();
    assert!(d.events().is_empty());
    assert_eq!(a.stats().unwrap().stream_shrinks, 0);
    check(&a);
}

#[test]
fn a_failed_event_record_changes_nothing() {
    let (d, a) = faulty_stream_arena(4, 16);
    let (x, _) = a.alloc_growable(3 * C, 4 * C).unwrap();
    for kind in FaultKind::ALL {
        let before = Snap::of(&a).without_driver_counters();
        d.fail_nth(Some(CallKind::Event), 1, kind);
        let e = a.resize_on_stream(x, C, 1).unwrap_err();
        assert!(matches!(e, Error::Driver { .. } | Error::OutOfMemory(_)), "{e}");
        assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing changed");
    }
    a.resize_on_stream(x, C, 1).unwrap();
    assert_eq!(a.query(x).unwrap().mapped_bytes, C);
}

#[test]
fn unknown_ids_and_bad_sizes_are_refused_before_any_event_is_recorded() {
    let (d, a) = arena(4, 16);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    a.free(x).unwrap();
    assert!(matches!(a.resize_on_stream(x, C, 1), Err(Error::UnknownAllocation(_))));
    let (y, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    assert!(matches!(a.resize_on_stream(y, 0, 1), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.resize_on_stream(y, u64::MAX, 1), Err(Error::InvalidArgument(_))));
    assert!(d.events().is_empty());
}

#[test]
fn sleep_and_drop_handle_pending_shrinks() {
    let (d, a) = arena(8, 32);
    let (x, _) = a.alloc_growable(3 * C, 4 * C).unwrap();
    a.resize_on_stream(x, C, 1).unwrap();
    a.sleep(ALL_TAGS, 0).unwrap();
    assert!(d.events().is_empty(), "sleep waited for it");
    assert_eq!(d.live_chunks(), 0, "everything given back");
    a.wake(ALL_TAGS).unwrap();
    let (y, _) = a.alloc_growable(3 * C, 4 * C).unwrap();
    a.resize_on_stream(y, C, 3).unwrap();
    assert!(!d.events().is_empty());
    drop(a);
    assert!(d.events().is_empty());
    assert_eq!((d.live_chunks(), d.live_mappings(), d.live_reservations()), (0, 0, 0));
}

#[test]
#[cfg_attr(miri, ignore)] // system calls
fn the_host_backend_resizes_as_resize() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 4 << 20, chunk_bytes: 1 << 20, ..Default::default() }).unwrap();
    let (x, ptr) = a.alloc_growable(3 << 20, 4 << 20).unwrap();
    assert_eq!(a.resize_on_stream(x, 1 << 20, 0).unwrap(), ptr);
    let s = a.stats().unwrap();
    assert_eq!((s.stream_shrinks, s.cached_mapped_bytes), (0, 2 << 20));
}

#[test]
fn a_poll_costs_one_query_per_stream_not_one_per_pending_event() {
    let (d, a) = arena(64, 128);
    let (x, _) = a.alloc_growable(40 * C, 64 * C).unwrap();
    for n in (1..40).rev() {
        a.resize_on_stream(x, n * C, 1).unwrap();
    }
    let (y, _) = a.alloc_growable(4 * C, 8 * C).unwrap();
    a.resize_on_stream(y, C, 2).unwrap();
    assert_eq!(d.events().len(), 40);
    let polls = a.stats().unwrap().event_polls;
    a.maintain().unwrap(); // polls every stream
    let s = a.stats().unwrap();
    assert_eq!(s.event_polls - polls, 2, "stream 1's first event is incomplete: its later ones are not polled");
    // Stream 2's event completes alone: it is found behind stream 1's.
    let (y_event, _) = *d.events().last().unwrap();
    assert!(d.complete_event(y_event));
    a.maintain().unwrap();
    assert_eq!(d.events().len(), 39, "stream 2's event reaped past stream 1's");
    d.complete_all_events();
    a.maintain().unwrap();
    assert!(d.events().is_empty());
    check(&a);
}
