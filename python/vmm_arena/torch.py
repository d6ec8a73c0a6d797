"""vmm_arena under PyTorch: pausable regions with torch_memory_saver's meaning.

    import vmm_arena.torch as vt
    with vt.region("weights", enable_cpu_backup=True):
        model = build_model().cuda()
    with vt.region("kv_cache"):
        kv = torch.empty(..., device="cuda")
    vt.pause()            # every region's memory back to the driver, all devices
    vt.resume()           # same addresses; the weights' bytes restored

The allocator is the extension module itself: it exports the PyTorch hooks
`vmm_arena_torch_malloc_or_throw` and `vmm_arena_torch_free`, loaded by
`torch.cuda.memory.CUDAPluggableAllocator(vmm_arena.torch.library_path(),
...)`; `pip install ./python` is the whole install. Inside a `region`,
PyTorch allocates from a `torch.cuda.MemPool` over that allocator (one pool
per tag and backup choice, as torch_memory_saver does); outside, PyTorch's
own allocator serves, and that memory is never paused. `use()` instead makes
the arena PyTorch's allocator for everything (memory outside a region is
then the arena's too, and still never paused).

Each device's arena is created on first use, configured by `configure()` or
else $VMM_ARENA_CONF (`backend:auto|cuda|host|host-sparse`, `capacity:`,
`reserve:`, `chunk:`, `retain:`; sizes take KiB/MiB/GiB/TiB). `auto`, the
default, is the CUDA backend, or the host one (with a warning) where CUDA
cannot start: `backend()` says which.

Tags: a region's name (any str or int) and its backup choice select one
arena tag; memory outside any region has tag 0 and `pause()` never touches
it. `pause(tag=None)` sleeps every region's memory (or one name's) on every
device with an arena, backing up the bytes of allocations made with
`enable_cpu_backup=True`; `resume(tag=None)` maps them back at the same
addresses. Every allocation PyTorch makes is pinned: nothing moves.
"""

import contextlib
import ctypes
import hashlib
import os
import threading
import warnings

from . import _vmm_arena as _ext

OUTSIDE = 0  # the tag of memory outside any region: never paused
RESIDENT = 1  # the tag keep_resident() gives: never paused

_lock = threading.Lock()
_names = {}  # region name -> index (1, 2, ...); tags 2*index (+1 with backup)
_pools = {}  # tag -> torch.cuda.MemPool over the arena
_allocator = None  # the CUDAPluggableAllocator, once made
_replaced = False  # use() made the arena PyTorch's allocator
_preload_mode = False  # set_hook_mode("preload"): cudaMalloc in a region is the arena's
_conf = None  # what configure() set, passed on to children by configure_subprocess()
_warned = set()


def library_path():
    """The file holding the PyTorch allocator entry points: the installed
    extension module (no other build or library needed)."""
    return _ext.__file__


def _load(library=None):
    """The extension module as a ctypes library (the hooks PyTorch calls),
    with argument types set. `library` is accepted for compatibility and
    must be None or this very file."""
    if library not in (None, library_path()):
        raise ValueError("the hooks live in the extension module; library= is no longer needed")
    lib = ctypes.CDLL(library_path())
    lib.vmm_arena_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vmm_arena_torch_malloc.restype = ctypes.c_void_p
    lib.vmm_arena_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vmm_arena_torch_free.restype = None
    lib.vmm_arena_torch_last_error.restype = ctypes.c_char_p
    return lib


def configure(conf):
    """Sets the arenas' configuration (VMM_ARENA_CONF's syntax, e.g.
    "backend:host,capacity:8GiB"); only before the first allocation."""
    global _conf
    _ext._hooks_configure(conf)
    _conf = conf


def _index(name):
    if isinstance(name, bool) or not isinstance(name, (str, int)):
        raise TypeError(f"a region's tag is a str or an int, not {type(name).__name__}")
    with _lock:
        return _names.setdefault(name, len(_names) + 1)


def tag_of(name, enable_cpu_backup=False):
    """The arena tag of a region name and backup choice (0 for None: no region)."""
    if name is None:
        return OUTSIDE
    return 2 * _index(name) + (1 if enable_cpu_backup else 0)


