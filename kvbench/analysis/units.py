"""One analysis unit (task, model, experiment) with its plan and tables: what the report writes per
unit and what each notebook shows one figure or table of.

    unit = analyze(pick_unit(load_frame("results/runs"), task="niah"))
    figures.cliff_map(unit.means, unit.paired, unit.plan["reference"], unit.plan["metric"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kvbench.analysis import tables
from kvbench.analysis.frame import groups, plan_of


@dataclass
class Unit:
    key: tuple[str, str, str | None]
    frame: pd.DataFrame
    plan: dict[str, Any]
    means: pd.DataFrame
    paired: pd.DataFrame
    cliff: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    @property
    def grid_key(self) -> str:
        return self.plan.get("grid_key") or "bits"

    @property
    def title(self) -> str:
        """``experiment: task / model`` (``task / model`` for runs outside an experiment node): what
        the unit's figures are titled."""
        task, model, experiment = self.key
        return f"{experiment}: {task} / {model}" if experiment else f"{task} / {model}"


def pick_unit(
    frame: pd.DataFrame, task: str | None = None, experiment: str | None = None, model: str | None = None
) -> tuple[tuple[str, str, str | None], pd.DataFrame]:
    """The first (task, model, experiment) unit of ``frame`` matching the filters given; among
    several, one with a declared grid first. ValueError naming the filters when none matches."""
    candidates = [
        (key, sub)
        for key, sub in groups(frame)
        if (task is None or key[0] == task)
        and (model is None or key[1] == model)
        and (experiment is None or key[2] == experiment)
    ]
    if not candidates:
        raise ValueError(f"no runs with task={task} model={model} experiment={experiment}")
    candidates.sort(key=lambda c: plan_of(c[1])["grid"] is None)
    return candidates[0]


def analyze(
    unit: tuple[tuple[str, str, str | None], pd.DataFrame], seed: int = 0, n_resamples: int = 10_000
) -> Unit:
    """Plan, per-configuration means, paired comparisons and cliff brackets of one unit."""
    key, frame = unit
    plan = plan_of(frame)
    metric = plan["metric"]
    if metric is None:
        raise ValueError("no analysis.metric declared and no finished run names the task's primary metric")
    if metric not in frame.columns:
        raise ValueError(f"analysis.metric={metric}: not a per-sample column of the {key[0]} runs")
    grid_key = plan.get("grid_key") or "bits"
    means = tables.config_means(
        frame, metric, float(plan["alpha"]), n_resamples, seed, grid_key, reference=plan["reference"]
    )
    notes = []
    if (frame["method"] == plan["reference"]).any():
        paired = tables.paired_table(frame, plan, seed=seed, n_resamples=n_resamples)
        if paired.attrs.get("unpaired"):
            notes.append(
                f"no sample pairs with the reference, left out: {', '.join(paired.attrs['unpaired'])}"
            )
    else:
        paired = pd.DataFrame()
        notes.append(f"no runs of the reference {plan['reference']!r}: no paired comparisons")
    cliff = tables.cliff_table(paired, "bits" if grid_key == "bits" else "grid_value")
    return Unit(key, frame, plan, means, paired, cliff, notes)
