//! Export × share × sleep, against a model (host backend, exportable
//! chunks of 64 KiB, a capacity of 24 chunks). Random sequences interleave
//! `alloc`, `alloc_shared` of a live allocation, `sleep` and `wake` of one
//! allocation (each has a tag of its own; sleeps keep a backup), `export`
//! and closing an export, `import` of an open export into a second arena
//! and the import's free, `free`, `resize`, and stamped writes through an
//! allocation or an import.
//!
//! The model (`export_share_sleep_model/chunks.rs`) keeps which physical
//! chunk backs each page (so which allocations share chunks), the
//! sleepers' sharing groups (a sleeper page whose chunk was shared joins
//! the chunk's group: on wake it maps the chunk again if an awake
//! allocation still maps it, else the group's first waker gets a new chunk
//! with the newest member's backup), and the open exports. The rules it
//! holds the arena to (module docs of `arena/export.rs`, `arena/alias.rs`,
//! `vmm_arena.h`):
//! - an allocation sharing a chunk with another, awake or asleep, cannot
//!   be exported (`InvalidArgument`); a sleeping one is `Asleep`;
//! - once exported, until freed: `alloc_shared` from it is refused, it
//!   never sleeps, a shrink below the chunks it exported is refused; while
//!   an export is open it is pinned (growth stays in place or is `Pinned`);
//! - a source freed while a sharer lives leaves the sharer's chunks mapped
//!   (`mapped_bytes` counts them) and the sharer sleeps and wakes with them;
//! - `alloc`, growth and `wake` are `OutOfMemory` exactly when the distinct
//!   chunks awake allocations map plus those needed exceed the capacity.
//!
//! After every operation: its outcome is the model's; every awake
//! allocation's stamps read back (a chunk's bytes seen through every
//! allocation and import that maps it); `query` agrees (size, asleep,
//! pinned; a pinned or sleeping allocation never moved); `mapped_bytes`,
//! `shared_bytes`, `live_*`, `exported_allocations`, `backup_bytes`,
//! `asleep_bytes` are the model's; the importer's stats count imports only
//! in the sharing stats (no allocation, no mapped byte, no driver call);
//! both snapshots pass `check_structure`, and each live range's
//! `shares_with` is the model's set of awake allocations sharing its chunks.
//!
//! The free of an exported allocation pools none of its chunks and
//! releases them all.
//!
//! The test can fail: with the sleeping-sharer condition taken out of
//! `Arena::hand_out` (an export then checks only awake sharers), the
//! property test failed in 5 runs of 5 at the default 256 cases (at 48
//! cases one run of three missed it), shrunk to: alloc of 4
//! chunks, alloc_shared of its first chunk, sleep of the sharer, export of
//! the source (which succeeded where the model wants `InvalidArgument`);
//! the coverage test below failed too. The condition was then restored.
//! `PROPTEST_CASES` sets the number of cases (256 by default).

#[path = "export_share_sleep_model/chunks.rs"]
mod chunks;
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use chunks::{Chunks, Slept};
use common::{stamp_bytes, Snap, HOST_CHUNK as C};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::{Arena, ArenaConfig, Export, Id, Result, Status, SLEEP_BACKUP};

/// The exporter's capacity, in chunks.
const CAP: u64 = 24;
/// Where each page carries a stamp.
const STAMP_AT: [u64; 3] = [0, C / 2, C - 8];

#[derive(Clone, Debug)]
enum Op {
    /// Chunks, growable, chunks more reserved.
    Alloc(u64, bool, u64),
    /// Source, first chunk, chunks, chunks more reserved.
    Share(usize, u64, u64, u64),
    /// With `true`, of the allocations that share a chunk, if any.
    Sleep(usize, bool),
    Wake(usize),
    /// With `true`, of the allocations that share a chunk (with an awake
    /// allocation or a sleeper's group), if any.
    Export(usize, bool),
    Close(usize),
    Import(usize),
    FreeImport(usize),
    Free(usize),
    Resize(usize, u64),
    Write(usize, u64),
    WriteImport(usize, u64),
}

