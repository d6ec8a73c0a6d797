//! Several threads churn one arena and check every byte and every address.
//!
//! ```text
//! stress [--threads N] [--seconds S] [--capacity BYTES] [--reserve BYTES] [--chunk BYTES]
//!        [--max-alloc BYTES] [--max-live N] [--retain BYTES] [--no-implicit-moves] [--no-pins] [--seed N]
//!        [--backend host|host-sparse] [--json PATH] [--snapshot PATH]
//! ```
//!
//! Each thread owns a set of allocations and, until the time is up, picks
//! random operations: `alloc`, `alloc_growable`, `resize` (grow or shrink),
//! `free`, rewrite, verify, `pin`/`unpin`, and on the whole arena `compact`,
//! `trim`, `release_retired` and `stats`. Every allocation carries a byte
//! pattern of its own (three 256-byte windows in every chunk: its start,
//! middle and end), written through `Arena::write` and verified through
//! `Arena::read` after resizes, moves and failed calls.
//!
//! A move callback keeps a shared table of each allocation's address (and
//! checks that each move starts where the table says, and that no pinned
//! allocation moves); threads check that `query` agrees with the table and
//! that pinned allocations keep their address. At the end the main thread
//! checks the stats against what the threads hold, frees everything, and
//! checks that `trim(0)` gives every chunk back.
//!
//! Refusals the contract allows (out of memory under the capacity, out of
//! address space, pinned) are counted, not errors. Anything else is an
//! error: the run prints operations per second and the errors, and exits
//! non-zero if there is any.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser, ValueEnum};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id, MoveEvent};

const MIB: u64 = 1 << 20;
const WINDOW: u64 = 256;
const MAX_SAMPLES: usize = 20;

/// Everything a run needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub threads: usize,
    pub seconds: f64,
    pub capacity_bytes: u64,
    /// 0: twice the capacity (tight, so implicit moves happen).
    pub reserve_bytes: u64,
    pub chunk_bytes: u64,
    pub max_alloc_bytes: u64,
    pub max_live_per_thread: usize,
    pub retain_bytes: u64,
    pub no_implicit_moves: bool,
    /// Pin and unpin allocations (off: nothing is ever pinned, and with one
    /// thread an alloc refused for address space while enough is free is an error).
    pub pins: bool,
    pub seed: u64,
    pub backend: Backend,
    pub snapshot: Option<PathBuf>,
    /// Show a progress bar of the run's time on standard error.
    pub progress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            threads: 4,
            seconds: 5.0,
            capacity_bytes: 256 * MIB,
            reserve_bytes: 0,
            chunk_bytes: 0,
            max_alloc_bytes: 16 * MIB,
            max_live_per_thread: 16,
            retain_bytes: 64 * MIB,
            no_implicit_moves: false,
            pins: true,
            seed: 1,
            backend: Backend::Host,
            snapshot: None,
            progress: false,
        }
    }
}

/// The kinds of operation, in report order.
pub const OPS: [&str; 13] = [
    "alloc",
    "alloc_growable",
    "resize",
    "free",
    "write",
    "verify",
    "query",
    "pin",
    "unpin",
    "compact",
    "trim",
    "release_retired",
    "stats",
];

/// Everything a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub threads: usize,
    pub seconds: f64,
    pub ops: u64,
    pub ops_by_kind: Vec<(&'static str, u64)>,
    /// Refusals the contract allows: out of memory, out of address space, pinned.
    pub refused_out_of_memory: u64,
    pub refused_out_of_address_space: u64,
    pub refused_pinned: u64,
    pub bytes_verified: u64,
    pub bytes_written: u64,
    pub pointer_checks: u64,
    /// Pointer checks skipped because the allocation moved during the check.
    pub pointer_checks_raced: u64,
    pub move_events: u64,
    pub moves: u64,
    pub compact_moved_allocations: u64,
    /// Compactions after which the largest free range was smaller than before (a quality figure, not an error).
    pub compact_shrank_largest_hole: u64,
    pub trimmed_bytes: u64,
    pub peak_physical_bytes: u64,
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    pub driver_unmaps: u64,
    pub driver_syncs: u64,
    pub live_at_end: u64,
    pub errors: u64,
    pub error_samples: Vec<String>,
}

