"""Exact, tie-aware tests for bounded scores, and the page-wide false discovery rate.

A task score such as NIAH recall or GSM8K accuracy lies in a known interval ``[lo, hi]`` (``[0, 1]``)
and, on a few dozen pairs, is mostly tied: both arms at 1.0, or both at 0. A paired t-test there
divides by a spread that is zero or nearly so and returns p = 0 from data that cannot tell the arms
apart. The tests here use the bound instead of the spread and are exact: their level holds for any
distribution on ``[lo, hi]``, at any n, whatever the ties.

- ``binomial_side_p``: the support side of non-inferiority, of each half of an equivalence and of
  a bound on one arm's mean of 0/1 values. A paired difference ``d`` on a metric of range ``R``
  satisfies ``d >= -R * 1{d < 0}``, so ``mean(d) <= -m`` forces the share of pairs the method loses
  to be at least ``m / R``; the exact binomial test (``scipy.stats.binomtest``) of that share is
  then a valid test of ``mean(d) <= -m``. Its inverse is the one-sided Clopper-Pearson bound: with
  every pair tied at n = 6 the losing share may still be 39 %, so a tie proves little.
- ``anderson_bounds``: confidence bounds for the mean of any variable on ``[lo, hi]`` from the
  one-sided Kolmogorov-Smirnov band around the empirical distribution (Anderson 1969;
  ``scipy.stats.ksone`` gives the band's half-width). It uses the size of each difference, where
  the binomial side counts only its sign, and serves the refuting side of a margin rule and the
  bounds on one arm's mean of fractional scores.
- ``trinomial_upper``: for paired 0/1 outcomes (``d`` in ``{-R, 0, R}``), ``mean(d) = R (p+ - p-)``
  bounded from above by Clopper-Pearson bounds on the two discordant shares (McNemar's cells),
  each at ``alpha / 2`` (Bonferroni): the exact refuting side for binary scores.
- ``p_by_inversion``: the p-value of a confidence-bound test, the smallest level at which it rejects.
- ``benjamini_hochberg``: adjusted p-values controlling the false discovery rate across a page.

Every p-value here is exact in the sense that it never falls below the true level; none is computed
from a spread, so none is 0 because the spread is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as sps


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """One-sided ``1 - alpha`` Clopper-Pearson bounds ``(lower, upper)`` on a binomial proportion
    from ``k`` successes in ``n`` trials (each bound alone has level ``1 - alpha``): the beta
    quantiles ``Beta(alpha; k, n - k + 1)`` and ``Beta(1 - alpha; k + 1, n - k)``, which invert the
    exact binomial test. ``(0, 1)`` for ``n == 0``."""
    _check_alpha(alpha)
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"k must lie in [0, n], got k={k}, n={n}")
    lower = 0.0 if k == 0 else float(sps.beta.ppf(alpha, k, n - k + 1))
    upper = 1.0 if k == n else float(sps.beta.ppf(1 - alpha, k + 1, n - k))
    return lower, upper


def binomial_side_p(k: int, n: int, share: float) -> float:
    """Exact p-value for "the true share is below ``share``" from ``k`` of ``n``: ``P(X <= k)`` with
    ``X ~ Binomial(n, share)`` (``scipy.stats.binomtest(..., alternative="less")``). 1.0 when
    ``share <= 0`` (no share is below it) and for ``n == 0``; ``share >= 1`` is rejected unless
    ``k == n``."""
    if n <= 0 or share <= 0:
        return 1.0
    if share >= 1:
        return 1.0 if k >= n else 0.0
    return float(sps.binomtest(int(k), int(n), float(share), alternative="less").pvalue)


def anderson_bounds(
    x: Sequence[float] | np.ndarray, lo: float, hi: float, alpha: float
) -> tuple[float, float]:
    """One-sided ``1 - alpha`` bounds ``(lower, upper)`` on the mean of a variable known to lie in
    ``[lo, hi]``, from the values ``x`` (each bound alone has level ``1 - alpha``).

    With ``c`` the ``1 - alpha`` quantile of the one-sided Kolmogorov-Smirnov statistic at n
    (``scipy.stats.ksone``), the true distribution function F satisfies ``F >= F_n - c`` (and, apart,
    ``F <= F_n + c``) everywhere with probability ``1 - alpha``. Since ``mean = hi - integral of F
    over [lo, hi]``, ``upper = hi - integral of max(0, F_n - c)`` and ``lower = hi - integral of
    min(1, F_n + c)``. Distribution-free and valid at every n; ``(lo, hi)`` for no values.
    """
    _check_alpha(alpha)
    v = np.sort(np.asarray(x, dtype=float).ravel())
    n = v.size
    if n == 0:
        return float(lo), float(hi)
    if v[0] < lo - 1e-12 or v[-1] > hi + 1e-12:
        raise ValueError(f"values must lie in [{lo}, {hi}], got [{v[0]}, {v[-1]}]")
    v = np.clip(v, lo, hi)
    c = float(sps.ksone.ppf(1 - alpha, n))
    # F_n is i / n on [v_(i), v_(i+1)), 0 on [lo, v_(1)), 1 on [v_(n), hi]
    edges = np.concatenate([[lo], v, [hi]])
    widths = np.diff(edges)
    levels = np.arange(n + 1) / n
    upper = hi - float(np.sum(widths * np.maximum(0.0, levels - c)))
    lower = hi - float(np.sum(widths * np.minimum(1.0, levels + c)))
    return lower, upper


def trinomial_upper(k_plus: int, k_minus: int, n: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` upper bound on ``p+ - p-``, the mean of paired 0/1 differences in
    units of the range, from ``k_plus`` pairs the first arm wins and ``k_minus`` it loses of ``n``:
    ``upper(p+) - lower(p-)``, each a Clopper-Pearson bound at ``alpha / 2`` (Bonferroni). Negate
    the roles for the lower bound on ``p+ - p-``: ``-trinomial_upper(k_minus, k_plus, n, alpha)``."""
    _, up_plus = clopper_pearson(k_plus, n, alpha / 2)
    low_minus, _ = clopper_pearson(k_minus, n, alpha / 2)
    return up_plus - low_minus


