//! The cost model's first rule: once warm, recurring allocations and frees
//! (and growth of KV-cache-like allocations) make no driver call at all.

use vmm_arena::{Arena, ArenaConfig, Stats};

const C: u64 = 2 << 20;

fn driver_calls(s: &Stats) -> [u64; 6] {
    [s.driver_creates, s.driver_maps, s.driver_unmaps, s.driver_releases, s.driver_access_calls, s.driver_syncs]
}

#[test]
fn recurring_sizes_make_no_driver_call_once_warm() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 256 * C, ..Default::default() }).unwrap();
    let sizes = [C, 3 * C, 100, 4000, 700_000, 8 * C + 5, 64 * 1024];
    let round = |a: &Arena| {
        let ids: Vec<_> = sizes.iter().map(|&s| a.alloc(s).unwrap().0).collect();
        // Free in a different order than allocated, as real programs do.
        for id in ids.iter().skip(1).step_by(2).chain(ids.iter().step_by(2)) {
            a.free(*id).unwrap();
        }
    };
    for _ in 0..3 {
        round(&a);
    }
    let warm = driver_calls(&a.stats().unwrap());
    for _ in 0..200 {
        round(&a);
    }
    assert_eq!(driver_calls(&a.stats().unwrap()), warm, "the steady state called the driver");
}

#[test]
fn kv_cache_requests_growing_token_by_token_make_no_driver_call_once_warm() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 512 * C, ..Default::default() }).unwrap();
    let per_token = 128 * 1024; // llama3-8b's KV bytes per token
    let batch = |a: &Arena, tokens: u64| {
        let reqs: Vec<_> = (0..8).map(|_| a.alloc_growable(per_token, 4096 * per_token).unwrap().0).collect();
        for t in 2..=tokens {
            for &r in &reqs {
                a.resize(r, t * per_token).unwrap();
            }
        }
        for r in reqs {
            a.free(r).unwrap();
        }
    };
    batch(&a, 300);
    let warm = driver_calls(&a.stats().unwrap());
    for _ in 0..5 {
        batch(&a, 300);
    }
    assert_eq!(driver_calls(&a.stats().unwrap()), warm, "growth through cached chunks called the driver");
    assert_eq!(a.stats().unwrap().moves, 0);
}
