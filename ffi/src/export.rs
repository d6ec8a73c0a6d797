//! The C ABI of exports and imports: sharing an allocation with another
//! process through file descriptors (see `vmm_arena::arena::export` for the
//! semantics). Conventions as in the rest of the header.

use std::os::fd::BorrowedFd;

use arena::{Error, Export, ExportLayout};

use crate::{boundary, handle, id_arg, invalid, optional, put, required, vmm_arena, vmm_arena_id};
use crate::{vmm_arena_status, with_raw_id};

/// The format version of vmm_arena_export_layout this library writes (the
/// version field). It imports records of this version and of version 1.
pub const VMM_ARENA_EXPORT_FORMAT_VERSION: u32 = 2u32;

/// vmm_arena_export_layout.handle_type: not said (a version 1 record); the
/// importer assumes its own backend's.
pub const VMM_ARENA_EXPORT_HANDLE_UNSPECIFIED: u32 = 0u32;
/// vmm_arena_export_layout.handle_type: host backend chunks (sealed memfds).
pub const VMM_ARENA_EXPORT_HANDLE_HOST_MEMFD: u32 = 1u32;
/// vmm_arena_export_layout.handle_type: CUDA chunks
/// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).
pub const VMM_ARENA_EXPORT_HANDLE_CUDA_POSIX_FD: u32 = 2u32;

/// The smallest struct_size a vmm_arena_export_layout may have: the
/// version 1 record (struct_size through size, 32 bytes).
pub const VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE: u32 = 32u32;

/// Descriptors one SCM_RIGHTS message carries (the kernel's SCM_MAX_FD):
/// vmm_arena_export_send sends an export in messages of at most this many.
pub const VMM_ARENA_FDS_PER_MESSAGE: u32 = 253u32;

const _: () = assert!(VMM_ARENA_FDS_PER_MESSAGE as usize == arena::fd_passing::FDS_PER_MESSAGE);
const _: () = assert!(VMM_ARENA_EXPORT_HANDLE_HOST_MEMFD == arena::EXPORT_HANDLE_HOST_MEMFD);
const _: () = assert!(VMM_ARENA_EXPORT_HANDLE_CUDA_POSIX_FD == arena::EXPORT_HANDLE_CUDA_POSIX_FD);
const _: () = assert!(VMM_ARENA_EXPORT_HANDLE_UNSPECIFIED == arena::EXPORT_HANDLE_UNSPECIFIED);

const _: () = assert!(VMM_ARENA_EXPORT_FORMAT_VERSION == arena::EXPORT_FORMAT_VERSION);

/// vmm_arena_import flag: map the chunks readable only (on the host backend
/// a store through the pointer faults; on CUDA the access is
/// CU_MEM_ACCESS_FLAGS_PROT_READ). The importer's own choice for its own
/// mapping, not a protection of the memory: the exporter, and any importer
/// that did not ask for it, can still write.
pub const VMM_ARENA_IMPORT_READ_ONLY: u32 = 1u32;

/// What an importer needs besides the descriptors: send it with them (a
/// plain struct of integers, 80 bytes; vmm_arena_export_send does both).
///
/// struct_size has minimum-size semantics, so two library versions read
/// each other's records: whoever fills the struct in sets struct_size to
/// the sizeof it knows; a reader uses the fields that fit in struct_size
/// (at least VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE) and ignores bytes past its
/// own sizeof; a writer writes only the fields that fit. Only whole fields
/// count: a struct_size that ends inside a field leaves that field unread
/// (and unwritten). Fields a short
/// record lacks read as unspecified (handle_type 0, device -1, backend 0).
/// reserved must be zero.
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
    /// VMM_ARENA_EXPORT_HANDLE_*: an arena whose chunks are of another type
    /// refuses the record (version 2)
    pub handle_type: u32,
    /// the exporter's CUDA device ordinal, -1 on the host; informational
    /// (CUDA maps an import on the importing arena's device, which needs
    /// peer access when they differ) (version 2)
    pub device: i32,
    /// the exporter's vmm_arena_backend (version 2)
    pub backend: u32,
    /// 0 (no flags defined)
    pub flags: u32,
    /// zero
    pub reserved: [u64; 4],
}

/// Where each field of vmm_arena_export_layout ends (each element of
/// `reserved` its own field), in order.
const FIELD_ENDS: [usize; 13] = {
    use std::mem::offset_of;
    type L = vmm_arena_export_layout;
    [
        offset_of!(L, version),
        offset_of!(L, chunk_bytes),
        offset_of!(L, chunk_count),
        offset_of!(L, size),
        offset_of!(L, handle_type),
        offset_of!(L, device),
        offset_of!(L, backend),
        offset_of!(L, flags),
        offset_of!(L, reserved),
        offset_of!(L, reserved) + 8,
        offset_of!(L, reserved) + 16,
        offset_of!(L, reserved) + 24,
        std::mem::size_of::<L>(),
    ]
};
const _: () = assert!(offset_of_reserved_end() == std::mem::size_of::<vmm_arena_export_layout>());
const fn offset_of_reserved_end() -> usize {
    std::mem::offset_of!(vmm_arena_export_layout, reserved) + 32
}

