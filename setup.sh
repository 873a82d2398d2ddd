#!/usr/bin/env bash
# dcomm's setup script: installs what is missing (Debian 12), builds, runs.
#
#   ./setup.sh demo    build and run the demo: 4 ranks train on Fashion-MNIST (synchronous SGD)
#   ./setup.sh test    build with g++ (-Werror), with ASan+UBSan and TSan, check every file
#                      with clang++ (-Werror), run every test, print 'N passed, N failed, N skipped'
#   ./setup.sh deps    only install the packages (the test command's)
# Each installs what it is missing with apt-get (root, or sudo), prints its
# builds' progress every 30 s, and says how long each part took.
set -euo pipefail
cd "$(dirname "$0")"

# What each command needs: the demo builds two programs with g++; the tests
# build with g++ and clang++, against libtorch and doctest, and check the
# CMake package; Slurm's daemons (slurmd, slurmctld: srun and munge come
# with them) run the MPI tests under srun; MPICH beside Open MPI (which
# stays the default mpirun) runs them once more; iproute2's `ip` makes the
# network namespaces of the launcher's interface tests.
demo_packages=(meson ninja-build pkg-config g++ libasio-dev libssl-dev zlib1g-dev
               dataset-fashion-mnist)
test_packages=("${demo_packages[@]}" clang doctest-dev libtorch-dev nlohmann-json3-dev cmake python3-torch
               gnuplot-nox openmpi-bin libopenmpi-dev slurmd slurmctld mpich libmpich-dev iproute2)

# install_missing PACKAGE...
install_missing() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "setup.sh: installing ${missing[*]} (apt-get, as root)"
  local sudo="" started=$SECONDS
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  echo "setup.sh: installed in $(took $started)"
}

# "3m07s" since SECONDS was `started`.
took() {
  local s=$((SECONDS - $1))
  printf '%dm%02ds' $((s / 60)) $((s % 60))
}

# build DIR LOG [TARGETS...]: ninja, its progress ("[412/1030]") on one line
# every 30 s, and how long it took; the log kept in LOG (printed on failure).
build() {
  local dir=$1 log=$2 started=$SECONDS
  shift 2
  ninja -C "$dir" -j "$(nproc)" "$@" >"$log" 2>&1 &
  local pid=$! last=$SECONDS
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    if [ $((SECONDS - last)) -ge 30 ]; then
      last=$SECONDS
      local step
      step=$(grep -o '^\[[0-9]*/[0-9]*\]' "$log" | tail -n 1)
      echo "   ${step:-[starting]} after $(took "$started")"
    fi
  done
  if ! wait "$pid"; then
    cat "$log"
    echo "build in $dir failed after $(took "$started")"
    return 1
  fi
  echo "   built in $(took "$started") ($(grep -c '^\[' "$log") steps)"
}

# configure DIR CXX [meson options...]: (re)configures a build directory;
# meson's output is kept in DIR.configure.log and printed if it fails.
configure() {
  local dir=$1 compiler=$2
  shift 2
  mkdir -p "$(dirname "$dir")"
  local log="$dir.configure.log" ok=0
  if [ -f "$dir/build.ninja" ]; then
    meson configure "$dir" "$@" >"$log" 2>&1 || ok=$?
  else
    CXX=$compiler meson setup "$dir" "$@" >"$log" 2>&1 || ok=$?
  fi
  if [ "$ok" -ne 0 ]; then
    cat "$log"
    echo "setup.sh: configuring $dir failed (meson's output above, kept in $log)"
    return 1
  fi
}

# Totals of every meson test run so far, from the builds' test logs; before
# them, the last lines of each failed test's output again (where only the
# end of a long log is kept, the cause stays in view).
summary() {
  python3 - "$@" <<'PY'
import json, sys
passed = failed = skipped = 0
for log in sys.argv[1:]:
    build = log.split("/meson-logs/")[0]
    for line in open(log):
        t = json.loads(line)
        r = t["result"]
        if r in ("OK", "EXPECTEDFAIL"): passed += 1
        elif r == "SKIP": skipped += 1
        else:
            failed += 1
            out = (t.get("stdout") or "") + (t.get("stderr") or "")
            print(f"== failed in {build}: {t['name']} ({r}); its last lines:")
            print("\n".join(out.rstrip().splitlines()[-60:]))
print(f"{passed} passed, {failed} failed, {skipped} skipped")
PY
}

