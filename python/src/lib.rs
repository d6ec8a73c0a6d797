//! `vmm_arena._vmm_arena`: the Rust arena for Python (the package
//! `vmm_arena` re-exports it with its docs and the typed `Stats`).
//!
//! Rules kept here:
//! - every arena call runs with the GIL released, and the move callback
//!   takes the GIL to call Python: a thread holding the GIL never waits for
//!   the arena's lock, so the two locks cannot deadlock;
//! - a Python exception raised by the move callback is reported through
//!   `sys.unraisablehook` and goes no further (the arena is not poisoned);
//! - arguments are converted here, so that a wrong type, a negative or a
//!   too large number is `InvalidArgument`, never a crash or an overflow;
//! - a DLPack view pins its buffer until the consumer releases it, so a
//!   view is never left at an old address (see `Buffer::__dlpack__`).

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use vmm_arena::{Arena as RArena, ArenaConfig, Backend, Error, Id, Status, ALL_TAGS, SLEEP_BACKUP};

mod dlpack;
use dlpack::*;
mod group;
mod layout;
mod torch_hooks;

/// An exception of `vmm_arena.errors` (defined in Python, so that it pickles
/// and `InvalidArgument` can be a `ValueError` too) carrying `msg`.
fn py_err(kind: &str, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::with_gil(|py| {
        let class = py.import("vmm_arena.errors").and_then(|m| m.getattr(kind));
        match class.and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from)) {
            Ok(c) => PyErr::from_type(c, msg),
            Err(e) => e,
        }
    })
}

fn to_py(e: Error) -> PyErr {
    let m = e.to_string();
    match e.status() {
        Status::InvalidArgument => py_err("InvalidArgument", m),
        Status::OutOfMemory => py_err("OutOfMemory", m),
        Status::OutOfAddressSpace => py_err("OutOfAddressSpace", m),
        Status::UnknownAllocation => py_err("UnknownAllocation", m),
        Status::Pinned => py_err("Pinned", m),
        Status::Asleep => py_err("Asleep", m),
        Status::Stale => py_err("Stale", m),
        Status::Unsupported => py_err("Unsupported", m),
        Status::Driver => py_err("DriverError", m),
        _ => py_err("InternalError", m),
    }
}

/// A file descriptor: an int, or an object with `fileno()` (a socket).
fn fd_of(v: &Bound<'_, PyAny>) -> PyResult<i32> {
    let raw = if v.hasattr("fileno")? { v.call_method0("fileno")? } else { v.clone() };
    let n = u64_arg(&raw, "sock")?;
    i32::try_from(n).map_err(|_| py_err("InvalidArgument", format!("sock = {n} is not a file descriptor")))
}

/// A non-negative integer that fits in 64 bits: a wrong type is
/// `InvalidType` (a `TypeError`), a number out of range `InvalidArgument`.
fn u64_arg(v: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if v.is_instance_of::<pyo3::types::PyBool>() || !v.is_instance_of::<pyo3::types::PyInt>() {
        let ty = v.get_type().name().map_or("?".into(), |n| n.to_string());
        return Err(py_err("InvalidType", format!("{name} must be an int, not {ty}")));
    }
    match v.extract::<u64>() {
        Ok(n) => Ok(n),
        Err(_) => Err(py_err("InvalidArgument", format!("{name} = {v} is out of range (0 .. 2**64)"))),
    }
}

/// A positive size, or `default` for None (0 would silently mean a default).
fn opt_positive(v: Option<&Bound<'_, PyAny>>, name: &str, default: u64) -> PyResult<u64> {
    match v {
        Some(v) if !v.is_none() => match u64_arg(v, name)? {
            0 => Err(py_err("InvalidArgument", format!("{name} = 0: give a positive size, or None for the default"))),
            n => Ok(n),
        },
        _ => Ok(default),
    }
}

fn u32_arg(v: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    let n = u64_arg(v, name)?;
    u32::try_from(n).map_err(|_| py_err("InvalidArgument", format!("{name} = {n} is out of range (0 .. 2**32)")))
}

fn opt_u64(v: Option<&Bound<'_, PyAny>>, name: &str, default: u64) -> PyResult<u64> {
    match v {
        Some(v) if !v.is_none() => u64_arg(v, name),
        _ => Ok(default),
    }
}

/// What the DLPack views of a buffer hold: the arena and the count of
/// views alive (the buffer is pinned while it is not zero, or while the
/// caller pinned it).
struct Pins {
    views: usize,
    user: bool,
}

