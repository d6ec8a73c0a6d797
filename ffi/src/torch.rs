//! PyTorch's pluggable-allocator entry points.
//!
//! `torch.cuda.memory.CUDAPluggableAllocator(path,
//! "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free")` loads the
//! allocation hook of `torch_shim.cpp` and the free hook here. PyTorch does
//! not check the pointer the allocation hook returns, so the hook it loads
//! must throw (`std::bad_alloc`) rather than return NULL; the C++ shim calls
//! `vmm_arena_torch_malloc` and throws, so that no exception crosses Rust
//! frames. Behind them is one
//! arena per device, created on first use and configured by the environment
//! variable `VMM_ARENA_CONF` (`key:value` pairs separated by commas, like
//! `PYTORCH_CUDA_ALLOC_CONF`):
//!
//! | key | value | default |
//! |---|---|---|
//! | `backend` | `cuda`, `host`, `host-sparse` | `cuda` |
//! | `capacity` | bytes, with `KiB`/`MiB`/`GiB`/`TiB` suffixes | the device's memory |
//! | `reserve` | bytes | 4 × capacity |
//! | `retain` | bytes of freed memory kept pooled, or `all` | `all` |
//! | `chunk` | bytes | 2 MiB |
//!
//! PyTorch keeps raw pointers, so every allocation made here is pinned: it
//! never moves. Frees are stream-ordered, as with PyTorch's own caching
//! allocator: a free records an event on its stream, and the memory goes
//! back to the arena (where another request may get it) only once the event
//! has completed. A free of a pointer this library did not hand out (or a
//! second free) is counted (`vmm_arena_torch_bad_frees`) and reported in
//! `vmm_arena_last_error`, and changes nothing.
//!
//! Tags (for pausing, as `torch_memory_saver` does): each thread has a
//! current tag, 0 unless `vmm_arena_torch_set_tag` changed it, and every
//! allocation the hook makes on that thread carries it, small ones
//! included (they go into slabs of that tag only). `vmm_arena_torch_sleep`
//! and `vmm_arena_torch_wake` put a tag's memory to sleep and wake it at
//! the same addresses (pinned allocations sleep too).
//!
//! These functions are not declared in `vmm_arena.h` (PyTorch finds them by
//! name); their prototypes are in `ffi/README.md`.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arena::{Arena, ArenaConfig, Backend, Error, Id};

use crate::{boundary, c_stats, guarded, required, set_last_error, vmm_arena_stats, vmm_arena_status};

/// One device's arena and the pointers handed to PyTorch.
struct TorchArena {
    arena: Arena,
    state: Mutex<Book>,
}

#[derive(Default)]
struct Book {
    /// Pointer -> id of every live allocation handed out.
    live: HashMap<u64, Id>,
    /// Frees waiting for their stream's event.
    pending: Vec<(Id, u64)>,
    bad_frees: u64,
}

/// In `Book::pending` instead of an event: a free whose event could not be
/// recorded and whose fallback synchronize failed too. (Event handles are
/// never 0: CUDA's are pointers.)
const NEEDS_SYNC: u64 = 0;

type Registry = Mutex<HashMap<c_int, Arc<TorchArena>>>;

/// torch_memory_saver's `memory_margin_bytes`, for every device
/// (`vmm_arena_torch_set_margin`); 0: no margin.
static MARGIN: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The tag this thread's allocations through the hook carry.
    static CURRENT_TAG: Cell<u32> = const { Cell::new(0) };
}

fn registry() -> &'static Registry {
    static ARENAS: OnceLock<Registry> = OnceLock::new();
    ARENAS.get_or_init(Default::default)
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
        .ok_or_else(|| Error::InvalidArgument(format!("VMM_ARENA_CONF: {key}:{v} is not a byte size")))
}

