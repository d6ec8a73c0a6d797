//! Stream-ordered frees (`Arena::free_on_stream`): the ordering rules,
//! checked through the mock driver's streams, whose events complete only
//! when the test says so (or when the arena waits for one).
//!
//! - the id is dead at once, the memory is neither unmapped nor reused
//!   before its event completes (its bytes stay at the old address);
//! - events are polled, never waited for, while anything else can serve;
//!   when nothing else can, the arena waits for the oldest, never the device;
//! - a completed free's chunks are known idle: stealing them for another
//!   address, and releasing the retired ranges of that allocation, need no
//!   synchronize (a plain free's still do: its meaning is unchanged);
//! - small objects keep their place; sleep and drop handle pending frees;
//!   a failed event record frees nothing; the host frees at once.

mod common;

use std::sync::Arc;

use common::fixtures::{faulty_stream_arena, stream_arena, STREAM_CHUNK};
use common::Snap;
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::{CallKind, Driver};
use vmm_arena::{Arena, ArenaConfig, Error, Id, ALL_TAGS};

const C: u64 = STREAM_CHUNK;

fn arena(cap: u64, reserve: u64) -> (Arc<MockDriver>, Arena) {
    stream_arena(cap, reserve)
}

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

fn read_at(d: &MockDriver, addr: u64) -> [u8; 8] {
    let mut out = [0u8; 8];
    d.read(addr, &mut out).unwrap();
    out
}

