//! Plans: the driver work that places chunks at a run of pages, computed
//! from the state without changing it (`Plan::new`, `Plan::for_ranges`),
//! performed (`Plan::execute`, inside the caller's transaction) and applied
//! to the books (`Plan::apply`, infallible).

use super::state::State;
use super::stream_reuse::{self, Taken};
use super::txn::{runs, Txn};
use crate::driver::ChunkHandle;
use crate::error::{Error, Result};

/// The message of the `Error::Internal` a plan returns when it needs a page
/// the prefetcher has set aside. It never reaches a caller: `Arena::run`
/// waits for the prefetcher to commit and retries the operation (which,
/// being all or nothing, changed nothing).
pub(crate) const SET_ASIDE: &str = "a page is set aside by the prefetcher";

/// Cached chunks taken at once when a plan must unmap some (see `Plan::new`).
const STEAL_BATCH: usize = 16;

/// Where a page's chunk comes from in a [`Plan`].
#[derive(Clone, Copy, Debug)]
enum Source {
    /// A chunk that is already the caller's (a moved allocation's own).
    Known(ChunkHandle),
    /// The next chunk from the plan's fresh sources.
    Fresh,
}

/// Cached pages to steal, in the order given, except that pages in a live
/// allocation's reservation (beyond its backed prefix: chunks its own
/// growth adopts with no driver call) come after every page of a free
/// range: a chunk stolen from a tail is one its owner's growth must map
/// again, one stolen from a free range only one a later placement there
/// might have adopted.
fn steal_order<'a>(st: &'a State, pages: impl Iterator<Item = &'a u64> + Clone + 'a) -> impl Iterator<Item = u64> + 'a {
    let in_tail = move |p: u64| {
        st.by_start.range(..=p).next_back().is_some_and(|(&start, &slot)| p < start + st.alloc(slot).reserved)
    };
    let free = pages.clone().copied().filter(move |&p| !in_tail(p));
    let tails = pages.copied().filter(move |&p| in_tail(p));
    free.chain(tails)
}

/// The driver work that places chunks at a run of pages, computed from the
/// state without changing it, then executed, then applied.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Cached pages whose chunks must be unmapped (stolen, or evicted from
    /// where a moved allocation lands); their chunks become fresh sources.
    unmap: Vec<u64>,
    take_pool: usize,
    create: usize,
    maps: Vec<(u64, Source)>,
    /// Cached pages adopted where they are.
    adopt: Vec<u64>,
    /// Events to wait for before adopting: those of adopted pages whose
    /// last user's stream may still write them (`State::busy_event`).
    wait: Vec<u64>,
    /// Chunks taken by same-stream reuse, and deferred pages to unmap.
    reuse: Taken,
    // Filled in by `execute`.
    unmapped_chunks: Vec<ChunkHandle>,
    fresh: Vec<ChunkHandle>,
    mapped: Vec<(u64, ChunkHandle)>,
}

impl Plan {
    /// Plans `pages` (in order) to receive `known` chunks first, then fresh
    /// ones; cached pages that need a fresh chunk are adopted in place, cached
    /// pages that receive a known chunk are evicted. `keep` is a page range
    /// whose cached chunks must not be stolen.
    pub fn new(
        st: &State,
        known: &[ChunkHandle],
        pages: std::ops::Range<u64>,
        keep: std::ops::Range<u64>,
    ) -> Result<Plan> {
        let sources: Vec<Option<ChunkHandle>> =
            (0..pages.end - pages.start).map(|i| known.get(i as usize).copied()).collect();
        Plan::build(st, &sources, &[(pages, keep)])
    }

    /// Like [`Plan::new`], with a known chunk (or none: a fresh one) for
    /// each page of `pages`.
    pub fn with_sources(
        st: &State,
        sources: &[Option<ChunkHandle>],
        pages: std::ops::Range<u64>,
        keep: std::ops::Range<u64>,
    ) -> Result<Plan> {
        Plan::build(st, sources, &[(pages, keep)])
    }

    /// Plans fresh chunks for several page ranges at once (growth of
    /// several allocations): one choice of sources, at most one device
    /// synchronize, one access call per contiguous run across all of them.
    /// Each range comes with the range whose cached chunks it keeps.
    pub fn for_ranges(st: &State, ranges: &[(std::ops::Range<u64>, std::ops::Range<u64>)]) -> Result<Plan> {
        Plan::build(st, &[], ranges)
    }

