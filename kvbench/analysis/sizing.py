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
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from kvbench.analysis.claims import ClaimResult, select

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
