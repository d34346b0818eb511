"""A task and a method added in a package of their own, registered the way the shipped ones are
(``@register_task`` / ``@register_method`` at import), are priced by ``kvbench.reproduce``, plotted
and oriented by ``kvbench.report`` and get id-neutral defaults in ``kvbench.results`` from what
their own files declare: no table elsewhere names them."""

from __future__ import annotations

import importlib
import math
import sys
import textwrap

import pytest

from kvbench import report, reproduce
from kvbench.analysis.frame import higher_is_better, load_frame
from kvbench.methods import METHODS
from kvbench.results import RunFolder, run_id
from kvbench.tasks import TASKS

TASK_MODULE = '''
"""A toy task: ``toy_windows`` windows of ``toy_len`` tokens, scored by a loss."""

from dataclasses import dataclass

from kvbench.config import inert
from kvbench.tasks import Metric, Task, TaskConfig, Work, register_task
from kvbench.tasks.base import limited

CALLS = []


def toy_plot(frame):
    import matplotlib.pyplot as plt

    CALLS.append(sorted(set(frame["task"])))
    fig, ax = plt.subplots()
    ax.plot(range(len(frame)), frame["toy_loss"])
    return fig


@dataclass
class ToyTaskConfig(TaskConfig):
    name: str = "toy_count"
    toy_len: int = 100
    toy_windows: int = 5
    toy_mode: str = inert("plain")


@register_task("toy_count")
class ToyTask(Task):
    Config = ToyTaskConfig
    primary_metric = "toy_loss"
    metrics = {"toy_loss": Metric(False, "nats per token"), "toy_hits": Metric(True, "fraction")}
    figures = {"toy_plot": "toyext.toy_task:toy_plot"}

    @classmethod
    def planned_samples(cls, config):
        return limited(config.toy_windows, config)

    @classmethod
    def sample_work(cls, config):
        return Work(config.toy_len, 10, config.toy_len, factor=2.0)
'''

METHOD_MODULE = '''
"""A toy method: nothing but what the upper floors read."""

from dataclasses import dataclass
from typing import ClassVar

from kvbench.config import inert
from kvbench.methods import Method, MethodConfig, register_method


@dataclass
class ToyMethodConfig(MethodConfig):
    name: str = "toy_half"
    toy_knob: int = inert(0)

    default_bits: ClassVar[float] = 2.0
    cost_cpu: ClassVar[float] = 7.0
    cost_gpu: ClassVar[float] = 3.0


@register_method("toy_half")
class ToyMethod(Method):
    Config = ToyMethodConfig
'''


