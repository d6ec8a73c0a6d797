//! Two-phase operations, for groups whose members live in separate
//! processes (tensor parallelism with one process per GPU, as vLLM and
//! SGLang run): every rank *prepares* the same operation on its own arena,
//! the engine agrees through its own collective (all prepared, or not),
//! and every rank then *commits* or *aborts*. No coordinator of ours takes
//! part; all or nothing holds across processes because:
//! - a prepare does everything that can fail (an allocation or a growth
//!   makes its chunks and mappings; a shrink or free runs every check its
//!   commit would run), and fails with the arena as it was;
//! - a commit then does nothing that can fail for memory or a driver call
//!   (an allocation or growth is already done; a shrink or free is
//!   bookkeeping), and an abort undoes a prepare with bookkeeping only
//!   (the free of the new allocation, the shrink back of the growth). The
//!   one free that makes driver calls, of an exported or DMA-BUF'd
//!   allocation (its chunks go back to the driver, never to the pool),
//!   cannot fail either: when they fail, the chunks are held (still in
//!   `mapped_bytes`) and the next call gives them back.
//!
//! The guarantee: after a successful prepare, with no other call on that
//! allocation in between, commit cannot fail (but for a poisoned arena) and
//! abort restores exactly the state before the prepare. Another call that
//! changed the allocation since (a resize, a free, a sleep, the wake of a
//! sleeper prepared for a free, an export or an `alloc_shared` that a
//! shrink would have to unmap) invalidates the
//! prepare: commit and abort then return [`Error::Stale`] and do nothing,
//! checked under the same lock as the work, so a stale operation never
//! acts on a state it was not prepared for. What the prepare left is
//! recorded as the allocation's size and awake state: calls that change
//! neither (pin, set_tag, a move by compaction) leave the prepare valid.
//!
//! So that ranks stay identical after an abort, a prepare moves nothing:
//! an allocation is placed in whole chunks without moving others
//! (`OutOfAddressSpace` when no free range fits: compact on every rank and
//! prepare again), and a growth stays inside the allocation's reservation
//! (`alloc_growable`'s `max_size`; `InvalidArgument` beyond it). With
//! `ArenaConfig::deterministic_placement`, placement ignores the chunks an
//! abort left pooled, so every rank places the next allocation at the same
//! offset from its base.
//!
//! A [`Prepared`] must be committed or aborted, on the arena that made it,
//! before the next operation that the ranks must agree on; operations in
//! between on other allocations are fine for all-or-nothing, but ranks must
//! apply the same operations in the same order to keep the same offsets.

use crate::error::{Error, Result};
use crate::Id;

use super::alloc::{Placing, Target};
use super::{pages_for, Arena, Inner};

/// An operation prepared on one arena ([`Arena::prepare_alloc`],
/// [`Arena::prepare_resize`], [`Arena::prepare_free`]); give it back to
/// [`Arena::commit`] or [`Arena::abort`]. Dropped without either, a
/// prepared allocation or growth stays as made (as if committed) and a
/// prepared shrink or free never happens (as if aborted).
#[must_use = "commit or abort it on every rank"]
#[derive(Debug)]
pub struct Prepared {
    arena: u64,
    op: Op,
}

/// Each operation with the size its allocation had when the prepare
/// returned (what commit and abort check it still has).
#[derive(Clone, Copy, Debug)]
enum Op {
    /// Allocated with `size` bytes; the abort frees it.
    Alloc { id: Id, size: u64 },
    /// Grown from `old` to `new` bytes; the abort shrinks it back.
    Grow { id: Id, old: u64, new: u64 },
    /// Checked at `from` bytes; the commit shrinks it to `size` bytes.
    Shrink { id: Id, from: u64, size: u64 },
    /// Checked at `size` bytes, asleep or not; the commit frees it.
    Free { id: Id, size: u64, asleep: bool },
}

impl Prepared {
    /// The allocation it acts on (the new one, for an allocation).
    pub fn id(&self) -> Id {
        match self.op {
            Op::Alloc { id, .. } | Op::Grow { id, .. } | Op::Shrink { id, .. } | Op::Free { id, .. } => id,
        }
    }
}

fn whole_chunks_only() -> Error {
    Error::invalid("two-phase operations act on allocations of whole chunks (prepare_alloc's)")
}

