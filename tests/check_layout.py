#!/usr/bin/env python3
"""The layout rules of include/dcomm, checked (docs/design.md, "Floors").

1. Floors: a header includes only headers of its own floor or a lower one.
2. Components (cpu/, nccl/, store/, launch/, ...) do not include each other's
   internals, except where ALLOWED_CROSSINGS says so.
3. Size: no header over MAX_LINES lines, whatever the reason (split it: a
   component's bodies go to its impl/).
4. Every collective of the CPU backend's tuning table has its algorithm in
   cpu/algorithms/<op>.hpp (the _v forms beside their base op).
5. A user of communicator.hpp or gradient_bucketer.hpp compiles no store,
   rendezvous, init_method or backend: LEAN says what each may not reach,
   through any chain of includes.
6. Length: no function of include/, tools/, bench/ or examples/ over
   MAX_FUNCTION_LINES (its head to its closing brace) unless the comment
   just above it says why (a line starting with "// Length:"). Functions
   are found at namespace and class scope by their braces, comments and
   strings blanked (functions(), below): a lambda counts in its function.
7. A header that includes an Asio header includes detail/asio_config.hpp
   (or detail/asio.hpp, which does) before it: Asio configured one way.
8. Every header's separate-compilation block (its DCOMM_INSTANTIATE lines,
   tools/separate_compilation.py) lists the coroutines it declares
   DCOMM_EMIT_ON_USE: a stale block would compile a new coroutine in every
   user's translation unit, or declare one that is gone.

Run from anywhere: check_layout.py <repository root>. Prints each breach
and exits 1 if there is one.
"""
import pathlib
import re
import sys

MAX_LINES = 600
MAX_FUNCTION_LINES = 80

# (floor, path prefix or exact file), first match wins; paths are relative to
# include/. A header that matches none is itself a breach: say where it lives.
FLOORS = [
    (0, 'dcomm/detail/'),
    (0, 'dcomm/error.hpp'), (0, 'dcomm/half.hpp'), (0, 'dcomm/dtype.hpp'),
    (0, 'dcomm/reduce_op.hpp'), (0, 'dcomm/option_string.hpp'), (0, 'dcomm/tensor.hpp'), (0, 'dcomm/log.hpp'),
    (0, 'dcomm/command_line.hpp'), (0, 'dcomm/operation.hpp'), (0, 'dcomm/codec.hpp'),
    (1, 'dcomm/completion.hpp'), (1, 'dcomm/backend.hpp'), (1, 'dcomm/cuda.hpp'),
    (1, 'dcomm/store/'), (1, 'dcomm/init_method.hpp'), (1, 'dcomm/init/'), (1, 'dcomm/launch/'),
    (1, 'dcomm/data_partitioner.hpp'), (1, 'dcomm/distributed_sampler.hpp'),
    # A backend's member bodies (Asio's impl/ style) are on the backend's floor.
    (3, 'dcomm/nccl/impl/'), (3, 'dcomm/mpi/impl/'),
    (2, 'dcomm/cpu/'), (2, 'dcomm/nccl/'), (2, 'dcomm/mpi/'), (2, 'dcomm/shm/'), (2, 'dcomm/trace/'),
    (3, 'dcomm/cpu_backend.hpp'), (3, 'dcomm/tcp_backend.hpp'), (3, 'dcomm/nccl.hpp'), (3, 'dcomm/mpi.hpp'), (3, 'dcomm/rendezvous.hpp'),
    (3, 'dcomm/spawn.hpp'), (3, 'dcomm/request.hpp'),
    (6, 'dcomm/impl/src.hpp'),  # the separate-compilation library: everything
    (4, 'dcomm/impl/'), (4, 'dcomm/communicator.hpp'), (4, 'dcomm/object_collectives.hpp'),
    (5, 'dcomm/init_process_group.hpp'), (5, 'dcomm/default_group.hpp'), (5, 'dcomm/gradient_bucketer.hpp'),
    (5, 'dcomm/thread_world.hpp'), (5, 'dcomm/torch.hpp'), (5, 'dcomm/rpc.hpp'), (5, 'dcomm/rpc/'), (5, 'dcomm/elastic.hpp'), (5, 'dcomm/elastic/'),
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
                               'dcomm/init/', 'dcomm/cpu/', 'dcomm/nccl/', 'dcomm/launch/',
                               'dcomm/mpi/', 'dcomm/shm/', 'dcomm/rpc/', 'dcomm/rpc.hpp',
                               'dcomm/cpu_backend.hpp', 'dcomm/mpi.hpp', 'dcomm/nccl.hpp'],
}
LEAN['dcomm/gradient_bucketer.hpp'] = LEAN['dcomm/communicator.hpp']


def blank_comments_strings(text):
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i)); i = j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j])); i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(')' + m.group(1) + '"', i) + len(m.group(1)) + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:end])); i = end
        elif c in '"\'' and not (c == "'" and i > 0 and text[i-1].isalnum()):
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == '\\' else 1
            out.append(c + ' ' * (j - i - 1) + c); i = j + 1
        else:
            out.append(c); i += 1
    return ''.join(out)

