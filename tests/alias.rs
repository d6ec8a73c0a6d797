//! Zero-copy sharing (`Arena::alloc_shared`): one physical chunk mapped into
//! several allocations. Writes through either address are seen through the
//! other; a shared chunk counts once; free, shrink, moves, compaction,
//! sleep and wake keep the sharing rules of the contract.
//!
//! The fault matrix of `alloc_shared` and of the free that drops the last
//! reference is in `tests/faults.rs`; the property test (`tests/model.rs`)
//! covers random sequences.
//!
//! Backend: the host (64 KiB chunks), or device 0 when
//! `VMM_ARENA_TEST_BACKEND=cuda`; the raw-pointer checks are host only.

mod common;

use common::fixtures::{check_consistent, fault_arena as arena, pattern, read_bytes as read, status};
use common::{fill, read_all, test_backend, Snap, TestBackend, TestDriver};
use vmm_arena::{Arena, ArenaConfig, Error, Id, Status, ALL_TAGS, SLEEP_BACKUP};

/// Equal bytes, or where they first differ.
fn same(got: &[u8], want: &[u8], what: &str) {
    let at = got.iter().zip(want).position(|(g, w)| g != w);
    assert!(
        at.is_none() && got.len() == want.len(),
        "{what}: {} bytes for {}, first difference at {at:?}",
        got.len(),
        want.len()
    );
}

#[test]
fn writes_through_either_address_are_seen_through_the_other() {
    let (d, a, c) = arena(16, 64);
    let (src, sp) = a.alloc(4 * c).unwrap();
    fill(&a, src, 7);
    let creates = a.stats().unwrap().driver_creates;
    let (sh, shp) = a.alloc_shared(src, c, 2 * c, 5 * c).unwrap();
    assert_ne!(shp, sp + c, "a second address");
    let info = a.query(sh).unwrap();
    assert_eq!((info.size, info.reserved_bytes, info.mapped_bytes, info.growable), (2 * c, 5 * c, 2 * c, true));
    assert_eq!(read_all(&a, sh), pattern(7, 4 * c)[c as usize..3 * c as usize].to_vec(), "nothing copied, same bytes");
    assert_eq!(a.stats().unwrap().driver_creates, creates, "no chunk created");
    a.write(sh, 10, b"through the share").unwrap();
    assert_eq!(read(&a, src, c + 10, 17), b"through the share");
    a.write(src, 3 * c - 4, b"back").unwrap();
    assert_eq!(read(&a, sh, 2 * c - 4, 4), b"back");
    if test_backend() == TestBackend::Host {
        // SAFETY: host backend; both pointers are the allocations' current
        // addresses and these offsets lie below their sizes; this thread is
        // the arena's only user.
        unsafe {
            *((shp + 100) as *mut u8) = 0xab;
            assert_eq!(*((sp + c + 100) as *const u8), 0xab, "a raw write is seen at the other address");
        }
    }
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.shared_bytes, s.live_bytes), (4 * c, 2 * c, 6 * c));
    let snap = Snap::of(&a);
    let r = snap.live_by_id();
    assert_eq!((r[&sh.get()].shared_bytes, r[&src.get()].shared_bytes), (2 * c, 2 * c));
    assert_eq!(r[&sh.get()].shares_with, vec![src.get()]);
    assert_eq!(r[&src.get()].shared_runs, vec![(c, 2 * c)]);
    check_consistent(&a, &d);
}

