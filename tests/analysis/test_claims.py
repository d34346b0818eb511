import copy
import math
import re
from pathlib import Path

import numpy as np
import pytest
from synthetic_claims import EXPERIMENT, NOISE, SAMPLES, SEEDS, fp16_score, write_claim_runs, write_paper

from kvbench import report
from kvbench.analysis.archive import frames_from_runs
from kvbench.analysis.claims import (
    ClaimsError,
    Outcome,
    _decide_family,
    claims_table,
    evaluate_claims,
    validate,
)
from kvbench.analysis.papers import load_claims, load_papers
from kvbench.paths import PAPERS_DIR
from kvbench.stats import n_from_pilot

REPO = Path(__file__).resolve().parents[2]
N_PAIRS = len(SAMPLES) * len(SEEDS)

ARMS = {
    "fp16": {"method": "fp16"},
    "chan": {"method": "kivi", "bits": 2, "config": {"key_axis": "channel"}},
    "tok": {"method": "kivi", "bits": 2, "config": {"key_axis": "token"}},
    "kivi_any": {"method": "kivi", "bits": 2},
    "u4": {"label": "uniform-4b"},
    "u3": {"method": "uniform", "bits": 3},
    "u2": {"method": "uniform", "bits": 2},
    "uniform": {"method": "uniform"},
    "ott": {"method": "ott", "bits": 2},
    "turbo": {"method": "turboquant"},
    "topk": {"method": "fp16", "metric": "hit_rates.exact_topk.0.005"},
    "h2o": {"method": "fp16", "metric": "hit_rates.h2o.0.005"},
}


def _claim(cid, rule, experiment=EXPERIMENT, **extra):
    return {
        "id": cid,
        "where": "Table 1",
        "statement": "A statement.",
        "published": "1.0",
        "experiment": experiment,
        "arms": ARMS,
        "rule": rule,
        **extra,
    }


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    return frames_from_runs(write_claim_runs(tmp_path_factory.mktemp("claim_runs")))


def _evaluate(frames, entries, model="tiny"):
    claims = [validate(e, i) for i, e in enumerate(entries)]
    return {r.claim.id: r for r in evaluate_claims(claims, frames, model, n_resamples=300)}


# The per-pair noise differences the inconclusive cases are built on (see synthetic_claims).
def _noise_diff():
    k = np.arange(N_PAIRS)
    return (NOISE[k] + 0.05) - NOISE[k]


CASES = [
    # better: one-sided paired sign-flip, Holm in the claim's family
    ("better-yes", "better(chan, tok)", "reproduced"),
    ("better-no", "better(tok, chan)", "evidence against"),
    ("better-flat", "better(u4, u3)", "inconclusive"),
    # not_worse: the non-inferiority half of TOST
    ("nw-yes", "not_worse(ott, fp16, margin=0.1)", "reproduced"),
    ("nw-no", "not_worse(u2, fp16, margin=0.1)", "evidence against"),
    # equivalent: both halves
    # u4 ties fp16 on all 24 pairs: the exact test confirms at margin 0.2 (0.8 ** 24), not at 0.1
    # (0.9 ** 24 = 0.08: a tie on 24 pairs leaves room for 10 % of samples to differ)
    ("eq-yes", "equivalent(u4, fp16, margin=0.2)", "reproduced"),
    ("eq-ties-too-few", "equivalent(u4, fp16, margin=0.1)", "inconclusive"),
    ("eq-no", "equivalent(u2, fp16, margin=0.1)", "evidence against"),
    # cliff_within: uniform is equivalent to fp16 at 4 and 3 bits and worse at 2
    ("cliff-yes", 'cliff_within(uniform, fp16, "(2, 3]", margin=0.2)', "reproduced"),
    ("cliff-unlocated", 'cliff_within(uniform, fp16, "(2, 3]")', "inconclusive"),
    ("cliff-too-low", 'cliff_within(uniform, fp16, "(3, 4]", margin=0.2)', "evidence against"),
    ("cliff-too-high", 'cliff_within(uniform, fp16, "(1, 2]")', "evidence against"),
    ("cliff-off-grid", 'cliff_within(uniform, fp16, "(2, 2.5]")', "not run"),
    ("cliff-holds-below", 'cliff_within(uniform, fp16, "(4, 5]", margin=0.2)', "evidence against"),
    # at_least / at_most: one-sample t-test against the bound
    ("al-yes", 'at_least(fp16, 0.9, metric="hit_rates.exact_topk.0.005")', "reproduced"),
    ("al-no", 'at_least(fp16, 0.99, metric="hit_rates.exact_topk.0.005")', "evidence against"),
    # h2o's hit rate is 0.5 on every pair: the exact (distribution-free) bound shows <= 0.8, not <= 0.6
    ("am-yes", "at_most(h2o, 0.8)", "reproduced"),
    ("am-near", "at_most(h2o, 0.6)", "inconclusive"),
    # ratio: mean(a) / mean(b) against the bound, paired
    ("ratio-yes", 'ratio(fp16, u4, metric="effective_bits") >= 3.0', "reproduced"),
    ("ratio-no", 'ratio(fp16, u4, metric="effective_bits") >= 4.0', "evidence against"),
    ("ratio-le", 'ratio(u4, fp16, metric="effective_bits") <= 0.35', "reproduced"),
    # larger_gain: (chan - tok) - (ott - fp16) = fp16 score + 0.02 > 0
    ("gain-yes", "larger_gain(chan, tok, ott, fp16)", "reproduced"),
    ("gain-no", "larger_gain(ott, fp16, chan, tok)", "evidence against"),
    # arms with their own metric columns of one run
    ("columns", "better(topk, h2o)", "reproduced"),
    # selection failures are "not run"
    ("arm-missing", "better(turbo, fp16)", "not run"),
    ("arm-ambiguous", "better(kivi_any, fp16)", "not run"),
]