impl Report {
    /// Operations per second over all threads.
    pub fn ops_per_second(&self) -> f64 {
        self.ops as f64 / self.seconds.max(1e-9)
    }
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn below(x: &mut u64, n: u64) -> u64 {
    splitmix(x) % n.max(1)
}

/// The pattern byte of an allocation with `seed` at `offset`.
fn pattern(seed: u64, offset: u64) -> u8 {
    let mut x = seed ^ (offset >> 3).wrapping_mul(0xd6e8_feb8_6659_fd93);
    (splitmix(&mut x) >> ((offset & 7) * 8)) as u8
}

/// The patterned windows of an allocation of `size` bytes, clipped to `[lo, hi)`.
fn windows(chunk: u64, size: u64, lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let hi = hi.min(size);
    let mut out = Vec::new();
    if lo >= hi {
        return out;
    }
    let w = WINDOW.min(chunk / 4).max(1);
    for k in lo / chunk..hi.div_ceil(chunk) {
        let base = k * chunk;
        for s in [base, base + chunk / 2, base + chunk - w] {
            let (a, b) = (s.max(lo), (s + w).min(hi));
            if a < b {
                out.push((a, b));
            }
        }
    }
    out
}

#[derive(Default)]
struct Entry {
    ptr: u64,
    moves: u64,
    pinned: bool,
}

#[derive(Default)]
struct Table {
    ptrs: HashMap<u64, Entry>,
    events: u64,
    wrong_old_ptr: u64,
    pinned_moved: u64,
}

struct Obj {
    id: Id,
    size: u64,
    seed: u64,
    growable: bool,
    pinned_at: Option<u64>,
}

#[derive(Default)]
struct Tally {
    ops: [u64; OPS.len()],
    oom: u64,
    oas: u64,
    pinned: u64,
    verified: u64,
    written: u64,
    ptr_checks: u64,
    ptr_raced: u64,
    compact_moved: u64,
    compact_shrank: u64,
    trimmed: u64,
    errors: u64,
    samples: Vec<String>,
}

impl Tally {
    fn error(&mut self, msg: String) {
        self.errors += 1;
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(msg);
        }
    }

    /// Counts an allowed refusal; anything else is an error.
    fn refusal(&mut self, what: &str, e: &Error) {
        match e {
            Error::OutOfMemory(_) => self.oom += 1,
            Error::OutOfAddressSpace(_) => self.oas += 1,
            Error::Pinned(_) => self.pinned += 1,
            e => self.error(format!("{what}: unexpected error {e}")),
        }
    }
}

struct Worker<'a> {
    arena: &'a Arena,
    table: &'a Mutex<Table>,
    cfg: &'a Config,
    chunk: u64,
    rng: u64,
    objs: Vec<Obj>,
    t: Tally,
}

