//! Prefetch: driver work ahead of need, off the callers' critical path
//! (`set_prefetch`, `maintain`, and the background worker's rounds).
//!
//! Two targets, in chunks: `precreate` unmapped pooled chunks (a later
//! allocation maps one instead of creating it: hides `cuMemCreate`), and
//! `ahead` chunks mapped and accessible right after each awake growable
//! allocation's backed pages, inside its reservation (its growth adopts
//! them with no driver call at all). Both are ordinary pooled chunks: they
//! count in `pooled_bytes`, are made only within the capacity left
//! (`held <= capacity` always, work in flight included) and within
//! `retain_bytes`. They come from the cheapest source that does not grow
//! the footprint first: pooled chunks, then *spare* known-idle cached
//! chunks (no window holds them; unmapping them needs no synchronize),
//! and a create only when the arena holds no spare chunk. They are the
//! first taken by any plan (the pool first,
//! then idle cached chunks, which include the mapped-ahead ones: unmapping
//! them needs no synchronize) and the first given back by `trim`. So they
//! never cause an out-of-memory.
//!
//! **Locking: plan, set aside, call outside, commit.** `maintain` works in
//! rounds. Under the lock a round plans one piece of work and sets aside
//! what it works on: for a *create* round, capacity only (`inflight_pages`
//! grows, so no other operation can be promised those chunks); for a *map*
//! round, chunks taken out of the pool and the pages they go to
//! (`State::set_aside`), and spare idle cached pages taken out of `cached`
//! and `idle` into `set_aside` (their chunks are unmapped first, then
//! mapped at the window's pages, or join the pool for the precreate
//! target). It then makes its driver calls without the lock,
//! and takes the lock again to commit: created chunks join the pool; mapped
//! pages become cached and idle wherever they now lie (the allocation may
//! have been freed, moved or shrunk meanwhile: the pages are then free or
//! in its unbacked tail, where a cached chunk is at home); the spare pages
//! become unmapped. A failure returns the chunks where they were (the map
//! round's transaction unmaps what it mapped and maps the spare pages back,
//! cached and idle again) and counts in `maintain_failures`.
//!
//! Other threads' operations never wait for a create: creates set no pages
//! aside. An operation that needs a page being mapped (typically the
//! allocation growing into its own map-ahead window) finds it in
//! `set_aside` while planning, before any driver call, and is retried
//! after the commit (a few maps and one access call later, and then it
//! adopts those pages for free). An operation that runs out of memory
//! while chunks are in flight waits for them to land and tries again; the
//! prefetcher starts nothing new while one waits (`pressure_waiters`).
//! Sleep and wake wait until nothing is in flight. One `maintain` runs at
//! a time; a second call returns at once.
//!
//! Event polls and destroys (stream-ordered frees) are made under the lock:
//! they never block (about a microsecond each).

use crate::driver::ChunkHandle;
use crate::error::{Error, Result};

use super::admission_ahead::{self, AdmitAhead};
use super::state::{runs, State};
use super::stream::{reap, Poll};
use super::txn::Txn;
use super::{Arena, Inner, Shared};

/// The most admission windows [`Arena::set_admission_prefetch`] keeps.
pub const MAX_ADMISSION_WINDOWS: u32 = 64;

/// Chunks created per round: the longest an operation that runs out of
/// memory may wait for work in flight is one create.
const CREATES_PER_ROUND: u64 = 1;

/// One round's work, set aside under the lock.
enum Round {
    /// Create this many chunks for the pool.
    Create(u64),
    /// Move chunks: unmap the known-idle cached chunks of `from` (no
    /// synchronize), then map `pooled` followed by `from`'s chunks at `to`
    /// (sorted), one access call per run. With `to` empty, `from`'s chunks
    /// go to the pool.
    Map(Move),
}

/// A map round's chunks and pages, all set aside.
struct Move {
    /// Idle cached pages (sorted) and their chunks: out of `cached` and in
    /// `set_aside` while the round is in flight (still mapped).
    from: Vec<(u64, ChunkHandle)>,
    /// Chunks taken out of the pool.
    pooled: Vec<ChunkHandle>,
    /// Unmapped pages to map, in `set_aside`.
    to: Vec<u64>,
}

impl Move {
    fn chunks(&self) -> u64 {
        (self.pooled.len() + self.from.len()) as u64
    }

    /// The chunk each page of `to` gets.
    fn targets(&self) -> impl Iterator<Item = (u64, ChunkHandle)> + '_ {
        self.to.iter().copied().zip(self.pooled.iter().copied().chain(self.from.iter().map(|&(_, h)| h)))
    }
}

