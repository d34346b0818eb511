"""Executable paper claims: each claim declares what to compare and a rule; the verdict and the
measured value are computed from the stored runs, never typed.

One module per concern, each importing only from those above it in this list:

- :mod:`~kvbench.analysis.claims.schema`: a claim as its paper's file declares it (the schema and
  the rule language, :class:`Claim`, :class:`Rule`, :func:`validate`, :func:`parse_rule`);
- :mod:`~kvbench.analysis.claims.selection`: from an arm selector to the runs and values it picks
  (:func:`select`, :func:`metric_values`, :func:`metric_bounds`, :class:`NotRun`);
- :mod:`~kvbench.analysis.claims.outcome`: what one rule's evaluation gives (:class:`Outcome`) and
  the statistics the rules share;
- :mod:`~kvbench.analysis.claims.checks`: the checks across a paper's claims when the papers load
  (:func:`check_claims`: ids, repeated tests, attainable alpha at the node's size);
- :mod:`~kvbench.analysis.claims.rules`: one evaluator per rule kind (``difference``: better and
  larger_gain; ``margin``: not_worse and equivalent; ``bound``: at_least, at_most and ratio;
  ``accounted``; ``cliff``: cliff_within);
- :mod:`~kvbench.analysis.claims.verdicts`: every claim's verdict on a model
  (:func:`evaluate_claims`, :class:`ClaimResult`): Holm across a family, floors, premises;
- :mod:`~kvbench.analysis.claims.page`: the claims page's tables and lines from the verdicts.

Every name is importable from here, as before the package was split.
"""

from kvbench.analysis.claims.checks import best_case_p, check_claims, rule_signature
from kvbench.analysis.claims.outcome import ALPHA, POWER, Outcome
from kvbench.analysis.claims.page import (
    ACCOUNTING_COLUMNS,
    CLAIMS_COLUMNS,
    DEFAULT_MODEL,
    FDR_Q,
    accounting_table,
    claims_table,
    fdr_line,
    margin_table,
    models_table,
    page_tests,
    verdict_counts,
)
from kvbench.analysis.claims.rules.cliff import cliff_text
from kvbench.analysis.claims.rules.difference import _decide_family
from kvbench.analysis.claims.schema import (
    MARGIN_SOURCES,
    OPTIONAL,
    OUTPUT_FIELDS,
    PREMISE_KEYS,
    PREMISE_OPTIONAL,
    REQUIRED,
    RULES,
    SELECTOR_KEYS,
    Claim,
    ClaimsError,
    Rule,
    parse_rule,
    validate,
)
from kvbench.analysis.claims.selection import (
    BOUNDED_METRICS,
    NotRun,
    metric_bounds,
    metric_values,
    select,
    several_configurations,
)
from kvbench.analysis.claims.verdicts import (
    MARGIN_FACTORS,
    VERDICTS,
    ClaimResult,
    _premise_failure,
    evaluate_claims,
)

__all__ = [
    "ACCOUNTING_COLUMNS",
    "ALPHA",
    "BOUNDED_METRICS",
    "CLAIMS_COLUMNS",
    "DEFAULT_MODEL",
    "FDR_Q",
    "MARGIN_FACTORS",
    "MARGIN_SOURCES",
    "OPTIONAL",
    "OUTPUT_FIELDS",
    "POWER",
    "PREMISE_KEYS",
    "PREMISE_OPTIONAL",
    "REQUIRED",
    "RULES",
    "SELECTOR_KEYS",
    "VERDICTS",
    "Claim",
    "ClaimResult",
    "ClaimsError",
    "NotRun",
    "Outcome",
    "Rule",
    "_decide_family",
    "_premise_failure",
    "accounting_table",
    "best_case_p",
    "check_claims",
    "claims_table",
    "cliff_text",
    "evaluate_claims",
    "fdr_line",
    "margin_table",
    "metric_bounds",
    "metric_values",
    "models_table",
    "page_tests",
    "parse_rule",
    "rule_signature",
    "select",
    "several_configurations",
    "validate",
    "verdict_counts",
]
