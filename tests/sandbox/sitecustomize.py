"""Keeps the test suite off data it must not depend on, in pytest and in every Python it starts.

``tests/conftest.py`` calls :func:`install` in the pytest process and puts this folder first on
``PYTHONPATH``, so every ``python -m kvbench ...`` a test starts imports this module as its
``sitecustomize`` and installs the same hook. The hook watches Python's audit events for opening or
listing a path under a forbidden folder (``KVBENCH_TEST_FORBIDDEN``: folders joined by ``os.pathsep``;
the conftest sets it to ``../shared`` beside the checkout). Such an access fails with
``PermissionError`` where it happens and is appended to ``KVBENCH_TEST_FORBIDDEN_LOG``, which the
conftest reads at the end of the session, so an access that some code catches and survives still
fails the run.
"""

from __future__ import annotations

import os
import sys

FORBIDDEN_ENV = "KVBENCH_TEST_FORBIDDEN"
LOG_ENV = "KVBENCH_TEST_FORBIDDEN_LOG"
# open() and the directory listings that glob, os.walk, Path.iterdir and shutil use underneath.
EVENTS = {"open", "os.listdir", "os.scandir", "shutil.copytree", "shutil.copyfile"}


def _forbidden() -> tuple[str, ...]:
    roots = os.environ.get(FORBIDDEN_ENV, "")
    return tuple(os.path.realpath(p) for p in roots.split(os.pathsep) if p)


def install() -> None:
    """Install the audit hook once per process (audit hooks cannot be removed)."""
    roots = _forbidden()
    if not roots or getattr(sys, "_kvbench_sandboxed", False):
        return
    sys._kvbench_sandboxed = True
    log = os.environ.get(LOG_ENV)
    busy = [False]  # the hook's own log write raises an "open" event too

    def hook(event: str, args: tuple) -> None:
        if event not in EVENTS or busy[0] or not args:
            return
        path = args[0]
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str | os.PathLike):
            return  # a file descriptor
        real = os.path.realpath(os.fspath(path))
        if not any(real == root or real.startswith(root + os.sep) for root in roots):
            return
        busy[0] = True
        try:
            if log:
                with open(log, "a", encoding="utf-8") as f:
                    f.write(f"{os.getpid()} {event} {real}\n")
        finally:
            busy[0] = False
        raise PermissionError(f"test sandbox: {event} {real} is outside the test fixtures")

    sys.addaudithook(hook)


install()
