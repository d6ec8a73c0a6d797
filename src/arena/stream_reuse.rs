//! Same-stream reuse: memory given up on a stream serves work ordered on
//! that same stream at once.
//!
//! Memory freed (`free_on_stream`) or shrunk (`resize_on_stream`) on stream
//! S may still be used by work queued on S before the free. Work queued on
//! S afterwards runs after that work, so an allocation whose work is
//! ordered on S (`alloc_on_stream`, growth by `resize_on_stream`) may take
//! those chunks without waiting for the free's event and without a device
//! synchronize. Work on any other stream is not ordered after it: reuse
//! from another stream still waits for the event (`stream::reclaim`), or
//! synchronizes to steal, as before.
//!
//! A chunk taken this way is mapped at its new address at once; its old
//! address stays mapped (the old owner's queued work may still reach the
//! chunk through it) and is listed in [`StreamReuse::deferred`] with the
//! event after which no work uses it. When that event completes
//! (`stream::complete`), the old address is unmapped with no synchronize.
//! A deferred page is neither cached nor retired: it maps a chunk that
//! backs another page. A plan that needs the page itself unmaps it first
//! (with no synchronize once its event has completed, after one before).
//!
//! Which memory an operation on S may take this way (cheapest first, after
//! the pool and idle cached chunks, before cached chunks that need a
//! synchronize): cached pages a shrink or a quiesced allocation left on S
//! whose event is pending (`State::pending_idle`), then the tail pages of
//! allocations freed on S whose event is pending (`Held::Chunks`: such an
//! allocation's backed prefix shrinks; its pages stay reserved until its
//! event completes). A page whose chunk another allocation maps too
//! (`Arena::alloc_shared`) is never taken.

use std::collections::{BTreeMap, HashSet};

use super::state::{Held, State};
use super::txn::Txn;
use super::Ctx;
use crate::driver::ChunkHandle;
use crate::error::Result;

/// The arena's same-stream bookkeeping (part of `State`).
#[derive(Clone, Debug, Default)]
pub(crate) struct StreamReuse {
    /// The stream the running operation's work is ordered on: set by
    /// `alloc_on_stream` and `resize_on_stream` for their duration only.
    pub op_stream: Option<u64>,
    /// Old addresses of taken chunks, still mapped: page -> the event
    /// after which no work uses it (0: already complete).
    pub deferred: BTreeMap<u64, u64>,
    /// For tests only (`Arena::ignore_stream_order_for_tests`): every
    /// stream counts as the operation's, which breaks the rule.
    pub ignore_order: bool,
    /// Chunks taken so, ever.
    pub reused: u64,
}

/// What a plan takes by same-stream reuse, and the deferred pages it must
/// unmap because it maps there.
#[derive(Clone, Debug, Default)]
pub(crate) struct Taken {
    /// Cached pages with a pending event on the operation's stream.
    cached: Vec<(u64, u64)>,
    /// (slot, pages taken from the end of its backed prefix, event) of
    /// allocations freed on the operation's stream.
    pending: Vec<(u32, u64, u64)>,
    /// Deferred pages inside the plan's ranges: (page, whether idle).
    evict: Vec<(u64, bool)>,
}

impl Taken {
    /// These chunks, with the evictions `other` planned.
    pub fn with_evictions(mut self, other: Taken) -> Taken {
        self.evict = other.evict;
        self
    }

    /// Whether it takes cached page `p` (no other source of the plan may).
    pub fn takes(&self, p: u64) -> bool {
        self.cached.iter().any(|&(q, _)| q == p)
    }

    pub fn count(&self) -> u64 {
        self.cached.len() as u64 + self.pending.iter().map(|&(_, n, _)| n).sum::<u64>()
    }
}

/// The pending events whose work the running operation's stream is
/// ordered after (recorded on that stream).
fn same_stream_events(st: &State) -> HashSet<u64> {
    let Some(s) = st.reuse.op_stream else { return HashSet::new() };
    st.pending.iter().filter(|p| !p.waited && (p.stream == s || st.reuse.ignore_order)).map(|p| p.event).collect()
}

/// Chunks held by frees the running operation could take by same-stream
/// reuse (for the out-of-memory checks made before planning).
pub(crate) fn takeable(st: &State) -> u64 {
    if st.reuse.op_stream.is_none() || st.pending.is_empty() {
        return 0;
    }
    // Cached pages count among the pooled ones already.
    pick(st, usize::MAX, &|_| true).pending.iter().map(|&(_, n, _)| n).sum()
}

