//! The C ABI of same-stream reuse: allocations whose work is ordered on a
//! stream (`vmm_arena_alloc_on_stream`, `vmm_arena_alloc_growable_on_stream`;
//! growth by `vmm_arena_resize_on_stream` is the same path). See
//! `vmm_arena::Arena::alloc_on_stream`; the conventions of the rest of the
//! header apply (statuses, out-parameters written only on VMM_ARENA_OK, the
//! panic boundary, last error). Additions of this project (in neither
//! abi/vmm_arena.h nor abi/vmm_arena_next.h).

use crate::boundary::{boundary, handle, put, required};
use crate::{vmm_arena, vmm_arena_id, vmm_arena_status};

/// Allocates like vmm_arena_alloc, for work ordered on stream (a CUstream;
/// 0 = the legacy default stream): the caller queues every use of the new
/// memory on stream, after the work queued there so far. The allocation may
/// then take memory freed (vmm_arena_free_on_stream) or shrunk
/// (vmm_arena_resize_on_stream) on the same stream at once, with no event
/// wait and no device-wide synchronization: stream order runs the old
/// owner's queued work first. Memory given up on another stream is reused
/// only after its event has completed (the arena waits for it when nothing
/// else can serve). A reused chunk is mapped at the new address at once;
/// its old address is unmapped once the free's event has completed. A small
/// allocation (size within a small class: it shares a slab with objects of
/// any stream) is placed exactly as by vmm_arena_alloc. Host backend (no
/// asynchronous streams): the same as vmm_arena_alloc. Errors: as
/// vmm_arena_alloc.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or
/// writable; `stream` is 0 or a CUstream of the arena's device context.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc_on_stream(
    arena: *mut vmm_arena,
    size: u64,
    stream: u64,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc_on_stream", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc_on_stream(size, stream)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}

/// vmm_arena_alloc_growable for work ordered on stream, as
/// vmm_arena_alloc_on_stream: it may take memory freed or shrunk on the same
/// stream at once. Growing it with vmm_arena_resize_on_stream on that
/// stream reuses the stream's memory too. max_size < size is
/// VMM_ARENA_ERR_INVALID_ARGUMENT; other errors as vmm_arena_alloc_growable.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or
/// writable; `stream` is 0 or a CUstream of the arena's device context.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc_growable_on_stream(
    arena: *mut vmm_arena,
    size: u64,
    max_size: u64,
    stream: u64,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc_growable_on_stream", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc_growable_on_stream(size, max_size, stream)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}
