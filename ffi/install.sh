#!/usr/bin/env bash
# Installs the vmm_arena C ABI library under a prefix:
#
#   <prefix>/include/vmm_arena.h, vmm_arena.hpp, vmm_arena_handles.hpp
#   <prefix>/<libdir>/libvmm_arena.so, libvmm_arena.a
#   <prefix>/<libdir>/cmake/vmm_arena/vmm_arenaConfig.cmake (+ ConfigVersion)
#   <prefix>/<libdir>/pkgconfig/vmm_arena.pc
#
# Usage: ffi/install.sh [--prefix DIR] [--libdir NAME] [--profile NAME]
#                       [--target-dir DIR] [--no-build]
#   --prefix      where to install (default /usr/local)
#   --libdir      library directory under the prefix (default lib)
#   --profile     cargo profile to build and install (default release; dev = debug)
#   --target-dir  cargo target directory (default $CARGO_TARGET_DIR or <repo>/target)
#   --no-build    install what is already built
set -euo pipefail

prefix=/usr/local
libdir=lib
profile=release
target_dir=""
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --prefix=*) prefix="${1#*=}"; shift ;;
    --libdir) libdir="$2"; shift 2 ;;
    --libdir=*) libdir="${1#*=}"; shift ;;
    --profile) profile="$2"; shift 2 ;;
    --profile=*) profile="${1#*=}"; shift ;;
    --target-dir) target_dir="$2"; shift 2 ;;
    --target-dir=*) target_dir="${1#*=}"; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
target_dir="${target_dir:-${CARGO_TARGET_DIR:-$root/target}}"
case "$profile" in
  dev|debug) profile=dev; profile_dir=debug ;;
  *) profile_dir="$profile" ;;
esac
out="$target_dir/$profile_dir"

if [ "$build" = 1 ]; then
  (cd "$root" && cargo build -p vmm-arena-ffi --lib --profile "$profile" --target-dir "$target_dir")
fi
for f in "$out/libvmm_arena.so" "$out/libvmm_arena.a" "$here/include/vmm_arena.h" "$here/include/vmm_arena.hpp" "$here/include/vmm_arena_handles.hpp"; do
  [ -f "$f" ] || { echo "install.sh: $f is missing (build first, or drop --no-build)" >&2; exit 1; }
done

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$here/Cargo.toml" | head -n 1)"
major="${version%%.*}"
minor="${version#*.}"; minor="${minor%%.*}"

mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
install -d "$prefix/include" "$prefix/$libdir/pkgconfig" "$prefix/$libdir/cmake/vmm_arena"
install -m 0644 "$here/include/vmm_arena.h" "$here/include/vmm_arena.hpp" "$here/include/vmm_arena_handles.hpp" "$prefix/include/"
install -m 0755 "$out/libvmm_arena.so" "$prefix/$libdir/"
install -m 0644 "$out/libvmm_arena.a" "$prefix/$libdir/"

# From <prefix>/<libdir>/cmake/vmm_arena back up to <prefix>.
relative=".."
IFS=/ read -r -a parts <<< "$libdir"
for part in "${parts[@]}" cmake; do
  [ -n "$part" ] && relative="$relative/.."
done
subst() {
  sed -e "s|@PREFIX@|$prefix|g" -e "s|@LIBDIR@|$libdir|g" -e "s|@VERSION@|$version|g" \
      -e "s|@VERSION_MAJOR@|$major|g" -e "s|@VERSION_MINOR@|$minor|g" \
      -e "s|@RELATIVE_PREFIX@|$relative|g" "$1" > "$2"
  chmod 0644 "$2"
}
subst "$here/cmake/vmm_arenaConfig.cmake.in" "$prefix/$libdir/cmake/vmm_arena/vmm_arenaConfig.cmake"
subst "$here/cmake/vmm_arenaConfigVersion.cmake.in" "$prefix/$libdir/cmake/vmm_arena/vmm_arenaConfigVersion.cmake"
subst "$here/cmake/vmm_arena.pc.in" "$prefix/$libdir/pkgconfig/vmm_arena.pc"

echo "installed vmm_arena $version ($profile build) under $prefix"
