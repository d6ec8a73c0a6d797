//! Chunk sizes that are not a power of two (issue 13).
//!
//! `cuMemAddressReserve` accepts only a power-of-two alignment, and the arena
//! used to pass the chunk size: a 6 MiB chunk (3 × 2 MiB, a valid multiple of
//! the granularity) would have failed on the first GPU to run it. The host
//! and mock backends now refuse such an alignment too, so these tests fail
//! here if the arena ever passes one again.

use std::sync::Arc;

use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, Error};

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 6 * MIB;

fn config() -> ArenaConfig {
    ArenaConfig { capacity_bytes: 8 * CHUNK, chunk_bytes: CHUNK, ..Default::default() }
}

/// Alloc, write, read, resize (grow and shrink, in place and moving), free.
fn exercise(a: &Arena) {
    assert_eq!(a.chunk_bytes(), CHUNK);
    let (base, len) = a.va_range();
    assert_eq!((base % CHUNK, len % CHUNK), (0, 0), "the range is chunk-aligned");

    let (x, px) = a.alloc(CHUNK + 4096).unwrap();
    assert_eq!(px % CHUNK, 0, "chunk-sized allocations are chunk-aligned");
    a.write(x, 0, b"head").unwrap();
    a.write(x, CHUNK - 2, b"span").unwrap(); // crosses the first page boundary
    a.write(x, CHUNK - 3, b"!").unwrap();

    let (y, _) = a.alloc_growable(MIB, 4 * CHUNK).unwrap();
    a.write(y, MIB - 4, b"tail").unwrap();
    let py = a.resize(y, 3 * CHUNK + 5).unwrap();
    assert_eq!(py % CHUNK, 0);
    a.write(y, 3 * CHUNK + 1, b"grow").unwrap();

    // Grow x past y's reservation: it moves, its bytes must follow.
    let px2 = a.resize(x, 3 * CHUNK).unwrap();
    assert_eq!(px2 % CHUNK, 0);
    let mut buf = [0u8; 4];
    a.read(x, 0, &mut buf).unwrap();
    assert_eq!(&buf, b"head");
    a.read(x, CHUNK - 2, &mut buf).unwrap();
    assert_eq!(&buf, b"span");
    let mut one = [0u8; 1];
    a.read(x, CHUNK - 3, &mut one).unwrap();
    assert_eq!(&one, b"!");

    a.read(y, MIB - 4, &mut buf).unwrap();
    assert_eq!(&buf, b"tail");
    a.read(y, 3 * CHUNK + 1, &mut buf).unwrap();
    assert_eq!(&buf, b"grow");
    a.resize(y, MIB).unwrap();
    a.read(y, MIB - 4, &mut buf).unwrap();
    assert_eq!(&buf, b"tail", "shrinking keeps the prefix");
    assert!(a.read(y, MIB, &mut one).is_err(), "past the shrunk end");

    a.free(x).unwrap();
    a.free(y).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.live_allocations, s.live_bytes), (0, 0));
}

#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn a_six_mib_chunk_works_on_the_host_backend() {
    let a = Arena::with_driver(HostDriver::new().unwrap(), config()).unwrap();
    exercise(&a);
}

#[test]
fn a_six_mib_chunk_works_on_the_mock_backend_and_gives_everything_back() {
    let d = Arc::new(MockDriver::new(2 * MIB, 1 << 30));
    let a = Arena::with_driver(d.clone(), config()).unwrap();
    exercise(&a);
    assert_eq!(d.live_reservations(), 1);
    drop(a);
    // The mock frees only an exact (base, size) it handed out: the arena
    // gave back the driver's reservation, not its chunk-aligned part.
    assert_eq!((d.live_reservations(), d.live_chunks(), d.live_mappings()), (0, 0, 0));
}

#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn both_backends_refuse_an_alignment_that_is_not_a_power_of_two() {
    let host = HostDriver::new().unwrap();
    let mock = MockDriver::new(2 * MIB, 1 << 30);
    let drivers: [&dyn Driver; 2] = [&host, &mock];
    for d in drivers {
        match d.reserve(4 * CHUNK, CHUNK) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("power of two"), "{}: {m}", d.name()),
            other => panic!("{}: expected InvalidArgument, got {other:?}", d.name()),
        }
        let base = d.reserve(4 * CHUNK, 2 * MIB).unwrap();
        assert_eq!(base % (2 * MIB), 0, "{}", d.name());
        d.free_reservation(base, 4 * CHUNK).unwrap();
    }
}
