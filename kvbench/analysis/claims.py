"""Executable paper claims: each claim declares what to compare and a rule; the verdict and the
measured value are computed from the stored runs, never typed.

Schema: one mapping per claim under the ``claims:`` list of its paper's file
(``kvbench/papers/<paper>.yaml``, read by :func:`kvbench.analysis.papers.load_papers`, which sets
the claim's ``paper``; a claim does not name it).

- ``id``: unique across the papers, lower-case words joined by ``-``;
- ``where``, ``statement``: the table/figure/section of the paper and the claim in a sentence or two;
- ``published``: the paper's value (number or text);
- ``experiment``: the ``kvbench/conf/experiment`` node whose runs test it (null only with ``untestable``);
- ``metric``: the per-sample column compared (default: the experiment plan's metric); a dotted path
  reaches into dict columns (``hit_rates.exact_topk.0.005``);
- ``arms``: ``{name: selector}``; a selector picks one configuration of the experiment's runs by
  what was run, never by folder name: ``label`` (the method label, e.g. ``kivi-2b``) and/or
  ``method`` (the method's registered name), ``bits``, ``config`` (a subset of the run's method
  node, nested mappings allowed, e.g. ``{key_axis: channel}``), and optionally ``metric`` (this
  arm's column, for comparisons of two columns of one run);
- ``rule``: one rule or a list of rules (the claim's family), written as calls on arm names:

  ``better(a, b)``            a beats b: one-sided paired sign-flip test, Holm across the family;
  ``larger_gain(a, b, c, d)`` the gain of a over b exceeds that of c over d (paired contrast);
  ``not_worse(a, b, margin=m)`` a is no worse than b by more than m: the non-inferiority half of the
                              paired TOST (t-test of ``mean(d) > -m``);
  ``equivalent(a, b, margin=m)`` both halves of TOST: ``|mean(d)| < m``;
  ``cliff_within(f, ref, "(lo, hi]", margin=m)`` the cliff of family f (one arm matching a bit
                              grid) against ref lies in the interval: every grid point >= hi is
                              equivalent to ref (TOST, margin m or the plan's; without a margin:
                              not significantly worse) and the point at lo is worse (Holm over
                              the grid, ``kvbench.stats.compare``); refuted by a worse point >= hi
                              or a point <= lo that holds; ``not run`` unless lo and hi are both
                              grid points;
  ``at_least(a, v)`` / ``at_most(a, v)`` the mean of a's metric is >= v / <= v (one-sample t-test;
                              hit rates, effective bits);
  ``ratio(a, b) >= x`` / ``<= x`` mean(a) / mean(b) against x, tested as the paired mean of
                              ``a - x b`` (Fieller's linearization), estimate with a paired
                              bootstrap interval;
  ``accounted(a, "q") >= x`` / ``<= x`` / ``== x`` (``==``: "about x") a storage claim counted the
                              paper's own way: quantity q of the paper's ``accounting``
                              (``kvbench.analysis.accounting``: code bits, outlier fraction, read
                              bits of a's stored rows, and the paper's convention) against x at the
                              precision x is written with; arithmetic, no test. kvbench's own bytes
                              (the same rows counted by what kvbench holds) go on a second line
                              (``accounting_table``) and never decide the verdict: a convention
                              difference is not evidence against;

  every rule but ``accounted`` takes ``metric=`` to override the claim's metric;
- ``family``: optional name shared by claims whose ``better`` tests form one Holm family (default:
  each claim is its own family);
- ``pending``: why the claim cannot run yet (its node or arms do not exist): the verdict stays
  ``not run`` with this reason until runs that match exist;
- ``untestable``: why no run here can test it (a GPU throughput claim): verdict ``not testable here``;
- ``floor``: optional ``{arm: NAME, above: V}``: the comparison says something about the methods
  only when that arm (the FP16 reference) scores above V on the model. At or below it (a 135M
  model scoring 0 on GSM8K, where every method ties at 0) the verdict is ``not testable here``,
  with the arm's measured mean as the reason: computed from the runs, like every verdict;
- ``premise``: optional list of conditions the paper's claim presupposes, each computed from the
  runs of a (possibly other) experiment node: ``{cliff_at_most: X, experiment: NODE, family:
  SELECTOR, reference: SELECTOR, why: TEXT}`` holds when that family's measured cliff on the model
  lies at or below X bits (every grid point >= X is not significantly worse than the reference,
  Holm over the grid: SemKV's recipe interpolates above the model's own cliff). A premise that
  fails makes the verdict ``premise not met here``, with the measured cliff as the reason;
- ``proxy``: optional text, what the rule measures in place of the paper's quantity (an
  attention-output error for task accuracy); the verdict reads ``... in proxy``, and ``task_claim``
  names the claim that tests the paper's task-level quantity;
- ``quote``: the source document's own words the claim rests on (verbatim, any language);
  ``scripts/check_claim_sources.py`` finds it, the ``where`` and the ``published`` numbers in
  ``../shared/papers`` and records the excerpts in ``tests/fixtures/claim_sources.json``;
  ``where: summary`` when the document names no section, table or figure; each label of ``where``
  (``Fig. 4``, ``Table 6``, ``Sec. 1``, ``Abstract``, ``§ HEADING``: a heading line of the
  document) must be found near the quote (the script's ``NEAR`` characters), so a label another
  part of a shared document holds does not pass;
- ``note``: optional text;
- ``underpowered``: why the node stays at a size where a margin or bound rule can only refute (the
  exact test's best p at the node's n is not below alpha, ``best_case_p``); required then, refused
  otherwise;
- ``margin_source``: ``paper`` when the margins are the paper's own numbers; otherwise (default
  ``kvbench``) the page gives each margin rule's verdict at half and twice the margin;
- a premise item may name ``rules``: the claim's rule texts that rest on it (default: all). A failed
  premise sets only those; the claim is still judged on the others (``evidence against`` when one
  of them is) and every rule stays on the page.

``measured``, ``verdict`` and ``source`` are rejected: they are outputs. No two claims of a paper
may declare the same test (``rule_signature``: node, arms, metric, rule).

Bounded metrics (``BOUNDED_METRICS``: task scores, recall, hit rates in [0, 1]) take the exact,
tie-aware tests of ``kvbench.stats.exact`` in the margin and bound rules (the sign-flip test of
``better`` is already exact: on 0/1 scores it is the sign test on McNemar's discordant pairs). No
rule computes a t statistic from a zero spread: an unbounded quantity that is the same on every
pair (an accounting figure) is compared with its bound by arithmetic, and says so. When every arm
of a rule sits at the same bound (``ceiling: all arms at 1.0 ...``), or the claim's side is out of
reach because one arm does (``better(a, b)`` with b at the ceiling), the rule reads ``not testable
here`` with that reason, never ``no effect``. ``page_tests`` / ``fdr_line`` give the page-wide
Benjamini-Hochberg line; ``margin_table`` the margin sensitivity; ``verdict_counts`` counts proxy
verdicts apart from task-level ones.

Verdicts (``VERDICTS``), per rule: ``reproduced`` when the rule's test rejects in the claim's
direction at ``alpha``; ``evidence against`` when the test in the opposite direction rejects (a
significant effect the other way, a mean significantly outside the bound); ``no effect at this
power`` when neither does but the rule declares the smallest effect the claim asserts
(``better(a, b, effect=e)``) and the one-sided t-test rejects a mean of ``e`` or more: an effect of
the claimed size would have been detected, so its absence is a finding; ``inconclusive`` otherwise,
with the pairs needed in both directions at the observed spread (power 0.8, ``kvbench.stats.power``;
for a family at ``alpha / m``, Holm's first step): ``n to confirm`` (at the observed mean when it
points the claim's way, else at the declared ``effect``, else infinite) and ``n to refute`` (at
the observed mean when it points against the claim, else infinite); ``not run`` when the experiment
has no runs for the model, an arm matches no configuration, fewer than 2 pairs are shared, or the
stored pairs are too few for the rule's test to reach ``alpha`` at all (the sign-flip floor
``kvbench.stats.min_p_sign_flip``; the declared node size is checked when the file is loaded,
so this only happens with archives older than the node). A claim with several rules is
``evidence against`` if any rule is, else ``no effect at this power``, ``not run``,
``inconclusive``, ``reproduced`` in that order; a failed premise gives ``premise not met here`` and
a floor ``not testable here`` whatever the rules say.

Checked at declaration (``check_claims`` with ``conf_dir``, which the loader calls): every rule
can reach ``alpha`` at the node's size (``analysis.n`` per seed times its seeds): the exact
sign-flip test's smallest p is ``2 ** -n`` one-sided (two-sided for the cliff's grid points),
times the Holm family size (the family's better/larger_gain rules; the node's ``analysis.grid``
for a cliff). A rule that cannot is a schema error naming the pairs it needs.

Differences are oriented so that positive means the first arm is better (lower is better for
perplexity and errors, as in ``kvbench.analysis.frame.higher_is_better``); the measured text shows
the raw ``mean(a - b)`` in metric units with its paired-bootstrap ``1 - alpha`` interval.
"""

