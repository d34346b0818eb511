"""Report tables from the sample frame (``kvbench.analysis.frame.load_frame``).

- ``config_means``: per configuration (method label and bits) the mean of the metric over every
  sample and seed with a bootstrap interval, the mean effective bits and the runaway rate.
- ``paired_table``: every configuration against the reference, paired by (sample_id, seed), through
  ``kvbench.stats.compare`` (paired-bootstrap CI of the mean difference, sign-flip p, Holm, TOST at
  the declared margin, verdict), plus McNemar's test (Holm-adjusted on its own) when the metric is
  binary.
- ``cliff_table``: for each method family with two or more bit widths, the cliff bracket from
  ``kvbench.stats.locate_cliff`` on that family's verdicts.

Differences are oriented so that positive means the method did better (``compare``'s convention);
for lower-is-better metrics (perplexity) ``mean_diff`` is ``reference - method``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.frame import higher_is_better
from kvbench.stats import PAIR_KEYS, bootstrap_ci, compare, holm, locate_cliff, mcnemar_test, runaway_rate

MEANS_COLUMNS = [
    "method",
    "family",
    "bits",
    "n",
    "seeds",
    "mean",
    "ci_low",
    "ci_high",
    "effective_bits",
    "code_bits",
    "runaway_rate",
]


def method_family(label: str, bits: float) -> str:
    """The method label without its bit width: ``kivi-2b`` -> ``kivi``,
    ``kivi-1b-specache0`` -> ``kivi-specache0``; a grid of one family differs only in bits."""
    if bits is None or (isinstance(bits, float) and math.isnan(bits)):
        return label
    return re.sub(rf"-{re.escape(f'{bits:g}')}b(?=-|$)", "", label, count=1)


def _runaway(group: pd.DataFrame) -> float:
    """Runaway rate of a group's generations (NaN when the task does not generate)."""
    needed = {"prediction", "stopped", "generated_tokens", "max_new_tokens"}
    if not needed <= set(group.columns):
        return math.nan
    gen = group.dropna(subset=["stopped", "generated_tokens", "max_new_tokens"])
    if gen.empty:
        return math.nan
    rates = [
        runaway_rate(sub.to_dict("records"), int(limit)) * len(sub)
        for limit, sub in gen.groupby("max_new_tokens")
    ]
    return float(sum(rates) / len(gen))


def config_means(
    frame: pd.DataFrame, metric: str, alpha: float = 0.05, n_resamples: int = 10_000, seed: int = 0
) -> pd.DataFrame:
    """One row per configuration (method label, bits): n values (samples x seeds), number of seeds,
    mean of ``metric``, its percentile bootstrap ``1 - alpha`` interval (resampling the n values),
    mean effective and code bits per value from the per-sample accounting, and the runaway rate
    (``kvbench.stats.runaway_rate``; NaN for tasks that do not generate)."""
    if metric not in frame.columns:
        raise ValueError(f"metric {metric!r} is not a column of the frame; columns: {sorted(frame.columns)}")
    rows = []
    for (method, bits), group in frame.groupby(["method", "bits"], sort=True, dropna=False):
        values = group[metric].to_numpy(dtype=float)
        values = values[np.isfinite(values)]
        rng = np.random.default_rng([seed, len(rows)])
        low, high = (
            bootstrap_ci(values, level=1 - alpha, n_resamples=n_resamples, rng=rng)
            if values.size
            else (math.nan, math.nan)
        )
        rows.append(
            {
                "method": method,
                "family": method_family(method, bits),
                "bits": bits,
                "n": int(values.size),
                "seeds": int(group["seed"].nunique()),
                "mean": float(values.mean()) if values.size else math.nan,
                "ci_low": low,
                "ci_high": high,
                "effective_bits": _col_mean(group, "effective_bits"),
                "code_bits": _col_mean(group, "code_bits"),
                "runaway_rate": _runaway(group),
            }
        )
    return pd.DataFrame(rows, columns=MEANS_COLUMNS)


def _col_mean(group: pd.DataFrame, column: str) -> float:
    if column not in group:
        return math.nan
    values = pd.to_numeric(group[column], errors="coerce")
    return float(values.mean()) if values.notna().any() else math.nan


