"""Degenerate archives, one case each, and the verdict reason each must give (issue 43): every
pair tied, one arm at the ceiling, every arm at the ceiling, no spread, a single sample. None may
rest on a p-value computed from a zero spread."""

import re

import pytest
from synthetic_claims import write_arm_runs

from kvbench.analysis.archive import frames_from_runs
from kvbench.analysis.claims import evaluate_claims, validate

SAMPLES = [f"s{i:02d}" for i in range(12)]
SEEDS = (0, 1)  # 24 pairs

# (label, method node, bits, per-pair fields); fp16 scores 1.0 everywhere: the ceiling
DEGENERATE_ARMS = [
    ("fp16", None, None, lambda i, s: {"score": 1.0, "ppl": 10.0 + i, "eff": 16.0}),
    # ties fp16 on every pair, at the ceiling too
    ("ott-2b", {"name": "ott", "bits": 2}, 2, lambda i, s: {"score": 1.0, "ppl": 10.0 + i, "eff": 4.5}),
    # below the ceiling on sample s00 only (2 pairs): not significantly worse than fp16
    ("kivi-2b", {"name": "kivi", "bits": 2}, 2, lambda i, s: {"score": 1.0 if i else 2 / 3, "eff": 4.0}),
    # two arms tied on every pair away from either bound; ppl 0.25 above fp16 on every pair
    (
        "uniform-4b",
        {"name": "uniform", "bits": 4},
        4,
        lambda i, s: {"score": 2 / 3, "ppl": 10.25 + i, "eff": 5.0},
    ),
    ("uniform-3b", {"name": "uniform", "bits": 3}, 3, lambda i, s: {"score": 2 / 3, "eff": 4.0}),
]
ARMS = {
    "fp16": {"method": "fp16"},
    "ott": {"method": "ott"},
    "kivi": {"method": "kivi"},
    "u4": {"method": "uniform", "bits": 4},
    "u3": {"method": "uniform", "bits": 3},
}
P_ZERO = re.compile(r"\bp=0(?![.\d])")


def _claim(cid, rule):
    return {
        "id": cid,
        "where": "summary",
        "statement": "A statement.",
        "published": "1.0",
        "experiment": "semkv_cliff",
        "metric": "score",
        "arms": ARMS,
        "rule": rule,
    }


def _verdicts(root, entries, samples=SAMPLES, seeds=SEEDS):
    frames = frames_from_runs(write_arm_runs(root, DEGENERATE_ARMS, samples, seeds))
    claims = [validate(e, i) for i, e in enumerate(entries)]
    return {r.claim.id: r for r in evaluate_claims(claims, frames, "tiny", n_resamples=200)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _verdicts(
        tmp_path_factory.mktemp("degenerate"),
        [
            _claim("all-ceiling-equivalent", "equivalent(ott, fp16, margin=0.1)"),
            _claim("all-ceiling-better", "better(ott, fp16, effect=0.05)"),
            _claim("one-at-ceiling", "better(kivi, fp16)"),
            _claim("one-at-ceiling-refuted", "better(u4, fp16)"),
            _claim("ties-margin", "equivalent(u4, u3, margin=0.1)"),
            _claim("ties-margin-wide", "equivalent(u4, u3, margin=0.2)"),
            _claim("zero-spread-ppl", 'not_worse(u4, fp16, margin=0.5, metric="ppl")'),
            _claim("zero-spread-bits", 'at_most(u4, 5.5, metric="effective_bits")'),
        ],
    )


def test_every_arm_at_the_ceiling_is_its_own_reason_never_no_effect(results):
    for cid in ("all-ceiling-equivalent", "all-ceiling-better"):
        r = results[cid]
        assert r.verdict == "not testable here", r.measured
        assert "ceiling: all arms" in r.reason and "at 1 on score over 24 pairs" in r.reason
        assert "nothing can be told apart" in r.reason


def test_one_arm_at_the_ceiling_blocks_the_claims_side_only(results):
    r = results["one-at-ceiling"]
    assert r.verdict == "not testable here", r.measured
    assert "ceiling: fp16 at 1 on score on every one of 24 pairs" in r.reason
    assert "kivi cannot be shown better than fp16" in r.reason
    # the other side stays open: an arm significantly below the ceiling refutes the claim
    assert results["one-at-ceiling-refuted"].verdict == "evidence against"


def test_tied_pairs_prove_only_what_their_count_allows(results):
    # 24 tied pairs at margin 0.1: the exact binomial side gives 0.9 ** 24 = 0.08, not p = 0
    tied = results["ties-margin"]
    assert tied.verdict == "inconclusive"
    assert "0 of 24 pairs lost, 0 won" in tied.measured and "exact TOST p=0.07977" in tied.measured
    assert "cannot confirm whatever the data" in tied.measured
    assert tied.n_confirm == 29  # ties on 29 pairs would show it
    assert results["ties-margin-wide"].verdict == "reproduced"  # 0.8 ** 24 = 0.005


def test_zero_spread_is_arithmetic_not_a_test(results):
    ppl = results["zero-spread-ppl"]
    assert ppl.verdict == "reproduced"
    assert "every one of the 24 pairs gives 0.25: no spread, so no test" in ppl.measured
    bits = results["zero-spread-bits"]
    assert bits.verdict == "reproduced" and "decided by arithmetic" in bits.measured
    assert all(o.arithmetic and not o.page_tests for o in (*ppl.outcomes, *bits.outcomes))


def test_no_verdict_rests_on_a_p_of_zero(results):
    for r in results.values():
        assert not P_ZERO.search(r.measured), (r.claim.id, r.measured)


def test_a_single_sample_is_not_run(tmp_path):
    (r,) = _verdicts(tmp_path, [_claim("n1", "equivalent(u4, u3, margin=0.1)")], SAMPLES[:1], (0,)).values()
    assert r.verdict == "not run"
    assert "1 (sample_id, seed) pairs shared by u4, u3; need 2" in r.reason
