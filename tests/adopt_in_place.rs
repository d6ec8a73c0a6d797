//! Adoption in place: chunks already mapped where a new owner needs them
//! are taken there, with no driver call (issue 40, item 1).
//!
//! - a range freed on the stream is adopted whole by the next allocation
//!   of its reservation, before and after the free's event completes;
//! - an evicted prefix entry (shrunk, then freed, on the stream) is
//!   adopted in place by the next admission;
//! - the old owner's pending work is respected: on another stream, the
//!   freed range is not adopted until its event completes;
//! - a live allocation's cached reservation tail is its own growth's:
//!   another allocation's growth takes a free range's cached chunks first;
//! - a freed range that joined a longer free range is adopted before an
//!   exact fit with nothing cached;
//! - a block pool of one-chunk allocations (a paged engine's blocks read
//!   through a block table) freed in any order serves later blocks from
//!   the same chunks, where they lie.

mod common;

use common::fixtures::{stream_arena, STREAM_CHUNK};
use common::{driver_calls, Snap};

const C: u64 = STREAM_CHUNK;

#[test]
fn a_range_freed_on_the_stream_is_adopted_whole_once_its_event_completes() {
    let (d, a) = stream_arena(8, 64);
    let (x, x_ptr) = a.alloc_growable_on_stream(6 * C, 16 * C, 1).unwrap();
    d.enqueue_write(1, x_ptr, &vec![0xAA; (6 * C) as usize]).unwrap();
    a.free_on_stream(x, 1).unwrap();
    d.complete_stream(1);
    a.maintain().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.idle_cached_bytes), (0, 6 * C), "cached where it was, known idle");
    let before = driver_calls(&s);
    // Another stream: nothing pending, so nothing to wait for.
    let (y, y_ptr) = a.alloc_growable_on_stream(4 * C, 16 * C, 2).unwrap();
    assert_eq!(y_ptr, x_ptr, "placed on the freed range");
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "its four chunks adopted where they lie");
    // Its growth adopts the two left in its reservation's tail.
    a.resize_on_stream(y, 6 * C, 2).unwrap();
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "growth into its own cached tail");
    assert_eq!(d.events_waited(), 0);
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn an_evicted_prefix_entrys_chunks_are_adopted_in_place() {
    let (d, a) = stream_arena(8, 64);
    // A finished request kept as a prefix entry of 5 chunks, evicted in
    // two steps as the prefix cache does: shrunk to 2, then freed.
    let (e, e_ptr) = a.alloc_growable_on_stream(5 * C, 16 * C, 1).unwrap();
    d.enqueue_write(1, e_ptr, &vec![0xAA; (5 * C) as usize]).unwrap();
    a.resize_on_stream(e, 2 * C, 1).unwrap();
    a.free_on_stream(e, 1).unwrap();
    d.complete_stream(1);
    a.maintain().unwrap();
    let before = driver_calls(&a.stats().unwrap());
    // The next admission, of the same reservation, takes the entry's range.
    let (r, r_ptr) = a.alloc_growable_on_stream(5 * C, 16 * C, 1).unwrap();
    assert_eq!(r_ptr, e_ptr, "the entry's range, where it lies");
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "all five chunks adopted: no map, no unmap");
    d.enqueue_write(1, r_ptr, &vec![0xBB; (5 * C) as usize]).unwrap();
    d.complete_stream(1);
    assert!(d.faults().is_empty(), "{:?}", d.faults());
    a.free(r).unwrap();
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn another_streams_admission_does_not_adopt_a_range_whose_free_is_pending() {
    // Capacity of 4: the pending free holds 2, 2 more may be created.
    let (d, a) = stream_arena(4, 64);
    let (x, x_ptr) = a.alloc_growable_on_stream(2 * C, 16 * C, 1).unwrap();
    d.enqueue_write(1, x_ptr, &vec![0xAA; (2 * C) as usize]).unwrap();
    a.free_on_stream(x, 1).unwrap();
    let before = a.stats().unwrap();
    // Stream 2 while x's work is queued: its chunks are not taken (they
    // are out of every plan until the event completes), so new ones are
    // created, and x's queued write never lands in the new allocation.
    let (y, y_ptr) = a.alloc_growable_on_stream(2 * C, 16 * C, 2).unwrap();
    let s = a.stats().unwrap();
    assert_ne!(y_ptr, x_ptr, "the pending range is not adopted");
    assert_eq!(s.driver_creates - before.driver_creates, 2, "fresh chunks, not the pending ones");
    assert_eq!(s.pending_free_bytes, 2 * C);
    assert_eq!(d.events_waited(), 0, "memory was left: nothing waited");
    d.enqueue_write(2, y_ptr, &vec![0xBB; (2 * C) as usize]).unwrap();
    d.complete_stream(1);
    d.complete_stream(2);
    assert!(d.faults().is_empty(), "{:?}", d.faults());
    a.free_on_stream(y, 2).unwrap();
    d.complete_stream(2);
    a.maintain().unwrap();
    // Once complete, x's range is adopted whole by the next admission.
    let before = driver_calls(&a.stats().unwrap());
    let (_, z_ptr) = a.alloc_growable_on_stream(2 * C, 16 * C, 2).unwrap();
    assert!(z_ptr == x_ptr || z_ptr == y_ptr, "a freed range, where it lies");
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "adopted with no driver call");
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn growth_takes_a_free_ranges_cached_chunks_before_another_allocations_tail() {
    // Capacity of 9 chunks, all in use: x (4), t (4, then shrunk to 1:
    // 3 cached in its tail), g (1).
    let (d, a) = stream_arena(9, 256);
    let (x, x_ptr) = a.alloc_on_stream(4 * C, 1).unwrap();
    let (t, t_ptr) = a.alloc_growable_on_stream(4 * C, 16 * C, 1).unwrap();
    let (g, g_ptr) = a.alloc_growable_on_stream(C, 16 * C, 1).unwrap();
    assert!(x_ptr < t_ptr && t_ptr < g_ptr, "placed in order");
    a.resize_on_stream(t, C, 1).unwrap();
    a.free_on_stream(x, 1).unwrap();
    d.complete_stream(1);
    a.maintain().unwrap();
    assert_eq!(a.stats().unwrap().idle_cached_bytes, 7 * C, "x's 4 and t's tail of 3, known idle");
    // g grows by one chunk: one of x's (an unmap and a map, no synchronize).
    let before = a.stats().unwrap();
    a.resize_on_stream(g, 2 * C, 2).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.driver_unmaps - before.driver_unmaps, s.driver_maps - before.driver_maps), (1, 1));
    assert_eq!(s.driver_syncs, before.driver_syncs);
    // t grows back: its whole tail is still there, adopted.
    let before = driver_calls(&s);
    a.resize_on_stream(t, 4 * C, 1).unwrap();
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "t's tail adopted in place");
    Snap::of(&a).check_structure(a.va_range());
    let _ = g_ptr;
}