#[test]
fn freed_memory_is_not_reused_before_its_event_completes() {
    let (d, a) = arena(4, 16);
    let (x, x_ptr) = a.alloc(2 * C).unwrap();
    a.write(x, C, b"x's data").unwrap();
    a.free_on_stream(x, 7).unwrap();
    assert!(matches!(a.query(x), Err(Error::UnknownAllocation(_))), "the id is dead at once");
    assert!(matches!(a.free(x), Err(Error::UnknownAllocation(_))));
    let s = a.stats().unwrap();
    assert_eq!((s.live_allocations, s.live_bytes, s.mapped_bytes), (0, 0, 0));
    assert_eq!((s.pending_free_bytes, s.pooled_bytes, s.stream_frees), (2 * C, 2 * C, 1));
    check(&a);

    // Capacity is left: the new allocation goes elsewhere, with new chunks.
    let (y, y_ptr) = a.alloc(2 * C).unwrap();
    assert!(y_ptr >= x_ptr + 2 * C || y_ptr + 2 * C <= x_ptr, "placed over the pending free");
    a.write(y, 0, b"y's data").unwrap();
    assert_eq!(&read_at(&d, x_ptr + C), b"x's data", "x's memory is still mapped and untouched");
    assert_eq!(d.events_waited(), 0, "something else could serve: no wait");
    check(&a);

    // The event completes; a request the capacity cannot meet otherwise
    // reaps it (a poll), and adopts x's chunks in place.
    let (event, done) = d.events()[0];
    assert!(!done);
    assert!(d.complete_event(event));
    let before = a.stats().unwrap();
    let (z, z_ptr) = a.alloc(2 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(z_ptr, x_ptr, "best fit puts it in the hole x left");
    assert_eq!(s.caller_driver_calls, before.caller_driver_calls, "adopted: no driver call");
    assert_eq!((s.event_waits, s.driver_syncs, s.pending_free_bytes), (0, 0, 0));
    assert!(s.event_polls > before.event_polls);
    assert!(d.events().is_empty(), "the reaped event is destroyed");
    a.free(y).unwrap();
    a.free(z).unwrap();
    check(&a);
}

#[test]
fn waits_for_the_oldest_event_only_when_nothing_else_can_serve() {
    let (d, a) = arena(4, 16);
    let (x1, x1_ptr) = a.alloc(C).unwrap();
    let (x2, _) = a.alloc(C).unwrap();
    let (_x3, _) = a.alloc(2 * C).unwrap();
    a.free_on_stream(x1, 1).unwrap();
    a.free_on_stream(x2, 2).unwrap();
    let events = d.events();
    assert_eq!(events.len(), 2);
    // The capacity is held (two chunks pending): nothing else can serve.
    let (y, y_ptr) = a.alloc(C).unwrap();
    assert_eq!(d.events_waited(), 1, "one wait");
    let left = d.events();
    assert_eq!(left, vec![(events[1].0, false)], "the oldest was waited for and reaped; the newer one still runs");
    assert_eq!(y_ptr, x1_ptr, "the waited-for free's chunk serves it");
    let s = a.stats().unwrap();
    assert_eq!((s.event_waits, s.driver_syncs, s.pending_free_bytes), (1, 0, C), "no device synchronize");
    check(&a);

    // More than the pending frees can give: every one is waited for, then
    // out of memory.
    assert!(matches!(a.alloc(2 * C), Err(Error::OutOfMemory(_))));
    assert!(d.events().is_empty(), "the other free was waited for too");
    assert_eq!(d.events_waited(), 2);
    assert_eq!(a.stats().unwrap().pending_free_bytes, 0);
    a.free(y).unwrap();
    check(&a);
}

/// Two runs of the same steal: the chunk at page 0 comes from a free on a
/// stream (completed) or from a plain free.
fn steal_after(on_stream: bool) -> (u64, u64) {
    let (d, a) = arena(3, 16);
    let (x, _) = a.alloc(C).unwrap(); // page 0
    let (_b, _) = a.alloc(C).unwrap(); // page 1
    if on_stream {
        a.free_on_stream(x, 5).unwrap();
        d.complete_all_events();
        a.maintain().unwrap(); // reaps it: page 0 cached and idle
    } else {
        a.free(x).unwrap();
    }
    assert_eq!(a.stats().unwrap().cached_mapped_bytes, C);
    // Two pages at 2..4: one new chunk (the capacity allows one), one
    // stolen from page 0 (an unmap there).
    let before = a.stats().unwrap();
    let (_y, y_ptr) = a.alloc(2 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(y_ptr, a.va_range().0 + 2 * C);
    assert_eq!((s.driver_unmaps - before.driver_unmaps, s.driver_creates - before.driver_creates), (1, 1));
    check(&a);
    (s.driver_syncs - before.driver_syncs, s.caller_syncs - before.caller_syncs)
}

#[test]
fn an_allocation_reuses_a_completed_free_rather_than_create() {
    let (d, a) = arena(16, 64);
    let (x, _) = a.alloc(4 * C).unwrap();
    let (y, _) = a.alloc(C).unwrap();
    a.free_on_stream(x, 1).unwrap();
    d.complete_all_events();
    let s0 = a.stats().unwrap();
    assert_eq!(s0.pending_free_bytes, 4 * C, "not reaped yet: nothing polled since");
    // Capacity is left for new chunks, yet the completed free serves.
    a.alloc(3 * C).unwrap();
    a.resize(y, 2 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_creates, s0.driver_creates, "x's chunks serve, no create");
    assert_eq!((s.driver_syncs, s.event_waits), (s0.driver_syncs, 0), "polled, never waited");
    assert_eq!((s.pending_free_bytes, s.pooled_bytes), (0, 0));
    check(&a);
}

#[test]
fn idle_chunks_are_stolen_without_a_synchronize_and_plain_frees_keep_their_meaning() {
    assert_eq!(steal_after(true), (0, 0), "known idle: no synchronize");
    assert_eq!(steal_after(false), (1, 1), "a plain free's chunk: synchronize first, as before");
}

fn release_retired_after(on_stream: bool) -> u64 {
    let (d, a) = arena(4, 16);
    let (g, g_ptr) = a.alloc_growable(C, C).unwrap(); // page 0
    let (_b, _) = a.alloc(C).unwrap(); // page 1: g cannot grow in place
    a.write(g, 0, b"g before").unwrap();
    let moved = a.resize(g, 2 * C).unwrap();
    assert_ne!(moved, g_ptr);
    assert_eq!(a.stats().unwrap().retired_va_bytes, C, "page 0 retired");
    if on_stream {
        a.free_on_stream(g, 9).unwrap();
        // Until the event completes, the old address still works.
        assert_eq!(&read_at(&d, g_ptr), b"g before");
        d.complete_all_events();
        a.maintain().unwrap();
    } else {
        a.free(g).unwrap();
    }
    let before = a.stats().unwrap().driver_syncs;
    a.release_retired().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.retired_va_bytes, 0);
    check(&a);
    s.driver_syncs - before
}

#[test]
fn retired_ranges_of_a_completed_free_are_released_without_a_synchronize() {
    assert_eq!(release_retired_after(true), 0);
    assert_eq!(release_retired_after(false), 1);
}

#[test]
fn small_objects_freed_on_a_stream_keep_their_place() {
    let (d, a) = arena(4, 16);
    let (s1, p1) = a.alloc(100).unwrap();
    let (_s0, _) = a.alloc(100).unwrap(); // keeps the slab alive
    a.write(s1, 0, b"small 1!").unwrap();
    a.free_on_stream(s1, 3).unwrap();
    assert!(matches!(a.query(s1), Err(Error::UnknownAllocation(_))));
    assert_eq!(a.stats().unwrap().live_allocations, 1);
    check(&a);
    let (_s2, p2) = a.alloc(100).unwrap();
    assert_ne!(p2, p1, "the object is still taken");
    assert_eq!(&read_at(&d, p1), b"small 1!");
    d.complete_all_events();
    a.maintain().unwrap();
    check(&a);
    let (_s3, p3) = a.alloc(100).unwrap();
    assert_eq!(p3, p1, "given back once the event completed");
    check(&a);
}

#[test]
fn a_slab_whose_objects_are_all_pending_stays_until_their_events() {
    let (d, a) = arena(4, 16);
    let (s1, _) = a.alloc(100).unwrap();
    a.free_on_stream(s1, 3).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.small_slabs, s.live_allocations), (1, 0));
    check(&a);
    d.complete_all_events();
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.small_slabs, s.cached_mapped_bytes), (0, C), "the empty slab is freed like any allocation");
    check(&a);
}

