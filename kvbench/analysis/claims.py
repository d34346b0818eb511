"""The paper-claims register (``results/claims.yaml``): each quantitative claim of the seed papers
that kvbench can test, what this harness measured for it, and a verdict.

Schema (one mapping per claim under the top-level ``claims:`` list):

- ``id``: unique, lower-case words joined by ``-``;
- ``paper``: one of ``PAPERS`` (kivi, intactkv, kvquant, ott, readkv, semkv, specache);
- ``where``: the table, figure or section of the paper;
- ``statement``: the claim in one or two sentences;
- ``published``: the paper's value (number or text);
- ``experiment``: the ``conf/experiment`` node that tests it (may be null only when the verdict is
  ``not testable here``);
- ``metric``: what the measured value is (optional text);
- ``measured``: the value on the default model, or ``pending``;
- ``source``: the committed aggregated result under ``results/`` that holds ``measured``
  (null while pending);
- ``verdict``: one of ``VERDICTS``;
- ``note``: optional text; required for ``not testable here`` (why) and ``not reproduced``.

Consistency: ``pending`` verdict <=> ``measured: pending`` and no source; ``reproduced in
direction`` / ``not reproduced`` need a measured value and a source file that exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

PAPERS = ("kivi", "intactkv", "kvquant", "ott", "readkv", "semkv", "specache")
VERDICTS = ("reproduced in direction", "not reproduced", "not testable here", "pending")
REQUIRED = ("id", "paper", "where", "statement", "published", "experiment", "measured", "source", "verdict")
OPTIONAL = ("metric", "note", "model")
DEFAULT_MODEL = "smollm2-135m"
_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9.]+)*$")


class ClaimsError(ValueError):
    """A schema violation, naming the claim and the field."""

    def __init__(self, claim: str, field: str, problem: str):
        super().__init__(f"claim {claim!r} field {field!r}: {problem}")
        self.claim, self.field = claim, field


@dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    where: str
    statement: str
    published: Any
    experiment: str | None
    measured: Any
    source: str | None
    verdict: str
    metric: str | None = None
    note: str | None = None
    model: str = DEFAULT_MODEL


def _text(cid: str, entry: dict, key: str, allow_none: bool = False) -> None:
    value = entry.get(key)
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value.strip():
        raise ClaimsError(cid, key, f"must be non-empty text, got {value!r}")


def validate(entry: Any, index: int, root: Path) -> Claim:
    """One claim mapping checked against the schema (see the module docstring)."""
    if not isinstance(entry, dict):
        raise ClaimsError(f"#{index}", "(entry)", f"must be a mapping, got {type(entry).__name__}")
    cid = entry.get("id")
    if not isinstance(cid, str) or not _ID.match(cid):
        raise ClaimsError(f"#{index}", "id", f"must match {_ID.pattern}, got {cid!r}")
    missing = [k for k in REQUIRED if k not in entry]
    if missing:
        raise ClaimsError(cid, missing[0], "missing")
    unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ClaimsError(cid, unknown[0], f"unknown field; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    if entry["paper"] not in PAPERS:
        raise ClaimsError(cid, "paper", f"{entry['paper']!r} is not one of {', '.join(PAPERS)}")
    verdict = entry["verdict"]
    if verdict not in VERDICTS:
        raise ClaimsError(cid, "verdict", f"{verdict!r} is not one of: {'; '.join(VERDICTS)}")
    for key in ("where", "statement"):
        _text(cid, entry, key)
    _text(cid, entry, "experiment", allow_none=verdict == "not testable here")
    for key in ("metric", "note"):
        _text(cid, entry, key, allow_none=True)
    if entry["published"] is None or entry["published"] == "":
        raise ClaimsError(cid, "published", "the paper's value is required")
    measured, source = entry["measured"], entry["source"]
    if verdict == "pending":
        if measured != "pending":
            raise ClaimsError(
                cid, "measured", f"must be 'pending' while the verdict is pending, got {measured!r}"
            )
        if source is not None:
            raise ClaimsError(cid, "source", "must be null while the verdict is pending")
    elif verdict in ("reproduced in direction", "not reproduced"):
        if measured in (None, "", "pending"):
            raise ClaimsError(cid, "measured", f"a value is required for verdict {verdict!r}")
        if not isinstance(source, str) or not source.startswith("results/"):
            raise ClaimsError(cid, "source", f"must be a committed file under results/, got {source!r}")
    if verdict in ("not testable here", "not reproduced"):
        _text(cid, entry, "note")
    if source is not None and (not isinstance(source, str) or not (root / source).is_file()):
        raise ClaimsError(cid, "source", f"{source} does not exist")
    return Claim(
        **{k: entry.get(k) for k in REQUIRED + OPTIONAL if k != "model"},
        model=entry.get("model") or DEFAULT_MODEL,
    )


def load_claims(
    path: str | Path, root: str | Path | None = None, require_all_papers: bool = True
) -> list[Claim]:
    """Read and validate a claims file. ``root`` is the repository root that ``source`` paths are
    relative to (default: the folder above the file's ``results/`` folder). With
    ``require_all_papers``, every paper in ``PAPERS`` needs at least one claim."""
    path = Path(path)
    if not path.is_file():
        raise ClaimsError("(file)", "path", f"{path} does not exist")
    root = Path(root) if root is not None else path.resolve().parent.parent
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("claims"), list):
        raise ClaimsError("(file)", "claims", "the file must hold a top-level 'claims:' list")
    claims = [validate(entry, i, root) for i, entry in enumerate(doc["claims"])]
    seen: set[str] = set()
    for claim in claims:
        if claim.id in seen:
            raise ClaimsError(claim.id, "id", "repeated")
        seen.add(claim.id)
    if require_all_papers:
        covered = {c.paper for c in claims}
        for paper in PAPERS:
            if paper not in covered:
                raise ClaimsError("(file)", "paper", f"no claim for the seed paper {paper!r}")
    return claims


def claims_table(claims: list[Claim], conf_dir: str | Path | None = None) -> pd.DataFrame:
    """The claims as a table: id, paper, where, published, measured, verdict, experiment, source;
    with ``conf_dir`` (the ``conf`` folder) also ``node``: whether ``experiment/NAME.yaml`` exists."""
    columns = ["id", "paper", "where", "published", "measured", "verdict", "experiment", "source"]
    table = pd.DataFrame([{c: getattr(claim, c) for c in columns} for claim in claims], columns=columns)
    if conf_dir is not None:
        folder = Path(conf_dir) / "experiment"
        table["node"] = [
            None if c.experiment is None else (folder / f"{c.experiment}.yaml").is_file() for c in claims
        ]
    return table