impl Arena {
    /// Sets the prefetch targets, each rounded up to whole chunks:
    /// `precreate_bytes` of created chunks kept pooled and unmapped, and,
    /// for every awake growable allocation, up to `map_ahead_bytes` of
    /// chunks kept mapped and accessible right after its backed size
    /// (within its reservation), so that its growth makes no driver call
    /// (none for a quiesced one, which promised not to grow: see
    /// [`Arena::quiesce_on_stream`]).
    /// The map-ahead chunks do not count toward `precreate_bytes`.
    ///
    /// Both count in `pooled_bytes`, are held within the capacity left by
    /// live allocations and within `retain_bytes`, and are the first to be
    /// used or given back under pressure: they never cause an
    /// `OutOfMemory`. `(0, 0)`, the default, turns prefetching off (what is
    /// pooled stays pooled). The work is done by [`Arena::maintain`] or by
    /// the background worker ([`ArenaConfig::background`](super::ArenaConfig::background));
    /// while any allocation is asleep, neither does anything. Never fails
    /// on a live arena.
    pub fn set_prefetch(&self, precreate_bytes: u64, map_ahead_bytes: u64) -> Result<()> {
        let mut inner = self.lock()?;
        let c = self.chunk;
        inner.st.prefetch = (precreate_bytes.div_ceil(c), map_ahead_bytes.div_ceil(c));
        self.sh.poke_worker(&mut inner);
        Ok(())
    }

    /// Sets the admission map-ahead target: chunks kept mapped and
    /// accessible at the first `ready_bytes` of each of the places the next
    /// `count` allocations of whole chunks reserving `reservation_bytes`
    /// will be given (a growable allocation reserves its `max_size`, any
    /// other its size; each rounded up to whole chunks), so that such an
    /// allocation, up to `ready_bytes`, makes no driver call. An engine
    /// sets it from its waiting queue and recent admissions, between steps.
    ///
    /// Placement is predicted exactly as it will be made (best fit, the
    /// most cached chunks first, see `admission_ahead.rs`), so the
    /// prediction holds while no other allocation is placed first. Window
    /// chunks come from the unmapped pool and from known-idle cached chunks
    /// no other window holds; they count toward the `precreate_bytes`
    /// target of [`Arena::set_prefetch`] (they are precreated chunks mapped
    /// where they will be used) and in `pooled_bytes` and
    /// `prefetched_bytes`, and like every prefetched chunk they are the
    /// first used or given back under pressure, so they never cause an
    /// `OutOfMemory`. The work is done by [`Arena::maintain`] or the
    /// background worker; while any allocation is asleep, neither does
    /// anything. `count` 0 (the default) turns it off.
    ///
    /// # Errors
    /// `InvalidArgument` if `count` exceeds [`MAX_ADMISSION_WINDOWS`] (each
    /// window costs a placement search every `maintain` round).
    pub fn set_admission_prefetch(&self, reservation_bytes: u64, ready_bytes: u64, count: u32) -> Result<()> {
        if count > MAX_ADMISSION_WINDOWS {
            return Err(Error::InvalidArgument(format!(
                "{count} admission windows asked for; at most {MAX_ADMISSION_WINDOWS}"
            )));
        }
        let mut inner = self.lock()?;
        let c = self.chunk;
        inner.st.admit_ahead =
            AdmitAhead { reserve: reservation_bytes.div_ceil(c), ready: ready_bytes.div_ceil(c), count };
        if inner.st.admit_ahead.is_off() {
            inner.st.admit_windows.clear();
        }
        self.sh.poke_worker(&mut inner);
        Ok(())
    }

    /// Brings the arena as close to its prefetch targets as the capacity
    /// left by live allocations allows, now, on the calling thread (e.g.
    /// between decode steps, while the device computes), and gives back the
    /// memory of stream-ordered frees whose events have completed (that
    /// bookkeeping, unlike the prefetch, also while an allocation sleeps).
    ///
    /// Best effort: falling short of a target is not an error, and neither
    /// is a driver out of memory (the device has no more for the targets;
    /// it ends the call early and counts in `maintain_failures`). Another
    /// driver failure is returned (`Error::Driver`) and keeps what was
    /// completed before it, with the arena consistent and nothing lost; it
    /// counts in `maintain_failures` too. Other
    /// threads' calls are not held up for the duration of its driver calls
    /// (see the module docs). Its driver calls count in
    /// `maintain_driver_calls`, not `caller_driver_calls`. If another
    /// thread (or the background worker) is maintaining, returns at once.
    pub fn maintain(&self) -> Result<()> {
        maintain(&self.sh).map(|_| ())
    }
}

