"""What evaluating one rule gives (:class:`Outcome`), the level and power the rules test and plan
at, and the small statistics and formatting the rules share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats as sps

from kvbench.stats import min_pairs_sign_flip, n_from_pilot

ALPHA = 0.05
POWER = 0.8


@dataclass
class Outcome:
    """The result of one rule: verdict, what was measured (estimate, interval, pairs, p-values)
    and, when inconclusive, the pairs needed to confirm and to refute it."""

    rule: str
    verdict: str
    estimate: Any = None
    ci: tuple[float, float] | None = None
    n: int | None = None
    n_confirm: float | None = None
    n_refute: float | None = None
    measured: str = ""
    reason: str = ""
    # one-sided p-values of better/larger_gain, Holm-adjusted across the family afterwards
    p_greater: float | None = None
    p_less: float | None = None
    diffs: np.ndarray | None = None
    effect: float | None = None
    # the metric's range when it is bounded (exact tests), and why the claim's side cannot be shown
    # (an arm at the ceiling or floor) when it cannot
    bounds: tuple[float, float] | None = None
    blocked: str | None = None
    # the raw p-values of the page-wide false discovery rate: (label, two-sided p) per test; None
    # when the verdict is arithmetic on a constant (no test) or the rule did not run
    page_tests: list[tuple[str, float]] = field(default_factory=list)
    arithmetic: bool = False
    # the verdict at other margins: {margin: verdict}, for margins kvbench chose
    sensitivity: dict[float, str] = field(default_factory=dict)
    margin: float | None = None
    # whether the rule holds its verdict apart from a failed premise
    premise_free: bool = True
    # what the rule tests (``rule_signature``), so a test two papers share is counted once
    signature: tuple | None = None
    # an ``accounted`` rule's two lines: the paper's count and kvbench's bytes (``accounting_table``)
    accounting: dict[str, Any] | None = None


def _plan(d: np.ndarray, direction: str, alpha: float, sign_flip: bool = False) -> float:
    """Pairs for a one-sided test of the mean of ``d`` in ``direction`` (``greater``/``less``) at
    the observed mean and spread; infinite when the mean points the other way. A sign-flip test
    never plans below the pairs at which it can reject at all."""
    planned = n_from_pilot(d, direction, alpha=alpha, power=POWER)
    if sign_flip and not math.isnan(planned) and not math.isinf(planned):
        planned = max(planned, min_pairs_sign_flip(alpha))
    return planned


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4g}"
    return str(value)


def _ci_text(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"


def _t_sides(d: np.ndarray, shift: float = 0.0) -> tuple[float, float]:
    """One-sided paired t p-values ``(P for mean > shift, P for mean < shift)``. With no spread there
    is no t statistic and none is computed: NaN, NaN (the callers decide a constant by arithmetic,
    ``_constant_text``, or, for a bounded metric, by the exact tests)."""
    mean = float(d.mean()) - shift
    se = float(d.std(ddof=1)) / math.sqrt(d.size) if d.size > 1 else math.nan
    if d.size < 2 or math.isnan(se) or se == 0:
        return math.nan, math.nan
    t = mean / se
    return float(sps.t.sf(t, d.size - 1)), float(sps.t.cdf(t, d.size - 1))


def _no_spread(d: np.ndarray) -> bool:
    return bool(d.size) and bool(np.all(np.isclose(d, d[0], rtol=0, atol=1e-12)))


def _two_sided(p_claim: float | None, p_against: float | None) -> float:
    """The two one-sided p-values of a rule as one two-sided p (``2 min``), for the page's FDR."""
    ps = [p for p in (p_claim, p_against) if p is not None and not math.isnan(p)]
    return min(1.0, 2 * min(ps)) if ps else math.nan


def _bound_state(values: np.ndarray, bounds: tuple[float, float] | None) -> str | None:
    """``"ceiling"`` when every value sits at the metric's top, ``"floor"`` at its bottom, else None."""
    if bounds is None or not values.size:
        return None
    if np.allclose(values, bounds[1]):
        return "ceiling"
    if np.allclose(values, bounds[0]):
        return "floor"
    return None


def _all_at_bound(arms: tuple[str, ...], values: list[np.ndarray], bounds, metric: str) -> str | None:
    """The reason no rule can tell the arms apart when every one of them sits at the same bound of a
    bounded metric on every pair (``ceiling: all arms at 1.0 ...``), else None."""
    states = {_bound_state(v, bounds) for v in values}
    if len(states) != 1 or None in states:
        return None
    state = states.pop()
    value = bounds[1] if state == "ceiling" else bounds[0]
    return (
        f"{state}: all arms ({', '.join(arms)}) at {value:g} on {metric} over {values[0].size} pairs, "
        "nothing can be told apart"
    )


def _constant_text(value: float, n: int) -> str:
    return f"every one of the {n} pairs gives {_fmt(value)}: no spread, so no test; decided by arithmetic"
