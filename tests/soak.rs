//! Soak: many threads churn one host arena in cycles, and memory does not
//! grow. Each cycle, every worker thread runs random operations (alloc,
//! alloc_growable, resize that grows in place, moves or copies, free, write
//! and verify, pin and unpin, compact, trim, release_retired) until the
//! cycle's time is up, checking its allocations' bytes after every
//! operation, then frees what it holds; the main thread then releases the
//! retired ranges and trims to 0, and measures:
//! - the arena's stats (live, mapped, pooled, retired, cached, free and
//!   largest free address space, slabs);
//! - the driver's live chunks and mappings, and the memfd's allocated size
//!   (`HostDriver::allocated_file_bytes`);
//! - the process's mapped regions (the lines of /proc/self/maps).
//!
//! All of them must come back to the same values after every cycle: the
//! arena's and the driver's to empty, the process's to the value after the
//! first cycle (which warms up thread stacks and malloc arenas; the workers
//! live for the whole run, so later cycles create none).
//!
//! Short by default (about 3 seconds, in `cargo test`); the long soak:
//!
//! ```text
//! VMM_ARENA_SOAK_SECONDS=600 cargo test --release --test soak -- --nocapture
//! ```
//!
//! (`VMM_ARENA_SOAK_THREADS`, default 4, and `VMM_ARENA_SOAK_CYCLE_MS`,
//! default 300, tune it.) This file holds one test: /proc/self/maps is
//! process-wide.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::Stamps;
use vmm_arena::driver::host::HostDriver;
use vmm_arena::{Arena, ArenaConfig, Error, Id};

const C: u64 = 64 << 10;

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn maps_lines() -> usize {
    std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps").lines().count()
}

/// What must come back to the same value after every cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Level {
    live_allocations: u64,
    live_bytes: u64,
    mapped_bytes: u64,
    pooled_bytes: u64,
    cached_mapped_bytes: u64,
    retired_va_bytes: u64,
    free_va_bytes: u64,
    largest_free_va_bytes: u64,
    small_slabs: u64,
    driver_chunks: usize,
    driver_mappings: usize,
    memfd_allocated_bytes: u64,
    maps_lines: usize,
}

fn level(a: &Arena, d: &HostDriver) -> Level {
    let s = a.stats().unwrap();
    Level {
        live_allocations: s.live_allocations,
        live_bytes: s.live_bytes,
        mapped_bytes: s.mapped_bytes,
        pooled_bytes: s.pooled_bytes,
        cached_mapped_bytes: s.cached_mapped_bytes,
        retired_va_bytes: s.retired_va_bytes,
        free_va_bytes: s.free_va_bytes,
        largest_free_va_bytes: s.largest_free_va_bytes,
        small_slabs: s.small_slabs,
        driver_chunks: d.live_chunks(),
        driver_mappings: d.live_mappings(),
        memfd_allocated_bytes: d.allocated_file_bytes().unwrap(),
        maps_lines: maps_lines(),
    }
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Default)]
struct Counts {
    ops: AtomicU64,
    refusals: AtomicU64,
    moves_seen: AtomicU64,
    bytes_verified: AtomicU64,
}

struct Mine {
    id: Id,
    size: u64,
    pinned: bool,
    stamps: Stamps,
}

/// One worker's cycle: churn until `until`, then free everything it holds.
fn churn(a: &Arena, rng: &mut u64, until: Instant, counts: &Counts) {
    let mut mine: Vec<Mine> = Vec::new();
    let mut ops = 0u64;
    let refused = |e: &Error, what: &str| match e {
        Error::OutOfMemory(_) | Error::OutOfAddressSpace(_) | Error::Pinned(_) => {
            counts.refusals.fetch_add(1, Ordering::Relaxed);
        }
        e => panic!("{what}: unexpected error {e:?}"),
    };
    let size = |rng: &mut u64| match splitmix(rng) % 4 {
        0 => 1 + splitmix(rng) % (C / 2),
        1 | 2 => 1 + splitmix(rng) % (4 * C),
        _ => 1 + splitmix(rng) % (12 * C),
    };
    while Instant::now() < until {
        ops += 1;
        let r = splitmix(rng) % 100;
        match r {
            0..=24 if mine.len() < 12 => {
                let s = size(rng);
                let res = if r < 8 { a.alloc_growable(s, s + (splitmix(rng) % 8) * C) } else { a.alloc(s) };
                match res {
                    Ok((id, _)) => {
                        let mut stamps = Stamps { seed: splitmix(rng), marks: vec![] };
                        stamps.write(a, id, 0, s);
                        mine.push(Mine { id, size: s, pinned: false, stamps });
                    }
                    Err(e) => refused(&e, "alloc"),
                }
            }
            0..=39 if !mine.is_empty() => {
                let i = (splitmix(rng) % mine.len() as u64) as usize;
                let m = mine.swap_remove(i);
                m.stamps.verify(a, m.id, "before free");
                a.free(m.id).unwrap();
            }
            40..=64 if !mine.is_empty() => {
                let i = (splitmix(rng) % mine.len() as u64) as usize;
                let s = size(rng);
                let m = &mut mine[i];
                match a.resize(m.id, s) {
                    Ok(_) => {
                        m.stamps.truncate(m.size.min(s));
                        m.stamps.verify(a, m.id, "after resize");
                        if s > m.size {
                            m.stamps.write(a, m.id, m.size, s);
                        }
                        m.size = s;
                    }
                    Err(e) => refused(&e, "resize"),
                }
            }
            65..=74 if !mine.is_empty() => {
                let i = (splitmix(rng) % mine.len() as u64) as usize;
                let m = &mut mine[i];
                if m.pinned { a.unpin(m.id) } else { a.pin(m.id) }.unwrap();
                m.pinned = !m.pinned;
            }
            75..=79 => {
                a.compact().unwrap();
            }
            80..=82 => a.release_retired().unwrap(),
            83..=85 => {
                a.trim((splitmix(rng) % 8) * C).unwrap();
            }
            _ if !mine.is_empty() => {
                let i = (splitmix(rng) % mine.len() as u64) as usize;
                let m = &mine[i];
                let info = a.query(m.id).unwrap();
                assert_eq!(info.size, m.size);
                m.stamps.verify(a, m.id, "verify");
                counts.bytes_verified.fetch_add(m.stamps.marks.len() as u64 * 8, Ordering::Relaxed);
            }
            _ => {}
        }
    }
    for m in mine {
        m.stamps.verify(a, m.id, "at the end of the cycle");
        a.free(m.id).unwrap();
        ops += 1;
    }
    counts.ops.fetch_add(ops, Ordering::Relaxed);
}

