"""ArenaCache on the CUDA backend: the same generation as DynamicCache on the
GPU, with attention reading the arena's device memory through DLPack views.

    python integrations/transformers/cuda_check.py                 # needs a GPU; SKIPPED (exit 0) without one
    python integrations/transformers/cuda_check.py --device cpu    # the same check on the host backend

Exit 0 when the check passed (or was skipped: no CUDA device), 1 when it
failed, 2 with --require-gpu and no GPU.
"""

import argparse
import sys

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=256, help="generated tokens")
    p.add_argument("--require-gpu", action="store_true")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device visible to torch")
        return 2 if args.require_gpu else 0

    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from vmm_arena.transformers import ArenaCache

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(args.device)
    lengths = [7, 23, 16]
    ids = torch.zeros((3, 23), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, 23 - n:] = torch.randint(3, 512, (n,))
        mask[row, 23 - n:] = 1
    inputs = {"input_ids": ids.to(args.device), "attention_mask": mask.to(args.device)}
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0)

    ref = model.generate(**inputs, cache=DynamicCache(config=config), **kw)
    backend = "cuda" if args.device == "cuda" else "host"
    cache = ArenaCache(config, backend=backend)
    got = model.generate(**inputs, cache=cache, **kw)

    failures = []
    if not torch.equal(ref.sequences, got.sequences):
        failures.append("greedy ids differ")
    worst = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        try:
            torch.testing.assert_close(b, a, rtol=1.3e-6, atol=1e-5)
        except AssertionError as e:
            failures.append(f"logits differ at step {step}: {e}")
            break
    base, size = cache.arena.va_range
    for i, layer in enumerate(cache.layers):
        for name, t in (("keys", layer.keys), ("values", layer.values)):
            if t.device.type != args.device:
                failures.append(f"layer {i} {name} on {t.device}, not {args.device}")
            if not base <= t.data_ptr() < base + size:
                failures.append(f"layer {i} {name} is not arena memory")
    st = cache.arena.stats()
    live = cache.live_bytes()
    if st.bytes_copied or st.moves or cache.copied_bytes:
        failures.append(f"copies: bytes_copied {st.bytes_copied}, moves {st.moves}, cache {cache.copied_bytes}")
    if not live <= st.mapped_bytes <= live + st.live_allocations * st.chunk_bytes:
        failures.append(f"mapped {st.mapped_bytes} bytes for {live} live")
    print(f"{args.device}: {args.tokens} tokens, batch 3; max |logit diff| {worst:.3g}; "
          f"live KV {live} bytes, mapped {st.mapped_bytes} ({st.live_allocations} allocations of "
          f"{st.chunk_bytes}-byte chunks); bytes_copied {st.bytes_copied}")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
