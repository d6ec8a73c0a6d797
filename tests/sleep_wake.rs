//! Sleep and wake (`Arena::set_tag`, `Arena::sleep`, `Arena::wake`): a tag's
//! physical memory goes back to the driver and comes back at the same
//! addresses, with the bytes of those that slept with a backup.
//!
//! The fault matrix of sleep and wake is in `tests/faults.rs` (its case
//! table); this file checks the behaviour without faults, and the one fault
//! the table cannot express (a release that fails after the sleep is done).
//!
//! Backend: the host (64 KiB chunks), or device 0 when
//! `VMM_ARENA_TEST_BACKEND=cuda`; the raw-pointer test is host only.

mod common;

use common::fixtures::{check_consistent, fault_arena as arena, pattern, status};
use common::{fill, read_all, test_backend, Snap, TestBackend};
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::CallKind;
use vmm_arena::{Id, Status, ALL_TAGS, SLEEP_BACKUP};

#[test]
fn wake_restores_the_backup_at_the_same_address() {
    let (d, a, c) = arena(16, 64);
    let (w, wp) = a.alloc(3 * c + 100).unwrap();
    let (g, gp) = a.alloc_growable(c + 7, 4 * c).unwrap();
    let (k, _) = a.alloc(2 * c).unwrap();
    for (id, seed) in [(w, 1), (g, 2), (k, 3)] {
        fill(&a, id, seed);
    }
    a.set_tag(w, 1).unwrap();
    a.set_tag(g, 1).unwrap();
    a.set_tag(k, 2).unwrap();
    let before = a.stats().unwrap();
    a.sleep(1, SLEEP_BACKUP).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.live_allocations, s.live_bytes), (before.live_allocations, before.live_bytes));
    assert_eq!(s.mapped_bytes, 2 * c, "only k stays mapped");
    assert_eq!(s.asleep_bytes, 4 * c + 4 * c, "w's 4 chunks and g's reservation of 4");
    assert_eq!(s.backup_bytes, 3 * c + 100 + c + 7);
    assert_eq!(s.pooled_bytes, 0, "sleep gives back every pooled chunk");
    assert_eq!(d.fault.live_chunks(), 2, "the driver holds k's chunks only");
    let info = a.query(w).unwrap();
    assert!(info.asleep && info.tag == 1 && info.ptr == wp && info.mapped_bytes == 0, "{info:?}");
    assert_eq!(read_all(&a, k), pattern(3, 2 * c), "the other tag is untouched");
    check_consistent(&a, &d);

    a.wake(1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.asleep_bytes, s.backup_bytes, s.mapped_bytes), (0, 0, before.mapped_bytes));
    assert_eq!(a.query(w).unwrap().ptr, wp);
    assert_eq!(a.query(g).unwrap().ptr, gp);
    assert_eq!(read_all(&a, w), pattern(1, 3 * c + 100));
    assert_eq!(read_all(&a, g), pattern(2, c + 7));
    // A kernel (or CUDA graph) keeps the raw address across sleep and wake;
    // on the host, a pointer kept by the test reads the restored bytes.
    if test_backend() == TestBackend::Host {
        // SAFETY: w is awake again, its 3 * c + 100 bytes are mapped
        // read-write at wp, and nothing else touches them meanwhile.
        let raw = unsafe { std::slice::from_raw_parts(wp as *const u8, (3 * c + 100) as usize) };
        assert_eq!(raw, &pattern(1, 3 * c + 100)[..], "the kept pointer reads the restored bytes");
        // SAFETY: as above, for g's first c + 7 bytes at gp.
        let raw = unsafe { std::slice::from_raw_parts(gp as *const u8, (c + 7) as usize) };
        assert_eq!(raw, &pattern(2, c + 7)[..]);
    }
    // Awake again: it grows, moves and is written like any allocation.
    a.resize(g, 3 * c).unwrap();
    a.write(w, 0, b"again").unwrap();
    check_consistent(&a, &d);
}

