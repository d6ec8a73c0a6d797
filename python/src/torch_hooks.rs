//! PyTorch's pluggable-allocator entry points, exported by the extension
//! module itself: `CUDAPluggableAllocator(vmm_arena._vmm_arena.__file__,
//! "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free")` loads the
//! installed file (loading it again gives the same copy Python imported, so
//! the module's functions and PyTorch's hooks share one arena per device).
//!
//! Each device's arena is created on first use, configured by
//! `vmm_arena.torch.configure()` or else `$VMM_ARENA_CONF` (key:value pairs:
//! backend cuda|host|host-sparse|auto, capacity, reserve, chunk, retain).
//! `auto` (the default) is the CUDA backend, or the host one when CUDA
//! cannot be started (no driver, no device): said by `_hooks_backend`.
//!
//! Every allocation handed to PyTorch is pinned (PyTorch keeps raw
//! pointers) and carries the calling thread's tag. Frees are stream-ordered:
//! the memory goes back once an event recorded on the free's stream has
//! completed.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use vmm_arena::{Arena as RArena, ArenaConfig, Backend, Error, Id, SLEEP_BACKUP};

use crate::{py_err, to_py};

/// One device's arena and the pointers handed out.
struct HookArena {
    arena: RArena,
    /// Why the CUDA backend was not used, when `auto` fell back to host.
    fallback: Option<String>,
    book: Mutex<Book>,
}

#[derive(Default)]
struct Book {
    /// Address -> (id, bytes, tag) of every live allocation handed out.
    live: BTreeMap<u64, (Id, u64, u32)>,
    /// Frees waiting for their stream's event (0: waits for a synchronize).
    pending: Vec<(Id, u64)>,
    bad_frees: u64,
}

type Registry = Mutex<HashMap<c_int, Arc<HookArena>>>;

/// torch_memory_saver's `memory_margin_bytes`, for every device: an
/// allocation through the hooks that would leave less than this much of its
/// arena's capacity free is refused (0: no margin).
static MARGIN: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static CURRENT_TAG: Cell<u32> = const { Cell::new(0) };
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn registry() -> &'static Registry {
    static ARENAS: OnceLock<Registry> = OnceLock::new();
    ARENAS.get_or_init(Default::default)
}

/// The configuration set from Python before any arena exists.
fn conf_override() -> &'static Mutex<Option<String>> {
    static CONF: OnceLock<Mutex<Option<String>>> = OnceLock::new();
    CONF.get_or_init(Default::default)
}

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn parse_bytes(key: &str, v: &str) -> Result<u64, Error> {
    let v = v.trim();
    let (num, mult) = [("TiB", 1u64 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)]
        .iter()
        .find_map(|(suf, m)| v.strip_suffix(suf).map(|n| (n.trim(), *m)))
        .unwrap_or((v, 1));
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| Error::InvalidArgument(format!("{key}:{v} is not a byte size")))
}

/// The configuration for `device`; `None` as the backend means auto.
fn parse_conf(conf: &str, device: c_int) -> Result<(ArenaConfig, Option<Backend>), Error> {
    let mut c = ArenaConfig { device, ..ArenaConfig::default() };
    let mut backend = None;
    for item in conf.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) =
            item.split_once(':').ok_or_else(|| Error::InvalidArgument(format!("{item:?} is not key:value")))?;
        match (k.trim(), v.trim()) {
            ("backend", "auto") => backend = None,
            ("backend", "cuda") => backend = Some(Backend::Cuda),
            ("backend", "host") => backend = Some(Backend::Host),
            ("backend", "host-sparse") => backend = Some(Backend::HostSparse),
            ("backend", other) => return Err(Error::InvalidArgument(format!("unknown backend {other:?}"))),
            ("capacity", v) => c.capacity_bytes = parse_bytes(k, v)?,
            ("reserve", v) => c.reserve_bytes = parse_bytes(k, v)?,
            ("chunk", v) => c.chunk_bytes = parse_bytes(k, v)?,
            ("retain", "all") => c.retain_bytes = u64::MAX,
            ("retain", v) => c.retain_bytes = parse_bytes(k, v)?,
            (other, _) => return Err(Error::InvalidArgument(format!("unknown key {other:?}"))),
        }
    }
    Ok((c, backend))
}

fn current_conf() -> String {
    let set = conf_override().lock().ok().and_then(|c| c.clone());
    set.or_else(|| std::env::var("VMM_ARENA_CONF").ok()).unwrap_or_default()
}

