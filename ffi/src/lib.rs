//! # vmm-arena-ffi: the C ABI of vmm-arena
//!
//! Builds `libvmm_arena.so` and `libvmm_arena.a`. The C declarations in
//! `include/vmm_arena.h` are generated from this file by cbindgen (a test
//! fails when the committed header is stale) and declare everything of the
//! contract header `abi/vmm_arena.h`, identically.
//!
//! House rules, each of them tested from C:
//! - every exported function runs inside one panic boundary (`boundary`):
//!   a panic becomes `VMM_ARENA_ERR_INTERNAL` and poisons the arena, which
//!   then refuses every call but `vmm_arena_destroy`;
//! - the function's own arguments are checked first (NULL pointers,
//!   `struct_size`, unknown enum values and flag bits), then the poison, then
//!   the arena's own checks in the contract's order of precedence;
//! - enums arrive as plain `u32` and are converted (an out-of-range value in
//!   a Rust enum would be undefined behaviour);
//! - `struct_size` is read first, and nothing past it;
//! - out-parameters are written only on `VMM_ARENA_OK`;
//! - a failing call sets this thread's last error; a successful one leaves it.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arena::driver::fault::FaultDriver;
use arena::driver::host::HostDriver;
use arena::{Arena, Error, Id, MoveEvent, Status};

mod boundary;
mod group;
mod share;
mod testing;
mod torch;

use boundary::*;

/// The ABI version; bumped on any incompatible change.
pub const VMM_ARENA_ABI_VERSION: u32 = 1;

/// alloc, alloc_growable and resize never move other allocations to make
/// room: they fail with VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE instead, and only
/// vmm_arena_compact and the resized allocation itself move.
pub const VMM_ARENA_FLAG_NO_IMPLICIT_MOVES: u32 = 1u32;

/// Config flag: the arena runs a background thread of its own that keeps the
/// targets of vmm_arena_set_prefetch (driver work off the caller's critical
/// path); vmm_arena_destroy stops and joins it.
pub const VMM_ARENA_FLAG_BACKGROUND: u32 = 2u32;

/// Chunks are exportable to other processes (vmm_arena_export): on the
/// host backend each chunk gets a sealed memfd of its own (one descriptor
/// per chunk held by the arena); on CUDA chunks are created with the POSIX
/// file-descriptor handle type (VMM_ARENA_ERR_UNSUPPORTED at create where
/// the device lacks it). (8, not 4: the contract's own program checks that
/// 4 is refused.)
pub const VMM_ARENA_FLAG_EXPORTABLE: u32 = 8u32;

/// Every flag bit this version knows.
const KNOWN_FLAGS: u32 = VMM_ARENA_FLAG_NO_IMPLICIT_MOVES | VMM_ARENA_FLAG_BACKGROUND | VMM_ARENA_FLAG_EXPORTABLE;

/// What every call that can fail returns. Values are never changed or reused.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum vmm_arena_status {
    /// Success.
    VMM_ARENA_OK = 0,
    /// NULL pointer; size 0; a size that overflows when rounded up to the
    /// chunk size; max_size < size; a bad config field or struct_size; a
    /// call from inside the arena's own move callback.
    VMM_ARENA_ERR_INVALID_ARGUMENT = 1,
    /// The physical capacity (or the driver's memory) cannot cover the
    /// request, after pooled chunks were reused. Returned also when the
    /// address space falls short at the same time. The arena is unchanged.
    VMM_ARENA_ERR_OUT_OF_MEMORY = 2,
    /// Physical capacity suffices, but the reserved virtual range cannot fit
    /// the request even after compaction: pinned allocations are in the way,
    /// or VMM_ARENA_FLAG_NO_IMPLICIT_MOVES forbids the moves that would make
    /// room. The arena is unchanged.
    VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE = 3,
    /// The id was never issued by this arena, or was already freed.
    VMM_ARENA_ERR_UNKNOWN_ALLOCATION = 4,
    /// The request would have to move the pinned allocation it names (resize
    /// of a pinned allocation that cannot grow where it stands).
    VMM_ARENA_ERR_PINNED = 5,
    /// The backend cannot run here: no CUDA driver, no such device, a device
    /// without virtual memory management, or a host without memfd.
    VMM_ARENA_ERR_UNSUPPORTED = 6,
    /// Any other driver failure; vmm_arena_last_error() says which call and code.
    VMM_ARENA_ERR_DRIVER = 7,
    /// A bug inside the library was caught at the boundary; the arena refuses
    /// every later call with this status, and destroy still releases it.
    VMM_ARENA_ERR_INTERNAL = 8,
    /// The allocation is asleep (vmm_arena_sleep) and the call needs its
    /// memory: resize and pin of a sleeping allocation.
    VMM_ARENA_ERR_ASLEEP = 9,
}

use vmm_arena_status::*;

