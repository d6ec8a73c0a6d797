//! The C ABI of exports and imports: sharing an allocation with another
//! process through file descriptors (see `vmm_arena::arena::export` for the
//! semantics). Conventions as in the rest of the header.

use std::os::fd::{AsRawFd, BorrowedFd};

use arena::{Error, Export, ExportLayout};

use crate::{boundary, handle, id_arg, invalid, optional, put, required, vmm_arena, vmm_arena_id};
use crate::{vmm_arena_status, with_raw_id};

/// The format version of vmm_arena_export_layout this library writes and
/// accepts (the version field).
pub const VMM_ARENA_EXPORT_FORMAT_VERSION: u32 = 1u32;

const _: () = assert!(VMM_ARENA_EXPORT_FORMAT_VERSION == arena::EXPORT_FORMAT_VERSION);

/// vmm_arena_import flag: map the chunks readable only (on the host backend
/// a store through the pointer faults; on CUDA the access is
/// CU_MEM_ACCESS_FLAGS_PROT_READ).
pub const VMM_ARENA_IMPORT_READ_ONLY: u32 = 1u32;

/// What an importer needs besides the descriptors: send it with them (a
/// plain struct of integers, 32 bytes). struct_size is set by whoever fills
/// it in and checked by whoever reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct vmm_arena_export_layout {
    /// sizeof(vmm_arena_export_layout)
    pub struct_size: u32,
    /// VMM_ARENA_EXPORT_FORMAT_VERSION
    pub version: u32,
    /// bytes per chunk: the importing arena's chunk_bytes must be equal
    pub chunk_bytes: u64,
    /// chunks, one descriptor each, in address order
    pub chunk_count: u64,
    /// the allocation's size when it was exported
    pub size: u64,
}

/// Opaque open export: one descriptor per chunk of an allocation and its
/// layout. It may outlive the arena that made it (the descriptors keep the
/// memory alive).
pub struct vmm_arena_export {
    export: Export,
}

/// Reads a caller's layout: `struct_size` first, and the rest only when it
/// is this version's size.
///
/// # Safety
/// `layout` is NULL or points to at least `struct_size` readable bytes that
/// start with a `uint32_t struct_size`.
unsafe fn read_layout(layout: *const vmm_arena_export_layout) -> Result<ExportLayout, Error> {
    if layout.is_null() || !layout.is_aligned() {
        return Err(invalid("layout is NULL or not aligned"));
    }
    // SAFETY: non-NULL and aligned; the struct starts with its struct_size.
    let size = unsafe { layout.cast::<u32>().read() };
    if size as usize != std::mem::size_of::<vmm_arena_export_layout>() {
        return Err(invalid(format!(
            "layout->struct_size is {size}, expected sizeof(vmm_arena_export_layout) = {}",
            std::mem::size_of::<vmm_arena_export_layout>()
        )));
    }
    // SAFETY: struct_size says the whole struct is readable; any bits are
    // valid integers.
    let l = unsafe { layout.read() };
    Ok(ExportLayout { version: l.version, chunk_bytes: l.chunk_bytes, chunk_count: l.chunk_count, size: l.size })
}

/// Exports allocation `id`: *out receives a new export holding one file
/// descriptor per chunk of the allocation, owned by the export. The
/// allocation must be of whole chunks (more than half a chunk, or growable;
/// a small allocation is INVALID_ARGUMENT) in an arena created with
/// VMM_ARENA_FLAG_EXPORTABLE (else VMM_ARENA_ERR_UNSUPPORTED); an asleep
/// one is VMM_ARENA_ERR_ASLEEP, an imported one INVALID_ARGUMENT.
///
/// While any export of it is open, the allocation is pinned (it never
/// moves; vmm_arena_unpin takes effect once every export is closed). From
/// its first export until it is freed, its chunks never go back to the
/// pool: vmm_arena_free unmaps and releases them, a resize below the chunks
/// it exported is INVALID_ARGUMENT, it never sleeps, and vmm_arena_alloc_shared
/// from it is INVALID_ARGUMENT (as is exporting an allocation that shares
/// chunks with another).
///
/// If the exporter frees first: the importers' mappings stay valid, with
/// their bytes, until each importer frees its import (the memory lives
/// while any process maps it or holds a descriptor for it); the exporting
/// arena no longer counts it.
///
/// # Safety
/// `arena` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_export_open(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    out: *mut *mut vmm_arena_export,
) -> vmm_arena_status {
    boundary("vmm_arena_export_open", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out, "out")?;
        let export = h.live()?.export(id_arg(id)).map_err(with_raw_id(id))?;
        let p = Box::into_raw(Box::new(vmm_arena_export { export }));
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, p) };
        Ok(())
    })
}

