"""The package's import graph: no import circle, every import going down the floors below,
no module below the entry points importing them, the scheduler deciding without the runner
or the engine, at most 12 modules loose at the top, no old module path or old name left, no
file over 450 lines, and no reach into another object's private members. Every import counts, those inside
functions too: a lazy import that closes a circle is still a circle a reader has to
untangle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "impress_flexgen"
# The programs, and the old module paths that forward to them.
ENTRY = "impress_flexgen.entrypoints"
SHIMS = {f"{PACKAGE}.{m}" for m in ("run", "serve", "verify", "__main__")}
# The package's floors, top down: a top-level module or subpackage imports only from floors
# below its own. A new one must be placed here.
FLOORS = (
    ("__main__", "run", "serve", "verify"),       # the documented commands; nothing imports them
    ("entrypoints",),                             # the command lines and the OpenAI server
    ("bench", "service"),                         # workload runs; the service's request queue
    ("engine", "metrics"),                        # the engine loop; the service's counters
    ("planner", "config"),                        # load-or-recompute; every setting's record
    ("models", "frontend"),                       # weights, placement and runtime; prompts
    ("store", "request"),                         # the prefix store; a request and its stats
    ("tiers",),                                   # memory, disk and the shared pool
    ("__init__", "errors", "paths", "defaults", "cpu_threads", "progress", "sampling"),
)
MAX_TOP_LEVEL = 12
# Old module paths and old names: gone, every import uses the real one.
OLD_PATHS = ["batch_runner.py", "serving.py", "costs.py", "prefix_plan.py", "cli.py",
             "engine/batch_prefill.py", "store/shared.py", "store/readahead.py",
             "store/loads.py"]
OLD_NAMES = {"TierSizes", "PrefixPlanner"}
MAX_LINES = 450
# Files still over the limit, until they are split by concept: none may be added.
STILL_LONG: set[str] = set()


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """{module: {imported module of the package: line}} for every .py file under
    root/package, resolving relative imports and `from pkg import submodule`."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in files.items():
        base = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")[:len(base.split(".")) - node.level + 1]
                    source = ".".join(parts + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source
                           for a in node.names]
            else:
                continue
            for target in targets:
                if target == package or target.startswith(package + "."):
                    found = known(target)
                    if found and found != mod:
                        edges.setdefault(found, node.lineno)
                    # Importing a.b.c first runs the packages a.b above it, unless they
                    # already are running (the importer's own packages).
                    parent = (found or "").rpartition(".")[0]
                    while parent and parent != package:
                        if parent in files and not mod.startswith(parent + ".") and \
                                parent != mod:
                            edges.setdefault(parent, node.lineno)
                        parent = parent.rpartition(".")[0]
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _describe(graph, component) -> str:
    return "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in component
                     for b in graph[a] if b in component)


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50                    # the whole package was read
    found = cycles(graph)
    assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)


def test_nothing_below_the_entry_points_imports_them():
    top = lambda m: m == ENTRY or m.startswith(ENTRY + ".") or m in SHIMS  # noqa: E731
    wrong = [f"{mod} imports {target} (line {line})"
             for mod, edges in import_graph().items() if not top(mod)
             for target, line in edges.items() if top(target)]
    assert not wrong, wrong


def test_nothing_imports_the_documented_commands():
    """run, serve and verify are `python -m` commands only: the tests, the experiments and
    the scripts import the modules they forward to."""
    wrong = []
    for path in sorted(p for d in ("tests", "experiments", "scripts")
                       for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n in SHIMS]
    assert not wrong, wrong


