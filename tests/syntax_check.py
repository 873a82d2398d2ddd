#!/usr/bin/env python3
"""Checks every translation unit of a configured Meson build with the
compiler's -fsyntax-only: the build's own commands (compile_commands.json),
its warnings as errors, no code generated and nothing linked.

setup.sh's clang phase uses it: clang 14's diagnostics on every file (tests,
examples, benchmarks, tools), in a third of the time of building them; the
programs themselves are built and run by the g++ and sanitizer phases.

  syntax_check.py BUILD_DIR [JOBS]

Writes one result per file to BUILD_DIR/meson-logs/testlog.json (the lines
meson test writes, so setup.sh counts them with the tests), prints each
failure's diagnostics, and exits 1 if there was one.
"""
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import time


def check(entry):
    args = shlex.split(entry["command"])
    kept = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MQ", "-MT"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD"):
            continue
        kept.append(a)
    kept.append("-fsyntax-only")
    started = time.monotonic()
    done = subprocess.run(kept, cwd=entry["directory"], capture_output=True, text=True)
    return entry, done.returncode, done.stdout + done.stderr, time.monotonic() - started


def generate_sources(build):
    """Builds the build's generated sources (custom targets) the files need."""
    targets = json.loads(subprocess.run(["meson", "introspect", build, "--targets"], check=True,
                                        capture_output=True, text=True).stdout)
    outputs = [os.path.relpath(f, os.path.abspath(build))
               for t in targets if t["type"] == "custom" for f in t["filename"]]
    if outputs:
        subprocess.run(["ninja", "-C", build] + outputs, check=True, stdout=subprocess.DEVNULL)


def main():
    build = sys.argv[1]
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count()
    generate_sources(build)
    entries = json.load(open(os.path.join(build, "compile_commands.json")))
    os.makedirs(os.path.join(build, "meson-logs"), exist_ok=True)
    failed = 0
    with open(os.path.join(build, "meson-logs", "testlog.json"), "w") as log, \
            concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for entry, code, output, seconds in pool.map(check, entries):
            name = os.path.relpath(os.path.join(entry["directory"], entry["file"]))
            ok = code == 0
            failed += not ok
            print(f"{'OK  ' if ok else 'FAIL'} {seconds:6.1f}s  {name}", flush=True)
            if not ok:
                print(output, flush=True)
            log.write(json.dumps({"name": "syntax " + name, "result": "OK" if ok else "FAIL",
                                  "duration": seconds}) + "\n")
    print(f"{len(entries) - failed} of {len(entries)} files pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
