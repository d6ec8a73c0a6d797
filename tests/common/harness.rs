//! The model of an arena that the property test (`tests/model.rs`) and the
//! `ops` fuzz target (`fuzz/logic/ops.rs`) share: the operations, what the
//! model knows of every allocation, and every check made after each
//! operation. The property test draws operations with proptest on the host,
//! the mock or a GPU; the fuzz target decodes them from bytes and adds
//! injected driver failures (`Op::Faulty`). Both include this file with
//! `#[path]`, beside `tests/common/mod.rs` (as `super::common`'s sibling).
//!
//! `resize_on_stream` has `resize`'s model: neither the host nor the mock
//! (its streams off) records an event, so it must resize exactly as
//! `resize` there, and `stream_shrinks` stays 0; on a GPU the stat counts
//! its shrinks of whole chunks.
//!
//! `quiesce_on_stream` (`Op::Quiesce`): the model keeps a `quiesced` flag
//! per allocation of whole chunks, set by a successful call on an awake
//! one, cleared when it grows (a larger size), sleeps or is unquiesced
//! (`Op::Unquiesce`, `Ok` for every live allocation). It is `Ok` for every
//! awake allocation and `Asleep` for a sleeper; `quiesces` counts a call
//! only on a GPU (neither the host nor the mock here records an event),
//! and never a small allocation's or a repeated one's while the promise
//! holds; a quiesced allocation shrunk on a stream records no shrink
//! event. The harness keeps the caller's side of the contract: it writes
//! nothing through a quiesced allocation's addresses (`Op::Write` skips
//! it) until it grows; reads
//! for the checks go on. On the host and the mock the promise holds at
//! once, so what a free or a shrink of it leaves cached is known idle:
//! `idle_cached_bytes` grows by exactly its pages no one else maps (and
//! by nothing for any other allocation), checked where no watermark
//! gives cached chunks back and no retired range maps them too.
//!
//! After each operation (see [`Harness::check`]):
//! - the snapshot's ranges tile the reserved range and agree with the
//!   stats and with the model (live allocations and bytes; mapped bytes as
//!   the distinct chunks of the awake allocations, a shared chunk once, and
//!   the slabs; `shared_bytes` and each range's sharers as the model's
//!   reference counts say; mapped + pooled <= capacity; pooled memory under
//!   the watermark);
//! - the driver holds exactly the chunks and mappings the arena accounts for;
//! - every live allocation's stamped bytes survive resizes, moves,
//!   compactions, sleeps with a backup and failed calls, read through the
//!   arena and (host) through the raw pointer; a write through one holder
//!   of a shared chunk is seen through every other holder;
//! - out of memory only when the capacity cannot cover the request, out of
//!   address space only when no window can be evacuated (a brute-force
//!   oracle, `evacuation_exists`), or, without implicit moves, no free range
//!   fits; PINNED only when the pinned allocation must move;
//! - pinned and sleeping allocations never move, nothing moves implicitly
//!   when implicit moves are off, move events chain every address change,
//!   and old addresses stay readable until retired memory is released by an
//!   operation that may do so;
//! - sleep and wake: the sharing rules of the contract (a chunk an awake
//!   allocation maps stays and is mapped again as it is now; sleepers that
//!   shared share again, each byte from the one that slept last with a
//!   backup covering it);
//! - an operation whose injected failure fired returns that failure and
//!   leaves the arena exactly as it was (`trim`: what was released stays
//!   released; a give-back that failed after the operation's own change is
//!   absorbed and counted).
//!
//! Sharing in the model: every allocation of whole chunks lists a *model
//! chunk* per backed page (`Model::chunks`); `alloc_shared` copies a range
//! of its source's list, growth adds new ones, shrinking drops the tail. A
//! model chunk's reference count is the number of awake allocations listing
//! it; the bytes written through one are copied into every other awake
//! holder's stamps (`Harness::restamp`).

#![allow(dead_code)] // each includer uses what it needs

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use super::common::{evacuation_exists, Growth, Snap, Stamps};
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, Error, Id, MoveEvent, Status, ALL_TAGS, SLEEP_BACKUP};

#[derive(Clone, Debug)]
pub struct Config {
    pub cap_pages: u64,
    pub reserve_pages: u64,
    pub retain_pages: Option<u64>,
    pub no_implicit_moves: bool,
}

