//! # vmm-arena
//!
//! A GPU memory manager over CUDA's virtual memory management API. One large
//! virtual address range is reserved once and backed by physical chunks
//! (2 MiB by default) mapped where they are needed, so that
//!
//! - allocations **grow in place** (a growable allocation reserves address
//!   space up to its maximum and maps chunks as it grows);
//! - allocations **move by remapping**: their chunks are mapped at a new
//!   address, no byte is copied and no scratch memory is needed;
//! - the address space is **compacted** by such moves, so an allocation never
//!   fails for fragmentation while the capacity covers it;
//! - freed memory is **pooled** (kept mapped where it can serve the next
//!   request without a driver call) and **given back** beyond a watermark.
//!
//! The policy ([`Arena`]) talks to the device only through the narrow
//! [`driver::Driver`] trait. Backends: [`driver::host::HostDriver`] (Linux
//! memory, a faithful model of the CUDA rules, so everything is testable
//! without a GPU), [`driver::cuda::CudaDriver`], [`driver::mock::MockDriver`]
//! and [`driver::fault::FaultDriver`] for fault injection.
//!
//! ```
//! use vmm_arena::{Arena, ArenaConfig};
//!
//! let arena = Arena::new(ArenaConfig { capacity_bytes: 64 << 20, ..Default::default() })?;
//! let (kv, _ptr) = arena.alloc_growable(1 << 20, 32 << 20)?;
//! arena.write(kv, 0, b"token 0")?;
//! let ptr = arena.resize(kv, 24 << 20)?; // grows in place: same address
//! assert_eq!(arena.query(kv)?.ptr, ptr);
//! let mut out = [0u8; 7];
//! arena.read(kv, 0, &mut out)?;
//! assert_eq!(&out, b"token 0");
//! arena.free(kv)?;
//! # Ok::<(), vmm_arena::Error>(())
//! ```
#![deny(unsafe_code)]
#![warn(missing_debug_implementations)]

pub mod arena;
mod compact;
pub mod driver;
pub mod error;
#[cfg(unix)]
pub mod fd_passing;
pub mod group;
mod id;
pub mod layout;
mod snapshot;
mod sync;
mod va;

#[cfg(unix)]
#[cfg(unix)]
pub use arena::DmaBuf;
pub use arena::Prepared;
pub use arena::{
    AllocInfo, Arena, ArenaConfig, Backend, CompactReport, MoveCallback, MoveEvent, Stats, ALL_TAGS,
    DEFAULT_CHUNK_BYTES, MAX_ADMISSION_WINDOWS, SLEEP_BACKUP,
};
pub use arena::{
    Export, ExportLayout, EXPORT_FORMAT_VERSION, EXPORT_HANDLE_CUDA_POSIX_FD, EXPORT_HANDLE_HOST_MEMFD,
    EXPORT_HANDLE_UNSPECIFIED,
};
pub use error::{Error, Result, Status};
pub use group::{Group, GroupConfig, GroupError, GroupId};
pub use id::Id;

/// The README's code blocks, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
