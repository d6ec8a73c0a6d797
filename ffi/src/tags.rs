//! Allocations tagged at birth: `vmm_arena_alloc_tagged` and
//! `vmm_arena_alloc_growable_tagged`.
//!
//! A tag selects what `vmm_arena_sleep` and `vmm_arena_wake` act on. Every
//! allocation has one (0 unless given), whatever its size: small ones (at
//! most half a chunk) go into slabs of their tag only, so a tag's slabs
//! sleep and wake with it and no other tag's bytes are in them.

use arena::Error;

use crate::boundary::{boundary, handle, put, required};
use crate::{vmm_arena, vmm_arena_id, vmm_arena_status};

/// vmm_arena_alloc with a tag: the allocation sleeps and wakes with `tag`
/// (see vmm_arena_set_tag). A small allocation (at most half a chunk) is
/// placed in a slab holding allocations of this tag only. Any tag value is
/// allowed; VMM_ARENA_ALL_TAGS as a tag is selected by every sleep and wake.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc_tagged(
    arena: *mut vmm_arena,
    size: u64,
    tag: u32,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc_tagged", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc_tagged(size, tag)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok::<(), Error>(())
    })
}

/// vmm_arena_alloc_growable with a tag (see vmm_arena_alloc_tagged).
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc_growable_tagged(
    arena: *mut vmm_arena,
    size: u64,
    max_size: u64,
    tag: u32,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc_growable_tagged", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc_growable_tagged(size, max_size, tag)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok::<(), Error>(())
    })
}
