//! Same-stream reuse (`alloc_on_stream`, growth by `resize_on_stream`),
//! checked on the mock driver's streams, whose queued writes run only when
//! the device gets past them:
//!
//! - memory freed or shrunk on stream S serves an allocation ordered on S
//!   at once: no event wait, no device synchronize, no unmap of the old
//!   address until the free's event completes;
//! - memory given up on another stream is reused only after its event
//!   (the arena waits for it when nothing else can serve);
//! - a reused chunk's bytes are never written by the old owner's queued
//!   work, and the emulation shows the violation when the rule is broken
//!   (`ignore_stream_order_for_tests`);
//! - a page another stream's shrink left is adopted only after that
//!   shrink's event, and on the shrink's own stream at once;
//! - a property test over random operations on two streams with queued
//!   writes (fixed-size and growable allocations): every live allocation
//!   holds exactly its own bytes, no queued write faults, an operation
//!   never waits on its own stream's events, and an allocation whose
//!   reservation lies in a free range of cached chunks adopts them with no
//!   driver call.

mod common;

use std::sync::Arc;

use common::fixtures::{faulty_stream_arena, stream_arena, STREAM_CHUNK};
use common::{driver_calls, Snap};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::{CallKind, Driver};
use vmm_arena::{Arena, Error, Id};

const C: u64 = STREAM_CHUNK;

fn read_at(d: &MockDriver, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    d.read(addr, &mut out).unwrap();
    out
}

/// An allocation `x` of `pages` chunks whose owner queued a write of 0xAA
/// over it on stream 1 (not yet run), then freed it on stream 1.
fn freed_with_queued_work(d: &MockDriver, a: &Arena, pages: u64) -> u64 {
    let (x, x_ptr) = a.alloc_on_stream(pages * C, 1).unwrap();
    d.enqueue_write(1, x_ptr, &vec![0xAA; (pages * C) as usize]).unwrap();
    a.free_on_stream(x, 1).unwrap();
    x_ptr
}

#[test]
fn same_stream_reuse_never_waits_and_defers_only_the_old_unmap() {
    // Capacity of two chunks, both held by the pending free.
    let (d, a) = stream_arena(2, 16);
    let x_ptr = freed_with_queued_work(&d, &a, 2);
    let before = a.stats().unwrap();
    // Growable (another kind of reservation): it cannot take x over in
    // place, so it takes x's chunks to its own address.
    let (y, y_ptr) = a.alloc_growable_on_stream(2 * C, 4 * C, 1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(d.events_waited(), 0, "same stream: no event wait");
    assert_eq!(s.driver_syncs, before.driver_syncs, "same stream: no synchronize");
    assert_eq!(s.driver_unmaps, before.driver_unmaps, "the old address stays mapped");
    assert_eq!(s.driver_creates, before.driver_creates, "the freed chunks serve it");
    assert_eq!(a.stream_reused_chunks().unwrap(), 2);
    assert_ne!(y_ptr, x_ptr);
    // The new owner's work, queued after the old owner's on the same stream.
    d.enqueue_write(1, y_ptr, &vec![0xBB; (2 * C) as usize]).unwrap();
    d.complete_stream(1);
    assert!(d.faults().is_empty(), "the old owner's write found its address mapped: {:?}", d.faults());
    assert!(read_at(&d, y_ptr, (2 * C) as usize).iter().all(|&b| b == 0xBB), "stream order: the new owner wrote last");
    // The event completed: `maintain` unmaps the old address (one call for
    // the run of two pages), with no synchronize.
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_unmaps, before.driver_unmaps + 1, "the deferred unmap ran");
    assert_eq!(s.driver_syncs, before.driver_syncs);
    assert_eq!(d.live_mappings(), 2, "only the new address maps the chunks");
    assert_eq!(s.pending_free_bytes, 0);
    Snap::of(&a).check_structure(a.va_range());
    a.free(y).unwrap();
}

