"""Exact, tie-aware tests of ``kvbench.stats.exact`` against scipy and hand cases."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from kvbench.stats.exact import (
    anderson_bounds,
    benjamini_hochberg,
    binomial_side_p,
    bounded_mean_p,
    clopper_pearson,
    n_for_binomial_side,
    paired_bounded_p,
)


@pytest.mark.parametrize("k, n", [(0, 6), (3, 10), (10, 10), (7, 44)])
def test_clopper_pearson_is_scipys_exact_interval(k, n):
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
    assert clopper_pearson(k, n, 0.05) == pytest.approx((ci.low, ci.high))


def test_all_ties_still_allow_a_share_of_losses():
    # six tied pairs: up to 39 % of samples may still differ (1 - 0.05 ** (1 / 6))
    assert clopper_pearson(0, 6, 0.05)[1] == pytest.approx(1 - 0.05 ** (1 / 6))
    res = paired_bounded_p(np.zeros(6), 1.0, -0.1, "greater")
    assert res["p"] == pytest.approx(0.9**6) and res["p"] > 0.05
    assert binomial_side_p(0, 29, 0.1) < 0.05 < binomial_side_p(0, 28, 0.1)
    assert n_for_binomial_side(0.0, 0.1, 0.05, 0.8) == 29


def test_no_p_is_zero_for_a_constant():
    for values in (np.ones(8), np.full(8, 0.5), np.zeros(3)):
        for side in ("greater", "less"):
            assert bounded_mean_p(values, 0, 1, 0.6, side) > 0


def test_anderson_bounds_cover_the_mean():
    rng = np.random.default_rng(0)
    misses = 0
    for _ in range(300):
        x = rng.beta(0.5, 2.0, 15)
        lower, upper = anderson_bounds(x, 0, 1, 0.05)
        mean = 0.5 / 2.5
        misses += not (lower <= mean <= upper)
    # each side fails at most 5 % of the time, so both together at most about 10 %
    assert misses / 300 <= 0.1


def test_binomial_side_size_holds_at_the_null():
    rng = np.random.default_rng(1)
    n, share = 40, 0.2
    draws = rng.binomial(n, share, 4000)
    size = np.mean([binomial_side_p(int(k), n, share) < 0.05 for k in draws])
    assert size <= 0.05


def test_benjamini_hochberg_hand_case():
    # sorted 0.01, 0.03, 0.04, 0.2 with m = 4: 0.04, 0.06, 0.0533, 0.2 -> step-up min from the top
    adjusted, reject = benjamini_hochberg([0.01, 0.04, 0.03, 0.2, math.nan], q=0.05)
    np.testing.assert_allclose(adjusted[:4], [0.04, 0.16 / 3, 0.16 / 3, 0.2])
    assert math.isnan(adjusted[4])
    assert reject.tolist() == [True, False, False, False, False]
