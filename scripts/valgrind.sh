#!/usr/bin/env bash
# The C and C++ test programs of ffi/tests (the same sources that
# ffi/tests/c_programs.rs builds with AddressSanitizer and UBSan), built
# here WITHOUT sanitizers and run under Valgrind's memcheck:
#
#   valgrind --error-exitcode=1 --leak-check=full --fair-sched=yes
#
# --fair-sched=yes: Valgrind runs one thread at a time, and by default lets
# a thread that releases and retakes a lock without a system call keep
# running, so test_threads' maintainer loop could starve the workers for
# over an hour (CI, 2026-12-01). Each program also runs under a time limit
# ($VMM_ARENA_VALGRIND_TIMEOUT_S, default 300 s) so that a hang fails with
# a message instead of eating CI's budget.
#
# Any invalid read or write, use of uninitialised memory, or leaked block
# (definite or possible) fails the run, but for the suppressions of
# scripts/valgrind.supp (the PyTorch entry points' process-wide arenas).
#
#   scripts/valgrind.sh [PROGRAM...]     default: all of them
#
# Installs valgrind with apt-get when it is missing. Uses $CARGO_TARGET_DIR
# (default target/) for the release build of libvmm_arena; programs and logs
# go to <target>/valgrind/. Exits non-zero if any program fails.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null 2>&1; then
    echo "valgrind.sh: installing valgrind (apt-get)"
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq valgrind >/dev/null
fi
valgrind --version

target=${CARGO_TARGET_DIR:-target}
case $target in /*) ;; *) target=$PWD/$target ;; esac
cargo build --release -p vmm-arena-ffi --lib --target-dir "$target"
lib=$target/release
work=$target/valgrind
mkdir -p "$work"

cc=${CC:-cc}
cxx=${CXX:-c++}
common=(-Wall -Wextra -Werror -g -O1 -pthread -I ffi/include -I ffi/tests/c)
link=(-L "$lib" -lvmm_arena "-Wl,-rpath,$lib")

# name:language:sources (comma-separated)
programs=(
    test_api:c:ffi/tests/c/test_api.c,ffi/tests/c/api_create.c,ffi/tests/c/api_moves.c,ffi/tests/c/api_sleep_share.c,ffi/tests/c/api_stats.c,ffi/tests/c/api_stream.c
    test_threads:c:ffi/tests/c/test_threads.c
    test_torch:c:ffi/tests/c/test_torch.c
    test_faults:c:ffi/tests/c/test_faults.c
    test_group:c:ffi/tests/c/test_group.c
    test_export:c:ffi/tests/c/test_export.c
    test_batch_bytes:c:ffi/tests/c/test_batch_bytes.c
    test_layout:c:ffi/tests/c/test_layout.c
    test_tags:c:ffi/tests/c/test_tags.c
    test_wrapper:cpp:ffi/tests/cpp/test_wrapper.cpp
    test_torch_throw:cpp:ffi/tests/cpp/test_torch_throw.cpp
    contract_program:cpp:ffi/tests/cpp/contract_program.cpp
    kv_cache:cpp:ffi/examples/kv_cache_cpp/main.cpp
    test_preload:c:ffi/tests/c/test_preload.c
)
# Run under LD_PRELOAD of libvmm_arena_preload.so (built next to the
# library), linked to a stand-in CUDA runtime (tests/c/fake_cudart.c).
preloaded=" test_preload "
wanted=("$@")

failed=0
for p in "${programs[@]}"; do
    IFS=: read -r name lang src <<<"$p"
    IFS=, read -r -a srcs <<<"$src"
    if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " == *" $name "* ]]; then
        continue
    fi
    exe=$work/$name
    extra=()
    run_env=()
    if [[ $preloaded == *" $name "* ]]; then
        "$cc" -std=c11 -Wall -Wextra -Werror -g -fPIC -shared -o "$work/libfake_cudart.so" ffi/tests/c/fake_cudart.c
        extra=(-L "$work" -lfake_cudart "-Wl,-rpath,$work" -ldl)
        run_env=(env "LD_PRELOAD=$lib/libvmm_arena_preload.so" "VMM_ARENA_CONF=backend:host,capacity:64MiB,chunk:2MiB")
    fi
    if [ "$lang" = c ]; then
        "$cc" -std=c11 -Wstrict-prototypes "${common[@]}" -o "$exe" "${srcs[@]}" "${link[@]}" "${extra[@]}"
    else
        "$cxx" -std=c++17 "${common[@]}" -o "$exe" "${srcs[@]}" "${link[@]}" "${extra[@]}"
    fi
    log=$work/$name.log
    start=$(date +%s)
    # --num-callers: deep enough that a suppression's frame (the torch
    # entry points, under the arena's call layers) is in the stack it sees.
    if timeout --kill-after=10 "${VMM_ARENA_VALGRIND_TIMEOUT_S:-300}" "${run_env[@]}" \
        valgrind --fair-sched=yes --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,possible \
        --num-callers=64 --track-origins=yes --suppressions=scripts/valgrind.supp --log-file="$log" "$exe" >"$work/$name.out" 2>&1; then
        verdict=ok
    else
        rc=$?
        verdict=FAILED
        if [ $rc = 124 ] || [ $rc = 137 ]; then verdict="FAILED (timed out after ${VMM_ARENA_VALGRIND_TIMEOUT_S:-300}s)"; fi
        failed=1
    fi
    secs=$(($(date +%s) - start))
    errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) errors.*/\1/p' "$log" | tail -n 1)
    lost=$(sed -n 's/.*definitely lost: \([0-9,]*\) bytes.*/\1/p' "$log" | tail -n 1)
    echo "valgrind $name: $verdict in ${secs}s (errors: ${errors:-?}, definitely lost: ${lost:-0} bytes; $(tail -n 1 "$work/$name.out"))"
    if [ "$verdict" != ok ]; then
        tail -n 40 "$log"
        tail -n 5 "$work/$name.out"
    fi
done
exit $failed
