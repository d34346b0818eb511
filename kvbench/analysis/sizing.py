"""What the inconclusive claims would cost to settle: pairs needed against the time a pair takes.

For each claim whose verdict is ``inconclusive``, the power calculations behind its verdict
(``kvbench.stats.power``, at the observed spread) give the pairs needed each way: ``n_to_confirm``
(the claim's side, at the observed mean when it points that way, else at the rule's declared
effect) and ``n_to_refute`` (the other side, at the observed mean when it points against the
claim); the direction the data point decides which of the two is finite. The runs give what one
pair costs: the mean wall seconds per sample (prefill + decode, the frame's
``seconds``) of each configuration the claim's rules compare, summed over those configurations
(each counted once, though other claims may share it). Their product is the compute a settled verdict
needs on the machine that made the runs, which says whether a larger CPU run can settle the claim
or only a GPU run can. An effect of zero needs infinitely many pairs (``inf``).

``node_sizing`` turns the same plans into each experiment node's size, the stored runs serving as
the pilot (issue 27): per node, the largest n its inconclusive claims need, each in the direction
its pilot points (:func:`claim_need`), and what the whole node would cost at that n on the machine
of the runs, through ``kvbench.reproduce``'s cost model (its stored seconds per sample of each
job and its per-run model load, :mod:`kvbench.node_plan`; no cost table of its own), against
``NODE_BUDGET_MIN``. The claims page prints it with the resizes that fit and, for each claim that
does not, its price. It sizes; it changes no node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from kvbench.analysis.claims import ClaimResult, Outcome, select
from kvbench.node_plan import Job, NodePlan, frame_seconds, stored_job_seconds

# A working day on the machine that made the runs: the budget `make reproduce` is sized against.
WORKING_DAY_H = 8.0

COLUMNS = [
    "id",
    "experiment",
    "n",
    "n_to_confirm",
    "hours_to_confirm",
    "n_to_refute",
    "hours_to_refute",
    "s_per_pair",
    "fits_a_day",
]


def _seconds_per_pair(result: ClaimResult, frame: pd.DataFrame) -> float:
    """Sum over the configurations the claim's rules compare (each once, over all its seeds) of
    the mean wall seconds of one sample."""
    names = dict.fromkeys(arm for rule in result.claim.rules for arm in rule.arms)
    picked = [select(frame, result.claim.arms[name]) for name in names]
    if not picked:
        return math.nan
    rows = pd.concat(picked).drop_duplicates(subset=["run_id", "sample_id", "seed"])
    if "seconds" not in rows or rows.empty:
        return math.nan
    config = rows["method"].astype(str) + "|" + rows["method_config"].map(repr)
    means = pd.to_numeric(rows["seconds"], errors="coerce").groupby(config).mean().dropna()
    return float(means.sum()) if len(means) else math.nan


def _price(needed: float | None, n_now: int, per_pair: float) -> tuple[str, str, float]:
    """``(pairs, hours, hours as a number)`` for one direction."""
    if needed is None or math.isnan(needed):
        return "-", "-", math.nan
    if math.isinf(needed):
        return "inf", "inf", math.inf
    more = max(0, int(needed) - n_now)
    hours = more * per_pair / 3600
    return str(int(needed)), "-" if math.isnan(hours) else f"{hours:.3g}", hours


def sizing_table(
    results: list[ClaimResult], frames: Mapping[str, pd.DataFrame], budget_hours: float = WORKING_DAY_H
) -> pd.DataFrame:
    """One row per inconclusive claim: pairs now, pairs needed to confirm and to refute it, the
    hours the missing pairs would take on the machine of the runs, and whether the cheaper
    direction fits ``budget_hours``."""
    rows = []
    for r in results:
        if r.verdict != "inconclusive" or (r.n_confirm is None and r.n_refute is None):
            continue
        frame = frames.get(r.claim.experiment)
        sub = frame[frame["model"] == r.model] if frame is not None else None
        per_pair = _seconds_per_pair(r, sub) if sub is not None and not sub.empty else math.nan
        n_now = r.n or 0
        confirm, confirm_h, ch = _price(r.n_confirm, n_now, per_pair)
        refute, refute_h, rh = _price(r.n_refute, n_now, per_pair)
        cheapest = min((h for h in (ch, rh) if not math.isnan(h)), default=math.nan)
        rows.append(
            {
                "id": r.claim.id,
                "experiment": r.claim.experiment,
                "n": n_now,
                "n_to_confirm": confirm,
                "hours_to_confirm": confirm_h,
                "n_to_refute": refute,
                "hours_to_refute": refute_h,
                "s_per_pair": "-" if math.isnan(per_pair) else f"{per_pair:.3g}",
                "fits_a_day": "-" if math.isnan(cheapest) else ("yes" if cheapest <= budget_hours else "no"),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS, dtype=object)


# ------------------------------------------------------------------------------ nodes, from a pilot

# The CPU time one experiment node may take at the size its claims need, on the machine that made
# the stored runs (two cores, shared). An hour lets a reviewer rerun any one node to check its
# verdicts in a sitting, and keeps the CPU profile of `make reproduce` (about fifteen nodes with
# claims) within a day of that machine; a claim that needs more is a GPU run's or a bigger
# machine's, and the claims page says so with its price.
NODE_BUDGET_MIN = 60.0

NODE_COLUMNS = ["node", "claims", "n_now", "n_needed", "minutes_at_n", "within_budget", "resize_to"]


def pilot_direction(outcome: Outcome) -> str | None:
    """The way an open rule's pilot points: ``confirm`` (the claim's side) or ``refute``.

    A paired-difference rule (``better``, ``larger_gain``) keeps its oriented differences: their
    mean's sign decides (its ``n_confirm`` may be planned at a declared effect when the mean points
    against, not at the pilot's). Every other rule plans each side at the observed effect, finite
    only on the side the mean lies: the finite one decides, and where both are finite (a cliff
    grid, one side per grid point) the smaller, the side the pilot's standardized effect is larger
    on. None when neither side is finite (a nil effect: no n settles it)."""
    if outcome.diffs is not None and outcome.diffs.size:
        return "confirm" if float(outcome.diffs.mean()) > 0 else "refute"
    sides = {
        side: n
        for side, n in (("confirm", outcome.n_confirm), ("refute", outcome.n_refute))
        if n is not None and not math.isnan(n) and not math.isinf(n)
    }
    return min(sides, key=sides.get) if sides else None


def claim_need(result: ClaimResult) -> tuple[float, str] | None:
    """``(pairs, direction)`` an inconclusive claim needs at power 0.8, in the direction its pilot
    points: when any open rule points against the claim, the fewest pairs showing one of them the
    other way (``refute``); else the pairs for every open rule to reach the claim's side
    (``confirm``, :attr:`ClaimResult.n_confirm`). ``inf`` pairs when the pilot's effect is nil. None
    for a settled or untested claim."""
    if result.verdict != "inconclusive":
        return None
    open_rules = [o for o in result.outcomes if o.verdict == "inconclusive"]
    directions = [pilot_direction(o) for o in open_rules]
    against = [o.n_refute for o, d in zip(open_rules, directions, strict=True) if d == "refute"]
    against = [n for n in against if n is not None and not math.isnan(n)]
    if against:
        return float(min(against)), "refute"
    if directions and all(d == "confirm" for d in directions) and result.n_confirm is not None:
        return float(result.n_confirm), "confirm"
    return math.inf, "either"


def node_pairs(frame: pd.DataFrame) -> int:
    """Pairs ``(sample_id, seed)`` the node's best-covered configuration holds."""
    config = frame["method"].astype(str) + "|" + frame["method_config"].map(repr)
    keys = frame["sample_id"].astype(str) + "|" + frame["seed"].astype(str)
    return int(keys.groupby(config).nunique().max())