impl Worker<'_> {
    fn write_range(&mut self, o: usize, lo: u64, hi: u64) {
        let (id, seed, size) = (self.objs[o].id, self.objs[o].seed, self.objs[o].size);
        for (a, b) in windows(self.chunk, size, lo, hi) {
            let buf: Vec<u8> = (a..b).map(|off| pattern(seed, off)).collect();
            match self.arena.write(id, a, &buf) {
                Ok(()) => self.t.written += b - a,
                Err(e) => self.t.error(format!("write {id} [{a}, {b}) of {size}: {e}")),
            }
        }
    }

    fn verify(&mut self, o: usize, what: &str) {
        let (id, seed, size) = (self.objs[o].id, self.objs[o].seed, self.objs[o].size);
        let mut buf = Vec::new();
        for (a, b) in windows(self.chunk, size, 0, size) {
            buf.resize((b - a) as usize, 0);
            if let Err(e) = self.arena.read(id, a, &mut buf) {
                self.t.error(format!("{what}: read {id} [{a}, {b}) of {size}: {e}"));
                return;
            }
            if let Some(i) = (a..b).position(|off| buf[(off - a) as usize] != pattern(seed, off)) {
                self.t.error(format!("{what}: {id} (size {size}) has a wrong byte at offset {}", a + i as u64));
                return;
            }
            self.t.verified += b - a;
        }
    }

    /// `query` agrees with the pointer table, the size, the pin, and a pinned allocation's address.
    fn check_query(&mut self, o: usize, what: &str) {
        let (id, size, pinned_at) = (self.objs[o].id, self.objs[o].size, self.objs[o].pinned_at);
        let moves_of = |t: &Table| t.ptrs.get(&id.get()).map(|e| (e.ptr, e.moves));
        let before = moves_of(&self.table.lock().unwrap());
        let info = match self.arena.query(id) {
            Ok(i) => i,
            Err(e) => return self.t.error(format!("{what}: query {id}: {e}")),
        };
        let after = moves_of(&self.table.lock().unwrap());
        match (before, after) {
            (Some((_, m1)), Some((p, m2))) if m1 == m2 => {
                self.t.ptr_checks += 1;
                if p != info.ptr {
                    self.t.error(format!("{what}: {id} is at {:#x} but the move table says {p:#x}", info.ptr));
                }
            }
            (Some(_), Some(_)) => self.t.ptr_raced += 1,
            _ => self.t.error(format!("{what}: {id} is missing from the pointer table")),
        }
        // Whole chunks, or (small, slab-packed) a size class of at most half a chunk.
        let mapped_ok = if info.mapped_bytes >= self.chunk {
            info.mapped_bytes == size.div_ceil(self.chunk) * self.chunk
        } else {
            info.mapped_bytes >= size && info.mapped_bytes <= self.chunk / 2 && !info.growable
        };
        if info.size != size || !mapped_ok || info.growable != self.objs[o].growable {
            self.t.error(format!(
                "{what}: {id} has size {} mapped {} growable {} (expected {size}, whole chunks or a small class, {})",
                info.size, info.mapped_bytes, info.growable, self.objs[o].growable
            ));
        }
        if info.pinned != pinned_at.is_some() {
            self.t.error(format!("{what}: {id} pinned is {} (expected {})", info.pinned, pinned_at.is_some()));
        }
        if let Some(p) = pinned_at {
            if info.ptr != p {
                self.t.error(format!("{what}: pinned {id} moved from {p:#x} to {:#x}", info.ptr));
            }
        }
    }

    /// With one thread and nothing pinned, an allocation refused for address
    /// space must not succeed after an explicit `compact()`: the contract says
    /// holes are never a reason to fail, the arena compacts before it refuses.
    /// Returns the allocation if the retry succeeded (and counts an error).
    fn check_address_space(&mut self, e: &Error, size: u64, max: Option<u64>) -> Option<(Id, u64)> {
        if !matches!(e, Error::OutOfAddressSpace(_))
            || self.cfg.threads != 1
            || self.cfg.pins
            || self.cfg.no_implicit_moves
        {
            return None;
        }
        let before = self.arena.stats().ok()?;
        if let Err(e) = self.arena.compact() {
            self.t.error(format!("compact: {e}"));
            return None;
        }
        let retry = match max {
            None => self.arena.alloc(size),
            Some(m) => self.arena.alloc_growable(size, m),
        };
        let r = retry.ok()?;
        self.t.error(format!(
            "alloc{}({size}{}) refused ({e}) with {} bytes of free and {} of retired address space and nothing \
             pinned, but succeeded after compact()",
            if max.is_some() { "_growable" } else { "" },
            max.map(|m| format!(", {m}")).unwrap_or_default(),
            before.free_va_bytes,
            before.retired_va_bytes
        ));
        Some(r)
    }

    fn random_size(&mut self) -> u64 {
        let max = self.cfg.max_alloc_bytes.max(1);
        match below(&mut self.rng, 10) {
            0..=4 => 1 + below(&mut self.rng, self.chunk.min(max)),
            5..=8 => 1 + below(&mut self.rng, (4 * self.chunk).min(max)),
            _ => 1 + below(&mut self.rng, max),
        }
    }

    fn add(&mut self, id: Id, ptr: u64, size: u64, growable: bool) {
        self.table.lock().unwrap().ptrs.entry(id.get()).or_insert(Entry { ptr, moves: 0, pinned: false });
        let seed = splitmix(&mut self.rng);
        self.objs.push(Obj { id, size, seed, growable, pinned_at: None });
        let o = self.objs.len() - 1;
        self.write_range(o, 0, size);
    }

    fn step(&mut self) {
        let n = self.objs.len();
        let full = n >= self.cfg.max_live_per_thread;
        let pick = below(&mut self.rng, 1000);
        let o = if n > 0 { below(&mut self.rng, n as u64) as usize } else { 0 };
        let op = match pick {
            _ if n == 0 => 0,
            0..=149 if !full => 0,
            150..=249 if !full => 1,
            0..=249 => 3,
            250..=499 => 2,
            500..=629 => 3,
            630..=699 => 4,
            700..=829 => 5,
            830..=899 => 6,
            900..=929 if self.cfg.pins => 7,
            930..=959 if self.cfg.pins => 8,
            900..=959 => 6,
            960..=969 => 9,
            970..=979 => 10,
            980..=989 => 11,
            _ => 12,
        };
        self.t.ops[op] += 1;
        match op {
            0 => {
                let size = self.random_size();
                match self.arena.alloc(size) {
                    Ok((id, ptr)) => self.add(id, ptr, size, false),
                    Err(e) => {
                        self.t.refusal("alloc", &e);
                        if let Some((id, ptr)) = self.check_address_space(&e, size, None) {
                            self.add(id, ptr, size, false);
                        }
                    }
                }
            }
            1 => {
                let size = self.random_size();
                let max = size * (1 + below(&mut self.rng, 8));
                match self.arena.alloc_growable(size, max) {
                    Ok((id, ptr)) => self.add(id, ptr, size, true),
                    Err(e) => {
                        self.t.refusal("alloc_growable", &e);
                        if let Some((id, ptr)) = self.check_address_space(&e, size, Some(max)) {
                            self.add(id, ptr, size, true);
                        }
                    }
                }
            }
            2 => {
                let old = self.objs[o].size;
                let new = match below(&mut self.rng, 3) {
                    0 => 1 + below(&mut self.rng, old),
                    _ if self.objs[o].growable => old + 1 + below(&mut self.rng, 2 * self.chunk),
                    _ => self.random_size(),
                };
                let id = self.objs[o].id;
                match self.arena.resize(id, new) {
                    Ok(ptr) => {
                        if let Some(p) = self.objs[o].pinned_at {
                            if p != ptr {
                                self.t.error(format!("resize moved pinned {id} from {p:#x} to {ptr:#x}"));
                            }
                        }
                        self.objs[o].size = new;
                        if new > old {
                            self.write_range(o, old, new);
                        }
                        self.verify(o, "after resize");
                    }
                    Err(e) => {
                        self.t.refusal("resize", &e);
                        // A failed call leaves the allocation as it was.
                        self.check_query(o, "after a failed resize");
                        self.verify(o, "after a failed resize");
                    }
                }
            }
            3 => {
                let obj = self.objs.swap_remove(o);
                if obj.pinned_at.is_some() {
                    if let Some(e) = self.table.lock().unwrap().ptrs.get_mut(&obj.id.get()) {
                        e.pinned = false;
                    }
                }
                match self.arena.free(obj.id) {
                    Ok(()) => {
                        self.table.lock().unwrap().ptrs.remove(&obj.id.get());
                        if !matches!(self.arena.query(obj.id), Err(Error::UnknownAllocation(_))) {
                            self.t.error(format!("freed {} still answers query", obj.id));
                        }
                    }
                    Err(e) => self.t.error(format!("free {}: {e}", obj.id)),
                }
            }
            4 => {
                self.objs[o].seed = splitmix(&mut self.rng);
                let size = self.objs[o].size;
                self.write_range(o, 0, size);
            }
            5 => {
                self.verify(o, "verify");
                self.check_query(o, "verify");
            }
            6 => self.check_query(o, "query"),
            7 => {
                let pinned = self.objs.iter().filter(|x| x.pinned_at.is_some()).count();
                if self.objs[o].pinned_at.is_none() && pinned < 2 {
                    let id = self.objs[o].id;
                    match self.arena.pin(id) {
                        Ok(()) => {
                            // Moves before pin() returned were reported before it returned.
                            let ptr = {
                                let mut t = self.table.lock().unwrap();
                                let e = t.ptrs.get_mut(&id.get()).expect("live allocation in the table");
                                e.pinned = true;
                                e.ptr
                            };
                            self.objs[o].pinned_at = Some(ptr);
                            self.check_query(o, "after pin");
                        }
                        Err(e) => self.t.error(format!("pin {id}: {e}")),
                    }
                }
            }
            8 => {
                if let Some(o) = self.objs.iter().position(|x| x.pinned_at.is_some()) {
                    let id = self.objs[o].id;
                    if let Some(e) = self.table.lock().unwrap().ptrs.get_mut(&id.get()) {
                        e.pinned = false;
                    }
                    match self.arena.unpin(id) {
                        Ok(()) => self.objs[o].pinned_at = None,
                        Err(e) => self.t.error(format!("unpin {id}: {e}")),
                    }
                }
            }
            9 => match self.arena.compact() {
                Ok(r) => {
                    self.t.compact_moved += r.moved_allocations;
                    if r.largest_free_va_after < r.largest_free_va_before {
                        self.t.compact_shrank += 1;
                    }
                    self.verify(o, "after compact");
                }
                Err(e) => self.t.error(format!("compact: {e}")),
            },
            10 => {
                let keep = below(&mut self.rng, self.cfg.capacity_bytes / 4 + 1);
                match self.arena.trim(keep) {
                    Ok(b) => self.t.trimmed += b,
                    Err(e) => self.t.error(format!("trim({keep}): {e}")),
                }
            }
            11 => {
                if let Err(e) = self.arena.release_retired() {
                    self.t.error(format!("release_retired: {e}"));
                }
                self.verify(o, "after release_retired");
            }
            _ => match self.arena.stats() {
                Ok(s) => {
                    if s.mapped_bytes + s.pooled_bytes > s.capacity_bytes
                        || s.peak_physical_bytes > s.capacity_bytes
                        || s.live_bytes > s.mapped_bytes
                        || s.largest_free_va_bytes > s.free_va_bytes
                    {
                        self.t.error(format!("inconsistent stats {s:?}"));
                    }
                }
                Err(e) => self.t.error(format!("stats: {e}")),
            },
        }
    }
}