#[test]
fn sleep_without_backup_discards_the_bytes_and_keeps_the_place() {
    let (d, a, c) = arena(8, 32);
    let (kv, p) = a.alloc_growable(2 * c, 6 * c).unwrap();
    fill(&a, kv, 9);
    a.set_tag(kv, 2).unwrap();
    a.sleep(2, 0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.backup_bytes, s.asleep_bytes), (0, 0, 6 * c));
    assert_eq!(d.fault.live_chunks(), 0);
    assert_eq!(d.fault.live_mappings(), 0);
    a.wake(2).unwrap();
    let info = a.query(kv).unwrap();
    assert_eq!((info.ptr, info.size, info.mapped_bytes, info.asleep), (p, 2 * c, 2 * c, false));
    // Contents unspecified, but readable and writable again.
    assert_eq!(read_all(&a, kv).len() as u64, 2 * c);
    fill(&a, kv, 10);
    assert_eq!(read_all(&a, kv), pattern(10, 2 * c));
    check_consistent(&a, &d);
}

#[test]
fn a_sleeping_allocation_refuses_what_needs_its_memory() {
    let (d, a, c) = arena(8, 32);
    let (x, _) = a.alloc_growable(c, 4 * c).unwrap();
    let (y, _) = a.alloc(c).unwrap();
    a.set_tag(x, 5).unwrap();
    a.sleep(5, SLEEP_BACKUP).unwrap();
    assert_eq!(status(a.resize(x, 2 * c)), Status::Asleep, "grow");
    assert_eq!(status(a.resize(x, c / 2)), Status::Asleep, "shrink");
    assert_eq!(status(a.resize(x, 0)), Status::InvalidArgument, "INVALID_ARGUMENT comes first");
    assert_eq!(status(a.pin(x)), Status::Asleep);
    assert_eq!(status(a.write(x, 0, b"no")), Status::Asleep);
    assert_eq!(status(a.read(x, 0, &mut [0u8; 4])), Status::Asleep);
    assert_eq!(status(a.read(x, c, &mut [0u8; 4])), Status::InvalidArgument, "a span beyond the size");
    assert_eq!(Status::Asleep.name(), "VMM_ARENA_ERR_ASLEEP");
    assert_eq!(Status::Asleep as u32, 9);
    // What works: query, unpin, set_tag, and an awake neighbour.
    assert!(a.query(x).unwrap().asleep);
    a.unpin(x).unwrap();
    a.set_tag(x, 6).unwrap();
    assert_eq!(a.query(x).unwrap().tag, 6);
    a.resize(y, 2 * c).unwrap();
    a.wake(5).unwrap();
    assert!(a.query(x).unwrap().asleep, "wake(5) no longer selects it: its tag is 6");
    a.wake(6).unwrap();
    a.pin(x).unwrap();
    // A pinned allocation sleeps too, and stays pinned.
    a.sleep(6, 0).unwrap();
    let info = a.query(x).unwrap();
    assert!(info.asleep && info.pinned);
    check_consistent(&a, &d);
}

#[test]
fn free_while_asleep_drops_the_backup() {
    let (d, a, c) = arena(8, 32);
    let (x, _) = a.alloc(3 * c).unwrap();
    let (y, _) = a.alloc(c).unwrap();
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    assert_eq!(a.stats().unwrap().backup_bytes, 4 * c);
    a.free(x).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.live_allocations, s.live_bytes, s.backup_bytes, s.asleep_bytes), (1, c, c, c));
    assert_eq!(status(a.query(x)), Status::UnknownAllocation);
    check_consistent(&a, &d);
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(d.fault.live_chunks(), 1, "only y's chunk comes back");
    a.free(y).unwrap();
    check_consistent(&a, &d);
}

#[test]
fn compaction_never_moves_a_sleeping_allocation() {
    // Pages: [h][h][h][s][y][free 5..8): compaction would move s and y down.
    let (d, a, c) = arena(8, 8);
    let v: Vec<Id> = (0..5).map(|_| a.alloc(c).unwrap().0).collect();
    for &h in &v[..3] {
        a.free(h).unwrap();
    }
    let (s, y) = (v[3], v[4]);
    let sp = a.query(s).unwrap().ptr;
    a.set_tag(s, 7).unwrap();
    fill(&a, s, 77);
    a.sleep(7, SLEEP_BACKUP).unwrap();
    a.compact().unwrap();
    assert_eq!(a.query(s).unwrap().ptr, sp, "compact left the sleeper where it was");
    assert!(a.query(y).unwrap().ptr < sp, "and moved the awake y below it");
    // Six free pages, split by the sleeper: a request for six must move it,
    // and may not (like a pinned allocation).
    assert_eq!(a.stats().unwrap().free_va_bytes, 6 * c);
    assert_eq!(status(a.alloc(6 * c)), Status::OutOfAddressSpace, "the sleeper is in the way");
    assert_eq!(status(a.alloc_growable(c, 6 * c)), Status::OutOfAddressSpace);
    assert_eq!(a.query(s).unwrap().ptr, sp);
    a.wake(7).unwrap();
    assert_eq!(read_all(&a, s), pattern(77, c));
    // Awake, it moves again.
    a.alloc(6 * c).unwrap();
    assert_ne!(a.query(s).unwrap().ptr, sp);
    assert_eq!(read_all(&a, s), pattern(77, c));
    check_consistent(&a, &d);
}

