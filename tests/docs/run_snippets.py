#!/usr/bin/env python3
"""Runs the documentation's runnable snippets (tests/docs/snippets.py wrote
the list beside the program): each directly, or under dcomm-run, and checks
that it succeeds and prints what its `expect:` lines say.

    run_snippets.py PROGRAM LIST.json DCOMM_RUN
"""
import json
import subprocess
import sys

program, listing, launcher = sys.argv[1:4]
spec = json.load(open(listing))
failed = []
for r in spec["runs"]:
    command = [program, r["id"]]
    if r["run"][0] == "dcomm-run":
        command = [launcher] + r["run"][1:] + command
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        out = done.stdout + done.stderr
        ok = done.returncode == 0
    except subprocess.TimeoutExpired as e:
        out, ok = f"timed out after 120 s\n{e.stdout or ''}{e.stderr or ''}", False
    missing = [e for e in r["expect"] if e not in out]
    status = "ok" if ok and not missing else "FAILED"
    print(f"{status}: {r['id']} ({' '.join(r['run'])})")
    if status != "ok":
        failed.append(r["id"])
        print(out)
        for e in missing:
            print(f"  missing: {e}")
print(f"{len(spec['compiled'])} snippet(s) compiled, {len(spec['runs'])} run, "
      f"{len(failed)} failed")
sys.exit(1 if failed else 0)