#[derive(Clone, Debug)]
pub enum Op {
    Alloc(u64),
    AllocGrowable(u64, u64),
    /// A share of the `src`th live allocation: from its whole page
    /// `first`, `pages` pages, reserving `extra` pages more (each taken
    /// modulo what the source allows; a source without a whole chunk is
    /// refused).
    AllocShared {
        src: usize,
        first: u64,
        pages: u64,
        extra: u64,
    },
    Free(usize),
    Resize(usize, u64),
    /// `resize_on_stream` on the stream given: the model is `Resize`'s.
    /// Neither the host nor the mock (without streams) records an event,
    /// so `stream_shrinks` stays 0 there; on a GPU it counts the shrinks
    /// that drop whole chunks.
    ResizeOnStream(usize, u64, u64),
    /// `quiesce_on_stream` of the `n`th live allocation on the stream given.
    Quiesce(usize, u64),
    /// `unquiesce` of the `n`th live allocation (no driver call).
    Unquiesce(usize),
    Pin(usize),
    Unpin(usize),
    Compact,
    ReleaseRetired,
    Trim(u64),
    Write(usize),
    /// A stale or made-up id must be refused.
    BadId(u64),
    /// Tags 0..=2 (a small allocation refuses any).
    SetTag(usize, u32),
    /// A tag (3: `ALL_TAGS`), with or without a backup.
    Sleep(u32, bool),
    Wake(u32),
    /// The `n`th driver call of the operation fails with the fault.
    Faulty(u64, FaultKind, Box<Op>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Linux host memory: bytes are also checked through raw pointers.
    Host,
    /// The in-memory mock.
    Mock,
    /// Device 0; bytes are checked through `cuMemcpy` only.
    Cuda,
}

/// Outcome counters, to show that a search reaches the interesting paths.
pub static OUTCOMES: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

pub fn count(what: &'static str) {
    *OUTCOMES.lock().unwrap_or_else(|p| p.into_inner()).entry(what).or_default() += 1;
}

/// The model's tags: 0..=2, and 3 for `ALL_TAGS`.
pub fn tag_arg(t: u32) -> u32 {
    if t == 3 {
        ALL_TAGS
    } else {
        t
    }
}

fn status_of(kind: FaultKind) -> Status {
    match kind {
        FaultKind::OutOfMemory => Status::OutOfMemory,
        FaultKind::Driver => Status::Driver,
    }
}

/// Stamps: (offset, bytes) pairs.
type Marks = Vec<(u64, Vec<u8>)>;

/// What a sleeper slept with.
#[derive(Clone, Debug)]
struct Slept {
    /// Its stamps when it fell asleep, if it slept with a backup.
    backup: Option<Marks>,
    /// Order of falling asleep.
    seq: u64,
    /// Per backed page: whether its chunk was shared then (it joined the
    /// chunk's group and shares again on wake).
    grouped: Vec<bool>,
}

/// What the model knows about one allocation.
#[derive(Debug)]
pub struct Model {
    size: u64,
    growable: bool,
    pinned: bool,
    /// Packed in a slab (a non-growable allocation of at most half a chunk,
    /// until a resize beyond the small classes promotes it).
    small: bool,
    ptr: u64,
    /// Bytes reserved for it: its reservation, or its size class if small.
    reserved: u64,
    stamps: Stamps,
    tag: u32,
    /// Asleep (its stamps restored on wake, see `Harness::wake`).
    asleep: bool,
    /// Model chunks of its backed pages (empty for a small one).
    chunks: Vec<u64>,
    slept: Option<Slept>,
    /// Promised no more work (`quiesce_on_stream`) since it last grew or
    /// slept: the harness writes nothing through it.
    quiesced: bool,
}

/// The pieces of `marks` inside page `page` (pages of `c` bytes), as
/// (offset in the page, bytes); a mark across a page boundary is split.
fn marks_in_page(marks: &[(u64, Vec<u8>)], page: u64, c: u64) -> Vec<(u64, Vec<u8>)> {
    let (lo, hi) = (page * c, (page + 1) * c);
    marks
        .iter()
        .filter_map(|(off, b)| {
            let (s, e) = ((*off).max(lo), (off + b.len() as u64).min(hi));
            (s < e).then(|| (s - lo, b[(s - off) as usize..(e - off) as usize].to_vec()))
        })
        .collect()
}

/// Replaces whatever `marks` said about `off..off + bytes.len()` by `bytes`.
fn overwrite(marks: &mut Vec<(u64, Vec<u8>)>, off: u64, bytes: Vec<u8>) {
    let end = off + bytes.len() as u64;
    marks.retain(|(o, b)| o + b.len() as u64 <= off || *o >= end);
    marks.push((off, bytes));
}

/// The driver under the fault injector, kept to compare its own live
/// chunks and mappings with the injector's count (`None`: CUDA, which
/// cannot count them itself).
enum Probe {
    Host(Arc<HostDriver>),
    Mock(Arc<MockDriver>),
    None,
}

type Fd = Arc<FaultDriver<Arc<dyn Driver>>>;

pub struct Harness {
    pub arena: Arena,
    fd: Fd,
    probe: Probe,
    backend: Backend,
    /// The chunk size.
    c: u64,
    cfg: Config,
    events: Arc<Mutex<Vec<MoveEvent>>>,
    live: BTreeMap<Id, Model>,
    freed: Vec<Id>,
    next_seed: u64,
    next_chunk: u64,
    sleeps: u64,
    snap: Snap,
    moves: u64,
    /// The allocation being resized and its old size, during a resize.
    resized: Option<(Id, u64)>,
    /// Old addresses of moved allocations of whole chunks, and the bytes
    /// there that must stay readable while the range is retired.
    views: Vec<(Id, u64, u64)>,
    /// A failure to plan before the next driver-calling operation.
    fault: Option<(u64, FaultKind)>,
    /// The last successful operation's give-back failed: pooled memory may
    /// exceed the watermark until an operation succeeds without that.
    watermark_failed: bool,
    /// The current operation's give-back failed (an injected failure absorbed).
    absorbed_now: bool,
    /// The `stream_shrinks` the arena must count: 0 but on a GPU.
    stream_shrinks: u64,
    /// The `quiesces` the arena must count: 0 but on a GPU.
    quiesces: u64,
}

/// Whether an operation's injected failure fired, and how it ended.
enum Faulted {
    /// No failure fired: judge the operation as usual.
    No,
    /// It fired and the operation failed with it: the arena was checked
    /// unchanged; the operation's handler stops.
    RolledBack,
}

impl Harness {
    /// A fresh arena on `backend` with chunks of `c` bytes (`cuda`: the
    /// test's shared device driver, which the caller passes).
    pub fn new(backend: Backend, c: u64, cfg: Config, cuda: Option<Arc<dyn Driver>>) -> Harness {
        let ac = ArenaConfig {
            capacity_bytes: cfg.cap_pages * c,
            reserve_bytes: cfg.reserve_pages * c,
            chunk_bytes: c,
            retain_bytes: cfg.retain_pages.map_or(u64::MAX, |p| p * c),
            no_implicit_moves: cfg.no_implicit_moves,
            ..ArenaConfig::default()
        };
        let (inner, probe): (Arc<dyn Driver>, Probe) = match backend {
            Backend::Host => {
                let d = Arc::new(HostDriver::new().expect("host driver"));
                (d.clone(), Probe::Host(d))
            }
            Backend::Mock => {
                let d = Arc::new(MockDriver::new(4096, 1 << 40));
                (d.clone(), Probe::Mock(d))
            }
            Backend::Cuda => (cuda.expect("the CUDA driver"), Probe::None),
        };
        let fd: Fd = Arc::new(FaultDriver::new(inner));
        let arena = Arena::with_driver(fd.clone(), ac).expect("arena");
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        arena.set_move_callback(Some(Box::new(move |e: &MoveEvent| sink.lock().unwrap().push(*e)))).unwrap();
        let snap = Snap::of(&arena);
        let mut h = Harness {
            arena,
            fd,
            probe,
            backend,
            c,
            cfg,
            events,
            live: BTreeMap::new(),
            freed: Vec::new(),
            next_seed: 1,
            next_chunk: 0,
            sleeps: 0,
            snap,
            moves: 0,
            resized: None,
            views: Vec::new(),
            fault: None,
            watermark_failed: false,
            absorbed_now: false,
            stream_shrinks: 0,
            quiesces: 0,
        };
        h.check("initial", &[]);
        h
    }

    fn pages(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.c)
    }

    /// The largest small allocation: half a chunk.
    fn small_max(&self) -> u64 {
        self.c / 2
    }

    /// Whether a free's or a shrink's effect on `idle_cached_bytes` is
    /// exact (see the module doc): the promise holds at once (no GPU), no
    /// watermark gives cached chunks back, and no retired range maps a
    /// chunk as well (which would retire a page, not cache it).
    fn idle_checked(&self) -> bool {
        self.backend != Backend::Cuda && self.cfg.retain_pages.is_none() && self.snap.stats["retired_va_bytes"] == 0
    }

    /// How many of `id`'s backed pages `pages` (indices into its model
    /// chunks) map a chunk no other awake allocation maps.
    fn mapped_alone(&self, id: Id, pages: std::ops::Range<usize>) -> u64 {
        let m = &self.live[&id];
        if m.asleep {
            return 0;
        }
        m.chunks[pages].iter().filter(|&&k| self.awake_holders(k).iter().all(|&(o, _)| o == id)).count() as u64
    }

    fn nth(&self, i: usize) -> Option<Id> {
        (!self.live.is_empty()).then(|| *self.live.keys().nth(i % self.live.len()).unwrap())
    }

    fn seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn fresh_chunks(&mut self, n: u64) -> Vec<u64> {
        let first = self.next_chunk;
        self.next_chunk += n;
        (first..first + n).collect()
    }

    /// Chunks a request may still obtain: the capacity minus the chunks
    /// backing allocations and slabs (pooled ones are reusable, and so are
    /// the slabs of retired small objects only), before the op.
    fn obtainable(&self) -> u64 {
        self.cfg.cap_pages - self.snap.stats["mapped_bytes"] / self.c
    }

    /// An operation that applies the retain watermark succeeded: the
    /// watermark holds again, unless its own give-back failed.
    fn ran_ok(&mut self) {
        self.watermark_failed = std::mem::take(&mut self.absorbed_now);
    }

    fn moved_so_far(&self) -> usize {
        self.events.lock().unwrap().len()
    }

    fn movable_ids(&self) -> Vec<Id> {
        self.live.iter().filter(|(_, m)| !m.pinned && !m.asleep).map(|(&id, _)| id).collect()
    }

    /// Awake allocations mapping model chunk `k`, with the page where each does.
    fn awake_holders(&self, k: u64) -> Vec<(Id, u64)> {
        self.live
            .iter()
            .filter(|(_, m)| !m.asleep)
            .flat_map(|(&id, m)| {
                m.chunks.iter().enumerate().filter(move |&(_, &x)| x == k).map(move |(j, _)| (id, j as u64))
            })
            .collect()
    }

