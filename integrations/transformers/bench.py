"""DynamicCache, StaticCache and vmm_arena's ArenaCache side by side, on a
small Llama made from a config with seeded random weights (no download).

For each total length N (prompt + generated tokens), each cache runs in a
fresh subprocess: a prompt of N - G tokens is prefilled in chunks, then G
tokens are decoded greedily one at a time (G = --gen), so the decode steps
measured are the last G before the context reaches N. Reported per run:

  ms/token      wall time per decoded token (the mean over the G steps)
  copied        bytes of cached tokens copied to a new address by the
                cache's updates, over the whole run (prefill and decode):
                measured the same way for every cache (an update whose
                returned keys/values start elsewhere than the cache's did
                before it copied them); for ArenaCache the arena's own
                bytes_copied is added (0 unless something is broken)
  copied/token  the same, per decoded token, at the end of the run
  kv held       bytes the cache holds at the end (DynamicCache and
                StaticCache: its tensors; ArenaCache: the arena's mapped
                bytes, chunk-rounded)
  peak rss      the process's peak resident memory during the run, above
                its resident memory just before the cache was made (model,
                activations and cache together; VmHWM reset through
                /proc/self/clear_refs)

StaticCache and ArenaCache are sized for --max-len tokens (the model's
max_position_embeddings): StaticCache allocates all of it, ArenaCache only
reserves the address space and maps chunks as tokens arrive.

    python integrations/transformers/bench.py                 # 1k, 4k, 16k
    python integrations/transformers/bench.py --lengths 1024 --gen 128 --json out.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

CACHES = ("dynamic", "static", "arena")


def model_config(args):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    return config


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def watch_copies(cache, counter):
    """Counts the bytes of cached tokens an update moved to a new address."""
    for layer in cache.layers:
        update = layer.update

        def checked(key_states, value_states, *a, _layer=layer, _update=update, **kw):
            old = []
            for t in (_layer.keys, _layer.values):
                if t is not None and t.numel() > 0:
                    old.append((t.data_ptr(), t.nbytes))
            keys, values = _update(key_states, value_states, *a, **kw)
            for (ptr, nbytes), new in zip(old, (keys, values)):
                if new.data_ptr() != ptr:
                    counter[0] += nbytes
            return keys, values

        layer.update = checked


def run_one(args, kind, total):
    import torch
    from transformers import DynamicCache, LlamaForCausalLM, StaticCache

    torch.set_num_threads(args.threads)
    config = model_config(args)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    gen = min(args.gen, total - 1)
    prompt = torch.randint(3, config.vocab_size, (1, total - gen), generator=torch.Generator().manual_seed(1))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    rss_before = status_kib("VmRSS")
    if kind == "dynamic":
        cache = DynamicCache(config=config)
    elif kind == "static":
        cache = StaticCache(config=config, max_cache_len=args.max_len)
    else:
        from vmm_arena.transformers import ArenaCache

        cache = ArenaCache(config, max_cache_len=args.max_len, backend="host")
    copied = [0]
    watch_copies(cache, copied)

    with torch.no_grad():
        t0 = time.perf_counter()
        for start in range(0, prompt.shape[1], args.prefill_chunk):
            out = model(prompt[:, start:start + args.prefill_chunk], cache=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        token = out.logits[:, -1:].argmax(-1)
        copied_before_decode = copied[0]
        t0 = time.perf_counter()
        for _ in range(gen):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
        # What the last decode step copied, over one step: the per-token cost at length N.
        before_last = copied[0]
        model(token, cache=cache, use_cache=True)
        last_step_copied = copied[0] - before_last
        copied[0] = before_last
    peak_kib = status_kib("VmHWM") - rss_before

    if kind == "arena":
        st = cache.arena.stats()
        kv_held = st.mapped_bytes
        copied[0] += st.bytes_copied + cache.copied_bytes
    else:
        kv_held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    return {
        "cache": kind, "total_tokens": total, "prompt_tokens": total - gen, "decoded_tokens": gen,
        "ms_per_token": decode_s / gen * 1e3, "prefill_s": prefill_s,
        "copied_bytes": copied[0], "decode_copied_bytes": copied[0] - copied_before_decode,
        "copied_bytes_per_token_at_end": last_step_copied,
        "kv_held_bytes": kv_held, "peak_rss_growth_bytes": peak_kib * 1024,
    }


def mib(n):
    return f"{n / (1 << 20):.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096,16384", help="total tokens (prompt + generated), comma-separated")
    p.add_argument("--gen", type=int, default=256, help="decoded tokens measured per length")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--max-len", type=int, default=32768, help="max_position_embeddings: StaticCache's size, ArenaCache's reservation")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--one", nargs=2, metavar=("CACHE", "TOTAL"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.one:
        print(json.dumps(run_one(args, args.one[0], int(args.one[1]))))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    caches = [c for c in args.caches.split(",") if c]
    for c in caches:
        if c not in CACHES:
            p.error(f"unknown cache {c!r}: one of {', '.join(CACHES)}")
    if max(lengths) + 1 > args.max_len:
        p.error(f"--max-len {args.max_len} must exceed the longest length {max(lengths)}")
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                   for k in ("gen", "prefill_chunk", "max_len", "layers", "hidden", "heads", "threads")]
    rows = []
    kv_per_token = args.layers * 2 * args.hidden * 4
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads, float32, batch 1: "
          f"{kv_per_token} bytes of KV per token; max_len {args.max_len}; {args.gen} decoded tokens per length; "
          f"{args.threads} torch thread(s)")
    print(f"{'tokens':>7} {'cache':>8} {'ms/token':>9} {'copied MiB':>11} {'copied/token MiB':>17} "
          f"{'kv held MiB':>12} {'peak rss MiB':>13}")
    for total in lengths:
        for kind in caches:
            cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--one", kind, str(total)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.stderr.write(res.stderr)
                raise SystemExit(f"{kind} at {total} tokens failed (exit {res.returncode})")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"{total:>7} {kind:>8} {r['ms_per_token']:>9.2f} {mib(r['copied_bytes']):>11} "
                  f"{mib(r['copied_bytes_per_token_at_end']):>17} {mib(r['kv_held_bytes']):>12} "
                  f"{mib(r['peak_rss_growth_bytes']):>13}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
