//! `Arena::quiesce_on_stream`, the caller's promise that no more device
//! work uses an allocation, checked through the mock driver's streams,
//! whose events complete only when the test says so:
//!
//! - once the promise's event has completed, what the allocation gives up
//!   (a free, a shrink, the old range of a move, the pages a sharer keeps)
//!   is known idle at once: another address takes its chunks without a
//!   synchronize or an event wait, and a `free_on_stream` of it records no
//!   event and holds nothing back;
//! - before the event, pages it gives up become idle when the event
//!   completes (wherever a move took it), unless taken back meanwhile;
//! - growth and sleep end the promise; a repeated promise, a small
//!   allocation and the host backend record no event; bad ids, sleepers and
//!   a failed record change nothing.

mod common;

use common::fixtures::{faulty_stream_arena, stream_arena, STREAM_CHUNK};
use common::Snap;
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Error, Id, Stats, ALL_TAGS};

const C: u64 = STREAM_CHUNK;

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

/// The events' completion, then a poll.
fn complete(d: &MockDriver, a: &Arena) {
    d.complete_all_events();
    a.maintain().unwrap();
}

/// Capacity 3, full: an entry of two chunks (bytes "kept" in it) and a
/// growable neighbour of one. `give_up` runs (it quiesces, completes
/// events, frees or shrinks the entry), then the neighbour grows by a
/// chunk, which it must steal from a page the entry gave up. Returns the
/// synchronizes and event waits that steal made.
fn steal_after(give_up: impl FnOnce(&MockDriver, &Arena, Id)) -> (u64, u64) {
    let (d, a) = stream_arena(3, 16);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    a.write(x, 0, b"kept").unwrap();
    let (b, _) = a.alloc_growable(C, 4 * C).unwrap();
    give_up(&d, &a, x);
    let before = a.stats().unwrap();
    a.resize(b, 2 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.driver_unmaps - before.driver_unmaps, s.driver_creates - before.driver_creates), (1, 0), "stolen");
    check(&a);
    (s.driver_syncs - before.driver_syncs, s.event_waits - before.event_waits)
}

#[test]
fn a_quiesced_allocations_pages_are_stolen_without_a_synchronize_once_its_event_completes() {
    let freed = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        complete(d, a);
        a.free(x).unwrap();
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 2 * C, "both pages known idle at the free");
    });
    assert_eq!(freed, (0, 0), "known idle: neither a synchronize nor a wait");
    let shrunk = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        complete(d, a);
        let shrinks = a.stats().unwrap().stream_shrinks;
        a.resize_on_stream(x, C, 1).unwrap();
        let s = a.stats().unwrap();
        assert_eq!(s.stream_shrinks, shrinks, "the promise covers the shrink: no event");
        assert_eq!(s.idle_cached_bytes, C);
        let mut kept = [0u8; 4];
        a.read(x, 0, &mut kept).unwrap();
        assert_eq!(&kept, b"kept", "the contents stay");
    });
    assert_eq!(shrunk, (0, 0));
    let plain_shrink = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        complete(d, a);
        a.resize(x, C).unwrap();
    });
    assert_eq!(plain_shrink, (0, 0), "a plain shrink of a quiesced allocation too");
    // Without the promise, a plain free: a synchronize first, as before.
    assert_eq!(steal_after(|_, a, x| a.free(x).unwrap()), (1, 0));
}

#[test]
fn before_its_event_the_pages_given_up_become_idle_when_it_completes() {
    // Freed before the event completes: as a plain free until it does.
    let early = steal_after(|_, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        a.free(x).unwrap();
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 0);
    });
    assert_eq!(early, (1, 0), "not known idle yet: a synchronize");
    let later = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        a.free(x).unwrap();
        complete(d, a);
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 2 * C, "idle once the event completed");
    });
    assert_eq!(later, (0, 0));
    let shrunk = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        a.resize_on_stream(x, C, 1).unwrap();
        assert_eq!(a.stats().unwrap().stream_shrinks, 0, "the promise's event covers it");
        complete(d, a);
        assert_eq!(a.stats().unwrap().idle_cached_bytes, C);
    });
    assert_eq!(shrunk, (0, 0));
}