/// Draws the elapsed share of the run until its deadline (the workers stop
/// on their own; this thread would only wait for them anyway).
fn show_progress(start: Instant, deadline: Instant) {
    let total = deadline.saturating_duration_since(start);
    let bar = indicatif::ProgressBar::new(total.as_millis() as u64).with_style(
        indicatif::ProgressStyle::with_template("stress {bar:40} {elapsed}/{duration}").expect("a valid template"),
    );
    while Instant::now() < deadline {
        bar.set_position(start.elapsed().as_millis() as u64);
        std::thread::sleep(Duration::from_millis(100).min(deadline.saturating_duration_since(Instant::now())));
    }
    bar.finish_and_clear();
}

/// Runs the stress test.
pub fn run(cfg: &Config) -> Result<Report, String> {
    let capacity = cfg.capacity_bytes;
    let arena = Arena::new(ArenaConfig {
        backend: cfg.backend,
        capacity_bytes: capacity,
        reserve_bytes: if cfg.reserve_bytes == 0 { capacity * 2 } else { cfg.reserve_bytes },
        chunk_bytes: cfg.chunk_bytes,
        retain_bytes: cfg.retain_bytes,
        no_implicit_moves: cfg.no_implicit_moves,
        ..Default::default()
    })
    .map_err(|e| format!("cannot create the arena: {e}"))?;
    let chunk = arena.chunk_bytes();
    let table = Arc::new(Mutex::new(Table::default()));
    let cb_table = Arc::clone(&table);
    arena
        .set_move_callback(Some(Box::new(move |e: &MoveEvent| {
            let mut guard = cb_table.lock().unwrap();
            let t = &mut *guard;
            t.events += 1;
            match t.ptrs.get_mut(&e.id.get()) {
                Some(ent) => {
                    if ent.ptr != e.old_ptr {
                        t.wrong_old_ptr += 1;
                    }
                    if ent.pinned {
                        t.pinned_moved += 1;
                    }
                    ent.ptr = e.new_ptr;
                    ent.moves += 1;
                }
                // Moved before its owner recorded it: the owner keeps this entry.
                None => {
                    t.ptrs.insert(e.id.get(), Entry { ptr: e.new_ptr, moves: 1, pinned: false });
                }
            }
        })))
        .map_err(|e| e.to_string())?;

    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(cfg.seconds.max(0.0));
    let results: Vec<Result<(Vec<Obj>, Tally), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cfg.threads.max(1))
            .map(|i| {
                let (arena, table) = (&arena, &*table);
                s.spawn(move || {
                    let mut w = Worker {
                        arena,
                        table,
                        cfg,
                        chunk,
                        rng: cfg.seed.wrapping_mul(0x1000_0001).wrapping_add(i as u64),
                        objs: Vec::new(),
                        t: Tally::default(),
                    };
                    let mut n = 0u64;
                    loop {
                        w.step();
                        n += 1;
                        if n % 16 == 0 && Instant::now() >= deadline {
                            break;
                        }
                    }
                    (w.objs, w.t)
                })
            })
            .collect();
        if cfg.progress {
            show_progress(start, deadline);
        }
        handles
            .into_iter()
            .map(|h| h.join().map_err(|p| format!("a worker panicked: {:?}", p.downcast_ref::<String>())))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();

    let mut t = Tally::default();
    let mut objs = Vec::new();
    for r in results {
        match r {
            Ok((o, w)) => {
                objs.extend(o);
                for (a, b) in t.ops.iter_mut().zip(w.ops) {
                    *a += b;
                }
                t.oom += w.oom;
                t.oas += w.oas;
                t.pinned += w.pinned;
                t.verified += w.verified;
                t.written += w.written;
                t.ptr_checks += w.ptr_checks;
                t.ptr_raced += w.ptr_raced;
                t.compact_moved += w.compact_moved;
                t.compact_shrank += w.compact_shrank;
                t.trimmed += w.trimmed;
                t.errors += w.errors;
                for m in w.samples {
                    if t.samples.len() < MAX_SAMPLES {
                        t.samples.push(m);
                    }
                }
            }
            Err(e) => t.error(e),
        }
    }

    // Quiescent checks: the stats match what the threads hold.
    // Mapped bytes: whole-chunk allocations plus the slabs holding the
    // small ones (a slab of retired objects only counts as pooled).
    let s = arena.stats().map_err(|e| e.to_string())?;
    let live_at_end = objs.len() as u64;
    let sizes: u64 = objs.iter().map(|o| o.size).sum();
    let mut mapped = 0;
    let mut slabs = std::collections::BTreeSet::new();
    for o in &objs {
        match arena.query(o.id) {
            Ok(i) if i.mapped_bytes >= chunk => mapped += i.mapped_bytes,
            // Slabs are one page of the arena's range.
            Ok(i) => {
                slabs.insert((i.ptr - arena.va_range().0) / chunk);
            }
            Err(e) => t.error(format!("query {} at the end: {e}", o.id)),
        }
    }
    mapped += slabs.len() as u64 * chunk;
    if s.live_allocations != live_at_end || s.live_bytes != sizes || s.mapped_bytes != mapped {
        t.error(format!(
            "stats say {} live, {} bytes, {} mapped; the threads hold {live_at_end}, {sizes}, {mapped} \
             (whole chunks + {} slabs)",
            s.live_allocations,
            s.live_bytes,
            s.mapped_bytes,
            slabs.len()
        ));
    }
    if let Some(path) = &cfg.snapshot {
        let json = arena.snapshot_json().map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    {
        let mut w = Worker { arena: &arena, table: &table, cfg, chunk, rng: 0, objs, t };
        for o in 0..w.objs.len() {
            w.verify(o, "at the end");
            w.check_query(o, "at the end");
        }
        for o in std::mem::take(&mut w.objs) {
            if let Err(e) = arena.free(o.id) {
                w.t.error(format!("free {} at the end: {e}", o.id));
            }
        }
        t = w.t;
    }
    let end = (|| {
        arena.release_retired()?;
        let trimmed = arena.trim(0)?;
        Ok::<_, Error>((trimmed, arena.stats()?))
    })();
    let (trimmed, f) = end.map_err(|e| format!("final release/trim failed: {e}"))?;
    t.trimmed += trimmed;
    if f.live_allocations != 0 || f.live_bytes != 0 || f.mapped_bytes != 0 || f.pooled_bytes != 0 {
        t.error(format!("after freeing everything and trim(0): {f:?}"));
    }
    if f.driver_creates != f.driver_releases {
        t.error(format!("{} chunks created but {} released", f.driver_creates, f.driver_releases));
    }
    let tb = table.lock().unwrap();
    if tb.wrong_old_ptr > 0 {
        t.error(format!("{} move events started somewhere else than the table said", tb.wrong_old_ptr));
    }
    if tb.pinned_moved > 0 {
        t.error(format!("{} move events moved a pinned allocation", tb.pinned_moved));
    }
    Ok(Report {
        threads: cfg.threads.max(1),
        seconds,
        ops: t.ops.iter().sum(),
        ops_by_kind: OPS.iter().copied().zip(t.ops).collect(),
        refused_out_of_memory: t.oom,
        refused_out_of_address_space: t.oas,
        refused_pinned: t.pinned,
        bytes_verified: t.verified,
        bytes_written: t.written,
        pointer_checks: t.ptr_checks,
        pointer_checks_raced: t.ptr_raced,
        move_events: tb.events,
        moves: f.moves,
        compact_moved_allocations: t.compact_moved,
        compact_shrank_largest_hole: t.compact_shrank,
        trimmed_bytes: t.trimmed,
        peak_physical_bytes: f.peak_physical_bytes,
        driver_creates: f.driver_creates,
        driver_releases: f.driver_releases,
        driver_maps: f.driver_maps,
        driver_unmaps: f.driver_unmaps,
        driver_syncs: f.driver_syncs,
        live_at_end,
        errors: t.errors,
        error_samples: t.samples,
    })
}

