"""The typed run object all the way down (issue 45, item 3): after :meth:`kvbench.spec.RunSpec.from_config`
nothing reads the run's plain config again. Run ids, folders, resume, the logger and the samples'
cache key take the typed objects; the plain config is hashed once (the run id) and written in the
forms :class:`kvbench.spec.RunRecord` made at the entry, byte for byte as before.

Two checks:

- **Source** (:mod:`ast`, nothing imported): the modules a run goes through after its spec is built
  read no key out of a plain config, reach no plain config through the spec, and convert no config
  node, outside the functions listed in :data:`ENTRIES` (the spec's construction, the run id's hash,
  and the plain-node entries that scripts call).
- **Behaviour**: the run id, the folder and the ``config.json`` bytes of points of committed
  experiment nodes, and of one executed run, are the ones pinned below (recorded with the code from
  before the spec carried its record); a run whose spec's plain config refuses every read still
  runs and resumes.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import gzip
import hashlib
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench import run as run_module
from kvbench.config import to_plain
from kvbench.models import model_node
from kvbench.paths import CONF_DIR
from kvbench.results import RunFolder, _clean
from kvbench.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]

# The modules a run passes through once its spec is built (kvbench/spec.py for the spec's own
# accessors: everything it does at construction is listed in ENTRIES).
BELOW_THE_ENTRY = (
    "kvbench/run.py",
    "kvbench/logger.py",
    "kvbench/results.py",
    "kvbench/builder.py",
    "kvbench/generate.py",
    "kvbench/spec.py",
)

# (module, qualified function or class) where reading a plain config is the point, each with why.
ENTRIES = {
    # the entry: the one conversion and validation of the run's config, and the forms it writes
    ("kvbench/spec.py", "RunSpec.from_config"): "builds the spec from the config",
    ("kvbench/spec.py", "RunRecord.of"): "makes the written forms once, at the entry",
    ("kvbench/spec.py", "RunConfig.__post_init__"): "validates the run's own nodes at the entry",
    ("kvbench/spec.py", "run_config"): "the plain config without a run (kvbench.reproduce)",
    ("kvbench/spec.py", "_filled"): "the run's bits into the method node, at the entry",
    ("kvbench/spec.py", "bits_ignored"): "a warning made from the config as given, at the entry",
    # the hash: the run id of a plain config (at the entry, and for kvbench.reproduce)
    ("kvbench/results.py", "canonical_config"): "what the run id hashes",
    ("kvbench/results.py", "_declaring_config"): "the class that declares a node, for the hash",
    ("kvbench/results.py", "_packs_base_l"): "the hash of a node without its built config",
    ("kvbench/results.py", "analysis_plan"): "validates the analysis node at the entry",
    # entries of their own, for a script's plain node (a run passes typed objects)
    ("kvbench/logger.py", "log_run"): "a script's plain config (a run passes its spec)",
    ("kvbench/logger.py", "experiment_group"): "the group of a script's plain config",
    ("kvbench/logger.py", "build_logger"): "a logger node (kvbench.report --wandb)",
    ("kvbench/builder.py", "model_config"): "a model node or name (scripts, lm-eval)",
    ("kvbench/builder.py", "build_runner"): "a method node (scripts)",
}
# Where a plain config may be reached through a spec or a plan (``spec.config``-like reads are
# allowed nowhere else, not even in ENTRIES: a function that takes a spec takes its typed objects).
THROUGH_SPEC = {
    ("kvbench/run.py", "RunPlan"): "RunPlan.config: the hashed plain config, for readers outside the run",
}

# What holds a plain config, by name: a receiver ending in one of these is a plain dict.
PLAIN_NAMES = ("config", "cfg", "node", "config_json", "method_config", "logged", "record")
# Objects through which a plain config is reached: ``spec.config``, ``plan.config``, ``record.config``.
SPEC_NAMES = {"spec", "plan", "record", "run"}
# Calls that convert or validate a config node (each belongs at the entry).
CONVERSIONS = {
    "to_plain",
    "build_config",
    "run_config",
    "with_run_bits",
    "build_method",
    "build_task",
    "analysis_plan",
    "to_container",
    "create",
    "select",
}
READS = {"get", "items", "keys", "values", "pop", "setdefault"}


def _name(node: ast.AST) -> str | None:
    """The last name of ``a.b.c`` or ``c`` (None for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _chain(node: ast.AST) -> list[str]:
    """Every name of an attribute chain, outermost last: ``spec.record.config`` -> spec, record, config."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _plain(node: ast.AST) -> bool:
    """Whether ``node`` names a plain config: its last name ends in one of :data:`PLAIN_NAMES`, or it
    is reached through a record."""
    name = _name(node)
    if name is None:
        return False
    return name.lower().endswith(PLAIN_NAMES) or "record" in _chain(node)[:-1]


def raw_reads(source: str) -> list[tuple[str, int, str, bool]]:
    """``(enclosing function or class, line, what, through a spec)`` for each read of a plain config
    in ``source``: a key read, an iteration or an unpacking of a plain config, a config node
    converted, and (``through a spec`` True) a plain config reached through a spec, a plan or a
    record (``spec.config``)."""
    found: list[tuple[str, int, str, bool]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        where = ".".join(scope) or "<module>"
        what, through = None, False
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _plain(node.value):
            what = f"{ast.unparse(node.value)}[...]"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in READS and _plain(node.func.value):
                what = f"{ast.unparse(node.func)}(...)"
            elif node.func.attr in CONVERSIONS and _name(node.func.value) in ("OmegaConf", "config_module"):
                what = f"{ast.unparse(node.func)}(...)"
        elif (
            isinstance(node, ast.Call) and _name(node.func) in CONVERSIONS and isinstance(node.func, ast.Name)
        ):
            what = f"{node.func.id}(...)"
        elif isinstance(node, ast.Attribute) and node.attr == "config" and _name(node.value) in SPEC_NAMES:
            what, through = ast.unparse(node), True
        elif isinstance(node, ast.Dict):
            what = next(
                (
                    f"**{ast.unparse(v)}"
                    for k, v in zip(node.keys, node.values, strict=True)
                    if k is None and _plain(v)
                ),
                None,
            )
        elif isinstance(node, ast.comprehension) and isinstance(node.iter, ast.Name) and _plain(node.iter):
            what = f"for ... in {node.iter.id}"
        if what is not None:
            found.append((where, node.lineno, what, through))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def _allowed(module: str, where: str, through: bool) -> bool:
    allowed = THROUGH_SPEC if through else ENTRIES
    return any(m == module and (where == q or where.startswith(q + ".")) for m, q in allowed)


def reads_below_the_entry(sources: dict[str, str]) -> list[str]:
    """``module:line (function): what`` for each read :func:`raw_reads` finds outside the allowed places."""
    return [
        f"{module}:{line} ({where}): {what}"
        for module, source in sources.items()
        for where, line, what, through in raw_reads(source)
        if not _allowed(module, where, through)
    ]


def test_nothing_below_the_entry_reads_the_plain_config():
    reads = reads_below_the_entry({m: (ROOT / m).read_text() for m in BELOW_THE_ENTRY})
    assert reads == [], "read after the spec is built; take the spec's typed objects:\n" + "\n".join(reads)


def test_every_listed_entry_exists():
    # a listed function that was renamed or removed must leave the list, so the list stays short
    for module, qualified in [*ENTRIES, *THROUGH_SPEC]:
        tree = ast.parse((ROOT / module).read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                names.update(
                    f"{node.name}.{f.name}"
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.ClassDef))
                )
        names.update(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
        assert qualified in names, (module, qualified)


@pytest.mark.parametrize(
    "snippet, what",
    [
        # the reads this check was written against (kvbench/run.py and kvbench/logger.py before it)
        ('key = canonical_json([spec.config.get("task"), spec.config.get("model")])', "spec.config"),
        ("config, run_cfg = spec.config, spec.run", "spec.config"),
        ('folder.write_config({**config, "run_id": rid})', "**config"),
        ('m = {"method_config": config.get("method") or {"name": "fp16"}}', "config.get(...)"),
        ("cfg, config, group = run.logger, run.config, run.experiment_group", "run.config"),
        ('logger.start({k: v for k, v in config.items() if k != "logger"})', "config.items(...)"),
        # and reads of what the record holds, or a node converted again
        ('task = spec.record.config_json["task"]', "spec.record.config_json[...]"),
        ('model = build_config(ModelConfig, node, "model")', "build_config(...)"),
        ("node = OmegaConf.to_container(cfg)", "OmegaConf.to_container(...)"),
    ],
)
def test_the_check_finds_a_read(snippet, what):
    source = (
        f"def _execute_in(spec, plan, folder, run, rid, logger, ModelConfig, node, cfg):\n    {snippet}\n"
    )
    assert what in [w for _, _, w, _ in raw_reads(source)]
    assert reads_below_the_entry({"kvbench/run.py": source}) != []


def test_a_spec_read_is_found_in_an_entry_too():
    # log_run reads a script's plain config; the spec it is given it reads through typed objects
    # only, as kvbench/logger.py did not before this check
    source = (
        "def log_run(run, metrics):\n"
        "    if isinstance(run, Mapping):\n"
        "        cfg = build_config(LoggerConfig, dict(run.get('logger') or {}), 'logger')\n"
        "    else:\n"
        "        cfg, config, group = run.logger, run.config, run.experiment_group\n"
    )
    assert reads_below_the_entry({"kvbench/logger.py": source}) == [
        "kvbench/logger.py:5 (log_run): run.config"
    ]


def test_the_check_passes_typed_reads():
    source = (
        "def _execute_in(spec, folder):\n"
        "    folder.write_config(spec.record.config_json)\n"
        "    m = {'method_config': spec.record.method_config, 'bits': spec.method.config.bits}\n"
        "    return spec.run.output.resume, spec.model.name, spec.task.registered_name, spec.logger.name\n"
    )
    assert raw_reads(source) == []


# -- behaviour: the same ids, folders and bytes as before ------------------------------------------

# Points of committed experiment nodes with ``data.root=data``: the run id, the folder under the
# node's output root and the sha256 of the config.json bytes each had before the spec carried its
# record (every run id is one of the node's committed archive, results/<node>/samples.csv.gz).
NODE_POINTS = [
    (
        "semkv_cliff",
        {"+method": "uniform", "bits": "1.585", "seed": "1"},
        "niah/smollm2-135m/uniform-1.585b/seed1-8d07818d2b07",
        "0eb93a19dd74f408fbdca0fa8032d63194294e1b95261f8eaa07b8a9f376efbc",
    ),
    (
        "semkv_cliff",
        {"+method": "fp16", "bits": "4", "seed": "0"},
        "niah/smollm2-135m/fp16/seed0-620c0b167210",
        "51bbfd94ef2132d7f83a4ab3e5527eaaad55f64c4dd90f71111e40a85f3bd82c",
    ),
    (
        "kivi_axis_ablation",
        {"+experiment/arms/kivi_axis_ablation@method": "k_token_v_channel", "bits": "2", "seed": "0"},
        "perplexity/smollm2-135m/uniform-2b/seed0-10027a2be6c1",
        "74d283d856daea9cddb4ddedd8b24678d2faa373fe34c6009c3129a9cd8afc30",
    ),
    (
        "attention_probe",
        {"+experiment/arms/attention_probe@method": "kivi2", "seed": "0"},
        "attention_probe/smollm2-135m/kivi-2b/seed0-322d2511a96b",
        "8559527017324aa5eaf6cb0194cceaf88914a18acf75759cd89fe083a9db4f79",
    ),
    (
        "specache_niah",
        {"+experiment/arms/specache_niah@method": "specache_1b", "seed": "0"},
        "niah/smollm2-135m/specache-1b-k64/seed0-c41c39d36145",
        "9993051e3ce6c28332fbd4abea96def272cc3990ee2ccdb3d45026d4f372c8a4",
    ),
    (
        "readkv_read_budget",
        {"+method": "readkv", "bits": "2", "seed": "0"},
        "perplexity/smollm2-135m/readkv-2of8b/seed0-4df93f1e9801",
        "19d260e8ed0ba0b01f8315b1ee63a6f184c85c8eb04e24d827de0ab02efc6ebe",
    ),
    (
        "kvquant_ablation",
        {"+experiment/arms/kvquant_ablation@method": "kvquant_full", "bits": "3", "seed": "0"},
        "perplexity/smollm2-135m/kvquant-nuq3b-o0.01-sink1/seed0-5f387d9cd4e1",
        "fecd00c477869e53b6d016142ec3c63c7d7d0697c7e3ebd1ef433b73446086a8",
    ),
    (
        "ott_vs_kivi",
        {"+experiment/arms/ott_vs_kivi@method": "ott", "bits": "2", "seed": "0"},
        "niah/smollm2-135m/ott-2b/seed0-748dfaf44669",
        "28a9f5cfde320f5db3cb52f2093a6a1d3ba59e34ea47e2bc4c6e2b1b02f1e8df",
    ),
    (
        "kivi_gsm8k",
        {"+method": "kivi", "bits": "2", "seed": "0"},
        "gsm8k/smollm2-135m/kivi-2b/seed0-d9ff2d7531d5",
        "712cfca52c8cd26e103485bb8efd23902c0fd22996cba525129118836f8feee1",
    ),
]


def _config_json_bytes(spec: RunSpec) -> bytes:
    """``config.json`` as the run writes it (:func:`kvbench.results.write_json_atomic`)."""
    return (
        json.dumps(_clean(spec.record.config_json), indent=2, sort_keys=True, default=str) + "\n"
    ).encode()


def _compose(node: str, point: dict[str, str]) -> dict:
    overrides = [f"+experiment={node}", "data.root=data", *(f"{k}={v}" for k, v in point.items())]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_plain(compose("config", overrides=overrides))


@pytest.fixture
def in_tmp(tmp_path, data_root, monkeypatch):
    """A working directory with ``data`` (the test data root) in it: relative output and data roots,
    so that config.json is the same bytes on every machine."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(data_root, target_is_directory=True)
    return tmp_path


def _archived_run_ids(node: str) -> set[str]:
    with gzip.open(ROOT / "results" / node / "samples.csv.gz", "rt", newline="") as f:
        return {row["run_id:str"] for row in csv.DictReader(f)}


@pytest.mark.parametrize(
    "node, point, folder, digest", NODE_POINTS, ids=lambda v: v if isinstance(v, str) else None
)
def test_node_points_keep_their_run_id_folder_and_config_json(node, point, folder, digest, in_tmp):
    cfg = _compose(node, point)
    spec = RunSpec.from_config(cfg)
    assert spec.folder == Path(cfg["output"]["root"]) / folder
    assert spec.run_id == folder.rpartition("-")[2]
    assert spec.run_id in _archived_run_ids(node)
    assert hashlib.sha256(_config_json_bytes(spec)).hexdigest() == digest
    # the forms the run writes are the plain config's, made once
    record = spec.record
    assert record.config_json == {**record.config, "run_id": spec.run_id}
    assert record.method_config == (record.config.get("method") or {"name": "fp16"})
    assert record.logged == {k: v for k, v in record.config.items() if k != "logger"}


class Sealed(dict):
    """A plain config that refuses every read: what the run writes was made from it at the entry."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("the plain config was read below the entry")

    __getitem__ = get = items = keys = values = __iter__ = __contains__ = __len__ = copy = _refuse
    pop = setdefault = __eq__ = __ne__ = __repr__ = _refuse
    __hash__ = None


# The one-sample run below, as the code before the spec carried its record wrote it.
RUN_FOLDER = "runs/niah/smollm2-135m/kivi-2b/seed0-27299d595cf4"
RUN_CONFIG_JSON = "046af5b5762e9ee82137e49ab8e5fd4155ef6a8c7c43d45d0e8a6ed3637725d6"


def test_a_run_reads_nothing_back_and_writes_the_same_bytes(in_tmp):
    cfg = {
        "model": model_node("smollm2-135m"),
        "task": {"name": "niah", "context_lengths": [256], "depths": [50], "max_new_tokens": 2},
        "method": {"name": "kivi", "group_size": 32, "residual": 64},
        "seed": 0,
        "bits": 2,
        "device": "cpu",
        "output": {"root": "runs", "resume": True},
        "data": {"root": "data"},
    }
    spec = RunSpec.from_config(cfg)
    plain = spec.record.config
    sealed = dataclasses.replace(spec, record=dataclasses.replace(spec.record, config=Sealed(plain)))
    for read in (lambda c: c.get("task"), lambda c: {**c}, lambda c: c["method"], lambda c: list(c)):
        with pytest.raises(AssertionError, match="read below the entry"):
            read(sealed.record.config)

    checked: dict = {}
    run_module.plan_run(sealed, checked)
    assert len(checked) == 1 and run_module.plan_run(sealed, checked).samples == next(iter(checked.values()))
    metrics = run_module.execute(sealed, progress=False)
    folder = Path(metrics["folder"])
    assert folder == Path(RUN_FOLDER) and metrics["run_id"] == spec.run_id == RUN_FOLDER.rpartition("-")[2]
    written = (folder / "config.json").read_bytes()
    assert written == _config_json_bytes(spec)
    assert hashlib.sha256(written).hexdigest() == RUN_CONFIG_JSON
    assert json.loads(written) == {**plain, "run_id": spec.run_id}
    stored = json.loads((folder / "metrics.json").read_text())
    assert stored["method_config"] == {"name": "kivi", "group_size": 32, "residual": 64, "bits": 2}
    assert [r["sample_id"] for r in RunFolder(folder).rows()] == [s["id"] for s in spec.task.samples()]

    # the same spec again: the finished run is read back (resume, metrics, logger), nothing rerun
    again = run_module.execute(sealed, progress=False)
    assert again["run_id"] == spec.run_id and again["timings"] == stored["timings"]
    assert (folder / "config.json").read_bytes() == written