def p_by_inversion(rejects: Callable[[float], bool], floor: float = 1e-12, steps: int = 60) -> float:
    """The p-value of a test given as confidence bounds: the smallest ``alpha`` at which
    ``rejects(alpha)`` holds, found by bisection on ``log(alpha)`` (``rejects`` must be monotone:
    a test that rejects at some level rejects at every larger one). 1.0 when it does not reject at
    ``alpha`` just below 1, ``floor`` when it rejects already there."""
    if not rejects(1 - 1e-9):
        return 1.0
    if rejects(floor):
        return floor
    low, high = math.log(floor), math.log(1 - 1e-9)
    for _ in range(steps):
        mid = (low + high) / 2
        if rejects(math.exp(mid)):
            high = mid
        else:
            low = mid
    return float(math.exp(high))


def is_binary(values: np.ndarray, lo: float, hi: float) -> bool:
    """Whether every value is one of the two bounds (0/1 scores)."""
    v = np.asarray(values, dtype=float)
    return bool(np.all(np.isclose(v, lo) | np.isclose(v, hi)))


def bounded_mean_p(
    x: Sequence[float] | np.ndarray, lo: float, hi: float, bound: float, alternative: str
) -> float:
    """Exact p-value that the mean of ``x`` (values on ``[lo, hi]``) lies above ``bound``
    (``alternative="greater"``: H0 ``mean <= bound``) or below it (``"less"``: H0 ``mean >= bound``).

    0/1 values: the exact binomial test of the share at ``hi`` against ``(bound - lo) / (hi - lo)``.
    Other values: ``anderson_bounds`` inverted (``p_by_inversion``)."""
    v = np.asarray(x, dtype=float).ravel()
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    if v.size == 0:
        return 1.0
    span = hi - lo
    if is_binary(v, lo, hi):
        k, n = int(np.count_nonzero(np.isclose(v, hi))), int(v.size)
        share = (bound - lo) / span
        if alternative == "greater":
            # H0: share of hi <= s; count of lo is then >= n (1 - s)
            return binomial_side_p(n - k, n, 1 - share)
        return binomial_side_p(k, n, share)
    if alternative == "greater":
        return p_by_inversion(lambda a: anderson_bounds(v, lo, hi, a)[0] > bound)
    return p_by_inversion(lambda a: anderson_bounds(v, lo, hi, a)[1] < bound)


