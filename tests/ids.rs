//! Ids: stale, made-up and foreign ids are rejected; a panicking callback
//! poisons the arena rather than wedging its thread.

use std::panic::{catch_unwind, AssertUnwindSafe};

use vmm_arena::{Arena, ArenaConfig, Error};

const C: u64 = 2 << 20;

fn cfg() -> ArenaConfig {
    ArenaConfig { capacity_bytes: 16 * C, ..Default::default() }
}

#[test]
fn another_arenas_id_is_rejected() {
    let (a, b) = (Arena::new(cfg()).unwrap(), Arena::new(cfg()).unwrap());
    for size in [1, 3 * C] {
        let (ia, _) = a.alloc(size).unwrap();
        let (ib, _) = b.alloc(size).unwrap();
        assert_ne!(ia, ib, "same slot, different arenas, different ids");
        assert!(matches!(a.free(ib), Err(Error::UnknownAllocation(_))));
        assert!(matches!(b.query(ia), Err(Error::UnknownAllocation(_))));
        a.free(ia).unwrap();
        b.free(ib).unwrap();
        assert!(matches!(a.free(ia), Err(Error::UnknownAllocation(_))), "stale");
    }
}

#[test]
fn a_panicking_callback_poisons_the_arena_on_every_thread() {
    let a = Arena::new(cfg()).unwrap();
    a.set_move_callback(Some(Box::new(|_| panic!("callback bug")))).unwrap();
    let (g, _) = a.alloc_growable(1, C).unwrap();
    a.alloc(1).unwrap();
    a.alloc(C).unwrap(); // blocks growth in place
    let r = catch_unwind(AssertUnwindSafe(|| a.resize(g, 6 * C)));
    assert!(r.is_err(), "the callback panicked");
    assert!(matches!(a.stats(), Err(Error::Internal(_))), "this thread: poisoned, not 'inside a callback'");
    std::thread::scope(|s| {
        s.spawn(|| assert!(matches!(a.alloc(1), Err(Error::Internal(_)))));
    });
}