@pytest.mark.parametrize("cid, rule, expected", CASES, ids=[c[0] for c in CASES])
def test_each_rule_kind_gives_the_built_in_verdict(frames, cid, rule, expected):
    result = _evaluate(frames, [_claim(cid, rule)])[cid]
    assert result.verdict == expected, result.measured or result.reason
    if expected not in ("not run",):
        assert result.n == N_PAIRS
    if expected == "reproduced" or expected == "evidence against":
        assert result.n_confirm is None and result.n_refute is None


def test_estimates_are_computed_from_the_runs(frames):
    results = _evaluate(
        frames,
        [
            _claim("a", "better(chan, tok)"),
            _claim("b", 'ratio(fp16, u4, metric="effective_bits") >= 3.0'),
            _claim("c", 'cliff_within(uniform, fp16, "(2, 3]", margin=0.2)'),
            _claim("d", 'at_least(fp16, 0.9, metric="hit_rates.exact_topk.0.005")'),
        ],
    )
    hand = np.mean([fp16_score(i) for i in range(len(SAMPLES))])
    assert results["a"].outcomes[0].estimate == pytest.approx(hand)
    assert results["b"].outcomes[0].estimate == pytest.approx(16 / 5)
    assert results["c"].outcomes[0].estimate == "(2, 3]"
    assert results["d"].outcomes[0].estimate == pytest.approx(0.95 + NOISE.mean() / 10)
    lo, hi = results["d"].outcomes[0].ci
    assert lo < 0.95 + NOISE.mean() / 10 < hi
    assert "n=24" in results["a"].measured and "Holm p=" in results["a"].measured


def test_inconclusive_reports_the_pairs_needed(frames):
    noise = NOISE[np.arange(N_PAIRS)]
    target = float(noise.mean()) - 0.004  # a bound just under the observed mean
    results = _evaluate(
        frames,
        [
            _claim("al", f'at_least(fp16, {target!r}, metric="noise")'),
            _claim("nw", 'not_worse(fp16, chan, metric="noise", margin=0.01)'),
        ],
    )
    al = results["al"]
    assert al.verdict == "inconclusive"
    assert al.n_confirm == n_from_pilot(noise - target, "greater") > N_PAIRS
    assert math.isinf(al.n_refute)  # the mean lies above the bound: no power to refute it
    nw = results["nw"]
    # fp16 - chan = -0.05 on every pair: below -margin with no spread, so it is decided
    assert nw.verdict == "evidence against"
    table = claims_table([al])
    assert (
        table.loc[0, "n_to_confirm"] == str(int(al.n_confirm)) and table.loc[0, "verdict"] == "inconclusive"
    )
    assert table.loc[0, "n_to_refute"] == "inf"


def test_holm_across_the_family_can_turn_a_pass_inconclusive():
    diffs = np.array([0.1, 0.2, -0.05, 0.15, 0.1, 0.05])
    alone = [Outcome("better(a, b)", "pending", p_greater=0.04, p_less=0.9, diffs=diffs)]
    _decide_family(alone, 0.05)
    assert alone[0].verdict == "reproduced"
    pair = [
        Outcome(f"r{i}", "pending", p_greater=p, p_less=0.9, diffs=diffs) for i, p in enumerate((0.04, 0.03))
    ]
    _decide_family(pair, 0.05)  # Holm: 0.03 * 2 = 0.06 > alpha, so neither is rejected
    assert [o.verdict for o in pair] == ["inconclusive", "inconclusive"]
    # planned at alpha / m, Holm's first step
    assert pair[0].n_confirm == n_from_pilot(diffs, "greater", alpha=0.025)
    assert pair[0].n_confirm > n_from_pilot(diffs, "greater", alpha=0.05)
    assert math.isinf(pair[0].n_refute)


