//! An OrtAllocator whose Alloc, Reserve and Free call vmm-arena through its
//! C ABI, and whose GetStats reports the arena's figures, registered on
//! ONNX Runtime's environment for the CPU device so that sessions with
//! session.use_env_allocators=1 take their CPU tensors from it: every
//! intermediate and output, and the weights ONNX Runtime copies at session
//! creation (MatMul's prepacked weights, reserved). Initializers it can use
//! in place stay in the buffers of the loaded model and never reach an
//! allocator. An arena on the CUDA backend registers the same way for
//! ONNX Runtime's "Cuda" device (see the README; not run without a GPU).

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use ort_sys::{OrtAllocatorType, OrtApi, OrtErrorCode, OrtKeyValuePairs, OrtMemType, OrtMemoryInfo, OrtStatus};

use crate::arena::{Arena, ArenaConfig, ArenaDevice, ArenaError, ArenaStats};
use crate::runtime::{Ort, OrtError, Session};

extern "C-unwind" {
    /// src/throw.cpp: throws a std::bad_alloc whose what() is `message`.
    fn vmm_ort_throw_allocation_error(message: *const c_char) -> !;
}

/// ONNX Runtime's OrtAllocator as of API version 23, with the entry points
/// that may throw typed "C-unwind". Layout-identical to
/// ort_sys::OrtAllocator (checked below), which is what ONNX Runtime reads.
#[repr(C)]
struct AllocatorTable {
    version: u32,
    alloc: unsafe extern "C-unwind" fn(*mut AllocatorTable, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut AllocatorTable, *mut c_void),
    info: unsafe extern "C" fn(*const AllocatorTable) -> *const OrtMemoryInfo,
    reserve: unsafe extern "C-unwind" fn(*const AllocatorTable, usize) -> *mut c_void,
    get_stats: unsafe extern "C" fn(*const AllocatorTable, *mut *mut OrtKeyValuePairs) -> *mut OrtStatus,
    /// Stream-ordered allocation, for devices with streams: none on the CPU.
    alloc_on_stream: Option<unsafe extern "C" fn(*mut AllocatorTable, usize, *mut c_void) -> *mut c_void>,
}

const _: () = assert!(std::mem::size_of::<AllocatorTable>() == std::mem::size_of::<ort_sys::OrtAllocator>());
const _: () = assert!(ort_sys::ORT_API_VERSION == 23);

/// What the allocator did, counted by it (not by the arena).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorCounters {
    /// Alloc calls that succeeded
    pub allocs: u64,
    /// Reserve calls that succeeded (ONNX Runtime reserves the weights it
    /// copies at session creation, e.g. MatMul's prepacked ones)
    pub reserves: u64,
    /// Free calls of a pointer this allocator gave out
    pub frees: u64,
    /// Alloc or Reserve calls the arena refused (each reported to ONNX
    /// Runtime as an exception)
    pub refused: u64,
    /// Free calls of a pointer this allocator never gave out (or gave back)
    pub unknown_frees: u64,
    /// vmm_arena_free failures
    pub arena_free_errors: u64,
    /// blocks given out and not yet freed
    pub live_blocks: u64,
    /// bytes of those blocks, as requested
    pub live_bytes: u64,
    /// high-water mark of live_bytes since creation or reset_peak
    pub peak_live_bytes: u64,
    /// largest single request
    pub max_request_bytes: u64,
    /// bytes given out, ever
    pub total_bytes: u64,
    /// nanoseconds spent in vmm_arena_alloc (Alloc and Reserve, refused ones included)
    pub alloc_nanos: u64,
    /// nanoseconds spent in vmm_arena_free
    pub free_nanos: u64,
}

struct Block {
    id: u64,
    size: u64,
}

struct Book {
    blocks: HashMap<usize, Block>,
    counters: AllocatorCounters,
}

struct State {
    arena: Arena,
    api: &'static OrtApi,
    memory_info: *mut OrtMemoryInfo,
    book: Mutex<Book>,
}

