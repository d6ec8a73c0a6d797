//! Implicit compaction makes room whenever whole-range compaction could.

use vmm_arena::{Arena, ArenaConfig, Error};

const C: u64 = 2 << 20;

#[test]
fn alloc_compacts_in_several_moves_when_one_window_is_not_enough() {
    // Found by the stress example: one window evacuation cannot make room,
    // but two moves (a whole-range compaction) can.
    let a = Arena::new(ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 8 * C, ..Default::default() }).unwrap();
    let (x, _) = a.alloc(3 * C).unwrap(); // pages 0..3
    let (g, _) = a.alloc_growable(C, 2 * C).unwrap(); // pages 3..5
    let (y, _) = a.alloc(2 * C).unwrap(); // pages 5..7; page 7 free
    a.write(g, 0, b"growable").unwrap();
    a.write(y, 2 * C - 4, b"tail").unwrap();
    a.free(x).unwrap(); // 4 free pages, nothing pinned
    let (z, _) = a.alloc(4 * C).expect("compaction makes a 4-chunk hole");
    let mut b = [0u8; 8];
    a.read(g, 0, &mut b).unwrap();
    assert_eq!(&b, b"growable");
    a.read(y, 2 * C - 4, &mut b[..4]).unwrap();
    assert_eq!(&b[..4], b"tail");
    assert!(a.stats().unwrap().moves >= 2);
    a.free(z).unwrap();
}

#[test]
fn a_refusal_changes_nothing() {
    // 8 pages: A 0..2, free 2..4, P (pinned) 4, B 5..8. Every 4-page window
    // holds P or needs A moved where nothing is free.
    let a = Arena::new(ArenaConfig { capacity_bytes: 16 * C, reserve_bytes: 8 * C, ..Default::default() }).unwrap();
    a.alloc(2 * C).unwrap();
    let (f, _) = a.alloc(2 * C).unwrap();
    let (p, _) = a.alloc(C).unwrap();
    a.alloc(3 * C).unwrap();
    a.free(f).unwrap();
    a.pin(p).unwrap();
    let before = (a.snapshot_json().unwrap(), a.stats().unwrap());
    assert!(matches!(a.alloc(4 * C), Err(Error::OutOfAddressSpace(_))));
    let after = (a.snapshot_json().unwrap(), a.stats().unwrap());
    assert_eq!(before.1, after.1, "no driver call, nothing changed");
    assert_eq!(before.0, after.0);
}