#[test]
fn a_trim_gives_nothing_back_that_an_old_address_still_maps() {
    // y takes x's chunks by same-stream reuse; x's old address stays mapped
    // until x's free event completes. y is freed and everything trimmed
    // while that event is still pending: giving the chunks back must unmap
    // the old address too (after the device wait it needs), or the
    // driver's memory outlives the release (the stand-in found 4 such
    // mappings left after the model test's teardown).
    let (d, a) = stream_arena(2, 16);
    let x_ptr = freed_with_queued_work(&d, &a, 2);
    let (y, y_ptr) = a.alloc_growable_on_stream(2 * C, 4 * C, 1).unwrap();
    assert_ne!(y_ptr, x_ptr);
    assert_eq!(Snap::of(&a).deferred_unmap_pages, 2);
    a.free(y).unwrap();
    a.trim(0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, 0));
    assert_eq!(Snap::of(&a).deferred_unmap_pages, 0, "the old address is unmapped");
    assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0), "nothing left on the driver");
    assert!(d.faults().is_empty(), "queued work found its memory gone: {:?}", d.faults());
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn an_allocation_freed_on_the_stream_is_taken_over_in_place_with_no_driver_call() {
    let (d, a) = stream_arena(2, 16);
    let (x, x_ptr) = a.alloc_growable_on_stream(2 * C, 8 * C, 1).unwrap();
    d.enqueue_write(1, x_ptr, &vec![0xAA; (2 * C) as usize]).unwrap();
    a.free_on_stream(x, 1).unwrap();
    let before = a.stats().unwrap();
    let (y, y_ptr) = a.alloc_growable_on_stream(C + 1, 8 * C, 1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(y_ptr, x_ptr, "the same reservation, where it is");
    assert_ne!(y, x);
    assert!(a.query(x).is_err(), "the old id stays dead");
    let calls = |s: &vmm_arena::Stats| s.driver_creates + s.driver_maps + s.driver_unmaps + s.driver_syncs;
    assert_eq!((calls(&s), d.events_waited()), (calls(&before), 0), "no driver call, no wait");
    assert_eq!((s.live_allocations, s.live_bytes), (1, C + 1));
    assert_eq!(a.stream_reused_chunks().unwrap(), 2);
    d.enqueue_write(1, y_ptr, &vec![0xBB; (C + 1) as usize]).unwrap();
    d.complete_stream(1);
    assert!(d.faults().is_empty(), "{:?}", d.faults());
    assert!(read_at(&d, y_ptr, (C + 1) as usize).iter().all(|&b| b == 0xBB));
    a.maintain().unwrap();
    // Its second chunk, beyond its size, is cached and known idle now.
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.idle_cached_bytes), (0, 0), "grown back: {s:?}");
    a.resize_on_stream(y, 2 * C, 1).unwrap();
    assert_eq!(a.stats().unwrap().driver_maps, before.driver_maps, "its own cached chunk, adopted");
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn growth_on_the_same_stream_steals_a_shrunk_entrys_chunks_without_a_synchronize() {
    let (d, a) = stream_arena(4, 32);
    // A prefix entry of 3 chunks; its owner queued a write over it on 1.
    let (e, e_ptr) = a.alloc_growable_on_stream(3 * C, 8 * C, 1).unwrap();
    d.enqueue_write(1, e_ptr, &vec![0xAA; (3 * C) as usize]).unwrap();
    let (g, g_ptr) = a.alloc_growable_on_stream(C, 8 * C, 1).unwrap();
    // Evicting the entry's tail on stream 1: two chunks cached, not idle.
    a.resize_on_stream(e, C, 1).unwrap();
    let before = a.stats().unwrap();
    // g grows by two chunks, both stolen from e (the capacity is spent).
    a.resize_on_stream(g, 3 * C, 1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_syncs, before.driver_syncs, "no synchronize to steal on the same stream");
    assert_eq!(d.events_waited(), 0);
    assert_eq!(s.driver_unmaps, before.driver_unmaps, "the stolen pages' unmap is deferred");
    assert_eq!(a.stream_reused_chunks().unwrap(), 2);
    d.enqueue_write(1, g_ptr, &vec![0xBB; (3 * C) as usize]).unwrap();
    d.complete_stream(1);
    assert!(d.faults().is_empty(), "{:?}", d.faults());
    assert!(read_at(&d, g_ptr, (3 * C) as usize).iter().all(|&b| b == 0xBB));
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().driver_unmaps, before.driver_unmaps + 1, "one call for the run of two pages");
    // e grows back into its reservation (the deferred pages are unmapped).
    a.release_retired().unwrap();
    a.free(g).unwrap();
    a.resize(e, 3 * C).unwrap();
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn a_batch_grown_on_the_same_stream_reuses_without_waiting() {
    // Capacity of four chunks: two live growables, two chunks freed on 1.
    let (d, a) = stream_arena(4, 32);
    let (g, g_ptr) = a.alloc_growable_on_stream(C, 8 * C, 1).unwrap();
    let (h, h_ptr) = a.alloc_growable_on_stream(C, 8 * C, 1).unwrap();
    freed_with_queued_work(&d, &a, 2);
    let before = a.stats().unwrap();
    let ptrs = a.resize_many_on_stream(&[(g, 2 * C), (h, 2 * C)], 1).unwrap();
    assert_eq!(ptrs, vec![g_ptr, h_ptr]);
    let s = a.stats().unwrap();
    assert_eq!((d.events_waited(), s.driver_syncs - before.driver_syncs), (0, 0));
    assert_eq!(a.stream_reused_chunks().unwrap(), 2);
    d.enqueue_write(1, g_ptr, &vec![0xBB; (2 * C) as usize]).unwrap();
    d.enqueue_write(1, h_ptr, &vec![0xCC; (2 * C) as usize]).unwrap();
    d.complete_stream(1);
    assert!(d.faults().is_empty(), "{:?}", d.faults());
    assert!(read_at(&d, g_ptr, (2 * C) as usize).iter().all(|&b| b == 0xBB));
    assert!(read_at(&d, h_ptr, (2 * C) as usize).iter().all(|&b| b == 0xCC));
    // The same batch on another stream waits instead.
    let (d, a) = stream_arena(4, 32);
    let (g, _) = a.alloc_growable_on_stream(C, 8 * C, 2).unwrap();
    let (h, _) = a.alloc_growable_on_stream(C, 8 * C, 2).unwrap();
    freed_with_queued_work(&d, &a, 2);
    a.resize_many_on_stream(&[(g, 2 * C), (h, 2 * C)], 2).unwrap();
    assert_eq!((d.events_waited(), a.stream_reused_chunks().unwrap()), (1, 0));
}