from __future__ import annotations

import ast
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from scipy import stats as sps

from kvbench.analysis.accounting import Accounting, decimals, evaluate, reaches
from kvbench.analysis.frame import higher_is_better, plan_of
from kvbench.stats import (
    PAIR_KEYS,
    bootstrap_ci,
    compare,
    holm,
    locate_cliff,
    min_n_sign_flip,
    min_p_sign_flip,
    min_pairs_sign_flip,
    n_for_difference,
    n_from_pilot,
    sign_flip_test,
    tost_equivalence,
)
from kvbench.stats.exact import (
    benjamini_hochberg,
    bounded_mean_p,
    is_binary,
    n_for_binomial_side,
    paired_bounded_p,
)

VERDICTS = (
    "reproduced",
    "evidence against",
    "no effect at this power",
    "inconclusive",
    "premise not met here",
    "not run",
    "not testable here",
)
REQUIRED = ("id", "where", "statement", "published", "experiment")
OPTIONAL = (
    "metric",
    "arms",
    "rule",
    "family",
    "pending",
    "untestable",
    "floor",
    "premise",
    "proxy",
    "task_claim",
    "quote",
    "note",
    "underpowered",
    "margin_source",
)
PREMISE_KEYS = ("cliff_at_most", "experiment", "family", "reference", "why")
PREMISE_OPTIONAL = ("rules",)
MARGIN_SOURCES = ("paper", "kvbench")
# Metrics whose per-sample value lies in a known range (the head of a dotted path): a task score,
# a recall, a hit rate. Their rules get the exact, tie-aware tests of ``kvbench.stats.exact``.
BOUNDED_METRICS: dict[str, tuple[float, float]] = {
    "score": (0.0, 1.0),
    "needle_recall": (0.0, 1.0),
    "hit_rate": (0.0, 1.0),
    "hit_rates": (0.0, 1.0),
    "quantized_fraction": (0.0, 1.0),
}
OUTPUT_FIELDS = ("measured", "verdict", "source")
SELECTOR_KEYS = ("label", "method", "bits", "config", "metric")
DEFAULT_MODEL = "smollm2-135m"
ALPHA = 0.05
POWER = 0.8
_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9.]+)*$")
_INTERVAL = re.compile(r"^\(\s*([-\d.]+)\s*,\s*([-\d.]+)\s*\]$")

# kind: (arm arguments, other positional arguments, keyword arguments)
RULES: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "better": (2, 0, ("metric", "effect")),
    "larger_gain": (4, 0, ("metric", "effect")),
    "not_worse": (2, 0, ("margin", "metric")),
    "equivalent": (2, 0, ("margin", "metric")),
    "cliff_within": (2, 1, ("margin", "metric")),
    "at_least": (1, 1, ("metric",)),
    "at_most": (1, 1, ("metric",)),
    "ratio": (2, 0, ("metric",)),
    "accounted": (1, 1, ()),
}
# the rules that compare with a bound written after them, and the comparisons each takes
_COMPARES = {"ratio": (">=", "<="), "accounted": (">=", "<=", "==")}
_NEEDS_MARGIN = ("not_worse", "equivalent")
_SIGN_FLIP = ("better", "larger_gain")


class ClaimsError(ValueError):
    """A schema violation, naming the claim and the field (and, once located, the paper file)."""

    def __init__(self, claim: str, field: str, problem: str, file: str | Path | None = None):
        where = f"{file}: " if file is not None else ""
        super().__init__(f"{where}claim {claim!r} field {field!r}: {problem}")
        self.claim, self.field, self.problem, self.file = claim, field, problem, file

    def located(self, file: str | Path) -> ClaimsError:
        """The same error, naming the file that declares the claim."""
        return ClaimsError(self.claim, self.field, self.problem, file)


@dataclass(frozen=True)
class Rule:
    """One parsed rule: ``kind``, its arm names, other positional values, keywords and, for
    ``ratio``, the comparison (``>=`` or ``<=``) and the bound."""

    text: str
    kind: str
    arms: tuple[str, ...]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    op: str | None = None
    bound: float | None = None
    # the decimals the bound is written with (``accounted``: the paper's rounding)
    places: int | None = None


@dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    where: str
    statement: str
    published: Any
    experiment: str | None
    metric: str | None = None
    arms: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    family: str | None = None
    pending: str | None = None
    untestable: str | None = None
    floor: Mapping[str, Any] | None = None
    premise: tuple[Mapping[str, Any], ...] = ()
    proxy: str | None = None
    task_claim: str | None = None
    quote: str | list[str] | None = None
    note: str | None = None
    underpowered: str | None = None
    margin_source: str = "kvbench"
    # the paper's accounting (``kvbench.analysis.accounting``), for ``accounted`` rules
    accounting: Accounting | None = None


# ------------------------------------------------------------------------------------ parsing


