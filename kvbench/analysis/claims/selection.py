"""From a claim's arms to the values its rules compare: the runs an arm selector picks
(:func:`select`), a metric's per-row values (:func:`metric_values`) and its range when bounded
(:func:`metric_bounds`), the (sample_id, seed) pairs arms share, and :class:`NotRun` when the
data a rule needs is not there.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.claims.schema import Claim, Rule
from kvbench.analysis.frame import higher_is_better, plan_of

# Metrics whose per-sample value lies in a known range (the head of a dotted path): a task score,
# a recall, a hit rate. Their rules get the exact, tie-aware tests of ``kvbench.stats.exact``.
BOUNDED_METRICS: dict[str, tuple[float, float]] = {
    "score": (0.0, 1.0),
    "needle_recall": (0.0, 1.0),
    "hit_rate": (0.0, 1.0),
    "hit_rates": (0.0, 1.0),
    "quantized_fraction": (0.0, 1.0),
}


def metric_bounds(metric: str | None, *values: np.ndarray) -> tuple[float, float] | None:
    """The range ``(lo, hi)`` of a bounded metric (``BOUNDED_METRICS``, by the head of a dotted
    path), or None for an unbounded one (perplexity, an error, bits) and for values that leave the
    range (then the metric is not the bounded one the name suggests)."""
    if metric is None:
        return None
    bounds = BOUNDED_METRICS.get(str(metric).split(".")[0])
    if bounds is None:
        return None
    lo, hi = bounds
    for v in values:
        v = np.asarray(v, dtype=float)
        if v.size and (np.nanmin(v) < lo - 1e-9 or np.nanmax(v) > hi + 1e-9):
            return None
    return bounds


def _subset(wanted: Any, node: Any) -> bool:
    """Whether ``wanted`` (a mapping or a value) is contained in the config ``node``."""
    if isinstance(wanted, dict):
        return isinstance(node, dict) and all(k in node and _subset(v, node[k]) for k, v in wanted.items())
    if isinstance(wanted, (int, float)) and isinstance(node, (int, float)) and not isinstance(node, bool):
        return math.isclose(float(wanted), float(node), rel_tol=1e-9, abs_tol=1e-12)
    return wanted == node


def select(frame: pd.DataFrame, selector: Mapping[str, Any]) -> pd.DataFrame:
    """The rows of ``frame`` whose run matches an arm selector (label, method name, bits, and a
    subset of the method node)."""
    keep = pd.Series(True, index=frame.index)
    if "label" in selector:
        keep &= frame["method"] == selector["label"]
    if "method" in selector:
        keep &= frame["method_name"] == selector["method"]
    if "bits" in selector:
        keep &= pd.Series(np.isclose(frame["bits"].astype(float), float(selector["bits"])), index=frame.index)
    if "config" in selector:
        configs = frame["method_config"] if "method_config" in frame else [{}] * len(frame)
        keep &= pd.Series([_subset(selector["config"], c) for c in configs], index=frame.index)
    return frame[keep]


def _lookup(value: Any, path: str) -> Any:
    """Walk a dict by a dotted path whose keys may themselves hold dots (``"0.005"``)."""
    if path == "":
        return value
    if not isinstance(value, dict):
        return math.nan
    if path in value:
        return value[path]
    head, _, rest = path.partition(".")
    return _lookup(value[head], rest) if head in value and rest else math.nan


def metric_values(rows: pd.DataFrame, metric: str) -> pd.Series:
    """The per-row values of ``metric``: a column, or a dotted path into a dict column."""
    if metric in rows.columns:
        return pd.to_numeric(rows[metric], errors="coerce").astype(float)
    head, _, rest = metric.partition(".")
    if rest and head in rows.columns:
        return pd.Series([_lookup(v, rest) for v in rows[head]], index=rows.index, dtype=float)
    raise KeyError(metric)


class NotRun(Exception):
    """The data a rule needs is not there: the rule's verdict is ``not run`` with this reason."""


def several_configurations(rows: pd.DataFrame) -> bool:
    """Whether ``rows`` hold more than one configuration. A label that changes only with the run's
    seed (random pruning draws with ``seed: ${seed}``, so its label carries it) is one configuration
    seen at several seeds: within each seed there must be a single label."""
    return bool(len(rows)) and int(rows.groupby("seed")["method"].nunique().max()) > 1


def _pairs(rows: pd.DataFrame, metric: str, arm: str) -> dict[tuple, float]:
    labels = sorted(rows["method"].unique())
    if several_configurations(rows):
        raise NotRun(f"arm {arm!r} matches {len(labels)} configurations ({', '.join(labels)}); narrow it")
    try:
        values = metric_values(rows, metric)
    except KeyError:
        raise NotRun(f"arm {arm!r}: no per-sample {metric!r}") from None
    keys = zip(rows["sample_id"].astype(str), rows["seed"].astype(int), strict=True)
    return {k: v for k, v in zip(keys, values, strict=True) if math.isfinite(v)}


class _Context:
    """The runs of one claim's experiment for one model, with the plan's defaults."""

    def __init__(self, claim: Claim, frame: pd.DataFrame, alpha: float, seed: int, n_resamples: int):
        self.claim, self.frame, self.alpha = claim, frame, alpha
        self.plan = plan_of(frame)
        self.seed, self.n_resamples = seed, n_resamples

    def rng(self, rule: Rule) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(f"{self.claim.id}|{rule.text}".encode())])

    def metric(self, rule: Rule, arm: str | None = None) -> str:
        sel = self.claim.arms.get(arm, {}) if arm else {}
        metric = sel.get("metric") or rule.kwargs.get("metric") or self.claim.metric or self.plan["metric"]
        if metric is None:
            raise NotRun("no metric declared and the runs name no primary metric")
        return metric

    def higher_is_better(self, metric: str) -> bool:
        declared = self.plan.get("higher_is_better")
        return higher_is_better(metric) if declared is None else bool(declared)

    def rows(self, arm: str) -> pd.DataFrame:
        rows = select(self.frame, self.claim.arms[arm])
        if rows.empty:
            raise NotRun(f"arm {arm!r} matches no run of {self.claim.experiment}")
        return rows

    def paired(self, rule: Rule, arms: tuple[str, ...]) -> tuple[list[np.ndarray], str]:
        """Values of each arm on the pairs all of them share, and the (first arm's) metric."""
        per_arm = [_pairs(self.rows(a), self.metric(rule, a), a) for a in arms]
        shared = sorted(set.intersection(*(set(p) for p in per_arm)))
        if len(shared) < 2:
            raise NotRun(f"{len(shared)} (sample_id, seed) pairs shared by {', '.join(arms)}; need 2")
        return [np.array([p[k] for k in shared]) for p in per_arm], self.metric(rule, arms[0])