/// The arena of `device`, created on first use.
fn arena_for(device: c_int) -> Result<Arc<HookArena>, Error> {
    let mut reg = registry().lock().map_err(|_| Error::Internal("hook registry poisoned".into()))?;
    if let Some(a) = reg.get(&device) {
        return Ok(a.clone());
    }
    if device < 0 {
        return Err(Error::InvalidArgument(format!("device {device}")));
    }
    let (config, backend) =
        parse_conf(&current_conf(), device).map_err(|e| Error::InvalidArgument(format!("VMM_ARENA_CONF: {e}")))?;
    let (arena, fallback) = match backend {
        Some(b) => (RArena::new(ArenaConfig { backend: b, ..config })?, None),
        None => match RArena::new(ArenaConfig { backend: Backend::Cuda, ..config }) {
            Ok(a) => (a, None),
            Err(cuda) => (RArena::new(ArenaConfig { backend: Backend::Host, ..config })?, Some(cuda.to_string())),
        },
    };
    let a = Arc::new(HookArena { arena, fallback, book: Mutex::new(Book::default()) });
    reg.insert(device, a.clone());
    Ok(a)
}

fn existing(device: c_int) -> Option<Arc<HookArena>> {
    registry().lock().ok()?.get(&device).cloned()
}

impl HookArena {
    fn book(&self) -> Result<MutexGuard<'_, Book>, Error> {
        self.book.lock().map_err(|_| Error::Internal("hook book poisoned".into()))
    }

    /// Frees the pending allocations whose events completed (all of them
    /// when `wait`).
    fn reap(&self, book: &mut Book, wait: bool) -> Result<(), Error> {
        let mut i = 0;
        while i < book.pending.len() {
            let (id, ev) = book.pending[i];
            let done = if ev == 0 {
                self.arena.synchronize()?;
                true
            } else {
                let mut done = self.arena.event_complete(ev)?;
                while wait && !done {
                    std::thread::yield_now();
                    done = self.arena.event_complete(ev)?;
                }
                if done {
                    let _ = self.arena.destroy_event(ev);
                }
                done
            };
            if done {
                self.arena.free(id)?;
                book.pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    fn malloc(&self, size: u64) -> Result<u64, Error> {
        let mut book = self.book()?;
        self.reap(&mut book, false)?;
        let margin = MARGIN.load(Ordering::Relaxed);
        if margin > 0 {
            if let Err(e) = self.arena.stats()?.check_margin(size, margin) {
                // Memory still waiting for a stream may be what is missing.
                if book.pending.is_empty() {
                    return Err(e);
                }
                self.reap(&mut book, true)?;
                self.arena.stats()?.check_margin(size, margin)?;
            }
        }
        let tag = CURRENT_TAG.with(Cell::get);
        let (id, ptr) = match self.arena.alloc_tagged(size, tag) {
            // Memory still waiting for a stream may be what is missing.
            Err(Error::OutOfMemory(_) | Error::OutOfAddressSpace(_)) if !book.pending.is_empty() => {
                self.reap(&mut book, true)?;
                self.arena.alloc_tagged(size, tag)?
            }
            other => other?,
        };
        if let Err(e) = self.arena.pin(id) {
            let _ = self.arena.free(id);
            return Err(e);
        }
        book.live.insert(ptr, (id, size, tag));
        Ok(ptr)
    }

    fn free(&self, ptr: u64, stream: u64) -> Result<(), Error> {
        let mut book = self.book()?;
        let Some((id, _, _)) = book.live.remove(&ptr) else {
            book.bad_frees += 1;
            return Err(Error::InvalidArgument(format!("{ptr:#x} was not allocated here, or was already freed")));
        };
        match self.arena.record_event(stream) {
            Ok(Some(ev)) => book.pending.push((id, ev)),
            Ok(None) => self.arena.free(id)?,
            // Without an event only a device-wide synchronize proves the
            // stream is done with it; kept back (retried by reap) if that fails.
            Err(_) => match self.arena.synchronize() {
                Ok(()) => self.arena.free(id)?,
                Err(e) => {
                    book.pending.push((id, 0));
                    return Err(e);
                }
            },
        }
        self.reap(&mut book, false)
    }

    /// The live allocation containing `ptr`: (base, id, bytes, tag).
    fn containing(book: &Book, ptr: u64) -> Option<(u64, Id, u64, u32)> {
        let (&base, &(id, size, tag)) = book.live.range(..=ptr).next_back()?;
        (ptr < base + size.max(1)).then_some((base, id, size, tag))
    }
}

fn malloc_inner(size: isize, device: c_int) -> *mut c_void {
    if size <= 0 {
        return std::ptr::null_mut();
    }
    let r = std::panic::catch_unwind(|| arena_for(device).and_then(|a| a.malloc(size as u64)));
    match r {
        Ok(Ok(ptr)) => ptr as *mut c_void,
        Ok(Err(e)) => {
            set_last_error(format!("vmm_arena_torch_malloc({size}, device {device}): {e}"));
            std::ptr::null_mut()
        }
        Err(_) => {
            set_last_error(format!("vmm_arena_torch_malloc({size}, device {device}): internal panic"));
            std::ptr::null_mut()
        }
    }
}

/// `size` bytes on `device` for PyTorch; NULL on failure, the reason in
/// `vmm_arena_torch_last_error`. PyTorch does not check for NULL: point it at
/// `vmm_arena_torch_malloc_or_throw`.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let _ = stream; // An allocation serves any stream; frees are what is ordered.
    malloc_inner(size, device)
}

extern "C-unwind" {
    /// Throws `std::bad_alloc` carrying `what` (torch_throw.cpp); never returns.
    fn vmm_arena_py_throw_bad_alloc(what: *const c_char) -> !;
}

/// Like `vmm_arena_torch_malloc`, but a failure throws `std::bad_alloc`
/// (PyTorch turns it into a Python error at the allocation).
#[no_mangle]
pub extern "C-unwind" fn vmm_arena_torch_malloc_or_throw(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let _ = stream;
    let p = malloc_inner(size, device);
    if p.is_null() && size != 0 {
        // The message lives in this thread's LAST_ERROR until the next
        // failure; the C++ side copies it before throwing. Nothing in this
        // frame needs dropping while the exception passes.
        let what = LAST_ERROR.with(|e| e.borrow().as_ptr());
        // SAFETY: `what` is a NUL-terminated string alive for the call; the
        // function unwinds with a C++ exception, allowed by "C-unwind".
        unsafe { vmm_arena_py_throw_bad_alloc(what) }
    }
    p
}

/// PyTorch's free hook: the memory is reused once `stream` has passed here.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    let _ = size;
    if ptr.is_null() {
        return;
    }
    let (addr, stream) = (ptr as u64, stream as u64);
    let r = std::panic::catch_unwind(|| arena_for(device).and_then(|a| a.free(addr, stream)));
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => set_last_error(format!("vmm_arena_torch_free({ptr:p}, device {device}): {e}")),
        Err(_) => set_last_error(format!("vmm_arena_torch_free({ptr:p}, device {device}): internal panic")),
    }
}

