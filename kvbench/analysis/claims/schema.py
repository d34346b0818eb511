"""A claim as its paper's file declares it: the schema, the rule language, and the parsing and
checking of one claim (:func:`validate`, :func:`parse_rule`).

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
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.analysis.accounting import Accounting, decimals

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
OUTPUT_FIELDS = ("measured", "verdict", "source")
SELECTOR_KEYS = ("label", "method", "bits", "config", "metric")
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
