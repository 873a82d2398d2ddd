#!/usr/bin/env bash
# How other projects take dcomm, checked with real consumers:
#   1. installed (meson install into a scratch root): CMake's
#      find_package(dcomm) and the target dcomm::dcomm, pkg-config dcomm,
#      and the installed dcomm-run running the consumer;
#   2. as a Meson subproject: dependency('dcomm') and find_program('dcomm-run').
#
#   check_packaging.sh SOURCE_ROOT BUILD_DIR
# Exit 77 (skipped) where cmake is missing.
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
here="$src/tests/packaging"
command -v cmake >/dev/null || { echo "skipped: cmake is not installed"; exit 77; }
work=$(mktemp -d /tmp/dcomm-packaging-XXXXXX)
trap 'rm -rf "$work"' EXIT
cxx=${CXX:-g++}

echo "== installed"
meson install -C "$build" --no-rebuild --quiet --destdir "$work/root" >/dev/null
prefix=$(meson introspect "$build" --buildoptions |
  python3 -c 'import json, sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
root="$work/root$prefix"
config=$(find "$root" -name dcommConfig.cmake)
[ -n "$config" ] && [ -f "$(dirname "$config")/dcommConfigVersion.cmake" ] ||
  { echo "no dcommConfig.cmake and dcommConfigVersion.cmake under $root"; exit 1; }
echo "installed: ${config#"$root"/}"
mkdir "$work/consumer"
cp -r "$here/cmake_consumer" "$here/consumer.cpp" "$work/consumer/"
cmake -S "$work/consumer/cmake_consumer" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$root" \
  -DCMAKE_CXX_COMPILER="$cxx" >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/cmake" >>"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
out=$("$root/bin/dcomm-run" -n 2 "$work/cmake/consumer")
echo "$out"
grep -q '^\[1\] consumer: rank 1 of 2$' <<<"$out"
# pkg-config, as the README's "Using it in your project" says.
pc=$(find "$root" -name dcomm.pc)
flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags dcomm)
echo "pkg-config dcomm --cflags: $flags"
grep -q -- '-DASIO_STANDALONE' <<<"$flags"

echo "== Meson subproject"
mkdir -p "$work/meson/subprojects"
cp "$here/meson_consumer/meson.build" "$here/consumer.cpp" "$work/meson/"
ln -s "$src" "$work/meson/subprojects/dcomm"
CXX=$cxx meson setup "$work/meson/build" "$work/meson" -Ddcomm:torch=disabled \
  -Ddcomm:nccl=disabled >"$work/meson.log" 2>&1 || { cat "$work/meson.log"; exit 1; }
meson test -C "$work/meson/build" --print-errorlogs >>"$work/meson.log" 2>&1 ||
  { cat "$work/meson.log"; exit 1; }
grep -q '^\[1\] consumer: rank 1 of 2$' "$work/meson/build/meson-logs/testlog.txt" ||
  { cat "$work/meson.log"; exit 1; }
echo "packaging: CMake package, pkg-config and Meson subproject all work"