def test_family_shared_between_claims(frames):
    one = _evaluate(frames, [_claim("x", "better(chan, tok)")])["x"]
    shared = _evaluate(
        frames,
        [_claim("x", "better(chan, tok)", family="f"), _claim("y", "better(topk, h2o)", family="f")],
    )
    assert "1 in family" in one.measured and "2 in family" in shared["x"].measured


def test_a_claim_is_as_weak_as_its_weakest_rule(frames):
    results = _evaluate(
        frames,
        [
            _claim("run-and-missing", ["better(chan, tok)", "better(turbo, fp16)"]),
            _claim("pass-and-fail", ["better(chan, tok)", "better(tok, chan)"]),
            _claim("pass-and-open", ["better(chan, tok)", "better(u4, u3)"]),
        ],
    )
    assert results["run-and-missing"].verdict == "not run"
    assert "arm 'turbo' matches no run" in results["run-and-missing"].reason
    assert results["pass-and-fail"].verdict == "evidence against"
    assert results["pass-and-open"].verdict == "inconclusive"
    # no difference at all: never detectable either way
    assert math.isinf(results["pass-and-open"].n_confirm) and math.isinf(results["pass-and-open"].n_refute)


def test_not_run_without_runs_and_not_testable(frames):
    entries = [
        _claim("other-node", "better(chan, tok)", experiment="kivi_gsm8k"),
        _claim("pending", "better(chan, tok)", experiment="attention_probe", pending="no probe node yet"),
        {k: v for k, v in _claim("gpu", None, experiment=None).items() if k not in ("arms", "rule")}
        | {"untestable": "GPU only"},
    ]
    results = _evaluate(frames, entries)
    assert results["other-node"].verdict == "not run"
    assert results["other-node"].reason == "no runs of kivi_gsm8k on tiny"
    assert results["pending"].verdict == "not run" and results["pending"].reason == "no probe node yet"
    assert results["gpu"].verdict == "not testable here"
    # another model has no runs of the experiment at all
    assert _evaluate(frames, [_claim("m", "better(chan, tok)")], model="llama")["m"].verdict == "not run"


def test_floor_turns_a_comparison_at_the_reference_floor_untestable(frames):
    """A reference at or below the declared floor (every method tied at 0) cannot tell methods
    apart: not testable here, with the reference's measured mean as the reason; above it the rule
    decides as usual."""
    fp16_mean = float(np.mean([fp16_score(i) for i in range(len(SAMPLES)) for _ in SEEDS]))
    results = _evaluate(
        frames,
        [
            _claim("at-floor", "better(chan, tok)", floor={"arm": "fp16", "above": fp16_mean + 1e-9}),
            _claim("above-floor", "better(chan, tok)", floor={"arm": "fp16", "above": fp16_mean - 1e-3}),
        ],
    )
    at = results["at-floor"]
    assert at.verdict == "not testable here"
    assert at.reason.startswith(f"fp16 scores {fp16_mean:.4g} on score over {N_PAIRS} samples on tiny")
    assert results["above-floor"].verdict == "reproduced"


def test_sizing_prices_the_pairs_an_inconclusive_claim_needs(frames):
    """n_needed from the power calculation times the seconds a pair costs (each selected
    configuration's mean sample time, summed)."""
    from kvbench.analysis.sizing import sizing_table

    timed = {name: frame.assign(seconds=3.0) for name, frame in frames.items()}
    claims = [_claim("open", "better(chan, kivi_any)"), _claim("nil", "better(u4, u3)")]
    results = [r for r in _evaluate(timed, claims).values() if r.verdict == "inconclusive"]
    table = sizing_table(results, timed).set_index("id")
    nil = table.loc["nil"]
    assert nil["n_to_confirm"] == "inf" and nil["hours_to_confirm"] == "inf" and nil["fits_a_day"] == "no"
    assert nil["n_to_refute"] == "inf" and nil["hours_to_refute"] == "inf"
    assert nil["s_per_pair"] == "6"  # two configurations at 3 s each
    if "open" in table.index:
        row = table.loc["open"]
        need = int(row["n_to_confirm"])
        assert float(row["hours_to_confirm"]) == pytest.approx(
            (need - row["n"]) * float(row["s_per_pair"]) / 3600, rel=1e-2
        )


