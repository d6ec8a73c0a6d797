#!/usr/bin/env python3
"""torch_memory_saver's preload mode through vmm_arena on a GPU: a child
process started inside `configure_subprocess()` (LD_PRELOAD of the library
the package ships) sets `hook_mode = "preload"`; PyTorch's own allocator
and a raw `cudaMalloc` (as NCCL or an extension would call it) inside
regions land in the arena with the regions' tags, a tensor outside any
region does not. Pause both regions, check the device's free memory rose by
about what they hold, resume, check the backed-up tensor's bytes and the
one outside regions. Prints one JSON line.

  python3 torch_preload_check.py

Skipped (exit 0, a message) where PyTorch, CUDA, torch.cuda.MemPool or
vmm_arena is missing.
"""
import ctypes
import json
import subprocess
import sys

MiB = 1 << 20


def child():
    import torch
    import vmm_arena.torch as vt
    from vmm_arena.torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "preload"
    runtime = ctypes.CDLL(None)  # cudaMalloc as any library resolves it: the preloaded one
    runtime.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    runtime.cudaFree.argtypes = [ctypes.c_void_p]
    outside = torch.full((64 * MiB,), 3, dtype=torch.uint8, device="cuda")
    with tms.region("weights", enable_cpu_backup=True):
        weights = torch.full((256 * MiB,), 7, dtype=torch.uint8, device="cuda")
    raw = ctypes.c_void_p()
    with tms.region("kv"):
        kv = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        assert runtime.cudaMalloc(ctypes.byref(raw), 128 * MiB) == 0
    tags = {t for _, _, t in vt.allocations(0)}
    in_arena = sum(n for _, n, t in vt.allocations(0) if t >= 2)
    outside_in_arena = any(p <= outside.data_ptr() < p + n for p, n, _ in vt.allocations(0))
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    tms.pause()
    free1, _ = torch.cuda.mem_get_info()
    tms.resume()
    torch.cuda.synchronize()
    kv.zero_()
    result = {
        "region_tags": sorted(tags - {0}),
        "region_bytes_in_arena": in_arena,
        "outside_in_arena": outside_in_arena,
        "freed_bytes": free1 - free0,
        "weights_restored": bool(weights.eq(7).all()),
        "outside_intact": bool(outside.eq(3).all()),
        "raw_free": runtime.cudaFree(raw),
    }
    print(json.dumps(result))
    wanted = (256 + 512 + 128) * MiB
    ok = (result["weights_restored"] and result["outside_intact"] and not outside_in_arena
          and in_arena >= wanted and result["freed_bytes"] >= 0.9 * wanted and result["raw_free"] == 0
          and vt.tag_of("weights", True) in tags and vt.tag_of("kv") in tags)
    return 0 if ok else 1


def main():
    if sys.argv[1:] == ["--child"]:
        return child()
    try:
        import torch
        import vmm_arena.torch as vt
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    if not hasattr(torch.cuda, "MemPool"):
        print("skipped: this PyTorch has no torch.cuda.MemPool")
        return 0
    with vt.configure_subprocess():
        return subprocess.run([sys.executable, __file__, "--child"], timeout=240).returncode


if __name__ == "__main__":
    sys.exit(main())
