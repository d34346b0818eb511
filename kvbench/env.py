"""Environment variables kvbench reads, read strictly.

A variable is a configuration source like any key: its reader raises a
:class:`~kvbench.errors.ConfigError` naming the variable, the value and what is allowed, and
:func:`kvbench.spec.check_environment` calls every reader before a run starts, so a bad value is one
line up front rather than an error wherever the value is first used (for ``KVBENCH_BLOCK_SIZE``,
deep inside the first attention call, after the model has loaded). An empty value counts as unset
(the shell's ``VAR= cmd`` idiom). Imports nothing heavy: kernels and quantizers read through it.

It also sets up kvbench's ``logging`` tree (:func:`get_logger`), through which every module's
warnings go.
"""

from __future__ import annotations

import logging
import os
import sys

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


# -- kvbench's warnings: the ``kvbench`` logger --------------------------------------------------------

LOGGER = "kvbench"


class _ConsoleFallback(logging.Handler):
    """kvbench's records on the current ``sys.stderr`` as ``kvbench: warning: MESSAGE`` (an INFO
    record as ``kvbench: MESSAGE``), the lines kvbench always printed, unless the application shows
    log records on a terminal itself: where the root logger has a handler writing to ``sys.stdout``
    or ``sys.stderr`` (Hydra's job logging, ``logging.basicConfig``), the record reaches it by
    propagation, in the application's format and its log files, and this handler stays quiet, so a
    warning is never printed twice. Records always propagate: ``caplog``, a user's own handlers and
    ``logging.getLogger("kvbench").setLevel(logging.ERROR)`` (silence) work as for any library."""

    def emit(self, record: logging.LogRecord) -> None:
        consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in consoles:
                return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)

    def format(self, record: logging.LogRecord) -> str:
        kind = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"kvbench: {kind}{record.getMessage()}"


def configure_logging() -> logging.Logger:
    """Set up the ``kvbench`` logger once per process (later calls change nothing) and return it:
    the console fallback above, and level INFO where nobody has set one, so kvbench's notes show
    outside Hydra too. :func:`get_logger` calls it; entries may call it earlier."""
    root = logging.getLogger(LOGGER)
    if not any(isinstance(h, _ConsoleFallback) for h in root.handlers):
        root.addHandler(_ConsoleFallback())
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
    return root


def get_logger(name: str) -> logging.Logger:
    """A module's logger (``get_logger(__name__)``), under the configured ``kvbench`` logger."""
    configure_logging()
    if name != LOGGER and not name.startswith(f"{LOGGER}."):
        name = f"{LOGGER}.{name}"
    return logging.getLogger(name)
