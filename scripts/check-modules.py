#!/usr/bin/env python3
"""The module rules every crate keeps (run by scripts/test.sh; exits 1 on a breach):

1. No import circle. Within every module (the crate root included), its child modules, each
   taken with everything under it, import one another without a circle. Every form counts:
   `use crate::a::b`, `use crate::{a, b}`, `use super::x`, and paths written inline
   (`crate::a::f()`, `super::b::T`).
2. No module imports the crate root's own items: `lib.rs`/`main.rs` only declares modules,
   re-exports and wires; a `crate::X` that names a re-export counts as an import of the module
   it comes from.
3. No production file over 1,000 lines (test files, `tests.rs` and `tests/`, are not counted;
   neither is a trailing `#[cfg(test)] mod tests { ... }`).

Usage: scripts/check-modules.py [crate source dir ...]   (default: every crate of the workspace)
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["src", "agent/src", "launcher/src", "rendezvous/src", "kernels/src"]
MAX_LINES = 1000


def strip_comments_and_strings(text):
    """Blanks out comments, string and char literals (keeping newlines, so lines still count)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or c == "'" and re.match(r"'\\[xu]", text[i:i + 3]):
            j = text.find("'", i + 2)
            out.append("' '")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text, open_at):
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{")
INLINE_MOD = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*\{")


def without_test_modules(text):
    while True:
        m = TEST_MOD.search(text)
        if not m:
            return text
        end = matching_brace(text, m.end() - 1)
        text = text[:m.start()] + "\n" * text.count("\n", m.start(), end + 1) + text[end + 1:]


def split_inline_modules(text, path):
    """(module path, text) for the file's own body and every inline module in it."""
    parts, body, pos = [], [], 0
    for m in INLINE_MOD.finditer(text):
        if m.start() < pos:
            continue
        end = matching_brace(text, m.end() - 1)
        body.append(text[pos:m.start()])
        parts.extend(split_inline_modules(text[m.end():end], path + [m.group(1)]))
        pos = end + 1
    body.append(text[pos:])
    return [(path, "".join(body))] + parts


def expand_use_tree(tree, aliases=False):
    """`a::{b, c::{d, e as f}}` -> ["a::b", "a::c::d", "a::c::e"] (with `aliases`: pairs of the
    path and its alias or None)."""
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree.strip())
    i = tree.find("{")
    if i < 0:
        path, _, alias = tree.partition(" as ")
        path, alias = path.strip(), alias.strip() or None
        return [(path, alias)] if aliases else [path]
    prefix, inner = tree[:i], tree[i + 1:matching_brace(tree, i)]
    items, depth, start = [], 0, 0
    for j, c in enumerate(inner):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(inner[start:j])
            start = j + 1
    items.append(inner[start:])
    out = []
    for it in items:
        if it:
            for sub in expand_use_tree(it, aliases):
                out.append((prefix + sub[0], sub[1]) if aliases else prefix + sub)
    return out


USE = re.compile(r"\buse\s+((?:crate|super|self)\b[^;]*);")
INLINE = re.compile(r"(?<![\w:])((?:crate|super|self)(?:::(?:super|self|[A-Za-z_]\w*))+)")


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module path tuple -> relative file
        for dirpath, _, names in os.walk(os.path.join(ROOT, src)):
            for name in names:
                if not name.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), os.path.join(ROOT, src))
                parts = rel[:-3].split(os.sep)
                if parts[0] == "bin":
                    continue  # each binary is a crate of its own, importing this one by name
                if parts[-1] == "mod":
                    parts = parts[:-1]
                if parts in (["lib"], ["main"]):
                    parts = []
                self.files[tuple(parts)] = rel
        self.modules = set(self.files)
        self.reexports = {}  # root item name -> module path tuple
        self.root_items = set()
        self.refs = {}  # module path -> set of (target module, item or None, file, line)

    def is_test(self, path):
        rel = self.files[path]
        return os.path.basename(rel) == "tests.rs" or "tests" in path

    def load(self):
        for path, rel in sorted(self.files.items()):
            if self.is_test(path):
                continue
            text = open(os.path.join(ROOT, self.src, rel), encoding="utf-8").read()
            clean = without_test_modules(strip_comments_and_strings(text))
            for mpath, body in split_inline_modules(clean, list(path)):
                mpath = tuple(mpath)
                self.modules.add(mpath)
                self.scan(mpath, body, rel)
            if path == ():
                self.scan_root(clean)

    def scan_root(self, text):
        # `pub use a::B as C`: `crate::C` is an import of `a` (the front door re-exporting).
        # A root's private `use a::B` is the root's own business: `crate::B` from a module
        # imports the crate root.
        for m in re.finditer(r"(?<![\w:])(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);", text):
            public = m.group(1) is not None and m.group(1).strip() == "pub"
            for full, alias in expand_use_tree(m.group(2), aliases=True):
                segs = [x for x in full.split("::") if x and x not in ("crate", "self")]
                if not segs or segs[0] not in {p[0] for p in self.modules if p}:
                    continue  # an external crate's item
                name = alias or segs[-1]
                if public:
                    self.reexports[name] = tuple(segs[:-1]) if tuple(segs) not in self.modules else tuple(segs)
                else:
                    self.root_items.add(name)
        item = r"\b(?:(?:const|async|unsafe|extern\s+\"[^\"]*\")\s+)*(?:fn|struct|enum|union|trait|type|const|static(?:\s+mut)?|macro_rules!)\s+(\w+)"
        for m in re.finditer(item, text):
            self.root_items.add(m.group(1))

    def scan(self, mpath, text, rel):
        refs = self.refs.setdefault(mpath, set())
        lines = text.split("\n")

        def line_of(offset):
            return text.count("\n", 0, offset) + 1

        uses = []
        for m in USE.finditer(text):
            for full in expand_use_tree(m.group(1)):
                uses.append((full, line_of(m.start())))
        text_no_use = USE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in INLINE.finditer(text_no_use):
            uses.append((m.group(1), line_of(m.start())))
        del lines
        for full, line in uses:
            target = self.resolve(mpath, full.split(" as ")[0].split("::"))
            if target is not None:
                refs.add((target[0], target[1], rel, line))

    def resolve(self, here, segs):
        base = list(here)
        i = 0
        if segs[0] == "crate":
            base, i = [], 1
        while i < len(segs) and segs[i] in ("super", "self"):
            if segs[i] == "super":
                if not base:
                    return None
                base = base[:-1]
            i += 1
        rest = [s for s in segs[i:] if s and s != "*"]
        path = base
        for s in rest:
            if tuple(path + [s]) in self.modules:
                path = path + [s]
            else:
                if not path and s in self.reexports:
                    return self.reexports[s], s
                return tuple(path), s
        return tuple(path), None