/// Writes the export's layout (layout->struct_size must be set by the
/// caller to sizeof(vmm_arena_export_layout)).
///
/// # Safety
/// `handle` is NULL or a live export; `layout` is NULL or points to at least
/// `layout->struct_size` writable bytes starting with a `uint32_t struct_size`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_export_layout_get(
    handle: *const vmm_arena_export,
    layout: *mut vmm_arena_export_layout,
) -> vmm_arena_status {
    boundary("vmm_arena_export_layout_get", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let e = unsafe { handle.as_ref() }.ok_or_else(|| invalid("export is NULL"))?;
        let out = required(layout, "layout")?;
        // SAFETY: non-NULL and aligned; the struct starts with its struct_size.
        let size = unsafe { out.as_ptr().cast::<u32>().read() };
        if size as usize != std::mem::size_of::<vmm_arena_export_layout>() {
            return Err(invalid(format!(
                "layout->struct_size is {size}, expected sizeof(vmm_arena_export_layout) = {}",
                std::mem::size_of::<vmm_arena_export_layout>()
            )));
        }
        let l = e.export.layout();
        let c = vmm_arena_export_layout {
            struct_size: size,
            version: l.version,
            chunk_bytes: l.chunk_bytes,
            chunk_count: l.chunk_count,
            size: l.size,
        };
        // SAFETY: the caller's struct is struct_size = sizeof bytes, writable.
        unsafe { put(out, c) };
        Ok(())
    })
}

/// The export's descriptors, in chunk order: if cap is at least their
/// count, writes them into fds (fds may be NULL when cap is 0); either way
/// *out_count receives the count, and the status is VMM_ARENA_OK. The
/// descriptors stay owned by the export and are closed by
/// vmm_arena_export_close: pass them on (SCM_RIGHTS gives the receiver its
/// own) or dup() them before closing the export.
///
/// # Safety
/// `handle` is NULL or a live export; `fds` is NULL or has `cap` writable
/// entries; `out_count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_export_fds(
    handle: *const vmm_arena_export,
    fds: *mut i32,
    cap: usize,
    out_count: *mut usize,
) -> vmm_arena_status {
    boundary("vmm_arena_export_fds", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let e = unsafe { handle.as_ref() }.ok_or_else(|| invalid("export is NULL"))?;
        let out = required(out_count, "out_count")?;
        let list = e.export.fds();
        if cap >= list.len() && !list.is_empty() {
            let p = required(fds, "fds")?;
            for (i, fd) in list.iter().enumerate() {
                // SAFETY: `i < list.len() <= cap` writable entries.
                unsafe { p.as_ptr().add(i).write(fd.as_raw_fd()) };
            }
        }
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, list.len()) };
        Ok(())
    })
}

/// Closes an export: its descriptors are closed, and once every export of
/// the allocation is closed it is no longer pinned by them. Importers are
/// not affected. NULL is fine.
///
/// # Safety
/// `handle` is NULL or a live export that no other thread is using, and is
/// not used again.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_export_close(handle: *mut vmm_arena_export) {
    let _ = boundary("vmm_arena_export_close", std::ptr::null(), || {
        if !handle.is_null() {
            // SAFETY: made by Box::into_raw in vmm_arena_export_open, owned by the
            // caller, who gives it up here.
            drop(unsafe { Box::from_raw(handle) });
        }
        Ok(())
    });
}

