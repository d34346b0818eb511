import itertools
import math

import numpy as np
import pytest
import scipy.stats as sps

from kvbench.stats import (
    bootstrap_ci,
    cohens_dz,
    holm,
    mcnemar_test,
    paired_differences,
    sign_flip_test,
    tost_bootstrap,
    tost_equivalence,
    win_rate,
)

# --------------------------------------------------------------------------------------- pairing


def test_paired_differences_aligns_on_keys_not_order():
    method = {("b", 0): 3.0, ("a", 1): 5.0, ("a", 0): 1.0}
    reference = {("a", 0): 2.0, ("a", 1): 1.0, ("b", 0): 3.5}
    # Sorted keys: (a,0), (a,1), (b,0).
    np.testing.assert_array_equal(paired_differences(method, reference), [-1.0, 4.0, -0.5])


def test_paired_differences_lists_missing_keys():
    with pytest.raises(ValueError, match=r"missing from the method: \[\('c', 0\)\]"):
        paired_differences({("a", 0): 1.0}, {("a", 0): 1.0, ("c", 0): 2.0})
    with pytest.raises(ValueError, match=r"missing from the reference: \[\('z', 3\)\]"):
        paired_differences({("a", 0): 1.0, ("z", 3): 0.0}, {("a", 0): 1.0})


# ------------------------------------------------------------------------------------- sign flip


def brute_force_sign_flip(d, alternative):
    """Independent reference: every sign vector, statistic = mean of the flipped differences."""
    d = list(d)
    observed = sum(d) / len(d)
    hits = total = 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        t = sum(s * x for s, x in zip(signs, d, strict=True)) / len(d)
        total += 1
        if alternative == "greater":
            hits += t >= observed - 1e-12
        elif alternative == "less":
            hits += t <= observed + 1e-12
        else:
            hits += abs(t) >= abs(observed) - 1e-12
    return hits / total


@pytest.mark.parametrize(
    "d",
    [
        [0.8, -0.3, 1.7, 0.45, 0.2, -0.05],  # no ties
        [1.0, 2.0, 3.0, -1.0, 0.0, 2.0],  # integer data: many exact ties, and a zero difference
        [-0.9, -1.3, 0.1, -0.4, -2.2, 0.6],  # mostly negative
    ],
)
@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_sign_flip_exact_matches_brute_force(d, alternative):
    expected = brute_force_sign_flip(d, alternative)
    assert sign_flip_test(d, alternative=alternative) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_sign_flip_exact_equals_scipys_permutation_test(alternative):
    # scipy as the oracle: a one-sample permutation test of the mean flips the signs of the pairs,
    # every one of the 2**n assignments when n_resamples is infinite
    d = np.array([0.8, -0.3, 1.7, 0.45, 0.2, -0.05, 1.1, 0.6, -0.7, 0.9])
    theirs = sps.permutation_test(
        (d,), np.mean, permutation_type="samples", n_resamples=np.inf, alternative=alternative
    ).pvalue
    assert sign_flip_test(d, alternative=alternative) == pytest.approx(theirs, rel=1e-12)


def test_sign_flip_hand_values():
    # All six positive: only the identity assignment reaches the observed sum (one-sided 1/64);
    # two-sided adds the all-negative assignment.
    d = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert sign_flip_test(d, alternative="greater") == 1 / 64
    assert sign_flip_test(d) == 2 / 64
    assert sign_flip_test(d, alternative="less") == 1.0
    assert sign_flip_test([0.0, 0.0, 0.0]) == 1.0


def test_sign_flip_monte_carlo_close_to_exact():
    d = np.random.default_rng(4).normal(0.35, 1.0, 12)
    for alternative in ("two-sided", "greater", "less"):
        exact = sign_flip_test(d, alternative=alternative)
        mc = sign_flip_test(d, n_resamples=20_000, rng=5, alternative=alternative)
        assert 0.01 < exact < 0.99  # a p-value in the middle, where Monte Carlo error is largest
        assert mc == pytest.approx(exact, abs=0.012)  # ~3.5 Monte Carlo standard errors


