"""Report tables from the sample frame (``kvbench.analysis.frame.load_frame``).

- ``config_means``: per configuration (method label and bits) the mean of the metric over every
  sample and seed with a bootstrap interval, the mean effective bits, the runaway rate against the
  reference's generations and the share of looping generations.
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
from kvbench.stats import (
    PAIR_KEYS,
    bootstrap_ci,
    compare,
    degenerate_rate,
    holm,
    locate_cliff,
    mcnemar_test,
    runaway_rate,
)

MEANS_COLUMNS = [
    "method",
    "family",
    "bits",
    "grid_value",
    "n",
    "seeds",
    "mean",
    "ci_low",
    "ci_high",
    "effective_bits",
    "code_bits",
    "runaway_rate",
    "degenerate_rate",
]


def method_family(label: str, value: float, grid_key: str = "bits") -> str:
    """The method label without its grid value, so that a grid of one family differs only there:
    ``kivi-2b`` -> ``kivi``, ``kivi-1b-specache0`` -> ``kivi-specache0`` (grid key ``bits``);
    ``specache-1b-k16`` -> ``specache-1b`` (grid key ``method.topk``, value 16). An arm suffix
    (``[key_axis=token]``) is kept."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return label
    if grid_key == "bits":
        return re.sub(rf"-{re.escape(f'{value:g}')}b(?=[-\[]|$)", "", label, count=1)
    # Any "-"-separated token of the label that carries the value as a whole number.
    number = rf"(?<![\d.]){re.escape(f'{value:g}')}(?![\d.])"
    return re.sub(rf"-[^-\[]*{number}[^-\[]*(?=[-\[]|$)", "", label, count=1)


def _generations(group: pd.DataFrame) -> list[dict[str, Any]] | None:
    """The group's generation rows as records, or None when the task does not generate."""
    needed = {"prediction", "stopped", "generated_tokens", "max_new_tokens"}
    if not needed <= set(group.columns):
        return None
    gen = group.dropna(subset=["stopped", "generated_tokens", "max_new_tokens"])
    return gen.to_dict("records") if not gen.empty else None


def _runaway(group: pd.DataFrame, reference: pd.DataFrame | None) -> float:
    """Runaway rate of a group's generations against the reference's on the same pairs
    (``kvbench.stats.runaway_rate``); NaN when the task does not generate or no reference ran."""
    rows = _generations(group)
    refs = _generations(reference) if reference is not None else None
    if rows is None or refs is None:
        return math.nan
    return runaway_rate(rows, refs)


def _degenerate(group: pd.DataFrame) -> float:
    rows = _generations(group)
    return math.nan if rows is None else degenerate_rate(rows)