#[test]
fn cross_stream_reuse_waits_for_the_event() {
    let (d, a) = stream_arena(2, 16);
    let _x_ptr = freed_with_queued_work(&d, &a, 2);
    let (y, y_ptr) = a.alloc_on_stream(2 * C, 2).unwrap();
    assert_eq!(d.events_waited(), 1, "another stream: the arena waited for the free's event");
    assert_eq!(a.stream_reused_chunks().unwrap(), 0);
    d.enqueue_write(2, y_ptr, &vec![0xBB; (2 * C) as usize]).unwrap();
    d.complete_all_events();
    assert!(d.faults().is_empty(), "{:?}", d.faults());
    assert!(read_at(&d, y_ptr, (2 * C) as usize).iter().all(|&b| b == 0xBB), "the old owner's write ran first");
    a.free(y).unwrap();
}

#[test]
fn breaking_the_rule_is_detected_by_the_emulation() {
    // The same sequence as `cross_stream_reuse_waits_for_the_event`, with
    // the rule switched off: the new owner on stream 2 takes the chunks at
    // once, and the old owner's queued write lands in its memory.
    let (d, a) = stream_arena(2, 16);
    freed_with_queued_work(&d, &a, 2);
    a.ignore_stream_order_for_tests(true).unwrap();
    let (_y, y_ptr) = a.alloc_on_stream(2 * C, 2).unwrap();
    assert_eq!(d.events_waited(), 0, "broken rule: no wait");
    d.enqueue_write(2, y_ptr, &vec![0xBB; (2 * C) as usize]).unwrap();
    d.complete_stream(2);
    d.complete_stream(1);
    let bytes = read_at(&d, y_ptr, (2 * C) as usize);
    assert!(bytes.contains(&0xAA), "the emulation shows the old owner's write in the new owner's memory");
}

