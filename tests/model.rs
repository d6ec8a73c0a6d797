//! Property test: random operation sequences against a simple model.
//!
//! Each case builds a small arena (64 KiB chunks, a few dozen of them, so
//! that capacity and address space run short and compaction happens) on the
//! host backend or on the in-memory mock, runs a random sequence of every
//! public operation, and after each one checks:
//! - the snapshot's ranges tile the reserved range (live ranges never
//!   overlap and lie inside it) and the stats agree with them and with the
//!   model (live allocations, live bytes, mapped bytes = whole chunks of each
//!   size, mapped + pooled <= capacity, free and largest free VA);
//! - every live allocation's stamped bytes survive every resize, move and
//!   compaction, read through the arena and, on the host, through the raw
//!   pointer;
//! - out-of-memory exactly when the request exceeds capacity minus mapped;
//!   out-of-address-space, with implicit moves allowed, only when no window
//!   can be evacuated (a brute-force oracle, `common::evacuation_exists`)
//!   and, for a resize, neither can the pages after the allocation (so it
//!   would grow in place); with them disallowed only when no free range fits;
//! - PINNED only when a pinned allocation can grow neither into free or
//!   retired pages nor by its unpinned neighbours moving away; growth into
//!   free or retired pages never moves the allocation;
//! - pinned allocations never move; with `no_implicit_moves` nothing but the
//!   resized allocation moves during alloc and resize; a slab is pinned
//!   exactly while one of its objects is;
//! - the old address of a moved allocation stays readable (on the host,
//!   through the raw pointer) until retired memory is released, which only
//!   alloc, resize, compact and `release_retired` may do (`free` and `trim`
//!   with any retain watermark never release a live allocation's old range);
//! - `compact` reports as moved allocations exactly the moves it made;
//! - the move callback's events chain each moved allocation from its old
//!   address to its new one, and their count is the `moves` stat's increase.
//!
//! `PROPTEST_CASES=1000 cargo test --test model` runs a longer search.
//!
//! On a GPU, `VMM_ARENA_TEST_BACKEND=cuda cargo test --release --test model
//! cuda` runs the same model on device 0 with 2 MiB chunks (sizes are drawn
//! in chunks, so the cases scale). There every byte is checked through
//! `Arena::read`, that is `cuMemcpy`; the raw-pointer reads are host-only.
//! Without the variable that test is skipped; with it and no usable GPU it
//! fails.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::{evacuation_exists, Growth, Snap, Stamps, TestBackend, CUDA_CHUNK};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vmm_arena::driver::fault::FaultDriver;
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, Error, Id, MoveEvent, Status, ALL_TAGS, SLEEP_BACKUP};

/// The chunk size on the host and the mock (and in the regressions).
const C: u64 = common::HOST_CHUNK;

/// Outcome counters over all cases, printed at the end (`--nocapture`), to
/// show the search reaches the interesting paths.
static OUTCOMES: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn count(what: &'static str) {
    *OUTCOMES.lock().unwrap().entry(what).or_default() += 1;
}

fn report(backend: Backend) {
    eprintln!("{backend:?} outcomes over all cases: {:?}", OUTCOMES.lock().unwrap());
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Host,
    Mock,
    /// Device 0; bytes are checked through `cuMemcpy` only.
    Cuda,
}

impl Backend {
    fn chunk(self) -> u64 {
        match self {
            Backend::Host | Backend::Mock => C,
            Backend::Cuda => CUDA_CHUNK,
        }
    }
}

#[derive(Clone, Debug)]
struct Config {
    cap_pages: u64,
    reserve_pages: u64,
    retain_pages: Option<u64>,
    no_implicit_moves: bool,
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    AllocGrowable(u64, u64),
    Free(usize),
    Resize(usize, u64),
    Pin(usize),
    Unpin(usize),
    Compact,
    ReleaseRetired,
    Trim(u64),
    Write(usize),
    /// A stale or made-up id must be refused.
    BadId(usize),
    /// Tags 0..=2 (a small allocation refuses any).
    SetTag(usize, u32),
    /// A tag (3: `ALL_TAGS`), with or without a backup.
    Sleep(u32, bool),
    Wake(u32),
}

/// The model's tags: 0..=2, and 3 for `ALL_TAGS`.
fn tag_arg(t: u32) -> u32 {
    if t == 3 {
        ALL_TAGS
    } else {
        t
    }
}

/// A size in bytes of 1..=`max_pages` chunks of `c`, not chunk-aligned in general.
fn size(c: u64, max_pages: u64) -> impl Strategy<Value = u64> {
    (1..=max_pages, 1..=c, 0..4u8).prop_map(move |(p, b, whole)| (p - 1) * c + if whole == 0 { c } else { b })
}

