"""What no single claim can check, run when the papers are loaded (:func:`check_claims`): ids
unique, task-level claims declared, no test declared twice (:func:`rule_signature`), and every
rule able to reach its alpha at its node's declared size (:func:`best_case_p`).

Checked at declaration (``check_claims`` with ``conf_dir``, which the loader calls): every rule
can reach ``alpha`` at the node's size (``analysis.n`` per seed times its seeds): the exact
sign-flip test's smallest p is ``2 ** -n`` one-sided (two-sided for the cliff's grid points),
times the Holm family size (the family's better/larger_gain rules; the node's ``analysis.grid``
for a cliff). A rule that cannot is a schema error naming the pairs it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvbench.analysis.claims.outcome import ALPHA
from kvbench.analysis.claims.schema import _NEEDS_MARGIN, _SIGN_FLIP, Claim, ClaimsError, Rule
from kvbench.analysis.claims.selection import metric_bounds
from kvbench.stats import min_n_sign_flip, min_p_sign_flip


def _node_plan(conf_dir: Path, experiment: str) -> dict[str, Any]:
    """The ``analysis`` block of an experiment node (its declared size and grid)."""
    node = yaml.safe_load((Path(conf_dir) / "experiment" / f"{experiment}.yaml").read_text()) or {}
    return node.get("analysis") or {}


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
