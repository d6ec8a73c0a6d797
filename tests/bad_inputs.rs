//! Regressions for what fuzzing (and the rest of the reliability work of
//! RELIABILITY.md) found: each was an abort or an arena unlike its books,
//! and is now an error value with the arena as it was.

mod common;

use std::sync::Arc;

use common::Snap;
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Error, Status};

/// A reservation of 64 TiB with 4 KiB chunks has 2^34 pages: a flat page
/// table (256 GiB) aborted the process on the failed allocation (through
/// the C ABI too: `vmm_arena_create` cannot catch an abort), and was then
/// refused as `OutOfMemory`. The page table is now segmented and shares
/// one empty segment until pages are mapped: such an arena works, at the
/// cost of a pointer per 4,096 pages. A reservation whose segment pointers
/// cannot be allocated either is still `OutOfMemory`, the reservation given
/// back.
#[test]
#[cfg_attr(miri, ignore)] // Miri cannot model a failing huge allocation quickly
fn regression_a_huge_page_table_is_sparse_or_out_of_memory_never_an_abort() {
    let fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
    let cfg = ArenaConfig { capacity_bytes: 4 << 12, chunk_bytes: 4096, reserve_bytes: 1 << 46, ..Default::default() };
    let a = Arena::with_driver(fd.clone(), cfg).unwrap();
    let (x, _) = a.alloc(3 << 12).unwrap();
    a.write(x, 100, b"sparse").unwrap();
    let mut back = [0u8; 6];
    a.read(x, 100, &mut back).unwrap();
    assert_eq!(&back, b"sparse");
    a.free(x).unwrap();
    drop(a);
    assert_eq!(fd.live_chunks(), 0, "everything released at drop");

    // 2^50 pages: 2^38 segment pointers (2 TiB) cannot be had.
    let fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
    let cfg = ArenaConfig { reserve_bytes: 1 << 62, ..cfg };
    let e = Arena::with_driver(fd.clone(), cfg).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(
        (fd.calls(CallKind::Reserve), fd.calls(CallKind::FreeReservation)),
        (1, 1),
        "the reservation is given back"
    );
}

/// An alloc that needed the address space of retired ranges unmapped them,
/// then found no room anyway (pinned allocations in the way) and rolled the
/// unmaps back by mapping the chunks again: a driver failure during that
/// undo left the retired range unmapped on the driver while the books said
/// mapped (found by the `ops` fuzz target: the 4th call of an alloc failing).
/// Room is now decided before any driver call, so a refusal makes none.
#[test]
fn regression_a_refusal_for_address_space_makes_no_driver_call() {
    const C: u64 = 64 << 10;
    for n in 1..=4 {
        let fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
        let cfg = ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 4 * C, chunk_bytes: C, ..Default::default() };
        let a = Arena::with_driver(fd.clone(), cfg).unwrap();
        let (g, _) = a.alloc_growable(C, C).unwrap(); // page 0
        let (p, _) = a.alloc(C).unwrap(); // page 1
        a.resize(g, 2 * C).unwrap(); // g moves to pages 2..4; page 0 is retired
        a.pin(g).unwrap();
        a.pin(p).unwrap();
        let before = Snap::of(&a).without_driver_counters();
        assert_eq!(before.stats["retired_va_bytes"], C);
        fd.fail_nth(None, n, FaultKind::Driver);
        let e = a.alloc(2 * C).unwrap_err();
        assert_eq!(e.status(), Status::OutOfAddressSpace, "{e}");
        assert!(fd.pending(), "the refusal made driver calls");
        fd.clear();
        let after = Snap::of(&a);
        assert_eq!(after.clone().without_driver_counters(), before);
        assert_eq!(fd.live_mappings() as u64, after.mapped_pages(), "driver mappings vs the books");
        a.release_retired().unwrap();
        assert_eq!(fd.live_mappings() as u64, Snap::of(&a).mapped_pages());
    }
}