impl From<Status> for vmm_arena_status {
    fn from(s: Status) -> Self {
        match s {
            Status::Ok => VMM_ARENA_OK,
            Status::InvalidArgument => VMM_ARENA_ERR_INVALID_ARGUMENT,
            Status::OutOfMemory => VMM_ARENA_ERR_OUT_OF_MEMORY,
            Status::OutOfAddressSpace => VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE,
            Status::UnknownAllocation => VMM_ARENA_ERR_UNKNOWN_ALLOCATION,
            Status::Pinned => VMM_ARENA_ERR_PINNED,
            Status::Unsupported => VMM_ARENA_ERR_UNSUPPORTED,
            Status::Driver => VMM_ARENA_ERR_DRIVER,
            Status::Internal => VMM_ARENA_ERR_INTERNAL,
            Status::Asleep => VMM_ARENA_ERR_ASLEEP,
        }
    }
}

/// A `vmm_arena_status` as a caller passes it: any 32-bit value. The header
/// spells it `vmm_arena_status` (cbindgen renames it), which C passes as a
/// 32-bit integer; Rust must not take it as an enum, since a value outside
/// the enum would be undefined behaviour.
pub type vmm_arena_status_raw = u32;

/// Backends, as the values of vmm_arena_config.backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum vmm_arena_backend {
    /// Linux: mmap reservation + memfd chunks
    VMM_ARENA_BACKEND_HOST = 0,
    /// CUDA driver virtual memory management
    VMM_ARENA_BACKEND_CUDA = 1,
}

/// Names one allocation for the arena's lifetime; 0 is never issued and an
/// id is never reused, so a stale id is detected.
pub type vmm_arena_id = u64;

/// Opaque arena.
pub struct vmm_arena {
    arena: Arena,
    /// Set when a panic was caught in a call on this arena.
    poisoned: AtomicBool,
    /// The fault injector under a testing arena (see `testing`).
    fault: Option<Arc<FaultDriver<HostDriver>>>,
}

/// Arena configuration. Defaults (vmm_arena_config_default): backend CUDA,
/// device 0, flags 0, capacity 0, reserve 0, chunk 0, retain UINT64_MAX.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct vmm_arena_config {
    /// must equal sizeof(vmm_arena_config) of this ABI version
    pub struct_size: u32,
    /// vmm_arena_backend
    pub backend: u32,
    /// CUDA device ordinal; ignored by the host backend
    pub device: i32,
    /// VMM_ARENA_FLAG_* bits; unknown bits are INVALID_ARGUMENT
    pub flags: u32,
    /// most physical memory the arena may hold, rounded down to the chunk
    /// size; 0 = backend default: the host's physical RAM, or the CUDA
    /// device's total memory
    pub capacity_bytes: u64,
    /// size of the virtual range, rounded up to the chunk size; 0 = four
    /// times the capacity
    pub reserve_bytes: u64,
    /// physical chunk size: 0 = 2 MiB, or the driver's recommended
    /// granularity if larger; otherwise it must be a multiple of the
    /// backend's minimum granularity (host: the page size), else
    /// INVALID_ARGUMENT
    pub chunk_bytes: u64,
    /// unused physical memory kept pooled; beyond it freed chunks go back to
    /// the driver. UINT64_MAX = keep everything until vmm_arena_trim; 0 =
    /// keep nothing
    pub retain_bytes: u64,
}

/// Counters and sizes of an arena.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct vmm_arena_stats {
    /// set by the caller; must equal sizeof(vmm_arena_stats)
    pub struct_size: u32,
    /// written as 0
    pub reserved0: u32,
    /// allocations alive
    pub live_allocations: u64,
    /// sum of the sizes callers asked for
    pub live_bytes: u64,
    /// physical bytes backing live allocations (each chunk once); every
    /// other chunk held is in pooled_bytes (a slab holding only retired
    /// objects included)
    pub mapped_bytes: u64,
    /// physical bytes held but backing no live allocation
    pub pooled_bytes: u64,
    /// high-water mark of mapped_bytes + pooled_bytes
    pub peak_physical_bytes: u64,
    /// the capacity, rounded down to the chunk size
    pub capacity_bytes: u64,
    /// size of the virtual range
    pub reserved_va_bytes: u64,
    /// address space that no live allocation (a growable's whole reservation
    /// included) and no retired range covers
    pub free_va_bytes: u64,
    /// the longest contiguous such range
    pub largest_free_va_bytes: u64,
    /// old ranges of moved allocations not yet released
    pub retired_va_bytes: u64,
    /// moves by remapping, ever (one allocation moved twice counts 2)
    pub moves: u64,
    /// physical chunks created, ever
    pub driver_creates: u64,
    /// physical chunks given back to the driver, ever
    pub driver_releases: u64,
    /// driver map calls, ever
    pub driver_maps: u64,
    /// driver unmap calls, ever
    pub driver_unmaps: u64,
    /// driver access-setting calls (cuMemSetAccess), ever
    pub driver_access_calls: u64,
}

