//! Contract violations a black-box tester found through the C ABI (issue
//! 16), as fixed scenarios on the host backend. Each was written before its
//! fix and seen failing; the model test (`tests/model.rs`) checks each class
//! in random sequences too.

mod common;

use std::sync::{Arc, Mutex};

use common::Snap;
use vmm_arena::driver::host::HostDriver;
use vmm_arena::{Arena, ArenaConfig, MoveEvent, Status};

const C: u64 = 64 << 10;

fn arena(cap_pages: u64, reserve_pages: u64, retain_pages: Option<u64>) -> (Arena, Arc<HostDriver>) {
    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: cap_pages * C,
        reserve_bytes: reserve_pages * C,
        chunk_bytes: C,
        retain_bytes: retain_pages.map_or(u64::MAX, |p| p * C),
        ..ArenaConfig::default()
    };
    (Arena::with_driver(d.clone(), cfg).unwrap(), d)
}

fn events(a: &Arena) -> Arc<Mutex<Vec<MoveEvent>>> {
    let ev = Arc::new(Mutex::new(Vec::new()));
    let sink = ev.clone();
    a.set_move_callback(Some(Box::new(move |e: &MoveEvent| sink.lock().unwrap().push(*e)))).unwrap();
    ev
}

/// Reads `len` bytes at a raw host address.
///
/// # Safety
/// `addr..addr + len` must be mapped, readable memory of a host arena that
/// no other thread changes during the call.
unsafe fn raw(addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: the caller guarantees the range is mapped and readable.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), len) };
    v
}

/// 1. Freeing a pinned small object left its slab pinned: the slab could
///    never move again, and compaction and allocations failed around it.
#[test]
fn freeing_a_pinned_small_object_unpins_its_slab() {
    let (a, _d) = arena(4, 4, None);
    let (big, _) = a.alloc(C).unwrap(); // page 0
    let (p, _) = a.alloc(4096).unwrap(); // a slab at page 1
    let (q, _) = a.alloc(4096).unwrap(); // the same slab
    a.write(q, 0, b"q").unwrap();
    a.pin(p).unwrap();
    a.free(p).unwrap();
    a.free(big).unwrap();
    let snap = Snap::of(&a);
    assert!(snap.slabs().all(|s| !s.pinned), "no object is pinned, so no slab is: {:?}", snap.ranges);
    assert!(!a.query(q).unwrap().pinned);
    // Three pages in a row exist only once the slab leaves page 1.
    let (r, _) = a.alloc(3 * C).expect("the slab is movable again");
    let mut out = [0u8; 1];
    a.read(q, 0, &mut out).unwrap();
    assert_eq!(&out, b"q");
    a.free(r).unwrap();
}

/// 3. `resize` refused with out-of-address-space where moving a neighbour
///    out of the way made room (as `compact` followed by the resize showed).
#[test]
fn resize_moves_a_neighbour_when_that_makes_room() {
    let (a, _d) = arena(4, 4, None);
    let ev = events(&a);
    let (h, _) = a.alloc(C).unwrap(); // page 0
    let (r, pr) = a.alloc(2 * C).unwrap(); // pages 1-2
    let (b, _) = a.alloc(C).unwrap(); // page 3
    a.write(r, 0, b"r").unwrap();
    a.write(b, 0, b"b").unwrap();
    a.free(h).unwrap();
    let p = a.resize(r, 3 * C).expect("moving b to page 0 makes room");
    assert_eq!(p, pr, "r grows in place once b is out of the way");
    let mut out = [0u8; 1];
    a.read(r, 0, &mut out).unwrap();
    assert_eq!(&out, b"r");
    a.read(b, 0, &mut out).unwrap();
    assert_eq!(&out, b"b");
    let ev = ev.lock().unwrap();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].id, b);
    assert_eq!(a.stats().unwrap().moves, 1);
}

/// 3 (pinned). A pinned allocation grows in place when an unpinned
/// neighbour can move away.
#[test]
fn pinned_growth_moves_an_unpinned_neighbour() {
    let (a, _d) = arena(4, 4, None);
    let (h, _) = a.alloc(C).unwrap();
    let (r, pr) = a.alloc(2 * C).unwrap();
    let (_b, _) = a.alloc(C).unwrap();
    a.pin(r).unwrap();
    a.free(h).unwrap();
    assert_eq!(a.resize(r, 3 * C).unwrap(), pr);
}

