"""What the inconclusive claims would cost to settle: pairs needed against the time a pair takes.

For each claim whose verdict is ``inconclusive``, the power calculation behind its verdict
(``kvbench.stats.power``, at the observed mean difference and spread) gives ``n_needed`` pairs; the
runs give what one pair costs: the mean wall seconds per sample (prefill + decode, the frame's
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

COLUMNS = ["id", "experiment", "n", "n_needed", "s_per_pair", "hours_more", "fits_a_day"]


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


def sizing_table(
    results: list[ClaimResult], frames: Mapping[str, pd.DataFrame], budget_hours: float = WORKING_DAY_H
) -> pd.DataFrame:
    """One row per inconclusive claim: pairs now and needed, seconds per pair, the hours the missing
    pairs would take on the machine of the runs, and whether that fits ``budget_hours``."""
    rows = []
    for r in results:
        if r.verdict != "inconclusive" or r.n_needed is None or math.isnan(r.n_needed):
            continue
        frame = frames.get(r.claim.experiment)
        sub = frame[frame["model"] == r.model] if frame is not None else None
        per_pair = _seconds_per_pair(r, sub) if sub is not None and not sub.empty else math.nan
        n_now = r.n or 0
        if math.isinf(r.n_needed):
            needed, hours, fits = "inf", "inf", "no"
        else:
            needed = str(int(r.n_needed))
            more = max(0, int(r.n_needed) - n_now)
            hours_value = more * per_pair / 3600
            hours = "-" if math.isnan(hours_value) else f"{hours_value:.3g}"
            fits = "-" if math.isnan(hours_value) else ("yes" if hours_value <= budget_hours else "no")
        rows.append(
            {
                "id": r.claim.id,
                "experiment": r.claim.experiment,
                "n": n_now,
                "n_needed": needed,
                "s_per_pair": "-" if math.isnan(per_pair) else f"{per_pair:.3g}",
                "hours_more": hours,
                "fits_a_day": fits,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS, dtype=object)