fn op() -> impl Strategy<Value = Op> {
    let s = any::<usize>();
    prop_oneof![
        4 => (1..=5u64, any::<bool>(), 0..=4u64).prop_map(|(p, g, e)| Op::Alloc(p, g, e)),
        4 => (s, 0..8u64, 1..=3u64, 0..=2u64).prop_map(|(k, f, p, e)| Op::Share(k, f, p, e)),
        3 => (s, any::<bool>()).prop_map(|(k, b)| Op::Sleep(k, b)),
        2 => s.prop_map(Op::Wake),
        3 => (s, any::<bool>()).prop_map(|(k, b)| Op::Export(k, b)),
        2 => s.prop_map(Op::Close),
        2 => s.prop_map(Op::Import),
        1 => s.prop_map(Op::FreeImport),
        2 => s.prop_map(Op::Free),
        3 => (s, 1..=10u64).prop_map(|(k, n)| Op::Resize(k, n)),
        2 => (s, 0..8u64).prop_map(|(k, p)| Op::Write(k, p)),
        1 => (s, 0..8u64).prop_map(|(k, p)| Op::WriteImport(k, p)),
    ]
}

/// Outcomes seen, by name (for the coverage test).
static SEEN: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

struct Alloc {
    id: Id,
    ptr: u64,
    pages: u64,
    /// Chunks of the backing pages (awake).
    chunks: Vec<usize>,
    sleep: Option<Vec<Slept>>,
    exported: bool,
    export_pages: u64,
}

struct Open {
    export: Export,
    owner: usize,
    chunks: Vec<usize>,
}

struct Import {
    id: Id,
    chunks: Vec<usize>,
}

struct Harness {
    ex: Arena,
    im: Arena,
    allocs: BTreeMap<usize, Alloc>,
    chunks: Chunks,
    exports: Vec<Open>,
    imports: Vec<Import>,
    /// Allocation keys (each tag is its key's) and stamp seeds.
    next: u64,
}

fn cfg() -> ArenaConfig {
    ArenaConfig { capacity_bytes: CAP * C, reserve_bytes: 32 * CAP * C, chunk_bytes: C, ..ArenaConfig::default() }
}

fn tag_of(key: usize) -> u32 {
    key as u32 + 1
}

fn seen(what: &'static str) {
    *SEEN.lock().unwrap().entry(what).or_default() += 1;
}

/// The error `got` must be.
fn refused<T: std::fmt::Debug>(got: Result<T>, want: &[Status], what: &str) -> Status {
    match got {
        Ok(v) => panic!("{what}: succeeded ({v:?}), the model wants {want:?}"),
        Err(e) => {
            assert!(want.contains(&e.status()), "{what}: {e}, the model wants {want:?}");
            e.status()
        }
    }
}

fn verify(arena: &Arena, id: Id, page: usize, seed: u64, what: &str) {
    let mut got = [0u8; 8];
    for off in STAMP_AT {
        arena.read(id, page as u64 * C + off, &mut got).unwrap_or_else(|e| panic!("{what}: read: {e}"));
        assert_eq!(got, stamp_bytes(seed, off), "{what}: page {page} at {off} lost its bytes");
    }
}

impl Harness {
    fn new() -> Harness {
        let d = HostDriver::with_exportable_chunks(HostOptions::default()).unwrap();
        let ex = Arena::with_driver(Arc::new(d), cfg()).unwrap();
        let im = Arena::with_driver(Arc::new(HostDriver::new().unwrap()), cfg()).unwrap();
        let (allocs, chunks, exports, imports) = Default::default();
        Harness { ex, im, allocs, chunks, exports, imports, next: 0 }
    }

    fn pick(&self, sel: usize) -> Option<usize> {
        let n = self.allocs.len();
        (n > 0).then(|| *self.allocs.keys().nth(sel % n).unwrap())
    }