struct Shared {
    arena: RArena,
    /// The CUDA device (DLPack's device id).
    device: i32,
    /// Ids with views or a caller's pin, by id.
    pins: Mutex<std::collections::HashMap<u64, Pins>>,
    /// Ids of the live allocations made through this object (for `close`).
    ids: Mutex<std::collections::HashSet<u64>>,
    /// Set by `close`: no new allocation after it.
    closed: std::sync::atomic::AtomicBool,
    /// DLPack views of the whole range (`Arena.range_view`) alive.
    range_views: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// Refuses new allocations once closed.
    fn open(&self) -> PyResult<()> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(py_err("InvalidArgument", "the arena is closed"));
        }
        Ok(())
    }

    /// Books a new allocation as this object's: an `Allocation` (or a
    /// `Buffer`, for a growable one) over it.
    fn adopt(self: &Arc<Self>, py: Python<'_>, id: Id, growable: bool) -> PyResult<PyObject> {
        if let Ok(mut ids) = self.ids.lock() {
            ids.insert(id.get());
        }
        let a = Allocation { shared: self.clone(), id: id.get() };
        if growable {
            Ok(Py::new(py, PyClassInitializer::from(a).add_subclass(Buffer))?.into_any())
        } else {
            Ok(Py::new(py, a)?.into_any())
        }
    }

    /// Applies the pin the books say the id should have.
    fn sync_pin(&self, id: u64, was: bool, now: bool) -> Result<(), Error> {
        match (was, now) {
            (false, true) => self.arena.pin(Id::from_raw(id).ok_or_else(|| Error::InvalidArgument("id 0".into()))?),
            (true, false) => self.arena.unpin(Id::from_raw(id).ok_or_else(|| Error::InvalidArgument("id 0".into()))?),
            _ => Ok(()),
        }
    }

    fn pinned(&self, id: u64) -> bool {
        self.pins.lock().map(|p| p.get(&id).is_some_and(|p| p.user || p.views > 0)).unwrap_or(false)
    }

    fn views(&self, id: u64) -> usize {
        self.pins.lock().map(|p| p.get(&id).map_or(0, |p| p.views)).unwrap_or(0)
    }

    /// Changes the views or the caller's pin of `id`; pins or unpins it.
    fn change(&self, id: u64, f: impl FnOnce(&mut Pins)) -> Result<(), Error> {
        let mut all = self.pins.lock().map_err(|_| Error::Internal("pin books poisoned".into()))?;
        let p = all.entry(id).or_insert(Pins { views: 0, user: false });
        let was = p.user || p.views > 0;
        let before = (p.views, p.user);
        f(p);
        let now = p.user || p.views > 0;
        if let Err(e) = self.sync_pin(id, was, now) {
            (p.views, p.user) = before;
            return Err(e);
        }
        if !now {
            all.remove(&id);
        }
        Ok(())
    }
}

/// A backend's name as the constructors take it.
pub(crate) fn backend_arg(name: &str) -> PyResult<Backend> {
    match name {
        "cuda" => Ok(Backend::Cuda),
        "host" => Ok(Backend::Host),
        "host-sparse" => Ok(Backend::HostSparse),
        other => Err(py_err("InvalidArgument", format!("backend {other:?}: one of 'cuda', 'host', 'host-sparse'"))),
    }
}

fn id_of(v: &Bound<'_, PyAny>, arena: &Arc<Shared>) -> PyResult<Id> {
    if let Ok(a) = v.downcast::<Allocation>() {
        let a = a.borrow();
        if !Arc::ptr_eq(&a.shared, arena) {
            return Err(py_err("UnknownAllocation", "the allocation belongs to another arena"));
        }
        return Id::from_raw(a.id).ok_or_else(|| py_err("UnknownAllocation", "id 0"));
    }
    if let Ok(b) = v.downcast::<Buffer>() {
        let b = b.borrow();
        let a = b.as_super();
        if !Arc::ptr_eq(&a.shared, arena) {
            return Err(py_err("UnknownAllocation", "the buffer belongs to another arena"));
        }
        return Id::from_raw(a.id).ok_or_else(|| py_err("UnknownAllocation", "id 0"));
    }
    let raw = u64_arg(v, "id")?;
    Id::from_raw(raw).ok_or_else(|| py_err("UnknownAllocation", "id 0 is never issued"))
}

/// An arena over the CUDA backend (`backend="cuda"`) or host memory
/// (`backend="host"`), configured by keyword arguments.
#[pyclass(module = "vmm_arena._vmm_arena", subclass, frozen)]
struct Arena {
    shared: Arc<Shared>,
}

