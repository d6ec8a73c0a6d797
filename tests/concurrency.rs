//! Concurrency: several threads churning one arena, with data checks, a move
//! callback keeping a shared address table, and callbacks that call back
//! into the arena (they get `InvalidArgument`, never a deadlock).
//!
//! Each thread owns its allocations and writes a pattern of its own into
//! them; the others' compactions, growths and allocations move them at any
//! time. Reads go through ids (`Arena::read`), which always name the current
//! address. Every few hundred operations all threads meet at a barrier and,
//! while nobody changes the arena, check that the address table the move
//! callback maintains agrees with `query` for every allocation.
//!
//! Backend: the host (64 KiB chunks), or device 0 with 2 MiB chunks when
//! `VMM_ARENA_TEST_BACKEND=cuda` (see `common::test_backend`); sizes are in
//! chunks, and every byte is checked through `Arena::read`, which on CUDA is
//! `cuMemcpy`.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex, OnceLock, Weak};
use std::thread;
use std::time::Duration;

use common::test_backend;
use vmm_arena::{Arena, ArenaConfig, Id, MoveEvent, Status};
const THREADS: usize = 4;
/// Rounds of churn; `VMM_ARENA_CHURN_ROUNDS` raises it for a longer soak.
const ROUNDS: usize = 10;
const OPS_PER_ROUND: usize = 500;

/// xorshift64*: a tiny deterministic generator, one per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The byte at `offset` of an allocation written by `thread` with `gen`.
fn byte(thread: usize, gen: u64, offset: u64) -> u8 {
    (offset.wrapping_mul(131) ^ gen.wrapping_mul(7) ^ ((thread as u64) << 5)) as u8
}

/// Offsets checked in an allocation of `size` bytes in chunks of `c`: the
/// ends and each chunk's first and last bytes (what moves by remapping
/// could lose).
fn probes(size: u64, c: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..size.div_ceil(c)).flat_map(|k| [k * c, (k * c + c - 1).min(size - 1)]).collect();
    v.push(size - 1);
    v.sort_unstable();
    v.dedup();
    v
}

struct Owned {
    id: Id,
    size: u64,
    gen: u64,
    pinned: bool,
}

fn write_pattern(a: &Arena, thread: usize, o: &Owned) {
    for off in probes(o.size, a.chunk_bytes()) {
        a.write(o.id, off, &[byte(thread, o.gen, off)]).unwrap();
    }
}

fn verify(a: &Arena, thread: usize, o: &Owned, what: &str) {
    let mut b = [0u8; 1];
    for off in probes(o.size, a.chunk_bytes()) {
        a.read(o.id, off, &mut b).unwrap();
        assert_eq!(b[0], byte(thread, o.gen, off), "thread {thread}: {what}: {} lost byte {off}", o.id);
    }
}

/// Failures the contract allows when threads compete for capacity and space.
fn tolerated(s: Status) -> bool {
    matches!(s, Status::OutOfMemory | Status::OutOfAddressSpace)
}

