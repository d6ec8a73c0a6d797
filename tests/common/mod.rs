//! Helpers shared by the core's integration tests: the backend a suite runs
//! on (`VMM_ARENA_TEST_BACKEND`), a reader for the arena's JSON snapshot (the
//! library has no JSON dependency, and neither do its tests), byte stamps
//! that prove contents survive moves, and the leak and equality checks the
//! model, fault and concurrency tests have in common.
#![allow(dead_code)]

pub mod fixtures;
mod json;
mod snap_parse;
mod snapshot;

#[allow(unused_imports)] // not every includer reads a JSON tree
pub use json::*;
pub use snapshot::*;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use vmm_arena::driver::cuda::CudaDriver;
use vmm_arena::driver::fault::FaultDriver;
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, Id, Stats};

// ---------------------------------------------------------------- backends

/// The variable that picks the backend of the model, fault and concurrency
/// suites: unset or `host` for the host backend, `cuda` for device 0.
pub const BACKEND_VAR: &str = "VMM_ARENA_TEST_BACKEND";

/// Chunk size of the suites on the host and mock backends: small, so that
/// small arenas have many pages.
pub const HOST_CHUNK: u64 = 64 << 10;

/// Chunk size on CUDA: the allocation granularity of current GPUs. The
/// suites' sizes are mostly in pages, so they scale with it.
pub const CUDA_CHUNK: u64 = 2 << 20;

/// Where a suite's arenas get their memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestBackend {
    /// `HostDriver`: mmap and a memfd; raw pointers are readable.
    Host,
    /// `CudaDriver` on device 0; data is checked through `cuMemcpy`.
    Cuda,
}

/// The backend [`BACKEND_VAR`] asks for. A value it does not know is a
/// mistake in the caller's setup, not a reason to fall back to the host.
pub fn test_backend() -> TestBackend {
    let v = match std::env::var(BACKEND_VAR) {
        Err(std::env::VarError::NotPresent) => return TestBackend::Host,
        Err(e) => panic!("{BACKEND_VAR}: {e}"),
        Ok(v) => v,
    };
    match v.as_str() {
        "" | "host" => TestBackend::Host,
        "cuda" => TestBackend::Cuda,
        _ => panic!("{BACKEND_VAR}={v:?}: expected unset, \"host\" or \"cuda\""),
    }
}

/// Whether a CUDA-only test should run: it should when the backend is CUDA;
/// otherwise it says why it is skipped (and the caller returns, passing).
pub fn cuda_selected(test: &str) -> bool {
    let cuda = test_backend() == TestBackend::Cuda;
    if !cuda {
        eprintln!("{test}: skipped, set {BACKEND_VAR}=cuda to run it on a GPU");
    }
    cuda
}

/// Device 0, opened once per process and shared (opening retains the
/// primary context; once is enough). Panics when CUDA cannot be used: the
/// caller asked for it, and passing without it would hide a broken GPU check.
pub fn cuda_device() -> Arc<CudaDriver> {
    static DEVICE: OnceLock<Arc<CudaDriver>> = OnceLock::new();
    DEVICE
        .get_or_init(|| match CudaDriver::new(0) {
            Ok(d) => Arc::new(d),
            Err(e) => panic!("{BACKEND_VAR}=cuda, but CUDA device 0 cannot be used: {e}"),
        })
        .clone()
}

/// A driver for one arena, wrapped in a `FaultDriver` so that every backend
/// can count its live chunks and mappings and inject failures.
pub struct TestDriver {
    pub fault: Arc<FaultDriver<Arc<dyn Driver>>>,
    /// The host driver underneath, for checks only the host can make (the
    /// memfd's committed bytes); `None` on CUDA.
    pub host: Option<Arc<HostDriver>>,
}

impl TestBackend {
    /// The chunk size the suites use on this backend.
    pub fn chunk(self) -> u64 {
        match self {
            TestBackend::Host => HOST_CHUNK,
            TestBackend::Cuda => CUDA_CHUNK,
        }
    }

    /// A fresh driver: on the host a new `HostDriver` (its own memfd), on
    /// CUDA the shared device under a new counting wrapper.
    pub fn driver(self) -> TestDriver {
        let (inner, host): (Arc<dyn Driver>, _) = match self {
            TestBackend::Host => {
                let h = Arc::new(HostDriver::new().expect("host driver"));
                (h.clone(), Some(h))
            }
            TestBackend::Cuda => (cuda_device(), None),
        };
        TestDriver { fault: Arc::new(FaultDriver::new(inner)), host }
    }
}

// ---------------------------------------------------------------- window condition

/// Occupants at most of a window whose evacuation the oracle decides
/// exactly (the planner's exact packing goes as far; beyond, it packs by
/// best fit, which may fail where an arrangement exists, and the oracle
/// then claims nothing).
pub const EXACT_OCCUPANTS: usize = 8;

