"""Environment variables kvbench reads, read strictly.

A variable is a configuration source like any key: its reader raises a
:class:`~kvbench.errors.ConfigError` naming the variable, the value and what is allowed, and
:func:`kvbench.spec.check_environment` calls every reader before a run starts, so a bad value is one
line up front rather than an error wherever the value is first used (for ``KVBENCH_BLOCK_SIZE``,
deep inside the first attention call, after the model has loaded). An empty value counts as unset
(the shell's ``VAR= cmd`` idiom). Imports nothing heavy: kernels and quantizers read through it.
"""

from __future__ import annotations

import os

from kvbench.errors import ConfigError

FLAG_TRUE = ("1", "true", "yes", "on")
FLAG_FALSE = ("0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """A yes/no variable (case-insensitive; unset or empty: no)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return False
    value = raw.strip().lower()
    if value not in FLAG_TRUE + FLAG_FALSE:
        raise ConfigError(
            name, raw, f"yes ({', '.join(FLAG_TRUE)}) or no ({', '.join(FLAG_FALSE)}, or unset)"
        )
    return value in FLAG_TRUE


def env_positive_int(name: str, default: int, what: str) -> int:
    """A positive integer variable, written in decimal digits only (no sign, no spaces: a value that
    is not exactly a number is more likely a quoting slip than a wish); unset or empty: ``default``."""
    raw = os.environ.get(name)
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ConfigError(name, raw, f"a positive integer in decimal digits ({what}; unset: {default})")
    return int(raw)
