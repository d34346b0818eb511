"""Where quality falls off a cliff along a bit-width grid, and how often generation runs away.

``locate_cliff`` reads the per-bit verdicts that ``kvbench.stats.compare`` produces for one method
and brackets the bit width at which the method first becomes significantly worse than the
reference (the SemKV-style "cliff"). ``runaway_rate`` counts generations that loop or never stop
where the reference's generation on the same sample did not, the usual failure mode below the cliff
that a task score alone can hide.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvbench.stats.paired import VERDICTS

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


# ------------------------------------------------------------------------------------- runaway

# Words and single punctuation marks: "the end. the end." is 6 tokens, so looping sentences repeat.
_TOKEN = re.compile(r"\w+|[^\w\s]")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text or "")


def repeated_coverage(text: str, n: int = 4, min_repeats: int = 3) -> float:
    """Share of the text's tokens covered by some n-gram that occurs at least ``min_repeats`` times.

    Tokens are words (``\\w+``) and single punctuation marks, lower-cased. A token is covered when
    it lies inside any occurrence (overlapping ones included) of an n-gram whose count in the text
    is ``>= min_repeats``. 0.0 for texts shorter than n tokens.
    """
    toks = [t.lower() for t in _tokens(text)]
    if len(toks) < n:
        return 0.0
    grams = [tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(toks)
    for i, g in enumerate(grams):
        if counts[g] >= min_repeats:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(toks)


def is_degenerate(text: str, n: int = 4, min_repeats: int = 3, min_coverage: float = 0.5) -> bool:
    """True when the text loops: ``repeated_coverage(text, n, min_repeats) >= min_coverage``.

    The defaults say: some 4-gram occurs 3 or more times, and such repeated 4-grams cover at least
    half of the tokens. A phrase quoted twice, or a short list with a shared prefix, stays below.
    """
    return repeated_coverage(text, n, min_repeats) >= min_coverage


def _hit_limit(row: Mapping[str, Any], max_new_tokens: int | None) -> bool:
    limit = row.get("max_new_tokens", max_new_tokens) if max_new_tokens is None else max_new_tokens
    if limit is None or row.get("stopped") is None or row.get("generated_tokens") is None:
        return False
    return not row["stopped"] and row["generated_tokens"] >= limit


def is_runaway(
    row: Mapping[str, Any],
    reference: Mapping[str, Any],
    max_new_tokens: int | None = None,
    overrun_factor: float = 2.0,
    **degenerate_kwargs: Any,
) -> bool:
    """True when a generation ran away *where the reference's generation on the same sample did
    not*. ``row`` and ``reference`` are one (sample_id, seed) pair's rows (``prediction``,
    ``stopped``, ``generated_tokens``; ``max_new_tokens`` from the row unless given). Either:

    - it loops and the reference does not: ``is_degenerate(row)`` and not ``is_degenerate(reference)``
      (``degenerate_kwargs`` go to ``is_degenerate``); or
    - it overruns: it hit the length limit without stopping while the reference stopped within
      ``1 / overrun_factor`` of that limit (``generated_tokens * overrun_factor <= max_new_tokens``).

    Hitting the limit alone says nothing when the limit is about as long as a healthy answer: the
    NIAH nodes allow 24-32 new tokens for a ~23-token answer, so the FP16 reference itself is cut
    off on most samples. Requiring room for twice the reference's answer makes a limit hit mean
    "kept going well past where the reference stopped". A pair is never a runaway of the
    reference against itself, so the reference's rate is 0 by construction; ``degenerate_rate``
    reports how often the reference itself loops.
    """
    loops = is_degenerate(row.get("prediction") or "", **degenerate_kwargs) and not is_degenerate(
        reference.get("prediction") or "", **degenerate_kwargs
    )
    if loops:
        return True
    limit = row.get("max_new_tokens", max_new_tokens) if max_new_tokens is None else max_new_tokens
    ref_tokens = reference.get("generated_tokens")
    ref_stopped = bool(reference.get("stopped")) and ref_tokens is not None and limit is not None
    return bool(_hit_limit(row, max_new_tokens) and ref_stopped and ref_tokens * overrun_factor <= limit)


def _key(row: Mapping[str, Any]) -> tuple:
    return (str(row["sample_id"]), int(row["seed"]))


def runaway_rate(
    rows: Iterable[Mapping[str, Any]],
    reference_rows: Iterable[Mapping[str, Any]],
    max_new_tokens: int | None = None,
    **kwargs: Any,
) -> float:
    """Share of a method's generations that run away relative to the reference (``is_runaway``).

    ``rows`` and ``reference_rows`` are mappings with ``sample_id``, ``seed``, ``prediction``,
    ``stopped``, ``generated_tokens`` (and ``max_new_tokens`` unless given); they are paired on
    (sample_id, seed) and rows without a reference partner are left out. Keyword arguments go to
    ``is_runaway`` (``overrun_factor``) and ``is_degenerate`` (``n``, ``min_repeats``,
    ``min_coverage``). NaN when no row has a partner.
    """
    refs = {_key(r): r for r in reference_rows}
    flags = [is_runaway(r, refs[_key(r)], max_new_tokens, **kwargs) for r in rows if _key(r) in refs]
    return sum(flags) / len(flags) if flags else math.nan


def degenerate_rate(rows: Iterable[Mapping[str, Any]], **degenerate_kwargs: Any) -> float:
    """Share of generations whose ``prediction`` loops (``is_degenerate``), with no reference: the
    absolute figure, shown for the reference itself. NaN for no rows."""
    flags = [is_degenerate(r.get("prediction") or "", **degenerate_kwargs) for r in rows]
    return sum(flags) / len(flags) if flags else math.nan