/// What vmm_arena_compact did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct vmm_arena_compact_report {
    /// allocations moved
    pub moved_allocations: u64,
    /// physical bytes of the moved allocations
    pub moved_bytes: u64,
    /// longest free address range before
    pub largest_free_va_before: u64,
    /// longest free address range after
    pub largest_free_va_after: u64,
}

/// Called once for every move (the count in stats.moves), the moved
/// allocation's own included when resize moves it, during the call that
/// moved it, after the new address is mapped; size is the allocation's size
/// at that moment. It must not call back into the arena (such calls fail
/// with VMM_ARENA_ERR_INVALID_ARGUMENT; vmm_arena_destroy is refused), must
/// not unwind (no C++ exception may leave it), and runs on whichever thread
/// made the call that moved, so `user` must be usable from those threads.
pub type vmm_arena_move_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, id: vmm_arena_id, old_ptr: u64, new_ptr: u64, size: u64)>;

// ---------------------------------------------------------------------------
// The exported functions, in the contract's order.

/// The ABI version this library implements (VMM_ARENA_ABI_VERSION).
#[no_mangle]
pub extern "C" fn vmm_arena_abi_version() -> u32 {
    guarded(VMM_ARENA_ABI_VERSION, || VMM_ARENA_ABI_VERSION)
}

static STATUS_NAMES: [&CStr; 10] = [
    c"VMM_ARENA_OK",
    c"VMM_ARENA_ERR_INVALID_ARGUMENT",
    c"VMM_ARENA_ERR_OUT_OF_MEMORY",
    c"VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE",
    c"VMM_ARENA_ERR_UNKNOWN_ALLOCATION",
    c"VMM_ARENA_ERR_PINNED",
    c"VMM_ARENA_ERR_UNSUPPORTED",
    c"VMM_ARENA_ERR_DRIVER",
    c"VMM_ARENA_ERR_INTERNAL",
    c"VMM_ARENA_ERR_ASLEEP",
];

/// Static, never NULL, e.g. "VMM_ARENA_ERR_PINNED". Unknown values give "UNKNOWN".
#[no_mangle]
pub extern "C" fn vmm_arena_status_name(status: vmm_arena_status_raw) -> *const c_char {
    guarded(c"UNKNOWN".as_ptr(), || STATUS_NAMES.get(status as usize).copied().unwrap_or(c"UNKNOWN").as_ptr())
}

/// Detail of the last failure on this thread (e.g. the driver call and its
/// code); "" if none. Valid until the next call on this thread. Never NULL.
#[no_mangle]
pub extern "C" fn vmm_arena_last_error() -> *const c_char {
    guarded(c"".as_ptr(), || {
        LAST_ERROR.try_with(|e| e.borrow().as_ref().map(|s| s.as_ptr())).ok().flatten().unwrap_or(c"".as_ptr())
    })
}

/// Fills every field with its default (struct_size included). NULL is ignored.
///
/// # Safety
/// `config` is NULL or points to a writable `vmm_arena_config`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_config_default(config: *mut vmm_arena_config) {
    let _ = boundary("vmm_arena_config_default", std::ptr::null(), || {
        if let Some(p) = optional(config, "config")? {
            // SAFETY: a writable config, per this function's contract.
            unsafe { put(p, default_config()) };
        }
        Ok(())
    });
}

/// Creates an arena. *out receives it on VMM_ARENA_OK.
///
/// The config is checked before the backend is loaded: a config no backend
/// accepts (wrong struct_size, unknown backend or flags, chunk_bytes not a
/// multiple of 4096, capacity_bytes below one chunk, reserve_bytes that
/// overflows when rounded up) is VMM_ARENA_ERR_INVALID_ARGUMENT even where
/// the backend is unavailable (VMM_ARENA_ERR_UNSUPPORTED otherwise, e.g. the
/// CUDA backend without libcuda). What depends on the backend (chunk_bytes
/// a multiple of its granularity, the device ordinal) is checked after.
///
/// # Safety
/// `config` is NULL or points to a config of at least its `struct_size`
/// bytes; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_create(
    config: *const vmm_arena_config,
    out: *mut *mut vmm_arena,
) -> vmm_arena_status {
    boundary("vmm_arena_create", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let c = unsafe { read_config(config) }?;
        let out = required(out, "out")?;
        let cfg = arena_config(&c)?;
        let arena = Arena::new(cfg)?;
        // SAFETY: `out` was checked and is writable per this function's contract.
        unsafe { publish(arena, None, out) }
    })
}

/// Unmaps and releases everything. NULL is fine. Refused (the arena stays,
/// and the last error says so) when called from the arena's own move callback.
///
/// # Safety
/// `arena` is NULL or a live handle that no other thread is using, and is
/// not used again.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_destroy(arena: *mut vmm_arena) {
    // The boundary gets NULL: a panic here must not touch a freed handle.
    let _ = boundary("vmm_arena_destroy", std::ptr::null(), || {
        if arena.is_null() {
            return Ok(());
        }
        if in_callback_of(arena) {
            return Err(invalid("called from inside the arena's own move callback; the arena was not destroyed"));
        }
        // SAFETY: a live handle made by Box::into_raw in `publish`, owned by
        // the caller, who gives it up here.
        drop(unsafe { Box::from_raw(arena) });
        Ok(())
    });
}