def name_of(tag):
    """The region name of an arena tag (None for memory outside a region)."""
    if tag < 2:
        return None
    idx = tag // 2
    with _lock:
        return next((n for n, i in _names.items() if i == idx), None)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cuda():
    """torch.cuda where PyTorch and a device are present, else None."""
    torch = _torch()
    return torch.cuda if torch is not None and torch.cuda.is_available() else None


def _pluggable():
    global _allocator
    torch = _torch()
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free"
            )
        return _allocator


def use():
    """Makes the arena PyTorch's CUDA allocator for every allocation (before
    any CUDA tensor exists). Returns the CUDAPluggableAllocator."""
    global _replaced
    cuda = _cuda()
    if cuda is None:
        raise RuntimeError("vmm_arena.torch.use() needs CUDA")
    alloc = _pluggable()
    if not _replaced:
        cuda.memory.change_current_allocator(alloc)
        _replaced = True
    return alloc


def mem_pool(tag=None, enable_cpu_backup=False):
    """The torch.cuda.MemPool over the arena whose allocations carry the tag
    of (`tag`, `enable_cpu_backup`) (one pool per tag, kept)."""
    t = tag_of(tag, enable_cpu_backup)
    torch = _torch()
    if _cuda() is None or not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError("a MemPool needs CUDA and a PyTorch with torch.cuda.MemPool")
    # In preload mode PyTorch's own allocator serves the pool: its cudaMalloc
    # calls are the arena's, with the region's tag.
    alloc = None if _preload_mode else _pluggable()
    with _lock:
        if t not in _pools:
            _pools[t] = torch.cuda.MemPool() if alloc is None else torch.cuda.MemPool(alloc.allocator())
        return _pools[t]


@contextlib.contextmanager
def _thread_tag(t):
    prev = _ext._hooks_set_tag(t)
    try:
        yield
    finally:
        _ext._hooks_set_tag(prev)


@contextlib.contextmanager
def region(tag="default", enable_cpu_backup=False):
    """Memory PyTorch allocates on this thread inside carries `tag` and pauses
    and resumes with it; with `enable_cpu_backup` its bytes survive a pause
    (the choice is per allocation: one name may have both kinds). Yields the
    arena tag."""
    t = tag_of(tag, enable_cpu_backup)
    _warn_if_fallback()
    with _thread_tag(t):
        if _cuda() is not None and not _replaced:
            torch = _torch()
            with torch.cuda.use_mem_pool(mem_pool(tag, enable_cpu_backup)):
                yield t
        else:
            yield t


@contextlib.contextmanager
def disable():
    """Inside a region: memory allocated here is outside any region (PyTorch's
    own allocator where the arena is not PyTorch's allocator; tag 0, never
    paused)."""
    with _thread_tag(OUTSIDE):
        torch = _torch()
        if _cuda() is not None and not _replaced and hasattr(torch.cuda, "MemPool"):
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                yield
            del pool
        else:
            yield


@contextlib.contextmanager
def cuda_graph(cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default",
               enable_cpu_backup=False):
    """`torch.cuda.graph(...)` whose memory comes from the arena under `tag`
    (the region's pool unless `pool` is given), so that it pauses and
    resumes with that tag. Needs CUDA."""
    torch = _torch()
    with region(tag, enable_cpu_backup):
        if pool is None and not _replaced:
            pool = mem_pool(tag, enable_cpu_backup).id
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield cuda_graph


PRELOAD_LIBRARY_NAME = "libvmm_arena_preload.so"


def _write_if_changed(path, data):
    """Makes `path` hold `data` (written aside, then renamed over it)."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def preload_library():
    """The path of the LD_PRELOAD library (libvmm_arena_preload.so): under it,
    a process's raw cudaMalloc/cudaMallocAsync calls made inside a region go
    to these hooks' arenas, with the region's tag, so pause()/resume() cover
    them (outside a region they go to the CUDA runtime, as in
    torch_memory_saver; $VMM_ARENA_PRELOAD_ALL=1 sends them to the arena too,
    tag 0), and cudaFree/cudaFreeAsync of the arenas' pointers come back. It is part of the extension module and written out on first
    call, next to it (or, where that directory is read-only, into
    $XDG_CACHE_HOME/vmm_arena/, default ~/.cache). See configure_subprocess()."""
    data = _ext._hooks_preload_library()
    digest = hashlib.sha256(data).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates = [
        os.path.join(os.path.dirname(library_path()), PRELOAD_LIBRARY_NAME),
        os.path.join(cache, "vmm_arena", digest, PRELOAD_LIBRARY_NAME),
    ]
    errors = []
    for path in candidates:
        try:
            _write_if_changed(path, data)
            return path
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise RuntimeError("vmm_arena: cannot write the preload library: " + "; ".join(errors))


def preloaded():
    """Whether this process runs with the preload library active: its
    cudaMalloc calls in regions are the arenas' (see configure_subprocess())."""
    try:
        active = ctypes.CDLL(None).vmm_arena_preload_active
    except AttributeError:
        return False
    active.restype = ctypes.c_int
    return active() == 1


