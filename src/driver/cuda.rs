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
//! the private `Lib` methods below, into a small function that returns
//! [`Result`]; nothing else in this file sees a raw result code. cudarc finds
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
//! primary context). If the calling thread had another (non-primary) context
//! current, it is restored when the method returns.
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
//! [`Driver::dmabuf_fd`] is `cuMemGetHandleForAddressRange`. These paths are
//! built and unit-tested here but were not run on a GPU by the tests of this
//! repository's host-only CI.
//!
//! Chunk handles are tracked: releasing a handle twice, or mapping a handle
//! that was released, is an [`Error::InvalidArgument`] here rather than a call
//! into the driver with a value that may by then name someone else's chunk
//! (trap 4).
#![allow(unsafe_code)]

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use crate::driver::{ChunkHandle, Driver, Granularity, HostBuffer, HostMemory};
use crate::error::{Error, Result};

/// A driver result code as the driver returns it (`CUresult`), unconverted.
type Code = c_uint;

const SUCCESS: Code = CUresult::CUDA_SUCCESS as Code;
const OUT_OF_MEMORY: Code = CUresult::CUDA_ERROR_OUT_OF_MEMORY as Code;
const NOT_READY: Code = CUresult::CUDA_ERROR_NOT_READY as Code;

/// Declares `Api`, the table of driver functions, and `REQUIRED_SYMBOLS`.
/// Field names are the exported symbol names (the versioned `_v2` ones where
/// the driver has them, as cudarc loads them).
macro_rules! driver_api {
    ($($name:ident: fn($($arg:ty),* $(,)?);)*) => {
        /// libcuda's functions used here, resolved once from cudarc's handle
        /// to the library, which lives as long as the process.
        #[allow(non_snake_case)]
        struct Api {
            $($name: unsafe extern "C" fn($($arg),*) -> Code,)*
        }

        /// Every libcuda symbol this backend calls (checked by a test).
        #[cfg(test)]
        const REQUIRED_SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl Api {
            /// Resolves every function, or names the first missing one.
            ///
            /// # Safety
            ///
            /// Opens libcuda through cudarc: the library must be present
            /// (`sys::is_culib_present()` returned true), or cudarc panics.
            /// Each declared signature must match the driver's C prototype
            /// (they are copied from cudarc's bindings for CUDA 12.8, with the
            /// result as a plain integer).
            unsafe fn resolve() -> std::result::Result<Api, &'static str> {
                // SAFETY: the caller guarantees the library is present;
                // `culib` keeps it open for the life of the process.
                let lib = unsafe { sys::culib() };
                Ok(Api {
                    $($name: {
                        let name = concat!(stringify!($name), "\0");
                        // SAFETY: the symbol's type is the driver's prototype
                        // (caller's guarantee); the pointer is copied out of
                        // the `Symbol` and stays valid because the library is
                        // never closed.
                        let sym = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> Code>(name.as_bytes()) };
                        *sym.map_err(|_| stringify!($name))?
                    },)*
                })
            }
        }
    };
}

