"""``accounted(a, "q") >= x`` / ``<= x`` / ``== x``: a storage claim counted the paper's own way
(``kvbench.analysis.accounting``), decided by arithmetic, with kvbench's bytes beside it.
"""

from __future__ import annotations

import math

import numpy as np

from kvbench.analysis.accounting import evaluate, reaches
from kvbench.analysis.claims.outcome import Outcome, _fmt, _no_spread
from kvbench.analysis.claims.schema import Rule
from kvbench.analysis.claims.selection import NotRun, _Context, _subset, several_configurations


def _accounted_outcome(ctx: _Context, rule: Rule) -> Outcome:
    """``accounted(arm, "q") op x``: the arm counted the paper's way (its accounting's quantity q,
    from the stored rows) against x at the precision x is written with; arithmetic, no test. The
    same rows counted kvbench's way (the bytes kvbench holds) go on a second line with the
    difference and what the paper leaves out; they never decide the verdict."""
    acc = ctx.claim.accounting
    assert acc is not None  # validate() refuses an accounted rule without one
    q = acc.quantities[rule.args[0]]
    arm = rule.arms[0]
    rows = ctx.rows(arm)
    if several_configurations(rows):
        raise NotRun(f"arm {arm!r} matches {rows['method'].nunique()} configurations; narrow it")
    if q.config:
        configs = rows["method_config"] if "method_config" in rows else [{}] * len(rows)
        if not all(_subset(q.config, c) for c in configs):
            raise NotRun(
                f"arm {arm!r} is not a configuration the paper's {q.name!r} count applies to ({q.config})"
            )
    try:
        paper = evaluate(q.paper, rows, acc.constants)
        ours = evaluate(q.kvbench, rows, acc.constants)
    except KeyError as err:
        raise NotRun(f"arm {arm!r}: no stored {err.args[0]!r} for the accounting's {q.name!r}") from None
    paper, ours = paper[np.isfinite(paper)], ours[np.isfinite(ours)]
    if not paper.size:
        raise NotRun(f"arm {arm!r}: {q.paper} is not stored on its rows")
    bits, kv_bits = float(paper.mean()), float(ours.mean()) if ours.size else math.nan
    stated, kv_stated = acc.stated(q, bits), acc.stated(q, kv_bits)
    places = rule.places if rule.places is not None else 3
    holds = reaches(stated, rule.op or "==", float(rule.bound), places)
    unit = {"ratio": "x", "fraction": " of FP16", "bits": " bits per value"}[q.as_]
    op = "about" if rule.op == "==" else rule.op
    spread = (
        ""
        if _no_spread(paper)
        else f" (mean of {paper.size} rows, {_fmt(float(paper.min()))}-{_fmt(float(paper.max()))})"
    )
    paper_line = (
        f"{arm} counted as the paper counts ({q.paper}): {bits:.4g} bits per value{spread}"
        + ("" if q.as_ == "bits" else f", {stated:.4g}{unit}")
        + f", {round(stated, places):.{places}f} at the paper's precision; claim {op} {rule.bound:.{places}f}"
    )
    kv_line = (
        f"kvbench's bytes ({q.kvbench}): {kv_bits:.4g} bits per value"
        + ("" if q.as_ == "bits" else f", {kv_stated:.4g}{unit}")
        + f"; {kv_bits - bits:+.4g} bits per value against the paper's count"
    )
    out = Outcome(rule.text, "reproduced" if holds else "evidence against", stated, None, int(paper.size))
    out.arithmetic = True
    out.measured = f"paper's accounting: {paper_line}; {kv_line}"
    out.accounting = {
        "quantity": q.name,
        "what": q.what,
        "paper": paper_line,
        "kvbench": kv_line,
        "differs": acc.differs,
        "holds": holds,
    }
    return out
