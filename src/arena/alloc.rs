//! Allocation and growth: `alloc`, `free`, `resize` (in place, or by
//! moving), small allocations in slabs, what an id names, pinning and
//! `query`.

use crate::compact;
use crate::error::{Error, Result};
use crate::va::FreeRanges;
use crate::Id;

use super::moves::{forget_retired, make_room, move_alloc, release_retired_into};
use super::small::SmallEntry;
use super::state::{Alloc, MoveEvent, Owner, Plan, Quiet, State};
use super::txn::Txn;
use super::{pages_for, AllocInfo, Arena, Touch};

impl Arena {
    /// Allocates `size` bytes (rounded up to whole chunks). Returns the id and
    /// the address, chunk-aligned.
    pub fn alloc(&self, size: u64) -> Result<(Id, u64)> {
        self.alloc_inner(size, size, false, 0, Placing::Any, None)
    }

    /// [`Arena::alloc`] in whole chunks however small `size` is (never in a
    /// slab), placed as `placing` says: what group and two-phase
    /// allocations use (see `group.rs` and `arena/two_phase.rs`).
    pub(crate) fn alloc_whole(&self, size: u64, max_size: u64, growable: bool, placing: Placing) -> Result<(Id, u64)> {
        if max_size < size {
            return Err(Error::invalid(format!("max_size {max_size} < size {size}")));
        }
        self.alloc_inner(size, max_size, growable, 0, placing, None)
    }

    /// [`Arena::alloc`] with a tag (see [`Arena::set_tag`]): the allocation
    /// sleeps and wakes with `tag`. A small one (at most half a chunk) goes
    /// into a slab of that tag only.
    pub fn alloc_tagged(&self, size: u64, tag: u32) -> Result<(Id, u64)> {
        self.alloc_inner(size, size, false, tag, Placing::Any, None)
    }

    /// Allocates `size` bytes inside a reservation of `max_size`, so the
    /// allocation can grow up to `max_size` without moving.
    pub fn alloc_growable(&self, size: u64, max_size: u64) -> Result<(Id, u64)> {
        self.alloc_growable_tagged(size, max_size, 0)
    }

    /// [`Arena::alloc_growable`] with a tag (see [`Arena::alloc_tagged`]).
    pub fn alloc_growable_tagged(&self, size: u64, max_size: u64, tag: u32) -> Result<(Id, u64)> {
        if max_size < size {
            return Err(Error::invalid(format!("max_size {max_size} < size {size}")));
        }
        self.alloc_inner(size, max_size, true, tag, Placing::Any, None)
    }

