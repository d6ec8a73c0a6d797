//! The pool and giving memory back: `trim` and the retain watermark.

use crate::driver::ChunkHandle;
use crate::error::Result;

use super::moves::forget_retired_pages;
use super::state::{self, State};
use super::stream::{reap, Poll};
use super::txn;
use super::{Arena, Ctx, Inner, Touch};

impl Arena {
    /// Gives pooled chunks back to the driver until at most `keep_bytes`
    /// (or the retain watermark, if lower) stay pooled; returns the bytes
    /// given back.
    ///
    /// Unlike every other operation, a driver failure here cannot undo what
    /// was already given back: chunks released before the failure stay
    /// released (and are counted), the rest stay pooled, and the error is
    /// returned. Nothing is leaked either way.
    ///
    /// A chunk to be given back may still be mapped at retired pages (the
    /// old range of an allocation that moved and was then freed or shrunk):
    /// those pages are unmapped first, so the memory really goes back. No
    /// other retired page is: a live allocation's old address stays valid
    /// (for its current size) until [`Arena::release_retired`], and the bytes
    /// returned never exceed what was pooled.
    ///
    /// Pooled means what `Stats::pooled_bytes` counts, slabs holding only
    /// retired small objects included: when the other pooled chunks are not
    /// enough to reach `keep_bytes`, the retired objects of as many such
    /// slabs as needed are released (after a device synchronize) and their
    /// chunks given back.
    ///
    /// Stream-ordered frees count as pooled while their events are pending:
    /// trim polls every pending event first (never waiting), so the memory
    /// of those that completed goes back too. Chunks a prefetch round has in
    /// flight count as pooled too: trim first waits for the round to land
    /// (one create or one map round at most), so that they go back as well.
    ///
    /// Chunks of an exported or DMA-BUF'd allocation whose release failed
    /// when it was freed (counted in `Stats::release_failures`; they never
    /// return to the pool, since a peer may still reach them) are released
    /// again here first, and counted in the bytes returned.
    pub fn trim(&self, keep_bytes: u64) -> Result<u64> {
        // Down to the retain watermark too, if it is lower: `run` would give
        // that back right after (pooled memory may exceed the watermark after
        // a failed give-back), and the bytes returned must count it.
        self.run(Touch::Everything, |inner, ctx, _| {
            #[cfg(unix)]
            let leftovers = super::export::release_leftovers(inner, ctx) * inner.st.chunk;
            #[cfg(not(unix))]
            let leftovers = 0;
            reap(&mut inner.st, ctx, Poll::All);
            let keep = keep_bytes.min(inner.st.retain_bytes);
            Ok(leftovers + trim_pool(&mut inner.st, ctx, keep)?)
        })
    }
}

/// Gives pooled chunks back until at most `keep_bytes` stay pooled.
///
/// A chunk about to be given back may still be mapped at retired pages
/// (the old range of an allocation that moved and was then freed or
/// shrunk) or at an old address that same-stream reuse keeps mapped until
/// its free's event completes. Its memory would outlive the release, so
/// those pages are unmapped first — only those: a pooled chunk backs no live allocation,
/// so no live allocation's old address loses a byte below its size, and
/// every other retired page (and retired small object) stays valid until
/// `release_retired`. Hence the bytes given back never exceed what was
/// pooled when the call began.
///
/// Pooled as `Stats::pooled_bytes` counts it: slabs holding only retired
/// objects too. Ordinary pooled chunks go first; only if they are not
/// enough are the retired objects of as many such slabs as still needed
/// released (their old places stop being mapped, after the device
/// synchronize that precedes the unmap of any page not known idle, as
/// when the arena needs retired memory) and their chunks given back.
/// That is done on a copy of the books, which replaces them once the
/// unmaps succeeded.
fn trim_pool(st: &mut State, ctx: &Ctx<'_>, keep_bytes: u64) -> Result<u64> {
    let keep = keep_bytes / st.chunk;
    let (pooled, slabs) = (st.pooled_pages(), st.small.reclaimable_slabs());
    if pooled + slabs <= keep {
        return Ok(0);
    }
    let excess = pooled + slabs - keep;
    if excess <= pooled {
        return give_back(st, ctx, excess as usize).map_err(|(e, _)| e);
    }
    let from_slabs = excess - pooled;
    let mut sim = st.clone();
    for slab in sim.small.release_idle_slabs(from_slabs) {
        sim.remove_alloc(slab);
    }
    let k = excess as usize;
    match give_back(&mut sim, ctx, k) {
        Ok(n) => {
            *st = sim;
            Ok(n)
        }
        // Unmapped and released some: the books are the copy's.
        Err((e, true)) => {
            *st = sim;
            Err(e)
        }
        Err((e, false)) => Err(e),
    }
}

