//! Two-phase operations, for groups whose members live in separate
//! processes (tensor parallelism with one process per GPU, as vLLM and
//! SGLang run): every rank *prepares* the same operation on its own arena,
//! the engine agrees through its own collective (all prepared, or not),
//! and every rank then *commits* or *aborts*. No coordinator of ours takes
//! part; all or nothing holds across processes because:
//! - a prepare does everything that can fail (an allocation or a growth
//!   makes its chunks and mappings; a shrink or free only checks the id),
//!   and fails with the arena as it was;
//! - a commit then does nothing that can fail for memory or a driver call
//!   (an allocation or growth is already done; a shrink or free is
//!   bookkeeping), and an abort undoes a prepare with bookkeeping only
//!   (the free of the new allocation, the shrink back of the growth).
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

use super::alloc::Placing;
use super::Arena;

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

#[derive(Clone, Copy, Debug)]
enum Op {
    /// Allocated; the abort frees it.
    Alloc { id: Id },
    /// Grown from `old` bytes; the abort shrinks it back.
    Grow { id: Id, old: u64 },
    /// Checked; the commit shrinks it to `size` bytes.
    Shrink { id: Id, size: u64 },
    /// Checked; the commit frees it.
    Free { id: Id },
}

impl Prepared {
    /// The allocation it acts on (the new one, for an allocation).
    pub fn id(&self) -> Id {
        match self.op {
            Op::Alloc { id } | Op::Grow { id, .. } | Op::Shrink { id, .. } | Op::Free { id } => id,
        }
    }
}

impl Arena {
    /// Prepares an allocation of `size` bytes in whole chunks (however
    /// small), reserving `max_size` (growable when `growable`), moving no
    /// other allocation; returns it and its address. On error nothing
    /// changed (`OutOfAddressSpace` when only compaction would make room).
    pub fn prepare_alloc(&self, size: u64, max_size: u64, growable: bool) -> Result<(Prepared, u64)> {
        let (id, ptr) = self.alloc_whole(size, max_size, growable, Placing::WholeNoMoves)?;
        Ok((Prepared { arena: self.sh.key, op: Op::Alloc { id } }, ptr))
    }

    /// Prepares a resize of an allocation of whole chunks. A growth is done
    /// now, inside its reservation (beyond it, or of a small allocation:
    /// `InvalidArgument`); a shrink is only checked, and done by the commit.
    /// Returns the allocation's address (it does not move). On error
    /// nothing changed.
    pub fn prepare_resize(&self, id: Id, new_size: u64) -> Result<(Prepared, u64)> {
        if id.is_small() {
            return Err(Error::invalid("two-phase operations act on allocations of whole chunks (prepare_alloc's)"));
        }
        let info = self.query(id)?;
        if info.asleep {
            return Err(Error::Asleep(id.get()));
        }
        if new_size <= info.size {
            let op = Op::Shrink { id, size: new_size };
            return Ok((Prepared { arena: self.sh.key, op }, info.ptr));
        }
        if new_size > info.reserved_bytes {
            return Err(Error::invalid(format!(
                "a two-phase growth stays inside the reservation: {new_size} bytes exceed its {} \
                 (allocate with prepare_alloc(growable) and a larger max_size)",
                info.reserved_bytes
            )));
        }
        let ptr = self.resize(id, new_size)?;
        if ptr != info.ptr {
            // Cannot happen inside the reservation; if it did, ranks would
            // disagree on the address, so say so rather than go on.
            return Err(Error::Internal(format!("a growth inside its reservation moved {:#x}", id.get())));
        }
        Ok((Prepared { arena: self.sh.key, op: Op::Grow { id, old: info.size } }, ptr))
    }

    /// Prepares a free: checks the id; the commit frees it.
    pub fn prepare_free(&self, id: Id) -> Result<Prepared> {
        if id.is_small() {
            return Err(Error::invalid("two-phase operations act on allocations of whole chunks (prepare_alloc's)"));
        }
        self.query(id)?;
        Ok(Prepared { arena: self.sh.key, op: Op::Free { id } })
    }

    /// Commits a prepared operation. Fails only when the allocation was
    /// changed behind its back (freed, put to sleep), when a shrink unmaps
    /// chunks another allocation shares (`alloc_shared`), or when the arena
    /// is poisoned; `InvalidArgument` for another arena's [`Prepared`].
    pub fn commit(&self, p: Prepared) -> Result<()> {
        self.check_owner(&p)?;
        match p.op {
            Op::Alloc { .. } | Op::Grow { .. } => Ok(()),
            Op::Shrink { id, size } => self.resize(id, size).map(drop),
            Op::Free { id } => self.free(id),
        }
    }

    /// Aborts a prepared operation: frees a prepared allocation, shrinks a
    /// prepared growth back, forgets a prepared shrink or free. Fails only
    /// as [`Arena::commit`] does.
    pub fn abort(&self, p: Prepared) -> Result<()> {
        self.check_owner(&p)?;
        match p.op {
            Op::Alloc { id } => self.free(id),
            Op::Grow { id, old } => self.resize(id, old).map(drop),
            Op::Shrink { .. } | Op::Free { .. } => Ok(()),
        }
    }

    fn check_owner(&self, p: &Prepared) -> Result<()> {
        match p.arena == self.sh.key {
            true => Ok(()),
            false => Err(Error::invalid("this prepared operation belongs to another arena")),
        }
    }
}