def test_a_label_that_follows_the_seed_is_one_configuration():
    """Random pruning's label carries the run's seed: one label per seed is one configuration; two
    labels within a seed are two."""
    import pandas as pd

    from kvbench.analysis.claims import several_configurations

    per_seed = pd.DataFrame({"seed": [0, 0, 1, 1], "method": ["rp-s0", "rp-s0", "rp-s1", "rp-s1"]})
    assert not several_configurations(per_seed)
    mixed = pd.DataFrame({"seed": [0, 0, 1], "method": ["kivi-2b", "kivi-4b", "kivi-2b"]})
    assert several_configurations(mixed)


GOOD = _claim("x-claim", "better(chan, tok)")


@pytest.mark.parametrize(
    "change, field, message",
    [
        ({"measured": "0.5"}, "measured", "computed from the runs"),
        ({"verdict": "reproduced"}, "verdict", "computed from the runs"),
        ({"paper": "gear"}, "paper", "the paper file declares its claims"),
        ({"rule": "best(chan, tok)"}, "rule", "unknown rule"),
        ({"rule": "better(chan, nope)"}, "rule", "not declared under arms"),
        ({"rule": "better(chan)"}, "rule", "takes 2 arms"),
        ({"rule": "not_worse(chan, tok)"}, "rule", "needs margin"),
        ({"rule": "not_worse(chan, tok, margin=-1)"}, "rule", "positive"),
        ({"rule": 'cliff_within(uniform, fp16, "2 to 3")'}, "rule", "interval"),
        ({"rule": "ratio(fp16, u4)"}, "rule", "ratio needs"),
        ({"rule": "better(chan, tok) >= 2"}, "rule", "only they compare"),
        ({"rule": "better(chan, tok) +"}, "rule", "not a rule"),
        ({"rule": None}, "rule", "needs a rule"),
        ({"arms": {"a": {"bits": 2}}, "rule": "at_least(a, 1)"}, "arms.a", "needs 'label' or 'method'"),
        ({"arms": {"a": {"method": "kivi", "folder": "x"}}}, "arms.a", "unknown key"),
        ({"statement": ""}, "statement", "non-empty text"),
        ({"experiment": None}, "experiment", "non-empty text"),
        ({"colour": "red"}, "colour", "unknown field"),
        ({"published": None}, "published", "required"),
        ({"floor": {"arm": "nope", "above": 0.1}}, "floor", "expected"),
        ({"floor": {"arm": "fp16", "above": "low"}}, "floor", "expected"),
    ],
)
def test_schema_errors_name_claim_and_field(tmp_path, change, field, message):
    entry = {**copy.deepcopy(GOOD), **change}
    write_paper(tmp_path, [entry])
    with pytest.raises(ClaimsError, match=message) as err:
        load_claims(tmp_path)
    assert err.value.claim == "x-claim" and err.value.field == field
    # one line naming the file that declares the claim
    assert str(err.value).startswith(f"{tmp_path / 'toy.yaml'}: claim 'x-claim' field {field!r}: ")
    assert "\n" not in str(err.value)


def test_experiment_node_must_exist_unless_pending(tmp_path):
    conf = REPO / "kvbench" / "conf"
    write_paper(tmp_path, [_claim("x", "better(chan, tok)", experiment="no_such_node")])
    with pytest.raises(ClaimsError, match="no node conf/experiment/no_such_node.yaml"):
        load_claims(tmp_path, conf_dir=conf)
    write_paper(tmp_path, [_claim("x", "better(chan, tok)", experiment="no_such_node", pending="soon")])
    assert load_claims(tmp_path, conf_dir=conf)[0].pending == "soon"


def test_claim_ids_are_unique_across_paper_files(tmp_path):
    write_paper(tmp_path, [_claim("same", "better(chan, tok)")], paper="one")
    write_paper(tmp_path, [_claim("same", "better(tok, chan)")], paper="two", order=2)
    with pytest.raises(ClaimsError, match="field 'id': repeated") as err:
        load_claims(tmp_path)
    assert str(err.value).startswith(str(tmp_path / "two.yaml"))


def test_committed_declarations_hold_no_measured_values_or_verdicts():
    for path in PAPERS_DIR.glob("*.yaml"):
        text = path.read_text().split("\nclaims:\n", 1)[1]
        assert not re.findall(r"^\s*-?\s*(measured|verdict|source)\s*:", text, flags=re.M), path.name
    papers = load_papers(conf_dir=REPO / "kvbench" / "conf")
    claims = load_claims(conf_dir=REPO / "kvbench" / "conf")
    assert {c.paper for c in claims} == {p.id for p in papers}
    for claim in claims:
        assert claim.rules or claim.untestable, claim.id
    # every seed paper has at least one claim a run can decide
    assert {c.paper for c in claims if c.rules} == {p.id for p in papers}