/// The free of the LD_PRELOAD library (`ffi/src/preload_shim.c`), which does
/// not know the device: frees `ptr` on whichever device's hooks handed it
/// out, once `stream` has passed this point. 1: theirs and freed; 0: no
/// device's hooks handed it out (nothing changes, no bad free is counted:
/// the shim passes it on to the real runtime); -1: theirs, but the free
/// failed (the reason in `vmm_arena_torch_last_error`).
#[no_mangle]
pub extern "C" fn vmm_arena_torch_release(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    if ptr.is_null() {
        return 0;
    }
    let (addr, stream) = (ptr as u64, stream as u64);
    let r = std::panic::catch_unwind(|| {
        let arenas: Vec<Arc<HookArena>> = registry()
            .lock()
            .map_err(|_| Error::Internal("hook registry poisoned".into()))?
            .values()
            .cloned()
            .collect();
        for a in arenas {
            if a.book()?.live.contains_key(&addr) {
                return a.free(addr, stream).map(|()| true);
            }
        }
        Ok(false)
    });
    match r {
        Ok(Ok(freed)) => c_int::from(freed),
        Ok(Err(e)) => {
            set_last_error(format!("vmm_arena_torch_release({ptr:p}): {e}"));
            -1
        }
        Err(_) => {
            set_last_error(format!("vmm_arena_torch_release({ptr:p}): internal panic"));
            -1
        }
    }
}

