"""kvbench's import graph: no circles, nothing pointing up, few floors (issue 45).

The graph is read from the source with :mod:`ast` (nothing is imported). It counts every
``import``/``from ... import`` statement that names kvbench, wherever it stands: at module level,
under ``if TYPE_CHECKING:``, and inside functions and methods. A function-level import is still a
dependency (it only runs later), and the circles this test was written against went through
function-level imports. Dynamic imports (``importlib.import_module``: the method and task registries
loading their own package, ``compile_check`` loading the kernel it compiles, a task's declared
figure) are not seen.

Two granularities:

- **modules**: every ``.py`` file under ``kvbench/`` and ``scripts/`` (a package's ``__init__.py``
  is the package). No import circle among them.
- **units**: the top-level modules and subpackages of ``kvbench/`` (``kvbench/cache/`` is one unit,
  ``kvbench/run.py`` another), the root package ``kvbench/__init__.py`` (unit ``kvbench``), plus
  ``scripts/`` as one unit on top. Every unit stands on one floor of :data:`FLOORS`; a unit imports
  only from its own floor or below, with no circle inside a floor. The levels (the longest chain of
  imports from ``scripts/`` or ``kvbench/report/`` down to ``errors.py``, both ends counted) are at
  most :data:`MAX_LEVELS`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvbench"

# The floors, top to bottom, in the order of DESIGN's layer picture (__main__ > run > tasks > generate >
# methods > cache > quant, kernels > stats, analysis), with the modules the picture leaves out put
# where their imports say they belong. Two places where the code and the picture disagree follow the
# code: kernels import their quant references, so kernels stand above quant; analysis reads stored
# runs through results and tasks and tests through stats, so it stands above them, under the entries.
# Written down once: everything below reads it. A unit imports from its own floor or any floor below
# it, never from a floor above, and there is no circle inside a floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("scripts",),  # setup, benchmarks, figure regeneration, the device check
    # the entries: the report, the reproduction, the Hydra entry, and the package itself
    # (kvbench/__init__.py exports the Python API of kvbench/api.py)
    ("report", "reproduce", "__main__", PACKAGE),
    ("cli",),  # what the entries call before Hydra runs: the chosen config nodes, Hydra composition
    ("analysis",),  # stored runs into pandas, paper tables, claims, figures
    ("launchers",),  # Hydra launchers (submitit) around runs
    ("run", "api"),  # one run: load, build, execute, write; a method's cache in the user's own code
    ("lmeval",),  # the lm-eval entry: the model lm-eval builds from model_args, kvbench-lm-eval
    ("logger",),  # wandb or nothing, fed the run's spec and metrics
    ("spec", "builder"),  # the typed run object from a config; model and method builders
    ("results", "node_plan", "sweep"),  # run folders and rows; a node's jobs and cost; a sweep's folder
    ("tasks",),  # one file per task
    ("lmeval_adapter",),  # lm-eval's model API over a runner built already (task=lmeval, the entry)
    ("generate",),  # the decode loop tasks share
    ("methods",),  # one file per method
    ("models",),  # model configs, files and loaders
    ("cache",),  # per-layer storage, attention hook, byte accounting
    ("kernels",),  # compiled CPU and Triton kernels beside their torch references
    ("quant",),  # quantizer math in plain torch
    ("stats",),  # paired tests, bootstrap, cliffs
    ("registry", "data", "objective"),  # name registries, data roots, the sweep objective
    ("config", "env", "paths", "atomic"),  # config building, environment, safe paths, atomic writes
    ("errors", "version"),  # the error types; the package's version
)
MAX_LEVELS = 12

# Upward imports not fixed yet, each with the issue item that removes it. The test fails when one of
# these is gone (delete its line) as well as when a new one appears. None is left (issue 45 items 2
# and 4 removed the last two).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package and of ``scripts/``."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in sorted((ROOT / "scripts").glob("*.py")):
        found[f"scripts.{path.stem}"] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` lands in: itself, or the longest module prefix (``kvbench.cache.X``
    where ``X`` is a class of ``kvbench/cache/__init__.py`` lands in ``kvbench.cache``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


@cache
def module_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> where: ``path:line`` of every import statement between two modules."""
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    continue
                imported = _resolve(target, modules)
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if imported is not None and imported != name and where not in edges[name, imported]:
                    edges[name, imported].append(where)
    return dict(edges)