#[test]
fn small_allocations_do_not_reuse_by_stream() {
    let (d, a) = stream_arena(1, 16);
    freed_with_queued_work(&d, &a, 1);
    // A slab serves objects of any stream: it waits as `alloc` does.
    let (_s, _) = a.alloc_on_stream(256, 1).unwrap();
    assert_eq!((a.stream_reused_chunks().unwrap(), d.events_waited()), (0, 1));
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        pages: u64,
        stream: u64,
        /// `alloc_on_stream` (a reservation of its size: a freed one
        /// leaves a range of cached chunks the next fits in) rather than
        /// a growable one of 8 chunks.
        fixed: bool,
    },
    // Growth, shrinks and frees are ordered on the allocation's own stream.
    Grow {
        i: usize,
        pages: u64,
    },
    Shrink {
        i: usize,
        pages: u64,
    },
    Free {
        i: usize,
    },
    Complete(u64),
    /// Every live allocation freed on its stream, then `trim(0)` while
    /// their events (and those before) may be pending: what stays on the
    /// driver is what the frees still hold, and no chunk given back is
    /// still mapped at an old address of same-stream reuse.
    FreeAllAndTrim,
}

fn op() -> impl Strategy<Value = Op> {
    let s = 1..=2u64;
    prop_oneof![
        3 => (1..=3u64, s.clone(), any::<bool>()).prop_map(|(pages, stream, fixed)| Op::Alloc { pages, stream, fixed }),
        2 => (any::<usize>(), 1..=3u64).prop_map(|(i, pages)| Op::Grow { i, pages }),
        2 => (any::<usize>(), 1..=3u64).prop_map(|(i, pages)| Op::Shrink { i, pages }),
        3 => any::<usize>().prop_map(|i| Op::Free { i }),
        1 => s.prop_map(Op::Complete),
        1 => Just(Op::FreeAllAndTrim),
    ]
}

/// A live allocation of the property test: its id, stream, and the byte
/// its owner's queued writes fill it with.
struct Live {
    id: Id,
    stream: u64,
    fill: u8,
    pages: u64,
}

/// Every live allocation's work is a queued write of its own byte over
/// all of it (after each growth). At the end, once every stream ran, each
/// holds exactly its own byte: no earlier owner's queued write landed in
/// it. An operation never waits for an event of its own stream while its
/// stream's given-up memory could serve it.
fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_with(ops, false).map(|_| ())
}

