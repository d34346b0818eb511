"""Every verdict kind from synthetic archives, as the claims page prints it (issue 27).

The runs of ``tests/synthetic_claims.py`` are archived (``kvbench.analysis.archive``, the path
``make results`` reads), the claims below are evaluated on them, and the page
``results/claims/<model>.md`` must name each verdict with its reason, the pairs needed each way
and, for a proxy, the task-level claim."""

import math

import numpy as np
import pandas as pd
import pytest
from synthetic_claims import EXPERIMENT, NOISE, write_claim_runs, write_paper

from kvbench import report
from kvbench.analysis.archive import load_archives, write_archives
from kvbench.stats import n_from_pilot

ARMS = {
    "fp16": {"method": "fp16"},
    "chan": {"method": "kivi", "bits": 2, "config": {"key_axis": "channel"}},
    "tok": {"method": "kivi", "bits": 2, "config": {"key_axis": "token"}},
    "u4": {"label": "uniform-4b"},
    "u3": {"method": "uniform", "bits": 3},
    "ott": {"method": "ott", "bits": 2},
    "u2": {"method": "uniform", "bits": 2},
}
CLIFF = {"experiment": EXPERIMENT, "family": {"method": "uniform"}, "reference": {"method": "fp16"}}


def _claim(cid, rule, **extra):
    return {
        "id": cid,
        "where": "summary",
        "statement": "A statement.",
        "published": "1.0",
        "experiment": EXPERIMENT,
        "arms": ARMS,
        "rule": rule,
        **extra,
    }


CLAIMS = [
    _claim("yes", "better(chan, tok)"),
    _claim("against", "better(tok, chan)"),
    # fp16 and ott's noise columns differ by nothing on average (spread 0.48 over 24 pairs): an
    # effect of 0.5 would have shown, one of 0.1 might not have
    _claim("no-effect", 'better(fp16, ott, metric="noise", effect=0.5)'),
    _claim("open", 'better(fp16, ott, metric="noise", effect=0.1)'),
    # the synthetic uniform family is worse than fp16 at 2 bits only: its cliff is (2, 3]
    # each claim its own test (one claim per distinct test): arms scoring fp16's score against 0
    _claim(
        "premise-fails",
        "better(u4, tok)",
        premise=[{"cliff_at_most": 2, "why": "the levels must lie above the cliff", **CLIFF}],
    ),
    _claim(
        "premise-holds",
        "better(u3, u2)",
        premise=[{"cliff_at_most": 3, "why": "the levels must lie above the cliff", **CLIFF}],
    ),
    {**{k: v for k, v in _claim("gpu", None).items() if k not in ("arms", "rule")}, "experiment": None}
    | {"untestable": "a GPU throughput claim"},
    _claim("at-floor", "better(fp16, tok)", floor={"arm": "fp16", "above": 0.99}),
    _claim("proxy", "better(chan, u2)", proxy="an error stands in for accuracy", task_claim="yes"),
]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts")
    results = root / "results"
    write_archives(write_claim_runs(root / "runs"), results)
    claims = write_paper(root / "papers", CLAIMS, paper="semkv")
    frames = load_archives(results)
    by_model = report.claims_results(frames, claims, ["tiny"], n_resamples=300, conf_dir=None)
    (path,) = report.write_claims(by_model, results / "claims", frames)
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[0] in {c["id"] for c in CLAIMS}:
            rows[cells[0]] = dict(
                zip(
                    [
                        "id",
                        "paper",
                        "where",
                        "published",
                        "measured",
                        "n",
                        "verdict",
                        "confirm",
                        "refute",
                        "experiment",
                        "rule",
                    ],
                    cells,
                    strict=True,
                )
            )
    return {r.claim.id: r for r in by_model["tiny"]}, rows, path.read_text()


@pytest.mark.parametrize(
    "cid, verdict",
    [
        ("yes", "reproduced"),
        ("against", "evidence against"),
        ("no-effect", "no effect at this power"),
        ("open", "inconclusive"),
        ("premise-fails", "premise not met here"),
        ("premise-holds", "reproduced"),
        ("gpu", "not testable here"),
        ("at-floor", "not testable here"),
        ("proxy", "reproduced in proxy"),
    ],
)
def test_the_page_says_each_verdict(page, cid, verdict):
    _, rows, _ = page
    assert rows[cid]["verdict"] == verdict


def test_evidence_against_shows_the_reverse_p(page):
    results, rows, _ = page
    # tok - chan is -1 on the 22 pairs where fp16 scores 1 (both 0 on s00): past exact enumeration,
    # the Monte Carlo p the other way is at its floor 1 / 10001
    assert "Holm p=1 for the claim, 9.999e-05 against" in rows["against"]["measured"]
    assert results["against"].n_confirm is None and results["against"].n_refute is None


