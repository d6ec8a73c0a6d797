#!/usr/bin/env python3
"""An RL-style cycle through vmm_arena.torch on a GPU: a small transformer's
weights under tag "weights" (CPU backup), its KV cache under "kv_cache"
(none); pause both, check the device's free memory rose by about what the
arena held, resume, check the model's outputs are bit-identical to before
the pause; time pause and resume, and the backup copy rate (first cycle,
then cycles with the staging buffers kept) against a plain pinned copy of
as many bytes. Prints one JSON line.

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
    gib = float(1 << 30)

    # Backups at line rate: three more cycles with the page-locked staging
    # buffers kept (vt.keep_backups), against a plain pinned copy of as many
    # bytes, both directions, in the same run.
    vt.keep_backups(True)
    kept = []
    for _ in range(3):
        torch.cuda.synchronize()
        a = time.perf_counter()
        vt.pause()
        b = time.perf_counter()
        vt.resume()
        torch.cuda.synchronize()
        kept.append((b - a, time.perf_counter() - b))
    vt.keep_backups(False)
    src = torch.empty(weights, dtype=torch.uint8, device="cuda")
    host = torch.empty(weights, dtype=torch.uint8, pin_memory=True)
    plain = []
    for _ in range(3):
        torch.cuda.synchronize()
        a = time.perf_counter()
        host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        b = time.perf_counter()
        src.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        plain.append((b - a, time.perf_counter() - b))
    del src, host
    best = lambda pairs, i: min(p[i] for p in pairs)  # noqa: E731
    result = {
        "weights_bytes": weights,
        "kv_bytes": kv.numel() * kv.element_size(),
        "free_before_pause": free0,
        "free_after_pause": free1,
        "freed_bytes": free1 - free0,
        "pause_s": t1 - t0,
        "resume_s": t3 - t2,
        "bit_identical": bool(torch.equal(before, after)),
        # The weights' bytes are what a pause copies out and a resume back.
        "first_pause_backup_gib_s": weights / (t1 - t0) / gib,
        "first_resume_restore_gib_s": weights / (t3 - t2) / gib,
        "kept_pause_backup_gib_s": weights / best(kept, 0) / gib,
        "kept_resume_restore_gib_s": weights / best(kept, 1) / gib,
        "plain_pinned_d2h_gib_s": weights / best(plain, 0) / gib,
        "plain_pinned_h2d_gib_s": weights / best(plain, 1) / gib,
    }
    result["kept_pause_vs_plain"] = result["kept_pause_backup_gib_s"] / result["plain_pinned_d2h_gib_s"]
    result["kept_resume_vs_plain"] = result["kept_resume_restore_gib_s"] / result["plain_pinned_h2d_gib_s"]
    print(json.dumps(result))
    ok = result["bit_identical"] and result["freed_bytes"] >= 0.9 * (weights + result["kv_bytes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