impl Report {
    /// The printed summary.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "stress: {} threads, {:.1} s: {} operations, {:.0} ops/s, errors {}",
            self.threads,
            self.seconds,
            self.ops,
            self.ops_per_second(),
            self.errors
        );
        let _ = writeln!(o, "{:<16} {:>12} {:>12}", "operation", "count", "per second");
        for (k, n) in &self.ops_by_kind {
            let _ = writeln!(o, "{k:<16} {n:>12} {:>12.0}", *n as f64 / self.seconds.max(1e-9));
        }
        let _ = writeln!(
            o,
            "refused (allowed): out of memory {}, out of address space {}, pinned {}",
            self.refused_out_of_memory, self.refused_out_of_address_space, self.refused_pinned
        );
        let _ = writeln!(
            o,
            "moves {} (compaction moved {}; {} compactions left a smaller largest hole), move events {}, \
             pointer checks {} ({} raced with a move, skipped)",
            self.moves,
            self.compact_moved_allocations,
            self.compact_shrank_largest_hole,
            self.move_events,
            self.pointer_checks,
            self.pointer_checks_raced
        );
        let _ = writeln!(
            o,
            "bytes written {:.1} MiB, verified {:.1} MiB; trimmed {:.1} MiB; peak physical {:.1} MiB",
            self.bytes_written as f64 / MIB as f64,
            self.bytes_verified as f64 / MIB as f64,
            self.trimmed_bytes as f64 / MIB as f64,
            self.peak_physical_bytes as f64 / MIB as f64
        );
        let _ = writeln!(
            o,
            "driver: creates {} releases {} maps {} unmaps {} syncs {}; live at the end {}",
            self.driver_creates,
            self.driver_releases,
            self.driver_maps,
            self.driver_unmaps,
            self.driver_syncs,
            self.live_at_end
        );
        for m in &self.error_samples {
            let _ = writeln!(o, "ERROR: {m}");
        }
        let _ = writeln!(o, "errors: {}", self.errors);
        o
    }

    /// The figures as a JSON document.
    pub fn to_json(&self) -> String {
        let doc = ReportJson {
            example: "stress",
            threads: self.threads,
            seconds: self.seconds,
            ops: self.ops,
            ops_per_second: self.ops_per_second(),
            ops_by_kind: InOrder(&self.ops_by_kind),
            refused_out_of_memory: self.refused_out_of_memory,
            refused_out_of_address_space: self.refused_out_of_address_space,
            refused_pinned: self.refused_pinned,
            bytes_written: self.bytes_written,
            bytes_verified: self.bytes_verified,
            pointer_checks: self.pointer_checks,
            pointer_checks_raced: self.pointer_checks_raced,
            move_events: self.move_events,
            moves: self.moves,
            compact_moved_allocations: self.compact_moved_allocations,
            compact_shrank_largest_hole: self.compact_shrank_largest_hole,
            trimmed_bytes: self.trimmed_bytes,
            peak_physical_bytes: self.peak_physical_bytes,
            driver_calls: DriverCalls {
                create: self.driver_creates,
                release: self.driver_releases,
                map: self.driver_maps,
                unmap: self.driver_unmaps,
                sync: self.driver_syncs,
            },
            live_at_end: self.live_at_end,
            errors: self.errors,
            error_samples: &self.error_samples,
        };
        serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
    }
}