#[pymethods]
impl Arena {
    #[new]
    #[pyo3(signature = (*, backend="host", device=None, capacity_bytes=None, reserve_bytes=None, chunk_bytes=None, retain_bytes=None, no_implicit_moves=false, background=false, exportable=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: &str,
        device: Option<&Bound<'_, PyAny>>,
        capacity_bytes: Option<&Bound<'_, PyAny>>,
        reserve_bytes: Option<&Bound<'_, PyAny>>,
        chunk_bytes: Option<&Bound<'_, PyAny>>,
        retain_bytes: Option<&Bound<'_, PyAny>>,
        no_implicit_moves: bool,
        background: bool,
        exportable: bool,
    ) -> PyResult<Arena> {
        let backend = backend_arg(backend)?;
        let device = opt_u64(device, "device", 0)?;
        let device = i32::try_from(device)
            .map_err(|_| py_err("InvalidArgument", format!("device = {device} is out of range (0 .. 2**31)")))?;
        let config = ArenaConfig {
            backend,
            device,
            capacity_bytes: opt_positive(capacity_bytes, "capacity_bytes", 0)?,
            reserve_bytes: opt_positive(reserve_bytes, "reserve_bytes", 0)?,
            chunk_bytes: opt_positive(chunk_bytes, "chunk_bytes", 0)?,
            retain_bytes: opt_u64(retain_bytes, "retain_bytes", u64::MAX)?,
            no_implicit_moves,
            exportable,
            deterministic_placement: false,
            background,
        };
        let arena = py.allow_threads(|| RArena::new(config)).map_err(to_py)?;
        Ok(Arena {
            shared: Arc::new(Shared {
                arena,
                device,
                pins: Mutex::new(Default::default()),
                ids: Mutex::new(Default::default()),
                closed: Default::default(),
                range_views: Default::default(),
            }),
        })
    }

    /// Bytes of one physical chunk.
    #[getter]
    fn chunk_bytes(&self) -> u64 {
        self.shared.arena.chunk_bytes()
    }

    /// "cuda" or "host".
    #[getter]
    fn backend(&self) -> &'static str {
        self.shared.arena.backend_name()
    }

    /// (base address, bytes) of the reserved virtual range.
    #[getter]
    fn va_range(&self) -> (u64, u64) {
        self.shared.arena.va_range()
    }

    /// A fixed-size allocation (small ones, at most half a chunk, share
    /// slabs with allocations of the same tag only).
    #[pyo3(signature = (size, tag=None))]
    fn alloc(&self, py: Python<'_>, size: &Bound<'_, PyAny>, tag: Option<&Bound<'_, PyAny>>) -> PyResult<PyObject> {
        let size = u64_arg(size, "size")?;
        let tag = match tag {
            Some(t) if !t.is_none() => u32_arg(t, "tag")?,
            _ => 0,
        };
        self.shared.open()?;
        let (id, _) = py.allow_threads(|| self.shared.arena.alloc_tagged(size, tag)).map_err(to_py)?;
        self.shared.adopt(py, id, false)
    }

    /// A growable buffer: `size` bytes backed inside a reservation of
    /// `max_size`, growing in place up to it; viewable through DLPack.
    #[pyo3(signature = (size, max_size=None, tag=None))]
    fn alloc_growable(
        &self,
        py: Python<'_>,
        size: &Bound<'_, PyAny>,
        max_size: Option<&Bound<'_, PyAny>>,
        tag: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyObject> {
        let size = u64_arg(size, "size")?;
        let max = opt_u64(max_size, "max_size", size)?;
        let tag = match tag {
            Some(t) if !t.is_none() => u32_arg(t, "tag")?,
            _ => 0,
        };
        self.shared.open()?;
        let (id, _) = py.allow_threads(|| self.shared.arena.alloc_growable_tagged(size, max, tag)).map_err(to_py)?;
        self.shared.adopt(py, id, true)
    }

    /// Frees an allocation (an `Allocation`, a `Buffer` or a raw id).
    fn free(&self, py: Python<'_>, a: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_of(a, &self.shared)?;
        free_id(py, &self.shared, id, None)
    }

    /// Frees once the work queued on `stream` (a CUstream as an int, 0 the
    /// default stream) has passed this point.
    fn free_on_stream(&self, py: Python<'_>, a: &Bound<'_, PyAny>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_of(a, &self.shared)?;
        let stream = u64_arg(stream, "stream")?;
        free_id(py, &self.shared, id, Some(stream))
    }

    /// Resizes an allocation; returns its (maybe new) address.
    fn resize(&self, py: Python<'_>, a: &Bound<'_, PyAny>, new_size: &Bound<'_, PyAny>) -> PyResult<u64> {
        let id = id_of(a, &self.shared)?;
        resize_id(py, &self.shared, id, u64_arg(new_size, "new_size")?)
    }

    /// Moves unpinned allocations together; returns a dict of what it did.
    fn compact<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.allow_threads(|| self.shared.arena.compact()).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("moved_allocations", r.moved_allocations)?;
        d.set_item("moved_bytes", r.moved_bytes)?;
        d.set_item("largest_free_va_before", r.largest_free_va_before)?;
        d.set_item("largest_free_va_after", r.largest_free_va_after)?;
        Ok(d)
    }

    /// Gives pooled chunks back to the driver down to `keep_bytes`; returns
    /// the bytes given back.
    #[pyo3(signature = (keep_bytes=None))]
    fn trim(&self, py: Python<'_>, keep_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let keep = opt_u64(keep_bytes, "keep_bytes", 0)?;
        py.allow_threads(|| self.shared.arena.trim(keep)).map_err(to_py)
    }

    /// Unmaps the old addresses of moved allocations.
    fn release_retired(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.shared.arena.release_retired()).map_err(to_py)
    }

    /// The JSON snapshot: every range in address order, and the stats.
    fn snapshot_json(&self, py: Python<'_>) -> PyResult<String> {
        py.allow_threads(|| self.shared.arena.snapshot_json()).map_err(to_py)
    }

    /// Puts every allocation of `tag` (None: every tag) to sleep; with
    /// `backup`, their bytes are kept in host memory and come back on wake.
    #[pyo3(signature = (tag=None, backup=false))]
    fn sleep(&self, py: Python<'_>, tag: Option<&Bound<'_, PyAny>>, backup: bool) -> PyResult<()> {
        let tag = match tag {
            Some(t) if !t.is_none() => u32_arg(t, "tag")?,
            _ => ALL_TAGS,
        };
        let flags = if backup { SLEEP_BACKUP } else { 0 };
        py.allow_threads(|| self.shared.arena.sleep(tag, flags)).map_err(to_py)
    }

    /// Wakes every sleeping allocation of `tag` (None: every tag) at its address.
    #[pyo3(signature = (tag=None))]
    fn wake(&self, py: Python<'_>, tag: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let tag = match tag {
            Some(t) if !t.is_none() => u32_arg(t, "tag")?,
            _ => ALL_TAGS,
        };
        py.allow_threads(|| self.shared.arena.wake(tag)).map_err(to_py)
    }

    /// Keeps spent sleep backups for the next sleep (`keep=True`), or
    /// stops and frees what is kept. With it on, a wake keeps each backup
    /// buffer it wrote back (page-locked on CUDA) and a sleep reuses one of
    /// exactly the size it needs: a loop that sleeps and wakes the same
    /// allocations allocates host memory in its first cycle only.
    fn set_backup_cache(&self, keep: bool) -> PyResult<()> {
        self.shared.arena.set_backup_cache(keep).map_err(to_py)
    }

    /// Frees the kept backup buffers; returns their bytes.
    fn release_backup_cache(&self) -> PyResult<u64> {
        self.shared.arena.release_backup_cache().map_err(to_py)
    }

    /// Bytes of host memory the backup cache keeps.
    #[getter]
    fn backup_cache_bytes(&self) -> PyResult<u64> {
        self.shared.arena.backup_cache_bytes().map_err(to_py)
    }

    /// Installs `callback(id, old_ptr, new_ptr, size)`, called for every
    /// move (None removes it). It runs during the call that moved, with
    /// the arena locked: calls into the arena from it fail. An exception it
    /// raises is reported to `sys.unraisablehook` and changes nothing.
    #[pyo3(signature = (callback=None))]
    fn set_move_callback(&self, py: Python<'_>, callback: Option<PyObject>) -> PyResult<()> {
        let cb: Option<vmm_arena::MoveCallback> = match callback {
            None => None,
            Some(f) if f.is_none(py) => None,
            Some(f) => {
                if !f.bind(py).is_callable() {
                    return Err(py_err("InvalidArgument", "the move callback must be callable"));
                }
                Some(Box::new(move |e: &vmm_arena::MoveEvent| {
                    Python::with_gil(|py| {
                        if let Err(err) = f.call1(py, (e.id.get(), e.old_ptr, e.new_ptr, e.size)) {
                            err.write_unraisable(py, Some(f.bind(py)));
                        }
                    })
                }))
            }
        };
        py.allow_threads(|| self.shared.arena.set_move_callback(cb)).map_err(to_py)
    }

    /// Frees every allocation made through this object and gives the
    /// arena's pooled memory back; no allocation is accepted after it.
    /// Raises `Pinned` (and frees nothing) while a DLPack view is alive.
    /// Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let ids: Vec<u64> = self.shared.ids.lock().map(|i| i.iter().copied().collect()).unwrap_or_default();
        if let Some(id) = ids.iter().find(|id| self.shared.views(**id) > 0) {
            return Err(py_err("Pinned", format!("{id:#x} has DLPack views alive: release them before closing")));
        }
        let range_views = self.shared.range_views.load(std::sync::atomic::Ordering::Acquire);
        if range_views > 0 {
            return Err(py_err(
                "Pinned",
                format!("{range_views} DLPack views of the arena's range are alive: release them before closing"),
            ));
        }
        self.shared.closed.store(true, std::sync::atomic::Ordering::Release);
        for raw in ids {
            let Some(id) = Id::from_raw(raw) else { continue };
            if let Ok(mut p) = self.shared.pins.lock() {
                p.remove(&raw);
            }
            // Freed through a raw id elsewhere already: nothing left to do.
            match py.allow_threads(|| self.shared.arena.free(id)) {
                Ok(()) | Err(Error::UnknownAllocation(_)) => {}
                Err(e) => return Err(to_py(e)),
            }
            if let Ok(mut i) = self.shared.ids.lock() {
                i.remove(&raw);
            }
        }
        py.allow_threads(|| {
            self.shared.arena.release_retired()?;
            self.shared.arena.trim(0).map(|_| ())
        })
        .map_err(to_py)
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// Does the pooled-memory work the prefetch settings ask for (what the
    /// background worker does when `background=True`); best effort.
    fn maintain(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.shared.arena.maintain()).map_err(to_py)
    }

    /// Keeps `precreate_bytes` of chunks created ahead and maps
    /// `map_ahead_bytes` ahead of growing buffers (done by `maintain()` or
    /// the background worker); (0, 0) turns it off.
    fn set_prefetch(
        &self,
        py: Python<'_>,
        precreate_bytes: &Bound<'_, PyAny>,
        map_ahead_bytes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (p, m) = (u64_arg(precreate_bytes, "precreate_bytes")?, u64_arg(map_ahead_bytes, "map_ahead_bytes")?);
        py.allow_threads(|| self.shared.arena.set_prefetch(p, m)).map_err(to_py)
    }

    /// A new growable buffer mapping `nbytes` of `src` from `src_offset`
    /// (whole chunks: a prefix shared without a copy), growable up to
    /// `max_size`.
    #[pyo3(signature = (src, src_offset, nbytes, max_size=None))]
    fn alloc_shared(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        src_offset: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        max_size: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyObject> {
        self.shared.open()?;
        let src = id_of(src, &self.shared)?;
        let off = u64_arg(src_offset, "src_offset")?;
        let n = u64_arg(nbytes, "nbytes")?;
        let max = opt_u64(max_size, "max_size", n)?;
        let (id, _) = py.allow_threads(|| self.shared.arena.alloc_shared(src, off, n, max)).map_err(to_py)?;
        self.shared.adopt(py, id, true)
    }

    /// Sends an allocation to another process over a connected Unix socket
    /// (`sock`: a file descriptor, or an object with `fileno()`): its
    /// chunks' descriptors and layout, which the receiver's
    /// `import_recv` maps at an address of its own (the same memory: writes
    /// on either side are seen on the other). The arena must be made with
    /// `exportable=True` (else `Unsupported`). From the first export on the
    /// allocation is pinned and cannot shrink below what was sent.
    fn export_send(&self, py: Python<'_>, alloc: &Bound<'_, PyAny>, sock: &Bound<'_, PyAny>) -> PyResult<()> {
        self.shared.open()?;
        let id = id_of(alloc, &self.shared)?;
        let fd = fd_of(sock)?;
        py.allow_threads(|| {
            let export = self.shared.arena.export(id)?;
            // SAFETY: `fd` is the caller's open descriptor for the duration
            // of this call (checked to be non-negative by `fd_of`).
            let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            export.send(sock)
        })
        .map_err(to_py)
    }

    /// Receives what another process's `export_send` sent on `sock` and
    /// maps it here: a new allocation of the same memory (with
    /// `read_only=True`, mapped readable only). Freeing it unmaps it here
    /// only. `InvalidArgument` for a peer that sent something else.
    #[pyo3(signature = (sock, read_only=false))]
    fn import_recv(&self, py: Python<'_>, sock: &Bound<'_, PyAny>, read_only: bool) -> PyResult<PyObject> {
        self.shared.open()?;
        let fd = fd_of(sock)?;
        let (id, _) = py
            .allow_threads(|| {
                // SAFETY: as in `export_send`.
                let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
                self.shared.arena.import_from_socket(sock, read_only)
            })
            .map_err(to_py)?;
        self.shared.adopt(py, id, false)
    }

    /// Resizes several allocations at once, all or nothing:
    /// `requests` is [(allocation or id, new size)]; returns their addresses.
    fn resize_many(&self, py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let mut reqs = Vec::new();
        for item in requests.try_iter().map_err(|_| py_err("InvalidType", "requests must be an iterable of pairs"))? {
            let item = item?;
            let (a, n): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                item.extract().map_err(|_| py_err("InvalidType", "each request is an (allocation, new size) pair"))?;
            let id = id_of(&a, &self.shared)?;
            let n = u64_arg(&n, "new size")?;
            if self.shared.views(id.get()) > 0 {
                let size = py.allow_threads(|| self.shared.arena.query(id)).map_err(to_py)?.size;
                if n < size {
                    return Err(py_err("Pinned", format!("{:#x} has DLPack views alive: it cannot shrink", id.get())));
                }
            }
            reqs.push((id, n));
        }
        py.allow_threads(|| self.shared.arena.resize_many(&reqs)).map_err(to_py)
    }

    /// Promises that the work queued on `stream` so far is the last that
    /// touches the allocation until `unquiesce` (see the Rust API).
    fn quiesce_on_stream(&self, py: Python<'_>, a: &Bound<'_, PyAny>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_of(a, &self.shared)?;
        let stream = u64_arg(stream, "stream")?;
        py.allow_threads(|| self.shared.arena.quiesce_on_stream(id, stream)).map_err(to_py)
    }

    /// Ends the promise of `quiesce_on_stream`.
    fn unquiesce(&self, py: Python<'_>, a: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_of(a, &self.shared)?;
        py.allow_threads(|| self.shared.arena.unquiesce(id)).map_err(to_py)
    }

    /// The arena's whole reserved range as a DLPack-viewable object
    /// (`vmm_arena.layout` cuts per-layer KV views from it; see
    /// `ArenaRange`).
    fn range_view(&self) -> PyResult<layout::ArenaRange> {
        layout::ArenaRange::of(self)
    }

    /// The stats as a dict of ints, every field of the Rust `Stats` (the
    /// package's `Arena.stats()` types it).
    fn stats_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.allow_threads(|| self.shared.arena.stats()).map_err(to_py)?;
        stats_to_dict(py, &s)
    }
}

