"""vmm_arena as PyTorch's CUDA allocator, with torch_memory_saver's pause and
resume by tag.

    import vmm_arena.torch as vt
    vt.use()                                   # before the first CUDA tensor
    with vt.region("weights", enable_cpu_backup=True):
        model = build_model().cuda()
    with vt.region("kv_cache"):
        kv = torch.empty(..., device="cuda")
    vt.pause()                                 # memory back to the driver
    vt.resume()                                # same addresses; weights restored

The allocator is the C library's PyTorch entry points (libvmm_arena.so,
built by `cargo build --release -p vmm-arena-ffi`), loaded through
`torch.cuda.memory.CUDAPluggableAllocator`: the library is found at
`library=`, else $VMM_ARENA_LIBRARY, else target/release/libvmm_arena.so
of the repository this package was built from. The arena is configured by
$VMM_ARENA_CONF (see ffi/src/torch.rs). Every allocation PyTorch makes is
pinned (PyTorch keeps raw pointers): nothing moves.

Tags: the names given to `region` map to small integers (the first name
1, the next 2, ...; outside any region, tag 0). `pause(tag=None)` sleeps
that tag (None: every tag), backing up the bytes of tags whose region asked
for `enable_cpu_backup`; `resume(tag=None)` wakes them at the same
addresses. Needs CUDA: on a machine without it `use()` raises RuntimeError.
"""

import contextlib
import ctypes
import os
import threading

_ALL_TAGS = 0xFFFFFFFF
_SLEEP_BACKUP = 1
_lock = threading.Lock()
_tags = {}
_backup = set()
_lib = None
_allocator = None


def _library_path(library=None):
    if library:
        return library
    env = os.environ.get("VMM_ARENA_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (os.path.join(here, "..", ".."), os.getcwd()):
        cand = os.path.normpath(os.path.join(up, "target", "release", "libvmm_arena.so"))
        if os.path.exists(cand):
            return cand
    raise FileNotFoundError(
        "libvmm_arena.so not found: build it with `cargo build --release -p vmm-arena-ffi` "
        "and pass library= or set VMM_ARENA_LIBRARY"
    )


def _load(library=None):
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(_library_path(library))
        lib.vmm_arena_torch_set_tag.argtypes = [ctypes.c_uint32]
        lib.vmm_arena_torch_set_tag.restype = ctypes.c_uint32
        lib.vmm_arena_torch_tag.restype = ctypes.c_uint32
        lib.vmm_arena_torch_sleep.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32]
        lib.vmm_arena_torch_sleep.restype = ctypes.c_int
        lib.vmm_arena_torch_wake.argtypes = [ctypes.c_int, ctypes.c_uint32]
        lib.vmm_arena_torch_wake.restype = ctypes.c_int
        lib.vmm_arena_last_error.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def tag_of(name):
    """The integer tag of a region name (allocated on first use; 0 is no region)."""
    if name is None:
        return 0
    if isinstance(name, int) and not isinstance(name, bool):
        if not 0 <= name < _ALL_TAGS:
            raise ValueError(f"tag {name} out of range")
        return name
    if not isinstance(name, str):
        raise TypeError("a region's tag is a str (or an int)")
    with _lock:
        return _tags.setdefault(name, len(_tags) + 1)


def use(library=None):
    """Makes the arena PyTorch's CUDA allocator (before any CUDA tensor exists).
    Returns the CUDAPluggableAllocator."""
    global _allocator
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("vmm_arena.torch.use() needs CUDA")
    path = _library_path(library)
    _load(path)
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            path, "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free"
        )
        torch.cuda.memory.change_current_allocator(_allocator)
    return _allocator


def mem_pool(library=None):
    """A torch.cuda.MemPool over the arena (where PyTorch has MemPool), for
    `with torch.cuda.use_mem_pool(pool):` instead of replacing the allocator."""
    import torch

    path = _library_path(library)
    _load(path)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free")
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError("this PyTorch has no torch.cuda.MemPool; use vmm_arena.torch.use()")
    return torch.cuda.MemPool(alloc.allocator())


@contextlib.contextmanager
def region(tag="default", enable_cpu_backup=False):
    """Allocations made by this thread inside carry `tag` (and so pause and
    resume with it); with enable_cpu_backup their bytes survive a pause."""
    t = tag_of(tag)
    if enable_cpu_backup:
        _backup.add(t)
    lib = _load()
    prev = lib.vmm_arena_torch_set_tag(t)
    try:
        yield t
    finally:
        lib.vmm_arena_torch_set_tag(prev)


def _check(status, what):
    if status != 0:
        from . import VmmArenaError

        raise VmmArenaError(f"{what}: {_lib.vmm_arena_last_error().decode(errors='replace')}")


def _cuda():
    """torch.cuda where PyTorch and a device are present, else None (the
    entry points then serve VMM_ARENA_CONF's backend, e.g. the host one in
    tests, on device 0)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _device():
    cuda = _cuda()
    return cuda.current_device() if cuda else 0


def pause(tag=None):
    """Gives the physical memory of `tag` (None: every tag) back to the
    driver, after the device's work; addresses stay. Tags whose region asked
    for a CPU backup keep their bytes."""
    cuda = _cuda()
    if cuda:
        cuda.synchronize()
    lib = _load()
    dev = _device()
    tags = [tag_of(tag)] if tag is not None else sorted(set(_tags.values()) | {0})
    for t in tags:
        _check(lib.vmm_arena_torch_sleep(dev, t, _SLEEP_BACKUP if t in _backup else 0), f"pause({t})")


def resume(tag=None):
    """Maps memory back for `tag` (None: every tag) at the same addresses."""
    lib = _load()
    t = _ALL_TAGS if tag is None else tag_of(tag)
    _check(lib.vmm_arena_torch_wake(_device(), t), f"resume({tag})")


@contextlib.contextmanager
def cuda_graph(graph, tag="cuda_graph", enable_cpu_backup=False, **kwargs):
    """torch.cuda.graph(graph, ...) whose private pool comes from the arena
    under `tag` (the allocator must be in use: use()), so that the graph's
    memory pauses and resumes with that tag."""
    import torch

    with region(tag, enable_cpu_backup=enable_cpu_backup):
        with torch.cuda.graph(graph, **kwargs):
            yield graph
