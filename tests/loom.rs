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
//!
//! Two more models check the prefetcher's protocol (plan and set aside under
//! the lock, driver calls outside it, commit under it; see
//! `src/arena/prefetch.rs`):
//! - a `maintain` mapping ahead of a growable allocation while another
//!   thread grows that allocation into the pages being mapped, allocates and
//!   frees: the growth either adopts the mapped-ahead page or maps its own,
//!   never both; no deadlock (a growth that meets a page set aside waits on
//!   the condition variable the commit signals); the books match the driver;
//! - a `maintain` creating a chunk while another thread needs the last of
//!   the capacity: the allocation never fails for the prefetcher's sake (it
//!   waits for the chunk in flight and uses it).
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

/// A mock driver the test can inspect after the arena is gone (a std `Arc`:
/// it is a `Driver`, and no part of the protocol under test).
fn mock_arena(cap: u64, reserve: u64) -> (std::sync::Arc<MockDriver>, Arena) {
    let d = std::sync::Arc::new(MockDriver::new(C, 1 << 30));
    let cfg =
        ArenaConfig { capacity_bytes: cap * C, reserve_bytes: reserve * C, chunk_bytes: C, ..ArenaConfig::default() };
    (d.clone(), Arena::with_driver(d, cfg).unwrap())
}

/// The books agree with the driver: every chunk held is alive there, every
/// mapping there is a page the arena maps.
fn books_match(d: &MockDriver, a: &Arena) {
    let s = a.stats().unwrap();
    assert_eq!(d.live_chunks() as u64, (s.mapped_bytes + s.pooled_bytes) / C, "{s:?}");
    assert!(s.mapped_bytes + s.pooled_bytes <= s.capacity_bytes, "{s:?}");
    assert_eq!(s.maintain_failures, 0);
}

#[test]
fn growth_while_maintain_maps_ahead_under_every_interleaving() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    static EXECUTIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static ADOPTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    builder.check(|| {
        EXECUTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (d, arena) = mock_arena(6, 12);
        let arena = Arc::new(arena);
        let (g, g_ptr) = arena.alloc_growable(C, 4 * C).unwrap();
        arena.write(g, 0, b"G").unwrap();
        // One pooled chunk, so that maintain's round is a map (not a create).
        arena.set_prefetch(C, 0).unwrap();
        arena.maintain().unwrap();
        arena.set_prefetch(0, C).unwrap();
        let m = {
            let arena = arena.clone();
            thread::spawn(move || arena.maintain().unwrap())
        };
        let b = {
            let arena = arena.clone();
            thread::spawn(move || {
                let before = arena.stats().unwrap().caller_driver_calls;
                assert_eq!(arena.resize(g, 2 * C).unwrap(), g_ptr, "in place");
                let made = arena.stats().unwrap().caller_driver_calls - before;
                let (x, _) = arena.alloc(C).unwrap();
                arena.free(x).unwrap();
                made
            })
        };
        m.join().unwrap();
        let made = b.join().unwrap();
        if made == 0 {
            ADOPTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut out = [0u8; 1];
        arena.read(g, 0, &mut out).unwrap();
        assert_eq!(&out, b"G");
        let info = arena.query(g).unwrap();
        assert_eq!((info.size, info.mapped_bytes), (2 * C, 2 * C));
        books_match(&d, &arena);
        drop(arena);
        assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
    });
    let n = EXECUTIONS.load(std::sync::atomic::Ordering::Relaxed);
    let adopted = ADOPTED.load(std::sync::atomic::Ordering::Relaxed);
    println!("{n} interleavings explored, the growth adopted the mapped-ahead page in {adopted}");
    assert!(n > 1 && adopted > 0 && adopted < n, "both outcomes are reached");
}

#[test]
fn an_allocation_never_fails_for_a_chunk_in_flight_under_every_interleaving() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let (d, arena) = mock_arena(2, 8);
        let arena = Arc::new(arena);
        let (_x, _) = arena.alloc(C).unwrap();
        arena.set_prefetch(C, 0).unwrap();
        let m = {
            let arena = arena.clone();
            thread::spawn(move || arena.maintain().unwrap())
        };
        // The last chunk of the capacity: maintain may be creating it.
        let (y, _) = arena.alloc(C).expect("never an out-of-memory for the prefetcher's sake");
        arena.write(y, 0, b"Y").unwrap();
        m.join().unwrap();
        books_match(&d, &arena);
        drop(arena);
        assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
    });
}
