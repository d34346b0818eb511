import math

import numpy as np
import pytest

from kvbench.stats import (
    n_for_difference,
    n_for_equivalence,
    n_for_noninferiority,
    n_from_pilot,
    n_normal,
    power_difference,
    power_equivalence,
    sign_flip_test,
    tost_equivalence,
)


def test_normal_formula_by_hand():
    # (z_0.95 + z_0.80)^2 / 0.5^2 = (1.644854 + 0.841621)^2 * 4
    assert n_normal(0.5, 1.0) == pytest.approx((1.644854 + 0.841621) ** 2 * 4, rel=1e-5)
    # two-sided: z_0.975 = 1.959964
    assert n_normal(0.5, 1.0, two_sided=True) == pytest.approx((1.959964 + 0.841621) ** 2 * 4, rel=1e-5)
    # n scales with (sd / delta)^2
    assert n_normal(0.2, 2.0) == pytest.approx(100 * n_normal(1.0, 1.0))
    assert math.isinf(n_normal(0.0, 1.0))


@pytest.mark.parametrize(
    "delta, alternative, expected",
    # Published paired t-test sizes (standardized effect delta/sd, alpha 0.05, power 0.8):
    # d=0.5 one-sided 27, two-sided 34; d=1 one-sided 8.
    [(0.5, "greater", 27), (0.5, "two-sided", 34), (1.0, "greater", 8), (-0.5, "less", 27)],
)
def test_t_sizes_exceed_the_normal_approximation_by_a_few_pairs(delta, alternative, expected):
    n = n_for_difference(delta, 1.0, alternative=alternative)
    assert n == expected
    approx = n_normal(abs(delta), 1.0, two_sided=alternative == "two-sided")
    assert approx < n <= math.ceil(approx) + 3
    # smallest such n: one pair fewer falls short of the power
    assert power_difference(delta, 1.0, n, alternative=alternative) >= 0.8
    assert power_difference(delta, 1.0, n - 1, alternative=alternative) < 0.8


def test_sizes_are_infinite_when_the_effect_points_the_other_way():
    assert math.isinf(n_for_difference(-0.3, 1.0, alternative="greater"))
    assert math.isinf(n_for_difference(0.0, 1.0, alternative="two-sided"))
    assert math.isinf(n_for_noninferiority(0.1, 1.0, true_diff=-0.2))
    assert math.isinf(n_for_equivalence(0.1, 1.0, true_diff=0.15))
    assert n_for_difference(0.1, 0.0) == 2  # no spread: two pairs decide


def test_equivalence_against_normal_approximation():
    # theta = 0: n ~ ((z_{1-a} + z_{1-b/2}) sd / margin)^2 = ((1.6449 + 1.2816) / 0.5)^2 = 34.3
    n = n_for_equivalence(0.5, 1.0)
    normal = ((1.644854 + 1.281552) / 0.5) ** 2
    assert normal < n <= math.ceil(normal) + 3
    # a true difference inside the margin costs pairs
    assert n_for_equivalence(0.5, 1.0, true_diff=0.1) > n
    assert n_for_noninferiority(0.5, 1.0, true_diff=0.0) == n_for_difference(0.5, 1.0)


def test_sign_flip_power_by_simulation_matches_the_plan():
    """At the planned n the exact sign-flip test rejects in about 80 % of simulated pilots."""
    n = n_for_difference(1.0, 1.0)
    assert n == 8
    rng = np.random.default_rng(12)
    reps = 1500
    hits = sum(sign_flip_test(rng.normal(1.0, 1.0, n), alternative="greater") < 0.05 for _ in range(reps))
    # The randomization test is discrete (256 sign patterns), so a little below the t-test's power.
    assert 0.72 <= hits / reps <= 0.86
    # and clearly short of it with half the pairs
    short = sum(sign_flip_test(rng.normal(1.0, 1.0, 4), alternative="greater") < 0.05 for _ in range(reps))
    assert short / reps < 0.5


def test_tost_power_by_simulation_matches_the_plan():
    margin, sd = 0.5, 1.0
    n = n_for_equivalence(margin, sd)
    rng = np.random.default_rng(7)
    reps = 2000
    hits = sum(tost_equivalence(rng.normal(0.0, sd, n), margin)["equivalent"] for _ in range(reps))
    assert abs(hits / reps - power_equivalence(margin, sd, n)) < 0.04
    assert hits / reps >= 0.76


def test_n_from_pilot_uses_the_pilots_mean_and_spread():
    pilot = np.array([0.3, -0.1, 0.5, 0.2, 0.1, 0.4, 0.0, 0.2])
    sd, mean = pilot.std(ddof=1), pilot.mean()
    assert n_from_pilot(pilot, "greater") == n_for_difference(mean, sd)
    assert n_from_pilot(pilot, "equivalence", margin=0.5) == n_for_equivalence(0.5, sd, mean)
    assert n_from_pilot(pilot, "noninferiority", margin=0.1) == n_for_noninferiority(0.1, sd, mean)
    assert n_from_pilot(-pilot - 0.2, "inferiority", margin=0.1) == n_for_difference(
        -mean - 0.2 + 0.1, sd, alternative="less"
    )
    assert math.isnan(n_from_pilot([0.1], "greater"))
    with pytest.raises(ValueError, match="margin"):
        n_from_pilot(pilot, "equivalence")


def test_min_pairs_sign_flip_is_where_the_exact_test_first_can_reject():
    """2**-n is the smallest one-sided sign-flip p-value with n nonzero differences."""
    from kvbench.stats import min_pairs_sign_flip, sign_flip_test

    for alpha, expected in ((0.05, 5), (0.05 / 3, 6), (0.05 / 4, 7), (0.01, 7)):
        n = min_pairs_sign_flip(alpha)
        assert n == expected
        assert 2.0**-n < alpha <= 2.0 ** -(n - 1)
    # the test itself: n - 1 all-positive pairs cannot reach alpha = 0.05 / 3, n can
    n = min_pairs_sign_flip(0.05 / 3)
    assert sign_flip_test([1.0] * (n - 1), alternative="greater") >= 0.05 / 3
    assert sign_flip_test([1.0] * n, alternative="greater") < 0.05 / 3
