#!/usr/bin/env python3
"""Writes the separate-compilation block at the end of each header.

dcomm's coroutines that are not templates are declared DCOMM_EMIT_ON_USE
(detail/asio.hpp): function templates of an unused parameter, instantiated
as f<void>. In the separate-compilation mode (DCOMM_SEPARATE_COMPILATION,
README's "Using it in your project") a user's translation unit declares each of them an
explicit instantiation (`extern template`) and compiles none of them; the
library's one source file (dcomm/impl/src.hpp) instantiates them all. This
script lists them: for every header that dcomm/dcomm.hpp includes, one
DCOMM_INSTANTIATE line per DCOMM_EMIT_ON_USE declaration at namespace or
class scope, fully qualified, between the markers below at the header's
end.

  tools/separate_compilation.py [ROOT]            rewrite the blocks
  tools/separate_compilation.py --check [ROOT]    exit 1 if one is stale
"""
import os
import re
import sys

BEGIN = '// Separate compilation (tools/separate_compilation.py writes this block).'
END = '// End of the separate-compilation block.'
# Headers whose coroutines the library holds: what dcomm/dcomm.hpp brings.
ENTRY = 'dcomm/dcomm.hpp'

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
from check_layout import blank_comments_strings  # noqa: E402


def closure(inc, entry):
    seen, todo = set(), [entry]
    while todo:
        h = todo.pop()
        if h in seen:
            continue
        seen.add(h)
        text = open(os.path.join(inc, h)).read()
        todo += re.findall(r'^#include "(dcomm/[^"]+)"', text, re.M)
    return sorted(seen)


def split_top(text, sep=','):
    """text split at `sep` outside (), <>, [] and {}."""
    parts, depth, cur = [], 0, ''
    for ch in text:
        if ch in '(<[{':
            depth += 1
        elif ch in ')>]}':
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ''
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def declaration(head, scopes):
    """The DCOMM_INSTANTIATE argument for one declaration's head (up to its
    body or ';'), or None for what cannot be named (a member of a class
    template)."""
    if any(kind == 'template' for kind, _ in scopes):
        return None
    text = ' '.join(head.split())
    text = re.sub(r'^DCOMM_EMIT_ON_USE\s+', '', text)
    text = re.sub(r'\b(inline|static|virtual|constexpr|friend)\s+', '', text)
    open_paren = None
    depth = 0
    for i, ch in enumerate(text):
        if ch == '<':
            depth += 1
        elif ch == '>':
            depth -= 1
        elif ch == '(' and depth == 0:
            open_paren = i
            break
    depth, close = 0, None
    for i in range(open_paren, len(text)):
        if text[i] == '(':
            depth += 1
        elif text[i] == ')':
            depth -= 1
            if depth == 0:
                close = i
                break
    before, params, after = text[:open_paren], text[open_paren + 1:close], text[close + 1:]
    m = re.match(r'^(.*?)(\w+)\s*$', before)
    result, name = m.group(1).strip(), m.group(2)
    kept = [split_top(p, '=')[0].strip() for p in split_top(params)]
    after = re.sub(r'\boverride\b|\bfinal\b', '', after)
    after = ' '.join(after.split())
    qualified = '::'.join(n for _, n in scopes) + '::' + name
    tail = (' ' + after) if after else ''
    return f'auto {qualified}<void>({", ".join(kept)}){tail} -> {result}'


def instantiations(text):
    s = blank_comments_strings(text)
    s = re.sub(r'^[ \t]*#(?:[^\n]*\\\n)*[^\n]*', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), s,
               flags=re.M)
    out, scopes = [], []  # scopes: (kind, name); kind None for a brace that is no scope
    head_start = 0
    i = 0
    while i < len(s):
        ch = s[i]
        if s.startswith('DCOMM_EMIT_ON_USE', i) and not s.startswith('DCOMM_EMIT_ON_USE_', i) \
                and all(kind in ('namespace', 'class', 'template') for kind, _ in scopes):
            j, depth = i, 0
            while j < len(s):
                if s[j] == '(':
                    depth += 1
                elif s[j] == ')':
                    depth -= 1
                elif depth == 0 and s[j] in '{;':
                    break
                j += 1
            d = declaration(s[i:j], scopes)
            if d:
                out.append(d)
        if ch in ';}':
            if ch == '}':
                scopes.pop()
            head_start = i + 1
        elif ch == '{':
            head = ' '.join(s[head_start:i].split())
            m = re.match(r'^namespace\s+([\w:]+)$', head)
            c = re.match(r'^(template\s*<.*>\s*)?(class|struct)\s+(\w+)\b[^()]*$', head)
            if m:
                scopes.append(('namespace', m.group(1)))
            elif c:
                scopes.append(('template' if c.group(1) else 'class', c.group(3)))
            else:
                scopes.append((None, ''))
            head_start = i + 1
        i += 1
    return out


def block(lines):
    if not lines:
        return ''
    body = ''.join(f'DCOMM_INSTANTIATE({line})\n' for line in lines)
    return f'\n{BEGIN}\n// clang-format off\n{body}// clang-format on\n{END}\n'


def current(text):
    """text with its block as this script writes it."""
    bare = re.sub(r'\n' + re.escape(BEGIN) + r'.*?' + re.escape(END) + r'\n', '', text, flags=re.S)
    return bare.rstrip('\n') + '\n' + block(instantiations(bare))


def stale(path):
    text = open(path).read()
    return current(text) != text


def rewrite(path, check):
    text = open(path).read()
    new = current(text)
    if new != text:
        if check:
            print(f'{path}: its separate-compilation block is stale: run tools/separate_compilation.py')
            return False
        open(path, 'w').write(new)
    return True


def main(argv):
    check = '--check' in argv
    args = [a for a in argv if a != '--check']
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
    inc = os.path.join(root, 'include')
    ok = True
    for h in closure(inc, ENTRY):
        ok = rewrite(os.path.join(inc, h), check) and ok
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
