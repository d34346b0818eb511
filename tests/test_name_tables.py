"""No registered method or task name is written as a string outside the module that registers it.

A name known outside its class becomes a table someone must edit when a method or task is added;
the upper floors read what the registered classes declare instead (``Task.metrics``,
``Task.figures``, ``Task.planned_samples``/``sample_work``, ``MethodConfig.cost_cpu``/``cost_gpu``,
:func:`kvbench.config.inert`). Scanned: every string constant of the ``kvbench`` package and the
Hydra plugins that is not a docstring, against ``METHODS.names()`` and ``TASKS.names()``. Not
scanned, by the rule itself: each name's config node (``kvbench/conf``), tests and docs; nor
``scripts/``, command lines that choose which methods to benchmark as experiment nodes do, i.e.
configuration.

Every exception is one line of :data:`ALLOWED` with its reason; an entry no longer needed fails too,
so the list only shrinks.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from kvbench.methods import METHODS
from kvbench.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("kvbench", "hydra_plugins")

BASELINE = (
    "the FP16 baseline: what a run without a method node runs and the default reference arm of "
    "every comparison (a default value, not a look-up that a new method would extend)"
)
VARIANT_VALUE = (
    "a knob value named after the paper that introduced the variant (SpeCache's 1-bit zero point, "
    "KIVI's arithmetic, KVQuant's uniform datatype), not a method look-up"
)
HITRATE_POLICY = (
    "the pg19_hitrate task's policies (the keys of its rows' hit_rates), built from those methods "
    "by the task and drawn by its figure"
)

# (file, name): why the name is written there
ALLOWED: dict[tuple[str, str], str] = {
    ("kvbench/analysis/figures.py", "fp16"): BASELINE,
    ("kvbench/analysis/frame.py", "fp16"): BASELINE,
    ("kvbench/analysis/tables.py", "fp16"): BASELINE,
    ("kvbench/stats/comparison.py", "fp16"): BASELINE,
    ("kvbench/results.py", "fp16"): BASELINE,
    ("kvbench/spec.py", "fp16"): BASELINE,
    ("kvbench/lmeval.py", "fp16"): BASELINE,
    ("kvbench/launchers.py", "fp16"): BASELINE,
    ("kvbench/methods/base.py", "fp16"): BASELINE,
    ("kvbench/cache/quantized.py", "kivi"): VARIANT_VALUE,
    ("kvbench/cache/quantized.py", "specache"): VARIANT_VALUE,
    ("kvbench/quant/affine.py", "kivi"): VARIANT_VALUE,
    ("kvbench/quant/affine.py", "specache"): VARIANT_VALUE,
    ("kvbench/kernels/quant_pack.py", "specache"): VARIANT_VALUE,
    ("kvbench/methods/kivi.py", "specache"): VARIANT_VALUE,
    ("kvbench/methods/kvquant.py", "uniform"): VARIANT_VALUE,
    ("kvbench/methods/kvquant_calibration.py", "uniform"): VARIANT_VALUE,
    (
        "kvbench/methods/semkv.py",
        "uniform",
    ): "SemKV's base quantizer (its paper's uniform or TurboQuant codes)",
    (
        "kvbench/methods/semkv.py",
        "turboquant",
    ): "SemKV's base quantizer (its paper's uniform or TurboQuant codes)",
    ("kvbench/methods/intactkv.py", "kivi"): "IntactKV's default base, the quantizer its paper pairs it with",
    ("kvbench/tasks/pg19_hitrate.py", "fp16"): HITRATE_POLICY,
    ("kvbench/tasks/pg19_hitrate.py", "h2o"): HITRATE_POLICY,
    ("kvbench/tasks/pg19_hitrate.py", "kivi"): HITRATE_POLICY,
    ("kvbench/tasks/pg19_hitrate.py", "specache"): HITRATE_POLICY,
    ("kvbench/analysis/hitrate.py", "h2o"): HITRATE_POLICY,
    ("kvbench/analysis/hitrate.py", "specache"): HITRATE_POLICY,
    ("kvbench/analysis/niah.py", "niah"): "the NIAH heatmap keeps its own task's rows of a mixed frame",
    ("kvbench/data.py", "niah"): "a dataset folder under the data root (its download hint)",
    ("kvbench/data.py", "gsm8k"): "a dataset folder under the data root (its download hint)",
    ("kvbench/data.py", "longbench"): "a dataset folder under the data root (its download hint)",
}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _owners() -> dict[str, set[Path]]:
    owners: dict[str, set[Path]] = {}
    for registry in (METHODS, TASKS):
        for name in registry.names():
            owners.setdefault(name, set()).add(Path(inspect.getsourcefile(registry.get(name))).resolve())
    return owners


def name_literals() -> dict[tuple[str, str], list[int]]:
    """``{(file, name): [line, ...]}`` of every registered name written outside its owner."""
    owners = _owners()
    found: dict[tuple[str, str], list[int]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                    continue
                if node.value in owners and path.resolve() not in owners[node.value]:
                    key = (path.relative_to(ROOT).as_posix(), node.value)
                    found.setdefault(key, []).append(node.lineno)
    return found


def test_no_registered_name_is_written_outside_its_owner():
    found = name_literals()
    unexplained = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not unexplained, (
        "a registered name outside its own module (declare it on the class): "
        + ", ".join(f"{f}:{lines[0]} {name!r}" for (f, name), lines in sorted(unexplained.items()))
    )
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, f"allow-list entries no longer needed (remove them): {stale}"


def test_the_scan_sees_a_name_written_outside_its_owner(tmp_path, monkeypatch):
    """The scan is not vacuous: a task name written into another module is found."""
    folder = tmp_path / "kvbench"
    folder.mkdir()
    (folder / "elsewhere.py").write_text('"""A docstring may say niah."""\nif task == "niah":\n    pass\n')
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SCANNED", ("kvbench",))
    assert name_literals() == {("kvbench/elsewhere.py", "niah"): [2]}
