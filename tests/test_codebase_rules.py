"""The layout rules of issue 37, read from the source (no imports of the code, no jax): no private name reached
across modules, no import arrow from tbe_jax up to tt_jax or examples, no import cycle inside a kernels package or
through one, no library file over 600 lines, a README of at most 16 KB, no `sys.path` edits."""

from __future__ import annotations

import ast
import collections
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ("tbe_jax", "tt_jax", "examples", "benchmarks")
LIBRARY = ("tbe_jax", "tt_jax")
# NamedTuple's own methods are public API despite the underscore.
NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(packages=PROJECT) -> dict[str, pathlib.Path]:
    out = {}
    for pkg in packages:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imported(mod: str, path: pathlib.Path, node) -> list[str]:
    """Dotted names an import statement names (`from a.b import c` -> `a.b.c`), relative imports resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    return [f"{src}.{a.name}" for a in node.names]


def _defined(tree) -> set[str]:
    """Every name a module binds or names as a string (attributes set through `object.__setattr__` included)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name.split(".")[-1])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)
    return out


def private_reaches() -> list[str]:
    """`from <project module> import _x`, `module._x` of an imported project module, and `obj._x` (obj not
    self / cls) where `_x` is defined in another project module but not in this one."""
    mods = _modules()
    trees = {m: ast.parse(f.read_text()) for m, f in mods.items()}
    defined = {m: _defined(t) for m, t in trees.items()}
    anywhere = set().union(*defined.values())
    found = []
    for m, tree in trees.items():
        where = f"{mods[m].relative_to(ROOT)}"
        aliases = {}
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for name, alias in zip(_imported(m, mods[m], n), n.names):
                    if name.split(".")[0] not in PROJECT:
                        continue
                    if any(_private(p) for p in name.split(".")):
                        found.append(f"{where}:{n.lineno}: imports {name}")
                    aliases[alias.asname or alias.name.split(".")[0]] = name
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and _private(n.attr)) or n.attr in NAMEDTUPLE:
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in aliases:
                found.append(f"{where}:{n.lineno}: {ast.unparse(n)} ({aliases[n.value.id]})")
            elif n.attr in anywhere and n.attr not in defined[m]:
                found.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
    return found


def import_edges(packages=PROJECT) -> dict[str, dict[str, int]]:
    """Module -> project module it imports (any import, function-local ones included) -> line."""
    mods = _modules(packages)
    edges = collections.defaultdict(dict)
    for m, f in mods.items():
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for name in _imported(m, f, n):
                    while name and name not in mods:
                        name = name.rpartition(".")[0]
                    if name and name != m:
                        edges[m].setdefault(name, n.lineno)
    return edges


def cycles(edges, scope: str) -> list[list[str]]:
    """Strongly connected components (more than one module) of the modules under `scope`."""
    nodes = {a for a in edges if a.startswith(scope + ".")} | {
        b for bs in edges.values() for b in bs if b.startswith(scope + ".")}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_no_private_name_reached_across_modules():
    assert not private_reaches(), "\n".join(private_reaches())


def test_tbe_jax_imports_nothing_above_it():
    edges = import_edges()
    up = [f"{a} -> {b} (line {ln})" for a, bs in edges.items() for b, ln in bs.items()
          if (a.startswith("tbe_jax") and b.startswith(("tt_jax", "examples", "benchmarks")))
          or (a.startswith("tt_jax") and b.startswith(("examples", "benchmarks")))]
    assert not up, up


def test_no_import_cycle_in_kernel_packages():
    edges = import_edges(LIBRARY)
    for scope in ("tbe_jax.kernels", "tt_jax.kernels"):
        assert not cycles(edges, scope), (scope, cycles(edges, scope))
    # Nor one through a module outside them (`tt_jax.prefix` -> `kernels.plan` -> `kernels.tiles` -> `prefix` was).
    for scope in LIBRARY:
        through = [c for c in cycles(edges, scope) if any(".kernels." in m for m in c)]
        assert not through, (scope, through)


def test_library_files_at_most_600_lines():
    long = {str(f.relative_to(ROOT)): n for f in _modules(LIBRARY).values()
            if (n := len(f.read_text().splitlines())) > 600}
    assert not long, long


def test_readme_at_most_16_kb():
    assert os.path.getsize(ROOT / "README.md") <= 16384


def test_no_sys_path_edits():
    edits = []
    for f in _modules().values():
        for n in ast.walk(ast.parse(f.read_text())):
            if (isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
                    and n.value.id == "sys"):
                edits.append(f"{f.relative_to(ROOT)}:{n.lineno}")
    assert not edits, edits
