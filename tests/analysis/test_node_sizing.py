"""Nodes sized from a pilot (issue 27): the claims page's Sizing section, from synthetic archives.

The runs of ``tests/synthetic_claims.py`` are archived and serve as the pilot of two nodes: the
stored node, its samples timed at 10 s, and a copy under another name timed at 0.01 s. Each node
carries the same inconclusive claim and a settled one. The open claim compares fp16's noise column
with OTT's raised by ``SHIFT``: the pilot leans against the claim (mean about -0.05, spread about
0.48 over 24 pairs), by less than the declared effect 0.1, so confirming plans at 0.1 and refuting
at the pilot's 0.05: the refuting n is the larger, and the one the pilot points to. At 10 s a
sample the node costs more than the budget at that n, at 0.01 s it fits."""

import math

import numpy as np
import pytest
from synthetic_claims import ARMS as RUN_ARMS
from synthetic_claims import EXPERIMENT, NOISE, SAMPLES, SEEDS, write_claim_runs, write_paper

from kvbench import report
from kvbench.analysis.archive import load_archives, write_archives
from kvbench.analysis.sizing import NODE_BUDGET_MIN, claim_need, node_sizing
from kvbench.node_plan import CPU_RUN_OVERHEAD_S
from kvbench.stats import n_from_pilot

CHEAP = "cheap_copy"
ARMS = {
    "fp16": {"method": "fp16"},
    "chan": {"method": "kivi", "bits": 2, "config": {"key_axis": "channel"}},
    "tok": {"method": "kivi", "bits": 2, "config": {"key_axis": "token"}},
    "ott": {"method": "ott", "bits": 2},
}
SECONDS = {EXPERIMENT: 10.0, CHEAP: 0.01}
SHIFT = 0.05
TAG = {EXPERIMENT: "costly", CHEAP: "cheap"}


def _claim(cid, experiment, rule):
    return {
        "id": cid,
        "where": "summary",
        "statement": "A statement.",
        "published": "1.0",
        "experiment": experiment,
        "arms": ARMS,
        "rule": rule,
    }


CLAIMS = [
    _claim(f"open-{TAG[node]}", node, 'better(fp16, ott, metric="shifted", effect=0.1)') for node in SECONDS
] + [_claim(f"settled-{TAG[node]}", node, "better(chan, tok)") for node in SECONDS]


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizing")
    results = root / "results"
    write_archives(write_claim_runs(root / "runs"), results)
    stored = load_archives(results)[EXPERIMENT]
    shifted = stored["noise"] + SHIFT * (stored["method"] == "ott-2b")
    frames = {node: stored.assign(seconds=s, shifted=shifted) for node, s in SECONDS.items()}
    papers = write_paper(root / "papers", CLAIMS, paper="semkv")
    (results_tiny,) = report.claims_results(frames, papers, ["tiny"], n_resamples=300, conf_dir=None).values()
    (path,) = report.write_claims({"tiny": results_tiny}, results / "claims", frames)
    return results_tiny, frames, path.read_text()


def _expected_need() -> int:
    k = np.arange(len(NOISE))
    d = NOISE - 0.9 * NOISE[(k + 7) % len(NOISE)] - SHIFT
    assert -0.1 < d.mean() < 0  # the pilot points against the claim, by less than the effect
    return n_from_pilot(d, "less", alpha=0.05)


def _expected_minutes(need: int, seconds: float) -> float:
    runs = len(RUN_ARMS) * len(SEEDS)
    pairs = len(SAMPLES) * len(SEEDS)
    per_run = math.ceil(len(SAMPLES) * need / pairs)
    return (runs * per_run * seconds + runs * CPU_RUN_OVERHEAD_S) / 60


def _sizing_rows(text: str) -> dict[str, list[str]]:
    section = text.split("## Sizing", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in SECONDS:
            rows[cells[0]] = cells
    return rows


def test_the_open_claim_is_sized_in_the_direction_the_pilot_points(sized):
    results, _, _ = sized
    need = _expected_need()
    by_id = {r.claim.id: r for r in results}
    assert by_id["open-costly"].verdict == "inconclusive"
    assert claim_need(by_id["open-costly"]) == (need, "refute")
    # the confirming plan (at the declared effect) is smaller: taking it would misstate the pilot
    assert by_id["open-costly"].n_confirm < need
    assert claim_need(by_id["settled-costly"]) is None


def test_a_node_past_the_budget_says_so_with_the_price(sized):
    _, _, text = sized
    need = _expected_need()
    minutes = _expected_minutes(need, SECONDS[EXPERIMENT])
    assert minutes > NODE_BUDGET_MIN
    node, claims, n_now, needed, at_n, within, resize = _sizing_rows(text)[EXPERIMENT]
    assert claims == "open-costly (open), settled-costly"
    assert n_now == str(len(SAMPLES) * len(SEEDS))
    assert needed == f"{need} (open-costly, refute)"
    assert at_n == f"{minutes:,.0f}" and within == "no" and resize == "-"
    assert (
        f"`{EXPERIMENT}`: open-costly cannot be settled within the budget: to refute it needs "
        f"{need} pairs (it has {n_now}), {minutes:,.0f} CPU-minutes"
    ) in text


def test_a_node_within_the_budget_is_resized_not_flagged(sized):
    results, frames, text = sized
    need = _expected_need()
    minutes = _expected_minutes(need, SECONDS[CHEAP])
    assert minutes <= NODE_BUDGET_MIN
    row = _sizing_rows(text)[CHEAP]
    assert row[3] == f"{need} (open-cheap, refute)"
    assert row[4:] == [f"{minutes:,.0f}", "yes", f"{need} ({minutes:,.0f} min)"]
    assert f"`{CHEAP}`: open-cheap cannot be settled" not in text
    assert f"`{CHEAP}` to n={need} (open-cheap)" in text
    # the same pilot under a budget below its price is flagged: the budget decides, not the node
    table, notes = node_sizing(results, frames, budget_min=minutes / 2)
    assert table.set_index("node").loc[CHEAP, "within_budget"] == "no"
    assert any(n.startswith(f"`{CHEAP}`: open-cheap cannot be settled") for n in notes)