/// The slot of an allocation a two-phase operation may act on: whole
/// chunks of this arena (not a small object, not an import).
fn chunk_slot(inner: &Inner, id: Id) -> Result<u32> {
    if id.is_small() {
        return Err(whole_chunks_only());
    }
    #[cfg(unix)]
    if let Some(r) = inner.shares.import_of(&inner.st, id) {
        r?;
        return Err(Error::invalid("two-phase operations do not act on imported allocations"));
    }
    match inner.st.resolve(id)? {
        Target::Chunks(slot) => Ok(slot),
        Target::Small(_) => Err(whole_chunks_only()),
    }
}

/// Whether shrinking `slot` to `pages` would unmap chunks another
/// allocation maps too (`alloc_shared`): a growable allocation unmaps its
/// page of them at once, with driver calls a commit must not make.
fn shrink_unmaps_shared(inner: &Inner, slot: u32, pages: u64) -> bool {
    let a = inner.st.alloc(slot);
    a.growable && pages < a.backed && (a.start + pages..a.start + a.backed).any(|p| inner.st.page_shared(p))
}

/// `Ok` when the allocation is as the prepare left it (`size` bytes,
/// awake, or asleep where `asleep`: only a free may be prepared of a
/// sleeper) and shrinking it to `to_bytes` (when given) needs no driver
/// call and no export forbids it; else `Stale`.
fn unchanged(inner: &Inner, chunk: u64, id: Id, size: u64, asleep: bool, to_bytes: Option<u64>) -> Result<()> {
    let stale =
        |why: String| Error::Stale(format!("allocation {:#x} {why} since its prepare; nothing was done", id.get()));
    let slot = match inner.st.resolve(id) {
        Ok(Target::Chunks(slot)) => slot,
        _ => return Err(stale("was freed".into())),
    };
    let a = inner.st.alloc(slot);
    match (a.sleep.is_some(), asleep) {
        (true, false) => return Err(stale("was put to sleep".into())),
        (false, true) => return Err(stale("was woken".into())),
        _ => {}
    }
    if a.size != size {
        return Err(stale(format!("was resized from {size} to {} bytes", a.size)));
    }
    if let Some(to) = to_bytes {
        let pages = pages_for(to, chunk, "size")?;
        #[cfg(unix)]
        inner.shares.check_resize(&inner.st, id, pages).map_err(|e| stale(format!("was exported ({e})")))?;
        if shrink_unmaps_shared(inner, slot, pages) {
            return Err(stale("had chunks shared with alloc_shared".into()));
        }
    }
    Ok(())
}

impl Arena {
    /// Prepares an allocation of `size` bytes in whole chunks (however
    /// small), reserving `max_size` (growable when `growable`), moving no
    /// other allocation; returns it and its address. On error nothing
    /// changed (`OutOfAddressSpace` when only compaction would make room;
    /// `InvalidArgument` for a `max_size` other than `size` when not
    /// `growable`).
    pub fn prepare_alloc(&self, size: u64, max_size: u64, growable: bool) -> Result<(Prepared, u64)> {
        if !growable && max_size != size {
            return Err(Error::invalid(format!(
                "max_size {max_size} must equal size {size} for an allocation that is not growable"
            )));
        }
        let (id, ptr) = self.alloc_whole(size, max_size, growable, Placing::WholeNoMoves)?;
        Ok((Prepared { arena: self.sh.key, op: Op::Alloc { id, size } }, ptr))
    }