def node_minutes(node: str, frame: pd.DataFrame, scale: float) -> float:
    """CPU minutes the node's runs in ``frame`` would take from scratch with ``scale`` times the
    samples each holds now: :meth:`kvbench.node_plan.NodePlan.estimate_s` over one job per stored
    run, each at the seconds per sample ``kvbench.node_plan.stored_job_seconds`` gives from the
    frame's stored times (nan when the frame stores none for a run's model)."""
    if math.isinf(scale):
        return math.inf
    stored = frame_seconds(frame)
    plan = NodePlan(node, "cpu")
    for (model, method, _), rows in frame.groupby(["model", "method", "run_id"], sort=True):
        known = stored_job_seconds(stored, str(model), str(method))
        if known is None:
            return math.nan
        samples = math.ceil(rows["sample_id"].nunique() * scale - 1e-9)
        job = Job(str(method), [], samples, method=str(method), model=str(model), seconds=known[0])
        plan.jobs.append(job)
    return plan.estimate_s() / 60


def _minutes_text(minutes: float) -> str:
    if math.isnan(minutes):
        return "-"
    return "inf" if math.isinf(minutes) else f"{minutes:,.0f}"


def _times(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:,.0f}x"


def _count_text(n: float) -> str:
    return "inf" if math.isinf(n) else str(int(n))