#[test]
fn sleep_waits_for_pending_frees_and_gives_their_memory_back() {
    let (d, a) = arena(8, 32);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    let (y, _) = a.alloc(3 * C).unwrap();
    a.free_on_stream(x, 1).unwrap();
    a.sleep(ALL_TAGS, 0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.pooled_bytes, s.mapped_bytes), (0, 0, 0));
    assert!(d.events().is_empty());
    assert_eq!(d.live_chunks(), 0, "everything given back");
    a.wake(ALL_TAGS).unwrap();
    a.free(y).unwrap();
    check(&a);
}

#[test]
fn dropping_the_arena_destroys_pending_events_and_releases_their_memory() {
    let (d, a) = arena(8, 32);
    let (x, _) = a.alloc(2 * C).unwrap();
    let (s, _) = a.alloc(300).unwrap();
    a.free_on_stream(x, 1).unwrap();
    a.free_on_stream(s, 2).unwrap();
    assert_eq!(d.events().len(), 2);
    drop(a);
    assert!(d.events().is_empty());
    assert_eq!((d.live_chunks(), d.live_mappings(), d.live_reservations()), (0, 0, 0));
}

#[test]
fn a_failed_event_record_frees_nothing() {
    let (d, a) = faulty_stream_arena(4, 16);
    let (x, _) = a.alloc(C).unwrap();
    for kind in FaultKind::ALL {
        let before = Snap::of(&a).without_driver_counters();
        d.fail_nth(Some(CallKind::Event), 1, kind);
        let e = a.free_on_stream(x, 1).unwrap_err();
        assert!(matches!(e, Error::Driver { .. } | Error::OutOfMemory(_)), "{e}");
        assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing changed");
        assert!(a.query(x).is_ok(), "still live");
    }
    a.free_on_stream(x, 1).unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, C);
}