/// Runs rounds until the targets are met or out of reach. Returns whether
/// anything was done (a round, or a completed free reaped).
pub(super) fn maintain(sh: &Shared) -> Result<bool> {
    let mut inner = sh.lock()?;
    if inner.maintaining {
        return Ok(false);
    }
    let ctx = sh.bg_ctx();
    // Everything is looked at now; what changes meanwhile sets it again.
    inner.st.prefetch_dirty = false;
    let mut progressed = reap(&mut inner.st, &ctx, Poll::All) > 0;
    // Old addresses of chunks reused on their stream, now idle.
    super::stream_reuse::unmap_completed(&mut inner.st, &ctx);
    if progressed {
        sh.round_done.notify_all();
    }
    inner.maintaining = true;
    let result = loop {
        let Some(round) = plan_round(&mut inner) else { break Ok(()) };
        // The round's chunks in flight count as held (and in the stats'
        // `pooled_bytes`) from now on: recorded in the peak before anyone
        // can read them, since a failed round takes them back.
        inner.st.note_peak();
        let (base, chunk) = (inner.st.base, inner.st.chunk);
        drop(inner);
        // Outside the lock: other threads' operations proceed meanwhile.
        let done = execute(&round, &ctx, base, chunk);
        inner = match sh.inner.lock() {
            Ok(g) => g,
            // A panic elsewhere poisoned the arena: every call fails from now on.
            Err(_) => return Err(super::poisoned()),
        };
        progressed = true;
        let failed = commit(&mut inner, round, done);
        // A round's pages commit where they now lie: if their allocation was
        // freed meanwhile they are cached at free pages, which are pooled,
        // and may carry the pool past the watermark that the free applied
        // (it could not count pages in flight). Applied now, before the next
        // round lets go of the lock: every other thread, and the stats,
        // find the watermark kept, also while this maintain goes on.
        super::pool::enforce_watermark(&mut inner, &ctx);
        sh.round_done.notify_all();
        match failed {
            Ok(()) => {}
            // The device has no memory for more: the target is out of
            // reach, which is no error (the contract), but it is counted.
            Err(Error::OutOfMemory(_)) => {
                inner.maintain_failures += 1;
                break Ok(());
            }
            Err(e) => {
                inner.maintain_failures += 1;
                break Err(e);
            }
        }
    };
    // And once more for what this call reaped first (completed frees
    // pooled), if no round applied it since.
    super::pool::enforce_watermark(&mut inner, &ctx);
    inner.maintaining = false;
    inner.st.note_peak();
    result.map(|()| progressed)
}

/// The awake growable allocations' map-ahead windows: (pages in the window
/// that hold no chunk yet and are not set aside), in address order.
fn missing_ahead(st: &State, ahead: u64) -> impl Iterator<Item = Vec<u64>> + '_ {
    st.by_start.values().filter_map(move |&slot| {
        let a = st.alloc(slot);
        if !a.maps_ahead() {
            return None;
        }
        let end = a.start + a.backed + ahead.min(a.reserved - a.backed);
        let missing: Vec<u64> = (a.start + a.backed..end)
            .filter(|&p| st.mapped[p as usize].is_none() && !st.set_aside.contains(&p))
            .collect();
        (!missing.is_empty()).then_some(missing)
    })
}

/// Pooled pages serving the targets now (for `Stats::prefetched_bytes`).
pub(super) fn prefetched_pages(st: &State) -> u64 {
    let (pre, ahead) = st.prefetch;
    let pooled = (st.pool.len() as u64).min(pre) + admission_ahead::cached_in(st, &st.admit_windows);
    if ahead == 0 {
        return pooled;
    }
    let mapped: u64 = st
        .by_start
        .values()
        .map(|&slot| {
            let a = st.alloc(slot);
            if !a.maps_ahead() {
                return 0;
            }
            let from = a.start + a.backed;
            st.cached.range(from..from + ahead.min(a.reserved - a.backed)).count() as u64
        })
        .sum();
    pooled + mapped
}

