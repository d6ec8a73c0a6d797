#!/usr/bin/env bash
# Runs the CUDA backend against cuda-standin, the strict libcuda stand-in
# (cuda-standin/, see its README and RELIABILITY.md), in both readings of
# cuMemUnmap:
#   lenient: one call may unmap several adjacent mappings; events complete
#            at their first poll;
#   strict:  CUDA_STANDIN_STRICT_UNMAP=1, a span of mappings is refused;
#            events answer NOT_READY to 3 polls first.
# In each: the stand-in's own rule test, tests/cuda_backend.rs with
# VMM_ARENA_REQUIRE_GPU=1, every suite that honours
# VMM_ARENA_TEST_BACKEND=cuda (the fault matrix and the group suite, the
# slow ones, in the strict mode only), the C programs with the CUDA
# backend, and gpu_measure --quick. A rule violation or a leak makes the stand-in exit
# the process with status 86, which fails the step.
#
#   bash scripts/cuda-standin.sh [lenient|strict]...   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$PWD/target/cuda-standin
bash cuda-standin/build.sh "$lib" >/dev/null
mkdir -p target/ci

run() { printf -- '-- %s\n' "$*"; "$@"; }

# The rule test: every rule caught once, in both modes; a leak at exit
# must turn into exit status 86.
CUDA_STANDIN_EVENT_POLLS=2 run "$lib/standin-rules" >/dev/null
CUDA_STANDIN_STRICT_UNMAP=1 run "$lib/standin-rules" >/dev/null
rc=0
CUDA_STANDIN_LEAK_AT_EXIT=1 "$lib/standin-rules" >/dev/null 2>&1 || rc=$?
[[ $rc == 86 ]] || { echo "cuda-standin: a leak at exit gave status $rc, not 86" >&2; exit 1; }

modes=("$@")
[[ ${#modes[@]} -gt 0 ]] || modes=(lenient strict)
for mode in "${modes[@]}"; do
    case $mode in
    lenient) strict=0 polls=0 ;;
    strict) strict=1 polls=3 ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    echo "== cuda-standin, $mode unmaps (CUDA_STANDIN_STRICT_UNMAP=$strict, CUDA_STANDIN_EVENT_POLLS=$polls) [+${SECONDS}s]"
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export CUDA_STANDIN_STRICT_UNMAP=$strict CUDA_STANDIN_EVENT_POLLS=$polls CUDA_STANDIN_QUIET=1
    VMM_ARENA_REQUIRE_GPU=1 run cargo test -q --test cuda_backend
    VMM_ARENA_TEST_BACKEND=cuda run cargo test -q --test model cuda_backend_matches_the_model
    VMM_ARENA_TEST_BACKEND=cuda run cargo test -q --test concurrency --test alias --test sleep_wake
    if [[ $mode == strict ]]; then
        # The fault matrix and the group suite copy every chunk's 2 MiB
        # through the driver many times over: optimised, and in the strict
        # mode only (the default reading, with pending events), to keep the
        # step within minutes.
        VMM_ARENA_TEST_BACKEND=cuda run cargo test -q --release --test faults --test group
    fi
    VMM_ARENA_REQUIRE_GPU=1 run cargo test -q -p vmm-arena-ffi --test c_programs -- c_cuda_backend_test c_api_test_shared_library
    # The stand-in loads no modules: the kernels are reported not measured
    # (--kernels-optional), which the run must say.
    run cargo run -q --release -p vmm-sim --bin gpu_measure -- --quick --kernels-optional --out "target/ci/gpu-measure-$mode" >/dev/null
    grep -q "Not measured: this driver cannot load modules" "target/ci/gpu-measure-$mode/gpu-measure.md" ||
        { echo "gpu_measure did not say the kernels were not measured on the stand-in" >&2; exit 1; }
    if grep -q attn_eff "target/ci/gpu-measure-$mode/kv-profile.json" 2>/dev/null; then
        echo "gpu_measure wrote attn_eff_* without measuring the kernels" >&2; exit 1
    fi
    grep -q "\"unmap_spans_mappings\": $([[ $strict == 1 ]] && echo false || echo true)" "target/ci/gpu-measure-$mode/gpu-measure.json" ||
        { echo "gpu_measure did not record the probe's answer for $mode unmaps" >&2; exit 1; }
    unset LD_LIBRARY_PATH CUDA_STANDIN_STRICT_UNMAP CUDA_STANDIN_EVENT_POLLS CUDA_STANDIN_QUIET
done
echo "cuda-standin: all passed in ${SECONDS}s"