/// The JSON layout of a [`Report`] (field names are what scripts read).
#[derive(Serialize)]
struct ReportJson<'a> {
    example: &'static str,
    threads: usize,
    seconds: f64,
    ops: u64,
    ops_per_second: f64,
    ops_by_kind: InOrder<'a>,
    refused_out_of_memory: u64,
    refused_out_of_address_space: u64,
    refused_pinned: u64,
    bytes_written: u64,
    bytes_verified: u64,
    pointer_checks: u64,
    pointer_checks_raced: u64,
    move_events: u64,
    moves: u64,
    compact_moved_allocations: u64,
    compact_shrank_largest_hole: u64,
    trimmed_bytes: u64,
    peak_physical_bytes: u64,
    driver_calls: DriverCalls,
    live_at_end: u64,
    errors: u64,
    error_samples: &'a [String],
}

#[derive(Serialize)]
struct DriverCalls {
    create: u64,
    release: u64,
    map: u64,
    unmap: u64,
    sync: u64,
}

/// Pairs as a JSON object in their own order (the report's operation order),
/// which a map type would sort.
struct InOrder<'a>(&'a [(&'static str, u64)]);

impl Serialize for InOrder<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Parses `123`, `64MiB`, `1.5G`, `512k` (binary units).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => MIB,
        "g" | "gib" | "gb" => 1 << 30,
        _ => return Err(format!("bad size {s:?}")),
    };
    let v: f64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    Ok((v * mult as f64) as u64)
}