def _constant(cid: str, node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
    ):
        return -node.operand.value
    raise ClaimsError(cid, "rule", f"{text!r}: expected a number or a quoted string, got {ast.unparse(node)}")


def parse_rule(cid: str, text: str, arms: Mapping[str, Any]) -> Rule:
    """One rule from its text (see the module docstring), checked against the claim's arms."""
    if not isinstance(text, str) or not text.strip():
        raise ClaimsError(cid, "rule", f"must be text such as 'better(a, b)', got {text!r}")
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ClaimsError(cid, "rule", f"{text!r}: not a rule ({err.msg})") from None
    op = bound = places = None
    if isinstance(node, ast.Compare):
        ops = {ast.GtE: ">=", ast.LtE: "<=", ast.Eq: "=="}
        if len(node.ops) != 1 or type(node.ops[0]) not in ops:
            raise ClaimsError(
                cid, "rule", f"{text!r}: only 'ratio(a, b) >= x' / '<= x' and 'accounted(a, q) >= x' compare"
            )
        op = ops[type(node.ops[0])]
        bound = _constant(cid, node.comparators[0], text)
        if not isinstance(bound, (int, float)):
            raise ClaimsError(cid, "rule", f"{text!r}: the bound must be a number")
        places = decimals(ast.get_source_segment(text.strip(), node.comparators[0]) or str(bound))
        node = node.left
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ClaimsError(cid, "rule", f"{text!r}: expected a call such as better(a, b)")
    kind = node.func.id
    if kind not in RULES:
        raise ClaimsError(cid, "rule", f"{text!r}: unknown rule {kind!r}; rules: {', '.join(RULES)}")
    if (kind in _COMPARES) != (op is not None) or (op is not None and op not in _COMPARES[kind]):
        raise ClaimsError(
            cid,
            "rule",
            f"{text!r}: ratio needs '>= x' or '<= x', accounted '>= x', '<= x' or '== x', "
            "and only they compare",
        )
    n_arms, n_values, keywords = RULES[kind]
    if len(node.args) != n_arms + n_values:
        raise ClaimsError(cid, "rule", f"{text!r}: {kind} takes {n_arms} arms and {n_values} value(s)")
    names = []
    for arg in node.args[:n_arms]:
        if not isinstance(arg, ast.Name):
            raise ClaimsError(cid, "rule", f"{text!r}: {ast.unparse(arg)} is not an arm name")
        if arg.id not in arms:
            raise ClaimsError(cid, "rule", f"{text!r}: arm {arg.id!r} is not declared under arms")
        names.append(arg.id)
    values = tuple(_constant(cid, a, text) for a in node.args[n_arms:])
    kwargs = {}
    for kw in node.keywords:
        if kw.arg not in keywords:
            raise ClaimsError(cid, "rule", f"{text!r}: {kind} takes keywords {', '.join(keywords)}")
        kwargs[kw.arg] = _constant(cid, kw.value, text)
    if kind in _NEEDS_MARGIN and "margin" not in kwargs:
        raise ClaimsError(cid, "rule", f"{text!r}: {kind} needs margin=...")
    for key in ("margin", "effect"):
        if key in kwargs and not (isinstance(kwargs[key], (int, float)) and kwargs[key] > 0):
            raise ClaimsError(cid, "rule", f"{text!r}: {key} must be a positive number")
    if kind == "cliff_within" and (not isinstance(values[0], str) or not _INTERVAL.match(values[0])):
        raise ClaimsError(cid, "rule", f'{text!r}: the interval must be text like "(2.0, 2.322]"')
    if kind in ("at_least", "at_most") and not isinstance(values[0], (int, float)):
        raise ClaimsError(cid, "rule", f"{text!r}: the bound must be a number")
    if kind == "accounted" and not isinstance(values[0], str):
        raise ClaimsError(cid, "rule", f"{text!r}: the quantity is a quoted name of the paper's accounting")
    return Rule(
        text.strip(), kind, tuple(names), values, kwargs, op, None if bound is None else float(bound), places
    )


def _text(cid: str, entry: dict, key: str, allow_none: bool = False) -> None:
    value = entry.get(key)
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value.strip():
        raise ClaimsError(cid, key, f"must be non-empty text, got {value!r}")


def _selector(cid: str, name: str, sel: Any) -> dict[str, Any]:
    where = f"arms.{name}"
    if not name.isidentifier():
        raise ClaimsError(cid, where, "an arm name must be an identifier (letters, digits, _)")
    if not isinstance(sel, dict):
        raise ClaimsError(cid, where, f"must be a mapping of {', '.join(SELECTOR_KEYS)}")
    unknown = sorted(set(sel) - set(SELECTOR_KEYS))
    if unknown:
        raise ClaimsError(cid, where, f"unknown key {unknown[0]!r}; allowed: {', '.join(SELECTOR_KEYS)}")
    if "label" not in sel and "method" not in sel:
        raise ClaimsError(
            cid, where, "needs 'label' or 'method' (arms are chosen by what ran, not by folder)"
        )
    if "config" in sel and not isinstance(sel["config"], dict):
        raise ClaimsError(cid, where, "config must be a mapping (a subset of the method node)")
    if "bits" in sel and not isinstance(sel["bits"], (int, float)):
        raise ClaimsError(cid, where, f"bits must be a number, got {sel['bits']!r}")
    return dict(sel)


