import copy
import re
from pathlib import Path

import pytest
import yaml

from kvbench import report
from kvbench.analysis.claims import PAPERS, ClaimsError, claims_table, load_claims

REPO = Path(__file__).resolve().parents[2]
CLAIMS = REPO / "results" / "claims.yaml"


def test_committed_claims_load_and_cover_every_paper():
    claims = load_claims(CLAIMS)
    assert {c.paper for c in claims} == set(PAPERS)
    # Every paper has at least one claim that is not left pending or untestable.
    decided = {c.paper for c in claims if c.verdict in ("reproduced in direction", "not reproduced")}
    assert decided == set(PAPERS)
    for claim in claims:
        if claim.verdict == "pending":
            assert claim.measured == "pending" and claim.source is None and claim.experiment


def test_measured_numbers_are_in_their_source():
    """Every 3- or 4-decimal number quoted as measured appears verbatim in the cited result file."""
    checked = 0
    for claim in load_claims(CLAIMS):
        if claim.source is None:
            continue
        text = (REPO / claim.source).read_text()
        for number in re.findall(r"(?<![\d.])\d+\.\d{3,4}(?![\d.])", str(claim.measured)):
            assert number in text, f"{claim.id}: {number} not in {claim.source}"
            checked += 1
    assert checked >= 20


def _write(tmp_path, claims):
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / "table.md").write_text("| a | 0.5 |\n")
    path = tmp_path / "results" / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": claims}))
    return path


GOOD = {
    "id": "x-claim",
    "paper": "kivi",
    "where": "Table 1",
    "statement": "KIVI is good.",
    "published": "2 %",
    "experiment": "kivi_axis_ablation",
    "measured": "0.5",
    "source": "results/table.md",
    "verdict": "reproduced in direction",
}


@pytest.mark.parametrize(
    "change, field, message",
    [
        ({"verdict": "reproduced"}, "verdict", "not one of"),
        ({"paper": "gear"}, "paper", "not one of"),
        ({"source": "results/missing.md"}, "source", "does not exist"),
        ({"source": None}, "source", "committed file under results/"),
        ({"measured": "pending"}, "measured", "a value is required"),
        ({"verdict": "pending"}, "measured", "must be 'pending'"),
        ({"verdict": "pending", "measured": "pending"}, "source", "must be null"),
        ({"verdict": "not testable here", "experiment": None}, "note", "non-empty text"),
        ({"verdict": "not reproduced"}, "note", "non-empty text"),
        ({"statement": ""}, "statement", "non-empty text"),
        ({"experiment": None}, "experiment", "non-empty text"),
        ({"colour": "red"}, "colour", "unknown field"),
        ({"published": None}, "published", "required"),
    ],
)
def test_schema_errors_name_claim_and_field(tmp_path, change, field, message):
    entry = {**copy.deepcopy(GOOD), **change}
    path = _write(tmp_path, [entry])
    with pytest.raises(ClaimsError, match=message) as err:
        load_claims(path, require_all_papers=False)
    assert err.value.claim == "x-claim" and err.value.field == field
    assert str(err.value).startswith(f"claim 'x-claim' field '{field}'")


def test_missing_field_duplicates_and_coverage(tmp_path):
    entry = {k: v for k, v in GOOD.items() if k != "where"}
    with pytest.raises(ClaimsError, match="claim 'x-claim' field 'where': missing"):
        load_claims(_write(tmp_path, [entry]), require_all_papers=False)
    with pytest.raises(ClaimsError, match="field 'id': repeated"):
        load_claims(_write(tmp_path, [GOOD, GOOD]), require_all_papers=False)
    with pytest.raises(ClaimsError, match="no claim for the seed paper 'intactkv'"):
        load_claims(_write(tmp_path, [GOOD]))
    good = load_claims(_write(tmp_path, [GOOD]), require_all_papers=False)
    assert good[0].model == "smollm2-135m" and good[0].measured == "0.5"
    table = claims_table(good, REPO / "conf")
    assert table.loc[0, "node"] == (REPO / "conf" / "experiment" / "kivi_axis_ablation.yaml").is_file()


def test_cli_prints_the_claims_table(capsys, tmp_path):
    assert report.main(["--claims"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| id ")]
    assert len(rows) == len(load_claims(CLAIMS))
    assert any(r.startswith("| specache-1bit-zero-point | specache |") for r in rows)
    bad = _write(tmp_path, [{**GOOD, "verdict": "maybe"}])
    assert report.main(["--claims", "--claims-file", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvbench.report: error: claim 'x-claim' field 'verdict': 'maybe' is not one of: "
        "reproduced in direction; not reproduced; not testable here; pending"
    ]