/// Plans the next round and sets its work aside, or `None` when there is
/// nothing to do (or nothing allowed: someone waits for memory, an
/// allocation sleeps, the capacity or `retain_bytes` is reached).
fn plan_round(inner: &mut Inner) -> Option<Round> {
    if inner.pressure_waiters > 0 || inner.stop_worker {
        return None;
    }
    let st = &mut inner.st;
    let (pre, ahead) = st.prefetch;
    if (pre == 0 && ahead == 0 && st.admit_ahead.is_off()) || st.asleep_pages > 0 {
        return None;
    }
    let room = st.cap_pages.saturating_sub(st.held_pages());
    let retain_room = if st.retain_bytes == u64::MAX {
        u64::MAX
    } else {
        (st.retain_bytes / st.chunk)
            .saturating_sub(st.pooled_pages() + st.small.reclaimable_slabs() + st.inflight_pages)
    };
    let create_room = room.min(retain_room);
    // Where the next admissions will be placed (kept for the plans, which
    // take other idle chunks before these windows').
    st.admit_windows = admission_ahead::windows(st);
    // (A separate statement: the scan's borrow ends before `st` changes.)
    let first = if ahead > 0 { missing_ahead(st, ahead).next() } else { None };
    if let Some(first) = first {
        // Sources in order of cost, none growing the footprint before a
        // create: the pool, then known-idle cached chunks no window holds.
        let need = first.len();
        let from_pool = need.min(st.pool.len());
        let spare = spare_idle(st, ahead, need - from_pool);
        let have = from_pool + spare.len();
        // Chunks for the whole window first, so that it is mapped in one
        // round with one access call.
        if have < need && create_room > 0 {
            let n = ((need - have) as u64).min(create_room).min(CREATES_PER_ROUND);
            st.inflight_pages += n;
            return Some(Round::Create(n));
        }
        if have == 0 {
            return None;
        }
        let pooled = st.pool.split_off(st.pool.len() - from_pool);
        let mv = Move { from: set_aside_idle(st, &spare), pooled, to: first[..have].to_vec() };
        st.inflight_pages += mv.chunks();
        st.set_aside.extend(mv.to.iter().copied());
        return Some(Round::Map(mv));
    }
    // Admission windows: from the pool and spare idle chunks only (no
    // create: they are the precreated chunks, mapped where the next
    // admission will be placed).
    if let Some(missing) = admission_ahead::first_missing(st, &st.admit_windows) {
        let need = missing.len();
        let from_pool = need.min(st.pool.len());
        let spare = spare_idle(st, ahead, need - from_pool);
        let have = from_pool + spare.len();
        if have > 0 {
            let pooled = st.pool.split_off(st.pool.len() - from_pool);
            let mv = Move { from: set_aside_idle(st, &spare), pooled, to: missing[..have].to_vec() };
            st.inflight_pages += mv.chunks();
            st.set_aside.extend(mv.to.iter().copied());
            return Some(Round::Map(mv));
        }
    }
    // Window chunks are precreated chunks too.
    let have = st.pool.len() as u64 + admission_ahead::cached_in(st, &st.admit_windows);
    if have < pre {
        // Known-idle cached chunks first: an unmap, no synchronize, and the
        // footprint stays; a create only when the arena holds none spare.
        let spare = spare_idle(st, ahead, (pre - have) as usize);
        if !spare.is_empty() {
            let mv = Move { from: set_aside_idle(st, &spare), pooled: Vec::new(), to: Vec::new() };
            st.inflight_pages += mv.chunks();
            return Some(Round::Map(mv));
        }
        if create_room > 0 {
            let n = (pre - have).min(create_room).min(CREATES_PER_ROUND);
            st.inflight_pages += n;
            return Some(Round::Create(n));
        }
    }
    None
}

/// Up to `want` known-idle cached pages (sorted) that no awake growable
/// allocation's map-ahead window and no admission window holds: chunks the arena holds and no
/// growth adopts soon, whose unmapping needs no synchronize.
fn spare_idle(st: &State, ahead: u64, want: usize) -> Vec<u64> {
    if want == 0 {
        return Vec::new();
    }
    let in_window = |p: u64| {
        if admission_ahead::in_windows(&st.admit_windows, p) {
            return true;
        }
        let Some((_, &slot)) = st.by_start.range(..=p).next_back() else { return false };
        let a = st.alloc(slot);
        if !a.maps_ahead() {
            return false;
        }
        let from = a.start + a.backed;
        (from..from + ahead.min(a.reserved - a.backed)).contains(&p)
    };
    // Free ranges' chunks before those of a live allocation's reservation
    // tail (its own growth adopts those with no driver call), and deepest
    // into their free range (or allocation) first: a new allocation placed
    // there adopts the cached chunks at its start, so those are the
    // likeliest to save a caller's driver calls.
    let depth = |p: u64| match st.free.containing(p) {
        Some((s, _)) => (1, p - s),
        None => (0, st.by_start.range(..=p).next_back().map_or(0, |(&s, _)| p - s)),
    };
    let mut spare: Vec<((u64, u64), u64)> =
        st.idle.iter().filter(|p| st.cached.contains(p) && !in_window(**p)).map(|&p| (depth(p), p)).collect();
    if spare.len() > want {
        spare.select_nth_unstable_by(want, |a, b| b.cmp(a));
        spare.truncate(want);
    }
    let mut pages: Vec<u64> = spare.into_iter().map(|(_, p)| p).collect();
    pages.sort_unstable();
    pages
}