def validate(
    entry: Any,
    index: int,
    conf_dir: Path | None = None,
    paper: str = "",
    accounting: Accounting | None = None,
) -> Claim:
    """One claim mapping of ``paper``'s file checked against the schema (see the module docstring).
    With ``conf_dir`` (the ``conf`` folder), the experiment node must exist unless ``pending`` says
    why not; an ``accounted`` rule must name a quantity of the paper's ``accounting``."""
    if not isinstance(entry, dict):
        raise ClaimsError(f"#{index}", "(entry)", f"must be a mapping, got {type(entry).__name__}")
    cid = entry.get("id")
    if not isinstance(cid, str) or not _ID.match(cid):
        raise ClaimsError(f"#{index}", "id", f"must match {_ID.pattern}, got {cid!r}")
    outputs = [k for k in OUTPUT_FIELDS if k in entry]
    if outputs:
        raise ClaimsError(
            cid, outputs[0], "is computed from the runs (python -m kvbench.report --claims), not declared"
        )
    if "paper" in entry:
        raise ClaimsError(
            cid, "paper", f"{entry['paper']!r}: the paper file declares its claims; remove the key"
        )
    missing = [k for k in REQUIRED if k not in entry]
    if missing:
        raise ClaimsError(cid, missing[0], "missing")
    unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ClaimsError(cid, unknown[0], f"unknown field; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    for key in ("where", "statement"):
        _text(cid, entry, key)
    for key in ("metric", "note", "pending", "untestable", "family", "proxy", "task_claim", "underpowered"):
        _text(cid, entry, key, allow_none=True)
    if entry.get("margin_source", "kvbench") not in MARGIN_SOURCES:
        raise ClaimsError(
            cid, "margin_source", f"{entry['margin_source']!r}: one of {', '.join(MARGIN_SOURCES)}"
        )
    quote = entry.get("quote")
    quotes = quote if isinstance(quote, list) else [quote]
    if quote is not None and not all(isinstance(q, str) and q.strip() for q in quotes):
        raise ClaimsError(cid, "quote", f"must be the document's text (or a list of such), got {quote!r}")
    if (entry.get("proxy") is None) != (entry.get("task_claim") is None):
        raise ClaimsError(
            cid, "task_claim", "a proxy rule needs the task-level claim beside it, and only a proxy names one"
        )
    if entry["published"] is None or entry["published"] == "":
        raise ClaimsError(cid, "published", "the paper's value is required")
    untestable = entry.get("untestable")
    _text(cid, entry, "experiment", allow_none=untestable is not None)
    if untestable is not None:
        if entry.get("rule") is not None or entry.get("arms") is not None:
            raise ClaimsError(cid, "rule", "an untestable claim declares no rule or arms")
        return Claim(
            **{k: entry.get(k) for k in REQUIRED},
            paper=paper,
            untestable=untestable,
            quote=entry.get("quote"),
            note=entry.get("note"),
        )
    arms = entry.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise ClaimsError(cid, "arms", "a testable claim needs arms: {name: selector}")
    arms = {str(name): _selector(cid, str(name), sel) for name, sel in arms.items()}
    rules = entry.get("rule")
    if rules is None:
        raise ClaimsError(cid, "rule", "a testable claim needs a rule (or 'untestable: why')")
    texts = rules if isinstance(rules, list) else [rules]
    if not texts:
        raise ClaimsError(cid, "rule", "the list of rules is empty")
    parsed = tuple(parse_rule(cid, t, arms) for t in texts)
    for rule in parsed:
        if rule.kind != "accounted":
            continue
        if accounting is None:
            raise ClaimsError(cid, "rule", f"{rule.text!r}: the paper file declares no accounting")
        if rule.args[0] not in accounting.quantities:
            raise ClaimsError(
                cid,
                "rule",
                f"{rule.text!r}: {rule.args[0]!r} is not a quantity of the paper's accounting "
                f"({', '.join(accounting.quantities)})",
            )
    floor = entry.get("floor")
    if floor is not None:
        if (
            not isinstance(floor, dict)
            or set(floor) != {"arm", "above"}
            or str(floor["arm"]) not in arms
            or isinstance(floor["above"], bool)
            or not isinstance(floor["above"], (int, float))
        ):
            raise ClaimsError(
                cid, "floor", f"{floor!r}: expected {{arm: one of {', '.join(arms)}, above: a number}}"
            )
    premise = _premise(cid, entry.get("premise"), parsed)
    experiment = entry["experiment"]
    if conf_dir is not None and entry.get("pending") is None:
        if not (Path(conf_dir) / "experiment" / f"{experiment}.yaml").is_file():
            raise ClaimsError(
                cid,
                "experiment",
                f"no node conf/experiment/{experiment}.yaml; declare 'pending: why' until it exists",
            )
    return Claim(
        **{k: entry.get(k) for k in REQUIRED},
        paper=paper,
        metric=entry.get("metric"),
        arms=arms,
        rules=parsed,
        family=entry.get("family"),
        pending=entry.get("pending"),
        floor=floor,
        premise=premise,
        proxy=entry.get("proxy"),
        task_claim=entry.get("task_claim"),
        quote=entry.get("quote"),
        note=entry.get("note"),
        underpowered=entry.get("underpowered"),
        margin_source=entry.get("margin_source", "kvbench"),
        accounting=accounting if any(r.kind == "accounted" for r in parsed) else None,
    )


def _premise(cid: str, value: Any, rules: tuple[Rule, ...] = ()) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        where = f"premise[{i}]"
        if not isinstance(item, dict) or not set(PREMISE_KEYS) <= set(item) <= {
            *PREMISE_KEYS,
            *PREMISE_OPTIONAL,
        }:
            raise ClaimsError(
                cid,
                where,
                f"expected the keys {', '.join(PREMISE_KEYS)} (and optionally rules), got {item!r}",
            )
        texts = {r.text for r in rules}
        covered = item.get("rules")
        if covered is not None and (
            not isinstance(covered, list) or not covered or not all(str(t).strip() in texts for t in covered)
        ):
            raise ClaimsError(
                cid, f"{where}.rules", f"{covered!r}: a list of the claim's own rule texts that rest on it"
            )
        if isinstance(item["cliff_at_most"], bool) or not isinstance(item["cliff_at_most"], (int, float)):
            raise ClaimsError(cid, where, f"cliff_at_most must be a bit width, got {item['cliff_at_most']!r}")
        for key in ("experiment", "why"):
            _text(cid, item, key)
        out.append(
            {
                **item,
                "rules": None if covered is None else [str(t).strip() for t in covered],
                "family": _selector(cid, "family", item["family"]),
                "reference": _selector(cid, "reference", item["reference"]),
            }
        )
    return tuple(out)


def _node_plan(conf_dir: Path, experiment: str) -> dict[str, Any]:
    """The ``analysis`` block of an experiment node (its declared size and grid)."""
    node = yaml.safe_load((Path(conf_dir) / "experiment" / f"{experiment}.yaml").read_text()) or {}
    return node.get("analysis") or {}


def metric_bounds(metric: str | None, *values: np.ndarray) -> tuple[float, float] | None:
    """The range ``(lo, hi)`` of a bounded metric (``BOUNDED_METRICS``, by the head of a dotted
    path), or None for an unbounded one (perplexity, an error, bits) and for values that leave the
    range (then the metric is not the bounded one the name suggests)."""
    if metric is None:
        return None
    bounds = BOUNDED_METRICS.get(str(metric).split(".")[0])
    if bounds is None:
        return None
    lo, hi = bounds
    for v in values:
        v = np.asarray(v, dtype=float)
        if v.size and (np.nanmin(v) < lo - 1e-9 or np.nanmax(v) > hi + 1e-9):
            return None
    return bounds


def _rule_metric(claim: Claim, rule: Rule, plan: Mapping[str, Any], arm: str | None = None) -> str | None:
    arm = arm or rule.arms[0]
    return (
        claim.arms.get(arm, {}).get("metric")
        or rule.kwargs.get("metric")
        or claim.metric
        or plan.get("metric")
    )


def best_case_p(claim: Claim, rule: Rule, n: int, plan: Mapping[str, Any]) -> tuple[float, str] | None:
    """The smallest p the confirming side of a margin or bound rule can give with ``n`` pairs, on
    the most favourable data (every pair tied or won; every value at the favourable bound), and the
    test that gives it; None for the sign-flip rules (``min_p_sign_flip`` covers them).

    Bounded metrics take the exact tests of ``kvbench.stats.exact``: at margin m on a range R the
    binomial side's best p is ``(1 - m / R) ** n``; a bound v on a 0/1 mean, ``s ** n`` for
    ``at_least`` and ``(1 - s) ** n`` for ``at_most`` with ``s = (v - lo) / R``. Unbounded metrics
    take the t-test, which reaches any level with 2 pairs and some spread (1.0 below 2 pairs)."""
    if rule.kind in _SIGN_FLIP or rule.kind == "accounted":
        return None  # accounted: arithmetic on stored quantities, no test
    metric = _rule_metric(claim, rule, plan)
    bounds = metric_bounds(metric)
    if rule.kind == "cliff_within":
        margin = rule.kwargs.get("margin", plan.get("margin"))
        if margin is None or bounds is None:
            return None
        span = bounds[1] - bounds[0]
        return max(0.0, 1 - float(margin) / span) ** n, f"exact TOST at margin {margin:g} per grid point"
    if bounds is None or rule.kind == "ratio":
        return (0.0 if n >= 2 else 1.0), "t-test"
    lo, hi = bounds
    span = hi - lo
    if rule.kind in _NEEDS_MARGIN:
        margin = float(rule.kwargs["margin"])
        return max(0.0, 1 - margin / span) ** n, f"exact binomial side at margin {margin:g} on {metric}"
    share = min(1.0, max(0.0, (float(rule.args[0]) - lo) / span))
    best = share**n if rule.kind == "at_least" else (1 - share) ** n
    return best, f"exact binomial bound {float(rule.args[0]):g} on {metric}"


def _check_attainable(claims: list[Claim], conf_dir: Path) -> None:
    """Every rule of every testable claim can reach its alpha at its node's declared size (see the
    module docstring); a ClaimsError naming the pairs needed otherwise. A margin or bound rule that
    can only refute at that size (``best_case_p``) is accepted only when the claim says why in
    ``underpowered``, and ``underpowered`` only on a claim that has such a rule."""
    families: dict[str, int] = {}
    for c in claims:
        families[c.family or c.id] = families.get(c.family or c.id, 0) + sum(
            r.kind in _SIGN_FLIP for r in c.rules
        )
    for c in claims:
        if c.untestable is not None or c.pending is not None or not c.rules:
            continue
        plan = _node_plan(conf_dir, c.experiment)
        n = int(plan.get("n") or 0) * max(1, len(plan.get("seeds") or [0]))
        alpha = float(plan.get("alpha") or ALPHA)
        weak = []
        for rule in c.rules:
            best = best_case_p(c, rule, n, plan)
            if best is not None and best[0] >= alpha:
                weak.append(f"{rule.text!r} (best p {best[0]:.3g} by the {best[1]})")
            if rule.kind in _SIGN_FLIP:
                m, two_sided, what = families[c.family or c.id], False, "Holm family"
            elif rule.kind == "cliff_within":
                m, two_sided, what = max(1, len(plan.get("grid") or [])), True, "grid points"
            else:
                continue
            floor = min_p_sign_flip(n, m, two_sided)
            if floor >= alpha:
                need = min_n_sign_flip(alpha, m, two_sided)
                raise ClaimsError(
                    c.id,
                    "rule",
                    f"{rule.text!r} can never reach alpha={alpha:g} at node {c.experiment}'s size: n={n} "
                    f"pairs (analysis.n x seeds), {m} {what}, smallest attainable p {floor:.3g}; it "
                    f"needs n >= {need} (resize the node or change the rule)",
                )
        if weak and c.underpowered is None:
            raise ClaimsError(
                c.id,
                "rule",
                f"{'; '.join(weak)}: at node {c.experiment}'s size (n={n} pairs) no data can confirm it at "
                f"alpha={alpha:g}, only refute it; resize the node, or say why it stays this size in "
                "'underpowered'",
            )
        if not weak and c.underpowered is not None:
            raise ClaimsError(
                c.id, "underpowered", f"every rule can confirm at n={n} pairs; remove the field"
            )


def _selector_key(sel: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(sel), sort_keys=True)


def rule_signature(claim: Claim, rule: Rule) -> tuple:
    """What a rule tests, independent of how the claim names its arms: the node, the metric, the
    rule kind with its values and keywords, and each arm's selector in the rule's order."""
    arms = tuple(
        _selector_key({**claim.arms[a], "metric": _rule_metric(claim, rule, {}, a)}) for a in rule.arms
    )
    kwargs = tuple(sorted((k, v) for k, v in rule.kwargs.items() if k != "metric"))
    return (claim.experiment, rule.kind, arms, rule.args, kwargs, rule.op, rule.bound)


def _check_distinct(claims: list[Claim]) -> None:
    """No two claims of one paper test the same thing: a rule whose ``rule_signature`` another claim
    of the paper already has is a ClaimsError (one claim per distinct test). Two papers may make the
    same claim about the same runs (KIVI's and KVQuant's per-channel keys); the page then counts
    that test once in its false discovery rate (``page_tests``)."""
    seen: dict[tuple, str] = {}
    for c in claims:
        if c.untestable is not None:
            continue
        for rule in c.rules:
            key = (c.paper, *rule_signature(c, rule))
            if key in seen and seen[key] != c.id:
                raise ClaimsError(
                    c.id,
                    "rule",
                    f"{rule.text!r} repeats the test of claim {seen[key]!r} (same node, arms, metric and "
                    "rule): make them one claim, or declare a test that differs",
                )
            seen.setdefault(key, c.id)


def check_claims(claims: list[Claim], conf_dir: str | Path | None = None) -> None:
    """What no single claim can check: ids unique, each task-level claim declared, no test declared
    twice (``_check_distinct``), and with ``conf_dir`` every rule able to reach its alpha at its
    node's size (``_check_attainable``)."""
    seen: set[str] = set()
    for claim in claims:
        if claim.id in seen:
            raise ClaimsError(claim.id, "id", "repeated")
        seen.add(claim.id)
    for claim in claims:
        if claim.task_claim is not None and claim.task_claim not in seen:
            raise ClaimsError(claim.id, "task_claim", f"{claim.task_claim!r} is not a declared claim")
    _check_distinct(claims)
    if conf_dir is not None:
        _check_attainable(claims, Path(conf_dir))


# ---------------------------------------------------------------------------------- selection


def _subset(wanted: Any, node: Any) -> bool:
    """Whether ``wanted`` (a mapping or a value) is contained in the config ``node``."""
    if isinstance(wanted, dict):
        return isinstance(node, dict) and all(k in node and _subset(v, node[k]) for k, v in wanted.items())
    if isinstance(wanted, (int, float)) and isinstance(node, (int, float)) and not isinstance(node, bool):
        return math.isclose(float(wanted), float(node), rel_tol=1e-9, abs_tol=1e-12)
    return wanted == node


def select(frame: pd.DataFrame, selector: Mapping[str, Any]) -> pd.DataFrame:
    """The rows of ``frame`` whose run matches an arm selector (label, method name, bits, and a
    subset of the method node)."""
    keep = pd.Series(True, index=frame.index)
    if "label" in selector:
        keep &= frame["method"] == selector["label"]
    if "method" in selector:
        keep &= frame["method_name"] == selector["method"]
    if "bits" in selector:
        keep &= pd.Series(np.isclose(frame["bits"].astype(float), float(selector["bits"])), index=frame.index)
    if "config" in selector:
        configs = frame["method_config"] if "method_config" in frame else [{}] * len(frame)
        keep &= pd.Series([_subset(selector["config"], c) for c in configs], index=frame.index)
    return frame[keep]


def _lookup(value: Any, path: str) -> Any:
    """Walk a dict by a dotted path whose keys may themselves hold dots (``"0.005"``)."""
    if path == "":
        return value
    if not isinstance(value, dict):
        return math.nan
    if path in value:
        return value[path]
    head, _, rest = path.partition(".")
    return _lookup(value[head], rest) if head in value and rest else math.nan


def metric_values(rows: pd.DataFrame, metric: str) -> pd.Series:
    """The per-row values of ``metric``: a column, or a dotted path into a dict column."""
    if metric in rows.columns:
        return pd.to_numeric(rows[metric], errors="coerce").astype(float)
    head, _, rest = metric.partition(".")
    if rest and head in rows.columns:
        return pd.Series([_lookup(v, rest) for v in rows[head]], index=rows.index, dtype=float)
    raise KeyError(metric)


class NotRun(Exception):
    """The data a rule needs is not there: the rule's verdict is ``not run`` with this reason."""


def several_configurations(rows: pd.DataFrame) -> bool:
    """Whether ``rows`` hold more than one configuration. A label that changes only with the run's
    seed (random pruning draws with ``seed: ${seed}``, so its label carries it) is one configuration
    seen at several seeds: within each seed there must be a single label."""
    return bool(len(rows)) and int(rows.groupby("seed")["method"].nunique().max()) > 1


def _pairs(rows: pd.DataFrame, metric: str, arm: str) -> dict[tuple, float]:
    labels = sorted(rows["method"].unique())
    if several_configurations(rows):
        raise NotRun(f"arm {arm!r} matches {len(labels)} configurations ({', '.join(labels)}); narrow it")
    try:
        values = metric_values(rows, metric)
    except KeyError:
        raise NotRun(f"arm {arm!r}: no per-sample {metric!r}") from None
    keys = zip(rows["sample_id"].astype(str), rows["seed"].astype(int), strict=True)
    return {k: v for k, v in zip(keys, values, strict=True) if math.isfinite(v)}


# --------------------------------------------------------------------------------- evaluation


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


class _Context:
    """The runs of one claim's experiment for one model, with the plan's defaults."""

    def __init__(self, claim: Claim, frame: pd.DataFrame, alpha: float, seed: int, n_resamples: int):
        self.claim, self.frame, self.alpha = claim, frame, alpha
        self.plan = plan_of(frame)
        self.seed, self.n_resamples = seed, n_resamples

    def rng(self, rule: Rule) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(f"{self.claim.id}|{rule.text}".encode())])

    def metric(self, rule: Rule, arm: str | None = None) -> str:
        sel = self.claim.arms.get(arm, {}) if arm else {}
        metric = sel.get("metric") or rule.kwargs.get("metric") or self.claim.metric or self.plan["metric"]
        if metric is None:
            raise NotRun("no metric declared and the runs name no primary metric")
        return metric

    def higher_is_better(self, metric: str) -> bool:
        declared = self.plan.get("higher_is_better")
        return higher_is_better(metric) if declared is None else bool(declared)

    def rows(self, arm: str) -> pd.DataFrame:
        rows = select(self.frame, self.claim.arms[arm])
        if rows.empty:
            raise NotRun(f"arm {arm!r} matches no run of {self.claim.experiment}")
        return rows

    def paired(self, rule: Rule, arms: tuple[str, ...]) -> tuple[list[np.ndarray], str]:
        """Values of each arm on the pairs all of them share, and the (first arm's) metric."""
        per_arm = [_pairs(self.rows(a), self.metric(rule, a), a) for a in arms]
        shared = sorted(set.intersection(*(set(p) for p in per_arm)))
        if len(shared) < 2:
            raise NotRun(f"{len(shared)} (sample_id, seed) pairs shared by {', '.join(arms)}; need 2")
        return [np.array([p[k] for k in shared]) for p in per_arm], self.metric(rule, arms[0])


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


