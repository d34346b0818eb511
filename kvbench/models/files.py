"""Whether a model's weight files are whole, read from their headers alone (milliseconds, no
tensor loaded), so a file cut short by a full disk or an interrupted copy is one line naming it
before any load starts rather than an error from deep inside the load.

A safetensors file is an 8-byte little-endian header length, a JSON header that gives every
tensor's byte range in the data that follows, and the data; the file is whole when the data ends
exactly where the header says (the ``safetensors`` reader refuses any other length). Other weight
formats (``.bin``, ``.pt``) are pickles and are left to their loader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from kvbench.errors import ConfigError

HEADER_LENGTH_BYTES = 8
# The safetensors reader refuses headers above 100 MB; a larger length is a damaged file.
MAX_HEADER_BYTES = 100_000_000


def safetensors_problem(path: str | Path) -> str | None:
    """Why the safetensors file at ``path`` is not whole, or None when it is."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(HEADER_LENGTH_BYTES)
            if len(head) < HEADER_LENGTH_BYTES:
                return f"{size} bytes, shorter than a safetensors header; truncated or not safetensors"
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - HEADER_LENGTH_BYTES):
                return f"a header length of {length} bytes in {size} bytes; truncated or not safetensors"
            header = json.loads(handle.read(length))
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not JSON; damaged or not safetensors"
    if not isinstance(header, dict):
        return "its header is not a JSON object; damaged or not safetensors"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {name!r} has no byte range in its header; damaged"
        end = max(end, offsets[1])
    expected = HEADER_LENGTH_BYTES + length + end
    if size < expected:
        return f"its header describes {expected} bytes and the file has {size}; truncated"
    if size > expected:
        return f"its header describes {expected} bytes and the file has {size}; damaged"
    return None


def check_safetensors(path: str | Path, key: str, value: object) -> None:
    """A ConfigError naming ``key`` and the file when ``path`` is not a whole safetensors file."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise ConfigError(key, value, f"whole weight files; {path}: {problem}")
