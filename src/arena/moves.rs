//! Moves and compaction: moving an allocation by remapping, making room
//! for one, the compaction passes, and releasing retired ranges (the old
//! ranges of moved allocations).

use crate::compact;
use crate::error::{Error, Result};

use super::state::{MoveEvent, Owner, Plan, State};
use super::txn::Txn;
use super::{Arena, CompactReport, Touch};

impl Arena {
    /// Moves unpinned allocations by remapping to close address-space
    /// holes, then releases the old ranges (after a synchronize). Moves
    /// happen whatever `no_implicit_moves` says: this is the explicit call.
    pub fn compact(&self) -> Result<CompactReport> {
        self.run(Touch::Nothing, |inner, ctx, events| {
            let st = &mut inner.st;
            let mut report =
                CompactReport { largest_free_va_before: st.free.largest() * st.chunk, ..Default::default() };
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            let mut evs = Vec::new();
            let done = (|| {
                release_retired_into(&mut sim, &mut tx)?;
                let (passes, _) = plan_passes(&sim, |s, slot| s.alloc(slot).immovable());
                let (moved, bytes) = run_passes(&mut sim, &mut tx, passes, &mut evs)?;
                report.moved_allocations = moved;
                report.moved_bytes = bytes;
                Ok::<_, Error>(())
            })();
            match done {
                Ok(()) => {
                    tx.commit();
                    *st = sim;
                    events.extend(evs);
                    report.largest_free_va_after = st.free.largest() * st.chunk;
                    Ok(report)
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }

    /// Unmaps the old ranges of moved allocations, synchronizing the device
    /// first. Their address space becomes free.
    pub fn release_retired(&self) -> Result<()> {
        self.run(Touch::Nothing, |inner, ctx, _| {
            let st = &mut inner.st;
            if st.retired.is_empty() && st.small.nothing_retired() {
                return Ok(());
            }
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            match release_retired_into(&mut sim, &mut tx) {
                Ok(()) => {
                    tx.commit();
                    *st = sim;
                    Ok(())
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }
}

/// Finds `n` free pages, releasing retired ranges and then (unless implicit
/// moves are off) evacuating the cheapest window. Works on a state copy.
pub(super) fn make_room(
    sim: &mut State,
    tx: &mut Txn<'_>,
    n: u64,
    resizing: Option<u32>,
    evs: &mut Vec<MoveEvent>,
) -> Result<u64> {
    if let Some(t) = sim.free.best_fit(n) {
        return Ok(t);
    }
    // Decide whether room can be made before any driver call: a refusal
    // after the retired ranges were unmapped would need a rollback, whose
    // own driver calls (mapping them back) may fail and leave the arena
    // unlike its books. The bookkeeping of the release is pure, so a copy
    // shows what the state will be after it.
    // Retired pages known idle go first: unmapping them needs no synchronize.
    let idle_retired: Vec<u64> =
        sim.retired.iter().flat_map(|(&s, &l)| s..s + l).filter(|p| sim.idle.contains(p)).collect();
    if !idle_retired.is_empty() && idle_retired.len() as u64 != sim.retired_pages {
        let mut released = sim.clone();
        forget_retired_pages(&mut released, &idle_retired);
        if let Some(t) = released.free.best_fit(n) {
            release_idle_retired(sim, tx)?;
            return Ok(t);
        }
    }
    let mut released = sim.clone();
    forget_retired(&mut released);
    if let Some(t) = released.free.best_fit(n) {
        release_retired_into(sim, tx)?;
        return Ok(t);
    }
    let bytes = n * sim.chunk;
    if sim.no_implicit_moves {
        return Err(Error::OutOfAddressSpace(format!(
            "no free range of {bytes} bytes and implicit moves are disabled (largest free: {} bytes)",
            sim.free.largest() * sim.chunk
        )));
    }
    let immovable = |s: &State, slot: u32| Some(slot) == resizing || s.alloc(slot).immovable();
    let refused = || {
        Error::OutOfAddressSpace(format!(
            "no window of {bytes} bytes can be evacuated: pinned or sleeping allocations are in the way or there is nowhere to move them"
        ))
    };
    let plan = match compact::plan_window(&released, n, |slot| immovable(&released, slot)) {
        Some(plan) => {
            release_retired_into(sim, tx)?;
            plan
        }
        None => {
            // No single evacuation suffices: compact the whole range first
            // (planned on a copy, so a refusal makes no driver call), then
            // place the request directly or by evacuating a window.
            let (passes, after) = plan_passes(&released, immovable);
            let fits_after = after.free.best_fit(n).is_some()
                || compact::plan_window(&after, n, |slot| immovable(&after, slot)).is_some();
            if passes.is_empty() || !fits_after {
                return Err(refused());
            }
            release_retired_into(sim, tx)?;
            run_passes(sim, tx, passes, evs)?;
            if let Some(t) = sim.free.best_fit(n) {
                return Ok(t);
            }
            compact::plan_window(sim, n, |slot| immovable(sim, slot)).ok_or_else(refused)?
        }
    };
    drop(released);
    for (slot, dest) in plan.moves {
        let a = sim.alloc(slot).clone();
        move_alloc(sim, tx, slot, dest, a.backed, a.reserved, a.size, evs)?;
    }
    release_retired_into(sim, tx)?;
    sim.free.best_fit(n).ok_or_else(|| Error::Internal("compaction plan did not free its window".into()))
}

/// Maps `slot`'s chunks at `dest` (plus new ones up to `backed` pages),
/// retires its old range, and records the move.
#[allow(clippy::too_many_arguments)]
pub(super) fn move_alloc(
    st: &mut State,
    tx: &mut Txn<'_>,
    slot: u32,
    dest: u64,
    backed: u64,
    reserved: u64,
    size: u64,
    evs: &mut Vec<MoveEvent>,
) -> Result<()> {
    let a = st.alloc(slot).clone();
    let known: Vec<_> =
        (a.start..a.start + a.backed).map(|p| st.mapped[p as usize].expect("backing page is mapped")).collect();
    let mut plan = Plan::new(st, &known, dest..dest + backed, dest..dest + reserved)?;
    plan.execute(st, tx)?;
    plan.apply(st);
    relocate_books(st, slot, dest, backed, reserved, size);
    let (old, new) = (st.addr(a.start), st.addr(dest));
    match a.owner {
        // Every object of a slab moves with it.
        Owner::Slab(slab) => {
            let s = st.small.slab(slab);
            let class = st.small.classes.size(s.class);
            for (i, member) in s.members.iter().enumerate() {
                if let Some(ss) = *member {
                    let off = i as u64 * class;
                    let id = st.small_id(ss);
                    evs.push(MoveEvent { id, old_ptr: old + off, new_ptr: new + off, size: st.small.size_of(ss) });
                    st.moves += 1;
                }
            }
        }
        _ => {
            evs.push(MoveEvent { id: st.user_id(slot), old_ptr: old, new_ptr: new, size });
            st.moves += 1;
        }
    }
    Ok(())
}

/// The address-space bookkeeping of a move (pure): the allocation takes
/// `dest..dest + reserved`, its old backed range is retired and its old
/// unbacked tail becomes free.
fn relocate_books(st: &mut State, slot: u32, dest: u64, backed: u64, reserved: u64, size: u64) {
    let a = st.alloc(slot).clone();
    st.by_start.remove(&a.start);
    if a.backed > 0 {
        st.retired.insert(a.start, a.backed);
        st.retired_owner.insert(a.start, slot);
        // Its old addresses, of a quiesced allocation, see no more work.
        st.left_quiet(a.quiet, a.start..a.start + a.backed);
    }
    st.retired_pages += a.backed;
    st.free.insert(a.start + a.backed, a.reserved - a.backed);
    st.free.remove(dest, reserved);
    st.by_start.insert(dest, slot);
    st.backed_pages += backed - a.backed;
    if a.owner.counts_live() {
        st.live_bytes = st.live_bytes - a.size + size;
    }
    let m = st.alloc_mut(slot);
    m.start = dest;
    m.reserved = reserved;
    m.backed = backed;
    m.size = size;
}

/// Plans top-down compaction passes on a copy of the books, without a
/// driver call: each movable allocation, highest first, moves into the
/// best-fitting hole below it, provided that does not shrink the largest
/// free range (counting retired ranges as free, as they are at the end of
/// the pass: filling a big hole to free a small pocket between pinned
/// neighbours would fragment, not compact). Returns the moves of each pass
/// and the books after them (retired ranges released).
fn plan_passes(st: &State, immovable: impl Fn(&State, u32) -> bool) -> (Vec<Vec<(u32, u64)>>, State) {
    let mut sim = st.clone();
    forget_retired(&mut sim);
    let mut passes = Vec::new();
    for _pass in 0..8 {
        let mut moves = Vec::new();
        let mut after = sim.free.clone();
        let order: Vec<u32> = sim.by_start.values().rev().copied().collect();
        for slot in order {
            if immovable(&sim, slot) {
                continue;
            }
            let a = sim.alloc(slot).clone();
            let Some(t) = sim.free.best_fit_where(a.reserved, 64, |s, _| s < a.start) else {
                continue;
            };
            let largest = after.largest();
            after.remove(t, a.reserved);
            after.insert(a.start, a.reserved);
            if after.largest() < largest {
                after.remove(a.start, a.reserved);
                after.insert(t, a.reserved);
                continue;
            }
            relocate_books(&mut sim, slot, t, a.backed, a.reserved, a.size);
            moves.push((slot, t));
        }
        forget_retired(&mut sim);
        if moves.is_empty() {
            break;
        }
        passes.push(moves);
    }
    (passes, sim)
}

/// Performs planned compaction passes: the moves of each pass, then the
/// release of the ranges they retired. Returns the allocations moved (as
/// callers count them: each object of a moved slab) and the bytes remapped.
fn run_passes(
    sim: &mut State,
    tx: &mut Txn<'_>,
    passes: Vec<Vec<(u32, u64)>>,
    evs: &mut Vec<MoveEvent>,
) -> Result<(u64, u64)> {
    let (mut moved, mut bytes) = (0, 0);
    for pass in passes {
        for (slot, dest) in pass {
            let a = sim.alloc(slot).clone();
            // Allocations, as callers know them: a slab's move moves each
            // of its objects (one event each), and none if it holds only
            // retired ones.
            let events_before = evs.len();
            move_alloc(sim, tx, slot, dest, a.backed, a.reserved, a.size, evs)?;
            moved += (evs.len() - events_before) as u64;
            bytes += a.backed * sim.chunk;
        }
        release_retired_into(sim, tx)?;
    }
    Ok((moved, bytes))
}

/// Unmaps every retired range and frees its pages. The device is
/// synchronized first unless every retired page is known idle (see
/// `State::idle`: its allocation was freed on a stream whose event has
/// completed).
pub(super) fn release_retired_into(st: &mut State, tx: &mut Txn<'_>) -> Result<()> {
    let ranges: Vec<(u64, u64)> = st.retired.iter().map(|(&s, &l)| (s, l)).collect();
    for &(s, l) in &ranges {
        let chunks = (s..s + l).map(|p| st.mapped[p as usize].expect("retired page is mapped")).collect();
        if (s..s + l).all(|p| st.idle.contains(&p)) {
            tx.unmap_idle(s, chunks)?;
        } else {
            tx.unmap(s, chunks)?;
        }
    }
    forget_retired(st);
    Ok(())
}

/// Unmaps the retired pages known idle, without a device synchronize, and
/// frees them; every other retired page stays. Returns the pages freed.
pub(super) fn release_idle_retired(st: &mut State, tx: &mut Txn<'_>) -> Result<u64> {
    let pages: Vec<u64> = st.retired.iter().flat_map(|(&s, &l)| s..s + l).filter(|p| st.idle.contains(p)).collect();
    for run in super::state::runs(&pages) {
        let chunks = run.clone().map(|p| st.mapped[p as usize].expect("retired page is mapped")).collect();
        tx.unmap_idle(run.start, chunks)?;
    }
    forget_retired_pages(st, &pages);
    Ok(pages.len() as u64)
}

/// The bookkeeping of releasing every retired range, once it is unmapped
/// (pure: no driver call).
pub(super) fn forget_retired(st: &mut State) {
    let ranges: Vec<(u64, u64)> = st.retired.iter().map(|(&s, &l)| (s, l)).collect();
    for (s, l) in ranges {
        for p in s..s + l {
            st.mapped[p as usize] = None;
            st.forget_idle(p);
        }
        st.free.insert(s, l);
    }
    st.retired.clear();
    st.retired_owner.clear();
    st.retired_pages = 0;
    // Copy-resized small objects: their old places become free, and a slab
    // left empty goes back like any freed allocation.
    for slab in st.small.release_retired() {
        st.remove_alloc(slab);
    }
}

/// The bookkeeping of unmapping some pages of retired ranges (sorted):
/// they become free, and the ranges around them stay retired.
pub(super) fn forget_retired_pages(st: &mut State, pages: &[u64]) {
    for &p in pages {
        let (&s, &l) = st.retired.range(..=p).next_back().expect("page lies in a retired range");
        debug_assert!(p < s + l, "page {p} outside the retired range {s}+{l}");
        st.retired.remove(&s);
        let owner = st.retired_owner.remove(&s);
        if p > s {
            st.retired.insert(s, p - s);
            if let Some(o) = owner {
                st.retired_owner.insert(s, o);
            }
        }
        if p + 1 < s + l {
            st.retired.insert(p + 1, s + l - p - 1);
            if let Some(o) = owner {
                st.retired_owner.insert(p + 1, o);
            }
        }
        st.retired_pages -= 1;
        st.forget_idle(p);
        st.mapped[p as usize] = None;
        st.free.insert(p, 1);
    }
}