    /// With `sharer`, an allocation whose chunks an awake allocation (or,
    /// with `groups`, a sleeper's group) shares, if there is one.
    fn pick_sharing(&self, sel: usize, sharer: bool, groups: bool) -> Option<usize> {
        let c = &self.chunks;
        let shares = |a: &Alloc| a.chunks.iter().any(|&h| c.awake_sharer(h) || groups && c.sleeper_sharer(h));
        let some: Vec<usize> = self.allocs.iter().filter(|(_, a)| shares(a)).map(|(&k, _)| k).collect();
        match sharer && !some.is_empty() {
            true => Some(some[sel % some.len()]),
            false => self.pick(sel),
        }
    }

    fn fresh(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn open_exports(&self, key: usize) -> usize {
        self.exports.iter().filter(|e| e.owner == key).count()
    }

    /// Writes fresh stamps into page `page` of `id` (an import's with
    /// `import`) and records them as chunk `h`'s.
    fn stamp(&mut self, import: bool, id: Id, page: usize, h: usize) {
        let seed = self.fresh();
        let arena = if import { &self.im } else { &self.ex };
        for off in STAMP_AT {
            arena.write(id, page as u64 * C + off, &stamp_bytes(seed, off)).expect("write a stamp");
        }
        self.chunks.all[h].seed = seed;
    }

    fn apply(&mut self, op: &Op) {
        let what = format!("{op:?}");
        let what = what.as_str();
        match *op {
            Op::Alloc(pages, growable, extra) => {
                let got = match growable {
                    true => self.ex.alloc_growable(pages * C, (pages + extra) * C),
                    false => self.ex.alloc(pages * C),
                };
                if self.chunks.mapped() + pages > CAP {
                    refused(got, &[Status::OutOfMemory], what);
                    return seen("alloc out of memory");
                }
                let (id, ptr) = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                let key = self.fresh() as usize;
                self.ex.set_tag(id, tag_of(key)).unwrap();
                let chunks: Vec<usize> = (0..pages).map(|_| self.chunks.create(0)).collect();
                for (p, &h) in chunks.iter().enumerate() {
                    self.stamp(false, id, p, h);
                }
                let a = Alloc { id, ptr, pages, chunks, sleep: None, exported: false, export_pages: 0 };
                self.allocs.insert(key, a);
            }
            Op::Share(src, first, pages, extra) => {
                let Some(k) = self.pick(src) else { return };
                let a = &self.allocs[&k];
                // Mostly inside the source, sometimes past its end.
                let first = first % (a.pages + 1);
                let want = if a.exported || first + pages > a.pages {
                    Some(Status::InvalidArgument)
                } else {
                    a.sleep.as_ref().map(|_| Status::Asleep)
                };
                let got = self.ex.alloc_shared(a.id, first * C, pages * C, (pages + extra) * C);
                if let Some(w) = want {
                    refused(got, &[w], what);
                    return seen(if a.exported { "share from an exported one refused" } else { "share refused" });
                }
                let (id, ptr) = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                let chunks = a.chunks[first as usize..(first + pages) as usize].to_vec();
                chunks.iter().for_each(|&h| self.chunks.map_again(h));
                let key = self.fresh() as usize;
                self.ex.set_tag(id, tag_of(key)).unwrap();
                let a = Alloc { id, ptr, pages, chunks, sleep: None, exported: false, export_pages: 0 };
                self.allocs.insert(key, a);
                seen("shared");
            }
            Op::Sleep(sel, sharer) => {
                let Some(k) = self.pick_sharing(sel, sharer, false) else { return };
                self.ex.sleep(tag_of(k), SLEEP_BACKUP).unwrap_or_else(|e| panic!("{what}: {e}"));
                let a = &self.allocs[&k];
                if a.sleep.is_some() {
                    return;
                }
                if a.exported {
                    return seen("an exported one stays awake");
                }
                let chunks = std::mem::take(&mut self.allocs.get_mut(&k).unwrap().chunks);
                let slept = self.chunks.sleep(k, &chunks);
                self.allocs.get_mut(&k).unwrap().sleep = Some(slept);
            }
            Op::Wake(sel) => {
                let Some(k) = self.pick(sel) else { return };
                let got = self.ex.wake(tag_of(k));
                let Some(slept) = self.allocs[&k].sleep.clone() else {
                    return got.unwrap_or_else(|e| panic!("{what}: {e}"));
                };
                if self.chunks.mapped() + self.chunks.wake_needs(&slept) > CAP {
                    refused(got, &[Status::OutOfMemory], what);
                    return seen("wake out of memory");
                }
                got.unwrap_or_else(|e| panic!("{what}: {e}"));
                let chunks = self.chunks.wake(k, &slept);
                let a = self.allocs.get_mut(&k).unwrap();
                (a.chunks, a.sleep) = (chunks, None);
            }
            Op::Export(sel, sharer) => {
                let Some(k) = self.pick_sharing(sel, sharer, true) else { return };
                let a = &self.allocs[&k];
                let got = self.ex.export(a.id);
                if a.sleep.is_some() {
                    refused(got, &[Status::Asleep], what);
                    return seen("export of a sleeper refused");
                }
                if a.chunks.iter().any(|&h| self.chunks.awake_sharer(h)) {
                    refused(got, &[Status::InvalidArgument], what);
                    return seen("export refused: an awake sharer");
                }
                if a.chunks.iter().any(|&h| self.chunks.sleeper_sharer(h)) {
                    refused(got, &[Status::InvalidArgument], what);
                    return seen("export refused: a sleeping sharer");
                }
                let export = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                let chunks = a.chunks.clone();
                let a = self.allocs.get_mut(&k).unwrap();
                a.exported = true;
                a.export_pages = a.export_pages.max(chunks.len() as u64);
                self.exports.push(Open { export, owner: k, chunks });
                seen("exported");
            }
            Op::Close(sel) => {
                if !self.exports.is_empty() {
                    let n = self.exports.len();
                    drop(self.exports.remove(sel % n));
                }
            }
            Op::Import(sel) => {
                let Some(e) = (!self.exports.is_empty()).then(|| &self.exports[sel % self.exports.len()]) else {
                    return;
                };
                let (id, _) = self.im.import_export(&e.export, false).unwrap_or_else(|err| panic!("{what}: {err}"));
                if !self.allocs.contains_key(&e.owner) {
                    seen("import after the exporter freed");
                }
                self.imports.push(Import { id, chunks: e.chunks.clone() });
            }
            Op::FreeImport(sel) => {
                if !self.imports.is_empty() {
                    let n = self.imports.len();
                    let i = self.imports.remove(sel % n);
                    self.im.free(i.id).unwrap_or_else(|e| panic!("{what}: {e}"));
                }
            }
            Op::Free(sel) => {
                let Some(k) = self.pick(sel) else { return };
                let a = self.allocs.remove(&k).unwrap();
                let before = self.ex.stats().unwrap();
                self.ex.free(a.id).unwrap_or_else(|e| panic!("{what}: {e}"));
                if a.exported {
                    // Its chunks go back to the driver, never to the pool.
                    let s = self.ex.stats().unwrap();
                    assert!(s.pooled_bytes <= before.pooled_bytes, "{what}: an exported allocation's chunks pooled");
                    assert!(s.driver_releases >= before.driver_releases + a.pages, "{what}: chunks not released");
                    seen("free of an exported one");
                }
                match &a.sleep {
                    Some(slept) => self.chunks.leave(k, slept),
                    None => {
                        if a.chunks.iter().any(|&h| self.chunks.awake_sharer(h)) {
                            seen("free of a chunk another still maps");
                        }
                        a.chunks.iter().for_each(|&h| self.chunks.unmap(h));
                    }
                }
                // Its open exports stay open (their owner is gone).
                for e in self.exports.iter_mut().filter(|e| e.owner == k) {
                    e.owner = usize::MAX;
                }
            }
            Op::Resize(sel, np) => {
                let Some(k) = self.pick(sel) else { return };
                let a = &self.allocs[&k];
                let got = self.ex.resize(a.id, np * C);
                if a.sleep.is_some() {
                    refused(got, &[Status::Asleep], what);
                    return;
                }
                if a.exported && np < a.export_pages {
                    refused(got, &[Status::InvalidArgument], what);
                    return seen("shrink below the exported chunks refused");
                }
                let cur = a.chunks.len() as u64;
                let short = np > cur && self.chunks.mapped() + np - cur > CAP;
                let pinned = self.open_exports(k) > 0;
                let want: &[Status] = match (pinned, short) {
                    (true, true) => &[Status::Pinned, Status::OutOfMemory],
                    (false, true) => &[Status::OutOfMemory],
                    (true, false) => &[Status::Pinned],
                    (false, false) => &[],
                };
                let ptr = match got {
                    Ok(ptr) if !short => ptr,
                    got => {
                        let s = refused(got, want, what);
                        return seen(if s == Status::Pinned {
                            "pinned growth refused"
                        } else {
                            "growth out of memory"
                        });
                    }
                };
                assert!(!pinned || ptr == a.ptr, "{what}: a pinned allocation moved");
                let (id, old) = (a.id, a.chunks.clone());
                if np <= cur {
                    old[np as usize..].iter().for_each(|&h| self.chunks.unmap(h));
                    let a = self.allocs.get_mut(&k).unwrap();
                    a.chunks.truncate(np as usize);
                } else {
                    for p in cur..np {
                        let h = self.chunks.create(0);
                        self.allocs.get_mut(&k).unwrap().chunks.push(h);
                        self.stamp(false, id, p as usize, h);
                    }
                }
                let a = self.allocs.get_mut(&k).unwrap();
                (a.pages, a.ptr) = (np, ptr);
            }
            Op::Write(sel, page) => {
                let Some(k) = self.pick(sel) else { return };
                let a = &self.allocs[&k];
                let (id, p) = (a.id, (page % a.pages) as usize);
                if a.sleep.is_some() {
                    refused(self.ex.write(id, 0, &[1]), &[Status::Asleep], what);
                    return;
                }
                let h = a.chunks[p];
                self.stamp(false, id, p, h);
            }
            Op::WriteImport(sel, page) => {
                if !self.imports.is_empty() {
                    let i = &self.imports[sel % self.imports.len()];
                    let (id, p) = (i.id, (page % i.chunks.len() as u64) as usize);
                    let h = i.chunks[p];
                    self.stamp(true, id, p, h);
                }
            }
        }
    }

    /// Everything the model says of both arenas.
    fn check(&mut self, what: &str) {
        let ids: BTreeMap<u64, usize> = self.allocs.iter().map(|(&k, a)| (a.id.get(), k)).collect();
        for (&k, a) in self.allocs.iter_mut() {
            let info = self.ex.query(a.id).unwrap_or_else(|e| panic!("{what}: query of {k}: {e}"));
            let pinned = self.exports.iter().any(|e| e.owner == k);
            assert_eq!((info.size, info.asleep, info.pinned), (a.pages * C, a.sleep.is_some(), pinned), "{what}: {k}");
            if pinned || a.sleep.is_some() {
                assert_eq!(info.ptr, a.ptr, "{what}: {k} moved while pinned or asleep");
            }
            a.ptr = info.ptr;
            for (p, &h) in a.chunks.iter().enumerate() {
                verify(&self.ex, a.id, p, self.chunks.all[h].seed, &format!("{what}: allocation {k}"));
            }
        }
        for i in &self.imports {
            for (p, &h) in i.chunks.iter().enumerate() {
                verify(&self.im, i.id, p, self.chunks.all[h].seed, &format!("{what}: import {}", i.id));
            }
        }
        let s = self.ex.stats().unwrap();
        let sleepers = || self.allocs.values().filter(|a| a.sleep.is_some());
        let asleep: u64 = sleepers().map(|a| self.ex.query(a.id).unwrap().reserved_bytes).sum();
        let all = || self.allocs.values();
        let bytes = [self.chunks.mapped(), self.chunks.shared(), all().map(|a| a.pages).sum()].map(|n| n * C);
        let counts = [self.allocs.len() as u64, all().filter(|a| a.exported).count() as u64];
        let sleep = [sleepers().map(|a| a.pages * C).sum::<u64>(), asleep];
        let got = (
            [s.mapped_bytes, s.shared_bytes, s.live_bytes],
            [s.live_allocations, s.exported_allocations],
            [s.backup_bytes, s.asleep_bytes],
        );
        assert_eq!(got, (bytes, counts, sleep), "{what}: exporter stats (mapped, shared, live; live, exported; sleep)");
        let i = self.im.stats().unwrap();
        let imported = (self.imports.len() as u64, self.imports.iter().map(|i| i.chunks.len() as u64 * C).sum());
        assert_eq!((i.imported_allocations, i.imported_bytes), imported, "{what}: importer's sharing stats");
        let own =
            [i.live_allocations, i.live_bytes, i.mapped_bytes, i.pooled_bytes, i.driver_creates, i.driver_releases];
        let calls = [i.driver_maps, i.driver_unmaps, i.driver_access_calls];
        assert!(own.iter().chain(&calls).all(|&v| v == 0), "{what}: imports count in the importer's own stats: {i:?}");
        let snap = Snap::of(&self.ex);
        snap.check_structure(self.ex.va_range());
        for r in snap.live() {
            let k = ids[&r.id];
            let mine = &self.allocs[&k].chunks;
            let want: BTreeSet<u64> = (self.allocs.iter())
                .filter(|&(&o, b)| o != k && b.chunks.iter().any(|h| mine.contains(h)))
                .map(|(_, b)| b.id.get())
                .collect();
            let got: BTreeSet<u64> = r.shares_with.iter().copied().collect();
            assert_eq!(got, want, "{what}: allocation {k} shares chunks with");
        }
        Snap::of(&self.im).check_structure(self.im.va_range());
    }
}

fn run(ops: &[Op]) {
    let mut h = Harness::new();
    for (n, op) in ops.iter().enumerate() {
        seen("op");
        h.apply(op);
        h.check(&format!("op {n} ({op:?})"));
    }
    // Exports close, imports go, every allocation is freed: nothing mapped.
    h.exports.clear();
    for i in std::mem::take(&mut h.imports) {
        h.im.free(i.id).unwrap();
    }
    for a in std::mem::take(&mut h.allocs).into_values() {
        h.ex.free(a.id).unwrap();
    }
    let s = h.ex.stats().unwrap();
    assert_eq!((s.live_allocations, s.mapped_bytes, s.shared_bytes, s.exported_allocations), (0, 0, 0, 0));
    h.ex.trim(0).unwrap();
    Snap::of(&h.ex).check_structure(h.ex.va_range());
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn export_share_and_sleep_keep_the_models_rules(ops in prop::collection::vec(op(), 1..40)) {
        run(&ops);
    }
}

#[test]
fn the_generator_reaches_every_rule() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(op(), 30..40);
    for _ in 0..64 {
        run(&strategy.new_tree(&mut runner).unwrap().current());
    }
    let seen = SEEN.lock().unwrap();
    println!("outcomes: {seen:?}");
    for what in [
        "alloc out of memory",
        "shared",
        "share from an exported one refused",
        "a sleeper joins a group",
        "an exported one stays awake",
        "a waker maps its group's chunk again",
        "a waker gets its group a new chunk",
        "exported",
        "export of a sleeper refused",
        "export refused: an awake sharer",
        "export refused: a sleeping sharer",
        "import after the exporter freed",
        "free of a chunk another still maps",
        "shrink below the exported chunks refused",
        "free of an exported one",
        "growth out of memory",
    ] {
        assert!(seen.contains_key(what), "never reached: {what} (reached: {seen:?})");
    }
}
