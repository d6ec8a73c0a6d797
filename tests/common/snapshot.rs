//! The snapshot parsed (`Snap`: every range of the virtual space, the stats)
//! and compared, and the stats without the driver counters.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::*;

/// The snapshot's stats by name. Tests read one after every operation, so
/// the names the library writes today are kept without a copy of each
/// (see [`stat_name`]) and hashed with FNV-1a rather than SipHash (no
/// adversary chooses these keys).
pub type StatMap = HashMap<Cow<'static, str>, u64, BuildHasherDefault<KeyHasher>>;

/// FNV-1a, for [`StatMap`].
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The stats the library's snapshot has today; a name not here is kept as
/// an owned string (the list only saves allocations).
const STAT_NAMES: [&str; 40] = [
    "live_allocations",
    "live_bytes",
    "mapped_bytes",
    "pooled_bytes",
    "peak_physical_bytes",
    "capacity_bytes",
    "reserved_va_bytes",
    "free_va_bytes",
    "largest_free_va_bytes",
    "retired_va_bytes",
    "moves",
    "driver_creates",
    "driver_releases",
    "driver_maps",
    "driver_unmaps",
    "driver_access_calls",
    "driver_syncs",
    "chunk_bytes",
    "cached_mapped_bytes",
    "release_failures",
    "reserve_fallbacks",
    "bytes_copied",
    "small_slabs",
    "asleep_bytes",
    "backup_bytes",
    "caller_driver_calls",
    "caller_creates",
    "caller_syncs",
    "maintain_driver_calls",
    "stream_frees",
    "stream_shrinks",
    "quiesces",
    "idle_cached_bytes",
    "unmapped_pooled_bytes",
    "event_polls",
    "event_waits",
    "pending_free_bytes",
    "prefetched_bytes",
    "maintain_failures",
    "shared_bytes",
];

/// A stat's name as a map key: borrowed from [`STAT_NAMES`] when it is
/// there. `at` is where the name is expected (the stats come in the
/// library's order), tried first: each string comparison is a `memcmp`,
/// which libFuzzer's hook also examines.
pub fn stat_name(k: &str, at: usize) -> Cow<'static, str> {
    let hit = STAT_NAMES.get(at).filter(|n| **n == k).or_else(|| STAT_NAMES.iter().find(|n| **n == k));
    match hit {
        Some(n) => Cow::Borrowed(n),
        None => Cow::Owned(k.to_string()),
    }
}

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
    /// Old addresses of chunks taken by same-stream reuse, still mapped
    /// (a driver mapping each, no bytes of their own).
    pub deferred_unmap_pages: u64,
    pub ranges: Vec<Range>,
    pub stats: StatMap,
}

impl Snap {
    pub fn of(arena: &Arena) -> Snap {
        Snap::parse(&arena.snapshot_json().expect("snapshot"))
    }

    /// Reads a snapshot's text (in one pass: `snap_parse.rs`).
    pub fn parse(text: &str) -> Snap {
        super::snap_parse::parse(text)
    }

    /// The snapshot without the counters of driver calls, which a rolled
    /// back operation legitimately changes (its calls and their undoing).
    pub fn without_driver_counters(mut self) -> Snap {
        self.stats.retain(|k, _| !k.starts_with("driver_") && !CALL_COUNTERS.contains(&k.as_ref()));
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

    /// Whether `addr..addr + bytes` lies in one free range whose pages all
    /// hold a cached chunk: an allocation placed there adopts them in place.
    pub fn cached_free_covers(&self, addr: u64, bytes: u64) -> bool {
        self.ranges.iter().any(|r| {
            r.kind == Kind::Free
                && r.pooled_mapped_bytes == r.bytes
                && r.addr <= addr
                && addr + bytes <= r.addr + r.bytes
        })
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

    /// Pages that hold a mapping: backing pages, cached pooled chunks,
    /// retired ranges, and old addresses same-stream reuse keeps mapped.
    pub fn mapped_pages(&self) -> u64 {
        self.deferred_unmap_pages
            + self
                .ranges
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