/// Gives `k` pooled chunks back. On error, whether `st` changed (the
/// unmaps were committed and a release failed: the rest stay pooled).
fn give_back(st: &mut State, ctx: &Ctx<'_>, k: usize) -> std::result::Result<u64, (crate::Error, bool)> {
    // Unmapped pooled chunks first (giving them back needs no unmap of
    // theirs; the prefetcher's are the newest, at the end), then cached
    // chunks known idle (mapped ahead, or freed on a completed stream: no
    // synchronize), then the other cached ones, highest addresses first.
    let from_pool: Vec<ChunkHandle> = st.pool.iter().rev().take(k).copied().collect();
    let want = k - from_pool.len();
    let idle = st.cached.iter().rev().filter(|p| st.idle.contains(p));
    let busy = st.cached.iter().rev().filter(|p| !st.idle.contains(p));
    let mut cached_pages: Vec<u64> = idle.chain(busy).take(want).copied().collect();
    cached_pages.sort_unstable();
    let cached_chunks: Vec<ChunkHandle> =
        cached_pages.iter().map(|&p| st.mapped[p as usize].expect("cached page is mapped")).collect();
    let doomed: std::collections::HashSet<ChunkHandle> = from_pool.iter().chain(&cached_chunks).copied().collect();
    let retired_pages: Vec<u64> = st
        .retired
        .iter()
        .flat_map(|(&s, &l)| s..s + l)
        .filter(|&p| st.mapped[p as usize].is_some_and(|h| doomed.contains(&h)))
        .collect();
    // Old addresses that same-stream reuse keeps mapped (`stream_reuse.rs`)
    // map chunks too: those of doomed chunks go first, as retired pages do
    // (known idle once their event has completed; else after the device
    // wait of `unmap`).
    let deferred_pages: Vec<u64> = st
        .reuse
        .deferred
        .keys()
        .copied()
        .filter(|&p| st.mapped[p as usize].is_some_and(|h| doomed.contains(&h)))
        .collect();
    let deferred_idle = |p: u64| {
        let e = st.reuse.deferred[&p];
        e == 0 || !st.pending.iter().any(|x| x.event == e)
    };
    // Every unmap first, in one transaction (undoable until committed).
    let mut tx = ctx.txn(st);
    for run in state::runs(&deferred_pages) {
        let hs: Vec<_> = run.clone().map(|p| st.mapped[p as usize].expect("deferred page is mapped")).collect();
        let unmapped =
            if run.clone().all(deferred_idle) { tx.unmap_idle(run.start, hs) } else { tx.unmap(run.start, hs) };
        if let Err(e) = unmapped {
            tx.rollback();
            return Err((e, false));
        }
    }
    for run in state::runs(&retired_pages).into_iter().chain(state::runs(&cached_pages)) {
        let hs: Vec<_> = run.clone().map(|p| st.mapped[p as usize].expect("page is mapped")).collect();
        let unmapped = if run.clone().all(|p| st.idle.contains(&p)) {
            tx.unmap_idle(run.start, hs)
        } else {
            tx.unmap(run.start, hs)
        };
        if let Err(e) = unmapped {
            tx.rollback();
            return Err((e, false));
        }
    }
    tx.commit();
    for &p in &deferred_pages {
        st.reuse.deferred.remove(&p);
        st.mapped[p as usize] = None;
    }
    forget_retired_pages(st, &retired_pages);
    for &p in &cached_pages {
        st.cached.remove(&p);
        st.forget_idle(p);
        st.mapped[p as usize] = None;
    }
    st.pool.truncate(st.pool.len() - from_pool.len());
    // Then the releases, which cannot be undone: a failure keeps the rest pooled.
    let chunks: Vec<ChunkHandle> = from_pool.into_iter().chain(cached_chunks).collect();
    let mut released = 0u64;
    for (i, &h) in chunks.iter().enumerate() {
        if let Err(e) = txn::release(ctx.drv, ctx.counts, h) {
            st.pool.extend_from_slice(&chunks[i..]);
            return Err((e, true));
        }
        released += st.chunk;
    }
    Ok(released)
}

/// After an operation (a free, a shrink, a release of retired ranges that
/// emptied a slab): give back pooled memory beyond the retain watermark.
/// Best effort: the operation itself has succeeded, so a driver failure
/// only keeps the memory pooled (counted in `release_failures`).
///
/// Pooled as in `Stats::pooled_bytes`: slabs holding only retired objects
/// count (see `trim_pool`), and so do the chunks a prefetch round has in
/// flight: they land in the pool or in a window when the
/// round commits, so the pool keeps room for them and the watermark holds
/// whenever the lock is free, also while a round runs.
pub(super) fn enforce_watermark(inner: &mut Inner, ctx: &Ctx<'_>) {
    let st = &mut inner.st;
    let inflight = st.inflight_pages * st.chunk;
    if st.retain_bytes == u64::MAX
        || (st.pooled_pages() + st.small.reclaimable_slabs()) * st.chunk + inflight <= st.retain_bytes
    {
        return;
    }
    if trim_pool(st, ctx, st.retain_bytes.saturating_sub(inflight)).is_err() {
        inner.release_failures += 1;
    }
}
