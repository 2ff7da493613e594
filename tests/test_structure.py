"""The tree's shape, checked from its sources (no imports run): no import circle between the
library's modules and no import up the layers (storage < mpress < semoe < inference < tools) or up the
rooms of semoe/ (kernels < model < checkpoints < decode < evaluation < train), lazy
(function-level) and TYPE_CHECKING imports included; no `from M import name` of a name that M does
not have, in the library, the benches and the tests; no library file (Python or the kernels' C) over
MAX_LINES lines, and no test that starts processes outside the `slow` mark."""

from __future__ import annotations

import ast
import os

from helpers.procs import ROOT

PACKAGES = ("storage", "mpress", "semoe", "inference", "tools")  # the layers, lowest first
# semoe/'s rooms, lowest first: a module imports from its own room and those below it. The package
# itself holds no module but its empty __init__.py.
SEMOE_ROOMS = ("kernels", "model", "checkpoints", "decode", "evaluation", "train")
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


def test_no_module_imports_from_a_layer_above_its_own():
    """storage < mpress < semoe < inference < tools: a module imports from its own package and those
    below it, never above (lazy imports included), so each layer can be read and tested without the
    ones above it."""
    modules = _modules()
    rank = {pkg: i for i, pkg in enumerate(PACKAGES)}
    climbs = sorted(f"{m} imports {dep}" for m, p in modules.items() for dep in _imports(p, modules)
                    if rank[dep.split(".")[0]] > rank[m.split(".")[0]])
    assert climbs == []


