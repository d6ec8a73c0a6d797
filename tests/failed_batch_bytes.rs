//! A failed `resize_many` leaves every byte as it was: all or nothing
//! includes the contents, not only the sizes. A small allocation resized
//! past its size class is copied; a copy that lands in a chunk another
//! request of the batch gave up must be undone when a later request fails.
//! Refusals now come before any driver call (a dry run on the books), so
//! what can fail after the copy is a driver call: the second test fails
//! each call of the batch in turn.

mod common;

use common::fixtures::{pattern, read_bytes, status};
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Status};

const MIB: u64 = 1 << 20;
const C: u64 = 2 * MIB;

fn arena(cap_chunks: u64) -> Arena {
    let cfg =
        ArenaConfig { capacity_bytes: cap_chunks * C, reserve_bytes: 64 * C, chunk_bytes: C, ..Default::default() };
    Arena::with_driver(MockDriver::new(C, 1 << 34), cfg).unwrap()
}

/// The reproduction: shrink x (4 → 2 MiB), resize a 100 KiB small
/// allocation s past its class to 1.5 MiB, grow y beyond the capacity. The
/// batch fails with OutOfMemory and x, s and y keep every byte.
#[test]
fn a_failed_resize_many_leaves_every_allocations_bytes() {
    let a = arena(4);
    let (x, _) = a.alloc(4 * MIB).unwrap();
    let (s, _) = a.alloc(100 * 1024).unwrap();
    let (y, _) = a.alloc(C).unwrap();
    let want_x = pattern(1, 4 * MIB);
    let want_s = pattern(2, 100 * 1024);
    let want_y = pattern(3, C);
    a.write(x, 0, &want_x).unwrap();
    a.write(s, 0, &want_s).unwrap();
    a.write(y, 0, &want_y).unwrap();
    let before = a.stats().unwrap();
    let r = a.resize_many(&[(x, 2 * MIB), (s, 3 * MIB / 2), (y, 64 * C)]);
    assert_eq!(status(r), Status::OutOfMemory);
    assert_eq!(a.query(x).unwrap().size, 4 * MIB);
    assert_eq!(a.query(s).unwrap().size, 100 * 1024);
    assert_eq!(a.query(y).unwrap().size, C);
    assert!(read_bytes(&a, x, 0, 4 * MIB) == want_x, "x's bytes changed by a failed batch");
    assert!(read_bytes(&a, s, 0, 100 * 1024) == want_s, "s's bytes changed by a failed batch");
    assert!(read_bytes(&a, y, 0, C) == want_y, "y's bytes changed by a failed batch");
    let after = a.stats().unwrap();
    assert_eq!((after.live_bytes, after.mapped_bytes), (before.live_bytes, before.mapped_bytes));
}

/// The same batch within the capacity (y grows by one chunk), with each of
/// its driver calls failing in turn: whichever fails, after s's copy or
/// before, the batch fails with it and every byte is as it was.
#[test]
fn a_resize_many_failing_at_any_driver_call_leaves_every_byte() {
    use std::sync::Arc;
    use vmm_arena::driver::fault::{FaultDriver, FaultKind};
    for n in 1.. {
        let d = Arc::new(FaultDriver::new(MockDriver::new(C, 1 << 34)));
        let cfg = ArenaConfig { capacity_bytes: 5 * C, reserve_bytes: 64 * C, chunk_bytes: C, ..Default::default() };
        let a = Arena::with_driver(d.clone(), cfg).unwrap();
        let (x, _) = a.alloc(4 * MIB).unwrap();
        let (s, _) = a.alloc(100 * 1024).unwrap();
        let (y, _) = a.alloc(C).unwrap();
        let want = [(x, pattern(1, 4 * MIB)), (s, pattern(2, 100 * 1024)), (y, pattern(3, C))];
        for (id, bytes) in &want {
            a.write(*id, 0, bytes).unwrap();
        }
        let copies0 = a.stats().unwrap().bytes_copied;
        d.fail_nth(None, n, FaultKind::Driver);
        let r = a.resize_many(&[(x, 2 * MIB), (s, 3 * MIB / 2), (y, 2 * C)]);
        let fired = !d.pending();
        d.clear();
        if !fired {
            r.unwrap();
            assert!(n > 3, "the batch makes driver calls");
            break;
        }
        assert_eq!(status(r), Status::Driver, "call {n}");
        for (id, bytes) in &want {
            let info = a.query(*id).unwrap();
            assert_eq!(info.size, bytes.len() as u64, "call {n}");
            assert!(read_bytes(&a, *id, 0, info.size) == *bytes, "call {n} failing changed the bytes of {id}");
        }
        assert_eq!(a.stats().unwrap().bytes_copied, copies0);
    }
}