#[test]
fn arguments_are_checked_in_the_contract_order() {
    let (_d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(5 * c / 2).unwrap(); // 2.5 chunks: shares at most 2
    let inv = Status::InvalidArgument;
    assert_eq!(status(a.alloc_shared(src, 0, 0, c)), inv, "bytes 0");
    assert_eq!(status(a.alloc_shared(src, 1, c, c)), inv, "offset not a chunk multiple");
    assert_eq!(status(a.alloc_shared(src, 0, c + 1, 2 * c)), inv, "bytes not a chunk multiple");
    assert_eq!(status(a.alloc_shared(src, 0, 3 * c, 3 * c)), inv, "beyond src's size");
    assert_eq!(status(a.alloc_shared(src, 2 * c, c, c)), inv, "the partial last chunk is not shared");
    assert_eq!(status(a.alloc_shared(src, u64::MAX - c + 1, c, c)), inv, "offset overflow");
    assert_eq!(status(a.alloc_shared(src, 0, 2 * c, c)), inv, "max_size < bytes");
    a.alloc_shared(src, 0, 2 * c, 2 * c).unwrap();
    let (small, _) = a.alloc(100).unwrap();
    assert_eq!(status(a.alloc_shared(small, 0, c, c)), inv, "a small src");
    a.free(small).unwrap();
    // INVALID_ARGUMENT before UNKNOWN_ALLOCATION, before ASLEEP.
    assert_eq!(a.alloc_shared(small, 0, c, c), Err(Error::UnknownAllocation(small.get())));
    assert_eq!(status(a.alloc_shared(small, 0, 0, c)), inv, "invalid first");
    a.set_tag(src, 1).unwrap();
    a.sleep(1, 0).unwrap();
    assert_eq!(a.alloc_shared(src, 0, c, c), Err(Error::Asleep(src.get())));
    assert_eq!(status(a.alloc_shared(src, 0, 3 * c, 3 * c)), inv, "invalid before asleep");
}

#[test]
fn a_shared_chunk_stays_until_its_last_holder_lets_go() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(3 * c).unwrap();
    fill(&a, src, 1);
    let (sh, _) = a.alloc_shared(src, 0, 2 * c, 2 * c).unwrap();
    a.free(src).unwrap();
    assert_eq!(read_all(&a, sh), pattern(1, 2 * c), "the sharer keeps the bytes");
    let s = a.stats().unwrap();
    // src's own third chunk is pooled; its pages of the shared ones are
    // retired (still mapped, unmapped on release).
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.shared_bytes, s.retired_va_bytes), (2 * c, c, 0, 2 * c));
    check_consistent(&a, &d);
    a.release_retired().unwrap();
    assert_eq!(read_all(&a, sh), pattern(1, 2 * c));
    check_consistent(&a, &d);
    a.free(sh).unwrap();
    assert_eq!(a.trim(0).unwrap(), 3 * c);
    assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), (0, 0));
}

#[test]
fn the_free_of_the_last_holder_gives_the_chunk_back_under_the_watermark() {
    let backend = test_backend();
    let (d, c) = (backend.driver(), backend.chunk());
    let cfg = ArenaConfig {
        capacity_bytes: 8 * c,
        reserve_bytes: 32 * c,
        chunk_bytes: c,
        retain_bytes: 0,
        ..Default::default()
    };
    let a = Arena::with_driver(d.fault.clone(), cfg).unwrap();
    let (src, _) = a.alloc(2 * c).unwrap();
    let (sh, _) = a.alloc_shared(src, 0, 2 * c, 2 * c).unwrap();
    a.free(sh).unwrap();
    assert_eq!(d.fault.live_chunks(), 2, "src still maps both chunks");
    a.free(src).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.retired_va_bytes), (0, 0, 0));
    assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), (0, 0), "released, and every alias unmapped");
}

#[test]
fn shrinking_a_sharer_drops_its_references_only() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(3 * c).unwrap();
    fill(&a, src, 2);
    let (sh, shp) = a.alloc_shared(src, 0, 3 * c, 4 * c).unwrap();
    assert_eq!(a.resize(sh, c).unwrap(), shp);
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.shared_bytes), (3 * c, c));
    check_consistent(&a, &d);
    // Growing again gives new chunks: src's bytes are not touched.
    assert_eq!(a.resize(sh, 3 * c).unwrap(), shp, "growth within the reservation");
    a.write(sh, c, &vec![0x5a; c as usize]).unwrap();
    assert_eq!(read_all(&a, src), pattern(2, 3 * c), "src unchanged by the sharer's new pages");
    assert_eq!(a.stats().unwrap().mapped_bytes, 5 * c);
    // Shrinking src (not growable) retires its shared page.
    a.resize(src, c / 2).unwrap();
    assert_eq!(read(&a, sh, 0, 16), pattern(2, 16));
    check_consistent(&a, &d);
}

