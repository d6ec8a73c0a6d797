//! The CUDA backend: the [`Driver`] primitives over the CUDA driver API's
//! virtual memory management calls, with cudarc's `sys` bindings.
//!
//! libcuda is loaded at run time (cudarc's `dynamic-loading`), so this backend
//! builds and links everywhere, including machines without a GPU or a CUDA
//! toolkit. [`CudaDriver::new`] is the only way in, and it answers
//! [`Error::Unsupported`] — never a panic — when libcuda is missing, lacks a
//! symbol this backend calls, cannot initialise, has no such device, or the
//! device lacks virtual memory management.
//!
//! Layering, as in cudarc: every raw driver call is wrapped exactly once, in
//! the private `Lib` methods (`raw.rs`), into a small function that returns
//! [`Result`]; nothing else in this backend sees a raw result code. cudarc finds
//! and opens libcuda ([`sys::is_culib_present`], [`sys::culib`]) and provides
//! the driver's types (property structs, enums, handles). The functions
//! themselves are resolved from that library *once*, all together, into a
//! table (`Api`) whose entries return the result code as a plain `u32`,
//! instead of being called through cudarc's per-function lazy loaders, for
//! two reasons found in testing against a stand-in libcuda:
//! - cudarc's loaders panic when a symbol is missing (design trap 9); here a
//!   missing symbol is an [`Error::Unsupported`] from [`CudaDriver::new`];
//! - cudarc declares the result as a Rust enum (`CUresult`), so a code that
//!   its enum does not list (a newer driver's) is undefined behaviour; it
//!   crashed the process with an illegal instruction. A `u32` cannot be wrong.
//!
//! Context handling (trap 5): the device's *primary* context is retained once
//! in [`CudaDriver::new`] and released in `Drop`. Every driver method first
//! makes it current on the calling thread, so any thread may call in and the
//! memory is shared with code using the CUDA runtime API (which also uses the
//! primary context). Whatever the calling thread had current before (another
//! context, or none) is current again when the method returns.
//!
//! Host buffers ([`Driver::alloc_host`], the backups of sleeping
//! allocations) are page-locked memory from `cuMemHostAlloc`, which the
//! device reads and writes by DMA without a staging copy. Each buffer holds
//! a share of the retained primary context, so the context (and the pinned
//! memory with it) lives until the last buffer is freed with `cuMemFreeHost`,
//! even after the driver itself is dropped. When the driver cannot pin that
//! much (`CUDA_ERROR_OUT_OF_MEMORY`: page-locked memory is limited), the
//! buffer is ordinary memory instead, which the same copies accept.
//!
//! Data calls (`read`, `write`, `copy`, [`CudaDriver::fill_u32`]) run on the
//! legacy default stream and return only when their bytes are in place, like
//! the host backend, so an unmap that follows them never races them. The VMM
//! calls themselves do not wait for the device: [`Driver::synchronize`]
//! (`cuCtxSynchronize`) is the one place that does (trap 1).
//!
//! Peers and sharing: [`CudaDriver::with_options`] can give every mapping
//! access from peer devices too (one `cuMemSetAccess` descriptor per device,
//! design trap 6) and create chunks exportable as POSIX file descriptors
//! (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`; a
//! read-only import's mappings get read-only descriptors), and
//! [`Driver::dmabuf_fd`] is `cuMemGetHandleForAddressRange`. An import's size
//! is checked with trial mappings (the driver API answers no allocation's
//! size from its handle): another size than the layout's is
//! [`Error::InvalidArgument`]. These paths are
//! built and unit-tested here but were not run on a GPU by the tests of this
//! repository's host-only CI.
//!
//! Chunk handles are tracked: releasing a handle twice, or mapping a handle
//! that was released, is an [`Error::InvalidArgument`] here rather than a call
//! into the driver with a value that may by then name someone else's chunk
//! (trap 4).
#![allow(unsafe_code)]

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUresult};

use crate::driver::{ChunkHandle, Driver, Granularity, HostBuffer};
use crate::error::{Error, Result};

mod context;
mod raw;

use context::{CurrentCtx, PinnedHostMemory, PrimaryContext};
use raw::*;

