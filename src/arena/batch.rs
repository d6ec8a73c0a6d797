//! `resize_many`: the growth of many allocations in one step (an engine
//! growing every running sequence's KV cache before a decode step).
//!
//! When every request is a shrink or a growth in place (inside its
//! reservation, or into the free pages right after it), the growths are
//! planned together ([`Plan::for_ranges`]): one choice of chunk sources for
//! all of them, out-of-memory decided before any driver call, at most one
//! device synchronize, and one access call per contiguous run of newly
//! mapped pages across all of them. Otherwise each request runs in turn,
//! shrinks first, on a copy of the books and one transaction (one
//! synchronize at most, still), which replaces the books only if every
//! request succeeded. That run is made twice: first over a driver that does
//! nothing ([`DryRun`]), so that every refusal (out of memory, of address
//! space, pinned) comes before any real driver call and never needs a
//! rollback; then for real, where only a driver failure can stop it.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::Id;

use super::alloc::{resize_target, small_asleep, small_ptr, Target};
use super::dry_run::DryRun;
use super::state::{Plan, Quiet, State};
use super::txn::{Counters, Txn};
use super::{pages_for, Arena, Ctx, Touch};

impl Arena {
    /// Resizes several allocations at once, all or nothing: on success
    /// returns each one's address after the whole batch (in request order;
    /// an allocation may move when it outgrows its reservation, or when
    /// another request's compaction moves it); on failure none of them has
    /// changed. Each request means what [`Arena::resize`] means for it.
    ///
    /// Errors, in this precedence: `InvalidArgument` (a size of 0 or one
    /// that overflows, the same id twice, an import, the shrink of an
    /// exported allocation below the chunks it exported), `UnknownAllocation`, `Asleep`,
    /// then `Pinned`, `OutOfMemory`, `OutOfAddressSpace` as the requests
    /// meet them. An empty batch does nothing.
    pub fn resize_many(&self, requests: &[(Id, u64)]) -> Result<Vec<u64>> {
        self.resize_many_ordered(requests, None)
    }