#[test]
fn unknown_ids_are_refused_before_any_event_is_recorded() {
    let (d, a) = arena(4, 16);
    let (x, _) = a.alloc(C).unwrap();
    a.free(x).unwrap();
    assert!(matches!(a.free_on_stream(x, 1), Err(Error::UnknownAllocation(_))));
    assert!(matches!(a.free_on_stream(Id::from_raw(12345).unwrap(), 1), Err(Error::UnknownAllocation(_))));
    assert!(d.events().is_empty());
}

#[test]
#[cfg_attr(miri, ignore)] // system calls
fn the_host_backend_frees_at_once() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 4 << 20, chunk_bytes: 1 << 20, ..Default::default() }).unwrap();
    let (x, ptr) = a.alloc(1 << 20).unwrap();
    a.free_on_stream(x, 0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.stream_frees, s.cached_mapped_bytes), (0, 0, 1 << 20));
    let (_y, again) = a.alloc(1 << 20).unwrap();
    assert_eq!(again, ptr, "reusable at once");
}

#[test]
fn resize_and_compaction_never_touch_a_pending_free() {
    let (d, a) = arena(8, 8);
    let (x, x_ptr) = a.alloc(2 * C).unwrap(); // pages 0..2
    let (y, _) = a.alloc(C).unwrap(); // page 2
    a.write(x, 0, b"pending!").unwrap();
    a.free_on_stream(x, 4).unwrap();
    a.free(y).unwrap();
    // Compaction moves nothing into or out of the pending reservation.
    a.compact().unwrap();
    let (z, _) = a.alloc(5 * C).unwrap(); // pages 2..7 (0..2 are pending)
    assert_eq!(&read_at(&d, x_ptr), b"pending!");
    // No room left but in the pending pages: waits for it, then compacts.
    let (w, _) = a.alloc(C).unwrap();
    assert_eq!(d.events_waited(), 0, "page 7 was free");
    a.free(w).unwrap();
    let (w, _) = a.alloc(2 * C).unwrap();
    assert_eq!(d.events_waited(), 1, "only the pending free's pages could serve");
    a.free(z).unwrap();
    a.free(w).unwrap();
    check(&a);
}

#[test]
fn failed_event_polls_waits_and_destroys_lose_nothing() {
    let (d, a) = faulty_stream_arena(2, 16);
    let (x, _) = a.alloc(C).unwrap();
    let (y, _) = a.alloc(C).unwrap();
    // A failed poll: the free stays pending, and is reaped by a later poll.
    a.free_on_stream(x, 1).unwrap();
    d.inner().complete_all_events();
    d.fail_nth(Some(CallKind::Event), 1, FaultKind::Driver);
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, C, "not seen complete yet");
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, 0);
    // A failed destroy: the memory is reaped all the same (one event leaks).
    a.free_on_stream(y, 1).unwrap();
    d.inner().complete_all_events();
    d.fail_nth(Some(CallKind::Event), 2, FaultKind::Driver);
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, 0);
    check(&a);
    // A failed wait: the request fails with it, the free stays pending.
    let (z, _) = a.alloc(2 * C).unwrap();
    a.free_on_stream(z, 3).unwrap();
    let before = Snap::of(&a).without_driver_counters();
    // The alloc's first poll and the out-of-memory poll pass, the wait fails.
    d.fail_nth(Some(CallKind::Event), 3, FaultKind::Driver);
    assert!(matches!(a.alloc(C), Err(Error::Driver { .. })));
    assert_eq!(Snap::of(&a).without_driver_counters(), before);
    let (w, _) = a.alloc(C).unwrap();
    assert_eq!(a.stats().unwrap().event_waits, 1);
    a.free(w).unwrap();
    check(&a);
}