/// Allocates `size` bytes. Every address is a multiple of 256; allocations
/// of chunk_bytes or more are chunk-aligned. Unless
/// VMM_ARENA_FLAG_NO_IMPLICIT_MOVES is set, alloc, alloc_growable and resize
/// move other unpinned allocations by remapping when that makes room for the
/// request (the move callback reports each move).
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc(
    arena: *mut vmm_arena,
    size: u64,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc(size)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}

/// Reserves address space for max_size; backs only size. Growth up to
/// max_size never moves the allocation; shrinking keeps the reservation.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc_growable(
    arena: *mut vmm_arena,
    size: u64,
    max_size: u64,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc_growable", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc_growable(size, max_size)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}

/// Zero-copy sharing (e.g. a KV-cache prefix common to several requests): a
/// new growable allocation whose first bytes are the physical chunks of
/// src's range [src_offset, src_offset + bytes), mapped a second time,
/// nothing copied; a write through either address is seen through the other.
/// src_offset and bytes are multiples of chunk_bytes, bytes > 0, the range
/// lies inside src's size, src is not a small allocation and max_size >=
/// bytes, else VMM_ARENA_ERR_INVALID_ARGUMENT. The new allocation has size
/// bytes, reserves max_size, and grows, shrinks, moves, pins and frees like
/// any growable allocation; src is not changed. A chunk mapped by several
/// allocations stays until the last of them no longer maps it, and counts
/// once in mapped_bytes (live_bytes counts each allocation's size). A
/// sleeping src is VMM_ARENA_ERR_ASLEEP.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_id` and `out_ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_alloc_shared(
    arena: *mut vmm_arena,
    src: vmm_arena_id,
    src_offset: u64,
    bytes: u64,
    max_size: u64,
    out_id: *mut vmm_arena_id,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_alloc_shared", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oid, optr) = (required(out_id, "out_id")?, required(out_ptr, "out_ptr")?);
        let (id, ptr) = h.live()?.alloc_shared(id_arg(src), src_offset, bytes, max_size).map_err(with_raw_id(src))?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put(optr, ptr);
        }
        Ok(())
    })
}

/// Frees an allocation; its id is never valid again.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_free(arena: *mut vmm_arena, id: vmm_arena_id) -> vmm_arena_status {
    boundary("vmm_arena_free", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.free(id_arg(id)).map_err(with_raw_id(id))
    })
}

/// Frees like vmm_arena_free, but ordered after the work queued so far on
/// stream (a CUstream; 0 = the legacy default stream): the memory is neither
/// unmapped nor handed to another address before that work completes. The
/// arena records an event and polls it; it waits (on such events, oldest
/// first, never with a device-wide synchronization) only when nothing else
/// can serve a request. Host backend: the same as vmm_arena_free.
///
/// # Safety
/// `arena` is NULL or a live handle; `stream` is 0 or a CUstream of the
/// arena's device context (the driver checks it).
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_free_on_stream(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    stream: u64,
) -> vmm_arena_status {
    boundary("vmm_arena_free_on_stream", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.free_on_stream(id_arg(id), stream).map_err(with_raw_id(id))
    })
}

/// Driver work ahead of need, so that allocations and growth find chunks
/// ready. Targets, each rounded up to whole chunks:
///  - precreate_bytes: created chunks kept pooled and unmapped (hides chunk
///    creation);
///  - map_ahead_bytes: for every awake growable allocation, chunks kept
///    mapped and accessible right after its backed size, as many as its
///    reservation has room for up to this amount (growth into them makes no
///    driver call). They do not count toward precreate_bytes.
///
/// Both count in pooled_bytes, are held within the capacity left by live
/// allocations, and are the first to be used or given back under pressure:
/// they never cause an OUT_OF_MEMORY. 0, 0 (the default) turns it off. The
/// work is done by vmm_arena_maintain, or by the background thread
/// (VMM_ARENA_FLAG_BACKGROUND); while any allocation is asleep, neither does
/// anything.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_set_prefetch(
    arena: *mut vmm_arena,
    precreate_bytes: u64,
    map_ahead_bytes: u64,
) -> vmm_arena_status {
    boundary("vmm_arena_set_prefetch", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.set_prefetch(precreate_bytes, map_ahead_bytes)
    })
}

