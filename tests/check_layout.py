#!/usr/bin/env python3
"""The layout rules of include/dcomm, checked (docs/design.md, "Floors").

1. Floors: a header includes only headers of its own floor or a lower one.
2. Components (cpu/, nccl/, store/, launch/, ...) do not include each other's
   internals, except where ALLOWED_CROSSINGS says so.
3. Size: no header over MAX_LINES unless its first comment block says why
   (a line starting with "// Size:").
4. Every collective of the CPU backend's tuning table has its algorithm in
   cpu/algorithms/<op>.hpp (the _v forms beside their base op).
5. A user of communicator.hpp or gradient_bucketer.hpp compiles no store,
   rendezvous, init_method or backend: LEAN says what each may not reach,
   through any chain of includes.

Run from anywhere: check_layout.py <repository root>. Prints each breach
and exits 1 if there is one.
"""
import pathlib
import re
import sys

MAX_LINES = 600

# (floor, path prefix or exact file), first match wins; paths are relative to
# include/. A header that matches none is itself a breach: say where it lives.
FLOORS = [
    (0, 'dcomm/detail/'),
    (0, 'dcomm/error.hpp'), (0, 'dcomm/half.hpp'), (0, 'dcomm/dtype.hpp'),
    (0, 'dcomm/reduce_op.hpp'), (0, 'dcomm/option_string.hpp'), (0, 'dcomm/tensor.hpp'), (0, 'dcomm/log.hpp'),
    (0, 'dcomm/command_line.hpp'),
    (1, 'dcomm/completion.hpp'), (1, 'dcomm/backend.hpp'), (1, 'dcomm/cuda.hpp'),
    (1, 'dcomm/store/'), (1, 'dcomm/init_method.hpp'), (1, 'dcomm/init/'), (1, 'dcomm/launch/'),
    (1, 'dcomm/data_partitioner.hpp'), (1, 'dcomm/distributed_sampler.hpp'),
    # A backend's member bodies (Asio's impl/ style) are on the backend's floor.
    (3, 'dcomm/nccl/impl/'), (3, 'dcomm/mpi/impl/'),
    (2, 'dcomm/cpu/'), (2, 'dcomm/nccl/'), (2, 'dcomm/mpi/'), (2, 'dcomm/shm/'), (2, 'dcomm/trace/'),
    (3, 'dcomm/cpu_backend.hpp'), (3, 'dcomm/tcp_backend.hpp'), (3, 'dcomm/nccl.hpp'), (3, 'dcomm/mpi.hpp'), (3, 'dcomm/rendezvous.hpp'),
    (3, 'dcomm/spawn.hpp'), (3, 'dcomm/request.hpp'),
    (4, 'dcomm/impl/'), (4, 'dcomm/communicator.hpp'),
    (5, 'dcomm/init_process_group.hpp'), (5, 'dcomm/gradient_bucketer.hpp'),
    (5, 'dcomm/thread_world.hpp'), (5, 'dcomm/torch.hpp'), (5, 'dcomm/rpc.hpp'), (5, 'dcomm/rpc/'),
    (6, 'dcomm/dcomm.hpp'),
]

COMPONENTS = ['dcomm/cpu/', 'dcomm/nccl/', 'dcomm/mpi/', 'dcomm/store/', 'dcomm/launch/', 'dcomm/init/',
              'dcomm/shm/', 'dcomm/trace/', 'dcomm/rpc/']
# Component -> headers (or folders, ending in '/') of others it may include (the mesh finds its
# peers through the store; the transport's links to ranks of its host are
# shared memory; the host's ranks find their segment through the store).
ALLOWED_CROSSINGS = {'dcomm/cpu/': ['dcomm/store/store.hpp', 'dcomm/shm/'],
                     'dcomm/shm/': ['dcomm/store/store.hpp']}


LEAN = {
    'dcomm/communicator.hpp': ['dcomm/store/', 'dcomm/rendezvous.hpp', 'dcomm/init_method.hpp',
                               'dcomm/init/', 'dcomm/cpu/', 'dcomm/nccl/', 'dcomm/launch/'],
}
LEAN['dcomm/gradient_bucketer.hpp'] = LEAN['dcomm/communicator.hpp']


def includes_of(inc, header):
    return re.findall(r'^#include\s+[<"](dcomm/[^">]+)[">]', (inc / header).read_text(), re.M)


def reach(inc, header):
    seen, todo = set(), [header]
    while todo:
        h = todo.pop()
        for t in includes_of(inc, h):
            if t not in seen and (inc / t).exists():
                seen.add(t)
                todo.append(t)
    return seen


def floor_of(path):
    for floor, where in FLOORS:
        if path == where or (where.endswith('/') and path.startswith(where)):
            return floor
    return None


def component_of(path):
    return next((c for c in COMPONENTS if path.startswith(c)), None)


def main(root):
    inc = root / 'include'
    breaches = []
    headers = sorted(p.relative_to(inc).as_posix() for p in inc.rglob('*.hpp'))
    for h in headers:
        text = (inc / h).read_text()
        fl = floor_of(h)
        if fl is None:
            breaches.append(f'{h}: on no floor (add it to FLOORS in tests/check_layout.py)')
            continue
        lines = text.count('\n')
        head = text[:text.find('#pragma once')] if '#pragma once' in text else text[:2000]
        if lines > MAX_LINES and '// Size:' not in head:
            breaches.append(f'{h}: {lines} lines, over {MAX_LINES} with no "// Size:" reason at its top')
        for target in re.findall(r'^#include\s+[<"](dcomm/[^">]+)[">]', text, re.M):
            tf = floor_of(target)
            if tf is None:
                continue  # reported as a header of its own
            if tf > fl:
                breaches.append(f'{h} (floor {fl}) includes {target} (floor {tf}): an arrow up')
            c, tc = component_of(h), component_of(target)
            allowed = ALLOWED_CROSSINGS.get(c, [])
            if c and tc and c != tc and not any(
                    target == a or (a.endswith('/') and target.startswith(a)) for a in allowed):
                breaches.append(f'{h} reaches into another component: {target}')
    tuning = (inc / 'dcomm/cpu/tuning.hpp').read_text()
    for op in sorted(set(re.findall(r'\{coll_op::(\w+),', tuning))):
        base = re.sub(r'_v$', '', op)
        if not (inc / f'dcomm/cpu/algorithms/{base}.hpp').exists():
            breaches.append(f'cpu collective {op}: no cpu/algorithms/{base}.hpp')
    for header, banned in LEAN.items():
        for t in sorted(reach(inc, header)):
            if any(t == b or (b.endswith('/') and t.startswith(b)) for b in banned):
                breaches.append(f'{header} reaches {t}: its users would compile it')
    for b in breaches:
        print('layout:', b)
    print(f'{len(headers)} headers checked, {len(breaches)} breaches')
    return 1 if breaches else 0


if __name__ == '__main__':
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else '.').resolve()))