/// Parses `VMM_ARENA_CONF` into an arena configuration for `device`.
pub(crate) fn parse_conf(conf: &str, device: c_int) -> Result<ArenaConfig, Error> {
    let mut c = ArenaConfig { backend: Backend::Cuda, device, ..ArenaConfig::default() };
    for item in conf.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) = item
            .split_once(':')
            .ok_or_else(|| Error::InvalidArgument(format!("VMM_ARENA_CONF: {item:?} is not key:value")))?;
        match k.trim() {
            "backend" => {
                c.backend = match v.trim() {
                    "cuda" => Backend::Cuda,
                    "host" => Backend::Host,
                    "host-sparse" => Backend::HostSparse,
                    other => return Err(Error::InvalidArgument(format!("VMM_ARENA_CONF: unknown backend {other:?}"))),
                }
            }
            "capacity" => c.capacity_bytes = parse_bytes(k, v)?,
            "reserve" => c.reserve_bytes = parse_bytes(k, v)?,
            "chunk" => c.chunk_bytes = parse_bytes(k, v)?,
            "retain" if v.trim() == "all" => c.retain_bytes = u64::MAX,
            "retain" => c.retain_bytes = parse_bytes(k, v)?,
            other => return Err(Error::InvalidArgument(format!("VMM_ARENA_CONF: unknown key {other:?}"))),
        }
    }
    Ok(c)
}

/// The arena of `device`, created on first use.
fn arena_for(device: c_int) -> Result<Arc<TorchArena>, Error> {
    let mut reg = registry().lock().map_err(|_| Error::Internal("torch registry poisoned".into()))?;
    if let Some(a) = reg.get(&device) {
        return Ok(a.clone());
    }
    let conf = std::env::var("VMM_ARENA_CONF").unwrap_or_default();
    let arena = Arena::new(parse_conf(&conf, device)?)?;
    let a = Arc::new(TorchArena { arena, state: Mutex::new(Book::default()) });
    reg.insert(device, a.clone());
    Ok(a)
}

impl TorchArena {
    fn book(&self) -> Result<std::sync::MutexGuard<'_, Book>, Error> {
        self.state.lock().map_err(|_| Error::Internal("torch allocator state poisoned".into()))
    }

    /// Frees the pending allocations whose events have completed (all of
    /// them when `wait`, synchronizing on each event in turn).
    fn reap(&self, book: &mut Book, wait: bool) -> Result<(), Error> {
        let mut i = 0;
        while i < book.pending.len() {
            let (id, ev) = book.pending[i];
            if ev == NEEDS_SYNC {
                // A free that has no event: the device must be idle first.
                self.arena.synchronize()?;
                self.arena.free(id)?;
                book.pending.swap_remove(i);
                continue;
            }
            let mut done = self.arena.event_complete(ev)?;
            while wait && !done {
                std::thread::yield_now();
                done = self.arena.event_complete(ev)?;
            }
            if done {
                let _ = self.arena.destroy_event(ev);
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
        book.live.insert(ptr, id);
        Ok(ptr)
    }

    fn free(&self, ptr: u64, stream: u64) -> Result<(), Error> {
        let mut book = self.book()?;
        let Some(id) = book.live.remove(&ptr) else {
            book.bad_frees += 1;
            return Err(Error::InvalidArgument(format!(
                "vmm_arena_torch_free: {ptr:#x} was not allocated here, or was already freed"
            )));
        };
        match self.arena.record_event(stream) {
            Ok(Some(ev)) => book.pending.push((id, ev)),
            Ok(None) => self.arena.free(id)?,
            // The id is out of the live map already: dropping it here would
            // leak the memory for good. Without an event, only a device-wide
            // synchronize proves the stream is done with it.
            Err(_) => match self.arena.synchronize() {
                Ok(()) => self.arena.free(id)?,
                Err(sync) => {
                    // Not safe to reuse yet: kept back, retried by reap.
                    book.pending.push((id, NEEDS_SYNC));
                    return Err(sync);
                }
            },
        }
        self.reap(&mut book, false)
    }
}

/// `size` bytes on `device`, for `stream` (a `cudaStream_t`). NULL on
/// failure, with the reason in `vmm_arena_last_error`. PyTorch does not
/// check for NULL: point it at `vmm_arena_torch_malloc_or_throw` (the C++
/// shim over this function), not at this one.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let _ = stream; // An allocation can be used on any stream; frees are what is ordered.
    guarded(std::ptr::null_mut(), || {
        if size <= 0 {
            return std::ptr::null_mut();
        }
        match arena_for(device).and_then(|a| a.malloc(size as u64)) {
            Ok(ptr) => ptr as *mut c_void,
            Err(e) => {
                set_last_error(format!("vmm_arena_torch_malloc({size}, device {device}): {e}"));
                std::ptr::null_mut()
            }
        }
    })
}

