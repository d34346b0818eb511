"""An experiment node's plan: its jobs, the seconds per sample stored for them, and the time it has
left to run.

:mod:`kvbench.reproduce` makes the plans (composing each job's run folder, counting what it holds)
and runs them; :func:`kvbench.analysis.sizing.node_sizing` prices a node at other sample counts
through the same stored times (:func:`stored_job_seconds`) and per-run model load
(:meth:`NodePlan.estimate_s`), so the two share one cost model. Step 2 of the cost estimate (the
modelled seconds when nothing is stored) is :func:`kvbench.reproduce.modelled_seconds`; the
module docstring of :mod:`kvbench.reproduce` describes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The machine each profile's cost is modelled for (minutes on this CPU, or GPU hours).
PROFILE_DEVICE = {"cpu": "cpu", "strong": "cpu", "paper": "gpu"}
# The model load each unfinished run adds (see kvbench.reproduce's module docstring).
CPU_RUN_OVERHEAD_S = 15.0
GPU_RUN_OVERHEAD_S = 120.0


# ---------------------------------------------------------------------------------------- stored


def add_seconds(found: dict[tuple, list[float]], model: Any, method: Any, seconds: Any) -> None:
    """Add one stored row's ``seconds`` to ``found`` under ``(model, method label)`` (a missing,
    non-finite or non-positive time is left out)."""
    if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0:
        found.setdefault((str(model), str(method)), []).append(float(seconds))


def frame_seconds(frame: Any) -> dict[tuple, list[float]]:
    """``{(model, method label): [seconds per sample, ...]}`` from a sample frame (an archive's)."""
    found: dict[tuple, list[float]] = {}
    if frame is not None and {"model", "method", "seconds"} <= set(frame.columns):
        for model, method, seconds in zip(frame["model"], frame["method"], frame["seconds"], strict=True):
            add_seconds(found, model, method, seconds)
    return found


def stored_job_seconds(stored: dict[tuple, list[float]], model: str, method: str) -> tuple[float, str] | None:
    """Seconds per sample of a job of ``model`` under ``method`` (a label) from ``stored`` (step 1
    of the cost estimate, :mod:`kvbench.reproduce`), with where it came from: the mean of the same
    model and method's rows (``stored``), else of the same model's rows in the node (``stored
    (node)``); None when the node stores no time for the model."""
    times = stored.get((model, method)) or [s for (m, _), v in stored.items() if m == model for s in v]
    if not times:
        return None
    return sum(times) / len(times), "stored" if (model, method) in stored else "stored (node)"


# ----------------------------------------------------------------------------------------- plans


@dataclass
class Job:
    """One job of a node's multirun."""

    label: str
    overrides: list[str]
    samples: int = 0
    folder: Path | None = None  # the run folder; None when the job was not composed
    method: str = ""
    model: str = ""
    done: int = 0
    complete: bool = False
    same_as: int | None = None  # index of the earlier job of the same run folder
    seconds: float = 0.0  # estimated per sample
    source: str = "model"


@dataclass
class NodePlan:
    node: str
    profile: str
    config_name: str | None = None
    jobs: list[Job] = field(default_factory=list)
    output_root: str = ""
    error: str | None = None

    @property
    def runs(self) -> list[Job]:
        """The first job of each distinct run (every job when the jobs were not composed)."""
        return [j for j in self.jobs if j.same_as is None]

    @property
    def samples(self) -> int:
        return sum(j.samples for j in self.runs)

    @property
    def todo(self) -> int:
        return sum(j.samples - j.done for j in self.runs if not j.complete)

    @property
    def complete(self) -> bool:
        return bool(self.jobs) and all(j.complete for j in self.runs)

    def estimate_s(self) -> float:
        """Seconds for what is left: the samples still to run, and a model load per unfinished run."""
        overhead = CPU_RUN_OVERHEAD_S if PROFILE_DEVICE[self.profile] == "cpu" else GPU_RUN_OVERHEAD_S
        left = [j for j in self.runs if not j.complete]
        return sum((j.samples - j.done) * j.seconds for j in left) + overhead * len(left)