/// The bytes of the whole fields that fit in `struct_size` (capped at this
/// library's sizeof): a struct_size that ends inside a field does not
/// count that field, for the reader or the writer.
fn whole_fields(struct_size: u32) -> usize {
    FIELD_ENDS.iter().copied().take_while(|&end| end <= struct_size as usize).last().unwrap_or(0)
}

fn to_c(l: &ExportLayout, struct_size: u32) -> vmm_arena_export_layout {
    let backend = match l.handle_type {
        arena::EXPORT_HANDLE_HOST_MEMFD => crate::vmm_arena_backend::VMM_ARENA_BACKEND_HOST as u32,
        arena::EXPORT_HANDLE_CUDA_POSIX_FD => crate::vmm_arena_backend::VMM_ARENA_BACKEND_CUDA as u32,
        _ => 0,
    };
    vmm_arena_export_layout {
        struct_size,
        version: l.version,
        chunk_bytes: l.chunk_bytes,
        chunk_count: l.chunk_count,
        size: l.size,
        handle_type: l.handle_type,
        device: l.device,
        backend,
        flags: 0,
        reserved: [0; 4],
    }
}

/// Opaque open export: one descriptor per chunk of an allocation and its
/// layout. It may outlive the arena that made it (the descriptors keep the
/// memory alive).
pub struct vmm_arena_export {
    export: Export,
}

/// Reads a caller's layout: `struct_size` first, then the fields that fit
/// in it (minimum-size semantics).
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
    if size < VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE {
        return Err(invalid(format!(
            "layout->struct_size is {size}, below VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE ({VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE})"
        )));
    }
    let n = whole_fields(size);
    let mut l = vmm_arena_export_layout {
        struct_size: size,
        version: 0,
        chunk_bytes: 0,
        chunk_count: 0,
        size: 0,
        handle_type: 0,
        device: -1,
        backend: 0,
        flags: 0,
        reserved: [0; 4],
    };
    // SAFETY: the caller's struct has `size >= n` readable bytes; `l` has
    // at least `n` bytes (`whole_fields` caps it at its sizeof), and every
    // bit pattern of its integer fields is valid.
    unsafe {
        std::ptr::copy_nonoverlapping(layout.cast::<u8>(), (&mut l as *mut vmm_arena_export_layout).cast::<u8>(), n)
    };
    if l.flags != 0 || l.reserved != [0; 4] {
        return Err(invalid("layout->flags and layout->reserved must be zero"));
    }
    Ok(ExportLayout {
        version: l.version,
        chunk_bytes: l.chunk_bytes,
        chunk_count: l.chunk_count,
        size: l.size,
        handle_type: l.handle_type,
        device: l.device,
    })
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
/// chunks with another, awake or asleep: a sleeper that shared them would
/// map them again when it wakes).
///
/// Ordering: the call first waits for the device (cuCtxSynchronize), so
/// every write queued before it is complete and visible to importers; the
/// processes order later writes themselves (an IPC event sent with the
/// layout, as PyTorch sends one with its handles).
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

/// Writes the export's layout: the fields that fit in layout->struct_size
/// (set by the caller, at least VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE; bytes past
/// this library's sizeof are left alone).
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
        if size < VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE {
            return Err(invalid(format!(
                "layout->struct_size is {size}, below VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE ({VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE})"
            )));
        }
        let c = to_c(&e.export.layout(), size);
        let n = whole_fields(size);
        // SAFETY: the caller's struct has `size >= n` writable bytes; `c` has
        // at least `n` bytes (`whole_fields` caps it at its sizeof).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&c as *const vmm_arena_export_layout).cast::<u8>(),
                out.as_ptr().cast::<u8>(),
                n,
            )
        };
        Ok(())
    })
}

