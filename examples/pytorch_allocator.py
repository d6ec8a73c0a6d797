#!/usr/bin/env python3
"""PyTorch's pluggable allocator on vmm-arena: the set-up.

PyTorch loads two functions from the C library (libvmm_arena.so):
vmm_arena_torch_malloc_or_throw and vmm_arena_torch_free. Behind them is one
arena per device, configured by VMM_ARENA_CONF ("key:value" pairs, like
PYTORCH_CUDA_ALLOC_CONF). Build the library first:

    cargo build --release -p vmm-arena-ffi

    python3 examples/pytorch_allocator.py          # host part: no GPU, no PyTorch
    python3 examples/pytorch_allocator.py --gpu    # needs a GPU and PyTorch with CUDA

The host part calls the same entry points PyTorch calls, through ctypes, on
the host backend (VMM_ARENA_CONF=backend:host): allocations, frees on a
stream, and the arena's stats, which PyTorch's own memory statistics do not
see. The --gpu part installs the allocator in PyTorch and runs a few tensor
operations on it; it must run before CUDA allocates anything, which is why
it is a separate run.
"""
import argparse
import ctypes
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "ffi", "include", "vmm_arena.h")


def stats_struct():
    """vmm_arena_stats as ctypes, its fields read from the generated header."""
    text = open(HEADER).read()
    body = re.search(r"typedef struct vmm_arena_stats \{(.*?)\} vmm_arena_stats;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = []
    for ctype, name in re.findall(r"(uint32_t|uint64_t)\s+(\w+);", body):
        fields.append((name, ctypes.c_uint32 if ctype == "uint32_t" else ctypes.c_uint64))
    return type("ArenaStats", (ctypes.Structure,), {"_fields_": fields})


def host_part(lib_path):
    # Read once, when device 0's arena is created (the first call).
    os.environ["VMM_ARENA_CONF"] = "backend:host,capacity:256MiB,retain:all"
    lib = ctypes.CDLL(lib_path)
    lib.vmm_arena_torch_malloc.restype = ctypes.c_void_p
    lib.vmm_arena_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vmm_arena_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    Stats = stats_struct()
    lib.vmm_arena_torch_stats.argtypes = [ctypes.c_int, ctypes.POINTER(Stats)]

    def stats():
        s = Stats()
        s.struct_size = ctypes.sizeof(Stats)
        assert lib.vmm_arena_torch_stats(0, ctypes.byref(s)) == 0, "vmm_arena_torch_stats failed"
        return s

    sizes = [3 << 20, 4096, 100, 64 << 20]
    ptrs = []
    for i, size in enumerate(sizes):
        p = lib.vmm_arena_torch_malloc(size, 0, None)  # device 0, the default stream
        assert p, f"allocation of {size} bytes failed"
        ctypes.memset(p, i + 1, size)  # host backend: the pointer is host memory
        ptrs.append(p)
    s = stats()
    print(f"{s.live_allocations} allocations, {s.live_bytes} live bytes, {s.mapped_bytes} mapped")
    assert s.live_allocations == len(sizes)
    for i, p in enumerate(ptrs):
        assert ctypes.string_at(p, 1)[0] == i + 1

    # PyTorch frees on the stream that used the memory; on CUDA the memory
    # is reused once that stream's work is done.
    for p, size in zip(ptrs, sizes):
        lib.vmm_arena_torch_free(p, size, 0, None)
    s = stats()
    print(f"after the frees: {s.live_allocations} allocations, {s.pooled_bytes} bytes pooled for reuse")
    assert s.live_allocations == 0


def gpu_part(lib_path):
    import torch  # PyTorch with CUDA, on a GPU machine

    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        lib_path, "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free")
    torch.cuda.memory.change_current_allocator(alloc)  # before any CUDA allocation
    x = torch.randn(4096, 4096, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    print(f"matmul on vmm-arena memory: {tuple(y.shape)}, sum {y.sum().item():.3e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=os.path.join(ROOT, "target", "release", "libvmm_arena.so"))
    ap.add_argument("--gpu", action="store_true", help="install the allocator in PyTorch (needs a GPU)")
    a = ap.parse_args()
    if not os.path.exists(a.lib):
        sys.exit(f"{a.lib} is missing: build it with `cargo build --release -p vmm-arena-ffi`")
    gpu_part(a.lib) if a.gpu else host_part(a.lib)


if __name__ == "__main__":
    main()