def _constant_text(value: float, n: int) -> str:
    return f"every one of the {n} pairs gives {_fmt(value)}: no spread, so no test; decided by arithmetic"


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


def _cliff_table(
    fam: pd.DataFrame,
    ref: pd.DataFrame,
    metric: str,
    higher: bool,
    margin: float | None,
    alpha: float,
    seed: int,
    n_resamples: int,
) -> pd.DataFrame:
    """Every grid point of a family against the reference (``kvbench.stats.compare``: paired
    sign-flip, Holm over the grid, TOST at the margin, exact for a bounded metric), one row per
    bit width."""
    if fam["bits"].isna().any() or fam.groupby("method")["bits"].nunique().gt(1).any():
        raise NotRun("every configuration of the family needs one bit width")
    if ref["method"].nunique() > 1:
        raise NotRun("the reference matches several configurations; narrow it")
    data = pd.concat([fam, ref])
    data = data.assign(_value=metric_values(data, metric)).dropna(subset=["_value"])
    bounds = metric_bounds(metric, data["_value"].to_numpy())
    table = compare(
        data[["method", "bits", "_value", *PAIR_KEYS]],
        "_value",
        reference=ref["method"].iloc[0],
        by=("method", "bits"),
        higher_is_better=higher,
        margin=margin,
        alpha=alpha,
        seed=seed,
        n_resamples=n_resamples,
        missing="intersect",
        bounds=bounds,
    )
    if table.empty or table["n"].min() < 2:
        raise NotRun("fewer than 2 pairs with the reference at some grid point")
    return table