/// Brings the arena as close to its prefetch targets as the capacity left by
/// live allocations allows, now, on the calling thread (e.g. between decode
/// steps while the GPU computes). Best effort: falling short of a target is
/// not an error (VMM_ARENA_OK); a driver failure is VMM_ARENA_ERR_DRIVER and
/// keeps what was completed before it, with the arena consistent. Other
/// threads' calls are not held up for the duration of its driver calls.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_maintain(arena: *mut vmm_arena) -> vmm_arena_status {
    boundary("vmm_arena_maintain", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.maintain()
    })
}

/// Resizes count allocations in one call (e.g. every running sequence's KV
/// cache before a decode step): the allocation ids names at each index to
/// the size new_sizes holds at that index, each as vmm_arena_resize would,
/// planned together: one choice of chunk sources, at most one device
/// synchronization and one access call per contiguous run of newly mapped
/// pages across all of them. out_ptrs receives, at the same index, each
/// allocation's address after the whole call (an allocation may move when
/// it outgrows its reservation, or when room is made for another). All or nothing: on
/// any error no allocation has changed and out_ptrs is not written.
/// count == 0 does nothing (the pointers may then be NULL). Statuses, in
/// this precedence: INVALID_ARGUMENT (arena, ids, new_sizes or out_ptrs
/// NULL with count > 0; a new size of 0 or one that overflows; the same id
/// twice), UNKNOWN_ALLOCATION, ASLEEP, then PINNED, OUT_OF_MEMORY,
/// OUT_OF_ADDRESS_SPACE as the requests meet them.
///
/// # Safety
/// `arena` is NULL or a live handle; `ids` and `new_sizes` are NULL or
/// point to `count` readable elements; `out_ptrs` is NULL or points to
/// `count` writable elements.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_resize_many(
    arena: *mut vmm_arena,
    ids: *const vmm_arena_id,
    new_sizes: *const u64,
    count: usize,
    out_ptrs: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_resize_many", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        if count == 0 {
            return h.live().map(|_| ());
        }
        let ids_p = required(ids.cast_mut(), "ids")?;
        let sizes_p = required(new_sizes.cast_mut(), "new_sizes")?;
        let out = required(out_ptrs, "out_ptrs")?;
        // SAFETY: non-NULL, aligned, and `count` readable elements each, per
        // this function's contract.
        let (raw_ids, sizes) = unsafe {
            (std::slice::from_raw_parts(ids_p.as_ptr(), count), std::slice::from_raw_parts(sizes_p.as_ptr(), count))
        };
        let requests: Vec<(Id, u64)> = raw_ids.iter().zip(sizes).map(|(&raw, &size)| (id_arg(raw), size)).collect();
        let ptrs = h.live()?.resize_many(&requests).map_err(|e| match e {
            // Report an unknown id as the caller spelled it.
            Error::UnknownAllocation(v) => {
                Error::UnknownAllocation(raw_ids.iter().copied().find(|&r| id_arg(r).get() == v).unwrap_or(v))
            }
            e => e,
        })?;
        // SAFETY: `count` writable elements at a checked, aligned pointer,
        // per this function's contract; `ptrs` has `count` elements.
        unsafe { std::ptr::copy_nonoverlapping(ptrs.as_ptr(), out.as_ptr(), count) };
        Ok(())
    })
}

/// Grows or shrinks, keeping the first min(old, new) bytes. Grows in place
/// when it can, else moves by remapping (never by copying a chunk); after a
/// move the reservation is at least new_size. Shrinking gives whole tail
/// chunks back to the pool, but a chunk another allocation also maps
/// (vmm_arena_alloc_shared) stays with it. out_ptr receives the (maybe new)
/// address.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_ptr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_resize(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    new_size: u64,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_resize", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let optr = required(out_ptr, "out_ptr")?;
        let ptr = h.live()?.resize(id_arg(id), new_size).map_err(with_raw_id(id))?;
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(optr, ptr) };
        Ok(())
    })
}

/// Resizes like vmm_arena_resize (the same arguments, checks, statuses and
/// precedence); a shrink is also ordered after the work queued so far on
/// stream (a CUstream; 0 = the legacy default stream). The dropped chunks are
/// given up as vmm_arena_resize gives them up, and once that work has
/// completed the arena knows them idle: another address takes them, and the
/// pool or the driver gets them back, without a device-wide synchronization
/// (for a caller that shrinks often, e.g. a prefix cache evicting the tails
/// of its entries). An event is recorded only for a shrink that leaves whole
/// chunks behind; growth, an unchanged chunk count, a small allocation, an
/// exported allocation or an import, and the host backend (no asynchronous
/// streams) resize exactly as vmm_arena_resize. A failure to record the event
/// is VMM_ARENA_ERR_DRIVER and changes nothing. An addition of this project
/// (in neither abi/vmm_arena.h nor abi/vmm_arena_next.h).
///
/// # Safety
/// `arena` is NULL or a live handle; `out_ptr` is NULL or writable; `stream`
/// is 0 or a CUstream of the arena's device context (the driver checks it).
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_resize_on_stream(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    new_size: u64,
    stream: u64,
    out_ptr: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_resize_on_stream", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let optr = required(out_ptr, "out_ptr")?;
        let ptr = h.live()?.resize_on_stream(id_arg(id), new_size, stream).map_err(with_raw_id(id))?;
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(optr, ptr) };
        Ok(())
    })
}