driver_api! {
    cuGetErrorName: fn(Code, *mut *const c_char);
    cuGetErrorString: fn(Code, *mut *const c_char);
    cuInit: fn(c_uint);
    cuDriverGetVersion: fn(*mut c_int);
    cuDeviceGetCount: fn(*mut c_int);
    cuDeviceGet: fn(*mut sys::CUdevice, c_int);
    cuDeviceGetName: fn(*mut c_char, c_int, sys::CUdevice);
    cuDeviceGetAttribute: fn(*mut c_int, sys::CUdevice_attribute, sys::CUdevice);
    cuDeviceTotalMem_v2: fn(*mut usize, sys::CUdevice);
    cuDeviceCanAccessPeer: fn(*mut c_int, sys::CUdevice, sys::CUdevice);
    cuDevicePrimaryCtxRetain: fn(*mut sys::CUcontext, sys::CUdevice);
    cuDevicePrimaryCtxRelease_v2: fn(sys::CUdevice);
    cuCtxGetCurrent: fn(*mut sys::CUcontext);
    cuCtxSetCurrent: fn(sys::CUcontext);
    cuCtxSynchronize: fn();
    cuStreamSynchronize: fn(sys::CUstream);
    cuMemGetAllocationGranularity: fn(
        *mut usize,
        *const sys::CUmemAllocationProp,
        sys::CUmemAllocationGranularity_flags,
    );
    cuMemAddressReserve: fn(*mut sys::CUdeviceptr, usize, usize, sys::CUdeviceptr, u64);
    cuMemAddressFree: fn(sys::CUdeviceptr, usize);
    cuMemCreate: fn(
        *mut sys::CUmemGenericAllocationHandle,
        usize,
        *const sys::CUmemAllocationProp,
        u64,
    );
    cuMemRelease: fn(sys::CUmemGenericAllocationHandle);
    cuMemMap: fn(sys::CUdeviceptr, usize, usize, sys::CUmemGenericAllocationHandle, u64);
    cuMemSetAccess: fn(sys::CUdeviceptr, usize, *const sys::CUmemAccessDesc, usize);
    cuMemUnmap: fn(sys::CUdeviceptr, usize);
    cuMemcpyDtoH_v2: fn(*mut c_void, sys::CUdeviceptr, usize);
    cuMemcpyHtoD_v2: fn(sys::CUdeviceptr, *const c_void, usize);
    cuMemcpyDtoD_v2: fn(sys::CUdeviceptr, sys::CUdeviceptr, usize);
    cuMemsetD32_v2: fn(sys::CUdeviceptr, c_uint, usize);
    cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint);
    cuMemFreeHost: fn(*mut c_void);
    cuEventCreate: fn(*mut sys::CUevent, c_uint);
    cuEventRecord: fn(sys::CUevent, sys::CUstream);
    cuEventQuery: fn(sys::CUevent);
    cuEventSynchronize: fn(sys::CUevent);
    cuEventDestroy_v2: fn(sys::CUevent);
    cuMemExportToShareableHandle: fn(
        *mut c_void,
        sys::CUmemGenericAllocationHandle,
        sys::CUmemAllocationHandleType,
        u64,
    );
    cuMemImportFromShareableHandle: fn(
        *mut sys::CUmemGenericAllocationHandle,
        *mut c_void,
        sys::CUmemAllocationHandleType,
    );
    cuMemGetHandleForAddressRange: fn(*mut c_void, sys::CUdeviceptr, usize, sys::CUmemRangeHandleType, u64);
}

/// The resolved table, or the name of the missing symbol.
static API: OnceLock<std::result::Result<Api, &'static str>> = OnceLock::new();

/// Builds the crate error for a failed driver call (pure: no driver call).
///
/// `CUDA_ERROR_OUT_OF_MEMORY` becomes [`Error::OutOfMemory`]; every other
/// code becomes [`Error::Driver`] carrying the call, the numeric code, and the
/// driver's name and text for it.
fn error_from_parts(call: &'static str, code: Code, name: String, message: String) -> Error {
    if code == OUT_OF_MEMORY {
        Error::OutOfMemory(format!("{call} failed with {name}: {message}"))
    } else {
        Error::Driver { call, code: i64::from(code), name, message }
    }
}

