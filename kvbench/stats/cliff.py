"""Where quality falls off a cliff along a bit-width grid.

``locate_cliff`` reads the per-bit verdicts that ``kvbench.stats.compare`` produces for one method
and brackets the bit width at which the method first becomes significantly worse than the
reference (the SemKV-style "cliff"). Below the cliff generation often runs away (loops, never
stops): :mod:`kvbench.stats.runaway` counts that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvbench.stats.comparison import VERDICTS

# --------------------------------------------------------------------------------------- cliff


@dataclass(frozen=True)
class Cliff:
    """A bracket on the cliff: quality holds at ``last_ok_bits`` and breaks at ``first_bad_bits``.

    ``interval`` is ``"(first_bad, last_ok]"``, the bit widths the cliff may lie in. When no grid
    point is significantly worse, ``first_bad_bits`` and ``interval`` are None (``last_ok_bits`` is
    then the lowest grid point); when the highest grid point is already worse, ``last_ok_bits`` and
    ``interval`` are None (the cliff is above the grid). ``non_monotone`` flags a grid with an ok
    point below the first bad one, which means noise or a real non-monotone effect: check by hand.
    """

    last_ok_bits: float | None
    first_bad_bits: float | None
    interval: str | None
    non_monotone: bool = False

    @property
    def found(self) -> bool:
        """True when the grid brackets the cliff (both an ok and a bad point)."""
        return self.interval is not None


def _fmt_bits(bits: float) -> str:
    """Bits as written in a grid: 4, 2.585 (not 4.0, 2.5849625)."""
    return f"{bits:.4g}"


def _grid(table: pd.DataFrame | Iterable[Mapping[str, Any]], bits_col: str, verdict_col: str) -> list:
    """``[(bits, verdict), ...]`` sorted from the highest bit width down; validated."""
    frame = table if isinstance(table, pd.DataFrame) else pd.DataFrame(list(table))
    missing = [c for c in (bits_col, verdict_col) if c not in frame.columns]
    if missing:
        raise ValueError(f"columns missing from the grid: {missing}")
    points = [(float(b), v) for b, v in zip(frame[bits_col], frame[verdict_col], strict=True)]
    if any(math.isnan(b) for b, _ in points):
        raise ValueError("bit widths must not be NaN")
    bits = [b for b, _ in points]
    if len(set(bits)) != len(bits):
        # Two verdicts for one bit width: the table mixes methods or settings; filter it first.
        raise ValueError(f"repeated bit widths in the grid: {sorted(bits)}")
    unknown = {v for _, v in points} - set(VERDICTS)
    if unknown:
        raise ValueError(f"unknown verdicts {sorted(map(str, unknown))}; expected {VERDICTS}")
    return sorted(points, key=lambda p: -p[0])


def locate_cliff(
    table: pd.DataFrame | Iterable[Mapping[str, Any]],
    bits_col: str = "bits",
    verdict_col: str = "verdict",
) -> Cliff:
    """Bracket the cliff on one method's bit grid from its ``compare`` verdicts.

    A grid point is "bad" when its verdict is ``worse`` (significantly worse than the reference
    after Holm) and "ok" otherwise: ``equivalent``, ``better`` and also ``inconclusive``, since
    a point not shown to be worse is statistically indistinguishable from the reference. Walking
    from the highest bit width down, ``first_bad_bits`` is the first bad point and ``last_ok_bits``
    the ok point just above it (the lowest point of the unbroken ok run from the top). Points below
    the first bad one do not move the bracket; an ok one among them sets ``non_monotone``.
    ``table`` is a DataFrame or an iterable of row mappings, one row per bit width.
    """
    points = _grid(table, bits_col, verdict_col)
    last_ok = None
    for i, (bits, v) in enumerate(points):
        if v == "worse":
            non_monotone = any(w != "worse" for _, w in points[i + 1 :])
            interval = None if last_ok is None else f"({_fmt_bits(bits)}, {_fmt_bits(last_ok)}]"
            return Cliff(last_ok, bits, interval, non_monotone)
        last_ok = bits
    return Cliff(last_ok, None, None, False)
