//! The C ABI of two-phase operations (see `vmm_arena::arena::two_phase`):
//! for tensor-parallel ranks in separate processes, each with its own
//! arena, that prepare the same operation, agree through the engine's own
//! collective, then all commit or all abort.
//!
//! What "prepared" promises: after a prepare returned OK, with no other
//! call on that allocation before the commit or abort, vmm_arena_commit
//! cannot fail (but for a poisoned arena) and vmm_arena_abort restores
//! exactly the state before the prepare. Another call that changed the
//! allocation in between (a resize, a free, a sleep, the wake of a sleeper
//! prepared for a free, an export or a share of the chunks a shrink would
//! drop) invalidates the prepare: commit and
//! abort then return VMM_ARENA_ERR_STALE and do nothing.

use arena::{Id, Prepared};

use crate::{boundary, handle, id_arg, invalid, put, required, vmm_arena, vmm_arena_id};
use crate::{vmm_arena_status, with_raw_id};

/// vmm_arena_prepare_alloc flag: the allocation is growable (reserving
/// max_size), as vmm_arena_alloc_growable.
pub const VMM_ARENA_PREPARE_GROWABLE: u32 = 1u32;

/// Opaque prepared operation: give it to vmm_arena_commit or
/// vmm_arena_abort (either consumes it).
pub struct vmm_arena_prepared {
    prepared: Prepared,
}

/// Writes a new prepared handle to `out`.
///
/// # Safety
/// `out` is writable (checked by `required`).
unsafe fn publish(prepared: Prepared, out: std::ptr::NonNull<*mut vmm_arena_prepared>) {
    let p = Box::into_raw(Box::new(vmm_arena_prepared { prepared }));
    // SAFETY: per this function's contract.
    unsafe { put(out, p) };
}

/// Prepares an allocation of size bytes, in whole chunks however small
/// (flags: VMM_ARENA_PREPARE_GROWABLE to reserve max_size and grow in place
/// up to it; without it max_size must equal size), moving no other
/// allocation. *out_prepared, *out_id and *out_ptr receive the prepared
/// operation and the new allocation (usable now; an abort frees it).
///
/// Every rank of a tensor-parallel group calls this with the same arguments
/// on its own arena, the engine gathers the statuses through its own
/// collective, and then every rank calls vmm_arena_commit if all succeeded,
/// else vmm_arena_abort (a rank whose prepare failed has nothing to abort).
/// With VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT on every rank and the same
/// operations in the same order, every rank's allocation is at the same
/// offset from its arena's base, an aborted one included.
///
/// OUT_OF_ADDRESS_SPACE when no free range fits without moving others
/// (vmm_arena_compact on every rank, then prepare again); otherwise as
/// vmm_arena_alloc. On failure nothing changed.
///
/// # Safety
/// `arena` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_prepare_alloc(
    arena: *mut vmm_arena,
    size: u64,
    max_size: u64,
    flags: u32,
    out_prepared: *mut *mut vmm_arena_prepared,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_prepare_alloc", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_prepared, "out_prepared")?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        if flags & !VMM_ARENA_PREPARE_GROWABLE != 0 {
            return Err(invalid(format!("unknown prepare flags {:#x}", flags & !VMM_ARENA_PREPARE_GROWABLE)));
        }
        let growable = flags & VMM_ARENA_PREPARE_GROWABLE != 0;
        let (p, ptr) = h.live()?.prepare_alloc(size, max_size, growable)?;
        let id = p.id().get();
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id);
            put(optr, ptr);
            publish(p, out);
        }
        Ok(())
    })
}