def is_binary(values: Sequence[float] | pd.Series) -> bool:
    """True when every finite value is 0 or 1 (a correct/incorrect score)."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    return bool(arr.size) and bool(np.isin(arr, (0.0, 1.0)).all())


def _pairs(frame: pd.DataFrame, metric: str) -> dict[tuple, float]:
    return {
        (sid, seed): float(v)
        for sid, seed, v in zip(frame["sample_id"], frame["seed"], frame[metric], strict=True)
    }


def paired_table(
    frame: pd.DataFrame,
    plan: dict[str, Any],
    seed: int = 0,
    n_resamples: int = 10_000,
) -> pd.DataFrame:
    """Every configuration against ``plan["reference"]`` on ``plan["metric"]``, paired.

    The ``compare`` columns (n, means, mean_diff, ci_low/ci_high, p_value, p_holm, tost_p,
    cohens_dz, win_rate, verdict) plus: ``family``; ``n_missing``, reference pairs the configuration
    lacks (compared on the shared pairs only, so an unfinished run still reports, and says so);
    ``margin``; ``equivalent`` (TOST p < alpha; None when no margin was declared); ``p_mcnemar`` and
    ``p_mcnemar_holm`` (NaN unless the metric is binary).
    """
    metric, reference, alpha = plan["metric"], plan["reference"], float(plan["alpha"])
    margin = plan.get("margin")
    margin = None if margin is None or (isinstance(margin, float) and math.isnan(margin)) else float(margin)
    hib = plan.get("higher_is_better")
    hib = higher_is_better(metric) if hib is None else bool(hib)
    data = frame.dropna(subset=[metric])
    out = compare(
        data,
        metric,
        reference=reference,
        by=("method", "bits"),
        higher_is_better=hib,
        margin=margin,
        alpha=alpha,
        seed=seed,
        n_resamples=n_resamples,
        missing="intersect",
    )
    if out.empty:
        return out
    ref_rows = data[data["method"] == reference]
    ref_pairs = _pairs(ref_rows, metric)
    binary = is_binary(data[metric])
    n_missing, p_mcnemar = [], []
    for row in out.itertuples():
        group = data[(data["method"] == row.method) & _same_bits(data["bits"], row.bits)]
        pairs = _pairs(group, metric)
        shared = pairs.keys() & ref_pairs.keys()
        n_missing.append(len(ref_pairs) - len(shared))
        if binary and shared:
            m = {k: bool(pairs[k]) for k in shared}
            r = {k: bool(ref_pairs[k]) for k in shared}
            p_mcnemar.append(mcnemar_test(m, r)[1])
        else:
            p_mcnemar.append(math.nan)
    out.insert(1, "family", [method_family(m, b) for m, b in zip(out["method"], out["bits"], strict=True)])
    out["n_missing"] = n_missing
    out["margin"] = margin if margin is not None else math.nan
    out["equivalent"] = [None if margin is None else bool(p < alpha) for p in out["tost_p"]]
    out["p_mcnemar"] = p_mcnemar
    out["p_mcnemar_holm"] = holm(np.asarray(p_mcnemar, dtype=float), alpha)[0]
    out.attrs.update({"metric": metric, "reference": reference, "higher_is_better": hib, "alpha": alpha})
    return out


def _same_bits(column: pd.Series, bits: float) -> pd.Series:
    if bits is None or (isinstance(bits, float) and math.isnan(bits)):
        return column.isna()
    return column == bits


def cliff_table(paired: pd.DataFrame) -> pd.DataFrame:
    """The cliff bracket of every method family with two or more bit widths in ``paired``:
    family, grid (bits, high to low), verdicts along it, last_ok_bits, first_bad_bits, interval,
    non_monotone (see ``kvbench.stats.Cliff``)."""
    rows = []
    if paired.empty:
        return pd.DataFrame(
            columns=[
                "family",
                "grid",
                "verdicts",
                "last_ok_bits",
                "first_bad_bits",
                "interval",
                "non_monotone",
            ]
        )
    for family, group in paired.dropna(subset=["bits"]).groupby("family", sort=True):
        if group["bits"].nunique() < 2:
            continue
        group = group.sort_values("bits", ascending=False)
        cliff = locate_cliff(group, bits_col="bits", verdict_col="verdict")
        rows.append(
            {
                "family": family,
                "grid": " ".join(f"{b:g}" for b in group["bits"]),
                "verdicts": " ".join(group["verdict"]),
                "last_ok_bits": cliff.last_ok_bits,
                "first_bad_bits": cliff.first_bad_bits,
                "interval": cliff.interval,
                "non_monotone": cliff.non_monotone,
            }
        )
    return pd.DataFrame(
        rows,
        columns=["family", "grid", "verdicts", "last_ok_bits", "first_bad_bits", "interval", "non_monotone"],
    )


def to_markdown(table: pd.DataFrame, digits: int = 4) -> str:
    """A pipe table: floats to ``digits`` significant digits, p-values below 1e-4 in e-notation,
    missing values as ``-``; numbers right-aligned."""

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (bool, np.bool_)):
            return "yes" if value else "no"
        if isinstance(value, (float, np.floating)):
            value = float(value)
            if value != 0 and abs(value) < 1e-4:
                return f"{value:.2e}"
            return f"{value:.{digits}g}"
        return str(value).replace("|", "\\|")

    if table.empty:
        return "(no rows)\n"
    numeric = [pd.api.types.is_numeric_dtype(table[c]) and table[c].dtype != bool for c in table.columns]
    header = "| " + " | ".join(str(c) for c in table.columns) + " |"
    rule = "|" + "|".join("--:" if n else ":--" for n in numeric) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


__all__ = [
    "PAIR_KEYS",
    "cliff_table",
    "config_means",
    "is_binary",
    "method_family",
    "paired_table",
    "to_markdown",
]