    /// `sources` (a known chunk or a fresh one, per page) applies to the
    /// first range only; the others get fresh chunks.
    fn build(
        st: &State,
        sources: &[Option<ChunkHandle>],
        ranges: &[(std::ops::Range<u64>, std::ops::Range<u64>)],
    ) -> Result<Plan> {
        let mut plan = Plan::default();
        let mut fresh_needed = 0u64;
        if !st.set_aside.is_empty()
            && ranges.iter().any(|(pages, _)| st.set_aside.range(pages.clone()).next().is_some())
        {
            return Err(Error::Internal(SET_ASIDE.into()));
        }
        for (r, (pages, _)) in ranges.iter().enumerate() {
            stream_reuse::evict_in(st, &mut plan.reuse, pages.clone());
            for (i, p) in pages.clone().enumerate() {
                let cached_here = st.cached.contains(&p);
                let known = if r == 0 { sources.get(i).copied().flatten() } else { None };
                match known {
                    Some(h) => {
                        if cached_here {
                            plan.unmap.push(p);
                        }
                        plan.maps.push((p, Source::Known(h)));
                    }
                    None if cached_here => {
                        if let Some(e) = st.busy_event(p).filter(|e| !plan.wait.contains(e)) {
                            plan.wait.push(e);
                        }
                        plan.adopt.push(p);
                    }
                    None => {
                        plan.maps.push((p, Source::Fresh));
                        fresh_needed += 1;
                    }
                }
            }
        }
        // Regions whose cached chunks are spoken for (each range and its keep).
        let regions: Vec<std::ops::Range<u64>> =
            ranges.iter().map(|(p, k)| k.start.min(p.start)..k.end.max(p.end)).collect();
        let outside = |p: &u64| !regions.iter().any(|r| r.contains(p));
        // Sources in order of cost: evicted chunks (already being unmapped),
        // unmapped pool, idle cached chunks (an unmap, no synchronize),
        // other cached chunks (an unmap after a synchronize), new chunks (a
        // create).
        let mut have = plan.unmap.len() as u64;
        plan.take_pool = (fresh_needed.saturating_sub(have)).min(st.pool.len() as u64) as usize;
        have += plan.take_pool as u64;
        if have < fresh_needed {
            let want = (fresh_needed - have) as usize;
            // Chunks waiting in admission windows last (see
            // `admission_ahead.rs`): the next admission adopts them.
            let windows = &st.admit_windows;
            let usable = |p: &&u64| st.cached.contains(p) && outside(p);
            let in_window = |p: &&u64| super::admission_ahead::in_windows(windows, **p);
            // A live allocation's reservation tail is its own growth's to
            // adopt: cached chunks of free ranges go first (see
            // `steal_order`).
            let idle: Vec<u64> = steal_order(st, st.idle.iter().rev().filter(|p| usable(p) && !in_window(p)))
                .chain(st.idle.iter().rev().filter(|p| usable(p) && in_window(p)).copied())
                .take(want)
                .collect();
            have += idle.len() as u64;
            plan.unmap.extend(idle);
        }
        if have < fresh_needed {
            // Memory given up on this operation's stream: no wait, no unmap.
            let evictions = std::mem::take(&mut plan.reuse);
            plan.reuse = stream_reuse::pick(st, (fresh_needed - have) as usize, &outside).with_evictions(evictions);
            have += plan.reuse.count();
        }
        if have < fresh_needed {
            // Unmapping needs a device synchronize: take a batch at once,
            // the extra chunks going to the unmapped pool, so that growth
            // token by token synchronizes once per batch, not per chunk.
            let want = ((fresh_needed - have) as usize).max(STEAL_BATCH);
            let stolen: Vec<u64> = steal_order(
                st,
                st.cached.iter().rev().filter(|p| !st.idle.contains(p) && outside(p) && !plan.reuse.takes(**p)),
            )
            .take(want)
            .collect();
            have += stolen.len() as u64;
            plan.unmap.extend(stolen);
        }
        let room = st.cap_pages.saturating_sub(st.held_pages());
        if have + room < fresh_needed {
            // Last resort before running out of memory: the cached chunks
            // the keeps protect (the reservations' own unbacked pages).
            let mut want = (fresh_needed - have - room) as usize;
            for (pages, keep) in ranges {
                let tail = st.cached.range(pages.end.max(keep.start)..keep.end.max(pages.end)).rev();
                let head = st.cached.range(keep.start.min(pages.start)..pages.start).rev();
                let stolen: Vec<u64> = tail
                    .chain(head)
                    .filter(|p| !plan.unmap.contains(p) && !plan.reuse.takes(**p))
                    .copied()
                    .take(want)
                    .collect();
                want -= stolen.len();
                have += stolen.len() as u64;
                plan.unmap.extend(stolen);
            }
        }
        if have < fresh_needed {
            plan.create = (fresh_needed - have) as usize;
            if plan.create as u64 > room {
                return Err(Error::OutOfMemory(format!(
                    "{} more chunks of {} bytes needed, capacity allows {}",
                    plan.create, st.chunk, room
                )));
            }
        }
        plan.unmap.sort_unstable();
        plan.unmap.dedup();
        plan.maps.sort_unstable_by_key(|&(p, _)| p);
        Ok(plan)
    }

