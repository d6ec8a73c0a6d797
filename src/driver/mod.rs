//! The narrow device interface the arena's policy talks through.
//!
//! A [`Driver`] exposes the CUDA virtual-memory primitives and nothing else:
//! reserve a virtual range, create physical chunks, map them, set access,
//! unmap, release, free the range, synchronize. Backends translate these calls
//! and hold no policy; every decision (which chunk goes where, when to unmap,
//! what to keep pooled) lives in the arena.
//!
//! Rules every backend enforces or models (they are the CUDA rules):
//! - a fresh mapping is not accessible until [`Driver::set_access`] covers it,
//!   and `set_access` requires its whole span to be mapped;
//! - [`Driver::unmap`] must cover whole mappings (one or more), never a part;
//! - a chunk may be released while still mapped: its memory lives until its
//!   last mapping goes; releasing twice is an error;
//! - addresses, sizes and offsets are multiples of the granularity.
//!
//! Backends: [`host::HostDriver`] (Linux mmap + memfd), [`cuda::CudaDriver`]
//! (CUDA driver API, loaded at run time), [`mock::MockDriver`] (in memory,
//! no system calls: for Miri, loom and fast policy tests), and
//! [`fault::FaultDriver`], which wraps any of them and fails chosen calls.
//!
//! Backends also lend host memory for the backups of sleeping allocations
//! ([`Driver::alloc_host`], a [`HostBuffer`]): pinned on CUDA, ordinary
//! elsewhere.

use crate::error::Result;

pub mod cuda;
pub mod fault;
pub mod host;
mod host_buffer;
pub mod mock;
mod rules;

pub use host_buffer::{HostBuffer, HostMemory};

/// Opaque handle of one physical chunk, as issued by a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHandle(pub u64);

/// Allocation granularities reported by a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granularity {
    /// Every address, size and offset must be a multiple of this.
    pub minimum: u64,
    /// The size the backend performs best with (CUDA: the recommended granularity).
    pub recommended: u64,
}

/// The kinds of driver call, for counting and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallKind {
    Reserve,
    FreeReservation,
    Create,
    Release,
    Map,
    SetAccess,
    Unmap,
    Synchronize,
    /// Data movement: `read`, `write`, `copy` (not VMM calls, but they can fail).
    Data,
    /// Stream events: `record_event`, `event_complete`, `wait_event`,
    /// `destroy_event`.
    Event,
    /// Host buffers for backups: `alloc_host`.
    HostAlloc,
    /// Sharing with other processes: `export_chunk`, `import_chunk`,
    /// `dmabuf_fd`.
    Share,
}

impl CallKind {
    /// Every kind, in a fixed order.
    pub const ALL: [CallKind; 12] = [
        CallKind::Reserve,
        CallKind::FreeReservation,
        CallKind::Create,
        CallKind::Release,
        CallKind::Map,
        CallKind::SetAccess,
        CallKind::Unmap,
        CallKind::Synchronize,
        CallKind::Data,
        CallKind::Event,
        CallKind::HostAlloc,
        CallKind::Share,
    ];
}

/// The virtual-memory primitives a backend provides.
///
/// Implementations must be `Send + Sync`; the arena serializes its own calls
/// but may call from any thread.
pub trait Driver: Send + Sync {
    /// Short backend name for messages and snapshots (`"host"`, `"cuda"`, ...).
    fn name(&self) -> &'static str;

    /// The backend's granularities.
    fn granularity(&self) -> Result<Granularity>;

    /// Total physical memory the backend could provide (the default capacity).
    fn total_memory(&self) -> Result<u64>;

    /// Reserves `size` bytes of virtual address space aligned to `align`;
    /// returns the base address. Nothing is accessible in it yet.
    fn reserve(&self, size: u64, align: u64) -> Result<u64>;

    /// Frees a whole reservation made by [`Driver::reserve`] (exactly that range).
    fn free_reservation(&self, base: u64, size: u64) -> Result<()>;

    /// Creates one physical chunk of `size` bytes.
    fn create(&self, size: u64) -> Result<ChunkHandle>;

    /// Releases a chunk. Its memory lives on while it is still mapped.
    fn release(&self, chunk: ChunkHandle) -> Result<()>;

    /// Maps `size` bytes of `chunk`, starting at `offset` within it, at `addr`
    /// (inside a reservation, not mapped yet). The mapping has no access yet.
    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()>;

    /// Makes a fully mapped span readable and writable by the device.
    fn set_access(&self, addr: u64, size: u64) -> Result<()>;

    /// Unmaps a span made of whole mappings. Does not wait for the device:
    /// callers synchronize first when the span may be in use.
    fn unmap(&self, addr: u64, size: u64) -> Result<()>;

    /// Waits until the device has finished all work that may touch memory
    /// about to be unmapped. A no-op on the host.
    fn synchronize(&self) -> Result<()>;

    /// Copies `dst.len()` bytes from the mapped, accessible span at `addr`.
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()>;

    /// Copies `src` into the mapped, accessible span at `addr`.
    fn write(&self, addr: u64, src: &[u8]) -> Result<()>;

    /// Copies `len` bytes between two mapped, accessible spans (may not overlap).
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()>;

    /// Records an event on `stream` (a `CUstream`; 0 is the legacy default
    /// stream) and returns it, so memory freed now can be handed out again
    /// only once the stream has passed this point. `None`: the backend has no
    /// asynchronous streams (the host), the memory is reusable at once.
    fn record_event(&self, stream: u64) -> Result<Option<u64>> {
        let _ = stream;
        Ok(None)
    }