/// PyTorch's free hook. The memory is reused once `stream` has passed this point.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    let _ = size;
    guarded((), || {
        if ptr.is_null() {
            return;
        }
        let freed = arena_for(device).and_then(|a| a.free(ptr as u64, stream as u64));
        if let Err(e) = freed {
            set_last_error(format!("vmm_arena_torch_free({ptr:p}, device {device}): {e}"));
        }
    })
}

/// The free of the LD_PRELOAD shim (`preload_shim.c`), which does not know
/// the device: frees `ptr` on whichever device's hooks handed it out, after
/// `stream` (a `cudaStream_t`) has passed this point. Returns 1 when it was
/// theirs and is freed, 0 when no device's hooks handed it out (nothing
/// changes and no bad free is counted: the shim passes it on to the real
/// runtime), -1 when it was theirs but the free failed (the reason in
/// `vmm_arena_last_error`).
#[no_mangle]
pub extern "C" fn vmm_arena_torch_release(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guarded(-1, || {
        if ptr.is_null() {
            return 0;
        }
        let arenas: Vec<(c_int, Arc<TorchArena>)> = match registry().lock() {
            Ok(reg) => reg.iter().map(|(d, a)| (*d, a.clone())).collect(),
            Err(_) => {
                set_last_error("vmm_arena_torch_release: torch registry poisoned".into());
                return -1;
            }
        };
        for (device, a) in arenas {
            let owned = a.book().map(|b| b.live.contains_key(&(ptr as u64)));
            let freed = match owned {
                Ok(false) => continue,
                Ok(true) => a.free(ptr as u64, stream as u64),
                Err(e) => Err(e),
            };
            return match freed {
                Ok(()) => 1,
                Err(e) => {
                    set_last_error(format!("vmm_arena_torch_release({ptr:p}, device {device}): {e}"));
                    -1
                }
            };
        }
        0
    })
}

/// Stats of `device`'s arena (created if needed). `stats->struct_size` must
/// be `sizeof(vmm_arena_stats)`.
///
/// # Safety
/// `stats` is NULL or points to a writable `vmm_arena_stats`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_torch_stats(device: c_int, stats: *mut vmm_arena_stats) -> vmm_arena_status {
    boundary("vmm_arena_torch_stats", std::ptr::null(), || {
        let out = required(stats, "stats")?;
        // SAFETY: non-NULL; the caller's struct starts with its uint32_t struct_size.
        let size = unsafe { out.as_ptr().cast::<u32>().read() };
        if size as usize != std::mem::size_of::<vmm_arena_stats>() {
            return Err(Error::InvalidArgument(format!("stats->struct_size is {size}")));
        }
        let c = c_stats(&arena_for(device)?.arena.stats()?);
        // SAFETY: a whole writable vmm_arena_stats, per this function's contract.
        unsafe { out.as_ptr().write(c) };
        Ok(())
    })
}

/// Frees of pointers that were not live (never allocated here, or freed
/// twice) seen on `device`; 0 if its arena does not exist.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_bad_frees(device: c_int) -> u64 {
    guarded(0, || {
        let reg = match registry().lock() {
            Ok(r) => r,
            Err(_) => return 0,
        };
        reg.get(&device).and_then(|a| a.book().ok().map(|b| b.bad_frees)).unwrap_or(0)
    })
}

/// Sets the tag this thread's next allocations through the hook carry;
/// returns the one it replaces (to restore it when a region ends).
#[no_mangle]
pub extern "C" fn vmm_arena_torch_set_tag(tag: u32) -> u32 {
    guarded(0, || CURRENT_TAG.with(|t| t.replace(tag)))
}

/// Sets the margin every later allocation through the hooks keeps free, on
/// every device (torch_memory_saver's `memory_margin_bytes`): a request
/// that would leave less than `margin` bytes of its arena's capacity
/// neither mapped nor pooled fails as out of memory. 0 turns it off.
/// Returns the margin it replaces.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_set_margin(margin: u64) -> u64 {
    guarded(0, || MARGIN.swap(margin, Ordering::Relaxed))
}

/// The tag this thread's allocations through the hook carry now.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_tag() -> u32 {
    guarded(0, || CURRENT_TAG.with(Cell::get))
}