#[test]
fn threads_churning_one_arena_keep_their_data_and_the_move_table_agrees() {
    let backend = test_backend();
    let (driver, c) = (backend.driver(), backend.chunk());
    let cfg = ArenaConfig {
        capacity_bytes: 64 * c,
        reserve_bytes: 96 * c,
        chunk_bytes: c,
        retain_bytes: 8 * c,
        ..ArenaConfig::default()
    };
    let arena = Arc::new(Arena::with_driver(driver.fault.clone(), cfg).unwrap());
    let table: Arc<Mutex<HashMap<Id, u64>>> = Arc::default();
    let events = Arc::new(AtomicU64::new(0));
    let broken_chains = Arc::new(AtomicU64::new(0));
    {
        let (table, events, broken) = (table.clone(), events.clone(), broken_chains.clone());
        arena
            .set_move_callback(Some(Box::new(move |e: &MoveEvent| {
                events.fetch_add(1, Ordering::Relaxed);
                let mut t = table.lock().unwrap();
                // Known ids must move from where the table says they are; an
                // id its owner has not recorded yet is simply entered.
                if let Some(&old) = t.get(&e.id) {
                    if old != e.old_ptr {
                        broken.fetch_add(1, Ordering::Relaxed);
                    }
                }
                t.insert(e.id, e.new_ptr);
            })))
            .unwrap();
    }
    let rounds: usize = std::env::var("VMM_ARENA_CHURN_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(ROUNDS);
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, table, barrier) = (arena.clone(), table.clone(), barrier.clone());
            thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678));
                let mut mine: Vec<Owned> = Vec::new();
                let mut gen = 0u64;
                for round in 0..rounds {
                    for _ in 0..OPS_PER_ROUND {
                        gen += 1;
                        let pick = |rng: &mut Rng, n: usize| rng.below(n as u64) as usize;
                        match rng.below(100) {
                            0..=24 => {
                                let size = match rng.below(3) {
                                    0 => 1 + rng.below(c / 2),
                                    _ => 1 + rng.below(4 * c),
                                };
                                let r = if rng.below(3) == 0 {
                                    a.alloc_growable(size, size + rng.below(6) * c)
                                } else {
                                    a.alloc(size)
                                };
                                match r {
                                    Ok((id, ptr)) => {
                                        table.lock().unwrap().entry(id).or_insert(ptr);
                                        let o = Owned { id, size, gen, pinned: false };
                                        write_pattern(&a, t, &o);
                                        mine.push(o);
                                    }
                                    Err(e) => assert!(tolerated(e.status()), "thread {t}: alloc: {e}"),
                                }
                            }
                            25..=44 if !mine.is_empty() => {
                                let i = pick(&mut rng, mine.len());
                                let new = 1 + rng.below(5 * c);
                                match a.resize(mine[i].id, new) {
                                    Ok(_) => {
                                        let o = &mut mine[i];
                                        let old = probes(o.size, c);
                                        let old_size = o.size;
                                        o.size = new;
                                        // The surviving probes keep their bytes; write the new ones
                                        // (the grown tail, and a shrunk allocation's new last byte).
                                        for off in probes(new, c) {
                                            if off >= old_size || !old.contains(&off) {
                                                a.write(o.id, off, &[byte(t, o.gen, off)]).unwrap();
                                            }
                                        }
                                    }
                                    Err(e) if e.status() == Status::Pinned => assert!(mine[i].pinned),
                                    Err(e) => assert!(tolerated(e.status()), "thread {t}: resize: {e}"),
                                }
                            }
                            45..=59 if !mine.is_empty() => {
                                let o = mine.swap_remove(pick(&mut rng, mine.len()));
                                verify(&a, t, &o, "before free");
                                a.free(o.id).unwrap();
                                table.lock().unwrap().remove(&o.id);
                            }
                            60..=79 if !mine.is_empty() => {
                                let o = &mine[pick(&mut rng, mine.len())];
                                verify(&a, t, o, "churn");
                            }
                            80..=84 if !mine.is_empty() => {
                                let i = pick(&mut rng, mine.len());
                                let o = &mut mine[i];
                                if o.pinned {
                                    a.unpin(o.id).unwrap();
                                } else {
                                    a.pin(o.id).unwrap();
                                }
                                o.pinned = !o.pinned;
                            }
                            85..=89 => {
                                a.compact().unwrap();
                            }
                            90..=92 => a.release_retired().unwrap(),
                            93 => {
                                a.trim(4 * c).unwrap();
                            }
                            94..=99 if !mine.is_empty() => {
                                let i = pick(&mut rng, mine.len());
                                mine[i].gen = gen;
                                write_pattern(&a, t, &mine[i]);
                            }
                            _ => {}
                        }
                    }
                    // Quiescent check: nobody changes the arena between the barriers.
                    barrier.wait();
                    {
                        let tbl = table.lock().unwrap();
                        for o in &mine {
                            let info = a.query(o.id).unwrap();
                            assert_eq!(info.size, o.size);
                            assert_eq!(
                                tbl.get(&o.id).copied(),
                                Some(info.ptr),
                                "thread {t}, round {round}: the move table lost track of {}",
                                o.id
                            );
                        }
                    }
                    for o in &mine {
                        verify(&a, t, o, "at the barrier");
                    }
                    barrier.wait();
                }
                for o in mine {
                    verify(&a, t, &o, "at the end");
                    a.free(o.id).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a churning thread failed");
    }
    assert_eq!(broken_chains.load(Ordering::Relaxed), 0, "a move event did not start where the last one ended");
    // Retired objects of copy-resized small allocations hold their slabs
    // (mapped) until released.
    arena.release_retired().unwrap();
    let s = arena.stats().unwrap();
    assert_eq!(s.moves, events.load(Ordering::Relaxed), "one callback per move");
    assert!(s.moves > 0, "the churn should move something");
    assert_eq!((s.live_allocations, s.live_bytes, s.mapped_bytes), (0, 0, 0));
    arena.trim(0).unwrap();
    assert_eq!((driver.fault.live_chunks(), driver.fault.live_mappings()), (0, 0), "nothing leaked");
    println!("{} moves, {} driver maps, {} creates", s.moves, s.driver_maps, s.driver_creates);
}