/// Current address and size (either out-parameter may be NULL).
///
/// # Safety
/// `arena` is NULL or a live handle; `out_ptr` and `out_size` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_query(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    out_ptr: *mut u64,
    out_size: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_query", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (optr, osize) = (optional(out_ptr, "out_ptr")?, optional(out_size, "out_size")?);
        let info = h.live()?.query(id_arg(id)).map_err(with_raw_id(id))?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            if let Some(p) = optr {
                put(p, info.ptr);
            }
            if let Some(p) = osize {
                put(p, info.size);
            }
        }
        Ok(())
    })
}

/// Pins an allocation: it never moves until unpinned (buffers registered
/// with NCCL or RDMA, captured in CUDA graphs).
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_pin(arena: *mut vmm_arena, id: vmm_arena_id) -> vmm_arena_status {
    boundary("vmm_arena_pin", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.pin(id_arg(id)).map_err(with_raw_id(id))
    })
}

/// Lets a pinned allocation move again.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_unpin(arena: *mut vmm_arena, id: vmm_arena_id) -> vmm_arena_status {
    boundary("vmm_arena_unpin", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.unpin(id_arg(id)).map_err(with_raw_id(id))
    })
}

/// Every tag, for vmm_arena_sleep and vmm_arena_wake.
pub const VMM_ARENA_ALL_TAGS: u32 = 0xFFFFFFFFu32;

/// vmm_arena_sleep flag: copy each allocation's bytes to host memory first;
/// vmm_arena_wake writes them back.
pub const VMM_ARENA_SLEEP_BACKUP: u32 = 1u32;

/// Sets an allocation's tag (0 by default), which vmm_arena_sleep and
/// vmm_arena_wake select by; works on a sleeping allocation too.
///
/// Sleep and wake (e.g. an inference engine giving its GPU memory to a
/// training step, then resuming): a sleeping allocation is live: it counts
/// in live_allocations and live_bytes, its id, size, address and
/// reservation stay (so pointers held elsewhere, by kernels or CUDA graphs,
/// are valid again after wake), and its reservation is not free address
/// space; it maps nothing and counts nothing in mapped_bytes. It must not be
/// touched. resize (growing or shrinking) and pin return
/// VMM_ARENA_ERR_ASLEEP; query, unpin, set_tag and free work (free drops its
/// backup). Compaction never moves it; like a pinned allocation, it can be
/// why a request gets OUT_OF_ADDRESS_SPACE.
///
/// Small allocations (at most half a chunk, from vmm_arena_alloc) share
/// slabs with others and never sleep: set_tag on one is
/// VMM_ARENA_ERR_INVALID_ARGUMENT. Allocate more than half a chunk, or with
/// vmm_arena_alloc_growable, to tag an allocation.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_set_tag(arena: *mut vmm_arena, id: vmm_arena_id, tag: u32) -> vmm_arena_status {
    boundary("vmm_arena_set_tag", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.set_tag(id_arg(id), tag).map_err(with_raw_id(id))
    })
}

/// Puts every awake allocation with this tag (VMM_ARENA_ALL_TAGS: all) to
/// sleep: waits for the device, copies each one's bytes to host memory when
/// flags has VMM_ARENA_SLEEP_BACKUP (else its contents are lost), unmaps it,
/// gives its chunks back to the driver, then gives back every pooled chunk
/// whatever retain_bytes says. Pinned allocations sleep too. Already
/// sleeping ones are left as they are. Unknown flag bits are
/// INVALID_ARGUMENT. All or nothing: on failure nothing has slept.
///
/// Backups are host memory from the backend: page-locked (cuMemHostAlloc)
/// on CUDA, ordinary memory where that much cannot be pinned and on the
/// host backend. One that cannot be had fails the sleep, nothing slept.
///
/// Retired ranges (the old addresses of moved allocations) are all
/// unmapped, after the device wait, as vmm_arena_release_retired does: one
/// may still map a sleeper's or a pooled chunk, and the driver frees no
/// chunk that is still mapped. The arena may release them whenever it has
/// synchronized; only the old addresses the move callback reported stop
/// being mapped.
///
/// The chunks are given back after the point of no return (a released
/// chunk cannot be had back): a chunk the driver refuses to release stays
/// pooled (held, not leaked), counts in release_failures, and
/// vmm_arena_trim or the next sleep gives it back. The sleepers have slept,
/// so the call returns VMM_ARENA_OK: an error would say they had not.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_sleep(arena: *mut vmm_arena, tag: u32, flags: u32) -> vmm_arena_status {
    boundary("vmm_arena_sleep", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        if flags & !VMM_ARENA_SLEEP_BACKUP != 0 {
            return Err(Error::InvalidArgument(format!("unknown sleep flags {flags:#x}")));
        }
        h.live()?.sleep(tag, flags)
    })
}

