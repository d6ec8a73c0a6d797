#!/usr/bin/env python3
"""vLLM's CuMemAllocator behaviours, restated against vmm_arena.vllm on a
GPU (vLLM's own tests, tests/basic_correctness/test_cumem.py, allocate CUDA
tensors throughout, so they cannot run on the host backend):

- a tensor outside any pool is never slept: its values survive sleep and
  wake_up untouched;
- tensors in the default pool are backed up by sleep() (offload_tags
  defaults to the default tag) and read their values after wake_up();
- a tag not offloaded (sleep(offload_tags=())) gives its memory back: the
  device's free memory rises by about the pool's usage, and wake_up()
  maps it again at the same addresses (contents undefined);
- get_current_usage() counts the pool's bytes, asleep or awake.

Prints one JSON line; exits 1 when a behaviour does not hold, 0 with
"skipped: ..." where PyTorch, CUDA or vmm_arena is missing.

  python3 vllm_cumem_check.py
"""
import json
import sys


def main():
    try:
        import torch
        from vmm_arena.vllm import CuMemAllocator
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    shape = (1024, 1024)
    outside = torch.full(shape, 7.0, device="cuda")
    alloc = CuMemAllocator.get_instance()
    with alloc.use_memory_pool():
        kept_a = torch.full(shape, 1.0, device="cuda")
        kept_b = torch.full(shape, 2.0, device="cuda")
    with alloc.use_memory_pool(tag="scratch"):
        scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    usage = alloc.get_current_usage()
    ptrs = (kept_a.data_ptr(), scratch.data_ptr())
    torch.cuda.synchronize()

    # Level 1: the default tag offloaded, "scratch" discarded.
    free0, _ = torch.cuda.mem_get_info()
    alloc.sleep()
    free1, _ = torch.cuda.mem_get_info()
    asleep_usage = alloc.get_current_usage()
    alloc.wake_up()
    torch.cuda.synchronize()
    level1 = {
        "outside_kept": bool((outside == 7.0).all()),
        "offloaded_restored": bool((kept_a == 1.0).all() and (kept_b == 2.0).all()),
        "same_addresses": (kept_a.data_ptr(), scratch.data_ptr()) == ptrs,
        "freed_bytes": free1 - free0,
    }
    scratch.fill_(3)  # usable again after wake_up

    # Level 2: nothing offloaded.
    free2, _ = torch.cuda.mem_get_info()
    alloc.sleep(offload_tags=())
    free3, _ = torch.cuda.mem_get_info()
    alloc.wake_up()
    torch.cuda.synchronize()
    level2 = {"outside_kept": bool((outside == 7.0).all()), "freed_bytes": free3 - free2}

    result = {
        "pool_usage_bytes": usage,
        "usage_while_asleep": asleep_usage,
        "level1": level1,
        "level2": level2,
    }
    print(json.dumps(result))
    ok = (
        level1["outside_kept"]
        and level1["offloaded_restored"]
        and level1["same_addresses"]
        and level2["outside_kept"]
        and asleep_usage == usage
        # Memory goes back to the device: most of the pool at each level.
        and level1["freed_bytes"] >= 0.9 * usage
        and level2["freed_bytes"] >= 0.9 * usage
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
