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

use clap::{CommandFactory, Parser};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id, MoveEvent};

mod cli;
mod report;
mod worker;

pub use crate::cli_args::{parse_bytes, BackendArg};
pub use cli::{main, Cli};

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
