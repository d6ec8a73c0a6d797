//! Set-ups several suites share: an arena over the suite's backend behind
//! the fault driver, byte patterns, and the check that the driver holds and
//! maps exactly what the arena says.

use std::sync::Arc;

use vmm_arena::driver::fault::FaultDriver;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Id, Status};

use super::{stamp_bytes, test_backend, Snap, TestDriver};

/// The chunk size of [`stream_arena`].
pub const STREAM_CHUNK: u64 = 4096;

/// An arena of `cap` chunks of capacity and `reserve` chunks of address
/// space (of [`STREAM_CHUNK`] bytes) over the mock driver with streams,
/// whose events complete only when the test says so, and the driver.
pub fn stream_arena(cap: u64, reserve: u64) -> (Arc<MockDriver>, Arena) {
    let c = STREAM_CHUNK;
    let d = Arc::new(MockDriver::with_streams(c, 1 << 30));
    let cfg = ArenaConfig { capacity_bytes: cap * c, reserve_bytes: reserve * c, chunk_bytes: c, ..Default::default() };
    (d.clone(), Arena::with_driver(d, cfg).unwrap())
}

/// [`stream_arena`] behind the fault driver, and the fault driver (to
/// make the streams' event calls fail).
pub fn faulty_stream_arena(cap: u64, reserve: u64) -> (Arc<FaultDriver<MockDriver>>, Arena) {
    let c = STREAM_CHUNK;
    let d = Arc::new(FaultDriver::new(MockDriver::with_streams(c, 1 << 30)));
    let cfg = ArenaConfig { capacity_bytes: cap * c, reserve_bytes: reserve * c, chunk_bytes: c, ..Default::default() };
    (d.clone(), Arena::with_driver(d, cfg).unwrap())
}

/// An arena of `cap` chunks of capacity and `reserve` chunks of address
/// space over the suite's backend (behind the fault driver), with the
/// driver and the chunk size.
pub fn fault_arena(cap: u64, reserve: u64) -> (TestDriver, Arena, u64) {
    let backend = test_backend();
    let (d, c) = (backend.driver(), backend.chunk());
    let cfg = ArenaConfig { capacity_bytes: cap * c, reserve_bytes: reserve * c, chunk_bytes: c, ..Default::default() };
    let a = Arena::with_driver(d.fault.clone(), cfg).unwrap();
    (d, a, c)
}

/// `size` bytes of the stamps of `seed` (see [`stamp_bytes`]).
pub fn pattern(seed: u64, size: u64) -> Vec<u8> {
    (0..size).map(|i| stamp_bytes(seed, i / 8)[(i % 8) as usize]).collect()
}

/// The status of a call that must fail.
pub fn status<T: std::fmt::Debug>(r: vmm_arena::Result<T>) -> Status {
    r.expect_err("an error").status()
}

/// `len` bytes of `id` at `off`.
pub fn read_bytes(a: &Arena, id: Id, off: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    a.read(id, off, &mut v).unwrap();
    v
}

/// The driver holds exactly the distinct chunks the arena says it holds,
/// and maps exactly the pages its snapshot says are mapped.
pub fn check_consistent(a: &Arena, d: &TestDriver) {
    let snap = Snap::of(a);
    snap.check_structure(a.va_range());
    let s = a.stats().unwrap();
    assert_eq!(d.fault.live_chunks() as u64 * a.chunk_bytes(), s.mapped_bytes + s.pooled_bytes);
    assert_eq!(d.fault.live_mappings() as u64, snap.mapped_pages());
}
