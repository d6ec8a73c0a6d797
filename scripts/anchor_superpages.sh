#!/usr/bin/env bash
# The closed-loop workload of the TensorRT-LLM VMM-arena measurement
# (NVIDIA/TensorRT-LLM pull request 15931: Llama-3.1-8B, H100, 1,024 in /
# 1,024 out, concurrency 256, unique prompts and 15 shared system prompts)
# through the replay: arena against vllm-paged at 2 MiB chunks, and the
# arena at super-pages of 4, 8, 16 and 20 MiB. Writes one JSON per run
# into DIR (default target/anchor). docs/bench/anchor_superpages.md holds
# the figures; REQUESTS (default 5000) and CAPACITY (default 48GiB) change
# the run's size.
set -euo pipefail
dir=${1:-target/anchor}
requests=${REQUESTS:-5000}
capacity=${CAPACITY:-48GiB}
mkdir -p "$dir"
bin=target/release/kv_serving
cargo build --release -p vmm-sim --bin kv_serving
common=(--profile h100 --model llama3-8b --fixed-lengths 1024:1024 --closed-loop 256 --max-batch 256
    --requests "$requests" --capacity "$capacity")
for variant in unique shared; do
    extra=()
    [ "$variant" = shared ] && extra=(--shared-prompts 15:512)
    start=$(date +%s)
    "$bin" "${common[@]}" "${extra[@]}" --managers arena,vllm-paged --jobs 2 --json "$dir/$variant-2mib.json" >"$dir/$variant-2mib.txt"
    echo "$variant 2 MiB (arena, vllm-paged): $(( $(date +%s) - start )) s"
    for mib in 4 8 16 20; do
        start=$(date +%s)
        "$bin" "${common[@]}" "${extra[@]}" --chunk-mib "$mib" --managers arena --jobs 1 \
            --json "$dir/$variant-${mib}mib.json" >"$dir/$variant-${mib}mib.txt"
        echo "$variant $mib MiB (arena): $(( $(date +%s) - start )) s"
    done
done