# Heads of scopes whose braces hold functions, and of statements that are
# no function.
CONTAINER = re.compile(r'^(template\s*<.*>\s*)?(namespace|class|struct|union|enum|extern\s+"C")\b', re.S)
CONTROL = re.compile(r'^(if|for|while|switch|catch|else|do|try|return)\b')

def functions(text):
    """(first line, last line) of each function body at namespace or class scope."""
    s = blank_comments_strings(text)
    # Preprocessor lines (with their continuations) are no part of a head.
    s = re.sub(r'^[ \t]*#(?:[^\n]*\\\n)*[^\n]*', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), s, flags=re.M)
    found = []
    def line(pos): return s.count('\n', 0, pos) + 1
    def match(pos):  # index of the } that closes the { at pos
        depth = 0
        for k in range(pos, len(s)):
            if s[k] == '{': depth += 1
            elif s[k] == '}':
                depth -= 1
                if depth == 0: return k
        return len(s) - 1
    def scan(start, end):
        head_start = start
        k = start
        while k < end:
            ch = s[k]
            if ch in ';}':
                head_start = k + 1
            elif ch == '{':
                head = ' '.join(s[head_start:k].split())
                close = match(k)
                bare = re.sub(r'^(template\s*<[^{]*?>\s*)+', '', head)
                bare = re.sub(r'^\[\[[^\]]*\]\]\s*', '', bare)
                # Braces inside a head: a default argument's, a member
                # initializer's ("x() : a_{1} {"), an initializer's.
                inner = (head.count('(') != head.count(')') or re.search(r'[=,(]\s*$', head)
                         or (re.search(r'\)\s*(noexcept\s*)?:', head) and re.search(r'[\w>]$', head)))
                if inner and not CONTAINER.match(bare):
                    k = close + 1
                    continue
                if CONTAINER.match(head) or CONTAINER.match(bare):
                    if not bare.startswith('enum'):
                        scan(k + 1, close)
                elif '(' in head and not CONTROL.match(bare):
                    first = line(head_start + len(s[head_start:k]) - len(s[head_start:k].lstrip()))
                    found.append((first, line(close), head))
                k = close
                head_start = k + 1
            k += 1
    scan(0, len(s))
    return found


def long_functions(path):
    """Breaches of rule 6 in one file."""
    text = path.read_text()
    lines = text.split('\n')
    out = []
    for first, last, head in functions(text):
        if last - first + 1 <= MAX_FUNCTION_LINES:
            continue
        above = first - 2  # the line before the head, 0-based
        reason = False
        while above >= 0 and lines[above].lstrip().startswith('//'):
            reason = reason or lines[above].lstrip().startswith('// Length:')
            above -= 1
        if not reason:
            name = re.sub(r'\s*\(.*', '', head).split()[-1] if '(' in head else head[:40]
            out.append(f'{path}:{first}: {name} is {last - first + 1} lines, over '
                       f'{MAX_FUNCTION_LINES} with no "// Length:" reason above it')
    return out


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
        asio_at = [m.start() for m in re.finditer(r'^#include\s+<asio[/.]', text, re.M)]
        config_at = [m.start() for m in re.finditer(
            r'^#include\s+"dcomm/detail/asio(_config)?\.hpp"', text, re.M)]
        if asio_at and h not in ('dcomm/detail/asio.hpp',) and (
                not config_at or config_at[0] > asio_at[0]):
            breaches.append(f'{h} includes Asio before dcomm/detail/asio_config.hpp')
        lines = text.count('\n')
        if lines > MAX_LINES:
            breaches.append(f'{h}: {lines} lines, over {MAX_LINES}')
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
    dispatch = (inc / 'dcomm/cpu/algorithms/dispatch.hpp').read_text()
    for op in sorted(set(re.findall(r'\{\.op = operation::(\w+)', dispatch))):
        base = re.sub(r'_v$', '', op)
        if not (inc / f'dcomm/cpu/algorithms/{base}.hpp').exists():
            breaches.append(f'cpu collective {op}: no cpu/algorithms/{base}.hpp')
    for header, banned in LEAN.items():
        for t in sorted(reach(inc, header)):
            if any(t == b or (b.endswith('/') and t.startswith(b)) for b in banned):
                breaches.append(f'{header} reaches {t}: its users would compile it')
    for folder in ['include', 'tools', 'bench', 'examples']:
        for p in sorted((root / folder).rglob('*')):
            if p.suffix in ('.hpp', '.cpp'):
                breaches += [b.replace(str(root) + '/', '') for b in long_functions(p)]
    sys.path.insert(0, str(root / 'tools'))
    import separate_compilation
    for h in separate_compilation.closure(inc, separate_compilation.ENTRY):
        if separate_compilation.stale(inc / h):
            breaches.append(f'{h}: its separate-compilation block is stale '
                            '(run tools/separate_compilation.py)')
    for b in breaches:
        print('layout:', b)
    print(f'{len(headers)} headers checked, {len(breaches)} breaches')
    return 1 if breaches else 0


if __name__ == '__main__':
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else '.').resolve()))
