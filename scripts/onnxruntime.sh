#!/usr/bin/env bash
# ONNX Runtime on vmm-arena (integrations/onnxruntime): its tests and a
# short run of its benchmark, on the onnxruntime wheel's C library.
#
#   scripts/onnxruntime.sh [--bench-only | --tests-only]
#
# Python: $VMM_ARENA_PYTHON, a python with the onnxruntime, onnx and numpy
# wheels installed (CI: VMM_ARENA_PYTHON=target/ci/pyenv/bin/python). When
# unset, a venv is made under <target>/onnxruntime/pyenv and they are pip
# installed from PyPI. The python builds the decoder model (onnx package)
# and says where the wheel's libonnxruntime.so is; nothing is downloaded at
# build time (the Rust side opens that library at run time).
#
# Builds libvmm_arena (the C ABI) with `cargo build --release -p
# vmm-arena-ffi` into $CARGO_TARGET_DIR (default target/), then runs
# `cargo fmt --check`, clippy, `cargo test --release` and
# `cargo run --release --example bench -- --quick` in
# integrations/onnxruntime (its own cargo project, its own target/). The
# benchmark's figures go to <target>/onnxruntime/bench_quick.json.
# About 2 minutes on a 2-core machine once the crates are built.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

mode=${1:-all}
case $mode in
all | --tests-only | --bench-only) ;;
*)
    echo "usage: scripts/onnxruntime.sh [--tests-only | --bench-only]" >&2
    exit 2
    ;;
esac

target=${CARGO_TARGET_DIR:-target}
case $target in /*) ;; *) target=$root/$target ;; esac
work=$target/onnxruntime
mkdir -p "$work"

python=${VMM_ARENA_PYTHON:-}
if [ -z "$python" ]; then
    python=$work/pyenv/bin/python
    if [ ! -x "$python" ]; then
        echo "onnxruntime.sh: making a venv at $work/pyenv"
        python3 -m venv "$work/pyenv"
    fi
    if ! "$python" -c "import onnxruntime, onnx, numpy" 2>/dev/null; then
        echo "onnxruntime.sh: pip install onnxruntime onnx numpy"
        "$python" -m pip install -q onnxruntime onnx numpy
    fi
fi
# The tests run from integrations/onnxruntime: a relative path must not
# change meaning there.
case $python in */*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;; esac
if ! "$python" -c "import onnxruntime, onnx, numpy" 2>/dev/null; then
    echo "onnxruntime.sh: $python cannot import onnxruntime, onnx and numpy" >&2
    echo "  (pip install onnxruntime onnx numpy into it, or unset VMM_ARENA_PYTHON)" >&2
    exit 1
fi
ORT_DYLIB_PATH=$("$python" - <<'EOF'
import glob, os, onnxruntime
capi = os.path.join(os.path.dirname(onnxruntime.__file__), "capi")
print(sorted(glob.glob(os.path.join(capi, "libonnxruntime.so*")))[0])
EOF
)
"$python" -c "import onnxruntime, onnx; print('onnxruntime', onnxruntime.__version__, '| onnx', onnx.__version__)"
echo "library: $ORT_DYLIB_PATH"
export VMM_ARENA_PYTHON=$python ORT_DYLIB_PATH

cargo build --release -p vmm-arena-ffi --lib --target-dir "$target"
export VMM_ARENA_LIB_DIR=$target/release

cd integrations/onnxruntime
if [ "$mode" != --bench-only ]; then
    # Its own cargo project: the workspace's format and clippy steps do not
    # reach it.
    cargo fmt --check
    cargo clippy --release --all-targets -- -D warnings
    # One test binary at a time (cargo's default): each is one process with
    # its own ONNX Runtime environment and resident set.
    cargo test --release
fi
if [ "$mode" != --tests-only ]; then
    cargo run --release --example bench -- --quick --json "$work/bench_quick.json"
fi
