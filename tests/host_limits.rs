//! Host out-of-memory is an error, never a crash; the reservation falls back.
//!
//! This file holds one test per process concern: the file-size limit below is
//! process-wide, so this test binary sets it before anything else runs and
//! no other test lives here.

use std::sync::Arc;

use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Error};

const C: u64 = 2 << 20;

#[test]
fn host_memory_exhaustion_is_out_of_memory_at_create_and_reservation_falls_back() {
    // 1. A backing store that cannot hold more than 5 chunks: the kernel
    //    refuses the memfd's growth (EFBIG) at create time, the arena
    //    reports OutOfMemory, and nothing is touched later (no SIGBUS).
    // SAFETY: plain libc calls; this test binary runs only this test, so no
    // other thread depends on the previous limit or signal disposition.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit { rlim_cur: 5 * C, rlim_max: libc::RLIM_INFINITY };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let a = Arena::new(ArenaConfig { capacity_bytes: 64 * C, ..Default::default() }).unwrap();
    let (x, _) = a.alloc(4 * C).unwrap();
    a.write(x, 4 * C - 8, &[7; 8]).unwrap();
    let before = a.stats().unwrap();
    match a.alloc(2 * C) {
        Err(Error::OutOfMemory(msg)) => assert!(msg.contains("ftruncate") || msg.contains("fallocate"), "{msg}"),
        other => panic!("expected OutOfMemory from the backing store, got {other:?}"),
    }
    let after = a.stats().unwrap();
    assert_eq!((before.mapped_bytes, before.pooled_bytes), (after.mapped_bytes, after.pooled_bytes));
    // One more chunk still fits under the limit: the arena keeps working.
    let (y, _) = a.alloc(C).unwrap();
    a.write(y, 0, &[1; 64]).unwrap();
    let mut b = [0u8; 8];
    a.read(x, 4 * C - 8, &mut b).unwrap();
    assert_eq!(b, [7; 8]);
    drop(a);
    // SAFETY: as above; lift the limit for the rest of the test.
    unsafe {
        let lim = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }

    // 2. The platform refuses the big reservation (as on Jetson or WDDM):
    //    the arena retries smaller, down to the capacity, and says so.
    let drv = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
    drv.fail_nth(Some(CallKind::Reserve), 1, FaultKind::OutOfMemory);
    let cfg = ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 64 * C, ..Default::default() };
    let a = Arena::with_driver(drv.clone(), cfg).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.reserve_fallbacks, s.reserved_va_bytes), (1, 32 * C));
    a.alloc(8 * C).unwrap();
    drop(a);
    // A reservation that cannot shrink below the capacity: the error comes
    // back, and nothing is leaked.
    let drv = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
    let strict = ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 8 * C, ..Default::default() };
    drv.fail_nth(Some(CallKind::Reserve), 1, FaultKind::Driver);
    assert!(matches!(Arena::with_driver(drv.clone(), strict), Err(Error::Driver { .. })), "cannot go below capacity");
    assert_eq!((drv.live_chunks(), drv.live_mappings()), (0, 0));
}
