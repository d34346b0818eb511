"""``cliff_within(f, ref, "(lo, hi]")``: where a family's bit grid falls off against a reference
(:func:`_cliff_table`, :func:`cliff_text`); the premises' cliffs are measured the same way.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.claims.outcome import POWER, Outcome, _fmt, _plan
from kvbench.analysis.claims.schema import _INTERVAL, Rule
from kvbench.analysis.claims.selection import NotRun, _Context, _pairs, metric_bounds, metric_values
from kvbench.stats import PAIR_KEYS, compare, locate_cliff, min_n_sign_flip, min_p_sign_flip, n_from_pilot


def _cliff_table(
    fam: pd.DataFrame,
    ref: pd.DataFrame,
    metric: str,
    higher: bool,
    margin: float | None,
    alpha: float,
    seed: int,
    n_resamples: int,
) -> pd.DataFrame:
    """Every grid point of a family against the reference (``kvbench.stats.compare``: paired
    sign-flip, Holm over the grid, TOST at the margin, exact for a bounded metric), one row per
    bit width."""
    if fam["bits"].isna().any() or fam.groupby("method")["bits"].nunique().gt(1).any():
        raise NotRun("every configuration of the family needs one bit width")
    if ref["method"].nunique() > 1:
        raise NotRun("the reference matches several configurations; narrow it")
    data = pd.concat([fam, ref])
    data = data.assign(_value=metric_values(data, metric)).dropna(subset=["_value"])
    bounds = metric_bounds(metric, data["_value"].to_numpy())
    table = compare(
        data[["method", "bits", "_value", *PAIR_KEYS]],
        "_value",
        reference=ref["method"].iloc[0],
        by=("method", "bits"),
        higher_is_better=higher,
        margin=margin,
        alpha=alpha,
        seed=seed,
        n_resamples=n_resamples,
        missing="intersect",
        bounds=bounds,
    )
    if table.empty or table["n"].min() < 2:
        raise NotRun("fewer than 2 pairs with the reference at some grid point")
    return table


def cliff_text(table: pd.DataFrame, cliff: Any) -> str:
    """Where a grid places the cliff, saying only what its verdicts establish. Bracketed
    ``(bad, ok]`` when the point above the first worse one is shown equivalent (or, without a
    margin, when the grid holds no TOST at all); ``above BAD, upper end not located at this n`` when
    the points above it are merely not shown worse (inconclusive: absence of evidence, not a
    location); ``below the grid`` / ``above the grid`` when no point / the top point is worse."""
    if cliff.first_bad_bits is None:
        return "below the grid (no point worse)"
    if cliff.last_ok_bits is None:
        return "above the grid"
    above = table[table["bits"] > cliff.first_bad_bits + 1e-9]
    shown = above["verdict"].isin(["equivalent", "better"])
    tested = "tost_p" in table and table["tost_p"].notna().any()
    if shown.all() or not tested:
        return cliff.interval
    open_points = ", ".join(f"{b:g}" for b in above.loc[~shown, "bits"])
    return (
        f"above {cliff.first_bad_bits:g}, upper end not located at this n ({open_points} neither worse "
        "nor shown equivalent)"
    )


def _grid_cannot_conclude(table: pd.DataFrame, alpha: float) -> str | None:
    """Why a cliff grid (``_cliff_table``'s rows) cannot show any point worse than its reference,
    or None when it can: with n pairs per point on a k-point Holm grid the smallest attainable
    two-sided sign-flip p is ``min_p_sign_flip(n, k)``, and a grid at or above alpha there can only
    ever read "no point worse"."""
    n, points = int(table["n"].min()), len(table)
    floor = min_p_sign_flip(n, points, two_sided=True)
    if floor < alpha:
        return None
    need = min_n_sign_flip(alpha, points, two_sided=True)
    return (
        f"n={n} pairs per point on a {points}-point Holm grid: the smallest attainable p is {floor:.3g} "
        f">= alpha {alpha:g}, so no point can be shown worse; it needs {need} pairs per point"
    )


def _cliff_outcome(ctx: _Context, rule: Rule) -> Outcome:
    """cliff_within: every grid point of the family is compared with the reference through
    ``_cliff_table``; a grid whose pairs are too few for the two-sided exact test to reach alpha
    after Holm is ``not run`` (no point could ever be shown worse)."""
    family, reference = rule.arms
    metric = ctx.metric(rule, family)
    fam, ref = ctx.rows(family), ctx.rows(reference)
    lo, hi = (float(v) for v in _INTERVAL.match(rule.args[0]).groups())
    margin = rule.kwargs.get("margin", ctx.plan.get("margin"))
    margin = None if margin is None or (isinstance(margin, float) and math.isnan(margin)) else float(margin)
    try:
        table = _cliff_table(
            fam, ref, metric, ctx.higher_is_better(metric), margin, ctx.alpha, ctx.seed, ctx.n_resamples
        )
    except NotRun as err:
        raise NotRun(f"{family} against {reference}: {err}") from None
    cliff = locate_cliff(table, bits_col="bits", verdict_col="verdict")
    high = table[table["bits"] >= hi - 1e-9]
    at_lo = table[table["bits"] <= lo + 1e-9].sort_values("bits").tail(1)
    grid = " ".join(f"{b:g}:{v}" for b, v in zip(table["bits"], table["verdict"], strict=True))
    bracket = cliff_text(table, cliff)
    n, points = int(table["n"].min()), len(table)
    out = Outcome(rule.text, "inconclusive", bracket, None, n, margin=margin)
    out.page_tests = [
        (f"{rule.text} at {b:g} bits", float(p)) for b, p in zip(table["bits"], table["p_value"], strict=True)
    ]
    p_worst = float(table["p_holm"].min())
    out.measured = f"cliff {bracket} on {metric}, n={n} per point; {grid}; smallest Holm p={_fmt(p_worst)}"
    holds = (high["verdict"] == "equivalent") if margin is not None else (high["verdict"] != "worse")
    # A refutation needs only one side of the interval on the grid, so it is checked first.
    if (high["verdict"] == "worse").any() or at_lo["verdict"].isin(["equivalent", "better"]).any():
        out.verdict = "evidence against"
        return out
    if not (np.isclose(table["bits"], hi).any() and np.isclose(table["bits"], lo).any()):
        # Without grid points at both ends the runs cannot place the cliff inside the interval.
        grid_text = " ".join(f"{b:g}" for b in table["bits"])
        raise NotRun(f"the grid ({grid_text}) lacks a point at {hi:g} or at {lo:g}")
    if holds.all() and (at_lo["verdict"] == "worse").all():
        out.verdict = "reproduced"
        return out
    stuck = _grid_cannot_conclude(table, ctx.alpha)
    if stuck is not None:
        raise NotRun(f"{stuck} (rerun {ctx.claim.experiment} at its declared size)")
    ref_pairs = _pairs(ref, metric, reference)
    sign = 1.0 if ctx.higher_is_better(metric) else -1.0
    level = ctx.alpha / points

    def diffs(row) -> np.ndarray:
        pairs = _pairs(fam[fam["method"] == row.method], metric, family)
        keys = sorted(pairs.keys() & ref_pairs.keys())
        return sign * np.array([pairs[k] - ref_pairs[k] for k in keys])

    confirm, refute = [], []
    for row in high.itertuples():
        d = diffs(row)
        if margin is not None:
            confirm.append(n_from_pilot(d, "equivalence", margin=margin, alpha=ctx.alpha, power=POWER))
        refute.append(_plan(d, "less", level, sign_flip=True))  # a point >= hi shown worse
    for row in at_lo.itertuples():
        d = diffs(row)
        confirm.append(_plan(d, "less", level, sign_flip=True))  # the point at lo shown worse
        if margin is not None:
            refute.append(n_from_pilot(d, "equivalence", margin=margin, alpha=ctx.alpha, power=POWER))
    out.n_confirm = max(confirm) if confirm else math.nan
    out.n_refute = min(refute) if refute else math.inf
    return out
