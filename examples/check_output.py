#!/usr/bin/env python3
"""Runs an example and checks that each expected line appears in its output.

    check_output.py PROGRAM [ARGS...] -- EXPECTED_LINE...

An expected line matches an output line that starts with it. Exits non-zero,
printing the output, when the program fails, times out (90 s) or a line is
missing.
"""
import subprocess
import sys

split = sys.argv.index("--")
command, expected = sys.argv[1:split], sys.argv[split + 1:]
try:
    run = subprocess.run(command, capture_output=True, text=True, timeout=90)
except subprocess.TimeoutExpired as e:
    print(f"timed out after 90 s: {command}\n{e.stdout or ''}{e.stderr or ''}")
    sys.exit(1)
lines = run.stdout.splitlines()
missing = [e for e in expected if not any(line.startswith(e) for line in lines)]
print(run.stdout, end="")
print(run.stderr, end="", file=sys.stderr)
if run.returncode != 0:
    print(f"exit status {run.returncode}: {command}")
    sys.exit(1)
if missing:
    print("missing lines:\n  " + "\n  ".join(missing))
    sys.exit(1)
print(f"all {len(expected)} expected lines present")
