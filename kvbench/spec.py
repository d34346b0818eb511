"""One run, typed: the composed config resolved and validated once, at the entry.

:meth:`RunSpec.from_config` takes what Hydra hands a job (a DictConfig; a plain dict from a test or a
script reads the same) and turns it into the objects a run needs: the run's own knobs
(:class:`RunConfig`: seed, bits, device, output, data, objective), the model's config, the method
and task objects (built through their registries), the logger's config and the analysis plan, plus
the run id and the run's folder. Everything below the entry (:mod:`kvbench.run`, the result writing,
the logger) reads those objects and never converts a config node again: a config travels as one
typed object, so a check runs once and a run's id cannot drift between two readings of its config.

The resolved plain config has two uses, both at the entry: the run id hashes it
(:func:`kvbench.results.run_id`) and the run writes it. Both are done here, once: the spec holds the
run id and, in :attr:`RunSpec.record` (:class:`RunRecord`), the plain forms the run writes
(``config.json``, ``metrics.json``'s ``method_config``, the logger's run config), byte for byte as
before. Nothing below the entry reads a key out of the plain config: run ids, folders, resume, the
logger and the samples' cache key all take the typed objects.

Building a spec reads the environment and checks that the output root can be written and the data
root exists (a task is built on its data root), but loads no data, model file or weights:
:func:`kvbench.run.plan_run` does that, on top of the spec.

The top-level ``bits`` reaches the method through the run (:func:`run_config`): it fills the knob
the method's config names (``MethodConfig.bits_knob``) unless the node sets its own, so a method node
carries no ``bits: ${bits}`` line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvbench import paths
from kvbench.config import LoggerConfig, build_config, check_choice, require, to_plain, unknown_key
from kvbench.data import resolve_data_root
from kvbench.errors import ConfigError
from kvbench.methods import Method, build_method
from kvbench.methods.base import with_run_bits
from kvbench.objective import check_objective, objective_names
from kvbench.results import AnalysisPlan, analysis_plan, run_id
from kvbench.tasks import Task, build_task

if TYPE_CHECKING:
    from kvbench.models import ModelConfig

# Top-level keys other than RunConfig's own: nodes validated by their own dataclasses.
NODE_KEYS = ("model", "task", "method", "logger", "analysis")
SEED_LIMIT = 2**32  # numpy's generators take seeds below this; torch takes them too


RESUME_CHOICES = (True, False, "force")


@dataclass
class OutputConfig:
    """``resume``: true skips the samples a run folder already holds, provided the same code wrote
    them (commit, kvbench version, method and task versions); ``force`` accepts rows written by
    other code too, and the run records that it did (``provenance.json``); false reruns every
    sample."""

    root: str = "results/runs"
    resume: bool | str = True

    def __post_init__(self):
        require(
            isinstance(self.root, str) and self.root.strip() != "", "output.root", self.root, "a folder path"
        )
        require(
            any(self.resume is c or self.resume == c for c in RESUME_CHOICES if isinstance(c, str))
            or isinstance(self.resume, bool),
            "output.resume",
            self.resume,
            "true, false or force",
        )

    def check_root(self) -> None:
        """The root can be created and written (:func:`kvbench.paths.check_writable_folder`)."""
        paths.check_writable_folder("output.root", self.root, self.root)


@dataclass
class DataConfig:
    root: str | None = None


@dataclass
class RunConfig:
    """The top-level knobs (model, task and method nodes are validated by their own dataclasses)."""

    seed: int = 0
    bits: float | None = None
    device: str = "auto"
    output: OutputConfig = field(default_factory=OutputConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # what the run returns to an optimizing sweeper (kvbench/objective.py): a name or a list of
    # names; null: its summary row
    objective: Any = None

    def __post_init__(self):
        # a negative or fractional seed would run, into a folder named seed-1 or seed1.5
        require(
            0 <= self.seed < SEED_LIMIT,
            "seed",
            self.seed,
            f"an int in 0..{SEED_LIMIT - 1}",
        )
        require(
            self.bits is None or self.bits > 0,
            "bits",
            self.bits,
            "a positive number (log2 of a level count), or null for the method's default",
        )
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        objective_names(self.objective)  # a name or a list of names; which names: the task's (plan_run)
        if self.device == "cuda" and not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError("device", self.device, f"auto or cpu here: {why}")
        if isinstance(self.output, dict):
            self.output = build_config(OutputConfig, self.output, "output")
        if isinstance(self.data, dict):
            self.data = build_config(DataConfig, self.data, "data")

    def torch_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def _filled(given: dict[str, Any]) -> dict[str, Any]:
    """A plain config with the top-level ``bits`` in the method node's bits knob (see
    :func:`run_config`); ``given`` itself is left as it is."""
    config = dict(given)
    if isinstance(config.get("method"), dict):
        config["method"] = with_run_bits(config["method"], config.get("bits"))
    return config


def run_config(cfg: Any) -> dict[str, Any]:
    """The plain config a run writes to config.json and hashes into its run id: ``cfg`` (a Hydra
    DictConfig or a dict) resolved, with the top-level ``bits`` in the method node's bits knob where
    the node leaves it unset (:func:`kvbench.methods.base.with_run_bits`). For code that needs a
    run's id or folder without a run (:mod:`kvbench.reproduce`); a run's is in :attr:`RunSpec.record`."""
    return _filled(to_plain(cfg))  # a copy: the caller's dict keeps its node as given


def bits_ignored(config: dict[str, Any], method: Method) -> dict[str, str]:
    """Where the top-level ``bits`` changes nothing: no method (the FP16 baseline), a method without
    a bits knob (``MethodConfig.bits_knob``), or a node that sets the knob to another value itself.
    ``config`` is the config as given, before :func:`run_config` fills the knob."""
    bits, node, knob = config.get("bits"), config.get("method"), method.config.bits_knob
    if bits is None:
        return {}
    if not node:
        why = "no +method was given, so this is the FP16 baseline"
    elif knob is None:
        why = f"{method.label()} has no bits"
    elif node.get(knob) is not None and node[knob] != bits:
        why = f"the method node sets method.{knob}={node[knob]:g}"
    else:
        return {}
    return {"bits_ignored": f"bits={bits:g} is ignored: {why}"}


def check_environment() -> None:
    """Every environment variable a run reads, through the reader its owner uses (each raises a
    ConfigError naming the variable): a bad value fails here, before anything loads, rather than
    where it is first used. ``KVBENCH_DATA_DIR`` is checked with the data root it stands for."""
    from kvbench.cache.blockwise import configured_block_size
    from kvbench.kernels.runtime import interpreting
    from kvbench.models.hub import hub_offline

    configured_block_size()
    paths.cache_dir()
    paths.user_config_dirs()  # KVBENCH_CONFIG_PATH: Hydra's search path skips a bad entry silently
    hub_offline()
    interpreting()


def run_folder(root: str, task: str, model: str, method: str, seed: int, rid: str) -> Path:
    """``root/task/model/method/seed<seed>-<run id>``. Each part is one safe folder name (the model's
    name is checked by its config; the others are made by kvbench, checked here all the same) and
    the folder resolves inside ``root``: no configuration writes a run anywhere else."""
    parts = {"task.name": task, "model.name": model, "method": method, "run id": f"seed{seed}-{rid}"}
    for key, value in parts.items():
        paths.safe_component(key, value)
    folder = Path(root).joinpath(*parts.values())
    paths.check_inside(folder, root, "output.root", root)
    return folder


@dataclass(frozen=True)
class RunRecord:
    """The run's resolved plain config in the forms a run writes, each made once at the entry
    (:meth:`of`) so that nothing below it reads a key out of the plain config. Written as they are,
    never read back or changed.

    ``config``: the resolved plain config with the run's ``bits`` in the method node: what the run
    id hashes (:func:`kvbench.results.run_id`, at the entry). ``config_json``: what the run folder's
    ``config.json`` holds, ``config`` and the ``run_id``. ``method_config``: the method node as
    ``metrics.json`` records it (``{"name": "fp16"}`` for the FP16 baseline). ``logged``: the
    config the logger's run holds, ``config`` without the ``logger`` node."""

    config: dict[str, Any]
    config_json: dict[str, Any]
    method_config: dict[str, Any]
    logged: dict[str, Any]

    @classmethod
    def of(cls, config: dict[str, Any], rid: str) -> RunRecord:
        """The record of ``config`` (as :func:`run_config` makes it) whose run id is ``rid``."""
        return cls(
            config=config,
            config_json={**config, "run_id": rid},
            method_config=config.get("method") or {"name": "fp16"},
            logged={k: v for k, v in config.items() if k != "logger"},
        )


