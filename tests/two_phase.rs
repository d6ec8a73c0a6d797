//! The two-phase protocol's guarantee, case by case: after a successful
//! prepare, with no other call on that allocation, commit cannot fail and
//! abort restores exactly the state before the prepare; after another call
//! changed the allocation, commit and abort refuse with `Stale` and change
//! nothing. Each test is one reproduction of a contract mismatch found by a
//! black-box tester (the random interleavings are in `tests/model.rs`).

use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::{Arena, ArenaConfig, Id, Status};

const C: u64 = 2 << 20;

fn arena(cap: u64) -> Arena {
    // Exportable chunks, for the cases with an export.
    let host = HostDriver::with_exportable_chunks(HostOptions::default()).unwrap();
    let cfg =
        ArenaConfig { capacity_bytes: cap * C, reserve_bytes: 4 * cap * C, chunk_bytes: C, ..ArenaConfig::default() };
    Arena::with_driver(host, cfg).unwrap()
}

/// Size, reservation and mapped bytes of `id`, and the arena's mapped bytes.
fn facts(a: &Arena, id: Id) -> (u64, u64, u64, u64) {
    let i = a.query(id).unwrap();
    (i.size, i.reserved_bytes, i.mapped_bytes, a.stats().unwrap().mapped_bytes)
}

#[test]
fn a_prepared_shrink_is_checked_as_the_commit_would_check_it() {
    let a = arena(16);
    let (p, _) = a.prepare_alloc(4 * C, 4 * C, true).unwrap();
    let id = p.id();
    a.commit(p).unwrap();
    // new_size 0: refused by the prepare, not by every rank's commit.
    let e = a.prepare_resize(id, 0).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // A shrink below an export's chunks.
    let _export = a.export(id).unwrap();
    let e = a.prepare_resize(id, C).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert_eq!(facts(&a, id).0, 4 * C);
    // A resize of an import.
    let b = arena(16);
    let (imported, _) = b.import_export(&a.export(id).unwrap(), false).unwrap();
    for size in [C, 4 * C, 8 * C] {
        let e = b.prepare_resize(imported, size).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "import, {size}: {e}");
    }
    let e = b.prepare_free(imported).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "two-phase free of an import: {e}");
}

#[test]
fn a_prepare_checks_its_own_arguments_before_the_allocation_state() {
    let a = arena(16);
    let (p, _) = a.prepare_alloc(2 * C, 3 * C, true).unwrap();
    let id = p.id();
    a.commit(p).unwrap();
    a.sleep(0, 0).unwrap();
    assert!(a.query(id).unwrap().asleep);
    // Beyond the reservation: the argument is wrong whatever the state.
    let e = a.prepare_resize(id, 4 * C).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    let e = a.prepare_resize(id, 0).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // A valid size: the state decides.
    let e = a.prepare_resize(id, 3 * C).unwrap_err();
    assert_eq!(e.status(), Status::Asleep, "{e}");
    let e = a.prepare_resize(id, C).unwrap_err();
    assert_eq!(e.status(), Status::Asleep, "{e}");
}

#[test]
fn commit_of_a_shrink_after_a_plain_shrink_is_stale_and_changes_nothing() {
    let a = arena(16);
    let (id, _) = a.alloc_growable(4 * C, 4 * C).unwrap();
    let (p, _) = a.prepare_resize(id, 3 * C).unwrap();
    a.resize(id, C).unwrap();
    let before = facts(&a, id);
    let e = a.commit(p).unwrap_err();
    assert_eq!(e.status(), Status::Stale, "{e}");
    assert_eq!(facts(&a, id), before, "the commit grew it back");
}