    /// Writes fresh stamps over `from..to` of `id` (replacing what its
    /// stamps said there), and copies them into every other awake holder
    /// of the chunks written.
    fn restamp(&mut self, id: Id, from: u64, to: u64) {
        let seed = self.seed();
        let c = self.c;
        let m = self.live.get_mut(&id).unwrap();
        m.stamps.marks.retain(|(o, b)| o + b.len() as u64 <= from || *o >= to);
        let n0 = m.stamps.marks.len();
        m.stamps.seed = seed;
        m.stamps.write(&self.arena, id, from, to);
        let written: Marks = m.stamps.marks[n0..].to_vec();
        let chunks = m.chunks.clone();
        for (i, &k) in chunks.iter().enumerate() {
            let pieces = marks_in_page(&written, i as u64, c);
            if pieces.is_empty() {
                continue;
            }
            for (other, j) in self.awake_holders(k) {
                if other == id {
                    continue;
                }
                let o = self.live.get_mut(&other).unwrap();
                for (off, bytes) in &pieces {
                    let at = j * c + off;
                    if at < o.size {
                        let keep = (o.size - at).min(bytes.len() as u64) as usize;
                        overwrite(&mut o.stamps.marks, at, bytes[..keep].to_vec());
                    }
                }
            }
        }
    }

    /// Whether an out-of-address-space for `n` pages is justified, given the
    /// state before the call and the allocations that may not move.
    fn oas_justified(&self, n: u64, immovable: impl Fn(u64, bool) -> bool) -> bool {
        let free = self.snap.free_after_release();
        if n > self.cfg.reserve_pages {
            return true;
        }
        if self.cfg.no_implicit_moves {
            return free.iter().all(|&(_, l)| l < n);
        }
        let live: Vec<(u64, u64, bool)> =
            self.snap.live_pages().into_iter().map(|(id, s, l, pinned)| (s, l, immovable(id, pinned))).collect();
        !evacuation_exists(self.cfg.reserve_pages, n, &free, &live)
    }

    /// Runs one arena call with the planned failure, if any.
    fn call<T>(
        &mut self,
        what: &str,
        trim: bool,
        f: impl FnOnce(&Arena) -> vmm_arena::Result<T>,
    ) -> (vmm_arena::Result<T>, Faulted) {
        let Some((n, kind)) = self.fault.take() else { return (f(&self.arena), Faulted::No) };
        let failures0 = self.snap.stats["release_failures"];
        let polls0 = self.arena.stats().unwrap().event_polls;
        self.fd.fail_nth(None, n, kind);
        let r = f(&self.arena);
        let fired = !self.fd.pending();
        self.fd.clear();
        if !fired {
            count("fault planned beyond the operation's calls");
            return (r, Faulted::No);
        }
        match &r {
            Ok(_) => {
                // Only a give-back after the operation's own change may fail
                // without failing the call, and (on a GPU, the only backend
                // here whose events are pending) a poll of a pending event,
                // which reads as not complete yet (polled again later).
                let s = self.arena.stats().unwrap();
                if self.backend == Backend::Cuda && s.release_failures == failures0 && s.event_polls > polls0 {
                    count("fault absorbed (an event poll)");
                    return (r, Faulted::No);
                }
                count("fault absorbed (give-back kept pooled)");
                assert_eq!(
                    s.release_failures,
                    failures0 + 1,
                    "{what}: a fault that fired without failing the call is counted"
                );
                self.absorbed_now = true;
                (r, Faulted::No)
            }
            Err(e) => {
                assert_eq!(e.status(), status_of(kind), "{what}: the call fails with the injected failure: {e}");
                let now = Snap::of(&self.arena).without_driver_counters();
                let pre = self.snap.clone().without_driver_counters();
                if trim {
                    count("trim failed by a fault");
                    // Documented: released chunks stay released; nothing else changes.
                    // (Chunks cached in a growable's reservation tail are pooled: trim gives them back.)
                    let live = |s: &Snap| {
                        s.live()
                            .map(|r| super::common::Range { pooled_mapped_bytes: 0, ..r.clone() })
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(live(&now), live(&pre), "{what}: a failed trim changed an allocation");
                    assert!(now.stats["pooled_bytes"] <= pre.stats["pooled_bytes"]);
                } else {
                    count("operation rolled back after a fault");
                    assert_eq!(now, pre, "{what}: a failed call changed the arena");
                }
                assert!(self.events.lock().unwrap().is_empty(), "{what}: a failed call reported moves");
                self.check(what, &[]);
                (r, Faulted::RolledBack)
            }
        }
    }

    fn alloc(&mut self, size: u64, max: u64, growable: bool) {
        let small = !growable && size <= self.small_max();
        // Pages the request needs at most (a small one: a new slab).
        let (np, nr) = if small { (1, 1) } else { (self.pages(size), self.pages(max)) };
        let obtainable = self.obtainable();
        let (r, f) = self.call("alloc", false, |a| if growable { a.alloc_growable(size, max) } else { a.alloc(size) });
        if let Faulted::RolledBack = f {
            return;
        }
        match r {
            Ok((id, ptr)) => {
                count(match (small, self.moved_so_far()) {
                    (true, 0) => "alloc small ok",
                    (false, 0) => "alloc ok",
                    _ => "alloc ok, after moving others",
                });
                assert!(np <= obtainable || small, "alloc of {np} pages succeeded beyond the capacity");
                assert_eq!(ptr % if small { 256 } else { self.c }, 0, "alignment of {size} bytes at {ptr:#x}");
                let chunks = if small { Vec::new() } else { self.fresh_chunks(np) };
                let m = Model {
                    size,
                    growable,
                    pinned: false,
                    small,
                    ptr,
                    reserved: 0,
                    stamps: Stamps::default(),
                    tag: 0,
                    asleep: false,
                    chunks,
                    slept: None,
                    quiesced: false,
                };
                assert!(self.live.insert(id, m).is_none(), "id {id} issued twice");
                assert!(!self.freed.contains(&id), "id {id} reused");
                self.restamp(id, 0, size);
                let moved_others = if self.cfg.no_implicit_moves { vec![] } else { self.movable_ids() };
                self.ran_ok();
                self.check("alloc", &moved_others);
            }
            Err(e) => {
                count(match e.status() {
                    Status::OutOfMemory => "alloc out of memory",
                    _ => "alloc out of address space",
                });
                match e.status() {
                    Status::OutOfMemory => {
                        assert!(np > obtainable, "OutOfMemory for {np} pages while {obtainable} are obtainable: {e}")
                    }
                    Status::OutOfAddressSpace => {
                        assert!(np <= obtainable, "capacity short too: must be OutOfMemory");
                        assert!(
                            self.oas_justified(nr, |_, pinned| pinned),
                            "OutOfAddressSpace for {nr} pages though a window can be evacuated: {e}\n{:?}",
                            self.snap.ranges
                        );
                    }
                    _ => panic!("alloc failed with {e:?}"),
                }
                self.check("failed alloc", &[]);
            }
        }
    }

    fn alloc_shared(&mut self, src_i: usize, first: u64, pages: u64, extra: u64) {
        let Some(src) = self.nth(src_i) else { return };
        let c = self.c;
        let m = &self.live[&src];
        let whole = if m.small { 0 } else { m.size / c };
        if whole == 0 {
            // Nothing of a whole chunk to share (a small allocation, or one
            // under a chunk): refused before any driver call.
            let e = self.arena.alloc_shared(src, 0, c, c).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "alloc_shared of {src} without a whole chunk: {e}");
            count("alloc_shared invalid");
            return self.check("failed alloc_shared", &[]);
        }
        let first = first % whole;
        let pages = 1 + pages % (whole - first);
        let (bytes, max) = (pages * c, (pages + extra) * c);
        if m.asleep {
            assert_eq!(self.arena.alloc_shared(src, first * c, bytes, max), Err(Error::Asleep(src.get())));
            count("alloc_shared asleep");
            return self.check("failed alloc_shared", &[]);
        }
        let (r, f) = self.call("alloc_shared", false, |a| a.alloc_shared(src, first * c, bytes, max));
        if let Faulted::RolledBack = f {
            return;
        }
        match r {
            Ok((id, ptr)) => {
                count(if self.moved_so_far() == 0 {
                    "alloc_shared ok"
                } else {
                    "alloc_shared ok, after moving others"
                });
                assert_eq!(ptr % c, 0, "alignment of a share at {ptr:#x}");
                let m = &self.live[&src];
                let (lo, hi) = (first * c, first * c + bytes);
                let marks = m
                    .stamps
                    .marks
                    .iter()
                    .filter(|(o, b)| *o >= lo && o + b.len() as u64 <= hi)
                    .map(|(o, b)| (o - lo, b.clone()))
                    .collect();
                let share = Model {
                    size: bytes,
                    growable: true,
                    pinned: false,
                    small: false,
                    ptr,
                    reserved: 0,
                    stamps: Stamps { seed: 0, marks },
                    tag: 0,
                    asleep: false,
                    chunks: m.chunks[first as usize..(first + pages) as usize].to_vec(),
                    slept: None,
                    quiesced: false,
                };
                assert!(self.live.insert(id, share).is_none(), "id {id} issued twice");
                assert!(!self.freed.contains(&id), "id {id} reused");
                let moved_others = if self.cfg.no_implicit_moves { vec![] } else { self.movable_ids() };
                self.ran_ok();
                // The share reads src's bytes; then a write through it is
                // seen through src.
                self.check("alloc_shared", &moved_others);
                self.restamp(id, 0, c);
                self.check("write", &[]);
            }
            Err(e) => {
                count("alloc_shared out of address space");
                assert_eq!(e.status(), Status::OutOfAddressSpace, "alloc_shared creates no chunk: {e}");
                assert!(
                    self.oas_justified(pages + extra, |_, pinned| pinned),
                    "OutOfAddressSpace for a share of {} pages though a window can be evacuated: {e}",
                    pages + extra
                );
                self.check("failed alloc_shared", &[]);
            }
        }
    }