/// Wakes every sleeping allocation with this tag (or all), each at its own
/// address: its chunks are new (or pooled) and receive the backed-up bytes
/// (without a backup it holds whatever the driver gives). All or nothing: on
/// failure (e.g. OUT_OF_MEMORY) every one of them is still asleep, its
/// backup intact.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_wake(arena: *mut vmm_arena, tag: u32) -> vmm_arena_status {
    boundary("vmm_arena_wake", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.wake(tag)
    })
}

/// Moves unpinned allocations by remapping to close address-space holes.
/// report may be NULL.
///
/// # Safety
/// `arena` is NULL or a live handle; `report` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_compact(
    arena: *mut vmm_arena,
    report: *mut vmm_arena_compact_report,
) -> vmm_arena_status {
    boundary("vmm_arena_compact", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = optional(report, "report")?;
        let r = h.live()?.compact()?;
        if let Some(p) = out {
            let r = vmm_arena_compact_report {
                moved_allocations: r.moved_allocations,
                moved_bytes: r.moved_bytes,
                largest_free_va_before: r.largest_free_va_before,
                largest_free_va_after: r.largest_free_va_after,
            };
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(p, r) };
        }
        Ok(())
    })
}

/// Unmaps the old ranges of moved allocations (CUDA: after synchronizing
/// the device). The arena also does this by itself when it needs their
/// address space, with the same synchronization.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_release_retired(arena: *mut vmm_arena) -> vmm_arena_status {
    boundary("vmm_arena_release_retired", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.release_retired()
    })
}

/// Gives pooled physical chunks back to the driver until at most keep_bytes
/// stay pooled. out_released (may be NULL) receives the bytes released.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_released` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_trim(
    arena: *mut vmm_arena,
    keep_bytes: u64,
    out_released: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_trim", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = optional(out_released, "out_released")?;
        let released = h.live()?.trim(keep_bytes)?;
        if let Some(p) = out {
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(p, released) };
        }
        Ok(())
    })
}

/// The C view of the arena's stats (`struct_size` filled in).
fn c_stats(s: &arena::Stats) -> vmm_arena_stats {
    vmm_arena_stats {
        struct_size: std::mem::size_of::<vmm_arena_stats>() as u32,
        reserved0: 0,
        live_allocations: s.live_allocations,
        live_bytes: s.live_bytes,
        mapped_bytes: s.mapped_bytes,
        pooled_bytes: s.pooled_bytes,
        peak_physical_bytes: s.peak_physical_bytes,
        capacity_bytes: s.capacity_bytes,
        reserved_va_bytes: s.reserved_va_bytes,
        free_va_bytes: s.free_va_bytes,
        largest_free_va_bytes: s.largest_free_va_bytes,
        retired_va_bytes: s.retired_va_bytes,
        moves: s.moves,
        driver_creates: s.driver_creates,
        driver_releases: s.driver_releases,
        driver_maps: s.driver_maps,
        driver_unmaps: s.driver_unmaps,
        driver_access_calls: s.driver_access_calls,
    }
}

/// stats->struct_size must be set by the caller.
///
/// # Safety
/// `arena` is NULL or a live handle; `stats` is NULL or points to at least
/// `stats->struct_size` writable bytes starting with a `uint32_t struct_size`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_stats_get(arena: *mut vmm_arena, stats: *mut vmm_arena_stats) -> vmm_arena_status {
    boundary("vmm_arena_stats_get", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(stats, "stats")?;
        // SAFETY: non-NULL and aligned; the caller's struct starts with its
        // uint32_t struct_size, and nothing past it is read.
        let size = unsafe { out.as_ptr().cast::<u32>().read() };
        if size as usize != std::mem::size_of::<vmm_arena_stats>() {
            return Err(invalid(format!(
                "stats->struct_size is {size}, expected sizeof(vmm_arena_stats) = {}",
                std::mem::size_of::<vmm_arena_stats>()
            )));
        }
        let c = c_stats(&h.live()?.stats()?);
        // SAFETY: the caller's struct is struct_size = sizeof(vmm_arena_stats)
        // writable bytes, per this function's contract.
        unsafe { put(out, c) };
        Ok(())
    })
}

/// Installs the move callback; fn == NULL removes the callback. The arena
/// calls it under its lock, so once this returns the previous callback is
/// not running and will not run again.
///
/// # Safety
/// `arena` is NULL or a live handle; `fn` (if not NULL) and `user` follow
/// the rules of `vmm_arena_move_fn` for as long as they stay installed.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_set_move_callback(
    arena: *mut vmm_arena,
    r#fn: vmm_arena_move_fn,
    user: *mut c_void,
) -> vmm_arena_status {
    boundary("vmm_arena_set_move_callback", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let a = h.live()?;
        let cb = r#fn.map(|f| {
            let cb = CMoveCallback { f, user, owner: arena as usize };
            Box::new(move |e: &MoveEvent| cb.call(e)) as Box<dyn FnMut(&MoveEvent) + Send>
        });
        a.set_move_callback(cb)
    })
}

