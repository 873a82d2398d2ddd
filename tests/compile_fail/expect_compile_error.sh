#!/usr/bin/env bash
# Compile-failure test driver.
#
#   expect_compile_error.sh CXX FILE INCLUDE_DIR [extra flags...]
#   expect_compile_error.sh CXX_WORD... -- FILE INCLUDE_DIR [extra flags...]
#
# The second form is for compiler commands of several words (ccache g++, as
# meson's cmd_array() gives them): everything before the first `--` is the
# compiler, so no word ever needs re-splitting.
#
# FILE's first line must be `// expect: <text>`. The test passes when FILE
# fails to compile with an error line containing <text> (so a failure for
# another reason, such as a typo in the snippet or a missing header, does not
# count), or, for `// expect: compiles`, when FILE compiles cleanly;
# `// expect first: <text>` asks that the first error line contain it. Only the
# first line is read: keep it within the 100 columns clang-format allows, or
# it gets reflowed onto a second line that is ignored.
set -u

usage() {
  echo "usage: $0 CXX FILE INCLUDE_DIR [extra flags...]" >&2
  echo "       $0 CXX_WORD... -- FILE INCLUDE_DIR [extra flags...]" >&2
  exit 2
}

cxx=()
separated=0
for arg in "$@"; do
  if [ "$arg" = "--" ]; then
    separated=1
    break
  fi
done
if [ "$separated" = 1 ]; then
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    cxx+=("$1")
    shift
  done
  shift  # the --
else
  [ "$#" -ge 1 ] || usage
  cxx=("$1")
  shift
fi
if [ "${#cxx[@]}" -lt 1 ] || [ "$#" -lt 2 ]; then usage; fi
file=$1
include_dir=$2
shift 2

if [ ! -r "$file" ]; then
  echo "FAIL: cannot read $file" >&2
  exit 1
fi

first_line=$(head -n 1 -- "$file" | tr -d '\r')
first_only=0
case "$first_line" in
  "// expect: "*) expect=${first_line#"// expect: "} ;;
  "// expect first: "*)
    expect=${first_line#"// expect first: "}
    first_only=1
    ;;
  *)
    echo "FAIL: $file: first line must be '// expect: <diagnostic substring>' or '// expect: compiles'" >&2
    exit 1
    ;;
esac
# Trailing blanks in the comment are not part of what we look for.
expect=${expect%"${expect##*[![:space:]]}"}
if [ -z "$expect" ]; then
  echo "FAIL: $file: empty expectation" >&2
  exit 1
fi

command=("${cxx[@]}" -std=c++20 -fsyntax-only -I "$include_dir" "$@" "$file")
output=$("${command[@]}" 2>&1)
status=$?

if [ "$expect" = "compiles" ]; then
  if [ "$status" -eq 0 ]; then
    echo "PASS: $file compiles"
    exit 0
  fi
  echo "FAIL: $file should compile but did not (exit $status)" >&2
  echo "command: ${command[*]}" >&2
  printf '%s\n' "$output" >&2
  exit 1
fi

if [ "$status" -eq 0 ]; then
  echo "FAIL: $file compiled, but it must fail with: $expect" >&2
  echo "command: ${command[*]}" >&2
  exit 1
fi
# 126/127: the compiler itself could not be run; that says nothing about FILE.
if [ "$status" -eq 126 ] || [ "$status" -eq 127 ]; then
  echo "FAIL: could not run the compiler (exit $status): ${cxx[*]}" >&2
  printf '%s\n' "$output" >&2
  exit 1
fi
if [ "$first_only" = 1 ]; then
  if printf '%s\n' "$output" | grep -i -m 1 "error" | grep -q -F -- "$expect"; then
    echo "PASS: $file's first error says: $expect"
    exit 0
  fi
  echo "FAIL: $file's first error does not say: $expect" >&2
  echo "command: ${command[*]}" >&2
  printf '%s\n' "$output" | head -20 >&2
  exit 1
fi
if printf '%s\n' "$output" | grep -F -- "$expect" | grep -q -i "error"; then
  echo "PASS: $file fails to compile with: $expect"
  exit 0
fi
echo "FAIL: $file failed to compile, but no error line contains: $expect" >&2
echo "command: ${command[*]}" >&2
printf '%s\n' "$output" >&2
exit 1