    /// The body of the `alloc*` calls; `stream`: the one the new
    /// allocation's work is ordered on, if the caller said (see
    /// `stream_reuse.rs`).
    pub(super) fn alloc_inner(
        &self,
        size: u64,
        max_size: u64,
        growable: bool,
        tag: u32,
        placing: Placing,
        stream: Option<u64>,
    ) -> Result<(Id, u64)> {
        let chunk = self.chunk;
        let pages = pages_for(size, chunk, "size")?;
        let reserved = pages_for(max_size, chunk, "max_size")?;
        self.run(Touch::Nothing, |inner, ctx, events| {
            let st = &mut inner.st;
            let mut tx = ctx.txn(st);
            let small = match (growable, placing) {
                (false, Placing::Any) => st.small.classes.class_of(size),
                _ => None,
            };
            // A two-phase prepare moves nothing: its abort (a free) could not
            // move anything back, and ranks would no longer agree.
            let implicit_moves_were_off = st.no_implicit_moves;
            if placing == Placing::WholeNoMoves {
                st.no_implicit_moves = true;
            }
            let placed = match small {
                Some(class) => alloc_small(st, &mut tx, tag, class, size, events).map(Target::Small),
                None => {
                    // Only an allocation of whole chunks reuses by stream: a
                    // slab serves objects whose work may be on any stream
                    // (cleared by `run` when the closure returns).
                    st.reuse.op_stream = stream;
                    alloc_pages(st, &mut tx, pages, reserved, size, growable, Owner::User, events).map(|slot| {
                        st.alloc_mut(slot).tag = tag;
                        Target::Chunks(slot)
                    })
                }
            };
            st.no_implicit_moves = implicit_moves_were_off;
            match placed {
                Ok(Target::Small(ss)) => {
                    tx.commit();
                    Ok((st.small_id(ss), small_ptr(st, ss)))
                }
                Ok(Target::Chunks(slot)) => {
                    tx.commit();
                    Ok((st.id_of(slot), st.addr(st.alloc(slot).start)))
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }

    /// Frees an allocation. Its chunks stay mapped in the pool (up to the
    /// retain watermark), ready for the next allocation without a driver
    /// call; a chunk another allocation still maps (see
    /// [`Arena::alloc_shared`]) stays with it, and this allocation's page
    /// of it is retired (unmapped when retired memory is released).
    ///
    /// The free is immediate, not ordered after device work: the next
    /// allocation may get the same address and chunks while kernels queued
    /// earlier still use them. Synchronize first, or use
    /// [`Arena::free_on_stream`], which keeps the memory until the stream's
    /// earlier work completes.
    pub fn free(&self, id: Id) -> Result<()> {
        self.run(Touch::Nothing, |inner, _ctx, _| {
            #[cfg(unix)]
            if let Some(r) = super::export::free_shared(inner, _ctx, id) {
                return r;
            }
            let target = inner.st.resolve(id)?;
            free_now(&mut inner.st, target);
            Ok(())
        })
    }

    /// [`Arena::free`] for a two-phase commit, after `precondition` holds
    /// (checked under the same lock; when it fails, nothing is done).
    /// Nothing in it can fail for a driver call: an exported allocation
    /// whose chunks cannot be given back now is held and finished by the
    /// next call (`export::free_exported_or_hold`). Imports are never
    /// prepared.
    pub(super) fn free_committed(&self, id: Id, precondition: impl Fn(&super::Inner) -> Result<()>) -> Result<()> {
        self.run(Touch::Nothing, |inner, _ctx, _| {
            precondition(inner)?;
            #[cfg(unix)]
            if super::export::free_exported_or_hold(inner, _ctx, id).is_some() {
                return Ok(());
            }
            let target = inner.st.resolve(id)?;
            free_now(&mut inner.st, target);
            Ok(())
        })
    }

    /// Grows or shrinks an allocation, keeping its first `min(old, new)`
    /// bytes. Grows in place when its reservation (or the free space after
    /// it) allows, else moves it by remapping. Returns the (maybe new) address.
    ///
    /// Shrinking gives whole tail chunks to the pool, but a chunk another
    /// allocation also maps (see [`Arena::alloc_shared`]) stays with it: a
    /// growable allocation unmaps its page of that chunk at once (after a
    /// device synchronize: the one shrink that makes driver calls, and can
    /// fail, leaving the allocation as it was), any other retires it.
    pub fn resize(&self, id: Id, new_size: u64) -> Result<u64> {
        self.resize_ordered(id, new_size, None)
    }

    /// Address and facts of a live allocation.
    pub fn query(&self, id: Id) -> Result<AllocInfo> {
        let inner = self.lock()?;
        let st = &inner.st;
        #[cfg(unix)]
        if let Some(info) = inner.shares.query(st, id) {
            return info;
        }
        let slot = match st.resolve(id)? {
            Target::Chunks(slot) => slot,
            Target::Small(ss) => {
                let SmallEntry::InSlab { slab, size, pinned, .. } = *st.small.entry_of(ss) else {
                    unreachable!("resolve gives Small only for objects in slabs")
                };
                let s = st.small.slab(slab);
                let class = st.small.classes.size(s.class);
                return Ok(AllocInfo {
                    ptr: small_ptr(st, ss),
                    size,
                    reserved_bytes: class,
                    mapped_bytes: class,
                    pinned,
                    growable: false,
                    tag: s.tag,
                    asleep: st.alloc(s.alloc_slot).sleep.is_some(),
                });
            }
        };
        let a = st.alloc(slot);
        Ok(AllocInfo {
            ptr: st.addr(a.start),
            size: a.size,
            reserved_bytes: a.reserved * st.chunk,
            mapped_bytes: a.backed * st.chunk,
            pinned: a.pinned,
            growable: a.growable,
            tag: a.tag,
            asleep: a.sleep.is_some(),
        })
    }

    /// Pins an allocation: it never moves until unpinned (for buffers
    /// registered with NCCL, RDMA or captured in CUDA graphs).
    pub fn pin(&self, id: Id) -> Result<()> {
        self.set_pinned(id, true)
    }

    /// Lets a pinned allocation move again.
    pub fn unpin(&self, id: Id) -> Result<()> {
        self.set_pinned(id, false)
    }

    fn set_pinned(&self, id: Id, pinned: bool) -> Result<()> {
        let mut inner = self.lock()?;
        #[cfg(unix)]
        {
            let super::Inner { st, shares, .. } = &mut *inner;
            if let Some(r) = shares.set_pinned(st, id, pinned) {
                return r;
            }
        }
        let st = &mut inner.st;
        match st.resolve(id)? {
            Target::Chunks(slot) => {
                // Unpinning a sleeping allocation is fine; pinning needs it awake.
                if pinned && st.alloc(slot).sleep.is_some() {
                    return Err(Error::Asleep(id.get()));
                }
                st.alloc_mut(slot).pinned = pinned
            }
            Target::Small(ss) => {
                if pinned && small_asleep(st, ss) {
                    return Err(Error::Asleep(id.get()));
                }
                // A slab is pinned while any object in it is.
                let (slab_slot, count) = st.small.set_pinned(ss, pinned).expect("object in a slab");
                st.alloc_mut(slab_slot).pinned = count > 0;
            }
        }
        Ok(())
    }
}

/// Resizes what `target` names (the body of `Arena::resize`; `resize_many`
/// runs it for each request on one transaction). Changes `st` only on
/// success; on error the caller rolls `tx` back.
#[allow(clippy::too_many_arguments)]
pub(super) fn resize_target(
    st: &mut State,
    tx: &mut Txn<'_>,
    target: Target,
    id: Id,
    np: u64,
    new_size: u64,
    events: &mut Vec<MoveEvent>,
) -> Result<u64> {
    let slot = match target {
        Target::Chunks(slot) => slot,
        Target::Small(ss) => return resize_small(st, tx, ss, id, new_size, events),
    };
    let a = st.alloc(slot).clone();
    if a.sleep.is_some() {
        return Err(Error::Asleep(id.get()));
    }
    if np <= a.backed {
        if np < a.backed {
            // Pages whose chunk another allocation maps too stay with it: a
            // growable allocation, which keeps them in its reservation,
            // unmaps them now (growth must not find them there); otherwise
            // they are retired.
            let kept: Vec<u64> = (a.start + np..a.start + a.backed).filter(|&p| st.page_shared(p)).collect();
            if a.growable {
                for run in super::state::runs(&kept) {
                    let hs = run.clone().map(|p| st.mapped[p as usize].expect("backing page")).collect();
                    tx.unmap(run.start, hs)?;
                }
            }
            let kept = st.shrink_backing(slot, np);
            if a.growable {
                for p in kept {
                    st.mapped[p as usize] = None;
                }
            } else {
                st.free.insert(a.start + np, a.reserved - np);
                st.alloc_mut(slot).reserved = np;
                st.retire_pages(&kept);
            }
            // A quiesced allocation's dropped pages saw their last work.
            st.left_quiet(a.quiet, a.start + np..a.start + a.backed);
        }
        st.live_bytes = st.live_bytes - a.size + new_size;
        let m = st.alloc_mut(slot);
        m.size = new_size;
        // A larger size within its pages is growth too: new work.
        if new_size > a.size {
            m.quiet = Quiet::No;
        }
        return Ok(st.addr(a.start));
    }
    // A growable allocation that outgrew its reservation gets twice
    // the room when it moves, so repeated growth stays cheap.
    let wanted = if a.growable { np.max(a.reserved.saturating_mul(2)).min(st.pages) } else { np };
    let tail = (a.start + a.reserved, np.saturating_sub(a.reserved));
    let extend_in_place = np > a.reserved && st.free.contains(tail.0, tail.1);
    let via = if np > a.reserved && !extend_in_place { in_place_route(st, slot, tail, wanted) } else { None };
    if np > a.reserved && !extend_in_place && via.is_none() && a.pinned {
        return Err(Error::Pinned(id.get()));
    }
    // Chunks held only by retired small objects come back when the
    // retired memory is released: growth may count on them.
    let short = np - a.backed > st.obtainable_pages();
    if short && np - a.backed > st.obtainable_pages() + st.small.reclaimable_slabs() {
        return Err(Error::OutOfMemory(format!(
            "growing to {new_size} bytes needs {} more chunks; {} are obtainable",
            np - a.backed,
            st.obtainable_pages()
        )));
    }
    if (np <= a.reserved || extend_in_place) && !short {
        grow_in_place(st, tx, slot, np, new_size)?;
        // Growth is for new work: the promise of none ends.
        st.alloc_mut(slot).quiet = Quiet::No;
        return Ok(st.addr(a.start));
    }
    let in_place = np <= a.reserved || extend_in_place || via.is_some();
    // Several steps (releases, moves of neighbours or of the
    // allocation itself): on a copy that replaces the state only
    // if every driver call succeeded.
    let mut sim = st.clone();
    let mut evs = Vec::new();
    let moved = (|| {
        if in_place {
            match via {
                Some(InPlace::Release) => release_retired_into(&mut sim, tx)?,
                Some(InPlace::Evacuate(moves)) => {
                    // Planned on the books after the release, which
                    // are `sim`'s once it is done.
                    release_retired_into(&mut sim, tx)?;
                    for (other, dest) in moves {
                        let o = sim.alloc(other).clone();
                        move_alloc(&mut sim, tx, other, dest, o.backed, o.reserved, o.size, &mut evs)?;
                    }
                    // The neighbours' old ranges are the pages to grow into.
                    release_retired_into(&mut sim, tx)?;
                }
                None if short => release_retired_into(&mut sim, tx)?,
                None => {}
            }
            return grow_in_place(&mut sim, tx, slot, np, new_size);
        }
        let (t, reserved) = match sim.free.best_fit(wanted) {
            Some(t) => (t, wanted),
            None => (make_room(&mut sim, tx, np, Some(slot), &mut evs)?, np),
        };
        // The chunks of retired small objects' slabs only after the
        // place is found: `make_room` refuses before any driver call,
        // and a refusal after these unmaps would need a rollback whose
        // own calls may fail.
        if short {
            release_retired_into(&mut sim, tx)?;
        }
        move_alloc(&mut sim, tx, slot, t, np, reserved, new_size, &mut evs)
    })();
    moved?;
    *st = sim;
    events.extend(evs);
    st.alloc_mut(slot).quiet = Quiet::No;
    Ok(st.addr(st.alloc(slot).start))
}

/// How an allocation can grow in place beyond its reservation when the
/// pages after it are not free.
enum InPlace {
    /// They are retired: release the retired ranges, then grow.
    Release,
    /// They hold unpinned allocations that fit elsewhere: move them
    /// (slot, destination page, planned on the books after the release of
    /// retired ranges), release, then grow.
    Evacuate(Vec<(u32, u64)>),
}

/// Whether `slot` can grow in place into `tail` (start page, pages) after
/// releasing retired ranges or moving its neighbours; `wanted` is the
/// reservation it would get by moving instead.
///
/// In place is preferred to moving the allocation itself: its address
/// stays, and the arena releases retired ranges when it needs their
/// address space anyway. Neighbours move for it only when it is pinned or
/// when no free range could take it (and never with `no_implicit_moves`).
fn in_place_route(st: &State, slot: u32, tail: (u64, u64), wanted: u64) -> Option<InPlace> {
    let (t0, n) = tail;
    if t0.checked_add(n).map_or(true, |end| end > st.pages) {
        return None;
    }
    let released_books;
    let released = if st.retired.is_empty() && st.small.nothing_retired() {
        st
    } else {
        let mut r = st.clone();
        forget_retired(&mut r);
        released_books = r;
        &released_books
    };
    if released.free.contains(t0, n) {
        // (Never with nothing retired: the caller found the pages not free.)
        return Some(InPlace::Release);
    }
    if st.no_implicit_moves || (!st.alloc(slot).pinned && st.free.best_fit(wanted).is_some()) {
        return None;
    }
    compact::plan_evacuation(released, t0, t0 + n, |other| other == slot || released.alloc(other).immovable())
        .map(InPlace::Evacuate)
}

/// Grows `slot` to `np` pages within its reservation, or into the free
/// range right after it. Changes `st` only on success.
fn grow_in_place(st: &mut State, tx: &mut Txn<'_>, slot: u32, np: u64, new_size: u64) -> Result<()> {
    let a = st.alloc(slot).clone();
    let reserved = a.reserved.max(np);
    let mut plan = Plan::new(st, &[], a.start + a.backed..a.start + np, a.start..a.start + reserved)?;
    plan.execute(st, tx)?;
    plan.apply(st);
    if reserved > a.reserved {
        st.free.remove(a.start + a.reserved, reserved - a.reserved);
    }
    st.backed_pages += np - a.backed;
    st.live_bytes = st.live_bytes - a.size + new_size;
    let m = st.alloc_mut(slot);
    m.reserved = reserved;
    m.backed = np;
    m.size = new_size;
    Ok(())
}

/// How an allocation may be placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placing {
    /// As `alloc` places it: a small one in a slab, moving others if needed.
    Any,
    /// In whole chunks, moving others if needed (group allocations).
    Whole,
    /// In whole chunks, moving nothing (two-phase prepares).
    WholeNoMoves,
}

/// Places a new allocation of whole chunks: best fit, else after releasing
/// retired ranges and compacting. Returns its slot. On error the state is
/// unchanged and the caller rolls `tx` back.
#[allow(clippy::too_many_arguments)]
fn alloc_pages(
    st: &mut State,
    tx: &mut Txn<'_>,
    pages: u64,
    reserved: u64,
    size: u64,
    growable: bool,
    owner: Owner,
    events: &mut Vec<MoveEvent>,
) -> Result<u32> {
    let chunk = st.chunk;
    // Chunks held only by retired small objects come back when the retired
    // memory is released (below, on the slow path): count them.
    let short = pages > st.obtainable_pages();
    if short && pages > st.obtainable_pages() + st.small.reclaimable_slabs() {
        return Err(Error::OutOfMemory(format!(
            "{size} bytes need {pages} chunks; {} are obtainable under the capacity of {} bytes",
            st.obtainable_pages(),
            st.cap_pages * chunk
        )));
    }
    if reserved > st.pages {
        return Err(Error::OutOfAddressSpace(format!(
            "a reservation of {} bytes exceeds the whole virtual range",
            reserved * chunk
        )));
    }
    let a = Alloc {
        start: 0,
        reserved,
        backed: pages,
        size,
        growable,
        pinned: false,
        owner,
        tag: 0,
        sleep: None,
        quiet: Quiet::No,
    };
    // On a stream: an allocation freed there, taken over where it is (on
    // a copy: growing it to `pages` may fail, and then the caller rolls
    // back; its plan refuses before any driver call if memory is short).
    if owner == Owner::User && !st.pending.is_empty() && st.reuse.op_stream.is_some() {
        let mut sim = st.clone();
        if let Some(slot) = super::stream_reuse::take_over_pending(&mut sim, pages, reserved, size, growable) {
            if sim.alloc(slot).backed < pages {
                grow_in_place(&mut sim, tx, slot, pages, size)?;
            }
            *st = sim;
            return Ok(slot);
        }
    }
    if let (false, Some(t)) = (short, best_fit_adopting(st, &st.free, reserved, pages)) {
        let mut plan = Plan::new(st, &[], t..t + pages, t..t + reserved)?;
        plan.execute(st, tx)?;
        plan.apply(st);
        return Ok(st.insert_alloc(Alloc { start: t, ..a }));
    }
    // Several steps: work on a copy that replaces the state only on success.
    let mut sim = st.clone();
    let mut evs = Vec::new();
    let t = make_room(&mut sim, tx, reserved, None, &mut evs)?;
    // The chunks of retired small objects' slabs only after the place is
    // found: `make_room` refuses before any driver call, and a refusal after
    // these unmaps would need a rollback whose own calls may fail.
    if short {
        release_retired_into(&mut sim, tx)?;
    }
    let mut plan = Plan::new(&sim, &[], t..t + pages, t..t + reserved)?;
    plan.execute(&sim, tx)?;
    plan.apply(&mut sim);
    let slot = sim.insert_alloc(Alloc { start: t, ..a });
    *st = sim;
    events.extend(evs);
    Ok(slot)
}

/// Best fit for a reservation of `reserved` pages whose first `pages` are
/// backed: among the free ranges of the best length (at most 16 looked at),
/// the one whose first `pages` pages hold the most cached chunks, lowest
/// address on ties; a longer free range is taken instead only where more
/// of its cached chunks would be adopted (placed at its first cached
/// chunk, or as near as the range allows: a freed range that joined its
/// free neighbours). Each cached chunk is adopted with no driver call, where
/// an unmapped page costs a map, a share of an access call and maybe a
/// create (the time model's costliest calls): with fits otherwise equal,
/// adoption is never slower. `free` is `st.free`, or a copy of it on which
/// admission map-ahead predicts several placements in a row
/// (`admission_ahead.rs`).
pub(super) fn best_fit_adopting(st: &State, free: &FreeRanges, reserved: u64, pages: u64) -> Option<u64> {
    let candidates = free.best_fits(reserved, 16);
    if st.deterministic {
        // Placement must not depend on what the pool holds, which an
        // aborted two-phase operation leaves different on one rank.
        return candidates.into_iter().min();
    }
    // A cached page another stream may still write is adopted only after
    // a wait: it counts for nothing here.
    let ready = |p: &&u64| st.busy_event(**p).is_none();
    let cached_at = |t: u64| st.cached.range(t..t + pages).filter(ready).count();
    let mut best: Option<(usize, u64)> = None;
    for t in candidates {
        let n = cached_at(t);
        if best.map_or(true, |(b, _)| n > b) {
            best = Some((n, t));
        }
    }
    // A longer free range whose cached chunks it would adopt more of (a
    // freed range coalesced with free neighbours): placed at its first
    // cached chunk, or as near it as the range allows.
    for (start, len) in free.iter() {
        if len < reserved {
            continue;
        }
        let Some(&first) = st.cached.range(start..start + len).find(ready) else { continue };
        let t = first.min(start + len - reserved);
        let n = cached_at(t);
        if best.map_or(true, |(b, _)| n > b) {
            best = Some((n, t));
        }
    }
    best.map(|(_, t)| t)
}

/// Whether the slab of a small allocation (in a slab) sleeps.
pub(super) fn small_asleep(st: &State, ss: u32) -> bool {
    st.small.slab_of(ss).is_some_and(|s| st.alloc(s.alloc_slot).sleep.is_some())
}

/// Places a small allocation in an awake slab of its tag and class, making
/// a slab (one chunk, like any allocation, with the tag) when none has
/// room. Returns its small slot.
pub(super) fn alloc_small(
    st: &mut State,
    tx: &mut Txn<'_>,
    tag: u32,
    class: u16,
    size: u64,
    events: &mut Vec<MoveEvent>,
) -> Result<u32> {
    // A sleeping slab maps nothing: its free objects wait for its wake.
    let awake = st.small.partial_slabs(tag, class).find(|&s| st.alloc(st.small.slab(s).alloc_slot).sleep.is_none());
    let slab = match awake {
        Some(s) => s,
        None => {
            let chunk = st.chunk;
            // A slab serves objects of any stream: no reuse by stream.
            let stream = st.reuse.op_stream.take();
            let placed = alloc_pages(st, tx, 1, 1, chunk, false, Owner::Slab(u32::MAX), events);
            st.reuse.op_stream = stream;
            let slot = placed?;
            let slab = st.small.add_slab(tag, class, slot);
            let a = st.alloc_mut(slot);
            a.owner = Owner::Slab(slab);
            a.tag = tag;
            slab
        }
    };
    Ok(st.small.take(slab, size).0)
}

/// Address of a small allocation in its slab.
pub(super) fn small_ptr(st: &State, small_slot: u32) -> u64 {
    match st.small.slots[small_slot as usize].entry.as_ref().expect("live small slot") {
        SmallEntry::InSlab { slab, index, .. } => {
            let s = st.small.slab(*slab);
            st.addr(st.alloc(s.alloc_slot).start) + *index as u64 * st.small.classes.size(s.class)
        }
        SmallEntry::Promoted { alloc_slot } => st.addr(st.alloc(*alloc_slot).start),
    }
}

/// Resizes a small allocation. Within its class it stays where it is;
/// beyond, it gets a new place (another class, or whole chunks) and its
/// bytes are copied — the one place where the arena copies. The copy counts
/// in `bytes_copied`, and the address change is reported like a move.
fn resize_small(
    st: &mut State,
    tx: &mut Txn<'_>,
    ss: u32,
    id: Id,
    new_size: u64,
    events: &mut Vec<MoveEvent>,
) -> Result<u64> {
    let SmallEntry::InSlab { slab, .. } = *st.small.entry_of(ss) else {
        unreachable!("resolve gives Small only for objects in slabs")
    };
    let (class, tag) = (st.small.slab(slab).class, st.small.slab(slab).tag);
    // Like an allocation of whole chunks, a sleeping one keeps its size.
    if small_asleep(st, ss) {
        return Err(Error::Asleep(id.get()));
    }
    if new_size <= st.small.classes.size(class) {
        st.small.set_size(ss, new_size);
        return Ok(small_ptr(st, ss));
    }
    copy_small(st, tx, ss, id, new_size, tag, events)
}

/// Gives a small allocation a new place for `new_size` bytes and `tag` (a
/// slab of that tag and `new_size`'s class, or whole chunks with that tag
/// past the classes) and copies its bytes there; its old place is retired.
/// Refused for a pinned allocation (`Pinned`) or a sleeping one (`Asleep`:
/// its bytes are not mapped).
#[allow(clippy::too_many_arguments)]
pub(super) fn copy_small(
    st: &mut State,
    tx: &mut Txn<'_>,
    ss: u32,
    id: Id,
    new_size: u64,
    tag: u32,
    events: &mut Vec<MoveEvent>,
) -> Result<u64> {
    let SmallEntry::InSlab { size, pinned, .. } = *st.small.entry_of(ss) else {
        unreachable!("copy_small moves objects in slabs only")
    };
    if pinned {
        return Err(Error::Pinned(id.get()));
    }
    if small_asleep(st, ss) {
        return Err(Error::Asleep(id.get()));
    }
    let mut sim = st.clone();
    let mut evs = Vec::new();
    let done = (|| {
        let chunk = sim.chunk;
        let new_place = match sim.small.classes.class_of(new_size) {
            Some(c) => {
                let tmp = alloc_small(&mut sim, tx, tag, c, new_size, &mut evs)?;
                NewPlace::Small(tmp)
            }
            None => {
                let pages = pages_for(new_size, chunk, "new_size")?;
                let owner = Owner::Promoted(ss);
                let slot = alloc_pages(&mut sim, tx, pages, pages, new_size, false, owner, &mut evs)?;
                sim.alloc_mut(slot).tag = tag;
                NewPlace::Chunks(slot)
            }
        };
        // Placing the new object may have compacted: read the old address now.
        let old_ptr = small_ptr(&sim, ss);
        let new_ptr = match new_place {
            NewPlace::Small(tmp) => small_ptr(&sim, tmp),
            NewPlace::Chunks(slot) => sim.addr(sim.alloc(slot).start),
        };
        // Through the transaction: in a batch (`resize_many`, a group's
        // resize) a later request may fail, and its rollback must give the
        // destination its bytes back.
        tx.copy(new_ptr, old_ptr, size.min(new_size))?;
        sim.bytes_copied += size.min(new_size);
        // The old place is retired, not freed: a kernel may still use it.
        sim.small.retire(ss);
        match new_place {
            NewPlace::Small(tmp) => sim.small.adopt(ss, tmp),
            NewPlace::Chunks(slot) => sim.small.set_entry(ss, SmallEntry::Promoted { alloc_slot: slot }),
        }
        sim.moves += 1;
        evs.push(MoveEvent { id, old_ptr, new_ptr, size: new_size });
        Ok::<_, Error>(new_ptr)
    })();
    let ptr = done?;
    *st = sim;
    events.extend(evs);
    Ok(ptr)
}

/// Frees what `target` names at once (the bookkeeping of `Arena::free`).
pub(super) fn free_now(st: &mut State, target: Target) {
    match target {
        Target::Chunks(slot) => {
            if let Owner::Promoted(ss) = st.alloc(slot).owner {
                st.small.drop_slot(ss);
            }
            st.remove_alloc(slot);
        }
        Target::Small(ss) => {
            let SmallEntry::InSlab { slab, .. } = *st.small.entry_of(ss) else {
                unreachable!("resolve gives Small only for objects in slabs")
            };
            match st.small.release(ss) {
                Some(empty_slab) => st.remove_alloc(empty_slab),
                // Freeing a pinned object unpins it: the slab stays
                // pinned only while another object in it is.
                None => sync_slab_pin(st, slab),
            }
            st.small.drop_slot(ss);
        }
    }
}

/// A slab is pinned while any object in it is.
pub(super) fn sync_slab_pin(st: &mut State, slab: u32) {
    let s = st.small.slab(slab);
    let (slab_slot, pinned) = (s.alloc_slot, s.pinned > 0);
    st.alloc_mut(slab_slot).pinned = pinned;
}

enum NewPlace {
    Small(u32),
    Chunks(u32),
}

/// What an id names.
pub(crate) enum Target {
    /// An allocation of whole chunks (its arena slot).
    Chunks(u32),
    /// A small allocation in a slab (its small-table slot).
    Small(u32),
}

impl State {
    /// Resolves a caller's id; unknown, freed and internal ids are errors.
    pub(crate) fn resolve(&self, id: Id) -> Result<Target> {
        if !id.is_small() {
            return self.lookup(id).map(Target::Chunks);
        }
        let crate::id::IdParts { generation, tag, slot, .. } = id.parts();
        if tag != self.tag {
            return Err(Error::UnknownAllocation(id.get()));
        }
        match self.small.entry(slot, generation) {
            Some(SmallEntry::InSlab { .. }) => Ok(Target::Small(slot)),
            Some(SmallEntry::Promoted { alloc_slot }) => Ok(Target::Chunks(*alloc_slot)),
            None => Err(Error::UnknownAllocation(id.get())),
        }
    }

    /// The id a caller knows an allocation of whole chunks by.
    pub(crate) fn user_id(&self, slot: u32) -> Id {
        match self.alloc(slot).owner {
            Owner::Promoted(ss) => self.small_id(ss),
            _ => self.id_of(slot),
        }
    }
}