/// Operations on an arena with chunks of `c` (small sizes: up to half a chunk).
fn op(c: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => size(c, 8).prop_map(Op::Alloc),
        4 => (1..=c / 2).prop_map(Op::Alloc),
        1 => size(c, 40).prop_map(Op::Alloc),
        4 => (size(c, 6), 0..=12u64).prop_map(move |(s, extra)| Op::AllocGrowable(s, s + extra * c)),
        5 => any::<usize>().prop_map(Op::Free),
        6 => (any::<usize>(), size(c, 16)).prop_map(|(i, s)| Op::Resize(i, s)),
        3 => (any::<usize>(), 1..=c / 2).prop_map(|(i, s)| Op::Resize(i, s)),
        1 => (any::<usize>(), size(c, 40)).prop_map(|(i, s)| Op::Resize(i, s)),
        2 => any::<usize>().prop_map(Op::Pin),
        2 => any::<usize>().prop_map(Op::Unpin),
        1 => Just(Op::Compact),
        1 => Just(Op::ReleaseRetired),
        1 => (0..8u64).prop_map(Op::Trim),
        2 => any::<usize>().prop_map(Op::Write),
        1 => any::<usize>().prop_map(Op::BadId),
        2 => (any::<usize>(), 0..=2u32).prop_map(|(i, t)| Op::SetTag(i, t)),
        1 => (0..=3u32, any::<bool>()).prop_map(|(t, b)| Op::Sleep(t, b)),
        2 => (0..=3u32).prop_map(Op::Wake),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    (
        16..=48u64,
        0..=3u64,
        prop_oneof![Just(None), Just(Some(0)), Just(Some(1)), Just(Some(4))],
        prop::bool::weighted(0.2),
    )
        .prop_flat_map(|(cap, r, retain, nim)| {
            // Reservation from a bit under the capacity to twice it.
            let lo = cap * 3 / 4;
            (lo..=cap * 2).prop_map(move |reserve| Config {
                cap_pages: cap,
                reserve_pages: if r == 0 { cap * 2 } else { reserve },
                retain_pages: retain,
                no_implicit_moves: nim,
            })
        })
}

/// What the model knows about one allocation.
#[derive(Debug)]
struct Model {
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
    /// Asleep (its stamps kept only if it slept with a backup).
    asleep: bool,
}

/// The driver, kept to compare its live chunks and mappings with the arena's books.
enum Probe {
    Host(Arc<HostDriver>),
    Mock(Arc<MockDriver>),
    /// A driver that cannot count them itself (CUDA), under a wrapper that does.
    Counted(Arc<FaultDriver<Arc<dyn Driver>>>),
}

impl Probe {
    fn live(&self) -> (usize, usize) {
        match self {
            Probe::Host(d) => (d.live_chunks(), d.live_mappings()),
            Probe::Mock(d) => (d.live_chunks(), d.live_mappings()),
            Probe::Counted(d) => (d.live_chunks(), d.live_mappings()),
        }
    }
}

struct Harness {
    arena: Arena,
    probe: Probe,
    backend: Backend,
    /// The chunk size.
    c: u64,
    cfg: Config,
    events: Arc<Mutex<Vec<MoveEvent>>>,
    live: BTreeMap<Id, Model>,
    freed: Vec<Id>,
    next_seed: u64,
    snap: Snap,
    moves: u64,
    /// The allocation being resized and its old size, during a resize.
    resized: Option<(Id, u64)>,
    /// Old addresses of moved allocations of whole chunks, and the bytes
    /// there that must stay readable while the range is retired.
    views: Vec<(Id, u64, u64)>,
}