/// Maps the chunks behind fds (an export's descriptors, received from this
/// or another process, count of them, in chunk order) into a new allocation
/// of layout->size bytes; *out_id and *out_ptr receive it. The descriptors
/// are borrowed: the arena keeps duplicates (closed at vmm_arena_free), the
/// caller still owns and closes its own. flags: VMM_ARENA_IMPORT_READ_ONLY
/// or 0.
///
/// The import lives in an address range of its own: it never moves, counts
/// in vmm_arena_sharing_stats and not in vmm_arena_stats (nor against the
/// capacity, which is the arena's own memory), and works with
/// vmm_arena_query, vmm_arena_pin/unpin (no effect) and vmm_arena_free
/// (which unmaps it). vmm_arena_resize, vmm_arena_set_tag and
/// vmm_arena_export_open of it are INVALID_ARGUMENT.
///
/// INVALID_ARGUMENT: a NULL layout, fds (with count > 0), out_id or
/// out_ptr; unknown flag bits; a layout whose struct_size or version is not
/// this library's, whose chunk_bytes is not this arena's, whose chunk_count
/// is not count, or whose size does not fill its chunks; a descriptor that
/// is negative, closed, or not an exported chunk of chunk_bytes bytes. All
/// or nothing: on failure nothing is mapped or kept.
///
/// # Safety
/// `arena` is NULL or a live handle; `layout` is NULL or readable for its
/// struct_size; `fds` is NULL or has `count` readable entries; the
/// out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_import(
    arena: *mut vmm_arena,
    layout: *const vmm_arena_export_layout,
    fds: *const i32,
    count: usize,
    flags: u32,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_import", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        // SAFETY: per this function's contract.
        let l = unsafe { read_layout(layout) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        if flags & !VMM_ARENA_IMPORT_READ_ONLY != 0 {
            return Err(invalid(format!("unknown import flags {:#x}", flags & !VMM_ARENA_IMPORT_READ_ONLY)));
        }
        let raw: &[i32] = match count {
            0 => &[],
            _ => {
                if fds.is_null() || !fds.is_aligned() {
                    return Err(invalid("fds is NULL or not aligned"));
                }
                // SAFETY: `count` readable entries per this function's contract.
                unsafe { std::slice::from_raw_parts(fds, count) }
            }
        };
        for &fd in raw {
            // SAFETY: F_GETFD only reads the descriptor table; a number that
            // names no open descriptor is EBADF, nothing else happens.
            if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(invalid(format!("descriptor {fd} is not open")));
            }
        }
        // SAFETY: every descriptor was just found open, and the caller keeps
        // it open for this call (its contract); they are only borrowed.
        let borrowed: Vec<BorrowedFd<'_>> = raw.iter().map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) }).collect();
        let (id, ptr) = h.live()?.import(&l, &borrowed, flags & VMM_ARENA_IMPORT_READ_ONLY != 0)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}

/// A DMA-BUF file descriptor for the allocation's backed bytes
/// (cuMemGetHandleForAddressRange), for RDMA stacks to register. GPU only:
/// VMM_ARENA_ERR_UNSUPPORTED on the host backend. *out_fd receives a
/// descriptor the caller owns and closes. Pin the allocation first if the
/// registration must not see it move (the call does not pin it).
///
/// # Safety
/// `arena` is NULL or a live handle; `out_fd` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_export_dmabuf(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    out_fd: *mut i32,
) -> vmm_arena_status {
    boundary("vmm_arena_export_dmabuf", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_fd, "out_fd")?;
        let fd = h.live()?.dmabuf_fd(id_arg(id)).map_err(with_raw_id(id))?;
        use std::os::fd::IntoRawFd;
        // SAFETY: a checked out-parameter; the caller owns the descriptor now.
        unsafe { put(out, fd.into_raw_fd()) };
        Ok(())
    })
}

/// Cross-process sharing counts: imported allocations and the chunk bytes
/// they map, and allocations exported at least once and not yet freed (each
/// out-parameter may be NULL). Chunks aliased inside one arena
/// (vmm_arena_alloc_shared) are not counted here.
///
/// # Safety
/// `arena` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_sharing_stats(
    arena: *mut vmm_arena,
    out_imported_allocations: *mut u64,
    out_imported_bytes: *mut u64,
    out_exported_allocations: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_sharing_stats", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let a = optional(out_imported_allocations, "out_imported_allocations")?;
        let b = optional(out_imported_bytes, "out_imported_bytes")?;
        let c = optional(out_exported_allocations, "out_exported_allocations")?;
        let s = h.live()?.stats()?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            for (p, v) in [(a, s.imported_allocations), (b, s.imported_bytes), (c, s.exported_allocations)] {
                if let Some(p) = p {
                    put(p, v);
                }
            }
        }
        Ok(())
    })
}