    /// Whether a recorded event has completed.
    fn event_complete(&self, event: u64) -> Result<bool> {
        let _ = event;
        Ok(true)
    }

    /// Blocks until a recorded event has completed (`cuEventSynchronize`):
    /// the work queued on its stream before it, and nothing else, is done.
    /// The arena calls it only when nothing else can serve a request.
    fn wait_event(&self, event: u64) -> Result<()> {
        let _ = event;
        Ok(())
    }

    /// Destroys a recorded event.
    fn destroy_event(&self, event: u64) -> Result<()> {
        let _ = event;
        Ok(())
    }

    /// Allocates `len` zeroed bytes of host memory for copies to and from
    /// the device with [`Driver::read`] and [`Driver::write`] (the backups
    /// of sleeping allocations). The buffer frees itself when dropped, and
    /// stays valid after the driver is gone. The default is ordinary memory
    /// ([`HostBuffer::pageable`]); CUDA gives page-locked memory.
    /// `Error::OutOfMemory` when the host has none.
    fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        HostBuffer::pageable(len)
    }

    /// A new file descriptor for `chunk`, which another process (or this
    /// one) can pass to [`Driver::import_chunk`]; it gives access to that
    /// chunk's memory and nothing else. The caller owns it. The chunk must
    /// have been created exportable (a backend option); otherwise, and on
    /// backends that cannot share, `Error::Unsupported`.
    #[cfg(unix)]
    fn export_chunk(&self, chunk: ChunkHandle) -> Result<std::os::fd::OwnedFd> {
        let _ = chunk;
        Err(crate::error::Error::Unsupported(format!("the {} backend cannot export chunks", self.name())))
    }

    /// A chunk handle for the memory behind `fd` (from [`Driver::export_chunk`],
    /// possibly in another process), of `size` bytes: it maps, and is
    /// released, like a created chunk; its memory lives until every process
    /// has released and unmapped it. `fd` is only borrowed (the backend
    /// duplicates what it keeps). With `read_only`, [`Driver::set_access`]
    /// on its mappings gives read access only. A descriptor that is closed,
    /// not an exported chunk, or of another size is `Error::InvalidArgument`.
    #[cfg(unix)]
    fn import_chunk(&self, fd: std::os::fd::BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
        let _ = (fd, size, read_only);
        Err(crate::error::Error::Unsupported(format!("the {} backend cannot import chunks", self.name())))
    }

    /// A DMA-BUF file descriptor for the mapped span `addr..addr+size`
    /// (`cuMemGetHandleForAddressRange`), which RDMA stacks register. GPU
    /// only: `Error::Unsupported` elsewhere. The caller owns it.
    #[cfg(unix)]
    fn dmabuf_fd(&self, addr: u64, size: u64) -> Result<std::os::fd::OwnedFd> {
        let _ = (addr, size);
        Err(crate::error::Error::Unsupported(format!("the {} backend has no DMA-BUF handles (GPU only)", self.name())))
    }
}

/// Forwards every driver method through a smart pointer.
macro_rules! forward_driver {
    ($($ptr:ident)::+) => {
        impl<T: Driver + ?Sized> Driver for $($ptr)::+<T> {
            fn name(&self) -> &'static str {
                (**self).name()
            }
            fn granularity(&self) -> Result<Granularity> {
                (**self).granularity()
            }
            fn total_memory(&self) -> Result<u64> {
                (**self).total_memory()
            }
            fn reserve(&self, size: u64, align: u64) -> Result<u64> {
                (**self).reserve(size, align)
            }
            fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
                (**self).free_reservation(base, size)
            }
            fn create(&self, size: u64) -> Result<ChunkHandle> {
                (**self).create(size)
            }
            fn release(&self, chunk: ChunkHandle) -> Result<()> {
                (**self).release(chunk)
            }
            fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
                (**self).map(addr, size, chunk, offset)
            }
            fn set_access(&self, addr: u64, size: u64) -> Result<()> {
                (**self).set_access(addr, size)
            }
            fn unmap(&self, addr: u64, size: u64) -> Result<()> {
                (**self).unmap(addr, size)
            }
            fn synchronize(&self) -> Result<()> {
                (**self).synchronize()
            }
            fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
                (**self).read(addr, dst)
            }
            fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
                (**self).write(addr, src)
            }
            fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
                (**self).copy(dst, src, len)
            }
            fn record_event(&self, stream: u64) -> Result<Option<u64>> {
                (**self).record_event(stream)
            }
            fn event_complete(&self, event: u64) -> Result<bool> {
                (**self).event_complete(event)
            }
            fn wait_event(&self, event: u64) -> Result<()> {
                (**self).wait_event(event)
            }
            fn destroy_event(&self, event: u64) -> Result<()> {
                (**self).destroy_event(event)
            }
            fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
                (**self).alloc_host(len)
            }
            #[cfg(unix)]
            fn export_chunk(&self, chunk: ChunkHandle) -> Result<std::os::fd::OwnedFd> {
                (**self).export_chunk(chunk)
            }
            #[cfg(unix)]
            fn import_chunk(&self, fd: std::os::fd::BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
                (**self).import_chunk(fd, size, read_only)
            }
            #[cfg(unix)]
            fn dmabuf_fd(&self, addr: u64, size: u64) -> Result<std::os::fd::OwnedFd> {
                (**self).dmabuf_fd(addr, size)
            }
        }
    };
}

forward_driver!(std::sync::Arc);
forward_driver!(Box);