def paired_bounded_p(d: Sequence[float] | np.ndarray, span: float, shift: float, alternative: str) -> dict:
    """Exact p-values for the mean of paired differences ``d`` (oriented: positive = first arm
    better) of a metric whose values span ``span`` (so ``d`` lies in ``[-span, span]``).

    ``alternative="greater"``: H0 ``mean(d) <= shift`` with ``shift < 0`` (non-inferiority at margin
    ``-shift``) is rejected by the binomial side on the losing pairs (``binomial_side_p`` with share
    ``-shift / span``); ``shift >= 0`` (beating a positive bound) by ``anderson_bounds``.
    ``"less"``: H0 ``mean(d) >= shift``; with ``shift > 0`` (the upper half of an equivalence) the
    binomial side on the winning pairs; otherwise (an effect shown below ``shift``) the exact
    refuting side: ``trinomial_upper`` for 0/1 differences, ``anderson_bounds`` otherwise.
    Returns ``{"p": ..., "test": name}``."""
    v = np.asarray(d, dtype=float).ravel()
    n = int(v.size)
    if n == 0:
        return {"p": 1.0, "test": "no pairs"}
    wins, losses = int(np.count_nonzero(v > 0)), int(np.count_nonzero(v < 0))
    binary = bool(np.all(np.isclose(np.abs(v), span) | np.isclose(v, 0)))
    if alternative == "greater" and shift < 0:
        return {"p": binomial_side_p(losses, n, -shift / span), "test": "exact binomial on the losing pairs"}
    if alternative == "less" and shift > 0:
        return {"p": binomial_side_p(wins, n, shift / span), "test": "exact binomial on the winning pairs"}
    if binary:
        if alternative == "less":
            p = p_by_inversion(lambda a: span * trinomial_upper(wins, losses, n, a) < shift)
        else:
            p = p_by_inversion(lambda a: -span * trinomial_upper(losses, wins, n, a) > shift)
        return {"p": p, "test": "Clopper-Pearson on the discordant pairs"}
    if alternative == "less":
        p = p_by_inversion(lambda a: anderson_bounds(v, -span, span, a)[1] < shift)
    else:
        p = p_by_inversion(lambda a: anderson_bounds(v, -span, span, a)[0] > shift)
    return {"p": p, "test": "Anderson (KS band)"}


def n_for_binomial_side(share_true: float, share_null: float, alpha: float, power: float) -> float:
    """The fewest pairs at which ``binomial_side_p`` (H0: share >= ``share_null``) rejects at
    ``alpha`` with probability ``power`` when the true share is ``share_true``: planning for the
    exact support side. ``math.inf`` when ``share_true >= share_null`` or beyond 100000 pairs."""
    _check_alpha(alpha)
    if share_true >= share_null or share_null <= 0:
        return math.inf
    for n in range(1, 100_001):
        # the largest count that still rejects: P(X <= k | share_null) < alpha
        k = int(sps.binom.ppf(alpha, n, share_null))
        while k >= 0 and sps.binom.cdf(k, n, share_null) >= alpha:
            k -= 1
        if k >= 0 and sps.binom.cdf(k, n, share_true) >= power:
            return n
    return math.inf


def benjamini_hochberg(
    pvalues: Sequence[float] | np.ndarray, q: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """Benjamini-Hochberg step-up adjustment; returns ``(adjusted, reject)`` in the input order.

    With the m valid p-values sorted ascending, ``adjusted_(i) = min_{j >= i} min(1, m p_(j) / j)``;
    ``reject`` is ``adjusted <= q``, which controls the expected share of false discoveries among
    the rejections at q for independent or positively dependent tests. NaN p-values are left out
    (m counts the others) and are never rejected."""
    p = np.asarray(pvalues, dtype=float).ravel()
    adjusted = np.full(p.shape, np.nan)
    valid = np.flatnonzero(~np.isnan(p))
    m = valid.size
    if m:
        order = valid[np.argsort(p[valid], kind="stable")]
        scaled = p[order] * m / np.arange(1, m + 1)
        adjusted[order] = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])
    reject = np.zeros(p.shape, dtype=bool)
    reject[valid] = adjusted[valid] <= q
    return adjusted, reject
