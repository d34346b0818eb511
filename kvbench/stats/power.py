"""Sample sizes for paired comparisons: how many (sample_id, seed) pairs a claim needs.

The unit is the paired difference ``d = method - reference`` (``kvbench.stats.paired``), with
standard deviation ``sd`` estimated from a pilot (the runs already stored). Each function gives the
smallest number of pairs n at which a test at level ``alpha`` reaches the requested ``power``:

- ``n_for_difference``: the paired t-test (one- or two-sided) detecting a true mean difference
  ``delta``. The power is exact for normal differences: under the alternative the statistic
  ``mean / (sd / sqrt(n))`` is noncentral t with n - 1 degrees of freedom and noncentrality
  ``delta * sqrt(n) / sd``. The sign-flip test that ``kvbench.stats`` runs is a randomization test
  of the same mean and has asymptotically the same power (Lehmann & Romano, *Testing Statistical
  Hypotheses*, ch. 17), so the t-test n is the planning figure for it too.
- ``n_for_noninferiority``: one-sided test that the mean exceeds ``-margin`` (the lower half of
  TOST), i.e. ``n_for_difference`` with the distance ``true_diff + margin``.
- ``n_for_equivalence``: TOST (Schuirmann 1987) within ``(-margin, +margin)``. Its power is taken as
  ``P(reject lower) + P(reject upper) - 1`` with each one-sided probability from the noncentral t:
  a lower bound on the probability that both reject, tight whenever the power is useful (the two
  rejection events then nearly cover the sample space).

``n_normal`` is the textbook normal approximation ``((z_{1-a} + z_{1-b}) * sd / delta)^2`` (two-sided:
``z_{1-a/2}``), which the t-based figures exceed by a few pairs at small n. ``n_from_pilot`` applies
the right one of these to a pilot's differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

# Past this many pairs the answer is "more than can be run": reported as infinity.
N_MAX = 10_000_000


def _check(alpha: float, power: float, sd: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not 0 < power < 1:
        raise ValueError(f"power must lie in (0, 1), got {power}")
    if not sd >= 0 or math.isinf(sd):
        raise ValueError(f"sd must be finite and non-negative, got {sd}")


def power_difference(
    delta: float, sd: float, n: int, alpha: float = 0.05, alternative: str = "greater"
) -> float:
    """Power of the paired t-test with n pairs when the true mean difference is ``delta``.

    ``alternative``: ``"greater"`` (H1: mean > 0), ``"less"`` (mean < 0) or ``"two-sided"``. With
    ``sd == 0`` the test is decided by the sign of ``delta`` alone (power 1 or 0)."""
    if n < 2:
        return 0.0
    if alternative == "less":
        delta, alternative = -delta, "greater"
    if sd == 0:
        hit = delta > 0 if alternative == "greater" else delta != 0
        return 1.0 if hit else 0.0
    df, nc = n - 1, delta * math.sqrt(n) / sd
    if alternative == "greater":
        return float(sps.nct.sf(sps.t.ppf(1 - alpha, df), df, nc))
    if alternative == "two-sided":
        crit = sps.t.ppf(1 - alpha / 2, df)
        return float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))
    raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided', got {alternative!r}")


def power_equivalence(margin: float, sd: float, n: int, true_diff: float = 0.0, alpha: float = 0.05) -> float:
    """Power of paired TOST within ``(-margin, margin)`` with n pairs and true mean ``true_diff``
    (the lower bound described in the module docstring; 0 when it is negative)."""
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    if n < 2:
        return 0.0
    if sd == 0:
        return 1.0 if abs(true_diff) < margin else 0.0
    df, crit = n - 1, sps.t.ppf(1 - alpha, df=n - 1)
    scale = math.sqrt(n) / sd
    p_lower = sps.nct.sf(crit, df, (true_diff + margin) * scale)
    p_upper = sps.nct.cdf(-crit, df, (true_diff - margin) * scale)
    return float(max(0.0, p_lower + p_upper - 1.0))


def _smallest_n(power_at, target: float) -> float:
    """The smallest n >= 2 with ``power_at(n) >= target``, for power increasing in n: doubling to
    bracket it, then bisection. ``math.inf`` when even ``N_MAX`` pairs fall short."""
    if power_at(2) >= target:
        return 2
    low, high = 2, 4
    while power_at(high) < target:
        low, high = high, high * 2
        if high > N_MAX:
            return math.inf
    while high - low > 1:
        mid = (low + high) // 2
        if power_at(mid) >= target:
            high = mid
        else:
            low = mid
    return high


def n_for_difference(
    delta: float, sd: float, alpha: float = 0.05, power: float = 0.8, alternative: str = "greater"
) -> float:
    """Pairs needed for the paired t-test to detect a true mean difference ``delta`` (see the module
    docstring). ``math.inf`` when ``delta`` is 0 or points away from a one-sided alternative."""
    _check(alpha, power, sd)
    sign = -1.0 if alternative == "less" else 1.0
    if delta == 0 or (alternative != "two-sided" and sign * delta < 0):
        return math.inf
    return _smallest_n(lambda n: power_difference(delta, sd, n, alpha, alternative), power)


def n_for_noninferiority(
    margin: float, sd: float, true_diff: float = 0.0, alpha: float = 0.05, power: float = 0.8
) -> float:
    """Pairs needed to show ``mean > -margin`` (one-sided, level alpha) when the true mean is
    ``true_diff``; ``math.inf`` when ``true_diff <= -margin`` (then it is not true)."""
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    return n_for_difference(true_diff + margin, sd, alpha, power, "greater")


def n_for_equivalence(
    margin: float, sd: float, true_diff: float = 0.0, alpha: float = 0.05, power: float = 0.8
) -> float:
    """Pairs needed for TOST to show equivalence within ``margin`` when the true mean is
    ``true_diff``; ``math.inf`` when ``|true_diff| >= margin``."""
    _check(alpha, power, sd)
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    if abs(true_diff) >= margin:
        return math.inf
    return _smallest_n(lambda n: power_equivalence(margin, sd, n, true_diff, alpha), power)


def n_normal(
    delta: float, sd: float, alpha: float = 0.05, power: float = 0.8, two_sided: bool = False
) -> float:
    """The normal-approximation sample size ``((z_{1-a} + z_{1-b}) * sd / delta)^2``, unrounded
    (``z_{1-a/2}`` when ``two_sided``); ``math.inf`` for ``delta == 0``."""
    _check(alpha, power, sd)
    if delta == 0:
        return math.inf
    z_a = sps.norm.ppf(1 - alpha / 2 if two_sided else 1 - alpha)
    return float(((z_a + sps.norm.ppf(power)) * sd / delta) ** 2)


def min_pairs_sign_flip(alpha: float) -> int:
    """The fewest pairs at which the exact one-sided sign-flip test can reject at all: its smallest
    p-value is ``2 ** -n`` (every nonzero difference on the claimed side), so ``n`` must exceed
    ``log2(1 / alpha)`` (5 pairs at 0.05; 6 at 0.05 / 3, Holm's first step in a family of three).
    A t-test plan below this floor promises a power the test cannot have."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    return math.floor(math.log2(1 / alpha)) + 1


def min_p_sign_flip(n: int, family: int = 1, two_sided: bool = False) -> float:
    """The smallest Holm-adjusted p-value the sign-flip test of ``kvbench.stats.paired`` can give
    with ``n`` nonzero pairs in a family of ``family`` tests: exact enumeration (n <= 20) gives at
    best ``2 ** -n`` one-sided, ``2 ** (1 - n)`` two-sided; past 20 pairs the Monte Carlo p is at
    least ``1 / (B + 1)`` with B = 10000 resamples. Holm multiplies the smallest p by the family
    size, and when every member is at that floor each adjusted p is ``family`` times it. A rule
    whose floor is not below alpha can never reject, whatever the data (1.0 for n < 1)."""
    from kvbench.stats.paired import DEFAULT_RESAMPLES, EXACT_MAX_N

    if n < 1:
        return 1.0
    if n <= EXACT_MAX_N:
        floor = 2.0 ** (-n) * (2.0 if two_sided else 1.0)
    else:
        floor = 1.0 / (DEFAULT_RESAMPLES + 1)
    return min(1.0, family * floor)


def min_n_sign_flip(alpha: float, family: int = 1, two_sided: bool = False) -> int:
    """The fewest pairs at which ``min_p_sign_flip`` falls below ``alpha`` (9 for a two-sided test
    on a 7-point Holm grid at 0.05: 7 x 2 / 2**9 = 0.027)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    n = 1
    while min_p_sign_flip(n, family, two_sided) >= alpha:
        n += 1
        if n > 10_000:
            return math.inf
    return n


def n_from_pilot(
    diffs: Sequence[float] | np.ndarray,
    kind: str,
    margin: float | None = None,
    alpha: float = 0.05,
    power: float = 0.8,
    delta: float | None = None,
) -> float:
    """Pairs needed to settle a question, planned from a pilot's paired differences ``diffs`` (shape
    ``[n_pairs]``): ``sd`` is their sample standard deviation (ddof 1) and the assumed true mean
    is their mean unless ``delta`` is given.

    ``kind``: ``"greater"`` / ``"less"`` (detect a mean above / below 0), ``"noninferiority"``
    (mean above ``-margin``), ``"inferiority"`` (mean below ``-margin``: the claim refuted),
    ``"equivalence"`` (within ``margin``). NaN for fewer than 2 pairs (no variance to plan from).
    """
    d = np.asarray(diffs, dtype=float).ravel()
    if d.size < 2:
        return math.nan
    sd, mean = float(d.std(ddof=1)), float(d.mean()) if delta is None else float(delta)
    if kind in ("greater", "less"):
        return n_for_difference(mean, sd, alpha, power, kind)
    if margin is None or not margin > 0:
        raise ValueError(f"kind={kind!r} needs a positive margin, got {margin}")
    if kind == "noninferiority":
        return n_for_noninferiority(margin, sd, mean, alpha, power)
    if kind == "inferiority":
        return n_for_difference(mean + margin, sd, alpha, power, "less")
    if kind == "equivalence":
        return n_for_equivalence(margin, sd, mean, alpha, power)
    raise ValueError(f"unknown kind {kind!r}")
