#!/usr/bin/env bash
# The C and C++ thread tests of ffi/tests under ThreadSanitizer:
#
#   ffi/tests/c/test_threads.c       eight pthreads on one arena
#   ffi/tests/c/test_group.c         pthreads sharing one device group
#   ffi/tests/cpp/test_wrapper.cpp   the C++ wrapper, std::threads included
#                                    (concurrent set_move_callback among them)
#
# built with -fsanitize=thread and linked to the normal (release, not
# instrumented) libvmm_arena. A data race, a lock-order inversion or any
# other TSan report fails the run.
#
# What TSan checks here: the C/C++ side, i.e. the test programs, the
# header-only C++ wrapper and the move callbacks. The Rust library itself is
# not instrumented: that would need nightly -Zsanitizer=thread and a rebuilt
# std (-Zbuild-std). Its locking is covered instead by the loom model and the
# Rust concurrency tests. Because TSan cannot see the library's lock, the
# programs are linked with ffi/tests/tsan/serialize_calls.c, which runs every
# library call under one pthread mutex (see that file for why this neither
# adds false reports nor hides the wrapper's races). Before the programs, a
# deliberately racy one must be caught, so that a silently broken TSan
# cannot pass this step.
#
#   scripts/tsan.sh
#
# Uses $CC/$CXX (default gcc/g++; clang works too) and $CARGO_TARGET_DIR
# (default target/); programs and logs go to <target>/tsan/.
set -euo pipefail
cd "$(dirname "$0")/.."

target=${CARGO_TARGET_DIR:-target}
case $target in /*) ;; *) target=$PWD/$target ;; esac
cargo build --release -p vmm-arena-ffi --lib --target-dir "$target"
lib=$target/release
work=$target/tsan
mkdir -p "$work"

cc=${CC:-gcc}
cxx=${CXX:-g++}
# VMM_ARENA_CALLS_SERIALIZED: test_threads skips its run with the arena's
# background worker, a thread inside the library whose state accesses go
# under the library's own (uninstrumented) lock, not serialize_calls' one,
# so TSan would report them falsely. The worker's locking is checked by the
# loom model and the Rust concurrency tests (tests/prefetch.rs).
flags=(-Wall -Wextra -Werror -g -O1 -pthread -fsanitize=thread -DVMM_ARENA_CALLS_SERIALIZED -I ffi/include -I ffi/tests/c)
link=(-ldl -L "$lib" -lvmm_arena "-Wl,-rpath,$lib")
# halt_on_error: the first report ends the program with exitcode.
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"

# The sanity check: a plain data race must be reported.
cat >"$work/racy.c" <<'C'
#include <pthread.h>
static int shared;
static void *bump(void *arg) { (void)arg; for (int i = 0; i < 1000; i++) shared++; return 0; }
int main(void) {
  pthread_t t;
  pthread_create(&t, 0, bump, 0);
  bump(0);
  pthread_join(t, 0);
  return 0;
}
C
"$cc" -std=c11 -g -O1 -pthread -fsanitize=thread -o "$work/racy" "$work/racy.c"
if "$work/racy" >"$work/racy.log" 2>&1 || ! grep -q 'ThreadSanitizer: data race' "$work/racy.log"; then
    echo "tsan.sh: ThreadSanitizer did not report a known data race; is it working?"
    cat "$work/racy.log"
    exit 1
fi
echo "tsan: sanity check: a known race is reported"

"$cc" -std=c11 "${flags[@]}" -c -o "$work/serialize_calls.o" ffi/tests/tsan/serialize_calls.c

# name:language:source
programs=(
    test_threads:c:ffi/tests/c/test_threads.c
    test_group:c:ffi/tests/c/test_group.c
    test_wrapper:cpp:ffi/tests/cpp/test_wrapper.cpp
)

failed=0
for p in "${programs[@]}"; do
    IFS=: read -r name lang src <<<"$p"
    exe=$work/$name
    if [ "$lang" = c ]; then
        "$cc" -std=c11 -Wstrict-prototypes "${flags[@]}" -o "$exe" "$src" "$work/serialize_calls.o" "${link[@]}"
    else
        "$cxx" -std=c++17 "${flags[@]}" -o "$exe" "$src" "$work/serialize_calls.o" "${link[@]}"
    fi
    log=$work/$name.log
    start=$(date +%s)
    # A time limit ($VMM_ARENA_TSAN_TIMEOUT_S, default 300 s): a hang fails
    # with a message instead of eating CI's budget.
    if timeout --kill-after=10 "${VMM_ARENA_TSAN_TIMEOUT_S:-300}" "$exe" >"$work/$name.out" 2>"$log" &&
        ! grep -q 'ThreadSanitizer' "$log"; then
        verdict=ok
    else
        rc=$?
        verdict=FAILED
        if [ $rc = 124 ] || [ $rc = 137 ]; then verdict="FAILED (timed out after ${VMM_ARENA_TSAN_TIMEOUT_S:-300}s)"; fi
        failed=1
    fi
    secs=$(($(date +%s) - start))
    echo "tsan $name: $verdict in ${secs}s ($(tail -n 1 "$work/$name.out"))"
    if [ "$verdict" != ok ]; then
        head -n 60 "$log"
        tail -n 5 "$work/$name.out"
    fi
done
exit $failed