#[test]
fn growth_ends_the_promise_and_a_page_taken_back_is_not_made_idle() {
    let grown = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        complete(d, a);
        a.resize(x, C).unwrap();
        a.resize(x, 2 * C).unwrap(); // takes the page back: new work
        a.free(x).unwrap();
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "the promise ended with the growth");
    });
    assert_eq!(grown, (1, 0));
    let retaken = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        a.resize(x, C).unwrap(); // listed to become idle with the event
        a.resize(x, 2 * C).unwrap(); // taken back before it completes
        a.resize(x, C).unwrap();
        complete(d, a);
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "the event says nothing of the new work");
    });
    assert_eq!(retaken, (1, 0));
    let resumed = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        complete(d, a);
        a.unquiesce(x).unwrap(); // new work, no growth: a take-over
        a.resize(x, C).unwrap();
        assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "unquiesce ended the promise");
    });
    assert_eq!(resumed, (1, 0));
    let kept_before = steal_after(|d, a, x| {
        a.quiesce_on_stream(x, 1).unwrap();
        a.resize(x, C).unwrap(); // given up under the promise
        a.unquiesce(x).unwrap();
        complete(d, a);
        assert_eq!(a.stats().unwrap().idle_cached_bytes, C, "what it gave up before stays covered");
    });
    assert_eq!(kept_before, (0, 0));
}

#[test]
fn unquiesce_refuses_unknown_ids_and_changes_nothing_else() {
    let (d, a) = stream_arena(4, 16);
    let (x, _) = a.alloc(C).unwrap();
    let (s, _) = a.alloc(100).unwrap();
    a.unquiesce(x).unwrap(); // no promise: nothing to end
    a.unquiesce(s).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    let (before, calls) = (Snap::of(&a).without_driver_counters(), a.stats().unwrap().caller_driver_calls);
    a.unquiesce(x).unwrap();
    assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing observable");
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls, "no driver call");
    a.free(x).unwrap();
    assert!(matches!(a.unquiesce(x), Err(Error::UnknownAllocation(_))));
    complete(&d, &a);
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "freed after unquiesce: not idle");
    check(&a);
}

#[test]
fn a_free_on_stream_of_a_quiesced_allocation_records_nothing_and_holds_nothing_back() {
    let (d, a) = stream_arena(2, 16);
    let (x, _) = a.alloc(2 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    assert_eq!(a.stats().unwrap().quiesces, 1);
    complete(&d, &a);
    assert!(d.events().is_empty(), "the promise's event was reaped and destroyed");
    a.free_on_stream(x, 1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.stream_frees, s.pending_free_bytes, s.idle_cached_bytes), (0, 0, 2 * C));
    assert!(d.events().is_empty());
    assert!(matches!(a.query(x), Err(Error::UnknownAllocation(_))), "the id is dead");
    // The whole capacity serves at once: no wait, no synchronize.
    let (_y, _) = a.alloc(2 * C).unwrap();
    let after = a.stats().unwrap();
    assert_eq!((after.event_waits, after.driver_syncs), (0, s.driver_syncs));
    check(&a);
}

#[test]
fn a_free_on_stream_before_the_event_completes_is_an_ordinary_stream_free() {
    let (d, a) = stream_arena(4, 16);
    let (x, _) = a.alloc(2 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    a.free_on_stream(x, 1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.stream_frees, s.pending_free_bytes), (1, 2 * C), "held until its own event");
    complete(&d, &a);
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.idle_cached_bytes), (0, 2 * C));
    assert!(d.events().is_empty(), "both events destroyed");
    check(&a);
}

#[test]
fn a_sharers_pages_keep_the_chunks_and_the_quiesced_source_leaves_them_idle() {
    // The prefix-cache pattern: a finished request's entry is quiesced, a
    // new request maps its first chunk, the entry is evicted. The entry's
    // page that the new request still maps is retired; it is idle, so
    // releasing it (its address space is needed) needs no synchronize.
    let (d, a) = stream_arena(4, 6);
    let (entry, _) = a.alloc_growable(2 * C, 2 * C).unwrap();
    a.write(entry, 0, b"prefix").unwrap();
    a.quiesce_on_stream(entry, 1).unwrap();
    complete(&d, &a);
    let (sharer, _) = a.alloc_shared(entry, 0, C, 2 * C).unwrap();
    a.free(entry).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.retired_va_bytes, s.idle_cached_bytes), (C, C), "one page retired, one cached, both idle");
    let mut got = [0u8; 6];
    a.read(sharer, 0, &mut got).unwrap();
    assert_eq!(&got, b"prefix");
    let syncs = s.driver_syncs;
    // Four of six pages of address space are needed: the retired one goes.
    let (_z, _) = a.alloc(2 * C).unwrap();
    let _ = a.alloc_growable(C, 2 * C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.driver_syncs - syncs, s.event_waits), (0, 0), "idle pages: no synchronize");
    a.read(sharer, 0, &mut got).unwrap();
    assert_eq!(&got, b"prefix", "the sharer keeps the chunk");
    check(&a);
}