/// The CUDA backend for one device. See the [module docs](self).
#[derive(Debug)]
pub struct CudaDriver {
    lib: Lib,
    ordinal: i32,
    device: sys::CUdevice,
    /// The device's primary context, retained once by `new`; shared with
    /// the pinned host buffers, which may outlive the driver.
    ctx: Arc<PrimaryContext>,
    granularity: Granularity,
    name: String,
    driver_version: i32,
    /// Handles created and not yet released (trap 4: never release twice).
    live: Mutex<HashSet<u64>>,
    /// One access descriptor per device that gets read-write access to
    /// every mapping: this device first, then its peers (trap 6).
    access: Vec<sys::CUmemAccessDesc>,
    /// The same devices with read access only, for read-only imports.
    read_access: Vec<sys::CUmemAccessDesc>,
    /// Chunks are created with the POSIX file-descriptor handle type.
    exportable: bool,
    /// Imported read-only handles, and where each is mapped (address ->
    /// size), so that `set_access` gives those spans read access only.
    read_only: Mutex<(HashSet<u64>, std::collections::BTreeMap<u64, u64>)>,
}

impl CudaDriver {
    /// Opens device `device` (an ordinal, as in `CUDA_VISIBLE_DEVICES` order).
    ///
    /// Returns [`Error::Unsupported`] with a reason when libcuda is missing or
    /// too old, the driver cannot initialise, the device does not exist, or it
    /// lacks virtual memory management. Never panics.
    pub fn new(device: i32) -> Result<CudaDriver> {
        CudaDriver::with_peer_access(device, &[])
    }

    /// Like [`CudaDriver::new`], and every mapping is also made readable
    /// and writable from each device in `peers` (ordinals): one access
    /// descriptor per device in each `cuMemSetAccess` call, since peer
    /// access enabled through the runtime API does not reach VMM mappings
    /// (design trap 6). A peer that does not exist, repeats, is `device`
    /// itself, or cannot access `device`'s memory (`cuDeviceCanAccessPeer`)
    /// is [`Error::Unsupported`], before anything is mapped.
    pub fn with_peer_access(device: i32, peers: &[i32]) -> Result<CudaDriver> {
        CudaDriver::with_options(device, peers, false)
    }

