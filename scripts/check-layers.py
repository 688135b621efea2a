#!/usr/bin/env python3
"""Check farmap's layering, file import cycles, long functions and a few figures.

Standard library only; reads the sources, never runs cargo.

    python3 scripts/check-layers.py            # human report, exit 0
    python3 scripts/check-layers.py --json     # one JSON object
    python3 scripts/check-layers.py --check    # exit 1 on crate-arrow errors or cycles
                                               # that are not in ALLOWED_CYCLES

What it checks (see the sections of the report):

1. Crate arrows. Every crate lives in a layer folder; a normal dependency ([dependencies],
   and [target.*.dependencies]) may point down or sideways (same layer: reported as info),
   never up. farmap-testkit may only be a [dev-dependency], except from tools/*.
2. File import cycles inside each crate. Modules come from file paths (src/a.rs and
   src/a/mod.rs are "a", src/a/b.rs is "a::b", lib.rs/main.rs is the root "crate");
   a module depends on another when its non-test code names it (crate::x, super::x,
   self::x, or x:: for a child module x declared with `mod x;`). Edges to the root are
   ignored (lib.rs re-exports would make everything one cycle). Strongly connected
   components of more than one module are cycles.
3. Functions over MAX_FN_LINES lines and files over MAX_FILE_LINES lines (test code
   excluded).
4. Figures: Rust lines per crate, `unsafe` blocks/fns/impls per crate, crates without
   `#![forbid(unsafe_code)]` in their lib.rs/main.rs.

The Rust "parser" here is a lexer that blanks comments, string and char literals, plus
brace counting: good enough for rustfmt-formatted code, not a compiler. Known gaps are
listed under LIMITATIONS at the end of this file.
"""

import argparse
import bisect
import json
import os
import re
import sys

try:
    import tomllib  # Python 3.11+
except ImportError:  # pragma: no cover - older Pythons use the small fallback below
    tomllib = None

# --------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------

# Layer folders, bottom to top. A crate may depend on crates of a lower or the same layer.
LAYERS = {
    "base": 0,
    "stores": 1,
    "stages": 2,
    "net": 3,
    "frontends": 4,
    "migrate": 5,
    "app": 6,
    "tools": 7,  # tools/*: may depend on anything
}
# crates/testkit/*: a test helper, outside the order. Depended on only from
# [dev-dependencies], or from tools/* normal dependencies.
TESTKIT_LAYER = "testkit"

# File cycles that are accepted, per crate (package name): each entry is the exact set of
# modules of one strongly connected component, with the reason it is fine.
ALLOWED_CYCLES = {
    "farmap": {
        # Stage and tier specs contain specs (a recursive grammar): the registry parses,
        # prints and opens them through spec::stage and spec::tier, which parse, print and
        # open their members through the registry and spec::open (spec::nest parses a
        # member for both).
        frozenset({"spec::nest", "spec::open", "spec::registry", "spec::stage", "spec::tier",
                   "spec::versioned"}),
    },
}

MAX_FN_LINES = 100
MAX_FILE_LINES = 800

ROOT_MODULE = "crate"

# --------------------------------------------------------------------------------------
# Lexing: blank comments and the contents of string/char literals, keep the offsets
# --------------------------------------------------------------------------------------


def _is_ident_char(c):
    return c.isalnum() or c == "_"


def sanitize(text):
    """Return `text` with comments and literal contents replaced by spaces.

    Newlines are kept, so offsets and line numbers are the same as in `text`. String
    delimiters stay (`"   "`), so `extern "C"` still looks like `extern "  "`.
    """
    out = list(text)
    n = len(text)
    i = 0

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c == "/" and nxt == "*":
            depth = 1
            j = i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth += 1
                    j += 2
                elif text.startswith("*/", j):
                    depth -= 1
                    j += 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c == "r" and (nxt == '"' or nxt == "#") and (
            i == 0
            or not _is_ident_char(text[i - 1])
            or (text[i - 1] == "b" and (i < 2 or not _is_ident_char(text[i - 2])))
        ):
            # Raw string r"..." / r#"..."# (or br"..."), unless it is a raw identifier r#x.
            j = i + 1
            while j < n and text[j] == "#":
                j += 1
            if j < n and text[j] == '"':
                hashes = j - (i + 1)
                close = '"' + "#" * hashes
                end = text.find(close, j + 1)
                end = n if end < 0 else end
                blank(j + 1, end)
                i = end + len(close)
            else:
                i += 1
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        elif c == "'":
            # Char literal ('x', '\n', '\'', '\u{1F600}') or a lifetime/label ('a).
            if nxt == "\\":
                j = i + 3
                while j < n and text[j] != "'" and text[j] != "\n":
                    j += 1
                if j < n and text[j] == "'":
                    blank(i + 1, j)
                    i = j + 1
                else:
                    i += 1
            elif i + 2 < n and text[i + 2] == "'" and nxt != "\n":
                blank(i + 1, i + 2)
                i += 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def match_brace(code, open_pos):
    """Offset of the `}` closing the `{` at open_pos (in sanitized code), or len-1."""
    depth = 0
    for k in range(open_pos, len(code)):
        ch = code[k]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(code) - 1