#[test]
fn a_moved_quiesced_allocations_old_range_is_released_without_a_synchronize() {
    let (d, a) = stream_arena(8, 8);
    let (hole, _) = a.alloc(2 * C).unwrap();
    let (x, old) = a.alloc(2 * C).unwrap();
    a.write(x, 0, b"moved").unwrap();
    // The hole's pages are idle too (a completed stream free), so the
    // move steals them without a synchronize: only the old range counts.
    a.free_on_stream(hole, 1).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    complete(&d, &a);
    let syncs = a.stats().unwrap().driver_syncs;
    let report = a.compact().unwrap();
    assert_eq!(report.moved_allocations, 1);
    assert_ne!(a.query(x).unwrap().ptr, old);
    assert_eq!(a.stats().unwrap().driver_syncs, syncs, "its old range is idle: released without a synchronize");
    let mut got = [0u8; 5];
    a.read(x, 0, &mut got).unwrap();
    assert_eq!(&got, b"moved");
    // The promise survives the move: its free leaves its pages idle.
    a.free(x).unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 2 * C);
    check(&a);
}

/// The promise's event covers the allocation wherever it lies: moved by a
/// compaction before the event completes, then freed, the pages it gives
/// up at its new place become idle with the event (the promise once made
/// idle only the pages the allocation had when it was quiesced).
#[test]
fn moved_before_its_event_the_pages_it_gives_up_at_its_new_place_become_idle_when_it_completes() {
    let (d, a) = stream_arena(8, 16);
    let (hole, _) = a.alloc(2 * C).unwrap(); // pages 0..2
    let (x, old) = a.alloc(2 * C).unwrap(); // pages 2..4
    a.write(x, 0, b"kv").unwrap();
    a.free(hole).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    assert_eq!(a.compact().unwrap().moved_allocations, 1, "x slides down into the hole");
    assert_ne!(a.query(x).unwrap().ptr, old);
    let mut got = [0u8; 2];
    a.read(x, 0, &mut got).unwrap();
    assert_eq!(&got, b"kv");
    a.free(x).unwrap(); // its pages at the new place, before the event completes
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "not idle before the event");
    complete(&d, &a);
    let s = a.stats().unwrap();
    assert!(s.cached_mapped_bytes >= 2 * C, "x's chunks stay cached: {s:?}");
    assert_eq!(s.idle_cached_bytes, s.cached_mapped_bytes, "every page x gave up is idle: {s:?}");
    check(&a);
}

#[test]
fn repeated_promises_small_allocations_and_failures_record_nothing() {
    let (d, a) = stream_arena(8, 16);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    a.quiesce_on_stream(x, 2).unwrap();
    complete(&d, &a);
    a.quiesce_on_stream(x, 1).unwrap();
    assert_eq!(a.stats().unwrap().quiesces, 1, "one promise, one event");
    let (s, _) = a.alloc(100).unwrap();
    a.quiesce_on_stream(s, 1).unwrap();
    a.free(x).unwrap();
    assert!(matches!(a.quiesce_on_stream(x, 1), Err(Error::UnknownAllocation(_))));
    let (y, _) = a.alloc_growable(C, 2 * C).unwrap();
    a.set_tag(y, 3).unwrap();
    a.sleep(3, 0).unwrap();
    let before = Snap::of(&a).without_driver_counters();
    assert!(matches!(a.quiesce_on_stream(y, 1), Err(Error::Asleep(_))));
    assert_eq!(Snap::of(&a).without_driver_counters(), before);
    assert_eq!(a.stats().unwrap().quiesces, 1);
    assert!(d.events().is_empty());
    check(&a);
}

#[test]
fn sleep_ends_the_promise() {
    let (d, a) = stream_arena(8, 16);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    complete(&d, &a);
    a.sleep(ALL_TAGS, vmm_arena::SLEEP_BACKUP).unwrap();
    a.wake(ALL_TAGS).unwrap();
    a.free(x).unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "woken: no promise");
    check(&a);
}

