"""``compare``: every method against the reference on a results table, paired by (sample_id, seed).

The statistical tests themselves (bootstrap intervals, the sign-flip test, TOST, Holm) live in
:mod:`kvbench.stats.paired`; this module groups a DataFrame of per-sample scores, pairs each group
with the reference, runs the tests and turns them into a verdict per group.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvbench.stats.exact import paired_bounded_p
from kvbench.stats.paired import (
    DEFAULT_RESAMPLES,
    PAIR_KEYS,
    _sort_keys,
    aligned_pairs,
    bootstrap_ci,
    cohens_dz,
    holm,
    sign_flip_test,
    tost_equivalence,
    win_rate,
)

VERDICTS = ("better", "worse", "equivalent", "inconclusive")

COMPARE_COLUMNS = (
    "n",
    "mean_method",
    "mean_reference",
    "mean_diff",
    "ci_low",
    "ci_high",
    "p_value",
    "p_holm",
    "tost_p",
    "cohens_dz",
    "win_rate",
    "verdict",
)


def verdict(p_holm: float, ci_low: float, ci_high: float, tost_p: float, alpha: float) -> str:
    """The decision for one comparison, differences oriented so that positive = method better.

    ``worse`` when ``p_holm < alpha`` and ``ci_high < 0``; ``better`` when ``p_holm < alpha`` and
    ``ci_low > 0``; otherwise ``equivalent`` when ``tost_p < alpha``; otherwise ``inconclusive``.
    A significant difference takes precedence over equivalence, so a detectable degradation is
    reported even when it falls inside the margin. NaN inputs never satisfy a condition.
    """
    if p_holm < alpha and ci_high < 0:
        return "worse"
    if p_holm < alpha and ci_low > 0:
        return "better"
    if tost_p < alpha:
        return "equivalent"
    return "inconclusive"


def _scores_by_pair(frame: pd.DataFrame, metric: str, what: str) -> dict[tuple, float]:
    """``{(sample_id, seed): score}`` for one group; ValueError on repeated pairs or bad scores."""
    keys = list(zip(*(frame[c].tolist() for c in PAIR_KEYS), strict=True))
    scores = frame[metric].to_numpy(dtype=float)
    repeated = {k for k, count in Counter(keys).items() if count > 1}
    if repeated:
        raise ValueError(f"{what}: repeated (sample_id, seed) pairs, e.g. {_sort_keys(repeated)[:10]}")
    bad = [k for k, s in zip(keys, scores, strict=True) if not math.isfinite(s)]
    if bad:
        raise ValueError(
            f"{what}: non-finite {metric!r} for pairs {_sort_keys(set(bad))[:10]}; "
            "drop them or transform the metric (e.g. log perplexity) before comparing"
        )
    return dict(zip(keys, scores.tolist(), strict=True))


def _plain(value: Any) -> Any:
    """numpy scalars as Python ones, so group keys print (and hash into seeds) stably."""
    return value.item() if isinstance(value, np.generic) else value


def _group_rng(seed: int, key: tuple) -> np.random.Generator:
    """A generator fixed by ``seed`` and the group key, so a group's resamples do not depend on
    which other groups are in the table."""
    return np.random.default_rng([seed, zlib.crc32(repr(key).encode())])


def compare(
    df: pd.DataFrame,
    metric: str,
    reference: str = "fp16",
    by: Sequence[str] = ("method", "bits"),
    higher_is_better: bool = True,
    margin: float | None = None,
    alpha: float = 0.05,
    seed: int = 0,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    missing: str = "raise",
    bounds: tuple[float, float] | None = None,
) -> pd.DataFrame:
    """Compare every group of rows against the reference method, paired by (sample_id, seed).

    Reference rows are those with ``method == reference``; every other row is grouped by ``by``.
    For each group, ``d = method - reference`` per pair (``reference - method`` when
    ``higher_is_better`` is False, so positive always means the method is better) and the row holds:
    ``n`` pairs; ``mean_method``/``mean_reference`` (raw metric); ``mean_diff`` = mean(d);
    ``ci_low``/``ci_high``, the percentile paired-bootstrap ``1 - alpha`` interval of mean(d);
    ``p_value``, the two-sided sign-flip p (exact for n <= 20 nonzero pairs); ``p_holm``, Holm-adjusted
    across all groups of this call; ``tost_p``, the paired-t TOST p for ``margin`` (NaN when
    ``margin`` is None, or when every pair differs by the same amount: no spread, no t);
    ``cohens_dz``, ``win_rate``; and ``verdict`` (see ``verdict``): worse/better
    when ``p_holm < alpha`` and the CI excludes 0 on that side, else equivalent when
    ``tost_p < alpha``, else inconclusive.

    ``missing="raise"`` (default) rejects a group whose pairs differ from the reference's;
    ``missing="intersect"`` compares on the shared pairs only (the reference restricted per group).
    Resampling is seeded by ``seed`` and the group key, so results are reproducible.

    ``bounds``: the metric's range ``(lo, hi)`` when it is bounded (a task score in [0, 1]); then
    ``tost_p`` is the exact, tie-aware TOST of ``kvbench.stats.exact.paired_bounded_p`` (the larger
    of the two exact binomial sides) instead of the paired t, which on tied 0/1 scores divides by a
    zero spread. The sign-flip p is exact either way.
    """
    if missing not in ("raise", "intersect"):
        raise ValueError(f"missing must be 'raise' or 'intersect', got {missing!r}")
    by = [by] if isinstance(by, str) else list(by)
    needed = {"method", metric, *PAIR_KEYS, *by}
    absent = sorted(needed - set(df.columns))
    if absent:
        raise ValueError(f"columns missing from the table: {absent}")
    is_ref = df["method"] == reference
    if not is_ref.any():
        raise ValueError(f"no rows for the reference method {reference!r}")
    ref_scores = _scores_by_pair(df[is_ref], metric, f"reference {reference!r}")
    sign = 1.0 if higher_is_better else -1.0

    rows = []
    # dropna=False: a NaN in a grouping column (e.g. bits of a method without a bit width) is a group.
    for key, group in df[~is_ref].groupby(by, sort=True, dropna=False):
        key = tuple(_plain(k) for k in key)
        what = ", ".join(f"{c}={v!r}" for c, v in zip(by, key, strict=True))
        scores = _scores_by_pair(group, metric, what)
        ref = ref_scores
        if missing == "intersect":
            shared = scores.keys() & ref_scores.keys()
            scores = {k: scores[k] for k in shared}
            ref = {k: ref_scores[k] for k in shared}
        try:
            _, m, r = aligned_pairs(scores, ref)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
        d = sign * (m - r)
        rng = _group_rng(seed, key)
        ci_low, ci_high = bootstrap_ci(d, level=1.0 - alpha, n_resamples=n_resamples, rng=rng)
        if margin is None or not d.size:
            tost_p = math.nan
        elif bounds is not None:
            span = float(bounds[1] - bounds[0])
            tost_p = max(
                paired_bounded_p(d, span, -margin, "greater")["p"],
                paired_bounded_p(d, span, margin, "less")["p"],
            )
        else:
            tost_p = tost_equivalence(d, margin, alpha)["p"]
        nan = math.nan
        rows.append(
            {
                **dict(zip(by, key, strict=True)),
                "n": int(d.size),
                "mean_method": float(m.mean()) if d.size else nan,
                "mean_reference": float(r.mean()) if d.size else nan,
                "mean_diff": float(d.mean()) if d.size else nan,
                "ci_low": ci_low,
                "ci_high": ci_high,
                "p_value": sign_flip_test(d, rng=rng) if d.size else nan,
                "tost_p": tost_p,
                "cohens_dz": cohens_dz(d),
                "win_rate": win_rate(d),
            }
        )
    out = pd.DataFrame(rows, columns=[*by, *COMPARE_COLUMNS])
    if out.empty:
        return out
    out["p_holm"], _ = holm(out["p_value"].to_numpy(dtype=float), alpha)
    out["verdict"] = [
        verdict(r.p_holm, r.ci_low, r.ci_high, r.tost_p, alpha)
        for r in out[["p_holm", "ci_low", "ci_high", "tost_p"]].itertuples()
    ]
    out.attrs.update(
        {"metric": metric, "reference": reference, "higher_is_better": higher_is_better, "alpha": alpha}
    )
    return out