#[test]
fn abort_of_a_growth_after_a_plain_shrink_is_stale_and_changes_nothing() {
    let a = arena(16);
    let (id, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    let (p, _) = a.prepare_resize(id, 3 * C).unwrap();
    a.resize(id, C).unwrap();
    let before = facts(&a, id);
    let e = a.abort(p).unwrap_err();
    assert_eq!(e.status(), Status::Stale, "{e}");
    assert_eq!(facts(&a, id), before, "the abort grew it");
}

#[test]
fn abort_of_a_growth_after_a_later_growth_keeps_that_growth() {
    let a = arena(16);
    let (id, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    let (p, _) = a.prepare_resize(id, 3 * C).unwrap();
    a.resize(id, 4 * C).unwrap();
    let e = a.abort(p).unwrap_err();
    assert_eq!(e.status(), Status::Stale, "{e}");
    assert_eq!(facts(&a, id).0, 4 * C, "the abort dropped the later growth");
}

#[test]
fn stale_commits_with_the_capacity_in_use_fail_stale_not_out_of_memory() {
    // Capacity 4 chunks: the prepared shrink 4 -> 3, a plain shrink to 1,
    // then the freed chunks taken by another allocation.
    let a = Arena::with_driver(
        HostDriver::new().unwrap(),
        ArenaConfig { capacity_bytes: 4 * C, reserve_bytes: 16 * C, chunk_bytes: C, ..ArenaConfig::default() },
    )
    .unwrap();
    let (id, _) = a.alloc_growable(4 * C, 4 * C).unwrap();
    let (p, _) = a.prepare_resize(id, 3 * C).unwrap();
    a.resize(id, C).unwrap();
    let (_other, _) = a.alloc(3 * C).unwrap();
    let before = facts(&a, id);
    assert_eq!(a.commit(p).unwrap_err().status(), Status::Stale);
    assert_eq!(facts(&a, id), before);
    // A prepared growth 2 -> 3 shrunk to 1 behind it; abort refuses.
    let b = Arena::with_driver(
        HostDriver::new().unwrap(),
        ArenaConfig { capacity_bytes: 4 * C, reserve_bytes: 16 * C, chunk_bytes: C, ..ArenaConfig::default() },
    )
    .unwrap();
    let (id, _) = b.alloc_growable(2 * C, 4 * C).unwrap();
    let (p, _) = b.prepare_resize(id, 3 * C).unwrap();
    b.resize(id, C).unwrap();
    let (_other, _) = b.alloc(3 * C).unwrap();
    let before = facts(&b, id);
    assert_eq!(b.abort(p).unwrap_err().status(), Status::Stale);
    assert_eq!(facts(&b, id), before);
}

#[test]
fn commit_or_abort_after_the_allocation_was_freed_or_put_to_sleep_is_stale() {
    let a = arena(16);
    // A prepared allocation freed before its commit.
    let (p, _) = a.prepare_alloc(C, C, false).unwrap();
    a.free(p.id()).unwrap();
    assert_eq!(a.commit(p).unwrap_err().status(), Status::Stale);
    let (p, _) = a.prepare_alloc(C, C, false).unwrap();
    a.free(p.id()).unwrap();
    let live = a.stats().unwrap().live_allocations;
    assert_eq!(a.abort(p).unwrap_err().status(), Status::Stale);
    assert_eq!(a.stats().unwrap().live_allocations, live);
    // A prepared free of an allocation put to sleep.
    let (id, _) = a.alloc(2 * C).unwrap();
    let p = a.prepare_free(id).unwrap();
    a.sleep(0, 0).unwrap();
    assert_eq!(a.commit(p).unwrap_err().status(), Status::Stale);
    assert!(a.query(id).is_ok(), "still there");
    a.wake(0).unwrap();
    // Without another call: commit and abort do what they say.
    let p = a.prepare_free(id).unwrap();
    a.commit(p).unwrap();
    assert_eq!(a.query(id).unwrap_err().status(), Status::UnknownAllocation);
}

#[test]
fn a_prepared_free_of_a_sleeping_allocation_commits_and_aborts() {
    // A plain free of a sleeper is allowed (its backup is dropped), so a
    // prepare of it is too, and with no other call its commit and abort
    // cannot fail. A wake in between changes its state: stale.
    let a = arena(16);
    let (id, _) = a.alloc(2 * C).unwrap();
    a.sleep(0, vmm_arena::SLEEP_BACKUP).unwrap();
    let p = a.prepare_free(id).unwrap();
    a.abort(p).unwrap();
    assert!(a.query(id).unwrap().asleep, "an abort leaves it asleep");
    let p = a.prepare_free(id).unwrap();
    a.commit(p).unwrap();
    assert_eq!(a.query(id).unwrap_err().status(), Status::UnknownAllocation);
    assert_eq!(a.stats().unwrap().backup_bytes, 0, "its backup went with it");
    let (id, _) = a.alloc(C).unwrap();
    a.sleep(0, 0).unwrap();
    let p = a.prepare_free(id).unwrap();
    a.wake(0).unwrap();
    assert_eq!(a.commit(p).unwrap_err().status(), Status::Stale);
    assert!(a.query(id).is_ok(), "still there");
}

#[test]
fn without_another_call_abort_restores_exactly_the_state_before_the_prepare() {
    let a = arena(16);
    let (id, _) = a.alloc_growable(2 * C, 6 * C).unwrap();
    a.write(id, 0, &[7u8; 64]).unwrap();
    let before = (facts(&a, id), a.stats().unwrap().live_bytes, a.stats().unwrap().live_allocations);
    let (p, _) = a.prepare_resize(id, 5 * C).unwrap();
    a.abort(p).unwrap();
    let (p, _) = a.prepare_resize(id, C).unwrap();
    a.abort(p).unwrap();
    let p = a.prepare_free(id).unwrap();
    a.abort(p).unwrap();
    let (p, _) = a.prepare_alloc(3 * C, 3 * C, false).unwrap();
    a.abort(p).unwrap();
    assert_eq!((facts(&a, id), a.stats().unwrap().live_bytes, a.stats().unwrap().live_allocations), before);
    let mut buf = [0u8; 64];
    a.read(id, 0, &mut buf).unwrap();
    assert_eq!(buf, [7u8; 64]);
}

#[test]
fn commit_of_a_prepared_free_of_an_exported_allocation_cannot_fail_for_a_driver_call() {
    use std::sync::Arc;
    use vmm_arena::driver::fault::{FaultDriver, FaultKind};
    use vmm_arena::driver::Driver;
    // An allocation that had a DMA-BUF is exported until freed: its free
    // synchronizes, unmaps and releases its chunks (never pooled). A commit
    // makes none of those calls fail it: they are done, or the chunks are
    // held and given back by a later call.
    let host: Arc<dyn Driver> = Arc::new(HostDriver::new().unwrap().with_dmabuf_standin());
    let fd = Arc::new(FaultDriver::new(host));
    let cfg = ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 32 * C, chunk_bytes: C, ..ArenaConfig::default() };
    let a = Arena::with_driver(fd.clone(), cfg).unwrap();
    for n in 1..=4 {
        let (id, _) = a.alloc(2 * C).unwrap();
        drop(a.dmabuf(id).unwrap());
        let p = a.prepare_free(id).unwrap();
        fd.fail_nth(None, n, FaultKind::Driver);
        a.commit(p).unwrap_or_else(|e| panic!("commit with driver call {n} failing: {e}"));
        fd.clear();
        assert_eq!(a.query(id).unwrap_err().status(), Status::UnknownAllocation);
        assert_eq!(a.stats().unwrap().live_allocations, 0);
        // The next call gives whatever was held back to the driver.
        a.trim(0).unwrap();
        let s = a.stats().unwrap();
        assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, 0), "driver call {n} failing: chunks left");
        assert_eq!((fd.live_chunks(), fd.live_mappings()), (0, 0), "driver call {n} failing: chunks left");
    }
}
