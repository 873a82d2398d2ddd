#!/usr/bin/env bash
# Builds and runs dcomm's GPU checks on a machine that cannot install
# anything (the `device` machines lent to some sessions: CUDA, ninja and a
# pip-installed meson, but no Asio or doctest, and NCCL perhaps only as
# the nvidia-nccl Python package).
#
#   tools/gpu_kit.sh pack    here: copies the Asio and doctest headers into
#                            .gpu-kit/include (git-ignored; carry it along)
#   tools/gpu_kit.sh run     there: configures build/gpu against the kit,
#                            builds the GPU tests, example and benchmarks,
#                            runs them (collective_bench on CUDA tensors),
#                            and writes their output to $OUT (or
#                            .gpu-kit/out)
#
# With the device tool: run(command="tools/gpu_kit.sh run", carry=[".gpu-kit"]).
set -euo pipefail
cd "$(dirname "$0")/.."
kit=$PWD/.gpu-kit

pack() {
  [ -f /usr/include/asio.hpp ] || ./setup.sh deps
  rm -rf "$kit/include"
  mkdir -p "$kit/include"
  cp -r /usr/include/asio /usr/include/asio.hpp /usr/include/doctest "$kit/include/"
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu-kit/' "$exclude" 2>/dev/null || echo '/.gpu-kit/' >>"$exclude"
  du -sh "$kit"
}

# NCCL's headers and library: under CUDA_HOME, else from the nvidia-nccl
# Python package (which has libnccl.so.2 but no libnccl.so to link with).
find_nccl() {
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  if [ -f "$cuda/include/nccl.h" ]; then
    echo "$cuda"
    return
  fi
  local pkg
  pkg=$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null) || true
  if [ -n "$pkg" ] && [ -f "$pkg/include/nccl.h" ]; then
    mkdir -p "$kit/nccl/lib"
    ln -sfn "$pkg/include" "$kit/nccl/include"
    ln -sf "$(ls "$pkg"/lib/libnccl.so* | head -1)" "$kit/nccl/lib/libnccl.so"
    echo "$kit/nccl"
    return
  fi
  echo "gpu_kit: no nccl.h under $cuda or in the nvidia-nccl Python package" >&2
  return 1
}

run() {
  [ -d "$kit/include/asio" ] || { echo "gpu_kit: no .gpu-kit/include: run 'tools/gpu_kit.sh pack' here first and carry .gpu-kit" >&2; exit 1; }
  local out=${OUT:-$kit/out}
  mkdir -p "$out"
  local meson=(meson)
  command -v meson >/dev/null || meson=(python3 -m mesonbuild.mesonmain)
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  NCCL_HOME=$(find_nccl)
  export NCCL_HOME
  export LD_LIBRARY_PATH=$NCCL_HOME/lib:$NCCL_HOME/lib64:$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    "${CXX:-g++}" --version | head -1
    echo "CUDA_HOME=$CUDA_HOME NCCL_HOME=$NCCL_HOME"
  } 2>&1 | tee "$out/machine.txt"
  if [ ! -f build/gpu/build.ninja ]; then
    "${meson[@]}" setup build/gpu -Dbuildtype=release -Dwerror=false -Dheader_tests=false \
      -Dtorch=disabled -Dopenssl=disabled -Dnccl=enabled "-Dcpp_args=-I$kit/include" \
      2>&1 | tee "$out/configure.txt"
  fi
  ninja -C build/gpu tests/gpu_tests examples/nccl_all_reduce bench/nccl_bench \
    bench/collective_bench 2>&1 | tail -5 | tee "$out/build.txt"
  local status=0
  build/gpu/tests/gpu_tests 2>&1 | tee "$out/gpu_tests.txt" || status=1
  build/gpu/examples/nccl_all_reduce 2>&1 | tee "$out/nccl_all_reduce.txt" || status=1
  build/gpu/bench/nccl_bench --min-bytes 8 --max-bytes 256M --factor 4 2>&1 |
    tee "$out/nccl_bench.txt" || status=1
  # CUDA tensors over tcp, two ranks on the GPU: slice by slice (the
  # default 4 MiB slices) against whole staging (a slice above every size).
  {
    for op in all_reduce sendrecv broadcast; do
      for slice in 4M 64G; do
        echo "## --op $op --staging-slice $slice"
        build/gpu/bench/collective_bench --world 2 --device cuda --op $op --min-bytes 1M \
          --max-bytes 256M --factor 4 --staging-slice $slice
      done
    done
  } 2>&1 | tee "$out/tcp_cuda_bench.txt" || status=1
  return $status
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
