//! Fuzz target logic: operation sequences against a model.
//!
//! The input bytes decode (see [`decode`]) into an arena configuration and
//! a sequence of every public operation, some of them with a driver failure
//! injected (the `n`th driver call of the operation fails with out of memory
//! or a driver error). The arena runs on the in-memory [`MockDriver`] under a
//! [`FaultDriver`], and after every operation the checks of the core's
//! property test (`tests/model.rs`) apply:
//! - the snapshot's ranges tile the reserved range and agree with the stats
//!   and with the model (live allocations and bytes, mapped bytes as whole
//!   chunks of each size, slabs, pooled memory under the watermark);
//! - the driver holds exactly the chunks and mappings the arena accounts for;
//! - every live allocation's stamped bytes survive resizes, moves,
//!   compactions and failed calls;
//! - out of memory only when the capacity cannot cover the request,
//!   out of address space only when no window can be evacuated (or, without
//!   implicit moves, no free range fits);
//! - pinned and sleeping allocations never move, and nothing moves
//!   implicitly when implicit moves are off; move events chain every
//!   address change;
//! - `sleep` puts exactly the awake allocations of whole chunks with the
//!   tag to sleep and gives every pooled chunk back; `wake` restores their
//!   stamps when they slept with a backup; resize, pin and write of a
//!   sleeper are `Asleep`; wake's out of memory only when the capacity
//!   cannot cover the sleepers;
//! - an operation whose injected failure fired returns that failure and
//!   leaves the arena exactly as it was (`trim`: as documented, what was
//!   released stays released; a free, shrink or sleep whose give-back
//!   failed succeeds, keeps that chunk pooled and counts the failure).
//!
//! At the end everything is freed and trimmed: the driver holds nothing.
//!
//! This file is the body of the cargo-fuzz target `fuzz/fuzz_targets/ops.rs`
//! and of the stable replay test `tests/fuzz_replay.rs` (both include it
//! with `#[path]`), so the committed corpus runs in `cargo test`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, Error, Id, MoveEvent, Status, ALL_TAGS, SLEEP_BACKUP};

#[path = "bytes.rs"]
mod bytes;
#[path = "../../tests/common/mod.rs"]
mod common;

use bytes::Bytes;
use common::{evacuation_exists, Growth, Snap, Stamps};

const C: u64 = 64 << 10;
/// The largest small allocation with 64 KiB chunks (half a chunk).
const SMALL_MAX: u64 = C / 2;
/// Operations per input at most (longer inputs are cut).
pub const MAX_OPS: usize = 96;

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
    Free(usize),
    Resize(usize, u64),
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

/// A size of 1..=`max_pages` chunks, not chunk-aligned in general.
fn size(b: &mut Bytes<'_>, max_pages: u64) -> u64 {
    let p = 1 + b.below(max_pages);
    let tail = if b.below(4) == 0 { C } else { 1 + b.below(C) };
    (p - 1) * C + tail
}

fn op(b: &mut Bytes<'_>, faults: bool) -> Op {
    match b.below(if faults { 45 } else { 41 }) {
        0..=5 => Op::Alloc(size(b, 8)),
        6..=9 => Op::Alloc(1 + b.below(SMALL_MAX)),
        10 => Op::Alloc(size(b, 40)),
        11..=14 => {
            let s = size(b, 6);
            Op::AllocGrowable(s, s + b.below(13) * C)
        }
        15..=19 => Op::Free(b.u16() as usize),
        20..=25 => Op::Resize(b.u16() as usize, size(b, 16)),
        26..=28 => Op::Resize(b.u16() as usize, 1 + b.below(SMALL_MAX)),
        29 => Op::Resize(b.u16() as usize, size(b, 40)),
        30 => Op::Pin(b.u16() as usize),
        31 => Op::Unpin(b.u16() as usize),
        32 => Op::Compact,
        33 => Op::ReleaseRetired,
        34 => Op::Trim(b.below(8)),
        35 => match b.below(3) {
            0 => Op::BadId(b.u64()),
            _ => Op::Write(b.u16() as usize),
        },
        36 | 37 => Op::SetTag(b.u16() as usize, b.below(3) as u32),
        38 => Op::Sleep(b.below(4) as u32, b.bool()),
        39 | 40 => Op::Wake(b.below(4) as u32),
        _ => {
            let n = 1 + b.below(12);
            let kind = FaultKind::ALL[b.below(2) as usize];
            Op::Faulty(n, kind, Box::new(op(b, false)))
        }
    }
}