#[test]
fn sleeping_everything_gives_every_chunk_back() {
    let (d, a, c) = arena(16, 64);
    // A growable allocation that moved (its old range retired, still
    // mapping its first chunk), cached chunks, unmapped pooled chunks.
    let (g, _) = a.alloc_growable(c, c).unwrap();
    let (b, _) = a.alloc(c).unwrap();
    fill(&a, g, 1);
    a.resize(g, 2 * c).unwrap();
    assert!(a.stats().unwrap().retired_va_bytes > 0);
    let (t, _) = a.alloc(3 * c).unwrap();
    a.free(t).unwrap();
    assert!(a.stats().unwrap().pooled_bytes > 0);
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.retired_va_bytes), (0, 0, 0), "{s:?}");
    assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), (0, 0), "the driver holds nothing");
    if let Some(h) = &d.host {
        assert_eq!(h.allocated_file_bytes().unwrap(), 0, "the memfd holds nothing");
    }
    assert_eq!(s.live_allocations, 2);
    check_consistent(&a, &d);
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(&read_all(&a, g)[..c as usize], &pattern(1, c)[..]);
    assert_eq!(read_all(&a, b).len() as u64, c);
    check_consistent(&a, &d);
}

#[test]
fn tags_select_what_sleeps() {
    let (d, a, c) = arena(16, 64);
    let ids: Vec<Id> = (0..4).map(|_| a.alloc(c + 1).unwrap().0).collect();
    for (i, &id) in ids.iter().enumerate() {
        a.set_tag(id, i as u32 % 2).unwrap();
    }
    a.sleep(1, 0).unwrap();
    let asleep: Vec<bool> = ids.iter().map(|&id| a.query(id).unwrap().asleep).collect();
    assert_eq!(asleep, [false, true, false, true]);
    a.sleep(ALL_TAGS, 0).unwrap();
    assert!(ids.iter().all(|&id| a.query(id).unwrap().asleep));
    a.wake(0).unwrap();
    let asleep: Vec<bool> = ids.iter().map(|&id| a.query(id).unwrap().asleep).collect();
    assert_eq!(asleep, [false, true, false, true]);
    a.wake(ALL_TAGS).unwrap();
    assert!(ids.iter().all(|&id| !a.query(id).unwrap().asleep));
    // Waking or sleeping a tag nobody has makes no driver call.
    let calls = d.fault.total_calls();
    a.wake(42).unwrap();
    assert_eq!(d.fault.total_calls(), calls);
    check_consistent(&a, &d);
}

#[test]
fn bad_arguments() {
    let (_d, a, c) = arena(8, 32);
    assert_eq!(status(a.sleep(0, 2)), Status::InvalidArgument, "unknown flag bit");
    assert_eq!(status(a.sleep(0, SLEEP_BACKUP | 0x8000_0000)), Status::InvalidArgument);
    let (big, _) = a.alloc(c).unwrap();
    a.free(big).unwrap();
    assert_eq!(status(a.set_tag(big, 1)), Status::UnknownAllocation);
    // A small allocation takes a tag and sleeps with it (tests/tags.rs).
    let (small, _) = a.alloc(1000).unwrap();
    a.set_tag(small, 1).unwrap();
    a.sleep(ALL_TAGS, 0).unwrap();
    assert!(a.query(small).unwrap().asleep);
    assert_eq!(status(a.write(small, 0, b"asleep")), Status::Asleep);
}

