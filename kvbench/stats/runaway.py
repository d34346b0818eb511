"""Runaway generations: text that loops, or keeps going well past where the reference stopped.

``runaway_rate`` counts generations that loop or never stop where the reference's generation on the
same sample did not, the usual failure mode below a bit-width cliff that a task score alone can
hide; ``degenerate_rate`` is the absolute looping rate, shown for the reference itself.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

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