    /// Performs the plan's driver calls. On error the caller rolls `tx` back;
    /// the state is untouched either way.
    pub fn execute(&mut self, st: &State, tx: &mut Txn<'_>) -> Result<()> {
        for &event in &self.wait {
            tx.wait_event(event)?;
        }
        stream_reuse::execute_evictions(st, &self.reuse, tx)?;
        for run in runs(&self.unmap) {
            // Idle pages need no synchronize; a run is unmapped in pieces
            // of equal idleness (each page is one whole mapping).
            let mut at = run.start;
            while at < run.end {
                let idle = st.idle.contains(&at);
                let mut end = at + 1;
                while end < run.end && st.idle.contains(&end) == idle {
                    end += 1;
                }
                let chunks: Vec<ChunkHandle> =
                    (at..end).map(|p| st.mapped[p as usize].expect("cached page is mapped")).collect();
                if idle {
                    tx.unmap_idle(at, chunks.clone())?;
                } else {
                    tx.unmap(at, chunks.clone())?;
                }
                self.unmapped_chunks.extend(chunks);
                at = end;
            }
        }
        // Reused chunks first: every one is used (they are still mapped).
        self.fresh = stream_reuse::chunks(st, &self.reuse);
        self.fresh.extend(self.unmapped_chunks.iter().copied());
        self.fresh.extend(st.pool[st.pool.len() - self.take_pool..].iter().rev());
        for _ in 0..self.create {
            let h = tx.create()?;
            self.fresh.push(h);
        }
        let mut next_fresh = 0;
        for &(p, src) in &self.maps {
            let h = match src {
                Source::Known(h) => h,
                Source::Fresh => {
                    next_fresh += 1;
                    self.fresh[next_fresh - 1]
                }
            };
            tx.map(p, h)?;
            self.mapped.push((p, h));
        }
        self.fresh.drain(..next_fresh);
        let pages: Vec<u64> = self.mapped.iter().map(|&(p, _)| p).collect();
        for run in runs(&pages) {
            tx.set_access(run.start, run.end - run.start)?;
        }
        Ok(())
    }

    /// Applies an executed plan to the state (infallible).
    pub fn apply(self, st: &mut State) {
        stream_reuse::apply(st, &self.reuse);
        for &p in &self.unmap {
            st.cached.remove(&p);
            st.forget_idle(p);
            st.mapped[p as usize] = None;
        }
        let keep = st.pool.len() - self.take_pool;
        st.pool.truncate(keep);
        // Unused fresh chunks (evicted beyond need) go to the pool.
        st.pool.extend(self.fresh.iter().copied());
        for &p in &self.adopt {
            st.cached.remove(&p);
            st.forget_idle(p);
        }
        for &(p, h) in &self.mapped {
            st.mapped[p as usize] = Some(h);
        }
        if !self.adopt.is_empty() || !self.mapped.is_empty() {
            st.prefetch_dirty = true;
        }
    }
}