def test_cli_computes_and_writes_the_verdict_table(tmp_path, capsys):
    runs = write_claim_runs(tmp_path / "runs")
    papers = tmp_path / "papers"
    write_paper(
        papers,
        [_claim("cli-pass", "better(chan, tok)"), _claim("cli-fail", "better(tok, chan)")],
        paper="semkv",
    )
    args = ["--claims", "--runs", str(runs), "--results", str(tmp_path / "results")]
    args += ["--declarations", str(papers), "--model", "tiny", "--resamples", "200"]
    assert report.main(args) == 0
    out = capsys.readouterr().out
    assert "| cli-pass | semkv |" in out and "reproduced: 1; evidence against: 1" in out
    md = (tmp_path / "results" / "claims" / "tiny.md").read_text()
    assert md.startswith("# Paper claims on tiny") and "| cli-fail |" in md
    assert (tmp_path / "results" / "claims" / "tiny.csv").exists()
    # a declaration with a typed verdict is refused with one line naming the claim and field
    write_paper(papers, [{**_claim("bad", "better(chan, tok)"), "verdict": "reproduced"}], paper="semkv")
    assert report.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "claim 'bad' field 'verdict'" in err[0]


def test_a_rule_that_can_never_reach_alpha_is_refused_at_declaration(tmp_path):
    """The semkv_cliff node holds 9 pairs per grid point (3 per seed x 3 seeds): a cliff over its
    7-point grid can reach 7 x 2 / 2**9 = 0.027; a family of 20 one-sided tests cannot
    (20 / 2**9 = 0.039 reaches, 60 / 2**9 = 0.117 does not)."""
    from kvbench.stats import min_n_sign_flip, min_p_sign_flip

    assert min_p_sign_flip(6, 7, two_sided=True) == 7 * 2 / 64 and min_n_sign_flip(0.05, 7, True) == 9
    assert min_p_sign_flip(6, 3) == 3 / 64 and min_n_sign_flip(0.05, 4) == 7
    conf = REPO / "kvbench" / "conf"
    # the node's margin (0.1) needs 29 tied pairs per point for the exact TOST: at 9 the cliff can
    # only be refuted, which the claim must say (underpowered) or the declaration is refused
    write_paper(tmp_path, [_claim("cliff", 'cliff_within(uniform, fp16, "(2, 3]")')])
    with pytest.raises(ClaimsError, match=r"best p 0.387 .*n=9 pairs\) no data can confirm it"):
        load_claims(tmp_path, conf_dir=conf)
    said = _claim("cliff", 'cliff_within(uniform, fp16, "(2, 3]")', underpowered="a CPU node")
    write_paper(tmp_path, [said])
    assert load_claims(tmp_path, conf_dir=conf)
    # the same for an equivalence on a [0, 1] score, and never for an unbounded metric (t-test)
    write_paper(tmp_path, [_claim("eq", "equivalent(u4, fp16, margin=0.1)")])
    with pytest.raises(ClaimsError, match="exact binomial side at margin 0.1 on score"):
        load_claims(tmp_path, conf_dir=conf)
    write_paper(tmp_path, [_claim("eq", 'equivalent(u4, fp16, margin=0.1, metric="ppl")', underpowered="x")])
    with pytest.raises(ClaimsError, match="every rule can confirm at n=9 pairs; remove the field"):
        load_claims(tmp_path, conf_dir=conf)
    many = [_claim(f"c{i}", f"better(chan, tok, effect={i + 1})", family="big") for i in range(60)]
    write_paper(tmp_path, many)
    with pytest.raises(ClaimsError, match=r"can never reach alpha=0.05 .* n=9 pairs .* needs n >= 11") as err:
        load_claims(tmp_path, conf_dir=conf)
    assert err.value.field == "rule"


def test_stored_pairs_below_the_floor_are_not_run_never_inconclusive():
    """Archives older than a resized node: the family's test cannot reject at all, so the verdict
    says so (not run, with the pairs it needs) instead of 'inconclusive'."""
    diffs = np.array([0.1, 0.2, 0.15, 0.1])
    family = [Outcome(f"r{i}", "pending", p_greater=1 / 16, p_less=1.0, diffs=diffs) for i in range(2)]
    _decide_family(family, 0.05)
    assert [o.verdict for o in family] == ["not run", "not run"]
    assert "smallest attainable p is 0.125" in family[0].reason and "needs 6 pairs" in family[0].reason
