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
