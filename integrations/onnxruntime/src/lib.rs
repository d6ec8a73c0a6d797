//! ONNX Runtime on vmm-arena: an OrtAllocator over vmm-arena's C ABI,
//! registered on ONNX Runtime's environment so that its CPU kernels take
//! their tensors from the arena, plus what the tests and the benchmark need
//! (loading the onnxruntime wheel's library, sessions of the decoder model,
//! the model file, the process's resident memory).

pub mod allocator;
pub mod arena;
pub mod model;
pub mod runtime;

pub use allocator::{session_allocator_stats, AllocatorCounters, ArenaAllocator, Registration, SetupError};
pub use arena::{Arena, ArenaConfig, ArenaDevice, ArenaError, ArenaStats};
pub use runtime::{Ort, OrtError, Session, SessionConfig};

/// The Python that has onnxruntime, onnx and numpy installed:
/// VMM_ARENA_PYTHON, else PYTHON, else `python3`.
pub fn python() -> String {
    std::env::var("VMM_ARENA_PYTHON").or_else(|_| std::env::var("PYTHON")).unwrap_or_else(|_| "python3".into())
}

/// This process's resident set (VmRSS) in bytes.
pub fn rss_bytes() -> u64 {
    status_kib("VmRSS:") * 1024
}

/// The part of the resident set in shared memory (RssShmem): the host
/// backend's memfd chunks while mapped.
pub fn shmem_rss_bytes() -> u64 {
    status_kib("RssShmem:") * 1024
}

/// Asks the C library to give its free heap back to the system
/// (glibc's malloc_trim; false where there is none). ONNX Runtime's own
/// bookkeeping goes through malloc, whose freed memory glibc may otherwise
/// keep, so that the resident set says little about the allocator under test.
pub fn release_free_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim takes a byte count and only touches free heap.
        unsafe { malloc_trim(0) };
        true
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// This process's peak resident set (VmHWM) in bytes since start or
/// `reset_peak_rss`.
pub fn peak_rss_bytes() -> u64 {
    status_kib("VmHWM:") * 1024
}

/// Resets VmHWM to the current resident set (Linux: clear_refs 5).
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0)
}