@pytest.fixture
def toyext(tmp_path, monkeypatch):
    package = tmp_path / "pkg" / "toyext"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "toy_task.py").write_text(textwrap.dedent(TASK_MODULE))
    (package / "toy_method.py").write_text(textwrap.dedent(METHOD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    try:
        task = importlib.import_module("toyext.toy_task")
        importlib.import_module("toyext.toy_method")
        yield task
    finally:
        # the registries are the process's: leave them as the other tests expect them
        TASKS._items.pop("toy_count", None)
        METHODS._items.pop("toy_half", None)
        for name in [m for m in sys.modules if m == "toyext" or m.startswith("toyext.")]:
            del sys.modules[name]


TOY_SHAPE = {"parameters": 1e9, "layers": 10, "hidden_size": 1000, "kv_heads": 2, "head_dim": 50}


def _job(**task):
    return {
        "task": {"name": "toy_count", **task},
        "method": {"name": "toy_half", "bits": 2},
        "model": {"name": "toy-model", "hub_id": "org/toy", "shape": TOY_SHAPE},
        "analysis": {"n": 99},
    }


def test_a_new_task_and_method_are_priced_from_their_declarations(toyext):
    assert reproduce.samples_per_job(_job()) == 5
    assert reproduce.samples_per_job(_job(limit=3)) == 3
    # CPU: task factor 2 x method cost 7 x the model's size against the default's (1e9 / 1.35e8
    # parameters, to the 0.4) x (5 s per 1000 prompt tokens + 0.1 s per step)
    size = (1e9 / 1.35e8) ** 0.4
    assert reproduce.modelled_seconds(_job(), "cpu") == pytest.approx(
        2 * 7 * size * (5 * 100 / 1000 + 0.1 * 10)
    )
    # GPU: the model node's shape (KV: 2 x 10 layers x 2 heads x 50 dims x 2 bytes per token)
    prefill = (2 * 1e9 * 100 + 2 * 10 * 1000 * 100**2) / 150e12
    step = max(0.025, (2 * 1e9 + 4000 * 100) / 1.5e12)
    assert reproduce.modelled_seconds(_job(), "paper") == pytest.approx(2 * 3 * (prefill + 10 * step))
    # the FP16 baseline is the unit of every method's cost
    fp16 = {**_job(), "method": None}
    assert reproduce.modelled_seconds(fp16, "cpu") == pytest.approx(2 * 1 * size * (0.5 + 1.0))


def test_a_new_task_and_method_get_id_neutral_defaults_from_field_metadata(toyext):
    base = {k: v for k, v in _job().items() if k != "analysis"}
    for part, key, default, other in (("method", "toy_knob", 0, 1), ("task", "toy_mode", "plain", "fancy")):
        at_default = {**base, part: {**base[part], key: default}}
        changed = {**base, part: {**base[part], key: other}}
        assert run_id(at_default) == run_id(base) != run_id(changed), key
    # the model's shape is stored but is no part of the id
    assert run_id(base) == run_id({**base, "model": {k: v for k, v in base["model"].items() if k != "shape"}})


def _write_runs(root):
    plan = {"name": "toy_exp", "reference": "fp16", "metric": "toy_loss", "alpha": 0.05, "n": 6, "seeds": [0]}
    for label, method, loss in (("fp16", None, 1.0), ("toy_half-2b", {"name": "toy_half", "bits": 2}, 1.5)):
        config = {
            "task": {"name": "toy_count"},
            "model": {"name": "toy-model"},
            "method": method,
            "bits": 2 if method else None,
            "seed": 0,
            "analysis": plan,
        }
        rid = run_id(config)
        folder = RunFolder(root / "toy_count" / "toy-model" / label / f"seed0-{rid}")
        folder.write_config({**config, "run_id": rid})
        for i in range(6):
            folder.append(
                {
                    "sample_id": f"w{i}",
                    "seed": 0,
                    "task": "toy_count",
                    "model": "toy-model",
                    "method": label,
                    "bits": 2 if method else None,
                    "toy_loss": loss + 0.01 * i,
                    "toy_hits": 1.0,
                    "memory": {"effective_bits": 2.5 if method else 16.0},
                    "seconds": 1.0,
                }
            )
        folder.write_metrics({"toy_loss": loss})


def test_a_new_task_is_plotted_and_its_metric_oriented_by_its_declaration(toyext, tmp_path):
    assert not higher_is_better("toy_loss") and higher_is_better("toy_hits")
    assert not higher_is_better("toy_loss", "toy_count")
    _write_runs(tmp_path / "runs")
    frame = load_frame(tmp_path / "runs")
    unit = report.report_unit(
        ("toy_count", "toy-model", "toy_exp"), frame, tmp_path / "out", n_resamples=200, say=lambda _: None
    )
    assert [p.name for p in unit["figures"]] == ["cliff_map.png", "memory_quality.png", "toy_plot.png"]
    assert toyext.CALLS == [["toy_count"]]
    paired = unit["paired"].set_index("method")
    # lower is better: the method's loss 0.5 above the reference's is a difference of -0.5
    assert paired.attrs["higher_is_better"] is False
    assert paired.loc["toy_half-2b", "mean_diff"] == pytest.approx(-0.5)
    assert math.isfinite(paired.loc["toy_half-2b", "ci_low"])


def test_every_task_declares_its_primary_metric_and_no_two_disagree_on_a_direction():
    # a metric looked up without its task takes the first declaration found: they must agree
    directions: dict[str, set[bool]] = {}
    for name in TASKS.names():
        cls = TASKS.get(name)
        assert cls.primary_metric in cls.metrics, name
        for metric, declared in cls.metrics.items():
            directions.setdefault(metric, set()).add(declared.higher_is_better)
            assert declared.unit, f"{name}.{metric} declares no unit"
    assert {m: d for m, d in directions.items() if len(d) > 1} == {}
    assert not higher_is_better("ppl") and not higher_is_better("rel_err_by_layer.3")
    assert higher_is_better("effective_bits")  # no task declares it


def test_model_shape_bad_input_is_one_line_naming_the_key():
    from kvbench.config import build_config
    from kvbench.errors import ConfigError
    from kvbench.models import ModelConfig

    node = {"name": "toy-model", "hub_id": "org/toy"}
    assert build_config(ModelConfig, {**node, "shape": TOY_SHAPE}, "model").kv_bytes_per_token() == 4000
    for shape, key in (
        ({**TOY_SHAPE, "layers": 0}, "model.shape.layers"),
        ({**TOY_SHAPE, "depth": 3}, "model.shape.depth"),
        ({k: v for k, v in TOY_SHAPE.items() if k != "head_dim"}, "model.shape"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build_config(ModelConfig, {**node, "shape": shape}, "model")