def test_inconclusive_gives_the_pairs_both_ways(page):
    results, rows, _ = page
    k = np.arange(len(NOISE))
    d = NOISE - 0.9 * NOISE[(k + 7) % len(NOISE)]
    assert d.mean() < 0  # the data lean against the claim, so confirming plans at the declared effect
    level = 0.05  # a family of one
    confirm = n_from_pilot(d, "greater", alpha=level, delta=0.1)
    refute = n_from_pilot(d, "less", alpha=level)
    assert math.isfinite(confirm) and math.isfinite(refute) and confirm < refute
    assert rows["open"]["confirm"] == str(int(confirm)) and rows["open"]["refute"] == str(int(refute))
    assert results["open"].n_confirm == confirm and results["open"].n_refute == refute


def test_no_effect_says_which_effect_was_ruled_out(page):
    _, rows, _ = page
    assert "an effect of 0.5 or more is rejected" in rows["no-effect"]["measured"]
    assert rows["no-effect"]["confirm"] == "-" and rows["no-effect"]["refute"] == "-"


def test_premise_and_floor_reasons_are_measured(page):
    _, rows, _ = page
    # 3 and 4 bits tie fp16 on all 24 pairs, which the exact TOST at margin 0.1 cannot call
    # equivalent (0.9 ** 24 = 0.08): the cliff's upper end is not located, and the page says so
    assert (
        "places this model's cliff above 2, upper end not located at this n (3, 4 neither worse nor "
        "shown equivalent); it is worse than the reference at 2 bits, above 2"
    ) in rows["premise-fails"]["rule"]
    assert "(2, 3]" not in rows["premise-fails"]["rule"]
    assert "fp16 scores 0.9167 on score over 24 samples on tiny" in rows["at-floor"]["rule"]
    assert rows["gpu"]["rule"] == "a GPU throughput claim"
    assert "task-level claim: yes" in rows["proxy"]["rule"]


def test_a_premise_whose_grid_cannot_conclude_is_not_taken_as_met(tmp_path):
    """A premise holds when no grid point at or above its bound is worse; with too few pairs no
    point can ever be worse, so the premise is unknown (``not run``), not met by default."""
    from kvbench.analysis.claims import _premise_failure
    from kvbench.analysis.papers import load_claims

    frames = load_archives(_archived(tmp_path))
    (frame,) = frames.values()
    held = next(c for c in CLAIMS if c["id"] == "premise-holds")
    (claim,) = load_claims(write_paper(tmp_path / "papers", [held], paper="semkv"), conf_dir=None)
    assert _premise_failure(claim, frames, "tiny", 0.05, 0, 300) is None  # 24 pairs per point
    # 3 samples x 2 seeds: the smallest two-sided Holm p over the 3 points is 3 x 2 / 2**6 = 0.094
    few = frame[frame["sample_id"].isin(["s00", "s01", "s02"])]
    verdict, why, _ = _premise_failure(claim, {EXPERIMENT: few}, "tiny", 0.05, 0, 300)
    assert verdict == "not run"
    assert "n=6 pairs per point on a 3-point Holm grid: the smallest attainable p is 0.0938" in why
    assert "it needs 7 pairs per point, so the cliff is unknown" in why


def test_the_page_counts_every_kind(page):
    _, _, text = page
    assert (
        "reproduced: 2; evidence against: 1; no effect at this power: 1; inconclusive: 1; "
        "premise not met here: 1; not run: 0; not testable here: 2 (task-level claims); "
        "in proxy, counted apart: reproduced: 1"
    ) in text
    assert "Page-wide false discovery rate: Benjamini-Hochberg at q = 0.05" in text


def test_a_second_model_gains_its_column(tmp_path):
    """The claims page's models side by side: a second model's runs give it a verdict column (the
    default first), each verdict with its pairs; a model the archives hold no run of adds none."""
    from kvbench.analysis.claims import models_table

    frames = load_archives(_archived(tmp_path))
    (frame,) = frames.values()
    # the second model: the same runs with the channel and token arms' scores swapped
    other = frame.copy()
    other["model"] = "big"
    axis = other["method_config"].map(lambda c: (c or {}).get("key_axis"))
    chan = other[axis == "channel"].sort_values(["seed", "sample_id"])
    tok = other[axis == "token"].sort_values(["seed", "sample_id"])
    other.loc[chan.index, "score"] = tok["score"].to_numpy()
    other.loc[tok.index, "score"] = chan["score"].to_numpy()
    both = {EXPERIMENT: pd.concat([frame, other], ignore_index=True)}
    claims = write_paper(tmp_path / "papers", CLAIMS[:2], paper="semkv")
    by_model = report.claims_results(both, claims, ["tiny", "big", "absent"], n_resamples=300, conf_dir=None)
    table = models_table(by_model, first="tiny")
    assert list(table.columns) == ["id", "paper", "published", "tiny", "big"]
    rows = table.set_index("id")
    assert rows.loc["yes", "tiny"].startswith("reproduced (n=")
    assert rows.loc["yes", "big"].startswith("evidence against (n=")
    page = report.models_markdown(by_model)
    # neither is the default model here: by name
    assert "| id | paper | published | big | tiny |" in page
    assert "| yes | semkv | 1.0 | evidence against (n=24) | reproduced (n=24) |" in page
    assert "absent" not in page


def _archived(tmp_path):
    results = tmp_path / "results"
    write_archives(write_claim_runs(tmp_path / "runs"), results)
    return results
