"""Level counts: the one range every quantizer, packer and kernel accepts (2..256 levels, i.e. up
to one byte per unpacked code) and the check that enforces it."""

from __future__ import annotations

MIN_LEVELS = 2
MAX_LEVELS = 256


def check_levels(levels: int) -> None:
    """Raise ValueError unless ``levels`` is an int (not a bool) in ``MIN_LEVELS..MAX_LEVELS``."""
    if isinstance(levels, bool) or not isinstance(levels, int) or not MIN_LEVELS <= levels <= MAX_LEVELS:
        raise ValueError(f"levels must be an int in {MIN_LEVELS}..{MAX_LEVELS}, got {levels!r}")