def _unit(mod: str) -> str:
    """The top-level module or subpackage a module belongs to."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_goes_down_the_floors():
    floor = {unit: len(FLOORS) - i for i, units in enumerate(FLOORS) for unit in units}
    graph = import_graph()
    unplaced = {_unit(m) for m in graph} - floor.keys()
    assert not unplaced, f"place these in FLOORS: {sorted(unplaced)}"
    wrong = [f"{mod} imports {target} (line {line})" for mod, edges in graph.items()
             for target, line in edges.items()
             if _unit(mod) != _unit(target) and floor[_unit(mod)] <= floor[_unit(target)]]
    assert not wrong, wrong


def test_the_floor_check_finds_an_import_upwards(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "tiers").mkdir(parents=True)
    (pkg / "tiers" / "__init__.py").write_text("")
    (pkg / "tiers" / "x.py").write_text("from ..engine import y\n")
    (pkg / "engine.py").write_text("from .tiers import x\n")
    graph = import_graph(tmp_path)
    floor = {unit: len(FLOORS) - i for i, units in enumerate(FLOORS) for unit in units}
    upward = [(m, t) for m, edges in graph.items() for t in edges
              if _unit(m) != _unit(t) and floor[_unit(m)] <= floor[_unit(t)]]
    assert upward == [(f"{PACKAGE}.tiers.x", f"{PACKAGE}.engine")]


def test_at_most_12_modules_at_the_top_of_the_package():
    entry = {"__init__", "__main__", "run", "serve", "verify"}
    loose = sorted(p.stem for p in (ROOT / PACKAGE).glob("*.py") if p.stem not in entry)
    assert len(loose) <= MAX_TOP_LEVEL, loose


def test_no_old_module_path_or_old_name_is_left():
    assert not [p for p in OLD_PATHS if (ROOT / PACKAGE / p).exists()]
    defined = [f"{p.relative_to(ROOT)}:{node.lineno}"
               for p in (ROOT / PACKAGE).rglob("*.py")
               for node in ast.walk(ast.parse(p.read_text(), str(p)))
               if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in OLD_NAMES
               or isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and
               node.id in OLD_NAMES]
    assert not defined, defined


def test_no_file_in_the_package_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / PACKAGE).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long.keys() - STILL_LONG, long


def test_the_scheduler_imports_neither_the_runner_nor_the_engine():
    """The scheduler decides; it never runs the model nor calls back into the engine."""
    edges = import_graph()[f"{PACKAGE}.engine.scheduler"]
    assert f"{PACKAGE}.engine.runner" not in edges and f"{PACKAGE}.engine.engine" not in edges, \
        edges
    assert f"{PACKAGE}.engine.sequence" in edges      # the graph was read


# Private members of another object reached on purpose, with why.
PRIVATE_ALLOWED = {
    # The standard library's only hook that runs before non-daemon threads are joined.
    ("impress_flexgen/models/compat.py", "threading._register_atexit"),
    # torch's only way to ask how many tensors share a storage (a workspace buffer is free
    # when nothing else holds it).
    ("impress_flexgen/models/quant.py", "torch._C._storage_Use_Count"),
    ("impress_flexgen/models/quant.py", "torch._C"),
    ("impress_flexgen/models/quant.py", "t.untyped_storage()._cdata"),
}


def private_reaches(root: Path = ROOT, package: str = PACKAGE) -> list[tuple[str, str, int]]:
    """(file, expression, line) of every `x._name` in the package where x is not self or
    cls: a reach into another object's private member."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or \
                    node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((rel, ast.unparse(node), node.lineno))
    return found


def test_no_reach_into_another_objects_private_members():
    wrong = [f"{f}:{line}: {expr}" for f, expr, line in private_reaches()
             if (f, expr) not in PRIVATE_ALLOWED]
    assert not wrong, wrong


def test_the_private_check_finds_a_reach(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def f(self, b):\n        return self._x, b._y\n")
    assert private_reaches(tmp_path) == [(f"{PACKAGE}/a.py", "b._y", 3)]


def test_the_checker_finds_a_circle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("def g():\n    from impress_flexgen import a\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(tmp_path)
    # a imports sub.b, which first runs the package sub.
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.sub.b": 1, f"{PACKAGE}.sub": 1}
    assert cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.c", f"{PACKAGE}.sub.b"]]


def test_the_checker_finds_a_circle_through_a_package_init(tmp_path):
    """Importing pkg.engine.x runs pkg/engine/__init__.py first: a module that pkg.engine's
    modules import, and that imports pkg.engine.x, is in a circle with them."""
    pkg = tmp_path / PACKAGE
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("from .core import Engine\n")
    (pkg / "engine" / "core.py").write_text("from ..prefill import Job\nclass Engine: ...\n")
    (pkg / "engine" / "reads.py").write_text("class Reads: ...\n")
    (pkg / "prefill.py").write_text("from .engine.reads import Reads\nclass Job: ...\n")
    assert cycles(import_graph(tmp_path)) == [
        [f"{PACKAGE}.engine", f"{PACKAGE}.engine.core", f"{PACKAGE}.prefill"]]
