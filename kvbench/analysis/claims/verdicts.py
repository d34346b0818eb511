"""Every claim's verdict on a model (:func:`evaluate_claims`): each rule evaluated, the family's
Holm step, the floor and the premise, the margin sensitivity, and the rules' verdicts combined
into the claim's (:class:`ClaimResult`).

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import pandas as pd

from kvbench.analysis.claims.checks import rule_signature
from kvbench.analysis.claims.outcome import ALPHA, Outcome
from kvbench.analysis.claims.rules import _EVALUATORS
from kvbench.analysis.claims.rules.cliff import _cliff_table, _grid_cannot_conclude, cliff_text
from kvbench.analysis.claims.rules.difference import _decide_family
from kvbench.analysis.claims.schema import Claim, Rule
from kvbench.analysis.claims.selection import NotRun, _Context, metric_values, select
from kvbench.analysis.frame import higher_is_better, plan_of
from kvbench.stats import locate_cliff

VERDICTS = (
    "reproduced",
    "evidence against",
    "no effect at this power",
    "inconclusive",
    "premise not met here",
    "not run",
    "not testable here",
)


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
