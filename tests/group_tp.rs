//! Tensor-parallel groups: an in-process group's undo restores what each
//! member maps; placement is a pure function of the operations and the
//! config across separate processes (forked ranks); two-phase operations
//! (prepare on every rank, a vote, commit or abort) keep ranks identical
//! when one rank fails.

use std::sync::Arc;

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
