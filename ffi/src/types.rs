//! The C types of the ABI: its constants and flag bits, the status codes,
//! the backend enum, the opaque handle, the config, stats and compact-report
//! structs and the move callback's type, with their conversions from the
//! Rust library's types. The exported functions that take and return them
//! are in the crate root.
//!
//! cbindgen emits the constants in the order it meets them: this module is
//! declared before `group` and `share`, so the header's order stays the
//! contract's.

use std::ffi::{c_void, CStr};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arena::driver::fault::FaultDriver;
use arena::driver::host::HostDriver;
use arena::{Arena, Status};

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
/// the device lacks it). Bits 4 and 16 are no flags: a config that sets
/// either is INVALID_ARGUMENT, like every unknown bit.
pub const VMM_ARENA_FLAG_EXPORTABLE: u32 = 8u32;

/// Config flag: allocations are placed as a pure function of the operations
/// and the config, whatever the pool holds, so tensor-parallel ranks (one
/// process per GPU) that apply the same operations get the same offsets
/// from their bases, also after a two-phase operation was aborted on some
/// of them (vmm_arena_prepare_alloc). It gives up preferring free ranges
/// whose pages still hold pooled chunks (fewer driver calls, same memory).
/// Stream-ordered frees (vmm_arena_free_on_stream) make reuse depend on
/// when events complete: ranks that use them may diverge.
pub const VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT: u32 = 32u32;

/// Every flag bit this version knows.
pub(crate) const KNOWN_FLAGS: u32 = VMM_ARENA_FLAG_NO_IMPLICIT_MOVES
    | VMM_ARENA_FLAG_BACKGROUND
    | VMM_ARENA_FLAG_EXPORTABLE
    | VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT;

/// Every tag, for vmm_arena_sleep and vmm_arena_wake.
pub const VMM_ARENA_ALL_TAGS: u32 = 0xFFFFFFFFu32;

/// vmm_arena_sleep flag: copy each allocation's bytes to host memory first;
/// vmm_arena_wake writes them back.
pub const VMM_ARENA_SLEEP_BACKUP: u32 = 1u32;

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
    /// A prepared two-phase operation whose allocation another call changed
    /// since the prepare (resized, freed, put to sleep): the commit or abort
    /// did nothing (see vmm_arena_commit).
    VMM_ARENA_ERR_STALE = 10,
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
            Status::Stale => VMM_ARENA_ERR_STALE,
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
    /// Shared with a group when the handle names a member of it
    /// (`vmm_arena_group_member`).
    pub(crate) arena: Arc<Arena>,
    /// Set when a panic was caught in a call on this arena.
    pub(crate) poisoned: AtomicBool,
    /// The fault injector under a testing arena (see `testing`).
    pub(crate) fault: Option<Arc<FaultDriver<HostDriver>>>,
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
    /// physical bytes backing live allocations (each chunk once), and the
    /// chunks of freed allocations that an open DMA-BUF still holds (not
    /// reusable, so not pooled); every other chunk held is in pooled_bytes
    /// (a slab holding only retired objects included)
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

pub(crate) static STATUS_NAMES: [&CStr; 11] = [
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
    c"VMM_ARENA_ERR_STALE",
];

/// The C view of the arena's stats (`struct_size` filled in).
pub(crate) fn c_stats(s: &arena::Stats) -> vmm_arena_stats {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_contract() {
        assert_eq!(std::mem::size_of::<vmm_arena_config>(), 48);
        assert_eq!(std::mem::size_of::<vmm_arena_stats>(), 8 + 16 * 8);
        assert_eq!(std::mem::size_of::<vmm_arena_compact_report>(), 32);
        assert_eq!(std::mem::size_of::<vmm_arena_status>(), 4);
    }
}