/// Picks up to `want` chunks for the running operation; `outside` says
/// which cached pages no range of the plan keeps.
pub(crate) fn pick(st: &State, want: usize, outside: &dyn Fn(&u64) -> bool) -> Taken {
    let mut t = Taken::default();
    let events = same_stream_events(st);
    if events.is_empty() || want == 0 {
        return t;
    }
    let mut left = want;
    for (&p, &e) in st.pending_idle.iter().rev() {
        if left == 0 {
            break;
        }
        if events.contains(&e) && st.cached.contains(&p) && !st.idle.contains(&p) && outside(&p) {
            t.cached.push((p, e));
            left -= 1;
        }
    }
    for entry in &st.pending {
        if left == 0 {
            break;
        }
        let Held::Chunks(slot) = entry.what else { continue };
        if !events.contains(&entry.event) {
            continue;
        }
        let a = st.alloc(slot);
        let n = (a.start..a.start + a.backed).rev().take_while(|&p| !st.page_shared(p)).take(left).count() as u64;
        if n > 0 {
            t.pending.push((slot, n, entry.event));
            left -= n as usize;
        }
    }
    t
}

/// A new allocation on the operation's stream takes over, in place, an
/// allocation freed on that stream whose event is pending: same
/// reservation size and kind (a non-growable one with exactly `pages`
/// backed), no chunk shared. Its pages are mapped already, so this makes
/// no driver call: the new owner's work, queued on the same stream, runs
/// after the old owner's. Backed pages beyond `pages` become cached in the
/// reservation, known idle when the free's event completes (the free's
/// entry stays pending for them, as a shrink's); pages short of `pages`
/// are left to the caller to grow (`backed` says how many are mapped).
/// Returns the slot, under a new generation (the old id stays dead).
pub(crate) fn take_over_pending(st: &mut State, pages: u64, reserved: u64, size: u64, growable: bool) -> Option<u32> {
    let events = same_stream_events(st);
    if events.is_empty() {
        return None;
    }
    let mut best: Option<(u64, usize)> = None;
    for (i, p) in st.pending.iter().enumerate() {
        let Held::Chunks(slot) = p.what else { continue };
        if !events.contains(&p.event) || st.slots[slot as usize].generation >= crate::id::MAX_GENERATION {
            continue;
        }
        let a = st.alloc(slot);
        let fits = a.reserved == reserved && a.growable == growable && (growable || a.backed == pages);
        if !fits || (a.start..a.start + a.backed).any(|q| st.page_shared(q)) {
            continue;
        }
        // The fewest pages to give up, else the fewest to map.
        let cost = if a.backed >= pages { a.backed - pages } else { (pages - a.backed) << 32 };
        if best.map_or(true, |(c, _)| cost < c) {
            best = Some((cost, i));
        }
    }
    let (_, i) = best?;
    let entry = st.pending[i];
    let Held::Chunks(slot) = entry.what else { unreachable!("chosen above") };
    let (start, backed) = (st.alloc(slot).start, st.alloc(slot).backed);
    let excess = backed.saturating_sub(pages);
    st.slots[slot as usize].generation += 1;
    if excess > 0 {
        for q in st.shrink_backing(slot, pages) {
            debug_assert!(false, "page {q} is shared");
        }
        for q in start + pages..start + pages + excess {
            st.pending_idle.insert(q, entry.event);
        }
    }
    st.pending[i].what = Held::Pages { first: start + pages, count: excess };
    let m = st.alloc_mut(slot);
    m.owner = super::state::Owner::User;
    m.size = size;
    m.quiet = super::state::Quiet::No;
    m.tag = 0;
    st.live_bytes += size;
    st.live_count += 1;
    st.reuse.reused += pages.min(backed);
    st.prefetch_dirty = true;
    Some(slot)
}

/// Deferred pages among `pages`: a plan mapping there unmaps them first.
pub(crate) fn evict_in(st: &State, t: &mut Taken, pages: std::ops::Range<u64>) {
    for (&p, &e) in st.reuse.deferred.range(pages) {
        let idle = e == 0 || !st.pending.iter().any(|x| x.event == e);
        t.evict.push((p, idle));
    }
}

/// The taken chunks, in the order a plan uses them.
pub(crate) fn chunks(st: &State, t: &Taken) -> Vec<ChunkHandle> {
    let mut out: Vec<ChunkHandle> = t.cached.iter().map(|&(p, _)| st.mapped[p as usize].expect("cached")).collect();
    for &(slot, n, _) in &t.pending {
        let a = st.alloc(slot);
        let end = a.start + a.backed;
        out.extend((end - n..end).map(|p| st.mapped[p as usize].expect("backing page is mapped")));
    }
    out
}

/// Unmaps the deferred pages a plan maps over (before anything else it does).
pub(crate) fn execute_evictions(st: &State, t: &Taken, tx: &mut Txn<'_>) -> Result<()> {
    for &(p, idle) in &t.evict {
        let h = vec![st.mapped[p as usize].expect("deferred page is mapped")];
        if idle {
            tx.unmap_idle(p, h)?;
        } else {
            tx.unmap(p, h)?;
        }
    }
    Ok(())
}

/// The bookkeeping of an executed plan's reuse (infallible).
pub(crate) fn apply(st: &mut State, t: &Taken) {
    for &(p, _) in &t.evict {
        st.reuse.deferred.remove(&p);
        st.mapped[p as usize] = None;
    }
    for &(p, e) in &t.cached {
        st.cached.remove(&p);
        st.forget_idle(p);
        st.reuse.deferred.insert(p, e);
    }
    for &(slot, n, e) in &t.pending {
        let a = st.alloc(slot).clone();
        let end = a.start + a.backed;
        for p in end - n..end {
            st.reuse.deferred.insert(p, e);
        }
        st.alloc_mut(slot).backed -= n;
        st.backed_pages -= n;
    }
    st.reuse.reused += t.count();
}