/// Decodes an input: a configuration, then operations until the bytes run out.
pub fn decode(data: &[u8]) -> (Config, Vec<Op>) {
    let mut b = Bytes::new(data);
    let cap = 4 + b.below(45);
    let lo = (cap * 3 / 4).max(1);
    let reserve = if b.below(4) == 0 { cap * 2 } else { lo + b.below(cap * 2 - lo + 1) };
    let retain = [None, Some(0), Some(1), Some(4)][b.below(4) as usize];
    let nim = b.below(5) == 0;
    let cfg = Config { cap_pages: cap, reserve_pages: reserve, retain_pages: retain, no_implicit_moves: nim };
    let mut ops = Vec::new();
    while !b.is_empty() && ops.len() < MAX_OPS {
        ops.push(op(&mut b, true));
    }
    (cfg, ops)
}

/// Outcome counters, for the replay test's report of what the corpus reaches.
pub static OUTCOMES: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn count(what: &'static str) {
    *OUTCOMES.lock().unwrap_or_else(|p| p.into_inner()).entry(what).or_default() += 1;
}

/// What the model knows about one allocation.
#[derive(Debug)]
struct Model {
    size: u64,
    growable: bool,
    pinned: bool,
    /// Packed in a slab.
    small: bool,
    ptr: u64,
    /// Its reservation, or its size class if small.
    reserved: u64,
    stamps: Stamps,
    tag: u32,
    /// Asleep (its stamps kept only if it slept with a backup).
    asleep: bool,
}

/// The model's tags: 0..=2, and 3 for `ALL_TAGS`.
fn tag_arg(t: u32) -> u32 {
    if t == 3 {
        ALL_TAGS
    } else {
        t
    }
}

fn pages(bytes: u64) -> u64 {
    bytes.div_ceil(C)
}

fn status_of(kind: FaultKind) -> Status {
    match kind {
        FaultKind::OutOfMemory => Status::OutOfMemory,
        FaultKind::Driver => Status::Driver,
    }
}

type Fd = Arc<FaultDriver<MockDriver>>;

