//! Slabs holding only retired objects (the old places of small allocations
//! copy-resized past their size class) back no live allocation: the stats
//! count them in `pooled_bytes`, and every rule that reads the pool counts
//! them the same way — wake's out-of-memory check, the retain watermark
//! and `trim`.

mod common;

use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Id};

const MIB: u64 = 1 << 20;
const C: u64 = 2 * MIB;

fn arena(cap_chunks: u64, retain: u64) -> Arena {
    let cfg = ArenaConfig {
        capacity_bytes: cap_chunks * C,
        reserve_bytes: 64 * C,
        chunk_bytes: C,
        retain_bytes: retain,
        ..Default::default()
    };
    Arena::with_driver(MockDriver::new(C, 1 << 34), cfg).unwrap()
}

/// A small allocation copied out of its slab into whole chunks: the slab
/// holds only its retired old place. Returns the allocation.
fn retired_slab(a: &Arena) -> Id {
    let (s, _) = a.alloc(100 * 1024).unwrap();
    a.resize(s, 3 * MIB / 2).unwrap();
    let st = a.stats().unwrap();
    assert_eq!(st.small_slabs, 1, "the slab stays, holding the retired old place");
    assert_eq!(st.pooled_bytes, C, "a slab of retired objects counts as pooled");
    s
}

/// The finding: with a slab holding only a retired object, an
/// allocation of the sleeper's size succeeds (it releases retired memory),
/// so wake must too.
#[test]
fn wake_counts_slabs_of_retired_objects_as_obtainable() {
    let a = arena(2, u64::MAX);
    let (g, _) = a.alloc_growable(C, 4 * C).unwrap();
    a.set_tag(g, 1).unwrap();
    a.write(g, 0, b"asleep").unwrap();
    a.sleep(1, vmm_arena::SLEEP_BACKUP).unwrap();
    let _s = retired_slab(&a);
    // Held: the slab and s's chunk, the whole capacity; the slab's chunk
    // comes back when retired memory is released.
    a.wake(1).expect("wake with a reclaimable slab within the capacity");
    let mut out = [0u8; 6];
    a.read(g, 0, &mut out).unwrap();
    assert_eq!(&out, b"asleep");
    common::Snap::of(&a).check_structure(a.va_range());
}

/// The finding: with retain = one chunk, a freed chunk stays pooled
/// beside a slab of retired objects, so `pooled_bytes` exceeds the
/// watermark. The watermark counts what `pooled_bytes` counts.
#[test]
fn the_retain_watermark_counts_slabs_of_retired_objects() {
    let a = arena(8, C);
    let (x, _) = a.alloc(C).unwrap();
    let _s = retired_slab(&a);
    a.free(x).unwrap();
    let st = a.stats().unwrap();
    assert!(st.pooled_bytes <= C, "pooled_bytes {} above retain_bytes {C} after a free", st.pooled_bytes);
    common::Snap::of(&a).check_structure(a.va_range());
}

/// `trim(keep)` leaves at most `keep` bytes pooled, as `pooled_bytes`
/// counts them: ordinary pooled chunks go first, then, if that is not
/// enough, slabs holding only retired objects (their retired places are
/// released, after a device synchronize, as the arena may do whenever it
/// needs retired memory).
#[test]
fn trim_counts_slabs_of_retired_objects() {
    let a = arena(8, u64::MAX);
    let (x, _) = a.alloc(C).unwrap();
    let s = retired_slab(&a);
    a.write(s, 0, b"kept").unwrap();
    a.free(x).unwrap();
    assert_eq!(a.stats().unwrap().pooled_bytes, 2 * C);
    assert_eq!(a.trim(C).unwrap(), C, "trim(one chunk) gives back the freed chunk");
    let st = a.stats().unwrap();
    assert!(st.pooled_bytes <= C, "pooled_bytes {} above keep_bytes {C} after a trim", st.pooled_bytes);
    assert_eq!(st.small_slabs, 1, "the slab was not needed to reach keep_bytes");
    assert_eq!(a.trim(0).unwrap(), C, "trim(0) gives back the slab of retired objects");
    let st = a.stats().unwrap();
    assert_eq!((st.pooled_bytes, st.small_slabs, st.retired_va_bytes), (0, 0, 0));
    assert_eq!(st.mapped_bytes, C, "s, promoted to a chunk, is untouched");
    let mut out = [0u8; 4];
    a.read(s, 0, &mut out).unwrap();
    assert_eq!(&out, b"kept");
    common::Snap::of(&a).check_structure(a.va_range());
}

/// A trim that must reclaim a slab of retired objects and whose unmap
/// fails leaves the arena as it was: the retired place stays, readable.
#[test]
fn a_trim_whose_unmap_fails_keeps_the_slab_of_retired_objects() {
    use std::sync::Arc;
    use vmm_arena::driver::fault::{FaultDriver, FaultKind};
    use vmm_arena::driver::CallKind;
    let d = Arc::new(FaultDriver::new(MockDriver::new(C, 1 << 34)));
    let cfg = ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 64 * C, chunk_bytes: C, ..Default::default() };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let _s = retired_slab(&a);
    let before = common::stats_sans_driver(a.stats().unwrap());
    let snap = common::Snap::of(&a).without_driver_counters();
    d.fail_nth(Some(CallKind::Unmap), 1, FaultKind::Driver);
    assert!(a.trim(0).is_err());
    assert_eq!(common::stats_sans_driver(a.stats().unwrap()), before);
    assert_eq!(common::Snap::of(&a).without_driver_counters(), snap);
    assert_eq!(d.live_chunks() as u64, 2, "the slab's chunk and s's");
    assert_eq!(a.trim(0).unwrap(), C, "then it goes");
    common::Snap::of(&a).check_structure(a.va_range());
}
