#!/usr/bin/env python3
"""The separate-compilation mode, checked on the object files g++ makes.

  separate_compilation.py ROOT CXX [ARGS...]

A translation unit that includes dcomm/dcomm.hpp and calls nothing is
compiled at -O0 in both modes. g++ 12 emits a coroutine's body (its actor
and destroy functions) wherever the coroutine is instantiated, used or not
(detail/asio.hpp): in the separate-compilation mode, where every
DCOMM_EMIT_ON_USE coroutine (an f<void>) is declared an explicit
instantiation, none may be emitted; a member defined inside its class, or
a function declared inline, is instantiated all the same and shows here.
The header-only object is the comparison: it must hold them (else this
test sees nothing). Prints both objects' counts.
"""
import os
import re
import subprocess
import sys
import tempfile


def coroutines(obj):
    names = subprocess.run(['nm', '-C', obj], check=True, capture_output=True, text=True).stdout
    actors = [l for l in names.splitlines() if '[clone .actor]' in l]
    ours = [l for l in actors if re.search(r'\bdcomm::[\w:]+<void>\(', l)]
    return actors, ours


def main(root, cxx):
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, 'includes_everything.cpp')
        with open(source, 'w') as f:
            f.write('#include <dcomm/dcomm.hpp>\nint main() {}\n')
        found = {}
        for mode, extra in [('header-only', []), ('separate', ['-DDCOMM_SEPARATE_COMPILATION'])]:
            obj = os.path.join(tmp, mode + '.o')
            subprocess.run(cxx + ['-std=c++20', '-O0', '-I', os.path.join(root, 'include')] + extra +
                           ['-c', source, '-o', obj], check=True)
            actors, ours = coroutines(obj)
            found[mode] = ours
            print(f'{mode}: {len(actors)} coroutine bodies emitted, {len(ours)} of them '
                  "dcomm's DCOMM_EMIT_ON_USE coroutines")
    if not found['header-only']:
        print('the header-only object holds none of them: this check would see nothing')
        return 1
    for line in found['separate'][:20]:
        print('emitted in separate mode:', line.split(' t ', 1)[-1][:200])
    return 1 if found['separate'] else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1], sys.argv[2:]))
