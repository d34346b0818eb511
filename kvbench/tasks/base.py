"""What every task is: a validated config, a list of samples, a per-sample run and an aggregate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvbench.config import build_config, require
from kvbench.errors import ConfigError
from kvbench.registry import Registry

TASKS: Registry[type[Task]] = Registry("task")
register_task = TASKS.register


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
    registered_name: ClassVar[str]

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


def build_task(node: dict[str, Any], data_root: Path, seed: int) -> Task:
    node = dict(node or {})
    name = node.get("name")
    if not name:
        raise ConfigError("task.name", name, f"registered tasks are {', '.join(TASKS.names())}")
    cls = TASKS.get(name)
    return cls(build_config(cls.Config, node, "task"), data_root, seed)
