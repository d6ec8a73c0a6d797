//! Criterion benches of the arena's own speed.
//!
//! - `alloc_free_pair`: one alloc + free of a recurring size on the
//!   no-driver-call path, with 100 and 100,000 other live allocations
//!   (mock backend: 100,000 host mappings would exceed the kernel's map
//!   count limit, and the bench measures bookkeeping, not system calls);
//! - `grow_in_place`: growth of a growable allocation, from cached chunks
//!   (no driver call) and from new chunks (create + map + one access call);
//! - `move_vs_memcpy`: moving an allocation by remapping against copying
//!   the same number of bytes with memcpy, 2 MiB to 1 GiB (host backend);
//! - `compact`: compaction of a fragmented arena;
//! - `move_planned_on_a_copy`: a growth that must move (planned on a copy of
//!   the books), in reservations of 16 GiB and 8 TiB of 2 MiB chunks (mock
//!   backend): the cost of that copy as the page table grows.
//!
//! Run: `cargo bench --bench arena`. Figures are recorded in BENCHMARKS.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Backend};

const C: u64 = 2 << 20;

fn mock_arena(chunks: u64) -> Arena {
    let cfg = ArenaConfig { capacity_bytes: chunks * C, reserve_bytes: 2 * chunks * C, ..Default::default() };
    Arena::with_driver(MockDriver::new(4096, chunks * C), cfg).expect("mock arena")
}

fn alloc_free_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_pair");
    for live in [100u64, 100_000] {
        let arena = mock_arena(live + 64);
        for _ in 0..live {
            arena.alloc(C).unwrap();
        }
        // Warm the path: the pair below then reuses the cached chunk.
        let (id, _) = arena.alloc(2 * C).unwrap();
        arena.free(id).unwrap();
        let before = arena.stats().unwrap();
        g.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                let (id, p) = arena.alloc(black_box(2 * C)).unwrap();
                arena.free(id).unwrap();
                black_box(p)
            })
        });
        let after = arena.stats().unwrap();
        assert_eq!(
            (before.driver_maps, before.driver_creates, before.driver_unmaps),
            (after.driver_maps, after.driver_creates, after.driver_unmaps),
            "the steady state made driver calls"
        );
    }
    g.finish();
}

fn grow_in_place(c: &mut Criterion) {
    let mut g = c.benchmark_group("grow_in_place");
    let arena = Arena::new(ArenaConfig { capacity_bytes: 128 * C, ..Default::default() }).unwrap();
    let (id, _) = arena.alloc_growable(C, 64 * C).unwrap();
    arena.resize(id, 32 * C).unwrap();
    arena.resize(id, C).unwrap();
    g.throughput(Throughput::Bytes(31 * C));
    g.bench_function("cached_31_chunks", |b| {
        b.iter(|| {
            arena.resize(id, 32 * C).unwrap();
            arena.resize(id, C).unwrap();
        })
    });
    g.bench_function("new_31_chunks_host", |b| {
        b.iter_batched(
            || {
                let a = Arena::new(ArenaConfig { capacity_bytes: 64 * C, ..Default::default() }).unwrap();
                let (id, _) = a.alloc_growable(C, 32 * C).unwrap();
                (a, id)
            },
            |(a, id)| {
                a.resize(id, 32 * C).unwrap();
                a
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn move_vs_memcpy(c: &mut Criterion) {
    let mut g = c.benchmark_group("move_vs_memcpy");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    for mib in [2u64, 32, 256, 1024] {
        let size = mib << 20;
        g.throughput(Throughput::Bytes(size));
        g.bench_with_input(BenchmarkId::new("remap", mib), &size, |b, &size| {
            b.iter_batched(
                || {
                    // Sparse: the remap cost does not depend on touched pages,
                    // and setup stays fast for 1 GiB.
                    let cfg = ArenaConfig {
                        backend: Backend::HostSparse,
                        capacity_bytes: 2 * size + 4 * C,
                        reserve_bytes: 4 * size + 8 * C,
                        ..Default::default()
                    };
                    let a = Arena::new(cfg).unwrap();
                    let (id, _) = a.alloc(size).unwrap();
                    a.alloc(C).unwrap(); // blocks growth in place
                    (a, id)
                },
                |(a, id)| {
                    // Grows by one chunk: cannot extend, so it moves.
                    a.resize(id, size + C).unwrap();
                    a
                },
                BatchSize::PerIteration,
            )
        });
        g.bench_with_input(BenchmarkId::new("memcpy", mib), &size, |b, &size| {
            let src = vec![1u8; size as usize];
            let mut dst = vec![0u8; size as usize];
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            })
        });
    }
    g.finish();
}

fn compact(c: &mut Criterion) {
    let mut g = c.benchmark_group("compact");
    g.sample_size(20);
    for n in [100u64, 1000] {
        g.bench_with_input(BenchmarkId::new("fragmented_host", n), &n, |b, &n| {
            b.iter_batched(
                || {
                    let cfg = ArenaConfig {
                        backend: Backend::HostSparse,
                        capacity_bytes: 4 * n * C,
                        reserve_bytes: 8 * n * C,
                        ..Default::default()
                    };
                    let a = Arena::new(cfg).unwrap();
                    let ids: Vec<_> = (0..n).map(|i| a.alloc((1 + i % 3) * C).unwrap().0).collect();
                    for id in ids.iter().step_by(2) {
                        a.free(*id).unwrap();
                    }
                    a
                },
                |a| {
                    let r = a.compact().unwrap();
                    black_box(r);
                    a
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

/// A growable allocation hemmed in by a neighbour grows past its
/// reservation: the arena plans the move on a copy of its books. The
/// reservation's size (its page table) should not matter.
fn move_planned_on_a_copy(c: &mut Criterion) {
    let mut g = c.benchmark_group("move_planned_on_a_copy");
    for (name, reserve) in [("16GiB", 16u64 << 30), ("8TiB", 8u64 << 40)] {
        let cfg = ArenaConfig { capacity_bytes: 64 * C, reserve_bytes: reserve, ..Default::default() };
        let arena = Arena::with_driver(MockDriver::new(4096, 64 * C), cfg).expect("mock arena");
        g.bench_function(name, |b| {
            b.iter(|| {
                let (x, _) = arena.alloc_growable(C, 2 * C).unwrap();
                let (n, _) = arena.alloc(C).unwrap();
                let p = arena.resize(x, black_box(4 * C)).unwrap();
                arena.free(x).unwrap();
                arena.free(n).unwrap();
                arena.release_retired().unwrap();
                black_box(p)
            })
        });
        assert!(arena.stats().unwrap().moves > 0, "the growth moved");
    }
    g.finish();
}

criterion_group!(benches, alloc_free_pair, grow_in_place, move_vs_memcpy, compact, move_planned_on_a_copy);
criterion_main!(benches);