def test_sign_flip_monte_carlo_never_returns_zero():
    # n = 25 > 20, all positive: the exact two-sided p is 2/2**25, so almost surely no random
    # assignment is as extreme and the (b + 1) / (m + 1) correction gives 1 / (m + 1).
    d = np.arange(1.0, 26.0)
    assert sign_flip_test(d, rng=0) == 1 / 10_001
    assert sign_flip_test(d, n_resamples=999, rng=0, alternative="greater") == 1 / 1000


# ------------------------------------------------------------------------------------- bootstrap

# Right-skewed differences, so BCa and percentile intervals differ measurably.
SKEWED = np.round(np.random.default_rng(7).gamma(2.0, 0.5, 40) - 0.7, 3)


@pytest.mark.parametrize(("ours", "theirs"), [("percentile", "percentile"), ("bca", "BCa")])
def test_bootstrap_ci_matches_scipy(ours, theirs):
    low, high = bootstrap_ci(SKEWED, n_resamples=50_000, rng=1, method=ours)
    ref = sps.bootstrap((SKEWED,), np.mean, n_resamples=100_000, method=theirs, rng=2).confidence_interval
    # Monte Carlo sd of each endpoint is ~0.002 here; the interval is ~0.35 wide.
    assert low == pytest.approx(ref.low, abs=0.008)
    assert high == pytest.approx(ref.high, abs=0.008)


def test_bca_differs_from_percentile_on_skewed_data():
    pct = bootstrap_ci(SKEWED, n_resamples=50_000, rng=1)
    bca = bootstrap_ci(SKEWED, n_resamples=50_000, rng=1, method="bca")
    # Right skew moves the BCa interval up at both ends (~0.015 and ~0.025 for this sample).
    assert bca[0] - pct[0] > 0.008 and bca[1] - pct[1] > 0.012


def test_bootstrap_ci_other_stat_and_degenerate_cases():
    d = np.arange(10.0)
    low, high = bootstrap_ci(d, stat=np.median, n_resamples=4000, rng=0)
    assert 1.0 <= low < 4.5 < high <= 8.0
    assert bootstrap_ci([0.3] * 8, rng=0) == (0.3, 0.3)
    assert bootstrap_ci([0.3] * 8, rng=0, method="bca") == (0.3, 0.3)
    assert all(math.isnan(x) for x in bootstrap_ci([1.0], rng=0))
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([1.0, math.nan])


# --------------------------------------------------------------------------------------- McNemar


def _binary_pairs(both, b, c, neither):
    """Aligned (method_correct, reference_correct) with b = reference-only and c = method-only wins."""
    method = [1] * both + [0] * b + [1] * c + [0] * neither
    reference = [1] * both + [1] * b + [0] * c + [0] * neither
    return method, reference


def test_mcnemar_exact_hand_case():
    # b = 1, c = 7: p = 2 * P(X <= 1 | n = 8, 1/2) = 2 * (1 + 8) / 256.
    method, reference = _binary_pairs(both=20, b=1, c=7, neither=5)
    stat, p = mcnemar_test(method, reference)
    assert stat == 1.0 and p == pytest.approx(2 * 9 / 256, rel=1e-12)
    # Concordant pairs carry no information.
    assert mcnemar_test(*_binary_pairs(0, 1, 7, 0)) == (stat, p)
    # b = c: the doubled tail exceeds 1 and is capped.
    assert mcnemar_test(*_binary_pairs(3, 4, 4, 3))[1] == 1.0
    assert mcnemar_test(*_binary_pairs(3, 0, 0, 3)) == (0.0, 1.0)


@pytest.mark.parametrize(("b", "c"), [(1, 7), (0, 5), (6, 2), (9, 9), (3, 14)])
def test_mcnemar_exact_equals_scipys_binomial_test(b, c):
    # scipy as the oracle: the exact test is a two-sided binomial test of b among the b + c
    # discordant pairs at 1/2
    _, p = mcnemar_test(*_binary_pairs(both=4, b=b, c=c, neither=2))
    assert p == pytest.approx(sps.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)