@dataclass(frozen=True)
class RunSpec:
    """A run's configuration as validated objects, built once at the entry (:meth:`from_config`).

    ``record``: the plain config in the forms the run writes (:class:`RunRecord`); the code below
    the entry writes them and reads nothing out of them. ``warnings``: what the configuration alone
    says will be wasted (``bits`` ignored, a method setting that the prompt lengths defeat), keyed
    by kind."""

    run: RunConfig
    model: ModelConfig
    method: Method
    task: Task
    logger: LoggerConfig
    analysis: AnalysisPlan | None
    data_root: Path
    run_id: str
    folder: Path
    warnings: dict[str, str]
    record: RunRecord

    @property
    def seed(self) -> int:
        return self.run.seed

    @property
    def output(self) -> OutputConfig:
        return self.run.output

    @property
    def experiment_group(self) -> str:
        """The run's experiment (``analysis.name``), else ``adhoc-<task>``: the names the archives
        use, and the logger's group."""
        return self.analysis.name if self.analysis is not None else f"adhoc-{self.task.registered_name}"

    @classmethod
    def from_config(cls, cfg: Any) -> RunSpec:
        """Resolve ``cfg`` (a Hydra DictConfig or a plain dict) once and validate every node; raise
        ConfigError on the first problem, cheapest checks first. A ``RunSpec`` comes back as is."""
        if isinstance(cfg, RunSpec):
            return cfg
        from kvbench.models import ModelConfig

        check_environment()
        given = to_plain(cfg)  # the one conversion of the run's config
        config = _filled(given)
        run_keys = [f.name for f in fields(RunConfig)]
        for key in config:
            if key not in run_keys and key not in NODE_KEYS:
                raise ConfigError(key, config[key], unknown_key(key, [*run_keys, *NODE_KEYS]))
        run_cfg = build_config(RunConfig, {k: config[k] for k in run_keys if k in config}, "")
        logger = build_config(LoggerConfig, config.get("logger"), "logger")
        analysis = analysis_plan(config["analysis"]) if config.get("analysis") is not None else None
        method = build_method(config.get("method"))
        model = build_config(ModelConfig, config.get("model"), "model")
        run_cfg.output.check_root()
        data_root = resolve_data_root(run_cfg.data.root)
        task = build_task(config.get("task"), data_root, run_cfg.seed)
        check_objective(run_cfg.objective, task.primary_metric)
        rid = run_id(config, method.config)
        folder = run_folder(
            run_cfg.output.root, task.registered_name, model.name, method.label(), run_cfg.seed, rid
        )
        warnings = {**method.config.context_warnings(task.prompt_lengths()), **bits_ignored(given, method)}
        return cls(
            run_cfg,
            model,
            method,
            task,
            logger,
            analysis,
            data_root,
            rid,
            folder,
            warnings,
            RunRecord.of(config, rid),
        )
