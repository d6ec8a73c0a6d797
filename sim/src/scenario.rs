//! The textbook fragmentation failure: fill the device with interleaved
//! allocations of mixed sizes (1–10 MiB, the range PyTorch packs into 20 MiB
//! segments), free every other one, then ask for one allocation larger than
//! any hole but well below the free total.
//!
//! Each allocator gets the same sequence on its own counted device of the
//! same capacity. Every live allocation carries tags at its first and last
//! 8 bytes, checked after the large request (so moves are checked too).

use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, Error, Id};

use super::caching::CachingAllocator;
use super::managers::{new_device, Dev};
use super::util::mix64;

/// The sizes cycled through while filling (MiB × 2, to allow halves).
pub const SIZES_HALF_MIB: [u64; 6] = [6, 10, 8, 12, 7, 11];

/// What happened to one allocator.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub name: String,
    pub allocations: u64,
    pub freed: u64,
    /// Free physical memory before the large request (capacity minus bytes in use).
    pub free_total: u64,
    /// Largest free contiguous address range that could serve the request
    /// without the allocator doing more than reusing what it has.
    pub largest_hole: u64,
    pub request: u64,
    pub succeeded: bool,
    pub detail: String,
    pub moves: u64,
    pub integrity_errors: u64,
}

fn size_of(i: u64) -> u64 {
    SIZES_HALF_MIB[(i % SIZES_HALF_MIB.len() as u64) as usize] << 19
}

fn tag(i: u64, end: bool) -> u64 {
    mix64(i * 2 + end as u64) | 1
}

/// Runs the scenario on PyTorch's caching allocator model.
pub fn run_caching(capacity: u64, request: u64, expandable: bool) -> Outcome {
    let dev: Dev = new_device(capacity).expect("host backend");
    let mut a = CachingAllocator::new(dev.clone(), capacity, expandable);
    let mut live: Vec<(u64, u64, u64)> = Vec::new(); // (index, ptr, size)
    let mut i = 0;
    while let Ok(p) = a.malloc(size_of(i)) {
        let s = size_of(i);
        let _ = dev.write(p, &tag(i, false).to_le_bytes());
        let _ = dev.write(p + s - 8, &tag(i, true).to_le_bytes());
        live.push((i, p, s));
        i += 1;
    }
    let allocations = i;
    let mut freed = 0;
    live.retain(|&(k, p, _)| {
        if k % 2 == 1 {
            a.free(p);
            freed += 1;
            false
        } else {
            true
        }
    });
    let in_use: u64 = a.stats().allocated_bytes;
    let free_total = capacity - in_use;
    let unreserved = capacity - a.stats().reserved_bytes;
    let largest_hole = a.largest_free_block().max(if expandable { 0 } else { unreserved });
    let result = a.malloc(request);
    let (succeeded, detail) = match &result {
        Ok(_) => (true, "allocated".to_string()),
        Err(oom) => (
            false,
            format!(
                "CUDA out of memory: {} requested, {} allocated, {} reserved but unallocated",
                super::util::fmt_bytes(oom.size),
                super::util::fmt_bytes(oom.allocated_bytes),
                super::util::fmt_bytes(oom.reserved_bytes - oom.allocated_bytes)
            ),
        ),
    };
    a.check_invariants();
    let mut integrity_errors = 0;
    for &(k, p, s) in &live {
        let mut b = [0u8; 8];
        for (addr, end) in [(p, false), (p + s - 8, true)] {
            if dev.read(addr, &mut b).is_err() || u64::from_le_bytes(b) != tag(k, end) {
                integrity_errors += 1;
            }
        }
    }
    let name = if expandable { "pytorch-expandable" } else { "pytorch-caching" };
    Outcome {
        name: name.into(),
        allocations,
        freed,
        free_total,
        largest_hole,
        request,
        succeeded,
        detail,
        moves: 0,
        integrity_errors,
    }
}

/// Runs the scenario on vmm-arena with a virtual range of `reserve` bytes
/// (0: the default, 4 × capacity).
pub fn run_arena(name: &str, capacity: u64, request: u64, reserve: u64, no_implicit_moves: bool) -> Outcome {
    let dev: Dev = new_device(capacity).expect("host backend");
    let cfg = ArenaConfig { capacity_bytes: capacity, reserve_bytes: reserve, no_implicit_moves, ..Default::default() };
    let arena = Arena::with_driver(dev, cfg).expect("arena");
    let mut live: Vec<(u64, Id, u64)> = Vec::new();
    let mut i = 0;
    while let Ok((id, _)) = arena.alloc(size_of(i)) {
        let s = size_of(i);
        arena.write(id, 0, &tag(i, false).to_le_bytes()).expect("write");
        arena.write(id, s - 8, &tag(i, true).to_le_bytes()).expect("write");
        live.push((i, id, s));
        i += 1;
    }
    let allocations = i;
    let mut freed = 0;
    live.retain(|&(k, id, _)| {
        if k % 2 == 1 {
            arena.free(id).expect("free");
            freed += 1;
            false
        } else {
            true
        }
    });
    let st = arena.stats().expect("stats");
    let free_total = st.capacity_bytes - st.mapped_bytes;
    let largest_hole = st.largest_free_va_bytes;
    let moves_before = st.moves;
    let (succeeded, detail) = match arena.alloc(request) {
        Ok(_) => (true, "allocated".to_string()),
        Err(e @ (Error::OutOfAddressSpace(_) | Error::OutOfMemory(_))) => (false, e.to_string()),
        Err(e) => (false, format!("unexpected error: {e}")),
    };
    let moves = arena.stats().map(|s| s.moves).unwrap_or(0) - moves_before;
    let mut integrity_errors = 0;
    for &(k, id, s) in &live {
        let mut b = [0u8; 8];
        for (off, end) in [(0, false), (s - 8, true)] {
            if arena.read(id, off, &mut b).is_err() || u64::from_le_bytes(b) != tag(k, end) {
                integrity_errors += 1;
            }
        }
    }
    Outcome {
        name: name.into(),
        allocations,
        freed,
        free_total,
        largest_hole,
        request,
        succeeded,
        detail,
        moves,
        integrity_errors,
    }
}

/// All variants, in report order: the two PyTorch models, vmm-arena with
/// its default virtual range, vmm-arena with a virtual range no larger than
/// the capacity (so holes in it matter and only moves help), and the same
/// without implicit moves.
pub fn run_all(capacity: u64, request: u64) -> Vec<Outcome> {
    vec![
        run_caching(capacity, request, false),
        run_caching(capacity, request, true),
        run_arena("arena", capacity, request, 0, false),
        run_arena("arena (VA = capacity)", capacity, request, capacity, false),
        run_arena("arena-no-moves (VA = capacity)", capacity, request, capacity, true),
    ]
}