def config_means(
    frame: pd.DataFrame,
    metric: str,
    alpha: float = 0.05,
    n_resamples: int = 10_000,
    seed: int = 0,
    grid_key: str = "bits",
    reference: str | None = "fp16",
) -> pd.DataFrame:
    """One row per configuration (method label, bits): n values (samples x seeds), number of seeds,
    mean of ``metric``, its percentile bootstrap ``1 - alpha`` interval (resampling the n values),
    mean effective and code bits per value from the per-sample accounting, the runaway rate against
    the ``reference`` method's generations on the same pairs (``kvbench.stats.runaway_rate``; 0 for
    the reference by construction) and the share of degenerate (looping) generations with no
    reference (``kvbench.stats.degenerate_rate``); both NaN for tasks that do not generate."""
    if metric not in frame.columns:
        raise ValueError(f"metric {metric!r} is not a column of the frame; columns: {sorted(frame.columns)}")
    ref_rows = frame[frame["method"] == reference] if reference is not None else None
    if ref_rows is not None and ref_rows.empty:
        ref_rows = None
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
        grid = _col_mean(group, "grid_value") if grid_key != "bits" else bits
        rows.append(
            {
                "method": method,
                "family": method_family(method, grid, grid_key),
                "bits": bits,
                "grid_value": grid,
                "n": int(values.size),
                "seeds": int(group["seed"].nunique()),
                "mean": float(values.mean()) if values.size else math.nan,
                "ci_low": low,
                "ci_high": high,
                "effective_bits": _col_mean(group, "effective_bits"),
                "code_bits": _col_mean(group, "code_bits"),
                "runaway_rate": _runaway(group, ref_rows),
                "degenerate_rate": _degenerate(group),
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
    if hib is None:
        tasks = frame["task"].dropna().unique() if "task" in frame else []
        hib = higher_is_better(metric, str(tasks[0]) if len(tasks) == 1 else None)
    hib = bool(hib)
    data = frame.dropna(subset=[metric])
    ref_keys = set(zip(*(data.loc[data["method"] == reference, c] for c in PAIR_KEYS), strict=True))
    shares = {
        m: bool(ref_keys & set(zip(*(g[c] for c in PAIR_KEYS), strict=True)))
        for m, g in data.groupby("method")
    }
    unpaired = sorted(m for m, ok in shares.items() if not ok and m != reference)
    data = data[~data["method"].isin(unpaired)]
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
        out.attrs["unpaired"] = unpaired
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
    grid_key = plan.get("grid_key") or "bits"
    if grid_key == "bits":
        grid = out["bits"].astype(float)
    else:
        by_method = data.groupby("method")["grid_value"].first() if "grid_value" in data else pd.Series()
        grid = pd.to_numeric(out["method"].map(by_method), errors="coerce").astype(float)
    out.insert(1, "family", [method_family(m, g, grid_key) for m, g in zip(out["method"], grid, strict=True)])
    out.insert(3, "grid_value", grid.to_numpy())
    out["n_missing"] = n_missing
    out["margin"] = margin if margin is not None else math.nan
    out["equivalent"] = [None if margin is None else bool(p < alpha) for p in out["tost_p"]]
    out["p_mcnemar"] = p_mcnemar
    out["p_mcnemar_holm"] = holm(np.asarray(p_mcnemar, dtype=float), alpha)[0]
    out.attrs.update(
        {
            "metric": metric,
            "reference": reference,
            "higher_is_better": hib,
            "alpha": alpha,
            "unpaired": unpaired,
        }
    )
    return out


def _same_bits(column: pd.Series, bits: float) -> pd.Series:
    if bits is None or (isinstance(bits, float) and math.isnan(bits)):
        return column.isna()
    return column == bits


CLIFF_COLUMNS = ["family", "grid", "verdicts", "last_ok", "first_bad", "interval", "non_monotone"]


def cliff_table(paired: pd.DataFrame, grid_col: str = "bits") -> pd.DataFrame:
    """The cliff bracket of every method family with two or more grid points in ``paired``
    (``grid_col``: ``bits``, or ``grid_value`` for another grid key): family, grid (high to low),
    verdicts along it, last_ok, first_bad, interval, non_monotone (see ``kvbench.stats.Cliff``)."""
    rows = []
    if paired.empty:
        return pd.DataFrame(columns=CLIFF_COLUMNS)
    for family, group in paired.dropna(subset=[grid_col]).groupby("family", sort=True):
        if group[grid_col].nunique() < 2 or group[grid_col].duplicated().any():
            continue
        group = group.sort_values(grid_col, ascending=False)
        cliff = locate_cliff(group, bits_col=grid_col, verdict_col="verdict")
        rows.append(
            {
                "family": family,
                "grid": " ".join(f"{b:g}" for b in group[grid_col]),
                "verdicts": " ".join(group["verdict"]),
                "last_ok": cliff.last_ok_bits,
                "first_bad": cliff.first_bad_bits,
                "interval": cliff.interval,
                "non_monotone": cliff.non_monotone,
            }
        )
    return pd.DataFrame(rows, columns=CLIFF_COLUMNS)


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