    /// Like [`CudaDriver::with_peer_access`]; with `exportable`, chunks are
    /// created with the POSIX file-descriptor handle type, so that
    /// [`Driver::export_chunk`] can hand them to another process. A device
    /// that does not support that handle type
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`)
    /// is [`Error::Unsupported`].
    pub fn with_options(device: i32, peers: &[i32], exportable: bool) -> Result<CudaDriver> {
        match catch_unwind(AssertUnwindSafe(|| CudaDriver::open(device, peers, exportable))) {
            Ok(r) => r,
            Err(_) => Err(Error::Unsupported("the CUDA driver could not be loaded (loader panicked)".into())),
        }
    }

    fn open(ordinal: i32, peers: &[i32], exportable: bool) -> Result<CudaDriver> {
        let lib = Lib::load()?;
        lib.init().map_err(|e| Error::Unsupported(format!("the CUDA driver cannot initialise: {e}")))?;
        let count = lib.device_count().map_err(|e| Error::Unsupported(e.to_string()))?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} does not exist ({count} device(s) visible)"
            )));
        }
        let device = lib.device_get(ordinal).map_err(|e| Error::Unsupported(e.to_string()))?;
        let unsupported = |e: Error| Error::Unsupported(format!("CUDA device {ordinal}: {e}"));
        let vmm = lib
            .device_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
            .map_err(unsupported)?;
        if vmm == 0 {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} does not support virtual memory management"
            )));
        }
        let mut access = vec![access_desc(ordinal)];
        for (i, &peer) in peers.iter().enumerate() {
            if peer < 0 || peer >= count || peer == ordinal || peers[..i].contains(&peer) {
                return Err(Error::Unsupported(format!(
                    "peer device {peer} of CUDA device {ordinal}: not another existing device, or listed twice \
                     ({count} device(s) visible)"
                )));
            }
            let peer_dev = lib.device_get(peer).map_err(|e| Error::Unsupported(e.to_string()))?;
            if !lib.can_access_peer(peer_dev, device).map_err(unsupported)? {
                return Err(Error::Unsupported(format!(
                    "CUDA device {peer} cannot access the memory of device {ordinal} (cuDeviceCanAccessPeer)"
                )));
            }
            access.push(access_desc(peer));
        }
        if exportable {
            let posix = lib
                .device_attribute(
                    device,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                )
                .map_err(unsupported)?;
            if posix == 0 {
                return Err(Error::Unsupported(format!(
                    "CUDA device {ordinal} cannot export memory as POSIX file descriptors"
                )));
            }
        }
        let read_access = access
            .iter()
            .map(|d| sys::CUmemAccessDesc { flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ, ..*d })
            .collect();
        let name = lib.device_name(device).unwrap_or_else(|_| "unknown".into());
        let driver_version = lib.driver_version().unwrap_or(0);

        let ctx = Arc::new(PrimaryContext { lib, device, ctx: lib.primary_ctx_retain(device).map_err(unsupported)? });
        // From here on, `PrimaryContext::drop` balances the retain, including
        // on error below.
        let mut driver = CudaDriver {
            lib,
            ordinal,
            device,
            ctx,
            granularity: Granularity { minimum: 0, recommended: 0 },
            name,
            driver_version,
            live: Mutex::new(HashSet::new()),
            access,
            read_access,
            exportable,
            read_only: Mutex::new((HashSet::new(), std::collections::BTreeMap::new())),
        };
        let (minimum, recommended) = {
            // The granularity query wants the context current, like every call.
            let _cur = driver.enter().map_err(unsupported)?;
            let prop = allocation_prop(ordinal, exportable);
            let flag = |f| lib.granularity(&prop, f).map_err(unsupported);
            (
                flag(sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?,
                flag(sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?,
            )
        };
        if minimum == 0 || recommended == 0 || recommended % minimum != 0 {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} reports unusable granularities {minimum} / {recommended}"
            )));
        }
        driver.granularity = Granularity { minimum, recommended };
        Ok(driver)
    }

    /// The device ordinal this driver was opened on.
    pub fn device_ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device's name as the driver reports it (e.g. `"NVIDIA H200"`).
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The driver's CUDA version, e.g. `12080` for 12.8.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Fills `count` 32-bit words at `addr` with `value` (`cuMemsetD32`),
    /// returning once the fill is complete. `addr` must be 4-byte aligned and
    /// the span mapped and accessible.
    pub fn fill_u32(&self, addr: u64, value: u32, count: u64) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let count = to_usize("count", count)?;
        let _cur = self.enter()?;
        self.lib.memset_d32(addr, value, count)?;
        self.lib.default_stream_synchronize()
    }

    /// Checks that an imported allocation is exactly `size` bytes. The
    /// driver API has no call that answers an allocation's size from its
    /// handle (`cuMemGetAllocationPropertiesFromHandle` gives the
    /// properties, not the size, and the POSIX descriptor is opaque), so it
    /// is found out with `cuMemMap`, which refuses a mapping past the end of
    /// the allocation: in a scratch reservation, `size` bytes must map and
    /// `size` plus one granule must not (sizes are multiples of the minimum
    /// granularity, so a larger allocation has at least that much more).
    /// The context is current (the caller's guard).
    fn check_import_size(&self, handle: u64, size: usize) -> Result<()> {
        let granule = to_usize("granularity", self.granularity.minimum)?;
        let mismatch = |what: &str| {
            Error::invalid(format!("import: the exported chunk is {what} the {size} bytes the layout says (size)"))
        };
        if size == 0 || size % granule != 0 {
            return Err(mismatch("not"));
        }
        let probe = size.checked_add(granule).ok_or_else(|| mismatch("not"))?;
        let base = self.lib.address_reserve(probe, 0)?;
        let mapped = |len: usize| -> Result<bool> {
            match self.lib.mem_map(base, len, 0, handle) {
                Ok(()) => self.lib.mem_unmap(base, len).map(|_| true),
                Err(Error::Driver { code, .. }) if code == CUresult::CUDA_ERROR_INVALID_VALUE as i64 => Ok(false),
                Err(e) => Err(e),
            }
        };
        let verdict = match mapped(size) {
            Ok(false) => Err(mismatch("smaller than")),
            Ok(true) => match mapped(probe) {
                Ok(true) => Err(mismatch("larger than")),
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        let freed = self.lib.address_free(base, probe);
        verdict.and(freed)
    }

    /// Makes the primary context current on this thread for one method.
    fn enter(&self) -> Result<CurrentCtx> {
        self.ctx.enter()
    }

    /// The devices that get access to every mapping: this one, then its peers.
    pub fn access_devices(&self) -> Vec<i32> {
        self.access.iter().map(|d| d.location.id).collect()
    }

    fn ro(&self) -> std::sync::MutexGuard<'_, (HashSet<u64>, std::collections::BTreeMap<u64, u64>)> {
        // Single inserts and removes, as for `live`: a poisoned lock is fine.
        self.read_only.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        // A panic while holding this lock cannot leave the set inconsistent
        // (single inserts and removes), so a poisoned lock is used as is.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Read-write access for device `ordinal`.
fn access_desc(ordinal: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
}

/// Pinned device memory on `ordinal`; exportable as a POSIX file
/// descriptor when asked, else with no shareable handle type.
fn allocation_prop(ordinal: i32, exportable: bool) -> sys::CUmemAllocationProp {
    let handles = match exportable {
        true => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        false => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn granularity(&self) -> Result<Granularity> {
        Ok(self.granularity)
    }

    fn total_memory(&self) -> Result<u64> {
        self.lib.device_total_mem(self.device)
    }

    fn reserve(&self, size: u64, align: u64) -> Result<u64> {
        // cuMemAddressReserve refuses an alignment that is not 0 or a power
        // of two; say so with the same error the host and mock rules give.
        if align != 0 && !align.is_power_of_two() {
            return Err(Error::invalid(format!(
                "reserve: alignment {align:#x} is not a power of two (cuMemAddressReserve refuses it)"
            )));
        }
        let size = to_usize("size", size)?;
        let align = to_usize("alignment", align)?;
        let _cur = self.enter()?;
        self.lib.address_reserve(size, align)
    }

    fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
        let size = to_usize("size", size)?;
        let _cur = self.enter()?;
        self.lib.address_free(base, size)
    }

    fn create(&self, size: u64) -> Result<ChunkHandle> {
        let size = to_usize("size", size)?;
        let _cur = self.enter()?;
        let handle = self.lib.mem_create(size, &allocation_prop(self.ordinal, self.exportable))?;
        self.live().insert(handle);
        Ok(ChunkHandle(handle))
    }

    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        let mut live = self.live();
        if !live.contains(&chunk.0) {
            return Err(Error::invalid(format!(
                "chunk handle {:#x} is not live (released twice, or never created here)",
                chunk.0
            )));
        }
        let _cur = self.enter()?;
        self.lib.mem_release(chunk.0)?;
        live.remove(&chunk.0);
        self.ro().0.remove(&chunk.0);
        Ok(())
    }

    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
        let size = to_usize("size", size)?;
        let offset = to_usize("offset", offset)?;
        if !self.live().contains(&chunk.0) {
            return Err(Error::invalid(format!(
                "chunk handle {:#x} is not live (released, or never created here)",
                chunk.0
            )));
        }
        let _cur = self.enter()?;
        self.lib.mem_map(addr, size, offset, chunk.0)?;
        let mut ro = self.ro();
        if ro.0.contains(&chunk.0) {
            ro.1.insert(addr, size as u64);
        }
        Ok(())
    }

    fn set_access(&self, addr: u64, size: u64) -> Result<()> {
        let read_only = self.ro().1.range(addr..addr + size).next().is_some();
        let size = to_usize("size", size)?;
        let _cur = self.enter()?;
        let desc = if read_only { &self.read_access } else { &self.access };
        self.lib.mem_set_access(addr, size, desc)
    }

    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        let bytes = size;
        let size = to_usize("size", size)?;
        let _cur = self.enter()?;
        self.lib.mem_unmap(addr, size)?;
        let mut ro = self.ro();
        let gone: Vec<u64> = ro.1.range(addr..addr + bytes).map(|(&a, _)| a).collect();
        for a in gone {
            ro.1.remove(&a);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        let _cur = self.enter()?;
        self.lib.ctx_synchronize()
    }

    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _cur = self.enter()?;
        // Synchronous for pageable destinations: complete on return.
        self.lib.memcpy_dtoh(dst, addr)
    }

    fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _cur = self.enter()?;
        self.lib.memcpy_htod(addr, src)?;
        // A pageable upload may still be in flight from the staging buffer.
        self.lib.default_stream_synchronize()
    }

    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let len = to_usize("length", len)?;
        let _cur = self.enter()?;
        self.lib.memcpy_dtod(dst, src, len)?;
        // Device-to-device copies are asynchronous to the host.
        self.lib.default_stream_synchronize()
    }

    fn record_event(&self, stream: u64) -> Result<Option<u64>> {
        let _cur = self.enter()?;
        self.lib.event_record(stream).map(Some)
    }

    fn event_complete(&self, event: u64) -> Result<bool> {
        let _cur = self.enter()?;
        self.lib.event_query(event)
    }

    fn wait_event(&self, event: u64) -> Result<()> {
        let _cur = self.enter()?;
        self.lib.event_synchronize(event)
    }

    fn destroy_event(&self, event: u64) -> Result<()> {
        let _cur = self.enter()?;
        self.lib.event_destroy(event)
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return HostBuffer::pageable(0);
        }
        match PinnedHostMemory::new(&self.ctx, len) {
            Ok(pinned) => Ok(HostBuffer::new(Box::new(pinned))),
            // Page-locked memory is limited (it cannot be swapped); ordinary
            // memory serves the same copies, only slower.
            Err(Error::OutOfMemory(_)) => HostBuffer::pageable(len),
            Err(e) => Err(e),
        }
    }

    fn export_chunk(&self, chunk: ChunkHandle) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        if !self.live().contains(&chunk.0) {
            return Err(Error::invalid(format!("chunk handle {:#x} is not live", chunk.0)));
        }
        if !self.exportable {
            return Err(Error::Unsupported(
                "this driver's chunks are not exportable: open it with exportable chunks".into(),
            ));
        }
        let _cur = self.enter()?;
        let fd = self.lib.export_fd(chunk.0)?;
        // SAFETY: the driver just created this descriptor for the caller,
        // who owns it from here on.
        close_on_exec(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    fn import_chunk(&self, fd: std::os::fd::BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
        use std::os::fd::AsRawFd;
        let bytes = to_usize("size", size)?;
        let _cur = self.enter()?;
        let handle = self.lib.import_fd(fd.as_raw_fd()).map_err(|e| match e {
            Error::Driver { code, message, .. } if code == CUresult::CUDA_ERROR_INVALID_VALUE as i64 => {
                Error::invalid(format!("import: descriptor {} is not an exported chunk: {message}", fd.as_raw_fd()))
            }
            e => e,
        })?;
        if let Err(e) = self.check_import_size(handle, bytes) {
            let _ = self.lib.mem_release(handle);
            return Err(e);
        }
        self.live().insert(handle);
        if read_only {
            self.ro().0.insert(handle);
        }
        Ok(ChunkHandle(handle))
    }

    fn dmabuf_fd(&self, addr: u64, size: u64) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let size = to_usize("size", size)?;
        let _cur = self.enter()?;
        let fd = self.lib.range_dmabuf_fd(addr, size)?;
        // SAFETY: the driver just created this descriptor for the caller.
        close_on_exec(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}

/// Sets FD_CLOEXEC on a descriptor the driver made (the driver API has no
/// flag for it), so that a child started with fork+exec does not keep GPU
/// memory alive. A failure closes it. A fork+exec on another thread between
/// the driver's call and this one can still inherit it: the driver gives no
/// way to close that window.
#[cfg(unix)]
fn close_on_exec(fd: std::os::fd::OwnedFd) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor owned here; F_GETFD/F_SETFD touch only
    // its flags.
    let ok = unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFD);
        flags >= 0 && libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags | libc::FD_CLOEXEC) == 0
    };
    match ok {
        true => Ok(fd),
        false => {
            let code = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            Err(Error::Driver {
                call: "fcntl(F_SETFD, FD_CLOEXEC)",
                code: code as i64,
                name: format!("errno {code}"),
                message: std::io::Error::from_raw_os_error(code).to_string(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore)] // system calls
    fn new_is_unsupported_without_libcuda_and_never_panics() {
        let result = std::panic::catch_unwind(|| CudaDriver::new(0));
        let result = result.expect("CudaDriver::new panicked");
        // SAFETY: only tries to open the library, as `Lib::load` does.
        let present = unsafe { sys::is_culib_present() };
        if !present {
            match result {
                Err(Error::Unsupported(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
                other => panic!("expected Unsupported without libcuda, got {other:?}"),
            }
        } else if let Err(e) = result {
            // libcuda is here but the device may not be usable: any error
            // value is acceptable, a panic is not.
            eprintln!("CudaDriver::new(0) with libcuda present: {e}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore)] // system calls
    fn absent_devices_are_unsupported() {
        for ordinal in [-1, i32::MAX] {
            let r = std::panic::catch_unwind(|| CudaDriver::new(ordinal)).expect("new panicked");
            assert!(matches!(r, Err(Error::Unsupported(_))), "device {ordinal}: {r:?}");
        }
    }

    #[test]
    fn out_of_memory_maps_to_out_of_memory() {
        let e = error_from_parts(
            "cuMemCreate",
            CUresult::CUDA_ERROR_OUT_OF_MEMORY as Code,
            "CUDA_ERROR_OUT_OF_MEMORY".into(),
            "out of memory".into(),
        );
        match e {
            Error::OutOfMemory(msg) => {
                assert!(msg.contains("cuMemCreate"), "{msg}");
                assert!(msg.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_codes_map_to_driver_errors_with_call_code_name_and_text() {
        for (code, num) in [
            (CUresult::CUDA_ERROR_INVALID_VALUE as Code, 1),
            (CUresult::CUDA_ERROR_NOT_INITIALIZED as Code, 3),
            (CUresult::CUDA_ERROR_NOT_SUPPORTED as Code, 801),
            (CUresult::CUDA_ERROR_UNKNOWN as Code, 999),
            // Not a code cudarc's enum knows: still just a value here.
            (35, 35),
            (Code::MAX, i64::from(Code::MAX)),
        ] {
            let name = offline_name(code);
            let e = error_from_parts("cuMemMap", code, name.clone(), "text".into());
            assert_eq!(e, Error::Driver { call: "cuMemMap", code: num, name, message: "text".into() });
            assert_eq!(e.status(), crate::error::Status::Driver);
        }
    }

    #[test]
    fn offline_names_are_the_cuda_names() {
        assert_eq!(offline_name(SUCCESS), "CUDA_SUCCESS");
        assert_eq!(offline_name(1), "CUDA_ERROR_INVALID_VALUE");
        assert_eq!(offline_name(OUT_OF_MEMORY), "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(offline_name(201), "CUDA_ERROR_INVALID_CONTEXT");
        assert_eq!(offline_name(35), "CUresult 35");
    }

    #[test]
    fn cuda_driver_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CudaDriver>();
    }

    #[test]
    fn required_symbols_are_the_driver_names() {
        let unique: HashSet<_> = REQUIRED_SYMBOLS.iter().collect();
        assert_eq!(unique.len(), REQUIRED_SYMBOLS.len());
        assert!(REQUIRED_SYMBOLS.iter().all(|s| s.starts_with("cu")));
        for s in ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"] {
            assert!(REQUIRED_SYMBOLS.contains(&s), "{s}");
        }
    }

    #[test]
    fn access_descriptors_are_read_write_per_device() {
        let d = access_desc(5);
        assert_eq!(d.location.id, 5);
        assert_eq!(d.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(d.flags, sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }

    #[test]
    #[cfg_attr(miri, ignore)] // system calls
    fn peers_that_cannot_exist_are_unsupported() {
        for peers in [&[-1][..], &[i32::MAX], &[0]] {
            let r = std::panic::catch_unwind(|| CudaDriver::with_peer_access(0, peers)).expect("no panic");
            assert!(matches!(r, Err(Error::Unsupported(_))), "peers {peers:?}: {r:?}");
        }
    }

    #[test]
    fn allocation_prop_is_pinned_device_memory() {
        let p = allocation_prop(3, false);
        assert_eq!(p.type_, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        assert_eq!(p.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(p.location.id, 3);
        assert_eq!(p.requestedHandleTypes, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
        let p = allocation_prop(3, true);
        assert_eq!(p.requestedHandleTypes, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    }
}