def check(src):
    crate = Crate(src)
    crate.load()
    problems = []
    # Rule 3: file length.
    for path, rel in sorted(crate.files.items()):
        if crate.is_test(path):
            continue
        text = open(os.path.join(ROOT, src, rel), encoding="utf-8").read()
        n = without_test_modules(text).rstrip().count("\n") + 1
        if n > MAX_LINES:
            problems.append(f"{src}/{rel}: {n} lines of production code (at most {MAX_LINES})")
    # Rule 2: nothing imports the crate root's own items.
    for mpath, refs in sorted(crate.refs.items()):
        if mpath == ():
            continue
        for target, item, rel, line in sorted(refs, key=lambda r: (r[2], r[3])):
            if target == () and item is not None and item in crate.root_items:
                problems.append(f"{src}/{rel}:{line}: `{'::'.join(mpath)}` imports `{item}` from the crate root")
    # Rule 1: circles among the children of every module.
    parents = {m[:-1] for m in crate.modules if m} | {()}
    for parent in sorted(parents):
        children = {m[len(parent)] for m in crate.modules if len(m) > len(parent) and m[:len(parent)] == parent}
        edges, where = {}, {}
        for mpath, refs in crate.refs.items():
            if len(mpath) <= len(parent) or mpath[:len(parent)] != parent:
                continue
            a = mpath[len(parent)]
            for target, item, rel, line in refs:
                if len(target) <= len(parent) or target[:len(parent)] != parent:
                    continue
                b = target[len(parent)]
                if a != b and b in children:
                    edges.setdefault(a, set()).add(b)
                    where.setdefault((a, b), (rel, line))
        for cycle in find_cycles(edges):
            hops = " -> ".join("::".join(parent + (c,)) for c in cycle + [cycle[0]])
            via = "; ".join(f"{where[(cycle[k], cycle[(k + 1) % len(cycle)])][0]}:{where[(cycle[k], cycle[(k + 1) % len(cycle)])][1]}"
                            for k in range(len(cycle)))
            problems.append(f"{src}: import circle {hops} (at {via})")
    return problems


def find_cycles(edges):
    """One cycle per strongly connected component with more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(shortest_cycle(edges, set(comp)))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def shortest_cycle(edges, comp):
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path))
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def main():
    srcs = sys.argv[1:] or CRATES
    problems = [p for src in srcs for p in check(src)]
    for p in problems:
        print(p)
    if problems:
        print(f"check-modules: {len(problems)} breach(es) of the module rules (see scripts/check-modules.py)")
        sys.exit(1)
    print(f"check-modules: {', '.join(srcs)}: no import circle, nothing imports a crate root, no file over {MAX_LINES} lines")


if __name__ == "__main__":
    main()