#[test]
fn moves_and_compaction_keep_the_sharing() {
    let (d, a, c) = arena(16, 24);
    let (hole, _) = a.alloc(4 * c).unwrap();
    let (src, _) = a.alloc(2 * c).unwrap();
    fill(&a, src, 3);
    let (sh, shp) = a.alloc_shared(src, 0, 2 * c, 2 * c).unwrap();
    a.free(hole).unwrap();
    let r = a.compact().unwrap();
    assert!(r.moved_allocations >= 1, "{r:?}");
    assert_ne!(a.query(sh).unwrap().ptr, shp, "the sharer moved down");
    a.write(sh, 8, b"moved").unwrap();
    assert_eq!(read(&a, src, 8, 5), b"moved", "still the same chunk");
    // Growth beyond the reservation moves the sharer by remapping.
    let before = a.query(sh).unwrap().ptr;
    a.resize(sh, 8 * c).unwrap();
    assert_ne!(a.query(sh).unwrap().ptr, before);
    a.write(src, 16, b"after").unwrap();
    assert_eq!(read(&a, sh, 16, 5), b"after");
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.shared_bytes), (8 * c, 2 * c));
    check_consistent(&a, &d);
}

#[test]
fn sleep_keeps_a_chunk_an_awake_allocation_maps_and_wake_maps_it_again() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(2 * c).unwrap();
    fill(&a, src, 4);
    let (sh, _) = a.alloc_growable(c, 4 * c).unwrap();
    a.free(sh).unwrap();
    let (sh, _) = a.alloc_shared(src, 0, 2 * c, 3 * c).unwrap();
    a.resize(sh, 3 * c).unwrap(); // one page of its own
    a.write(sh, 2 * c, b"own").unwrap();
    a.set_tag(sh, 1).unwrap();
    a.sleep(1, SLEEP_BACKUP).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.shared_bytes), (2 * c, 0, 0), "src's chunks stay, the own one went");
    assert_eq!(read_all(&a, src), pattern(4, 2 * c));
    a.write(src, 0, b"while asleep").unwrap();
    check_consistent(&a, &d);
    a.wake(1).unwrap();
    assert_eq!(read(&a, sh, 0, 12), b"while asleep", "the kept chunk is mapped again as it is now");
    assert_eq!(read(&a, sh, 2 * c, 3), b"own", "the new chunk gets the backup");
    a.write(sh, c, b"shared again").unwrap();
    assert_eq!(read(&a, src, c, 12), b"shared again");
    assert_eq!(a.stats().unwrap().shared_bytes, 2 * c);
    check_consistent(&a, &d);
}

#[test]
fn sleepers_that_shared_share_again_after_they_wake() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(2 * c).unwrap();
    fill(&a, src, 5);
    let (sh, _) = a.alloc_shared(src, c, c, c).unwrap();
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, 0), "nobody awake maps them: all given back");
    assert_eq!(d.fault.live_chunks(), 0);
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(read_all(&a, src), pattern(5, 2 * c));
    assert_eq!(read_all(&a, sh), pattern(5, 2 * c)[c as usize..].to_vec());
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.shared_bytes), (2 * c, c), "one chunk for both");
    a.write(sh, 0, b"together").unwrap();
    assert_eq!(read(&a, src, c, 8), b"together");
    check_consistent(&a, &d);
}

#[test]
fn a_group_woken_in_two_steps_shares_the_first_wakers_chunk() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(c).unwrap();
    fill(&a, src, 6);
    let (sh, _) = a.alloc_shared(src, 0, c, c).unwrap();
    a.set_tag(src, 1).unwrap();
    a.set_tag(sh, 2).unwrap();
    a.sleep(2, SLEEP_BACKUP).unwrap(); // src still maps the chunk: kept
    a.write(src, 0, b"newer").unwrap();
    a.sleep(1, SLEEP_BACKUP).unwrap(); // now nobody awake maps it
    assert_eq!(d.fault.live_chunks(), 0);
    a.wake(2).unwrap();
    // The member that slept last (src) has the newest bytes.
    assert_eq!(read(&a, sh, 0, 5), b"newer");
    a.write(sh, 8, b"sh").unwrap();
    a.wake(1).unwrap();
    assert_eq!(read(&a, src, 8, 2), b"sh", "src maps the chunk sh woke with, as it is now");
    assert_eq!(a.stats().unwrap().shared_bytes, c);
    check_consistent(&a, &d);
}