#[test]
fn a_shared_chunk_freed_on_a_stream_stays_with_its_other_holder() {
    let (d, a) = arena(8, 32);
    let (src, src_ptr) = a.alloc(2 * C).unwrap();
    a.write(src, 0, b"shared 0").unwrap();
    let (sh, sh_ptr) = a.alloc_shared(src, 0, C, 2 * C).unwrap();
    a.free_on_stream(src, 1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.pending_free_bytes, C, "only src's second chunk waits: the first backs `sh` too");
    assert_eq!(s.mapped_bytes, C);
    check(&a);
    let mut out = [0u8; 8];
    a.read(sh, 0, &mut out).unwrap();
    assert_eq!(&out, b"shared 0");
    assert_eq!(&read_at(&d, src_ptr + C), &[0u8; 8], "src's own chunk is still mapped where it was");
    d.complete_all_events();
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.mapped_bytes), (0, C));
    a.read(sh, 0, &mut out).unwrap();
    assert_eq!(&out, b"shared 0");
    assert_eq!(a.query(sh).unwrap().ptr, sh_ptr);
    a.free(sh).unwrap();
    a.release_retired().unwrap();
    check(&a);
}

/// A failed operation changes no allocation, but the frees it reaped (or
/// waited for) on its way to the out-of-memory are given back down to the
/// retain watermark, as after any other operation.
#[test]
fn an_out_of_memory_that_reaped_stream_frees_keeps_the_retain_watermark() {
    let d = Arc::new(MockDriver::with_streams(C, 1 << 30));
    let cfg = ArenaConfig {
        capacity_bytes: 4 * C,
        reserve_bytes: 16 * C,
        chunk_bytes: C,
        retain_bytes: C,
        ..Default::default()
    };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let (x, _) = a.alloc(3 * C).unwrap();
    a.free_on_stream(x, 7).unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, 3 * C, "pooled, not yet reusable");
    assert!(matches!(a.alloc(5 * C), Err(Error::OutOfMemory(_))));
    let s = a.stats().unwrap();
    assert_eq!(s.event_waits, 1, "nothing else could serve: the oldest event was waited for");
    assert_eq!(s.pending_free_bytes, 0);
    assert!(s.pooled_bytes <= C, "pool above retain_bytes after a failed operation: {s:?}");
    check(&a);
}

/// An out-of-memory waits only for a stream free that gives memory back:
/// a free whose chunks another allocation still maps returns none, and
/// waiting for it would drain the device for nothing (the kv_serving
/// replay's failed admissions, freed on the stream with their shared
/// prefix, drained 973 steps so). Running out of address space still
/// waits for it: its reservation comes back.
#[test]
fn an_out_of_memory_does_not_wait_for_a_free_that_returns_no_memory() {
    let (d, a) = arena(4, 64);
    let (src, _) = a.alloc(2 * C).unwrap();
    let (sh, _) = a.alloc_shared(src, 0, 2 * C, 4 * C).unwrap();
    a.free_on_stream(sh, 1).unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, 0, "its chunks back `src`");
    let before = Snap::of(&a).without_driver_counters();
    assert!(matches!(a.alloc(3 * C), Err(Error::OutOfMemory(_))));
    assert_eq!((a.stats().unwrap().event_waits, d.events_waited()), (0, 0), "no wait for a free that frees no chunk");
    assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing changed");
    assert_eq!(d.events().len(), 1, "still pending");
    // A free that does return memory is still waited for.
    let (x, _) = a.alloc(2 * C).unwrap();
    a.free_on_stream(x, 1).unwrap();
    a.alloc(2 * C).unwrap();
    assert_eq!(a.stats().unwrap().event_waits, 1, "x's chunks were worth the wait");
    check(&a);
}

/// Running out of address space waits for any pending free of whole
/// chunks: each gives its reservation back.
#[test]
fn running_out_of_address_space_waits_for_a_free_of_shared_chunks() {
    let (_d, a) = arena(16, 8);
    let (src, _) = a.alloc(2 * C).unwrap();
    let (sh, _) = a.alloc_shared(src, 0, 2 * C, 6 * C).unwrap();
    a.free_on_stream(sh, 1).unwrap();
    // Two pages of address space are left; four are needed.
    a.alloc(4 * C).unwrap();
    assert_eq!(a.stats().unwrap().event_waits, 1, "the reservation came back");
    check(&a);
}
