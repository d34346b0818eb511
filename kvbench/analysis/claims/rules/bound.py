"""``at_least(a, v)``, ``at_most(a, v)`` and ``ratio(a, b) >= x`` / ``<= x``: a mean, or a ratio
of means, against a written bound.
"""

from __future__ import annotations

import math

import numpy as np

from kvbench.analysis.claims.outcome import (
    Outcome,
    _ci_text,
    _constant_text,
    _fmt,
    _no_spread,
    _plan,
    _t_sides,
    _two_sided,
)
from kvbench.analysis.claims.schema import Rule
from kvbench.analysis.claims.selection import NotRun, _Context, _pairs, metric_bounds
from kvbench.stats import bootstrap_ci
from kvbench.stats.exact import bounded_mean_p, is_binary


def _bound_outcome(ctx: _Context, rule: Rule) -> Outcome:
    """at_least / at_most on one arm, ratio on two, signed so that positive supports the claim.

    A bounded metric (a hit rate, a score) takes the exact bound of ``kvbench.stats.exact``
    (``bounded_mean_p``: the exact binomial test for 0/1 values, Anderson's bound otherwise). An
    unbounded one takes a one-sample t-test of ``x - bound`` (for a ratio, of ``a - bound * b`` per
    pair, Fieller's linearization); with no spread at all (an accounting quantity that is the same
    on every sample) there is no test and the constant is compared with the bound by arithmetic."""
    alpha, rng = ctx.alpha, ctx.rng(rule)
    bounds = None
    if rule.kind == "ratio":
        (a, b), metric = ctx.paired(rule, rule.arms)
        x = rule.bound
        d = a - x * b if rule.op == ">=" else x * b - a
        idx = rng.integers(0, a.size, size=(ctx.n_resamples, a.size))
        with np.errstate(divide="ignore", invalid="ignore"):
            boot = a[idx].mean(axis=1) / b[idx].mean(axis=1)
        tail = alpha / 2
        ci = (float(np.nanquantile(boot, tail)), float(np.nanquantile(boot, 1 - tail)))
        estimate = float(a.mean() / b.mean()) if b.mean() != 0 else math.nan
        measured = f"mean {rule.arms[0]} / mean {rule.arms[1]} = {_fmt(estimate)}{_ci_text(ci)} {metric}"
        measured += f", n={a.size}, claim {rule.op} {_fmt(x)}"
        holds = estimate >= x if rule.op == ">=" else estimate <= x
        constant = _no_spread(a) and _no_spread(b)
    else:
        arm = rule.arms[0]
        metric = ctx.metric(rule, arm)
        values = np.array(list(_pairs(ctx.rows(arm), metric, arm).values()))
        if values.size < 2:
            raise NotRun(f"arm {arm!r}: {values.size} value(s) of {metric!r}; need 2")
        bound = float(rule.args[0])
        d = values - bound if rule.kind == "at_least" else bound - values
        ci = bootstrap_ci(values, level=1 - alpha, n_resamples=ctx.n_resamples, rng=rng)
        estimate = float(values.mean())
        sign = ">=" if rule.kind == "at_least" else "<="
        measured = f"mean {metric} of {arm} = {_fmt(estimate)}{_ci_text(ci)}, n={values.size}"
        measured += f", claim {sign} {_fmt(bound)}"
        holds = estimate >= bound if rule.kind == "at_least" else estimate <= bound
        bounds = metric_bounds(metric, values)
        constant = _no_spread(values)
    out = Outcome(rule.text, "inconclusive", estimate, ci, int(d.size))
    if bounds is not None:
        lo, hi = bounds
        side = "greater" if rule.kind == "at_least" else "less"
        other = "less" if side == "greater" else "greater"
        p_support = bounded_mean_p(values, lo, hi, bound, side)
        p_against = bounded_mean_p(values, lo, hi, bound, other)
        test = "exact binomial" if is_binary(values, lo, hi) else "exact Anderson bound"
        measured += f", {test} p={_fmt(p_support)} for the claim, {_fmt(p_against)} against"
    elif constant:
        out.arithmetic = True
        out.measured = f"{measured}; {_constant_text(estimate, int(d.size))}"
        out.verdict = "reproduced" if holds else "evidence against"
        return out
    else:
        p_support, p_against = _t_sides(d)
        measured += f", one-sided t p={_fmt(p_support)} for the claim, {_fmt(p_against)} against"
    out.measured = measured
    out.page_tests = [(rule.text, _two_sided(p_support, p_against))]
    if p_support < alpha:
        out.verdict = "reproduced"
    elif p_against < alpha:
        out.verdict = "evidence against"
    else:
        out.n_confirm = _plan(d, "greater", alpha)
        out.n_refute = _plan(d, "less", alpha)
    return out