/// Prepares a resize of an allocation of whole chunks to new_size: a growth
/// is done now, inside its reservation; a shrink is checked now, as the
/// commit would check it, and done by the commit. *out_ptr receives its
/// address (unchanged). Then commit or abort on every rank, as for
/// vmm_arena_prepare_alloc. On failure nothing changed.
///
/// Errors, the call's own arguments first: INVALID_ARGUMENT for a small
/// allocation, an imported one, a new_size of 0 or beyond the reservation,
/// a shrink below the chunks an export holds, or a shrink that would unmap
/// chunks shared by vmm_arena_alloc_shared (a driver call, which a commit
/// must not make: use vmm_arena_resize); then UNKNOWN_ALLOCATION, ASLEEP,
/// and what a growth meets (OUT_OF_MEMORY, DRIVER).
///
/// # Safety
/// `arena` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_prepare_resize(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    new_size: u64,
    out_prepared: *mut *mut vmm_arena_prepared,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_prepare_resize", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_prepared, "out_prepared")?;
        let optr = required(out_ptr, "out_ptr")?;
        let (p, ptr) = h.live()?.prepare_resize(id_arg(id), new_size).map_err(with_raw_id(id))?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(optr, ptr);
            publish(p, out);
        }
        Ok(())
    })
}

/// Prepares a free of an allocation of whole chunks: checks the id
/// (INVALID_ARGUMENT for a small or an imported allocation); the commit
/// frees it. A sleeping allocation may be prepared, as vmm_arena_free frees
/// one (its backup dropped); waking it before the commit makes the prepare
/// stale.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_prepared` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_prepare_free(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    out_prepared: *mut *mut vmm_arena_prepared,
) -> vmm_arena_status {
    boundary("vmm_arena_prepare_free", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_prepared, "out_prepared")?;
        let p = h.live()?.prepare_free(id_arg(id)).map_err(with_raw_id(id))?;
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { publish(p, out) };
        Ok(())
    })
}

/// Takes the operation out of a caller's handle, consuming it.
///
/// # Safety
/// `prepared` is NULL or a live handle that the caller gives up.
unsafe fn take(prepared: *mut vmm_arena_prepared) -> Result<Prepared, arena::Error> {
    if prepared.is_null() {
        return Err(invalid("prepared is NULL"));
    }
    // SAFETY: made by Box::into_raw in `publish`, given up by the caller.
    Ok(unsafe { Box::from_raw(prepared) }.prepared)
}

/// Commits a prepared operation and consumes the handle (on any status but
/// an INVALID_ARGUMENT for a NULL arena or prepared, which leave it with the
/// caller). Nothing in it can fail for memory or a driver call (the free of
/// an exported or DMA-BUF'd allocation, whose chunks go back to the driver,
/// holds them when that fails, still counted in mapped_bytes, and the next
/// call gives them back): with no
/// other call on the allocation since the prepare it returns OK (but for a
/// poisoned arena: INTERNAL). VMM_ARENA_ERR_STALE when another call changed
/// the allocation since (resized, freed, put it to sleep or woke a sleeper
/// prepared for a free; exported or
/// shared the chunks a shrink would drop): nothing is done, checked under
/// the same lock as the work. Calls that change neither its size nor its
/// awake state (pin, set_tag, a move by compaction) leave the prepare
/// valid. INVALID_ARGUMENT for a prepared handle of another arena.
///
/// # Safety
/// `arena` is NULL or a live handle; `prepared` is NULL or a live handle,
/// not used again after the call.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_commit(
    arena: *mut vmm_arena,
    prepared: *mut vmm_arena_prepared,
) -> vmm_arena_status {
    boundary("vmm_arena_commit", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        // SAFETY: per this function's contract.
        let p = unsafe { take(prepared) }?;
        let id: Id = p.id();
        h.live()?.commit(p).map_err(with_raw_id(id.get()))
    })
}

/// Aborts a prepared operation (frees a prepared allocation, shrinks a
/// prepared growth back, forgets a prepared shrink or free) and consumes
/// the handle, as vmm_arena_commit: with no other call on the allocation
/// since the prepare, the arena is then exactly as before the prepare;
/// fails only as vmm_arena_commit does (STALE: nothing is done).
///
/// # Safety
/// As for vmm_arena_commit.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_abort(arena: *mut vmm_arena, prepared: *mut vmm_arena_prepared) -> vmm_arena_status {
    boundary("vmm_arena_abort", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        // SAFETY: per this function's contract.
        let p = unsafe { take(prepared) }?;
        let id: Id = p.id();
        h.live()?.abort(p).map_err(with_raw_id(id.get()))
    })
}
