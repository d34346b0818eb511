"""Check every claim's provenance against the source documents and record what matched.

For each claim of the paper files ``kvbench/papers/<paper>.yaml`` (``kvbench.analysis.papers``):

- ``quote`` (one text or a list) must occur verbatim, up to whitespace, in the paper's ``source``
  document under ``../shared/papers``;
- every label of ``where`` (``Fig. 4``, ``Table 2``, ``Sec. 1``, ``Appendix G``, ``Abstract``, or
  ``§ HEADING``: a heading line of the document such as ``§ 实验细节``; separated by ``,`` or ``/``;
  a parenthetical remark is not a label) must occur in that document in one of the forms it uses
  (``图4``, ``表6``, ``Figure 2``, ``第4.9节``, a ``## 1`` heading, ``摘要``...) within ``NEAR``
  characters of the quote, so that a label of another part of the document (KIVI's, IntactKV's and
  KVQuant's summaries share one) or a section the text only mentions does not pass; ``where:
  summary`` names none; a venue (ICML, NeurIPS, ACL...) must occur as written;
- every ``where`` of the paper's tables (``tables[].where``, which may begin with the paper's name)
  must name labels the document holds, in the paper's part of a shared document (from the line
  that is the paper's name to the next paper's); ``none (...)`` marks a table of kvbench's own;
- every ``quote`` of the paper's ``accounting`` (how it counts storage) must occur verbatim;
- every number of ``published`` must occur in the quote's neighbourhood (its line and the lines
  on either side), as the document writes it.

The matches are written to ``tests/fixtures/claim_sources.json`` (document name, the matched
sentence or number with a little context); ``tests/analysis/test_claim_sources.py`` holds
the paper files to that file, so a claim whose provenance was not checked fails CI. Tests never
read ``../shared``; this script does, and is rerun whenever a claim's where, published or quote
changes:

    python scripts/check_claim_sources.py [--papers DIR] [--declarations DIR] [--out FILE]

Exit status 1, with one line per problem naming the claim and field, when anything does not match.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from kvbench.analysis.papers import claims_of, load_papers
from kvbench.paths import PAPERS_DIR

REPO = Path(__file__).resolve().parents[1]
# the shared data folder (KVBENCH_DATA_DIR, else ../shared beside the checkout)
DEFAULT_PAPERS = Path(os.environ.get("KVBENCH_DATA_DIR") or REPO.parent / "shared") / "papers"
DEFAULT_OUT = REPO / "tests" / "fixtures" / "claim_sources.json"
CONTEXT = 40  # characters kept either side of a matched label or number
NEAR = 2500  # characters between a claim's quote and the labels of its where

# A number as a claim states it: not part of a name such as "Llama-3.1-8B", "A100" or "INT4".
NUMBER = re.compile(r"(?<![A-Za-z\d.\-_])\d+(?:\.\d+)?(?![\d]|\.\d|[A-WYZa-wyz_])")
LABEL = re.compile(r"^(Fig\.|Figure|Table|Sec\.|Appendix|Algorithm)\s*([\dA-Z][\d.]*)$|^(Abstract)$")
HEADING = re.compile(r"^§\s*(\S.*)$")
REMARK = re.compile(r"\([^()]*\)")
VENUE = re.compile(r"\b(ICML|NeurIPS|ICLR|ACL|EMNLP|NAACL|Findings)\b(?:\s+(?:of\s+ACL\s+)?\d{4})?")


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def label_forms(kind: str, ident: str) -> list[str]:
    """The ways a document may write one ``where`` label (English and Chinese)."""
    if kind in ("Fig.", "Figure"):
        return [f"图{ident}", f"图 {ident}", f"Figure {ident}", f"Fig {ident}", f"Fig. {ident}"]
    if kind == "Table":
        return [f"表{ident}", f"表 {ident}", f"Table {ident}"]
    if kind == "Sec.":
        return [f"第{ident}节", f"\n## {ident} ", f"\n### {ident} ", f"Section {ident}"]
    if kind == "Appendix":
        return [f"附录{ident}", f"Appendix {ident}", f"\n{ident} "]
    if kind == "Algorithm":
        return [f"Algorithm {ident}", f"算法{ident}"]
    return ["摘要", "Abstract"]


def where_parts(where: str, title: str = "") -> list[str]:
    """The labels of a ``where`` field: parenthetical remarks dropped, split at ``,`` and ``/``, a
    leading paper name (``title``'s first word) dropped; empty for ``summary`` and ``none (...)``."""
    where = where.strip()
    if where == "summary" or where.startswith("none"):
        return []
    name = title.split()[0] if title else ""
    parts = []
    for part in re.split(r"[,/]", REMARK.sub("", where)):
        part = part.strip()
        if name and part.startswith(name + " "):
            part = part[len(name) :].strip()
        if part:
            parts.append(part)
    return parts


def _heading_positions(text: str, heading: str) -> list[int]:
    """Where a line of ``text`` is the heading (``#`` marks and spaces aside), or begins with it and
    a colon or full stop (a run-in heading or caption title: ``初步实验的观察结果：(a) ...``)."""
    out, at = [], 0
    for line in text.splitlines(keepends=True):
        bare = line.strip().lstrip("#").strip()
        if bare == heading or any(bare.startswith(heading + mark) for mark in ("：", ":", "。", ". ")):
            out.append(at)
        at += len(line)
    return out


def label_positions(text: str, part: str) -> tuple[list[tuple[str, int]], list[str]]:
    """``([(form, position), ...], forms)``: where the document writes one label of a ``where``
    (``§ HEADING`` or a LABEL), and the forms looked for; ValueError when the part is neither."""
    heading = HEADING.match(part)
    if heading:
        name = heading.group(1).strip()
        return [(name, p) for p in _heading_positions(text, name)], [f"a line {name!r}"]
    match = LABEL.match(part)
    if not match:
        raise ValueError(part)
    kind, ident = (match.group(1), match.group(2)) if match.group(1) else ("Abstract", "")
    forms = label_forms(kind, ident)
    hits = [(f, m.start()) for f in forms for m in re.finditer(re.escape(f) + r"(?!\d)", text)]
    return sorted(hits, key=lambda h: h[1]), forms


def _quote_position(text: str, quote: str) -> int:
    """The quote's first position in ``text``, matched ignoring whitespace (-1: absent)."""
    squashed, index = [], []
    for i, ch in enumerate(text):
        if not ch.isspace():
            squashed.append(ch)
            index.append(i)
    at = "".join(squashed).find(_squash(quote))
    return index[at] if at >= 0 else -1


def _excerpt(text: str, start: int, end: int) -> str:
    return re.sub(r"\s+", " ", text[max(0, start - CONTEXT) : end + CONTEXT]).strip()


def _neighbourhood(text: str, quote: str) -> str:
    """The lines around the quote's first occurrence (matched ignoring whitespace)."""
    lines = text.splitlines()
    target = _squash(quote)
    for i in range(len(lines)):
        window = "".join(lines[i : i + 6])
        if target[: min(len(target), 30)] in _squash(window):
            return "\n".join(lines[max(0, i - 1) : i + 7])
    return ""


def check_claim(claim: dict, documents: dict[str, str], source: str) -> tuple[dict, list[str]]:
    """The fixture entry of one claim of the paper whose document is ``source`` and the problems
    found (empty when everything matched)."""
    cid = claim.get("id", "?")
    problems: list[str] = []
    quotes = claim.get("quote")
    quotes = quotes if isinstance(quotes, list) else [quotes] if quotes else []
    if not quotes:
        return {}, [f"claim {cid!r} field 'quote': missing (the document's own words the claim rests on)"]
    if source not in documents:
        return {}, [f"claim {cid!r}: its paper's source {source!r} is not one of {', '.join(documents)}"]
    doc = source
    text = documents[doc]
    if not all(_squash(q) in _squash(text) for q in quotes):
        return {}, [f"claim {cid!r} field 'quote': not found verbatim in its paper's source {doc}"]
    entry: dict = {
        "id": cid,
        "document": doc,
        "quote": quotes,
        "where": claim["where"],
        "published": str(claim["published"]),
        "labels": [],
        "numbers": [],
    }
    where = str(claim["where"])
    anchors = [_quote_position(text, q) for q in quotes]
    for part in where_parts(where):
        try:
            hits, forms = label_positions(text, part)
        except ValueError:
            problems.append(
                f"claim {cid!r} field 'where': {part!r} is not a label such as 'Fig. 4', 'Sec. 1' "
                "or '§ 实验细节'"
            )
            continue
        if not hits:
            problems.append(f"claim {cid!r} field 'where': {doc} contains no {part!r} ({' | '.join(forms)})")
            continue
        dist, form, at = min((min(abs(p - a) for a in anchors), f, p) for f, p in hits)
        if dist > NEAR:
            problems.append(
                f"claim {cid!r} field 'where': {part!r} ({form.strip()!r}) is {dist} characters from the "
                f"quote in {doc}, more than {NEAR}: the label belongs to another part of the document"
            )
            continue
        entry["labels"].append(
            {
                "label": part,
                "form": form.strip(),
                "distance": dist,
                "excerpt": _excerpt(text, at, at + len(form)),
            }
        )
    for venue in VENUE.finditer(where + " " + str(claim["published"])):
        if venue.group(0) not in text:
            problems.append(f"claim {cid!r}: venue {venue.group(0)!r} does not occur in {doc}")
    near = "\n".join(_neighbourhood(text, q) for q in quotes)
    # a range ("2.35x-3.47x", "1.2-1.6x") states both ends
    published = re.sub(r"(\d)(x?)-(\d)", r"\1\2 \3", str(claim["published"]))
    for number in dict.fromkeys(NUMBER.findall(published)):
        hit = re.search(rf"(?<![\d.]){re.escape(number)}(?![\d]|\.\d)", near)
        if hit is None:
            problems.append(
                f"claim {cid!r} field 'published': {number} does not occur beside the quote in {doc}"
            )
            continue
        entry["numbers"].append({"number": number, "excerpt": _excerpt(near, hit.start(), hit.end())})
    return entry, problems


def _part_of(text: str, title: str, names: list[str]) -> str:
    """The paper's part of a shared document: from the line that is its name (``title``'s first
    word) to the next line that is another paper's name; the whole text when no line is its name."""
    name = title.split()[0]
    starts = _heading_positions(text, name)
    if not starts:
        return text
    start = starts[0]
    ends = [p for other in names if other != name for p in _heading_positions(text, other) if p > start]
    return text[start : min(ends) if ends else len(text)]


def check_paper(paper, documents: dict[str, str], names: list[str]) -> tuple[dict, list[str]]:
    """The fixture entry of a paper's tables' ``where`` fields and its accounting's quotes, and the
    problems found."""
    problems: list[str] = []
    entry: dict = {"paper": paper.id, "document": paper.source, "tables": [], "accounting": []}
    if paper.source not in documents:
        return entry, [
            f"paper {paper.id!r}: its source {paper.source!r} is not one of {', '.join(documents)}"
        ]
    text = documents[paper.source]
    part_text = _part_of(text, paper.title, names)
    for layout in paper.tables:
        found = {"node": layout.node, "where": layout.where, "labels": []}
        for part in where_parts(layout.where, paper.title):
            try:
                hits, forms = label_positions(part_text, part)
            except ValueError:
                problems.append(f"paper {paper.id!r} table {layout.node!r} where: {part!r} is not a label")
                continue
            if not hits:
                problems.append(
                    f"paper {paper.id!r} table {layout.node!r} where: its part of {paper.source} contains "
                    f"no {part!r} ({' | '.join(forms)})"
                )
                continue
            form, at = hits[0]
            found["labels"].append(
                {"label": part, "form": form.strip(), "excerpt": _excerpt(part_text, at, at + len(form))}
            )
        entry["tables"].append(found)
    if paper.accounting is not None:
        for q in paper.accounting.quote:
            if _squash(q) not in _squash(text):
                problems.append(
                    f"paper {paper.id!r} accounting quote not found verbatim in {paper.source}: {q[:40]!r}"
                )
            else:
                entry["accounting"].append(q)
    return entry, problems


def declared_claims(declarations: str | Path = PAPERS_DIR) -> list[tuple[dict, str]]:
    """Each claim's id, quote, where and published, with its paper's source document, in the
    claims register's order."""
    papers = load_papers(declarations)
    source = {p.id: p.source for p in papers}
    return [
        ({"id": c.id, "quote": c.quote, "where": c.where, "published": c.published}, source[c.paper])
        for c in claims_of(papers)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--papers", default=str(DEFAULT_PAPERS))
    parser.add_argument("--declarations", default=str(PAPERS_DIR), help="folder of <paper>.yaml files")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    papers = Path(args.papers)
    documents = {p.name: p.read_text() for p in sorted(papers.glob("*.md")) if p.name != "README.md"}
    if not documents:
        print(f"--papers={papers}: no source documents (*.md) there", file=sys.stderr)
        return 2
    entries, problems = [], []
    for claim, source in declared_claims(args.declarations):
        entry, found = check_claim(claim, documents, source)
        problems += found
        if entry:
            entries.append(entry)
    papers = load_papers(args.declarations)
    names = [p.title.split()[0] for p in papers]
    paper_entries = []
    for paper in papers:
        entry, found = check_paper(paper, documents, names)
        problems += found
        paper_entries.append(entry)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        return 1
    out = Path(args.out)
    out.write_text(
        json.dumps({"claims": entries, "papers": paper_entries}, ensure_ascii=False, indent=1) + "\n"
    )
    print(
        f"{len(entries)} claims and {len(paper_entries)} papers' tables and accounting checked against "
        f"{', '.join(documents)}; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
