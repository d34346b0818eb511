"""Paired comparisons of a method against the FP16 reference.

Every method is run on the same samples and seeds as the reference, so each (sample_id, seed) gives
one pair and the unit of analysis is the per-pair difference ``d = method - reference`` (sign
flipped for lower-is-better metrics, so that ``d > 0`` always means the method did better). Pairing
removes the between-sample variance, which is far larger than the method effect on most tasks.

Tests: ``sign_flip_test`` (exact or Monte Carlo randomization test of the mean difference),
``mcnemar_test`` (binary outcomes), ``tost_equivalence`` / ``tost_bootstrap`` (equivalence within a
margin), ``bootstrap_ci`` (percentile or BCa interval of a statistic of the differences) and
``holm`` (family-wise error control). ``kvbench.stats.compare`` runs them on a results table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats as sps

PAIR_KEYS = ("sample_id", "seed")
ALTERNATIVES = ("two-sided", "greater", "less")

# Exact sign-flip enumeration is 2**n sums: 2**20 floats is 8 MB and well under a second.
EXACT_MAX_N = 20
DEFAULT_RESAMPLES = 10_000
# Resampling matrices are built in chunks of at most this many elements, to bound memory.
_CHUNK_ELEMENTS = 2_000_000


# --------------------------------------------------------------------------------------- pairing


def _sort_keys(keys: set) -> list:
    """Keys in a deterministic order (natural order when comparable, else by repr)."""
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=repr)


def aligned_pairs(
    method_scores: Mapping[Hashable, Any], reference_scores: Mapping[Hashable, Any]
) -> tuple[list, np.ndarray, np.ndarray]:
    """The shared keys in sorted order and the two score arrays aligned on them.

    Raises ValueError naming the keys present on one side only: a paired design with holes is not
    paired, and silently dropping pairs would bias the comparison toward the samples that ran.
    """
    only_method = set(method_scores) - set(reference_scores)
    only_reference = set(reference_scores) - set(method_scores)
    if only_method or only_reference:
        parts = []
        if only_reference:
            parts.append(f"missing from the method: {_sort_keys(only_reference)[:20]}")
        if only_method:
            parts.append(f"missing from the reference: {_sort_keys(only_method)[:20]}")
        n_bad = len(only_method) + len(only_reference)
        raise ValueError(f"paired keys differ ({n_bad} unmatched); " + "; ".join(parts))
    keys = _sort_keys(set(method_scores))
    method = np.array([method_scores[k] for k in keys], dtype=float)
    reference = np.array([reference_scores[k] for k in keys], dtype=float)
    return keys, method, reference


def paired_differences(
    method_scores: Mapping[Hashable, float], reference_scores: Mapping[Hashable, float]
) -> np.ndarray:
    """``method - reference`` for every key (normally (sample_id, seed)), in sorted key order.

    Both mappings must hold exactly the same keys; otherwise ValueError lists the missing ones.
    """
    _, method, reference = aligned_pairs(method_scores, reference_scores)
    return method - reference


def _as_diffs(diffs: Sequence[float] | np.ndarray) -> np.ndarray:
    """A 1-D float array of finite differences (NaN/inf would silently poison every statistic)."""
    d = np.asarray(diffs, dtype=float).ravel()
    if not np.all(np.isfinite(d)):
        raise ValueError("differences must be finite (got NaN or inf)")
    return d


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


# ------------------------------------------------------------------------------------- bootstrap


def _apply_stat(stat: Callable, samples: np.ndarray) -> np.ndarray:
    """``stat`` of each row of ``samples``: vectorized via ``axis=-1`` when ``stat`` accepts it."""
    try:
        out = np.asarray(stat(samples, axis=-1), dtype=float)
    except TypeError:
        out = np.array([stat(row) for row in samples], dtype=float)
    if out.shape != samples.shape[:1]:
        raise ValueError("stat must reduce a 1-D sample to a scalar")
    return out


def _bootstrap_distribution(
    d: np.ndarray, stat: Callable, n_resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """``stat`` of ``n_resamples`` resamples of ``d`` drawn with replacement (pairs stay intact)."""
    n = d.size
    chunk = max(1, _CHUNK_ELEMENTS // n)
    out = np.empty(n_resamples)
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = _apply_stat(stat, d[idx])
    return out


def _jackknife(d: np.ndarray, stat: Callable) -> np.ndarray:
    """``stat`` of each leave-one-out sample: entry i leaves out ``d[i]``."""
    n = d.size
    chunk = max(1, _CHUNK_ELEMENTS // n)
    cols = np.arange(n - 1)
    out = np.empty(n)
    for start in range(0, n, chunk):
        rows = np.arange(start, min(start + chunk, n))[:, None]
        # Row i takes indices 0..i-1 and i+1..n-1: shift every column at or past i by one.
        out[rows[:, 0]] = _apply_stat(stat, d[cols + (cols >= rows)])
    return out


def _bca_levels(
    d: np.ndarray, stat: Callable, theta_hat: float, boot: np.ndarray, level: float
) -> tuple[float, float]:
    """BCa quantile levels (Efron 1987) for a two-sided ``level`` interval.

    Bias correction ``z0 = Phi^-1(#{boot < theta} / B + #{boot == theta} / (2B))``; acceleration
    ``a = sum(u^3) / (6 * sum(u^2)^1.5)`` with ``u_i = mean(jackknife) - jackknife_i``; the levels are
    ``Phi(z0 + (z0 + z) / (1 - a (z0 + z)))`` for ``z = Phi^-1(alpha/2)`` and ``Phi^-1(1 - alpha/2)``.
    """
    share = (np.sum(boot < theta_hat) + 0.5 * np.sum(boot == theta_hat)) / boot.size
    z0 = sps.norm.ppf(share)
    jack = _jackknife(d, stat)
    u = jack.mean() - jack
    denom = np.sum(u**2) ** 1.5
    # All leave-one-out values equal: no skewness to correct for.
    a = np.sum(u**3) / (6.0 * denom) if denom > 0 else 0.0
    tail = (1.0 - level) / 2.0
    levels = []
    for z in (sps.norm.ppf(tail), sps.norm.ppf(1.0 - tail)):
        levels.append(sps.norm.cdf(z0 + (z0 + z) / (1.0 - a * (z0 + z))))
    return levels[0], levels[1]


def bootstrap_ci(
    diffs: Sequence[float] | np.ndarray,
    stat: Callable = np.mean,
    level: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    rng: np.random.Generator | int | None = None,
    method: str = "percentile",
) -> tuple[float, float]:
    """Two-sided paired-bootstrap confidence interval ``(low, high)`` for ``stat`` of the differences.

    Resamples the n pair differences with replacement ``n_resamples`` times (resampling differences
    is resampling pairs) and computes ``stat`` of each resample. ``method="percentile"`` returns the
    ``(1-level)/2`` and ``(1+level)/2`` quantiles of that distribution (linear interpolation);
    ``method="bca"`` returns the bias-corrected and accelerated quantiles (see ``_bca_levels``).
    ``stat`` should accept ``axis=`` like the numpy reductions (otherwise it is looped per resample).

    Returns ``(nan, nan)`` for fewer than 2 pairs, where a resample can only repeat the one value,
    and ``(nan, nan)`` for BCa when ``stat`` of the data lies outside the bootstrap distribution.
    """
    if method not in ("percentile", "bca"):
        raise ValueError(f"method must be 'percentile' or 'bca', got {method!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = _as_diffs(diffs)
    if d.size < 2:
        return math.nan, math.nan
    boot = _bootstrap_distribution(d, stat, int(n_resamples), _rng(rng))
    if np.all(boot == boot[0]):
        # Degenerate distribution (e.g. all differences equal): every quantile is that value.
        return float(boot[0]), float(boot[0])
    if method == "percentile":
        lo_q, hi_q = (1.0 - level) / 2.0, (1.0 + level) / 2.0
    else:
        theta_hat = float(_apply_stat(stat, d[None, :])[0])
        lo_q, hi_q = _bca_levels(d, stat, theta_hat, boot, level)
        if not (np.isfinite(lo_q) and np.isfinite(hi_q)):
            return math.nan, math.nan
    low, high = np.quantile(boot, [lo_q, hi_q])
    return float(low), float(high)


# ------------------------------------------------------------------------------------- sign flip


def _tail_share(null_sums: np.ndarray, observed: float, alternative: str, tol: float) -> int:
    """How many null sums are at least as extreme as ``observed`` (ties within ``tol`` count)."""
    if alternative == "greater":
        return int(np.count_nonzero(null_sums >= observed - tol))
    if alternative == "less":
        return int(np.count_nonzero(null_sums <= observed + tol))
    return int(np.count_nonzero(np.abs(null_sums) >= abs(observed) - tol))


def _all_sign_sums(d: np.ndarray) -> np.ndarray:
    """The 2**n sums ``sum_i s_i d_i`` over every sign vector s in {-1, +1}^n."""
    sums = np.zeros(1)
    for x in d:
        sums = np.concatenate([sums + x, sums - x])
    return sums


def sign_flip_test(
    diffs: Sequence[float] | np.ndarray,
    n_resamples: int | None = None,
    rng: np.random.Generator | int | None = None,
    alternative: str = "two-sided",
) -> float:
    """Paired randomization (sign-flip) test p-value for the mean difference.

    Under H0 (method and reference exchangeable within each pair) every difference is equally
    likely to carry either sign. The statistic is the mean difference ``T = mean(d)``; the p-value
    is the share of sign assignments with ``T* >= T`` ("greater": method better), ``T* <= T``
    ("less") or ``|T*| >= |T|`` ("two-sided").

    Zero differences are dropped first: flipping a zero changes no statistic, so they leave the
    p-value unchanged and only double the work. With n nonzero differences:
    ``n_resamples=None`` and n <= 20 enumerates all 2**n assignments exactly; otherwise ``n_resamples``
    (default 10000) random assignments give ``p = (b + 1) / (m + 1)``, b of the m being at least as
    extreme, which counts the observed assignment and so never returns 0 (Phipson & Smyth 2010).
    Ties are judged with a tolerance of 1e-9 * sum|d| against summation rounding.
    Returns 1.0 when every difference is zero.
    """
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    d = _as_diffs(diffs)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    # mean is sum / n with n fixed across assignments, so comparing sums is the same test.
    observed = float(d.sum())
    tol = 1e-9 * float(np.abs(d).sum())
    if n_resamples is None and d.size <= EXACT_MAX_N:
        null = _all_sign_sums(d)
        return _tail_share(null, observed, alternative, tol) / null.size
    m = DEFAULT_RESAMPLES if n_resamples is None else int(n_resamples)
    gen = _rng(rng)
    chunk = max(1, _CHUNK_ELEMENTS // d.size)
    extreme = 0
    for start in range(0, m, chunk):
        size = min(chunk, m - start)
        signs = gen.integers(0, 2, size=(size, d.size)) * 2 - 1
        extreme += _tail_share(signs @ d, observed, alternative, tol)
    return (extreme + 1) / (m + 1)


# --------------------------------------------------------------------------------------- McNemar


def mcnemar_test(
    method_correct: Sequence[bool] | Mapping[Hashable, bool],
    reference_correct: Sequence[bool] | Mapping[Hashable, bool],
    exact: bool = True,
) -> tuple[float, float]:
    """McNemar's test for paired binary outcomes; returns ``(statistic, p)``, two-sided.

    Only discordant pairs carry information: ``b`` = reference right and method wrong, ``c`` = method
    right and reference wrong. ``exact=True``: statistic ``min(b, c)`` and
    ``p = min(1, 2 * P(X <= min(b, c)))`` with ``X ~ Binomial(b + c, 1/2)``. ``exact=False``:
    statistic ``max(|b - c| - 1, 0)^2 / (b + c)`` (continuity-corrected; clamped at 0 so the
    correction never overshoots when b == c) referred to chi-square with 1 degree of freedom.
    Inputs are aligned sequences, or mappings keyed by (sample_id, seed) aligned like
    ``paired_differences``. With no discordant pairs, returns ``(0.0, 1.0)``.
    """
    if isinstance(method_correct, Mapping) and isinstance(reference_correct, Mapping):
        _, m, r = aligned_pairs(method_correct, reference_correct)
        m, r = m.astype(bool), r.astype(bool)
    else:
        m = np.asarray(method_correct, dtype=bool).ravel()
        r = np.asarray(reference_correct, dtype=bool).ravel()
        if m.shape != r.shape:
            raise ValueError(f"outcome arrays differ in length: {m.size} vs {r.size}")
    b = int(np.count_nonzero(r & ~m))
    c = int(np.count_nonzero(m & ~r))
    if b + c == 0:
        return 0.0, 1.0
    if exact:
        k = min(b, c)
        return float(k), float(min(1.0, 2.0 * sps.binom.cdf(k, b + c, 0.5)))
    statistic = max(abs(b - c) - 1, 0) ** 2 / (b + c)
    return float(statistic), float(sps.chi2.sf(statistic, df=1))


# ------------------------------------------------------------------------------------------ TOST


def tost_equivalence(
    diffs: Sequence[float] | np.ndarray, margin: float, alpha: float = 0.05
) -> dict[str, float | bool]:
    """Two one-sided paired t-tests (TOST) for equivalence within ``(-margin, +margin)``.

    With mean difference m, standard error ``se = sd(d, ddof=1) / sqrt(n)`` and n - 1 degrees of
    freedom: ``p_lower = P(T >= (m + margin) / se)`` tests H0 ``mean <= -margin``; ``p_upper =
    P(T <= (m - margin) / se)`` tests H0 ``mean >= +margin``. ``p = max(p_lower, p_upper)`` and
    ``equivalent = p < alpha`` (both nulls rejected). Equivalent to the ``1 - 2 alpha`` t interval
    lying inside the margins. With zero spread (every pair differs by the same amount) there is no
    t statistic, and none is computed: every p is NaN and ``equivalent`` is False (a tie says
    nothing about the pairs not run; ``kvbench.stats.exact`` has the tests for bounded scores);
    likewise with fewer than 2 pairs.
    """
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    d = _as_diffs(diffs)
    n = d.size
    if n < 2:
        return {"p_lower": math.nan, "p_upper": math.nan, "p": math.nan, "equivalent": False}
    mean = float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0:
        return {"p_lower": math.nan, "p_upper": math.nan, "p": math.nan, "equivalent": False}
    p_lower = float(sps.t.sf((mean + margin) / se, df=n - 1))
    p_upper = float(sps.t.cdf((mean - margin) / se, df=n - 1))
    p = max(p_lower, p_upper)
    return {"p_lower": p_lower, "p_upper": p_upper, "p": p, "equivalent": bool(p < alpha)}


def tost_bootstrap(
    diffs: Sequence[float] | np.ndarray,
    margin: float,
    alpha: float = 0.05,
    n_resamples: int = DEFAULT_RESAMPLES,
    rng: np.random.Generator | int | None = None,
) -> dict[str, float | bool]:
    """Bootstrap TOST: the distribution-free counterpart of ``tost_equivalence``.

    From B bootstrap means of the differences (pairs resampled): ``p_lower = (#{mean* <= -margin}
    + 1) / (B + 1)`` and ``p_upper = (#{mean* >= +margin} + 1) / (B + 1)``; ``p`` is their max and
    ``equivalent = p < alpha``, which is (up to the +1) the ``1 - 2 alpha`` percentile interval lying
    inside the margins. Also returns that interval as ``ci_low``/``ci_high``. Needs 2 or more pairs.
    """
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    d = _as_diffs(diffs)
    if d.size < 2:
        nan = math.nan
        return {"p_lower": nan, "p_upper": nan, "p": nan, "equivalent": False, "ci_low": nan, "ci_high": nan}
    boot = _bootstrap_distribution(d, np.mean, int(n_resamples), _rng(rng))
    b = boot.size
    p_lower = (np.count_nonzero(boot <= -margin) + 1) / (b + 1)
    p_upper = (np.count_nonzero(boot >= margin) + 1) / (b + 1)
    p = max(p_lower, p_upper)
    ci_low, ci_high = np.quantile(boot, [alpha, 1.0 - alpha])
    return {
        "p_lower": float(p_lower),
        "p_upper": float(p_upper),
        "p": float(p),
        "equivalent": bool(p < alpha),
        "ci_low": float(ci_low),
        "ci_high": float(ci_high),
    }


# ------------------------------------------------------------------------------------------ Holm


def holm(pvalues: Sequence[float] | np.ndarray, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm-Bonferroni step-down adjustment; returns ``(adjusted, reject)`` in the input order.

    With the m p-values sorted ascending, ``adjusted_(i) = min(1, max_{j <= i} (m - j + 1) p_(j))``
    (1-based ranks), which keeps the adjusted values monotone in the raw ones; ``reject`` is
    ``adjusted <= alpha``, equivalent to Holm's rule of rejecting H_(1..i) while
    ``p_(j) <= alpha / (m - j + 1)``. NaN p-values are left out of the family (m counts the others);
    their adjusted value is NaN and they are not rejected.
    """
    p = np.asarray(pvalues, dtype=float).ravel()
    adjusted = np.full(p.shape, np.nan)
    valid = np.flatnonzero(~np.isnan(p))
    m = valid.size
    if m:
        order = valid[np.argsort(p[valid], kind="stable")]
        scaled = (m - np.arange(m)) * p[order]
        adjusted[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    reject = np.zeros(p.shape, dtype=bool)
    reject[valid] = adjusted[valid] <= alpha
    return adjusted, reject


# ---------------------------------------------------------------------------------- effect sizes


def cohens_dz(diffs: Sequence[float] | np.ndarray) -> float:
    """Cohen's d_z: ``mean(d) / sd(d, ddof=1)``, the standardized mean of the paired differences.

    NaN for fewer than 2 pairs or when every difference is zero; +/-inf when the differences are
    a nonzero constant (an effect with no spread).
    """
    d = _as_diffs(diffs)
    if d.size < 2:
        return math.nan
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0:
        return math.nan if mean == 0 else math.copysign(math.inf, mean)
    return mean / sd


def win_rate(diffs: Sequence[float] | np.ndarray) -> float:
    """``P(d > 0) + 0.5 * P(d = 0)`` over the pairs: the share of pairs the method wins, ties halved.

    0.5 means no tendency either way, 1 that the method wins every pair; NaN for no pairs.
    """
    d = _as_diffs(diffs)
    if d.size == 0:
        return math.nan
    return float((np.count_nonzero(d > 0) + 0.5 * np.count_nonzero(d == 0)) / d.size)