impl Harness {
    fn pages(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.c)
    }

    /// The largest small allocation: half a chunk.
    fn small_max(&self) -> u64 {
        self.c / 2
    }

    fn new(backend: Backend, cfg: Config) -> Harness {
        let c = backend.chunk();
        let ac = ArenaConfig {
            capacity_bytes: cfg.cap_pages * c,
            reserve_bytes: cfg.reserve_pages * c,
            chunk_bytes: c,
            retain_bytes: cfg.retain_pages.map_or(u64::MAX, |p| p * c),
            no_implicit_moves: cfg.no_implicit_moves,
            ..ArenaConfig::default()
        };
        let (arena, probe) = match backend {
            Backend::Host => {
                let d = Arc::new(HostDriver::new().expect("host driver"));
                (Arena::with_driver(d.clone(), ac), Probe::Host(d))
            }
            Backend::Mock => {
                let d = Arc::new(MockDriver::new(4096, 1 << 40));
                (Arena::with_driver(d.clone(), ac), Probe::Mock(d))
            }
            Backend::Cuda => {
                let d = TestBackend::Cuda.driver().fault;
                (Arena::with_driver(d.clone(), ac), Probe::Counted(d))
            }
        };
        let arena = arena.expect("arena");
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        arena.set_move_callback(Some(Box::new(move |e: &MoveEvent| sink.lock().unwrap().push(*e)))).unwrap();
        let snap = Snap::of(&arena);
        let mut h = Harness {
            arena,
            probe,
            backend,
            c,
            cfg,
            events,
            live: BTreeMap::new(),
            freed: Vec::new(),
            next_seed: 1,
            snap,
            moves: 0,
            resized: None,
            views: Vec::new(),
        };
        h.check("initial", &[]);
        h
    }

    fn nth(&self, i: usize) -> Option<Id> {
        (!self.live.is_empty()).then(|| *self.live.keys().nth(i % self.live.len()).unwrap())
    }

    fn seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Chunks a request may still obtain: the capacity minus the chunks
    /// backing allocations and slabs (pooled ones are reusable, and so are
    /// the slabs of retired small objects only), before the op.
    fn obtainable(&self) -> u64 {
        // Slabs of retired objects only count as pooled: reclaimable.
        self.cfg.cap_pages - self.snap.stats["mapped_bytes"] / self.c
    }

    fn total_pages(&self) -> u64 {
        self.cfg.reserve_pages
    }

    fn moved_so_far(&self) -> usize {
        self.events.lock().unwrap().len()
    }

    /// Whether an out-of-address-space for `n` pages is justified, given the
    /// state before the call and the allocations that may not move.
    fn oas_justified(&self, n: u64, immovable: impl Fn(u64, bool) -> bool) -> bool {
        let free = self.snap.free_after_release();
        if n > self.total_pages() {
            return true;
        }
        if self.cfg.no_implicit_moves {
            return free.iter().all(|&(_, l)| l < n);
        }
        let live: Vec<(u64, u64, bool)> =
            self.snap.live_pages().into_iter().map(|(id, s, l, pinned)| (s, l, immovable(id, pinned))).collect();
        !evacuation_exists(self.total_pages(), n, &free, &live)
    }

    fn alloc(&mut self, size: u64, max: u64, growable: bool) {
        let small = !growable && size <= self.small_max();
        // Pages the request needs at most (a small one: a new slab).
        let (np, nr) = if small { (1, 1) } else { (self.pages(size), self.pages(max)) };
        let r = if growable { self.arena.alloc_growable(size, max) } else { self.arena.alloc(size) };
        let obtainable = self.obtainable();
        match r {
            Ok((id, ptr)) => {
                count(match (small, self.moved_so_far()) {
                    (true, 0) => "alloc small ok",
                    (false, 0) => "alloc ok",
                    _ => "alloc ok, after moving others",
                });
                assert!(np <= obtainable || small, "alloc of {np} pages succeeded beyond the capacity");
                assert_eq!(ptr % if small { 256 } else { self.c }, 0, "alignment of {size} bytes at {ptr:#x}");
                let mut m = Model {
                    size,
                    growable,
                    pinned: false,
                    small,
                    ptr,
                    reserved: 0,
                    stamps: Stamps::default(),
                    tag: 0,
                    asleep: false,
                };
                m.stamps.seed = self.seed();
                m.stamps.write(&self.arena, id, 0, size);
                assert!(self.live.insert(id, m).is_none(), "id {id} issued twice");
                assert!(!self.freed.contains(&id), "id {id} reused");
                let moved_others = if self.cfg.no_implicit_moves { vec![] } else { self.movable_ids() };
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

    fn movable_ids(&self) -> Vec<Id> {
        self.live.iter().filter(|(_, m)| !m.pinned && !m.asleep).map(|(&id, _)| id).collect()
    }

    fn resize(&mut self, id: Id, new_size: u64) {
        let m = &self.live[&id];
        if m.asleep {
            assert_eq!(self.arena.resize(id, new_size), Err(Error::Asleep(id.get())), "resize of a sleeper");
            count("resize asleep");
            return self.check("failed resize", &[]);
        }
        let (old_size, old_ptr, reserved, pinned, growable, small) =
            (m.size, m.ptr, m.reserved, m.pinned, m.growable, m.small);
        let obtainable = self.obtainable();
        let mut growth: Option<Growth> = None;
        // What the resize needs: whether it must move, the pages a new place
        // needs at most, and whether that place is a small one.
        let (needs_move, need_pages, window, to_small) = if small {
            let needs_move = new_size > reserved;
            let to_small = new_size <= self.small_max();
            (
                needs_move,
                if !needs_move {
                    0
                } else if to_small {
                    1
                } else {
                    self.pages(new_size)
                },
                if to_small { 1 } else { self.pages(new_size) },
                to_small,
            )
        } else {
            let (backed, np) = (self.pages(old_size), self.pages(new_size));
            let start = (old_ptr - self.snap.base) / self.c;
            let g = Growth::of(
                &self.snap,
                id.get(),
                start,
                reserved / self.c,
                np,
                self.total_pages(),
                self.cfg.no_implicit_moves,
            );
            growth = Some(g);
            (g.must_move(), np.saturating_sub(backed), np, false)
        };
        let r = self.arena.resize(id, new_size);
        self.resized = Some((id, old_size));
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
                let m = self.live.get_mut(&id).unwrap();
                m.size = new_size;
                m.small = small && (to_small || !needs_move);
                m.stamps.truncate(old_size.min(new_size));
                if new_size > old_size {
                    m.stamps.write(&self.arena, id, old_size, new_size);
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
                self.check("resize", &moved);
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

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Alloc(size) => self.alloc(size, size, false),
            Op::AllocGrowable(size, max) => self.alloc(size, max, true),
            Op::Free(i) => {
                let Some(id) = self.nth(i) else { return };
                self.arena.free(id).unwrap();
                self.live.remove(&id);
                self.freed.push(id);
                assert_eq!(self.arena.free(id), Err(Error::UnknownAllocation(id.get())), "double free refused");
                assert_eq!(self.arena.query(id).unwrap_err().status(), Status::UnknownAllocation);
                self.check("free", &[]);
            }
            Op::Resize(i, size) => {
                if let Some(id) = self.nth(i) {
                    self.resize(id, size);
                }
            }
            Op::Pin(i) | Op::Unpin(i) => {
                let Some(id) = self.nth(i) else { return };
                let pin = matches!(op, Op::Pin(_));
                if pin && self.live[&id].asleep {
                    assert_eq!(self.arena.pin(id), Err(Error::Asleep(id.get())), "pin of a sleeper");
                    return self.check("failed pin", &[]);
                }
                if pin { self.arena.pin(id) } else { self.arena.unpin(id) }.unwrap();
                self.live.get_mut(&id).unwrap().pinned = pin;
                assert_eq!(self.arena.query(id).unwrap().pinned, pin);
                self.check("pin", &[]);
            }
            Op::Compact => {
                let report = self.arena.compact().unwrap();
                count(if report.moved_allocations > 0 { "compact moved" } else { "compact idle" });
                assert_eq!(report.largest_free_va_before, self.snap.stats["largest_free_va_bytes"]);
                let moved = self.movable_ids();
                let before = self.moves;
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
                self.arena.release_retired().unwrap();
                self.check("release_retired", &[]);
                assert_eq!(self.snap.stats["retired_va_bytes"], 0);
                assert_eq!(self.snap.free_pages(), free_after, "retired ranges become free");
            }
            Op::Trim(keep) => {
                let pooled = self.snap.stats["pooled_bytes"];
                let releases = self.arena.stats().unwrap().driver_releases;
                let released = self.arena.trim(keep * self.c).unwrap();
                self.check("trim", &[]);
                let now = self.snap.stats["pooled_bytes"];
                // Slabs of retired objects only are pooled, but wait for the
                // release of retired memory.
                let idle_slabs = self.snap.slabs().filter(|r| r.used == 0).count() as u64;
                assert!(now <= (keep + idle_slabs) * self.c, "trim keeps at most keep_bytes pooled");
                assert!(released <= pooled, "trim gave back more than was pooled");
                let s = self.arena.stats().unwrap();
                assert_eq!((s.driver_releases - releases) * self.c, released, "trim reports what it released");
                assert!(released >= pooled - now.min(pooled), "trim released less than the pool shrank");
            }
            Op::Write(i) => {
                let Some(id) = self.nth(i) else { return };
                let seed = self.seed();
                let m = self.live.get_mut(&id).unwrap();
                if m.asleep {
                    assert_eq!(self.arena.write(id, 0, b"x"), Err(Error::Asleep(id.get())), "write to a sleeper");
                    return self.check("failed write", &[]);
                }
                m.stamps = Stamps { seed, marks: vec![] };
                m.stamps.write(&self.arena, id, 0, m.size);
                self.check("write", &[]);
            }
            Op::BadId(i) => {
                let bad = match self.freed.get(i % self.freed.len().max(1)) {
                    Some(&id) => id,
                    // Made-up ids: a plain one, and one tagged as a small allocation's.
                    None if i % 2 == 0 => Id::from_raw(0xdead_0000_0001 + i as u64 % 7).unwrap(),
                    None => Id::from_raw((1 << 63) | (0x0bad_0000_0001 + i as u64 % 7)).unwrap(),
                };
                if self.live.contains_key(&bad) {
                    return;
                }
                for e in [
                    self.arena.free(bad).unwrap_err(),
                    self.arena.resize(bad, 1).unwrap_err(),
                    self.arena.pin(bad).unwrap_err(),
                    self.arena.query(bad).unwrap_err(),
                    self.arena.write(bad, 0, b"x").unwrap_err(),
                ] {
                    assert_eq!(e, Error::UnknownAllocation(bad.get()));
                }
                self.check("bad id", &[]);
            }
            Op::SetTag(i, tag) => {
                let Some(id) = self.nth(i) else { return };
                let m = self.live.get_mut(&id).unwrap();
                match self.arena.set_tag(id, tag) {
                    Ok(()) => {
                        assert!(!m.small, "a small allocation took a tag");
                        m.tag = tag;
                    }
                    Err(e) => assert!(m.small && e.status() == Status::InvalidArgument, "set_tag: {e}"),
                }
                assert_eq!(self.arena.query(id).unwrap().tag, m.tag);
                self.check("set_tag", &[]);
            }
            Op::Sleep(t, backup) => {
                let tag = tag_arg(t);
                self.arena.sleep(tag, if backup { SLEEP_BACKUP } else { 0 }).unwrap();
                let mut slept = 0;
                for m in self.live.values_mut() {
                    if !m.small && !m.asleep && (tag == ALL_TAGS || m.tag == tag) {
                        m.asleep = true;
                        slept += 1;
                        if !backup {
                            m.stamps.marks.clear(); // contents lost
                        }
                    }
                }
                count(if slept > 0 { "sleep" } else { "sleep idle" });
                self.check("sleep", &[]);
                let s = &self.snap.stats;
                assert_eq!((s["pooled_bytes"], s["retired_va_bytes"]), (0, 0), "sleep gives back what is pooled");
            }
            Op::Wake(t) => {
                let tag = tag_arg(t);
                let selected = |m: &Model| m.asleep && (tag == ALL_TAGS || m.tag == tag);
                let needed: u64 = self.live.values().filter(|m| selected(m)).map(|m| self.pages(m.size)).sum();
                let obtainable = self.obtainable();
                // Chunks of slabs holding only retired objects come back only
                // when retired memory is released, which wake does not do.
                let idle_slabs = self.snap.slabs().filter(|r| r.used == 0).count() as u64;
                match self.arena.wake(tag) {
                    Ok(()) => {
                        count(if needed > 0 { "wake" } else { "wake idle" });
                        assert!(needed <= obtainable, "woke {needed} pages beyond the capacity");
                        for m in self.live.values_mut().filter(|m| selected(m)) {
                            m.asleep = false;
                        }
                        self.check("wake", &[]);
                    }
                    Err(e) => {
                        count("wake out of memory");
                        assert_eq!(e.status(), Status::OutOfMemory, "{e}");
                        assert!(needed > obtainable - idle_slabs, "OutOfMemory waking {needed} of {obtainable}: {e}");
                        self.check("failed wake", &[]);
                    }
                }
            }
        }
    }

    /// Checks every invariant after an operation. `may_move` are the ids
    /// that were allowed to move during it.
    fn check(&mut self, what: &str, may_move: &[Id]) {
        let snap = Snap::of(&self.arena);
        snap.check_structure(self.arena.va_range());
        let s = &snap.stats;
        assert_eq!(s["chunk_bytes"], self.c);
        assert_eq!(s["capacity_bytes"], self.cfg.cap_pages * self.c);
        assert_eq!(s["live_allocations"], self.live.len() as u64, "{what}: live_allocations");
        assert_eq!(s["live_bytes"], self.live.values().map(|m| m.size).sum::<u64>(), "{what}: live_bytes");
        let chunk_pages: u64 = self.live.values().filter(|m| !m.small && !m.asleep).map(|m| self.pages(m.size)).sum();
        let idle_slabs = snap.slabs().filter(|r| r.used == 0).count() as u64;
        assert_eq!(s["mapped_bytes"], (chunk_pages + s["small_slabs"] - idle_slabs) * self.c, "{what}: mapped_bytes");
        assert_eq!(
            snap.slabs().map(|r| r.used).sum::<u64>(),
            self.live.values().filter(|m| m.small).count() as u64,
            "{what}: objects in slabs"
        );
        assert!(s["peak_physical_bytes"] >= self.snap.stats["peak_physical_bytes"], "{what}: the peak went down");
        if let Some(r) = self.cfg.retain_pages {
            // Slabs of retired objects wait for the release of retired memory.
            assert!(s["pooled_bytes"] <= (r + idle_slabs) * self.c, "{what}: pooled memory above the retain watermark");
        }
        let (chunks, mappings) = self.probe.live();
        assert_eq!(
            chunks as u64,
            (s["mapped_bytes"] + s["pooled_bytes"]) / self.c,
            "{what}: driver chunks vs held memory"
        );
        assert_eq!(mappings as u64, snap.mapped_pages(), "{what}: driver mappings vs mapped pages");
        let stats = self.arena.stats().unwrap();
        assert_eq!(stats.mapped_bytes, s["mapped_bytes"]);
        assert_eq!(stats.pooled_bytes, s["pooled_bytes"]);
        assert_eq!(stats.free_va_bytes, s["free_va_bytes"]);

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
        let by_id = snap.live_by_id();
        let mut small_extents = Vec::new();
        for (&id, m) in self.live.iter_mut() {
            let info = self.arena.query(id).unwrap();
            assert_eq!((info.size, info.pinned, info.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
            assert_eq!((info.tag, info.asleep), (m.tag, m.asleep), "{what}: {id}");
            match by_id.get(&id.get()) {
                Some(r) => {
                    assert!(!m.small, "{what}: small {id} has chunks of its own");
                    assert_eq!((info.ptr, info.reserved_bytes, info.mapped_bytes), (r.addr, r.bytes, r.mapped_bytes));
                    assert_eq!((r.size, r.pinned, r.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
                }
                None => {
                    assert!(m.small, "{what}: live {id} missing from the snapshot");
                    let slab =
                        snap.slab_at(info.ptr).unwrap_or_else(|| panic!("{what}: small {id} outside every slab"));
                    assert_eq!(info.reserved_bytes, slab.class_bytes, "{what}: small {id} reserves its class");
                    assert!(info.size <= slab.class_bytes);
                    assert_eq!(
                        (info.ptr - slab.addr) % slab.class_bytes,
                        0,
                        "{what}: small {id} on an object boundary"
                    );
                    assert!(!m.pinned || slab.pinned, "{what}: the slab of a pinned object is pinned");
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
            if self.backend == Backend::Host {
                // SAFETY: host backend; `m.ptr` is the allocation's current
                // address (queried just now), every stamp lies below its
                // size, and this thread is the arena's only user.
                unsafe { m.stamps.verify_raw(m.ptr, what) };
            }
        }
        let pinned_slabs: Vec<u64> = self
            .live
            .values()
            .filter(|m| m.small && m.pinned)
            .filter_map(|m| snap.slab_at(m.ptr).map(|r| r.addr))
            .collect();
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
}

impl Harness {
    /// Old addresses of moved allocations stay readable, with the bytes
    /// they had, until the arena releases retired memory — which only the
    /// operations that need address space (and `release_retired`) may do.
    fn check_old_addresses(&mut self, what: &str, snap: &Snap, events: &[MoveEvent]) {
        for e in events {
            let Some(m) = self.live.get(&e.id) else { continue };
            // Moves by remapping only: a small object's copy leaves a
            // retired object, not an alias, and slabs' objects churn.
            if m.small || e.old_ptr % self.c != 0 || !snap.retired_covers(e.old_ptr, self.c) {
                continue;
            }
            let len = match self.resized {
                Some((id, old)) if id == e.id => old.min(e.size),
                _ => e.size,
            };
            self.views.push((e.id, e.old_ptr, len));
        }
        let may_release = matches!(what, "alloc" | "resize" | "compact" | "release_retired" | "sleep" | "teardown");
        let mut kept = Vec::new();
        for (id, old_ptr, len) in std::mem::take(&mut self.views) {
            let Some(m) = self.live.get(&id) else { continue };
            // Bytes beyond a shrink are no longer the allocation's, anywhere.
            let len = len.min(m.size);
            if !snap.retired_covers(old_ptr, self.pages(len) * self.c) {
                assert!(may_release, "{what}: released the old range {old_ptr:#x} of live {id}");
                continue;
            }
            if self.backend == Backend::Host {
                // SAFETY: host backend; the pages below `len` at `old_ptr` are
                // in retired ranges (checked just above), which stay mapped,
                // and this thread is the arena's only user.
                unsafe { m.stamps.verify_raw_below(old_ptr, len, &format!("{what}: old address of {id}")) };
            }
            kept.push((id, old_ptr, len));
        }
        self.views = kept;
    }
}

fn run(backend: Backend, cfg: Config, ops: Vec<Op>) {
    let mut h = Harness::new(backend, cfg);
    for op in &ops {
        h.apply(op);
    }
    // Tear down: free everything, trim; the arena is empty again.
    let ids: Vec<Id> = h.live.keys().copied().collect();
    for id in ids {
        h.arena.free(id).unwrap();
        h.live.remove(&id);
    }
    h.arena.release_retired().unwrap();
    h.arena.trim(0).unwrap();
    h.check("teardown", &[]);
    let s = h.arena.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.free_va_bytes), (0, 0, h.cfg.reserve_pages * h.c));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn host_backend_matches_the_model(cfg in config(), ops in prop::collection::vec(op(C), 1..80)) {
        run(Backend::Host, cfg, ops);
    }

    #[test]
    fn mock_backend_matches_the_model(cfg in config(), ops in prop::collection::vec(op(C), 1..80)) {
        run(Backend::Mock, cfg, ops);
    }
}

/// The model on device 0, with 2 MiB chunks: arenas of 16 to 48 of them
/// (at most 96 MiB), fewer cases than on the host (each costs thousands of
/// `cuMemcpy` calls); `PROPTEST_CASES` overrides the count here too. Runs
/// only with `VMM_ARENA_TEST_BACKEND=cuda`.
#[test]
fn cuda_backend_matches_the_model() {
    if !common::cuda_selected("cuda_backend_matches_the_model") {
        return;
    }
    // Once, here: a missing GPU fails the test plainly, not as a case to shrink.
    common::cuda_device();
    proptest!(
        ProptestConfig { cases: 16, ..ProptestConfig::default() },
        |(cfg in config(), ops in prop::collection::vec(op(CUDA_CHUNK), 1..80))| {
            run(Backend::Cuda, cfg, ops);
        }
    );
    // Alone in the process (filtered by name), the counters are CUDA's only.
    report(Backend::Cuda);
}

#[test]
fn outcomes_are_reached() {
    // A fixed-seed search that checks the generator reaches every
    // interesting path (counters are shared with the property tests when
    // they run in the same process, which only adds to them).
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (config(), prop::collection::vec(op(C), 40..80));
    for _ in 0..64 {
        let (cfg, ops) = strategy.new_tree(&mut runner).unwrap().current();
        run(Backend::Mock, cfg, ops);
    }
    report(Backend::Mock);
    let seen = OUTCOMES.lock().unwrap();
    for what in [
        "alloc ok, after moving others",
        "alloc out of address space",
        "alloc out of memory",
        "compact moved",
        "resize by moving",
        "resize small by copying",
        "alloc small ok",
        "resize in place",
        "resize pinned",
        "resize out of address space",
    ] {
        assert!(seen.get(what).copied().unwrap_or(0) > 0, "the search never reached: {what}");
    }
}

// ------------------------------------------------------------------------
// Regressions: bugs the property test found, as fixed scenarios.

fn arena(cap_pages: u64, reserve_pages: u64, no_implicit_moves: bool) -> (Arena, Arc<HostDriver>) {
    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: cap_pages * C,
        reserve_bytes: reserve_pages * C,
        chunk_bytes: C,
        no_implicit_moves,
        ..ArenaConfig::default()
    };
    (Arena::with_driver(d.clone(), cfg).unwrap(), d)
}

/// `trim` released chunks that were still mapped at a moved allocation's
/// retired (old) range: the memory did not go back, and a later rollback
/// that had to map the retired range again failed, losing a mapping.
#[test]
fn regression_trim_releases_retired_ranges_that_hold_its_chunks() {
    let (a, d) = arena(8, 8, true);
    let (x, _) = a.alloc_growable(C, C).unwrap();
    let (_y, _) = a.alloc(C).unwrap();
    a.write(x, 0, b"x").unwrap();
    a.resize(x, 2 * C).unwrap(); // moves: page 0 is retired, still mapping x's chunk
    assert_eq!(a.stats().unwrap().retired_va_bytes, C);
    a.free(x).unwrap();
    assert_eq!(a.trim(0).unwrap(), 2 * C);
    let s = a.stats().unwrap();
    assert_eq!((s.retired_va_bytes, s.pooled_bytes), (0, 0), "the retired range went with the chunks");
    assert_eq!(d.allocated_file_bytes().unwrap(), C, "only y's memory is still held");
    assert_eq!((d.live_chunks(), d.live_mappings()), (1, 1));
    // The failing sequence: an alloc that releases retired ranges, then fails
    // and rolls back, must leave the arena consistent.
    let (z, _) = a.alloc_growable(C, C).unwrap();
    a.resize(z, 2 * C).unwrap(); // z moves, its old page is retired
    a.free(z).unwrap();
    a.trim(0).unwrap();
    assert_eq!(a.alloc(7 * C).unwrap_err().status(), Status::OutOfAddressSpace);
    a.release_retired().unwrap();
    let snap = Snap::of(&a);
    snap.check_structure(a.va_range());
    assert_eq!(d.live_mappings() as u64, snap.mapped_pages());
}

/// An allocation whose new reservation held pooled chunks beyond its
/// backed size failed with out-of-memory when the capacity was otherwise
/// used up, though those chunks were obtainable.
#[test]
fn regression_alloc_uses_pooled_chunks_inside_its_own_reservation() {
    let (a, d) = arena(5, 12, false);
    let (x, _) = a.alloc_growable(C, C).unwrap(); // page 0
    let (b, _) = a.alloc(2 * C).unwrap(); // pages 1..3
    let (_c, _) = a.alloc(C).unwrap(); // page 3
    a.resize(x, 2 * C).unwrap(); // x moves to 4..6; page 0 retired
    a.free(b).unwrap(); // pages 1, 2 cached
    a.release_retired().unwrap(); // free [0, 3): page 0 unmapped, 1 and 2 cached
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.capacity_bytes), (3 * C, 2 * C, 5 * C));
    // Best fit puts the reservation of 3 pages at [0, 3): page 0 needs a
    // chunk, and the only ones left are cached in its own tail.
    let (g, ptr) = a.alloc_growable(C, 3 * C).unwrap();
    assert_eq!(ptr, a.va_range().0);
    a.write(g, 0, b"g").unwrap();
    assert_eq!(a.resize(g, 2 * C).unwrap(), ptr);
    assert_eq!(a.stats().unwrap().mapped_bytes, 5 * C);
    assert_eq!(d.live_chunks(), 5);
}

/// Compaction moved an allocation boxed in by pinned neighbours into the
/// largest hole, making the largest free range smaller.
#[test]
fn regression_compaction_never_shrinks_the_largest_free_range() {
    let (a, _d) = arena(8, 8, false);
    let (big, _) = a.alloc(5 * C).unwrap();
    let (p1, _) = a.alloc(C).unwrap();
    let (x, px) = a.alloc(C).unwrap();
    let (p2, _) = a.alloc(C).unwrap();
    a.pin(p1).unwrap();
    a.pin(p2).unwrap();
    a.free(big).unwrap();
    let r = a.compact().unwrap();
    assert!(r.largest_free_va_after >= r.largest_free_va_before, "{r:?}");
    assert_eq!((r.moved_allocations, a.query(x).unwrap().ptr), (0, px), "moving x would only fragment");
    // With p1 unpinned, p1 and x slide down and the free space becomes one range.
    a.unpin(p1).unwrap();
    let r = a.compact().unwrap();
    assert_eq!(r.moved_allocations, 2, "{r:?}");
    assert_eq!(r.largest_free_va_after, a.stats().unwrap().free_va_bytes, "{r:?}");
}

/// A small allocation resized out of its slab emptied the slab, whose chunk
/// then stayed pooled above the `retain_bytes` watermark (a free applies it,
/// that resize did not; since small objects are retired when they move, it
/// is the release of retired memory that empties the slab, and it must
/// apply the watermark too).
#[test]
fn regression_resize_out_of_a_slab_applies_the_watermark() {
    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: 8 * C,
        reserve_bytes: 8 * C,
        chunk_bytes: C,
        retain_bytes: 0,
        ..ArenaConfig::default()
    };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let (x, _) = a.alloc(300).unwrap();
    a.write(x, 0, b"small").unwrap();
    a.resize(x, 3 * C).unwrap(); // beyond every class: promoted to chunks, by copying
    let mut out = [0u8; 5];
    a.read(x, 0, &mut out).unwrap();
    assert_eq!(&out, b"small");
    // The old place is retired (a kernel may still use it) and holds its
    // slab until retired memory is released; then the slab goes back.
    a.release_retired().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.small_slabs, s.mapped_bytes, s.pooled_bytes), (0, 3 * C, 0), "the empty slab went back");
    assert_eq!(d.live_chunks(), 3);
}

// `regression_trim_counts_what_releasing_retired_ranges_adds_to_the_pool`
// lived here: its `trim` released retired small objects of a live
// allocation. That contract changed (issue 16): see
// `tests/contract_regressions.rs`, `trim_gives_back_at_most_what_was_pooled`.

/// A slab holding only retired small objects (old places of copy-resized
/// ones) kept its chunk from an alloc that needed it: out of memory while
/// releasing retired memory, as the arena does for address space, would
/// have covered the request.
#[test]
fn regression_alloc_reclaims_slabs_of_retired_small_objects() {
    let (a, d) = arena(3, 8, false);
    let (x, _) = a.alloc(100).unwrap(); // slab 1
    a.write(x, 0, b"x").unwrap();
    a.resize(x, C / 4).unwrap(); // copied into slab 2; slab 1 holds only x's retired old place
    let (g, pg) = a.alloc_growable(C / 2 + 1, 2 * C).unwrap(); // the third chunk
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (2 * C, C), "slab 1 backs nothing live: pooled");
    // Growth needs slab 1's chunk back.
    assert_eq!(a.resize(g, C + 1).unwrap(), pg);
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.retired_va_bytes, s.small_slabs), (3 * C, 0, 1));
    // So does an alloc.
    a.free(g).unwrap(); // two chunks pooled
    a.resize(x, C / 2).unwrap(); // copied into slab 3; slab 2 holds only a retired object
    let (y, _) = a.alloc(3 * C / 2).unwrap(); // the pooled chunk and slab 2's
    a.write(y, 0, b"y").unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.retired_va_bytes, s.small_slabs), (3 * C, 0, 1));
    let mut out = [0u8; 1];
    a.read(x, 0, &mut out).unwrap();
    assert_eq!(&out, b"x");
    assert_eq!(d.live_chunks() as u64, (s.mapped_bytes + s.pooled_bytes) / C);
}
