//! The raw layer: libcuda's functions resolved once into a table (`Api`),
//! and `Lib`, whose methods wrap each raw call exactly once into a
//! function that returns [`Result`]; the error mapping of result codes.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::NonNull;
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

use crate::error::{Error, Result};
/// A driver result code as the driver returns it (`CUresult`), unconverted.
pub(super) type Code = c_uint;

pub(super) const SUCCESS: Code = CUresult::CUDA_SUCCESS as Code;
pub(super) const OUT_OF_MEMORY: Code = CUresult::CUDA_ERROR_OUT_OF_MEMORY as Code;
pub(super) const NOT_READY: Code = CUresult::CUDA_ERROR_NOT_READY as Code;

/// Declares `Api`, the table of driver functions, and `REQUIRED_SYMBOLS`.
/// Field names are the exported symbol names (the versioned `_v2` ones where
/// the driver has them, as cudarc loads them).
macro_rules! driver_api {
    ($($name:ident: fn($($arg:ty),* $(,)?);)*) => {
        /// libcuda's functions used here, resolved once from cudarc's handle
        /// to the library, which lives as long as the process.
        #[allow(non_snake_case)]
        pub(super) struct Api {
            $($name: unsafe extern "C" fn($($arg),*) -> Code,)*
        }

        /// Every libcuda symbol this backend calls (checked by a test).
        #[cfg(test)]
        pub(super) const REQUIRED_SYMBOLS: &[&str] = &[$(stringify!($name)),*];

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
            pub(super) unsafe fn resolve() -> std::result::Result<Api, &'static str> {
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
pub(super) static API: OnceLock<std::result::Result<Api, &'static str>> = OnceLock::new();

/// Builds the crate error for a failed driver call (pure: no driver call).
///
/// `CUDA_ERROR_OUT_OF_MEMORY` becomes [`Error::OutOfMemory`]; every other
/// code becomes [`Error::Driver`] carrying the call, the numeric code, and the
/// driver's name and text for it.
pub(super) fn error_from_parts(call: &'static str, code: Code, name: String, message: String) -> Error {
    if code == OUT_OF_MEMORY {
        Error::OutOfMemory(format!("{call} failed with {name}: {message}"))
    } else {
        Error::Driver { call, code: i64::from(code), name, message }
    }
}

/// The symbolic name of a code without asking the driver, for the codes this
/// backend is likely to meet; others get a numeric name.
pub(super) fn offline_name(code: Code) -> String {
    use CUresult as R;
    pub(super) const KNOWN: &[CUresult] = &[
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

pub(super) fn to_usize(what: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid(format!("{what} {v} does not fit in usize")))
}

/// Proof that libcuda is loaded and every function in [`Api`] resolved: only
/// [`Lib::load`] makes one. Its methods are the raw layer, one call each.
#[derive(Clone, Copy)]
pub(super) struct Lib {
    api: &'static Api,
}

impl std::fmt::Debug for Lib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lib(libcuda)")
    }
}

impl Lib {
    /// Finds libcuda and resolves every required symbol, without panicking.
    pub(super) fn load() -> Result<Lib> {
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
    pub(super) fn check(self, call: &'static str, code: Code) -> Result<()> {
        if code == SUCCESS {
            return Ok(());
        }
        let (name, message) = self.describe(code);
        Err(error_from_parts(call, code, name, message))
    }

    /// `cuGetErrorName` and `cuGetErrorString`, with fallbacks when the
    /// driver does not know the code.
    pub(super) fn describe(self, code: Code) -> (String, String) {
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

    pub(super) fn init(self) -> Result<()> {
        // SAFETY: resolved function (`self`); flags must be 0, and are.
        self.check("cuInit", unsafe { (self.api.cuInit)(0) })
    }

    pub(super) fn driver_version(self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDriverGetVersion", unsafe { (self.api.cuDriverGetVersion)(&mut v) })?;
        Ok(v)
    }

    pub(super) fn device_count(self) -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDeviceGetCount", unsafe { (self.api.cuDeviceGetCount)(&mut n) })?;
        Ok(n)
    }

    pub(super) fn device_get(self, ordinal: i32) -> Result<sys::CUdevice> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; the
        // driver validates the ordinal.
        self.check("cuDeviceGet", unsafe { (self.api.cuDeviceGet)(&mut dev, ordinal) })?;
        Ok(dev)
    }

    pub(super) fn device_name(self, dev: sys::CUdevice) -> Result<String> {
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

    pub(super) fn device_attribute(self, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDeviceGetAttribute", unsafe { (self.api.cuDeviceGetAttribute)(&mut v, attr, dev) })?;
        Ok(v)
    }

    pub(super) fn device_total_mem(self, dev: sys::CUdevice) -> Result<u64> {
        let mut bytes: usize = 0;
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDeviceTotalMem", unsafe { (self.api.cuDeviceTotalMem_v2)(&mut bytes, dev) })?;
        Ok(bytes as u64)
    }

    pub(super) fn can_access_peer(self, dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
        let mut v: c_int = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; the
        // driver validates both device handles.
        self.check("cuDeviceCanAccessPeer", unsafe { (self.api.cuDeviceCanAccessPeer)(&mut v, dev, peer) })?;
        Ok(v != 0)
    }

    pub(super) fn primary_ctx_retain(self, dev: sys::CUdevice) -> Result<sys::CUcontext> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.api.cuDevicePrimaryCtxRetain)(&mut ctx, dev) })?;
        Ok(ctx)
    }

    pub(super) fn primary_ctx_release(self, dev: sys::CUdevice) -> Result<()> {
        // SAFETY: resolved function; the caller balances one earlier retain.
        self.check("cuDevicePrimaryCtxRelease", unsafe { (self.api.cuDevicePrimaryCtxRelease_v2)(dev) })
    }

    pub(super) fn ctx_get_current(self) -> Result<sys::CUcontext> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: resolved function; the out-pointer is a valid local.
        self.check("cuCtxGetCurrent", unsafe { (self.api.cuCtxGetCurrent)(&mut ctx) })?;
        Ok(ctx)
    }

    pub(super) fn ctx_set_current(self, ctx: sys::CUcontext) -> Result<()> {
        // SAFETY: resolved function; `ctx` is a context handle obtained from
        // the driver and still retained by its owner (or null, which unsets).
        self.check("cuCtxSetCurrent", unsafe { (self.api.cuCtxSetCurrent)(ctx) })
    }

    pub(super) fn ctx_synchronize(self) -> Result<()> {
        // SAFETY: resolved function; acts on the current context.
        self.check("cuCtxSynchronize", unsafe { (self.api.cuCtxSynchronize)() })
    }

    pub(super) fn default_stream_synchronize(self) -> Result<()> {
        // SAFETY: resolved function; the null stream is the current context's
        // legacy default stream, always valid.
        self.check("cuStreamSynchronize", unsafe { (self.api.cuStreamSynchronize)(std::ptr::null_mut()) })
    }

    pub(super) fn granularity(
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

    pub(super) fn address_reserve(self, size: usize, align: usize) -> Result<u64> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: resolved function; the out-pointer is a valid local; no
        // fixed address is requested (0) and flags are 0. Reserving touches
        // no host memory.
        self.check("cuMemAddressReserve", unsafe { (self.api.cuMemAddressReserve)(&mut ptr, size, align, 0, 0) })?;
        Ok(ptr)
    }

    pub(super) fn address_free(self, ptr: u64, size: usize) -> Result<()> {
        // SAFETY: resolved function; plain integers, validated by the driver;
        // the range is device virtual address space, never host memory.
        self.check("cuMemAddressFree", unsafe { (self.api.cuMemAddressFree)(ptr, size) })
    }

    pub(super) fn mem_create(self, size: usize, prop: &sys::CUmemAllocationProp) -> Result<u64> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: resolved function; `prop` is a valid property struct, the
        // out-pointer a valid local, flags 0.
        self.check("cuMemCreate", unsafe { (self.api.cuMemCreate)(&mut handle, size, prop, 0) })?;
        Ok(handle)
    }

    pub(super) fn mem_release(self, handle: u64) -> Result<()> {
        // SAFETY: resolved function; the caller passes a live handle exactly
        // once (tracked by `CudaDriver`).
        self.check("cuMemRelease", unsafe { (self.api.cuMemRelease)(handle) })
    }

    pub(super) fn mem_map(self, ptr: u64, size: usize, offset: usize, handle: u64) -> Result<()> {
        // SAFETY: resolved function; the caller passes a live handle;
        // address, size and offset are validated by the driver; device
        // virtual address space only, flags 0.
        self.check("cuMemMap", unsafe { (self.api.cuMemMap)(ptr, size, offset, handle, 0) })
    }

    pub(super) fn mem_set_access(self, ptr: u64, size: usize, desc: &[sys::CUmemAccessDesc]) -> Result<()> {
        // SAFETY: resolved function; `desc` points to `desc.len()` valid
        // descriptors, borrowed for the call, and the count says so.
        self.check("cuMemSetAccess", unsafe { (self.api.cuMemSetAccess)(ptr, size, desc.as_ptr(), desc.len()) })
    }

    pub(super) fn mem_unmap(self, ptr: u64, size: usize) -> Result<()> {
        // SAFETY: resolved function; plain integers, validated by the driver.
        // Device work still using the range is the caller's to wait for.
        self.check("cuMemUnmap", unsafe { (self.api.cuMemUnmap)(ptr, size) })
    }

    pub(super) fn memcpy_dtoh(self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: resolved function; `dst` is a writable host buffer of
        // exactly `dst.len()` bytes, borrowed for the call; a device-to-host
        // copy into pageable or pinned memory returns only once the copy has
        // completed, so the driver never writes to it after the borrow ends.
        self.check("cuMemcpyDtoH", unsafe {
            (self.api.cuMemcpyDtoH_v2)(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
        })
    }

    pub(super) fn memcpy_htod(self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: resolved function; `src` is a readable host buffer of
        // exactly `src.len()` bytes, borrowed for the call; the driver has
        // finished reading it (staged or copied) when the call returns.
        self.check("cuMemcpyHtoD", unsafe { (self.api.cuMemcpyHtoD_v2)(dst, src.as_ptr().cast::<c_void>(), src.len()) })
    }

    pub(super) fn memcpy_dtod(self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: resolved function; device addresses only, validated by the
        // driver; no host memory is involved.
        self.check("cuMemcpyDtoD", unsafe { (self.api.cuMemcpyDtoD_v2)(dst, src, len) })
    }

    pub(super) fn event_record(self, stream: u64) -> Result<u64> {
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

    pub(super) fn event_query(self, ev: u64) -> Result<bool> {
        // SAFETY: `ev` came from `event_record` and is not destroyed yet
        // (the caller owns it until `event_destroy`).
        match unsafe { (self.api.cuEventQuery)(ev as sys::CUevent) } {
            SUCCESS => Ok(true),
            NOT_READY => Ok(false),
            code => self.check("cuEventQuery", code).map(|_| false),
        }
    }

    pub(super) fn event_synchronize(self, ev: u64) -> Result<()> {
        // SAFETY: as in `event_query`: a live event from `event_record`.
        self.check("cuEventSynchronize", unsafe { (self.api.cuEventSynchronize)(ev as sys::CUevent) })
    }

    pub(super) fn event_destroy(self, ev: u64) -> Result<()> {
        // SAFETY: as in `event_query`; destroyed once by its owner.
        self.check("cuEventDestroy", unsafe { (self.api.cuEventDestroy_v2)(ev as sys::CUevent) })
    }

    pub(super) fn export_fd(self, handle: u64) -> Result<c_int> {
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

    pub(super) fn import_fd(self, fd: c_int) -> Result<u64> {
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

    pub(super) fn range_dmabuf_fd(self, ptr: u64, size: usize) -> Result<c_int> {
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

    pub(super) fn memset_d32(self, dst: u64, value: u32, count: usize) -> Result<()> {
        // SAFETY: resolved function; device address only, validated by the
        // driver; no host memory is involved.
        self.check("cuMemsetD32", unsafe { (self.api.cuMemsetD32_v2)(dst, value, count) })
    }

    /// `len` (> 0) bytes of page-locked host memory, owned by the current
    /// context, uninitialised.
    pub(super) fn mem_host_alloc(self, len: usize) -> Result<NonNull<u8>> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: resolved function; the out-pointer is a valid local; flags
        // 0 (memory for the current context, no device mapping requested).
        self.check("cuMemHostAlloc", unsafe { (self.api.cuMemHostAlloc)(&mut ptr, len, 0) })?;
        NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::OutOfMemory("cuMemHostAlloc returned null".into()))
    }

    /// Frees memory from [`Lib::mem_host_alloc`]; its context must be current.
    pub(super) fn mem_free_host(self, ptr: NonNull<u8>) -> Result<()> {
        // SAFETY: resolved function; the caller passes a pointer from
        // `cuMemHostAlloc` exactly once, with its context current and alive.
        self.check("cuMemFreeHost", unsafe { (self.api.cuMemFreeHost)(ptr.as_ptr().cast::<c_void>()) })
    }
}
