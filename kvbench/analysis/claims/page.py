"""The claims page's tables and lines from the verdicts: one row per claim (:func:`claims_table`),
the verdicts counted (:func:`verdict_counts`, proxy verdicts apart from task-level ones), the
page-wide Benjamini-Hochberg line (:func:`page_tests`, :func:`fdr_line`), the accounted rules'
two lines (:func:`accounting_table`), the margin sensitivity (:func:`margin_table`) and the
models side by side (:func:`models_table`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from kvbench.analysis.claims.outcome import _fmt
from kvbench.analysis.claims.verdicts import MARGIN_FACTORS, VERDICTS, ClaimResult
from kvbench.stats.exact import benjamini_hochberg

DEFAULT_MODEL = "smollm2-135m"


CLAIMS_COLUMNS = [
    "id",
    "paper",
    "where",
    "published",
    "measured",
    "n",
    "verdict",
    "n_to_confirm",
    "n_to_refute",
    "experiment",
    "rule",
]


def _count(value: float | None) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return "inf" if math.isinf(value) else str(int(value))


def claims_table(results: list[ClaimResult]) -> pd.DataFrame:
    """One row per claim: id, paper, where, published, measured (each rule's estimate, interval,
    pairs and p-values), n (fewest pairs of any rule), verdict (``... in proxy`` for a proxy rule),
    n_to_confirm / n_to_refute (pairs an inconclusive claim would need to be settled each way;
    ``inf`` when the observed effect points the other way or is nil), experiment, rule (with the
    reason for ``not run`` / ``premise not met here`` / ``not testable here``, and a proxy's
    task-level claim)."""
    rows = []
    for r in results:
        c = r.claim
        rule = "; ".join(x.text for x in c.rules) if c.rules else "-"
        if r.verdict in ("not run", "not testable here", "premise not met here") and r.reason:
            rule = f"{rule} ({r.reason})" if c.rules else r.reason
        if c.proxy:
            rule += f" [proxy: {c.proxy}; task-level claim: {c.task_claim}]"
        rows.append(
            {
                "id": c.id,
                "paper": c.paper,
                "where": c.where,
                "published": str(c.published),
                "measured": r.measured if r.verdict not in ("not run", "not testable here") else "-",
                "n": r.n,
                "verdict": r.shown_verdict,
                "n_to_confirm": _count(r.n_confirm),
                "n_to_refute": _count(r.n_refute),
                "experiment": c.experiment or "-",
                "rule": rule,
            }
        )
    return pd.DataFrame(rows, columns=CLAIMS_COLUMNS, dtype=object)


def verdict_counts(results: list[ClaimResult]) -> str:
    """The verdicts counted, task-level claims apart from proxy ones: a proxy verdict (a stand-in
    for the paper's quantity) is not a task-level reproduction and is not counted among them."""
    task = [r for r in results if not r.claim.proxy]
    proxy = [r for r in results if r.claim.proxy]
    text = "; ".join(f"{v}: {sum(r.verdict == v for r in task)}" for v in VERDICTS)
    if proxy:
        counted = [
            f"{v}: {sum(r.verdict == v for r in proxy)}"
            for v in VERDICTS
            if any(r.verdict == v for r in proxy)
        ]
        text += f" (task-level claims); in proxy, counted apart: {'; '.join(counted)}"
    return text


FDR_Q = 0.05


def page_tests(results: list[ClaimResult]) -> pd.DataFrame:
    """Every test on the page with its raw p-value and its Benjamini-Hochberg adjustment across the
    whole page at ``FDR_Q``: one row per rule (its two one-sided p-values as one two-sided p,
    ``2 min``) and one per grid point of a cliff rule (its two-sided sign-flip p); a test two papers
    declare is counted once. Rules decided by arithmetic on a constant, and rules that did not run,
    hold no test and are left out."""
    rows, seen = [], set()
    for r in results:
        for o in r.outcomes:
            if o.signature is not None and o.signature in seen:
                continue  # the same test declared by another paper: counted once
            seen.add(o.signature)
            for label, pv in o.page_tests:
                if pv is not None and not math.isnan(pv):
                    rows.append(
                        {
                            "id": r.claim.id,
                            "rule": o.rule,
                            "test": label,
                            "p": float(pv),
                            "verdict": o.verdict,
                        }
                    )
    frame = pd.DataFrame(rows, columns=["id", "rule", "test", "p", "verdict"])
    adjusted, reject = benjamini_hochberg(frame["p"].to_numpy(dtype=float), FDR_Q)
    return frame.assign(p_bh=adjusted, discovery=reject)


def fdr_line(results: list[ClaimResult]) -> str:
    """The page-wide false discovery line: how many of the page's tests are discoveries under
    Benjamini-Hochberg at ``FDR_Q``, and which decided verdicts (reproduced, evidence against) rest
    on a rule that is not one (per-claim Holm keeps them; across the page they may be chance)."""
    tests = page_tests(results)
    decided = {"reproduced", "evidence against"}
    weak = sorted(
        {
            f"{row.id} ({row.rule})"
            for row in tests.itertuples()
            if row.verdict in decided and not row.discovery and row.test == row.rule
        }
    )
    arithmetic = sorted(
        {r.claim.id for r in results for o in r.outcomes if o.arithmetic and o.accounting is None}
    )
    accounted = sorted({r.claim.id for r in results for o in r.outcomes if o.accounting is not None})
    line = (
        f"Page-wide false discovery rate: Benjamini-Hochberg at q = {FDR_Q:g} over the {len(tests)} tests on "
        f"this page (each rule's two one-sided p-values as one two-sided p; each cliff grid point's "
        f"sign-flip p): {int(tests['discovery'].sum())} discoveries, beside each claim's own Holm. "
    )
    if weak:
        line += f"Decided rules that are not discoveries across the page: {', '.join(weak)}."
    else:
        line += "Every decided rule is a discovery across the page."
    if arithmetic:
        line += f" Decided by arithmetic on a constant (no test): {', '.join(arithmetic)}."
    if accounted:
        line += (
            f" Decided by arithmetic under the paper's own accounting (no test; kvbench's bytes beside): "
            f"{', '.join(accounted)}."
        )
    return line


ACCOUNTING_COLUMNS = ["id", "rule", "counted", "value", "verdict"]


def accounting_table(results: list[ClaimResult]) -> pd.DataFrame:
    """Each ``accounted`` rule on two lines: the paper's count (which decides the verdict) and
    kvbench's bytes (which do not), the second followed by what kvbench holds that the paper
    does not count."""
    rows = []
    for r in results:
        explained = False
        for o in r.outcomes:
            a = o.accounting
            if a is None:
                continue
            rows.append(
                {
                    "id": r.claim.id,
                    "rule": o.rule,
                    "counted": "the paper's way",
                    "value": a["paper"],
                    "verdict": o.verdict,
                }
            )
            rows.append(
                {
                    "id": "",
                    "rule": "",
                    "counted": "kvbench's bytes",
                    "value": a["kvbench"] + ("; as above" if explained else f". {a['differs'].strip()}"),
                    "verdict": "(not judged: a convention)",
                }
            )
            explained = True
    return pd.DataFrame(rows, columns=ACCOUNTING_COLUMNS, dtype=object)


def margin_table(results: list[ClaimResult]) -> pd.DataFrame:
    """Each margin rule whose margin kvbench chose (``margin_source`` not ``paper``): its verdict at
    half the margin, at the margin and at twice it."""
    rows = []
    for r in results:
        for o in r.outcomes:
            if not o.sensitivity or o.margin is None:
                continue
            half, double = (o.margin * f for f in MARGIN_FACTORS)
            rows.append(
                {
                    "id": r.claim.id,
                    "rule": o.rule,
                    "margin": _fmt(o.margin),
                    "at half": o.sensitivity.get(half, "-"),
                    "as declared": o.verdict,
                    "at twice": o.sensitivity.get(double, "-"),
                }
            )
    return pd.DataFrame(
        rows, columns=["id", "rule", "margin", "at half", "as declared", "at twice"], dtype=object
    )


def models_table(by_model: Mapping[str, list[ClaimResult]], first: str = DEFAULT_MODEL) -> pd.DataFrame:
    """One row per claim, one verdict column per model (``first`` leftmost, then by name), each
    verdict with its pairs ``n`` where the model's runs gave one: the claims page's columns side
    by side. A model only enters when some claim has runs on it (a verdict other than ``not run``
    or ``not testable here``), so a model the archives do not hold adds no empty column."""
    models = sorted(by_model, key=lambda m: (m != first, m))
    models = [
        m
        for m in models
        if m == first or any(r.verdict not in ("not run", "not testable here") for r in by_model[m])
    ]
    rows: dict[str, dict[str, Any]] = {}
    for model in models:
        for r in by_model[model]:
            row = rows.setdefault(
                r.claim.id,
                {"id": r.claim.id, "paper": r.claim.paper, "published": str(r.claim.published)},
            )
            shown = r.shown_verdict
            row[model] = (
                f"{shown} (n={r.n})" if r.n and r.verdict not in ("not run", "not testable here") else shown
            )
    return pd.DataFrame(list(rows.values()), columns=["id", "paper", "published", *models], dtype=object)