/// 4. Growth of a pinned allocation whose neighbour range was merely
///    retired failed with PINNED (and, unpinned, moved) although releasing
///    the retired range lets it grow in place.
#[test]
fn growth_into_a_retired_neighbour_range_stays_in_place() {
    for pinned in [true, false] {
        let (a, _d) = arena(8, 8, None);
        let (r, pr) = a.alloc(C).unwrap(); // page 0
        let (g, _) = a.alloc_growable(C, C).unwrap(); // page 1
        let (_x, _) = a.alloc(C).unwrap(); // page 2
        a.write(r, 0, b"r").unwrap();
        a.resize(g, 2 * C).unwrap(); // g moves on; page 1 is retired
        assert_eq!(a.stats().unwrap().retired_va_bytes, C);
        if pinned {
            a.pin(r).unwrap();
        }
        let p = a.resize(r, 2 * C).unwrap_or_else(|e| panic!("pinned={pinned}: {e}"));
        assert_eq!(p, pr, "pinned={pinned}: grows in place after releasing the retired range");
        let mut out = [0u8; 1];
        a.read(r, 0, &mut out).unwrap();
        assert_eq!(&out, b"r");
    }
}

/// 5. With `retain_bytes = 0`, freeing one moved allocation released every
///    retired range, also the old range of another, live, moved allocation,
///    whose old address the contract keeps readable until `release_retired`.
#[test]
fn the_watermark_keeps_live_allocations_retired_ranges() {
    let (a, _d) = arena(8, 16, Some(0));
    let (x, old_x) = a.alloc_growable(C, C).unwrap(); // page 0
    let (_b1, _) = a.alloc(C).unwrap(); // page 1
    let (y, _) = a.alloc_growable(C, C).unwrap(); // page 2
    let (_b2, _) = a.alloc(C).unwrap(); // page 3
    a.write(x, 0, b"xx").unwrap();
    a.resize(x, 2 * C).unwrap(); // x moves; page 0 retired
    a.resize(y, 2 * C).unwrap(); // y moves; page 2 retired
    assert_eq!(a.stats().unwrap().retired_va_bytes, 2 * C);
    a.free(y).unwrap(); // y's chunks go back (retain 0), with y's old range
    let s = a.stats().unwrap();
    assert_eq!(s.pooled_bytes, 0);
    assert_eq!(s.retired_va_bytes, C, "x's old range stays until release_retired");
    // SAFETY: host backend; x's old range is retired (asserted just above),
    // so it is still mapped, and this thread is the arena's only user.
    assert_eq!(unsafe { raw(old_x, 2) }, b"xx");
    assert_eq!(a.trim(0).unwrap(), 0, "nothing pooled: trim has nothing to give back");
    assert_eq!(a.stats().unwrap().retired_va_bytes, C, "trim keeps it too");
    // SAFETY: as above.
    assert_eq!(unsafe { raw(old_x, 2) }, b"xx");
    a.release_retired().unwrap();
    assert_eq!(a.stats().unwrap().retired_va_bytes, 0);
}

/// 6. `compact` counted a moved slab as one moved allocation, while each of
///    its objects moved (one event and one `moves` each).
#[test]
fn compact_counts_each_object_of_a_moved_slab() {
    let (a, _d) = arena(4, 4, None);
    let ev = events(&a);
    let (big, _) = a.alloc(C).unwrap(); // page 0
    let objs: Vec<_> = (0..5).map(|_| a.alloc(1000).unwrap().0).collect(); // a slab at page 1
    a.free(big).unwrap();
    let before = a.stats().unwrap().moves;
    let report = a.compact().unwrap();
    assert_eq!(ev.lock().unwrap().len(), objs.len(), "every object moved with the slab");
    assert_eq!(report.moved_allocations, objs.len() as u64, "{report:?}");
    assert_eq!(a.stats().unwrap().moves - before, report.moved_allocations);
    assert_eq!(report.moved_bytes, C, "one chunk was remapped");
}

/// `trim` reported more released bytes than were pooled when it started:
/// it released retired small objects (old places of live, copy-resized
/// allocations) and gave back the slab that emptied while `pooled_bytes`
/// did not count that slab. Now a slab holding only retired objects is
/// pooled, and trim gives back exactly what was pooled: ordinary pooled
/// chunks first, that slab only when they are not enough for `keep_bytes`.
#[test]
fn trim_gives_back_at_most_what_was_pooled() {
    let (a, d) = arena(8, 16, None);
    let (x, _) = a.alloc(300).unwrap(); // a slab at page 0
    let (g, _) = a.alloc_growable(C, C).unwrap(); // page 1
    let (_b, _) = a.alloc(C).unwrap(); // page 2
    a.resize(g, 2 * C).unwrap(); // g moves; page 1 retired, still mapping g's first chunk
    a.write(x, 0, b"x").unwrap();
    a.resize(x, 3 * C).unwrap(); // x leaves its slab by copying; its old place is retired
    a.free(g).unwrap(); // g's chunks are pooled, one still mapped at the retired page
    let pooled = a.stats().unwrap().pooled_bytes;
    assert_eq!(pooled, 3 * C, "g's two chunks and the slab of x's retired old place");
    assert_eq!(a.trim(C).unwrap(), 2 * C, "g's two chunks, enough for keep_bytes: the slab stays");
    let s = a.stats().unwrap();
    assert_eq!((s.pooled_bytes, s.small_slabs), (C, 1), "x's old place keeps its slab");
    assert!(s.retired_va_bytes > 0);
    assert_eq!(a.trim(0).unwrap(), C, "then the slab, and nothing more than was pooled");
    let s = a.stats().unwrap();
    assert_eq!((s.pooled_bytes, s.retired_va_bytes, s.small_slabs), (0, 0, 0));
    let mut out = [0u8; 1];
    a.read(x, 0, &mut out).unwrap();
    assert_eq!(&out, b"x");
    assert_eq!(d.live_chunks() as u64, a.stats().unwrap().mapped_bytes / C);
}