def cliff_text(table: pd.DataFrame, cliff: Any) -> str:
    """Where a grid places the cliff, saying only what its verdicts establish. Bracketed
    ``(bad, ok]`` when the point above the first worse one is shown equivalent (or, without a
    margin, when the grid holds no TOST at all); ``above BAD, upper end not located at this n`` when
    the points above it are merely not shown worse (inconclusive: absence of evidence, not a
    location); ``below the grid`` / ``above the grid`` when no point / the top point is worse."""
    if cliff.first_bad_bits is None:
        return "below the grid (no point worse)"
    if cliff.last_ok_bits is None:
        return "above the grid"
    above = table[table["bits"] > cliff.first_bad_bits + 1e-9]
    shown = above["verdict"].isin(["equivalent", "better"])
    tested = "tost_p" in table and table["tost_p"].notna().any()
    if shown.all() or not tested:
        return cliff.interval
    open_points = ", ".join(f"{b:g}" for b in above.loc[~shown, "bits"])
    return (
        f"above {cliff.first_bad_bits:g}, upper end not located at this n ({open_points} neither worse "
        "nor shown equivalent)"
    )


def _grid_cannot_conclude(table: pd.DataFrame, alpha: float) -> str | None:
    """Why a cliff grid (``_cliff_table``'s rows) cannot show any point worse than its reference,
    or None when it can: with n pairs per point on a k-point Holm grid the smallest attainable
    two-sided sign-flip p is ``min_p_sign_flip(n, k)``, and a grid at or above alpha there can only
    ever read "no point worse"."""
    n, points = int(table["n"].min()), len(table)
    floor = min_p_sign_flip(n, points, two_sided=True)
    if floor < alpha:
        return None
    need = min_n_sign_flip(alpha, points, two_sided=True)
    return (
        f"n={n} pairs per point on a {points}-point Holm grid: the smallest attainable p is {floor:.3g} "
        f">= alpha {alpha:g}, so no point can be shown worse; it needs {need} pairs per point"
    )


