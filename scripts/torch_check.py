#!/usr/bin/env python3
"""PyTorch on three allocators: native caching, expandable segments, vmm-arena.

Runs on the GPU machine (PyTorch installed, no network, no downloads): a
decoder-only transformer built from a config with random weights

  * generates tokens greedily with a KV cache that grows by concatenation
    (the naive cache of many PyTorch programs), and
  * runs training steps (forward, backward, AdamW) of the same model,

once per allocator, each in a fresh process (an allocator cannot be changed
after CUDA is initialised). It reports peak reserved memory and tokens or
steps per second side by side, as JSON and as a Markdown table.

  python3 torch_check.py --lib path/to/libvmm_arena.so --out RESULTS_DIR

For vmm-arena the allocator is CUDAPluggableAllocator over the library's
vmm_arena_torch_malloc_or_throw / vmm_arena_torch_free (the hook that throws
on failure: PyTorch does not check for NULL); its peak comes from the
arena's own stats (vmm_arena_torch_stats), since PyTorch does not track
memory reserved by a pluggable allocator.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

MODES = ["native", "expandable_segments", "vmm-arena"]


class ArenaStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in [
        "struct_size_and_reserved", "live_allocations", "live_bytes", "mapped_bytes", "pooled_bytes",
        "peak_physical_bytes", "capacity_bytes", "reserved_va_bytes", "free_va_bytes",
        "largest_free_va_bytes", "retired_va_bytes", "moves", "driver_creates", "driver_releases",
        "driver_maps", "driver_unmaps", "driver_access_calls"]]


def build_model(torch, cfg):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["d_model"]
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, cache=None):
            b, t, d = x.shape
            h = cfg["n_heads"]
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            if cache is not None:
                if cache.get("k") is not None:
                    k = torch.cat([cache["k"], k], dim=2)  # the growing KV cache
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None or t > 1)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(cfg["vocab"], cfg["d_model"])
            self.blocks = nn.ModuleList([Block() for _ in range(cfg["n_layers"])])
            self.ln = nn.LayerNorm(cfg["d_model"])
            self.head = nn.Linear(cfg["d_model"], cfg["vocab"], bias=False)

        def forward(self, idx, caches=None):
            x = self.emb(idx)
            for i, blk in enumerate(self.blocks):
                x = blk(x, None if caches is None else caches[i])
            return self.head(self.ln(x))

    return Model()


def child(mode, lib, args):
    if mode == "expandable_segments":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    arena = None
    if mode == "vmm-arena":
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)
        arena = ctypes.CDLL(lib)
    torch.manual_seed(0)
    cfg = {"vocab": 32000, "d_model": args.d_model, "n_layers": args.layers, "n_heads": 16}
    dev = torch.device("cuda")
    model = build_model(torch, cfg).to(dev).half()
    out = {"mode": mode, "config": cfg}

    # Generation with a growing KV cache.
    with torch.no_grad():
        idx = torch.randint(0, cfg["vocab"], (args.batch, args.prompt), device=dev)
        caches = [dict() for _ in range(cfg["n_layers"])]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(idx, caches)
        for _ in range(args.tokens):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, caches)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    out["generate_tokens_per_s"] = args.batch * args.tokens / dt
    del caches, logits
    # Training steps of the same model (fp32 master copy for AdamW).
    model = model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg["vocab"], (args.batch, args.train_len), device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    out["train_steps_per_s"] = args.steps / (time.perf_counter() - t0)
    if arena is None:
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    else:
        st = ArenaStats()
        st.struct_size_and_reserved = ctypes.sizeof(ArenaStats)
        rc = arena.vmm_arena_torch_stats(0, ctypes.byref(st))
        out["arena_status"] = rc
        out["peak_reserved_bytes"] = st.peak_physical_bytes
        out["driver_creates"] = st.driver_creates
        out["driver_maps"] = st.driver_maps
    print(json.dumps(out))


def write_results(out, results):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "torch-check.json"), "w") as f:
        json.dump(results, f, indent=1)
    base = next((r for r in results if r["mode"] == "native" and "error" not in r), None)
    lines = ["| allocator | peak reserved (MiB) | vs native | generate tok/s | train steps/s |", "|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            # A traceback's last line says what went wrong; the JSON keeps it all.
            last = (r["error"].strip().splitlines() or ["?"])[-1]
            lines.append(f"| {r['mode']} | error: {last[:100].replace('|', '/')} | | | |")
            continue
        ratio = f"{r['peak_reserved_bytes'] / base['peak_reserved_bytes']:.2f}x" if base else "-"
        lines.append(f"| {r['mode']} | {r['peak_reserved_bytes'] / 2**20:.0f} | {ratio} | "
                     f"{r['generate_tokens_per_s']:.0f} | {r['train_steps_per_s']:.2f} |")
    with open(os.path.join(out, "torch-check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--child", choices=MODES)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    # Per child: a cold `import torch` plus CUDA and cuBLAS initialisation
    # take most of a minute on a fresh machine, before any work.
    p.add_argument("--timeout", type=int, default=60)
    args = p.parse_args()
    if args.child:
        child(args.child, os.path.abspath(args.lib), args)
        return
    results = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode] + sys.argv[1:]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None
            results.append(json.loads(line) if line else {"mode": mode, "error": r.stderr[-2000:]})
        except subprocess.TimeoutExpired:
            results.append({"mode": mode, "error": f"timed out after {args.timeout} s"})
        # After every child, so that a parent killed by an outer timeout
        # still leaves the children that finished.
        lines = write_results(args.out, results)
    print("\n".join(lines))
    sys.exit(0 if all("error" not in r for r in results) else 1)


if __name__ == "__main__":
    main()