/// Sets idle cached pages aside for a round: out of `cached` and `idle`
/// (no one else steals or adopts them), into `set_aside` (no one maps
/// there), still mapped in the books until the commit.
fn set_aside_idle(st: &mut State, pages: &[u64]) -> Vec<(u64, ChunkHandle)> {
    pages
        .iter()
        .map(|&p| {
            st.cached.remove(&p);
            st.forget_idle(p);
            st.set_aside.insert(p);
            (p, st.mapped[p as usize].expect("cached page is mapped"))
        })
        .collect()
}

/// What a round's driver calls produced (outside the lock).
struct Done {
    /// Chunks created (kept even if a later create failed).
    created: Vec<ChunkHandle>,
    /// For a map round: whether every map and access call succeeded (a
    /// failed round unmapped what it had mapped).
    error: Option<Error>,
}

fn execute(round: &Round, ctx: &super::Ctx<'_>, base: u64, chunk: u64) -> Done {
    let mut tx = Txn::new(ctx.drv, ctx.counts, ctx.unmaps, base, chunk);
    match round {
        Round::Create(n) => {
            let mut created = Vec::new();
            let mut error = None;
            for _ in 0..*n {
                match tx.create() {
                    Ok(h) => created.push(h),
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            // The chunks made are good: they go to the pool.
            tx.commit();
            Done { created, error }
        }
        Round::Map(mv) => {
            let moved = (|| {
                let from: Vec<u64> = mv.from.iter().map(|&(p, _)| p).collect();
                let mut i = 0;
                for run in runs(&from) {
                    let n = (run.end - run.start) as usize;
                    tx.unmap_idle(run.start, mv.from[i..i + n].iter().map(|&(_, h)| h).collect())?;
                    i += n;
                }
                for (p, h) in mv.targets() {
                    tx.map(p, h)?;
                }
                for run in runs(&mv.to) {
                    tx.set_access(run.start, run.end - run.start)?;
                }
                Ok::<_, Error>(())
            })();
            match moved {
                Ok(()) => {
                    tx.commit();
                    Done { created: Vec::new(), error: None }
                }
                Err(e) => {
                    // Unmaps what it mapped, maps `from` back.
                    tx.rollback();
                    Done { created: Vec::new(), error: Some(e) }
                }
            }
        }
    }
}

/// Books a round's outcome (under the lock). Returns its error, if any.
fn commit(inner: &mut Inner, round: Round, done: Done) -> Result<()> {
    let st = &mut inner.st;
    match round {
        Round::Create(n) => {
            st.inflight_pages -= n;
            st.pool.extend(done.created);
        }
        Round::Map(mv) => {
            st.inflight_pages -= mv.chunks();
            for p in mv.to.iter().chain(mv.from.iter().map(|(p, _)| p)) {
                st.set_aside.remove(p);
            }
            if done.error.is_none() {
                for &(p, _) in &mv.from {
                    st.mapped[p as usize] = None;
                }
                if mv.to.is_empty() {
                    st.pool.extend(mv.from.iter().map(|&(_, h)| h));
                }
                // Wherever the page lies now (its allocation's unbacked
                // tail, or free pages if it was freed or moved meanwhile),
                // a cached chunk that no work has used.
                for (p, h) in mv.targets() {
                    debug_assert!(st.mapped[p as usize].is_none(), "page {p} was set aside");
                    st.mapped[p as usize] = Some(h);
                    st.cached.insert(p);
                    st.idle.insert(p);
                }
            } else {
                // The transaction mapped `from` back: cached and idle again.
                for &(p, _) in &mv.from {
                    st.cached.insert(p);
                    st.idle.insert(p);
                }
                st.pool.extend(mv.pooled);
            }
        }
    }
    match done.error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