/// [`run`], with the rule broken when `broken`; the number of
/// allocations that adopted cached chunks where they lay (each checked to
/// make no driver call).
fn run_with(ops: Vec<Op>, broken: bool) -> Result<u64, TestCaseError> {
    let (d, a): (Arc<MockDriver>, Arena) = stream_arena(6, 64);
    let mut adopted = 0u64;
    a.ignore_stream_order_for_tests(broken).unwrap();
    let mut live: Vec<Live> = Vec::new();
    let mut next_fill = 1u8;
    for op in ops {
        match op.clone() {
            Op::Alloc { pages, stream, fixed } => {
                let (before, s0) = (Snap::of(&a), a.stats().unwrap());
                let made = if fixed {
                    a.alloc_on_stream(pages * C, stream)
                } else {
                    a.alloc_growable_on_stream(pages * C, 8 * C, stream)
                };
                if let Ok((id, ptr)) = made {
                    // A reservation inside a free range whose every page
                    // holds a cached chunk takes them where they lie: no
                    // driver call. (A page another stream's shrink left,
                    // its event pending, is taken after waiting for it: the
                    // byte checks below hold that to account.)
                    let reserved = a.query(id).unwrap().reserved_bytes;
                    if before.cached_free_covers(ptr, reserved) {
                        adopted += 1;
                        prop_assert_eq!(
                            driver_calls(&a.stats().unwrap()),
                            driver_calls(&s0),
                            "adoption at {:#x} called the driver",
                            ptr
                        );
                    }
                    let fill = next_fill;
                    next_fill = next_fill.wrapping_add(1).max(1);
                    d.enqueue_write(stream, ptr, &vec![fill; (pages * C) as usize]).unwrap();
                    live.push(Live { id, stream, fill, pages });
                }
            }
            Op::Grow { i, pages } if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                let to = (l.pages + pages).min(8);
                if let Ok(ptr) = a.resize_on_stream(l.id, to * C, l.stream) {
                    l.pages = to;
                    d.enqueue_write(l.stream, ptr, &vec![l.fill; (to * C) as usize]).unwrap();
                }
            }
            Op::Shrink { i, pages } if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                let to = l.pages.saturating_sub(pages).max(1);
                a.resize_on_stream(l.id, to * C, l.stream).unwrap();
                l.pages = to;
            }
            Op::Free { i } if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                a.free_on_stream(l.id, l.stream).unwrap();
            }
            Op::Complete(stream) => d.complete_stream(stream),
            Op::FreeAllAndTrim => {
                for l in live.drain(..) {
                    a.free_on_stream(l.id, l.stream).unwrap();
                }
                a.trim(0).unwrap();
                let s = a.stats().unwrap();
                // Pooled is what the pending frees hold (`pooled_bytes`
                // counts them), nothing else.
                prop_assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, s.pending_free_bytes));
                prop_assert_eq!(d.live_chunks() as u64 * C, s.pending_free_bytes, "chunks beyond the pending frees");
            }
            _ => {}
        }
        prop_assert_eq!(d.released_but_mapped(), 0, "a chunk was given back while still mapped ({:?})", op);
        let snap = Snap::of(&a);
        prop_assert_eq!(d.live_mappings() as u64, snap.mapped_pages(), "driver mappings vs mapped pages ({:?})", op);
        snap.check_structure(a.va_range());
    }
    // The streams finish in either order on a device; stream 2's work
    // first is the order in which a lagging stream-1 write would land last.
    d.complete_stream(2);
    d.complete_stream(1);
    prop_assert!(d.faults().is_empty(), "queued writes faulted: {:?}", d.faults());
    for l in &live {
        let mut got = vec![0u8; (l.pages * C) as usize];
        a.read(l.id, 0, &mut got).unwrap();
        prop_assert!(got.iter().all(|&b| b == l.fill), "allocation {:?} holds another owner's bytes", l.id);
    }
    a.maintain().unwrap();
    for l in live {
        a.free(l.id).unwrap();
    }
    Ok(adopted)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn reused_memory_is_never_written_by_its_old_owners_work(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}

#[test]
fn the_search_reaches_adoption_in_place() {
    // A fixed-seed search: the property's adoption check runs, not only
    // its byte checks.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(op(), 1..60);
    let mut adopted = 0;
    for _ in 0..96 {
        let ops = strategy.new_tree(&mut runner).unwrap().current();
        adopted += run_with(ops, false).unwrap();
    }
    assert!(adopted > 0, "no allocation of the search adopted cached chunks in place");
}

#[test]
fn the_property_catches_a_broken_rule() {
    // Six chunks on stream 1 fill the capacity; one is freed on stream 1
    // and an allocation on stream 2 needs it.
    let mut ops: Vec<Op> = (0..6).map(|_| Op::Alloc { pages: 1, stream: 1, fixed: false }).collect();
    ops.push(Op::Free { i: 0 });
    ops.push(Op::Alloc { pages: 1, stream: 2, fixed: false });
    assert!(run_with(ops.clone(), false).is_ok());
    let broken = run_with(ops, true);
    assert!(broken.is_err(), "the old owner's queued write must show in the new owner's bytes");
}