#[derive(Clone, Copy)]
enum Kind {
    Alloc,
    Reserve,
}

impl State {
    fn book(&self) -> MutexGuard<'_, Book> {
        // A panic caught at an entry point may have poisoned the lock; the
        // book is updated in single steps, so it is still consistent.
        self.book.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn allocate(&self, size: usize, kind: Kind) -> Result<*mut c_void, String> {
        // Zero bytes still get a unique address that Free accepts.
        let request = size.max(1) as u64;
        let start = Instant::now();
        let result = self.arena.alloc(request);
        let nanos = start.elapsed().as_nanos() as u64;
        match result {
            Ok((id, address)) => {
                let mut book = self.book();
                book.counters.alloc_nanos += nanos;
                book.blocks.insert(address as usize, Block { id, size: request });
                let c = &mut book.counters;
                match kind {
                    Kind::Alloc => c.allocs += 1,
                    Kind::Reserve => c.reserves += 1,
                }
                c.live_blocks += 1;
                c.live_bytes += request;
                c.peak_live_bytes = c.peak_live_bytes.max(c.live_bytes);
                c.max_request_bytes = c.max_request_bytes.max(request);
                c.total_bytes += request;
                Ok(address as *mut c_void)
            }
            Err(error) => {
                let mut book = self.book();
                book.counters.refused += 1;
                book.counters.alloc_nanos += nanos;
                Err(format!("vmm-arena refused an allocation of {size} bytes: {error}"))
            }
        }
    }

    fn free(&self, ptr: *mut c_void) {
        if ptr.is_null() {
            return;
        }
        let block = {
            let mut book = self.book();
            match book.blocks.remove(&(ptr as usize)) {
                Some(block) => {
                    let c = &mut book.counters;
                    c.frees += 1;
                    c.live_blocks -= 1;
                    c.live_bytes -= block.size;
                    block
                }
                None => {
                    book.counters.unknown_frees += 1;
                    return;
                }
            }
        };
        let start = Instant::now();
        let result = self.arena.free(block.id);
        let nanos = start.elapsed().as_nanos() as u64;
        let mut book = self.book();
        book.counters.free_nanos += nanos;
        if result.is_err() {
            book.counters.arena_free_errors += 1;
        }
    }

    /// ONNX Runtime's allocator statistics keys (the ones its own arena
    /// reports, which it parses from a user allocator's GetStats).
    fn stats_pairs(&self) -> Result<Vec<(&'static str, u64)>, ArenaError> {
        let arena = self.arena.stats()?;
        let c = self.book().counters;
        Ok(vec![
            ("Limit", arena.capacity_bytes),
            ("InUse", c.live_bytes),
            ("TotalAllocated", arena.mapped_bytes + arena.pooled_bytes),
            ("MaxInUse", c.peak_live_bytes),
            ("NumAllocs", c.allocs),
            ("NumReserves", c.reserves),
            ("NumArenaExtensions", arena.driver_creates),
            ("NumArenaShrinkages", arena.driver_releases),
            ("MaxAllocSize", c.max_request_bytes),
        ])
    }
}

/// The allocator object ONNX Runtime holds a pointer to: the table first,
/// so that the OrtAllocator* it is given points at this struct.
#[repr(C)]
struct Shared {
    table: AllocatorTable,
    state: State,
}

/// # Safety
/// `this` is the table of a live `Shared`.
unsafe fn shared<'a>(this: *const AllocatorTable) -> &'a Shared {
    // SAFETY: the caller's contract; the table is Shared's first field of a
    // repr(C) struct, so the pointers are equal.
    unsafe { &*(this as *const Shared) }
}

/// A NUL-terminated copy of `text`, cut to fit; a plain array, so nothing
/// needs dropping when the exception unwinds past it.
fn c_message(text: &str) -> [u8; 512] {
    let mut out = [0u8; 512];
    let bytes = text.as_bytes();
    let n = bytes.len().min(out.len() - 1);
    out[..n].copy_from_slice(&bytes[..n]);
    out
}

