"""What every task is: a validated config, a list of samples, a per-sample run and an aggregate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvbench.config import build_config, is_int, require
from kvbench.errors import ConfigError
from kvbench.registry import Registry

TASKS: Registry[type[Task]] = Registry("task")
register_task = TASKS.register


@dataclass(frozen=True)
class Metric:
    """What one of a task's metrics means: whether a larger value is the better one (the paired
    tables and the claims orient every difference by it, as lm-eval's ``higher_is_better``) and its
    unit, in words."""

    higher_is_better: bool = True
    unit: str = ""


@dataclass(frozen=True)
class Work:
    """The work in one sample, what the cost estimate of ``python -m kvbench.reproduce --dry-run``
    prices: ``prompt`` tokens prefilled, ``steps`` forward steps after the prefill, ``context`` the
    mean cache length over those steps, and ``factor`` the sample's work beyond that prefill and
    those steps, as a multiple of them (a task that simulates more than it decodes)."""

    prompt: float
    steps: float
    context: float
    factor: float = 1.0


@dataclass
class TaskConfig:
    """Fields every task has. ``version`` changes whenever scoring changes (it is part of the run
    id, so results scored differently never mix). ``limit`` keeps the first N samples."""

    name: str = ""
    version: int = 1
    limit: int | None = None

    def __post_init__(self):
        require(
            self.limit is None or self.limit > 0,
            "task.limit",
            self.limit,
            "a positive integer or null",
        )


class Task:
    """A task. Subclasses set ``Config`` and ``primary_metric`` and implement the three methods.

    ``samples()`` must be deterministic for a given config, seed and data root: resume and paired
    statistics match rows by ``sample["id"]``.
    """

    Config: ClassVar[type[TaskConfig]] = TaskConfig
    primary_metric: ClassVar[str] = "score"
    # Every metric a row or the aggregate reports, with its direction and unit; a dict-valued one
    # (``rel_err_by_layer``) covers its entries (``rel_err_by_layer.4``).
    metrics: ClassVar[dict[str, Metric]] = {"score": Metric(True, "fraction of the samples")}
    # The report's figures of this task beyond the cliff map and memory against quality: name ->
    # ``"module:function"``, a function of the task's sample frame returning a Figure or a list.
    figures: ClassVar[dict[str, str]] = {}
    # The pandas dtype of row fields that are whole numbers or flags (``"Int64"``, ``"boolean"``):
    # what :func:`kvbench.analysis.load_results` gives them, from run folders and archives alike (a
    # whole-number column with gaps is stored in an archive as floats, a flag column as JSON).
    row_dtypes: ClassVar[dict[str, str]] = {}
    registered_name: ClassVar[str]

    @classmethod
    def planned_samples(cls, config: TaskConfig) -> int | None:
        """How many samples one run of ``config`` scores, where the config alone fixes it (no data
        read), ``limit`` applied; None where only the data knows (the estimate then takes the
        experiment's declared ``analysis.n``)."""
        return None

    @classmethod
    def sample_work(cls, config: TaskConfig) -> Work:
        """The work in one sample of ``config`` (:class:`Work`), for the cost estimate. Default: a
        1024-token prompt and 32 steps."""
        return Work(1024, 32, 1024)

    def __init__(self, config: TaskConfig, data_root: Path, seed: int = 0):
        self.config, self.data_root, self.seed = config, data_root, seed

    def samples(self) -> list[dict[str, Any]]:
        """Each sample is a JSON-serialisable dict with a unique string ``id``."""
        raise NotImplementedError

    def check_model(self, shape, tokenizer) -> None:
        """Raise ConfigError when the task cannot run on this model (e.g. context too long).
        ``shape`` is a :class:`kvbench.models.ModelShape` (``shape.max_context`` None: no limit
        known). Runs before the weights load when the model's files are local, else right after.
        Default: nothing to check."""

    def prompt_lengths(self) -> list[int]:
        """The prompt lengths (tokens) the samples will have, where the config fixes them; methods
        compare their token budgets against these. Empty when they are known only per sample."""
        return []

    def batch_for(self, runner) -> int:
        """How many samples :meth:`run_batch` takes at once in a run on ``runner``: 1 unless the
        task decodes in batches (a ``batch_size`` knob: a number, or ``auto``,
        :func:`auto_batch_size`) and the model and method allow it (no sliding-window layers, no
        static decode step)."""
        size = getattr(self.config, "batch_size", 1)
        if size == 1 or runner.shape.sliding_layers() or runner.method.config.cuda_graph:
            return 1
        if size == "auto":
            return auto_batch_size(runner, max(self.prompt_lengths() or [1]))
        return int(size)

    def run_batch(self, samples: list[dict[str, Any]], runner) -> list[dict[str, Any]]:
        """The rows of ``samples`` (as many as :meth:`batch_for` says), in order. Default: each
        :meth:`run` alone; a task that decodes in batches runs them as rows of one batch through
        the runner's batched loops (``runner.generate_batch``, ``runner.score_batch``)."""
        return [self.run(sample, runner) for sample in samples]

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        """Run one sample with a :class:`kvbench.generate.ModelRunner`, through its generation loop
        (``runner.generate``) or its scoring loop (``runner.score``), never a loop of the task's own,
        so every method hook applies. Returns the row: at least ``prompt_tokens``, ``prediction``
        and every score (``self.primary_metric`` among them); include ``memory`` (a
        :class:`MemoryReport`) from the generation so the runner records it."""
        raise NotImplementedError

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Task-level metrics from the finished rows (default: mean of the primary metric)."""
        values = [r[self.primary_metric] for r in rows if r.get(self.primary_metric) is not None]
        return {self.primary_metric: sum(values) / len(values) if values else float("nan"), "n": len(values)}


# ``batch_size: auto`` on the CPU. Decoded tokens per second on the default model, 1K-token ragged
# prompts, 2 threads (benchmarks/throughput.md), at batch 1/2/4/8/16/32: fp16 21/38/48/67/82/95,
# KIVI-2 21/33/42/52/72/78. Past 16 the gain is 9-16 % more for twice the batch's memory, and a
# run of the shipped nodes holds 6-44 samples.
AUTO_BATCH_CPU = 16
# On CUDA, ``auto`` fills at most this share of the free memory with the batch's FP16 prompts' KV.
AUTO_BATCH_MEMORY_SHARE = 0.5
AUTO_BATCH_MAX = 64


def check_batch_size(value: Any) -> None:
    require(
        value == "auto" or (is_int(value) and value >= 1),
        "task.batch_size",
        value,
        "auto (the machine's best batch) or an integer >= 1",
    )


def auto_batch_size(runner, prompt_tokens: int) -> int:
    """``batch_size: auto``: :data:`AUTO_BATCH_CPU` on the CPU; on CUDA as many sequences as fit
    :data:`AUTO_BATCH_MEMORY_SHARE` of the free device memory at their FP16 KV for
    ``prompt_tokens`` tokens (a bound on any method's, whose caches are smaller), at most
    :data:`AUTO_BATCH_MAX`."""
    import torch

    if runner.device.type != "cuda":
        return AUTO_BATCH_CPU
    free, _ = torch.cuda.mem_get_info(runner.device)
    shape = runner.shape
    per_sequence = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * max(prompt_tokens, 1)
    return max(1, min(AUTO_BATCH_MAX, int(free * AUTO_BATCH_MEMORY_SHARE) // per_sequence))


def limited(n: int, config: TaskConfig) -> int:
    """``n`` samples under the config's ``limit``."""
    return min(n, config.limit) if config.limit else n


def declared_metric(metric: str, task: str | None = None) -> Metric | None:
    """The declaration of ``metric`` (a dotted path such as ``rel_err_by_layer.4`` goes the way of
    its column) by ``task``, or by whichever registered task declares it when ``task`` is None or not
    registered; None when none does."""
    column = metric.partition(".")[0]
    owners = [TASKS.get(task)] if task in TASKS else [TASKS.get(n) for n in TASKS.names()]
    for owner in owners:
        found = owner.metrics.get(metric) or owner.metrics.get(column)
        if found is not None:
            return found
    return None


# The row fields of every task that decodes (kvbench.generate's Generation): tokens decoded, and
# whether a stop string or EOS ended the decode before max_new_tokens.
GENERATION_ROW_DTYPES = {"generated_tokens": "Int64", "stopped": "boolean"}


def declared_row_dtypes() -> dict[str, str]:
    """``{column: dtype}`` over every registered task's :attr:`Task.row_dtypes`; a column two tasks
    declare differently is left out (neither dtype is then safe for a frame holding both)."""
    out: dict[str, str] = {}
    clash: set[str] = set()
    for name in TASKS.names():
        for column, dtype in TASKS.get(name).row_dtypes.items():
            if out.setdefault(column, dtype) != dtype:
                clash.add(column)
    return {c: d for c, d in out.items() if c not in clash}


def build_task(node: dict[str, Any], data_root: Path, seed: int) -> Task:
    node = dict(node or {})
    name = node.get("name")
    if not name:
        raise ConfigError("task.name", name, f"registered tasks are {', '.join(TASKS.names())}")
    cls = TASKS.get(name)
    return cls(build_config(cls.Config, node, "task"), data_root, seed)