/// Brute-force oracle: whether every allocation in pages `w0..w1` can move
/// into free pages outside them. `free` are free ranges (retired ones
/// already released), `live` the allocations as (start, pages, immovable).
/// Decided by a search over subsets, bin (free piece) by bin — independent
/// of the planner's search. A window with more than [`EXACT_OCCUPANTS`]
/// occupants counts as not evacuable.
pub fn evacuable(w0: u64, w1: u64, free: &[(u64, u64)], live: &[(u64, u64, bool)]) -> bool {
    let inside: Vec<_> = live.iter().filter(|&&(s, l, _)| s < w1 && s + l > w0).collect();
    if inside.iter().any(|&&(_, _, imm)| imm) || inside.len() > EXACT_OCCUPANTS {
        return false;
    }
    let sizes: Vec<u64> = inside.iter().map(|&&(_, l, _)| l).collect();
    let bins: Vec<u64> = free
        .iter()
        .flat_map(|&(s, l)| [(s, (s + l).min(w0)), (s.max(w1), s + l)])
        .map(|(a, b)| b.saturating_sub(a))
        .filter(|&l| l > 0)
        .collect();
    let all = (1usize << sizes.len()) - 1;
    let weight = |set: usize| (0..sizes.len()).filter(|i| set >> i & 1 == 1).map(|i| sizes[i]).sum::<u64>();
    // Sets of occupants placed so far, after each bin.
    let mut placed = vec![false; all + 1];
    placed[0] = true;
    for &room in &bins {
        let before = placed.clone();
        for (done, _) in before.iter().enumerate().filter(|&(_, &ok)| ok) {
            let rest = all & !done;
            // Every subset of the rest that fits this bin.
            let mut sub = rest;
            loop {
                if weight(sub) <= room {
                    placed[done | sub] = true;
                }
                if sub == 0 {
                    break;
                }
                sub = (sub - 1) & rest;
            }
        }
    }
    placed[all]
}

/// Window starts the planner considers for `n` pages: those where a window
/// starts or ends at a boundary between segments (free ranges and
/// allocations). The guarantee (DESIGN.md, "Compaction") covers these.
pub fn boundary_windows(total_pages: u64, n: u64, free: &[(u64, u64)], live: &[(u64, u64, bool)]) -> Vec<u64> {
    let mut starts: Vec<u64> = free
        .iter()
        .map(|&(s, l)| (s, l))
        .chain(live.iter().map(|&(s, l, _)| (s, l)))
        .flat_map(|(s, l)| [s, s + l])
        .flat_map(|b| [Some(b), b.checked_sub(n)])
        .flatten()
        .filter(|&w0| n > 0 && w0 + n <= total_pages)
        .collect();
    starts.sort_unstable();
    starts.dedup();
    starts
}

/// Whether some window of `n` pages the planner considers can be evacuated
/// (see [`evacuable`] and [`boundary_windows`]).
pub fn evacuation_exists(total_pages: u64, n: u64, free: &[(u64, u64)], live: &[(u64, u64, bool)]) -> bool {
    boundary_windows(total_pages, n, free, live).into_iter().any(|w0| evacuable(w0, w0 + n, free, live))
}

/// What the contract lets a resize of an allocation of whole chunks (start
/// page, reserved pages) to `np` pages do, judged from the snapshot before it.
#[derive(Clone, Copy, Debug)]
pub struct Growth {
    /// It fits its reservation, or the pages after it are free once retired
    /// ranges are released: it grows in place and nothing else moves.
    pub stays: bool,
    /// Unpinned neighbours after it can move away so that it grows in place.
    pub evacuable_tail: bool,
    /// The pages after it hold more occupants than the oracle decides
    /// exactly: whether they can move away is unknown to it.
    pub undecided: bool,
}

impl Growth {
    pub fn of(snap: &Snap, id: u64, start: u64, res: u64, np: u64, total: u64, no_implicit_moves: bool) -> Growth {
        let free = snap.free_after_release();
        let tail = (start + res, np.saturating_sub(res));
        let stays = np <= res || free.iter().any(|&(s, l)| s <= tail.0 && tail.0 + tail.1 <= s + l);
        let live: Vec<(u64, u64, bool)> =
            snap.live_pages().into_iter().map(|(other, s, l, pinned)| (s, l, pinned || other == id)).collect();
        let fits = !stays && !no_implicit_moves && tail.0 + tail.1 <= total;
        let evacuable_tail = fits && evacuable(tail.0, tail.0 + tail.1, &free, &live);
        let occupants = live.iter().filter(|&&(s, l, _)| s < tail.0 + tail.1 && s + l > tail.0).count();
        let undecided = fits && !evacuable_tail && occupants > EXACT_OCCUPANTS;
        Growth { stays, evacuable_tail, undecided }
    }

    /// The allocation itself has to move (a pinned one: PINNED).
    pub fn must_move(&self) -> bool {
        !self.stays && !self.evacuable_tail
    }
}

// ---------------------------------------------------------------- stamps