/// Every field of `vmm_arena::Stats`, by name.
pub(crate) fn stats_to_dict<'py>(py: Python<'py>, s: &vmm_arena::Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    macro_rules! put {
        ($($f:ident)*) => { $( d.set_item(stringify!($f), s.$f)?; )* };
    }
    put!(live_allocations live_bytes mapped_bytes pooled_bytes peak_physical_bytes capacity_bytes reserved_va_bytes free_va_bytes largest_free_va_bytes retired_va_bytes moves driver_creates driver_releases driver_maps driver_unmaps driver_access_calls driver_syncs chunk_bytes cached_mapped_bytes idle_cached_bytes unmapped_pooled_bytes release_failures reserve_fallbacks bytes_copied small_slabs asleep_bytes backup_bytes imported_allocations imported_bytes exported_allocations caller_driver_calls caller_creates caller_syncs maintain_driver_calls stream_frees stream_shrinks quiesces event_polls event_waits pending_free_bytes prefetched_bytes maintain_failures shared_bytes);
    Ok(d)
}

fn free_id(py: Python<'_>, shared: &Arc<Shared>, id: Id, stream: Option<u64>) -> PyResult<()> {
    if shared.views(id.get()) > 0 {
        return Err(py_err("Pinned", format!("{:#x} has DLPack views alive: release them before freeing", id.get())));
    }
    py.allow_threads(|| match stream {
        None => shared.arena.free(id),
        Some(s) => shared.arena.free_on_stream(id, s),
    })
    .map_err(to_py)?;
    if let Ok(mut p) = shared.pins.lock() {
        p.remove(&id.get());
    }
    if let Ok(mut ids) = shared.ids.lock() {
        ids.remove(&id.get());
    }
    Ok(())
}

