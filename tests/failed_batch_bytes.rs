//! A failed `resize_many` leaves every byte as it was: all or nothing
//! includes the contents, not only the sizes. A small allocation resized
//! past its size class is copied; a copy that lands in a chunk another
//! request of the batch gave up must be undone when a later request fails.

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