def _room_climbs(modules: dict[str, str], rooms: tuple[str, ...]) -> list[str]:
    """Every import in semoe/ from a room above the importer's own (lazy imports included)."""
    rank = {room: i for i, room in enumerate(rooms)}

    def room(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if parts[0] == "semoe" and len(parts) > 1 else None

    return sorted(f"{m} imports {dep}" for m, p in modules.items() if room(m) is not None
                  for dep in _imports(p, modules) if room(dep) is not None and rank[room(dep)] > rank[room(m)])


def test_semoe_is_rooms_in_order_with_no_module_outside_them():
    """kernels < model < checkpoints < decode < evaluation < train: each room of semoe/ imports from
    itself and the rooms below it, never above, so the model can be read without the trainer and
    the decode core without the checkpoint converters."""
    modules = _modules()
    semoe = [m for m in modules if m.startswith("semoe.")]
    assert sorted({m.split(".")[1] for m in semoe}) == sorted(SEMOE_ROOMS)
    loose = [m for m in semoe if m.count(".") == 1 and m.split(".")[1] not in SEMOE_ROOMS]
    assert loose == [] and open(modules["semoe"]).read().strip() == ""
    assert _room_climbs(modules, SEMOE_ROOMS) == []


def test_the_room_order_check_sees_an_upward_import(tmp_path):
    """The check above reads real imports: the same modules with one planted lazy import of the
    trainer from the model are caught, and only that one."""
    modules = _modules()
    planted = tmp_path / "routing.py"
    planted.write_text(open(modules["semoe.model.routing"]).read()
                       + "\n\ndef _planted():\n    from semoe.train.trainer import Trainer\n")
    modules["semoe.model.routing"] = str(planted)
    assert _room_climbs(modules, SEMOE_ROOMS) == ["semoe.model.routing imports semoe.train.trainer"]


def _defined_names(path: str) -> set[str] | None:
    """The names a module defines or imports at its top level (inside `if`/`try` too); None when it
    computes them at run time (a module `__getattr__` or a star import), where nothing can be said."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == "__getattr__":
                    return False
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    return False
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                blocks = [node.body, getattr(node, "orelse", [])]
                if isinstance(node, ast.Try):
                    blocks += [h.body for h in node.handlers] + [node.finalbody]
                if not all(visit(b) for b in blocks):
                    return False
        return True

    return names if visit(ast.parse(open(path).read(), path).body) else None


def _sources_that_import() -> list[str]:
    """Every Python file whose imports are checked: the library's, the benches' and the tests'."""
    out = set(_modules().values())
    for top in ("bench", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            out.update(os.path.join(dirpath, f) for f in files if f.endswith(".py"))
    return sorted(out)


def test_every_name_imported_from_a_module_of_the_tree_exists_there():
    """`from storage.host_buffers import peak_rss_bytes` after the function moved raises ImportError only when
    that line runs, which for a bench or a lazy import may be long after a change; this finds it
    from the sources. Modules of the library, the benches (which import each other by file name) and
    the tests' helpers are checked, wherever the import stands."""
    modules = _modules()
    bench = os.path.join(ROOT, "bench")
    modules.update({f[:-3]: os.path.join(bench, f) for f in os.listdir(bench) if f.endswith(".py")})
    helpers = os.path.join(ROOT, "tests", "helpers")
    modules.update({f"helpers.{f[:-3]}": os.path.join(helpers, f) for f in os.listdir(helpers) if f.endswith(".py")})
    defined = {m: _defined_names(p) for m, p in modules.items()}
    missing, checked = [], 0
    for path in _sources_that_import():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if not (isinstance(node, ast.ImportFrom) and node.module in modules and not node.level):
                continue
            have = defined[node.module]
            for a in node.names:
                checked += 1
                if have is not None and a.name not in have and f"{node.module}.{a.name}" not in modules:
                    missing.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {a.name} from {node.module}")
    assert checked > 500
    assert missing == []


def _module_level_imports(path: str) -> set[str]:
    """Every module `path` imports when it is imported: its top-level statements (inside `if`/`try`,
    outside functions, classes' methods and `if TYPE_CHECKING:`), library modules and others alike,
    with the packages above each (importing a.b runs a/__init__.py)."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(open(path).read(), path).body)
    return out | {name.rsplit(".", k)[0] for name in out for k in range(1, name.count(".") + 1)}


# What `semoe generate --lean` imports before and while decoding: the command line with every
# command's parser, the lean runner, and the size parser its handler loads
LEAN_ROOTS = ("tools.cli", "tools.demo_cmd", "tools.env_cmd", "tools.eval_cmd", "tools.generate_cmd", "tools.plan_cmd",
              "tools.serve_cmd", "tools.store_cmd", "tools.train_cmd", "tools.size_flags",
              "inference.torch_free.runner", "inference.placement")


def test_the_lean_runner_and_the_command_line_import_no_torch():
    """The torch-free runner's point is a process without torch's runtime: no module it (or the
    command line that starts it) imports at load time imports torch, directly or through another."""
    modules = _modules()
    seen, todo, via = set(), list(LEAN_ROOTS), {}
    while todo:
        m = todo.pop()
        if m in seen or m not in modules:
            continue
        seen.add(m)
        for dep in _module_level_imports(modules[m]):
            via.setdefault(dep, m)
            todo.append(dep)
    heavy = sorted(d for d in via if d.split(".")[0] in ("torch", "transformers", "tensorstore"))
    assert heavy == [], {d: via[d] for d in heavy}
    assert {"inference.torch_free.runner", "semoe.kernels.loader", "semoe.checkpoints.hf_config"} <= seen


def test_no_library_file_over_the_line_limit():
    """Python and the kernels' C alike."""
    files = [os.path.join(d, f) for pkg in PACKAGES for d, _, fs in os.walk(os.path.join(ROOT, pkg)) for f in fs
             if f.endswith((".py", ".c", ".h"))]
    assert len(files) > 80
    long = {os.path.relpath(p, ROOT): n for p in files if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert long == {}


# calls that start a process: the helpers' (ranks, a CLI run, a run killed mid-way), methods that
# do whatever their receiver (`mp.spawn`, `ctx.Process`, `subprocess.Popen`), and functions of
# `subprocess` and `os` whose names other objects use too (`Trainer(...).run()` starts nothing)
PROCESS_HELPERS = {"run_ranks", "kill_mid_run", "cli"}
PROCESS_METHODS = {"spawn", "Popen", "Process"}
PROCESS_FUNCTIONS = {"subprocess": {"run", "check_output", "check_call", "call"}, "os": {"fork", "system"}}


def _starts_processes(fn: ast.AST, starters: set[str]) -> bool:
    """Whether `fn` calls a process starter (`subprocess.run`, `mp.spawn`, a helper), or calls or
    hands out (a fixture returning `run_ranks`) a function of its module known to start one."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and n.id in starters:
            return True
        if isinstance(n, ast.Call) and isinstance(f := n.func, ast.Attribute) and (
                f.attr in PROCESS_METHODS
                or (isinstance(f.value, ast.Name) and f.attr in PROCESS_FUNCTIONS.get(f.value.id, ()))):
            return True
    return False


def _unmarked_process_tests(path: str) -> list[str]:
    tree = ast.parse(open(path).read(), path)
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
           and "slow" in ast.unparse(n.value) for n in tree.body):
        return []
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    starters = set(PROCESS_HELPERS)
    grown = True
    while grown:  # functions and fixtures of the module that start processes, through each other
        new = {name for name, fn in funcs.items() if name not in starters and _starts_processes(fn, starters)}
        starters |= new
        grown = bool(new)
    return [name for name, fn in funcs.items() if name.startswith("test_")
            and not any("slow" in ast.unparse(d) for d in fn.decorator_list)
            and (name in starters or {a.arg for a in fn.args.args} & starters)]


def test_every_test_that_starts_processes_is_marked_slow():
    """Directly, through a helper, or through a fixture of its module."""
    paths = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "tests")) for f in fs
             if f.startswith("test_") and f.endswith(".py")]
    assert len(paths) > 50
    unmarked = {os.path.relpath(p, ROOT): names for p in paths if (names := _unmarked_process_tests(p))}
    assert unmarked == {}