#[test]
fn a_freed_range_merged_into_a_longer_free_range_is_adopted_before_an_empty_exact_fit() {
    let (_d, a) = stream_arena(16, 256);
    // h, s and b side by side, 16 pages reserved each; b maps 4 chunks.
    let (h, _) = a.alloc_growable(C, 16 * C).unwrap();
    let (_s, _) = a.alloc_growable(C, 16 * C).unwrap();
    let (b, b_ptr) = a.alloc_growable(4 * C, 16 * C).unwrap();
    // h's hole is an exact fit with nothing cached in it; b's range joins
    // the free space after it, its 4 chunks cached at its start.
    a.free(h).unwrap();
    a.trim(0).unwrap();
    a.free(b).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.cached_mapped_bytes, 4 * C);
    let before = driver_calls(&s);
    let (_, ptr) = a.alloc_growable(4 * C, 16 * C).unwrap();
    assert_eq!(ptr, b_ptr, "placed where b's chunks lie, not in the empty exact fit");
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "its 4 chunks adopted: no driver call");
    Snap::of(&a).check_structure(a.va_range());
}

#[test]
fn one_chunk_blocks_freed_in_any_order_are_taken_again_where_they_lie() {
    let (_d, a) = stream_arena(16, 64);
    let first: Vec<(vmm_arena::Id, u64)> = (0..12).map(|_| a.alloc(C).unwrap()).collect();
    let mut chunks: Vec<u64> = first.iter().map(|&(_, p)| p).collect();
    // Finished requests give their blocks back interleaved.
    for &(id, _) in
        first.iter().step_by(3).chain(first.iter().skip(1).step_by(3)).chain(first.iter().skip(2).step_by(3))
    {
        a.free(id).unwrap();
    }
    let before = driver_calls(&a.stats().unwrap());
    let mut second: Vec<u64> = (0..12).map(|_| a.alloc(C).unwrap().1).collect();
    assert_eq!(driver_calls(&a.stats().unwrap()), before, "every block adopted a mapped chunk");
    chunks.sort_unstable();
    second.sort_unstable();
    assert_eq!(second, chunks, "the same chunks, where they lie");
    Snap::of(&a).check_structure(a.va_range());
}