    /// `resize`, or `resize_on_stream` on `stream`: the same model.
    fn resize(&mut self, id: Id, new_size: u64, stream: Option<u64>) {
        let what = if stream.is_some() { "resize_on_stream" } else { "resize" };
        let call = move |a: &Arena| match stream {
            None => a.resize(id, new_size),
            Some(s) => a.resize_on_stream(id, new_size, s),
        };
        let m = &self.live[&id];
        if m.asleep {
            // Refused before any driver call: a planned failure cannot fire.
            assert_eq!(call(&self.arena), Err(Error::Asleep(id.get())), "{what} of a sleeper");
            count("resize asleep");
            return self.check("failed resize", &[]);
        }
        let (old_size, old_ptr, reserved, pinned, growable, small, quiesced) =
            (m.size, m.ptr, m.reserved, m.pinned, m.growable, m.small, m.quiesced);
        // A shrink's dropped pages that no one else maps: left cached, and
        // known idle if the allocation is quiesced (see `idle_checked`).
        let (np, have) = (self.pages(new_size), m.chunks.len());
        let dropped_alone = if np < have as u64 { self.mapped_alone(id, np as usize..have) } else { 0 };
        let idle0 = self.snap.stats["idle_cached_bytes"];
        let idle_checked = np <= have as u64 && self.idle_checked();
        let obtainable = self.obtainable();
        let mut growth: Option<Growth> = None;
        // What the resize needs: whether it must move, the pages a new place
        // needs at most, and whether that place is a small one.
        let (needs_move, need_pages, window, to_small) = if small {
            let needs_move = new_size > reserved;
            let to_small = new_size <= self.small_max();
            let need = match (needs_move, to_small) {
                (false, _) => 0,
                (true, true) => 1,
                (true, false) => self.pages(new_size),
            };
            (needs_move, need, if to_small { 1 } else { self.pages(new_size) }, to_small)
        } else {
            let (backed, np) = (self.pages(old_size), self.pages(new_size));
            let start = (old_ptr - self.snap.base) / self.c;
            let g = Growth::of(
                &self.snap,
                id.get(),
                start,
                reserved / self.c,
                np,
                self.cfg.reserve_pages,
                self.cfg.no_implicit_moves,
            );
            growth = Some(g);
            (g.must_move(), np.saturating_sub(backed), np, false)
        };
        self.resized = Some((id, old_size));
        let (r, f) = self.call(what, false, call);
        if let Faulted::RolledBack = f {
            self.resized = None;
            return;
        }
        match r {
            Ok(ptr) => {
                count(match (needs_move, self.moved_so_far()) {
                    (false, _) => "resize in place",
                    (true, 1) if small => "resize small by copying",
                    (true, 1) => "resize by moving",
                    (true, _) => "resize by moving, after moving others",
                });
                // (Where the oracle cannot decide whether the neighbours can
                // move away, the address check below still holds it to account.)
                let undecided = growth.is_some_and(|g| g.undecided);
                assert!(!(needs_move && pinned) || undecided, "a pinned allocation grew where it had to move");
                if !small {
                    assert!(need_pages <= obtainable, "grew beyond the capacity");
                }
                if !needs_move && growth.map_or(true, |g| g.stays) {
                    assert_eq!(ptr, old_ptr, "growth within the reservation (or shrinking) must not move");
                }
                if pinned {
                    assert_eq!(ptr, old_ptr, "a pinned allocation grows in place or not at all");
                }
                let shrank = !small && np < self.pages(old_size);
                // Only a GPU records an event: for a shrink of whole chunks
                // whose pages no promise of no more work covers already.
                if stream.is_some() && self.backend == Backend::Cuda && shrank && !quiesced {
                    self.stream_shrinks += 1;
                }
                if stream.is_some() && shrank {
                    count("resize_on_stream shrank whole chunks");
                }
                if shrank && quiesced {
                    count("shrink of a quiesced allocation");
                }
                // Growth ends the promise, within its pages too (new bytes are
                // for new work).
                let grew = !small && new_size > old_size;
                if grew && quiesced {
                    count("quiesced allocation grew");
                }
                let still_small = small && (to_small || !needs_move);
                let m = self.live.get_mut(&id).unwrap();
                m.size = new_size;
                m.small = still_small;
                m.quiesced &= !grew;
                let write_new = new_size > old_size && !m.quiesced;
                m.stamps.truncate(old_size.min(new_size));
                // Chunks: a shrink drops the tail (one reference each),
                // growth adds new ones; a small allocation promoted to
                // chunks gets new ones (its bytes were copied).
                let have = m.chunks.len() as u64;
                if still_small {
                    m.chunks.clear();
                } else if np < have {
                    m.chunks.truncate(np as usize);
                } else if np > have {
                    let more = self.fresh_chunks(np - have);
                    self.live.get_mut(&id).unwrap().chunks.extend(more);
                }
                // Nothing is written through a quiesced allocation: a growth
                // within its pages leaves its new bytes unstamped.
                if write_new {
                    self.restamp(id, old_size, new_size);
                }
                let info = self.arena.query(id).unwrap();
                assert_eq!(info.ptr, ptr);
                assert!(info.reserved_bytes >= new_size, "after a resize the reservation covers the size");
                if growable && !needs_move {
                    assert!(info.reserved_bytes >= reserved, "shrinking a growable keeps its reservation");
                }
                let moved: Vec<Id> = if self.cfg.no_implicit_moves { vec![id] } else { self.movable_ids() };
                // Neighbours may move out of the way unless it grows into
                // free (or retired) pages.
                let others_may_move = growth.map_or(needs_move, |g| !g.stays);
                let moved = if others_may_move { moved } else { vec![] };
                self.ran_ok();
                self.check(what, &moved);
                if idle_checked {
                    let want = if quiesced { dropped_alone * self.c } else { 0 };
                    let now = self.snap.stats["idle_cached_bytes"];
                    assert!(now >= idle0, "{what}: a shrink made known-idle cached pages busy");
                    assert_eq!(now - idle0, want, "{what}: pages a shrink left known idle (quiesced: {quiesced})");
                }
            }
            Err(e) => {
                count(match e.status() {
                    Status::Pinned => "resize pinned",
                    Status::OutOfMemory => "resize out of memory",
                    _ => "resize out of address space",
                });
                match e.status() {
                    Status::Pinned => assert!(pinned && needs_move, "Pinned error though no move was needed: {e}"),
                    Status::OutOfMemory => {
                        let undecided = growth.is_some_and(|g| g.undecided);
                        assert!(!(pinned && needs_move) || undecided, "must be Pinned first");
                        assert!(need_pages > obtainable, "OutOfMemory though capacity covers it: {e}")
                    }
                    Status::OutOfAddressSpace => {
                        assert!(needs_move && !pinned && need_pages <= obtainable, "unexpected {e:?}");
                        let me = id.get();
                        // Chunks grow in place or move themselves: they may
                        // not be moved away to make room. A small one's slab
                        // may.
                        assert!(
                            self.oas_justified(window, |other, pinned| pinned || (other == me && !small)),
                            "OutOfAddressSpace growing to {window} pages though a window can be evacuated: {e}\n{:?}",
                            self.snap.ranges
                        );
                    }
                    _ => panic!("resize failed with {e:?}"),
                }
                self.check("failed resize", &[]);
            }
        }
        self.resized = None;
    }