/// A member whose size ends inside the group's chunk backs up only part of
/// it: the rest of the new chunk comes from a member whose backup covers
/// it. (Found by the property test: sh, slept after src in the same call,
/// gave the chunk its 32453 bytes only, and src lost the rest of its page.)
#[test]
fn a_group_chunk_gets_every_byte_some_member_backed_up() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(c).unwrap();
    fill(&a, src, 9);
    let (sh, shp) = a.alloc_shared(src, 0, c, c).unwrap();
    assert!(shp > a.query(src).unwrap().ptr, "sh lies above src: it sleeps after src in the same call");
    let part = c / 2 - 315;
    a.resize(sh, part).unwrap(); // its page stays: it still maps src's chunk
    assert_eq!(a.stats().unwrap().shared_bytes, c);
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    assert_eq!(d.fault.live_chunks(), 0);
    a.wake(ALL_TAGS).unwrap();
    same(&read_all(&a, src), &pattern(9, c), "src's whole page, though sh backed up part of it");
    same(&read_all(&a, sh), &pattern(9, part), "sh");
    a.write(src, 8, b"again").unwrap();
    assert_eq!(read(&a, sh, 8, 5), b"again", "they share again");
    check_consistent(&a, &d);
}

/// Members that slept at different times: each byte comes from the newest
/// backup that covers it, here the later but shorter one's where it has
/// them and the earlier one's beyond; also when the short member wakes
/// first and alone.
#[test]
fn a_group_chunk_takes_each_byte_from_the_newest_backup_covering_it() {
    for short_wakes_first in [false, true] {
        let (d, a, c) = arena(16, 64);
        let (src, _) = a.alloc(c).unwrap();
        fill(&a, src, 10);
        let (sh, _) = a.alloc_shared(src, 0, c, c).unwrap();
        let part = c / 4 + 3;
        a.resize(sh, part).unwrap();
        a.set_tag(src, 1).unwrap();
        a.set_tag(sh, 2).unwrap();
        a.sleep(1, SLEEP_BACKUP).unwrap(); // sh still maps the chunk: kept
        a.write(sh, 0, b"newer").unwrap();
        a.sleep(2, SLEEP_BACKUP).unwrap(); // now nobody awake maps it
        assert_eq!(d.fault.live_chunks(), 0);
        if short_wakes_first {
            a.wake(2).unwrap();
            assert_eq!(read(&a, sh, 0, 5), b"newer");
        }
        a.wake(ALL_TAGS).unwrap();
        let mut want = pattern(10, c);
        want[..5].copy_from_slice(b"newer");
        same(&read_all(&a, src), &want, &format!("src, short_wakes_first {short_wakes_first}"));
        same(&read_all(&a, sh), &want[..part as usize], &format!("sh, short_wakes_first {short_wakes_first}"));
        assert_eq!(a.stats().unwrap().shared_bytes, c);
        check_consistent(&a, &d);
    }
}

#[test]
fn freeing_a_sleeper_leaves_its_group() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(c).unwrap();
    let (sh, _) = a.alloc_shared(src, 0, c, c).unwrap();
    let (sh2, _) = a.alloc_shared(sh, 0, c, c).unwrap();
    fill(&a, src, 8);
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    a.free(sh).unwrap();
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(read_all(&a, sh2), pattern(8, c));
    a.write(sh2, 0, b"x").unwrap();
    assert_eq!(read(&a, src, 0, 1), b"x");
    assert_eq!(a.stats().unwrap().mapped_bytes, c);
    a.free(src).unwrap();
    a.free(sh2).unwrap();
    a.release_retired().unwrap();
    a.trim(0).unwrap();
    check_consistent(&a, &d);
    assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), (0, 0));
}

#[test]
fn dropping_an_arena_with_shared_chunks_releases_each_once() {
    let (d, a, c) = arena(16, 64);
    let (src, _) = a.alloc(2 * c).unwrap();
    let _sh = a.alloc_shared(src, 0, 2 * c, 2 * c).unwrap();
    let _sh2 = a.alloc_shared(src, c, c, 2 * c).unwrap();
    // Counted from here: creating the arena probed the driver's unmaps
    // with a chunk of its own (created and released).
    let releases = || d.fault.calls(vmm_arena::driver::CallKind::Release);
    let before = releases();
    drop(a);
    assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), (0, 0));
    assert_eq!(releases() - before, 2, "two chunks, two releases");
}

