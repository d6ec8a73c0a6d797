//! Tags at allocation time and on small allocations: every allocation takes
//! a tag whatever its size or history, small allocations of different tags
//! never share a slab, and a tag sleeps and wakes with its neighbours'
//! bytes untouched.
//!
//! Backend: the host (64 KiB chunks), or device 0 when
//! `VMM_ARENA_TEST_BACKEND=cuda`.

mod common;

use std::sync::{Arc, Mutex};

use common::fixtures::{check_consistent, fault_arena as arena, pattern, read_bytes, status};
use common::Snap;
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::{Status, ALL_TAGS, SLEEP_BACKUP};

/// Finding: whether an allocation took a tag depended on its history (one
/// resized down to 1,000 bytes took a tag and slept, a fresh 1,000-byte one
/// was refused). Both take it and sleep now.
#[test]
fn a_small_allocation_takes_a_tag_whatever_its_history() {
    let (d, a, c) = arena(16, 64);
    let (resized, _) = a.alloc(c + 1).unwrap();
    a.resize(resized, 1000).unwrap();
    let (fresh, _) = a.alloc(1000).unwrap();
    for id in [resized, fresh] {
        a.write(id, 0, &pattern(9, 1000)).unwrap();
        a.set_tag(id, 3).expect("every allocation takes a tag");
        assert_eq!(a.query(id).unwrap().tag, 3);
    }
    a.sleep(3, SLEEP_BACKUP).unwrap();
    for id in [resized, fresh] {
        assert!(a.query(id).unwrap().asleep, "both sleep with their tag");
        assert_eq!(status(a.write(id, 0, b"x")), Status::Asleep);
    }
    check_consistent(&a, &d);
    a.wake(3).unwrap();
    for id in [resized, fresh] {
        assert_eq!(read_bytes(&a, id, 0, 1000), pattern(9, 1000));
    }
    check_consistent(&a, &d);
}

#[test]
fn small_allocations_of_two_tags_never_share_a_slab() {
    let (d, a, c) = arena(16, 64);
    let (w, wp) = a.alloc_tagged(1000, 1).unwrap();
    let (k, kp) = a.alloc_tagged(1000, 2).unwrap();
    let (w2, w2p) = a.alloc_tagged(1000, 1).unwrap();
    assert_eq!(a.stats().unwrap().small_slabs, 2, "one slab a tag");
    assert_ne!(wp / c, kp / c, "different tags, different chunks");
    assert_eq!(wp / c, w2p / c, "one tag, one slab");
    assert_eq!((a.query(w).unwrap().tag, a.query(k).unwrap().tag), (1, 2));
    a.write(w, 0, &pattern(1, 1000)).unwrap();
    a.write(w2, 0, &pattern(2, 1000)).unwrap();
    a.write(k, 0, &pattern(3, 1000)).unwrap();

    // Tag 1 sleeps (its slab's chunk goes back to the driver), tag 2 stays.
    let mapped = a.stats().unwrap().mapped_bytes;
    a.sleep(1, SLEEP_BACKUP).unwrap();
    assert_eq!(a.stats().unwrap().mapped_bytes, mapped - c);
    assert!(a.query(w).unwrap().asleep && !a.query(k).unwrap().asleep);
    assert_eq!(read_bytes(&a, k, 0, 1000), pattern(3, 1000), "the other tag is untouched");
    a.write(k, 0, &pattern(4, 1000)).unwrap();
    check_consistent(&a, &d);

    // While tag 1 sleeps: what needs its bytes is refused, a new small
    // allocation of tag 1 gets an awake slab, frees work.
    assert_eq!(status(a.resize(w, 2000)), Status::Asleep);
    assert_eq!(status(a.resize(w, 10)), Status::Asleep, "a sleeping allocation keeps its size");
    assert_eq!(status(a.pin(w)), Status::Asleep);
    assert_eq!(status(a.set_tag(w, 2)), Status::Asleep);
    let (w3, w3p) = a.alloc_tagged(1000, 1).unwrap();
    assert_ne!(w3p / c, wp / c, "not in the sleeping slab");
    a.write(w3, 0, b"awake").unwrap();
    a.free(w2).unwrap();
    check_consistent(&a, &d);

    a.wake(1).unwrap();
    assert_eq!(a.query(w).unwrap().ptr, wp, "same address");
    assert_eq!(read_bytes(&a, w, 0, 1000), pattern(1, 1000));
    assert_eq!(read_bytes(&a, k, 0, 1000), pattern(4, 1000));
    assert_eq!(read_bytes(&a, w3, 0, 5), b"awake");
    check_consistent(&a, &d);
}

