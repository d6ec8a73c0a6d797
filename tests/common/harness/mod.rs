//! The model of an arena that the property test (`tests/model.rs`) and the
//! `ops` fuzz target (`fuzz/logic/ops.rs`) share: the operations, what the
//! model knows of every allocation, and every check made after each
//! operation. The property test draws operations with proptest on the host,
//! the mock or a GPU; the fuzz target decodes them from bytes and adds
//! injected driver failures (`Op::Faulty`). Both include this directory's
//! `mod.rs` with `#[path]`, beside `tests/common/mod.rs` (as
//! `super::common`'s sibling, which the child modules reach as
//! `super::super::common`).
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
//! - adoption in place (host and mock): an allocation whose reservation
//!   lies in a free range of cached chunks, and a growth within a
//!   reservation whose tail is all cached chunks, take them where they lie
//!   with no driver call (but the give-back of pooled memory over the
//!   retain watermark after an earlier failed one);
//! - two-phase operations (`two_phase.rs`): after a successful prepare and
//!   no other call on its allocation, commit and abort succeed (whatever
//!   driver call fails); after one, they return `Stale` and change nothing;
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
//!
//! The files: `op.rs` (the configuration and the operations), `model.rs`
//! (what the model knows of each allocation, and sharing), `fault.rs`
//! (injected failures), `apply.rs`, `alloc.rs`, `resize.rs` and `sleep.rs`
//! (applying an operation to the arena and the model), `check.rs` (the
//! checks after each operation); this file holds the harness's state, its
//! construction and its teardown.

#![allow(dead_code)] // each includer uses what it needs

mod alloc;
mod apply;
mod batch;
mod check;
mod fault;
mod maintain;
mod model;
mod op;
mod resize;
mod sleep;
mod two_phase;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::common::Snap;
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, Id, MoveEvent};

use model::Model;
pub use op::{Config, Op};

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
    pub arena: Arc<Arena>,
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
    /// The allocations a `resize_many` resizes and their old sizes, during it.
    resized_many: Vec<(Id, u64)>,
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
    /// Prepared two-phase operations not yet committed or aborted.
    pending: Vec<two_phase::Pending>,
}

/// The driver calls an adoption in place makes none of, from a
/// snapshot's stats: creates, maps, unmaps, releases, access calls and
/// synchronizes. With pooled memory `over` the retain watermark (a
/// give-back that failed earlier), the operation gives the excess back
/// (unmaps, releases, a synchronize): then only creates, maps and access
/// calls are counted (the others read 0).
fn adoption_calls(snap: &Snap, over: bool) -> [u64; 6] {
    let s = &snap.stats;
    let giving_back = |name: &str| if over { 0 } else { s[name] };
    [
        s["driver_creates"],
        s["driver_maps"],
        giving_back("driver_unmaps"),
        giving_back("driver_releases"),
        s["driver_access_calls"],
        giving_back("driver_syncs"),
    ]
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
        let arena = Arc::new(Arena::with_driver(fd.clone(), ac).expect("arena"));
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
            resized_many: Vec::new(),
            views: Vec::new(),
            fault: None,
            watermark_failed: false,
            absorbed_now: false,
            stream_shrinks: 0,
            quiesces: 0,
            pending: Vec::new(),
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
        self.cfg.cap_pages - self.snap.stats["mapped_bytes"] / self.c
    }

    /// Whether `addr..addr + bytes` lies in one free range of the last
    /// snapshot whose pages all hold a cached chunk, where an allocation
    /// must adopt them in place. Only where no stream event can leave a
    /// cached chunk pending (the host and the mock).
    fn cached_free_covers(&self, addr: u64, bytes: u64) -> bool {
        self.backend != Backend::Cuda && self.snap.cached_free_covers(addr, bytes)
    }

    /// Whether pooled memory is over the retain watermark now (its last
    /// give-back failed): the next operation gives the excess back.
    fn over_watermark(&self) -> bool {
        self.cfg.retain_pages.is_some_and(|p| self.snap.stats["pooled_bytes"] > p * self.c)
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

    /// Frees everything, releases and trims: the arena and the driver hold
    /// nothing, and dropping the arena leaves the driver empty.
    pub fn teardown(mut self) {
        // Dropped, a prepared operation stays as made (an allocation or a
        // growth) or never happens (a shrink or a free).
        self.pending.clear();
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
