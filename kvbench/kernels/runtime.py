"""Whether the Triton kernels under :mod:`kvbench.kernels` can run here.

They run on a CUDA device, or on the CPU under Triton's interpreter. The interpreter is chosen when a
kernel is *decorated* (``@triton.jit`` reads ``TRITON_INTERPRET`` then), so the variable must be set
before the kernel modules are first imported; set it before triton itself is imported to be safe.

Nothing here imports triton at module level: kvbench's torch path may import this module freely.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kvbench.errors import ConfigError

# The spellings triton's own TRITON_INTERPRET parsing accepts as true (case-insensitive).
_TRUE = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_available() -> bool:
    """True when triton is importable and either a CUDA device is present or the interpreter is on."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpreting()


def require_triton(key: str = "method.backend") -> None:
    """Raise :class:`ConfigError` naming ``key`` unless :func:`triton_available`."""
    if not triton_available():
        raise ConfigError(
            key,
            "triton",
            "needs a CUDA device, or TRITON_INTERPRET=1 set before triton is imported "
            "(CPU interpreter, slow)",
        )
