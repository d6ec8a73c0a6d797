#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of vmm-arena's cargo-fuzz targets.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS per target (default 60); targets `ops` (operation sequences against
# a model, on the in-memory driver with injected failures) and `c_abi` (the C
# ABI with arbitrary ids, sizes, flags, NULLs and struct sizes), both by
# default. See fuzz/logic/*.rs.
#
# Needs nightly Rust (`cargo +nightly`), which it installs with rustup when
# missing, and cargo-fuzz, which it installs with `cargo install cargo-fuzz
# --locked` when missing. Without either it
# says why and exits 0: fuzzing is a bonus where the toolchain allows; the
# committed corpus runs on stable in `cargo test` anyway.
#
# New inputs go to a scratch corpus (target/fuzz-corpus/TARGET, seeded from
# a copy of the committed fuzz/corpus/TARGET, which this script never
# changes; `cargo +nightly fuzz cmin` or -merge=1 into it is a manual step). A
# crash stops the run: libFuzzer writes fuzz/artifacts/TARGET/crash-*, the
# script prints how to replay it on stable Rust and exits 1.
#
# Prints the executions of each target (libFuzzer's final stats) and writes
# them to target/fuzz-corpus/executions.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(ops c_abi)

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing the nightly toolchain (rustup toolchain install nightly --profile minimal)"
    if ! rustup toolchain install nightly --profile minimal || ! cargo +nightly --version >/dev/null 2>&1; then
        echo "fuzz.sh: no nightly toolchain (cargo +nightly): skipping the fuzz run"
        exit 0
    fi
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz (cargo install cargo-fuzz --locked)"
    if ! cargo install cargo-fuzz --locked; then
        echo "fuzz.sh: cargo-fuzz could not be installed: skipping the fuzz run"
        exit 0
    fi
fi

scratch=target/fuzz-corpus
mkdir -p "$scratch"
summary="$scratch/executions.txt"
: >"$summary"
status=0
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t"
    # A copy of the committed corpus as the seed: libFuzzer may rewrite
    # files of any corpus directory it is given.
    rm -rf "$scratch/$t-seed"
    cp -r "fuzz/corpus/$t" "$scratch/$t-seed"
    log="$scratch/$t.log"
    echo "==== fuzz $t for ${seconds}s"
    # -rss_limit_mb: the c_abi target's arenas commit up to 16 MiB each.
    # -max_len=128: inputs of about 20 operations (ops) or 15 calls
    # (c_abi). Every operation is followed by the whole model check, so an
    # input's cost grows with its length: libFuzzer's default grows inputs
    # past 1 KiB (96 operations), at about a third of the rate (measured on
    # ops). The property test runs sequences of up to 80.
    # -entropic=0: libFuzzer's default scheduler (entropic) keeps per-input
    # frequencies of rare features, updated for every feature an execution
    # hits; these targets hit thousands (every operation is followed by a
    # wide check), and that bookkeeping was over half of each execution's
    # CPU time (`perf`). Off, the same binaries ran 2.4-2.7 times as many
    # inputs in 60 s and reached more edges (RELIABILITY.md, "Execution
    # rates").
    # --no-trace-compares: no comparison tracing (libFuzzer's hints for
    # magic values; the inputs here decode any byte to something valid).
    # The C ABI target passes raw pointers and buffers of exact sizes:
    # AddressSanitizer (cargo-fuzz's default) checks them. The ops target is
    # safe Rust on the in-memory driver, where ASan finds nothing and costs
    # a factor of 5 in speed.
    case $t in ops) san=none ;; *) san=address ;; esac
    # Built first, so that the time limit below is all fuzzing.
    cargo +nightly fuzz build -s "$san" --no-trace-compares "$t" >"$scratch/$t.build.log" 2>&1 || {
        tail -n 30 "$scratch/$t.build.log"
        exit 1
    }
    start=$(date +%s)
    if cargo +nightly fuzz run -s "$san" --no-trace-compares "$t" "$scratch/$t" "$scratch/$t-seed" -- \
        -max_total_time="$seconds" -max_len=128 -entropic=0 -print_final_stats=1 -rss_limit_mb=4096 -timeout=60 >"$log" 2>&1; then
        :
    else
        status=1
        tail -n 60 "$log"
        echo "fuzz.sh: $t FAILED; the crashing input is in fuzz/artifacts/$t/"
        case $t in
            ops) echo "replay on stable: VMM_ARENA_FUZZ_INPUT=\$PWD/fuzz/artifacts/$t/<file> cargo test --test fuzz_replay" ;;
            c_abi) echo "replay on stable: VMM_ARENA_FUZZ_INPUT=\$PWD/fuzz/artifacts/$t/<file> cargo test -p vmm-arena-ffi --lib fuzz_replay" ;;
        esac
    fi
    took=$(($(date +%s) - start))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
    corpus=$(find "$scratch/$t" -type f | wc -l)
    line="$t: ${runs:-?} executions in ${took}s, coverage ${cov:-?} edges, scratch corpus $corpus inputs"
    echo "$line" | tee -a "$summary"
done
exit $status
