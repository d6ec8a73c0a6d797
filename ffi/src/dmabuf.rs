//! The C ABI of DMA-BUF handles (see `vmm_arena::arena::dmabuf` for the
//! semantics). Conventions as in the rest of the header.

use std::os::fd::AsRawFd;

use arena::DmaBuf;

use crate::{boundary, handle, id_arg, invalid, optional, put, required, vmm_arena, vmm_arena_id};
use crate::{vmm_arena_status, with_raw_id};

/// Opaque open DMA-BUF of an allocation: one descriptor for its backed
/// chunks, owned by the handle. It may outlive the arena that made it.
pub struct vmm_arena_dmabuf {
    buf: DmaBuf,
}

/// A DMA-BUF of allocation id's backed chunks (cuMemGetHandleForAddressRange),
/// for RDMA stacks to register (NIXL, UCX, Mooncake). *out receives a handle
/// that owns the descriptor (vmm_arena_dmabuf_fd reads it, close-on-exec);
/// vmm_arena_dmabuf_close closes both. GPU only: VMM_ARENA_ERR_UNSUPPORTED
/// on the host backend.
///
/// A DMA-BUF reaches the physical chunks behind the allocation when it was
/// made, not its addresses. So while any DMA-BUF of an allocation is open,
/// its chunks are never reused: the allocation is pinned (it never moves),
/// vmm_arena_sleep leaves it awake, a resize below the chunks handed out is
/// INVALID_ARGUMENT, and from its first DMA-BUF on its chunks never go back
/// to the pool (as for vmm_arena_export_open). vmm_arena_free while a
/// DMA-BUF is open succeeds, and the id is gone at once, but the chunks stay
/// mapped where they were (counted in mapped_bytes and against the
/// capacity) until the last DMA-BUF of them is closed; the arena's next
/// operation after that (an alloc, free, resize, trim, compact...; not a
/// read-only call such as vmm_arena_stats_get) gives them back to the
/// driver.
///
/// Close a DMA-BUF only when no device reaches the memory through it any
/// more (after ibv_dereg_mr of every registration made from it). The handle
/// may outlive its arena, but vmm_arena_destroy releases every chunk: close
/// the DMA-BUFs (and deregister) before destroying the arena.
///
/// INVALID_ARGUMENT for a small allocation, an import (take the DMA-BUF in
/// the exporting process), or an allocation whose chunks another allocation
/// shares (vmm_arena_alloc_shared, awake or asleep); ASLEEP for a sleeping
/// one. On failure nothing changed.
///
/// # Safety
/// `arena` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_dmabuf_open(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    out: *mut *mut vmm_arena_dmabuf,
) -> vmm_arena_status {
    boundary("vmm_arena_dmabuf_open", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out, "out")?;
        let buf = h.live()?.dmabuf(id_arg(id)).map_err(with_raw_id(id))?;
        let p = Box::into_raw(Box::new(vmm_arena_dmabuf { buf }));
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, p) };
        Ok(())
    })
}

/// The DMA-BUF's descriptor (*out_fd, still owned by the handle: register
/// it, or dup() it, but do not close it) and the bytes it spans
/// (*out_bytes, may be NULL): the allocation's backed chunks when it was
/// made.
///
/// # Safety
/// `handle` is NULL or a live DMA-BUF; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_dmabuf_fd(
    handle: *const vmm_arena_dmabuf,
    out_fd: *mut i32,
    out_bytes: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_dmabuf_fd", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let d = unsafe { handle.as_ref() }.ok_or_else(|| invalid("dmabuf is NULL"))?;
        let fd = required(out_fd, "out_fd")?;
        let bytes = optional(out_bytes, "out_bytes")?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(fd, d.buf.fd().as_raw_fd());
            if let Some(b) = bytes {
                put(b, d.buf.bytes());
            }
        }
        Ok(())
    })
}

/// Closes a DMA-BUF handle and its descriptor. Once every DMA-BUF of an
/// allocation is closed, it is no longer pinned by them, and if it was freed
/// meanwhile its chunks go back to the driver at the arena's next
/// operation (see vmm_arena_dmabuf_open).
/// NULL is fine.
///
/// # Safety
/// `handle` is NULL or a live DMA-BUF that no other thread is using, and is
/// not used again.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_dmabuf_close(handle: *mut vmm_arena_dmabuf) {
    let _ = boundary("vmm_arena_dmabuf_close", std::ptr::null(), || {
        if !handle.is_null() {
            // SAFETY: made by Box::into_raw in vmm_arena_dmabuf_open, owned by
            // the caller, who gives it up here.
            drop(unsafe { Box::from_raw(handle) });
        }
        Ok(())
    });
}
