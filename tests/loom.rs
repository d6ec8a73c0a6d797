//! A loom model of the arena's locking and callback protocol.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release --test loom
//! ```
//!
//! Under `cfg(loom)` the arena's mutex, atomics and thread-local (see
//! `src/sync.rs`) are loom's, so loom explores the interleavings of two
//! threads using one arena on the in-memory [`MockDriver`]:
//! - thread A grows a growable allocation beyond its reservation, twice
//!   (moves by remapping), with the move callback recording every event;
//! - thread B allocates, moves a small allocation out of its slab by
//!   copying, frees and compacts (compaction may move A's allocation again,
//!   or B's, or a slab with the small one);
//!
//! and checks, for every interleaving: no deadlock (loom reports one), every
//! operation returns, the callback's events per id form a chain (each starts
//! where the previous one ended, the first where the allocation was placed,
//! the last where it is now), and the data written before the moves is intact.
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, MoveEvent};

const C: u64 = 4096;

fn arena() -> Arena {
    let cfg = ArenaConfig { capacity_bytes: 10 * C, reserve_bytes: 12 * C, chunk_bytes: C, ..ArenaConfig::default() };
    Arena::with_driver(MockDriver::new(C, 1 << 30), cfg).unwrap()
}

#[test]
fn moves_and_callbacks_under_every_interleaving() {
    let mut builder = loom::model::Builder::new();
    // Full exploration (no preemption bound): each arena call holds the
    // arena's lock for its whole duration, so the interleavings are those
    // of the two threads' calls, a few thousand.
    builder.preemption_bound = None;
    builder.max_branches = 100_000;
    static EXECUTIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static ORDERS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    builder.check(|| {
        EXECUTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let arena = Arc::new(arena());
        let events: Arc<Mutex<Vec<MoveEvent>>> = Arc::new(Mutex::new(Vec::new()));
        {
            let events = events.clone();
            arena.set_move_callback(Some(Box::new(move |e: &MoveEvent| events.lock().unwrap().push(*e)))).unwrap();
        }
        // A placed before the threads start: page 0, reserved [0, 1).
        let (a_id, a_ptr) = arena.alloc_growable(C, C).unwrap();
        arena.write(a_id, 0, b"A").unwrap();
        let (blocker, _) = arena.alloc(C).unwrap(); // page 1: A cannot grow in place

        let t_a = {
            let arena = arena.clone();
            thread::spawn(move || {
                // Beyond the reservation: moves (unless B freed the blocker
                // first), then again beyond the doubled reservation.
                arena.resize(a_id, 2 * C).unwrap();
                arena.resize(a_id, 3 * C).unwrap();
                let mut out = [0u8; 1];
                arena.read(a_id, 0, &mut out).unwrap();
                assert_eq!(&out, b"A");
            })
        };
        let t_b = {
            let arena = arena.clone();
            thread::spawn(move || {
                let (b, b_ptr) = arena.alloc(C).unwrap();
                arena.write(b, 0, b"B").unwrap();
                // A small object, moved out of its slab by copying.
                let (s, s_ptr) = arena.alloc(100).unwrap();
                arena.write(s, 0, b"S").unwrap();
                arena.resize(s, C / 4).unwrap();
                arena.free(blocker).unwrap();
                arena.compact().unwrap();
                for (id, want) in [(b, b"B"), (s, b"S")] {
                    let mut out = [0u8; 1];
                    arena.read(id, 0, &mut out).unwrap();
                    assert_eq!(&out, want);
                }
                [(b, b_ptr), (s, s_ptr)]
            })
        };
        t_a.join().unwrap();
        let placed = t_b.join().unwrap();

        // The callback's events, per id, chain from where it was placed to
        // where it is now, in the order the moves happened.
        let events = events.lock().unwrap();
        let mut at: std::collections::HashMap<vmm_arena::Id, u64> = placed.into_iter().collect();
        at.insert(a_id, a_ptr);
        for e in events.iter() {
            assert_ne!(e.old_ptr, e.new_ptr);
            let cur = at.get_mut(&e.id).unwrap_or_else(|| panic!("event for an unknown id: {events:?}"));
            assert_eq!(e.old_ptr, *cur, "events out of order: {events:?}");
            *cur = e.new_ptr;
        }
        for (&id, &ptr) in &at {
            assert_eq!(arena.query(id).unwrap().ptr, ptr, "{id} is where its last event says");
        }
        let s = arena.stats().unwrap();
        assert_eq!(s.moves, events.len() as u64);
        assert_eq!(s.live_allocations, 3);
        let order = format!(
            "{:?}",
            events.iter().map(|e| (e.id == a_id, e.old_ptr - a_ptr, e.new_ptr - a_ptr)).collect::<Vec<_>>()
        );
        let mut orders = ORDERS.lock().unwrap();
        if !orders.contains(&order) {
            orders.push(order);
        }
    });
    let n = EXECUTIONS.load(std::sync::atomic::Ordering::Relaxed);
    println!("{n} interleavings explored, {} distinct sequences of moves", ORDERS.lock().unwrap().len());
    assert!(n > 1);
}

#[test]
fn a_callback_calling_into_its_arena_is_refused_under_loom() {
    loom::model(|| {
        let other = Arc::new(arena());
        let refused = Arc::new(Mutex::new(0u32));
        let me: Arc<Mutex<Option<std::sync::Weak<Arena>>>> = Arc::new(Mutex::new(None));
        // The arena inside the callback is reached through a std Arc/Weak
        // pair: loom's Arc has no weak references.
        let inner = std::sync::Arc::new(arena());
        *me.lock().unwrap() = Some(std::sync::Arc::downgrade(&inner));
        {
            let (me, refused) = (me.clone(), refused.clone());
            inner
                .set_move_callback(Some(Box::new(move |_e: &MoveEvent| {
                    let a = me.lock().unwrap().as_ref().and_then(|w| w.upgrade()).unwrap();
                    if a.stats().is_err() {
                        *refused.lock().unwrap() += 1;
                    }
                })))
                .unwrap();
        }
        let (g, _) = inner.alloc_growable(C, C).unwrap();
        let (_x, _) = inner.alloc(C).unwrap();
        let t = {
            let other = other.clone();
            // Another thread uses another arena meanwhile.
            thread::spawn(move || {
                let (id, _) = other.alloc(C).unwrap();
                other.free(id).unwrap();
            })
        };
        inner.resize(g, 2 * C).unwrap();
        t.join().unwrap();
        assert_eq!(*refused.lock().unwrap(), 1);
        *me.lock().unwrap() = None;
    });
}