/// The LD_PRELOAD library (`libvmm_arena_preload.so`, built from
/// `ffi/src/preload_shim.c` by build.rs), for `vmm_arena.torch` to write out.
#[pyfunction]
pub(crate) fn _hooks_preload_library(py: Python<'_>) -> Bound<'_, pyo3::types::PyBytes> {
    static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libvmm_arena_preload.so"));
    pyo3::types::PyBytes::new(py, LIBRARY)
}

/// This thread's last failure of the hooks (empty when none).
#[no_mangle]
pub extern "C" fn vmm_arena_torch_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

fn dev(device: i64) -> PyResult<c_int> {
    c_int::try_from(device)
        .ok()
        .filter(|d| *d >= 0)
        .ok_or_else(|| py_err("InvalidArgument", format!("device {device} is out of range")))
}

/// Sets the configuration (VMM_ARENA_CONF's syntax) of arenas not created yet.
#[pyfunction]
pub(crate) fn _hooks_configure(conf: &str) -> PyResult<()> {
    parse_conf(conf, 0).map_err(to_py)?;
    let reg = registry().lock().map_err(|_| py_err("InternalError", "hook registry poisoned"))?;
    if !reg.is_empty() {
        return Err(py_err("InvalidArgument", "configure() must come before the first allocation or call"));
    }
    *conf_override().lock().map_err(|_| py_err("InternalError", "poisoned"))? = Some(conf.to_string());
    Ok(())
}

/// Sets this thread's tag for allocations through the hooks; returns the old one.
#[pyfunction]
pub(crate) fn _hooks_set_tag(tag: u32) -> u32 {
    CURRENT_TAG.with(|t| t.replace(tag))
}

/// This thread's tag for allocations through the hooks (for the LD_PRELOAD
/// library: a raw allocation with tag 0 goes to the real runtime).
#[no_mangle]
pub extern "C" fn vmm_arena_torch_tag() -> u32 {
    CURRENT_TAG.with(Cell::get)
}

/// This thread's tag for allocations through the hooks.
#[pyfunction]
pub(crate) fn _hooks_tag() -> u32 {
    CURRENT_TAG.with(Cell::get)
}

/// The devices whose arenas exist.
#[pyfunction]
pub(crate) fn _hooks_devices() -> Vec<c_int> {
    let mut d: Vec<c_int> = registry().lock().map(|r| r.keys().copied().collect()).unwrap_or_default();
    d.sort_unstable();
    d
}

/// (backend name, why CUDA was not used or None) of `device`'s arena (created if needed).
#[pyfunction]
pub(crate) fn _hooks_backend(py: Python<'_>, device: i64) -> PyResult<(&'static str, Option<String>)> {
    let d = dev(device)?;
    let a = py.allow_threads(|| arena_for(d)).map_err(to_py)?;
    Ok((a.arena.backend_name(), a.fallback.clone()))
}

/// Live allocations of `device` handed out by the hooks: [(ptr, bytes, tag)].
#[pyfunction]
pub(crate) fn _hooks_allocations(py: Python<'_>, device: i64) -> PyResult<Vec<(u64, u64, u32)>> {
    let Some(a) = existing(dev(device)?) else { return Ok(Vec::new()) };
    py.allow_threads(|| {
        let book = a.book()?;
        Ok(book.live.iter().map(|(&p, &(_, size, tag))| (p, size, tag)).collect())
    })
    .map_err(to_py)
}

/// Sleeps `tag` on `device` (after the frees waiting on streams), with a
/// host backup of its bytes when `backup`.
#[pyfunction]
pub(crate) fn _hooks_sleep(py: Python<'_>, device: i64, tag: u32, backup: bool) -> PyResult<()> {
    let Some(a) = existing(dev(device)?) else { return Ok(()) };
    py.allow_threads(|| {
        let mut book = a.book()?;
        a.reap(&mut book, true)?;
        a.arena.sleep(tag, if backup { SLEEP_BACKUP } else { 0 })
    })
    .map_err(to_py)
}

/// Wakes `tag` on `device` at the same addresses.
#[pyfunction]
pub(crate) fn _hooks_wake(py: Python<'_>, device: i64, tag: u32) -> PyResult<()> {
    let Some(a) = existing(dev(device)?) else { return Ok(()) };
    py.allow_threads(|| a.arena.wake(tag)).map_err(to_py)
}

/// Keeps (or stops keeping) `device`'s spent sleep backups for the next
/// pause (`Arena::set_backup_cache`); returns the bytes freed when turned
/// off, 0 when the device has no arena yet.
#[pyfunction]
pub(crate) fn _hooks_backup_cache(py: Python<'_>, device: i64, keep: bool) -> PyResult<u64> {
    let Some(a) = existing(dev(device)?) else { return Ok(0) };
    py.allow_threads(|| {
        let kept = a.arena.backup_cache_bytes()?;
        a.arena.set_backup_cache(keep)?;
        Ok(if keep { 0 } else { kept })
    })
    .map_err(to_py)
}

/// Gives the allocation containing `ptr` the tag `tag`; returns its bytes,
/// 0 when no live allocation of the hooks contains `ptr`. Refused while it
/// sleeps (Asleep) and for small allocations sharing a slab (Pinned: they
/// would have to move).
#[pyfunction]
pub(crate) fn _hooks_retag(py: Python<'_>, device: i64, ptr: u64, tag: u32) -> PyResult<u64> {
    let Some(a) = existing(dev(device)?) else { return Ok(0) };
    py.allow_threads(|| {
        let mut book = a.book()?;
        let Some((base, id, size, _)) = HookArena::containing(&book, ptr) else { return Ok(0) };
        if a.arena.query(id)?.asleep {
            return Err(Error::Asleep(id.get()));
        }
        a.arena.set_tag(id, tag)?;
        if let Some(e) = book.live.get_mut(&base) {
            e.2 = tag;
        }
        Ok(size)
    })
    .map_err(to_py)
}

/// Sets the margin (`memory_margin_bytes`) every later allocation through
/// the hooks keeps free, on every device; 0 turns it off.
#[pyfunction]
pub(crate) fn _hooks_set_margin(margin: u64) {
    MARGIN.store(margin, Ordering::Relaxed);
}

/// The margin every allocation through the hooks keeps free (0: none).
#[pyfunction]
pub(crate) fn _hooks_margin() -> u64 {
    MARGIN.load(Ordering::Relaxed)
}

/// The `nbytes` bytes at `ptr` from the sleep backup of the hooks'
/// allocation containing them on `device`, or None when it has none (awake,
/// or paused without a backup) or `ptr` is not the hooks' memory.
/// `InvalidArgument` when the bytes run past the allocation's end.
#[pyfunction]
pub(crate) fn _hooks_cpu_backup<'py>(
    py: Python<'py>,
    device: i64,
    ptr: u64,
    nbytes: u64,
) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
    let Some(a) = existing(dev(device)?) else { return Ok(None) };
    let len = usize::try_from(nbytes).map_err(|_| py_err("InvalidArgument", "nbytes too large"))?;
    let read = py.allow_threads(|| {
        let book = a.book()?;
        let Some((base, id, size, _)) = HookArena::containing(&book, ptr) else { return Ok(None) };
        if (ptr - base).checked_add(nbytes).map_or(true, |end| end > size) {
            return Err(Error::InvalidArgument(format!(
                "{nbytes} bytes at {ptr:#x} run past the allocation's end ({size} bytes at {base:#x})"
            )));
        }
        if !a.arena.query(id)?.asleep {
            return Ok(None);
        }
        let mut out = vec![0u8; len];
        match a.arena.read_backup(id, ptr - base, &mut out) {
            Ok(()) => Ok(Some(out)),
            // Asleep without a backup (the span was checked above).
            Err(Error::InvalidArgument(_)) => Ok(None),
            Err(e) => Err(e),
        }
    });
    Ok(read.map_err(to_py)?.map(|out| pyo3::types::PyBytes::new(py, &out)))
}