/// A chunk size that is a multiple of the page size but not a power of two
/// (37 pages) is valid (the C ABI says so), yet the host backend refused to
/// align the reservation to it, and creation failed with a driver error
/// (found by the `c_abi` fuzz target). Chunk-sized allocations are now
/// chunk-aligned whatever the chunk size.
#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn regression_a_chunk_size_that_is_not_a_power_of_two_works() {
    let chunk = 37 * 4096;
    let cfg = ArenaConfig { capacity_bytes: 8 * chunk, chunk_bytes: chunk, ..Default::default() };
    let a = Arena::new(cfg).unwrap();
    let (base, len) = a.va_range();
    assert_eq!((base % chunk, len % chunk), (0, 0));
    let (x, px) = a.alloc(2 * chunk).unwrap();
    let (y, py) = a.alloc_growable(chunk + 1, 3 * chunk).unwrap();
    assert_eq!((px % chunk, py % chunk), (0, 0), "chunk-aligned");
    a.write(x, 2 * chunk - 3, b"end").unwrap();
    let py2 = a.resize(y, 5 * chunk).unwrap();
    assert_eq!(py2 % chunk, 0);
    let mut out = [0u8; 3];
    a.read(x, 2 * chunk - 3, &mut out).unwrap();
    assert_eq!(&out, b"end");
}

/// After a give-back failed (the memory stays pooled above the retain
/// watermark, as documented), `trim(keep)` with `keep` above the watermark
/// released down to `keep`, then the watermark released the rest within the
/// same call, and the bytes returned missed that part (found by the `ops`
/// fuzz target). `trim` now gives back down to the lower of the two, and
/// returns all it gave back.
#[test]
fn regression_trim_returns_everything_the_call_gave_back() {
    const C: u64 = 64 << 10;
    let fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
    let cfg = ArenaConfig {
        capacity_bytes: 8 * C,
        reserve_bytes: 16 * C,
        chunk_bytes: C,
        retain_bytes: 0,
        ..Default::default()
    };
    let a = Arena::with_driver(fd.clone(), cfg).unwrap();
    let (x, _) = a.alloc(3 * C).unwrap();
    fd.fail_nth(Some(CallKind::Release), 1, FaultKind::Driver);
    a.free(x).unwrap(); // the give-back fails: best effort, the chunks stay pooled
    let s = a.stats().unwrap();
    assert_eq!((s.release_failures, s.pooled_bytes), (1, 3 * C));
    let releases = s.driver_releases;
    let released = a.trim(C).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(released, (s.driver_releases - releases) * C, "trim returns all it gave back");
    assert_eq!((released, s.pooled_bytes), (3 * C, 0), "down to the watermark (0), below keep_bytes");
    assert_eq!(fd.live_chunks(), 0);
}

/// The same as above on the path that first releases retired memory to get
/// back the chunk of a slab held only by retired small objects (the capacity
/// is used up): it unmapped the retired ranges, then was refused for address
/// space and rolled back, and a failure during that undo left the books
/// unlike the driver (found by the `ops` fuzz target). The place is now
/// found first, so a refusal makes no driver call.
#[test]
fn regression_a_refusal_after_reclaiming_retired_slabs_makes_no_driver_call() {
    const C: u64 = 64 << 10;
    for n in 1..=4 {
        let fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
        let cfg = ArenaConfig {
            capacity_bytes: 5 * C,
            reserve_bytes: 6 * C,
            chunk_bytes: C,
            no_implicit_moves: true,
            ..Default::default()
        };
        let a = Arena::with_driver(fd.clone(), cfg).unwrap();
        let (x, _) = a.alloc(100).unwrap(); // a slab at page 0
        a.resize(x, C / 4).unwrap(); // copied into a slab at page 1; page 0 holds only its retired old place
        let (g, _) = a.alloc_growable(C, C).unwrap(); // page 2
        let (_b, _) = a.alloc(C).unwrap(); // page 3
        a.resize(g, 2 * C).unwrap(); // g moves to pages 4..6; page 2 is retired
        let before = Snap::of(&a).without_driver_counters();
        // Five chunks held, the retired-only slab's among them as pooled.
        let held = before.stats["mapped_bytes"] + before.stats["pooled_bytes"];
        assert_eq!((held, before.stats["mapped_bytes"], before.stats["retired_va_bytes"] >= C), (5 * C, 4 * C, true));
        fd.fail_nth(None, n, FaultKind::Driver);
        // One chunk: only the retired slab's can serve it; three pages of
        // address space: pages 0 and 2 come free, apart. Refused.
        let e = a.alloc_growable(C, 3 * C).unwrap_err();
        assert_eq!(e.status(), Status::OutOfAddressSpace, "{e}");
        assert!(fd.pending(), "the refusal made driver calls");
        fd.clear();
        let after = Snap::of(&a);
        assert_eq!(after.clone().without_driver_counters(), before);
        assert_eq!(fd.live_mappings() as u64, after.mapped_pages(), "driver mappings vs the books");
    }
}