/// Deterministic 8-byte content for `offset` of an allocation written with `seed`.
pub fn stamp_bytes(seed: u64, offset: u64) -> [u8; 8] {
    let mut x = seed ^ offset.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    x.to_le_bytes()
}

/// Offsets to stamp in `from..to` of an allocation with `chunk`-sized
/// pages: each page's first, middle and last bytes and the allocation's
/// last bytes, without overlaps. Returns (offset, length) pairs.
pub fn stamp_positions(from: u64, to: u64, chunk: u64) -> Vec<(u64, u64)> {
    let mut pos = Vec::new();
    let mut k = from / chunk * chunk;
    while k < to {
        pos.extend([k, k + chunk / 2, k + chunk - 8]);
        k += chunk;
    }
    pos.push(to.saturating_sub(8));
    pos.retain(|&p| p >= from && p < to);
    pos.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for p in pos {
        if out.last().is_some_and(|&(q, l)| p < q + l) {
            continue;
        }
        out.push((p, 8.min(to - p)));
    }
    out
}

/// Stamps written into one allocation, to be verified later.
#[derive(Clone, Debug, Default)]
pub struct Stamps {
    pub seed: u64,
    pub marks: Vec<(u64, Vec<u8>)>,
}

impl Stamps {
    /// Writes fresh stamps over `from..to`.
    pub fn write(&mut self, arena: &Arena, id: Id, from: u64, to: u64) {
        for (off, len) in stamp_positions(from, to, arena.chunk_bytes()) {
            let bytes = stamp_bytes(self.seed, off)[..len as usize].to_vec();
            arena.write(id, off, &bytes).expect("write a stamp");
            self.marks.push((off, bytes));
        }
    }

    /// Forgets stamps that do not lie wholly below `size`.
    pub fn truncate(&mut self, size: u64) {
        self.marks.retain(|(off, b)| off + b.len() as u64 <= size);
    }

    /// Reads every stamp back through the arena.
    pub fn verify(&self, arena: &Arena, id: Id, what: &str) {
        let mut buf = [0u8; 8];
        for (off, bytes) in &self.marks {
            let out = &mut buf[..bytes.len()];
            arena.read(id, *off, out).unwrap_or_else(|e| panic!("{what}: read of {id} at {off}: {e}"));
            assert_eq!(out, &bytes[..], "{what}: allocation {id} lost its bytes at offset {off}");
        }
    }

    /// Reads the stamps lying wholly below `limit` through the raw address
    /// `ptr` (host backend only).
    ///
    /// # Safety
    /// `ptr..ptr + limit` must be mapped, readable memory of a host arena
    /// that no other thread changes during the call.
    pub unsafe fn verify_raw_below(&self, ptr: u64, limit: u64, what: &str) {
        let below = Stamps {
            seed: self.seed,
            marks: self.marks.iter().filter(|(o, b)| o + b.len() as u64 <= limit).cloned().collect(),
        };
        // SAFETY: every remaining stamp lies below `limit`, inside the range
        // the caller guarantees.
        unsafe { below.verify_raw(ptr, what) }
    }

    /// Reads every stamp through the raw address (host backend only).
    ///
    /// # Safety
    /// `ptr` must be the current address of a live allocation of a host
    /// arena that covers every stamp, and no other thread may change the
    /// arena during the call (the pages stay mapped and readable).
    pub unsafe fn verify_raw(&self, ptr: u64, what: &str) {
        for (off, bytes) in &self.marks {
            let mut got = vec![0u8; bytes.len()];
            // SAFETY: the caller guarantees `ptr..ptr+size` is mapped readable
            // process memory (host backend) and that each stamp lies inside it.
            unsafe { std::ptr::copy_nonoverlapping((ptr + off) as *const u8, got.as_mut_ptr(), bytes.len()) };
            assert_eq!(&got, bytes, "{what}: raw read at {ptr:#x}+{off} differs");
        }
    }
}

/// Driver calls from the stats: creates, maps, unmaps, releases, access
/// calls and synchronizes.
pub fn driver_calls(s: &Stats) -> [u64; 6] {
    [s.driver_creates, s.driver_maps, s.driver_unmaps, s.driver_releases, s.driver_access_calls, s.driver_syncs]
}

/// Every byte of an allocation; nothing for a sleeping one (its bytes
/// cannot be read until it wakes).
pub fn read_all(arena: &Arena, id: Id) -> Vec<u8> {
    let info = arena.query(id).expect("live");
    if info.asleep {
        return Vec::new();
    }
    let size = info.size;
    let mut v = vec![0u8; size as usize];
    arena.read(id, 0, &mut v).expect("read");
    v
}

/// Fills a whole allocation with a pattern derived from `seed`.
pub fn fill(arena: &Arena, id: Id, seed: u64) {
    let size = arena.query(id).expect("live").size;
    let v: Vec<u8> = (0..size).map(|i| stamp_bytes(seed, i / 8)[(i % 8) as usize]).collect();
    arena.write(id, 0, &v).expect("write");
}
