"""``better(a, b)`` and ``larger_gain(a, b, c, d)``: oriented paired differences, one-sided
sign-flip p-values, and the verdicts decided together by Holm across the claim's family
(:func:`_decide_family`).
"""

from __future__ import annotations

from kvbench.analysis.claims.outcome import (
    POWER,
    Outcome,
    _all_at_bound,
    _bound_state,
    _ci_text,
    _fmt,
    _no_spread,
    _plan,
    _t_sides,
    _two_sided,
)
from kvbench.analysis.claims.schema import Rule
from kvbench.analysis.claims.selection import _Context, metric_bounds
from kvbench.stats import (
    bootstrap_ci,
    holm,
    min_n_sign_flip,
    min_p_sign_flip,
    min_pairs_sign_flip,
    n_from_pilot,
    sign_flip_test,
)
from kvbench.stats.exact import paired_bounded_p


def _difference_outcome(ctx: _Context, rule: Rule) -> Outcome:
    """better / larger_gain: oriented paired differences and their one-sided sign-flip p-values;
    the verdict waits for Holm across the family (``_decide_family``)."""
    values, metric = ctx.paired(rule, rule.arms)
    raw = (
        values[0] - values[1] if rule.kind == "better" else (values[0] - values[1]) - (values[2] - values[3])
    )
    higher = ctx.higher_is_better(metric)
    d = raw if higher else -raw
    rng = ctx.rng(rule)
    ci = bootstrap_ci(raw, level=1 - ctx.alpha, n_resamples=ctx.n_resamples, rng=rng)
    what = f"{rule.arms[0]} - {rule.arms[1]}" if rule.kind == "better" else "gain difference"
    effect = rule.kwargs.get("effect")
    measured = f"{what} = {_fmt(float(raw.mean()))}{_ci_text(ci)} {metric}, n={d.size}"
    bounds = metric_bounds(metric, *values)
    flat = _all_at_bound(rule.arms, values, bounds, metric)
    if flat is not None:
        return Outcome(
            rule.text, "not testable here", float(raw.mean()), ci, int(d.size), measured=measured, reason=flat
        )
    blocked = None
    if rule.kind == "better" and bounds is not None:
        # the claim's side is out of reach when the first arm sits at its worst bound or the second
        # at its best: a significant difference can then only go against the claim
        worst, best = ("floor", "ceiling") if higher else ("ceiling", "floor")
        for arm, v, bad in ((rule.arms[0], values[0], worst), (rule.arms[1], values[1], best)):
            if _bound_state(v, bounds) == bad:
                value = bounds[1] if bad == "ceiling" else bounds[0]
                blocked = (
                    f"{bad}: {arm} at {value:g} on {metric} on every one of {d.size} pairs, so "
                    f"{rule.arms[0]} cannot be shown better than {rule.arms[1]}"
                )
    return Outcome(
        rule.text,
        "pending",
        float(raw.mean()),
        ci,
        int(d.size),
        measured=measured,
        p_greater=sign_flip_test(d, alternative="greater", rng=rng),
        p_less=sign_flip_test(d, alternative="less", rng=rng),
        diffs=d,
        effect=None if effect is None else float(effect),
        bounds=bounds,
        blocked=blocked,
    )


def _decide_family(outcomes: list[Outcome], alpha: float) -> None:
    """Holm across a family's one-sided tests (the claim's direction and the reverse), then each
    verdict; the pairs needed are planned at ``alpha / m``, the level of Holm's first step. A
    family whose pairs are too few for the exact test to reach alpha is ``not run``: its p-values
    could never reject, so "inconclusive" would misstate it."""
    if not outcomes:
        return
    m = len(outcomes)
    greater, _ = holm([o.p_greater for o in outcomes], alpha)
    less, _ = holm([o.p_less for o in outcomes], alpha)
    level = alpha / m
    for o, pg, pl in zip(outcomes, greater, less, strict=True):
        d = o.diffs
        o.page_tests = [(o.rule, _two_sided(o.p_greater, o.p_less))]
        # the structural floor at this many pairs (ties only raise it, and more pairs lower it)
        pairs = int(d.size)
        o.measured += (
            f", one-sided Holm p={_fmt(float(pg))} for the claim, {_fmt(float(pl))} against ({m} in family)"
        )
        floor = min_p_sign_flip(pairs, m)
        if pg < alpha:
            o.verdict = "reproduced"
        elif pl < alpha:
            o.verdict = "evidence against"
        elif o.blocked is not None:
            o.verdict, o.reason = "not testable here", o.blocked
        elif floor >= alpha:
            o.verdict = "not run"
            o.reason = (
                f"{o.rule}: {pairs} pairs in a Holm family of {m}: the smallest attainable p is "
                f"{floor:.3g} >= alpha {alpha:g}, so no outcome could reject; it needs "
                f"{min_n_sign_flip(alpha, m)} pairs"
            )
        elif o.effect is not None and _small_effect_p(o)[0] < alpha:
            o.verdict = "no effect at this power"
            p_small, test = _small_effect_p(o)
            o.measured += f"; an effect of {_fmt(o.effect)} or more is rejected ({test} p={_fmt(p_small)})"
        else:
            o.verdict = "inconclusive"
            mean = float(d.mean())
            if mean > 0 or o.effect is None:
                o.n_confirm = _plan(d, "greater", level, sign_flip=True)
            else:
                o.n_confirm = n_from_pilot(d, "greater", alpha=level, power=POWER, delta=o.effect)
                o.n_confirm = max(o.n_confirm, min_pairs_sign_flip(level))
            o.n_refute = _plan(d, "less", level, sign_flip=True)


def _small_effect_p(o: Outcome) -> tuple[float, str]:
    """The p-value that the true effect is below the declared ``effect`` and its test: exact for a
    bounded metric (the binomial side on the pairs the first arm wins), a one-sided t-test
    otherwise; 1.0 when the differences have no spread (no t, and a tie shows no power)."""
    d = o.diffs
    if o.bounds is not None:
        span = o.bounds[1] - o.bounds[0]
        res = paired_bounded_p(d, span, float(o.effect), "less")
        return res["p"], res["test"]
    if _no_spread(d):
        return 1.0, "no test (no spread)"
    return _t_sides(d, o.effect)[1], "t-test"
