#!/usr/bin/env python3
"""Runs an example and checks that each expected line appears in its output.

    check_output.py [--status N] PROGRAM [ARGS...] -- EXPECTED_LINE...

An expected line matches an output line (stdout, or stderr too with
--status) that starts with it; "re:PATTERN" matches a line that PATTERN
matches anywhere. Exits non-zero, printing the output, when the program
ends with another status than N (default 0), times out (90 s) or a line is
missing.
"""
import re
import subprocess
import sys

args = sys.argv[1:]
status = 0
if args[:1] == ["--status"]:
    status, args = int(args[1]), args[2:]
split = args.index("--")
command, expected = args[:split], args[split + 1:]
try:
    run = subprocess.run(command, capture_output=True, text=True, timeout=90)
except subprocess.TimeoutExpired as e:
    print(f"timed out after 90 s: {command}\n{e.stdout or ''}{e.stderr or ''}")
    sys.exit(1)
lines = run.stdout.splitlines() + (run.stderr.splitlines() if status else [])


def found(e):
    if e.startswith("re:"):
        return any(re.search(e[3:], line) for line in lines)
    return any(line.startswith(e) for line in lines)


missing = [e for e in expected if not found(e)]
print(run.stdout, end="")
print(run.stderr, end="", file=sys.stderr)
if run.returncode != status:
    print(f"exit status {run.returncode}, expected {status}: {command}")
    sys.exit(1)
if missing:
    print("missing lines:\n  " + "\n  ".join(missing))
    sys.exit(1)
print(f"all {len(expected)} expected lines present")