    /// The body of `resize_many`, and of `resize_many_on_stream` (growth
    /// ordered on `stream`: see `stream_reuse.rs`).
    pub(super) fn resize_many_ordered(&self, requests: &[(Id, u64)], stream: Option<u64>) -> Result<Vec<u64>> {
        let chunk = self.chunk;
        let pages: Vec<u64> =
            requests.iter().map(|&(_, size)| pages_for(size, chunk, "new_size")).collect::<Result<_>>()?;
        let mut seen = HashSet::with_capacity(requests.len());
        if let Some(&(id, _)) = requests.iter().find(|&&(id, _)| !seen.insert(id)) {
            return Err(Error::invalid(format!("id {:#x} appears twice in one resize_many", id.get())));
        }
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Id> = requests.iter().map(|&(id, _)| id).collect();
        self.run(Touch::Nothing, |inner, ctx, events| {
            // Cleared by `run` when the closure returns.
            inner.st.reuse.op_stream = stream;
            // What `resize` refuses: an import, an exported allocation's
            // shrink below the chunks it exported.
            #[cfg(unix)]
            for (&id, &np) in ids.iter().zip(&pages) {
                inner.shares.check_resize(&inner.st, id, np)?;
            }
            let st = &mut inner.st;
            let targets: Vec<Target> = ids.iter().map(|&id| st.resolve(id)).collect::<Result<_>>()?;
            // Every request's state before any request's work: a sleeping
            // allocation, small ones included, is ASLEEP whatever an earlier
            // request would meet.
            for (t, &id) in targets.iter().zip(&ids) {
                let asleep = match *t {
                    Target::Chunks(slot) => st.alloc(slot).sleep.is_some(),
                    Target::Small(ss) => small_asleep(st, ss),
                };
                if asleep {
                    return Err(Error::Asleep(id.get()));
                }
            }
            if let Some(ptrs) = in_place_together(st, ctx, &targets, requests, &pages)? {
                return Ok(ptrs);
            }
            // Each in turn: shrinks first, so growth can use what they give.
            let mut order: Vec<usize> = (0..requests.len()).collect();
            order.sort_by_key(|&i| match targets[i] {
                Target::Chunks(slot) => pages[i] > st.alloc(slot).backed,
                Target::Small(_) => true,
            });
            // Every request in turn, on a copy of the books and `tx`.
            let run_all = |sim: &mut State, tx: &mut Txn<'_>, evs: &mut Vec<_>| -> Result<Vec<u64>> {
                for &i in &order {
                    // A request may have moved or promoted another's
                    // allocation: resolve on the books as they are now.
                    let target = sim.resolve(ids[i])?;
                    resize_target(sim, tx, target, ids[i], pages[i], requests[i].1, evs)?;
                }
                ids.iter().map(|&id| address_of(sim, id)).collect()
            };
            // First over a driver that does nothing: a request refused after
            // earlier ones made driver calls would need a rollback, whose
            // own calls may fail. So every refusal comes before any call.
            {
                let (dry, counts) = (DryRun::new(st.chunk), Counters::default());
                let mut tx = Txn::new(&dry, &counts, ctx.unmaps, st.base, st.chunk);
                let planned = run_all(&mut st.clone(), &mut tx, &mut Vec::new());
                tx.commit();
                planned?;
            }
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            let mut evs = Vec::new();
            let done = run_all(&mut sim, &mut tx, &mut evs);
            match done {
                Ok(ptrs) => {
                    tx.commit();
                    *st = sim;
                    events.extend(evs);
                    Ok(ptrs)
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }
}

/// The current address of a live id.
fn address_of(st: &State, id: Id) -> Result<u64> {
    Ok(match st.resolve(id)? {
        Target::Chunks(slot) => st.addr(st.alloc(slot).start),
        Target::Small(ss) => small_ptr(st, ss),
    })
}

/// The batch as one plan, when every request is a shrink or a growth in
/// place of an allocation of whole chunks and the memory is there without
/// the shrinks' chunks. `None`: the caller takes the general way (nothing
/// was changed). Growth is planned and executed before the shrinks are
/// booked, so a failure has no bookkeeping to undo.
fn in_place_together(
    st: &mut State,
    ctx: &Ctx<'_>,
    targets: &[Target],
    requests: &[(Id, u64)],
    pages: &[u64],
) -> Result<Option<Vec<u64>>> {
    let mut ranges = Vec::new();
    let mut growths = Vec::new();
    let mut fresh = 0u64;
    for (i, t) in targets.iter().enumerate() {
        let Target::Chunks(slot) = *t else { return Ok(None) };
        let a = st.alloc(slot);
        let np = pages[i];
        if np <= a.backed {
            // A shrink that gives up a shared chunk makes driver calls or
            // retires pages: the general way handles it.
            if (a.start + np..a.start + a.backed).any(|p| st.page_shared(p)) {
                return Ok(None);
            }
            continue;
        }
        let fits = np <= a.reserved || st.free.contains(a.start + a.reserved, np - a.reserved);
        if !fits {
            return Ok(None);
        }
        let reserved = a.reserved.max(np);
        let grow = a.start + a.backed..a.start + np;
        fresh += grow.clone().filter(|p| !st.cached.contains(p)).count() as u64;
        ranges.push((grow, a.start..a.start + reserved));
        growths.push((i, slot, np, reserved));
    }
    // Cached pages inside the growth count as obtainable but serve in place.
    if fresh > st.obtainable_pages() {
        return Ok(None);
    }
    if !ranges.is_empty() {
        let mut plan = match Plan::for_ranges(st, &ranges) {
            Ok(p) => p,
            Err(Error::OutOfMemory(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut tx: Txn<'_> = ctx.txn(st);
        if let Err(e) = plan.execute(st, &mut tx) {
            tx.rollback();
            return Err(e);
        }
        tx.commit();
        plan.apply(st);
        for &(i, slot, np, reserved) in &growths {
            let a = st.alloc(slot).clone();
            if reserved > a.reserved {
                st.free.remove(a.start + a.reserved, reserved - a.reserved);
            }
            st.backed_pages += np - a.backed;
            st.live_bytes = st.live_bytes - a.size + requests[i].1;
            let m = st.alloc_mut(slot);
            m.reserved = reserved;
            m.backed = np;
            m.size = requests[i].1;
            // Growth is for new work: a promise of none ends.
            m.quiet = Quiet::No;
        }
    }
    // The rest: shrinks and size changes within the backed pages (bookkeeping).
    let mut ptrs = Vec::with_capacity(targets.len());
    for (i, t) in targets.iter().enumerate() {
        let Target::Chunks(slot) = *t else { unreachable!("checked above") };
        let a = st.alloc(slot).clone();
        let np = pages[i];
        if np < a.backed {
            let kept = st.shrink_backing(slot, np);
            debug_assert!(kept.is_empty(), "shared pages take the general way");
            if !a.growable {
                st.free.insert(a.start + np, a.reserved - np);
                st.alloc_mut(slot).reserved = np;
            }
            st.left_quiet(a.quiet, a.start + np..a.start + a.backed);
        }
        if np <= a.backed {
            st.live_bytes = st.live_bytes - a.size + requests[i].1;
            let m = st.alloc_mut(slot);
            m.size = requests[i].1;
            if requests[i].1 > a.size {
                m.quiet = Quiet::No;
            }
        }
        ptrs.push(st.addr(a.start));
    }
    Ok(Some(ptrs))
}