def _cliff_outcome(ctx: _Context, rule: Rule) -> Outcome:
    """cliff_within: every grid point of the family is compared with the reference through
    ``_cliff_table``; a grid whose pairs are too few for the two-sided exact test to reach alpha
    after Holm is ``not run`` (no point could ever be shown worse)."""
    family, reference = rule.arms
    metric = ctx.metric(rule, family)
    fam, ref = ctx.rows(family), ctx.rows(reference)
    lo, hi = (float(v) for v in _INTERVAL.match(rule.args[0]).groups())
    margin = rule.kwargs.get("margin", ctx.plan.get("margin"))
    margin = None if margin is None or (isinstance(margin, float) and math.isnan(margin)) else float(margin)
    try:
        table = _cliff_table(
            fam, ref, metric, ctx.higher_is_better(metric), margin, ctx.alpha, ctx.seed, ctx.n_resamples
        )
    except NotRun as err:
        raise NotRun(f"{family} against {reference}: {err}") from None
    cliff = locate_cliff(table, bits_col="bits", verdict_col="verdict")
    high = table[table["bits"] >= hi - 1e-9]
    at_lo = table[table["bits"] <= lo + 1e-9].sort_values("bits").tail(1)
    grid = " ".join(f"{b:g}:{v}" for b, v in zip(table["bits"], table["verdict"], strict=True))
    bracket = cliff_text(table, cliff)
    n, points = int(table["n"].min()), len(table)
    out = Outcome(rule.text, "inconclusive", bracket, None, n, margin=margin)
    out.page_tests = [
        (f"{rule.text} at {b:g} bits", float(p)) for b, p in zip(table["bits"], table["p_value"], strict=True)
    ]
    p_worst = float(table["p_holm"].min())
    out.measured = f"cliff {bracket} on {metric}, n={n} per point; {grid}; smallest Holm p={_fmt(p_worst)}"
    holds = (high["verdict"] == "equivalent") if margin is not None else (high["verdict"] != "worse")
    # A refutation needs only one side of the interval on the grid, so it is checked first.
    if (high["verdict"] == "worse").any() or at_lo["verdict"].isin(["equivalent", "better"]).any():
        out.verdict = "evidence against"
        return out
    if not (np.isclose(table["bits"], hi).any() and np.isclose(table["bits"], lo).any()):
        # Without grid points at both ends the runs cannot place the cliff inside the interval.
        grid_text = " ".join(f"{b:g}" for b in table["bits"])
        raise NotRun(f"the grid ({grid_text}) lacks a point at {hi:g} or at {lo:g}")
    if holds.all() and (at_lo["verdict"] == "worse").all():
        out.verdict = "reproduced"
        return out
    stuck = _grid_cannot_conclude(table, ctx.alpha)
    if stuck is not None:
        raise NotRun(f"{stuck} (rerun {ctx.claim.experiment} at its declared size)")
    ref_pairs = _pairs(ref, metric, reference)
    sign = 1.0 if ctx.higher_is_better(metric) else -1.0
    level = ctx.alpha / points

    def diffs(row) -> np.ndarray:
        pairs = _pairs(fam[fam["method"] == row.method], metric, family)
        keys = sorted(pairs.keys() & ref_pairs.keys())
        return sign * np.array([pairs[k] - ref_pairs[k] for k in keys])

    confirm, refute = [], []
    for row in high.itertuples():
        d = diffs(row)
        if margin is not None:
            confirm.append(n_from_pilot(d, "equivalence", margin=margin, alpha=ctx.alpha, power=POWER))
        refute.append(_plan(d, "less", level, sign_flip=True))  # a point >= hi shown worse
    for row in at_lo.itertuples():
        d = diffs(row)
        confirm.append(_plan(d, "less", level, sign_flip=True))  # the point at lo shown worse
        if margin is not None:
            refute.append(n_from_pilot(d, "equivalence", margin=margin, alpha=ctx.alpha, power=POWER))
    out.n_confirm = max(confirm) if confirm else math.nan
    out.n_refute = min(refute) if refute else math.inf
    return out


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
_ORDER = (
    "evidence against",
    "no effect at this power",
    "not testable here",
    "not run",
    "inconclusive",
    "reproduced",
)
_MARGIN_KINDS = ("not_worse", "equivalent", "cliff_within")
MARGIN_FACTORS = (0.5, 2.0)


@dataclass
class ClaimResult:
    claim: Claim
    model: str
    verdict: str
    outcomes: list[Outcome]
    reason: str = ""

    @property
    def n(self) -> int | None:
        ns = [o.n for o in self.outcomes if o.n is not None]
        return min(ns) if ns else None

    def _open(self, attr: str) -> list[float]:
        return [
            getattr(o, attr)
            for o in self.outcomes
            if o.verdict == "inconclusive"
            and getattr(o, attr) is not None
            and not math.isnan(getattr(o, attr))
        ]

    @property
    def n_confirm(self) -> float | None:
        """Pairs for every open rule to reach the claim's side (the largest of them)."""
        ns = self._open("n_confirm")
        return max(ns) if ns and self.verdict == "inconclusive" else None

    @property
    def n_refute(self) -> float | None:
        """Pairs for one open rule to be shown the other way (the smallest of them)."""
        ns = self._open("n_refute")
        return min(ns) if ns and self.verdict == "inconclusive" else None

    @property
    def shown_verdict(self) -> str:
        """The verdict as the page prints it: a proxy rule's says so."""
        return f"{self.verdict} in proxy" if self.claim.proxy and self.verdict in _ORDER else self.verdict

    @property
    def measured(self) -> str:
        parts = []
        for o in self.outcomes:
            text = o.measured or f"{o.rule}: {o.reason}"
            if o.measured and o.verdict == "not testable here" and o.reason:
                text += f" ({o.reason})"
            if not o.premise_free:
                text += " [rests on the failed premise]"
            parts.append(text)
        return "; ".join(parts)