def test_mcnemar_chi_square_hand_case():
    # (|1 - 7| - 1)^2 / 8 = 25 / 8; chi-square(1) survival is erfc(sqrt(x / 2)).
    stat, p = mcnemar_test(*_binary_pairs(10, 1, 7, 2), exact=False)
    assert stat == pytest.approx(3.125)
    assert p == pytest.approx(math.erfc(math.sqrt(3.125 / 2)), rel=1e-10)
    assert p == pytest.approx(0.07710, abs=1e-5)


def test_mcnemar_accepts_keyed_mappings():
    method = {("s1", 0): True, ("s2", 0): True, ("s3", 0): False}
    reference = {("s3", 0): True, ("s2", 0): False, ("s1", 0): True}
    # s2: method-only win (c = 1); s3: reference-only win (b = 1).
    assert mcnemar_test(method, reference) == (1.0, 1.0)


# ------------------------------------------------------------------------------------------ TOST


def test_tost_matches_two_one_sided_t_tests():
    d = np.array([0.12, -0.05, 0.3, 0.02, -0.11, 0.07, 0.18, -0.02])
    out = tost_equivalence(d, margin=0.25)
    lower = sps.ttest_1samp(d, -0.25, alternative="greater").pvalue
    upper = sps.ttest_1samp(d, 0.25, alternative="less").pvalue
    assert out["p_lower"] == pytest.approx(lower, rel=1e-10)
    assert out["p_upper"] == pytest.approx(upper, rel=1e-10)
    assert out["p"] == pytest.approx(max(lower, upper), rel=1e-10)
    assert out["equivalent"] == (max(lower, upper) < 0.05)


def test_tost_size_at_margin_and_power_at_zero():
    rng = np.random.default_rng(11)
    reps, n, margin, alpha = 300, 30, 0.5, 0.05
    at_margin = rng.normal(margin, 1.0, (reps, n))
    size = np.mean([tost_equivalence(x, margin, alpha)["equivalent"] for x in at_margin])
    # The true difference sits on the upper null boundary: rejections should occur at about alpha.
    assert 0.01 <= size <= alpha + 0.03
    null_zero = rng.normal(0.0, 0.3, (reps, n))
    power = np.mean([tost_equivalence(x, margin, alpha)["equivalent"] for x in null_zero])
    assert power >= 0.95


def test_tost_degenerate_and_bootstrap_variant():
    # no spread: no t statistic is computed, so no p = 0 from dividing by it
    for constant in ([0.1] * 5, [0.3] * 5, [0.0] * 8):
        out = tost_equivalence(constant, margin=0.2)
        assert math.isnan(out["p"]) and not out["equivalent"]
    d = np.random.default_rng(3).normal(0.0, 0.2, 60)
    boot = tost_bootstrap(d, margin=0.2, rng=0)
    assert boot["equivalent"] and -0.2 < boot["ci_low"] < boot["ci_high"] < 0.2
    far = tost_bootstrap(d + 0.3, margin=0.2, rng=0)
    assert not far["equivalent"] and far["p_upper"] > 0.5


# ------------------------------------------------------------------------------------------ Holm


def test_holm_hand_case():
    # Sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> running max 0.06.
    adjusted, reject = holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_array_equal(reject, [True, False, False, True])


def test_holm_caps_at_one_and_skips_nan():
    adjusted, reject = holm([0.5, 0.6])
    np.testing.assert_allclose(adjusted, [1.0, 1.0])
    adjusted, reject = holm([0.02, math.nan, 0.01])
    # The family is the two real p-values.
    np.testing.assert_allclose(adjusted, [0.02, math.nan, 0.02])
    np.testing.assert_array_equal(reject, [True, False, True])


# ---------------------------------------------------------------------------------- effect sizes


def test_effect_sizes():
    d = [1.0, 2.0, 3.0, -2.0, 0.0]
    # mean 0.8, sd (ddof=1) sqrt(14.8 / 4).
    assert cohens_dz(d) == pytest.approx(0.8 / math.sqrt(3.7))
    assert win_rate(d) == pytest.approx((3 + 0.5) / 5)
    assert cohens_dz([0.5, 0.5]) == math.inf and math.isnan(cohens_dz([0.0, 0.0]))