#[test]
fn set_tag_moves_a_small_allocation_to_a_slab_of_its_new_tag() {
    let (d, a, c) = arena(16, 64);
    let moves = Arc::new(Mutex::new(Vec::new()));
    let seen = moves.clone();
    a.set_move_callback(Some(Box::new(move |e| seen.lock().unwrap().push((e.id, e.old_ptr, e.new_ptr))))).unwrap();
    let (x, xp) = a.alloc(3000).unwrap();
    let (y, yp) = a.alloc_tagged(3000, 7).unwrap();
    a.write(x, 0, &pattern(5, 3000)).unwrap();
    assert_ne!(xp / c, yp / c);
    let copied = a.stats().unwrap().bytes_copied;

    a.set_tag(x, 0).unwrap();
    assert!(moves.lock().unwrap().is_empty(), "its own tag: a no-op");
    a.set_tag(x, 7).unwrap();
    let info = a.query(x).unwrap();
    assert_eq!(info.tag, 7);
    assert_eq!(info.ptr / c, yp / c, "now in tag 7's slab");
    assert_eq!(*moves.lock().unwrap(), vec![(x, xp, info.ptr)], "reported as a move");
    assert_eq!(a.stats().unwrap().bytes_copied, copied + 3000);
    assert_eq!(read_bytes(&a, x, 0, 3000), pattern(5, 3000));

    // A pinned one cannot move, and stays as it was.
    a.pin(x).unwrap();
    assert_eq!(status(a.set_tag(x, 8)), Status::Pinned);
    assert_eq!(a.query(x).unwrap().tag, 7);
    a.unpin(x).unwrap();
    // Tag 0's slab held only x: after release, sleeping tag 0 leaves x be.
    a.release_retired().unwrap();
    a.sleep(0, 0).unwrap();
    assert!(!a.query(x).unwrap().asleep && !a.query(y).unwrap().asleep);
    a.sleep(7, SLEEP_BACKUP).unwrap();
    assert!(a.query(x).unwrap().asleep && a.query(y).unwrap().asleep);
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(read_bytes(&a, x, 0, 3000), pattern(5, 3000));
    check_consistent(&a, &d);
}

#[test]
fn a_tag_given_at_allocation_follows_growth_and_promotion() {
    let (d, a, c) = arena(16, 64);
    let (g, _) = a.alloc_growable_tagged(100, 4 * c, 4).unwrap();
    let (s, _) = a.alloc_tagged(500, 4).unwrap();
    let (big, _) = a.alloc_tagged(2 * c, 4).unwrap();
    // Past its class (another slab of tag 4), then past the classes (whole chunks).
    a.write(s, 0, &pattern(6, 500)).unwrap();
    a.resize(s, 5000).unwrap();
    assert_eq!(a.query(s).unwrap().tag, 4);
    a.resize(s, c + 1).unwrap();
    a.resize(g, 3 * c).unwrap();
    for id in [g, s, big] {
        assert_eq!(a.query(id).unwrap().tag, 4);
    }
    a.sleep(4, SLEEP_BACKUP).unwrap();
    for id in [g, s, big] {
        assert!(a.query(id).unwrap().asleep);
    }
    assert_eq!(a.stats().unwrap().mapped_bytes, 0, "all of tag 4 sleeps");
    a.wake(4).unwrap();
    assert_eq!(read_bytes(&a, s, 0, 500), pattern(6, 500));
    check_consistent(&a, &d);
}

