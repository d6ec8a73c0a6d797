#!/usr/bin/env bash
# The GPU check, in two halves (see scripts/README-gpu-check.md).
#
#   scripts/gpu-check.sh build [DIR]     here, with cargo: release test binaries,
#                                        the measuring binary, libvmm_arena.so and
#                                        the ops fuzz corpus into DIR (default
#                                        out/gpu-check), with this script.
#   DIR/gpu-check.sh run [RESULTS]       there, on the GPU machine: no Rust, no
#                                        network. Every step runs, times out and
#                                        reports on its own; writes four files
#                                        into RESULTS (default $OUT, else
#                                        DIR/results): summary.txt,
#                                        driver_latency.md, pytorch_comparison.md
#                                        and gpu-check-logs.tar.gz (every log);
#                                        and a fifth, kv-profile.json (the
#                                        measured driver prices, for
#                                        kv_serving --profile-file), when
#                                        gpu_measure wrote one.
#
# `run` exits 0 when no step FAILED or hit its TIMEOUT (SKIPPED is not a
# failure, but summary.txt says why: e.g. "no GPU"), 1 otherwise, and 2 when
# VMM_ARENA_REQUIRE_GPU=1 is set and no GPU was found.
set -euo pipefail

usage() {
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

# --- build: here ----------------------------------------------------------

cmd_build() {
    local root dir target
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    dir=${1:-$root/out/gpu-check}
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    rm -rf "${dir:?}/bin" "${dir:?}/lib" "${dir:?}/fuzz"
    mkdir -p "$dir/bin" "$dir/lib"
    cd "$root"

    # Cargo's output directory, wherever CARGO_TARGET_DIR or a config puts it.
    target=$(cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])') ||
        target=${CARGO_TARGET_DIR:-$root/target}

    local msgs
    msgs=$(mktemp)
    trap 'rm -f "$msgs"' RETURN

    echo "gpu-check build: release test binaries (lib unit tests + tests/*.rs)" >&2
    cargo test --release --lib --tests --no-run --message-format=json >"$msgs"
    echo "gpu-check build: measuring binary (sim/src/bin/gpu_measure/)" >&2
    cargo build --release -p vmm-sim --bin gpu_measure --message-format=json >>"$msgs"
    echo "gpu-check build: C library for the PyTorch check (libvmm_arena.so)" >&2
    cargo build --release -p vmm-arena-ffi --message-format=json >>"$msgs"

    # Copy what cargo says it built (its JSON messages name every file), so
    # the paths follow the target directory whatever it is.
    python3 - "$msgs" "$dir" <<'PY'
import json, shutil, sys
msgs, out = sys.argv[1], sys.argv[2]
n = 0
for line in open(msgs):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact":
        continue
    name, exe = m["target"]["name"], m.get("executable")
    if exe and m["profile"].get("test"):
        shutil.copy2(exe, f"{out}/bin/test-{name}")
        n += 1
    elif exe and name == "gpu_measure":
        shutil.copy2(exe, f"{out}/bin/gpu_measure")
        n += 1
    for f in m.get("filenames", []):
        if f.endswith("/libvmm_arena.so"):
            shutil.copy2(f, f"{out}/lib/libvmm_arena.so")
print(f"gpu-check build: copied {n} binaries", file=sys.stderr)
PY
    [[ -x $dir/bin/gpu_measure ]] || { echo "gpu-check build: gpu_measure was not built" >&2; exit 1; }
    if [[ ! -f $dir/lib/libvmm_arena.so ]]; then
        # Cargo reports no artifact for a crate that was already fresh.
        cp "$target/release/libvmm_arena.so" "$dir/lib/"
    fi

    # Debug info makes the release binaries large; the check does not need it.
    if command -v strip >/dev/null; then
        strip --strip-debug "$dir"/bin/* 2>/dev/null || true
    fi
    cp "$root/scripts/gpu-check.sh" "$dir/gpu-check.sh"
    cp "$root/scripts/torch_check.py" "$dir/torch_check.py"
    cp "$root/scripts/torch_rl_cycle.py" "$dir/torch_rl_cycle.py"
    cp "$root/scripts/torch_preload_check.py" "$dir/torch_preload_check.py"
    cp "$root/scripts/vllm_cumem_check.py" "$dir/vllm_cumem_check.py"
    chmod +x "$dir/gpu-check.sh"
    [[ -f $root/scripts/README-gpu-check.md ]] && cp "$root/scripts/README-gpu-check.md" "$dir/"
    # The fuzz replay reads fuzz/corpus/ops relative to its working directory
    # when the build tree is not there; a copy makes DIR enough on its own.
    mkdir -p "$dir/fuzz/corpus"
    cp -r "$root/fuzz/corpus/ops" "$dir/fuzz/corpus/ops"

    # What the binaries need from the GPU machine's C library.
    local glibc=unknown
    if command -v objdump >/dev/null; then
        glibc=$(objdump -T "$dir"/bin/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)
    fi
    {
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
        echo "rustc: $(rustc --version 2>/dev/null || echo unknown)"
        echo "target dir: $target"
        echo "needs: Linux x86_64, ${glibc:-unknown} or newer, an NVIDIA driver (libcuda.so.1) with CUDA 12.x or later"
        echo "binaries:"
        (cd "$dir/bin" && ls -1)
    } >"$dir/MANIFEST.txt"

    echo "gpu-check build: $(ls "$dir/bin" | wc -l) binaries in $dir ($(du -sh "$dir" | cut -f1)); needs ${glibc:-unknown}" >&2
    echo "gpu-check build: there, run: bash $dir/gpu-check.sh run [RESULTS]" >&2
}

# --- run: there -----------------------------------------------------------
#
# Time budget: every step has its own limit, and the limits add up to at
# most 380 s; with the 2 s grace `timeout -k` gives each of the seven steps
# that can hang, the worst case stays under 7 minutes (400 s):
#
#   gpu-info        10 s   nvidia-smi
#   cuda_backend    35 s   tests/cuda_backend.rs against the real driver
#   gpu_measure     50 s   driver call latencies (driver_latency.md) and the
#                          decode attention kernels by KV layout (seconds)
#   attn checks     40 s   gpu_measure --attention-only with a broken and a
#                          slow paged kernel (20 s each): both must be rejected
#   pytorch        190 s   three fresh processes (native, expandable segments,
#                          vmm-arena), 60 s each: a cold `import torch` plus
#                          CUDA and cuBLAS initialisation take most of that on
#                          a fresh machine; 10 s for the parent
#   fuzz_replay     10 s   the committed ops corpus (from the repository root)
#   cuda suites     35 s   the model test's CUDA case, the fault matrix and the
#                          concurrency tests with VMM_ARENA_TEST_BACKEND=cuda
#                          (data checked through cuMemcpy), sharing these 35 s
#   host tests      10 s   all other test binaries, sharing these 10 s; each
#                          gets what is left, the rest SKIPPED
#                 -----
#                  380 s
#
# Where the Python package and PyTorch are installed beside it, two more
# steps: torch_rl_cycle (300 s), torch_preload_check (120 s) and
# vllm_cumem_check (120 s).
#
# GPU_CHECK_MAX_STEP_S caps every step's limit (for testing the script).

LIMIT_INFO=10
LIMIT_CUDA=35
LIMIT_FUZZ=10
LIMIT_SUITES_TOTAL=35
LIMIT_HOST_TOTAL=10
LIMIT_HOST_EACH=10
LIMIT_MEASURE=50
LIMIT_ATTN_CHECK=20
TORCH_CHILD=60
LIMIT_TORCH=$((3 * TORCH_CHILD + 10))
KILL_GRACE=2

cap() {
    local v=$1
    if [[ -n ${GPU_CHECK_MAX_STEP_S:-} ]] && ((GPU_CHECK_MAX_STEP_S < v)); then
        v=$GPU_CHECK_MAX_STEP_S
    fi
    echo "$v"
}

# Runs one step: its own timeout, its own log, its own status line; never
# stops the script (a crash, a kill, a binary that cannot start are results).
#   run_step NAME LIMIT LOG CMD...
# Sets STEP_STATUS (ok / FAILED / TIMEOUT) and STEP_SECS.
run_step() {
    local name=$1 limit=$2 log=$3 rc t0
    shift 3
    t0=$SECONDS
    rc=0
    timeout -k "$KILL_GRACE" "$limit" "$@" >"$log" 2>&1 || rc=$?
    STEP_SECS=$((SECONDS - t0))
    if ((rc == 0)); then
        STEP_STATUS=ok
        report "$name" "ok" "${STEP_SECS}s$(counts "$log")"
    elif ((rc == 124 || (rc == 137 && STEP_SECS >= limit))); then
        STEP_STATUS=TIMEOUT
        report "$name" "TIMEOUT" "after ${limit}s$(counts "$log")"
    else
        STEP_STATUS=FAILED
        report "$name" "FAILED rc=$rc" "${STEP_SECS}s$(counts "$log")$(why "$rc" "$log")"
    fi
}

# ", N passed, M failed" from libtest's result lines, if the log has any.
counts() {
    local p f
    p=$(grep -o '[0-9]* passed' "$1" 2>/dev/null | awk '{s+=$1} END {print s+0}') || p=0
    f=$(grep -o '[0-9]* failed' "$1" 2>/dev/null | awk '{s+=$1} END {print s+0}') || f=0
    if grep -q '^test result:' "$1" 2>/dev/null; then
        printf ', %s passed, %s failed' "$p" "$f"
    fi
}

# A hint for a failure without a test summary.
why() {
    local rc=$1 log=$2
    if ((rc > 128 && rc < 160)); then
        printf ', killed by signal %d' $((rc - 128))
    elif ((rc == 126 || rc == 127)); then
        printf ', could not start: %s' "$(tail -1 "$log" 2>/dev/null | cut -c1-100)"
    elif ! grep -q '^test result:' "$log" 2>/dev/null && [[ $(basename "$log") == test-* ]]; then
        printf ', no test summary'
    fi
}

# Records one status line (summary, tarball) and echoes it.
report() {
    local line
    line=$(printf '%-22s %s (%s)' "$1:" "$2" "$3")
    echo "$line" >>"$WORK/status.txt"
    echo "gpu-check run: $line" >&2
    case $2 in ok | SKIPPED*) ;; *) FAILED_STEPS=$((FAILED_STEPS + 1)) ;; esac
}

# One step running a Python script of the bundle where the package and
# PyTorch import: python_step NAME LIMIT LOG SCRIPT.
python_step() {
    local name=$1 limit=$2 log=$3 script=$4
    if [[ -n $nogpu ]]; then
        skip "$name" "$nogpu"
    elif ! timeout 60 python3 -c 'import vmm_arena.torch, vmm_arena.vllm, torch' 2>/dev/null; then
        skip "$name" "python3 lacks vmm_arena (pip install ./python) or torch"
    else
        run_step "$name" "$limit" "$WORK/$log" python3 "$BUNDLE/$script"
    fi
}

skip() {
    printf '%-22s SKIPPED %s\n' "$1:" "$2" >>"$WORK/status.txt"
    echo "gpu-check run: $1: SKIPPED $2" >&2
}

# Writes the four result files (five with kv-profile.json); runs on every
# exit, even an interrupted one.
finalize() {
    [[ -n ${WORK:-} && -d ${WORK:-} ]] || return 0
    local total=$((SECONDS - RUN_START))
    {
        echo "# Driver call latency (gpu_measure)"
        echo
        if [[ -s $WORK/gpu-measure.md && $MEASURE_STATUS == ok ]]; then
            sed '1{/^# /d}' "$WORK/gpu-measure.md"
        else
            echo "Not measured: gpu_measure $MEASURE_STATUS."
        fi
    } >"$OUT_DIR/driver_latency.md"
    {
        echo "# PyTorch: native vs expandable segments vs vmm-arena"
        echo
        if [[ -s $WORK/torch-check.md ]]; then
            echo "Step: $TORCH_STATUS."
            echo
            cat "$WORK/torch-check.md"
        else
            echo "Not compared: PyTorch $TORCH_STATUS."
        fi
    } >"$OUT_DIR/pytorch_comparison.md"
    {
        echo "gpu-check: $([[ $GPU == none ]] && echo "no GPU (nothing was checked on a GPU)" || echo "GPU: $GPU")"
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), host: $(uname -srm), took ${total}s"
        echo "build: $(sed -n 's/^commit: //p' "$BUNDLE/MANIFEST.txt" 2>/dev/null | grep . || echo 'unknown (no MANIFEST.txt)')"
        echo "result: $([[ $FAILED_STEPS == 0 ]] && echo ok || echo "$FAILED_STEPS step(s) FAILED or TIMEOUT")$([[ $INTERRUPTED == 1 ]] && echo ' (interrupted)')"
        echo
        cat "$WORK/status.txt" 2>/dev/null
        echo
        echo "files: summary.txt, driver_latency.md, pytorch_comparison.md, gpu-check-logs.tar.gz (every log)$([[ -s $WORK/kv-profile.json && $MEASURE_STATUS == ok ]] && echo ', kv-profile.json')"
    } >"$WORK/summary.txt"
    cp "$WORK/summary.txt" "$OUT_DIR/summary.txt"
    if [[ -s $WORK/kv-profile.json && $MEASURE_STATUS == ok ]]; then
        cp "$WORK/kv-profile.json" "$OUT_DIR/kv-profile.json"
    fi
    cp "$OUT_DIR/driver_latency.md" "$OUT_DIR/pytorch_comparison.md" "$WORK/" 2>/dev/null
    tar -czf "$OUT_DIR/gpu-check-logs.tar.gz" -C "$WORK" . 2>/dev/null ||
        echo "gpu-check run: could not write the log tarball" >&2
    rm -rf "$WORK"
    WORK=
}

cmd_run() {
    set +e # every step reports on its own; nothing below may end the run
    BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    OUT_DIR=${1:-${OUT:-$BUNDLE/results}}
    mkdir -p "$OUT_DIR" || exit 1
    OUT_DIR=$(cd "$OUT_DIR" && pwd)
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || exit 1
    RUN_START=$SECONDS FAILED_STEPS=0 INTERRUPTED=0 GPU=none
    MEASURE_STATUS="SKIPPED (not reached)" TORCH_STATUS="SKIPPED (not reached)"
    : >"$WORK/status.txt"
    trap finalize EXIT
    trap 'INTERRUPTED=1; exit 130' INT TERM

    local bin=$BUNDLE/bin name log
    [[ -d $bin ]] || echo "gpu-check run: no bin/ beside $0 (run 'gpu-check.sh build' first): test steps are SKIPPED" >&2

    # 1. Is there a GPU? VMM_ARENA_GPU_CHECK_NO_GPU=1 says no (the host test).
    local nogpu="no GPU"
    if [[ ${VMM_ARENA_GPU_CHECK_NO_GPU:-0} == 1 ]]; then
        skip gpu-info "no GPU (VMM_ARENA_GPU_CHECK_NO_GPU=1)"
    elif ! command -v nvidia-smi >/dev/null; then
        skip gpu-info "no GPU (no nvidia-smi)"
    else
        run_step gpu-info "$(cap $LIMIT_INFO)" "$WORK/nvidia-smi.txt" \
            bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader && echo && nvidia-smi'
        if [[ $STEP_STATUS == ok ]]; then
            GPU=$(head -1 "$WORK/nvidia-smi.txt")
            [[ -n $GPU && $GPU != *"No devices"* ]] || GPU=none
        else
            nogpu="no GPU (nvidia-smi $STEP_STATUS)" # a hung or failing driver
        fi
    fi
    [[ $GPU == none ]] || nogpu=

    export RUST_BACKTRACE=1
    # The CUDA tests must fail, not skip, where a GPU was found.
    [[ -z $nogpu ]] && export VMM_ARENA_REQUIRE_GPU=${VMM_ARENA_REQUIRE_GPU-1}

    # Test binaries run from the repository root (the device tool starts
    # there; the bundle's own copy of the corpus otherwise), so fuzz_replay
    # finds fuzz/corpus/ops when the build tree's path does not exist.
    local root=$BUNDLE cand
    for cand in "$PWD" "$BUNDLE/../.."; do
        if [[ -d $cand/fuzz/corpus/ops ]]; then
            root=$(cd "$cand" && pwd)
            break
        fi
    done
    cd "$root" || exit 1 # every path below is absolute
    echo "gpu-check run: steps run in $root" >&2

    # The GPU steps first: if the machine is taken back early, what only a
    # GPU can tell is already in the logs (the EXIT trap writes the files).
    # 2. The CUDA backend's own tests.
    if [[ -n $nogpu ]]; then
        skip cuda_backend "$nogpu"
    elif [[ ! -x $bin/test-cuda_backend ]]; then
        skip cuda_backend "not built (bin/test-cuda_backend missing)"
    else
        run_step cuda_backend "$(cap $LIMIT_CUDA)" "$WORK/test-cuda_backend.log" \
            "$bin/test-cuda_backend" --test-threads=8
    fi

    # 3. Driver call latencies.
    if [[ -n $nogpu ]]; then
        MEASURE_STATUS="SKIPPED ($nogpu)"
        skip gpu_measure "$nogpu"
    elif [[ ! -x $bin/gpu_measure ]]; then
        MEASURE_STATUS="SKIPPED (not built)"
        skip gpu_measure "not built (bin/gpu_measure missing)"
    else
        run_step gpu_measure "$(cap $LIMIT_MEASURE)" "$WORK/gpu-measure.log" "$bin/gpu_measure" --out "$WORK"
        MEASURE_STATUS=$STEP_STATUS
        if [[ $STEP_STATUS == ok ]] && grep -q '"status": "unsupported"' "$WORK/gpu-measure.json" 2>/dev/null; then
            MEASURE_STATUS="FAILED (CUDA unsupported)"
            sed -i '$d' "$WORK/status.txt" # replaces run_step's "ok" line
            report gpu_measure "FAILED" "${STEP_SECS}s, a GPU was found but CUDA is unsupported; see gpu-measure.log"
        fi
        if [[ $MEASURE_STATUS == ok ]]; then
            # The arena's unmap probe (also in gpu-measure.md and .json):
            # true = one cuMemUnmap may cover several separate mappings.
            local spans
            spans=$(grep -o '"unmap_spans_mappings": [a-z]*' "$WORK/gpu-measure.json" 2>/dev/null | awk '{print $2}')
            echo "gpu-check run: one cuMemUnmap over separate mappings accepted (the arena's probe): ${spans:-unknown}" >&2
        fi
    fi

    # 3b. The attention measurement's own checks, with deliberately bad
    # kernels in place of paged: a broken one must fail verification (exit
    # non-zero, no attn_eff_*), a slow one must be marked INVALID by the
    # bandwidth rule at the full decode size.
    if [[ -z $nogpu && -x $bin/gpu_measure && $MEASURE_STATUS == ok ]]; then
        local rc=0
        timeout -k "$KILL_GRACE" "$(cap $LIMIT_ATTN_CHECK)" "$bin/gpu_measure" --attention-only --quick \
            --kernel-variant broken >"$WORK/attention-broken.log" 2>&1 || rc=$?
        if ((rc != 0)) && grep -q "FAILED: attention_paged_broken" "$WORK/attention-broken.log"; then
            report attention_broken_rejected "ok" "the broken kernel failed verification (rc=$rc)"
        else
            report attention_broken_rejected "FAILED" "rc=$rc: the broken kernel was not rejected; see attention-broken.log"
        fi
        rc=0
        timeout -k "$KILL_GRACE" "$(cap $LIMIT_ATTN_CHECK)" "$bin/gpu_measure" --attention-only \
            --kernel-variant slow >"$WORK/attention-slow.log" 2>&1 || rc=$?
        if ((rc == 0)) && grep -q "^| paged | attention_paged_slow .*INVALID |" "$WORK/attention-slow.log"; then
            report attention_slow_rejected "ok" "the slow kernel was marked INVALID"
        else
            report attention_slow_rejected "FAILED" "rc=$rc: the slow kernel was not marked INVALID; see attention-slow.log"
        fi
    fi

    # 4. PyTorch, through the library's torch entry points.
    if [[ -n $nogpu ]]; then
        TORCH_STATUS="SKIPPED ($nogpu)"
        skip pytorch "$nogpu"
    elif [[ ! -f $BUNDLE/lib/libvmm_arena.so || ! -f $BUNDLE/torch_check.py ]]; then
        TORCH_STATUS="SKIPPED (lib/libvmm_arena.so or torch_check.py missing)"
        skip pytorch "lib/libvmm_arena.so or torch_check.py missing"
    elif ! command -v python3 >/dev/null; then
        TORCH_STATUS="SKIPPED (no python3)"
        skip pytorch "no python3"
    elif ! timeout 10 python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
        # find_spec does not import torch: the cold import is left to the children.
        TORCH_STATUS="SKIPPED (python3 has no torch)"
        skip pytorch "python3 has no torch"
    else
        run_step pytorch "$(cap $LIMIT_TORCH)" "$WORK/torch-check.log" \
            python3 "$BUNDLE/torch_check.py" --lib "$BUNDLE/lib/libvmm_arena.so" --out "$WORK" \
            --timeout "$TORCH_CHILD" --d-model 768 --layers 8 --tokens 200 --steps 5
        TORCH_STATUS=$STEP_STATUS
    fi

    # 4b-4d. The Python package's scripts, where it is installed beside
    # PyTorch: an RL cycle through vmm_arena.torch (pause and resume by tag,
    # the backup copy rate), torch_memory_saver's preload mode (LD_PRELOAD of
    # the package's shim in a child: raw cudaMalloc inside regions on the
    # arena), vLLM's CuMemAllocator behaviours through vmm_arena.vllm.
    python_step torch_rl_cycle 300 torch-rl-cycle.log torch_rl_cycle.py
    python_step torch_preload_check 120 torch-preload-check.log torch_preload_check.py
    python_step vllm_cumem_check 120 vllm-cumem-check.log vllm_cumem_check.py

    # 5. The fuzz corpus replay.
    if [[ ! -x $bin/test-fuzz_replay ]]; then
        skip fuzz_replay "not built (bin/test-fuzz_replay missing)"
    else
        run_step fuzz_replay "$(cap $LIMIT_FUZZ)" "$WORK/test-fuzz_replay.log" \
            "$bin/test-fuzz_replay" --nocapture
    fi

    # 6. The model, fault-matrix and concurrency suites on the GPU.
    local suites_start=$SECONDS left n=0 f suite
    for suite in model faults concurrency; do
        f=$bin/test-$suite
        if [[ -n $nogpu ]]; then
            skip "cuda-$suite" "no GPU"
            continue
        elif [[ ! -x $f ]]; then
            skip "cuda-$suite" "not built (bin/test-$suite missing)"
            continue
        fi
        left=$((LIMIT_SUITES_TOTAL - (SECONDS - suites_start)))
        if ((left < 3)); then
            skip "cuda-$suite" "suite budget of ${LIMIT_SUITES_TOTAL}s spent"
            continue
        fi
        local filter=()
        [[ $suite == model ]] && filter=(cuda_backend_matches_the_model)
        VMM_ARENA_TEST_BACKEND=cuda run_step "cuda-$suite" "$(cap $left)" "$WORK/test-cuda-$suite.log" \
            "$f" "${filter[@]}" --nocapture --test-threads=4
    done

    # 7. Every other test binary (host backend), within a shared budget.
    local host_start=$SECONDS
    shopt -s nullglob
    for f in "$bin"/test-*; do
        name=${f##*/test-}
        [[ $name == cuda_backend || $name == fuzz_replay ]] && continue
        [[ -z $nogpu && ( $name == model || $name == faults || $name == concurrency ) ]] && continue
        n=$((n + 1))
        left=$((LIMIT_HOST_TOTAL - (SECONDS - host_start)))
        if ((left < 3)); then
            skip "$name" "host-test budget of ${LIMIT_HOST_TOTAL}s spent"
            continue
        fi
        ((left > LIMIT_HOST_EACH)) && left=$LIMIT_HOST_EACH
        run_step "$name" "$(cap $left)" "$WORK/test-$name.log" "$f" --test-threads=8
    done
    ((n > 0)) || skip host-tests "not built (no other bin/test-* binary)"

    echo "gpu-check run: results in $OUT_DIR; $((SECONDS - RUN_START))s" >&2
    local rc=0
    ((FAILED_STEPS == 0)) || rc=1
    [[ -n $nogpu && ${VMM_ARENA_REQUIRE_GPU:-} == 1 ]] && rc=2
    finalize
    return "$rc"
}

case ${1:-} in
build) shift; cmd_build "$@" ;;
run) shift; cmd_run "$@" ;;
*) usage ;;
esac