struct Harness {
    arena: Arena,
    fd: Fd,
    cfg: Config,
    events: Arc<Mutex<Vec<MoveEvent>>>,
    live: BTreeMap<Id, Model>,
    freed: Vec<Id>,
    next_seed: u64,
    snap: Snap,
    moves: u64,
    /// The allocation being resized and its old size, during a resize.
    resized: Option<(Id, u64)>,
    /// A failure to plan before the next driver-calling operation.
    fault: Option<(u64, FaultKind)>,
    /// The last successful operation's give-back failed: pooled memory may
    /// exceed the watermark until an operation succeeds without that.
    watermark_failed: bool,
    /// The current operation's give-back failed (an injected failure absorbed).
    absorbed_now: bool,
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
    fn new(cfg: Config) -> Harness {
        let ac = ArenaConfig {
            capacity_bytes: cfg.cap_pages * C,
            reserve_bytes: cfg.reserve_pages * C,
            chunk_bytes: C,
            retain_bytes: cfg.retain_pages.map_or(u64::MAX, |p| p * C),
            no_implicit_moves: cfg.no_implicit_moves,
            ..ArenaConfig::default()
        };
        let fd: Fd = Arc::new(FaultDriver::new(MockDriver::new(4096, 1 << 40)));
        let arena = Arena::with_driver(fd.clone(), ac).expect("arena");
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        arena.set_move_callback(Some(Box::new(move |e: &MoveEvent| sink.lock().unwrap().push(*e)))).unwrap();
        let snap = Snap::of(&arena);
        let mut h = Harness {
            arena,
            fd,
            cfg,
            events,
            live: BTreeMap::new(),
            freed: Vec::new(),
            next_seed: 1,
            snap,
            moves: 0,
            resized: None,
            fault: None,
            watermark_failed: false,
            absorbed_now: false,
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

    /// Chunks a request may still obtain (see tests/model.rs).
    fn obtainable(&self) -> u64 {
        // Slabs of retired objects only count as pooled: reclaimable.
        self.cfg.cap_pages - self.snap.stats["mapped_bytes"] / C
    }

    /// An operation that applies the retain watermark succeeded: the
    /// watermark holds again, unless its own give-back failed.
    fn ran_ok(&mut self) {
        self.watermark_failed = std::mem::take(&mut self.absorbed_now);
    }

    fn movable_ids(&self) -> Vec<Id> {
        self.live.iter().filter(|(_, m)| !m.pinned && !m.asleep).map(|(&id, _)| id).collect()
    }

    /// Whether an out-of-address-space for `n` pages is justified.
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
                // without failing the call.
                count("fault absorbed (give-back kept pooled)");
                let failures = self.arena.stats().unwrap().release_failures;
                assert_eq!(failures, failures0 + 1, "{what}: a fault that fired without failing the call is counted");
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
                        s.live().map(|r| common::Range { pooled_mapped_bytes: 0, ..r.clone() }).collect::<Vec<_>>()
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
        let small = !growable && size <= SMALL_MAX;
        let (np, nr) = if small { (1, 1) } else { (pages(size), pages(max)) };
        let obtainable = self.obtainable();
        let (r, f) = self.call("alloc", false, |a| if growable { a.alloc_growable(size, max) } else { a.alloc(size) });
        if let Faulted::RolledBack = f {
            return;
        }
        match r {
            Ok((id, ptr)) => {
                count(if small { "alloc small ok" } else { "alloc ok" });
                assert!(np <= obtainable || small, "alloc of {np} pages succeeded beyond the capacity");
                assert_eq!(ptr % if small { 256 } else { C }, 0, "alignment of {size} bytes at {ptr:#x}");
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
                let moved = if self.cfg.no_implicit_moves { vec![] } else { self.movable_ids() };
                self.ran_ok();
                self.check("alloc", &moved);
            }
            Err(e) => {
                match e.status() {
                    Status::OutOfMemory => {
                        count("alloc out of memory");
                        assert!(np > obtainable, "OutOfMemory for {np} pages while {obtainable} are obtainable: {e}")
                    }
                    Status::OutOfAddressSpace => {
                        count("alloc out of address space");
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

    fn resize(&mut self, id: Id, new_size: u64) {
        let m = &self.live[&id];
        if m.asleep {
            // Refused before any driver call: a planned failure cannot fire.
            assert_eq!(self.arena.resize(id, new_size), Err(Error::Asleep(id.get())), "resize of a sleeper");
            count("resize asleep");
            return self.check("failed resize", &[]);
        }
        let (old_size, old_ptr, reserved, pinned, growable, small) =
            (m.size, m.ptr, m.reserved, m.pinned, m.growable, m.small);
        let obtainable = self.obtainable();
        let mut growth: Option<Growth> = None;
        let (needs_move, need_pages, window, to_small) = if small {
            let needs_move = new_size > reserved;
            let to_small = new_size <= SMALL_MAX;
            let need = match (needs_move, to_small) {
                (false, _) => 0,
                (true, true) => 1,
                (true, false) => pages(new_size),
            };
            (needs_move, need, if to_small { 1 } else { pages(new_size) }, to_small)
        } else {
            let (backed, np) = (pages(old_size), pages(new_size));
            let start = (old_ptr - self.snap.base) / C;
            let g = Growth::of(
                &self.snap,
                id.get(),
                start,
                reserved / C,
                np,
                self.cfg.reserve_pages,
                self.cfg.no_implicit_moves,
            );
            growth = Some(g);
            (g.must_move(), np.saturating_sub(backed), np, false)
        };
        self.resized = Some((id, old_size));
        let (r, f) = self.call("resize", false, |a| a.resize(id, new_size));
        if let Faulted::RolledBack = f {
            self.resized = None;
            return;
        }
        match r {
            Ok(ptr) => {
                count(if needs_move { "resize by moving" } else { "resize in place" });
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
                self.ran_ok();
                self.check("resize", &moved);
            }
            Err(e) => {
                match e.status() {
                    Status::Pinned => {
                        count("resize pinned");
                        assert!(pinned && needs_move, "Pinned error though no move was needed: {e}")
                    }
                    Status::OutOfMemory => {
                        count("resize out of memory");
                        let undecided = growth.is_some_and(|g| g.undecided);
                        assert!(!(pinned && needs_move) || undecided, "must be Pinned first");
                        assert!(need_pages > obtainable, "OutOfMemory though capacity covers it: {e}")
                    }
                    Status::OutOfAddressSpace => {
                        count("resize out of address space");
                        assert!(needs_move && !pinned && need_pages <= obtainable, "unexpected {e:?}");
                        let me = id.get();
                        assert!(
                            self.oas_justified(window, |other, pinned| pinned || (other == me && !small)),
                            "OutOfAddressSpace growing to {window} pages though a window can be evacuated: {e}"
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
        match op {
            Op::Faulty(n, kind, inner) => {
                // Operations without driver calls run as they are.
                if matches!(
                    **inner,
                    Op::Pin(_) | Op::Unpin(_) | Op::Write(_) | Op::BadId(_) | Op::SetTag(..) | Op::Faulty(..)
                ) {
                    return self.apply(inner);
                }
                self.fault = Some((*n, *kind));
                self.apply(inner);
                self.fault = None;
            }
            &Op::Alloc(size) => self.alloc(size, size, false),
            &Op::AllocGrowable(size, max) => self.alloc(size, max, true),
            &Op::Free(i) => {
                let Some(id) = self.nth(i) else { return };
                let (r, f) = self.call("free", false, |a| a.free(id));
                if let Faulted::RolledBack = f {
                    panic!("free failed with an injected failure: its give-back is best effort");
                }
                r.unwrap();
                let m = self.live.remove(&id).expect("live");
                count(if m.asleep { "free asleep" } else { "free" });
                self.freed.push(id);
                assert_eq!(self.arena.free(id), Err(Error::UnknownAllocation(id.get())), "double free refused");
                assert_eq!(self.arena.query(id).unwrap_err().status(), Status::UnknownAllocation);
                self.ran_ok();
                self.check("free", &[]);
            }
            &Op::Resize(i, size) => {
                if let Some(id) = self.nth(i) {
                    self.resize(id, size);
                }
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
                assert_eq!(self.moves - before, report.moved_allocations, "report counts every move, as events");
                assert_eq!(report.largest_free_va_after, self.snap.stats["largest_free_va_bytes"]);
                assert_eq!(self.snap.stats["retired_va_bytes"], 0, "compact releases the old ranges");
                assert!(report.largest_free_va_after >= report.largest_free_va_before, "{report:?}");
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
                let pooled = self.snap.stats["pooled_bytes"];
                let releases = self.arena.stats().unwrap().driver_releases;
                let (r, f) = self.call("trim", true, |a| a.trim(keep * C));
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
                assert!(now <= (keep + idle_slabs) * C, "trim keeps at most keep_bytes pooled");
                assert!(released <= pooled, "trim gave back more than was pooled");
                let s = self.arena.stats().unwrap();
                assert_eq!((s.driver_releases - releases) * C, released, "trim reports what it released");
                assert!(released >= pooled - now.min(pooled), "trim released less than the pool shrank");
            }
            &Op::Write(i) => {
                let Some(id) = self.nth(i) else { return };
                let seed = self.seed();
                let m = self.live.get_mut(&id).unwrap();
                if m.asleep {
                    assert_eq!(self.arena.write(id, 0, b"x"), Err(Error::Asleep(id.get())), "write to a sleeper");
                    let mut out = [0u8; 1];
                    assert_eq!(self.arena.read(id, 0, &mut out), Err(Error::Asleep(id.get())), "read of a sleeper");
                    count("write asleep");
                    return self.check("failed write", &[]);
                }
                m.stamps = Stamps { seed, marks: vec![] };
                m.stamps.write(&self.arena, id, 0, m.size);
                self.check("write", &[]);
            }
            &Op::BadId(raw) => {
                let bad = match (raw % 3, self.freed.is_empty()) {
                    (0, false) => self.freed[(raw / 3) as usize % self.freed.len()],
                    _ => match Id::from_raw(raw) {
                        Some(id) => id,
                        None => return,
                    },
                };
                if self.live.contains_key(&bad) {
                    return;
                }
                count("bad id refused");
                for e in [
                    self.arena.free(bad).unwrap_err(),
                    self.arena.resize(bad, 1).unwrap_err(),
                    self.arena.pin(bad).unwrap_err(),
                    self.arena.query(bad).unwrap_err(),
                    self.arena.write(bad, 0, b"x").unwrap_err(),
                    self.arena.set_tag(bad, 1).unwrap_err(),
                ] {
                    assert_eq!(e, Error::UnknownAllocation(bad.get()));
                }
                self.check("bad id", &[]);
            }
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

    fn sleep(&mut self, tag: u32, backup: bool) {
        let (r, f) = self.call("sleep", false, |a| a.sleep(tag, if backup { SLEEP_BACKUP } else { 0 }));
        if let Faulted::RolledBack = f {
            return count("sleep rolled back after a fault");
        }
        r.unwrap();
        if self.absorbed_now {
            count("sleep kept a chunk whose release failed");
        }
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
        count(match (slept > 0, backup) {
            (false, _) => "sleep idle",
            (true, false) => "sleep",
            (true, true) => "sleep with backup",
        });
        let kept = self.absorbed_now;
        self.ran_ok();
        self.check("sleep", &[]);
        // Every pooled chunk goes back, but one whose release failed (which
        // the retain watermark, applied after the operation, may give back).
        let s = &self.snap.stats;
        assert!(s["pooled_bytes"] <= if kept { C } else { 0 }, "sleep gives back what is pooled");
        assert_eq!(s["retired_va_bytes"], 0, "sleep releases the retired ranges");
    }

    fn wake(&mut self, tag: u32) {
        let selected = |m: &Model| m.asleep && (tag == ALL_TAGS || m.tag == tag);
        let needed: u64 = self.live.values().filter(|m| selected(m)).map(|m| pages(m.size)).sum();
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
                count(if needed > 0 { "wake" } else { "wake idle" });
                assert!(needed <= obtainable, "woke {needed} pages beyond the capacity");
                for m in self.live.values_mut().filter(|m| selected(m)) {
                    m.asleep = false;
                }
                self.ran_ok();
                // check() verifies the woken stamps (kept only with a backup).
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
    fn check(&mut self, what: &str, may_move: &[Id]) {
        let snap = Snap::of(&self.arena);
        snap.check_structure(self.arena.va_range());
        let s = &snap.stats;
        assert_eq!(s["chunk_bytes"], C);
        assert_eq!(s["capacity_bytes"], self.cfg.cap_pages * C);
        assert_eq!(s["live_allocations"], self.live.len() as u64, "{what}: live_allocations");
        assert_eq!(s["live_bytes"], self.live.values().map(|m| m.size).sum::<u64>(), "{what}: live_bytes");
        let chunk_pages: u64 = self.live.values().filter(|m| !m.small && !m.asleep).map(|m| pages(m.size)).sum();
        let idle_slabs = snap.slabs().filter(|r| r.used == 0).count() as u64;
        assert_eq!(s["mapped_bytes"], (chunk_pages + s["small_slabs"] - idle_slabs) * C, "{what}: mapped_bytes");
        assert_eq!(
            snap.slabs().map(|r| r.used).sum::<u64>(),
            self.live.values().filter(|m| m.small).count() as u64,
            "{what}: objects in slabs"
        );
        assert!(s["peak_physical_bytes"] >= self.snap.stats["peak_physical_bytes"], "{what}: the peak went down");
        if let (Some(r), false) = (self.cfg.retain_pages, self.watermark_failed) {
            // Slabs of retired objects wait for the release of retired memory.
            assert!(s["pooled_bytes"] <= (r + idle_slabs) * C, "{what}: pooled memory above the retain watermark");
        }
        assert_eq!(self.fd.live_chunks() as u64, (s["mapped_bytes"] + s["pooled_bytes"]) / C, "{what}: chunks");
        assert_eq!(self.fd.live_mappings() as u64, snap.mapped_pages(), "{what}: driver mappings vs mapped pages");
        let inner = self.fd.inner();
        assert_eq!((inner.live_chunks(), inner.live_mappings()), (self.fd.live_chunks(), self.fd.live_mappings()));

        let events: Vec<MoveEvent> = std::mem::take(&mut *self.events.lock().unwrap());
        assert_eq!(s["moves"] - self.moves, events.len() as u64, "{what}: one event per counted move");
        self.moves = s["moves"];
        let mut now: BTreeMap<Id, u64> = self.live.iter().map(|(&id, m)| (id, m.ptr)).collect();
        for e in &events {
            assert!(may_move.contains(&e.id), "{what}: {} moved but was not allowed to: {e:?}", e.id);
            let cur = now.get_mut(&e.id).unwrap_or_else(|| panic!("{what}: event for a dead id {e:?}"));
            assert_eq!(e.old_ptr, *cur, "{what}: event's old address is not the last known one");
            assert_ne!(e.old_ptr, e.new_ptr);
            let ok_size = e.size == self.live[&e.id].size || self.resized == Some((e.id, e.size));
            assert!(ok_size, "{what}: event size {e:?}");
            *cur = e.new_ptr;
        }
        let by_id = snap.live_by_id();
        let mut small_extents = Vec::new();
        let mut pinned_slabs = Vec::new();
        for (&id, m) in self.live.iter_mut() {
            let info = self.arena.query(id).unwrap();
            assert_eq!((info.size, info.pinned, info.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
            assert_eq!((info.tag, info.asleep), (m.tag, m.asleep), "{what}: {id}");
            match by_id.get(&id.get()) {
                Some(r) => {
                    assert!(!m.small, "{what}: small {id} has chunks of its own");
                    assert_eq!((info.ptr, info.reserved_bytes, info.mapped_bytes), (r.addr, r.bytes, r.mapped_bytes));
                }
                None => {
                    assert!(m.small, "{what}: live {id} missing from the snapshot");
                    let slab =
                        snap.slab_at(info.ptr).unwrap_or_else(|| panic!("{what}: small {id} outside every slab"));
                    assert_eq!(info.reserved_bytes, slab.class_bytes, "{what}: small {id} reserves its class");
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
        }
        for slab in snap.slabs() {
            assert_eq!(
                slab.pinned,
                pinned_slabs.contains(&slab.addr),
                "{what}: a slab is pinned iff an object in it is"
            );
        }
        small_extents.sort_unstable();
        for w in small_extents.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{what}: small allocations overlap: {w:?}");
        }
        assert_eq!(by_id.len(), self.live.values().filter(|m| !m.small).count(), "{what}: unknown allocations");
        self.snap = snap;
    }
}

/// Runs one input: the fuzz target's whole body.
#[allow(dead_code)] // the replay test uses `run_limited`
pub fn run(data: &[u8]) {
    run_limited(data, MAX_OPS)
}

/// Runs the first `max_ops` operations of an input (Miri, ~1000 times
/// slower than native, replays the corpus this way).
pub fn run_limited(data: &[u8], max_ops: usize) {
    let (cfg, mut ops) = decode(data);
    ops.truncate(max_ops);
    // VMM_ARENA_FUZZ_DEBUG=1: print what the input decodes to (to study a crash).
    let debug = std::env::var_os("VMM_ARENA_FUZZ_DEBUG").is_some();
    if debug {
        eprintln!("{cfg:?}");
    }
    let mut h = Harness::new(cfg);
    for op in &ops {
        if debug {
            eprintln!("{op:?}");
        }
        h.apply(op);
    }
    let ids: Vec<Id> = h.live.keys().copied().collect();
    for id in ids {
        h.arena.free(id).unwrap();
        h.live.remove(&id);
    }
    h.arena.release_retired().unwrap();
    h.arena.trim(0).unwrap();
    h.check("teardown", &[]);
    let s = h.arena.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.free_va_bytes), (0, 0, h.cfg.reserve_pages * C));
    assert_eq!((h.fd.live_chunks(), h.fd.live_mappings()), (0, 0), "teardown leaves nothing on the driver");
    drop(h.arena);
    assert_eq!((h.fd.inner().live_chunks(), h.fd.inner().live_mappings()), (0, 0));
}
