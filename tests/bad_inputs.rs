//! Regressions for bad inputs that fuzzing (and the reliability work of
//! RELIABILITY.md) found: each was an abort or a wrong answer, and is now
//! an error value.

use std::sync::Arc;

use vmm_arena::driver::fault::FaultDriver;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Backend, Error};

/// A reservation of 64 TiB with 4 KiB chunks needs a page table of 2^34
/// entries (256 GiB): creating the arena aborted the process on the failed
/// allocation (through the C ABI too: `vmm_arena_create` cannot catch an
/// abort). It is now `OutOfMemory`, and the reservation is given back.
#[test]
#[cfg_attr(miri, ignore)] // Miri cannot model a failing 256 GiB allocation quickly
fn regression_a_page_table_that_cannot_be_allocated_is_out_of_memory() {
    let fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
    let cfg = ArenaConfig { capacity_bytes: 4 << 12, chunk_bytes: 4096, reserve_bytes: 1 << 46, ..Default::default() };
    let e = Arena::with_driver(fd.clone(), cfg).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(
        (fd.calls(CallKind::Reserve), fd.calls(CallKind::FreeReservation)),
        (1, 1),
        "the reservation is given back"
    );
    // The host backend: the kernel may refuse the reservation (then the
    // arena falls back to a smaller one) or grant it (then the page table is
    // refused); either way an answer, never an abort.
    let host = ArenaConfig { backend: Backend::Host, ..cfg };
    match Arena::new(host) {
        Ok(a) => assert!(a.stats().unwrap().reserve_fallbacks > 0),
        Err(e) => assert!(matches!(e, Error::OutOfMemory(_)), "{e}"),
    }
}