@contextlib.contextmanager
def configure_subprocess():
    """Inside, child processes (subprocess, multiprocessing) start with the
    preload library: $LD_PRELOAD gets preload_library() (in front of what it
    held), $VMM_ARENA_PRELOAD_HOOKS names the extension module holding the
    hooks, and $VMM_ARENA_CONF what configure() set, if it was called. The
    environment is restored on exit. A child that never loads CUDA (a shell)
    runs unchanged under it."""
    env = {"LD_PRELOAD": preload_library(), "VMM_ARENA_PRELOAD_HOOKS": library_path()}
    previous = os.environ.get("LD_PRELOAD")
    if previous:
        env["LD_PRELOAD"] += " " + previous
    if _conf is not None:
        env["VMM_ARENA_CONF"] = _conf
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hook_mode():
    """"torch" (regions allocate through a MemPool over the hooks) or
    "preload" (this process runs under the preload library)."""
    return "preload" if _preload_mode else "torch"


def set_hook_mode(mode):
    """Chooses how regions catch allocations: "torch", the default (a
    MemPool over the hooks, as CUDAPluggableAllocator), or "preload" (a
    MemPool of PyTorch's own allocator, whose cudaMalloc calls the preload
    library routes to the arenas with the region's tag; raw cudaMalloc from
    NCCL or extensions inside a region is caught too). "preload" needs this
    process started under the library (configure_subprocess()); without it
    a RuntimeError says so. Before the first region."""
    global _preload_mode
    if mode not in ("torch", "preload"):
        raise ValueError(f"hook_mode {mode!r}: 'torch' or 'preload'")
    if mode == "preload" and not preloaded():
        raise RuntimeError(
            "hook_mode 'preload' needs this process started with LD_PRELOAD=vmm_arena.torch.preload_library() "
            "(start it inside vmm_arena.torch.configure_subprocess())")
    with _lock:
        if _pools and (mode == "preload") != _preload_mode:
            raise RuntimeError("set the hook mode before the first region")
        _preload_mode = mode == "preload"


def devices():
    """The devices whose arenas exist (every one pause and resume act on)."""
    return _ext._hooks_devices()


def backend(device=0):
    """(backend, reason): "cuda", or "host" with why CUDA was not used (None
    when the host backend was asked for). Creates the device's arena."""
    return _ext._hooks_backend(device)


def _warn_if_fallback(device=0):
    if device in _warned:
        return
    name, why = backend(device)
    if why is not None:
        _warned.add(device)
        warnings.warn(f"vmm_arena: no usable CUDA ({why}); the arena of device {device} is host memory",
                      RuntimeWarning, stacklevel=3)


def allocations(device=0):
    """[(ptr, bytes, tag)] of the live allocations the hooks handed out."""
    return _ext._hooks_allocations(device)


def _region_tags(device, select):
    """The region tags with live memory on `device` that `select(name)` picks."""
    tags = sorted({t for _, _, t in allocations(device) if t >= 2})
    return [t for t in tags if select(name_of(t))]


def _synchronize():
    cuda = _cuda()
    if cuda is not None:
        for d in devices():
            with cuda.device(d):
                cuda.synchronize()


def _sleep(select, backup_of):
    """Sleeps the region tags `select` picks on every device, each with the
    backup `backup_of(tag)` says."""
    _synchronize()
    for d in devices():
        for t in _region_tags(d, select):
            _ext._hooks_sleep(d, t, backup_of(t))


def _wake(select):
    for d in devices():
        for t in _region_tags(d, select):
            _ext._hooks_wake(d, t)