/// Sleepers sharing chunks with each other and with an awake allocation.
/// Returns the driver, the arena and (src, sh, sh2): src (tag 1) and sh
/// (tag 1, one page of src's and one of its own) asleep with backups, sh2
/// (awake) mapping src's first chunk, and one cached chunk to steal.
fn sleeping_sharers() -> (TestDriver, Arena, u64, [Id; 3]) {
    let (d, a, c) = arena(4, 32);
    let (src, _) = a.alloc(2 * c).unwrap();
    fill(&a, src, 1);
    let (sh, _) = a.alloc_shared(src, c, c, 2 * c).unwrap();
    a.resize(sh, 2 * c).unwrap();
    a.write(sh, c, b"own").unwrap();
    let (sh2, _) = a.alloc_shared(src, 0, c, c).unwrap();
    let (k, _) = a.alloc(c).unwrap();
    a.set_tag(src, 1).unwrap();
    a.set_tag(sh, 1).unwrap();
    a.sleep(1, SLEEP_BACKUP).unwrap();
    a.free(k).unwrap(); // cached: wake steals it, and creates one more
    (d, a, c, [src, sh, sh2])
}

fn check_woken_sharers(a: &Arena, c: u64, [src, sh, sh2]: [Id; 3]) {
    assert_eq!(read_all(a, src), pattern(1, 2 * c), "src's bytes: the kept chunk and the group's backup");
    assert_eq!(read(a, sh, c, 3), b"own");
    a.write(src, c + 5, b"grp").unwrap();
    assert_eq!(read(a, sh, 5, 3), b"grp", "src and sh share again");
    a.write(sh2, 9, b"kept").unwrap();
    assert_eq!(read(a, src, 9, 4), b"kept", "src maps sh2's chunk again");
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.shared_bytes), (3 * c, 2 * c));
}

#[test]
fn wake_of_sharers_restores_every_share() {
    let (d, a, c, ids) = sleeping_sharers();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (c, c), "only sh2's chunk is kept, and k's cached one");
    a.wake(1).unwrap();
    check_woken_sharers(&a, c, ids);
    check_consistent(&a, &d);
}

/// The fault matrix of that wake: every call fails in turn, with each kind
/// of failure; the arena is as before (every sleeper still asleep, its
/// backup intact), and a wake without faults then restores every share.
#[test]
fn every_driver_call_of_a_wake_of_sharers_fails_cleanly() {
    use vmm_arena::driver::fault::FaultKind;
    let (twin_d, twin, _, _) = sleeping_sharers();
    let calls0 = twin_d.fault.total_calls();
    twin.wake(1).unwrap();
    let calls = twin_d.fault.total_calls() - calls0;
    assert!(calls >= 8, "steal, create, maps, access and writes: {calls} calls");
    for i in 1..=calls {
        for kind in FaultKind::ALL {
            let what = format!("call {i} of {calls} fails with {kind:?}");
            let (d, a, c, ids) = sleeping_sharers();
            let before = (Snap::of(&a).without_driver_counters(), common::stats_sans_driver(a.stats().unwrap()));
            let live = (d.fault.live_chunks(), d.fault.live_mappings());
            d.fault.fail_nth(None, i, kind);
            let e = a.wake(1).expect_err(&what);
            assert!(matches!(e.status(), Status::OutOfMemory | Status::Driver), "{what}: {e}");
            assert!(!d.fault.pending(), "{what}: fewer calls than the twin");
            let after = (Snap::of(&a).without_driver_counters(), common::stats_sans_driver(a.stats().unwrap()));
            assert_eq!(after, before, "{what}: the arena changed");
            assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), live, "{what}: leaked");
            d.fault.clear();
            a.wake(1).unwrap_or_else(|e| panic!("{what}: the wake after: {e}"));
            check_woken_sharers(&a, c, ids);
            check_consistent(&a, &d);
        }
    }
}
