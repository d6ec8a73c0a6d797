//! Sleep backups kept across cycles (`Arena::set_backup_cache`): with the
//! cache on, a loop that sleeps and wakes the same allocations asks the
//! driver for host memory in its first cycle only; the bytes survive every
//! cycle; a failed sleep leaves the cache as it was; releasing it or
//! turning it off gives the memory back.

use std::sync::Arc;

use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Id, SLEEP_BACKUP};

const C: u64 = 64 << 10;

fn arena() -> (Arc<FaultDriver<HostDriver>>, Arena) {
    let d = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
    let cfg = ArenaConfig { capacity_bytes: 32 * C, reserve_bytes: 64 * C, chunk_bytes: C, ..ArenaConfig::default() };
    (d.clone(), Arena::with_driver(d, cfg).unwrap())
}

fn stamp(a: &Arena, id: Id, size: u64, seed: u8) {
    let bytes: Vec<u8> = (0..size).map(|i| seed.wrapping_add((i % 251) as u8)).collect();
    a.write(id, 0, &bytes).unwrap();
}

fn stamped(a: &Arena, id: Id, size: u64, seed: u8) -> bool {
    let mut got = vec![0u8; size as usize];
    a.read(id, 0, &mut got).unwrap();
    got.iter().enumerate().all(|(i, &b)| b == seed.wrapping_add((i % 251) as u8))
}

/// Host buffers the driver lent over `cycles` sleep/wake cycles of three
/// allocations (one small), and the bytes checked each cycle.
fn host_allocs_per_cycle(keep: bool, cycles: usize) -> Vec<u64> {
    let (d, a) = arena();
    a.set_backup_cache(keep).unwrap();
    let sizes = [3 * C, C + 17, 1000];
    let ids: Vec<Id> = sizes.iter().map(|&s| a.alloc_tagged(s, 1).unwrap().0).collect();
    for (i, (&id, &s)) in ids.iter().zip(&sizes).enumerate() {
        stamp(&a, id, s, i as u8 * 40);
    }
    let mut per_cycle = Vec::new();
    for _ in 0..cycles {
        let before = d.calls(CallKind::HostAlloc);
        a.sleep(1, SLEEP_BACKUP).unwrap();
        a.wake(1).unwrap();
        per_cycle.push(d.calls(CallKind::HostAlloc) - before);
        for (i, (&id, &s)) in ids.iter().zip(&sizes).enumerate() {
            assert!(stamped(&a, id, s, i as u8 * 40), "bytes of allocation {i} after a cycle");
        }
    }
    per_cycle
}

#[test]
fn with_the_cache_only_the_first_cycle_allocates_host_memory() {
    let on = host_allocs_per_cycle(true, 5);
    let off = host_allocs_per_cycle(false, 5);
    println!("host allocations per cycle: cache on {on:?}, off {off:?}");
    assert!(on[0] > 0);
    assert_eq!(&on[1..], &[0, 0, 0, 0], "cache on: {on:?}");
    assert!(off.iter().all(|&n| n == off[0] && n > 0), "cache off: {off:?}");
}

#[test]
fn release_and_off_give_the_memory_back_and_a_failed_sleep_keeps_the_cache() {
    let (d, a) = arena();
    a.set_backup_cache(true).unwrap();
    let (x, _) = a.alloc_tagged(2 * C, 1).unwrap();
    let (y, _) = a.alloc_tagged(C, 1).unwrap();
    stamp(&a, x, 2 * C, 3);
    stamp(&a, y, C, 9);
    a.sleep(1, SLEEP_BACKUP).unwrap();
    assert_eq!(a.backup_cache_bytes().unwrap(), 0, "in use while asleep");
    a.wake(1).unwrap();
    assert_eq!(a.backup_cache_bytes().unwrap(), 3 * C);
    // A sleep whose second read fails: nothing asleep, the cache as it was.
    d.fail_nth(Some(CallKind::Data), 2, FaultKind::Driver);
    assert!(a.sleep(1, SLEEP_BACKUP).is_err());
    d.clear();
    assert!(!a.query(x).unwrap().asleep && !a.query(y).unwrap().asleep);
    assert_eq!(a.backup_cache_bytes().unwrap(), 3 * C, "a failed sleep kept the cache");
    assert!(stamped(&a, x, 2 * C, 3) && stamped(&a, y, C, 9));
    // Released: the next cycle allocates again.
    assert_eq!(a.release_backup_cache().unwrap(), 3 * C);
    assert_eq!(a.backup_cache_bytes().unwrap(), 0);
    let before = d.calls(CallKind::HostAlloc);
    a.sleep(1, SLEEP_BACKUP).unwrap();
    a.wake(1).unwrap();
    assert_eq!(d.calls(CallKind::HostAlloc) - before, 2);
    assert_eq!(a.backup_cache_bytes().unwrap(), 3 * C);
    // Off: freed, and wakes keep nothing.
    a.set_backup_cache(false).unwrap();
    assert_eq!(a.backup_cache_bytes().unwrap(), 0);
    a.sleep(1, SLEEP_BACKUP).unwrap();
    a.wake(1).unwrap();
    assert_eq!(a.backup_cache_bytes().unwrap(), 0);
    assert!(stamped(&a, x, 2 * C, 3) && stamped(&a, y, C, 9));
    assert_eq!(d.live_host_buffers(), 0, "no host buffer left");
}