/// `vmm_arena_sleep` on `device`'s arena (created if needed), after the
/// frees PyTorch ordered on streams have completed (waited for), so that
/// their memory goes back too.
#[no_mangle]
pub extern "C" fn vmm_arena_torch_sleep(device: c_int, tag: u32, flags: u32) -> vmm_arena_status {
    boundary("vmm_arena_torch_sleep", std::ptr::null(), || {
        let a = arena_for(device)?;
        let mut book = a.book()?;
        a.reap(&mut book, true)?;
        a.arena.sleep(tag, flags)
    })
}

/// `vmm_arena_wake` on `device`'s arena (created if needed).
#[no_mangle]
pub extern "C" fn vmm_arena_torch_wake(device: c_int, tag: u32) -> vmm_arena_status {
    boundary("vmm_arena_torch_wake", std::ptr::null(), || arena_for(device)?.arena.wake(tag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arena::driver::fault::{FaultDriver, FaultKind};
    use arena::driver::host::HostDriver;
    use arena::driver::CallKind;

    /// A torch arena on the host backend behind a fault injector.
    fn faulty() -> (Arc<FaultDriver<HostDriver>>, TorchArena) {
        let fd = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
        let config = ArenaConfig { capacity_bytes: 8 << 20, chunk_bytes: 64 << 10, ..ArenaConfig::default() };
        let arena = Arena::with_driver(Arc::clone(&fd), config).unwrap();
        (fd, TorchArena { arena, state: Mutex::new(Book::default()) })
    }

    #[test]
    fn a_free_whose_event_cannot_be_recorded_still_frees() {
        let (fd, t) = faulty();
        let p = t.malloc(100_000).unwrap();
        fd.fail_nth(Some(CallKind::Event), 1, FaultKind::Driver);
        // The free reports nothing to PyTorch (it cannot act on it); the
        // memory must still come back, after a synchronize.
        let syncs = fd.calls(CallKind::Synchronize);
        let freed = t.free(p, 0x5eed);
        assert_eq!(fd.injected(), 1);
        assert_eq!(t.arena.stats().unwrap().live_allocations, 0, "the allocation leaked");
        assert_eq!(fd.calls(CallKind::Synchronize), syncs + 1, "freed without waiting for the device");
        freed.unwrap();
        assert!(t.book().unwrap().live.is_empty());
        // And the allocator goes on working.
        let q = t.malloc(100_000).unwrap();
        t.free(q, 0).unwrap();
        assert_eq!(t.arena.stats().unwrap().live_allocations, 0);
    }

    #[test]
    fn the_thread_tag_reaches_small_allocations_and_sleeps_alone() {
        let (_fd, t) = faulty();
        let before = vmm_arena_torch_set_tag(5);
        let w = t.malloc(1000).unwrap();
        vmm_arena_torch_set_tag(6);
        let k = t.malloc(1000).unwrap();
        assert_eq!(vmm_arena_torch_set_tag(before), 6);
        let (wid, kid) = {
            let b = t.book().unwrap();
            (b.live[&w], b.live[&k])
        };
        assert_eq!((t.arena.query(wid).unwrap().tag, t.arena.query(kid).unwrap().tag), (5, 6));
        t.arena.write(kid, 0, b"kv").unwrap();
        t.arena.sleep(5, arena::SLEEP_BACKUP).unwrap();
        assert!(t.arena.query(wid).unwrap().asleep && !t.arena.query(kid).unwrap().asleep);
        let mut out = [0u8; 2];
        t.arena.read(kid, 0, &mut out).unwrap();
        assert_eq!(&out, b"kv");
        t.arena.wake(5).unwrap();
        t.free(w, 0).unwrap();
        t.free(k, 0).unwrap();
    }

    #[test]
    fn conf_parses_keys_sizes_and_rejects_nonsense() {
        let c = parse_conf("backend:host, capacity:8GiB,retain:512MiB,chunk:2MiB,reserve:64GiB", 3).unwrap();
        assert_eq!(c.backend, Backend::Host);
        assert_eq!((c.capacity_bytes, c.retain_bytes, c.chunk_bytes), (8 << 30, 512 << 20, 2 << 20));
        assert_eq!((c.reserve_bytes, c.device), (64 << 30, 3));
        assert_eq!(parse_conf("", 0).unwrap().backend, Backend::Cuda);
        assert_eq!(parse_conf("retain:all", 0).unwrap().retain_bytes, u64::MAX);
        for bad in ["capacity", "capacity:lots", "backend:tpu", "colour:blue", "capacity:99999999999TiB"] {
            assert!(matches!(parse_conf(bad, 0), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }
}
