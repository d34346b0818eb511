"""``not_worse(a, b, margin=m)`` and ``equivalent(a, b, margin=m)``: the paired TOST, or the
exact tests of ``kvbench.stats.exact`` on a bounded metric.
"""

from __future__ import annotations

import math

import numpy as np

from kvbench.analysis.claims.outcome import (
    POWER,
    Outcome,
    _all_at_bound,
    _ci_text,
    _constant_text,
    _fmt,
    _no_spread,
    _t_sides,
    _two_sided,
)
from kvbench.analysis.claims.schema import Rule
from kvbench.analysis.claims.selection import _Context, metric_bounds
from kvbench.stats import bootstrap_ci, n_for_difference, n_from_pilot, tost_equivalence
from kvbench.stats.exact import n_for_binomial_side, paired_bounded_p


def _margin_outcome(ctx: _Context, rule: Rule) -> Outcome:
    """not_worse / equivalent. A bounded metric (a task score) takes the exact tests of
    ``kvbench.stats.exact`` (``paired_bounded_p``): the confirming side is the exact binomial test
    on the pairs lost (and, for equivalence, won), so ties prove only what their count allows; the
    refuting side is exact too. Every arm at one bound is ``not testable here`` (a ceiling or floor).
    An unbounded metric takes the paired TOST of ``kvbench.stats.tost_equivalence``; with no spread
    at all the constant difference is compared with the margin by arithmetic."""
    (a, b), metric = ctx.paired(rule, rule.arms)
    raw = a - b
    d = raw if ctx.higher_is_better(metric) else -raw
    margin, alpha = float(rule.kwargs["margin"]), ctx.alpha
    ci = bootstrap_ci(raw, level=1 - alpha, n_resamples=ctx.n_resamples, rng=ctx.rng(rule))
    mean = float(d.mean())
    out = Outcome(rule.text, "inconclusive", float(raw.mean()), ci, int(d.size), margin=margin)
    out.measured = (
        f"{rule.arms[0]} - {rule.arms[1]} = {_fmt(out.estimate)}{_ci_text(ci)} {metric}, n={d.size}"
    )
    bounds = metric_bounds(metric, a, b)
    flat = _all_at_bound(rule.arms, [a, b], bounds, metric)
    if flat is not None:
        out.verdict, out.reason = "not testable here", flat
        return out
    if bounds is not None:
        return _bounded_margin(out, rule, d, bounds, margin, alpha)
    if _no_spread(d):
        out.arithmetic = True
        inside = mean > -margin if rule.kind == "not_worse" else abs(mean) < margin
        out.verdict = "reproduced" if inside else "evidence against"
        out.measured += f"; {_constant_text(float(raw[0]), d.size)} at margin {_fmt(margin)}"
        return out
    tost = tost_equivalence(d, margin, alpha)
    if rule.kind == "not_worse":
        p_inferior = _t_sides(d, -margin)[1]
        out.measured += (
            f", non-inferiority p={_fmt(tost['p_lower'])}, inferiority p={_fmt(p_inferior)}"
            f" at margin {_fmt(margin)}"
        )
        out.page_tests = [(rule.text, _two_sided(tost["p_lower"], p_inferior))]
        if tost["p_lower"] < alpha:
            out.verdict = "reproduced"
        elif p_inferior < alpha:
            out.verdict = "evidence against"
        else:
            out.n_confirm = n_from_pilot(d, "noninferiority", margin=margin, alpha=alpha, power=POWER)
            out.n_refute = n_from_pilot(d, "inferiority", margin=margin, alpha=alpha, power=POWER)
        return out
    above, below = _t_sides(d, margin)[0], _t_sides(d, -margin)[1]
    p_outside = min(1.0, 2 * min(above, below))  # Bonferroni over the two sides
    out.measured += f", TOST p={_fmt(tost['p'])}, outside-margin p={_fmt(p_outside)} at margin {_fmt(margin)}"
    out.page_tests = [(rule.text, _two_sided(tost["p"], p_outside))]
    if tost["equivalent"]:
        out.verdict = "reproduced"
    elif p_outside < alpha:
        out.verdict = "evidence against"
    else:
        out.n_confirm = n_from_pilot(d, "equivalence", margin=margin, alpha=alpha, power=POWER)
        excess = abs(mean) - margin
        sd = float(d.std(ddof=1))
        out.n_refute = n_for_difference(excess, sd, alpha / 2, POWER) if excess > 0 else math.inf
    return out