    /// `quiesce_on_stream`: `Ok` for every awake allocation (a small one's
    /// and a repeated call's change nothing), `Asleep` for a sleeper; the
    /// promise holds until the allocation grows or sleeps.
    fn quiesce(&mut self, id: Id, stream: u64) {
        let m = &self.live[&id];
        let (asleep, small, again) = (m.asleep, m.small, m.quiesced);
        let q0 = self.arena.stats().unwrap().quiesces;
        if asleep {
            // Refused before any driver call: a planned failure cannot fire.
            assert_eq!(self.arena.quiesce_on_stream(id, stream), Err(Error::Asleep(id.get())), "quiesce of a sleeper");
            count("quiesce asleep");
            assert_eq!(self.arena.stats().unwrap().quiesces, q0, "quiesce of a sleeper counted");
            return self.check("failed quiesce", &[]);
        }
        let (r, f) = self.call("quiesce_on_stream", false, |a| a.quiesce_on_stream(id, stream));
        if let Faulted::RolledBack = f {
            // (`call` checked that nothing changed, the count included.)
            return count("quiesce rolled back after a fault");
        }
        r.unwrap_or_else(|e| panic!("quiesce_on_stream of awake {id}: {e}"));
        count(match (small, again) {
            (true, _) => "quiesce small",
            (false, true) => "quiesce again",
            (false, false) => "quiesce",
        });
        // One event at most: only a GPU records one, and only for a promise
        // that does not hold already (of an allocation of whole chunks).
        let counted = self.arena.stats().unwrap().quiesces - q0;
        let want = u64::from(self.backend == Backend::Cuda && !small && !again);
        assert_eq!(counted, want, "quiesce_on_stream of {id} (small {small}, again {again}) counted {counted}");
        self.quiesces += want;
        if !small {
            self.live.get_mut(&id).unwrap().quiesced = true;
        }
        self.ran_ok();
        self.check("quiesce_on_stream", &[]);
    }

    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Faulty(n, kind, inner) => {
                // Operations without driver calls run as they are.
                if matches!(
                    **inner,
                    Op::Pin(_)
                        | Op::Unpin(_)
                        | Op::Write(_)
                        | Op::BadId(_)
                        | Op::SetTag(..)
                        | Op::Unquiesce(_)
                        | Op::Faulty(..)
                ) {
                    return self.apply(inner);
                }
                self.fault = Some((*n, *kind));
                self.apply(inner);
                self.fault = None;
            }
            &Op::Alloc(size) => self.alloc(size, size, false),
            &Op::AllocGrowable(size, max) => self.alloc(size, max, true),
            &Op::AllocShared { src, first, pages, extra } => self.alloc_shared(src, first, pages, extra),
            &Op::Free(i) => {
                let Some(id) = self.nth(i) else { return };
                let m = &self.live[&id];
                let (quiesced, alone) = (m.quiesced, self.mapped_alone(id, 0..m.chunks.len()));
                let idle0 = self.snap.stats["idle_cached_bytes"];
                let idle_checked = self.idle_checked();
                let (r, f) = self.call("free", false, |a| a.free(id));
                if let Faulted::RolledBack = f {
                    panic!("free failed with an injected failure: its give-back is best effort");
                }
                r.unwrap();
                let m = self.live.remove(&id).expect("live");
                count(match (m.asleep, m.chunks.iter().any(|&k| !self.awake_holders(k).is_empty())) {
                    (true, _) => "free asleep",
                    (false, true) => "free of a sharer",
                    (false, false) => "free",
                });
                if quiesced {
                    count("free of a quiesced allocation");
                }
                self.freed.push(id);
                assert_eq!(self.arena.free(id), Err(Error::UnknownAllocation(id.get())), "double free refused");
                assert_eq!(self.arena.query(id).unwrap_err().status(), Status::UnknownAllocation);
                self.ran_ok();
                self.check("free", &[]);
                if idle_checked {
                    // What it leaves cached is known idle iff it was quiesced.
                    let want = if quiesced { alone * self.c } else { 0 };
                    let now = self.snap.stats["idle_cached_bytes"];
                    assert!(now >= idle0, "free: made known-idle cached pages busy");
                    assert_eq!(now - idle0, want, "free: pages it left known idle (quiesced: {quiesced})");
                }
            }
            &Op::Resize(i, size) => {
                if let Some(id) = self.nth(i) {
                    self.resize(id, size, None);
                }
            }
            &Op::ResizeOnStream(i, size, stream) => {
                if let Some(id) = self.nth(i) {
                    self.resize(id, size, Some(stream));
                }
            }
            &Op::Quiesce(i, stream) => {
                if let Some(id) = self.nth(i) {
                    self.quiesce(id, stream);
                }
            }
            &Op::Unquiesce(i) => {
                let Some(id) = self.nth(i) else { return };
                self.arena.unquiesce(id).unwrap_or_else(|e| panic!("unquiesce of live {id}: {e}"));
                let m = self.live.get_mut(&id).unwrap();
                count(if std::mem::take(&mut m.quiesced) { "unquiesce ended a promise" } else { "unquiesce idle" });
                self.check("unquiesce", &[]);
            }
            &Op::Pin(i) | &Op::Unpin(i) => {
                let Some(id) = self.nth(i) else { return };
                let pin = matches!(op, Op::Pin(_));
                if pin && self.live[&id].asleep {
                    assert_eq!(self.arena.pin(id), Err(Error::Asleep(id.get())), "pin of a sleeper");
                    count("pin asleep");
                    return self.check("failed pin", &[]);
                }
                if pin { self.arena.pin(id) } else { self.arena.unpin(id) }.unwrap();
                self.live.get_mut(&id).unwrap().pinned = pin;
                assert_eq!(self.arena.query(id).unwrap().pinned, pin);
                self.check("pin", &[]);
            }
            Op::Compact => {
                let (r, f) = self.call("compact", false, |a| a.compact());
                if let Faulted::RolledBack = f {
                    return;
                }
                let report = r.unwrap();
                count(if report.moved_allocations > 0 { "compact moved" } else { "compact idle" });
                assert_eq!(report.largest_free_va_before, self.snap.stats["largest_free_va_bytes"]);
                let moved = self.movable_ids();
                let before = self.moves;
                self.ran_ok();
                self.check("compact", &moved);
                // A slab's move moves each of its objects (one event each).
                assert_eq!(self.moves - before, report.moved_allocations, "report counts every move, as events");
                assert_eq!(report.largest_free_va_after, self.snap.stats["largest_free_va_bytes"]);
                assert_eq!(self.snap.stats["retired_va_bytes"], 0, "compact releases the old ranges");
                assert!(
                    report.largest_free_va_after >= report.largest_free_va_before,
                    "compaction made the largest hole smaller: {report:?}"
                );
            }
            Op::ReleaseRetired => {
                let free_after = self.snap.free_after_release();
                let (r, f) = self.call("release_retired", false, |a| a.release_retired());
                if let Faulted::RolledBack = f {
                    return;
                }
                r.unwrap();
                count("release_retired");
                self.ran_ok();
                self.check("release_retired", &[]);
                assert_eq!(self.snap.stats["retired_va_bytes"], 0);
                assert_eq!(self.snap.free_pages(), free_after, "retired ranges become free");
            }
            &Op::Trim(keep) => {
                let c = self.c;
                let pooled = self.snap.stats["pooled_bytes"];
                let releases = self.arena.stats().unwrap().driver_releases;
                let (r, f) = self.call("trim", true, |a| a.trim(keep * c));
                if let Faulted::RolledBack = f {
                    return;
                }
                let released = r.unwrap();
                count("trim");
                self.ran_ok();
                self.check("trim", &[]);
                let now = self.snap.stats["pooled_bytes"];
                // Slabs of retired objects only are pooled, but wait for the
                // release of retired memory.
                let idle_slabs = self.snap.slabs().filter(|r| r.used == 0).count() as u64;
                assert!(now <= (keep + idle_slabs) * c, "trim keeps at most keep_bytes pooled");
                assert!(released <= pooled, "trim gave back more than was pooled");
                let s = self.arena.stats().unwrap();
                assert_eq!((s.driver_releases - releases) * c, released, "trim reports what it released");
                assert!(released >= pooled - now.min(pooled), "trim released less than the pool shrank");
            }
            &Op::Write(i) => {
                let Some(id) = self.nth(i) else { return };
                let m = &self.live[&id];
                if m.asleep {
                    assert_eq!(self.arena.write(id, 0, b"x"), Err(Error::Asleep(id.get())), "write to a sleeper");
                    let mut out = [0u8; 1];
                    assert_eq!(self.arena.read(id, 0, &mut out), Err(Error::Asleep(id.get())), "read of a sleeper");
                    count("write asleep");
                    return self.check("failed write", &[]);
                }
                if m.quiesced {
                    // The caller's promise: nothing goes through it until it
                    // grows. Its bytes are still checked (read) below.
                    count("write to a quiesced allocation skipped");
                    return self.check("write skipped", &[]);
                }
                let size = m.size;
                self.restamp(id, 0, size);
                self.check("write", &[]);
            }
            &Op::BadId(raw) => self.bad_id(raw),
            &Op::SetTag(i, tag) => {
                let Some(id) = self.nth(i) else { return };
                let m = self.live.get_mut(&id).unwrap();
                match self.arena.set_tag(id, tag) {
                    Ok(()) => {
                        assert!(!m.small, "a small allocation took a tag");
                        m.tag = tag;
                        count(if m.asleep { "set_tag asleep" } else { "set_tag" });
                    }
                    Err(e) => {
                        assert!(m.small && e.status() == Status::InvalidArgument, "set_tag: {e}");
                        count("set_tag small refused");
                    }
                }
                assert_eq!(self.arena.query(id).unwrap().tag, m.tag);
                self.check("set_tag", &[]);
            }
            &Op::Sleep(t, backup) => self.sleep(tag_arg(t), backup),
            &Op::Wake(t) => self.wake(tag_arg(t)),
        }
    }

    fn bad_id(&mut self, raw: u64) {
        let bad = match (raw % 3, self.freed.is_empty()) {
            (0, false) => self.freed[(raw / 3) as usize % self.freed.len()],
            // Made-up ids: a plain one, and one tagged as a small allocation's.
            (1, _) if raw % 2 == 0 => Id::from_raw(0xdead_0000_0001 + raw % 7).unwrap(),
            (1, _) => Id::from_raw((1 << 63) | (0x0bad_0000_0001 + raw % 7)).unwrap(),
            _ => match Id::from_raw(raw) {
                Some(id) => id,
                None => return,
            },
        };
        if self.live.contains_key(&bad) {
            return;
        }
        count("bad id refused");
        let c = self.c;
        for e in [
            self.arena.free(bad).unwrap_err(),
            self.arena.resize(bad, 1).unwrap_err(),
            self.arena.pin(bad).unwrap_err(),
            self.arena.query(bad).unwrap_err(),
            self.arena.write(bad, 0, b"x").unwrap_err(),
            self.arena.set_tag(bad, 1).unwrap_err(),
            self.arena.alloc_shared(bad, 0, c, c).unwrap_err(),
            self.arena.quiesce_on_stream(bad, 0).unwrap_err(),
            self.arena.unquiesce(bad).unwrap_err(),
        ] {
            assert_eq!(e, Error::UnknownAllocation(bad.get()));
        }
        self.check("bad id", &[]);
    }

    fn sleep(&mut self, tag: u32, backup: bool) {
        let (r, f) = self.call("sleep", false, |a| a.sleep(tag, if backup { SLEEP_BACKUP } else { 0 }));
        if let Faulted::RolledBack = f {
            return count("sleep rolled back after a fault");
        }
        r.unwrap();
        if self.absorbed_now {
            count("sleep kept a chunk whose release failed");
        }
        let selected: Vec<Id> = self
            .live
            .iter()
            .filter(|(_, m)| !m.small && !m.asleep && (tag == ALL_TAGS || m.tag == tag))
            .map(|(&id, _)| id)
            .collect();
        // A page shared with any other live allocation (awake, or asleep in
        // the chunk's group) joins the group.
        let mut shared_pages = 0;
        let mut kept_pages = 0;
        let sleepers: Vec<(Id, Vec<bool>)> = selected
            .iter()
            .map(|&id| {
                let grouped: Vec<bool> = self.live[&id]
                    .chunks
                    .iter()
                    .map(|k| self.live.iter().any(|(&o, om)| o != id && om.chunks.contains(k)))
                    .collect();
                shared_pages += grouped.iter().filter(|&&g| g).count();
                kept_pages += self.live[&id]
                    .chunks
                    .iter()
                    .filter(|&&k| self.awake_holders(k).iter().any(|(o, _)| !selected.contains(o)))
                    .count();
                (id, grouped)
            })
            .collect();
        for (id, grouped) in sleepers {
            self.sleeps += 1;
            let seq = self.sleeps;
            let m = self.live.get_mut(&id).unwrap();
            m.asleep = true;
            if std::mem::take(&mut m.quiesced) {
                // Waking restores its bytes and the caller's work.
                count("sleep ended a promise");
            }
            let marks = std::mem::take(&mut m.stamps.marks);
            m.slept = Some(Slept { backup: backup.then_some(marks), seq, grouped });
        }
        count(match (selected.is_empty(), backup) {
            (true, _) => "sleep idle",
            (false, false) => "sleep",
            (false, true) => "sleep with backup",
        });
        if shared_pages > 0 {
            count("sleep of sharers");
        }
        if kept_pages > 0 {
            count("sleep kept a chunk an awake allocation maps");
        }
        let kept = self.absorbed_now;
        self.ran_ok();
        self.check("sleep", &[]);
        // Every pooled chunk goes back, but one whose release failed (which
        // the retain watermark, applied after the operation, may give back).
        let s = &self.snap.stats;
        assert!(s["pooled_bytes"] <= if kept { self.c } else { 0 }, "sleep gives back what is pooled");
        assert_eq!(s["retired_va_bytes"], 0, "sleep releases the retired ranges");
    }

    fn wake(&mut self, tag: u32) {
        let c = self.c;
        let selected: Vec<Id> = self
            .live
            .iter()
            .filter(|(_, m)| m.asleep && (tag == ALL_TAGS || m.tag == tag))
            .map(|(&id, _)| id)
            .collect();
        // New chunks needed: one per model chunk no awake allocation maps
        // (a group's, once for all its members).
        let mut dead: BTreeSet<u64> = BTreeSet::new();
        for id in &selected {
            for &k in &self.live[id].chunks {
                if self.awake_holders(k).is_empty() {
                    dead.insert(k);
                }
            }
        }
        let needed = dead.len() as u64;
        let obtainable = self.obtainable();
        // Chunks of slabs holding only retired objects come back only when
        // retired memory is released, which wake does not do.
        let idle_slabs = self.snap.slabs().filter(|r| r.used == 0).count() as u64;
        let (r, f) = self.call("wake", false, |a| a.wake(tag));
        if let Faulted::RolledBack = f {
            return count("wake rolled back after a fault");
        }
        match r {
            Ok(()) => {
                count(if needed > 0 || !selected.is_empty() { "wake" } else { "wake idle" });
                assert!(needed <= obtainable, "woke {needed} pages beyond the capacity");
                // Each page's bytes, from the books before the wake: a chunk
                // an awake allocation maps, as it is now; a group's new
                // chunk, byte by byte the backup of the member that slept
                // last with one covering that byte; any other new chunk, its
                // own backup.
                let mut restored: Vec<(Id, Marks)> = Vec::new();
                for &id in &selected {
                    let m = &self.live[&id];
                    let z = m.slept.as_ref().expect("a sleeper");
                    let mut marks = Vec::new();
                    for (i, &k) in m.chunks.iter().enumerate() {
                        let i = i as u64;
                        let from: Option<Marks> = if let Some(&(h, j)) = self.awake_holders(k).first() {
                            Some(marks_in_page(&self.live[&h].stamps.marks, j, c))
                        } else if z.grouped[i as usize] {
                            // Byte by byte, the newest backup covering it: a
                            // member backed up its size, so only a prefix of
                            // a page its size ends in. Overlaid oldest first,
                            // each replacing what the older ones said there.
                            let mut members: Vec<(u64, u64, Marks)> = self
                                .live
                                .values()
                                .filter_map(|o| {
                                    let oz = o.slept.as_ref()?;
                                    let j = o.chunks.iter().position(|&x| x == k)? as u64;
                                    let b = oz.backup.as_ref()?;
                                    Some((oz.seq, (o.size - j * c).min(c), marks_in_page(b, j, c)))
                                })
                                .collect();
                            members.sort_by_key(|&(seq, _, _)| seq);
                            let mut page: Option<Marks> = None;
                            for (_, covers, pieces) in members {
                                let acc = page.get_or_insert_with(Vec::new);
                                acc.retain(|(o, _)| *o >= covers);
                                acc.extend(pieces);
                            }
                            page
                        } else {
                            z.backup.as_ref().map(|b| marks_in_page(b, i, c))
                        };
                        for (off, bytes) in from.unwrap_or_default() {
                            let at = i * c + off;
                            if at < m.size {
                                let keep = (m.size - at).min(bytes.len() as u64) as usize;
                                marks.push((at, bytes[..keep].to_vec()));
                            }
                        }
                    }
                    restored.push((id, marks));
                }
                for (id, marks) in restored {
                    let m = self.live.get_mut(&id).unwrap();
                    m.asleep = false;
                    m.slept = None;
                    m.stamps.marks = marks;
                }
                self.ran_ok();
                // check() verifies the woken stamps.
                self.check("wake", &[]);
            }
            Err(e) => {
                count("wake out of memory");
                assert_eq!(e.status(), Status::OutOfMemory, "{e}");
                assert!(needed > obtainable - idle_slabs, "OutOfMemory waking {needed} of {obtainable} pages: {e}");
                self.check("failed wake", &[]);
            }
        }
    }

    /// Checks every invariant after an operation; `may_move` are the ids
    /// that were allowed to move during it.
    pub fn check(&mut self, what: &str, may_move: &[Id]) {
        let c = self.c;
        let snap = Snap::of(&self.arena);
        snap.check_structure(self.arena.va_range());
        let s = &snap.stats;
        assert_eq!(s["chunk_bytes"], c);
        assert_eq!(s["capacity_bytes"], self.cfg.cap_pages * c);
        assert_eq!(s["live_allocations"], self.live.len() as u64, "{what}: live_allocations");
        assert_eq!(s["live_bytes"], self.live.values().map(|m| m.size).sum::<u64>(), "{what}: live_bytes");
        // resize_on_stream records an event only on a GPU (the host has no
        // asynchronous streams, the mock's are off here): else it is resize.
        assert_eq!(s["stream_shrinks"], self.stream_shrinks, "{what}: stream_shrinks");
        // So does quiesce_on_stream (a promise the host and the mock know
        // kept at once).
        assert_eq!(s["quiesces"], self.quiesces, "{what}: quiesces");
        assert_eq!(self.arena.stats().unwrap().quiesces, self.quiesces, "{what}: quiesces in the stats");
        // Reference counts: awake holders of each model chunk.
        let mut refs: BTreeMap<u64, u64> = BTreeMap::new();
        for m in self.live.values().filter(|m| !m.asleep) {
            assert_eq!(m.chunks.len() as u64, if m.small { 0 } else { self.pages(m.size) }, "{what}: model chunks");
            for &k in &m.chunks {
                *refs.entry(k).or_default() += 1;
            }
        }
        let idle_slabs = snap.slabs().filter(|r| r.used == 0).count() as u64;
        assert_eq!(
            s["mapped_bytes"],
            (refs.len() as u64 + s["small_slabs"] - idle_slabs) * c,
            "{what}: mapped_bytes (a shared chunk once)"
        );
        assert_eq!(s["shared_bytes"], refs.values().filter(|&&n| n > 1).count() as u64 * c, "{what}: shared_bytes");
        assert_eq!(
            snap.slabs().map(|r| r.used).sum::<u64>(),
            self.live.values().filter(|m| m.small).count() as u64,
            "{what}: objects in slabs"
        );
        assert!(s["peak_physical_bytes"] >= self.snap.stats["peak_physical_bytes"], "{what}: the peak went down");
        if let (Some(r), false) = (self.cfg.retain_pages, self.watermark_failed) {
            // Slabs of retired objects wait for the release of retired memory.
            assert!(s["pooled_bytes"] <= (r + idle_slabs) * c, "{what}: pooled memory above the retain watermark");
        }
        assert_eq!(self.fd.live_chunks() as u64, (s["mapped_bytes"] + s["pooled_bytes"]) / c, "{what}: chunks");
        assert_eq!(self.fd.live_mappings() as u64, snap.mapped_pages(), "{what}: driver mappings vs mapped pages");
        let inner = match &self.probe {
            Probe::Host(d) => Some((d.live_chunks(), d.live_mappings())),
            Probe::Mock(d) => Some((d.live_chunks(), d.live_mappings())),
            Probe::None => None,
        };
        if let Some(inner) = inner {
            assert_eq!(inner, (self.fd.live_chunks(), self.fd.live_mappings()), "{what}: the driver's own count");
        }
        let stats = self.arena.stats().unwrap();
        assert_eq!(stats.mapped_bytes, s["mapped_bytes"]);
        assert_eq!(stats.pooled_bytes, s["pooled_bytes"]);
        assert_eq!(stats.free_va_bytes, s["free_va_bytes"]);
        assert_eq!(stats.shared_bytes, s["shared_bytes"]);

        // Moves: the callback's events chain each id from its old address
        // to its new one.
        let events: Vec<MoveEvent> = std::mem::take(&mut *self.events.lock().unwrap());
        assert_eq!(s["moves"] - self.moves, events.len() as u64, "{what}: one event per counted move");
        self.moves = s["moves"];
        let mut now: BTreeMap<Id, u64> = self.live.iter().map(|(&id, m)| (id, m.ptr)).collect();
        for e in &events {
            assert!(may_move.contains(&e.id), "{what}: {} moved but was not allowed to: {e:?}", e.id);
            let cur = now.get_mut(&e.id).unwrap_or_else(|| panic!("{what}: event for a dead id {e:?}"));
            assert_eq!(e.old_ptr, *cur, "{what}: event's old address is not the last known one");
            assert_ne!(e.old_ptr, e.new_ptr);
            // The size at the moment of the move: a resized allocation may
            // move (with its slab) before its size changes.
            let ok_size = e.size == self.live[&e.id].size || self.resized == Some((e.id, e.size));
            assert!(ok_size, "{what}: event size {e:?}");
            *cur = e.new_ptr;
        }
        // Who shares with whom, as the model's chunks say.
        let sharers: BTreeMap<Id, (u64, BTreeSet<u64>)> = self
            .live
            .iter()
            .filter(|(_, m)| !m.asleep && !m.small)
            .map(|(&id, m)| {
                let mut pages = 0;
                let mut with = BTreeSet::new();
                for &k in &m.chunks {
                    let others: Vec<u64> =
                        self.awake_holders(k).into_iter().filter(|&(o, _)| o != id).map(|(o, _)| o.get()).collect();
                    pages += u64::from(!others.is_empty());
                    with.extend(others);
                }
                (id, (pages * c, with))
            })
            .collect();
        let by_id = snap.live_by_id();
        let mut small_extents = Vec::new();
        let mut pinned_slabs = Vec::new();
        let raw = self.backend == Backend::Host;
        for (&id, m) in self.live.iter_mut() {
            let info = self.arena.query(id).unwrap();
            assert_eq!((info.size, info.pinned, info.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
            assert_eq!((info.tag, info.asleep), (m.tag, m.asleep), "{what}: {id}");
            match by_id.get(&id.get()) {
                Some(r) => {
                    assert!(!m.small, "{what}: small {id} has chunks of its own");
                    assert_eq!((info.ptr, info.reserved_bytes, info.mapped_bytes), (r.addr, r.bytes, r.mapped_bytes));
                    assert_eq!((r.size, r.pinned, r.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
                    let (shared, with) = sharers.get(&id).cloned().unwrap_or_default();
                    assert_eq!(r.shared_bytes, shared, "{what}: shared bytes of {id}");
                    assert_eq!(
                        r.shares_with.iter().copied().collect::<BTreeSet<u64>>(),
                        with,
                        "{what}: sharers of {id}"
                    );
                }
                None => {
                    assert!(m.small, "{what}: live {id} missing from the snapshot");
                    let slab =
                        snap.slab_at(info.ptr).unwrap_or_else(|| panic!("{what}: small {id} outside every slab"));
                    assert_eq!(info.reserved_bytes, slab.class_bytes, "{what}: small {id} reserves its class");
                    assert!(info.size <= slab.class_bytes);
                    assert_eq!((info.ptr - slab.addr) % slab.class_bytes, 0, "{what}: small {id} on a boundary");
                    assert!(!m.pinned || slab.pinned, "{what}: the slab of a pinned object is pinned");
                    if m.pinned {
                        pinned_slabs.push(slab.addr);
                    }
                    small_extents.push((info.ptr, info.reserved_bytes));
                }
            }
            assert_eq!(info.ptr, now[&id], "{what}: {id} changed address without (or unlike) a move event");
            assert!(!(m.pinned && info.ptr != m.ptr), "{what}: pinned {id} moved");
            m.ptr = info.ptr;
            m.reserved = info.reserved_bytes;
            if m.asleep {
                continue; // its bytes are verified when it wakes
            }
            m.stamps.verify(&self.arena, id, what);
            if raw {
                // SAFETY: host backend; `m.ptr` is the allocation's current
                // address (queried just now), every stamp lies below its
                // size, and this thread is the arena's only user.
                unsafe { m.stamps.verify_raw(m.ptr, what) };
            }
        }
        for slab in snap.slabs() {
            assert_eq!(
                slab.pinned,
                pinned_slabs.contains(&slab.addr),
                "{what}: a slab is pinned iff an object in it is"
            );
        }
        self.check_old_addresses(what, &snap, &events);
        small_extents.sort_unstable();
        for w in small_extents.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{what}: small allocations overlap: {w:?}");
        }
        assert_eq!(by_id.len(), self.live.values().filter(|m| !m.small).count(), "{what}: unknown allocations");
        self.snap = snap;
    }

    /// Old addresses of moved allocations stay readable, with the bytes
    /// they had, until the arena releases retired memory — which only the
    /// operations that need address space (and `release_retired`) may do.
    fn check_old_addresses(&mut self, what: &str, snap: &Snap, events: &[MoveEvent]) {
        let c = self.c;
        for e in events {
            let Some(m) = self.live.get(&e.id) else { continue };
            // Moves by remapping only: a small object's copy leaves a
            // retired object, not an alias, and slabs' objects churn.
            if m.small || e.old_ptr % c != 0 || !snap.retired_covers(e.old_ptr, c) {
                continue;
            }
            let len = match self.resized {
                Some((id, old)) if id == e.id => old.min(e.size),
                _ => e.size,
            };
            self.views.push((e.id, e.old_ptr, len));
        }
        let may_release = matches!(
            what,
            "alloc"
                | "alloc_shared"
                | "resize"
                | "resize_on_stream"
                | "compact"
                | "release_retired"
                | "sleep"
                | "teardown"
        );
        let mut kept = Vec::new();
        for (id, old_ptr, len) in std::mem::take(&mut self.views) {
            let Some(m) = self.live.get(&id) else { continue };
            // Bytes beyond a shrink are no longer the allocation's, anywhere.
            let len = len.min(m.size);
            if !snap.retired_covers(old_ptr, len.div_ceil(c) * c) {
                assert!(may_release, "{what}: released the old range {old_ptr:#x} of live {id}");
                continue;
            }
            if self.backend == Backend::Host && !m.asleep {
                // SAFETY: host backend; the pages below `len` at `old_ptr` are
                // in retired ranges (checked just above), which stay mapped,
                // and this thread is the arena's only user.
                unsafe { m.stamps.verify_raw_below(old_ptr, len, &format!("{what}: old address of {id}")) };
            }
            kept.push((id, old_ptr, len));
        }
        self.views = kept;
    }

    /// Frees everything, releases and trims: the arena and the driver hold
    /// nothing, and dropping the arena leaves the driver empty.
    pub fn teardown(mut self) {
        let ids: Vec<Id> = self.live.keys().copied().collect();
        for id in ids {
            self.arena.free(id).unwrap();
            self.live.remove(&id);
        }
        self.arena.release_retired().unwrap();
        self.arena.trim(0).unwrap();
        self.check("teardown", &[]);
        let s = self.arena.stats().unwrap();
        assert_eq!((s.mapped_bytes, s.pooled_bytes, s.free_va_bytes), (0, 0, self.cfg.reserve_pages * self.c));
        assert_eq!((self.fd.live_chunks(), self.fd.live_mappings()), (0, 0), "teardown leaves nothing on the driver");
        let fd = self.fd.clone();
        drop(self);
        assert_eq!((fd.live_chunks(), fd.live_mappings()), (0, 0), "dropping the arena releases everything");
    }
}