/// The refusals the fixes must keep: a pinned allocation boxed in by a
/// pinned neighbour is PINNED; with implicit moves off, a neighbour is
/// never moved for growth.
#[test]
fn growth_refusals_that_stay() {
    let (a, _d) = arena(4, 4, None);
    let (h, _) = a.alloc(C).unwrap();
    let (r, _) = a.alloc(2 * C).unwrap();
    let (b, _) = a.alloc(C).unwrap();
    a.free(h).unwrap();
    a.pin(r).unwrap();
    a.pin(b).unwrap();
    assert_eq!(a.resize(r, 3 * C).unwrap_err().status(), Status::Pinned);

    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: 4 * C,
        reserve_bytes: 4 * C,
        chunk_bytes: C,
        no_implicit_moves: true,
        ..ArenaConfig::default()
    };
    let a = Arena::with_driver(d, cfg).unwrap();
    let (h, _) = a.alloc(C).unwrap();
    let (r, _) = a.alloc(2 * C).unwrap();
    let (_b, _) = a.alloc(C).unwrap();
    a.free(h).unwrap();
    assert_eq!(a.resize(r, 3 * C).unwrap_err().status(), Status::OutOfAddressSpace);
}

/// Issue 13: `mapped_bytes` counted the chunk of a slab that held only
/// retired objects (old places of copy-resized allocations, since freed),
/// though it backs no live allocation. The contract: such a chunk is held
/// memory backing nothing live, in `pooled_bytes`.
#[test]
fn a_slab_of_retired_objects_only_counts_as_pooled() {
    let d = Arc::new(HostDriver::new().unwrap());
    let mib = 1 << 20;
    let cfg = ArenaConfig { capacity_bytes: 256 * mib, reserve_bytes: 1024 * mib, ..ArenaConfig::default() };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let (x, _) = a.alloc(1_030_352).unwrap(); // two objects of one slab
    let (y, _) = a.alloc(1_022_000).unwrap();
    assert_eq!(a.stats().unwrap().small_slabs, 1);
    a.resize(x, 2 * mib).unwrap(); // x leaves the slab by copying; its old place is retired
    a.free(x).unwrap();
    a.free(y).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.live_allocations, 0);
    assert_eq!(s.mapped_bytes, 0, "nothing live, nothing backing");
    assert_eq!(s.pooled_bytes, 2 * 2 * mib, "x's chunk, and the slab of x's retired old place");
    assert_eq!(d.live_chunks() as u64 * 2 * mib, s.mapped_bytes + s.pooled_bytes);
    a.release_retired().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.small_slabs), (0, 2 * 2 * mib, 0));
}

/// Found by the multi-tenant workload (issue 11): memory freed on a stream
/// whose event has completed is pooled and given back by nothing else, yet
/// `trim(0)` kept it, because trim never polled the events — the idle
/// footprint stayed up after `trim(0)`. Trim polls first now.
#[test]
fn trim_gives_back_stream_frees_whose_events_completed() {
    use vmm_arena::driver::mock::MockDriver;
    let d = Arc::new(MockDriver::with_streams(C, 64 * C));
    let cfg = ArenaConfig { capacity_bytes: 16 * C, chunk_bytes: C, ..ArenaConfig::default() };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let (id, _) = a.alloc(3 * C).unwrap();
    a.free_on_stream(id, 7).unwrap();
    assert_eq!(a.stats().unwrap().pending_free_bytes, 3 * C);
    assert_eq!(a.trim(0).unwrap(), 0, "the event has not completed: nothing can go back");
    d.complete_all_events();
    assert_eq!(a.trim(0).unwrap(), 3 * C, "completed: all three chunks go back");
    let s = a.stats().unwrap();
    assert_eq!((s.pooled_bytes, s.pending_free_bytes, s.driver_syncs), (0, 0, 0), "{s:?}");
}