#[test]
fn wake_without_room_keeps_everything_asleep() {
    let (d, a, c) = arena(6, 32);
    let (x, xp) = a.alloc(2 * c).unwrap();
    let (y, _) = a.alloc(2 * c).unwrap();
    fill(&a, x, 1);
    fill(&a, y, 2);
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    // The trainer takes most of the capacity.
    let (t, _) = a.alloc(3 * c).unwrap();
    assert_eq!(status(a.wake(ALL_TAGS)), Status::OutOfMemory, "4 chunks needed, 3 left");
    assert!(a.query(x).unwrap().asleep && a.query(y).unwrap().asleep, "all or nothing");
    assert_eq!(a.stats().unwrap().backup_bytes, 4 * c);
    check_consistent(&a, &d);
    a.free(t).unwrap();
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(a.query(x).unwrap().ptr, xp);
    assert_eq!(read_all(&a, x), pattern(1, 2 * c));
    assert_eq!(read_all(&a, y), pattern(2, 2 * c));
    check_consistent(&a, &d);
}

/// A wake refused for memory made driver calls first (the first sleeper
/// mapped, the second found no room) and relied on a rollback; a driver
/// failure during that rollback leaked a chunk (found by the `c_abi` fuzz
/// target). The refusal is now decided before any driver call.
#[test]
fn a_wake_refused_for_memory_makes_no_driver_call() {
    let (d, a, c) = arena(6, 32);
    let (x, _) = a.alloc(2 * c).unwrap();
    let (y, _) = a.alloc(2 * c).unwrap();
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    let (_t, _) = a.alloc(3 * c).unwrap(); // 3 chunks obtainable, 4 needed
    let calls = d.fault.total_calls();
    assert_eq!(status(a.wake(ALL_TAGS)), Status::OutOfMemory);
    assert_eq!(d.fault.total_calls(), calls, "refused before any driver call");
    // So no failure can hit an undo: whichever call fails, nothing leaks.
    for n in 1..8 {
        d.fault.fail_nth(None, n, FaultKind::OutOfMemory);
        assert_eq!(status(a.wake(ALL_TAGS)), Status::OutOfMemory);
        d.fault.clear();
        assert!(a.query(x).unwrap().asleep && a.query(y).unwrap().asleep);
        check_consistent(&a, &d);
    }
}

/// The releases come after the sleep's point of no return (the unmaps): a
/// failed release keeps its chunk pooled, counts in `release_failures`, and
/// the sleep has happened. Every other call's failure is in the fault matrix.
#[test]
fn a_failed_release_keeps_the_chunk_pooled() {
    for kind in FaultKind::ALL {
        for n in 1..=3 {
            let (d, a, c) = arena(8, 32);
            let (x, xp) = a.alloc(2 * c).unwrap();
            let (y, _) = a.alloc(c).unwrap();
            a.free(y).unwrap(); // one cached chunk
            fill(&a, x, 4);
            d.fault.fail_nth(Some(CallKind::Release), n, kind);
            a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
            assert!(!d.fault.pending(), "three releases: x's two chunks and the cached one");
            let s = a.stats().unwrap();
            assert!(a.query(x).unwrap().asleep);
            assert_eq!((s.release_failures, s.pooled_bytes, s.mapped_bytes), (1, c, 0), "{kind:?} {n}");
            check_consistent(&a, &d);
            assert_eq!(a.trim(0).unwrap(), c, "trim gives it back later");
            a.wake(ALL_TAGS).unwrap();
            assert_eq!(a.query(x).unwrap().ptr, xp);
            assert_eq!(read_all(&a, x), pattern(4, 2 * c));
            check_consistent(&a, &d);
        }
    }
}

/// Backups live in host buffers the driver lends (`Driver::alloc_host`:
/// pinned on CUDA), one per sleeper, freed when it wakes or is freed.
#[test]
fn backups_are_host_buffers_from_the_driver() {
    let (d, a, c) = arena(8, 32);
    let (x, _) = a.alloc(2 * c).unwrap();
    let (y, _) = a.alloc(c + 3).unwrap();
    let (z, _) = a.alloc(c).unwrap();
    fill(&a, x, 5);
    fill(&a, y, 6);
    a.set_tag(z, 7).unwrap();
    a.sleep(7, 0).unwrap();
    assert_eq!((d.fault.calls(CallKind::HostAlloc), d.fault.live_host_buffers()), (0, 0), "no backup, no buffer");
    a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap();
    assert_eq!(d.fault.calls(CallKind::HostAlloc), 2, "one buffer per sleeper backed up");
    assert_eq!(d.fault.live_host_buffers(), 2);
    assert_eq!(a.stats().unwrap().backup_bytes, 3 * c + 3);
    a.free(y).unwrap();
    assert_eq!(d.fault.live_host_buffers(), 1, "free drops the backup");
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(d.fault.live_host_buffers(), 0, "wake drops the backup");
    assert_eq!(read_all(&a, x), pattern(5, 2 * c));
    check_consistent(&a, &d);
}

