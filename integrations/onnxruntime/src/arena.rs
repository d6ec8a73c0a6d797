//! vmm-arena through its C ABI (ffi/include/vmm_arena.h, ABI version 1):
//! the few functions the allocator uses, declared here, and a small owner.

use std::ffi::{c_char, CStr};
use std::fmt;
use std::ptr::NonNull;

/// The header's VMM_ARENA_ABI_VERSION these declarations follow.
pub const ABI_VERSION: u32 = 1;
const VMM_ARENA_OK: i32 = 0;
const BACKEND_HOST: u32 = 0;
const BACKEND_CUDA: u32 = 1;

#[repr(C)]
struct RawArena {
    _opaque: [u8; 0],
}

/// vmm_arena_config.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawConfig {
    struct_size: u32,
    backend: u32,
    device: i32,
    flags: u32,
    capacity_bytes: u64,
    reserve_bytes: u64,
    chunk_bytes: u64,
    retain_bytes: u64,
}

/// vmm_arena_stats: counters and sizes of an arena.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaStats {
    struct_size: u32,
    reserved0: u32,
    pub live_allocations: u64,
    pub live_bytes: u64,
    pub mapped_bytes: u64,
    pub pooled_bytes: u64,
    pub peak_physical_bytes: u64,
    pub capacity_bytes: u64,
    pub reserved_va_bytes: u64,
    pub free_va_bytes: u64,
    pub largest_free_va_bytes: u64,
    pub retired_va_bytes: u64,
    pub moves: u64,
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    pub driver_unmaps: u64,
    pub driver_access_calls: u64,
}

extern "C" {
    fn vmm_arena_abi_version() -> u32;
    fn vmm_arena_status_name(status: i32) -> *const c_char;
    fn vmm_arena_last_error() -> *const c_char;
    fn vmm_arena_config_default(config: *mut RawConfig);
    fn vmm_arena_create(config: *const RawConfig, out: *mut *mut RawArena) -> i32;
    fn vmm_arena_destroy(arena: *mut RawArena);
    fn vmm_arena_alloc(arena: *mut RawArena, size: u64, out_id: *mut u64, out_ptr: *mut u64) -> i32;
    fn vmm_arena_free(arena: *mut RawArena, id: u64) -> i32;
    fn vmm_arena_trim(arena: *mut RawArena, keep_bytes: u64, out_released: *mut u64) -> i32;
    fn vmm_arena_stats_get(arena: *mut RawArena, stats: *mut ArenaStats) -> i32;
}

/// A failed C ABI call: its status name and the library's detail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaError {
    pub status: i32,
    pub name: String,
    pub detail: String,
}

impl fmt::Display for ArenaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.detail.is_empty() {
            write!(f, "{}", self.name)
        } else {
            write!(f, "{}: {}", self.name, self.detail)
        }
    }
}

impl std::error::Error for ArenaError {}

fn check(status: i32) -> Result<(), ArenaError> {
    if status == VMM_ARENA_OK {
        return Ok(());
    }
    // SAFETY: both return static or thread-local NUL-terminated strings that
    // are never NULL (header contract), read before the next call.
    let (name, detail) = unsafe {
        (
            CStr::from_ptr(vmm_arena_status_name(status)).to_string_lossy().into_owned(),
            CStr::from_ptr(vmm_arena_last_error()).to_string_lossy().into_owned(),
        )
    };
    Err(ArenaError { status, name, detail })
}

/// Where an arena's memory lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ArenaDevice {
    /// The host backend: memfd chunks mapped into one reserved range of
    /// this process (ONNX Runtime's CPU device).
    #[default]
    Host,
    /// The CUDA backend on this device ordinal (ONNX Runtime's "Cuda"
    /// device); without a CUDA driver or device, creation fails with
    /// VMM_ARENA_ERR_UNSUPPORTED.
    Cuda(i32),
}