run_tests() {
  local jobs
  jobs=$(nproc)
  local logs=() status=0
  # name, compiler, options, targets, tests: g++ builds and runs everything
  # in the separate-compilation mode (dcomm's coroutines compiled once, in
  # the dcomm library), checks every header alone and builds the libtorch
  # interop; clang checks every translation unit with -fsyntax-only (its
  # diagnostics, -Werror; a third of the time of a build:
  # tests/syntax_check.py), separately compiled too, without OpenSSL; the
  # sanitizer build runs the suites under ASan+UBSan, separately compiled,
  # without OpenSSL (the refusal of a job token is tested there; g++'s run
  # tests the tokens themselves); TSan's build stays header-only, the
  # default (the backend's suites, linked from several translation units),
  # and runs the suites where ranks of one process share memory (the
  # lock-free rings and the arena; the rest of the backend is one strand
  # per rank), co_await's immediate resumption, the flight recorder, the
  # RPC agent (a blocking call from a plain thread), the default group (set
  # and read from several threads) and wait_any's watches. The builds that link
  # compile the test programs as unity translation units (-Dunity=on: four
  # test files in one, what they include parsed and instantiated once);
  # clang checks each file alone, so that each includes what it uses.
  # libtorch is built with g++ and not instrumented: the g++ build alone
  # compiles against it (its headers cost a minute per translation unit).
  local builds=(
    "gcc|g++|-Dwerror=true -Dbuildtype=debug -Dseparate_compilation=true -Dunity=on||"
    "clang|clang++|-Dwerror=true -Dbuildtype=debug -Dseparate_compilation=true -Dheader_tests=false -Dopenssl=disabled -Dtorch=disabled|syntax-only|"
    "sanitize|g++|-Dbuildtype=debug -Dseparate_compilation=true -Dunity=on -Db_sanitize=address,undefined -Dopenssl=disabled -Dheader_tests=false -Dexamples=false -Dbench=false -Dtorch=disabled -Dmpi=disabled||"
    "tsan|g++|-Dbuildtype=debug -Dunity=on -Db_sanitize=thread -Dheader_tests=false -Dexamples=false -Dbench=false -Dtorch=disabled -Dmpi=disabled|tests/backend_tests|shared memory,cpu collectives,cpu groups,completion tokens,flight recorder,stragglers,rpc,cpu elastic,default group,cpu composed calls,cpu objects"
  )
  for b in "${builds[@]}"; do
    IFS='|' read -r name compiler options targets tests <<<"$b"
    local dir="build/$name"
    echo "== $name: $compiler $options${tests:+ (tests: $tests)}"
    # shellcheck disable=SC2086
    configure "$dir" "$compiler" $options || return 1
    if [ "$targets" = syntax-only ]; then
      local checked=$SECONDS
      python3 tests/syntax_check.py "$dir" "$jobs" >"$dir.log" 2>&1 || { cat "$dir.log"; status=1; }
      echo "   $(tail -n 1 "$dir.log") (-fsyntax-only) in $(took "$checked")"
      logs+=("$dir/meson-logs/testlog.json")
      continue
    fi
    # shellcheck disable=SC2086
    build "$dir" "$dir.log" $targets || return 1
    local tests_started=$SECONDS
    local multiplier=1
    [ "$name" = sanitize ] || [ "$name" = tsan ] && multiplier=3
    local selected=()
    [ -n "$tests" ] && IFS=',' read -r -a selected <<<"$tests"
    # protect_shadow_gap=0: on a GPU machine the CUDA driver maps memory
    # where ASan would otherwise reserve its shadow gap, and fails to start.
    ASAN_OPTIONS=detect_leaks=1:protect_shadow_gap=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      TSAN_OPTIONS="halt_on_error=1:suppressions=$PWD/tests/tsan.supp" \
      meson test -C "$dir" --no-rebuild --print-errorlogs --num-processes "$jobs" -t "$multiplier" \
        "${selected[@]}" || true
    echo "   tests took $(took "$tests_started")"
    [ -f "$dir/meson-logs/testlog.json" ] && logs+=("$dir/meson-logs/testlog.json")
    if grep -q '"result": "\(FAIL\|TIMEOUT\|ERROR\|UNEXPECTEDPASS\)"' "$dir/meson-logs/testlog.json"; then status=1; fi
  done
  summary "${logs[@]}"
  return $status
}

# build_demo DIR [meson options...]: configures and builds the demo's two
# programs (the options given after the demo's own win).
build_demo() {
  local dir=$1
  shift
  configure "$dir" g++ -Dbuildtype=release -Dtests=false -Dbench=false -Dheader_tests=false \
    -Dtorch=disabled -Dnccl=disabled "$@" || return 1
  build "$dir" "$dir.log" tools/dcomm-run examples/train_fashion_mnist
}

run_demo() {
  echo "== demo: g++ release build of dcomm-run and train_fashion_mnist (build/demo)"
  build_demo build/demo || return 1
  build/demo/tools/dcomm-run -n 4 build/demo/examples/train_fashion_mnist
}

case "${1:-}" in
  deps) install_missing "${test_packages[@]}" ;;
  test) install_missing "${test_packages[@]}" && run_tests ;;
  demo) install_missing "${demo_packages[@]}" && run_demo ;;
  # For tests/packaging/demo_toolchain.sh: the demo's build alone, in DIR,
  # and the package lists.
  demo-build) build_demo "${2:?usage: $0 demo-build DIR [meson options...]}" "${@:3}" ;;
  packages)
    case "${2:-}" in
      demo) echo "${demo_packages[*]}" ;;
      test) echo "${test_packages[*]}" ;;
      *) echo "usage: $0 packages demo|test" >&2; exit 2 ;;
    esac
    ;;
  *)
    echo "usage: $0 demo|test|deps" >&2
    exit 2
    ;;
esac
