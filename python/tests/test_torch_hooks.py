"""vmm_arena.torch's region, pause and resume over the C library's PyTorch
entry points, on the host backend (VMM_ARENA_CONF=backend:host): what
PyTorch's CUDAPluggableAllocator would call, called here through ctypes.
`use()` itself (the allocator swap) needs CUDA: the GPU check runs it.

Needs libvmm_arena.so: $VMM_ARENA_LIBRARY (CI sets it to the library the
test step built); skipped where it is not set."""
import ctypes
import os

import pytest

LIB = os.environ.get("VMM_ARENA_LIBRARY")
pytestmark = pytest.mark.skipif(not LIB, reason="VMM_ARENA_LIBRARY is not set")


def test_regions_tag_allocations_and_pause_resume_by_tag():
    assert os.path.exists(LIB), LIB
    os.environ["VMM_ARENA_CONF"] = "backend:host,capacity:64MiB,chunk:2MiB"
    import vmm_arena.torch as vt

    lib = vt._load(LIB)
    lib.vmm_arena_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vmm_arena_torch_malloc.restype = ctypes.c_void_p
    lib.vmm_arena_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    class Stats(ctypes.Structure):  # the head of vmm_arena_stats (vmm_arena.h)
        _fields_ = [("struct_size", ctypes.c_uint32), ("reserved0", ctypes.c_uint32),
                    ("live_allocations", ctypes.c_uint64), ("live_bytes", ctypes.c_uint64),
                    ("mapped_bytes", ctypes.c_uint64), ("rest", ctypes.c_uint64 * 13)]

    def mapped():
        s = Stats(struct_size=ctypes.sizeof(Stats))
        assert lib.vmm_arena_torch_stats(0, ctypes.byref(s)) == 0, lib.vmm_arena_last_error()
        return s.mapped_bytes

    def malloc(n):
        p = lib.vmm_arena_torch_malloc(n, 0, None)
        assert p, lib.vmm_arena_last_error()
        return p

    with vt.region("weights", enable_cpu_backup=True) as wt:
        assert lib.vmm_arena_torch_tag() == wt
        weights = [malloc(n) for n in (1000, 100_000, 3 << 20)]  # small ones included
    assert lib.vmm_arena_torch_tag() == 0, "the region restores the previous tag"
    with vt.region("kv_cache"):
        kv = [malloc(n) for n in (1000, 5 << 20)]
    other = malloc(1000)  # tag 0: never paused by name here
    for i, p in enumerate(weights + kv + [other]):
        ctypes.memset(p, 0x30 + i, 1000)

    before = mapped()
    vt.pause("kv_cache")
    # kv's 6 MiB (3 chunks) and its slab's chunk went back; nothing else.
    assert mapped() == before - 4 * (2 << 20)
    for i, p in enumerate(weights):
        assert ctypes.string_at(p, 1000) == bytes([0x30 + i]) * 1000, "weights untouched"
    assert ctypes.string_at(other, 1000) == bytes([0x35]) * 1000
    vt.pause("weights")
    assert mapped() == 2 << 20, "only tag 0's slab is left"
    vt.resume()
    assert mapped() == before
    for i, p in enumerate(weights):
        assert ctypes.string_at(p, 1000) == bytes([0x30 + i]) * 1000, "restored from the CPU backup"
    for p in kv:
        ctypes.memset(p, 0, 1000)  # mapped again at the same address
    for p in weights + kv + [other]:
        lib.vmm_arena_torch_free(p, 0, 0, None)