fn resize_id(py: Python<'_>, shared: &Arc<Shared>, id: Id, new_size: u64) -> PyResult<u64> {
    if shared.views(id.get()) > 0 {
        let size = py.allow_threads(|| shared.arena.query(id)).map_err(to_py)?.size;
        if new_size < size {
            return Err(py_err(
                "Pinned",
                format!(
                    "{:#x} has DLPack views alive over its {size} bytes: it cannot shrink until they are released",
                    id.get()
                ),
            ));
        }
    }
    py.allow_threads(|| shared.arena.resize(id, new_size)).map_err(to_py)
}

/// One allocation of an arena. Freed by `free()` (or the arena's), not by
/// garbage collection: the arena owns the memory.
#[pyclass(module = "vmm_arena._vmm_arena", subclass, frozen)]
struct Allocation {
    shared: Arc<Shared>,
    id: u64,
}

impl Allocation {
    fn rid(&self) -> PyResult<Id> {
        Id::from_raw(self.id).ok_or_else(|| py_err("UnknownAllocation", "id 0"))
    }

    fn info(&self, py: Python<'_>) -> PyResult<vmm_arena::AllocInfo> {
        let id = self.rid()?;
        py.allow_threads(|| self.shared.arena.query(id)).map_err(to_py)
    }

