"""User-facing errors.

A :class:`ConfigError` is a mistake in what the user asked for (a bad key, an unknown name, a
missing file). The command-line entry prints its message as one line and exits with status 2,
without a traceback; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error. The message names the key, the bad value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={shown(value)}: {allowed}")


SHOWN_CHARS = 120


def shown(value: object) -> str:
    """``repr(value)``, cut to ``SHOWN_CHARS`` with the full length said: a pasted 100 kB value must
    not become a 100 kB error line."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[: SHOWN_CHARS - 20]}...{text[-8:]} ({len(text)} characters)"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt, so one handler ends a run either way."""


class Interrupted(Exception):
    """A run stopped by SIGINT or SIGTERM after ``done`` of ``total`` samples (every finished row is
    on disk). The entry prints it as one line and exits 130 (SIGINT) or 143 (SIGTERM)."""

    def __init__(self, done: int, total: int, terminated: bool = False):
        self.done, self.total, self.terminated = done, total, terminated
        self.exit_code = 143 if terminated else 130
        super().__init__(f"interrupted after {done} of {total} samples; the same command resumes")
