#!/usr/bin/env python3
"""An RL-style cycle through vmm_arena.torch on a GPU: a small transformer's
weights under tag "weights" (CPU backup), its KV cache under "kv_cache"
(none); pause both, check the device's free memory rose by about what the
arena held, resume, check the model's outputs are bit-identical to before
the pause; time pause and resume. Prints one JSON line.

  python3 torch_rl_cycle.py

The allocator hooks are in the installed package's extension module;
`--lib` is accepted and ignored (older gpu-check bundles pass it).

Skipped (exit 0, a message) where PyTorch, CUDA or vmm_arena is missing.
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="ignored: the hooks come with the installed package")
    ap.parse_args()
    try:
        import torch
        import vmm_arena.torch as vt
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    vt.use()
    torch.manual_seed(0)
    with vt.region("weights", enable_cpu_backup=True):
        layer = torch.nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, num_layers=8).cuda().eval()
    with vt.region("kv_cache"):
        kv = torch.empty(64, 2048, 1024, device="cuda")
    x = torch.randn(4, 256, 1024, device="cuda")
    with torch.no_grad():
        before = model(x).clone()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    vt.pause()
    t1 = time.perf_counter()
    free1, _ = torch.cuda.mem_get_info()
    t2 = time.perf_counter()
    vt.resume()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    with torch.no_grad():
        after = model(x)
    kv.zero_()  # the KV cache is usable again (its contents were not kept)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "weights_bytes": weights,
        "kv_bytes": kv.numel() * kv.element_size(),
        "free_before_pause": free0,
        "free_after_pause": free1,
        "freed_bytes": free1 - free0,
        "pause_s": t1 - t0,
        "resume_s": t3 - t2,
        "bit_identical": bool(torch.equal(before, after)),
    }
    print(json.dumps(result))
    ok = result["bit_identical"] and result["freed_bytes"] >= 0.9 * (weights + result["kv_bytes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
