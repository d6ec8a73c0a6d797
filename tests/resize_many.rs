//! Fewer driver calls per growth: `resize_many` (all or nothing, planned
//! once), one access call per contiguous run of newly mapped chunks, and
//! placement that prefers a hole whose chunks are still mapped.

mod common;

use common::Snap;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Error, Id, Stats};

const C: u64 = 4096;

fn arena(cap: u64, reserve: u64) -> Arena {
    let cfg = ArenaConfig { capacity_bytes: cap * C, reserve_bytes: reserve * C, chunk_bytes: C, ..Default::default() };
    Arena::with_driver(MockDriver::new(C, 1 << 30), cfg).unwrap()
}

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

/// (creates, maps, access calls, unmaps, syncs) made since `s0`.
fn calls(a: &Arena, s0: &Stats) -> (u64, u64, u64, u64, u64) {
    let s = a.stats().unwrap();
    (
        s.driver_creates - s0.driver_creates,
        s.driver_maps - s0.driver_maps,
        s.driver_access_calls - s0.driver_access_calls,
        s.driver_unmaps - s0.driver_unmaps,
        s.driver_syncs - s0.driver_syncs,
    )
}

#[test]
fn one_access_call_per_contiguous_run_of_new_chunks() {
    let a = arena(32, 64);
    let (g, _) = a.alloc_growable(C, 16 * C).unwrap();
    let s0 = a.stats().unwrap();
    a.resize(g, 6 * C).unwrap();
    assert_eq!(calls(&a, &s0), (5, 5, 1, 0, 0), "five chunks mapped, one access call over the run");
    // Cached pages in the tail are adopted; the rest is one run.
    a.resize(g, 2 * C).unwrap(); // pages 2..6 cached in the tail
    let s1 = a.stats().unwrap();
    a.resize(g, 10 * C).unwrap();
    assert_eq!(calls(&a, &s1), (4, 4, 1, 0, 0), "four adopted, four mapped with one access call");
    check(&a);
}

#[test]
fn resize_many_grows_in_place_with_one_plan() {
    let a = arena(64, 128);
    let ids: Vec<Id> = (0..4).map(|_| a.alloc_growable(C, 8 * C).unwrap().0).collect();
    let ptrs: Vec<u64> = ids.iter().map(|&id| a.query(id).unwrap().ptr).collect();
    for (i, &id) in ids.iter().enumerate() {
        a.write(id, 0, &(i as u64).to_le_bytes()).unwrap();
    }
    let s0 = a.stats().unwrap();
    let req: Vec<(Id, u64)> = ids.iter().enumerate().map(|(i, &id)| (id, (2 + i as u64) * C)).collect();
    let got = a.resize_many(&req).unwrap();
    assert_eq!(got, ptrs, "in place: same addresses");
    // 1 + 2 + 3 + 4 new chunks, one access call per allocation's run.
    assert_eq!(calls(&a, &s0), (10, 10, 4, 0, 0));
    for (i, &id) in ids.iter().enumerate() {
        let info = a.query(id).unwrap();
        assert_eq!((info.size, info.mapped_bytes), ((2 + i as u64) * C, (2 + i as u64) * C));
        let mut out = [0u8; 8];
        a.read(id, 0, &mut out).unwrap();
        assert_eq!(u64::from_le_bytes(out), i as u64);
    }
    // The same growth one call at a time makes no fewer calls.
    let b = arena(64, 128);
    let ids_b: Vec<Id> = (0..4).map(|_| b.alloc_growable(C, 8 * C).unwrap().0).collect();
    let t0 = b.stats().unwrap();
    for (i, &id) in ids_b.iter().enumerate() {
        b.resize(id, (2 + i as u64) * C).unwrap();
    }
    assert_eq!(calls(&b, &t0), (10, 10, 4, 0, 0));
    check(&a);
}

#[test]
fn resize_many_synchronizes_once_for_all_its_steals() {
    // The capacity is taken: every growth steals cached chunks (unmaps).
    let a = arena(8, 64);
    let g: Vec<Id> = (0..2).map(|_| a.alloc_growable(C, 4 * C).unwrap().0).collect();
    let x: Vec<Id> = (0..6).map(|_| a.alloc(C).unwrap().0).collect();
    for id in x {
        a.free(id).unwrap(); // six cached chunks, plain frees
    }
    let s0 = a.stats().unwrap();
    a.resize_many(&[(g[0], 4 * C), (g[1], 4 * C)]).unwrap();
    let (creates, maps, _, unmaps, syncs) = calls(&a, &s0);
    assert_eq!((creates, maps, syncs), (0, 6, 1), "one synchronize for the whole batch");
    assert!(unmaps >= 1);
    check(&a);
}

#[test]
fn resize_many_is_all_or_nothing() {
    let a = arena(8, 64);
    let g: Vec<Id> = (0..3).map(|_| a.alloc_growable(C, 8 * C).unwrap().0).collect();
    for (i, &id) in g.iter().enumerate() {
        a.write(id, 0, &[i as u8 + 1; 16]).unwrap();
    }
    a.resize(g[2], 4 * C).unwrap(); // 6 chunks held, 2 left
    let before = Snap::of(&a).without_driver_counters();
    // 3 + 4 chunks more than the 2 left: out of memory, nothing changed.
    let e = a.resize_many(&[(g[0], 4 * C), (g[1], C), (g[2], 8 * C)]).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(Snap::of(&a).without_driver_counters(), before);
    // 3 + 1 more fit once g[2]'s shrink (3 chunks) is counted.
    let got = a.resize_many(&[(g[0], 4 * C), (g[1], 2 * C), (g[2], C)]).unwrap();
    assert_eq!(got.len(), 3);
    for (i, &id) in g.iter().enumerate() {
        let mut out = [0u8; 16];
        a.read(id, 0, &mut out).unwrap();
        assert_eq!(out, [i as u8 + 1; 16]);
        assert_eq!(a.query(id).unwrap().ptr, got[i]);
    }
    check(&a);
}

