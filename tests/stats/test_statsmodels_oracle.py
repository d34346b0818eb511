"""statsmodels as the oracle for kvbench.stats' multiple-comparison corrections and power / sample
size figures. kvbench computes these itself (it does not depend on statsmodels); these tests hold
its numbers to an independent implementation. Skipped where statsmodels is not installed (it is in
the ``dev`` extra)."""

from __future__ import annotations

import math

import numpy as np
import pytest

multitest = pytest.importorskip("statsmodels.stats.multitest")
sm_power = pytest.importorskip("statsmodels.stats.power")

from kvbench.stats import (  # noqa: E402
    holm,
    n_for_difference,
    n_for_equivalence,
    n_for_noninferiority,
    n_normal,
    power_difference,
    power_equivalence,
)
from kvbench.stats.exact import benjamini_hochberg  # noqa: E402

# kvbench's alternative names -> statsmodels'
ALTERNATIVE = {"greater": "larger", "less": "smaller", "two-sided": "two-sided"}


def _families():
    rng = np.random.default_rng(44)
    yield np.array([0.01])
    yield np.array([0.04, 0.01, 0.03, 0.2])  # the worked example of Holm's step-down
    yield np.array([0.01, 0.01, 0.02, 0.02, 0.9])  # ties
    yield np.array([0.0, 1.0, 0.5, 0.049999, 0.05])  # the edges of [0, 1] and of alpha
    for m in (3, 10, 57):
        yield np.concatenate([rng.uniform(0, 0.01, m // 3), rng.uniform(0, 1, m - m // 3)])


@pytest.mark.parametrize("p", list(_families()), ids=lambda p: f"m{len(p)}")
@pytest.mark.parametrize("alpha", [0.05, 0.01, 0.2])
@pytest.mark.parametrize("method, ours", [("holm", holm), ("fdr_bh", benjamini_hochberg)], ids=["holm", "bh"])
def test_corrections_equal_multipletests(p, alpha, method, ours):
    reject_ref, adjusted_ref, _, _ = multitest.multipletests(p, alpha=alpha, method=method)
    adjusted, reject = ours(p, alpha)
    np.testing.assert_allclose(adjusted, adjusted_ref, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(reject, reject_ref)


@pytest.mark.parametrize("method, ours", [("holm", holm), ("fdr_bh", benjamini_hochberg)])
def test_nan_p_values_are_left_out_of_the_family(method, ours):
    # statsmodels takes no NaN; kvbench drops them from the family: the rest must equal the oracle
    # on the family without them
    p = np.array([0.02, np.nan, 0.001, 0.04, np.nan, 0.3])
    adjusted, reject = ours(p, 0.05)
    valid = ~np.isnan(p)
    reject_ref, adjusted_ref, _, _ = multitest.multipletests(p[valid], alpha=0.05, method=method)
    np.testing.assert_allclose(adjusted[valid], adjusted_ref, rtol=1e-12)
    np.testing.assert_array_equal(reject[valid], reject_ref)
    assert np.isnan(adjusted[~valid]).all() and not reject[~valid].any()


@pytest.mark.parametrize("alternative", ["greater", "less", "two-sided"])
@pytest.mark.parametrize("delta, sd, n", [(0.1, 0.3, 20), (0.05, 0.2, 7), (0.4, 1.0, 60), (0.02, 0.5, 300)])
@pytest.mark.parametrize("alpha", [0.05, 0.01])
def test_paired_t_power_equals_ttestpower(delta, sd, n, alpha, alternative):
    signed = -delta if alternative == "less" else delta
    ref = sm_power.TTestPower().power(
        effect_size=signed / sd, nobs=n, alpha=alpha, alternative=ALTERNATIVE[alternative]
    )
    assert power_difference(signed, sd, n, alpha, alternative) == pytest.approx(ref, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("alternative", ["greater", "two-sided"])
@pytest.mark.parametrize("delta, sd", [(0.1, 0.3), (0.5, 1.0), (0.05, 0.4), (1.0, 0.5)])
@pytest.mark.parametrize("power", [0.8, 0.9])
def test_pairs_needed_is_the_oracles_n_rounded_up(delta, sd, power, alternative):
    # statsmodels solves for a real n; kvbench gives the smallest whole n that reaches the power
    nobs = sm_power.TTestPower().solve_power(
        effect_size=delta / sd, alpha=0.05, power=power, alternative=ALTERNATIVE[alternative]
    )
    n = n_for_difference(delta, sd, 0.05, power, alternative)
    assert n == max(2, math.ceil(nobs - 1e-9))


def test_noninferiority_is_the_one_sided_test_at_the_shifted_distance():
    margin, sd, true_diff = 0.1, 0.25, -0.02
    nobs = sm_power.TTestPower().solve_power(
        effect_size=(true_diff + margin) / sd, alpha=0.05, power=0.8, alternative="larger"
    )
    assert n_for_noninferiority(margin, sd, true_diff) == math.ceil(nobs)


@pytest.mark.parametrize(
    "margin, sd, true_diff, n", [(0.1, 0.2, 0.0, 40), (0.1, 0.2, 0.03, 60), (0.2, 0.3, -0.05, 25)]
)
def test_tost_power_from_two_one_sided_ttestpowers(margin, sd, true_diff, n):
    # statsmodels has no power function for the paired TOST; kvbench's is the sum of the two
    # one-sided powers minus one (module docstring), each of which statsmodels computes
    t = sm_power.TTestPower()
    lower = t.power(effect_size=(true_diff + margin) / sd, nobs=n, alpha=0.05, alternative="larger")
    upper = t.power(effect_size=(true_diff - margin) / sd, nobs=n, alpha=0.05, alternative="smaller")
    assert power_equivalence(margin, sd, n, true_diff) == pytest.approx(max(0.0, lower + upper - 1), rel=1e-9)
    need = n_for_equivalence(margin, sd, true_diff)
    assert (
        power_equivalence(margin, sd, need, true_diff)
        >= 0.8
        > power_equivalence(margin, sd, need - 1, true_diff)
    )


@pytest.mark.parametrize("delta, sd", [(0.1, 0.3), (0.5, 1.0), (0.05, 0.4)])
def test_normal_approximation_equals_normalindpower_one_sample(delta, sd):
    # ratio=0: NormalIndPower's one-sample case. One-sided, the two formulas are the same.
    ref = sm_power.NormalIndPower().solve_power(
        effect_size=delta / sd, alpha=0.05, power=0.8, ratio=0, alternative="larger"
    )
    assert n_normal(delta, sd) == pytest.approx(ref, rel=1e-6)
    # Two-sided, statsmodels also counts the far tail's rejections, which the textbook formula
    # leaves out: kvbench's n is that formula's, at most a hair above statsmodels' (the far tail
    # adds power), never below.
    two = sm_power.NormalIndPower().solve_power(
        effect_size=delta / sd, alpha=0.05, power=0.8, ratio=0, alternative="two-sided"
    )
    ours = n_normal(delta, sd, two_sided=True)
    assert two <= ours <= two * (1 + 1e-4)