#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn memory_returns_to_the_same_level_after_every_cycle() {
    let seconds = env_f64("VMM_ARENA_SOAK_SECONDS", 3.0);
    let threads = env_f64("VMM_ARENA_SOAK_THREADS", 4.0) as usize;
    let cycle = Duration::from_millis(env_f64("VMM_ARENA_SOAK_CYCLE_MS", 300.0) as u64);
    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: 64 * C,
        reserve_bytes: 128 * C,
        chunk_bytes: C,
        retain_bytes: 16 * C,
        ..ArenaConfig::default()
    };
    let a = Arc::new(Arena::with_driver(d.clone(), cfg).unwrap());
    let counts = Arc::new(Counts::default());
    let sink = counts.clone();
    a.set_move_callback(Some(Box::new(move |_| {
        sink.moves_seen.fetch_add(1, Ordering::Relaxed);
    })))
    .unwrap();
    let empty = level(&a, &d);
    assert_eq!((empty.mapped_bytes, empty.driver_chunks, empty.memfd_allocated_bytes), (0, 0, 0));

    // Workers live for the whole run: no thread is created after the first cycle.
    let start = Arc::new(Barrier::new(threads + 1));
    let done = Arc::new(Barrier::new(threads + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Arc::new(std::sync::Mutex::new(Instant::now()));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (a, counts, start, done, stop, deadline) =
                (a.clone(), counts.clone(), start.clone(), done.clone(), stop.clone(), deadline.clone());
            std::thread::spawn(move || {
                let mut rng = 0x5eed_0000 + t as u64;
                loop {
                    start.wait();
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let until = *deadline.lock().unwrap();
                    churn(&a, &mut rng, until, &counts);
                    done.wait();
                }
            })
        })
        .collect();

    let t0 = Instant::now();
    let mut baseline: Option<Level> = None;
    let mut cycles = 0;
    while cycles < 2 || t0.elapsed().as_secs_f64() < seconds {
        *deadline.lock().unwrap() = Instant::now() + cycle;
        start.wait();
        done.wait();
        a.release_retired().unwrap();
        a.trim(0).unwrap();
        cycles += 1;
        let now = level(&a, &d);
        let arena_part = Level { maps_lines: empty.maps_lines, ..now.clone() };
        assert_eq!(arena_part, empty, "cycle {cycles}: the arena and the driver are not back to empty");
        match &baseline {
            None => baseline = Some(now),
            Some(b) => assert_eq!(&now, b, "cycle {cycles}: memory grew (or shrank) since the first cycle"),
        }
    }
    stop.store(true, Ordering::SeqCst);
    start.wait();
    for w in workers {
        w.join().unwrap();
    }
    let s = a.stats().unwrap();
    println!(
        "soak: {threads} threads, {cycles} cycles in {:.1} s: {} operations ({} refused as the contract allows), \
         {} moves ({} seen by the callback), {} bytes of stamps verified, {} chunks created and {} released; \
         every cycle back to: {:?}",
        t0.elapsed().as_secs_f64(),
        counts.ops.load(Ordering::Relaxed),
        counts.refusals.load(Ordering::Relaxed),
        s.moves,
        counts.moves_seen.load(Ordering::Relaxed),
        counts.bytes_verified.load(Ordering::Relaxed),
        s.driver_creates,
        s.driver_releases,
        baseline.unwrap()
    );
    assert_eq!(s.moves, counts.moves_seen.load(Ordering::Relaxed));
    assert!(counts.ops.load(Ordering::Relaxed) > 1000, "the soak ran too few operations to mean anything");
}
