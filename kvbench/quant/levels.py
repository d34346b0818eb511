"""Level counts: the one range every quantizer, packer and kernel accepts (2..256 levels, i.e. up
to one byte per unpacked code) and the check that enforces it; and the one tolerance within which a
``bits`` value names ``log2 L`` (so that the usual 3-4 digit spellings 1.585, 2.322, 2.585 are
accepted wherever a bit width is checked: a level count, or the end of a range of widths)."""

from __future__ import annotations

import math

MIN_LEVELS = 2
MAX_LEVELS = 256
BITS_TOLERANCE = 0.005


def names_bits(bits: float, levels: int) -> bool:
    """Whether ``bits`` names ``log2(levels)`` within :data:`BITS_TOLERANCE`."""
    return abs(math.log2(levels) - bits) <= BITS_TOLERANCE


def check_levels(levels: int) -> None:
    """Raise ValueError unless ``levels`` is an int (not a bool) in ``MIN_LEVELS..MAX_LEVELS``."""
    if isinstance(levels, bool) or not isinstance(levels, int) or not MIN_LEVELS <= levels <= MAX_LEVELS:
        raise ValueError(f"levels must be an int in {MIN_LEVELS}..{MAX_LEVELS}, got {levels!r}")