/// The stats of `device`'s arena as a dict (None when it does not exist),
/// with `bad_frees`, frees of pointers the hooks never handed out.
#[pyfunction]
pub(crate) fn _hooks_stats<'py>(py: Python<'py>, device: i64) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(a) = existing(dev(device)?) else { return Ok(None) };
    let (stats, bad) = py.allow_threads(|| Ok::<_, Error>((a.arena.stats()?, a.book()?.bad_frees))).map_err(to_py)?;
    let d = crate::stats_to_dict(py, &stats)?;
    d.set_item("bad_frees", bad)?;
    Ok(Some(d))
}

/// Drops `device`'s arena, giving all its memory back, when the hooks hold
/// no live allocation there; returns whether it did.
#[pyfunction]
pub(crate) fn _hooks_release(py: Python<'_>, device: i64) -> PyResult<bool> {
    let d = dev(device)?;
    py.allow_threads(|| {
        let mut reg = registry().lock().map_err(|_| Error::Internal("hook registry poisoned".into()))?;
        let Some(a) = reg.get(&d).cloned() else { return Ok(false) };
        {
            let mut book = a.book()?;
            a.reap(&mut book, true)?;
            if !book.live.is_empty() {
                return Ok(false);
            }
        }
        reg.remove(&d);
        Ok(true)
    })
    .map_err(to_py)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_parses_and_rejects_nonsense() {
        let (c, b) = parse_conf("backend:host, capacity:8GiB,retain:512MiB,chunk:2MiB", 3).unwrap();
        assert_eq!(
            (b, c.capacity_bytes, c.retain_bytes, c.chunk_bytes, c.device),
            (Some(Backend::Host), 8 << 30, 512 << 20, 2 << 20, 3)
        );
        assert_eq!(parse_conf("", 0).unwrap().1, None);
        for bad in ["capacity", "capacity:lots", "backend:tpu", "colour:blue"] {
            assert!(parse_conf(bad, 0).is_err(), "{bad}");
        }
    }
}