def unit(module: str) -> str:
    """The unit a module belongs to: ``kvbench.cache.layer`` -> ``cache``, ``kvbench`` -> ``kvbench``,
    ``scripts.gpu_check`` -> ``scripts``."""
    parts = module.split(".")
    if parts[0] == "scripts":
        return "scripts"
    return parts[1] if len(parts) > 1 else PACKAGE


def unit_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (a, b), where in module_edges().items():
        if unit(a) != unit(b):
            edges[unit(a), unit(b)].extend(where)
    return dict(edges)


def floor_of() -> dict[str, int]:
    """Unit -> floor index (0 is the top)."""
    return {name: i for i, floor in enumerate(FLOORS) for name in floor}


def cycles(edges) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted({x for edge in edges for x in edge}):
        if v not in index:
            visit(v)
    return found


def describe(edges: dict[tuple[str, str], list[str]], only=None) -> list[str]:
    """One line per edge (of those ``only`` keeps): importer -> imported, then where (at most 4)."""
    lines = []
    for (a, b), where in sorted(edges.items()):
        if only is None or only(a, b):
            more = f", +{len(where) - 4} more" if len(where) > 4 else ""
            lines.append(f"  {a} -> {b}  ({', '.join(where[:4])}{more})")
    return lines


def chain(edges, start: str, end: str) -> list[str]:
    """A longest chain of imports from ``start`` down to ``end`` (empty when none reaches it); the
    graph must have no circle."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)

    @cache
    def longest(v: str) -> tuple[str, ...]:
        if v == end:
            return (v,)
        best = max((longest(w) for w in sorted(graph[v])), key=len, default=())
        return (v, *best) if best else ()

    return list(longest(start))


def test_every_unit_stands_on_one_floor():
    named = [name for floor in FLOORS for name in floor]
    assert len(named) == len(set(named)), "a unit named on two floors"
    assert not {unit(m) for m in _modules()} - set(named), "units on no floor: add them to FLOORS"
    assert FLOORS[-1] == ("errors", "version") and {"report", "reproduce", "__main__"} <= set(FLOORS[1])


def _circles(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    lines = []
    for component in cycles(edges):
        lines += ["circle:", *describe(edges, lambda a, b, c=frozenset(component): {a, b} <= c)]
    return lines


def test_no_circle_between_modules():
    """Every ``.py`` file: no circle, leaving out the imports :data:`KNOWN_UPWARD` lists."""
    edges = {(a, b): w for (a, b), w in module_edges().items() if (unit(a), unit(b)) not in KNOWN_UPWARD}
    found = _circles(edges)
    assert not found, "import circles between modules:\n" + "\n".join(found)


def test_no_circle_between_units():
    edges = {edge: where for edge, where in unit_edges().items() if edge not in KNOWN_UPWARD}
    found = _circles(edges)
    assert not found, "import circles between packages and top-level modules:\n" + "\n".join(found)


def test_nothing_imports_from_a_higher_floor():
    floor = floor_of()
    # a unit on no floor is reported by test_every_unit_stands_on_one_floor
    placed = {edge: where for edge, where in unit_edges().items() if set(edge) <= set(floor)}
    upward = {(a, b): where for (a, b), where in placed.items() if floor[a] > floor[b]}
    new = describe(upward, lambda a, b: (a, b) not in KNOWN_UPWARD)
    gone = [f"  {a} -> {b}" for a, b in sorted(set(KNOWN_UPWARD) - set(upward))]
    assert not new, "imports from a higher floor (see FLOORS):\n" + "\n".join(new)
    assert not gone, "no longer imported, delete from KNOWN_UPWARD:\n" + "\n".join(gone)


def test_at_most_twelve_levels_from_the_top_down_to_errors():
    edges = {edge for edge in unit_edges() if edge not in KNOWN_UPWARD}
    assert not cycles(edges), "circles between units (test_no_circle_between_units)"
    for top in ("scripts", "report"):
        longest = chain(edges, top, "errors")
        assert longest, f"{top} does not reach errors.py"
        assert len(longest) <= MAX_LEVELS, (
            f"{len(longest)} levels from {top} down to errors (at most {MAX_LEVELS}): " + " -> ".join(longest)
        )