def _refute_p(d: np.ndarray, span: float, shift: float, side: str) -> dict:
    """The refuting side of a margin rule on a bounded metric: exact for 0/1 scores (Clopper-Pearson
    on the discordant pairs) and for differences with no spread (Anderson's bound); for fractional
    scores with some spread, the one-sided paired t-test, as for an unbounded metric: the
    distribution-free bound is too loose at a few dozen pairs to refute even every pair lost, and
    the t-test there has a spread to divide by. (The confirming side stays exact: that is where
    ties made the t-test claim what the data cannot show.)"""
    binary = bool(np.all(np.isclose(np.abs(d), span) | np.isclose(d, 0)))
    if binary or _no_spread(d):
        return paired_bounded_p(d, span, shift, side)
    greater, less = _t_sides(d, shift)
    return {"p": greater if side == "greater" else less, "test": "paired t"}


def _bounded_margin(
    out: Outcome, rule: Rule, d: np.ndarray, bounds: tuple[float, float], margin: float, alpha: float
) -> Outcome:
    """The exact margin tests of a bounded metric (see ``_margin_outcome``); the pairs needed are
    planned for the exact binomial side at the observed shares of lost and won pairs."""
    span = bounds[1] - bounds[0]
    n = int(d.size)
    lost, won = int(np.count_nonzero(d < 0)), int(np.count_nonzero(d > 0))
    lower = paired_bounded_p(d, span, -margin, "greater")
    below = _refute_p(d, span, -margin, "less")
    best = max(0.0, 1 - margin / span) ** n
    shares = f"{lost} of {n} pairs lost, {won} won"
    if rule.kind == "not_worse":
        p_claim, p_against = lower["p"], below["p"]
        out.measured += (
            f"; {shares}; exact non-inferiority p={_fmt(p_claim)} ({lower['test']}), inferiority "
            f"p={_fmt(p_against)} ({below['test']}) at margin {_fmt(margin)}"
        )
        plans = [n_for_binomial_side(lost / n, margin / span, alpha, POWER)]
    else:
        upper = paired_bounded_p(d, span, margin, "less")
        above = _refute_p(d, span, margin, "greater")
        p_claim = max(lower["p"], upper["p"])
        p_against = min(1.0, 2 * min(below["p"], above["p"]))
        out.measured += (
            f"; {shares}; exact TOST p={_fmt(p_claim)} ({lower['test']}), outside-margin "
            f"p={_fmt(p_against)} ({below['test']}) at margin {_fmt(margin)}"
        )
        plans = [
            n_for_binomial_side(lost / n, margin / span, alpha, POWER),
            n_for_binomial_side(won / n, margin / span, alpha, POWER),
        ]
    if best >= alpha:
        out.measured += (
            f"; at n={n} the exact test cannot confirm whatever the data (best p {_fmt(best)}), only refute"
        )
    out.page_tests = [(rule.text, _two_sided(p_claim, p_against))]
    if p_claim < alpha:
        out.verdict = "reproduced"
    elif p_against < alpha:
        out.verdict = "evidence against"
    else:
        out.n_confirm = max(plans)
        sd = float(d.std(ddof=1)) if n > 1 else 0.0
        excess = (abs(float(d.mean())) if rule.kind == "equivalent" else -float(d.mean())) - margin
        out.n_refute = n_for_difference(excess, sd, alpha / 2, POWER) if excess > 0 and sd > 0 else math.inf
    return out