def node_sizing(
    results: list[ClaimResult], frames: Mapping[str, pd.DataFrame], budget_min: float = NODE_BUDGET_MIN
) -> tuple[pd.DataFrame, list[str]]:
    """Every node with testable claims on the results' model, sized from its stored runs (the
    pilot): one row per node with its claims (open ones marked), the pairs it holds, the largest n
    its open claims need (:func:`claim_need`: which claim, which direction), the CPU minutes the
    node would take at that n (:func:`node_minutes`), whether that fits ``budget_min``, and the n it
    would be resized to (the largest needed n that fits, when above the n it holds). Then the
    notes: one sentence naming the resizes and the claims each settles, one per claim the budget
    cannot settle with its price, and one naming the nodes with claims but no stored runs on the
    model."""
    by_node: dict[str, list[ClaimResult]] = {}
    for r in results:
        if r.claim.experiment and r.claim.untestable is None:
            by_node.setdefault(r.claim.experiment, []).append(r)
    rows, notes, unsized, resized = [], [], [], []
    for node, members in sorted(by_node.items()):
        frame = frames.get(node)
        sub = frame[frame["model"] == members[0].model] if frame is not None else None
        if sub is None or sub.empty:
            unsized.append(node)
            continue
        n_now = node_pairs(sub)
        needs = {r.claim.id: (r, need) for r in members if (need := claim_need(r)) is not None}
        priced = []
        for cid, (r, (n, direction)) in needs.items():
            # in the claim's own pairs; a plan below the pairs held reruns the node as it is
            scale = n / (r.n or n_now)
            priced.append((n, cid, direction, node_minutes(node, sub, max(scale, 1.0))))
        claims = ", ".join(r.claim.id + (" (open)" if r.claim.id in needs else "") for r in members)
        if priced:
            n, cid, direction, minutes = max(priced, key=lambda p: (p[0], p[3]))
            needed = f"{_count_text(n)} ({cid}, {direction})"
        else:
            n, minutes, needed = n_now, node_minutes(node, sub, 1.0), "- (no open claim)"
        fits = [p for p in priced if not math.isnan(p[3]) and p[3] <= budget_min and p[0] > n_now]
        resize = "-"
        if fits:
            target = max(fits, key=lambda p: p[0])
            resize = f"{_count_text(target[0])} ({_minutes_text(target[3])} min)"
            settled = ", ".join(sorted(p[1] for p in fits if p[0] <= target[0]))
            resized.append(f"`{node}` to n={_count_text(target[0])} ({settled})")
        rows.append(
            {
                "node": node,
                "claims": claims,
                "n_now": n_now,
                "n_needed": needed,
                "minutes_at_n": _minutes_text(minutes),
                "within_budget": "-" if math.isnan(minutes) else ("yes" if minutes <= budget_min else "no"),
                "resize_to": resize,
            }
        )
        for n, cid, direction, minutes in sorted(priced, key=lambda p: p[1]):
            if math.isnan(minutes) or minutes <= budget_min:
                continue
            if math.isinf(n):
                notes.append(
                    f"`{node}`: {cid} cannot be settled within the budget: the pilot's effect is nil, "
                    "so no number of pairs settles it at power 0.8."
                )
            else:
                notes.append(
                    f"`{node}`: {cid} cannot be settled within the budget: to {direction} it needs "
                    f"{_count_text(n)} pairs (it has {n_now}), {_minutes_text(minutes)} CPU-minutes "
                    f"({minutes / 60:,.1f} h) for the node at that n, {_times(minutes / budget_min)} "
                    f"the {budget_min:g}-minute budget."
                )
        if not priced and not math.isnan(minutes) and minutes > budget_min:
            notes.append(
                f"`{node}`: its claims are settled, but the node takes {_minutes_text(minutes)} CPU-minutes "
                f"at the {n_now} pairs it holds, past the {budget_min:g}-minute budget."
            )
    if resized:
        notes.insert(
            0,
            "Would be resized within the budget (not done here; each needs a rerun of the node): "
            + "; ".join(resized)
            + ", each to settle the claims named, at power 0.8 if the pilot's effect holds.",
        )
    if unsized:
        notes.append(
            "No stored runs on this model, so no pilot to size from: "
            + ", ".join(f"`{n}`" for n in unsized)
            + "."
        )
    return pd.DataFrame(rows, columns=NODE_COLUMNS, dtype=object), notes
