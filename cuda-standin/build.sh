#!/usr/bin/env bash
# Builds the CUDA driver stand-in as OUT/libcuda.so (+ .so.1, the name the
# NVIDIA driver installs) and its own test program OUT/standin-rules.
#   bash cuda-standin/build.sh [OUT]     (default: target/cuda-standin)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../target/cuda-standin}
mkdir -p "$out"
cflags=(-std=c11 -O1 -g -Wall -Wextra -Werror -fPIC -pthread)
gcc "${cflags[@]}" -shared -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1" \
    "$here/state.c" "$here/vmm.c" "$here/stream.c" "$here/module.c"
ln -sf libcuda.so.1 "$out/libcuda.so"
gcc "${cflags[@]}" -o "$out/standin-rules" "$here/tests/rules.c" -L"$out" -lcuda -Wl,-rpath,"$out"
echo "$out"