/// The symbolic name of a code without asking the driver, for the codes this
/// backend is likely to meet; others get a numeric name.
fn offline_name(code: Code) -> String {
    use CUresult as R;
    const KNOWN: &[CUresult] = &[
        R::CUDA_SUCCESS,
        R::CUDA_ERROR_INVALID_VALUE,
        R::CUDA_ERROR_OUT_OF_MEMORY,
        R::CUDA_ERROR_NOT_INITIALIZED,
        R::CUDA_ERROR_DEINITIALIZED,
        R::CUDA_ERROR_STUB_LIBRARY,
        R::CUDA_ERROR_NO_DEVICE,
        R::CUDA_ERROR_INVALID_DEVICE,
        R::CUDA_ERROR_INVALID_CONTEXT,
        R::CUDA_ERROR_ALREADY_MAPPED,
        R::CUDA_ERROR_NOT_MAPPED,
        R::CUDA_ERROR_ECC_UNCORRECTABLE,
        R::CUDA_ERROR_OPERATING_SYSTEM,
        R::CUDA_ERROR_INVALID_HANDLE,
        R::CUDA_ERROR_ILLEGAL_ADDRESS,
        R::CUDA_ERROR_LAUNCH_FAILED,
        R::CUDA_ERROR_NOT_PERMITTED,
        R::CUDA_ERROR_NOT_SUPPORTED,
        R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
        R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
        R::CUDA_ERROR_UNKNOWN,
    ];
    match KNOWN.iter().find(|&&k| k as Code == code) {
        Some(k) => format!("{k:?}"),
        None => format!("CUresult {code}"),
    }
}

fn to_usize(what: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid(format!("{what} {v} does not fit in usize")))
}

/// Proof that libcuda is loaded and every function in [`Api`] resolved: only
/// [`Lib::load`] makes one. Its methods are the raw layer, one call each.
#[derive(Clone, Copy)]
struct Lib {
    api: &'static Api,
}

impl std::fmt::Debug for Lib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lib(libcuda)")
    }
}

impl Lib {
    /// Finds libcuda and resolves every required symbol, without panicking.
    fn load() -> Result<Lib> {
        if let Some(Ok(api)) = API.get() {
            return Ok(Lib { api });
        }
        // SAFETY: `is_culib_present` only tries to open the shared library
        // (dlopen), which runs the library's initialisers; libcuda is the
        // system's driver library and cudarc opens it the same way.
        let present = unsafe { sys::is_culib_present() };
        if !present {
            return Err(Error::Unsupported(
                "libcuda not found (no NVIDIA driver on this machine, or not on the loader path)".into(),
            ));
        }
        // SAFETY: the library is present (checked just above), and the
        // signatures in `driver_api!` are the driver's prototypes.
        match API.get_or_init(|| unsafe { Api::resolve() }) {
            Ok(api) => Ok(Lib { api }),
            Err(name) => {
                Err(Error::Unsupported(format!("libcuda does not export {name} (driver too old for this backend)")))
            }
        }
    }

    /// Turns a result code into `Ok` or the crate error, with the driver's
    /// name and text for the code.
    fn check(self, call: &'static str, code: Code) -> Result<()> {
        if code == SUCCESS {
            return Ok(());
        }
        let (name, message) = self.describe(code);
        Err(error_from_parts(call, code, name, message))
    }

    /// `cuGetErrorName` and `cuGetErrorString`, with fallbacks when the
    /// driver does not know the code.
    fn describe(self, code: Code) -> (String, String) {
        let mut name_ptr: *const c_char = std::ptr::null();
        let mut text_ptr: *const c_char = std::ptr::null();
        // SAFETY: resolved functions with their prototypes (`self`); the
        // out-pointers are valid locals. On success the driver stores
        // pointers to static, NUL-terminated strings, read only when non-null.
        let (name_ok, text_ok) = unsafe {
            (
                (self.api.cuGetErrorName)(code, &mut name_ptr) == SUCCESS,
                (self.api.cuGetErrorString)(code, &mut text_ptr) == SUCCESS,
            )
        };
        let read = |ok: bool, ptr: *const c_char| {
            // SAFETY: see above: a non-null pointer from a successful call
            // points to a static C string owned by the driver.
            (ok && !ptr.is_null()).then(|| unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
        };
        let name = read(name_ok, name_ptr).unwrap_or_else(|| offline_name(code));
        let message = read(text_ok, text_ptr).unwrap_or_else(|| "no description".into());
        (name, message)
    }

    fn init(self) -> Result<()> {
        // SAFETY: resolved function (`self`); flags must be 0, and are.
        self.check("cuInit", unsafe { (self.api.cuInit)(0) })
    }

    fn driver_version(self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDriverGetVersion", unsafe { (self.api.cuDriverGetVersion)(&mut v) })?;
        Ok(v)
    }

    fn device_count(self) -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDeviceGetCount", unsafe { (self.api.cuDeviceGetCount)(&mut n) })?;
        Ok(n)
    }