    /// `length` bytes from `offset` (default: to the end) through `read`,
    /// which is `Arena::read` or `Arena::read_backup`.
    fn read_with<'py>(
        &self,
        py: Python<'py>,
        offset: Option<&Bound<'_, PyAny>>,
        length: Option<&Bound<'_, PyAny>>,
        read: impl Fn(&vmm_arena::Arena, Id, u64, &mut [u8]) -> vmm_arena::Result<()> + Send + Sync,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let id = self.rid()?;
        let off = opt_u64(offset, "offset", 0)?;
        let size = self.info(py)?.size;
        let len = opt_u64(length, "length", size.saturating_sub(off))?;
        let len = usize::try_from(len).map_err(|_| py_err("InvalidArgument", "length too large"))?;
        if len as u64 > size {
            return Err(py_err("InvalidArgument", format!("length {len} exceeds the allocation's {size} bytes")));
        }
        let mut out = vec![0u8; len];
        py.allow_threads(|| read(&self.shared.arena, id, off, &mut out)).map_err(to_py)?;
        Ok(pyo3::types::PyBytes::new(py, &out))
    }
}

#[pymethods]
impl Allocation {
    /// The id the arena knows it by.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// Its current address (it may change when it moves).
    #[getter]
    fn ptr(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.info(py)?.ptr)
    }
    #[getter]
    fn size(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.info(py)?.size)
    }
    #[getter]
    fn reserved_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.info(py)?.reserved_bytes)
    }
    #[getter]
    fn tag(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(self.info(py)?.tag)
    }
    #[getter]
    fn asleep(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.info(py)?.asleep)
    }
    #[getter]
    fn pinned(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.info(py)?.pinned)
    }
    #[getter]
    fn growable(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.info(py)?.growable)
    }
    /// Sets its tag (a small one moves into a slab of the new tag).
    fn set_tag(&self, py: Python<'_>, tag: &Bound<'_, PyAny>) -> PyResult<()> {
        let (id, tag) = (self.rid()?, u32_arg(tag, "tag")?);
        py.allow_threads(|| self.shared.arena.set_tag(id, tag)).map_err(to_py)
    }
    fn resize(&self, py: Python<'_>, new_size: &Bound<'_, PyAny>) -> PyResult<u64> {
        resize_id(py, &self.shared, self.rid()?, u64_arg(new_size, "new_size")?)
    }
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        free_id(py, &self.shared, self.rid()?, None)
    }
    fn free_on_stream(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        free_id(py, &self.shared, self.rid()?, Some(u64_arg(stream, "stream")?))
    }
    /// Pins it: it never moves until unpinned. A sleeping one raises
    /// `Asleep` (DLPack views alive or not).
    fn pin(&self, py: Python<'_>) -> PyResult<()> {
        if self.info(py)?.asleep {
            return Err(py_err("Asleep", format!("{:#x} sleeps: wake its tag before pinning it", self.id)));
        }
        self.shared.change(self.id, |p| p.user = true).map_err(to_py)
    }
    fn unpin(&self, py: Python<'_>) -> PyResult<()> {
        let _ = self.info(py)?;
        self.shared.change(self.id, |p| p.user = false).map_err(to_py)
    }
    /// Copies `data` in at `offset`: any bytes-like object (bytes,
    /// bytearray, memoryview, array.array, a numpy array: its bytes in C
    /// order, whatever its item type).
    #[pyo3(signature = (data, offset=None))]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let (id, off) = (self.rid()?, opt_u64(offset, "offset", 0)?);
        let owned;
        let bytes: &[u8] = if let Ok(b) = data.downcast::<pyo3::types::PyBytes>() {
            b.as_bytes()
        } else {
            let view = pyo3::types::PyMemoryView::from(data).map_err(|_| {
                let ty = data.get_type().name().map_or("?".into(), |n| n.to_string());
                py_err("InvalidType", format!("data must be a bytes-like object, not {ty}"))
            })?;
            owned = view.call_method0("tobytes")?.downcast_into::<pyo3::types::PyBytes>()?;
            owned.as_bytes()
        };
        py.allow_threads(|| self.shared.arena.write(id, off, bytes)).map_err(to_py)
    }
    /// `length` bytes from `offset` (default: all of it).
    #[pyo3(signature = (offset=None, length=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: Option<&Bound<'_, PyAny>>,
        length: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        self.read_with(py, offset, length, |a, id, off, out| a.read(id, off, out))
    }
    /// `length` bytes from `offset` (default: all of it) of the backup a
    /// sleeping allocation took with `sleep(tag, backup=True)`, without
    /// waking it; `InvalidArgument` when it has none (awake, or slept
    /// without a backup).
    #[pyo3(signature = (offset=None, length=None))]
    fn read_backup<'py>(
        &self,
        py: Python<'py>,
        offset: Option<&Bound<'_, PyAny>>,
        length: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        self.read_with(py, offset, length, |a, id, off, out| a.read_backup(id, off, out))
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        match self.info(py) {
            Ok(i) => format!("<vmm_arena allocation {:#x}: {} bytes at {:#x}, tag {}>", self.id, i.size, i.ptr, i.tag),
            Err(_) => format!("<vmm_arena allocation {:#x} (freed)>", self.id),
        }
    }
}