    /// Prepares a resize of an allocation of whole chunks. A growth is done
    /// now, inside its reservation; a shrink is checked now, as the commit
    /// would check it, and done by the commit. Returns the allocation's
    /// address (it does not move). On error nothing changed.
    ///
    /// Errors, the call's own arguments first: `InvalidArgument` for a
    /// small allocation, an import, a `new_size` of 0 or beyond the
    /// reservation (allocate with `prepare_alloc(growable)` and a larger
    /// `max_size`), a shrink below an export's chunks or one that would
    /// unmap chunks shared by `alloc_shared` (driver calls: use `resize`);
    /// `UnknownAllocation`; `Asleep`; then what the growth meets
    /// (`OutOfMemory`, `Driver`).
    pub fn prepare_resize(&self, id: Id, new_size: u64) -> Result<(Prepared, u64)> {
        let np = pages_for(new_size, self.chunk, "new_size")?;
        let (size, ptr) = {
            let inner = self.lock()?;
            let slot = chunk_slot(&inner, id)?;
            let a = inner.st.alloc(slot);
            if np > a.reserved {
                return Err(Error::invalid(format!(
                    "a two-phase growth stays inside the reservation: {new_size} bytes exceed its {} \
                     (allocate with prepare_alloc(growable) and a larger max_size)",
                    a.reserved * self.chunk
                )));
            }
            #[cfg(unix)]
            inner.shares.check_resize(&inner.st, id, np)?;
            if a.sleep.is_some() {
                return Err(Error::Asleep(id.get()));
            }
            if new_size <= a.size && shrink_unmaps_shared(&inner, slot, np) {
                return Err(Error::invalid(
                    "a two-phase shrink cannot unmap chunks shared with alloc_shared (driver calls a commit \
                     must not make); shrink it with resize",
                ));
            }
            (a.size, inner.st.addr(a.start))
        };
        if new_size <= size {
            let op = Op::Shrink { id, from: size, size: new_size };
            return Ok((Prepared { arena: self.sh.key, op }, ptr));
        }
        let chunk = self.chunk;
        // Grown only if nothing changed it since the checks above.
        let grown = self.resize_checked(id, new_size, None, |inner| unchanged(inner, chunk, id, size, false, None))?;
        if grown != ptr {
            // Cannot happen inside the reservation; if it did, ranks would
            // disagree on the address, so say so rather than go on.
            return Err(Error::Internal(format!("a growth inside its reservation moved {:#x}", id.get())));
        }
        Ok((Prepared { arena: self.sh.key, op: Op::Grow { id, old: size, new: new_size } }, ptr))
    }

    /// Prepares a free: checks the id (an allocation of whole chunks of
    /// this arena, not an import); the commit frees it. A sleeping
    /// allocation may be prepared, as `free` frees it (its backup
    /// dropped); a wake before the commit makes the prepare stale, as a
    /// sleep does for an awake one.
    pub fn prepare_free(&self, id: Id) -> Result<Prepared> {
        let inner = self.lock()?;
        let slot = chunk_slot(&inner, id)?;
        let a = inner.st.alloc(slot);
        let (size, asleep) = (a.size, a.sleep.is_some());
        Ok(Prepared { arena: self.sh.key, op: Op::Free { id, size, asleep } })
    }

    /// Commits a prepared operation. With no other call on its allocation
    /// since the prepare, it cannot fail (but for a poisoned arena:
    /// `Internal`). `Stale` when another call changed the allocation since
    /// (resized, freed, put to sleep it, or exported or shared the chunks a
    /// shrink would drop): nothing is done. `InvalidArgument` for another
    /// arena's [`Prepared`].
    pub fn commit(&self, p: Prepared) -> Result<()> {
        self.check_owner(&p)?;
        let chunk = self.chunk;
        match p.op {
            Op::Alloc { id, size } | Op::Grow { id, new: size, .. } => {
                unchanged(&*self.lock()?, chunk, id, size, false, None)
            }
            Op::Shrink { id, from, size } => self
                .resize_checked(id, size, None, |inner| unchanged(inner, chunk, id, from, false, Some(size)))
                .map(drop),
            Op::Free { id, size, asleep } => {
                self.free_committed(id, |inner| unchanged(inner, chunk, id, size, asleep, None))
            }
        }
    }

    /// Aborts a prepared operation: frees a prepared allocation, shrinks a
    /// prepared growth back, forgets a prepared shrink or free; with no
    /// other call on its allocation since the prepare, the arena is then
    /// exactly as before the prepare. Fails only as [`Arena::commit`] does.
    pub fn abort(&self, p: Prepared) -> Result<()> {
        self.check_owner(&p)?;
        let chunk = self.chunk;
        match p.op {
            Op::Alloc { id, size } => self.free_committed(id, |inner| unchanged(inner, chunk, id, size, false, None)),
            Op::Grow { id, old, new } => {
                self.resize_checked(id, old, None, |inner| unchanged(inner, chunk, id, new, false, Some(old))).map(drop)
            }
            Op::Shrink { id, from: size, .. } => unchanged(&*self.lock()?, chunk, id, size, false, None),
            Op::Free { id, size, asleep } => unchanged(&*self.lock()?, chunk, id, size, asleep, None),
        }
    }

    fn check_owner(&self, p: &Prepared) -> Result<()> {
        match p.arena == self.sh.key {
            true => Ok(()),
            false => Err(Error::invalid("this prepared operation belongs to another arena")),
        }
    }
}