/// The export's descriptors, in chunk order: if cap is at least their
/// count, writes new duplicates of them into fds (close-on-exec, owned by
/// the caller, who closes them; closing them does not affect the export);
/// fds may be NULL when cap is 0, and nothing is duplicated when cap is
/// smaller than the count. Either way *out_count receives the count, and
/// the status is VMM_ARENA_OK. OUT_OF_MEMORY when the process runs out of
/// descriptors (none is left open then).
///
/// One descriptor per chunk: a 1 GiB allocation of 2 MiB chunks is 512,
/// which count against RLIMIT_NOFILE (often 1,024 soft) in every process
/// holding them, and more than one SCM_RIGHTS message carries
/// (VMM_ARENA_FDS_PER_MESSAGE): vmm_arena_export_send and
/// vmm_arena_import_recv move an export of any size in one call each.
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
        let count = e.export.fds().len();
        if cap >= count && count > 0 {
            let p = required(fds, "fds")?;
            let dups = e.export.dup_fds()?;
            for (i, fd) in dups.into_iter().enumerate() {
                // SAFETY: `i < count <= cap` writable entries; the caller owns
                // the descriptor from here on.
                unsafe { p.as_ptr().add(i).write(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
            }
        }
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, count) };
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
/// out_ptr; unknown flag bits; a layout whose struct_size is below
/// VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE, whose version is neither 1 nor
/// VMM_ARENA_EXPORT_FORMAT_VERSION, whose handle_type is not this arena's
/// chunks', whose flags or reserved are not zero, whose chunk_bytes is not
/// this arena's, whose chunk_count is not count, or whose size does not
/// fill its chunks; a descriptor that is negative, closed, or not an
/// exported chunk of chunk_bytes bytes (on the host backend: a memfd no
/// arena made is refused). All or nothing: on failure nothing is mapped or
/// kept.
///
/// Ordering: vmm_arena_export_open waited for the exporter's device, so
/// every write queued before the export is visible; writes after it are
/// for the processes to order (e.g. an IPC event sent with the layout).
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

/// A DMA-BUF file descriptor for the allocation's backed bytes that the
/// caller owns and closes, with no handle: the library cannot know when the
/// device is done with it, so the allocation stays pinned and its chunks
/// out of reuse (a free keeps them) until the arena is destroyed. Prefer
/// vmm_arena_dmabuf_open, whose close ends that. Otherwise as
/// vmm_arena_dmabuf_open (GPU only: VMM_ARENA_ERR_UNSUPPORTED on the host
/// backend).
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

/// Sends an export over a connected Unix socket (SOCK_STREAM or
/// SOCK_SEQPACKET, blocking): its layout and duplicates of its descriptors,
/// in messages of at most VMM_ARENA_FDS_PER_MESSAGE descriptors, so an
/// export of any size goes in one call. The export is unchanged. The peer
/// calls vmm_arena_import_recv. A socket timeout (SO_SNDTIMEO) or error is
/// VMM_ARENA_ERR_DRIVER with the errno in vmm_arena_last_error().
///
/// # Safety
/// `handle` is NULL or a live export.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_export_send(handle: *const vmm_arena_export, sock: i32) -> vmm_arena_status {
    boundary("vmm_arena_export_send", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let e = unsafe { handle.as_ref() }.ok_or_else(|| invalid("export is NULL"))?;
        // SAFETY: F_GETFD only reads the descriptor table.
        if sock < 0 || unsafe { libc::fcntl(sock, libc::F_GETFD) } < 0 {
            return Err(invalid(format!("socket {sock} is not open")));
        }
        // SAFETY: just found open; the caller keeps it open for this call.
        let sock = unsafe { BorrowedFd::borrow_raw(sock) };
        e.export.send(sock)
    })
}

/// Receives an export that vmm_arena_export_send sent on the other end of a
/// Unix socket and imports it, as vmm_arena_import with the received
/// layout and descriptors (flags as there); the received descriptors are
/// closed once the import holds its own. The receiver holds one descriptor
/// per chunk for the call's duration: RLIMIT_NOFILE must leave room
/// (OUT_OF_MEMORY, nothing kept, when it does not). INVALID_ARGUMENT for a
/// peer that sent something else or closed the socket; a socket timeout
/// (SO_RCVTIMEO) or error is VMM_ARENA_ERR_DRIVER.
///
/// # Safety
/// `arena` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_import_recv(
    arena: *mut vmm_arena,
    sock: i32,
    flags: u32,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_import_recv", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        if flags & !VMM_ARENA_IMPORT_READ_ONLY != 0 {
            return Err(invalid(format!("unknown import flags {:#x}", flags & !VMM_ARENA_IMPORT_READ_ONLY)));
        }
        // SAFETY: F_GETFD only reads the descriptor table.
        if sock < 0 || unsafe { libc::fcntl(sock, libc::F_GETFD) } < 0 {
            return Err(invalid(format!("socket {sock} is not open")));
        }
        // SAFETY: just found open; the caller keeps it open for this call.
        let sock = unsafe { BorrowedFd::borrow_raw(sock) };
        let (id, ptr) = h.live()?.import_from_socket(sock, flags & VMM_ARENA_IMPORT_READ_ONLY != 0)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}