#[test]
fn a_failed_tag_move_changes_nothing() {
    // Capacity of two chunks: x's slab and y's slab; moving x to a third
    // tag needs a third slab.
    let (d, a, c) = arena(2, 8);
    let (x, xp) = a.alloc_tagged(1000, 1).unwrap();
    let (_y, _) = a.alloc_tagged(1000, 2).unwrap();
    a.write(x, 0, &pattern(8, 1000)).unwrap();
    let before = a.stats().unwrap();
    assert_eq!(status(a.set_tag(x, 3)), Status::OutOfMemory);
    let info = a.query(x).unwrap();
    assert_eq!((info.ptr, info.tag), (xp, 1));
    assert_eq!(read_bytes(&a, x, 0, 1000), pattern(8, 1000));
    let after = a.stats().unwrap();
    assert_eq!((after.mapped_bytes, after.small_slabs, after.moves), (before.mapped_bytes, 2, before.moves));
    assert_eq!(c, a.chunk_bytes());
    check_consistent(&a, &d);
}

/// A small allocation's move to a slab of its new tag makes driver calls
/// (a chunk for the new slab: create, map, access; the copy): each of them
/// failing fails `set_tag` with nothing changed.
#[test]
fn every_driver_call_of_a_tag_move_failing_changes_nothing() {
    let mut n = 1;
    loop {
        let (d, a, _c) = arena(8, 32);
        let (x, xp) = a.alloc_tagged(3000, 1).unwrap();
        a.write(x, 0, &pattern(4, 3000)).unwrap();
        let before = Snap::of(&a).without_driver_counters();
        d.fault.fail_nth(None, n, FaultKind::Driver);
        let r = a.set_tag(x, 2);
        if d.fault.pending() {
            // Fewer than n calls: the move succeeded without the fault.
            r.unwrap();
            assert!(n > 1, "a tag move makes driver calls");
            break;
        }
        assert_eq!(status(r), Status::Driver, "call {n}");
        assert_eq!(Snap::of(&a).without_driver_counters(), before, "call {n} failed: nothing changed");
        let info = a.query(x).unwrap();
        assert_eq!((info.ptr, info.tag), (xp, 1), "call {n}");
        assert_eq!(read_bytes(&a, x, 0, 3000), pattern(4, 3000), "call {n}");
        check_consistent(&a, &d);
        n += 1;
    }
}

/// Sleep and wake of a tag whose allocations are small (its slabs): each
/// driver call failing leaves every one of them as it was (awake with its
/// bytes, or asleep with its backup), the other tag untouched.
#[test]
fn every_driver_call_of_a_small_tag_sleeping_or_waking_failing_changes_nothing() {
    for waking in [false, true] {
        let mut n = 1;
        loop {
            let (d, a, _c) = arena(8, 32);
            let ws: Vec<_> = (0..3).map(|_| a.alloc_tagged(20_000, 1).unwrap().0).collect();
            let (k, _) = a.alloc_tagged(20_000, 2).unwrap();
            for (i, &id) in ws.iter().chain([&k]).enumerate() {
                a.write(id, 0, &pattern(i as u64, 20_000)).unwrap();
            }
            if waking {
                a.sleep(1, SLEEP_BACKUP).unwrap();
            }
            let before = Snap::of(&a).without_driver_counters();
            d.fault.fail_nth(None, n, FaultKind::Driver);
            let r = if waking { a.wake(1) } else { a.sleep(1, SLEEP_BACKUP) };
            if d.fault.pending() {
                r.unwrap();
                assert!(n > 1, "driver calls were made");
                break;
            }
            let after = Snap::of(&a).without_driver_counters();
            match r {
                Err(e) => {
                    assert_eq!(e.status(), Status::Driver, "call {n}");
                    assert_eq!(after, before, "waking {waking}, call {n} failed: nothing changed");
                }
                // A release failing after the point of no return: the sleep
                // has happened, the chunk stays pooled (see Arena::sleep).
                Ok(()) => assert!(!waking && a.stats().unwrap().release_failures == 1, "call {n}"),
            }
            check_consistent(&a, &d);
            if a.query(ws[0]).unwrap().asleep {
                a.wake(1).unwrap();
            }
            for (i, &id) in ws.iter().chain([&k]).enumerate() {
                assert_eq!(read_bytes(&a, id, 0, 20_000), pattern(i as u64, 20_000), "waking {waking}, call {n}");
            }
            n += 1;
        }
    }
}