/// Sizes and device of an arena.
#[derive(Clone, Copy, Debug)]
pub struct ArenaConfig {
    pub device: ArenaDevice,
    /// Most physical memory held (0: the host's RAM, or the GPU's memory).
    pub capacity_bytes: u64,
    /// Physical chunk size (0: 2 MiB).
    pub chunk_bytes: u64,
    /// Pooled memory kept after frees (u64::MAX: everything until trim).
    pub retain_bytes: u64,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        ArenaConfig { device: ArenaDevice::Host, capacity_bytes: 0, chunk_bytes: 0, retain_bytes: u64::MAX }
    }
}

/// An arena on the host backend (memfd chunks mapped into one reserved
/// range) or the CUDA backend.
pub struct Arena {
    raw: NonNull<RawArena>,
}

// SAFETY: the C ABI says an arena is safe to use from many threads at once.
unsafe impl Send for Arena {}
// SAFETY: as above; every method takes &self and the library locks inside.
unsafe impl Sync for Arena {}

impl Arena {
    pub fn new(config: ArenaConfig) -> Result<Arena, ArenaError> {
        // SAFETY: a plain call without arguments.
        let abi = unsafe { vmm_arena_abi_version() };
        if abi != ABI_VERSION {
            return Err(ArenaError {
                status: -1,
                name: "ABI_MISMATCH".into(),
                detail: format!("libvmm_arena implements ABI {abi}, these bindings {ABI_VERSION}"),
            });
        }
        let mut raw_config = RawConfig::default();
        // SAFETY: raw_config is a writable vmm_arena_config.
        unsafe { vmm_arena_config_default(&mut raw_config) };
        (raw_config.backend, raw_config.device) = match config.device {
            ArenaDevice::Host => (BACKEND_HOST, 0),
            ArenaDevice::Cuda(ordinal) => (BACKEND_CUDA, ordinal),
        };
        raw_config.capacity_bytes = config.capacity_bytes;
        raw_config.chunk_bytes = config.chunk_bytes;
        raw_config.retain_bytes = config.retain_bytes;
        let mut out = std::ptr::null_mut();
        // SAFETY: the config is filled in by the library's own default (its
        // struct_size included); out is writable.
        check(unsafe { vmm_arena_create(&raw_config, &mut out) })?;
        Ok(Arena { raw: NonNull::new(out).expect("vmm_arena_create wrote a handle on OK") })
    }

    /// Allocates `size` bytes: (id, address).
    pub fn alloc(&self, size: u64) -> Result<(u64, u64), ArenaError> {
        let (mut id, mut ptr) = (0u64, 0u64);
        // SAFETY: self.raw is a live handle; the out-parameters are writable.
        check(unsafe { vmm_arena_alloc(self.raw.as_ptr(), size, &mut id, &mut ptr) })?;
        Ok((id, ptr))
    }

    pub fn free(&self, id: u64) -> Result<(), ArenaError> {
        // SAFETY: self.raw is a live handle.
        check(unsafe { vmm_arena_free(self.raw.as_ptr(), id) })
    }

    /// Gives pooled chunks back until at most `keep_bytes` stay pooled;
    /// returns the bytes released.
    pub fn trim(&self, keep_bytes: u64) -> Result<u64, ArenaError> {
        let mut released = 0u64;
        // SAFETY: self.raw is a live handle; released is writable.
        check(unsafe { vmm_arena_trim(self.raw.as_ptr(), keep_bytes, &mut released) })?;
        Ok(released)
    }

    pub fn stats(&self) -> Result<ArenaStats, ArenaError> {
        let mut stats = ArenaStats { struct_size: std::mem::size_of::<ArenaStats>() as u32, ..ArenaStats::default() };
        // SAFETY: self.raw is a live handle; stats is writable for its
        // struct_size, which is set.
        check(unsafe { vmm_arena_stats_get(self.raw.as_ptr(), &mut stats) })?;
        Ok(stats)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the handle is live, owned here and not used again.
        unsafe { vmm_arena_destroy(self.raw.as_ptr()) };
    }
}
