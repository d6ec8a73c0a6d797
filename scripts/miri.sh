#!/usr/bin/env bash
# Miri (undefined-behaviour checker) on the pure policy modules with the
# in-memory driver:
#
#   1. the library's unit tests (va, compact incl. a small property test,
#      arena state and slabs, ids, errors, the mock and fault drivers, the
#      CUDA rules checker); the tests that make system calls (host backend,
#      loading libcuda) are ignored under Miri;
#   2. tests/fuzz_replay.rs: the committed `ops` fuzz corpus, i.e. whole
#      arenas (alloc, grow, move, compact, trim, release, injected driver
#      failures) on MockDriver + FaultDriver, checked against the model:
#      $VMM_ARENA_FUZZ_MAX_INPUTS inputs (default 6, spread over the sorted
#      corpus) and the first $VMM_ARENA_FUZZ_MAX_OPS operations of each
#      (default 16): under Miri an operation with its checks takes ~4 s, so
#      this part takes about 5 minutes, the whole script about 8.
#
#   scripts/miri.sh [lib|replay]     default: both
#
# Installs the miri and rust-src components of the nightly toolchain when
# missing; without nightly it says why and exits 0. Runs in a target
# directory of its own (target/miri by default).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "miri.sh: no nightly toolchain (cargo +nightly): skipping Miri"
    exit 0
fi
if ! cargo +nightly miri --version >/dev/null 2>&1; then
    echo "miri.sh: installing Miri (rustup component add miri rust-src --toolchain nightly)"
    if ! rustup component add miri rust-src --toolchain nightly; then
        echo "miri.sh: Miri could not be installed: skipping"
        exit 0
    fi
fi

export CARGO_TARGET_DIR=${MIRI_TARGET_DIR:-target/miri}
# The replay test reads the corpus files; proptest reads PROPTEST_CASES.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
# Miri runs ~1000x slower than native: few property-test cases.
export PROPTEST_CASES=${PROPTEST_CASES:-8}
export VMM_ARENA_FUZZ_MAX_OPS=${VMM_ARENA_FUZZ_MAX_OPS:-16}
export VMM_ARENA_FUZZ_MAX_INPUTS=${VMM_ARENA_FUZZ_MAX_INPUTS:-6}
what=${1:-all}

cargo +nightly miri setup
if [ "$what" = all ] || [ "$what" = lib ]; then
    echo "==== miri: library unit tests"
    time cargo +nightly miri test -p vmm-arena --lib
fi
if [ "$what" = all ] || [ "$what" = replay ]; then
    echo "==== miri: the ops fuzz corpus on the in-memory driver"
    time cargo +nightly miri test -p vmm-arena --test fuzz_replay -- --nocapture
fi
