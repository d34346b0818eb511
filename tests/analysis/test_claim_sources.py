"""The claims of the paper files (``kvbench/papers/<paper>.yaml``) against the provenance fixture
that ``scripts/check_claim_sources.py`` writes from the source documents (tests never read
``../shared``): a claim whose where, published or quote changed, or that nobody checked, fails here
until the script is rerun."""

import json
import re
from pathlib import Path

from kvbench.analysis.papers import claims_of, load_papers

REPO = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "tests" / "fixtures" / "claim_sources.json").read_text())["claims"]
PAPERS = load_papers(conf_dir=REPO / "kvbench" / "conf")
SOURCE = {p.id: p.source for p in PAPERS}
DECLARED = [
    {"id": c.id, "paper": c.paper, "where": c.where, "published": c.published, "quote": c.quote}
    for c in claims_of(PAPERS)
]
DOCUMENTS = {"kivi-intactkv-kvquant.md", "ott.md", "readkv.md", "semkv.md", "specache.md"}


def _quotes(claim):
    q = claim.get("quote")
    return q if isinstance(q, list) else [q]


def test_every_claim_was_checked_against_its_document():
    checked = {e["id"]: e for e in FIXTURE}
    assert [c["id"] for c in DECLARED] == list(checked), "rerun scripts/check_claim_sources.py"
    for claim in DECLARED:
        entry = checked[claim["id"]]
        assert entry["document"] in DOCUMENTS and entry["document"] == SOURCE[claim["paper"]]
        assert (entry["where"], entry["published"], entry["quote"]) == (
            claim["where"],
            str(claim["published"]),
            _quotes(claim),
        ), f"{claim['id']}: changed since it was checked; rerun scripts/check_claim_sources.py"


def test_each_where_label_and_published_number_has_its_excerpt():
    for entry in FIXTURE:
        labels = [p.strip() for p in re.split(r"[,/]", entry["where"])] if entry["where"] != "summary" else []
        assert [m["label"] for m in entry["labels"]] == labels, entry["id"]
        for match in entry["labels"]:
            assert match["form"] in match["excerpt"], entry["id"]
        for match in entry["numbers"]:
            assert match["number"] in match["excerpt"] and match["number"] in entry["published"], entry["id"]


def test_at_least_forty_claims_with_no_venue_the_documents_lack():
    assert len(DECLARED) >= 40
    for claim in DECLARED:
        # the audit found these in "where" fields; the documents give none of them
        for bad in ("NeurIPS", "Findings of ACL", "Sec. 3.2", "Sec. 4.1", "Sec. 4.5", "Fig. 1(c)"):
            assert bad not in claim["where"], claim["id"]
