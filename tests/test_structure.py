"""The tree's shape, checked from its sources (no imports run): no import circle between the
library's modules, lazy (function-level) and TYPE_CHECKING imports included, and no library file
(Python or the kernels' C) over MAX_LINES lines."""

from __future__ import annotations

import ast
import os

from helpers.procs import ROOT

PACKAGES = ("storage", "mpress", "semoe", "inference", "tools")
MAX_LINES = 650


def _modules() -> dict[str, str]:
    """module name -> path, for every .py file of the library's packages"""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The library modules `path` imports anywhere in it (top level, functions, TYPE_CHECKING)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_library_lazy_imports_included():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    assert _cycles(graph) == []


def test_no_library_file_over_the_line_limit():
    """Python and the kernels' C alike."""
    files = [os.path.join(d, f) for pkg in PACKAGES for d, _, fs in os.walk(os.path.join(ROOT, pkg)) for f in fs
             if f.endswith((".py", ".c", ".h"))]
    assert len(files) > 80
    long = {os.path.relpath(p, ROOT): n for p in files if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert long == {}