#[test]
fn resize_many_moves_what_outgrows_its_reservation() {
    let a = arena(32, 64);
    let (g, g_ptr) = a.alloc_growable(C, 2 * C).unwrap();
    let (b, _) = a.alloc(C).unwrap(); // right after g: no growth in place past 2 chunks
    let (s, _) = a.alloc(200).unwrap();
    a.write(g, 0, b"grows").unwrap();
    a.write(s, 0, b"small").unwrap();
    let got = a.resize_many(&[(g, 5 * C), (b, 2 * C), (s, 3000)]).unwrap();
    assert_ne!(got[0], g_ptr, "g moved");
    for (&id, &ptr) in [g, b, s].iter().zip(&got) {
        assert_eq!(a.query(id).unwrap().ptr, ptr, "the addresses after the whole batch");
    }
    let mut out = [0u8; 5];
    a.read(g, 0, &mut out).unwrap();
    assert_eq!(&out, b"grows");
    a.read(s, 0, &mut out).unwrap();
    assert_eq!(&out, b"small");
    check(&a);
}

#[test]
fn resize_many_refuses_bad_batches_in_the_contract_order() {
    let a = arena(8, 64);
    let (g, _) = a.alloc_growable(C, 4 * C).unwrap();
    let (h, _) = a.alloc(C).unwrap();
    a.free(h).unwrap(); // a stale id
    assert!(a.resize_many(&[]).unwrap().is_empty());
    let invalid = |r: vmm_arena::Result<Vec<u64>>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(invalid(a.resize_many(&[(g, 2 * C), (g, 3 * C)])), "the same id twice");
    assert!(invalid(a.resize_many(&[(h, C), (g, 0)])), "size 0 before the unknown id");
    assert!(invalid(a.resize_many(&[(g, u64::MAX)])), "overflow");
    assert!(matches!(a.resize_many(&[(g, 2 * C), (h, C)]), Err(Error::UnknownAllocation(_))));
    a.set_tag(g, 1).unwrap();
    a.sleep(1, 0).unwrap();
    let (k, _) = a.alloc_growable(C, 2 * C).unwrap();
    assert!(matches!(a.resize_many(&[(k, 2 * C), (g, 2 * C)]), Err(Error::Asleep(_))));
    assert_eq!(a.query(k).unwrap().size, C, "nothing changed");
    a.pin(k).unwrap();
    let (blocker, _) = a.alloc(C).unwrap();
    a.pin(blocker).unwrap(); // nothing can make room after k
    let r = a.resize_many(&[(k, 6 * C)]);
    assert!(matches!(r, Err(Error::Pinned(_)) | Err(Error::OutOfAddressSpace(_))), "{r:?}");
    check(&a);
}

#[test]
fn placement_prefers_a_hole_whose_chunks_are_still_mapped() {
    let a = arena(16, 64);
    // Two holes of two pages: the first unmapped (trimmed), the second cached.
    let v: Vec<Id> = (0..5).map(|_| a.alloc(2 * C).unwrap().0).collect();
    let hole2 = a.query(v[3]).unwrap().ptr;
    a.free(v[1]).unwrap();
    a.trim(0).unwrap(); // the first hole's chunks go back
    a.free(v[3]).unwrap(); // the second hole keeps its chunks mapped
    let s0 = a.stats().unwrap();
    let (_x, ptr) = a.alloc(2 * C).unwrap();
    assert_eq!(ptr, hole2, "equal fits: the one to adopt");
    assert_eq!(calls(&a, &s0), (0, 0, 0, 0, 0), "adopted: no driver call");
    check(&a);
}

/// A sleeping small allocation named after a request that runs out of
/// memory (or address space, or meets a pinned neighbour): ASLEEP, since
/// every request's state is checked before any request's work.
#[test]
fn a_sleeping_small_allocation_is_asleep_before_any_request_runs() {
    let a = arena(8, 64);
    let (big, _) = a.alloc_growable(C, 16 * C).unwrap();
    let (small, _) = a.alloc_tagged(100, 1).unwrap();
    a.sleep(1, 0).unwrap();
    assert!(a.query(small).unwrap().asleep);
    // Alone, the growth is out of memory.
    assert!(matches!(a.resize_many(&[(big, 12 * C)]), Err(Error::OutOfMemory(_))));
    for batch in [[(big, 12 * C), (small, 200)], [(small, 200), (big, 12 * C)]] {
        let r = a.resize_many(&batch);
        assert!(matches!(r, Err(Error::Asleep(_))), "{batch:?}: {r:?}");
    }
    // Pinned: a pinned allocation boxed in by another pinned one.
    let (k, _) = a.alloc(C).unwrap();
    let (blocker, _) = a.alloc(C).unwrap();
    a.pin(k).unwrap();
    a.pin(blocker).unwrap();
    let r = a.resize_many(&[(k, 3 * C), (small, 200)]);
    assert!(matches!(r, Err(Error::Asleep(_))), "{r:?}");
    check(&a);
}