fn allocate_or_throw(state: &State, size: usize, kind: Kind) -> *mut c_void {
    let message = match catch_unwind(AssertUnwindSafe(|| state.allocate(size, kind))) {
        Ok(Ok(ptr)) => return ptr,
        Ok(Err(text)) => c_message(&text),
        Err(payload) => {
            drop(payload);
            c_message("vmm-arena OrtAllocator: a panic while allocating")
        }
    };
    // SAFETY: message is NUL-terminated. The call throws a C++ exception
    // that unwinds through this "C-unwind" frame (which owns nothing to
    // drop) into ONNX Runtime, which catches it and reports an OrtStatus.
    unsafe { vmm_ort_throw_allocation_error(message.as_ptr().cast()) }
}

unsafe extern "C-unwind" fn alloc_entry(this: *mut AllocatorTable, size: usize) -> *mut c_void {
    // SAFETY: ONNX Runtime passes back the table it was registered with.
    allocate_or_throw(&unsafe { shared(this) }.state, size, Kind::Alloc)
}

unsafe extern "C-unwind" fn reserve_entry(this: *const AllocatorTable, size: usize) -> *mut c_void {
    // SAFETY: as alloc_entry.
    allocate_or_throw(&unsafe { shared(this) }.state, size, Kind::Reserve)
}

unsafe extern "C" fn free_entry(this: *mut AllocatorTable, ptr: *mut c_void) {
    // SAFETY: as alloc_entry.
    let state = &unsafe { shared(this) }.state;
    // Free cannot report an error: failures are counted instead.
    let _ = catch_unwind(AssertUnwindSafe(|| state.free(ptr)));
}

unsafe extern "C" fn info_entry(this: *const AllocatorTable) -> *const OrtMemoryInfo {
    // SAFETY: as alloc_entry.
    unsafe { shared(this) }.state.memory_info
}

unsafe extern "C" fn get_stats_entry(this: *const AllocatorTable, out: *mut *mut OrtKeyValuePairs) -> *mut OrtStatus {
    // SAFETY: as alloc_entry.
    let state = &unsafe { shared(this) }.state;
    let api = state.api;
    let result = catch_unwind(AssertUnwindSafe(|| state.stats_pairs()));
    let pairs = match result {
        Ok(Ok(pairs)) => pairs,
        Ok(Err(error)) => return error_status(api, &format!("vmm-arena stats: {error}")),
        Err(_) => return error_status(api, "vmm-arena OrtAllocator: a panic while reading stats"),
    };
    if out.is_null() {
        return error_status(api, "GetStats: out is NULL");
    }
    let mut kvps = std::ptr::null_mut();
    // SAFETY: kvps is writable; each key and value is NUL-terminated and
    // copied by AddKeyValuePair; the pairs go to the caller, who releases them.
    unsafe {
        (api.CreateKeyValuePairs)(&mut kvps);
        for (key, value) in pairs {
            let key = CString::new(key).expect("no NUL");
            let value = CString::new(value.to_string()).expect("digits");
            (api.AddKeyValuePair)(kvps, key.as_ptr(), value.as_ptr());
        }
        *out = kvps;
    }
    std::ptr::null_mut()
}

fn error_status(api: &OrtApi, message: &str) -> *mut OrtStatus {
    let message = CString::new(message.replace('\0', " ")).expect("NULs replaced");
    // SAFETY: message is NUL-terminated; CreateStatus copies it.
    unsafe { (api.CreateStatus)(OrtErrorCode::ORT_FAIL, message.as_ptr()) }.0
}