/// A growable allocation, viewable through DLPack as a 1-D array of bytes.
///
/// The rule for views: a view (`numpy.from_dlpack(buf)`,
/// `torch.from_dlpack(buf)`) covers the bytes the buffer had when it was
/// taken, at the address it had then. While any view is alive the buffer
/// is pinned: compaction leaves it, growth within its reservation is in
/// place (the view stays valid, and does not see the new bytes: take a new
/// view), growth past its reservation, a shrink and `free` are refused
/// (`Pinned`). Sleep keeps the address: views are valid again after wake,
/// and must not be touched while it sleeps.
#[pyclass(module = "vmm_arena._vmm_arena", extends = Allocation, frozen)]
struct Buffer;

#[pymethods]
impl Buffer {
    /// A DLPack capsule viewing the buffer's bytes as uint8[size], no copy.
    /// `stream` and the other keywords of the protocol are accepted; the
    /// arena's memory is ordinary device memory, so no stream work is needed.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: PyRef<'py, Self>,
        py: Python<'py>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, dl_device);
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err("vmm_arena buffers are viewed, never copied"));
        }
        let a = slf.as_super();
        let info = a.info(py)?;
        if info.asleep {
            return Err(py_err("Asleep", format!("{:#x} sleeps: wake its tag before viewing it", a.id)));
        }
        let len = i64::try_from(info.size).map_err(|_| py_err("InvalidArgument", "too large"))?;
        // Pinned from here until the consumer releases the view.
        a.shared.change(a.id, |p| p.views += 1).map_err(to_py)?;
        // The address after pinning (pinning does not move it).
        let ptr = match a.info(py) {
            Ok(i) => i.ptr,
            Err(e) => {
                let _ = a.shared.change(a.id, |p| p.views -= 1);
                return Err(e);
            }
        };
        // DLPack 1.0 (writable views) when the consumer asks for it.
        let versioned =
            max_version.as_ref().and_then(|v| v.extract::<(u32, u32)>(py).ok()).is_some_and(|(major, _)| major >= 1);
        let ctx = ViewCtx { shape: [len], shared: a.shared.clone(), viewed: Viewed::Buffer(a.id) };
        capsule(py, ptr, dl_device_of(&a.shared), ctx, versioned)
    }

    /// (device type, device id): kDLCPU (1) on the host backend, kDLCUDA (2) on CUDA.
    fn __dlpack_device__(slf: PyRef<'_, Self>) -> (i32, i32) {
        let d = dl_device_of(&slf.as_super().shared);
        (d.device_type, d.device_id)
    }

    /// DLPack views alive now.
    #[getter]
    fn views(slf: PyRef<'_, Self>) -> usize {
        let a = slf.as_super();
        a.shared.views(a.id)
    }
}