/// A JSON object of every range (live, free, retired) and the stats. If cap
/// is at least the size needed, writes it with its terminating NUL; else
/// (buf may then be NULL) writes nothing. Either way *out_len receives the
/// size needed, NUL included, and the status is VMM_ARENA_OK.
///
/// # Safety
/// `arena` is NULL or a live handle; `buf` is NULL or has `cap` writable
/// bytes; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_snapshot_json(
    arena: *mut vmm_arena,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> vmm_arena_status {
    boundary("vmm_arena_snapshot_json", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_len, "out_len")?;
        let json = h.live()?.snapshot_json()?;
        let needed = json.len() + 1;
        if cap >= needed {
            if buf.is_null() {
                return Err(invalid(format!("buf is NULL while cap {cap} covers the {needed} bytes needed")));
            }
            // SAFETY: `buf` has `cap >= json.len() + 1` writable bytes per
            // this function's contract, and cannot overlap a fresh String.
            unsafe {
                std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), json.len());
                buf.add(json.len()).write(0);
            }
        }
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, needed) };
        Ok(())
    })
}

// The C ABI fuzz target's logic (fuzz/logic/c_abi.rs, shared with
// fuzz/fuzz_targets/c_abi.rs), replayed over its committed corpus on stable
// Rust by `fuzz_replay` below. It names this crate `ffi`.
#[cfg(test)]
use crate as ffi;
#[cfg(test)]
#[path = "../../fuzz/logic/c_abi.rs"]
mod fuzz_c_abi;

#[cfg(test)]
mod fuzz_replay {
    use std::path::{Path, PathBuf};

    /// Every input of fuzz/corpus/c_abi, or `$VMM_ARENA_FUZZ_INPUT` (a
    /// file, e.g. a crash artifact, or a directory, e.g. a scratch corpus).
    fn inputs() -> Vec<PathBuf> {
        let dir = match std::env::var_os("VMM_ARENA_FUZZ_INPUT").map(PathBuf::from) {
            Some(one) if one.is_file() => return vec![one],
            Some(dir) => dir,
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/c_abi"),
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        files
    }

    #[test]
    fn c_abi_corpus_replays() {
        let files = inputs();
        assert!(!files.is_empty(), "the c_abi corpus is empty");
        for f in &files {
            let data = std::fs::read(f).unwrap();
            if let Err(p) = std::panic::catch_unwind(|| super::fuzz_c_abi::run(&data)) {
                eprintln!("corpus input {} fails", f.display());
                std::panic::resume_unwind(p);
            }
        }
        let by_status: Vec<u64> =
            super::fuzz_c_abi::STATUSES.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect();
        println!(
            "replayed {} C ABI inputs: {} calls checked, by status (OK, INVALID_ARGUMENT, OUT_OF_MEMORY, \
             OUT_OF_ADDRESS_SPACE, UNKNOWN_ALLOCATION, PINNED, UNSUPPORTED, DRIVER, INTERNAL, ASLEEP): {by_status:?}",
            files.len(),
            by_status.iter().sum::<u64>()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arena::ArenaConfig;

    #[test]
    fn status_names_match_the_library() {
        for raw in 0..=9u32 {
            let name = Status::from_raw(raw).unwrap().name();
            // SAFETY: status names are static NUL-terminated strings.
            let c = unsafe { CStr::from_ptr(vmm_arena_status_name(raw)) };
            assert_eq!(c.to_str().unwrap(), name);
            assert_eq!(vmm_arena_status::from(Status::from_raw(raw).unwrap()) as u32, raw);
        }
        for raw in [10, 100, u32::MAX] {
            // SAFETY: as above.
            assert_eq!(unsafe { CStr::from_ptr(vmm_arena_status_name(raw)) }, c"UNKNOWN");
        }
    }

    #[test]
    fn id_zero_maps_to_an_id_no_arena_issues() {
        let a = Arena::new(ArenaConfig { capacity_bytes: 8 << 20, ..Default::default() }).unwrap();
        let (id, _) = a.alloc(1).unwrap();
        assert_ne!(id, id_arg(0));
        assert!(matches!(a.query(id_arg(0)), Err(Error::UnknownAllocation(_))));
        assert_eq!(id_arg(id.get()), id);
    }

    #[test]
    fn layouts_match_the_contract() {
        assert_eq!(std::mem::size_of::<vmm_arena_config>(), 48);
        assert_eq!(std::mem::size_of::<vmm_arena_stats>(), 8 + 16 * 8);
        assert_eq!(std::mem::size_of::<vmm_arena_compact_report>(), 32);
        assert_eq!(std::mem::size_of::<vmm_arena_status>(), 4);
    }
}