#[test]
fn a_failed_event_record_changes_nothing() {
    let (d, a) = faulty_stream_arena(4, 16);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    for kind in FaultKind::ALL {
        let before = Snap::of(&a).without_driver_counters();
        d.fail_nth(Some(CallKind::Event), 1, kind);
        let e = a.quiesce_on_stream(x, 1).unwrap_err();
        assert!(matches!(e, Error::Driver { .. } | Error::OutOfMemory(_)), "{e}");
        assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing changed");
        // No promise was made: a free leaves nothing idle.
        let stats: Stats = a.stats().unwrap();
        assert_eq!(stats.quiesces, 0);
    }
    a.quiesce_on_stream(x, 1).unwrap();
    assert_eq!(a.stats().unwrap().quiesces, 1);
}

#[test]
fn drop_destroys_a_pending_promises_event() {
    let (d, a) = stream_arena(4, 16);
    let (x, _) = a.alloc(2 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    assert_eq!(d.events().len(), 1);
    drop(a);
    assert!(d.events().is_empty());
    assert_eq!((d.live_chunks(), d.live_mappings(), d.live_reservations()), (0, 0, 0));
}

#[test]
#[cfg_attr(miri, ignore)] // system calls
fn on_the_host_backend_the_promise_holds_at_once() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 4 << 20, chunk_bytes: 1 << 20, ..Default::default() }).unwrap();
    let (x, _) = a.alloc(2 << 20).unwrap();
    a.quiesce_on_stream(x, 0).unwrap();
    a.free(x).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.quiesces, s.idle_cached_bytes), (0, 2 << 20), "no event; every call had completed");
}

#[test]
fn every_growth_ends_the_promise_batched_or_within_its_pages() {
    // resize_many's in-place path grows without resize.
    let (d, a) = stream_arena(8, 16);
    let (x, _) = a.alloc_growable(C, 4 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    complete(&d, &a);
    a.resize_many(&[(x, 3 * C)]).unwrap();
    a.free(x).unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "grown by resize_many: no promise");
    check(&a);
    // A larger size within the same chunk is growth too (new tokens are
    // written there).
    let (d, a) = stream_arena(8, 16);
    let (y, _) = a.alloc_growable(100, 4 * C).unwrap();
    a.quiesce_on_stream(y, 1).unwrap();
    complete(&d, &a);
    a.resize(y, C).unwrap();
    a.free(y).unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "grown within its page: no promise");
    let (z, _) = a.alloc_growable(100, 4 * C).unwrap();
    a.quiesce_on_stream(z, 1).unwrap();
    complete(&d, &a);
    a.resize_many(&[(z, C)]).unwrap();
    a.free(z).unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 0, "batched, within its page: no promise");
    check(&a);
}

#[test]
fn a_batched_shrink_of_a_quiesced_allocation_leaves_its_pages_idle() {
    let (d, a) = stream_arena(8, 16);
    let (x, _) = a.alloc_growable(3 * C, 4 * C).unwrap();
    a.quiesce_on_stream(x, 1).unwrap();
    complete(&d, &a);
    a.resize_many(&[(x, C)]).unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 2 * C, "as resize leaves them");
    check(&a);
}

#[test]
fn a_freed_slots_old_range_is_not_made_idle_by_the_next_owner_of_the_slot() {
    // A moves (its old range stays retired: work from before the move may
    // still use it) and is freed plainly; C takes A's slot and is freed on
    // a stream. C's event says nothing of A's old range.
    let (d, a) = stream_arena(16, 16);
    let (x, _) = a.alloc(C).unwrap();
    let (_b, _) = a.alloc(C).unwrap();
    a.resize(x, 2 * C).unwrap();
    assert_eq!(a.stats().unwrap().retired_va_bytes, C, "the old range is retired");
    a.free(x).unwrap();
    let (c, _) = a.alloc(C).unwrap();
    a.free_on_stream(c, 1).unwrap();
    complete(&d, &a);
    let syncs = a.stats().unwrap().driver_syncs;
    a.release_retired().unwrap();
    assert_eq!(a.stats().unwrap().driver_syncs, syncs + 1, "not known idle: a synchronize first");
    check(&a);
}