/// Where the arena's memory lives, as DLPack says it: the CUDA device, or
/// the CPU on the host backends.
fn dl_device_of(shared: &Shared) -> DLDevice {
    if shared.arena.backend_name() == "cuda" {
        DLDevice { device_type: KDLCUDA, device_id: shared.device }
    } else {
        DLDevice { device_type: KDLCPU, device_id: 0 }
    }
}

/// Whether the caller pinned, or views pin, an allocation (for tests).
#[pyfunction]
fn _pinned_by_views(a: PyRef<'_, Allocation>) -> bool {
    a.shared.pinned(a.id)
}

#[pymodule]
fn _vmm_arena(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Arena>()?;
    m.add_class::<group::Group>()?;
    m.add_class::<Allocation>()?;
    m.add_class::<Buffer>()?;
    m.add_function(wrap_pyfunction!(_pinned_by_views, m)?)?;
    layout::add_classes(m)?;
    use torch_hooks::*;
    m.add_function(wrap_pyfunction!(_hooks_configure, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_set_tag, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_tag, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_devices, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_backend, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_allocations, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_sleep, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_wake, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_backup_cache, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_retag, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_stats, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_release, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_preload_library, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_set_margin, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_margin, m)?)?;
    m.add_function(wrap_pyfunction!(_hooks_cpu_backup, m)?)?;
    m.add("ALL_TAGS", ALL_TAGS)?;
    Ok(())
}