/// Runs `f` on another thread and fails if it does not finish in time (a
/// deadlock would otherwise hang the test run).
fn within(secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            h.join().unwrap(); // propagates the panic
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: the operation did not return in {secs} s"),
    }
}

#[test]
fn a_callback_calling_back_into_its_arena_gets_invalid_argument() {
    within(30, || {
        let backend = test_backend();
        let c = backend.chunk();
        let cfg = ArenaConfig { capacity_bytes: 8 * c, reserve_bytes: 8 * c, chunk_bytes: c, ..Default::default() };
        let arena = Arc::new(Arena::with_driver(backend.driver().fault, cfg).unwrap());
        let other = Arc::new(Arena::with_driver(backend.driver().fault, cfg).unwrap());
        let me: Arc<OnceLock<Weak<Arena>>> = Arc::default();
        me.set(Arc::downgrade(&arena)).unwrap();
        let seen: Arc<Mutex<Vec<(&'static str, Status)>>> = Arc::default();
        let other_ok = Arc::new(AtomicU64::new(0));
        {
            let (me, seen, other, other_ok) = (me.clone(), seen.clone(), other.clone(), other_ok.clone());
            arena
                .set_move_callback(Some(Box::new(move |e: &MoveEvent| {
                    let a = me.get().unwrap().upgrade().unwrap();
                    let status = |r: Result<(), vmm_arena::Error>| r.err().map_or(Status::Ok, |e| e.status());
                    let mut s = seen.lock().unwrap();
                    s.push(("stats", status(a.stats().map(drop))));
                    s.push(("query", status(a.query(e.id).map(drop))));
                    s.push(("alloc", status(a.alloc(c).map(drop))));
                    s.push(("free", status(a.free(e.id))));
                    s.push(("compact", status(a.compact().map(drop))));
                    s.push(("snapshot", status(a.snapshot_json().map(drop))));
                    s.push(("set_move_callback", status(a.set_move_callback(None))));
                    // Another arena is not locked: calls into it work.
                    if let Ok((id, _)) = other.alloc(c) {
                        other.free(id).unwrap();
                        other_ok.fetch_add(1, Ordering::Relaxed);
                    }
                })))
                .unwrap();
        }
        // Force a move: a full-reservation growable allocation grows beyond it.
        let (g, _) = arena.alloc_growable(c, c).unwrap();
        let (_b, _) = arena.alloc(c).unwrap();
        arena.write(g, 0, b"kept").unwrap();
        arena.resize(g, 2 * c).unwrap();
        let seen = seen.lock().unwrap();
        assert!(!seen.is_empty(), "the move ran the callback");
        for (call, status) in seen.iter() {
            assert_eq!(*status, Status::InvalidArgument, "{call} from inside the callback");
        }
        assert_eq!(other_ok.load(Ordering::Relaxed), 1, "another arena stays usable from the callback");
        // The arena is intact and usable afterwards, on this thread and others.
        let mut out = [0u8; 4];
        arena.read(g, 0, &mut out).unwrap();
        assert_eq!(&out, b"kept");
        arena.free(g).unwrap();
        let a2 = arena.clone();
        thread::spawn(move || a2.stats().unwrap()).join().unwrap();
        assert_eq!(arena.stats().unwrap().live_allocations, 1);
    });
}

#[test]
fn callbacks_of_concurrent_moves_do_not_deadlock_with_other_threads() {
    // One thread keeps moving its allocation while others hammer the arena;
    // the callback takes a lock the other threads also take between calls.
    within(60, || {
        let backend = test_backend();
        let c = backend.chunk();
        let cfg = ArenaConfig { capacity_bytes: 32 * c, reserve_bytes: 48 * c, chunk_bytes: c, ..Default::default() };
        let arena = Arc::new(Arena::with_driver(backend.driver().fault, cfg).unwrap());
        let shared = Arc::new(Mutex::new(0u64));
        {
            let shared = shared.clone();
            arena.set_move_callback(Some(Box::new(move |_e: &MoveEvent| *shared.lock().unwrap() += 1))).unwrap();
        }
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, shared) = (arena.clone(), shared.clone());
                thread::spawn(move || {
                    for i in 0..200u64 {
                        let (id, _) = match a.alloc_growable(c, c) {
                            Ok(x) => x,
                            Err(e) => {
                                assert!(tolerated(e.status()));
                                continue;
                            }
                        };
                        match a.resize(id, (2 + (i + t as u64) % 3) * c) {
                            Ok(_) => {}
                            Err(e) => assert!(tolerated(e.status())),
                        }
                        let _ = *shared.lock().unwrap();
                        if i % 16 == 0 {
                            a.compact().unwrap();
                        }
                        a.free(id).unwrap();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*shared.lock().unwrap(), arena.stats().unwrap().moves);
    });
}

/// `try_stats` reads what `stats` reads when the lock is free, and returns
/// `None` instead of waiting while another call holds it (here a
/// compaction whose move callback, run under the lock, is held open).
#[test]
fn try_stats_never_waits_for_the_lock() {
    let backend = test_backend();
    let c = backend.chunk();
    let cfg = ArenaConfig { capacity_bytes: 16 * c, reserve_bytes: 64 * c, chunk_bytes: c, ..ArenaConfig::default() };
    let driver = backend.driver();
    let arena = Arc::new(Arena::with_driver(driver.fault.clone(), cfg).unwrap());
    let (a, _) = arena.alloc(c).unwrap();
    let (_b, _) = arena.alloc(c).unwrap();
    assert_eq!(arena.try_stats().unwrap(), Some(arena.stats().unwrap()));
    arena.free(a).unwrap();
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    arena
        .set_move_callback(Some(Box::new(move |_: &MoveEvent| {
            let _ = entered_tx.send(());
            let _ = release_rx.lock().unwrap().recv();
        })))
        .unwrap();
    let compacting = {
        let arena = arena.clone();
        thread::spawn(move || arena.compact().map(|r| r.moved_allocations))
    };
    entered_rx.recv_timeout(Duration::from_secs(60)).expect("the compaction moved b");
    assert_eq!(arena.try_stats().unwrap(), None, "the callback holds the lock");
    release_tx.send(()).unwrap();
    assert!(compacting.join().unwrap().unwrap() >= 1);
    assert!(arena.try_stats().unwrap().is_some());
}
