//! Helpers shared by the core's integration tests: the backend a suite runs
//! on (`VMM_ARENA_TEST_BACKEND`), a reader for the arena's JSON snapshot (the
//! library has no JSON dependency, and neither do its tests), byte stamps
//! that prove contents survive moves, and the leak and equality checks the
//! model, fault and concurrency tests have in common.
#![allow(dead_code)]

pub mod fixtures;
mod json;
mod snap_parse;

#[allow(unused_imports)] // not every includer reads a JSON tree
pub use json::Json;

use std::collections::{BTreeMap, HashMap};
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

// ---------------------------------------------------------------- snapshot

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Live,
    /// A chunk cut into small allocations of one size class.
    Slab,
    Free,
    Retired,
    /// Freed on a stream, its event not complete: its memory stays.
    Pending,
}

/// One range of the snapshot (fields that a kind lacks are 0/false).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    pub kind: Kind,
    pub addr: u64,
    pub bytes: u64,
    pub id: u64,
    pub size: u64,
    pub mapped_bytes: u64,
    pub pooled_mapped_bytes: u64,
    pub pinned: bool,
    pub growable: bool,
    /// Slabs: the size class, objects per slab, objects in use.
    pub class_bytes: u64,
    pub objects: u64,
    pub used: u64,
    /// Slabs: bytes of retired objects (old places of copy-resized ones).
    pub retired_bytes: u64,
    /// Slabs: bytes of objects freed on a stream whose event is pending.
    pub pending_bytes: u64,
    /// Live: its tag, whether it sleeps, and the bytes of its backup.
    pub tag: u64,
    pub asleep: bool,
    pub backup_bytes: u64,
    /// Live: its backing bytes that another live allocation maps too, as
    /// (offset, bytes) runs, and the ids of those allocations.
    pub shared_bytes: u64,
    pub shared_runs: Vec<(u64, u64)>,
    pub shares_with: Vec<u64>,
}

/// The arena's snapshot, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snap {
    pub base: u64,
    pub chunk: u64,
    pub pooled_unmapped_chunks: u64,
    /// Chunks the prefetcher works on outside the lock (held, pooled).
    pub inflight_chunks: u64,
    pub ranges: Vec<Range>,
    pub stats: HashMap<String, u64>,
}

impl Snap {
    pub fn of(arena: &Arena) -> Snap {
        Snap::parse(&arena.snapshot_json().expect("snapshot"))
    }

    /// Reads a snapshot's text (in one pass: `snap_parse.rs`).
    pub fn parse(text: &str) -> Snap {
        snap_parse::parse(text)
    }

    /// The snapshot without the counters of driver calls, which a rolled
    /// back operation legitimately changes (its calls and their undoing).
    pub fn without_driver_counters(mut self) -> Snap {
        self.stats.retain(|k, _| !k.starts_with("driver_") && !CALL_COUNTERS.contains(&k.as_str()));
        self
    }

    pub fn live(&self) -> impl Iterator<Item = &Range> {
        self.ranges.iter().filter(|r| r.kind == Kind::Live)
    }

    pub fn live_by_id(&self) -> BTreeMap<u64, Range> {
        self.live().map(|r| (r.id, r.clone())).collect()
    }

    /// Free ranges, in pages: (start page, pages).
    pub fn free_pages(&self) -> Vec<(u64, u64)> {
        self.pages_of(|r| r.kind == Kind::Free)
    }

    /// Free ranges once every retired range is released, coalesced, in
    /// pages. Slabs holding only retired objects go then too.
    pub fn free_after_release(&self) -> Vec<(u64, u64)> {
        self.pages_of(|r| r.kind == Kind::Free || r.kind == Kind::Retired || Self::retired_only(r))
    }

    /// A slab whose objects are all retired (released with the retired ranges).
    fn retired_only(r: &Range) -> bool {
        r.kind == Kind::Slab && r.used == 0 && r.pending_bytes == 0
    }

    pub fn slabs(&self) -> impl Iterator<Item = &Range> {
        self.ranges.iter().filter(|r| r.kind == Kind::Slab)
    }

    /// The slab containing `addr`, if any.
    pub fn slab_at(&self, addr: u64) -> Option<&Range> {
        self.slabs().find(|r| r.addr <= addr && addr < r.addr + r.bytes)
    }