/// Errors of setting the allocator up.
#[derive(Debug)]
pub enum SetupError {
    Arena(ArenaError),
    Ort(OrtError),
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetupError::Arena(e) => write!(f, "vmm-arena: {e}"),
            SetupError::Ort(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SetupError {}

/// A vmm-arena served to ONNX Runtime as an OrtAllocator.
pub struct ArenaAllocator {
    ort: &'static Ort,
    // Boxed: ONNX Runtime keeps its address while registered.
    shared: Box<Shared>,
}

// SAFETY: the arena is thread-safe, the book is behind a mutex, and the
// memory info is read-only after creation.
unsafe impl Send for ArenaAllocator {}
// SAFETY: as above.
unsafe impl Sync for ArenaAllocator {}

impl ArenaAllocator {
    pub fn new(ort: &'static Ort, config: ArenaConfig) -> Result<ArenaAllocator, SetupError> {
        let arena = Arena::new(config).map_err(SetupError::Arena)?;
        let api = ort.api();
        let mut memory_info = std::ptr::null_mut();
        // The device's default memory, as a device (not arena) allocator:
        // ONNX Runtime accepts only that type from a user allocator.
        // SAFETY: memory_info is writable; the name is NUL-terminated.
        ort.check(unsafe {
            match config.device {
                ArenaDevice::Host => (api.CreateCpuMemoryInfo)(
                    OrtAllocatorType::OrtDeviceAllocator,
                    OrtMemType::OrtMemTypeDefault,
                    &mut memory_info,
                ),
                // ONNX Runtime's name for the CUDA device's memory.
                ArenaDevice::Cuda(ordinal) => (api.CreateMemoryInfo)(
                    c"Cuda".as_ptr(),
                    OrtAllocatorType::OrtDeviceAllocator,
                    ordinal,
                    OrtMemType::OrtMemTypeDefault,
                    &mut memory_info,
                ),
            }
        })
        .map_err(SetupError::Ort)?;
        let table = AllocatorTable {
            version: ort_sys::ORT_API_VERSION,
            alloc: alloc_entry,
            free: free_entry,
            info: info_entry,
            reserve: reserve_entry,
            get_stats: get_stats_entry,
            alloc_on_stream: None,
        };
        let book = Mutex::new(Book { blocks: HashMap::new(), counters: AllocatorCounters::default() });
        let shared = Box::new(Shared { table, state: State { arena, api, memory_info, book } });
        Ok(ArenaAllocator { ort, shared })
    }

    /// Registers the allocator on the environment for its device (CPU, or
    /// CUDA for an `ArenaDevice::Cuda` arena). Until the registration is
    /// dropped, sessions made with `SessionConfig::allocator` set take that
    /// device's memory from it. One allocator per device is registered at a
    /// time; registering another replaces it.
    pub fn register(&self) -> Result<Registration<'_>, OrtError> {
        let table = &self.shared.table as *const AllocatorTable as *mut ort_sys::OrtAllocator;
        // SAFETY: the table is layout-identical to OrtAllocator and lives in
        // a Box that outlives the registration (it borrows self).
        self.ort.check(unsafe { (self.ort.api().RegisterAllocator)(self.ort.env(), table) })?;
        Ok(Registration { allocator: self })
    }

    pub fn counters(&self) -> AllocatorCounters {
        self.shared.state.book().counters
    }

    /// Starts a new high-water mark of live bytes at the current level.
    pub fn reset_peak(&self) {
        let mut book = self.shared.state.book();
        book.counters.peak_live_bytes = book.counters.live_bytes;
    }

    pub fn arena_stats(&self) -> Result<ArenaStats, ArenaError> {
        self.shared.state.arena.stats()
    }

    /// Gives every pooled chunk back to the system; returns the bytes released.
    pub fn trim(&self) -> Result<u64, ArenaError> {
        self.shared.state.arena.trim(0)
    }

    /// This allocator's GetStats, as ONNX Runtime's C API reads it.
    pub fn ort_stats(&self) -> Result<Vec<(String, String)>, OrtError> {
        let table = &self.shared.table as *const AllocatorTable as *const ort_sys::OrtAllocator;
        let mut kvps = std::ptr::null_mut();
        // SAFETY: the table is a live, layout-identical OrtAllocator.
        self.ort.check(unsafe { (self.ort.api().AllocatorGetStats)(table, &mut kvps) })?;
        // SAFETY: kvps was just returned by AllocatorGetStats.
        Ok(unsafe { take_pairs(self.ort.api(), kvps) })
    }
}

impl Drop for ArenaAllocator {
    fn drop(&mut self) {
        // SAFETY: created in new and released once; no registration is
        // alive (it borrows self), so ONNX Runtime no longer reads it.
        unsafe { (self.ort.api().ReleaseMemoryInfo)(self.shared.state.memory_info) };
    }
}

/// Reads and releases key-value pairs.
///
/// # Safety
/// `kvps` is NULL or pairs ONNX Runtime returned and nobody else releases.
unsafe fn take_pairs(api: &OrtApi, kvps: *mut OrtKeyValuePairs) -> Vec<(String, String)> {
    if kvps.is_null() {
        return Vec::new();
    }
    let (mut keys, mut values, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
    let mut pairs = Vec::new();
    // SAFETY: the caller's contract; the arrays hold n NUL-terminated
    // strings owned by kvps, copied before it is released.
    unsafe {
        (api.GetKeyValuePairs)(kvps, &mut keys, &mut values, &mut n);
        for i in 0..n {
            let key = CStr::from_ptr(*keys.add(i)).to_string_lossy().into_owned();
            let value = CStr::from_ptr(*values.add(i)).to_string_lossy().into_owned();
            pairs.push((key, value));
        }
        (api.ReleaseKeyValuePairs)(kvps);
    }
    pairs
}

/// The allocator statistics of a session's CPU allocator, read through
/// ONNX Runtime (CreateAllocator + AllocatorGetStats): ONNX Runtime's own
/// arena for a default session, this crate's allocator (parsed and re-emitted
/// by ONNX Runtime's wrapper) for an arena session.
pub fn session_allocator_stats(session: &Session<'_>) -> Result<Vec<(String, String)>, OrtError> {
    let ort = session.ort();
    let api = ort.api();
    let mut info = std::ptr::null_mut();
    // SAFETY: info is writable.
    ort.check(unsafe {
        (api.CreateCpuMemoryInfo)(OrtAllocatorType::OrtDeviceAllocator, OrtMemType::OrtMemTypeDefault, &mut info)
    })?;
    let mut allocator = std::ptr::null_mut();
    // SAFETY: session and info are live; allocator is writable.
    let status = unsafe { (api.CreateAllocator)(session.raw(), info, &mut allocator) };
    // SAFETY: released once; CreateAllocator does not keep it.
    unsafe { (api.ReleaseMemoryInfo)(info) };
    ort.check(status)?;
    let mut kvps = std::ptr::null_mut();
    // SAFETY: allocator is live until released below.
    let status = unsafe { (api.AllocatorGetStats)(allocator, &mut kvps) };
    let result = ort.check(status).map(|()| {
        // SAFETY: kvps was just returned by AllocatorGetStats.
        unsafe { take_pairs(api, kvps) }
    });
    // SAFETY: created by CreateAllocator and released once.
    unsafe { (api.ReleaseAllocator)(allocator) };
    result
}

/// The allocator's registration on the environment; dropping it
/// unregisters (sessions borrowing it are gone by then).
pub struct Registration<'a> {
    allocator: &'a ArenaAllocator,
}

impl Registration<'_> {
    pub fn allocator(&self) -> &ArenaAllocator {
        self.allocator
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let ort = self.allocator.ort;
        // SAFETY: env and memory info are live.
        let status = unsafe { (ort.api().UnregisterAllocator)(ort.env(), self.allocator.shared.state.memory_info) };
        if let Err(error) = ort.check(status) {
            eprintln!("vmm-arena: UnregisterAllocator failed: {error}");
        }
    }
}