/// The arena's backends a run can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Host,
    HostSparse,
}

/// Several threads churn one arena and check every byte and every address;
/// exits non-zero on any error.
#[derive(Debug, Parser)]
#[command(name = "stress")]
pub struct Cli {
    /// Worker threads.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub threads: u64,
    /// How long the threads run.
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    pub seconds: f64,
    /// Physical capacity (`256MiB`, `1.5G`, `512k`, plain bytes).
    #[arg(long, value_name = "BYTES", default_value = "256MiB", value_parser = parse_bytes)]
    pub capacity: u64,
    /// Reserved address space; 0: twice the capacity (tight, so implicit moves happen).
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub reserve: u64,
    /// Chunk size; 0: 2 MiB, or the driver's recommended granularity if larger.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub chunk: u64,
    /// Largest allocation a thread asks for.
    #[arg(long, value_name = "BYTES", default_value = "16MiB", value_parser = parse_bytes)]
    pub max_alloc: u64,
    /// Most allocations a thread holds at once.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_live: u64,
    /// Pooled memory kept after frees (beyond it chunks go back to the driver).
    #[arg(long, value_name = "BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub retain: u64,
    /// Forbid the arena's implicit moves.
    #[arg(long)]
    pub no_implicit_moves: bool,
    /// Never pin allocations.
    #[arg(long)]
    pub no_pins: bool,
    /// Seed of the threads' random choices.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// The arena's backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Host)]
    pub backend: BackendArg,
    /// Also write the report as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the arena's snapshot (for `snapshot_svg`) to PATH at the end of the run.
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<PathBuf>,
}

