"""Writes that a kill, a full disk or a power cut leave either old or new, never half-written.

Every file kvbench writes for keeps (run metadata, the committed tables, figures, claim pages and
archives under ``results/``) goes through :func:`write_bytes`: the bytes go to a temporary file in
the target's own folder (so the rename stays on one file system), are flushed and fsynced, and the
temporary file is renamed over the target; the folder is fsynced so the rename itself survives a
crash. A reader therefore sees the previous file or the complete new one. The temporary name starts
with ``.<name>.`` and ends with ``.tmp``, so a write that was killed leaves only a hidden file that
the next ``make results`` or ``report --archive`` removes (:func:`remove_stale_temporaries`).

An ``OSError`` (ENOSPC, EACCES, EROFS, ...) is re-raised as :class:`WriteError`, whose message is
one line naming the file: the callers' error handlers print it as is.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TMP_SUFFIX = ".tmp"


class WriteError(OSError):
    """A write that failed; ``str()`` is one line naming the file and the reason."""


def _fsync_dir(folder: Path) -> None:
    # Not every file system lets a folder be opened for fsync (some network mounts): best effort.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically (see the module docstring); returns the path."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    except OSError as err:
        raise WriteError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise WriteError(f"cannot write {path}: {err.strerror or err}") from None
    _fsync_dir(path.parent)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode())


def remove_stale_temporaries(root: str | Path) -> int:
    """Remove the temporary files that interrupted :func:`write_bytes` calls left anywhere under
    ``root``; returns how many. Only for a tree with one writer at a time (``results/``, written by
    ``make results`` and ``report --archive``)."""
    removed = 0
    for tmp in Path(root).rglob(f".*{TMP_SUFFIX}"):
        if tmp.is_file():
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed += 1
    return removed