    fn pages_of(&self, want: impl Fn(&Range) -> bool) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for r in self.ranges.iter().filter(|r| want(r)) {
            let (s, l) = ((r.addr - self.base) / self.chunk, r.bytes / self.chunk);
            match out.last_mut() {
                Some((ps, pl)) if *ps + *pl == s => *pl += l,
                _ => out.push((s, l)),
            }
        }
        out
    }

    /// Allocations of whole chunks and slabs (but those that go with the
    /// retired ranges), in pages: (id (0 for a slab), start page, reserved
    /// pages, immovable: pinned or asleep).
    pub fn live_pages(&self) -> Vec<(u64, u64, u64, bool)> {
        self.ranges
            .iter()
            .filter(|r| {
                r.kind == Kind::Live || r.kind == Kind::Pending || (r.kind == Kind::Slab && !Self::retired_only(r))
            })
            .map(|r| {
                let immovable = r.pinned || r.asleep || r.kind == Kind::Pending;
                (r.id, (r.addr - self.base) / self.chunk, r.bytes / self.chunk, immovable)
            })
            .collect()
    }

    /// Whether retired ranges cover `addr..addr + bytes` (several adjacent
    /// ones may: `trim` unmaps single retired pages).
    pub fn retired_covers(&self, addr: u64, bytes: u64) -> bool {
        let mut at = addr;
        for r in self.ranges.iter().filter(|r| r.kind == Kind::Retired) {
            if r.addr <= at && at < r.addr + r.bytes {
                at = r.addr + r.bytes;
            }
        }
        at >= addr + bytes
    }

    /// Pages that hold a mapping: backing pages, cached pooled chunks, retired ranges.
    pub fn mapped_pages(&self) -> u64 {
        self.ranges
            .iter()
            .map(|r| match r.kind {
                Kind::Live => r.mapped_bytes + r.pooled_mapped_bytes,
                Kind::Slab => r.mapped_bytes,
                Kind::Free => r.pooled_mapped_bytes,
                Kind::Retired => r.bytes,
                Kind::Pending => r.mapped_bytes + r.pooled_mapped_bytes,
            })
            .sum::<u64>()
            / self.chunk
    }

    /// Checks the structural invariants: ranges tile the reserved range
    /// exactly, in address order, without overlap; free ranges are
    /// coalesced; per-range facts are consistent; the stats agree.
    pub fn check_structure(&self, va: (u64, u64)) {
        let (base, len) = va;
        assert_eq!(self.base, base, "snapshot base");
        let c = self.chunk;
        let mut at = base;
        let mut prev_free = false;
        for r in &self.ranges {
            assert_eq!(r.addr, at, "ranges must tile the VA range without gap or overlap: {r:?}");
            assert!(r.bytes > 0 && r.bytes % c == 0, "range of whole chunks: {r:?}");
            at += r.bytes;
            let free = r.kind == Kind::Free;
            assert!(!(free && prev_free), "adjacent free ranges must be coalesced");
            prev_free = free;
            match r.kind {
                Kind::Live if r.asleep => {
                    assert_eq!((r.mapped_bytes, r.pooled_mapped_bytes), (0, 0), "a sleeper maps nothing: {r:?}");
                    assert!(r.backup_bytes == 0 || r.backup_bytes == r.size, "a backup holds the size: {r:?}");
                    assert!(r.growable || r.bytes == r.size.div_ceil(c) * c, "only growable ones reserve more: {r:?}");
                }
                Kind::Live => {
                    assert_eq!(r.mapped_bytes, r.size.div_ceil(c) * c, "mapped bytes of {r:?}");
                    assert_eq!(r.shared_runs.iter().map(|x| x.1).sum::<u64>(), r.shared_bytes, "{r:?}");
                    assert!(r.shared_runs.iter().all(|&(o, l)| o % c == 0 && l % c == 0 && o + l <= r.mapped_bytes));
                    assert_eq!(r.shared_bytes > 0, !r.shares_with.is_empty(), "{r:?}");
                    assert_eq!(r.backup_bytes, 0, "only sleepers hold a backup: {r:?}");
                    assert!(r.mapped_bytes + r.pooled_mapped_bytes <= r.bytes, "{r:?}");
                    assert!(r.growable || r.bytes == r.mapped_bytes, "only growable ones reserve more: {r:?}");
                    assert_eq!(r.addr % 256, 0);
                }
                Kind::Slab => {
                    assert_eq!(r.bytes, c, "a slab is one chunk: {r:?}");
                    assert_eq!(
                        r.mapped_bytes,
                        if r.asleep { 0 } else { c },
                        "a slab maps its chunk while awake: {r:?}"
                    );
                    assert!(r.class_bytes % 256 == 0 && r.class_bytes > 0 && r.class_bytes <= c / 2, "{r:?}");
                    assert_eq!(r.objects, c / r.class_bytes, "{r:?}");
                    assert!(
                        (r.used >= 1 || r.retired_bytes > 0 || r.pending_bytes > 0) && r.used <= r.objects,
                        "an empty slab is given back: {r:?}"
                    );
                }
                Kind::Free => assert!(r.pooled_mapped_bytes <= r.bytes),
                Kind::Retired => {}
                Kind::Pending => assert!(r.mapped_bytes + r.pooled_mapped_bytes <= r.bytes, "{r:?}"),
            }
        }
        assert_eq!(at, base + len, "ranges must end at the end of the VA range");
        let sum = |k: Kind| self.ranges.iter().filter(|r| r.kind == k).map(|r| r.bytes).sum::<u64>();
        let s = &self.stats;
        assert_eq!(s["free_va_bytes"], sum(Kind::Free), "free_va_bytes");
        assert_eq!(
            s["largest_free_va_bytes"],
            self.ranges.iter().filter(|r| r.kind == Kind::Free).map(|r| r.bytes).max().unwrap_or(0),
            "largest_free_va_bytes"
        );
        let retired_objects = self.slabs().map(|r| r.retired_bytes).sum::<u64>();
        assert_eq!(s["retired_va_bytes"], sum(Kind::Retired) + retired_objects, "retired_va_bytes");
        assert_eq!(s["reserved_va_bytes"], len);
        let slabs = self.slabs().count() as u64;
        let small = self.slabs().map(|r| r.used).sum::<u64>();
        assert_eq!(s["small_slabs"], slabs, "small_slabs");
        assert_eq!(s["live_allocations"], self.live().count() as u64 + small, "live_allocations");
        assert!(s["live_bytes"] >= self.live().map(|r| r.size).sum::<u64>() + small, "live_bytes");
        // A slab holding only retired objects backs nothing live: pooled.
        let idle_slabs = self.slabs().filter(|r| Self::retired_only(r)).count() as u64;
        // A sleeping slab maps nothing (it never holds retired objects: a
        // sleep releases them first).
        let asleep_slabs = self.slabs().filter(|r| r.asleep).count() as u64;
        // A shared chunk counts once: each holder lists it in its
        // `shared_bytes`, the stats once in theirs.
        let holders_shared: u64 = self.live().map(|r| r.shared_bytes).sum();
        let pending: u64 = self.ranges.iter().filter(|r| r.kind == Kind::Pending).map(|r| r.mapped_bytes).sum();
        if pending == 0 || s["shared_bytes"] == 0 {
            assert!(s["shared_bytes"] * 2 <= holders_shared, "a shared chunk has two holders at least");
            assert_eq!(
                s["mapped_bytes"],
                self.live().map(|r| r.mapped_bytes).sum::<u64>() - holders_shared
                    + s["shared_bytes"]
                    + (slabs - idle_slabs - asleep_slabs) * c,
                "mapped_bytes"
            );
            assert_eq!(s["pending_free_bytes"], pending, "pending_free_bytes");
        } else {
            // A pending free may still share a chunk with a live allocation
            // (which keeps it): the snapshot does not say which, so only
            // bounds hold.
            assert!(
                s["mapped_bytes"]
                    <= self.live().map(|r| r.mapped_bytes).sum::<u64>() + (slabs - idle_slabs - asleep_slabs) * c,
                "mapped_bytes"
            );
            assert!(s["pending_free_bytes"] <= pending, "pending_free_bytes");
        }
        let asleep: Vec<&Range> = self.live().chain(self.slabs()).filter(|r| r.asleep).collect();
        assert_eq!(s["asleep_bytes"], asleep.iter().map(|r| r.bytes).sum::<u64>(), "asleep_bytes");
        assert_eq!(s["backup_bytes"], asleep.iter().map(|r| r.backup_bytes).sum::<u64>(), "backup_bytes");
        let cached: u64 = self.ranges.iter().map(|r| r.pooled_mapped_bytes).sum();
        assert_eq!(s["cached_mapped_bytes"], cached);
        assert!(s["idle_cached_bytes"] <= cached, "idle cached chunks are cached");
        assert_eq!(s["unmapped_pooled_bytes"], self.pooled_unmapped_chunks * c, "unmapped_pooled_bytes");
        assert_eq!(
            s["pooled_bytes"],
            cached + (self.pooled_unmapped_chunks + self.inflight_chunks + idle_slabs) * c + s["pending_free_bytes"],
            "pooled = cached + unmapped pool + slabs of retired objects + pending frees"
        );
        assert!(s["mapped_bytes"] + s["pooled_bytes"] <= s["capacity_bytes"], "held memory exceeds the capacity");
        assert!(s["peak_physical_bytes"] >= s["mapped_bytes"] + s["pooled_bytes"]);
    }
}

/// The stats that count driver calls, besides the `driver_*` ones.
pub const CALL_COUNTERS: [&str; 8] = [
    "caller_driver_calls",
    "caller_creates",
    "caller_syncs",
    "maintain_driver_calls",
    "stream_frees",
    "stream_shrinks",
    "event_polls",
    "event_waits",
];

/// Stats without the counters of driver calls.
pub fn stats_sans_driver(s: Stats) -> Stats {
    Stats {
        driver_creates: 0,
        driver_releases: 0,
        driver_maps: 0,
        driver_unmaps: 0,
        driver_access_calls: 0,
        driver_syncs: 0,
        caller_driver_calls: 0,
        caller_creates: 0,
        caller_syncs: 0,
        maintain_driver_calls: 0,
        stream_frees: 0,
        stream_shrinks: 0,
        event_polls: 0,
        event_waits: 0,
        ..s
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