def _selector(tag):
    if tag is None:
        return lambda name: True
    _index(tag)  # type check
    return lambda name: name == tag


def pause(tag=None):
    """Gives the physical memory of every region (None) or of region `tag`
    back to the driver on every device, after the device's work; addresses
    stay. Allocations made with enable_cpu_backup keep their bytes. Memory
    outside any region and kept-resident memory are never touched."""
    _sleep(_selector(tag), lambda t: bool(t & 1))


def resume(tag=None):
    """Maps memory back for every region (None) or region `tag`, at the same
    addresses, on every device."""
    _wake(_selector(tag))


def keep_resident(x, device=None):
    """Keeps the allocation containing `x` (a tensor, or an address with
    `device`) out of every later pause; returns its bytes, 0 for an empty
    tensor or memory the arena did not allocate. Refused for a paused one
    (Asleep) and for a small allocation that shares a slab (Pinned: it
    would have to move)."""
    if hasattr(x, "data_ptr"):
        if x.numel() == 0:
            return 0
        ptr = x.data_ptr()
        device = x.device.index if x.device.index is not None else 0
    else:
        ptr = int(x)
    return _ext._hooks_retag(device or 0, ptr, RESIDENT)


def set_memory_margin(margin_bytes):
    """torch_memory_saver's `memory_margin_bytes`: every later allocation
    through the hooks (on every device) that would leave less than
    `margin_bytes` of its arena's capacity free (neither mapped nor pooled)
    is refused, as out of memory; 0 turns the rule off. The capacity is the
    arena's (`configure("capacity:...")`, by default the device's memory):
    memory other processes take on the device is not counted."""
    if isinstance(margin_bytes, bool) or not isinstance(margin_bytes, int):
        raise TypeError(f"memory_margin_bytes is an int, not {type(margin_bytes).__name__}")
    if not 0 <= margin_bytes < 1 << 64:
        from .errors import InvalidArgument

        raise InvalidArgument(f"memory_margin_bytes {margin_bytes} is out of range")
    _ext._hooks_set_margin(margin_bytes)


def memory_margin():
    """The margin set by set_memory_margin() (0: none)."""
    return _ext._hooks_margin()


def cpu_backup(ptr, nbytes, device=0):
    """The `nbytes` bytes at address `ptr` from the host backup of the paused
    allocation holding them, or None when it has none (awake, or paused
    without a backup) or `ptr` is not memory the hooks handed out."""
    return _ext._hooks_cpu_backup(device, ptr, nbytes)


def get_cpu_backup(x):
    """torch_memory_saver's get_cpu_backup: a CPU tensor (x's dtype, shape
    and strides, made contiguous) holding the bytes a paused tensor's
    backup kept, or None when x is not paused with enable_cpu_backup=True
    (or not the arena's memory). x stays paused."""
    torch = _torch()
    if x.numel() == 0:
        return None
    device = x.device.index if x.device.index is not None else 0
    if x.is_contiguous():
        nbytes = x.numel() * x.element_size()
        data = cpu_backup(x.data_ptr(), nbytes, device)
        if data is None:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(x.dtype).reshape(x.shape)
    storage = x.untyped_storage()
    data = cpu_backup(storage.data_ptr(), storage.nbytes(), device)
    if data is None:
        return None
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(x.dtype)
    return flat.as_strided(x.shape, x.stride(), x.storage_offset()).clone()


def stats(device=0):
    """The device's arena stats (vmm_arena.Stats), None before its first use;
    `other` holds bad_frees, frees of pointers the hooks never handed out."""
    from . import Stats

    d = _ext._hooks_stats(device)
    return None if d is None else Stats._from_dict(d)


def keep_backups(keep=True, device=None):
    """Keeps the host buffers of paused allocations' backups across pause and
    resume cycles (page-locked on CUDA), so that after the first cycle a
    pause allocates no host memory (an RL loop pausing the same tensors every
    step); `keep_backups(False)` frees them. On every device whose arena
    exists (or `device`); returns the bytes freed."""
    devices = _ext._hooks_devices() if device is None else [device]
    return sum(_ext._hooks_backup_cache(d, bool(keep)) for d in devices)


def release(device=0):
    """Drops the device's arena, giving all its memory (and host backups)
    back, when the hooks hold no live allocation there; returns whether it did."""
    return _ext._hooks_release(device)