    fn device_get(self, ordinal: i32) -> Result<sys::CUdevice> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; the
        // driver validates the ordinal.
        self.check("cuDeviceGet", unsafe { (self.api.cuDeviceGet)(&mut dev, ordinal) })?;
        Ok(dev)
    }

    fn device_name(self, dev: sys::CUdevice) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: resolved function; the driver writes at most `len` bytes,
        // NUL-terminated, into `buf`, which holds 256.
        self.check("cuDeviceGetName", unsafe {
            (self.api.cuDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` is NUL-terminated (forced just above) and outlives
        // the borrow.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    fn device_attribute(self, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDeviceGetAttribute", unsafe { (self.api.cuDeviceGetAttribute)(&mut v, attr, dev) })?;
        Ok(v)
    }

    fn device_total_mem(self, dev: sys::CUdevice) -> Result<u64> {
        let mut bytes: usize = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDeviceTotalMem", unsafe { (self.api.cuDeviceTotalMem_v2)(&mut bytes, dev) })?;
        Ok(bytes as u64)
    }

    fn can_access_peer(self, dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
        let mut v: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; the
        // driver validates both device handles.
        self.check("cuDeviceCanAccessPeer", unsafe { (self.api.cuDeviceCanAccessPeer)(&mut v, dev, peer) })?;
        Ok(v != 0)
    }

    fn primary_ctx_retain(self, dev: sys::CUdevice) -> Result<sys::CUcontext> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.api.cuDevicePrimaryCtxRetain)(&mut ctx, dev) })?;
        Ok(ctx)
    }

    fn primary_ctx_release(self, dev: sys::CUdevice) -> Result<()> {
        // SAFETY: resolved function; the caller balances one earlier retain.
        self.check("cuDevicePrimaryCtxRelease", unsafe { (self.api.cuDevicePrimaryCtxRelease_v2)(dev) })
    }

    fn ctx_get_current(self) -> Result<sys::CUcontext> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuCtxGetCurrent", unsafe { (self.api.cuCtxGetCurrent)(&mut ctx) })?;
        Ok(ctx)
    }

    fn ctx_set_current(self, ctx: sys::CUcontext) -> Result<()> {
        // SAFETY: resolved function; `ctx` is a context handle obtained from
        // the driver and still retained by its owner (or null, which unsets).
        self.check("cuCtxSetCurrent", unsafe { (self.api.cuCtxSetCurrent)(ctx) })
    }

    fn ctx_synchronize(self) -> Result<()> {
        // SAFETY: resolved function; acts on the current context.
        self.check("cuCtxSynchronize", unsafe { (self.api.cuCtxSynchronize)() })
    }

    fn default_stream_synchronize(self) -> Result<()> {
        // SAFETY: resolved function; the null stream is the current context's
        // legacy default stream, always valid.
        self.check("cuStreamSynchronize", unsafe { (self.api.cuStreamSynchronize)(std::ptr::null_mut()) })
    }

    fn granularity(
        self,
        prop: &sys::CUmemAllocationProp,
        option: sys::CUmemAllocationGranularity_flags,
    ) -> Result<u64> {
        let mut g: usize = 0;
        // SAFETY: resolved function; `prop` is a valid, fully initialised
        // property struct and the out-pointer a valid local.
        self.check("cuMemGetAllocationGranularity", unsafe {
            (self.api.cuMemGetAllocationGranularity)(&mut g, prop, option)
        })?;
        Ok(g as u64)
    }

    fn address_reserve(self, size: usize, align: usize) -> Result<u64> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; no
        // fixed address is requested (0) and flags are 0. Reserving touches
        // no host memory.
        self.check("cuMemAddressReserve", unsafe { (self.api.cuMemAddressReserve)(&mut ptr, size, align, 0, 0) })?;
        Ok(ptr)
    }

    fn address_free(self, ptr: u64, size: usize) -> Result<()> {
        // SAFETY: resolved function; plain integers, validated by the driver;
        // the range is device virtual address space, never host memory.
        self.check("cuMemAddressFree", unsafe { (self.api.cuMemAddressFree)(ptr, size) })
    }

    fn mem_create(self, size: usize, prop: &sys::CUmemAllocationProp) -> Result<u64> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: resolved function; `prop` is a valid property struct, the
        // out-pointer a valid local, flags 0.
        self.check("cuMemCreate", unsafe { (self.api.cuMemCreate)(&mut handle, size, prop, 0) })?;
        Ok(handle)
    }

    fn mem_release(self, handle: u64) -> Result<()> {
        // SAFETY: resolved function; the caller passes a live handle exactly
        // once (tracked by `CudaDriver`).
        self.check("cuMemRelease", unsafe { (self.api.cuMemRelease)(handle) })
    }

    fn mem_map(self, ptr: u64, size: usize, offset: usize, handle: u64) -> Result<()> {
        // SAFETY: resolved function; the caller passes a live handle;
        // address, size and offset are validated by the driver; device
        // virtual address space only, flags 0.
        self.check("cuMemMap", unsafe { (self.api.cuMemMap)(ptr, size, offset, handle, 0) })
    }

    fn mem_set_access(self, ptr: u64, size: usize, desc: &[sys::CUmemAccessDesc]) -> Result<()> {
        // SAFETY: resolved function; `desc` points to `desc.len()` valid
        // descriptors, borrowed for the call, and the count says so.
        self.check("cuMemSetAccess", unsafe { (self.api.cuMemSetAccess)(ptr, size, desc.as_ptr(), desc.len()) })
    }

    fn mem_unmap(self, ptr: u64, size: usize) -> Result<()> {
        // SAFETY: resolved function; plain integers, validated by the driver.
        // Device work still using the range is the caller's to wait for.
        self.check("cuMemUnmap", unsafe { (self.api.cuMemUnmap)(ptr, size) })
    }

    fn memcpy_dtoh(self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: resolved function; `dst` is a writable host buffer of
        // exactly `dst.len()` bytes, borrowed for the call; a device-to-host
        // copy into pageable or pinned memory returns only once the copy has
        // completed, so the driver never writes to it after the borrow ends.
        self.check("cuMemcpyDtoH", unsafe {
            (self.api.cuMemcpyDtoH_v2)(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
        })
    }

    fn memcpy_htod(self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: resolved function; `src` is a readable host buffer of
        // exactly `src.len()` bytes, borrowed for the call; the driver has
        // finished reading it (staged or copied) when the call returns.
        self.check("cuMemcpyHtoD", unsafe { (self.api.cuMemcpyHtoD_v2)(dst, src.as_ptr().cast::<c_void>(), src.len()) })
    }

    fn memcpy_dtod(self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: resolved function; device addresses only, validated by the
        // driver; no host memory is involved.
        self.check("cuMemcpyDtoD", unsafe { (self.api.cuMemcpyDtoD_v2)(dst, src, len) })
    }

    fn event_record(self, stream: u64) -> Result<u64> {
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: resolved function; `ev` is a valid out-pointer.
        self.check("cuEventCreate", unsafe {
            (self.api.cuEventCreate)(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint)
        })?;
        // SAFETY: `ev` was just created; the stream handle is the caller's
        // (a CUstream of this context, or 0), validated by the driver.
        let recorded = self.check("cuEventRecord", unsafe { (self.api.cuEventRecord)(ev, stream as sys::CUstream) });
        if let Err(e) = recorded {
            // SAFETY: `ev` is a live event that nothing else refers to.
            let _ = unsafe { (self.api.cuEventDestroy_v2)(ev) };
            return Err(e);
        }
        Ok(ev as u64)
    }

    fn event_query(self, ev: u64) -> Result<bool> {
        // SAFETY: `ev` came from `event_record` and is not destroyed yet
        // (the caller owns it until `event_destroy`).
        match unsafe { (self.api.cuEventQuery)(ev as sys::CUevent) } {
            SUCCESS => Ok(true),
            NOT_READY => Ok(false),
            code => self.check("cuEventQuery", code).map(|_| false),
        }
    }

    fn event_synchronize(self, ev: u64) -> Result<()> {
        // SAFETY: as in `event_query`: a live event from `event_record`.
        self.check("cuEventSynchronize", unsafe { (self.api.cuEventSynchronize)(ev as sys::CUevent) })
    }

    fn event_destroy(self, ev: u64) -> Result<()> {
        // SAFETY: as in `event_query`; destroyed once by its owner.
        self.check("cuEventDestroy", unsafe { (self.api.cuEventDestroy_v2)(ev as sys::CUevent) })
    }

    fn export_fd(self, handle: u64) -> Result<c_int> {
        let mut fd: c_int = -1;
        // SAFETY: resolved function; for the POSIX file-descriptor type the
        // driver writes one `int` through the pointer, a valid local; the
        // handle is live (tracked by `CudaDriver`), flags 0.
        self.check("cuMemExportToShareableHandle", unsafe {
            (self.api.cuMemExportToShareableHandle)(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(fd)
    }

    fn import_fd(self, fd: c_int) -> Result<u64> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; for
        // the POSIX file-descriptor type the driver takes the descriptor's
        // value in the pointer argument (it is never dereferenced) and does
        // not take ownership of it.
        self.check("cuMemImportFromShareableHandle", unsafe {
            (self.api.cuMemImportFromShareableHandle)(
                &mut handle,
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(handle)
    }

    fn range_dmabuf_fd(self, ptr: u64, size: usize) -> Result<c_int> {
        let mut fd: c_int = -1;
        // SAFETY: resolved function; for the DMA-BUF type the driver writes
        // one `int` through the pointer, a valid local; the range is device
        // virtual address space, validated by the driver; flags 0.
        self.check("cuMemGetHandleForAddressRange", unsafe {
            (self.api.cuMemGetHandleForAddressRange)(
                (&mut fd as *mut c_int).cast::<c_void>(),
                ptr,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        Ok(fd)
    }

    fn memset_d32(self, dst: u64, value: u32, count: usize) -> Result<()> {
        // SAFETY: resolved function; device address only, validated by the
        // driver; no host memory is involved.
        self.check("cuMemsetD32", unsafe { (self.api.cuMemsetD32_v2)(dst, value, count) })
    }

    /// `len` (> 0) bytes of page-locked host memory, owned by the current
    /// context, uninitialised.
    fn mem_host_alloc(self, len: usize) -> Result<NonNull<u8>> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: resolved function; the out-pointer is a valid local; flags
        // 0 (memory for the current context, no device mapping requested).
        self.check("cuMemHostAlloc", unsafe { (self.api.cuMemHostAlloc)(&mut ptr, len, 0) })?;
        NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::OutOfMemory("cuMemHostAlloc returned null".into()))
    }

    /// Frees memory from [`Lib::mem_host_alloc`]; its context must be current.
    fn mem_free_host(self, ptr: NonNull<u8>) -> Result<()> {
        // SAFETY: resolved function; the caller passes a pointer from
        // `cuMemHostAlloc` exactly once, with its context current and alive.
        self.check("cuMemFreeHost", unsafe { (self.api.cuMemFreeHost)(ptr.as_ptr().cast::<c_void>()) })
    }
}

/// Restores the calling thread's previous context, if it was another one.
struct CurrentCtx {
    lib: Lib,
    restore: Option<sys::CUcontext>,
}

impl Drop for CurrentCtx {
    fn drop(&mut self) {
        if let Some(prev) = self.restore.take() {
            // Best effort: failing to restore a foreign context must not
            // turn a finished call into an error, and Drop must not panic.
            let _ = self.lib.ctx_set_current(prev);
        }
    }
}

/// The device's primary context, retained once; released when the last
/// owner (the driver, or a pinned host buffer) drops it.
#[derive(Debug)]
struct PrimaryContext {
    lib: Lib,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a context handle may be made current and used on any thread (the
// driver API is thread-safe); `PrimaryContext` only passes it to the driver.
unsafe impl Send for PrimaryContext {}
// SAFETY: as for `Send`: shared access only reads the plain fields.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// Makes the context current on this thread until the guard drops.
    fn enter(&self) -> Result<CurrentCtx> {
        let prev = self.lib.ctx_get_current()?;
        if prev == self.ctx {
            return Ok(CurrentCtx { lib: self.lib, restore: None });
        }
        self.lib.ctx_set_current(self.ctx)?;
        // A thread with no context keeps ours (what the runtime API would
        // make current anyway); a thread with another context gets it back.
        let restore = (!prev.is_null()).then_some(prev);
        Ok(CurrentCtx { lib: self.lib, restore })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        let lib = self.lib;
        let device = self.device;
        // Best effort and never a panic: the release symbol was resolved by
        // `Lib::load`, and the guard catches anything unforeseen.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _ = lib.primary_ctx_release(device);
        }));
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, zeroed when made, freed
/// with `cuMemFreeHost` on drop. It holds the context it belongs to, so the
/// memory stays valid as long as the buffer, whether or not the driver does.
#[derive(Debug)]
struct PinnedHostMemory {
    ctx: Arc<PrimaryContext>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer exclusively owns `len` bytes of host memory at `ptr`
// (like a `Box<[u8]>`); host memory may be used and freed from any thread,
// and the context it holds is `Send + Sync`.
unsafe impl Send for PinnedHostMemory {}
// SAFETY: shared access only reads the bytes (`bytes`); writing needs
// `&mut self`.
unsafe impl Sync for PinnedHostMemory {}

impl PinnedHostMemory {
    /// `len` (> 0) zeroed bytes of pinned memory owned by `ctx`.
    fn new(ctx: &Arc<PrimaryContext>, len: usize) -> Result<PinnedHostMemory> {
        let ptr = {
            let _cur = ctx.enter()?;
            ctx.lib.mem_host_alloc(len)?
        };
        // SAFETY: `ptr` points to `len` writable bytes just allocated for
        // this buffer alone; zeroing makes every byte initialised, as
        // `bytes` requires.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedHostMemory { ctx: Arc::clone(ctx), ptr, len })
    }
}

impl HostMemory for PinnedHostMemory {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes (zeroed in `new`)
        // owned by `self` until `Drop`; the borrow of `self` bounds the slice.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn pinned(&self) -> bool {
        true
    }
}

impl Drop for PinnedHostMemory {
    fn drop(&mut self) {
        let (ctx, ptr) = (&self.ctx, self.ptr);
        // Best effort and never a panic. The context is alive (held by
        // `self.ctx`) and made current for the free, as cuMemFreeHost wants.
        // Should it fail, the memory goes when the context is destroyed.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            if let Ok(_cur) = ctx.enter() {
                let _ = ctx.lib.mem_free_host(ptr);
            }
        }));
    }
}

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
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    fn import_chunk(&self, fd: std::os::fd::BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
        use std::os::fd::AsRawFd;
        let _ = size; // cuMemMap checks the size against the chunk's own.
        let _cur = self.enter()?;
        let handle = self.lib.import_fd(fd.as_raw_fd()).map_err(|e| match e {
            Error::Driver { code, message, .. } if code == CUresult::CUDA_ERROR_INVALID_VALUE as i64 => {
                Error::invalid(format!("import: descriptor {} is not an exported chunk: {message}", fd.as_raw_fd()))
            }
            e => e,
        })?;
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
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
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