#[test]
fn a_fixed_allocations_tail_shrunk_on_its_stream_stays_mapped_until_its_event() {
    // A one-chunk allocation grown in place to two on stream 1, written
    // there by queued work, then shrunk back on stream 1: its dropped page
    // leaves its reservation (a fixed one is its size), but stream 1's
    // queued write still reaches it. Another stream's allocation may not
    // unmap or take it before the shrink's event completes.
    let (d, a) = stream_arena(6, 64);
    let (x, x_ptr) = a.alloc_on_stream(C, 1).unwrap();
    assert_eq!(a.resize_on_stream(x, 2 * C, 1).unwrap(), x_ptr, "grown in place");
    d.enqueue_write(1, x_ptr, &vec![0xAA; (2 * C) as usize]).unwrap();
    a.resize_on_stream(x, C, 1).unwrap();
    let (y, y_ptr) = a.alloc_growable_on_stream(C, 8 * C, 2).unwrap();
    d.enqueue_write(2, y_ptr, &vec![0xBB; C as usize]).unwrap();
    d.complete_stream(2);
    d.complete_stream(1);
    assert!(d.faults().is_empty(), "the old owner's queued write lost its page: {:?}", d.faults());
    assert!(read_at(&d, y_ptr, C as usize).iter().all(|&b| b == 0xBB), "the old owner's write ran into y");
    a.free(x).unwrap();
    a.free(y).unwrap();
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn a_page_another_streams_shrink_left_is_adopted_after_its_event_and_on_its_stream_at_once() {
    for (stream, waits) in [(2u64, 1u64), (1, 0)] {
        // Capacity of two chunks: x's one and the page its shrink left
        // (cached where it lies, stream 1's write still queued on it).
        let (d, a) = stream_arena(2, 64);
        let (x, x_ptr) = a.alloc_on_stream(C, 1).unwrap();
        a.resize_on_stream(x, 2 * C, 1).unwrap();
        d.enqueue_write(1, x_ptr, &vec![0xAA; (2 * C) as usize]).unwrap();
        a.resize_on_stream(x, C, 1).unwrap();
        let before = a.stats().unwrap();
        let (y, y_ptr) = a.alloc_on_stream(C, stream).unwrap();
        let s = a.stats().unwrap();
        assert_eq!(y_ptr, x_ptr + C, "stream {stream}: the left page, where it lies");
        assert_eq!(driver_calls(&s), driver_calls(&before), "stream {stream}: adopted with no driver call");
        assert_eq!(d.events_waited(), waits, "stream {stream}: waits for the shrink's event only from another stream");
        d.enqueue_write(stream, y_ptr, &vec![0xBB; C as usize]).unwrap();
        d.complete_stream(2);
        d.complete_stream(1);
        assert!(d.faults().is_empty(), "{:?}", d.faults());
        assert!(
            read_at(&d, y_ptr, C as usize).iter().all(|&b| b == 0xBB),
            "stream {stream}: the old owner's write ran into y"
        );
        a.free(x).unwrap();
        a.free(y).unwrap();
    }
}

#[test]
fn a_failed_wait_before_adopting_a_busy_page_leaves_the_arena_as_it_was() {
    // As above, from stream 2: the adoption's wait for stream 1's shrink
    // event fails (each event call in turn: a failed poll reads as "not
    // complete" and is absorbed; the failed wait fails the allocation).
    let mut failed = 0;
    for n in 1..=4 {
        let (d, a) = faulty_stream_arena(2, 64);
        let (x, _) = a.alloc_on_stream(C, 1).unwrap();
        a.resize_on_stream(x, 2 * C, 1).unwrap();
        a.resize_on_stream(x, C, 1).unwrap();
        let before = Snap::of(&a).without_driver_counters();
        d.fail_nth(Some(CallKind::Event), n, FaultKind::Driver);
        match a.alloc_on_stream(C, 2) {
            Ok((y, _)) => a.free(y).unwrap(),
            Err(e) => {
                failed += 1;
                assert!(matches!(e, Error::Driver { .. }), "{e}");
                assert_eq!(Snap::of(&a).without_driver_counters(), before, "nothing changed");
                d.clear();
                a.alloc_on_stream(C, 2).unwrap();
                assert_eq!(a.stats().unwrap().event_waits, 1, "the retry waits and adopts");
            }
        }
        Snap::of(&a).check_structure(a.va_range());
    }
    assert!(failed > 0, "no event call of the adoption failed it");
}
