#!/usr/bin/env bash
# The GPU check, in two halves (see scripts/README-gpu-check.md).
#
#   scripts/gpu-check.sh build [DIR]     here, with cargo: release test binaries
#                                        and the measuring binary into DIR
#                                        (default out/gpu-check), with this script.
#   DIR/gpu-check.sh run [RESULTS]       there, on the GPU machine: no Rust, no
#                                        network. Runs the tests, then measures;
#                                        writes gpu-check.json, gpu-check.md,
#                                        gpu-measure.json, gpu-measure.md and the
#                                        logs into RESULTS (default $OUT, else
#                                        DIR/results). Under 5 minutes in all.
#
# `run` exits 0 only when every test binary passed and the measurement ran
# (or said CUDA is unsupported, with VMM_ARENA_REQUIRE_GPU unset).
set -euo pipefail

usage() {
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

json_escape() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/ }
    s=${s//$'\n'/ }
    printf '%s' "$s"
}

# --- build: here ----------------------------------------------------------

cmd_build() {
    local root dir
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    dir=${1:-$root/out/gpu-check}
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    rm -rf "${dir:?}/bin"
    mkdir -p "$dir/bin"
    cd "$root"

    local msgs
    msgs=$(mktemp)
    trap 'rm -f "$msgs"' RETURN

    echo "gpu-check build: release test binaries (lib unit tests + tests/*.rs)" >&2
    cargo test --release --lib --tests --no-run --message-format=json >"$msgs"
    echo "gpu-check build: measuring binary (examples/gpu_measure.rs)" >&2
    cargo build --release --example gpu_measure --message-format=json >>"$msgs"
    echo "gpu-check build: C library for the PyTorch check (libvmm_arena.so)" >&2
    cargo build --release -p vmm-arena-ffi

    # One JSON object per line; an artifact with an executable names its target.
    local n=0 line name exe kind
    while IFS= read -r line; do
        case $line in *'"reason":"compiler-artifact"'*'"executable":"'*) ;; *) continue ;; esac
        name=$(sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*/\1/p' <<<"$line")
        exe=$(sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' <<<"$line")
        [[ -n $name && -n $exe ]] || continue
        if grep -q '"profile":{[^}]*"test":true' <<<"$line"; then
            kind=test
        elif [[ $name == gpu_measure ]]; then
            kind=measure
        else
            continue
        fi
        if [[ $kind == test ]]; then
            cp "$exe" "$dir/bin/test-$name"
        else
            cp "$exe" "$dir/bin/gpu_measure"
        fi
        n=$((n + 1))
    done <"$msgs"
    [[ -x $dir/bin/gpu_measure ]] || { echo "gpu-check build: gpu_measure was not built" >&2; exit 1; }

    # Debug info makes the release binaries large; the check does not need it.
    if command -v strip >/dev/null; then
        strip --strip-debug "$dir"/bin/* 2>/dev/null || true
    fi
    cp "$root/scripts/gpu-check.sh" "$dir/gpu-check.sh"
    mkdir -p "$dir/lib"
    cp "$root/target/release/libvmm_arena.so" "$dir/lib/"
    cp "$root/scripts/torch_check.py" "$dir/torch_check.py"
    chmod +x "$dir/gpu-check.sh"
    [[ -f $root/scripts/README-gpu-check.md ]] && cp "$root/scripts/README-gpu-check.md" "$dir/"

    # What the binaries need from the GPU machine's C library.
    local glibc=unknown
    if command -v objdump >/dev/null; then
        glibc=$(objdump -T "$dir"/bin/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)
    fi
    {
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
        echo "rustc: $(rustc --version 2>/dev/null || echo unknown)"
        echo "needs: Linux x86_64, ${glibc:-unknown} or newer, an NVIDIA driver (libcuda.so.1) with CUDA 12.x or later"
        echo "binaries:"
        (cd "$dir/bin" && ls -1)
    } >"$dir/MANIFEST.txt"

    echo "gpu-check build: $n binaries in $dir ($(du -sh "$dir" | cut -f1)); needs ${glibc:-unknown}" >&2
    echo "gpu-check build: there, run: bash $dir/gpu-check.sh run [RESULTS]" >&2
}

# --- run: there -----------------------------------------------------------

cmd_run() {
    local dir out
    dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    out=${1:-${OUT:-$dir/results}}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    [[ -d $dir/bin ]] || { echo "gpu-check run: no bin/ beside $0: run 'gpu-check.sh build' first" >&2; exit 2; }

    # Tests and measurements get 200 s; the PyTorch check the last 90 s.
    local budget=200 measure_reserve=90 start=$SECONDS
    local gpu="none found"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
        gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)
        gpu=${gpu:-unknown}
    fi
    echo "gpu-check run: GPU: $gpu" >&2

    # Tests: the CUDA backend tests must not skip here.
    export VMM_ARENA_REQUIRE_GPU=${VMM_ARENA_REQUIRE_GPU-1}
    export VMM_ARENA_TEST_BACKEND=${VMM_ARENA_TEST_BACKEND:-cuda}
    export RUST_BACKTRACE=1
    local failed=0 tests_json="" tests_md="" bin name rc secs t0 left limit passed nfail ignored status
    # The CUDA backend's own tests first, so they run even if time runs short.
    local bins=()
    shopt -s nullglob
    [[ -x $dir/bin/test-cuda_backend ]] && bins+=("$dir/bin/test-cuda_backend")
    for bin in "$dir"/bin/test-*; do
        [[ $bin == "$dir/bin/test-cuda_backend" ]] || bins+=("$bin")
    done
    for bin in "${bins[@]}"; do
        name=$(basename "$bin")
        name=${name#test-}
        left=$((budget - measure_reserve - (SECONDS - start)))
        if ((left < 10)); then
            status=skipped rc=-1 secs=0 passed=0 nfail=0 ignored=0
            echo "gpu-check run: $name skipped (time budget spent)" >&2
        else
            limit=$((left < 120 ? left : 120))
            t0=$SECONDS
            rc=0
            timeout -k 5 "$limit" "$bin" --test-threads=8 >"$out/test-$name.log" 2>&1 || rc=$?
            secs=$((SECONDS - t0))
            passed=$(grep -o '[0-9]* passed' "$out/test-$name.log" | awk '{s+=$1} END {print s+0}')
            nfail=$(grep -o '[0-9]* failed' "$out/test-$name.log" | awk '{s+=$1} END {print s+0}')
            ignored=$(grep -o '[0-9]* ignored' "$out/test-$name.log" | awk '{s+=$1} END {print s+0}')
            if ((rc == 0)); then status=ok; elif ((rc == 124 || rc == 137)); then status=timeout; else status=failed; fi
            echo "gpu-check run: $name: $status ($passed passed, $nfail failed, ${secs}s)" >&2
        fi
        [[ $status == ok ]] || failed=1
        tests_json+="${tests_json:+,}"$'\n'"    {\"binary\": \"$(json_escape "$name")\", \"status\": \"$status\", \"exit_code\": $rc, \"passed\": $passed, \"failed\": $nfail, \"ignored\": $ignored, \"seconds\": $secs, \"log\": \"test-$(json_escape "$name").log\"}"
        tests_md+="| \`$name\` | $status | $passed | $nfail | $ignored | $secs |"$'\n'
    done

    # Measurements.
    left=$((budget - (SECONDS - start)))
    limit=$((left < 150 ? left : 150))
    ((limit < 20)) && limit=20
    t0=$SECONDS
    local mrc=0 mstatus
    echo "gpu-check run: measuring (limit ${limit}s)" >&2
    timeout -k 5 "$limit" "$dir/bin/gpu_measure" --out "$out" >"$out/gpu-measure.log" 2>&1 || mrc=$?
    local msecs=$((SECONDS - t0))
    if ((mrc != 0)); then
        mstatus=failed
        ((mrc == 124 || mrc == 137)) && mstatus=timeout
        failed=1
    elif grep -q '"status": "unsupported"' "$out/gpu-measure.json" 2>/dev/null; then
        mstatus=unsupported
        [[ $VMM_ARENA_REQUIRE_GPU == 1 ]] && failed=1
    else
        mstatus=ok
    fi
    echo "gpu-check run: measurement: $mstatus (${msecs}s)" >&2

    # PyTorch: native vs expandable segments vs vmm-arena (where torch is installed).
    local tstatus="skipped (no python3 with torch)" trc=0
    if command -v python3 >/dev/null && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
        echo "gpu-check run: PyTorch check" >&2
        timeout -k 5 95 python3 "$dir/torch_check.py" --lib "$dir/lib/libvmm_arena.so" --out "$out" \
            --timeout 30 --d-model 768 --layers 8 --tokens 200 --steps 5 >"$out/torch-check.log" 2>&1 || trc=$?
        if ((trc == 0)); then tstatus=ok; else tstatus="failed (exit $trc)"; failed=1; fi
    fi
    echo "gpu-check run: PyTorch check: $tstatus" >&2

    local total=$((SECONDS - start)) when
    when=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    {
        echo "{"
        echo "  \"date\": \"$when\","
        echo "  \"gpu\": \"$(json_escape "$gpu")\","
        echo "  \"host\": \"$(json_escape "$(uname -srm)")\","
        echo "  \"build\": \"$(json_escape "$(sed -n 's/^commit: //p' "$dir/MANIFEST.txt" 2>/dev/null)")\","
        echo "  \"ok\": $([[ $failed == 0 ]] && echo true || echo false),"
        echo "  \"seconds\": $total,"
        echo "  \"tests\": [${tests_json}"
        echo "  ],"
        echo "  \"measure\": {\"status\": \"$mstatus\", \"exit_code\": $mrc, \"seconds\": $msecs, \"json\": \"gpu-measure.json\", \"log\": \"gpu-measure.log\"},"
        echo "  \"torch\": {\"status\": \"$(json_escape "$tstatus")\", \"json\": \"torch-check.json\", \"log\": \"torch-check.log\"}"
        echo "}"
    } >"$out/gpu-check.json"
    {
        echo "# GPU check"
        echo
        echo "Date: $when. GPU: $gpu. Host: $(uname -srm). Build: $(sed -n 's/^commit: //p' "$dir/MANIFEST.txt" 2>/dev/null). Took ${total} s."
        echo
        echo "## Tests"
        echo
        echo "| binary | status | passed | failed | ignored | seconds |"
        echo "|---|---|---:|---:|---:|---:|"
        printf '%s' "$tests_md"
        echo
        echo "Measurement: $mstatus (${msecs} s)."
        echo
        if [[ -f $out/gpu-measure.md ]]; then
            sed 's/^#/##/' "$out/gpu-measure.md"
        fi
        echo
        echo "## PyTorch: $tstatus"
        echo
        if [[ -f $out/torch-check.md ]]; then
            cat "$out/torch-check.md"
        fi
    } >"$out/gpu-check.md"
    echo "gpu-check run: results in $out (gpu-check.md, gpu-check.json); ${total}s" >&2
    return "$failed"
}

case ${1:-} in
build) shift; cmd_build "$@" ;;
run) shift; cmd_run "$@" ;;
*) usage ;;
esac