impl Cli {
    /// The run this command line asks for.
    pub fn config(&self) -> Result<Config, String> {
        if self.max_alloc == 0 {
            return Err("--max-alloc must be positive".into());
        }
        Ok(Config {
            threads: self.threads as usize,
            seconds: self.seconds,
            capacity_bytes: self.capacity,
            reserve_bytes: self.reserve,
            chunk_bytes: self.chunk,
            max_alloc_bytes: self.max_alloc,
            max_live_per_thread: self.max_live as usize,
            retain_bytes: self.retain,
            no_implicit_moves: self.no_implicit_moves,
            pins: !self.no_pins,
            seed: self.seed,
            backend: match self.backend {
                BackendArg::Host => Backend::Host,
                BackendArg::HostSparse => Backend::HostSparse,
            },
            snapshot: self.snapshot.clone(),
            progress: false,
        })
    }
}

/// The `stress` program (`src/bin/stress.rs`).
pub fn main() {
    let cli = Cli::parse();
    let cfg = match cli.config() {
        Ok(c) => Config { progress: std::io::stderr().is_terminal(), ..c },
        Err(e) => Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit(),
    };
    let json = cli.json;
    let report = match run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("stress: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", report.table());
    if let Some(path) = &json {
        if let Err(e) = std::fs::write(path, report.to_json()) {
            eprintln!("cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    if report.errors > 0 {
        std::process::exit(1);
    }
}