/// A backup buffer the driver cannot give (the second of two) fails the
/// sleep before any unmap: nothing has slept, the first buffer is freed,
/// every byte is in place.
#[test]
fn a_backup_buffer_refused_leaves_everything_awake() {
    for kind in FaultKind::ALL {
        let (d, a, c) = arena(8, 32);
        let (x, xp) = a.alloc(2 * c).unwrap();
        let (y, _) = a.alloc(c + 9).unwrap();
        fill(&a, x, 1);
        fill(&a, y, 2);
        let before = Snap::of(&a).without_driver_counters();
        d.fault.fail_nth(Some(CallKind::HostAlloc), 2, kind);
        let e = a.sleep(ALL_TAGS, SLEEP_BACKUP).unwrap_err();
        assert!(!d.fault.pending(), "the second buffer was asked for");
        let want = if kind == FaultKind::OutOfMemory { Status::OutOfMemory } else { Status::Driver };
        assert_eq!(e.status(), want, "{e}");
        assert_eq!(Snap::of(&a).without_driver_counters(), before, "{kind:?}: nothing slept");
        assert_eq!(d.fault.live_host_buffers(), 0, "{kind:?}: the first buffer is freed");
        assert!(!a.query(x).unwrap().asleep && a.query(x).unwrap().ptr == xp);
        assert_eq!((read_all(&a, x), read_all(&a, y)), (pattern(1, 2 * c), pattern(2, c + 9)));
        check_consistent(&a, &d);
    }
}

/// `Arena::read_backup`: a sleeping allocation's backed-up bytes (a small
/// one's from its slab's backup) read without waking it; an awake one, one
/// asleep without a backup, a span past the end and an unknown id are
/// errors, and nothing changes.
#[test]
fn read_backup_reads_a_sleepers_bytes_without_waking_it() {
    let (d, a, c) = arena(16, 64);
    let (big, _) = a.alloc_tagged(2 * c + 100, 1).unwrap();
    let (small, _) = a.alloc_tagged(300, 1).unwrap();
    let (bare, _) = a.alloc_tagged(c, 2).unwrap();
    for (id, seed) in [(big, 1), (small, 2), (bare, 3)] {
        fill(&a, id, seed);
    }
    let mut out = vec![0u8; 50];
    let awake = a.read_backup(big, 0, &mut out).unwrap_err();
    assert_eq!(awake.status(), Status::InvalidArgument, "{awake}");

    a.sleep(1, SLEEP_BACKUP).unwrap();
    a.sleep(2, 0).unwrap();
    let mut whole = vec![0u8; (2 * c + 100) as usize];
    a.read_backup(big, 0, &mut whole).unwrap();
    assert_eq!(whole, pattern(1, 2 * c + 100));
    a.read_backup(big, c + 10, &mut out).unwrap();
    assert_eq!(out, pattern(1, 2 * c + 100)[(c + 10) as usize..(c + 60) as usize]);
    let mut s = vec![0u8; 300];
    a.read_backup(small, 0, &mut s).unwrap();
    assert_eq!(s, pattern(2, 300), "a small allocation's bytes, from its slab's backup");

    let none = a.read_backup(bare, 0, &mut out).unwrap_err();
    assert_eq!(none.status(), Status::InvalidArgument, "{none}");
    assert!(none.to_string().contains("no sleep backup"), "{none}");
    let past = a.read_backup(big, 2 * c + 60, &mut out).unwrap_err();
    assert_eq!(past.status(), Status::InvalidArgument, "{past}");
    a.free(bare).unwrap();
    assert_eq!(a.read_backup(bare, 0, &mut out).unwrap_err().status(), Status::UnknownAllocation);

    let before = a.stats().unwrap();
    a.read_backup(big, 0, &mut whole).unwrap();
    let after = a.stats().unwrap();
    assert_eq!((after.asleep_bytes, after.backup_bytes), (before.asleep_bytes, before.backup_bytes));
    assert!(a.query(big).unwrap().asleep, "reading the backup does not wake it");
    a.wake(1).unwrap();
    assert_eq!(read_all(&a, big), pattern(1, 2 * c + 100));
    assert_eq!(read_all(&a, small), pattern(2, 300));
    check_consistent(&a, &d);
}
