#!/usr/bin/env bash
# The demo's build on a machine that has only the demo's packages: meson
# configures dcomm and builds the demo's two programs with nothing on PATH
# but the programs of those packages, of what they depend on, and of
# Debian's essential packages (no cmake, mpicc, nvcc or clang), as
# `./setup.sh demo` does on a bare Debian 12. A missing optional tool must
# never fail a build.
#
#   demo_toolchain.sh SOURCE_ROOT
# Exit 77 (skipped) where dpkg is missing or a demo package is not installed.
set -euo pipefail
src=$(cd "$1" && pwd)
command -v dpkg-query >/dev/null || { echo "skipped: not a Debian system (no dpkg-query)"; exit 77; }
read -r -a packages <<<"$("$src/setup.sh" packages demo)"
work=$(mktemp -d /tmp/dcomm-demo-toolchain-XXXXXX)
trap 'rm -rf "$work"' EXIT

# The installed packages the demo's need, recursively (Depends and
# Pre-Depends; alternatives: those installed), and the essential ones.
python3 - "$work/bin" "${packages[@]}" <<'PY' || exit $?
import os, re, subprocess, sys
bin_dir, wanted = sys.argv[1], sys.argv[2:]
fields = "${Package}\t${Status}\t${Essential}\t${Depends}, ${Pre-Depends}\t${Provides}\n"
out = subprocess.run(["dpkg-query", "-W", "-f", fields], capture_output=True, text=True).stdout
installed, depends, essential, provided_by = set(), {}, [], {}
for line in out.splitlines():
    name, status, ess, deps, provides = (line.split("\t") + [""] * 5)[:5]
    if not status.endswith(" installed"):
        continue
    name = name.split(":")[0]
    installed.add(name)
    depends[name] = [[re.split(r"[ :(]", alt.strip())[0] for alt in group.split("|")]
                     for group in deps.split(",") if group.strip()]
    for p in provides.split(","):
        if p.strip():
            provided_by.setdefault(re.split(r"[ :(]", p.strip())[0], []).append(name)
    if ess == "yes":
        essential.append(name)
missing = [p for p in wanted if p not in installed]
if missing:
    print("skipped: demo packages not installed: " + " ".join(missing))
    sys.exit(77)
seen, todo = set(), list(wanted) + essential
while todo:
    name = todo.pop()
    if name in seen:
        continue
    seen.add(name)
    for group in depends.get(name, []):
        for alt in group:
            names = [alt] if alt in installed else provided_by.get(alt, [])
            if names:
                todo.extend(names)
                break
os.makedirs(bin_dir)
count = 0
for name in sorted(seen):
    files = subprocess.run(["dpkg-query", "-L", name], capture_output=True, text=True).stdout
    for path in files.splitlines():
        if os.path.dirname(path) in ("/bin", "/usr/bin", "/sbin", "/usr/sbin") and \
                os.path.isfile(path) and os.access(path, os.X_OK):
            link = os.path.join(bin_dir, os.path.basename(path))
            if not os.path.lexists(link):
                os.symlink(path, link)
                count += 1
print(f"PATH: {count} programs of {len(seen)} packages")
PY
for tool in cmake mpicc mpicxx nvcc clang++; do
  if [ -e "$work/bin/$tool" ]; then
    echo "$tool is among the demo's programs: this check would prove nothing"
    exit 1
  fi
done
# A debug build: the check is whether it configures and builds, not how fast the demo runs.
PATH="$work/bin" "$src/setup.sh" demo-build "$work/build" -Dbuildtype=debug
echo "the demo's programs build with only the demo's packages on PATH"
