#!/usr/bin/env python3
"""The elastic demo through random SIGKILLs (issue 43's chaos test).

    elastic_chaos.py DCOMM_RUN TRAIN_FASHION_MNIST --kills K [--ranks N] [--seed S] -- ARGS...

Runs `DCOMM_RUN -n N --elastic TRAIN --elastic ARGS` once undisturbed, then
once more killing K ranks with SIGKILL at random times once the job has
begun (rank 0's process first, then any), each kill after the previous
replacement was admitted (the survivors said "after admitting", or 5 s
passed). A rank lost before the job began is tests/launch/
store_program_test.cpp's case. Checks that the
disturbed job ends with status 0, within its time limit (no hang), with
every kill seen by dcomm-run, and a test accuracy within 1 point of the
undisturbed run's. Prints both runs' accuracies and the disturbed run's
summary. Short in CI (meson); long by hand (--kills 10, all the images).
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("launcher")
parser.add_argument("program")
parser.add_argument("--kills", type=int, default=3)
parser.add_argument("--ranks", type=int, default=4)
parser.add_argument("--seed", type=int, default=None)
parser.add_argument("--limit", type=float, default=240, help="seconds a run may take")
split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
options = parser.parse_args(sys.argv[1:split])
options.args = sys.argv[split + 1:]
rng = random.Random(options.seed)
accuracy_line = re.compile(r"test accuracy: ([0-9.]+)%")


def command():
    # Restarts to spare: a replacement admitted into a world that a later
    # kill keeps from forming fails its join and is restarted too.
    return [options.launcher, "-n", str(options.ranks), "--elastic", "--max-restarts",
            str(3 * options.kills + 2), options.program, "--elastic"] + options.args


def ranks_of(launcher_pid):
    """{pid: RANK} of the launcher's children that run the program."""
    found = {}
    try:
        children = open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()
    except OSError:
        return found
    for pid in map(int, children):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if os.path.basename(os.readlink(f"/proc/{pid}/exe")) != os.path.basename(
                    options.program):
                continue
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                found[pid] = int(entry[5:])
    return found


def run(kills):
    """(status, stdout, stderr, kills done) of one run."""
    job = subprocess.Popen(command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = [], []
    admitted = threading.Semaphore(0)
    begun = threading.Event()

    def read(stream, into, watch):
        for line in stream:
            into.append(line)
            if watch and "Fashion-MNIST, elastic" in line:
                begun.set()
            if watch and "after admitting" in line:
                admitted.release()

    readers = [threading.Thread(target=read, args=(job.stdout, out, True)),
               threading.Thread(target=read, args=(job.stderr, err, False))]
    for r in readers:
        r.start()
    done = 0
    started = time.monotonic()
    if kills:
        begun.wait(timeout=options.limit)
    while done < kills and job.poll() is None:
        time.sleep(rng.uniform(0.3, 1.2))
        victims = ranks_of(job.pid)
        if not victims:
            continue
        if done == 0:  # rank 0's first: its store is not rank 0's to lose
            victims = {p: r for p, r in victims.items() if r == 0} or victims
        pid = rng.choice(sorted(victims))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        done += 1
        print(f"{time.monotonic() - started:.2f} s: killed rank {victims[pid]}'s process {pid}")
        admitted.acquire(timeout=5)
    try:
        job.wait(timeout=options.limit)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        for r in readers:
            r.join()
        print("".join(out) + "".join(err))
        sys.exit(f"the job ran past {options.limit} s: a hang")
    for r in readers:
        r.join()
    return job.returncode, "".join(out), "".join(err), done


def accuracy(out):
    found = accuracy_line.findall(out)
    return float(found[-1]) if found else None


status, out, err, _ = run(0)
clean = accuracy(out)
if status != 0 or clean is None:
    print(out + err)
    sys.exit(f"the undisturbed run failed (status {status})")
status, out, err, done = run(options.kills)
disturbed = accuracy(out)
print(out, end="")
print(err, end="", file=sys.stderr)
print(f"undisturbed: {clean:.2f}%; through {done} SIGKILL(s): {disturbed}%")
problems = []
if status != 0:
    problems.append(f"status {status}")
if done != options.kills:
    problems.append(f"{done} of {options.kills} kills landed before the job ended (train longer)")
if len(re.findall(r"^dcomm-run: rank \d+ \(pid \d+\) was killed by signal 9", err, re.M)) != done:
    problems.append("dcomm-run did not report every kill")
if disturbed is None or abs(disturbed - clean) > 1.0:
    problems.append(f"accuracy {disturbed} is not within 1 point of {clean}")
if problems:
    sys.exit("; ".join(problems))
