//! Tensor-parallel groups: an in-process group's undo restores what each
//! member maps; placement is a pure function of the operations and the
//! config across separate processes (forked ranks); two-phase operations
//! (prepare on every rank, a vote, commit or abort) keep ranks identical
//! when one rank fails.

mod common;

use std::sync::Arc;

use common::Snap;

use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Group};

const C: u64 = 2 << 20;

fn cfg(cap: u64) -> ArenaConfig {
    ArenaConfig { capacity_bytes: cap * C, reserve_bytes: 4 * cap * C, chunk_bytes: C, ..ArenaConfig::default() }
}

fn faulty_group(n: usize) -> (Vec<Arc<FaultDriver<HostDriver>>>, Group) {
    let faults: Vec<_> = (0..n).map(|_| Arc::new(FaultDriver::new(HostDriver::new().unwrap()))).collect();
    let arenas = faults.iter().map(|f| Arena::with_driver(f.clone(), cfg(8)).unwrap()).collect();
    (faults, Group::from_arenas(arenas).unwrap())
}

/// Issue 30, finding 9: a small group allocation grown past the small
/// classes on member 0 while member 1 fails must map on member 0 what it
/// mapped before.
#[test]
fn an_undone_group_resize_leaves_every_member_mapping_what_it_did() {
    let (faults, g) = faulty_group(2);
    let (id, _) = g.alloc(100 << 10).unwrap();
    let before: Vec<_> = g.query(id).unwrap().iter().map(|i| (i.size, i.mapped_bytes, i.reserved_bytes)).collect();
    let backing = |g: &Group| -> Vec<u64> { g.stats().unwrap().iter().map(|s| s.mapped_bytes).collect() };
    let backing_before = backing(&g);
    faults[1].fail_nth(Some(CallKind::Create), 1, FaultKind::OutOfMemory);
    let err = g.resize(id, 3 * C).unwrap_err();
    assert_eq!(err.member, Some(1), "{err}");
    assert!(err.undo_failures.is_empty(), "{err}");
    let after: Vec<_> = g.query(id).unwrap().iter().map(|i| (i.size, i.mapped_bytes, i.reserved_bytes)).collect();
    assert_eq!(after, before, "each member's allocation as before the failed resize");
    assert_eq!(backing(&g), backing_before, "each member backs what it backed");
}

/// Every driver call of a two-phase allocation and growth fails in turn
/// (both kinds): the prepare fails with the arena as it was; a retry then
/// succeeds, and its abort leaves the same allocations at the same places.
#[test]
fn every_driver_call_of_a_prepare_fails_cleanly_and_an_abort_restores_the_layout() {
    type Op = fn(&Arena, vmm_arena::Id) -> vmm_arena::Result<vmm_arena::Prepared>;
    let cases: [(&str, Op); 2] = [
        ("prepare_alloc", |a, _| a.prepare_alloc(3 * C, 5 * C, true).map(|(p, _)| p)),
        ("prepare_resize (growth)", |a, g| a.prepare_resize(g, 4 * C).map(|(p, _)| p)),
    ];
    let build = || {
        let fault = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
        let cfg = ArenaConfig { deterministic_placement: true, ..cfg(16) };
        let a = Arena::with_driver(fault.clone(), cfg).unwrap();
        let (x, _) = a.alloc(C).unwrap();
        let (g, _) = a.alloc_growable(C, 6 * C).unwrap();
        let (y, _) = a.alloc(2 * C).unwrap();
        a.free(x).unwrap(); // a hole, and pooled chunks
        let _ = y;
        (fault, a, g)
    };
    let layout = |a: &Arena| -> Vec<(u64, u64)> { Snap::of(a).live().map(|r| (r.addr, r.size)).collect() };
    let mut total = 0;
    for (name, op) in cases {
        let (fault, a, g) = build();
        let c0 = fault.total_calls();
        let p = op(&a, g).unwrap();
        let calls = fault.total_calls() - c0;
        assert!(calls > 0, "{name}");
        a.abort(p).unwrap();
        for i in 1..=calls {
            for kind in FaultKind::ALL {
                let what = format!("{name}: call {i} of {calls} fails with {kind:?}");
                let (fault, a, g) = build();
                let before = (Snap::of(&a).without_driver_counters(), common::stats_sans_driver(a.stats().unwrap()));
                let places = layout(&a);
                fault.fail_nth(None, i, kind);
                let e = op(&a, g).expect_err(&what);
                assert!(matches!(e.status(), vmm_arena::Status::OutOfMemory | vmm_arena::Status::Driver), "{what}");
                let now = (Snap::of(&a).without_driver_counters(), common::stats_sans_driver(a.stats().unwrap()));
                assert_eq!(now, before, "{what}: the arena changed");
                let p = op(&a, g).unwrap_or_else(|e| panic!("{what}: retry: {e}"));
                a.abort(p).unwrap();
                assert_eq!(layout(&a), places, "{what}: the abort left another layout");
                total += 1;
            }
        }
    }
    println!("two-phase fault matrix: {total} injected faults");
}

#[test]
fn prepares_refuse_what_an_abort_could_not_undo() {
    let a = Arena::with_driver(HostDriver::new().unwrap(), cfg(16)).unwrap();
    let (small, _) = a.alloc(1000).unwrap();
    assert_eq!(a.prepare_resize(small, 2 * C).unwrap_err().status(), vmm_arena::Status::InvalidArgument);
    let (x, _) = a.alloc(C).unwrap();
    assert_eq!(
        a.prepare_resize(x, 2 * C).unwrap_err().status(),
        vmm_arena::Status::InvalidArgument,
        "beyond its reservation"
    );
    let other = Arena::with_driver(HostDriver::new().unwrap(), cfg(4)).unwrap();
    let p = a.prepare_free(x).unwrap();
    assert_eq!(other.commit(p).unwrap_err().status(), vmm_arena::Status::InvalidArgument, "another arena's");
    // A shrink and a free happen at the commit only.
    let (g, _) = a.alloc_growable(3 * C, 3 * C).unwrap();
    let (p, _) = a.prepare_resize(g, C).unwrap();
    assert_eq!(a.query(g).unwrap().size, 3 * C);
    a.commit(p).unwrap();
    assert_eq!(a.query(g).unwrap().size, C);
    let p = a.prepare_free(g).unwrap();
    a.abort(p).unwrap();
    assert!(a.query(g).is_ok());
    // With no free range that fits, a prepare moves nothing: out of
    // address space, where a plain alloc would compact.
    let b = Arena::with_driver(
        HostDriver::new().unwrap(),
        ArenaConfig { capacity_bytes: 4 * C, reserve_bytes: 4 * C, chunk_bytes: C, ..ArenaConfig::default() },
    )
    .unwrap();
    let ids: Vec<_> = (0..4).map(|_| b.alloc(C).unwrap().0).collect();
    b.free(ids[0]).unwrap();
    b.free(ids[2]).unwrap();
    assert_eq!(b.prepare_alloc(2 * C, 2 * C, false).unwrap_err().status(), vmm_arena::Status::OutOfAddressSpace);
    b.compact().unwrap();
    let (p, _) = b.prepare_alloc(2 * C, 2 * C, false).unwrap();
    b.commit(p).unwrap();
}