def _at_floor(ctx: _Context, claim: Claim, model: str) -> str | None:
    """The reason a claim cannot be tested on ``model`` because its floor arm scores at or below
    the floor (None: above it, no floor declared, or the arm has no runs)."""
    if claim.floor is None:
        return None
    arm, above = str(claim.floor["arm"]), float(claim.floor["above"])
    try:
        rows = ctx.rows(arm)
    except NotRun:
        return None
    metric = claim.metric or ctx.plan.get("metric")
    try:
        values = metric_values(rows, metric).dropna()
    except KeyError:
        return None
    if values.empty or values.mean() > above:
        return None
    return (
        f"{arm} scores {values.mean():.4g} on {metric} over {len(values)} samples on {model}, at or "
        f"below the floor {above:g}: no method can be told apart from it there"
    )


def _premise_failure(
    claim: Claim, frames: Mapping[str, pd.DataFrame], model: str, alpha: float, seed: int, n_resamples: int
) -> tuple[str, str, list[str] | None] | None:
    """``(verdict, reason, rules)`` when a premise fails (``premise not met here``) or cannot be
    checked (``not run``), ``rules`` being the rule texts that rest on it (None: all of them); None
    when every premise holds."""
    for p in claim.premise:
        frame = frames.get(p["experiment"])
        sub = frame[frame["model"] == model] if frame is not None else None
        if sub is None or sub.empty:
            return (
                "not run",
                f"premise: no runs of {p['experiment']} on {model} to measure the cliff",
                p.get("rules"),
            )
        fam, ref = select(sub, p["family"]), select(sub, p["reference"])
        if fam.empty or ref.empty:
            return (
                "not run",
                f"premise: the family or reference matches no run of {p['experiment']}",
                p.get("rules"),
            )
        plan = plan_of(sub)
        metric = plan["metric"]
        higher = (
            higher_is_better(metric) if plan.get("higher_is_better") is None else plan["higher_is_better"]
        )
        margin = plan.get("margin")
        margin = (
            None if margin is None or (isinstance(margin, float) and math.isnan(margin)) else float(margin)
        )
        try:
            table = _cliff_table(fam, ref, metric, bool(higher), margin, alpha, seed, n_resamples)
        except NotRun as err:
            return "not run", f"premise: {p['experiment']}: {err}", p.get("rules")
        cliff = locate_cliff(table, bits_col="bits", verdict_col="verdict")
        bound = float(p["cliff_at_most"])
        bad_above = table[(table["bits"] >= bound - 1e-9) & (table["verdict"] == "worse")]
        if len(bad_above):
            where = cliff_text(table, cliff)
            where = f"at {where} bits" if where.startswith("(") else where
            return (
                "premise not met here",
                f"{p['why']}: {p['experiment']} places this model's cliff {where}; it is worse than the "
                f"reference at {', '.join(f'{b:g}' for b in bad_above['bits'])} bits, above {bound:g}",
                p.get("rules"),
            )
        # a grid that cannot show any point worse would let every premise pass unexamined
        stuck = _grid_cannot_conclude(table, alpha)
        if stuck is not None:
            return "not run", f"premise: {p['experiment']}: {stuck}, so the cliff is unknown", p.get("rules")
    return None


def _sensitivity(ctx: _Context, rule: Rule, outcome: Outcome) -> None:
    """The rule's verdict at half and at twice a margin kvbench chose (``MARGIN_FACTORS``), into
    ``outcome.sensitivity``; a family rule's Holm step is not redone (margins are never in one)."""
    if rule.kind not in _MARGIN_KINDS or ctx.claim.margin_source == "paper" or outcome.margin is None:
        return
    for factor in MARGIN_FACTORS:
        margin = outcome.margin * factor
        alt = replace(rule, kwargs={**rule.kwargs, "margin": margin})
        try:
            outcome.sensitivity[margin] = _EVALUATORS[rule.kind](ctx, alt).verdict
        except NotRun:
            outcome.sensitivity[margin] = "not run"


def _apply_premise(result: ClaimResult, premise: tuple[str, str, list[str] | None]) -> None:
    """A failed (or unchecked) premise sets the verdict of the rules resting on it; the claim is
    still judged on every other rule: ``evidence against`` when one of them is, else the premise's
    verdict. Every rule stays on the page with what it measured."""
    verdict, reason, covered = premise
    free = []
    for o in result.outcomes:
        if covered is None or o.rule in covered:
            o.premise_free = False
        else:
            free.append(o)
    against = [o for o in free if o.verdict == "evidence against"]
    if against:
        result.verdict = "evidence against"
        result.reason = (
            f"{'; '.join(o.rule for o in against)} (independent of the premise); premise: {reason}"
        )
    else:
        result.verdict, result.reason = verdict, reason


def evaluate_claims(
    claims: list[Claim],
    frames: Mapping[str, pd.DataFrame],
    model: str,
    alpha: float = ALPHA,
    seed: int = 0,
    n_resamples: int = 10_000,
) -> list[ClaimResult]:
    """Every claim's verdict on ``model`` from ``frames`` (``{experiment: sample frame}``, as
    ``kvbench.analysis.archive.load_archives`` or ``frames_from_runs`` give)."""
    results: list[ClaimResult] = []
    families: dict[str, list[Outcome]] = {}
    premises: dict[int, tuple[str, str, list[str] | None]] = {}
    for claim in claims:
        if claim.untestable is not None:
            results.append(ClaimResult(claim, model, "not testable here", [], claim.untestable))
            continue
        frame = frames.get(claim.experiment)
        sub = frame[frame["model"] == model] if frame is not None else None
        if sub is None or sub.empty:
            why = claim.pending or f"no runs of {claim.experiment} on {model}"
            outcomes = [Outcome(r.text, "not run", reason=why) for r in claim.rules]
            results.append(ClaimResult(claim, model, "not run", outcomes, why))
            continue
        ctx = _Context(claim, sub, alpha, seed, n_resamples)
        outcomes = []
        for rule in claim.rules:
            try:
                outcome = _EVALUATORS[rule.kind](ctx, rule)
            except NotRun as err:
                reason = str(err) + (f" ({claim.pending})" if claim.pending else "")
                outcome = Outcome(rule.text, "not run", reason=reason)
            outcome.signature = rule_signature(claim, rule)
            outcomes.append(outcome)
            if outcome.verdict == "pending":
                families.setdefault(claim.family or claim.id, []).append(outcome)
            elif outcome.verdict != "not run":
                _sensitivity(ctx, rule, outcome)
        floor = _at_floor(ctx, claim, model)
        if floor is not None:
            results.append(ClaimResult(claim, model, "not testable here", outcomes, floor))
            continue
        result = ClaimResult(claim, model, "", outcomes)
        premise = _premise_failure(claim, frames, model, alpha, seed, n_resamples)
        if premise is not None:
            premises[id(result)] = premise
        results.append(result)
    for members in families.values():
        _decide_family(members, alpha)
    for result in results:
        if result.verdict:
            continue
        if id(result) in premises:
            _apply_premise(result, premises[id(result)])
            continue
        verdicts = {o.verdict for o in result.outcomes}
        result.verdict = next(v for v in _ORDER if v in verdicts)
        result.reason = "; ".join(o.reason for o in result.outcomes if o.reason)
    return results


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
