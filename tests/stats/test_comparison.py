"""``compare`` on a synthetic results table: verdicts, values, orientation, seeding and pairing."""

import numpy as np
import pandas as pd
import pytest

from kvbench.stats import compare, holm


def _synthetic_results():
    """fp16 plus: an obviously worse method, an identical one, one better, one within +-0.01."""
    rng = np.random.default_rng(0)
    keys = [(f"s{i}", seed) for i in range(30) for seed in (0, 1)]
    base = rng.uniform(0.3, 0.9, len(keys))
    ppl_base = rng.uniform(8.0, 12.0, len(keys))
    variants = {
        ("fp16", 16.0): (base, ppl_base),
        ("kivi", 2.0): (base - 0.3 + rng.normal(0, 0.05, len(keys)), ppl_base + 2.0),
        ("kivi", 4.0): (base.copy(), ppl_base.copy()),
        ("oracle", 4.0): (base + 0.2 + rng.normal(0, 0.05, len(keys)), ppl_base - 1.0),
        ("near", 8.0): (base + rng.uniform(-0.01, 0.01, len(keys)), ppl_base),
    }
    rows = []
    for (method, bits), (acc, ppl) in variants.items():
        for (sample_id, seed), a, p in zip(keys, acc, ppl, strict=True):
            rows.append(
                {"sample_id": sample_id, "seed": seed, "method": method, "bits": bits, "acc": a, "ppl": p}
            )
    # Shuffle so pairing cannot rely on row order.
    return pd.DataFrame(rows).sample(frac=1.0, random_state=1).reset_index(drop=True), variants


def test_compare_verdicts_and_values():
    df, variants = _synthetic_results()
    out = compare(df, "acc", margin=0.05).set_index(["method", "bits"])
    assert set(out.index) == {("kivi", 2.0), ("kivi", 4.0), ("oracle", 4.0), ("near", 8.0)}
    assert (out["n"] == 60).all()
    assert out.loc[("kivi", 2.0), "verdict"] == "worse"
    assert out.loc[("oracle", 4.0), "verdict"] == "better"
    # identical on every pair: no spread, so the t-based TOST computes nothing and cannot say
    # "equivalent"; the near-identical method has a spread and is
    assert out.loc[("kivi", 4.0), "verdict"] == "inconclusive" and np.isnan(out.loc[("kivi", 4.0), "tost_p"])
    assert out.loc[("near", 8.0), "verdict"] == "equivalent"
    expected = np.mean(variants[("kivi", 2.0)][0] - variants[("fp16", 16.0)][0])
    assert out.loc[("kivi", 2.0), "mean_diff"] == pytest.approx(expected)
    assert out.loc[("kivi", 2.0), "ci_high"] < 0 and out.loc[("oracle", 4.0), "ci_low"] > 0
    identical = out.loc[("kivi", 4.0)]
    assert identical["p_value"] == 1.0 and identical["ci_low"] == identical["ci_high"] == 0.0
    # Holm over the four comparisons; the identical method's p stays capped at 1.
    np.testing.assert_allclose(out["p_holm"], holm(out["p_value"])[0])
    assert (out["p_holm"] >= out["p_value"]).all()
    assert out.loc[("kivi", 2.0), "win_rate"] < 0.05 and identical["win_rate"] == 0.5


def test_compare_without_margin_is_never_equivalent():
    df, _ = _synthetic_results()
    out = compare(df, "acc").set_index(["method", "bits"])
    assert out.loc[("kivi", 4.0), "verdict"] == "inconclusive"
    assert out["tost_p"].isna().all()


def test_compare_lower_is_better_flips_the_sign():
    df, _ = _synthetic_results()
    out = compare(df, "ppl", higher_is_better=False, margin=0.5).set_index(["method", "bits"])
    # kivi-2 raises perplexity by 2: positive raw difference, reported as -2 and "worse".
    assert out.loc[("kivi", 2.0), "mean_diff"] == pytest.approx(-2.0)
    assert out.loc[("kivi", 2.0), "verdict"] == "worse"
    assert out.loc[("oracle", 4.0), "mean_diff"] == pytest.approx(1.0)
    assert out.loc[("oracle", 4.0), "verdict"] == "better"
    assert out.loc[("kivi", 4.0), "mean_method"] == pytest.approx(out.loc[("kivi", 4.0), "mean_reference"])


def test_compare_is_seeded_and_checks_pairs():
    df, _ = _synthetic_results()
    first = compare(df, "acc", margin=0.05, seed=3)
    pd.testing.assert_frame_equal(first, compare(df, "acc", margin=0.05, seed=3))
    holed = df.drop(df.index[(df["method"] == "kivi") & (df["sample_id"] == "s5") & (df["seed"] == 1)])
    with pytest.raises(ValueError, match=r"missing from the method: \[\('s5', 1\)\]"):
        compare(holed, "acc")
    out = compare(holed, "acc", missing="intersect").set_index(["method", "bits"])
    assert out.loc[("kivi", 2.0), "n"] == 59 and out.loc[("oracle", 4.0), "n"] == 60
    with pytest.raises(ValueError, match="reference method 'bf16'"):
        compare(df, "acc", reference="bf16")


def test_compare_bounded_uses_the_exact_tie_aware_tost():
    df, _ = _synthetic_results()
    out = compare(df, "acc", margin=0.05, bounds=(0.0, 1.0)).set_index(["method", "bits"])
    # 60 tied pairs: the exact binomial side gives 0.95 ** 60 = 0.046 < 0.05, so equivalent
    assert out.loc[("kivi", 4.0), "tost_p"] == pytest.approx(0.95**60)
    assert out.loc[("kivi", 4.0), "verdict"] == "equivalent"
    # the same ties on fewer pairs cannot show it: 0.95 ** 40 = 0.13
    few = df[df["sample_id"].isin([f"s{i}" for i in range(20)])]
    small = compare(few, "acc", margin=0.05, bounds=(0.0, 1.0)).set_index(["method", "bits"])
    assert small.loc[("kivi", 4.0), "tost_p"] == pytest.approx(0.95**40)
    assert small.loc[("kivi", 4.0), "verdict"] == "inconclusive"