def match_bracket(code, open_pos, opening="[", closing="]"):
    depth = 0
    for k in range(open_pos, len(code)):
        ch = code[k]
        if ch == opening:
            depth += 1
        elif ch == closing:
            depth -= 1
            if depth == 0:
                return k
    return len(code) - 1


CFG_TEST_RE = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
INNER_CFG_TEST_RE = re.compile(r"#!\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")


def test_ranges(code):
    """(start, end) offsets of items under `#[cfg(test)]` (end exclusive).

    The item is what follows the attribute and any further attributes: up to its `;`
    or `,` (a field, a statement, `mod tests;`), or to the brace closing its first
    `{` (a `mod tests { ... }`, fn, impl).
    """
    if INNER_CFG_TEST_RE.search(code):
        return [(0, len(code))]
    ranges = []
    pos = 0
    n = len(code)
    while True:
        m = CFG_TEST_RE.search(code, pos)
        if not m:
            break
        start = m.start()
        k = m.end()
        # further outer attributes
        while True:
            while k < n and code[k].isspace():
                k += 1
            if code.startswith("#[", k) or (code.startswith("#", k) and code[k + 1 : k + 2].isspace()):
                b = code.find("[", k)
                k = match_bracket(code, b) + 1
            else:
                break
        depth = 0
        end = n
        while k < n:
            ch = code[k]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif depth == 0 and ch in ";,":
                end = k + 1
                break
            elif depth == 0 and ch == "}":
                end = k  # the enclosing block closes: the item had no terminator
                break
            elif depth == 0 and ch == "{":
                end = match_brace(code, k) + 1
                break
            k += 1
        ranges.append((start, end))
        pos = max(end, m.end())
    return ranges


def blank_ranges(code, ranges):
    if not ranges:
        return code
    out = list(code)
    for a, b in ranges:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "
    return "".join(out)


class SourceFile:
    """One .rs file: raw text, sanitized code, and code with test items blanked."""

    def __init__(self, path, rel):
        self.path = path
        self.rel = rel  # relative to the workspace root
        with open(path, encoding="utf-8", errors="replace") as f:
            self.text = f.read()
        self.code = sanitize(self.text)
        self.tests = test_ranges(self.code)
        self.prod = blank_ranges(self.code, self.tests)  # non-test code
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]
        self.lines = self.text.count("\n") + (0 if self.text.endswith("\n") or not self.text else 1)
        test_lines = set()
        for a, b in self.tests:
            la, lb = self.line_of(a), self.line_of(max(a, b - 1))
            test_lines.update(range(la, lb + 1))
        self.test_lines = len(test_lines)

    def line_of(self, offset):
        return bisect.bisect_right(self.line_starts, offset)  # 1-based


# --------------------------------------------------------------------------------------
# Workspace discovery and Cargo.toml
# --------------------------------------------------------------------------------------


