"""The rules, one module per kind, each an evaluator ``(context, rule) -> Outcome``, and
:data:`_EVALUATORS`, the rule kind each runs.

Bounded metrics (``BOUNDED_METRICS``: task scores, recall, hit rates in [0, 1]) take the exact,
tie-aware tests of ``kvbench.stats.exact`` in the margin and bound rules (the sign-flip test of
``better`` is already exact: on 0/1 scores it is the sign test on McNemar's discordant pairs). No
rule computes a t statistic from a zero spread: an unbounded quantity that is the same on every
pair (an accounting figure) is compared with its bound by arithmetic, and says so. When every arm
of a rule sits at the same bound (``ceiling: all arms at 1.0 ...``), or the claim's side is out of
reach because one arm does (``better(a, b)`` with b at the ceiling), the rule reads ``not testable
here`` with that reason, never ``no effect``.

Differences are oriented so that positive means the first arm is better (lower is better for
perplexity and errors, as in ``kvbench.analysis.frame.higher_is_better``); the measured text shows
the raw ``mean(a - b)`` in metric units with its paired-bootstrap ``1 - alpha`` interval.
"""

from kvbench.analysis.claims.rules.accounted import _accounted_outcome
from kvbench.analysis.claims.rules.bound import _bound_outcome
from kvbench.analysis.claims.rules.cliff import _cliff_outcome
from kvbench.analysis.claims.rules.difference import _difference_outcome
from kvbench.analysis.claims.rules.margin import _margin_outcome

_EVALUATORS = {
    "better": _difference_outcome,
    "larger_gain": _difference_outcome,
    "not_worse": _margin_outcome,
    "equivalent": _margin_outcome,
    "at_least": _bound_outcome,
    "at_most": _bound_outcome,
    "ratio": _bound_outcome,
    "cliff_within": _cliff_outcome,
    "accounted": _accounted_outcome,
}