/// `event` has completed: the old addresses it kept mapped are used by no
/// work now. They stay mapped, known idle, for [`unmap_completed`] (run by
/// `maintain`, between an engine's steps, and by `sleep`): the poll that
/// sees the event complete is often an operation on the critical path, and
/// the unmaps need not be there.
pub(crate) fn complete(st: &mut State, event: u64) {
    for e in st.reuse.deferred.values_mut() {
        if *e == event {
            *e = 0;
        }
    }
}

/// Unmaps the deferred pages whose event has completed, with no
/// synchronize (a run of pages as `unmap.rs` unmaps runs). A failed unmap keeps its
/// pages deferred, known idle, for the next try or for a plan mapping
/// there.
pub(crate) fn unmap_completed(st: &mut State, ctx: &Ctx<'_>) {
    let pages: Vec<u64> = st.reuse.deferred.iter().filter(|&(_, &e)| e == 0).map(|(&p, _)| p).collect();
    for run in super::state::runs(&pages) {
        let chunks: Vec<ChunkHandle> = run.clone().map(|p| st.mapped[p as usize].expect("deferred page")).collect();
        // As every run is unmapped (`unmap.rs`): one call, or one per page.
        let (addr, chunk) = (st.addr(run.start), st.chunk);
        if super::unmap::unmap_run(ctx.drv, ctx.counts, ctx.unmaps, addr, chunk, &chunks).is_ok() {
            for p in run {
                st.reuse.deferred.remove(&p);
                st.mapped[p as usize] = None;
            }
        }
    }
}

impl super::Arena {
    /// Allocates like [`Arena::alloc`](super::Arena::alloc), for work
    /// ordered on `stream` (a `CUstream`; 0 is the legacy default stream):
    /// the caller queues every use of the new memory on `stream`, after
    /// the work queued there so far. The allocation may then take memory
    /// freed ([`free_on_stream`](super::Arena::free_on_stream)) or shrunk
    /// ([`resize_on_stream`](super::Arena::resize_on_stream)) on the same
    /// stream at once, with no event wait and no device synchronize:
    /// stream order runs the old owner's queued work first. Memory given
    /// up on another stream is reused only as by `alloc` (after its event
    /// has completed, waiting for it if nothing else can serve). A reused
    /// chunk is mapped at the new address at once; its old address is
    /// unmapped once the free's event has completed.
    ///
    /// A small allocation (it lives in a slab whose other objects may be
    /// used on any stream) is placed exactly as by `alloc`. Errors: as
    /// `alloc`.
    pub fn alloc_on_stream(&self, size: u64, stream: u64) -> Result<(crate::Id, u64)> {
        self.alloc_inner(size, size, false, 0, super::alloc::Placing::Any, Some(stream))
    }

    /// [`alloc_growable`](super::Arena::alloc_growable) for work ordered
    /// on `stream`, as [`alloc_on_stream`](super::Arena::alloc_on_stream);
    /// growing it with `resize_on_stream` on the same stream reuses that
    /// stream's memory too.
    pub fn alloc_growable_on_stream(&self, size: u64, max_size: u64, stream: u64) -> Result<(crate::Id, u64)> {
        if max_size < size {
            return Err(crate::Error::invalid(format!("max_size {max_size} < size {size}")));
        }
        self.alloc_inner(size, max_size, true, 0, super::alloc::Placing::Any, Some(stream))
    }

    /// [`resize_many`](super::Arena::resize_many) whose growth is work
    /// ordered on `stream`: it may take memory freed or shrunk on the same
    /// stream at once, as [`alloc_on_stream`](super::Arena::alloc_on_stream)
    /// does (a decode batch growing on the engine's stream). Shrinks in the
    /// batch are plain shrinks (no event is recorded). Errors: as
    /// `resize_many`.
    pub fn resize_many_on_stream(&self, requests: &[(crate::Id, u64)], stream: u64) -> Result<Vec<u64>> {
        self.resize_many_ordered(requests, Some(stream))
    }

    /// Chunks that operations ordered on a stream took, ever, from memory
    /// given up on that same stream before its event completed.
    pub fn stream_reused_chunks(&self) -> Result<u64> {
        Ok(self.sh.inner.lock().map_err(|_| super::poisoned())?.st.reuse.reused)
    }

    /// For tests only: when `on`, an operation on any stream reuses memory
    /// given up on every stream as if it were its own, which breaks stream
    /// order (the old owner's queued work may write into the new owner's
    /// memory). It exists so that a test can show the violation is
    /// detectable; never set it otherwise.
    #[doc(hidden)]
    pub fn ignore_stream_order_for_tests(&self, on: bool) -> Result<()> {
        self.sh.inner.lock().map_err(|_| super::poisoned())?.st.reuse.ignore_order = on;
        Ok(())
    }
}