def _mini_toml(text):
    """A tiny TOML reader for Cargo.toml when tomllib is missing: tables of simple keys,
    dotted keys (a.workspace = true) and one-line inline tables. Enough for this repo."""
    data = {}
    table = data
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip() if '"' not in raw else raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[["):
            name = line.strip("[]").strip()
            table = {}
            data.setdefault(name, []).append(table)
            continue
        if line.startswith("["):
            table = data
            for part in re.findall(r'"[^"]*"|\'[^\']*\'|[^.]+', line.strip("[]").strip()):
                table = table.setdefault(part.strip().strip("'\""), {})
            continue
        if "=" not in line:
            continue
        key, val = line.split("=", 1)
        key, val = key.strip(), val.strip()
        if val.startswith("{"):
            inner = {}
            for k, v in re.findall(r'([\w.-]+)\s*=\s*("[^"]*"|\[[^\]]*\]|[\w.-]+)', val):
                inner[k] = _toml_scalar(v)
            value = inner
        else:
            value = _toml_scalar(val)
        parts = key.split(".")
        t = table
        for p in parts[:-1]:
            t = t.setdefault(p.strip('"'), {})
        t[parts[-1].strip('"')] = value
    return data


def _toml_scalar(v):
    v = v.strip()
    if v == "true":
        return True
    if v == "false":
        return False
    if v.startswith('"'):
        return v.strip('"')
    return v


def read_toml(path):
    with open(path, "rb") as f:
        raw = f.read()
    if tomllib is not None:
        return tomllib.loads(raw.decode("utf-8"))
    return _mini_toml(raw.decode("utf-8"))


class Crate:
    def __init__(self, root, folder):
        self.dir = os.path.join(root, folder)
        self.folder = folder  # e.g. crates/frontends/farmap-uffd
        parts = folder.split("/")
        self.layer_name = parts[1] if parts[0] == "crates" else "tools"
        self.layer = LAYERS.get(self.layer_name)  # None for testkit (and unknown folders)
        self.manifest = read_toml(os.path.join(self.dir, "Cargo.toml"))
        self.name = self.manifest.get("package", {}).get("name", parts[-1])

    @property
    def short(self):
        return "%s/%s" % (self.layer_name, os.path.basename(self.dir))

    def normal_deps(self):
        """[(key, spec_dict, section)] of normal dependencies."""
        out = []
        for key, spec in self.manifest.get("dependencies", {}).items():
            out.append((key, spec if isinstance(spec, dict) else {"version": spec}, "dependencies"))
        for cfg, tbl in self.manifest.get("target", {}).items():
            for key, spec in tbl.get("dependencies", {}).items():
                out.append(
                    (key, spec if isinstance(spec, dict) else {"version": spec},
                     "target.%s.dependencies" % cfg)
                )
        return out

    def rs_files(self):
        out = []
        for dirpath, dirnames, filenames in os.walk(self.dir):
            dirnames[:] = sorted(d for d in dirnames if d not in ("target", ".git"))
            for fn in sorted(filenames):
                if fn.endswith(".rs"):
                    out.append(os.path.join(dirpath, fn))
        return out


def discover(root):
    folders = []
    crates_dir = os.path.join(root, "crates")
    for layer in sorted(os.listdir(crates_dir)):
        ld = os.path.join(crates_dir, layer)
        if not os.path.isdir(ld):
            continue
        for c in sorted(os.listdir(ld)):
            if os.path.isfile(os.path.join(ld, c, "Cargo.toml")):
                folders.append("crates/%s/%s" % (layer, c))
    tools_dir = os.path.join(root, "tools")
    if os.path.isdir(tools_dir):
        for c in sorted(os.listdir(tools_dir)):
            if os.path.isfile(os.path.join(tools_dir, c, "Cargo.toml")):
                folders.append("tools/%s" % c)
    return [Crate(root, f) for f in folders]


# --------------------------------------------------------------------------------------
# 1. Crate arrows
# --------------------------------------------------------------------------------------


def check_arrows(root, crates):
    by_name = {c.name: c for c in crates}
    by_dir = {os.path.realpath(c.dir): c for c in crates}
    ws = read_toml(os.path.join(root, "Cargo.toml")).get("workspace", {})
    ws_deps = ws.get("dependencies", {})

    errors, same_layer, info, warnings = [], [], [], []
    for c in crates:
        if c.layer is None and c.layer_name != TESTKIT_LAYER:
            warnings.append("%s: unknown layer folder %r" % (c.folder, c.layer_name))
        for key, spec, section in c.normal_deps():
            target = None
            pkg = spec.get("package", key)
            if spec.get("workspace"):
                wspec = ws_deps.get(key, {})
                if isinstance(wspec, dict):
                    pkg = wspec.get("package", pkg)
                    if "path" in wspec:
                        target = by_dir.get(os.path.realpath(os.path.join(root, wspec["path"])))
            elif "path" in spec:
                target = by_dir.get(os.path.realpath(os.path.join(c.dir, spec["path"])))
            if target is None:
                target = by_name.get(pkg)
            if target is None or target is c:
                continue
            arrow = {
                "from": c.name,
                "from_folder": c.folder,
                "from_layer": c.layer_name,
                "to": target.name,
                "to_folder": target.folder,
                "to_layer": target.layer_name,
                "section": section,
                "optional": bool(spec.get("optional")),
            }
            opt = " (optional)" if arrow["optional"] else ""
            desc = "%s (%s) -> %s (%s)%s" % (
                c.short, _lvl(c), target.short, _lvl(target), opt)
            arrow["text"] = desc
            if target.layer_name == TESTKIT_LAYER:
                if c.layer_name == "tools":
                    arrow["kind"] = "testkit-from-tools"
                    info.append(arrow)
                else:
                    arrow["kind"] = "testkit-normal-dep"
                    arrow["text"] = desc + ": farmap-testkit only in [dev-dependencies]"
                    errors.append(arrow)
            elif c.layer_name == "tools":
                arrow["kind"] = "from-tools"
                info.append(arrow)
            elif c.layer_name == TESTKIT_LAYER:
                # Not in the order; a test helper depending on a product crate is noted only.
                arrow["kind"] = "from-testkit"
                info.append(arrow)
            elif c.layer is None or target.layer is None:
                arrow["kind"] = "unknown-layer"
                warnings.append(desc + ": unknown layer")
            elif (
                target.layer_name == "tools"
                and c.folder == "crates/app/farmap-cli"
                and arrow["optional"]
            ):
                # The binary links the tools (benchmarks, demo, proxy) behind its default
                # `tools` feature; without it, the product builds alone.
                arrow["kind"] = "tools-feature"
                info.append(arrow)
            elif target.layer > c.layer:
                arrow["kind"] = "up"
                errors.append(arrow)
            elif target.layer == c.layer:
                arrow["kind"] = "same-layer"
                same_layer.append(arrow)
            else:
                arrow["kind"] = "down"
    return {"errors": errors, "same_layer": same_layer, "info": info, "warnings": warnings}


def _lvl(c):
    return "%s=%s" % (c.layer_name, c.layer if c.layer is not None else "-")


# --------------------------------------------------------------------------------------
# 2. File import cycles
# --------------------------------------------------------------------------------------

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
MOD_DECL_RE = re.compile(r"(?<![A-Za-z0-9_])mod\s+(" + IDENT + r")\s*;")
INLINE_MOD_RE = re.compile(r"(?<![A-Za-z0-9_])mod\s+(" + IDENT + r")\s*\{")
USE_RE = re.compile(r"(?<![A-Za-z0-9_$])use\s+")
# A path: ident(::ident)+ not preceded by `::`, `$` ($crate) or an identifier character.
PATH_RE = re.compile(
    r"(?<![A-Za-z0-9_$:])(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)"
)
PUB_IN_RE = re.compile(r"pub\s*\(\s*in\s+[^)]*\)")
KEYWORD_STARTS = {"crate", "super", "self"}


def module_of(src_rel):
    """Module path of a file relative to src/ ('a/b.rs' -> 'a::b'), or None for bin/."""
    parts = src_rel.split("/")
    if parts[0] == "bin":
        return None
    if src_rel in ("lib.rs", "main.rs"):
        return ROOT_MODULE
    last = parts[-1][:-3]
    if last == "mod":
        parts = parts[:-1]
    else:
        parts = parts[:-1] + [last]
    return "::".join(parts)


def is_test_file(rel_parts):
    """tests/ folders, tests.rs and *_tests.rs are test code."""
    if "tests" in rel_parts[:-1]:
        return True
    base = rel_parts[-1][:-3] if rel_parts[-1].endswith(".rs") else rel_parts[-1]
    return base == "tests" or base.endswith("_tests")


def parse_use_tree(s):
    """Paths (lists of segments) named by one use tree, e.g. 'crate::{a::X, b}'."""
    tokens = re.findall(IDENT + r"|::|[{},*]", s)
    pos = 0

    def tree(prefix):
        nonlocal pos
        paths = []
        segs = list(prefix)
        while pos < len(tokens):
            t = tokens[pos]
            if t == "::":
                pos += 1
            elif t == "{":
                pos += 1
                while pos < len(tokens) and tokens[pos] != "}":
                    if tokens[pos] == ",":
                        pos += 1
                        continue
                    paths.extend(tree(segs))
                pos += 1  # '}'
                return paths
            elif t in (",", "}"):
                break
            elif t == "*":
                pos += 1
            elif t == "as":
                pos += 2  # alias
            elif t == "self" and segs:
                pos += 1  # `x::{self, ...}`: the prefix itself
            else:
                segs.append(t)
                pos += 1
        if segs:
            paths.append(segs)
        return paths

    out = []
    while pos < len(tokens):
        if tokens[pos] == ",":
            pos += 1
            continue
        before = pos
        out.extend(tree([]))
        if pos == before:
            pos += 1
    return out


class ModuleFile:
    def __init__(self, sf, module):
        self.sf = sf
        self.module = module
        code = PUB_IN_RE.sub(lambda m: " " * len(m.group(0)), sf.prod)
        self.code = code
        self.children = set(m.group(1) for m in MOD_DECL_RE.finditer(code))
        # inline (non-test) modules: offsets of their bodies, with their names
        self.inline = []
        for m in INLINE_MOD_RE.finditer(code):
            open_pos = m.end() - 1
            self.inline.append((open_pos, match_brace(code, open_pos), m.group(1)))

    def inline_stack(self, offset):
        return [name for a, b, name in self.inline if a < offset < b]

    def references(self):
        """[(offset, segments)] of every path in non-test code, use trees expanded."""
        code = self.code
        refs = []
        blanks = []
        for m in USE_RE.finditer(code):
            end = m.end()
            depth = 0
            while end < len(code):
                ch = code[end]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    if depth == 0:
                        break
                    depth -= 1
                elif ch == ";" and depth == 0:
                    break
                end += 1
            tree = code[m.end():end]
            for segs in parse_use_tree(tree):
                refs.append((m.start(), segs))
            blanks.append((m.start(), end))
        rest = blank_ranges(code, blanks)
        for m in PATH_RE.finditer(rest):
            segs = re.split(r"\s*::\s*", m.group(1))
            refs.append((m.start(), segs))
        return refs


def resolve(segs, mf, offset, modules):
    """Module a path names (longest existing module prefix), ROOT_MODULE, or None."""
    if not segs:
        return None
    file_mod = [] if mf.module == ROOT_MODULE else mf.module.split("::")
    stack = mf.inline_stack(offset)
    head = segs[0]
    if head == "crate":
        cur, rest = [], segs[1:]
    elif head in ("super", "self"):
        cur = file_mod + stack
        i = 0
        while i < len(segs) and segs[i] in ("super", "self"):
            if segs[i] == "super":
                if not cur:
                    return None
                cur = cur[:-1]
            i += 1
        rest = segs[i:]
        if len(cur) > len(file_mod):
            return mf.module  # still inside one of this file's inline modules
    elif not stack and head in mf.children:
        cur = file_mod + [head]
        if "::".join(cur) not in modules:
            return None
        rest = segs[1:]
    else:
        return None  # another crate, a type, an enum variant...
    for k in range(len(rest), -1, -1):
        cand = "::".join(cur + rest[:k])
        if not cand:
            return ROOT_MODULE
        if cand in modules:
            return cand
    return ROOT_MODULE if not cur else None


def tarjan(nodes, edges):
    """Strongly connected components (iterative Tarjan)."""
    index, low, on_stack = {}, {}, set()
    stack, sccs = [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                sccs.append(sorted(comp))
    return sccs


def cycle_through(members, edges, limit=12):
    """A closed walk through all members if one exists as a simple cycle (small SCCs),
    else a shortest cycle through the first member; as a list ending with its start."""
    mset = set(members)
    start = members[0]
    if len(members) <= limit:
        path = [start]
        seen = {start}

        def dfs(v):
            if len(path) == len(members):
                return start in edges.get(v, ())
            for w in sorted(edges.get(v, ())):
                if w in mset and w not in seen:
                    seen.add(w)
                    path.append(w)
                    if dfs(w):
                        return True
                    path.pop()
                    seen.discard(w)
            return False

        if dfs(start):
            return path + [start], True
    # shortest cycle through start (BFS)
    prev = {start: None}
    queue = [start]
    found = None
    while queue and found is None:
        nq = []
        for v in queue:
            for w in sorted(edges.get(v, ())):
                if w not in mset:
                    continue
                if w == start:
                    found = v
                    break
                if w not in prev:
                    prev[w] = v
                    nq.append(w)
            if found is not None:
                break
        queue = nq
    walk = []
    v = found
    while v is not None:
        walk.append(v)
        v = prev[v]
    walk.reverse()
    return walk + [start], False


def _related(a, b):
    """True when one module is an ancestor of the other."""
    return a.startswith(b + "::") or b.startswith(a + "::")


def check_cycles(root, crates):
    result = {}
    for c in crates:
        src = os.path.join(c.dir, "src")
        if not os.path.isdir(src):
            continue
        files = {}
        has_lib = os.path.isfile(os.path.join(src, "lib.rs"))
        for path in c.rs_files():
            if not path.startswith(src + os.sep):
                continue
            rel_src = os.path.relpath(path, src).replace(os.sep, "/")
            if is_test_file(rel_src.split("/")):
                continue
            if has_lib and rel_src == "main.rs":
                continue  # a second crate root (the binary): it uses the library by name
            mod = module_of(rel_src)
            if mod is None:
                continue
            sf = SourceFile(path, os.path.relpath(path, root).replace(os.sep, "/"))
            files[mod] = ModuleFile(sf, mod)
        modules = set(files)
        edges = {m: set() for m in modules}
        evidence = {}  # (a, b) -> [file:line, ...]
        for mod, mf in files.items():
            for offset, segs in mf.references():
                target = resolve(segs, mf, offset, modules)
                if target is None or target == ROOT_MODULE or target == mod:
                    continue
                edges[mod].add(target)
                evidence.setdefault((mod, target), []).append(
                    "%s:%d" % (mf.sf.rel, mf.sf.line_of(offset)))
        # files that no `mod x;` declares (dead files): informational
        orphans = []
        for mod in sorted(modules):
            if mod == ROOT_MODULE:
                continue
            parts = mod.split("::")
            parent = "::".join(parts[:-1]) or ROOT_MODULE
            pf = files.get(parent)
            declared = pf is not None and (
                parts[-1] in pf.children or parts[-1] in {n for _, _, n in pf.inline})
            if not declared:
                orphans.append(files[mod].sf.rel)
        nodes = sorted(modules)
        sccs = [s for s in tarjan(nodes, edges) if len(s) > 1]
        allowed = ALLOWED_CYCLES.get(c.name, set())
        cycles = []
        for members in sorted(sccs):
            walk, covers = cycle_through(members, edges)
            intra = []
            for a in members:
                for b in sorted(edges[a]):
                    if b in members:
                        ev = evidence[(a, b)]
                        intra.append({"from": a, "to": b, "at": ev[0], "count": len(ev)})
            cycles.append({
                "crate": c.name,
                "members": members,
                "cycle": walk,
                "cycle_covers_all": covers,
                # Allowed when every member belongs to one allowed set (a recursion the
                # text shows only in part, method calls being invisible to this script).
                "allowed": any(frozenset(members) <= a for a in allowed),
                "edges": intra,
            })
        for x in cycles:
            x["contains_allowed"] = [sorted(s) for s in allowed
                                     if s < frozenset(x["members"])]
        # The same graph without edges between a module and its own ancestors (children
        # using `super::`, parents using or re-exporting children): the cycles left are
        # between siblings/cousins. Information only; the exit status uses `cycles`.
        cross_edges = {m: {t for t in ts if not _related(m, t)} for m, ts in edges.items()}
        cross = []
        for members in sorted(s for s in tarjan(nodes, cross_edges) if len(s) > 1):
            walk, covers = cycle_through(members, cross_edges)
            cross.append({"members": members, "cycle": walk, "cycle_covers_all": covers})
        result[c.name] = {
            "folder": c.folder,
            "files": len(files),
            "modules": len(modules),
            "edges": sum(len(v) for v in edges.values()),
            "cycles": cycles,
            "cycles_without_parent_child_edges": cross,
            "orphan_files": orphans,
        }
    return result


# --------------------------------------------------------------------------------------
# 3. Long functions and files
# --------------------------------------------------------------------------------------

FN_RE = re.compile(
    r"^[ \t]*(?:#\[[^\]\n]*\][ \t]*)*"
    r"(?:pub(?:[ \t]*\([^)\n]*\))?[ \t]+)?(?:default[ \t]+)?(?:const[ \t]+)?(?:async[ \t]+)?"
    r"(?:unsafe[ \t]+)?(?:extern[ \t]+(?:\"[^\"\n]*\"[ \t]+)?)?fn[ \t]+(" + IDENT + r")",
    re.M,
)


def functions(sf):
    """[(line, name, length)] of fn items with a body, in non-test code."""
    code = sf.prod
    out = []
    for m in FN_RE.finditer(code):
        k = m.end()
        depth = 0
        body = None
        while k < len(code):
            ch = code[k]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif depth == 0 and ch == ";":
                break
            elif depth == 0 and ch == "{":
                body = k
                break
            k += 1
        if body is None:
            continue
        end = match_brace(code, body)
        start_line = sf.line_of(m.start(1))
        out.append((start_line, m.group(1), sf.line_of(end) - start_line + 1))
    return out


def check_long(root, crates):
    long_fns, long_files = [], []
    for c in crates:
        for path in c.rs_files():
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            rel_crate = os.path.relpath(path, c.dir).replace(os.sep, "/")
            if is_test_file(rel_crate.split("/")):
                continue
            sf = SourceFile(path, rel)
            for line, name, length in functions(sf):
                if length > MAX_FN_LINES:
                    long_fns.append({"crate": c.name, "file": rel, "line": line,
                                     "name": name, "lines": length})
            code_lines = sf.lines - sf.test_lines
            if code_lines > MAX_FILE_LINES:
                long_files.append({"crate": c.name, "file": rel, "lines": code_lines,
                                   "total_lines": sf.lines})
    long_fns.sort(key=lambda f: (-f["lines"], f["file"], f["line"]))
    long_files.sort(key=lambda f: (-f["lines"], f["file"]))
    return long_fns, long_files


# --------------------------------------------------------------------------------------
# 4. Figures
# --------------------------------------------------------------------------------------

UNSAFE_RES = {
    "block": re.compile(r"(?<![A-Za-z0-9_])unsafe\s*\{"),
    "fn": re.compile(r"(?<![A-Za-z0-9_])unsafe\s+(?:extern\s+\"[^\"]*\"\s+)?fn\b"),
    "impl": re.compile(r"(?<![A-Za-z0-9_])unsafe\s+impl\b"),
}
FORBID_RE = re.compile(r"#!\s*\[\s*forbid\s*\(([^)]*)\)\s*\]")
DENY_RE = re.compile(r"#!\s*\[\s*deny\s*\(([^)]*)\)\s*\]")
OUTER_FORBID_MOD_RE = re.compile(
    r"#\s*\[\s*forbid\s*\([^)]*\bunsafe_code\b[^)]*\)\s*\]\s*(?:#\s*\[[^\]]*\]\s*)*"
    r"(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(" + IDENT + r")")


def figures(root, crates):
    per_crate = {}
    lacking = []
    for c in crates:
        total = src_lines = src_prod = 0
        unsafe = {"block": 0, "fn": 0, "impl": 0}
        unsafe_test = 0
        unsafe_files = {}
        src = os.path.join(c.dir, "src")
        for path in c.rs_files():
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            rel_crate = os.path.relpath(path, c.dir).replace(os.sep, "/")
            sf = SourceFile(path, rel)
            total += sf.lines
            test_file = is_test_file(rel_crate.split("/"))
            if path.startswith(src + os.sep):
                src_lines += sf.lines
                if not test_file:
                    src_prod += sf.lines - sf.test_lines
            for kind, rx in UNSAFE_RES.items():
                n_all = len(rx.findall(sf.code))
                n_prod = 0 if test_file else len(rx.findall(sf.prod))
                unsafe[kind] += n_prod
                unsafe_test += n_all - n_prod
                if n_prod:
                    unsafe_files[rel] = unsafe_files.get(rel, 0) + n_prod
        roots = {}
        for root_file in ("lib.rs", "main.rs"):
            p = os.path.join(src, root_file)
            if not os.path.isfile(p):
                continue
            sf = SourceFile(p, os.path.relpath(p, root))
            forbid = any(re.search(r"\bunsafe_code\b", m.group(1))
                         for m in FORBID_RE.finditer(sf.code))
            deny = any(re.search(r"\bunsafe_code\b", m.group(1))
                       for m in DENY_RE.finditer(sf.code))
            declared = sorted(m.group(1) for m in MOD_DECL_RE.finditer(sf.prod))
            forbidden_mods = sorted(set(m.group(1) for m in OUTER_FORBID_MOD_RE.finditer(sf.prod)))
            roots[root_file] = {
                "forbid_unsafe_code": forbid,
                "deny_unsafe_code": deny,
                "modules": len(declared),
                "modules_with_forbid": forbidden_mods,
                "modules_without_forbid": [m for m in declared if m not in forbidden_mods],
            }
            if not forbid:
                lacking.append({"crate": c.name, "file": "%s/src/%s" % (c.folder, root_file),
                                **roots[root_file]})
        per_crate[c.name] = {
            "folder": c.folder,
            "layer": c.layer_name,
            "rust_lines": total,
            "src_lines": src_lines,
            "src_non_test_lines": src_prod,
            "unsafe": dict(unsafe, total=sum(unsafe.values())),
            "unsafe_in_test_code": unsafe_test,
            "unsafe_by_file": dict(sorted(unsafe_files.items())),
            "roots": roots,
        }
    cli = next((c for c in crates if c.folder == "crates/app/farmap-cli"), None)
    return {
        "per_crate": per_crate,
        "total_rust_lines": sum(v["rust_lines"] for v in per_crate.values()),
        "farmap_cli_lines": per_crate[cli.name]["rust_lines"] if cli else None,
        "farmap_cli_src_non_test_lines": per_crate[cli.name]["src_non_test_lines"] if cli else None,
        "lacking_forbid_unsafe_code": lacking,
    }


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _cycle_text(x):
    if x["cycle_covers_all"]:
        return " -> ".join(x["cycle"])
    return "{%s}; e.g. %s" % (", ".join(x["members"]), " -> ".join(x["cycle"]))


def human(report, out):
    w = out.write
    arrows = report["crate_arrows"]
    w("== 1. Crate arrows (normal dependencies) ==\n")
    for a in arrows["errors"]:
        w("ERROR %-6s %s\n" % ("up" if a["kind"] == "up" else "test", a["text"]))
    for a in arrows["same_layer"]:
        w("info  same-layer %s\n" % a["text"])
    for a in arrows["info"]:
        w("info  %s %s\n" % (a["kind"], a["text"]))
    for msg in arrows["warnings"]:
        w("warn  %s\n" % msg)
    w("%d error(s), %d same-layer, %d other info\n\n" % (
        len(arrows["errors"]), len(arrows["same_layer"]), len(arrows["info"])))

    w("== 2. File import cycles (non-test code; edges to the crate root ignored) ==\n")
    cyc = report["file_cycles"]
    for name, r in cyc.items():
        n_allowed = sum(1 for x in r["cycles"] if x["allowed"])
        w("%-20s files %3d  edges %4d  cycles %d%s\n" % (
            name, r["files"], r["edges"], len(r["cycles"]),
            " (%d allowed)" % n_allowed if n_allowed else ""))
    w("\n")
    for name, r in cyc.items():
        for x in r["cycles"]:
            tag = "allowed" if x["allowed"] else "ERROR"
            w("%-7s %s: %s\n" % (tag, name, _cycle_text(x)))
            for s in x["contains_allowed"]:
                w("          (contains the allowed {%s}, but is larger)\n" % ", ".join(s))
            for e in x["edges"]:
                more = " (+%d more)" % (e["count"] - 1) if e["count"] > 1 else ""
                w("          %s -> %s  at %s%s\n" % (e["from"], e["to"], e["at"], more))
    cross = [(name, x) for name, r in cyc.items() for x in r["cycles_without_parent_child_edges"]]
    if cross:
        w("\nCycles left without parent<->child edges (`super::`, a parent using its children):\n")
        for name, x in cross:
            w("        %s: %s\n" % (name, _cycle_text(x)))
    for name, r in cyc.items():
        for f in r["orphan_files"]:
            w("info    %s: %s is not declared by any `mod` (or only under #[path])\n" % (name, f))
    w("\n")

    w("== 3. Functions over %d lines (test code excluded) ==\n" % MAX_FN_LINES)
    for f in report["long_functions"]:
        w("%s:%d %s %d\n" % (f["file"], f["line"], f["name"], f["lines"]))
    w("%d function(s)\n\n" % len(report["long_functions"]))
    w("== 3b. Files over %d lines (lines outside #[cfg(test)] items; total in brackets) ==\n"
      % MAX_FILE_LINES)
    for f in report["long_files"]:
        w("%s %d [%d]\n" % (f["file"], f["lines"], f["total_lines"]))
    w("%d file(s)\n\n" % len(report["long_files"]))

    fig = report["figures"]
    w("== 4. Figures ==\n")
    w("%-20s %-10s %7s %7s %8s %7s %6s %s\n" % (
        "crate", "layer", "all.rs", "src", "src-test", "unsafe", "(test)", "forbid(unsafe_code)"))
    for name, v in fig["per_crate"].items():
        forbid = ", ".join("%s:%s" % (k, "yes" if r["forbid_unsafe_code"] else "NO")
                           for k, r in v["roots"].items()) or "-"
        u = v["unsafe"]
        w("%-20s %-10s %7d %7d %8d %7s %6d %s\n" % (
            name, v["layer"], v["rust_lines"], v["src_lines"], v["src_non_test_lines"],
            "%d" % u["total"], v["unsafe_in_test_code"], forbid))
    w("all.rs = every .rs file in the crate folder (src, tests, examples, build.rs);\n"
      "src-test = src/ without #[cfg(test)] items and test files;\n"
      "unsafe = `unsafe {` + `unsafe fn` + `unsafe impl` in non-test code; (test) = in test code\n")
    w("total Rust lines: %d\n" % fig["total_rust_lines"])
    w("crates/app/farmap-cli: %s lines (%s in src/ outside tests)\n" % (
        fig["farmap_cli_lines"], fig["farmap_cli_src_non_test_lines"]))
    w("unsafe by kind and file (non-test code):\n")
    for name, v in fig["per_crate"].items():
        if v["unsafe"]["total"]:
            u = v["unsafe"]
            w("  %s: %d blocks, %d fns, %d impls: %s\n" % (
                name, u["block"], u["fn"], u["impl"],
                ", ".join("%s %d" % (os.path.basename(f), n) for f, n in v["unsafe_by_file"].items())))
    w("lacking #![forbid(unsafe_code)]:\n")
    for l in fig["lacking_forbid_unsafe_code"]:
        extra = ""
        if l["modules_with_forbid"]:
            extra = "; %d of %d modules carry #[forbid(unsafe_code)], not: %s" % (
                len(l["modules_with_forbid"]), l["modules"], ", ".join(l["modules_without_forbid"]))
        if l["deny_unsafe_code"]:
            extra += "; has #![deny(unsafe_code)]"
        w("  %s (%s)%s\n" % (l["crate"], l["file"], extra))
    w("\n")

    s = report["summary"]
    w("== Summary ==\n")
    w("crate arrow errors: %d; cycles not allowed: %d; allowed cycles: %d; "
      "long functions: %d; long files: %d\n" % (
          s["arrow_errors"], s["cycles_not_allowed"], s["cycles_allowed"],
          s["long_functions"], s["long_files"]))
    w("%s\n" % ("OK" if s["ok"] else "FAILED (exit 1 with --check)"))


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.dirname(here),
                   help="workspace root (default: the parent of scripts/)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check", action="store_true",
                   help="exit 1 on crate-arrow errors or cycles not in ALLOWED_CYCLES")
    args = p.parse_args(argv)
    root = os.path.abspath(args.root)

    crates = discover(root)
    arrows = check_arrows(root, crates)
    cycles = check_cycles(root, crates)
    long_fns, long_files = check_long(root, crates)
    figs = figures(root, crates)

    all_cycles = [x for r in cycles.values() for x in r["cycles"]]
    bad = [x for x in all_cycles if not x["allowed"]]
    summary = {
        "arrow_errors": len(arrows["errors"]),
        "cycles_not_allowed": len(bad),
        "cycles_allowed": len(all_cycles) - len(bad),
        "long_functions": len(long_fns),
        "long_files": len(long_files),
        "ok": not arrows["errors"] and not bad,
    }
    report = {
        "root": root,
        "layers": dict(LAYERS, testkit=None),
        "crates": {c.name: {"folder": c.folder, "layer": c.layer_name, "level": c.layer}
                   for c in crates},
        "allowed_cycles": {k: sorted(sorted(s) for s in v) for k, v in ALLOWED_CYCLES.items()},
        "crate_arrows": arrows,
        "file_cycles": cycles,
        "long_functions": long_fns,
        "long_files": long_files,
        "limits": {"max_fn_lines": MAX_FN_LINES, "max_file_lines": MAX_FILE_LINES},
        "figures": figs,
        "summary": summary,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=1, sort_keys=False)
        sys.stdout.write("\n")
    else:
        human(report, sys.stdout)
    if args.check and not summary["ok"]:
        return 1
    return 0


# LIMITATIONS (known):
# - Paths are found lexically: a `use` brought in by a macro, a glob re-export chain
#   (`crate::Foo` where lib.rs re-exports `region::Foo`) or a path split by a macro is not
#   seen; references through the crate root (`crate::Foo`) are ignored by design.
# - `$crate::x` in macro_rules bodies is not counted (the expansion site depends on x).
# - `x::Y` counts as a use of child module x only when the file declares `mod x;`; an
#   enum/type/extern crate with the same name as a child module would be misread.
# - Any item under #[cfg(test)] is test code (not only `mod tests`), including
#   `#[cfg(test)] pub(crate) mod test_support`; #[cfg(any(test, ...))] is not.
# - `#[path = "..."] mod x;` is not followed (module paths come from file paths).
# - Function length counts from the line of `fn name` to the closing brace, so a
#   function's doc comment and attributes are not counted; nested fns are counted twice
#   (once on their own, once inside the outer fn).

if __name__ == "__main__":
    sys.exit(main())
