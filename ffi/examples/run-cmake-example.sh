#!/usr/bin/env bash
# Builds and runs the CMake example (kv_cache_cpp) against an installed
# vmm_arena, the way a C++ project consumes it:
#   1. installs cmake (and make, pkg-config) with apt-get when missing;
#   2. installs the library into a temporary prefix with ffi/install.sh;
#   3. configures, builds and runs the example with ctest, once finding the
#      library through its CMake package (find_package) and once through
#      pkg-config.
# Environment: VMM_ARENA_PROFILE (cargo profile to install; default release),
# CARGO_TARGET_DIR (honoured), KEEP_WORKDIR=1 (keep the temporary tree).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ffi="$(dirname "$here")"

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v c++ >/dev/null 2>&1 || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  echo "run-cmake-example: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "run-cmake-example: ${missing[*]} missing and no apt-get to install them" >&2
    exit 1
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
cmake --version | head -n 1

work="$(mktemp -d "${TMPDIR:-/tmp}/vmm-arena-cmake.XXXXXX")"
if [ "${KEEP_WORKDIR:-0}" = 1 ]; then
  echo "run-cmake-example: work tree kept in $work"
else
  trap 'rm -rf "$work"' EXIT
fi
prefix="$work/prefix"

"$ffi/install.sh" --prefix "$prefix" --profile "${VMM_ARENA_PROFILE:-release}"

for mode in config pkgconfig; do
  echo "run-cmake-example: building kv_cache_cpp, finding vmm_arena with: $mode"
  build="$work/build-$mode"
  PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
    cmake -S "$here/kv_cache_cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" -DKV_CACHE_FIND_WITH="$mode"
  cmake --build "$build" --parallel 2
  (cd "$build" && ctest --output-on-failure --verbose)
done
echo "run-cmake-example: OK"
